"""NumPy reference for ``nki_kernels.rmsnorm_quant``: RMSNorm (+ residual add) then FP8 per-token
or MXFP8 quantization, with the op's exact rounding steps and output byte layout.

The op's numerics (the kernel performs the same fp32 operations; docs/low-precision.md):

    h     = x                                  or  bf16(x + residual)   (also returned)
    ss    = sum_j h_j * h_j                    fp32 products; the sum is exact here (float64),
                                               the kernel accumulates in fp32
    z     = ss - ss                            0, or NaN when the row holds inf/NaN (or ss
                                               overflows): such rows come out all NaN
    rstd  = 1 / sqrt(ss * (1/H) + eps) + z     fp32, one rounding per operation

FP8 per token (``dtype`` float8_e4m3 (max 240), float8_e4m3fn (448) or float8_e5m2 (57344)):

    g     = bf16(h * gamma)
    dynamic:  m = max_j |g_j|,  mc = max(m, AMAX_FLOOR),  k = (1 / mc) * fp8_max + z
              q = fp8(g * k)                           (|g k| <= fp8_max: no overflow)
              scale = mc * (1/fp8_max) * rstd          (fp32, per row; dequant = q * scale)
    static:   k = rstd * (1/static_scale)
              q = fp8(clamp(g * k, -fp8_max, fp8_max)) (saturates),  scale = static_scale

    so with dynamic scaling the FP8 data does not depend on rstd at all (only the scale does).

MXFP8 (Trn3):

    y1    = bf16(h * rstd)
    y     = bf16(y1 * gamma)
    (data, scale) = MX quantization of y.T [H, T] in the MX tile layout of
          reference.mxfp8_matmul: data uint32 [128, (H/512) T], scale uint8 [64, ceil(H/2048) T];
          blocks of 32 consecutive H values per token.

A NaN or inf anywhere in a row makes all of that row's outputs NaN (FP8 data and scale NaN; MX
data NaN and block scales 0xFF); other rows are unaffected.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels.reference.mxfp8_matmul import quantize_mx_kmajor

BF16 = ml_dtypes.bfloat16
FP8 = {"float8_e4m3": ml_dtypes.float8_e4m3, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
       "float8_e5m2": ml_dtypes.float8_e5m2}
FP8_MAX = {"float8_e4m3": 240.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
# Rows whose |max| is below this are scaled as if it were this (keeps 1/m finite in fp32 and
# fp8_max/m below the fp32 maximum for every format); all-zero rows quantize to zeros.
AMAX_FLOOR = 2.0 ** -100

_F = np.float32


def residual_add(x, residual):
    """``bf16(x + residual)`` computed in fp32."""
    return (np.asarray(x).astype(_F) + np.asarray(residual).astype(_F)).astype(BF16)


def sum_squares(h):
    """Per-row sum of fp32 squares, summed exactly (float64) and rounded to fp32, shape [T]."""
    hf = np.asarray(h).astype(_F)
    with np.errstate(over="ignore", invalid="ignore"):
        sq = hf * hf                                             # fp32 products
        return sq.astype(np.float64).sum(axis=1).astype(_F)


def rms_rstd(h, eps=1e-6):
    """Per-row ``1 / sqrt(mean(h^2) + eps) + z`` in fp32 (z: NaN for rows with inf/NaN), [T]."""
    H = np.asarray(h).shape[1]
    ss = sum_squares(h)
    with np.errstate(over="ignore", invalid="ignore"):
        z = ss - ss
        v = ss * _F(1.0 / H) + _F(eps)
        return ((_F(1) / np.sqrt(v)).astype(_F) + z).astype(_F)


def rmsnorm_ref(x, gamma, eps=1e-6, residual=None):
    """Plain fp32 RMSNorm ``h * rstd * gamma`` (no quantization), for accuracy checks."""
    h = x if residual is None else residual_add(x, residual)
    rstd = rms_rstd(h, eps)
    with np.errstate(invalid="ignore"):
        return np.asarray(h).astype(_F) * rstd[:, None] * np.asarray(gamma).astype(_F)


def rmsnorm_quant_fp8_ref(x, gamma, residual=None, eps=1e-6, dtype="float8_e4m3fn",
                          static_scale=None):
    """Returns (q [T, H] fp8, scale [T, 1] fp32) and, with a residual, the updated residual."""
    h = np.asarray(x) if residual is None else residual_add(x, residual)
    rstd = rms_rstd(h, eps)
    with np.errstate(invalid="ignore"):
        z = sum_squares(h)
        z = z - z
    fmax = _F(FP8_MAX[dtype])
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        g = (h.astype(_F) * np.asarray(gamma).astype(_F)).astype(BF16).astype(_F)
        if static_scale is None:
            m = np.abs(g).max(axis=1)
            mc = np.maximum(m, _F(AMAX_FLOOR))
            k = ((_F(1) / mc).astype(_F) * fmax).astype(_F) + z
            q32 = g * k[:, None]
            scale = (mc * _F(1.0 / FP8_MAX[dtype])).astype(_F) * rstd
        else:
            k = rstd * _F(1.0 / static_scale)
            q32 = np.maximum(np.minimum((g * k[:, None]).astype(_F), fmax), -fmax)
            scale = np.full(h.shape[0], static_scale, dtype=_F)
    out = (q32.astype(_F).astype(FP8[dtype]), scale.astype(_F).reshape(-1, 1))
    return out + ((h,) if residual is not None else ())


def rmsnorm_quant_mx_ref(x, gamma, residual=None, eps=1e-6, fmt="e4m3fn"):
    """Returns (data uint32 [128, (H/512) T], scale uint8 [64, ceil(H/2048) T]) and, with a
    residual, the updated residual. :func:`rmsnorm_mx_values` gives the bf16 values quantized."""
    h = np.asarray(x) if residual is None else residual_add(x, residual)
    y = rmsnorm_mx_values(h, gamma, eps)
    data, scale = quantize_mx_kmajor(y.astype(_F).T, fmt)
    return (data, scale) + ((h,) if residual is not None else ())


def rmsnorm_mx_values(h, gamma, eps=1e-6):
    """The bf16 ``y = bf16(bf16(h * rstd) * gamma)`` that the MX path quantizes, [T, H]."""
    rstd = rms_rstd(h, eps)
    with np.errstate(invalid="ignore"):
        y1 = (np.asarray(h).astype(_F) * rstd[:, None]).astype(BF16)
        return (y1.astype(_F) * np.asarray(gamma).astype(_F)).astype(BF16)


def dequantize_fp8_rows(q, scale):
    """fp32 ``q * scale`` (per-row scale)."""
    with np.errstate(invalid="ignore"):
        return np.asarray(q).astype(_F) * np.asarray(scale, dtype=_F).reshape(-1, 1)


def flops_rmsnorm_quant(T, H):
    """Useful arithmetic per element: square, add, scale, gamma, |.|, max, quantize ~ 7."""
    return 7 * T * H


def bytes_rmsnorm_quant(T, H, quant="fp8", residual=False):
    """Compulsory HBM bytes: read x (bf16), write the 1-byte data and the scales; with a residual
    also read it and write the updated residual (bf16). gamma is counted once."""
    scales = 4 * T if quant == "fp8" else (H // 32) * T     # MX: the compact count
    b = 2 * T * H + T * H + scales + 2 * H
    if residual:
        b += 4 * T * H
    return b
