"""Bench definition of the fused MoE layer: routed SwiGLU experts (+ shared expert).

Shapes: ``reference.shapes`` tier ``.moe``; in the MODELS tier the fused-MoE targets
``shapes.MOE_TARGETS`` (Qwen3-30B-A3B; DeepSeek-V3 as one EP rank of 8 = 32 local experts, one
shared expert, sigmoid routing with groups; Mixtral-8x7B at TP8; T = 1, 8, 64, 4096), each in
bf16 and with FP8 e4m3 weights and per-channel scales, both in the row-major checkpoint layout:
for experts the tile-major layout gives *shorter* DMA runs (a run is bounded by one feature
tile's K extent, I bytes for an FP8 down projection: 768 B for Qwen3-30B-A3B), while row-major
rows are 2I (gate|up) and H (down) bytes long (docs/moe.md). The other MODELS entries (whole
unsharded layers, tens of GB of weights) are not benched.

Routing is drawn once per case with a fixed seed (``router_topk_ref`` on normal logits over the
global experts), so FLOPs and bytes count what this routing needs: FLOPs of the local (token,
expert) pairs, bytes of the *distinct* chosen local experts' weights read once, plus x, y and the
routing. Decode rows (T <= 64) are HBM-bound (goal: 80% of the memory roof on Trn3); prefill
rows (T = 4096) are TensorE-bound when an expert gets more tokens than the ridge (goal: 75% of
the TensorE peak of the dtype on Trn3).

MXFP8 rows (Trn3 only, ``shapes.MOE_MX_TARGETS``: Qwen3-30B-A3B T = 1, 8, 64, 4096 and
DeepSeek-V3 EP8 T = 8, 4096) take the experts from ``quantize_expert_weights_mx`` (the MX tile
layout, 1 byte per weight + 1/32 scale byte) and are measured against the MX TensorE peak (4x
bf16) and the HBM roof.

The prefill targets (T = 4096) also run in bf16 at LNC=2 (``fused_moe(lnc=2)``, the roofs of
two cores), the case NKI Library's ``moe_cte`` covers (``--vs-nkilib``).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels.bench.defs import BenchCase, check_rows, register
from nki_kernels.moe.fused_moe import DECODE_T_MAX, fused_moe, quantize_expert_weights_mx
from nki_kernels.quant.mxfp8_matmul import MXTensor
from nki_kernels.reference import shapes
from nki_kernels.reference.compare import cosine_similarity
from nki_kernels.reference.fused_moe import (
    bytes_fused_moe,
    distinct_local_experts,
    flops_fused_moe,
    fused_moe_ref,
    local_assignments,
)
from nki_kernels.reference.router_topk import router_topk_ref
from nki_kernels.reference.swiglu_mlp import quantize_fp8_per_channel

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = ml_dtypes.float8_e4m3


def routing_of(s: shapes.MoEShape, seed: int = 0):
    """(weights [T, k] fp32, ids [T, k] int32 global) drawn by the model's router."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((s.tokens, s.n_experts), dtype=np.float32)
    kw = {}
    if s.n_groups:
        kw = dict(n_groups=s.n_groups, topk_groups=s.topk_groups)
    return router_topk_ref(logits, s.top_k, scoring=s.scoring, routed_scaling=s.routed_scaling,
                           **kw)


def _expert_weights(rng, E, K, N, fp8=False):
    """Expert weights ``[E, K, N]`` (std 1/sqrt(K)) in bf16, or FP8 e4m3 with per-channel scales
    ``[E, N]``: two random experts, column-rolled per expert, built expert by expert in the
    target dtype (no fp32 stack: DeepSeek-V3's 32 local experts are 5.6 GB in fp32). The values
    do not change the modeled time."""
    pool = rng.standard_normal((2, K, N), dtype=np.float32) * K ** -0.5
    if fp8:
        q = [quantize_fp8_per_channel(pool[i], E4M3) for i in range(2)]
        out = np.empty((E, K, N), dtype=q[0][0].dtype)
        sc = np.empty((E, N), np.float32)
        for e in range(E):
            out[e] = np.roll(q[e % 2][0], e, axis=-1)
            sc[e] = np.roll(q[e % 2][1], e)
        return out, sc
    out = np.empty((E, K, N), dtype=BF16)
    for e in range(E):
        out[e] = np.roll(pool[e % 2], e, axis=-1).astype(BF16)
    return out


def _mx_expert_weights(rng, E, H, I):
    """MXFP8 experts ``(gate_up, down)`` MXTensors with E experts: two random experts quantized
    once, alternated (the values do not change the modeled time)."""
    g = rng.standard_normal((2, H, 2 * I), dtype=np.float32) * H ** -0.5
    d = rng.standard_normal((2, I, H), dtype=np.float32) * I ** -0.5
    qg, qd = quantize_expert_weights_mx(g, d)
    del g, d
    out = []
    for q in (qg, qd):
        data = np.empty((E,) + q.data.shape[1:], np.uint32)
        scale = np.empty((E,) + q.scale.shape[1:], np.uint8)
        for e in range(E):
            data[e], scale[e] = q.data[e % 2], q.scale[e % 2]
        out.append(MXTensor(data, scale, q.fmt, q.k))
    return out


def moe_case(s: shapes.MoEShape, dtype: str = "bf16", lnc: int = 1) -> BenchCase:
    T, H, I, k = s.tokens, s.hidden, s.intermediate, s.top_k
    E = s.n_local or s.n_experts
    Is = s.shared_intermediate
    fp8 = dtype == "fp8"
    mx = dtype == "mx"
    w, ids = routing_of(s)
    n_assign = local_assignments(ids, E)
    n_distinct = distinct_local_experts(ids, E)

    def make_inputs(rng):
        x = rng.standard_normal((T, H), dtype=np.float32).astype(BF16)               # [T, H]
        if mx:
            ws = _mx_expert_weights(rng, E, H, I)
            if Is:
                sg, sd = _mx_expert_weights(rng, 1, H, Is)
                ws += [MXTensor(a.data[0], a.scale[0], a.fmt, a.k) for a in (sg, sd)]
            return (x, w, ids, *ws)
        dims = [(E, H, 2 * I), (E, I, H)] + ([(1, H, 2 * Is), (1, Is, H)] if Is else [])
        ws = [_expert_weights(rng, *d, fp8=fp8) for d in dims]
        if not fp8:
            return (x, w, ids, ws[0], ws[1], *[a[0] for a in ws[2:]])
        return (x, w, ids, ws[0][0], ws[1][0], *[a[0][0] for a in ws[2:]],
                ws[0][1], ws[1][1], *[a[1][0] for a in ws[2:]])

    def extra_kw(rest):
        """The inputs after the expert weights -> fused_moe's keyword arguments (the shared
        expert; FP8: the scales)."""
        n = (2 if Is else 0) if fp8 else len(rest)
        shared, scales = rest[:n], rest[n:]
        kw = dict(shared=tuple(shared)) if shared else {}
        if fp8:
            kw.update(gate_up_scale=scales[0], down_scale=scales[1])
            if Is:
                kw.update(shared_scales=(scales[2], scales[3]))
        return kw

    def run(x, w, ids, wgu, wd, *rest, lnc=lnc):
        return fused_moe(x, wgu, wd, w, ids, lnc=lnc, **extra_kw(rest))

    def check(inputs, y):
        if fp8:     # W8A8: the reference quantizes x and h per token as the kernel does
            x, w_, ids_, wgu, wd, *rest = inputs
            rows = check_rows(T)
            ref = fused_moe_ref(x[rows], wgu, wd, w_[rows], ids_[rows], act_dtype=wgu.dtype,
                                **extra_kw(rest))
            cs = cosine_similarity(np.asarray(y, np.float32)[rows], ref.astype(np.float32))
            assert cs > 0.999, f"fused_moe {s.name} (FP8): cosine similarity {cs:.6f}"
            return
        if mx:
            x, w_, ids_, wgu, wd, *shared = inputs
            rows = check_rows(T)
            ref = fused_moe_ref(x[rows], tuple(wgu), tuple(wd), w_[rows], ids_[rows],
                                shared=tuple(tuple(a) for a in shared) if shared else None)
            cs = cosine_similarity(np.asarray(y, np.float32)[rows], ref.astype(np.float32))
            assert cs > 0.9999, f"fused_moe {s.name} (MX): cosine similarity {cs:.6f}"
            return
        x, w_, ids_, wgu, wd, *shared = inputs
        rows = check_rows(T)
        ref = fused_moe_ref(x[rows], wgu, wd, w_[rows], ids_[rows],
                            shared=tuple(shared) if shared else None)
        cs = cosine_similarity(np.asarray(y, np.float32)[rows], ref.astype(np.float32))
        assert cs > 0.9999, f"fused_moe {s.name}: cosine similarity {cs:.6f}"

    decode = T <= DECODE_T_MAX
    return BenchCase(
        op="fused_moe", shape=s.name,
        dims={"T": T, "H": H, "I": I, "E": E, "k": k, "experts_read": n_distinct},
        dtype=dtype, make_inputs=make_inputs, run=run,
        flops=flops_fused_moe(n_assign, H, I, T, Is),
        bytes=bytes_fused_moe(T, H, I, n_distinct, k, 1 if fp8 else 2, Is, mx=mx),
        roof_kind="mx" if mx else "fp8" if fp8 else "bf16", check=check, lnc=lnc,
        goal={"trn3": 80.0 if decode else 75.0} if s in shapes.MOE_TARGETS else None)


@register("fused_moe")
def cases(tier: str, target: str):
    t = shapes.tier(tier)
    if tier == "models":
        for s in shapes.MOE_TARGETS:
            yield moe_case(s, "bf16")
        for s in shapes.MOE_TARGETS:
            yield moe_case(s, "fp8")
        for s in shapes.MOE_TARGETS:
            if s.tokens > DECODE_T_MAX:
                yield moe_case(s, "bf16", lnc=2)
        if target == "trn3":
            for s in shapes.MOE_MX_TARGETS:
                yield moe_case(s, "mx")
        return
    for s in t.moe:
        yield moe_case(s, "bf16")
