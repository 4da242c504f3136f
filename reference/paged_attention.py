"""NumPy reference for ``nki_kernels.attention.paged_attention`` (no tiling, no online softmax).

Layouts (vLLM's unified attention contract, the kernel's):

* ``q [T, H_q, d]``: the new tokens of all ``R`` requests, concatenated; request ``r`` owns rows
  ``query_start_loc[r] : query_start_loc[r + 1]`` (``q_len_r`` of them, 0 allowed) and they are
  the LAST ``q_len_r`` positions of its ``seq_lens[r]`` tokens: query ``i`` of request ``r`` sits
  at ``pos = seq_lens[r] - q_len_r + i`` and sees keys ``j <= pos`` (and, with ``window = w``,
  ``j > pos - w``: ``w`` keys including its own);
* paged cache ``k_cache, v_cache [num_blocks, block_size, H_kv, d]`` with ``block_table
  [R, max_blocks]``: logical block ``n`` of request ``r`` is physical block ``block_table[r, n]``;
  the reference gathers exactly the ``ceil(seq_lens[r] / block_size)`` blocks a request uses
  (``reference.decode_attention.gather_kv``) and never touches another entry or page, and only
  for requests with at least one query row;
* query head ``h`` reads KV head ``h // (H_q / H_kv)``;
* FP8 caches are dequantized as ``float(k) * k_scale`` (a scalar or one scale per KV head), likewise
  V.

``logit = scale * q . k`` (``softcap = c``: ``c * tanh(logit / c)``); ``sinks [H_q]`` add
``exp(sink)`` to the denominator (not scaled, not capped). A row that sees no key (and has no
sink) gets output 0 and ``lse = -inf``. ``lse [T, H_q]`` is float32, natural log, sink included.

``p_dtype="bfloat16"`` rounds the probabilities to bf16 before ``P @ V`` and sums the rounded ones
for the denominator (the sink term stays unrounded), as ``reference.flash_attention`` does: the
same-precision reference of the attention accuracy rule. A serving step's chunk rows run the
prefill tiles, whose row sum is the rounded probabilities' (a ones column beside V), so lse
carries that rounding (up to ~2^-9); the decode reference's convention (unrounded denominator)
would hold the whole batch's lse to fp32 rounding. ``compute_dtype=np.float64`` gives the exact
baseline.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .decode_attention import _per_head, gather_kv
from .flash_attention import attended_pairs

_OUT = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
SCORE_ELEMS = 1 << 23      # query rows are scored in blocks of at most this many [H_q, rows, L]


def _name(x) -> str:
    d = np.asarray(x).dtype
    return "bfloat16" if d == np.dtype(ml_dtypes.bfloat16) else np.dtype(d).name


def request_rows(query_start_loc):
    """``[(start, stop), ...]``: the q rows of each request."""
    qsl = [int(x) for x in np.asarray(query_start_loc).reshape(-1)]
    return list(zip(qsl[:-1], qsl[1:]))


def paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *,
                        scale=None, window=None, softcap=None, sinks=None, k_scale=None,
                        v_scale=None, p_dtype=None, out_dtype=None, compute_dtype=np.float32,
                        rows=None):
    """Reference paged attention over a ragged batch; returns ``(o [T, H_q, d], lse [T, H_q])``.

    o is in ``out_dtype`` (default: q's dtype), lse float32. ``rows``: optional boolean mask or
    index array over T: only those rows are computed (the others stay o = 0, lse = -inf), for
    checks of big batches.
    """
    ct = np.dtype(compute_dtype).type
    q = np.asarray(q)
    T, Hq, d = q.shape
    Hkv = np.asarray(k_cache).shape[-2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    ks, vs = _per_head(k_scale, Hkv), _per_head(v_scale, Hkv)
    sk = None if sinks is None else np.asarray(sinks, dtype=np.float32).astype(ct)
    want = np.ones(T, dtype=bool)
    if rows is not None:
        want = np.zeros(T, dtype=bool)
        want[np.asarray(rows)] = True
    qf = q.astype(ct)
    o = np.zeros((T, Hq, d), dtype=ct)
    lse = np.full((T, Hq), -np.inf, dtype=np.float32)
    for r, (a, b) in enumerate(request_rows(query_start_loc)):
        n, L = b - a, int(seq_lens[r])
        if n == 0 or not want[a:b].any():
            continue
        k = gather_kv(k_cache, r, L, block_table).astype(ct) * ks[None, :, None].astype(ct)
        v = gather_kv(v_cache, r, L, block_table).astype(ct) * vs[None, :, None].astype(ct)
        k = np.repeat(k.transpose(1, 0, 2), G, axis=0)            # [Hq, L, d]
        v = np.repeat(v.transpose(1, 0, 2), G, axis=0)
        j = np.arange(L)[None, :]
        blk = max(1, min(256, SCORE_ELEMS // max(1, Hq * L)))
        for i0 in range(0, n, blk):
            i1 = min(n, i0 + blk)
            if not want[a + i0:a + i1].any():
                continue
            pos = L - n + np.arange(i0, i1)[:, None]               # [rows, 1]
            vis = j <= pos
            if window:
                vis &= j > pos - window
            s = np.einsum("qhd,hkd->hqk", qf[a + i0:a + i1], k) * ct(scale)   # [Hq, rows, L]
            if softcap:
                s = ct(softcap) * np.tanh(s / ct(softcap))
            s = np.where(vis[None], s, -np.inf)
            m = s.max(axis=2, keepdims=True, initial=-np.inf)
            if sk is not None:
                m = np.maximum(m, sk[:, None, None])
            m0 = np.where(np.isfinite(m), m, 0)
            e = np.exp(s - m0)
            p = e.astype(_OUT[p_dtype]).astype(ct) if p_dtype else e
            den = p.sum(axis=2, keepdims=True)
            if sk is not None:
                den = den + np.exp(sk[:, None, None] - m0)
            num = np.einsum("hqk,hkd->qhd", p, v)                   # [rows, Hq, d]
            den = den[..., 0].T                                     # [rows, Hq]
            m0 = m0[..., 0].T
            ok = den > 0
            safe = np.where(ok, den, 1)
            o[a + i0:a + i1] = np.where(ok[..., None], num / safe[..., None], 0)
            lse[a + i0:a + i1] = np.where(ok, m0 + np.log(safe), -np.inf)
    lse[~want] = -np.inf
    o[~want] = 0
    name = out_dtype or _name(q)
    return o.astype(_OUT[name]), lse


def kv_tokens_read(seq_lens, query_start_loc, window=None) -> int:
    """Cache tokens a step must read once: for each request with query rows, the keys its rows
    see (all ``seq_lens[r]`` of them; with a window, from the first row's window start on)."""
    tot = 0
    for r, (a, b) in enumerate(request_rows(query_start_loc)):
        n, L = b - a, int(seq_lens[r])
        if n == 0:
            continue
        lo = max(0, L - n - window + 1) if window else 0
        tot += L - lo
    return tot


def flops_paged_attention(seq_lens, query_start_loc, n_q_heads, head_dim, window=None) -> int:
    """Useful FLOPs: 4 d per attended (query, key) pair (Q K^T and P V), causal (end-aligned)
    and windowed pairs only, summed over requests and query heads."""
    pairs = 0
    for r, (a, b) in enumerate(request_rows(query_start_loc)):
        if b > a:
            pairs += attended_pairs(b - a, int(seq_lens[r]), True, window)
    return 4 * head_dim * n_q_heads * pairs


def bytes_paged_attention(seq_lens, query_start_loc, n_q_heads, n_kv_heads, head_dim,
                          kv_itemsize=2, q_itemsize=2, window=None, return_lse=False) -> int:
    """Compulsory HBM bytes: the K and V tokens each request reads (once, in the cache dtype),
    q read and o written (q's dtype), plus the fp32 lse when returned."""
    T = int(np.asarray(query_start_loc).reshape(-1)[-1])
    kv = 2 * kv_tokens_read(seq_lens, query_start_loc, window) * n_kv_heads * head_dim * kv_itemsize
    lse = 4 * T * n_q_heads if return_lse else 0
    return kv + 2 * T * n_q_heads * head_dim * q_itemsize + lse
