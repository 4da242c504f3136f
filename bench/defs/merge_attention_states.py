"""Bench definition of merge_attention_states (the flash-decoding combine of two partial
attention results through their log-sum-exp).

Shapes: the decode shapes of ``reference.shapes`` (``.decode`` of the tier; ``DECODE_DEFAULT``
for the default tier, ``DECODE_MODELS`` for models): one row per (sequence, new token, query
head), ``d = head_dim``, bf16 outputs with fp32 lse. Memory-bound: compulsory bytes are both
inputs read once and the merged output written (``reference.merge_attention_states``). No goal
is set (the issue sets none for the merge on its own; inside decode_attention the merge of split
parts happens in SBUF).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels.attention.merge_attention_states import merge_attention_states
from nki_kernels.bench.defs import BenchCase, register
from nki_kernels.reference import shapes
from nki_kernels.reference.merge_attention_states import (
    bytes_merge_attention_states,
    flops_merge_attention_states,
    merge_attention_states_ref,
)

BF16 = np.dtype(ml_dtypes.bfloat16)


def merge_case(name, rows, d) -> BenchCase:
    def make_inputs(rng):
        oa = rng.standard_normal((rows, d), dtype=np.float32).astype(BF16)
        ob = rng.standard_normal((rows, d), dtype=np.float32).astype(BF16)
        la = (rng.standard_normal(rows, dtype=np.float32) * 4).astype(np.float32)
        lb = (rng.standard_normal(rows, dtype=np.float32) * 4).astype(np.float32)
        return oa, la, ob, lb

    def check(inputs, out):
        o, lse = out
        ro, rl = merge_attention_states_ref(*inputs)
        np.testing.assert_allclose(lse, rl, rtol=0, atol=1e-5)
        err = np.abs(o.astype(np.float32) - ro.astype(np.float32)).max()
        assert err <= 2 * 2.0 ** -8 * 8, f"merge_attention_states {name}: max error {err}"

    return BenchCase(op="merge_attention_states", shape=name, dims={"rows": rows, "d": d},
                     dtype="bf16", make_inputs=make_inputs, run=merge_attention_states,
                     flops=flops_merge_attention_states(rows, d),
                     bytes=bytes_merge_attention_states(rows, d, 2), roof_kind="bf16",
                     check=check)


@register("merge_attention_states")
def cases(tier: str, target: str):
    if tier == "models":
        rows = shapes.DECODE_MODELS
    elif tier == "default":
        rows = shapes.DECODE_DEFAULT[:1]
    else:
        rows = shapes.tier(tier).decode
    seen = set()
    for s in rows:
        n = s.batch * s.q_len * s.n_q_heads
        if (n, s.head_dim) in seen:
            continue
        seen.add((n, s.head_dim))
        yield merge_case(f"{s.name}: {n} rows", n, s.head_dim)
