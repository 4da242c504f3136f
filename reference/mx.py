"""Pure NumPy reference for OCP microscaling (MX) as Trn3 implements it (OCP Microscaling
Formats (MX) v1.0 specification; ``nki.isa.quantize_mx`` / ``nc_matmul_mx`` in the NKI API reference;
the rules in our words: docs/low-precision.md).

Formats: ``"float8_e4m3fn"``, ``"float8_e5m2"`` (MXFP8) and ``"float4_e2m1fn"`` (MXFP4). A scale is
an E8M0 byte ``s`` meaning ``2**(s - 127)`` (0xFF = NaN). Scaling groups hold 32 values.

Layouts
  * Instruction tile layout (``quantize_mx_tile``): a ``[P, F]`` tile, groups of 8 partitions x 4
    consecutive free elements; free elements ``4j..4j+3`` become lanes 0..3 of x4 element ``j``.
  * Matrix layout (``quantize_mx``): ``X[4K', F]`` quantized along the contraction (rows). Values
    are returned as ``[K', F, 4]`` with element ``(k, f, q) = X[q*K' + k, f]`` and scales as
    ``[K'/8, F]`` (scale ``(b, f)`` covers ``k`` in ``8b..8b+7`` and all four ``q``).

Scale rule (the hardware's, 2x the OCP sample algorithm): ``X = 2**(floor(log2 amax) - (Emax-1))``
with Emax = 8 (e4m3fn), 15 (e5m2), 2 (e2m1; used here only to build fp4 test inputs: quantize_mx has
no fp4 output). ``amax == 0 -> 2**-127``; exponents below -127 clamp to -127; a group holding
NaN/inf gets scale 0xFF and NaN data (the last two are the emulator's documented choices where the
spec is silent). Data = round-to-nearest-even of ``v / X`` in the element format.

No import from ``nki_kernels.emulator``: tests use this as the independent expectation.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

EMAX = {"float8_e4m3fn": 8, "float8_e5m2": 15, "float4_e2m1fn": 2}
ELEM = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2,
        "float4_e2m1fn": ml_dtypes.float4_e2m1fn}


def _fmt(fmt):
    fmt = fmt[:-3] if fmt.endswith("_x4") else fmt
    if fmt not in EMAX:
        raise ValueError(f"format must be one of {sorted(EMAX)}; got {fmt!r}")
    return fmt


def _group_scale(amax, finite, fmt):
    """Scale exponent (int64) and scale byte (uint8) of groups with max-abs ``amax``."""
    a = np.where(finite & (amax > 0), amax, 1.0).astype(np.float64)
    e = np.floor(np.log2(a)).astype(np.int64) - (EMAX[fmt] - 1)
    e = np.where(amax > 0, e, -127)
    e = np.minimum(np.maximum(e, -127), 127)
    byte = np.where(finite, e + 127, 255).astype(np.uint8)
    return e, byte


def quantize_mx_tile(src, fmt="float8_e4m3fn"):
    """quantize_mx on a ``[P, F]`` tile: returns (values [P, F/4, 4] fp32, scales [P/8, F/4] u8)."""
    fmt = _fmt(fmt)
    x = np.asarray(src, dtype=np.float32)
    P, F = x.shape
    assert P % 8 == 0 and F % 4 == 0, (P, F)
    values = np.empty((P, F // 4, 4), dtype=np.float32)
    scales = np.empty((P // 8, F // 4), dtype=np.uint8)
    for b in range(P // 8):
        for j in range(F // 4):
            grp = x[8 * b:8 * b + 8, 4 * j:4 * j + 4].astype(np.float64)
            finite = bool(np.isfinite(grp).all())
            amax = float(np.abs(grp).max()) if finite else np.inf
            e, byte = _group_scale(np.array(amax), np.array(finite), fmt)
            scales[b, j] = byte
            if finite:
                q = (grp * 2.0 ** (-int(e))).astype(np.float32).astype(ELEM[fmt]).astype(np.float32)
            else:
                q = np.full(grp.shape, np.nan, dtype=np.float32)
            values[8 * b:8 * b + 8, j, :] = q
    return values, scales


def to_tile_layout(X):
    """``X[4K', F]`` -> tile ``T[K', 4F]`` with ``T[k, 4f + q] = X[q*K' + k, f]`` (so that
    quantize_mx of T gives matrix-layout x4 data)."""
    X = np.asarray(X)
    K4, F = X.shape
    assert K4 % 4 == 0
    K = K4 // 4
    return X.reshape(4, K, F).transpose(1, 2, 0).reshape(K, 4 * F)


def quantize_mx(X, fmt="float8_e4m3fn"):
    """MX-quantize ``X[4K', F]`` along the contraction: (values [K', F, 4], scales [K'/8, F])."""
    T = to_tile_layout(np.asarray(X, dtype=np.float32))
    return quantize_mx_tile(T, fmt)


def dequantize_mx(values, scales):
    """(values [K', F, 4], scales [K'/8, F]) -> fp32 ``X_hat[4K', F]`` (row ``q*K' + k``)."""
    values = np.asarray(values, dtype=np.float32)
    s = np.asarray(scales).astype(np.int64)
    K, F, _ = values.shape
    factor = np.where(s == 255, np.nan, np.exp2((s - 127).astype(np.float64)))   # [K'/8, F]
    factor = np.repeat(factor, 8, axis=0)[:, :, None]
    out = (values.astype(np.float64) * factor).astype(np.float32)                # [K', F, 4]
    return out.transpose(2, 0, 1).reshape(4 * K, F)


def mx_matmul(stat_values, stat_scales, mov_values, mov_scales):
    """``dequantize(stationary)[4K, M].T @ dequantize(moving)[4K, N]`` in fp32 -> [M, N]."""
    a = dequantize_mx(stat_values, stat_scales)
    b = dequantize_mx(mov_values, mov_scales)
    return (a.T @ b).astype(np.float32)


def pack_x4(values, fmt):
    """Values [..., 4] -> containers: uint32 (fp8: lane q = byte q) or uint16 (fp4: nibble q)."""
    fmt = _fmt(fmt)
    v = np.asarray(values, dtype=np.float32).astype(ELEM[fmt])
    b = v.view(np.uint8).astype(np.uint32)
    if fmt == "float4_e2m1fn":
        b = b & 0xF
        w = b[..., 0] | (b[..., 1] << 4) | (b[..., 2] << 8) | (b[..., 3] << 12)
        return w.astype(np.uint16)
    return (b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)).astype(np.uint32)


def unpack_x4(words, fmt):
    """Inverse of :func:`pack_x4`: containers -> fp32 values [..., 4]."""
    fmt = _fmt(fmt)
    w = np.asarray(words).astype(np.uint32)
    width = 4 if fmt == "float4_e2m1fn" else 8
    mask = (1 << width) - 1
    lanes = np.stack([(w >> (width * q)) & mask for q in range(4)], axis=-1).astype(np.uint8)
    return lanes.view(ELEM[fmt]).astype(np.float32)


def scale_partitions(R, offset=0):
    """Partition of each of ``R`` scale rows in the quadrant layout: 32*(r//4) + r%4 + offset."""
    r = np.arange(R)
    return 32 * (r // 4) + (r % 4) + offset


def place_scales(scales, partitions=128, offset=0, fill=0, out=None):
    """Spread logical scales [R, F] over SBUF quadrants into a [partitions, F] uint8 buffer."""
    scales = np.asarray(scales, dtype=np.uint8)
    R, F = scales.shape
    if out is None:
        out = np.full((partitions, F), fill, dtype=np.uint8)
    out[scale_partitions(R, offset), :F] = scales
    return out


def flops_mx_matmul(K4, M, N):
    """Useful FLOPs of one MX matmul with effective contraction ``K4`` (= 4 * x4 rows)."""
    return 2 * K4 * M * N


def bytes_mx_matmul(K4, M, N, fmt_stat="float8_e4m3fn", fmt_mov="float8_e4m3fn", out_bytes=4):
    """Bytes moved: packed data + one scale byte per 32 values for each operand, plus the output."""
    bits = {"float8_e4m3fn": 8, "float8_e5m2": 8, "float4_e2m1fn": 4}
    data = K4 * M * bits[_fmt(fmt_stat)] // 8 + K4 * N * bits[_fmt(fmt_mov)] // 8
    scales = (K4 // 32) * (M + N)
    return data + scales + M * N * out_bytes
