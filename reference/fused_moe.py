"""NumPy reference for ``nki_kernels.fused_moe``: routed SwiGLU experts, weighted sum, optional
shared expert.

``y[t] = sum_j w[t, j] * mlp_{ids[t, j]}(x[t]) (+ mlp_shared(x[t]))`` with
``mlp_e(a) = (silu(a @ Wg_e) * (a @ Wu_e)) @ Wd_e``, ``Wg_e = w_gate_up[e][:, :I]``,
``Wu_e = w_gate_up[e][:, I:]``, ``Wd_e = w_down[e]``. Plain fp32 per expert (no tiling), the
weighted sum accumulated in fp32, cast to bfloat16 at the end. Expert parallelism: the local
experts are global ids ``[expert_offset, expert_offset + E)``; any other id contributes nothing.
FP8 weights are dequantized exactly (``w * scale[column]``); ``act_dtype`` quantizes the GEMM
inputs (x and h) per token as the FP8 kernel does.

MXFP8 weights (Trn3) come as ``(data, scale, fmt, k)`` tuples with a leading expert dim (what
``quantize_expert_weights_mx`` returns). They are decoded here with the independent NumPy decoder
of ``reference.mxfp8_matmul`` (the MX tile layout); the down weight's rows are stored
interleaved (row ``512c + 4p + q`` holds ``w_down[128(4c + q) + p]``), so it decodes to
``D'[512 KC, H]`` and h is put in that order (:func:`interleave_rows`) before the down product.
The MX path is W8A8 as the kernel runs it, modelled step by step:

* ``x`` (bf16) MX-quantized per token in blocks of 32 consecutive hidden values (the hardware
  ``quantize_mx`` rule: scale ``2**(floor(log2 amax) - (Emax - 1))``, values rounded to nearest
  even in the element format; ``reference.mxfp8_matmul.mx_quantize_blocks``);
* ``g, u = xq @ deq(Wg), xq @ deq(Wu)`` in fp32; ``h = bf16(silu(g) * w * u)`` -- the routing
  weight ``w`` of the token scales h *before* it is quantized, as in the kernel (the shared
  expert: ``w = 1``), rounded to nearest even to bf16;
* ``h`` (interleaved) MX-quantized in blocks of 32 consecutive rows of ``D'``, then
  ``y += hq @ deq(D')`` in fp32.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _quantize_per_token(a, dtype):
    fmax = np.float32(ml_dtypes.finfo(dtype).max)
    amax = np.max(np.abs(a), axis=-1, keepdims=True)
    inv = fmax / np.maximum(amax, np.float32(1e-30))
    return (a * inv).astype(dtype).astype(np.float32) * (amax / fmax)


def _mlp(a, wgu, wd, sgu, sd, act_dtype):
    wgu = np.asarray(wgu).astype(np.float32)
    wd = np.asarray(wd).astype(np.float32)
    if sgu is not None:
        wgu = wgu * np.asarray(sgu, np.float32)[None, :]
        wd = wd * np.asarray(sd, np.float32)[None, :]
    I = wd.shape[0]
    if act_dtype is not None:
        a = _quantize_per_token(a, act_dtype)
    with np.errstate(over="ignore"):
        gu = a @ wgu
        h = _silu(gu[:, :I]) * gu[:, I:]
    if act_dtype is not None:
        h = _quantize_per_token(h, act_dtype)
    return h @ wd


def interleave_rows(h, KC):
    """``h[..., I]`` (I = 128 KI) -> ``[..., 512 KC]`` with entry ``512c + 4p + q`` =
    ``h[..., 128(4c + q) + p]`` (0 where that tile does not exist)."""
    h = np.asarray(h, np.float32)
    KI = h.shape[-1] // 128
    out = np.zeros(h.shape[:-1] + (KC, 128, 4), np.float32)
    for j in range(KI):
        out[..., j // 4, :, j % 4] = h[..., 128 * j:128 * (j + 1)]
    return out.reshape(h.shape[:-1] + (512 * KC,))


def _mx_act(a, fmt):
    """MX quantize-dequantize of ``a[n, K]`` along K (blocks of 32 consecutive values)."""
    from .mxfp8_matmul import mx_quantize_blocks
    n, K = a.shape
    vals, sc = mx_quantize_blocks(a.reshape(n, K // 32, 32), fmt)
    f = np.where(sc == 255, np.nan, np.exp2(sc.astype(np.float64) - 127))
    return (vals * f[..., None]).reshape(n, K).astype(np.float32)


def _mx_weight(data, scale, fmt, k):
    from .mxfp8_matmul import dequantize_mx_kmajor
    return dequantize_mx_kmajor(np.asarray(data), np.asarray(scale), fmt, KT=-(-int(k) // 512))


def _mlp_mx(a, w, gu, dn):
    """MXFP8 expert on rows ``a`` with per-row routing weights ``w`` (module docstring)."""
    fmt = gu[2]
    fmt = fmt[len("float8_"):] if str(fmt).startswith("float8_") else fmt
    H = a.shape[1]
    wgu = _mx_weight(gu[0], gu[1], fmt, gu[3])[:H]                 # [H, 2I]
    wd = _mx_weight(dn[0], dn[1], fmt, dn[3])                      # [512 KC, H] interleaved
    I = wgu.shape[1] // 2
    xq = _mx_act(a, fmt)
    with np.errstate(over="ignore"):
        gu_ = xq @ wgu
        h = (_silu(gu_[:, :I]) * w[:, None] * gu_[:, I:]).astype(BF16).astype(np.float32)
    hq = _mx_act(interleave_rows(h, wd.shape[0] // 512), fmt)
    return hq @ wd


def _fused_moe_mx_ref(a, w_gate_up, w_down, w, ids, shared, out_dtype):
    T, H = a.shape
    E = np.asarray(w_gate_up[0]).shape[0]
    y = np.zeros((T, H), np.float32)
    for e in range(E):
        ws = np.where(ids == e, w, 0).sum(axis=1)                      # summed if listed twice
        t = np.nonzero((ids == e).any(axis=1))[0]
        if t.size == 0:
            continue
        gu = (w_gate_up[0][e], w_gate_up[1][e], w_gate_up[2], w_gate_up[3])
        dn = (w_down[0][e], w_down[1][e], w_down[2], w_down[3])
        y[t] += _mlp_mx(a[t], ws[t], gu, dn)
    if shared is not None:
        y = y + _mlp_mx(a, np.ones(T, np.float32), tuple(shared[0]), tuple(shared[1]))
    return y.astype(out_dtype)


def fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids, *, shared=None,
                  gate_up_scale=None, down_scale=None, shared_scales=None, expert_offset=0,
                  act_dtype=None, out_dtype=BF16):
    """x [T, H]; w_gate_up [E, H, 2I]; w_down [E, I, H]; topk_weights, topk_ids [T, k];
    shared: None or (w_gate_up [H, 2Is], w_down [Is, H]); FP8 scales [E, 2I], [E, H] (and
    shared_scales ([2Is], [H])). MXFP8: w_gate_up, w_down (and shared's pair) are
    ``(data, scale, fmt, k)`` tuples (module docstring)."""
    a = np.asarray(x).astype(np.float32)
    if isinstance(w_gate_up, tuple):
        ids = np.asarray(topk_ids).astype(np.int64) - expert_offset
        return _fused_moe_mx_ref(a, w_gate_up, w_down, np.asarray(topk_weights, np.float32),
                                 ids, shared, out_dtype)
    T, H = a.shape
    E = w_gate_up.shape[0]
    ids = np.asarray(topk_ids).astype(np.int64) - expert_offset
    w = np.asarray(topk_weights).astype(np.float32)
    y = np.zeros((T, H), np.float32)
    for e in range(E):
        t, j = np.nonzero(ids == e)
        if t.size == 0:
            continue
        out = _mlp(a[t], w_gate_up[e], w_down[e],
                   None if gate_up_scale is None else gate_up_scale[e],
                   None if down_scale is None else down_scale[e], act_dtype)
        np.add.at(y, t, w[t, j][:, None] * out)
    if shared is not None:
        ss = shared_scales or (None, None)
        y = y + _mlp(a, shared[0], shared[1], ss[0], ss[1], act_dtype)
    return y.astype(out_dtype)


def local_assignments(topk_ids, n_local, expert_offset=0):
    """Number of (token, slot) pairs routed to the local experts."""
    ids = np.asarray(topk_ids).astype(np.int64) - expert_offset
    return int(np.count_nonzero((ids >= 0) & (ids < n_local)))


def distinct_local_experts(topk_ids, n_local, expert_offset=0):
    """Number of distinct local experts chosen by at least one token."""
    ids = np.asarray(topk_ids).astype(np.int64).ravel() - expert_offset
    return int(np.unique(ids[(ids >= 0) & (ids < n_local)]).size)


def flops_fused_moe(n_assign, H, I, T=0, shared_I=0):
    """Useful FLOPs: three GEMMs per routed (token, expert) pair, plus the shared expert."""
    return 6 * H * I * n_assign + 6 * T * H * shared_I


def bytes_fused_moe(T, H, I, n_distinct, top_k, w_itemsize=2, shared_I=0, mx=False):
    """Compulsory HBM traffic: the distinct chosen experts' weights once (+ FP8 scales; MXFP8:
    1 byte per weight + one E8M0 byte per block of 32), the shared expert's weights, x and y,
    the routing (weights fp32 + ids int32)."""
    if mx:
        per = 3 * H * I + 3 * H * I // 32
        sh = 3 * H * shared_I + 3 * H * shared_I // 32
        return n_distinct * per + sh + 2 * T * H * 2 + T * top_k * 8
    scales = 4 * (2 * I + H) if w_itemsize == 1 else 0
    sh = (3 * H * shared_I * w_itemsize + (4 * (2 * shared_I + H) if w_itemsize == 1 else 0)
          if shared_I else 0)
    return n_distinct * (3 * H * I * w_itemsize + scales) + sh + 2 * T * H * 2 + T * top_k * 8
