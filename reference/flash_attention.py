"""NumPy reference for ``nki_kernels.attention.flash_attention``.

``O = softmax(scale * Q K^T (+ soft-cap) + mask (+ sink column)) V``, computed in one shot (no
tiling, no online softmax) in float32 by default, so it is right at a glance.

Mask conventions (the same as the kernel's):

* query row ``i`` of ``S_q`` sits at absolute position ``pos(i) = i + (S_kv - S_q)``: the causal
  diagonal is aligned to the end (queries continue a prefix of ``S_kv - S_q`` keys);
* ``causal``: key ``j`` is visible iff ``j <= pos(i)``;
* ``window = w`` (left sliding window, Mistral / Gemma-2 / GPT-OSS ``sliding_window``): key ``j``
  is visible iff ``j > pos(i) - w``, i.e. ``w`` keys including the diagonal one (flash-attn's
  ``window_size=(w - 1, 0)``); without ``causal`` it bounds the left side only;
* ``softcap = c``: logits become ``c * tanh(logit / c)`` before masking (Gemma-2);
* ``sinks [H_q]``: one learned logit per query head joins the softmax denominator and carries no
  value (GPT-OSS); it is not scaled or soft-capped;
* a row with no visible key (and no sink) gets output 0 and ``lse = -inf``.

``lse[b, h, i] = log(sum_j exp(logit_ij) (+ exp(sink_h)))`` in natural log, float32.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

_OUT = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}


def visible_mask(s_q, s_kv, causal=True, window=None):
    """Boolean ``[s_q, s_kv]``: True where query row i may attend key j."""
    pos = np.arange(s_q)[:, None] + (s_kv - s_q)
    j = np.arange(s_kv)[None, :]
    m = np.ones((s_q, s_kv), dtype=bool)
    if causal:
        m &= j <= pos
    if window:
        m &= j > pos - window
    return m


def flash_attention_ref(q, k, v, *, causal=True, scale=None, window=None, softcap=None,
                        sinks=None, return_lse=False, k_layout="bhsd", out_dtype=None,
                        compute_dtype=np.float32, p_dtype=None):
    """Attention of ``q [B, Hq, Sq, d]`` over ``k, v [B, Hkv, Skv, d]`` (``k`` is
    ``[B, Hkv, d, Skv]`` when ``k_layout="bhds"``); query head h uses KV head ``h // (Hq/Hkv)``.

    compute_dtype: float32 (default) or float64 (the exact baseline of the accuracy rule).
    p_dtype: None, or "bfloat16" to round the probabilities to bf16 before ``P @ V`` as a bf16
      kernel does (the "same-precision reference" of the accuracy rule); the denominator is then
      the sum of the rounded probabilities, so numerator and denominator use the same weights
      (the sink term stays unrounded).
    out_dtype: output dtype name (default: the dtype of ``q``).
    Returns ``o`` (and ``lse [B, Hq, Sq]`` float32 when ``return_lse``).
    """
    cd = np.dtype(compute_dtype)
    qf = np.asarray(q).astype(cd)
    kf = np.asarray(k).astype(cd)
    vf = np.asarray(v).astype(cd)
    if k_layout == "bhds":
        kf = np.swapaxes(kf, -1, -2)
    B, Hq, Sq, d = qf.shape
    Hkv, Skv = kf.shape[1], kf.shape[2]
    g = Hq // Hkv
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    kf = np.repeat(kf, g, axis=1)                   # [B, Hq, Skv, d]
    vf = np.repeat(vf, g, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", qf, kf) * cd.type(scale)
    if softcap:
        s = cd.type(softcap) * np.tanh(s / cd.type(softcap))
    vis = visible_mask(Sq, Skv, causal, window)[None, None]
    s = np.where(vis, s, -np.inf)
    if sinks is not None:
        sk = np.asarray(sinks).astype(cd).reshape(1, Hq, 1, 1)
        m = np.maximum(s.max(axis=-1, keepdims=True, initial=-np.inf), sk)
    else:
        m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m_safe)                          # masked -> exp(-inf) = 0
    if p_dtype is not None:
        p = p.astype(_OUT[p_dtype]).astype(cd)
    l = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(sk - m_safe)
    o = np.einsum("bhqk,bhkd->bhqd", p, vf)
    with np.errstate(invalid="ignore", divide="ignore"):
        o = np.where(l > 0, o / np.where(l > 0, l, 1), 0)
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1)), -np.inf)[..., 0]
    name = out_dtype or _dtype_name(q)
    o = o.astype(_OUT[name]) if name in _OUT else o.astype(np.float32)
    if return_lse:
        return o, lse.astype(np.float32)
    return o


def _dtype_name(x):
    d = np.asarray(x).dtype
    if d == np.dtype(ml_dtypes.bfloat16):
        return "bfloat16"
    return str(d)


def attended_pairs(s_q, s_kv, causal=True, window=None) -> int:
    """Number of (query, key) pairs one head attends: exact for causal and sliding windows."""
    pos = np.arange(s_q, dtype=np.int64) + (s_kv - s_q)
    hi = np.minimum(pos, s_kv - 1) if causal else np.full(s_q, s_kv - 1, dtype=np.int64)
    lo = np.maximum(pos - window + 1, 0) if window else np.zeros(s_q, dtype=np.int64)
    return int(np.maximum(hi - lo + 1, 0).sum())


def flops_flash_attention(batch, n_q_heads, seq_q, seq_kv, head_dim, causal=True, window=None):
    """Useful FLOPs: 2*d for Q K^T plus 2*d for P V per attended pair (causal and sliding windows
    count attended pairs only; masked pairs, transposes and softmax are not counted)."""
    return 4 * head_dim * attended_pairs(seq_q, seq_kv, causal, window) * batch * n_q_heads


def bytes_flash_attention(batch, n_q_heads, n_kv_heads, seq_q, seq_kv, head_dim, itemsize=2,
                          return_lse=False):
    """Compulsory HBM traffic: read q, k, v once, write o once (+ fp32 lse)."""
    q = batch * n_q_heads * seq_q * head_dim
    kv = 2 * batch * n_kv_heads * seq_kv * head_dim
    lse = batch * n_q_heads * seq_q * 4 if return_lse else 0
    return (2 * q + kv) * itemsize + lse
