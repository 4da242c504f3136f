"""NumPy reference for ``nki_kernels.mxfp8_matmul``: MXFP8 quantization in the kernel's byte layout,
dequantization, and the MX matmul (dequantize both operands, fp32 matmul).

Quantization (OCP MX, the hardware ``quantize_mx`` rule): a matrix ``X[K, F]`` whose rows are
the contraction (``X = A.T`` with F = M, or ``X = B`` with F = N) is cut into blocks of 32
consecutive rows per column; each block gets one E8M0 scale byte ``s`` (value ``2**(s - 127)``,
0xFF = NaN) with ``e = floor(log2 amax) - (Emax - 1)``, Emax 8 (e4m3fn) / 15 (e5m2) -- 2x the
OCP MX sample algorithm (docs/low-precision.md) --, ``amax == 0 -> e = -127``, ``e`` clamped to
[-127, 127];
data = round-to-nearest-even of ``v / 2**e``; a block holding NaN/inf gets 0xFF and NaN data.

Byte layout ("MX tiles", docs/low-precision.md). K is zero-padded to ``512 * KT``; chunk ``c``
holds rows ``512c .. 512c + 511``, row ``512c + 4p + q`` going to partition ``p``, lane (byte)
``q`` of an x4 word. Columns are cut into tiles of 128 (the last may be narrower, width ``w``):

* ``data`` uint32 ``[128, KT * F]``: partition row ``p`` holds, for each column tile ``j`` in
  turn, the contiguous run ``[KT, w]`` of words ``(c, f) -> pack(X[512c + 4p + q, 128j + f])``;
* ``scale`` uint8 ``[64, SL * F]`` (``SL = ceil(KT / 4)``): the SBUF image of the scales with its
  unused partitions dropped. Row ``g = 16Q + 4o + i`` stands for SBUF partition ``32Q + 4o + i``
  and holds, per column tile, the run ``[SL, w]``: element ``(s, f)`` is the scale of block
  ``16(4s + o) + 4Q + i`` (chunk ``4s + o``, row ``4Q + i`` of the chunk's 16), 0 past KT.

So one 128-column tile of an operand is one contiguous DMA run per partition (data: KT*w*4
bytes; scales: SL*w bytes per used partition), and in SBUF chunk ``c`` is an x4 ``[128, w]``
tile whose 16 scale rows sit at partitions ``32*(r//4) + r%4 + 4*(c%4)`` of slot ``c//4`` --
the quadrant layout ``nc_matmul_mx`` reads (docs/low-precision.md).

Independent of the kernel (no tiling code shared, no emulator import). The block rule is
written out here and cross-checked in the tests against ``nki_kernels.reference.mx``.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

FORMATS = {"e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2"}
TILE = 128         # columns per tile of the byte layout
_ELEM = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
_EMAX = {"e4m3fn": 8, "e5m2": 15}
CHUNK = 512        # contraction rows per x4 tile (128 partitions x 4 lanes)
BLOCK = 32         # values per MX scale


def fmt_name(fmt: str) -> str:
    """Normalise ``"e4m3fn"`` / ``"float8_e4m3fn"`` (and ``_x4`` spellings) to the short name."""
    f = str(fmt)
    f = f[:-3] if f.endswith("_x4") else f
    f = f[len("float8_"):] if f.startswith("float8_") else f
    if f not in FORMATS:
        raise ValueError(f"MX format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    return f


def padded_k(K: int) -> int:
    return -(-K // CHUNK) * CHUNK


def mx_quantize_blocks(v, fmt="e4m3fn"):
    """MX-quantize blocks ``v[..., 32]`` (fp32): (values fp32 [..., 32], scale bytes [...])."""
    fmt = fmt_name(fmt)
    v = np.asarray(v, dtype=np.float32)
    finite = np.isfinite(v).all(axis=-1)
    with np.errstate(invalid="ignore"):
        amax = np.where(finite, np.abs(v).max(axis=-1), 0.0).astype(np.float32)
    _, e2 = np.frexp(amax)                           # amax = m * 2**e2, m in [0.5, 1)
    e = (e2.astype(np.int64) - 1) - (_EMAX[fmt] - 1)  # floor(log2 amax) - (Emax - 1)
    e = np.where(amax == 0, -127, e)
    e = np.clip(e, -127, 127)
    scale = np.where(finite, e + 127, 255).astype(np.uint8)
    scaled = np.ldexp(np.where(finite[..., None], v, 0).astype(np.float64), -e[..., None])
    vals = scaled.astype(np.float32).astype(_ELEM[fmt]).astype(np.float32)  # exact, then RNE
    vals = np.where(finite[..., None], vals, np.float32(np.nan))
    return vals, scale


def pack_words(vals, fmt):
    """fp32 values ``[..., 4]`` -> uint32 words, byte q = lane q in the fp8 format."""
    b = np.ascontiguousarray(np.asarray(vals, np.float32).astype(_ELEM[fmt_name(fmt)]))
    return b.view(np.uint8).reshape(b.shape).astype(np.uint32) @ np.array(
        [1, 1 << 8, 1 << 16, 1 << 24], dtype=np.uint32)


def unpack_words(words, fmt):
    """uint32 words -> fp32 values ``[..., 4]`` (lane q = byte q)."""
    w = np.asarray(words).astype(np.uint32)
    lanes = np.stack([(w >> (8 * q)) & 0xFF for q in range(4)], axis=-1).astype(np.uint8)
    return lanes.view(_ELEM[fmt_name(fmt)]).astype(np.float32)


def _col_tiles(F):
    return [(c0, min(TILE, F - c0)) for c0 in range(0, F, TILE)]


def tile_layout(data, scale):
    """Logical ``data[128, KT, F]`` words and ``scale[16 KT, F]`` bytes -> the MX tile layout
    (``data`` [128, KT*F], ``scale`` [64, SL*F])."""
    data = np.asarray(data, dtype=np.uint32)
    scale = np.asarray(scale, dtype=np.uint8)
    P, KT, F = data.shape
    SL = -(-KT // 4)
    img = np.zeros((4, 4, 4, SL, F), np.uint8)                 # [Q, o, i, s, f]
    for c in range(KT):
        s_, o = divmod(c, 4)
        img[:, o, :, s_, :] = scale[16 * c:16 * c + 16].reshape(4, 4, F)
    img = img.reshape(64, SL, F)
    d_out = np.empty((P, KT * F), np.uint32)
    s_out = np.empty((64, SL * F), np.uint8)
    for c0, w in _col_tiles(F):
        d_out[:, KT * c0:KT * (c0 + w)] = data[:, :, c0:c0 + w].reshape(P, KT * w)
        s_out[:, SL * c0:SL * (c0 + w)] = img[:, :, c0:c0 + w].reshape(64, SL * w)
    return d_out, s_out


def untile_layout(data, scale, KT):
    """Inverse of :func:`tile_layout`: -> (data [128, KT, F], scale [16 KT, F])."""
    data = np.asarray(data)
    scale = np.asarray(scale)
    P = data.shape[0]
    F = data.shape[1] // KT
    SL = -(-KT // 4)
    d = np.empty((P, KT, F), np.uint32)
    img = np.empty((64, SL, F), np.uint8)
    for c0, w in _col_tiles(F):
        d[:, :, c0:c0 + w] = data[:, KT * c0:KT * (c0 + w)].reshape(P, KT, w)
        img[:, :, c0:c0 + w] = scale[:, SL * c0:SL * (c0 + w)].reshape(64, SL, w)
    img = img.reshape(4, 4, 4, SL, F)
    sc = np.empty((16 * KT, F), np.uint8)
    for c in range(KT):
        s_, o = divmod(c, 4)
        sc[16 * c:16 * c + 16] = img[:, o, :, s_, :].reshape(16, F)
    return d, sc


def quantize_mx_kmajor(X, fmt="e4m3fn"):
    """``X[K, F]`` (contraction first) -> (data uint32 [128, KT*F], scale uint8 [64, SL*F]) in
    the MX tile layout."""
    fmt = fmt_name(fmt)
    X = np.asarray(X).astype(np.float32)
    K, F = X.shape
    Kp = padded_k(K)
    Xp = np.zeros((Kp, F), np.float32)
    Xp[:K] = X
    blocks = Xp.reshape(Kp // BLOCK, BLOCK, F).transpose(0, 2, 1)        # [Kp/32, F, 32]
    vals, scale = mx_quantize_blocks(blocks, fmt)
    vals = vals.transpose(0, 2, 1).reshape(Kp, F)                        # back to [Kp, F]
    words = pack_words(vals.reshape(Kp // 4, 4, F).transpose(0, 2, 1), fmt)   # [Kp/4, F]
    data = words.reshape(Kp // CHUNK, 128, F).transpose(1, 0, 2)         # [128, KT, F]
    return tile_layout(data, scale)


def dequantize_mx_kmajor(data, scale, fmt="e4m3fn", K=None, KT=None):
    """Inverse of :func:`quantize_mx_kmajor`: fp32 ``X_hat[K, F]`` (scale 0xFF -> NaN).
    ``KT`` defaults to ``ceil(K / 512)``; one of K, KT is required."""
    KT = KT if KT is not None else -(-K // CHUNK)
    d, sc = untile_layout(data, scale, KT)
    P, KT, F = d.shape
    vals = unpack_words(d.transpose(1, 0, 2).reshape(KT * P, F), fmt)      # [Kp/4, F, 4]
    vals = vals.transpose(0, 2, 1).reshape(KT * P * 4, F)                  # [Kp, F]
    s = sc.astype(np.int64)
    factor = np.where(s == 255, np.nan, np.exp2((s - 127).astype(np.float64)))
    out = (vals.astype(np.float64) * np.repeat(factor, BLOCK, axis=0)).astype(np.float32)
    return out if K is None else out[:K]


def mxfp8_matmul_ref(a, b, fmt="e4m3fn", out_dtype="bfloat16", a_fmt=None, b_fmt=None, K=None):
    """``C[M, N] = deq(A) @ deq(B)`` in fp32, cast to ``out_dtype``.

    ``a``: bf16 ``[M, K]`` (MX-quantized here with ``fmt``, as the kernel's ``quantize_mx``
    does) or ``(data, scale)`` of ``A.T`` in the MX tile layout; ``b``: bf16 ``[K, N]`` or
    ``(data, scale)`` of ``B``; ``K`` the logical contraction length (required when both are
    tuples). Returns (C, deq_A [M, K], deq_B [K, N])."""
    def deq(x, transposed, f):
        f = fmt_name(f or fmt)
        if isinstance(x, tuple):
            return dequantize_mx_kmajor(x[0], x[1], f, K)
        x = np.asarray(x).astype(np.float32)
        X = x.T if transposed else x
        return dequantize_mx_kmajor(*quantize_mx_kmajor(X, f), f, X.shape[0])

    if K is None:
        K = (np.asarray(a).shape[1] if not isinstance(a, tuple) else np.asarray(b).shape[0])
    at = deq(a, True, a_fmt)            # [K, M]
    bk = deq(b, False, b_fmt)           # [K, N]
    with np.errstate(invalid="ignore", over="ignore"):
        c = (at.astype(np.float64).T @ bk.astype(np.float64)).astype(np.float32)
    dt = ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.float32
    return c.astype(dt), at.T, bk


def flops_mxfp8_matmul(M, K, N):
    return 2 * M * K * N


def bytes_mxfp8_matmul(M, K, N, a_quantized=True, b_quantized=True, out_itemsize=2):
    """Compulsory HBM bytes: each operand read once (MX: 1 byte + 1/32 scale byte per value;
    bf16: 2 bytes per value), C written once."""
    def operand(n, quantized):
        return n + n // BLOCK if quantized else 2 * n
    return operand(M * K, a_quantized) + operand(K * N, b_quantized) + M * N * out_itemsize
