"""SwiGLU MLP against its NumPy reference: FAST / ODD / MODELS shapes, T in {1, 7, 129, 1000},
RMSNorm in front and residual behind, FP8 weights with per-channel scales (double_row, both
targets), adversarial inputs, the plan, and every refusal."""
import ml_dtypes
import numpy as np
import pytest

from nki_kernels.dense.swiglu_mlp import plan_mlp, swiglu_mlp, tile_weight
from nki_kernels.emulator import target
from nki_kernels.reference.compare import assert_rows_close, cosine_similarity
from nki_kernels.reference.shapes import DEFAULT, FAST, LLAMA3_8B, LLAMA3_70B_TP8, MODELS, ODD
from nki_kernels.reference.swiglu_mlp import quantize_fp8_per_channel, quantize_per_token, swiglu_mlp_ref

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3
E4M3FN = ml_dtypes.float8_e4m3fn


def _models(shapes_, default):
    """Every MODELS shape; those of the DEFAULT tier (one per kernel regime) run by default."""
    return [pytest.param(s, id=s.name, marks=() if s in default else pytest.mark.slow)
            for s in shapes_]


def _weights(rng, H, I):
    return [rng.standard_normal(s) / np.sqrt(s[0]) for s in ((H, I), (H, I), (I, H))]


def _inputs(rng, T, H, I, norm=True, residual=True):
    x = rng.standard_normal((T, H)).astype(BF16)
    ws = [w.astype(BF16) for w in _weights(rng, H, I)]
    kw = {}
    if norm:
        kw["norm_weight"] = rng.uniform(0.5, 1.5, H).astype(np.float32)
    if residual:
        kw["residual"] = rng.standard_normal((T, H)).astype(BF16)
    return x, ws, kw


def _run(rng, T, H, I, **opts):
    x, ws, kw = _inputs(rng, T, H, I, **opts)
    y = swiglu_mlp(x, *ws, **kw)
    assert y.shape == (T, H) and y.dtype == BF16
    assert_rows_close(y, swiglu_mlp_ref(x, *ws, **kw), what=f"y (T={T})")


# ---------------------------------------------------------------------------- shape tiers
@pytest.mark.parametrize("case", FAST.mlp + ODD.mlp, ids=lambda c: c.name)
def test_shapes(tgt, rng, case):
    """ODD holds hidden / intermediate sizes that are not multiples of 128 (bf16 supports them:
    partial k-tiles and feature tiles)."""
    _run(rng, case.tokens, case.hidden, case.intermediate)


@pytest.mark.parametrize("T", [1, 7, 129, 1000])
def test_tokens(tgt, rng, T):
    _run(rng, T, 256, 384)


@pytest.mark.parametrize("cfg", [LLAMA3_8B, LLAMA3_70B_TP8], ids=lambda c: c.name)
@pytest.mark.parametrize("T", [1, 129])
def test_model_widths(tgt, rng, cfg, T):
    """Real intermediate / hidden ratios at a reduced size (I/H as in the model, H = 256)."""
    _run(rng, T, 256, 256 * cfg.intermediate // cfg.hidden)


@pytest.mark.parametrize("case", _models(MODELS.mlp, DEFAULT.mlp))
def test_model_shapes(rng, case):
    with target("trn3"):
        _run(rng, case.tokens, case.hidden, case.intermediate)


@pytest.mark.parametrize("case", _models(MODELS.mlp, DEFAULT.mlp))
def test_model_shapes_fp8_w8a8(rng, case):
    """FP8 weights, tile-major, at model shapes on Trn2 (float8_e4m3): W8A8 against the
    per-token-quantized reference (norm in front, residual behind)."""
    T, H, I = case.tokens, case.hidden, case.intermediate
    x = rng.standard_normal((T, H)).astype(BF16)
    q = [quantize_fp8_per_channel(w, E4M3) for w in _weights(rng, H, I)]
    kw = dict(gate_scale=q[0][1], up_scale=q[1][1], down_scale=q[2][1],
              norm_weight=rng.uniform(0.5, 1.5, H).astype(np.float32), residual=x)
    with target("trn2"):
        y = swiglu_mlp(x, *[tile_weight(a) for a, _ in q], **kw)
    ref = swiglu_mlp_ref(x, *[a for a, _ in q], act_dtype=E4M3, **kw)
    assert cosine_similarity(y, ref) >= 0.999


@pytest.mark.parametrize("norm,residual", [(False, False), (True, False), (False, True)])
def test_optional_stages(tgt, rng, norm, residual):
    _run(rng, 70, 256, 512, norm=norm, residual=residual)


def test_residual_is_x(rng):
    """The usual fusion out = x + mlp(rmsnorm(x)): pass x as the residual."""
    x, ws, kw = _inputs(rng, 50, 256, 256, residual=False)
    y = swiglu_mlp(x, *ws, residual=x, **kw)
    assert_rows_close(y, swiglu_mlp_ref(x, *ws, residual=x, **kw))


# ---------------------------------------------------------------------------- FP8
def _fp8(rng, T, H, I, dtype=E4M3, norm=False):
    x = rng.standard_normal((T, H)).astype(BF16)
    q = [quantize_fp8_per_channel(w, dtype) for w in _weights(rng, H, I)]
    kw = dict(gate_scale=q[0][1], up_scale=q[1][1], down_scale=q[2][1])
    if norm:
        kw["norm_weight"] = rng.uniform(0.5, 1.5, H).astype(np.float32)
    return x, [a for a, _ in q], kw


@pytest.mark.parametrize("T", [1, 7, 129, 300])
def test_fp8_matches_per_token_quantization(tgt, rng, T):
    """Without a norm in front the kernel quantizes exactly the reference's activations, so it
    must match the per-token-quantized reference up to bf16 rounding: cos >= 0.9998 (measured
    0.99991; an error in a scale or a token mapping drops it below 0.99)."""
    x, ws, kw = _fp8(rng, T, 256, 384)
    y = swiglu_mlp(x, *ws, **kw)
    assert y.dtype == BF16 and y.shape == (T, 256)
    assert cosine_similarity(y, swiglu_mlp_ref(x, *ws, act_dtype=E4M3, **kw)) >= 0.9998
    assert cosine_similarity(y, swiglu_mlp_ref(x, *ws, **kw)) >= 0.998


def test_fp8_with_norm_and_residual(tgt, rng):
    """With a norm the quantized values are the bf16-rounded normalised activations; FP8
    rounding flips leave cos ~0.9995 to both references (0.999 required)."""
    x, ws, kw = _fp8(rng, 130, 256, 256, norm=True)
    kw["residual"] = x
    y = swiglu_mlp(x, *ws, **kw)
    yr = y.astype(np.float32) - x.astype(np.float32)
    for act in (E4M3, None):
        e = swiglu_mlp_ref(x, *ws, act_dtype=act, **kw).astype(np.float32) - x.astype(np.float32)
        assert cosine_similarity(yr, e) >= 0.999


def test_fp8_e4m3fn_trn3(rng):
    x, ws, kw = _fp8(rng, 20, 256, 384, E4M3FN)
    with target("trn3"):
        y = swiglu_mlp(x, *ws, **kw)
    assert cosine_similarity(y, swiglu_mlp_ref(x, *ws, act_dtype=E4M3FN, **kw)) >= 0.9998


def test_fp8_saturation_edge(rng):
    """Weights at the FP8 maximum and a token with one huge activation: the per-token scale
    keeps every quantized value finite (no overflow to inf) and the result tracks the
    reference."""
    x, ws, kw = _fp8(rng, 9, 256, 256)
    ws[0][0, :] = E4M3(240.0)
    ws[2][:, 3] = E4M3(-240.0)
    x[2, 5] = BF16(3e4)
    with target("trn2"):
        y = swiglu_mlp(x, *ws, **kw)
    assert np.isfinite(y.astype(np.float32)).all()
    assert cosine_similarity(y, swiglu_mlp_ref(x, *ws, act_dtype=E4M3, **kw)) >= 0.9998


def test_fp8_zero_token(rng):
    """An all-zero token has scale 0: its output is exactly 0 (no 0/0)."""
    x, ws, kw = _fp8(rng, 5, 256, 256)
    x[1] = 0
    y = swiglu_mlp(x, *ws, **kw)
    assert (y[1].astype(np.float32) == 0).all()
    assert np.isfinite(y.astype(np.float32)).all()


def test_quantize_per_token_reference():
    a = np.array([[0.0, 0.0], [1.0, -480.0]], np.float32)
    q = quantize_per_token(a, E4M3)
    assert (q[0] == 0).all() and q[1, 1] == -480.0


# ---------------------------------------------------------------------------- adversarial
def test_nonfinite_token_stays_in_its_row(rng):
    x, ws, kw = _inputs(rng, 140, 256, 256, residual=False)
    x[4, 9] = np.nan
    x[133, 1] = -np.inf
    y = swiglu_mlp(x, *ws, **kw)
    bad = ~np.isfinite(y.astype(np.float32))
    assert np.unique(np.nonzero(bad)[0]).tolist() == [4, 133]


def test_tiny_rows_depend_on_eps(rng):
    x, ws, kw = _inputs(rng, 6, 256, 256, residual=False)
    x = (x.astype(np.float32) * 1e-3).astype(BF16)
    y = swiglu_mlp(x, *ws, eps=1e-2, **kw)
    e = swiglu_mlp_ref(x, *ws, eps=1e-2, **kw)
    assert_rows_close(y, e)
    assert np.abs(e.astype(np.float32)).max() < 0.05


def test_large_activations(rng):
    x, ws, kw = _inputs(rng, 20, 256, 256, norm=False, residual=False)
    x = (x.astype(np.float32) * 20).astype(BF16)
    assert_rows_close(swiglu_mlp(x, *ws), swiglu_mlp_ref(x, *ws))


def test_noncontiguous_weights(rng):
    x, ws, kw = _inputs(rng, 12, 256, 256)
    wf = [np.asfortranarray(w) for w in ws]
    assert_rows_close(swiglu_mlp(x, *wf, **kw), swiglu_mlp_ref(x, *ws, **kw))


# ---------------------------------------------------------------------------- plan
@pytest.mark.parametrize("tname", ["trn2", "trn3"])
def test_plan_regimes(tname):
    from nki_kernels._limits import sbuf_budget
    with target(tname):
        budget = sbuf_budget()
    dec = plan_mlp(32, 4096, 14336, 2, False, budget)
    pre = plan_mlp(2048, 4096, 14336, 2, False, budget)
    assert dec.combined and dec.nf_gu == 32          # gate and up in one pass, 8 KiB rows
    # prefill: separate gate/up passes of 8 tiles; the weight rings (T >= RING_MIN_T) take the
    # room a second yT buffer had
    assert not pre.combined and pre.nf_gu == 8 and not pre.y_pipe
    assert pre.sbuf_bytes <= budget
    # Llama-3-8B prefill on Trn2: 512 tokens per block need 197504 bytes per partition even
    # with one yT buffer (hT of the block, the next block's rows and xT), over the budget
    assert pre.tb_max == (512 if tname == "trn3" else 448)
    small = plan_mlp(2048, 4096, 14336, 2, False, 120_000)
    assert small.tb_max < 512
    with pytest.raises(ValueError, match=r"swiglu_mlp: hidden=4096, intermediate=200000 need "):
        plan_mlp(2048, 4096, 200_000, 2, False, 190_000)


# ---------------------------------------------------------------------------- tile-major weights
def test_tile_weight_layout(rng):
    """out[f, p, kt, c] = w[kt*128 + p, f*128 + c], an odd k-tile count padded with zeros."""
    w = rng.standard_normal((384, 256)).astype(BF16)
    t = tile_weight(w)
    assert t.shape == (2, 128, 4, 128) and t.dtype == BF16
    for f, p, kt, c in [(0, 0, 0, 0), (1, 5, 2, 127), (0, 127, 1, 3)]:
        assert t[f, p, kt, c] == w[kt * 128 + p, f * 128 + c]
    assert not t[:, :, 3, :].astype(np.float32).any()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("T", [1, 7, 129, 600])
def test_tiled_weights_give_the_same_bits(tgt, rng, fp8, T):
    """Tile-major weights change only the DMA pattern: the same products accumulate in the
    same order, so the output is bit-identical to row-major weights (odd k-tile counts: H = 384,
    I = 640; T = 600 is two token blocks)."""
    H, I = 384, 640
    if fp8:
        x, ws, kw = _fp8(rng, T, H, I, norm=True)
    else:
        x, ws, kw = _inputs(rng, T, H, I, residual=False)
    kw["residual"] = x
    y = swiglu_mlp(x, *ws, **kw)
    yt = swiglu_mlp(x, *[tile_weight(w) for w in ws], **kw)
    assert np.array_equal(y.view(np.uint16), yt.view(np.uint16))
    if not fp8:
        assert_rows_close(yt, swiglu_mlp_ref(x, *ws, **kw), what="y (tiled)")


def test_tiled_weights_torch(rng):
    torch = pytest.importorskip("torch")
    x, ws, kw = _inputs(rng, 5, 256, 384, residual=False)
    tw = [tile_weight(torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16)) for w in ws]
    assert tuple(tw[0].shape) == (3, 128, 2, 128) and tw[0].dtype == torch.bfloat16
    y = swiglu_mlp(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16), *tw,
                   norm_weight=kw["norm_weight"])
    ref = swiglu_mlp(x, *[tile_weight(w) for w in ws], **kw)
    assert np.array_equal(y.float().numpy(), ref.astype(np.float32))


def test_rejects_tiled_misuse(rng):
    x, ws, kw = _inputs(rng, 4, 256, 384, norm=False, residual=False)
    t = [tile_weight(w) for w in ws]
    with pytest.raises(ValueError, match=r"w_gate is tile-major \(4-D, tile_weight\) so w_up must "
                                         r"be too; got shape \[256, 384\]"):
        swiglu_mlp(x, t[0], ws[1], t[2])
    with pytest.raises(ValueError, match=r"tile-major w_down must have shape \[2, 128, 4, 128\]"):
        swiglu_mlp(x, t[0], t[1], t[0])
    with pytest.raises(ValueError, match=r"tile-major w_gate must have shape \[3, 128, 2, 128\] "
                                         r"\(tile_weight of a \[H, I\] = \[256, 384\] weight\)"):
        swiglu_mlp(x, t[0][:, :, 0:1], t[1], t[2])
    with pytest.raises(ValueError, match=r"tile_weight: w must be 2-D \[K, N\] with K and N "
                                         r"positive multiples of 128; got shape \[200, 128\]"):
        tile_weight(np.zeros((200, 128), BF16))


# ---------------------------------------------------------------------------- refusals
def test_rejects_shapes_and_dtypes(rng):
    x, ws, kw = _inputs(rng, 4, 256, 128, norm=False, residual=False)
    g, u, d = ws
    with pytest.raises(ValueError, match=r"w_gate must be \[H, I\] with H = x.shape\[1\] = 256"):
        swiglu_mlp(x, g[:128], u, d)
    with pytest.raises(ValueError, match=r"w_up must have the shape of w_gate \[256, 128\]"):
        swiglu_mlp(x, g, u[:, :64], d)
    with pytest.raises(ValueError, match=r"w_down must be \[I, H\] = \[128, 256\]; got \[256, 128\]"):
        swiglu_mlp(x, g, u, g)
    with pytest.raises(TypeError, match=r"swiglu_mlp: x.dtype must be bfloat16; got float16"):
        swiglu_mlp(x.astype(np.float16), g, u, d)
    with pytest.raises(TypeError, match=r"w_up.dtype must equal w_gate.dtype \(bfloat16\); got "
                                        r"float32"):
        swiglu_mlp(x, g, u.astype(np.float32), d)
    with pytest.raises(TypeError, match=r"w_gate.dtype must be bfloat16 or float8_e4m3 or "
                                        r"float8_e4m3fn; got float32"):
        swiglu_mlp(x, g.astype(np.float32), u, d)
    with pytest.raises(ValueError, match=r"residual must have the shape of x \[4, 256\]"):
        swiglu_mlp(x, g, u, d, residual=x[:2])
    with pytest.raises(ValueError, match=r"norm_weight must be a vector of length 256"):
        swiglu_mlp(x, g, u, d, norm_weight=np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"swiglu_mlp: eps must be a finite float > 0; got -1.0"):
        swiglu_mlp(x, g, u, d, eps=-1.0)
    with pytest.raises(ValueError, match=r"swiglu_mlp: eps must be a finite float > 0; got 0"):
        swiglu_mlp(x, g, u, d, eps=0)
    with target("trn1"), pytest.raises(ValueError, match=r"swiglu_mlp: target trn1 is not "
                                                         r"supported; supported targets: trn2"):
        swiglu_mlp(x, g, u, d)
    with pytest.raises(ValueError, match=r"scale/up_scale/down_scale are only for FP8 weights"):
        swiglu_mlp(x, g, u, d, gate_scale=np.ones(128, np.float32))


@pytest.mark.parametrize("T", [8, 256, 600], ids=["decode", "one block", "two blocks"])
def test_plan_bounds_the_measured_sbuf_peak(tgt, rng, sbuf_peak, T):
    """Planned without the call's options (the default: every option on), the plan's SBUF figure
    bounds what the kernel holds at its peak (the emulator's liveness-based measurement); with
    them it is that peak exactly (tests/test_sbuf_plan.py)."""
    from nki_kernels._limits import sbuf_budget
    _run(rng, T, 512, 1024)
    plan = plan_mlp(T, 512, 1024, 2, False, sbuf_budget())
    assert 0 < sbuf_peak() <= plan.sbuf_bytes <= sbuf_budget()


def test_rejects_fp8_misuse(rng):
    x, ws, kw = _fp8(rng, 4, 256, 256)
    with pytest.raises(ValueError, match=r"FP8 weights need gate_scale \[I\], up_scale \[I\] and "
                                         r"down_scale \[H\]"):
        swiglu_mlp(x, *ws)
    bad = dict(kw, down_scale=np.ones(7, np.float32))
    with pytest.raises(ValueError, match=r"down_scale must be a vector of length 256"):
        swiglu_mlp(x, *ws, **bad)
    x2, ws2, kw2 = _fp8(rng, 4, 256, 256, E4M3FN)
    with target("trn2"), pytest.raises(ValueError, match=r"float8_e4m3fn weights need Trn3"):
        swiglu_mlp(x2, *ws2, **kw2)
    with target("trn1"), pytest.raises(ValueError, match=r"target trn1 is not supported"):
        swiglu_mlp(x, *ws, **kw)
    x3, ws3, kw3 = _fp8(rng, 4, 200, 256)
    with pytest.raises(ValueError, match=r"FP8 weights need hidden and intermediate sizes that "
                                         r"are multiples of 128; got H=200, I=256"):
        swiglu_mlp(x3, *ws3, **kw3)
