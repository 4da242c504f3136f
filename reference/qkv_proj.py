"""NumPy reference for ``nki_kernels.qkv_proj``: fused RMSNorm + QKV projection + QK-norm + RoPE.

Plain fp32 math on the whole arrays (no tiling), outputs cast to bfloat16 at the end. The
residual sum ``h = x + residual`` is the bf16 residual stream of the model: it is rounded to
bf16 (and returned) before the norm reads it.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def rope_tables(positions, rotary_dim, theta):
    """cos, sin [T, rotary_dim // 2]: angle_{t,i} = positions[t] * theta^(-2i / rotary_dim)."""
    pos = np.asarray(positions, dtype=np.float64)
    freq = 1.0 / theta ** (np.arange(rotary_dim // 2, dtype=np.float64) * 2 / rotary_dim)
    ang = np.outer(pos, freq)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rms_norm(x, weight, eps):
    """x [..., n] fp32 -> x / sqrt(mean(x^2) + eps) * weight."""
    x = np.asarray(x, np.float32)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + np.float32(eps)) * np.asarray(weight, np.float32)


def apply_rope(x, cos, sin, rotary_dim, layout="half"):
    """x [heads, T, d] fp32; cos, sin [T, rotary_dim // 2]. Rotates the first rotary_dim dims."""
    out = np.array(x, dtype=np.float32, copy=True)
    c, s = cos[None, :, :], sin[None, :, :]
    if layout == "half":
        h = rotary_dim // 2
        x1, x2 = x[..., :h], x[..., h:rotary_dim]
        out[..., :h] = x1 * c - x2 * s
        out[..., h:rotary_dim] = x2 * c + x1 * s
    else:  # interleaved pairs (2i, 2i+1)
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = x1 * c - x2 * s
        out[..., 1:rotary_dim:2] = x2 * c + x1 * s
    return out


def qkv_proj_ref(x, w_qkv, *, n_q_heads, n_kv_heads, head_dim, bias=None, residual=None,
                 norm_weight=None, eps=1e-6, q_norm_weight=None, k_norm_weight=None,
                 qk_norm_eps=None, positions=None, rope_theta=10000.0, cos=None, sin=None,
                 rotary_dim=None, rope_layout="half", k_layout="heads", out_dtype=BF16):
    """Returns (q [nq, T, d], k [nkv, T, d] or [nkv, d, T], v [nkv, T, d], h or None)."""
    x = np.asarray(x)
    T, H = x.shape
    d = head_dim
    h_res = None
    a = x.astype(np.float32)
    if residual is not None:
        h_res = (a + np.asarray(residual).astype(np.float32)).astype(x.dtype)
        a = h_res.astype(np.float32)
    if norm_weight is not None:
        a = rms_norm(a, norm_weight, eps)
    y = a @ np.asarray(w_qkv).astype(np.float32)
    if bias is not None:
        y = y + np.asarray(bias, np.float32)
    nq, nkv = n_q_heads, n_kv_heads
    q = y[:, :nq * d].reshape(T, nq, d).transpose(1, 0, 2)
    k = y[:, nq * d:(nq + nkv) * d].reshape(T, nkv, d).transpose(1, 0, 2)
    v = y[:, (nq + nkv) * d:].reshape(T, nkv, d).transpose(1, 0, 2)
    if q_norm_weight is not None:
        qe = eps if qk_norm_eps is None else qk_norm_eps
        q = rms_norm(q, q_norm_weight, qe)
        k = rms_norm(k, k_norm_weight, qe)
    rot = d if rotary_dim is None else rotary_dim
    if positions is not None:
        cos, sin = rope_tables(positions, rot, rope_theta)
    if cos is not None:
        cos = np.asarray(cos, np.float32)
        sin = np.asarray(sin, np.float32)
        q = apply_rope(q, cos, sin, rot, rope_layout)
        k = apply_rope(k, cos, sin, rot, rope_layout)
    if k_layout == "transposed":
        k = k.transpose(0, 2, 1)
    return (q.astype(out_dtype), np.ascontiguousarray(k).astype(out_dtype), v.astype(out_dtype),
            h_res)


def flops_qkv_proj(T, H, n_q_heads, n_kv_heads, head_dim):
    """Useful FLOPs: the projection GEMM (norm and RoPE are O(T*H) and O(T*N), not counted)."""
    return 2 * T * H * (n_q_heads + 2 * n_kv_heads) * head_dim


def bytes_qkv_proj(T, H, n_q_heads, n_kv_heads, head_dim, itemsize=2, residual=False):
    """Compulsory HBM traffic: x (and residual in, h out), the weights once, q/k/v once."""
    N = (n_q_heads + 2 * n_kv_heads) * head_dim
    act = T * H * itemsize * (3 if residual else 1)
    return act + H * N * itemsize + T * N * itemsize
