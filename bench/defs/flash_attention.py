"""Bench definition of flash attention (prefill): ``O = softmax(scale * Q K^T + mask) V``.

Shapes: ``reference.shapes`` tier ``.attention`` (FAST / ODD: small and edge cases, run whole;
MODELS: Llama-3-8B causal at 2K / 8K, Llama-3-70B-TP8, Gemma-3 (sliding window 1024; d = 256 on
the 12B), plus the issue's Llama-3-8B S = 32768 and head_dim 64 / 256 variants at S = 8192 built
from the shared model configs).

Model shapes run one KV-head group (its G query heads and their KV head; one query head for
S >= 16K): the groups of a layer are independent and run one after the other on a NeuronCore,
so the modeled time of the full layer is the group's time x the number of groups and every
ratio (TFLOP/s, % of peak) is that of the full shape. The shape name says which slice ran.
FLOPs count attended (query, key) pairs only (causal: the lower triangle; window: the band),
4 * d per pair, from ``reference.flash_attention``.

Ceilings (docs/attention.md, exponential): one exponential per attended pair, on ScalarE on
Trn2 (128 lanes x 1.2 GHz = 153.6 G/s: exactly the TensorE peak at d = 128, half of it at
d = 64) and on VectorE on Trn3 (``exponential``, 4x ScalarE).

Goal: at least 70% of the Trn3 bf16 TensorE peak for the Llama-3-8B shapes at S = 8192 (d = 128
and the d = 64 variant), the attention issue's target; the other rows report without a goal.
The check compares the last query rows (up to 512; with the causal diagonal aligned to the end,
they see every key) with the float64 reference, by the attention accuracy rule.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels.attention.flash_attention import flash_attention
from nki_kernels.bench.defs import BenchCase, EngineCeiling, register
from nki_kernels.reference import shapes
from nki_kernels.reference.compare import assert_attention_close
from nki_kernels.reference.flash_attention import (
    attended_pairs,
    bytes_flash_attention,
    flash_attention_ref,
    flops_flash_attention,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
# exponentials per second per NeuronCore: ScalarE 128 lanes x 1.2 GHz; VectorE's exponential 4x
# (NKI Trainium2 / Trainium3 architecture guides, AWS Neuron documentation)
EXP_PER_S = {"trn2": 128 * 1.2e9, "trn3": 4 * 128 * 1.2e9}
LONG = 16384            # from this length the model slice is a single query head


def attention_case(s: shapes.AttentionShape, model_slice: bool = False) -> BenchCase:
    """The bench case of one attention shape (``model_slice``: one KV-head group, see above)."""
    B, Hq, Hkv = s.batch, s.n_q_heads, s.n_kv_heads
    name = s.name
    if model_slice and Hkv > 1:
        g = Hq // Hkv
        B, Hq, Hkv = 1, (1 if s.seq_kv >= LONG else g), 1
        name = f"{s.name} ({Hq} of {s.n_q_heads} q-heads)"
    Sq, Skv, d = s.seq_q, s.seq_kv, s.head_dim
    window = s.sliding_window or None

    def make_inputs(rng):
        q = rng.standard_normal((B, Hq, Sq, d), dtype=np.float32).astype(BF16)     # [B, Hq, Sq, d]
        k = rng.standard_normal((B, Hkv, Skv, d), dtype=np.float32).astype(BF16)   # [B, Hkv, Skv, d]
        v = rng.standard_normal((B, Hkv, Skv, d), dtype=np.float32).astype(BF16)   # [B, Hkv, Skv, d]
        return q, k, v

    def run(q, k, v):
        return flash_attention(q, k, v, causal=s.causal, window=window)

    def check(inputs, o):
        q, k, v = inputs
        n = min(Sq, 512)
        kw = dict(causal=s.causal, window=window)
        exact = flash_attention_ref(q[:, :, -n:], k, v, compute_dtype=np.float64, **kw)
        same = flash_attention_ref(q[:, :, -n:], k, v, p_dtype="bfloat16", **kw)
        assert_attention_close(o[:, :, -n:], same, exact, what=f"flash_attention {name}")

    goal = None
    if s.name.startswith("llama-3-8b") and Sq == 8192 and s.causal and not window:
        goal = {"trn3": 70.0}
    exps = attended_pairs(Sq, Skv, s.causal, window) * B * Hq
    ceil = EngineCeiling("exp (ScalarE trn2 / VectorE trn3)", exps, EXP_PER_S)
    dims = {"B": B, "Hq": Hq, "Hkv": Hkv, "Sq": Sq, "Skv": Skv, "d": d}
    if window:
        dims["window"] = window
    return BenchCase(
        op="flash_attention", shape=name, dims=dims, dtype="bf16", make_inputs=make_inputs,
        run=run, flops=flops_flash_attention(B, Hq, Sq, Skv, d, s.causal, window),
        bytes=bytes_flash_attention(B, Hq, Hkv, Sq, Skv, d, 2), roof_kind="bf16",
        ceilings=(ceil,), check=check, goal=goal)


@register("flash_attention")
def cases(tier: str, target: str):
    for s in shapes.tier(tier).attention:
        yield attention_case(s, model_slice=tier in ("models", "default"))
