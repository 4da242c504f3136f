"""Flash attention (prefill) against its NumPy reference: every option, odd lengths, adversarial
logits, GQA/MQA, head_dim 64/128/192/256, KV chunking, LNC=2, both targets, and every refusal.

Accuracy rule (reference/compare.py): kernel error <= 2 x the error of a same-precision reference
(probabilities rounded to bf16 before P @ V, denominator summed from the same rounded values)
+ 1e-3, both measured against a float64 reference. The lse output follows the same rule.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from nki_kernels.attention import flash_attention as fa
from nki_kernels.attention.masks import MaskSpec, TileKind, classify
from nki_kernels.attention.schedule import (
    assign_programs,
    gqa_heads,
    kv_chunks,
    plan_qtile,
    prefill_units,
)
from nki_kernels.backend import launch, nl
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import jit, target
from nki_kernels.emulator import language as enl
from nki_kernels.reference.compare import assert_attention_close
from nki_kernels.reference.flash_attention import (
    attended_pairs,
    bytes_flash_attention,
    flash_attention_ref,
    flops_flash_attention,
    visible_mask,
)
from nki_kernels.reference.shapes import DEFAULT, FAST, MODELS, ODD

BF16 = ml_dtypes.bfloat16
flash_attention = fa.flash_attention


def _models(shapes_, default):
    """Every MODELS shape; those of the DEFAULT tier (one per kernel regime) run by default."""
    return [pytest.param(s, id=s.name, marks=() if s in default else pytest.mark.slow)
            for s in shapes_]


def _qkv(rng, B, Hq, Hkv, Sq, Skv, d, scale=1.0):
    q = (rng.standard_normal((B, Hq, Sq, d)) * scale).astype(BF16)
    k = (rng.standard_normal((B, Hkv, Skv, d)) * scale).astype(BF16)
    v = rng.standard_normal((B, Hkv, Skv, d)).astype(BF16)
    return q, k, v


def _check(out, q, k, v, **kw):
    """Apply the attention rule to ``out`` (and to lse when return_lse)."""
    exact = flash_attention_ref(q, k, v, compute_dtype=np.float64, **kw)
    same = flash_attention_ref(q, k, v, p_dtype="bfloat16", **kw)
    if kw.get("return_lse"):
        (o, lse), (eo, else_), (so, slse) = out, exact, same
        assert lse.dtype == np.float32 and lse.shape == q.shape[:3]
        assert_attention_close(lse, slse, else_, what="lse")
    else:
        o, eo, so = out, exact, same
    assert o.shape == q.shape and o.dtype == q.dtype
    assert_attention_close(o, so, eo)


# ------------------------------------------------------------------------------ shapes tiers


@pytest.mark.parametrize("s", FAST.attention + ODD.attention, ids=lambda s: s.name)
def test_shapes(tgt, rng, s):
    q, k, v = _qkv(rng, s.batch, s.n_q_heads, s.n_kv_heads, s.seq_q, s.seq_kv, s.head_dim)
    kw = dict(causal=s.causal, window=s.sliding_window or None)
    _check(flash_attention(q, k, v, **kw), q, k, v, **kw)


@pytest.mark.parametrize("s", _models(MODELS.attention, DEFAULT.attention))
def test_model_shapes(rng, s):
    """One KV-head group of the model (its G query heads; one query head from S = 16K), as the
    bench runs it, on Trn3; the last (up to 512) query rows checked: with the causal diagonal at
    the end they attend to every key, and the reference stays small at S = 32K."""
    Hq = 1 if s.seq_kv >= 16384 else s.n_q_heads // s.n_kv_heads
    q, k, v = _qkv(rng, 1, Hq, 1, s.seq_q, s.seq_kv, s.head_dim)
    kw = dict(causal=s.causal, window=s.sliding_window or None)
    with target("trn3"):
        o = flash_attention(q, k, v, **kw)
    n = min(s.seq_q, 512)
    _check(o[:, :, -n:], q[:, :, -n:], k, v, **kw)


def test_reference_agrees_with_rule(rng):
    q, k, v = _qkv(rng, 1, 2, 1, 200, 300, 64)
    same = flash_attention_ref(q, k, v, p_dtype="bfloat16")
    assert_attention_close(same, same, flash_attention_ref(q, k, v, compute_dtype=np.float64))
    with pytest.raises(AssertionError, match="exceeds 2 x reference error"):
        bad = (same.astype(np.float32) + 0.05).astype(BF16)
        assert_attention_close(bad, same, flash_attention_ref(q, k, v, compute_dtype=np.float64))


# ------------------------------------------------------------------------------ options


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_head_dims_gqa_lse(tgt, rng, d):
    q, k, v = _qkv(rng, 1, 4, 2, 200, 300, d)
    _check(flash_attention(q, k, v, return_lse=True), q, k, v, return_lse=True)


def test_mqa_non_causal_multi_block(tgt, rng):
    # S_kv = 2500: two 2048-key blocks (one ragged), 1024-key halves, ragged last key tile
    q, k, v = _qkv(rng, 2, 3, 1, 130, 2500, 64)
    _check(flash_attention(q, k, v, causal=False), q, k, v, causal=False)


def test_causal_long_prefix(tgt, rng):
    # queries continue a prefix (S_q < S_kv): diagonal aligned to the end, several blocks
    q, k, v = _qkv(rng, 1, 2, 2, 300, 2300, 64)
    _check(flash_attention(q, k, v), q, k, v)


@pytest.mark.parametrize("window,causal", [(1, True), (5, True), (300, True), (1100, True),
                                           (64, False)])
def test_sliding_window(tgt, rng, window, causal):
    q, k, v = _qkv(rng, 1, 2, 1, 1300, 1400, 64)
    kw = dict(window=window, causal=causal)
    _check(flash_attention(q, k, v, **kw), q, k, v, **kw)


def test_softcap(tgt, rng):
    q, k, v = _qkv(rng, 1, 4, 2, 150, 150, 128, scale=2.0)     # logits well past the cap
    kw = dict(softcap=5.0, window=40, return_lse=True)
    _check(flash_attention(q, k, v, **kw), q, k, v, **kw)


def test_sinks(tgt, rng):
    q, k, v = _qkv(rng, 1, 4, 2, 140, 140, 64)
    sinks = np.array([-20.0, 0.0, 3.0, 30.0], dtype=np.float32)   # negligible .. dominant
    kw = dict(sinks=sinks, window=16, return_lse=True)
    _check(flash_attention(q, k, v, **kw), q, k, v, **kw)


def test_custom_scale(tgt, rng):
    q, k, v = _qkv(rng, 1, 2, 2, 100, 100, 64)
    _check(flash_attention(q, k, v, scale=0.3), q, k, v, scale=0.3)


def test_pre_transposed_k(tgt, rng):
    q, k, v = _qkv(rng, 1, 2, 1, 200, 300, 192)
    kT = np.ascontiguousarray(np.swapaxes(k, -1, -2))
    _check(flash_attention(q, kT, v, k_layout="bhds", window=50), q, k, v, window=50)


def test_lnc2_is_bit_identical(tgt, rng):
    q, k, v = _qkv(rng, 1, 4, 2, 700, 700, 64)
    o1 = flash_attention(q, k, v)
    o2 = flash_attention(q, k, v, lnc=2)
    np.testing.assert_array_equal(o1.view(np.uint16), o2.view(np.uint16))
    _check(o2, q, k, v)


def test_kv_chunks_state_through_hbm(tgt, rng):
    """A KV sequence split into resident chunks (forced small here) keeps the softmax state in
    HBM between chunks; sinks and lse must survive the round trip."""
    q, k, v = _qkv(rng, 1, 2, 1, 900, 2600, 64)
    sinks = np.array([0.5, -1.0], dtype=np.float32)
    gen = int(nisa.get_nc_version())
    plan = fa.plan_flash_attention(gen, 64, 2600, causal=True, window=None, softcap=None,
                                   scale=0.125, has_sinks=True, return_lse=True,
                                   k_layout="bhsd", out_dtype=nl.bfloat16, sbuf_budget=10 ** 6,
                                   chunk=2048)
    assert plan.chunk == 2048
    out = tuple(launch(fa.flash_attention_kernel, q, k, v, sinks, plan))
    _check(out, q, k, v, sinks=sinks, return_lse=True)


def test_lse_merges_split_kv(tgt, rng):
    """Two halves of the keys attended separately merge (with their lse) into the full result."""
    q, k, v = _qkv(rng, 1, 2, 2, 64, 600, 64)
    o1, l1 = flash_attention(q, k[:, :, :300], v[:, :, :300], causal=False, return_lse=True)
    o2, l2 = flash_attention(q, k[:, :, 300:], v[:, :, 300:], causal=False, return_lse=True)
    m = np.maximum(l1, l2)
    w1, w2 = np.exp(l1 - m)[..., None], np.exp(l2 - m)[..., None]
    merged = (w1 * o1.astype(np.float32) + w2 * o2.astype(np.float32)) / (w1 + w2)
    full = flash_attention_ref(q, k, v, causal=False, compute_dtype=np.float64)
    assert np.abs(merged - full).max() < 1e-2
    lse_full = flash_attention_ref(q, k, v, causal=False, compute_dtype=np.float64,
                                   return_lse=True)[1]
    np.testing.assert_allclose(m + np.log((w1 + w2)[..., 0]), lse_full, atol=2e-3)


# ------------------------------------------------------------------------------ adversarial


def test_logits_of_magnitude_1e4(tgt, rng):
    q, k, v = _qkv(rng, 1, 2, 1, 300, 300, 64, scale=50.0)     # |logit| ~ 1e4
    s = np.einsum("bhqd,bkd->bhqk", q[:, :, :, :].astype(np.float32),
                  k[:, 0].astype(np.float32)) / 8.0
    assert np.abs(s).max() > 5e3
    _check(flash_attention(q, k, v), q, k, v)
    _check(flash_attention(q, k, v, causal=False, window=7), q, k, v, causal=False, window=7)


def test_huge_logits_only_in_masked_positions(tgt, rng):
    """The row max must be taken after masking: future keys aligned with the queries would
    otherwise push every visible probability to zero."""
    q, k, v = _qkv(rng, 1, 1, 1, 256, 256, 128)
    k[0, 0, 128:] = (q[0, 0, 0].astype(np.float32) * 100).astype(BF16)
    _check(flash_attention(q, k, v), q, k, v)
    _check(flash_attention(q, k, v, window=3), q, k, v, window=3)


def test_one_visible_key_per_row(tgt, rng):
    q, k, v = _qkv(rng, 1, 2, 2, 257, 257, 64)
    o = flash_attention(q, k, v, window=1)
    np.testing.assert_array_equal(o.view(np.uint16), v.view(np.uint16))   # P = 1 on the diagonal


# ------------------------------------------------------------------------------ schedule, masks


def test_classify_and_segments():
    spec = MaskSpec(s_q=512, s_kv=512, causal=True, window=200)
    assert classify(spec, 256, 384, 0, 57) is TileKind.SKIP           # before every window
    assert classify(spec, 256, 384, 0, 58) is TileKind.PARTIAL
    assert classify(spec, 256, 384, 512, 640) is TileKind.SKIP
    assert classify(spec, 256, 384, 184, 256) is TileKind.FULL
    assert classify(spec, 256, 384, 256, 384) is TileKind.PARTIAL
    qt = plan_qtile(spec, 256, 128, kb=2048)
    (blk,) = qt.blocks
    assert blk.k0 == 0 and blk.width == 384                           # aligned down to 128
    segs = [(s.c0, s.c1, s.masked) for s in blk.segments]
    assert segs == [(0, 184, True), (184, 257, False), (257, 384, True)]
    vis = visible_mask(512, 512, True, 200)[256:384]
    for s in blk.full:                                                # full = all rows see it
        assert vis[:, s.c0:s.c1].all()
    assert not vis[:, :blk.k0].any() and not vis[:, blk.k0 + blk.width:].any()


@pytest.mark.parametrize("causal,window", [(True, 0), (True, 33), (False, 0), (False, 40)])
def test_schedule_covers_exactly_the_visible_pairs(causal, window):
    spec = MaskSpec(s_q=700, s_kv=900, causal=causal, window=window)
    vis = visible_mask(700, 900, causal, window)
    for c0, c1 in kv_chunks(900, 256):
        for q0 in range(0, 700, 128):
            rows = min(128, 700 - q0)
            qt = plan_qtile(spec, q0, rows, kb=256, k_lo=c0, k_hi=c1)
            seen = np.zeros((rows, 900), dtype=bool)
            if qt is not None:
                for blk in qt.blocks:
                    assert blk.k0 % 128 == 0 and c0 <= blk.k0 < blk.k0 + blk.width <= c1
                    for s in blk.segments:
                        a, z = blk.k0 + s.c0, blk.k0 + s.c1
                        if not s.masked:
                            assert vis[q0:q0 + rows, a:z].all()
                        seen[:, a:z] = True
            assert not (vis[q0:q0 + rows, c0:c1] & ~seen[:, c0:c1]).any()


def test_units_gqa_and_program_split():
    spec = MaskSpec(s_q=1000, s_kv=1000)
    units = prefill_units(spec, batch=2, n_kv_heads=3, kb=2048, chunk=2048)
    assert len(units) == 2 * 3 * 8
    parts = assign_programs(units, 2)
    loads = [sum(u.work for u in p) for p in parts]
    assert sum(len(p) for p in parts) == len(units)
    assert max(loads) - min(loads) <= max(u.work for u in units)
    assert gqa_heads(32, 8, 3) == [12, 13, 14, 15]
    assert attended_pairs(1000, 1000) == 1000 * 1001 // 2
    assert flops_flash_attention(1, 2, 1000, 1000, 64) == 4 * 64 * 2 * 500500
    assert bytes_flash_attention(1, 4, 1, 100, 100, 64) == (2 * 4 * 100 * 64 + 2 * 100 * 64) * 2


@pytest.mark.parametrize("causal,window", [(True, 0), (True, 5), (False, 7)])
def test_mask_helpers_match_reference(causal, window):
    """row_bounds + range_select and affine_select give the reference's visible pattern."""
    from nki_kernels.attention.masks import FP32_MIN, mask_affine_select, mask_range_select, row_bounds
    spec = MaskSpec(s_q=200, s_kv=300, causal=causal, window=window)
    q0, k0, rows, w = 128, 200, 72, 100

    @jit
    def kern(x):
        t = enl.ndarray((rows, w), enl.float32, buffer=enl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        lo = enl.ndarray((rows, 1), enl.float32, buffer=enl.sbuf)
        hi = enl.ndarray((rows, 1), enl.float32, buffer=enl.sbuf)
        row_bounds(lo, hi, spec, q0, rows)
        a = enl.ndarray((rows, w), enl.float32, buffer=enl.sbuf)
        mx = enl.ndarray((rows, 1), enl.float32, buffer=enl.sbuf)
        mask_range_select(a, t, lo, hi, k0, reduce_res=mx)
        b = enl.ndarray((rows, w), enl.float32, buffer=enl.sbuf)
        mask_affine_select(b, t, spec, q0, k0, rows, w)
        outs = []
        for src in (a, b, mx):
            o = enl.ndarray(src.shape, enl.float32, buffer=enl.shared_hbm)
            nisa.dma_copy(dst=o, src=src)
            outs.append(o)
        return tuple(outs)

    x = np.random.default_rng(0).standard_normal((rows, w)).astype(np.float32)
    with target("trn2"):
        a, b, mx = kern(x)
    vis = visible_mask(200, 300, causal, window)[q0:q0 + rows, k0:k0 + w]
    want = np.where(vis, x, np.float32(FP32_MIN))
    np.testing.assert_array_equal(a, want)
    np.testing.assert_array_equal(b, want)
    np.testing.assert_array_equal(mx[:, 0], want.max(axis=1))


def test_plan_fits_sbuf_and_chunks_long_sequences():
    for gen, budget in ((3, 208 * 1024), (4, 240 * 1024)):
        for d in (64, 128, 192, 256):
            for s_kv in (1, 4096, 32768):
                p = fa.plan_flash_attention(gen, d, s_kv, causal=True, window=None, softcap=None,
                                            scale=0.1, has_sinks=False, return_lse=False,
                                            k_layout="bhsd", out_dtype=nl.bfloat16,
                                            sbuf_budget=int(budget * 0.9))
                assert fa.sbuf_bytes(p, d) <= budget * 0.9
                assert p.chunk >= min(s_kv, p.kb) and p.chunk % 128 == 0
    big = fa.plan_flash_attention(4, 256, 32768, causal=True, window=None, softcap=None,
                                  scale=0.1, has_sinks=False, return_lse=False, k_layout="bhsd",
                                  out_dtype=nl.bfloat16, sbuf_budget=int(240 * 1024 * 0.9))
    assert big.chunk < 32768                                          # K/V do not fit: chunked


# ------------------------------------------------------------------------------ refusals


def _small(rng, Sq=16, Skv=16, d=64):
    return _qkv(rng, 1, 2, 1, Sq, Skv, d)


@pytest.mark.parametrize("kw,match", [
    (dict(k_layout="bsd"), "k_layout must be 'bhsd'"),
    (dict(scale=0.0), "scale must be a finite number > 0"),
    (dict(scale=float("nan")), "scale must be a finite number > 0"),
    (dict(window=0), "window must be None or an int >= 1"),
    (dict(window=2.5), "window must be None or an int >= 1"),
    (dict(window=True), "window must be None or an int >= 1"),
    (dict(softcap=-1.0), "softcap must be None or a finite number > 0"),
    (dict(sinks=np.zeros(3, np.float32)), r"sinks must have shape \(H_q,\) = \(2,\)"),
    (dict(lnc=3), "lnc must be 1 or 2"),
])
def test_rejects_bad_options(rng, kw, match):
    q, k, v = _small(rng)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, **kw)


def test_rejects_bad_shapes_and_dtypes(rng):
    q, k, v = _small(rng)
    with pytest.raises(ValueError, match="q must be 4-D"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="head_dim must be one of 64, 128, 192, 256; got 80"):
        flash_attention(*_small(rng, d=80))
    with pytest.raises(ValueError, match="k and v must have batch 1 and head_dim 64"):
        flash_attention(q, k[..., :32], v)
    with pytest.raises(ValueError, match="v must be"):
        flash_attention(q, k, v[:, :, :8])
    with pytest.raises(ValueError, match=r"H_q \(3\) must be a multiple of H_kv \(2\)"):
        flash_attention(*_qkv(rng, 1, 3, 2, 8, 8, 64))
    with pytest.raises(ValueError, match="causal attention needs S_q <= S_kv"):
        flash_attention(*_small(rng, Sq=32, Skv=16))
    with pytest.raises(ValueError, match="every dimension must be >= 1"):
        flash_attention(q[:, :, :0], k, v)
    huge = np.broadcast_to(np.zeros((), BF16), (1, 1, 2 ** 24, 64))
    with pytest.raises(ValueError, match="S_kv must be < 2\\^24"):
        flash_attention(q, huge, huge)
    with pytest.raises(TypeError, match="q.dtype must be one of bfloat16, float16; got float32"):
        flash_attention(q.astype(np.float32), k, v)
    with pytest.raises(TypeError, match=r"v.dtype must equal q.dtype \(bfloat16\)"):
        flash_attention(q, k, v.astype(np.float16))


def test_rejects_trn1(rng):
    q, k, v = _small(rng)
    with target("trn1"):
        with pytest.raises(ValueError, match="flash_attention: target trn1 is not supported; "
                                             "supported targets: trn2, trn3"):
            flash_attention(q, k, v)


@pytest.mark.parametrize("kw,name", [(dict(causal="no"), "causal"), (dict(causal=1), "causal"),
                                     (dict(return_lse="yes"), "return_lse")])
def test_flags_take_booleans_only(rng, kw, name):
    q, k, v = _small(rng)
    with pytest.raises(TypeError, match=f"flash_attention: {name} must be True or False; got"):
        flash_attention(q, k, v, **kw)


def test_sinks_accept_any_array_like_and_name_what_they_got(rng):
    q, k, v = _small(rng)
    Hq = q.shape[1]
    sinks = [0.5] * Hq
    o_list = flash_attention(q, k, v, sinks=sinks)
    o_arr = flash_attention(q, k, v, sinks=np.asarray(sinks, np.float32))
    assert np.array_equal(o_list.view(np.uint16), o_arr.view(np.uint16))
    with pytest.raises(ValueError, match=r"sinks must have shape \(H_q,\) = .* got shape \(3,\): "
                                         r"\[1.0, 2.0, 3.0\]"):
        flash_attention(q, k, v, sinks=[1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match=r"sinks must be an array-like of numbers .*; got 'abc'"):
        flash_attention(q, k, v, sinks="abc")


def test_plan_rejects_bad_lags():
    with pytest.raises(ValueError, match="lags must be"):
        fa.plan_flash_attention(4, 64, 100, causal=True, window=None, softcap=None, scale=0.1,
                                has_sinks=False, return_lse=False, k_layout="bhsd",
                                out_dtype=nl.bfloat16, sbuf_budget=10 ** 6, lags=(0, 2, 3, 4))


def test_plan_is_data():
    p = fa.plan_flash_attention(4, 128, 8192, causal=True, window=None, softcap=None, scale=0.1,
                                has_sinks=False, return_lse=False, k_layout="bhsd",
                                out_dtype=nl.bfloat16, sbuf_budget=10 ** 6)
    assert dataclasses.is_dataclass(p) and p.kb == 2048 and p.exp_engine == "vector"
    p2 = fa.plan_flash_attention(3, 128, 8192, causal=True, window=None, softcap=None, scale=0.1,
                                 has_sinks=False, return_lse=False, k_layout="bhsd",
                                 out_dtype=nl.bfloat16, sbuf_budget=10 ** 6)
    assert p2.exp_engine == "scalar" and p2.mm_n == 512


def test_recipe_variants_stay_correct(rng):
    """Tuning knobs change engines, never results: Trn2 exp straight from PSUM (x_sbuf=False),
    all-TensorE or all-DMA transposes, VectorE evictions, the one-op O update, 1024-key blocks."""
    q, k, v = _qkv(rng, 1, 2, 1, 400, 2300, 64)
    variants = [("trn2", dict(x_sbuf=False)), ("trn2", dict(dma_tr_frac=1.0, evict_act=0.0)),
                ("trn3", dict(dma_tr_frac=0.0, o_update="stt", act_max_frac=1.0)),
                ("trn3", dict(kb=1024, lags=(0, 1, 2, 3)))]
    for tgt_name, ov in variants:
        with target(tgt_name):
            plan = fa.plan_flash_attention(int(nisa.get_nc_version()), 64, 2300, causal=True,
                                           window=700, softcap=None, scale=0.125,
                                           has_sinks=False, return_lse=False, k_layout="bhsd",
                                           out_dtype=nl.bfloat16, sbuf_budget=10 ** 6, **ov)
            o = launch(fa.flash_attention_kernel, q, k, v, None, plan)
        _check(o, q, k, v, window=700)
