"""NumPy reference for ``nki_kernels.fused_moe``: routed SwiGLU experts, weighted sum, optional
shared expert.

``y[t] = sum_j w[t, j] * mlp_{ids[t, j]}(x[t]) (+ mlp_shared(x[t]))`` with
``mlp_e(a) = (silu(a @ Wg_e) * (a @ Wu_e)) @ Wd_e``, ``Wg_e = w_gate_up[e][:, :I]``,
``Wu_e = w_gate_up[e][:, I:]``, ``Wd_e = w_down[e]``. Plain fp32 per expert (no tiling), the
weighted sum accumulated in fp32, cast to bfloat16 at the end. Expert parallelism: the local
experts are global ids ``[expert_offset, expert_offset + E)``; any other id contributes nothing.
FP8 weights are dequantized exactly (``w * scale[column]``); ``act_dtype`` quantizes the GEMM
inputs (x and h) per token as the FP8 kernel does.
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


def fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids, *, shared=None,
                  gate_up_scale=None, down_scale=None, shared_scales=None, expert_offset=0,
                  act_dtype=None, out_dtype=BF16):
    """x [T, H]; w_gate_up [E, H, 2I]; w_down [E, I, H]; topk_weights, topk_ids [T, k];
    shared: None or (w_gate_up [H, 2Is], w_down [Is, H]); FP8 scales [E, 2I], [E, H] (and
    shared_scales ([2Is], [H]))."""
    a = np.asarray(x).astype(np.float32)
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


def bytes_fused_moe(T, H, I, n_distinct, top_k, w_itemsize=2, shared_I=0):
    """Compulsory HBM traffic: the distinct chosen experts' weights once (+ FP8 scales), the
    shared expert's weights, x and y, the routing (weights fp32 + ids int32)."""
    scales = 4 * (2 * I + H) if w_itemsize == 1 else 0
    sh = (3 * H * shared_I * w_itemsize + (4 * (2 * shared_I + H) if w_itemsize == 1 else 0)
          if shared_I else 0)
    return n_distinct * (3 * H * I * w_itemsize + scales) + sh + 2 * T * H * 2 + T * top_k * 8
