"""Bench definition of the tiled matmul: C[M, N] = A[M, K] @ B[K, N].

Shapes: ``reference.shapes`` tier ``.matmul`` (FAST: up to 2048^3 plus DeepSeek-V3 expert GEMMs
at decode-like M; MODELS: 4096^3 and Llama-3-8B / DeepSeek-V3 / Llama-3-70B-TP8 / Qwen3 layers
at M in 1, 8, 32, 64). Every shape runs in bf16; square shapes also run in FP8 (double_row,
against the FP8 roof), and square shapes of the MODELS tier also at LNC=2. FLOPs and bytes come
from ``reference.matmul``.

Goal: at least 85% of the Trn2 bf16 TensorE peak for the square (compute-bound) bf16 shapes at
LNC=1 (the matmul issue's target at 2048^3); the other shapes report against their roof without
a goal.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels.bench.defs import BenchCase, check_rows, register
from nki_kernels.dense.matmul import matmul
from nki_kernels.reference import shapes
from nki_kernels.reference.compare import assert_matmul_close
from nki_kernels.reference.matmul import bytes_matmul, flops_matmul

# label -> (input NumPy dtype, TensorE roof kind, output itemsize: the op's default out_dtype)
DTYPES = {
    "bf16": (np.dtype(ml_dtypes.bfloat16), "bf16", 2),
    "fp8": (np.dtype(ml_dtypes.float8_e4m3), "fp8", 2),   # float8_e4m3 runs on Trn2 and Trn3
    "fp32": (np.dtype(np.float32), "fp32", 4),
}


def matmul_case(shape: shapes.MatmulShape, dtype: str = "bf16", lnc: int = 1) -> BenchCase:
    """The bench case of one matmul shape at one input dtype and LNC degree."""
    np_dtype, kind, out_isz = DTYPES[dtype]
    M, K, N = shape.M, shape.K, shape.N

    def make_inputs(rng):
        a = rng.standard_normal((M, K), dtype=np.float32).astype(np_dtype)  # [M, K]
        b = rng.standard_normal((K, N), dtype=np.float32).astype(np_dtype)  # [K, N]
        return a, b

    def run(a, b):
        return matmul(a, b, lnc=lnc)

    def check(inputs, c):
        a, b = inputs
        rows = check_rows(M)
        assert_matmul_close(c[rows], a[rows], b, what=f"matmul {shape.name} {dtype}")

    square = M == K == N
    return BenchCase(
        op="matmul", shape=shape.name, dims={"M": M, "K": K, "N": N}, dtype=dtype,
        make_inputs=make_inputs, run=run if lnc != 1 else matmul,
        flops=flops_matmul(M, K, N), bytes=bytes_matmul(M, K, N, np_dtype.itemsize, out_isz),
        roof_kind=kind, lnc=lnc, check=check,
        goal={"trn2": 85.0} if square and dtype == "bf16" and lnc == 1 else None)


@register("matmul")
def cases(tier: str, target: str):
    for s in shapes.tier(tier).matmul:
        yield matmul_case(s, "bf16")
    for s in shapes.tier(tier).matmul:
        if s.M == s.K == s.N:
            yield matmul_case(s, "fp8")
            if tier == "models":
                yield matmul_case(s, "bf16", lnc=2)
