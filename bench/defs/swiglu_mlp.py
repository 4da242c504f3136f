"""Bench definition of the SwiGLU MLP: x + (silu(xn @ W_gate) * (xn @ W_up)) @ W_down.

Shapes: ``reference.shapes`` tier ``.mlp`` (FAST: small; MODELS: Llama-3-8B and Llama-3-70B at
TP8, decode to prefill). Each shape runs with bf16 weights (roof: bf16 TensorE peak) and, in
the MODELS tier, with FP8 e4m3 weights and per-channel scales (double_row; roof: FP8 peak),
RMSNorm in front and the residual behind. FLOPs and bytes from ``reference.swiglu_mlp``.

Weight layouts (the ``dtype`` column): "bf16" row-major [H, I] / [I, H] as a checkpoint holds
them; "fp8" tile-major (``tile_weight``, done once at load time in ``make_inputs``, not timed),
the layout FP8 serving should use; "fp8 (row-major)" at the prefill shapes, for comparison.
FP8 is W8A8: the kernel also quantizes the activations (the normalised x and the SwiGLU product)
to FP8 per token.

Goal: at least 80% of the binding roof on both targets, for every shape and weight layout. The
DEFAULT tier runs only the FP8 (W8A8, tile-major) variant at its shape (one MLP model shape costs
about 30 s of emulation).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels.bench.defs import BenchCase, check_rows, register
from nki_kernels.dense.swiglu_mlp import swiglu_mlp, tile_weight
from nki_kernels.reference import shapes
from nki_kernels.reference.compare import assert_rows_close, cosine_similarity
from nki_kernels.reference.swiglu_mlp import (
    bytes_swiglu_mlp,
    flops_swiglu_mlp,
    quantize_fp8_per_channel,
    swiglu_mlp_ref,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
GOAL = {"trn2": 80.0, "trn3": 80.0}
FP8_COSINE = 0.999     # W8A8 against the per-token-quantized reference (tests: >= 0.9998 unnormed)


def mlp_case(s: shapes.MLPShape, dtype: str = "bf16") -> BenchCase:
    T, H, I = s.tokens, s.hidden, s.intermediate
    fp8 = dtype.startswith("fp8")
    tiled = dtype == "fp8"

    def make_inputs(rng):
        x = rng.standard_normal((T, H), dtype=np.float32).astype(BF16)             # [T, H]
        g = rng.uniform(0.5, 1.5, H).astype(np.float32)                             # [H]
        ws = [rng.standard_normal(sh, dtype=np.float32) * sh[0] ** -0.5
              for sh in ((H, I), (H, I), (I, H))]                                   # gate, up, down
        if not fp8:
            return (x, g, *[w.astype(BF16) for w in ws])
        q = [quantize_fp8_per_channel(w, ml_dtypes.float8_e4m3) for w in ws]
        return (x, g, *[tile_weight(a) if tiled else a for a, _ in q], *[sc for _, sc in q])

    def run(x, g, wg, wu, wd, *scales):
        kw = {}
        if scales:
            kw = dict(gate_scale=scales[0], up_scale=scales[1], down_scale=scales[2])
        return swiglu_mlp(x, wg, wu, wd, norm_weight=g, residual=x, **kw)

    def check(inputs, y):
        x, g, wg, wu, wd, *scales = inputs
        rows = check_rows(T)
        what = f"swiglu_mlp {s.name} {dtype}"
        if not scales:
            ref = swiglu_mlp_ref(x[rows], wg, wu, wd, norm_weight=g, residual=x[rows])
            assert_rows_close(y[rows], ref, what=what)
            return
        ws = [_untile(w, sh) for w, sh in zip((wg, wu, wd), ((H, I), (H, I), (I, H)))]
        ref = swiglu_mlp_ref(x[rows], *ws, norm_weight=g, residual=x[rows], gate_scale=scales[0],
                             up_scale=scales[1], down_scale=scales[2],
                             act_dtype=ml_dtypes.float8_e4m3)
        cos = cosine_similarity(y[rows], ref)
        assert cos >= FP8_COSINE, f"{what}: cosine similarity {cos:.6f} < {FP8_COSINE}"

    return BenchCase(
        op="swiglu_mlp", shape=s.name, dims={"T": T, "H": H, "I": I}, dtype=dtype,
        make_inputs=make_inputs, run=run, flops=flops_swiglu_mlp(T, H, I),
        bytes=bytes_swiglu_mlp(T, H, I, 1 if fp8 else 2, residual=True),
        roof_kind="fp8" if fp8 else "bf16", check=check, goal=GOAL)


def _untile(w, shape):
    """A weight back in the row-major [K, N] layout (tile_weight's inverse, for the check)."""
    if w.ndim == 2:
        return w
    K, N = shape                                 # w4[f, p, kt, c] = w[kt * 128 + p, f * 128 + c]
    return np.asarray(w)[:, :, :K // 128, :].transpose(2, 1, 0, 3).reshape(K, N)


@register("swiglu_mlp")
def cases(tier: str, target: str):
    if tier == "default":         # one case (an MLP model shape costs ~30 s of emulation): W8A8
        for s in shapes.tier(tier).mlp:
            yield mlp_case(s, "fp8")
        return
    for s in shapes.tier(tier).mlp:
        yield mlp_case(s, "bf16")
    if tier == "models":
        for s in shapes.tier(tier).mlp:
            yield mlp_case(s, "fp8")
        for s in shapes.tier(tier).mlp:
            if s.tokens == 2048:
                yield mlp_case(s, "fp8 (row-major)")
