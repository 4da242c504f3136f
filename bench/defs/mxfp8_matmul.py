"""Bench definition of the MXFP8 matmul (Trn3 only): C[M, N] = A[M, K] @ B[K, N], bf16 out.

Shapes: ``reference.shapes`` tier ``.mx_matmul`` (FAST: 512^3 and a small rectangle; ODD: M = 1
and 113; MODELS: 4096^3 and DeepSeek-V3 expert_up (K = 7168, N = 2048) at M = 1, 16, 64, 256, 1024;
the issue's decode sweep is M = 1, 16, 64).

Operand forms (the ``dtype`` column):
  "mxfp8"          A and B pre-quantized (rmsnorm_quant(quant="mx") activations and
                   quantize_weights_mx weights): the serving path;
  "mxfp8 (A bf16)" A in bf16, quantized inside the kernel; B pre-quantized;
  "mxfp8 (bf16)"   both bf16, quantized inside the kernel (square shapes only).
Quantization of pre-quantized operands happens in ``make_inputs`` (offline, not timed). The roof is
the Trn3 MX TensorE peak (315 TF) or the memory roof; bytes count 1 byte + 1/32 scale byte per
quantized value, 2 per bf16 value, and the bf16 output. Trn2 has no MX matmul: no cases.

Goal: at least 80% of the roof (the MX peak at 4096^3, HBM at decode) for the pre-quantized form
at 4096^3 and M <= 64 (the issue's targets); the other rows report without a goal.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels.bench.defs import BenchCase, register
from nki_kernels.quant.mxfp8_matmul import mxfp8_matmul, quantize_weights_mx
from nki_kernels.reference import shapes
from nki_kernels.reference.compare import assert_matmul_close
from nki_kernels.reference.mxfp8_matmul import (
    bytes_mxfp8_matmul,
    flops_mxfp8_matmul,
    mxfp8_matmul_ref,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
FORMS = {"mxfp8": (True, True), "mxfp8 (A bf16)": (False, True), "mxfp8 (bf16)": (False, False)}


def mxfp8_matmul_case(shape: shapes.MatmulShape, form: str = "mxfp8", lnc: int = 1) -> BenchCase:
    M, K, N = shape.M, shape.K, shape.N
    a_q, b_q = FORMS[form]

    def make_inputs(rng):
        a = rng.standard_normal((M, K), dtype=np.float32).astype(BF16)           # [M, K]
        b = (rng.standard_normal((K, N), dtype=np.float32) / 16).astype(BF16)   # [K, N]
        a_in = quantize_weights_mx(np.ascontiguousarray(a.T)) if a_q else a     # A.T, MX
        b_in = quantize_weights_mx(b) if b_q else b
        return a_in, b_in

    def run(a, b):
        return mxfp8_matmul(a, b, lnc=lnc)

    def check(inputs, c):
        a, b = ((x.data, x.scale) if not isinstance(x, np.ndarray) else x for x in inputs)
        _, da, db = mxfp8_matmul_ref(a, b, K=K)
        assert_matmul_close(c, da, db, what=f"mxfp8_matmul {shape.name} {form}")

    goal = {"trn3": 80.0} if form == "mxfp8" and (M == K == N or M <= 64) else None
    return BenchCase(
        op="mxfp8_matmul", shape=shape.name, dims={"M": M, "K": K, "N": N}, dtype=form,
        make_inputs=make_inputs, run=run, flops=flops_mxfp8_matmul(M, K, N),
        bytes=bytes_mxfp8_matmul(M, K, N, a_q, b_q, 2), roof_kind="mx", lnc=lnc,
        check=check, goal=goal)


@register("mxfp8_matmul")
def cases(tier: str, target: str):
    if target != "trn3":
        return                      # nc_matmul_mx is Trn3-only; the op refuses on Trn2
    found = list(shapes.tier(tier).mx_matmul)
    if tier == "models":
        found.sort(key=lambda s: (s.K, s.N, s.M))
    for s in found:
        yield mxfp8_matmul_case(s, "mxfp8")
        yield mxfp8_matmul_case(s, "mxfp8 (A bf16)")
        if s.M == s.K == s.N:
            yield mxfp8_matmul_case(s, "mxfp8 (bf16)")
