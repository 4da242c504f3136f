"""rmsnorm_quant against its NumPy reference: FP8 per-token (e4m3 / e4m3fn / e5m2, dynamic and
static scale, both layouts), MXFP8 (Trn3), residual add, odd T, large H, adversarial rows, LNC=2,
both targets, and every refusal.

Bit-exactness: FP8 and MX data and scales are compared byte for byte, up to the sign of zero and
the payload of NaN (TensorE's transposed path adds +0 terms, so -0 may come out +0). Scales depend
on the fp32 sum of squares, whose rounding depends on summation order: the bit-exact cases use
"exact-sum" rows (multiples of 1/16 in [-15/16, 15/16], or small integers) whose fp32 sums are
exact in any order; random rows check the data bit-exactly and the scales to a few ulp.
"""
import warnings

import ml_dtypes
import numpy as np
import pytest

from nki_kernels.emulator import target
from nki_kernels.quant.mxfp8_matmul import MXTensor, mxfp8_matmul, quantize_weights_mx
from nki_kernels.quant.rmsnorm_quant import rmsnorm_quant
from nki_kernels.reference import mx as mxref
from nki_kernels.reference import rmsnorm_quant as R
from nki_kernels.reference.compare import cosine_similarity
from nki_kernels.reference.mxfp8_matmul import dequantize_mx_kmajor, untile_layout
from nki_kernels.reference.shapes import DEFAULT, FAST, MODELS, ODD

BF16 = ml_dtypes.bfloat16
ODD_T = (1, 7, 1000)            # issue: odd token counts


def _models(shapes_, default):
    """Every MODELS shape; those of the DEFAULT tier (one per kernel regime) run by default."""
    return [pytest.param(s, id=s.name, marks=() if s in default else pytest.mark.slow)
            for s in shapes_]


def default_fp8(tgt):
    return "float8_e4m3" if tgt == "trn2" else "float8_e4m3fn"


# ------------------------------------------------------------------------------------ inputs
def exact_rows(rng, T, H):
    """Rows of multiples of 1/16 in [-15/16, 15/16]: fp32 sums of squares exact in any order."""
    return (rng.integers(-15, 16, (T, H)) / 16.0).astype(np.float32)


def adversarial(rng, T, H, nonfinite=True):
    """Exact-sum rows plus: an all-zero row, a row of bf16 subnormals, a row of integers with
    512 (> every fp8 max but e5m2's) and -0.0, and (if nonfinite) a NaN row and an inf row."""
    x = exact_rows(rng, T, H)
    special = [np.zeros(H), np.full(H, 2.0 ** -130),
               np.concatenate([[512.0, -0.0], rng.integers(-15, 16, H - 2)])]
    if nonfinite:
        nan_row = x[0].copy()
        nan_row[H // 3] = np.nan
        inf_row = x[0].copy()
        inf_row[H // 2] = -np.inf
        special += [nan_row, inf_row]
    for i, row in enumerate(special[:T]):
        x[i] = row
    return x.astype(BF16)


def canon_fp8(q):
    """fp8 bytes with every NaN as 0x7F and -0 as +0 (payload and zero sign are unspecified)."""
    b = np.asarray(q).view(np.uint8).copy()
    b[np.isnan(np.asarray(q).astype(np.float32))] = 0x7F
    b[b == 0x80] = 0
    return b


def canon_bf16(r):
    """bf16 bits with NaN canonical and -0 as +0 (the DMA add may turn -0 + -0 into +0)."""
    b = np.asarray(r).view(np.uint16).copy()
    b[np.isnan(np.asarray(r).astype(np.float32))] = 0x7FC0
    b[b == 0x8000] = 0
    return b


def assert_scales_equal(s, sr):
    s, sr = np.asarray(s, np.float32), np.asarray(sr, np.float32)
    assert np.array_equal(np.isnan(s), np.isnan(sr))
    fin = ~np.isnan(sr)
    assert np.array_equal(s[fin].view(np.uint32), sr[fin].view(np.uint32)), \
        np.argwhere(s != sr)[:5]


def assert_mx_equal(mx, data, scale, K):
    """MX data words (NaN lanes canonicalised, -0 -> +0) and scale bytes equal."""
    KT = -(-K // 512)
    d1, s1 = untile_layout(mx.data, mx.scale, KT)
    d2, s2 = untile_layout(data, scale, KT)
    assert np.array_equal(s1, s2), np.argwhere(s1 != s2)[:5]
    assert np.array_equal(_canon_words(d1, mx.fmt), _canon_words(d2, mx.fmt))


def _canon_words(words, fmt):
    b = np.asarray(words).astype(np.uint32).view(np.uint8).copy()
    elem = ml_dtypes.float8_e4m3fn if fmt == "e4m3fn" else ml_dtypes.float8_e5m2
    b[np.isnan(b.view(elem).astype(np.float32))] = 0x7F
    b[b == 0x80] = 0
    return b


def sum_rtol(H):
    """Scale tolerance for random rows: an fp32 sum of H positive terms in any order is within
    (H - 1) u of exact (u = 2^-24); rsqrt halves that; 4 u for the remaining roundings."""
    return (H / 2 + 4) * 2.0 ** -24


def run(*args, **kw):
    """rmsnorm_quant, quiet about inf * 0 inside the emulator's nc_matmul (its NumPy matmul warns;
    a process-wide filter, because LNC=2 programs run in their own threads)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "invalid value encountered in matmul", RuntimeWarning)
        return rmsnorm_quant(*args, **kw)


# ------------------------------------------------------------------------------------ FP8
@pytest.mark.parametrize("T,H", [(s.tokens, s.hidden) for s in FAST.rmsnorm] +
                         [(t, 256) for t in ODD_T] + [(130, 4608)], ids=str)
def test_fp8_bit_exact(tgt, rng, T, H):
    """T < 8 runs the row layout, T >= 8 the transposed one (H = 4608: 5 chunks of g, one
    evicted by VectorE on Trn3, and a ragged last chunk)."""
    x = adversarial(rng, T, H)
    g = rng.standard_normal(H).astype(BF16)
    q, s = run(x, g)
    qr, sr = R.rmsnorm_quant_fp8_ref(x, g, dtype=default_fp8(tgt))
    assert q.shape == (T, H) and q.dtype == qr.dtype and s.shape == (T, 1)
    assert np.array_equal(canon_fp8(q), canon_fp8(qr))
    assert_scales_equal(s, sr)
    if T >= 5:   # the NaN and inf rows come out all NaN, the zero row as zeros
        assert np.isnan(q[3].astype(np.float32)).all() and np.isnan(q[4].astype(np.float32)).all()
        assert np.isnan(s[3:5]).all() and not np.isnan(s[5:]).any()
        assert (q[0].astype(np.float32) == 0).all()


@pytest.mark.parametrize("T,variant", [(7, "plain"), (100, "residual"), (128, "fp32 gamma")],
                         ids=str)
def test_fp8_single_tile_column_chunks(tgt, rng, T, variant):
    """One tile in the row layout (fewer than 8 rows, or a residual, or an fp32 gamma) runs in
    column chunks (loads, passes and stores overlapped): H = 4608 is four 1024-column chunks and
    a ragged 512, and three quantize chunks over the engines. Bit-exact, NaN / inf / zero rows
    included, with a residual and an fp32 gamma."""
    H = 4608
    x = adversarial(rng, T, H)
    g = rng.standard_normal(H).astype(np.float32 if variant == "fp32 gamma" else BF16)
    fmt = default_fp8(tgt)
    if variant == "residual":
        res = adversarial(rng, T, H, nonfinite=False)
        q, s, r = run(x, g, residual=res)
        qr, sr, rr = R.rmsnorm_quant_fp8_ref(x, g, residual=res, dtype=fmt)
        assert np.array_equal(canon_bf16(r), canon_bf16(rr))
    else:
        q, s = run(x, g)
        qr, sr = R.rmsnorm_quant_fp8_ref(x, g, dtype=fmt)
    assert np.array_equal(canon_fp8(q), canon_fp8(qr))
    assert_scales_equal(s, sr)
    if variant != "residual":
        assert np.isnan(s[3:5]).all() and (q[0].astype(np.float32) == 0).all()


@pytest.mark.parametrize("T", [8, 100, 128, 300])
def test_fp8_transposed_layout_loads(tgt, rng, T):
    """FP8 with a bf16 gamma and no residual takes the transposed layout from 8 tokens on, a lone
    tile too: x.T by DMA transposes, no gamma broadcast. Nothing queues ahead of the x.T loads on
    the DMA rings: the identities are built on-chip (iota), gamma's columns come by one small DMA
    transpose issued first, and the scales leave as 512 B rows (TensorE transposes) by hardware
    DGE. Bit-exact, NaN / inf / zero rows included; T = 100 and 300 end in a ragged tile."""
    from nki_kernels.emulator.trace import trace
    from nki_kernels.quant.rmsnorm_quant import plan_rmsnorm_quant
    H = 1280
    x = adversarial(rng, T, H)
    g = rng.standard_normal(H).astype(BF16)
    with trace() as tr:
        q, s = run(x, g)
    qr, sr = R.rmsnorm_quant_fp8_ref(x, g, dtype=default_fp8(tgt))
    assert np.array_equal(canon_fp8(q), canon_fp8(qr))
    assert_scales_equal(s, sr)
    assert plan_rmsnorm_quant(T, H, "fp8", False, 2, 1 << 20).transposed
    assert not plan_rmsnorm_quant(7, H, "fp8", False, 2, 1 << 20).transposed
    loads = [ins for ins in tr if ins.engine == "dma" and ins.writes and ins.writes[0].on_chip
             and any(not o.on_chip for o in ins.reads)]
    assert [ins.opcode for ins in loads] == ["dma_transpose"] * len(loads)   # no dma_copy loads
    assert loads[0].reads[0].shape == (H // 128, 128)                         # gamma's, first
    scales = [ins for ins in tr if ins.engine == "dma" and ins.writes
              and ins.writes[0].buffer.endswith("hbm") and ins.writes[0].dtype == "float32"]
    assert scales and all(ins.attrs.get("dge") == "hwdge" for ins in scales)
    src_rows = sum(ins.reads[0].partitions[1] - ins.reads[0].partitions[0] for ins in scales)
    assert src_rows == -(-T // 128)                                   # one SBUF row per tile


@pytest.mark.parametrize("fmt", ["float8_e4m3", "float8_e5m2", "float8_e4m3fn"])
def test_fp8_formats(tgt, rng, fmt):
    if fmt == "float8_e4m3fn" and tgt == "trn2":
        pytest.skip("e4m3fn is Trn3-only (refusal tested below)")
    x = adversarial(rng, 130, 384)
    g = rng.standard_normal(384).astype(BF16)
    q, s = run(x, g, fp8_dtype=fmt)
    qr, sr = R.rmsnorm_quant_fp8_ref(x, g, dtype=fmt)
    assert q.dtype == np.dtype(getattr(ml_dtypes, fmt))
    assert np.array_equal(canon_fp8(q), canon_fp8(qr))
    assert_scales_equal(s, sr)
    fin = np.isfinite(q.astype(np.float32))
    assert np.abs(q.astype(np.float32)[fin]).max() == R.FP8_MAX[fmt]   # the row max maps to max


def test_fp8_random_rows_and_accuracy(tgt, rng):
    """Random bf16 rows: data bit-exact (it does not depend on the sum of squares), scales within
    2 ulp, and the dequantized rows within the fp8 rounding of the fp32 RMSNorm."""
    T, H = 200, 1024
    x = (rng.standard_normal((T, H)) * rng.uniform(0.01, 100, (T, 1))).astype(BF16)
    g = (1 + 0.1 * rng.standard_normal(H)).astype(BF16)
    q, s = run(x, g)
    qr, sr = R.rmsnorm_quant_fp8_ref(x, g, dtype=default_fp8(tgt))
    assert np.array_equal(canon_fp8(q), canon_fp8(qr))
    np.testing.assert_allclose(s, sr, rtol=sum_rtol(H))
    y = R.rmsnorm_ref(x, g)
    deq = R.dequantize_fp8_rows(q, s)
    # e4m3: 3 mantissa bits -> relative 2^-4 for normals, absolute 2^-10 scale (half the
    # smallest subnormal, 2^-9 in e4m3fn units; e4m3's is 2^-9 too) below; + bf16(g) 2^-9
    bound = (2.0 ** -4 + 2.0 ** -8) * np.abs(y) + 2.0 ** -9 * s
    assert (np.abs(deq - y) <= bound).all()


def test_fp8_static_scale_saturates(tgt, rng):
    x = exact_rows(rng, 64, 512).astype(BF16)
    g = rng.standard_normal(512).astype(BF16)
    fmt = default_fp8(tgt)
    q, s = run(x, g, static_scale=1.0 / 256)
    qr, sr = R.rmsnorm_quant_fp8_ref(x, g, dtype=fmt, static_scale=1.0 / 256)
    assert np.array_equal(canon_fp8(q), canon_fp8(qr))
    assert (s == np.float32(1.0 / 256)).all()
    qf = q.astype(np.float32)
    assert np.isfinite(qf).all() and np.abs(qf).max() == R.FP8_MAX[fmt]   # saturated, no inf
    assert (np.abs(qf) == R.FP8_MAX[fmt]).mean() > 0.05


def test_fp8_residual(tgt, rng):
    T, H = 131, 384
    x, res = adversarial(rng, T, H), adversarial(rng, T, H)
    g = rng.standard_normal(H).astype(BF16)
    q, s, r = run(x, g, residual=res)
    qr, sr, rr = R.rmsnorm_quant_fp8_ref(x, g, residual=res, dtype=default_fp8(tgt))
    assert np.array_equal(canon_bf16(r), canon_bf16(rr))
    assert np.array_equal(canon_fp8(q), canon_fp8(qr))
    assert_scales_equal(s, sr)


def test_fp8_fp32_gamma_and_eps(tgt, rng):
    x = adversarial(rng, 9, 256, nonfinite=False)
    g = rng.standard_normal(256).astype(np.float32)
    q, s = run(x, g, eps=1e-2)
    qr, sr = R.rmsnorm_quant_fp8_ref(x, g, eps=1e-2, dtype=default_fp8(tgt))
    assert np.array_equal(canon_fp8(q), canon_fp8(qr))
    assert_scales_equal(s, sr)


def test_fp8_large_h_and_lnc2(tgt, rng):
    """H = 16384 in the transposed layout (single-buffered on Trn2: 12 H bytes do not fit), and
    LNC=2 splitting 8 tiles."""
    x = exact_rows(rng, 130, 16384).astype(BF16)
    g = rng.standard_normal(16384).astype(BF16)
    q, s = run(x, g)
    qr, sr = R.rmsnorm_quant_fp8_ref(x, g, dtype=default_fp8(tgt))
    assert np.array_equal(canon_fp8(q), canon_fp8(qr))
    assert_scales_equal(s, sr)
    x2 = adversarial(rng, 1000, 256)
    g2 = rng.standard_normal(256).astype(BF16)
    q1, s1 = run(x2, g2)
    q2, s2 = run(x2, g2, lnc=2)
    assert np.array_equal(canon_fp8(q1), canon_fp8(q2))
    assert_scales_equal(s2, s1)


@pytest.mark.parametrize("shape", _models(MODELS.rmsnorm, DEFAULT.rmsnorm))
def test_fp8_model_shapes(tgt, rng, shape):
    x = rng.standard_normal((shape.tokens, shape.hidden)).astype(BF16)
    g = rng.standard_normal(shape.hidden).astype(BF16)
    q, s = run(x, g)
    qr, sr = R.rmsnorm_quant_fp8_ref(x, g, dtype=default_fp8(tgt))
    assert np.array_equal(canon_fp8(q), canon_fp8(qr))
    np.testing.assert_allclose(s, sr, rtol=sum_rtol(shape.hidden))


# ------------------------------------------------------------------------------------ MX
@pytest.mark.parametrize("T,H", [(s.tokens, s.hidden) for s in FAST.rmsnorm] +
                         [(t, 512) for t in ODD_T] + [(130, 2560)], ids=str)
def test_mx_bit_exact(rng, T, H):
    x = adversarial(rng, T, H)
    g = rng.standard_normal(H).astype(BF16)
    with target("trn3"):
        mx = run(x, g, quant="mx")
    data, scale = R.rmsnorm_quant_mx_ref(x, g)
    assert isinstance(mx, MXTensor) and mx.k == H and mx.fmt == "e4m3fn"
    assert mx.data.shape == (128, H // 512 * T) and mx.scale.shape == (64, -(-H // 2048) * T)
    assert_mx_equal(mx, data, scale, H)
    if T >= 5:   # NaN/inf rows: every block NaN (scale 0xFF); the zero row: data 0, scale 0
        _, sc = untile_layout(mx.data, mx.scale, H // 512)
        assert (sc[:, 3:5] == 255).all() and (sc[:, 0] == 0).all()
        assert not (sc[:, 5:] == 255).any()


def test_mx_large_h_single_buffered(rng):
    x = adversarial(rng, 7, 32768)
    g = rng.standard_normal(32768).astype(BF16)
    with target("trn3"):
        from nki_kernels.quant.rmsnorm_quant import plan_rmsnorm_quant
        assert not plan_rmsnorm_quant(7, 32768, "mx", False, 2, 221184).double
        mx = run(x, g, quant="mx")
    assert_mx_equal(mx, *R.rmsnorm_quant_mx_ref(x, g), 32768)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_mx_lone_tile_in_order(rng, residual):
    """One tile (T <= 128): the load and sum of squares in 1024-column chunks, the chunks
    quantized in order and stored slot by slot; H = 7168 is 14 chunks of 512, the last scale slot
    half full. Bit-exact, NaN / inf / zero rows included."""
    T, H = 128, 7168
    x = adversarial(rng, T, H)
    g = rng.standard_normal(H).astype(BF16)
    res = adversarial(rng, T, H, nonfinite=False) if residual else None
    with target("trn3"):
        out = run(x, g, residual=res, quant="mx")
    ref = R.rmsnorm_quant_mx_ref(x, g, residual=res)
    mx = out[0] if residual else out
    assert_mx_equal(mx, ref[0], ref[1], H)
    if residual:
        assert np.array_equal(canon_bf16(out[1]), canon_bf16(ref[2]))


def test_mx_lone_tile_engine_split(rng):
    """A lone tile leaves engines idle that a next tile would use: VectorE sums every other
    chunk's squares (ScalarE the rest), ScalarE makes one chunk of y1 = h * rstd in 4 and evicts
    one in 2, and the data goes out by hardware DGE (its own DMA ring, apart from the scale
    stores). Bit-exact, NaN / inf / zero rows included."""
    from nki_kernels.emulator.trace import trace
    T, H = 128, 4096
    x = adversarial(rng, T, H)
    g = rng.standard_normal(H).astype(BF16)
    with target("trn3"), trace() as tr:
        mx = run(x, g, quant="mx")
    assert_mx_equal(mx, *R.rmsnorm_quant_mx_ref(x, g), H)
    ops = [(ins.engine, ins.opcode, ins.attrs.get("op0") or ins.attrs.get("op")) for ins in tr]
    assert ops.count(("vector", "tensor_scalar_reduce", "square")) == 2     # of 4 load chunks
    assert sum(e == "scalar" and o == "activation" for e, o, _ in ops) == 2 + 2 + 4 * 4
    stores = [ins for ins in tr if ins.engine == "dma" and ins.writes[0].buffer.endswith("hbm")]
    data = [ins for ins in stores if ins.writes[0].dtype != "uint8"]
    assert len(data) == 2 and all(ins.attrs.get("dge") == "hwdge" for ins in data)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_mx_formats_residual_lnc2(rng, fmt):
    T, H = 300, 1024
    x, res = adversarial(rng, T, H), adversarial(rng, T, H)
    g = rng.standard_normal(H).astype(BF16)
    with target("trn3"):
        mx, r = run(x, g, residual=res, quant="mx", mx_fmt=fmt)
        mx2, r2 = run(x, g, residual=res, quant="mx", mx_fmt=fmt, lnc=2)
    data, scale, rr = R.rmsnorm_quant_mx_ref(x, g, residual=res, fmt=fmt)
    assert np.array_equal(canon_bf16(r), canon_bf16(rr))
    assert np.array_equal(canon_bf16(r2), canon_bf16(rr))
    assert_mx_equal(mx, data, scale, H)
    assert_mx_equal(mx2, data, scale, H)


def test_mx_blocks_match_instruction_reference(rng):
    """The MX block rule of reference.mxfp8_matmul agrees with reference.mx (the independent
    quantize_mx instruction reference) on the tile the kernel feeds to quantize_mx."""
    T, H = 64, 1024
    x = (rng.standard_normal((T, H)) * np.exp(rng.uniform(-20, 20, (T, 1)))).astype(BF16)
    g = rng.standard_normal(H).astype(BF16)
    y = R.rmsnorm_mx_values(x, g).astype(np.float32)                      # [T, H]
    data, scale = R.rmsnorm_quant_mx_ref(x, g)
    d, sc = untile_layout(data, scale, H // 512)
    for c in range(H // 512):
        tile = y[:, 512 * c:512 * c + 512].reshape(T, 128, 4).transpose(1, 0, 2).reshape(128, 4 * T)
        vals, s_ref = mxref.quantize_mx_tile(tile, "float8_e4m3fn")
        assert np.array_equal(s_ref, sc[16 * c:16 * c + 16])
        assert np.array_equal(mxref.pack_x4(vals, "float8_e4m3fn"), d[:, c, :])


def test_mx_accuracy_and_into_matmul(rng):
    """Dequantized MX rows track the fp32 RMSNorm; rmsnorm_quant(mx) -> mxfp8_matmul works."""
    T, H, N = 150, 1024, 384
    x = rng.standard_normal((T, H)).astype(BF16)
    g = (1 + 0.1 * rng.standard_normal(H)).astype(BF16)
    w = (rng.standard_normal((H, N)) / 32).astype(BF16)
    with target("trn3"):
        mx = run(x, g, quant="mx")
        c = mxfp8_matmul(mx, quantize_weights_mx(w), out_dtype="float32")
    y = R.rmsnorm_ref(x, g)
    yq = dequantize_mx_kmajor(mx.data, mx.scale, K=H).T                    # [T, H]
    # e4m3fn with the hardware's 2x scale keeps >= 2 mantissa bits: relative 2^-3 per element
    assert (np.abs(yq - y) <= 2.0 ** -3 * np.abs(y) + 2.0 ** -8 * np.abs(y).max(1, keepdims=True)
            ).all()
    assert cosine_similarity(c, y @ w.astype(np.float32)) > 0.998


# ------------------------------------------------------------------------------------ refusals
def test_refuses_mx_on_trn2(rng):
    x = rng.standard_normal((4, 512)).astype(BF16)
    with target("trn2"), pytest.raises(ValueError, match="quant='mx' .*needs Trn3"):
        rmsnorm_quant(x, np.ones(512, BF16), quant="mx")


def test_refuses_e4m3fn_on_trn2(rng):
    x = rng.standard_normal((4, 128)).astype(BF16)
    with target("trn2"), pytest.raises(ValueError, match="float8_e4m3fn.*needs Trn3"):
        rmsnorm_quant(x, np.ones(128, BF16), fp8_dtype="float8_e4m3fn")


@pytest.mark.parametrize("shape", ODD.rmsnorm, ids=lambda s: s.name)
def test_refuses_odd_tier_shapes(shape):
    """ODD tier: H=1000 and H=127 are not multiples of 128; T=0 is empty."""
    x = np.zeros((shape.tokens, shape.hidden), BF16)
    msg = r"T \(x.shape\[0\]\) must be >= 1" if shape.tokens == 0 else \
        r"H \(x.shape\[1\]\) must be a positive multiple of 128 for quant='fp8'; got"
    with pytest.raises(ValueError, match=msg):
        rmsnorm_quant(x, np.ones(shape.hidden, BF16))


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(x=np.zeros((4, 128), np.float32)), TypeError, "x must be bfloat16; got float32"),
    (dict(x=np.zeros((2, 4, 128), BF16)), ValueError, r"x must be 2-D \[T, H\]"),
    (dict(x=np.zeros((4, 256), BF16), quant="mx"), ValueError,
     "H .* must be a positive multiple of 512 for quant='mx'; got 256"),
    (dict(gamma=np.ones(64, BF16)), ValueError, "gamma must be 1-D of length H=128"),
    (dict(gamma=np.ones(128, np.float16)), TypeError, "gamma must be bfloat16 or float32"),
    (dict(residual=np.zeros((3, 128), BF16)), ValueError, "residual must have x's shape"),
    (dict(residual=np.zeros((4, 128), np.float32)), TypeError, "residual must be bfloat16"),
    (dict(eps=-1.0), ValueError, "rmsnorm_quant: eps must be a finite float > 0; got -1.0"),
    (dict(eps=0), ValueError, "rmsnorm_quant: eps must be a finite float > 0; got 0"),
    (dict(quant="int8"), ValueError, "quant must be 'fp8' or 'mx'; got 'int8'"),
    (dict(fp8_dtype="float8_e3m4"), ValueError, "fp8_dtype must be one of"),
    (dict(static_scale=0.0), ValueError, "static_scale must be a positive finite float"),
    (dict(static_scale=float("inf")), ValueError, "static_scale must be a positive finite"),
    (dict(static_scale=True), ValueError, "static_scale must be a positive finite float"),
    (dict(lnc=3), ValueError, "lnc must be 1 or 2; got 3"),
    (dict(x=np.zeros((4, 512), BF16), quant="mx", mx_fmt="e2m1"), ValueError,
     "mx_fmt must be 'e4m3fn' or 'e5m2'"),
    (dict(x=np.zeros((4, 512), BF16), quant="mx", static_scale=1.0), ValueError,
     "fp8_dtype and static_scale apply to quant='fp8' only"),
    (dict(x=np.zeros((4, 131072), BF16)), ValueError,
     "H=131072 needs .* bytes per partition of SBUF even single-buffered"),
])
def test_refusals(kwargs, exc, msg):
    x = kwargs.pop("x", np.zeros((4, 128), BF16))
    gamma = kwargs.pop("gamma", np.ones(x.shape[-1], BF16))
    with target("trn3"), pytest.raises(exc, match=msg):
        rmsnorm_quant(x, gamma, **kwargs)


def test_refuses_trn1_up_front():
    """Trn1 ran silently before; now one clear error before any kernel."""
    x = np.zeros((4, 128), BF16)
    with target("trn1"), pytest.raises(ValueError, match="rmsnorm_quant: target trn1 is not "
                                                         "supported; supported targets: trn2"):
        rmsnorm_quant(x, np.ones(128, BF16))


@pytest.mark.torch
def test_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    x = exact_rows(rng, 5, 256)
    g = rng.standard_normal(256).astype(np.float32)
    q, s = rmsnorm_quant(torch.from_numpy(x).to(torch.bfloat16),
                         torch.from_numpy(g).to(torch.bfloat16))
    qr, sr = R.rmsnorm_quant_fp8_ref(x.astype(BF16), g.astype(BF16))
    assert q.dtype == torch.float8_e4m3fn
    assert np.array_equal(canon_fp8(q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)),
                          canon_fp8(qr))
    assert_scales_equal(s.numpy(), sr)


@pytest.mark.torch
def test_torch_mx_into_matmul(rng):
    """CPU torch in, torch out, through rmsnorm_quant(mx) -> mxfp8_matmul."""
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((5, 1024)).astype(np.float32)
    w = (rng.standard_normal((1024, 256)) / 32).astype(np.float32)
    with target("trn3"):
        mx = rmsnorm_quant(torch.from_numpy(x).to(torch.bfloat16),
                           torch.ones(1024, dtype=torch.bfloat16), quant="mx")
        c = mxfp8_matmul(mx, quantize_weights_mx(torch.from_numpy(w)))
    assert isinstance(c, torch.Tensor) and c.dtype == torch.bfloat16 and tuple(c.shape) == (5, 256)
    y = R.rmsnorm_ref(x.astype(BF16), np.ones(1024, BF16))
    assert cosine_similarity(c.float().numpy(), y @ w) > 0.998
