"""Bench definition of RMSNorm + quantize: FP8 per-token (both targets) and MXFP8 (Trn3).

Shapes: ``reference.shapes`` tier ``.rmsnorm`` (tokens x hidden); shapes the op refuses (H not a
multiple of 128, or of 512 for MX, T = 0 -- the ODD tier's edge cases) are left out: their
refusals are tested, not benched. The MODELS tier carries the issue's prefill targets
[2048 x 8192] and [32768 x 8192] (Llama-3-70B hidden), and the fused residual add (x + residual,
written back) at T = 2048 ("+res" in the dtype column). FLOPs and compulsory bytes (read x,
write 1-byte data and the scales) come from ``reference.rmsnorm_quant``; the op is memory-bound
on paper and engine-bound in practice, so the report's "bound in model" column names the engine
that binds.

Goal: at least 60% of the HBM roof on both targets, for every shape and variant (the issue's
target at [2048, 8192] and [32768, 8192]).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels.bench.defs import BenchCase, check_rows, register
from nki_kernels.quant.rmsnorm_quant import rmsnorm_quant
from nki_kernels.reference import shapes
from nki_kernels.reference.compare import cosine_similarity
from nki_kernels.reference.mxfp8_matmul import dequantize_mx_kmajor
from nki_kernels.reference.rmsnorm_quant import (
    bytes_rmsnorm_quant,
    dequantize_fp8_rows,
    flops_rmsnorm_quant,
    residual_add,
    rmsnorm_ref,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
GOAL = {"trn2": 60.0, "trn3": 60.0}
COSINE = 0.999      # dequantized output against the fp32 RMSNorm (FP8 / MXFP8 rounding: ~0.9995)


def rmsnorm_quant_case(shape: shapes.RMSNormShape, quant: str = "fp8",
                       residual: bool = False) -> BenchCase:
    T, H = shape.tokens, shape.hidden

    def make_inputs(rng):
        x = rng.standard_normal((T, H), dtype=np.float32).astype(BF16)          # [T, H]
        g = (1 + 0.1 * rng.standard_normal(H, dtype=np.float32)).astype(BF16)   # [H]
        if residual:
            return x, g, rng.standard_normal((T, H), dtype=np.float32).astype(BF16)
        return x, g

    def run(x, g, res=None):
        return rmsnorm_quant(x, g, quant=quant, residual=res)

    def check(inputs, out):
        x, g, *res = inputs
        rows = check_rows(T)
        what = f"rmsnorm_quant {shape.name} {quant}"
        if res:
            h = residual_add(x[rows], res[0][rows])
            np.testing.assert_array_equal(np.asarray(out[-1])[rows].view(np.uint16),
                                          np.asarray(h).astype(BF16).view(np.uint16),
                                          err_msg=f"{what}: residual sum")
        y = rmsnorm_ref(x[rows], g, residual=res[0][rows] if res else None)
        if quant == "fp8":
            got = dequantize_fp8_rows(out[0][rows], out[1][rows])
        else:
            mx = out[0] if res else out
            got = dequantize_mx_kmajor(mx.data, mx.scale, mx.fmt, K=H).T[rows]
        cos = cosine_similarity(got, y)
        assert cos >= COSINE, f"{what}: cosine similarity {cos:.6f} < {COSINE}"

    dtype = "bf16->fp8" if quant == "fp8" else "bf16->mxfp8"
    return BenchCase(
        op="rmsnorm_quant", shape=shape.name, dims={"T": T, "H": H},
        dtype=dtype + (" +res" if residual else ""), make_inputs=make_inputs,
        run=run, flops=flops_rmsnorm_quant(T, H),
        bytes=bytes_rmsnorm_quant(T, H, quant, residual=residual), roof_kind="bf16",
        check=check, goal=GOAL)


@register("rmsnorm_quant")
def cases(tier: str, target: str):
    for s in shapes.tier(tier).rmsnorm:
        if s.tokens < 1 or s.hidden % 128:
            continue
        yield rmsnorm_quant_case(s, "fp8")
        if target == "trn3" and s.hidden % 512 == 0:
            yield rmsnorm_quant_case(s, "mx")
        if tier == "models" and s.tokens == 2048 and s.hidden == 8192:
            yield rmsnorm_quant_case(s, "fp8", residual=True)
            if target == "trn3":
                yield rmsnorm_quant_case(s, "mx", residual=True)
