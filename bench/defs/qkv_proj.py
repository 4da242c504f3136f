"""Bench definition of the fused QKV projection: rmsnorm(x) @ W_qkv, split into heads, RoPE.

Shapes: ``reference.shapes`` tier ``.qkv`` (FAST: small; MODELS: Llama-3-8B and Llama-3-70B at
TP8 from decode (T = 1, 8, 32) to prefill (T = 2048 and up)). Each case runs the op as a serving
stack calls it: RMSNorm in front, RoPE from positions (theta of Llama 3), q / k / v out. FLOPs
and bytes come from ``reference.qkv_proj`` (the GEMM; compulsory traffic: x, the weights once,
q / k / v once).

Goal: at least 80% of the binding roof (TensorE at prefill, HBM at decode) on both targets, for
every shape.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels.bench.defs import BenchCase, check_rows, register
from nki_kernels.dense.qkv_proj import qkv_proj
from nki_kernels.reference import shapes
from nki_kernels.reference.compare import assert_rows_close
from nki_kernels.reference.qkv_proj import bytes_qkv_proj, flops_qkv_proj, qkv_proj_ref

BF16 = np.dtype(ml_dtypes.bfloat16)
GOAL = {"trn2": 80.0, "trn3": 80.0}


def qkv_case(s: shapes.QKVShape) -> BenchCase:
    T, H, nq, nkv, d = s.tokens, s.hidden, s.n_q_heads, s.n_kv_heads, s.head_dim
    N = (nq + 2 * nkv) * d

    def make_inputs(rng):
        x = rng.standard_normal((T, H), dtype=np.float32).astype(BF16)              # [T, H]
        w = (rng.standard_normal((H, N), dtype=np.float32) * H ** -0.5).astype(BF16)  # [H, N]
        g = rng.uniform(0.5, 1.5, H).astype(np.float32)                              # [H]
        pos = np.arange(T, dtype=np.int64)                                           # [T]
        return x, w, g, pos

    def run(x, w, g, pos):
        return qkv_proj(x, w, n_q_heads=nq, n_kv_heads=nkv, head_dim=d, norm_weight=g,
                        positions=pos, rope_theta=500000.0)

    def check(inputs, out):
        x, w, g, pos = inputs
        rows = check_rows(T)
        q, k, v, _ = qkv_proj_ref(x[rows], w, n_q_heads=nq, n_kv_heads=nkv, head_dim=d,
                                  norm_weight=g, positions=pos[rows], rope_theta=500000.0)
        for name, a, e in (("q", out.q, q), ("k", out.k, k), ("v", out.v, v)):
            assert_rows_close(a[:, rows], e, what=f"qkv_proj {s.name} {name}")

    return BenchCase(
        op="qkv_proj", shape=s.name, dims={"T": T, "H": H, "Hq": nq, "Hkv": nkv, "d": d},
        dtype="bf16", make_inputs=make_inputs, run=run,
        flops=flops_qkv_proj(T, H, nq, nkv, d), bytes=bytes_qkv_proj(T, H, nq, nkv, d),
        roof_kind="bf16", check=check, goal=GOAL)


@register("qkv_proj")
def cases(tier: str, target: str):
    for s in shapes.tier(tier).qkv:
        yield qkv_case(s)
