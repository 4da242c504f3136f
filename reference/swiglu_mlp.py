"""NumPy reference for ``nki_kernels.swiglu_mlp``: SwiGLU MLP with optional RMSNorm in front,
residual add behind, and FP8 weights with per-output-channel scales.

Plain fp32 math on the whole arrays (no tiling), cast to bfloat16 at the end. FP8 weights are
dequantized exactly (``w.astype(f32) * scale[column]``); the reference does not quantize the
activations, so an FP8 kernel is compared with a global similarity metric.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def _silu(x):
    return x / (1.0 + np.exp(-x))


def quantize_per_token(a, dtype):
    """Symmetric per-row FP8 quantization, dequantized: ``fp8(a / s) * s``, s = max|row| / max."""
    fmax = np.float32(ml_dtypes.finfo(dtype).max)
    amax = np.max(np.abs(a), axis=-1, keepdims=True)
    s = amax / fmax
    inv = fmax / np.maximum(amax, np.float32(1e-30))
    return (a * inv).astype(dtype).astype(np.float32) * s


def swiglu_mlp_ref(x, w_gate, w_up, w_down, *, norm_weight=None, eps=1e-6, residual=None,
                   gate_scale=None, up_scale=None, down_scale=None, act_dtype=None,
                   out_dtype=BF16):
    """``residual + (silu(xn @ Wg) * (xn @ Wu)) @ Wd`` with ``xn = rmsnorm(x) * norm_weight``.

    act_dtype: an FP8 dtype to quantize the GEMM inputs (xn and the intermediate h) per token,
    as the FP8 kernel does; None keeps them in fp32."""
    a = np.asarray(x).astype(np.float32)
    if norm_weight is not None:
        ms = np.mean(a * a, axis=-1, keepdims=True)
        a = a / np.sqrt(ms + np.float32(eps)) * np.asarray(norm_weight, np.float32)
    wg = np.asarray(w_gate).astype(np.float32)
    wu = np.asarray(w_up).astype(np.float32)
    wd = np.asarray(w_down).astype(np.float32)
    if gate_scale is not None:
        wg = wg * np.asarray(gate_scale, np.float32)[None, :]
        wu = wu * np.asarray(up_scale, np.float32)[None, :]
        wd = wd * np.asarray(down_scale, np.float32)[None, :]
    if act_dtype is not None:
        a = quantize_per_token(a, act_dtype)
    with np.errstate(over="ignore"):
        h = _silu(a @ wg) * (a @ wu)
    if act_dtype is not None:
        h = quantize_per_token(h, act_dtype)
    y = h @ wd
    if residual is not None:
        y = y + np.asarray(residual).astype(np.float32)
    return y.astype(out_dtype)


def quantize_fp8_per_channel(w, dtype):
    """Symmetric per-output-channel (per column) FP8 quantization: returns (w_q, scale [N])."""
    fmax = float(ml_dtypes.finfo(dtype).max)
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=0)
    scale = np.where(amax > 0, amax / fmax, 1.0).astype(np.float32)
    return (w / scale[None, :]).astype(dtype), scale


def flops_swiglu_mlp(T, H, I):
    """Useful FLOPs: the three GEMMs (norm, silu and the product are O(T*I), not counted)."""
    return 6 * T * H * I


def bytes_swiglu_mlp(T, H, I, w_itemsize=2, act_itemsize=2, residual=False):
    """Compulsory HBM traffic: x, the three weights once (+ scales when FP8), y (+ residual)."""
    scales = 4 * (2 * I + H) if w_itemsize == 1 else 0
    return (T * H * act_itemsize * (3 if residual else 2) + 3 * H * I * w_itemsize + scales)
