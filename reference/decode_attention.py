"""NumPy reference for ``nki_kernels.attention.decode_attention`` (no tiling, no online softmax).

Layouts (the kernel's):

* ``q [B, s_q, H_q, d]``: the ``s_q`` new tokens of each sequence (``s_q > 1``: speculative
  drafts); query ``i`` of sequence ``b`` sits at position ``pos = seq_lens[b] - s_q + i`` and
  sees keys ``j <= pos`` (the causal diagonal aligned to the end) and, with ``window = w``,
  ``j > pos - w``;
* contiguous cache ``k_cache, v_cache [B, S_max, H_kv, d]``, valid up to ``seq_lens[b]`` (which
  counts the new tokens, already in the cache);
* paged cache (vLLM) ``[num_blocks, block_size, H_kv, d]`` with ``block_table [B, max_blocks]``:
  logical block ``n`` of sequence ``b`` is physical block ``block_table[b, n]``; the reference
  gathers exactly the ``ceil(seq_lens[b] / block_size)`` blocks a sequence uses, through the
  table, and never touches another entry;
* query head ``h`` reads KV head ``h // (H_q / H_kv)``;
* FP8 caches are dequantized as ``float(k) * k_scale`` (a scalar, or one scale per KV head,
  vLLM's convention), likewise V.

``logit = scale * q . k`` (``softcap = c``: ``c * tanh(logit / c)``); ``sinks [H_q]`` add
``exp(sink)`` to the denominator. A row that sees no key (a sequence of length 0) gets output 0
and ``lse = -inf``. ``lse [B, s_q, H_q]`` is float32, natural log, sink included.

``p_dtype="bfloat16"`` rounds the probabilities that multiply V to bf16 (the numerator; the
denominator stays the fp32 sum of the unrounded exponentials): the same-precision reference of
the attention accuracy rule.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

_OUT = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def _name(x) -> str:
    return np.dtype(np.asarray(x).dtype).name


def _per_head(s, h_kv):
    """A scale given as None, a scalar or one value per KV head -> float64 ``[H_kv]``."""
    if s is None:
        return np.ones(h_kv)
    a = np.asarray(s, dtype=np.float64).reshape(-1)
    return np.broadcast_to(a, (h_kv,)).astype(np.float64)


def gather_kv(cache, b, length, block_table=None):
    """The first ``length`` tokens of sequence ``b``: ``[length, H_kv, d]`` (cache dtype)."""
    cache = np.asarray(cache)
    if block_table is None:
        return cache[b, :length]
    bs = cache.shape[1]
    nblk = -(-length // bs)
    pages = np.asarray(block_table)[b, :nblk]
    return cache[pages].reshape((nblk * bs,) + cache.shape[2:])[:length]


def decode_attention_ref(q, k_cache, v_cache, seq_lens, *, block_table=None, scale=None,
                         window=None, softcap=None, sinks=None, k_scale=None, v_scale=None,
                         return_lse=False, compute_dtype=np.float32, p_dtype=None):
    """Reference decode attention; returns ``o [B, s_q, H_q, d]`` in q's dtype (and ``lse``)."""
    ct = compute_dtype
    B, s_q, Hq, d = q.shape
    Hkv = np.asarray(k_cache).shape[-2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    ks, vs = _per_head(k_scale, Hkv), _per_head(v_scale, Hkv)
    qf = np.asarray(q).astype(ct)
    o = np.zeros((B, s_q, Hq, d), dtype=ct)
    lse = np.full((B, s_q, Hq), -np.inf, dtype=np.float32)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        k = gather_kv(k_cache, b, L, block_table).astype(ct) * ks[None, :, None].astype(ct)
        v = gather_kv(v_cache, b, L, block_table).astype(ct) * vs[None, :, None].astype(ct)
        pos = L - s_q + np.arange(s_q)[:, None]                 # [s_q, 1]
        j = np.arange(L)[None, :]
        vis = j <= pos
        if window:
            vis &= j > pos - window
        for h in range(Hq):
            hk = h // G
            s = (qf[b, :, h, :] @ k[:, hk, :].T) * ct(scale)     # [s_q, L]
            if softcap:
                s = ct(softcap) * np.tanh(s / ct(softcap))
            s = np.where(vis, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            if sinks is not None:
                m = np.maximum(m, ct(np.asarray(sinks, dtype=np.float32)[h]))
            e = np.exp(s - m)
            den = e.sum(axis=1, keepdims=True)
            if sinks is not None:
                den = den + np.exp(ct(np.asarray(sinks, dtype=np.float32)[h]) - m)
            p = e.astype(_OUT[p_dtype]).astype(ct) if p_dtype else e
            o[b, :, h, :] = (p @ v[:, hk, :]) / den
            lse[b, :, h] = (m + np.log(den))[:, 0]
    out = o.astype(_OUT[_name(q)])
    return (out, lse) if return_lse else out


def kv_tokens_read(seq_lens) -> int:
    """Tokens of cache a decode step must read: every valid token once."""
    return int(np.sum(np.asarray(seq_lens, dtype=np.int64)))


def bytes_decode_attention(seq_lens, s_q, n_q_heads, n_kv_heads, head_dim, kv_itemsize=2,
                           q_itemsize=2) -> int:
    """Compulsory HBM bytes: the valid K and V tokens in the cache dtype, plus q and o."""
    B = len(seq_lens)
    kv = 2 * kv_tokens_read(seq_lens) * n_kv_heads * head_dim * kv_itemsize
    return kv + 2 * B * s_q * n_q_heads * head_dim * q_itemsize


def flops_decode_attention(seq_lens, s_q, n_q_heads, head_dim, window=None) -> int:
    """4 d FLOPs per attended (query, key) pair (QK^T and PV)."""
    pairs = 0
    for L in np.asarray(seq_lens, dtype=np.int64):
        for i in range(s_q):
            pos = int(L) - s_q + i
            if pos < 0:
                continue
            lo = max(0, pos - window + 1) if window else 0
            pairs += pos + 1 - lo
    return 4 * head_dim * n_q_heads * pairs
