"""Accuracy rules, written once for the whole test suite (docs/testing.md says which applies where).

* ``assert_close``: element-wise ops and norms, per output dtype (atol, rtol).
* ``assert_matmul_close``: a product against its fp32 reference, bounded by the output rounding
  plus the fp32 accumulation bound ``K * 2^-24 * (|A| @ |B|)`` (Higham's gamma_K), so the bound
  follows the data instead of a guessed tolerance.
* ``assert_attention_close``: kernel error at most twice the error of a same-precision reference
  plus a noise floor.
* ``cosine_similarity``: the global similarity metric for quantized matmuls.
NaN and inf positions must match in every rule.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

# unit roundoff of each output dtype (round to nearest even): half an ulp at 1.0
UNIT_ROUNDOFF = {
    "float32": 2.0 ** -24,
    "bfloat16": 2.0 ** -8,
    "float16": 2.0 ** -11,
    "float8_e4m3": 2.0 ** -4,
    "float8_e4m3fn": 2.0 ** -4,
    "float8_e5m2": 2.0 ** -3,
}

# element-wise ops: (atol, rtol) per output dtype. rtol = 2 units of roundoff (the result and one
# rounded intermediate); atol covers results that cancel to ~0.
ELEMENTWISE_TOL = {
    "float32": (1e-6, 2e-6),
    "bfloat16": (1e-3, 2 * 2.0 ** -8),
    "float16": (1e-4, 2 * 2.0 ** -11),
}


def dtype_name(x) -> str:
    d = np.asarray(x).dtype
    for n in UNIT_ROUNDOFF:
        if n in ("float32", "float16"):
            if d == np.dtype(n):
                return n
        elif d == np.dtype(getattr(ml_dtypes, n)):
            return n
    return str(d)


def _nonfinite_match(actual, expected, what):
    a = np.asarray(actual, dtype=np.float32)
    e = np.asarray(expected, dtype=np.float32)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape} != expected {e.shape}")
    for name, fn in (("NaN", np.isnan), ("+inf", lambda x: np.isposinf(x)),
                     ("-inf", lambda x: np.isneginf(x))):
        ma, me = fn(a), fn(e)
        if not np.array_equal(ma, me):
            idx = np.argwhere(ma != me)[:5].tolist()
            raise AssertionError(f"{what}: {name} positions differ at {idx}")
    fin = np.isfinite(e)
    return a, e, fin


def _report(what, err, bound, a, e):
    bad = err > bound
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(bound, 1e-30), 0)), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements out of bounds; worst at {list(i)}: "
            f"got {a[i]!r}, expected {e[i]!r}, |err| {err[i]:.3e} > bound {bound[i]:.3e}")


def assert_close(actual, expected, dtype=None, atol=None, rtol=None, what="result"):
    """Element-wise rule: |a - e| <= atol + rtol * |e| with the dtype's tolerances."""
    dtype = dtype or dtype_name(actual)
    d_atol, d_rtol = ELEMENTWISE_TOL[dtype]
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    a, e, fin = _nonfinite_match(actual, expected, what)
    err = np.where(fin, np.abs(a - e), 0.0)
    bound = atol + rtol * np.abs(np.where(fin, e, 0.0))
    _report(what, err, bound, a, e)


def assert_matmul_close(actual, a, b, what="matmul"):
    """``actual`` vs fp32 ``a @ b``: |err| <= u_out*|ref| + K*2^-24*(|a|@|b|) (+ a denormal floor)."""
    af = np.asarray(a).astype(np.float32)
    bf = np.asarray(b).astype(np.float32)
    ref = af @ bf
    K = af.shape[-1]
    u = UNIT_ROUNDOFF[dtype_name(actual)]
    acc = (np.abs(af) @ np.abs(bf)) * (K * 2.0 ** -24)
    x, e, fin = _nonfinite_match(actual, ref, what)
    err = np.where(fin, np.abs(x - e), 0.0)
    bound = u * np.abs(e) + acc * (1 + u) + 1e-30
    _report(what, err, bound, x, e)


def assert_attention_close(actual, reference_same_precision, reference_fp64, floor=1e-3,
                           what="attention"):
    """Kernel error <= 2 x (error of a same-precision reference) + floor, element-wise max-norm."""
    x, e, _ = _nonfinite_match(actual, reference_fp64, what)
    r = np.asarray(reference_same_precision, dtype=np.float32)
    k_err = float(np.nanmax(np.abs(x - e))) if x.size else 0.0
    r_err = float(np.nanmax(np.abs(r - e))) if x.size else 0.0
    if k_err > 2 * r_err + floor:
        raise AssertionError(f"{what}: max error {k_err:.3e} exceeds 2 x reference error "
                             f"{r_err:.3e} + floor {floor:.1e}")


def cosine_similarity(a, b) -> float:
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    return float(a @ b / (na * nb)) if na and nb else 0.0


# Fused dense ops (qkv_proj, swiglu_mlp). Inside these kernels the GEMM operands and the
# intermediates are rounded to bf16: the normalised activations, their product with the norm
# weight, the projection before QK-norm / RoPE (or the SwiGLU intermediate h), and the output.
# Up to four independent roundings of relative size u, so the RMS error of an output row is
# about sqrt(4/3) u (measured 1.0-1.5 u over random inputs and all QKV / MLP variants) and
# single elements reach ~3.2 u relative to |e| + rms(row). assert_matmul_close does not fit
# (it assumes exact GEMM inputs) and assert_close is per element only (no notion of the row
# scale an error is relative to). Bounds: 2x the measured worst case.
ROW_NORM_TOL = 3.0
ROW_ELEM_TOL = 6.0


def assert_rows_close(actual, expected, axis=-1, norm_tol=ROW_NORM_TOL, elem_tol=ROW_ELEM_TOL,
                      dtype=None, what="result"):
    """Row-wise rule for fused GEMM ops with rounded intermediates (u = output unit roundoff):

    * per row (the vectors along ``axis``): rms(a - e) <= norm_tol * u * rms(e);
    * per element: |a - e| <= elem_tol * u * (|e| + rms(row of e)).
    NaN and inf positions must match; rows of an exact zero reference must be zero.
    """
    u = UNIT_ROUNDOFF[dtype or dtype_name(actual)]
    a, e, fin = _nonfinite_match(actual, expected, what)
    a = np.where(fin, a, 0.0)
    e = np.where(fin, e, 0.0)
    rms = np.sqrt(np.mean(e * e, axis=axis, keepdims=True))
    err = np.abs(a - e)
    rerr = np.sqrt(np.mean(err * err, axis=axis, keepdims=True))
    bad = rerr > norm_tol * u * rms + 1e-30
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, rerr / np.maximum(rms, 1e-30), 0)), rerr.shape)
        raise AssertionError(f"{what}: {int(bad.sum())} rows with rms error above {norm_tol} u x "
                             f"rms(row); worst row {list(i)}: rms error {rerr[i]:.3e}, rms "
                             f"{rms[i]:.3e}")
    bound = elem_tol * u * (np.abs(e) + rms) + 1e-30
    _report(what, err, bound, a, e)
