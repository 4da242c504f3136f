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
``quantize_expert_weights_mx`` returns). The gate|up weight (the MX tile layout) is decoded with the
independent NumPy decoder of ``reference.mxfp8_matmul``; the down weight is chunk-major, chunk
c of 512 contraction rows packed on ``kp`` partitions with lane q of partition p holding row
``r0 + kp*q + p`` (:func:`down_chunks`), decoded here (:func:`_mx_down`).
The MX path is W8A8 as the kernel runs it, modelled step by step:

* ``x`` (bf16) MX-quantized per token in blocks of 32 consecutive hidden values (the hardware
  ``quantize_mx`` rule: scale ``2**(floor(log2 amax) - (Emax - 1))``, values rounded to nearest
  even in the element format; ``reference.mxfp8_matmul.mx_quantize_blocks``);
* ``g, u = xq @ deq(Wg), xq @ deq(Wu)`` in fp32; ``h = bf16(silu(g) * w * u)`` -- the routing
  weight ``w`` of the token scales h *before* it is quantized, as in the kernel (the shared
  expert: ``w = 1``), rounded to nearest even to bf16;
* ``h`` MX-quantized in the kernel's blocks (per down chunk: 8 partitions x 4 lanes, i.e. rows
  ``r0 + kp*q + p`` for 8 consecutive p), then ``y += hq @ deq(W_d)`` in fp32.
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


def down_chunks(I):
    """``[(r0, n, kp)]`` per 512-row chunk of the down contraction: ``n`` rows from ``r0`` on
    ``kp`` partitions, lane q holding rows ``r0 + kp*q + p`` (kp = n/4; a 384-row chunk uses
    kp = 128 with lane 3 empty)."""
    return [(r0, min(512, I - r0), 128 if min(512, I - r0) == 384 else min(512, I - r0) // 4)
            for r0 in range(0, I, 512)]


def _row_map(I):
    """For each down chunk: (rows [kp, 4] int, valid [kp, 4] bool): the contraction row held by
    partition p, lane q."""
    out = []
    for r0, n, kp in down_chunks(I):
        p, q = np.meshgrid(np.arange(kp), np.arange(4), indexing="ij")
        off = kp * q + p
        out.append((r0 + np.minimum(off, n - 1), off < n))
    return out


def _mx_act(a, fmt):
    """MX quantize-dequantize of ``a[n, K]`` along K (blocks of 32 consecutive values)."""
    from .mxfp8_matmul import mx_quantize_blocks
    n, K = a.shape
    vals, sc = mx_quantize_blocks(a.reshape(n, K // 32, 32), fmt)
    f = np.where(sc == 255, np.nan, np.exp2(sc.astype(np.float64) - 127))
    return (vals * f[..., None]).reshape(n, K).astype(np.float32)


def _mx_h(h, fmt):
    """MX quantize-dequantize of h ``[n, I]`` in the kernel's blocks: per down chunk, 8
    partitions x 4 lanes (rows ``r0 + kp*q + p``)."""
    from .mxfp8_matmul import mx_quantize_blocks
    out = np.zeros_like(h)
    for rows, valid in _row_map(h.shape[1]):
        kp = rows.shape[0]
        v = np.where(valid, h[:, rows], 0).reshape(h.shape[0], kp // 8, 32)   # [n, kp/8, 32]
        vals, sc = mx_quantize_blocks(v, fmt)
        f = np.where(sc == 255, np.nan, np.exp2(sc.astype(np.float64) - 127))
        dq = (vals * f[..., None]).reshape(h.shape[0], kp, 4).astype(np.float32)
        out[:, rows[valid]] = dq[:, valid]
    return out


def _mx_weight(data, scale, fmt, k):
    from .mxfp8_matmul import dequantize_mx_kmajor
    return dequantize_mx_kmajor(np.asarray(data), np.asarray(scale), fmt, KT=-(-int(k) // 512))


def _mx_down(data, scale, fmt, I):
    """Decode the chunk-major down data ``[128, KC*H]`` / scale image ``[64, SL*H]`` to
    ``W_d [I, H]`` fp32: chunk c is words ``[128, H]`` (byte q = lane q), the scale of
    partitions ``8b..8b+7`` at image row ``16(b//4) + 4(c%4) + b%4``, slot ``c//4``."""
    from .mxfp8_matmul import unpack_words
    data, scale = np.asarray(data), np.asarray(scale)
    KC = -(-I // 512)
    H = data.shape[1] // KC
    img = scale.reshape(64, -1, H)
    W = np.zeros((I, H), np.float32)
    for c, (rows, valid) in enumerate(_row_map(I)):
        kp = rows.shape[0]
        vals = unpack_words(data[0:kp, c * H:(c + 1) * H], fmt)                 # [kp, H, 4]
        b = np.arange(kp) // 8
        sc = img[16 * (b // 4) + 4 * (c % 4) + b % 4, c // 4, :].astype(np.int64)   # [kp, H]
        f = np.where(sc == 255, np.nan, np.exp2((sc - 127).astype(np.float64)))
        v = (vals.astype(np.float64) * f[:, :, None]).astype(np.float32)        # [kp, H, 4]
        for q in range(4):
            W[rows[valid[:, q], q]] = v[valid[:, q], :, q]
    return W


def _mlp_mx(a, w, gu, dn):
    """MXFP8 expert on rows ``a`` with per-row routing weights ``w`` (module docstring)."""
    fmt = gu[2]
    fmt = fmt[len("float8_"):] if str(fmt).startswith("float8_") else fmt
    H = a.shape[1]
    wgu = _mx_weight(gu[0], gu[1], fmt, gu[3])[:H]                 # [H, 2I]
    I = wgu.shape[1] // 2
    wd = _mx_down(dn[0], dn[1], fmt, I)                            # [I, H]
    xq = _mx_act(a, fmt)
    with np.errstate(over="ignore"):
        gu_ = xq @ wgu
        h = (_silu(gu_[:, :I]) * w[:, None] * gu_[:, I:]).astype(BF16).astype(np.float32)
    return _mx_h(h, fmt) @ wd


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
