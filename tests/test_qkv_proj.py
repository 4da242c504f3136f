"""Fused QKV projection against its NumPy reference: FAST / ODD / MODELS shapes, the GQA head
configurations of real models, every optional stage (residual, RMSNorm, bias, QK-norm, RoPE
layouts, partial rotary, tables, transposed K), adversarial inputs, and every refusal."""
import ml_dtypes
import numpy as np
import pytest

from nki_kernels.dense.qkv_proj import DECODE_T_MAX, plan_qkv, qkv_proj, rope_cos_sin
from nki_kernels.emulator import target
from nki_kernels.reference.compare import assert_rows_close
from nki_kernels.reference.qkv_proj import qkv_proj_ref, rope_tables
from nki_kernels.reference.shapes import (
    DEFAULT,
    FAST,
    GEMMA3_12B,
    LLAMA3_8B,
    LLAMA3_70B_TP8,
    MODELS,
    ODD,
    QWEN3_30B_A3B,
)

BF16 = ml_dtypes.bfloat16


def _models(shapes_, default):
    """Every MODELS shape; those of the DEFAULT tier (one per kernel regime) run by default."""
    return [pytest.param(s, id=s.name, marks=() if s in default else pytest.mark.slow)
            for s in shapes_]


def _inputs(rng, T, H, nq, nkv, d, *, norm=True, rope=True, residual=False, bias=False,
            qk_norm=False, **extra):
    x = rng.standard_normal((T, H)).astype(BF16)
    w = (rng.standard_normal((H, (nq + 2 * nkv) * d)) / np.sqrt(H)).astype(BF16)
    kw = dict(n_q_heads=nq, n_kv_heads=nkv, head_dim=d, **extra)
    if norm:
        kw["norm_weight"] = rng.uniform(0.5, 1.5, H).astype(np.float32)
    if rope:
        kw["positions"] = rng.integers(0, 8192, T)
        kw["rope_theta"] = 500000.0
    if residual:
        kw["residual"] = rng.standard_normal((T, H)).astype(BF16)
    if bias:
        kw["bias"] = rng.standard_normal((nq + 2 * nkv) * d).astype(np.float32)
    if qk_norm:
        kw["q_norm_weight"] = rng.uniform(0.5, 1.5, d).astype(np.float32)
        kw["k_norm_weight"] = rng.uniform(0.5, 1.5, d).astype(np.float32)
    return x, w, kw


def _check(out, ref, kw):
    T = out.q.shape[1]
    for name, a, e in (("q", out.q, ref[0]), ("k", out.k, ref[1]), ("v", out.v, ref[2])):
        assert a.shape == e.shape and a.dtype == BF16, (name, a.shape, e.shape, a.dtype)
        transposed = name == "k" and kw.get("k_layout") == "transposed"
        assert_rows_close(a, e, axis=-2 if transposed else -1, what=f"{name} (T={T})")
    if ref[3] is None:
        assert out.residual is None
    else:
        np.testing.assert_array_equal(out.residual.view(np.uint16), ref[3].view(np.uint16))


def _run(rng, T, H, nq, nkv, d, **opts):
    x, w, kw = _inputs(rng, T, H, nq, nkv, d, **opts)
    out = qkv_proj(x, w, **kw)
    _check(out, qkv_proj_ref(x, w, **kw), kw)
    return out


# ---------------------------------------------------------------------------- shape tiers
@pytest.mark.parametrize("case", FAST.qkv + ODD.qkv, ids=lambda c: c.name)
def test_shapes(tgt, rng, case):
    _run(rng, case.tokens, case.hidden, case.n_q_heads, case.n_kv_heads, case.head_dim,
         residual=True, bias=True)


# GQA head configurations of real models at a reduced hidden size (the GEMM depth does not
# change the tiling of heads), at the token counts that exercise each regime: 1 and 7 (decode,
# (head, token) lanes), 129 (one full token slot plus one leftover token), 1000 (two blocks).
MODEL_HEADS = [
    pytest.param(LLAMA3_8B, {}, id="llama3-8b-32/8"),
    pytest.param(LLAMA3_70B_TP8, {}, id="llama3-70b-tp8-8/1"),
    pytest.param(QWEN3_30B_A3B, {"qk_norm": True}, id="qwen3-30b-a3b-32/4-qknorm"),
    pytest.param(GEMMA3_12B, {"qk_norm": True}, id="gemma3-12b-16/8-d256"),
]


@pytest.mark.parametrize("T", [1, 7, 129, 1000])
@pytest.mark.parametrize("cfg,opts", MODEL_HEADS)
def test_model_heads(tgt, rng, cfg, opts, T):
    _run(rng, T, 256, cfg.n_q_heads, cfg.n_kv_heads, cfg.head_dim, **opts)


@pytest.mark.parametrize("case", _models(MODELS.qkv, DEFAULT.qkv))
def test_model_shapes(rng, case):
    with target("trn3"):
        _run(rng, case.tokens, case.hidden, case.n_q_heads, case.n_kv_heads, case.head_dim)


# ---------------------------------------------------------------------------- features
@pytest.mark.parametrize("opts", [
    dict(norm=False, rope=False),
    dict(norm=False, rope=True, bias=True),
    dict(residual=True, qk_norm=True),
    dict(qk_norm=True, rope=False),
    dict(rope_layout="interleaved"),
    dict(rope_layout="interleaved", rotary_dim=32, qk_norm=True),
    dict(rotary_dim=64),
    dict(k_layout="transposed"),
    dict(k_layout="transposed", qk_norm=True, rope_layout="interleaved"),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("T", [5, 300])
def test_features(tgt, rng, opts, T):
    _run(rng, T, 384, 4, 2, 128, **opts)


@pytest.mark.parametrize("d,T", [(64, 3), (64, 260), (256, 9), (256, 140)])
def test_transposed_k_head_dims(tgt, rng, d, T):
    _run(rng, T, 256, 4, 1, d, k_layout="transposed", qk_norm=True)


@pytest.mark.parametrize("opts", [
    dict(),
    dict(qk_norm=True, rope_layout="interleaved", rotary_dim=64),
    dict(residual=True, bias=True, qk_norm=True),
    dict(rope=False, qk_norm=True),
    dict(k_layout="transposed", qk_norm=True),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("T", [128, 200, 384])
def test_head_lanes(tgt, rng, sbuf_peak, opts, T):
    """One token per partition (a block of 128..255 tokens; at 384 the k-chunked nest's last
    group of 128): q, k and v (8 and 2 heads) go out in (head, token group) lanes with RoPE tables
    built on TensorE; at 200 the 72 leftover tokens in pair lanes. The plan's SBUF figure is the
    measured peak (in the k-chunked nest, with these options, a bound: it was before the head
    lanes too)."""
    from nki_kernels._limits import sbuf_budget
    _run(rng, T, 256, 8, 2, 128, **opts)
    rot = 0 if opts.get("rope") is False else opts.get("rotary_dim", 128)
    plan = plan_qkv(T, 256, 8, 2, 128, sbuf_budget(), norm=True, bias=bool(opts.get("bias")),
                    residual=bool(opts.get("residual")), rot=rot,
                    qk_norm=bool(opts.get("qk_norm")),
                    k_transposed=opts.get("k_layout") == "transposed")
    if plan.kc:
        assert sbuf_peak() <= plan.sbuf_bytes
    else:
        assert plan.sbuf_bytes == sbuf_peak()


def test_head_lanes_store_rows_of_heads(rng):
    """With one token per partition, each partition holds n_q consecutive tokens of one q head
    and stores them as one contiguous run of n_q * d elements (2 KiB for 8 heads), instead of
    one 256-B row per head and token (token lanes: descriptors priced at the 1.5 KiB floor;
    Llama-3-70B TP8 T=128 spent 5.3 us of its 58.6 us storing q, k, v after the last matmul).
    k and v (one head each) keep token lanes."""
    from nki_kernels.emulator.trace import trace
    T, H, nq, nkv, d = 128, 256, 8, 1, 128
    x, w, kw = _inputs(rng, T, H, nq, nkv, d)
    with target("trn3"), trace() as tr:
        out = qkv_proj(x, w, **kw)
    _check(out, qkv_proj_ref(x, w, **kw), kw)
    stores = {}
    for ins in tr:
        if ins.engine == "dma" and ins.writes and ins.writes[0].buffer.endswith("hbm"):
            dst, src = ins.writes[0], ins.reads[0]
            stores.setdefault(dst.alloc, []).append((dst.nbytes,
                                                     min(dst.contig_bytes, src.contig_bytes)))
    q = max(stores.values(), key=lambda v: sum(n for n, _ in v))
    assert sum(n for n, _ in q) == nq * T * d * 2
    assert q == [(nq * T * d * 2, nq * d * 2)]                  # one DMA, 2 KiB runs


def test_cos_sin_tables_equal_positions(rng):
    """Tables built by the caller (partial rotary, one angle per pair) give the same result as
    positions + theta."""
    T, H, d, rot = 40, 256, 128, 96
    x, w, kw = _inputs(rng, T, H, 4, 2, d, rope=False, rotary_dim=rot)
    pos = rng.integers(0, 30000, T)
    cos, sin = rope_tables(pos, rot, 1e6)
    a = qkv_proj(x, w, cos=cos, sin=sin, **kw)
    b = qkv_proj(x, w, positions=pos, rope_theta=1e6, **kw)
    for u, v in zip(a[:3], b[:3]):
        np.testing.assert_array_equal(u.view(np.uint16), v.view(np.uint16))
    _check(a, qkv_proj_ref(x, w, cos=cos, sin=sin, **kw), kw)


def test_rope_tables_match_reference():
    pos = np.array([0, 1, 7, 4095, 131071])
    c1, s1 = rope_cos_sin(pos, 64, 500000.0)
    c2, s2 = rope_tables(pos, 64, 500000.0)
    np.testing.assert_allclose(c1, c2, atol=1e-6)
    np.testing.assert_allclose(s1, s2, atol=1e-6)


def test_residual_only_returns_sum(rng):
    x, w, kw = _inputs(rng, 20, 256, 2, 1, 128, norm=False, rope=False, residual=True)
    out = qkv_proj(x, w, **kw)
    exp = (x.astype(np.float32) + kw["residual"].astype(np.float32)).astype(BF16)
    np.testing.assert_array_equal(out.residual.view(np.uint16), exp.view(np.uint16))


# ---------------------------------------------------------------------------- adversarial
def test_nonfinite_token_stays_in_its_row(rng):
    """A NaN / inf in one token's activations reaches that token's q, k, v rows and no other."""
    x, w, kw = _inputs(rng, 150, 256, 4, 2, 128)
    x[3, 17] = np.nan
    x[140, 0] = np.inf
    out = qkv_proj(x, w, **kw)
    for t in out.q, out.k, out.v:
        bad = ~np.isfinite(t.astype(np.float32))
        rows = np.unique(np.nonzero(bad)[1])
        assert rows.tolist() == [3, 140]
        assert bad[:, [3, 140], :].all()


def test_tiny_rows_depend_on_eps(rng):
    """Rows far below sqrt(eps): the norm's eps dominates; a kernel ignoring eps would blow
    these rows up to unit RMS."""
    x, w, kw = _inputs(rng, 9, 256, 2, 1, 128, eps=1e-2)
    x = (x.astype(np.float32) * 1e-3).astype(BF16)
    out = qkv_proj(x, w, **kw)
    ref = qkv_proj_ref(x, w, **kw)
    _check(out, ref, kw)
    assert np.abs(ref[2].astype(np.float32)).max() < 0.1


def test_large_activations(rng):
    x, w, kw = _inputs(rng, 33, 256, 2, 1, 128, norm=False)
    x = (x.astype(np.float32) * 3e4).astype(BF16)
    _check(qkv_proj(x, w, **kw), qkv_proj_ref(x, w, **kw), kw)


def test_noncontiguous_inputs(rng):
    """Column-major weights and a strided activation view are accepted as-is."""
    x, w, kw = _inputs(rng, 17, 256, 2, 1, 128)
    wf = np.asfortranarray(w)
    big = np.zeros((x.shape[0], 2 * x.shape[1]), BF16)
    big[:, ::2] = x
    xs = big[:, ::2]
    np.testing.assert_array_equal(xs.view(np.uint16), x.view(np.uint16))
    _check(qkv_proj(xs, wf, **kw), qkv_proj_ref(x, w, **kw), kw)


# ---------------------------------------------------------------------------- plan
@pytest.mark.parametrize("tname", ["trn2", "trn3"])
def test_plan_regimes(tname):
    from nki_kernels._limits import sbuf_budget
    with target(tname):
        budget = sbuf_budget()
    dec = plan_qkv(32, 4096, 32, 8, 128, budget)
    pre = plan_qkv(2048, 4096, 32, 8, 128, budget)
    narrow = plan_qkv(2048, 8192, 8, 1, 128, budget)      # Llama-3-70B TP8: N = 1280
    assert narrow.kc >= 8 and narrow.ts_max == 1024 and not pre.kc and not dec.kc
    assert dec.decode and not pre.decode
    assert DECODE_T_MAX == 128
    assert dec.nf_max >= 32 and pre.nf_max == 8     # PSUM: [128, 32] x 128 vs [128, 512] x 8
    assert max(dec.sbuf_bytes, pre.sbuf_bytes, narrow.sbuf_bytes) <= budget
    with pytest.raises(ValueError, match="qkv_proj: hidden=65536 needs .* bytes of SBUF .* even at 64"):
        plan_qkv(2048, 65536, 32, 8, 128, 200_000)


# ---------------------------------------------------------------------------- refusals
def _small(rng):
    return _inputs(rng, 4, 256, 4, 2, 64, norm=False, rope=False)


@pytest.mark.parametrize("change,err,msg", [
    (dict(head_dim=96), ValueError, r"head_dim must be one of 64, 128, 256; got 96"),
    (dict(n_q_heads=3), ValueError, r"n_q_heads \(3\) must be a multiple of n_kv_heads \(2\)"),
    (dict(n_kv_heads=0), ValueError, r"n_kv_heads must be a positive int; got 0"),
    (dict(bias=np.zeros(7, np.float32)), ValueError, r"bias must be a vector of length 512"),
    (dict(norm_weight=np.zeros(9, np.float32)), ValueError,
     r"norm_weight must be a vector of length 256"),
    (dict(eps=0.0), ValueError, r"qkv_proj: eps must be a finite float > 0; got 0.0"),
    (dict(eps=True), ValueError, r"eps must be a finite float > 0; got True"),
    (dict(qk_norm_eps=0.0, q_norm_weight=np.ones(64, np.float32),
          k_norm_weight=np.ones(64, np.float32)), ValueError, r"qk_norm_eps must be a finite"),
    (dict(q_norm_weight=np.ones(64, np.float32)), ValueError,
     r"q_norm_weight and k_norm_weight must be given together"),
    (dict(rope_layout="neox"), ValueError, r"rope_layout must be 'half' or 'interleaved'"),
    (dict(k_layout="bhsd"), ValueError, r"k_layout must be 'heads' or 'transposed'"),
    (dict(positions=np.arange(4), rotary_dim=7), ValueError, r"rotary_dim must be an even int"),
    (dict(positions=np.arange(4), rotary_dim=128), ValueError, r"rotary_dim must be an even int"),
    (dict(positions=np.arange(3)), ValueError, r"positions must be an integer array of shape \[4\]"),
    (dict(positions=np.arange(4.0)), ValueError, r"positions must be an integer array"),
    (dict(positions=np.arange(4), cos=np.zeros((4, 32))), ValueError,
     r"pass positions \(with rope_theta\) or cos/sin tables, not both"),
    (dict(cos=np.zeros((4, 32))), ValueError, r"cos and sin must be given together"),
    (dict(cos=np.zeros((4, 64)), sin=np.zeros((4, 64))), ValueError,
     r"cos must be \[T, rotary_dim // 2\] = \[4, 32\]"),
    (dict(positions=np.arange(4), rope_theta=1.0), ValueError, r"rope_theta must be a float > 1"),
    (dict(residual=np.zeros((4, 255), BF16)), ValueError, r"residual must have the shape of x"),
    (dict(residual=np.zeros((4, 256), np.float32)), TypeError,
     r"residual.dtype must be bfloat16; got float32"),
])
def test_rejects(rng, change, err, msg):
    x, w, kw = _small(rng)
    kw.update(change)
    with pytest.raises(err, match=msg):
        qkv_proj(x, w, **kw)


@pytest.mark.parametrize("T", [8, 256, 600], ids=["decode", "one block", "two blocks"])
def test_plan_bounds_the_measured_sbuf_peak(tgt, rng, sbuf_peak, T):
    """Planned without the call's options (the default: every option on), the plan's SBUF figure
    bounds what the kernel holds at its peak (the emulator's liveness-based measurement); with
    them it is that peak exactly (tests/test_sbuf_plan.py)."""
    from nki_kernels._limits import sbuf_budget
    _run(rng, T, 1024, 8, 2, 128)
    plan = plan_qkv(T, 1024, 8, 2, 128, sbuf_budget())
    assert 0 < sbuf_peak() <= plan.sbuf_bytes <= sbuf_budget()


def test_rejects_trn1_up_front(rng):
    x, w, kw = _small(rng)
    with target("trn1"), pytest.raises(ValueError, match=r"qkv_proj: target trn1 is not "
                                                         r"supported; supported targets: trn2"):
        qkv_proj(x, w, **kw)


def test_rejects_bad_x_and_weights(rng):
    x, w, kw = _small(rng)
    with pytest.raises(TypeError, match=r"qkv_proj: x.dtype must be bfloat16; got float32"):
        qkv_proj(x.astype(np.float32), w, **kw)
    with pytest.raises(ValueError, match=r"qkv_proj: x must be a 2-D array; got shape \(1, 4, 256\)"):
        qkv_proj(x[None], w, **kw)
    with pytest.raises(ValueError, match=r"w_qkv must be \[H, \(n_q_heads \+ 2 n_kv_heads\) \* "
                                         r"head_dim\] = \[256, 512\]; got \[256, 448\]"):
        qkv_proj(x, w[:, :448], **kw)
    with pytest.raises(TypeError, match=r"w_qkv.dtype must be bfloat16; got float8_e4m3"):
        qkv_proj(x, w.astype(ml_dtypes.float8_e4m3), **kw)
    with pytest.raises(ValueError, match=r"x must have positive dimensions"):
        qkv_proj(x[:0], w, **kw)
