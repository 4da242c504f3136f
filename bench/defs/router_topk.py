"""Bench definition of the MoE router top-k: scores, (group-limited) selection, weights.

Shapes: ``reference.shapes`` tier ``.moe`` (the router runs on ``logits [T, n_experts]``); in
the MODELS tier the fused-MoE targets ``shapes.MOE_TARGETS`` at their largest token count per
model (softmax for Qwen3 / Mixtral, DeepSeek-V3's sigmoid with bias and 8 groups keep 4).
Element-wise work only: the roof is the memory roof (logits in, weights and ids out).
"""
from __future__ import annotations

import numpy as np

from nki_kernels.bench.defs import BenchCase, register
from nki_kernels.moe.router_topk import router_topk
from nki_kernels.reference import shapes
from nki_kernels.reference.router_topk import bytes_router_topk, flops_router_topk, router_topk_ref


def router_case(s: shapes.MoEShape) -> BenchCase:
    T, E, k = s.tokens, s.n_experts, s.top_k
    kw = dict(scoring=s.scoring, routed_scaling=s.routed_scaling)
    if s.n_groups:
        kw.update(n_groups=s.n_groups, topk_groups=s.topk_groups)

    def make_inputs(rng):
        logits = rng.standard_normal((T, E), dtype=np.float32)                       # [T, E]
        bias = (rng.standard_normal(E, dtype=np.float32) * 0.1) if s.scoring == "sigmoid" \
            else None
        return logits, bias

    def run(logits, bias):
        return router_topk(logits, k, correction_bias=bias, **kw)

    def check(inputs, out):
        logits, bias = inputs
        _, ids = out
        _, want = router_topk_ref(logits, k, correction_bias=bias, **kw)
        assert np.array_equal(ids, want), f"router_topk {s.name}: ids differ"

    return BenchCase(
        op="router_topk", shape=s.name, dims={"T": T, "E": E, "k": k}, dtype="fp32",
        make_inputs=make_inputs, run=run, flops=flops_router_topk(T, E, k),
        bytes=bytes_router_topk(T, E, k), roof_kind="fp32", check=check)


@register("router_topk")
def cases(tier: str, target: str):
    if tier == "models":
        for s in shapes.MOE_TARGETS:
            if s.tokens == 4096:
                yield router_case(s)
        return
    for s in shapes.tier(tier).moe:
        yield router_case(s)
