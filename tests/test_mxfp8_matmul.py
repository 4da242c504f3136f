"""mxfp8_matmul against its NumPy reference: bf16 and pre-quantized operands in every combination,
e4m3fn / e5m2, odd M, N and K, adversarial values, LNC=2, the offline weight quantizer's bytes,
the in-kernel quantize_mx bytes, the Trn2 refusal and every other refusal.

Accuracy (docs/testing.md, quantized matmul): the global similarity with the bf16 product, and the
max error against the fp32 product of the *dequantized* inputs bounded by the fp32 accumulation
rule of reference.compare (the MX matmul must be exact up to accumulation order).
"""
import warnings

import ml_dtypes
import numpy as np
import pytest

from nki_kernels.emulator import target
from nki_kernels.quant.mxfp8_matmul import MXTensor, mxfp8_matmul, quantize_weights_mx
from nki_kernels.reference import mx as mxref
from nki_kernels.reference.compare import assert_matmul_close, cosine_similarity
from nki_kernels.reference.mxfp8_matmul import (
    dequantize_mx_kmajor,
    mxfp8_matmul_ref,
    quantize_mx_kmajor,
    untile_layout,
)
from nki_kernels.reference.shapes import DEFAULT, FAST, MODELS, ODD

BF16 = ml_dtypes.bfloat16


def _models(shapes_, default):
    """Every MODELS shape; those of the DEFAULT tier (one per kernel regime) run by default."""
    return [pytest.param(s, id=s.name, marks=() if s in default else pytest.mark.slow)
            for s in shapes_]


def inputs(rng, M, K, N, scale=1.0):
    a = (rng.standard_normal((M, K)) * scale).astype(BF16)
    b = (rng.standard_normal((K, N)) * scale).astype(BF16)
    return a, b


def mx_of(x, fmt="e4m3fn"):
    """Reference MX quantization of a [K, F] matrix (contraction first) as an MXTensor."""
    d, s = quantize_mx_kmajor(np.asarray(x).astype(np.float32), fmt)
    return MXTensor(d, s, fmt, x.shape[0])


def mm(*args, **kw):
    with target("trn3"), warnings.catch_warnings():
        # the emulator's NumPy warns on inf * 0 and on 2**(255-127) before it masks a NaN scale
        # (NaN/inf inputs); a process-wide filter because LNC=2 programs run in threads
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
        warnings.filterwarnings("ignore", "overflow encountered in ldexp", RuntimeWarning)
        return mxfp8_matmul(*args, **kw)


# ------------------------------------------------------------------------------------ accuracy
@pytest.mark.parametrize("case", FAST.mx_matmul + ODD.mx_matmul, ids=lambda c: c.name)
@pytest.mark.parametrize("form", ["bf16", "mx"])
def test_shapes(rng, case, form):
    M, K, N = case.M, case.K, case.N
    a, b = inputs(rng, M, K, N)
    x, y = (a, b) if form == "bf16" else (mx_of(a.T), mx_of(b))
    c = mm(x, y, out_dtype="float32")
    ref, da, db = mxfp8_matmul_ref(a, b, out_dtype="float32")
    assert c.shape == (M, N) and c.dtype == np.float32
    assert_matmul_close(c, da, db)                      # vs fp32 product of dequantized inputs
    exact = a.astype(np.float32) @ b.astype(np.float32)
    assert cosine_similarity(c, exact) > 0.998          # global similarity, e4m3fn
    cb = mm(x, y)                                        # default bf16 output
    assert cb.dtype == BF16
    assert_matmul_close(cb, da, db)


def test_operand_forms_agree(rng):
    """bf16 operands quantized in the kernel give exactly the result of pre-quantized ones."""
    M, K, N = 130, 1536, 300
    a, b = inputs(rng, M, K, N)
    outs = [mm(x, y, out_dtype="float32") for x in (a, mx_of(a.T)) for y in (b, mx_of(b))]
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])


@pytest.mark.parametrize("M", [1, 16, 40, 100])
def test_decode_paths(rng, M):
    """One A tile (decode): B scales partly staged and shuffled down a quadrant, output columns
    in 4 / 2 / 1 quadrant slots, a bf16 A tile spread over quadrants or halves; a partial last
    chunk (K = 4.75 x 512) and a ragged last B tile. Every operand form gives the same bits."""
    K, N = 2432, 1100
    a, b = inputs(rng, M, K, N)
    ref, da, db = mxfp8_matmul_ref(a, b, out_dtype="float32")
    outs = [mm(x, y, out_dtype="float32") for x in (a, mx_of(a.T)) for y in (b, mx_of(b))]
    assert_matmul_close(outs[0], da, db)
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])


@pytest.mark.parametrize("side", ["a", "b"])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_in_kernel_quantization_is_exact(rng, side, fmt):
    """quantize_mx inside the kernel reproduces the reference bytes: against an identity the
    product returns the dequantized operand exactly (one nonzero product per output)."""
    K, F = 640, 70                                        # partial chunk, odd width
    x = (rng.standard_normal((F, K)) * np.exp(rng.uniform(-30, 30, (F, 1)))).astype(BF16)
    x[3, 100:132] = 0.0
    x[5, 7] = 2.0 ** -133                                 # bf16 subnormal
    eye = np.eye(K, dtype=np.float32).astype(BF16)
    if side == "a":
        c = mm(x, eye, out_dtype="float32", fmt=fmt)                    # = deq(A) [F, K]
        want = dequantize_mx_kmajor(*quantize_mx_kmajor(x.astype(np.float32).T, fmt), fmt, K).T
    else:
        c = mm(eye, np.ascontiguousarray(x.T), out_dtype="float32", fmt=fmt)   # = deq(B) [K, F]
        want = dequantize_mx_kmajor(*quantize_mx_kmajor(x.astype(np.float32).T, fmt), fmt, K)
    assert np.array_equal(c, want)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_quantize_weights_bytes(rng, fmt):
    """The offline quantizer (its own implementation) matches the reference byte for byte,
    including zeros, subnormals, huge values, NaN/inf blocks and K padding to 512."""
    K, N = 896, 260
    w = (rng.standard_normal((K, N)) * np.exp(rng.uniform(-40, 40, (1, N)))).astype(np.float32)
    w[0:32, 0] = 0.0
    w[40, 1] = np.nan
    w[70, 2] = -np.inf
    w[:, 3] = 1e-42                                        # fp32 subnormal
    w[:, 4] = 3e38
    q = quantize_weights_mx(w, fmt=fmt)
    d, s = quantize_mx_kmajor(w, fmt)
    assert q.k == K and q.fmt == fmt and q.shape == (K, N)
    assert np.array_equal(q.scale, s) and np.array_equal(q.data, d)
    sc = untile_layout(q.data, q.scale, q.kt)[1]
    assert sc[1, 1] == 255 and sc[2, 2] == 255 and sc[0, 0] == 0


def test_reference_matches_instruction_reference(rng):
    """reference.mxfp8_matmul's block rule agrees with reference.mx (quantize_mx's reference)."""
    K, F = 1024, 9
    X = (rng.standard_normal((K, F)) * np.exp(rng.uniform(-20, 20, (K, 1)))).astype(np.float32)
    for fmt in ("e4m3fn", "e5m2"):
        d, sc = untile_layout(*quantize_mx_kmajor(X, fmt), 2)
        for c in range(2):
            tile = X[512 * c:512 * (c + 1)].reshape(128, 4, F).transpose(0, 2, 1)
            tile = tile.reshape(128, 4 * F)
            vals, s = mxref.quantize_mx_tile(tile, "float8_" + fmt)
            assert np.array_equal(s, sc[16 * c:16 * c + 16])
            assert np.array_equal(mxref.pack_x4(vals, "float8_" + fmt), d[:, c, :])


def test_formats_mixed_and_e5m2(rng):
    M, K, N = 64, 1024, 256
    a, b = inputs(rng, M, K, N)
    c = mm(mx_of(a.T, "e4m3fn"), mx_of(b, "e5m2"), out_dtype="float32")
    ref, da, db = mxfp8_matmul_ref(a, b, a_fmt="e4m3fn", b_fmt="e5m2", out_dtype="float32")
    assert_matmul_close(c, da, db)
    c5 = mm(a, b, fmt="e5m2", out_dtype="float32")
    ref5, da5, db5 = mxfp8_matmul_ref(a, b, fmt="e5m2", out_dtype="float32")
    assert_matmul_close(c5, da5, db5)
    assert cosine_similarity(c5, a.astype(np.float32) @ b.astype(np.float32)) > 0.99


def test_adversarial_values(rng):
    """Zeros, subnormals, values far past the fp8 range (MX scales absorb them), NaN and inf:
    NaN/inf positions of C match the reference (a non-finite value poisons its block)."""
    M, K, N = 20, 512, 136
    a, b = inputs(rng, M, K, N)
    a[0] = 0.0
    a[1] = 2.0 ** -133
    a[2] *= 1e30
    a[3, 5] = np.nan
    b[100, 7] = np.inf
    b[:, 9] = 1e-30
    c = mm(a, b, out_dtype="float32")
    ref, da, db = mxfp8_matmul_ref(a, b, out_dtype="float32")
    assert np.isnan(c[3]).all() and np.isnan(c[:, 7]).all()
    assert (np.delete(c[0], 7) == 0).all()
    assert_matmul_close(c, da, db)


def test_lnc2(rng):
    M, K, N = 129, 1024, 1100                        # split over B blocks
    a, b = inputs(rng, M, K, N)
    c1 = mm(a, b, out_dtype="float32")
    c2 = mm(a, mx_of(b), out_dtype="float32", lnc=2)
    ref, da, db = mxfp8_matmul_ref(a, b, out_dtype="float32")
    assert_matmul_close(c1, da, db)
    assert_matmul_close(c2, da, db)
    d1 = mm(a[:5], b[:, :200], lnc=2)                # one B block: split over A tiles
    assert_matmul_close(d1, da[:5], db[:, :200])


@pytest.mark.parametrize("case", _models(MODELS.mx_matmul, DEFAULT.mx_matmul))
def test_model_shapes(rng, case):
    a, b = inputs(rng, case.M, case.K, case.N)
    c = mm(mx_of(a.T), quantize_weights_mx(b), out_dtype="float32")
    ref, da, db = mxfp8_matmul_ref(a, b, out_dtype="float32")
    assert_matmul_close(c, da, db)


@pytest.mark.torch
def test_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    a, b = inputs(rng, 8, 512, 128)
    ta = torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    tb = torch.from_numpy(b.astype(np.float32)).to(torch.bfloat16)
    c = mm(ta, quantize_weights_mx(tb), out_dtype="float32")
    ref, da, db = mxfp8_matmul_ref(a, b, out_dtype="float32")
    assert isinstance(c, torch.Tensor)
    assert_matmul_close(c.numpy(), da, db)


# ------------------------------------------------------------------------------------ refusals
def test_refuses_trn2(rng):
    a, b = inputs(rng, 8, 512, 128)
    with target("trn2"), pytest.raises(ValueError, match="needs Trn3 .*On Trn2 use matmul"):
        mxfp8_matmul(a, b)


def _mx(K=512, F=8, **kw):
    d, s = quantize_mx_kmajor(np.ones((K, F), np.float32))
    base = dict(data=d, scale=s, fmt="e4m3fn", k=K)
    base.update(kw)
    return MXTensor(**base)


@pytest.mark.parametrize("a,b,kw,exc,msg", [
    (np.zeros((8, 512), BF16), np.zeros((256, 16), BF16), {}, ValueError,
     "contraction lengths differ: a has K=512, b has K=256"),
    (np.zeros((8, 200), BF16), np.zeros((200, 16), BF16), {}, ValueError,
     "K must be a multiple of 128 .*got K=200"),
    (np.zeros((8, 512), np.float32), np.zeros((512, 16), BF16), {}, TypeError,
     "a must be bfloat16 .* or an MXTensor .*got float32"),
    (np.zeros((2, 8, 512), BF16), np.zeros((512, 16), BF16), {}, ValueError,
     "a must be a 2-D bfloat16 array or an MXTensor"),
    ((np.zeros((128, 8), np.uint32), np.zeros((64, 8), np.uint8)), np.zeros((512, 16), BF16), {},
     ValueError, "a must be a 2-D bfloat16 array or an MXTensor; got tuple"),
    (np.zeros((8, 512), BF16), np.zeros((512, 16), BF16), {"out_dtype": "float16"}, ValueError,
     "out_dtype must be 'bfloat16' or 'float32'; got 'float16'"),
    (np.zeros((8, 512), BF16), np.zeros((512, 16), BF16), {"fmt": "e2m1"}, ValueError,
     "fmt must be one of e4m3fn, e5m2; got 'e2m1'"),
    (np.zeros((8, 512), BF16), np.zeros((512, 16), BF16), {"lnc": 4}, ValueError,
     "lnc must be 1 or 2; got 4"),
    (np.zeros((8, 512), BF16), _mx(data=np.zeros((128, 8), np.int32)), {}, ValueError,
     r"b.data must be uint32 \[128, KT\*F\]"),
    (np.zeros((8, 512), BF16), _mx(scale=np.zeros((16, 8), np.uint8)), {}, ValueError,
     r"b.scale must be uint8 \[64, SL\*F\] = \[64, 8\]"),
    (np.zeros((8, 512), BF16), _mx(fmt="e3m2"), {}, ValueError, "b.fmt must be one of"),
    (np.zeros((8, 512), BF16), _mx(k=0), {}, ValueError, "b.k must be >= 1; got 0"),
    (np.zeros((8, 1024), BF16), _mx(k=1024, data=np.zeros((128, 7), np.uint32)), {}, ValueError,
     r"b.data must be uint32 \[128, KT\*F\] .*KT = ceil\(k/512\) = 2"),
    (np.zeros((8, 512 * 600), BF16), np.zeros((512 * 600, 16), BF16), {}, ValueError,
     "K=307200 is too large for one resident B block"),
])
def test_refusals(a, b, kw, exc, msg):
    with target("trn3"), pytest.raises(exc, match=msg):
        mxfp8_matmul(a, b, **kw)


@pytest.mark.parametrize("w,kw,exc,msg", [
    (np.zeros((4, 8, 8), np.float32), {}, ValueError, r"w must be 2-D \[K, N\]"),
    (np.zeros((200, 8), np.float32), {}, ValueError, "K must be a positive multiple of 128"),
    (np.zeros((128, 8), np.int32), {}, TypeError, "w must be a float array"),
    (np.zeros((128, 8), np.float32), {"fmt": "int8"}, ValueError, "fmt must be one of"),
])
def test_quantize_weights_refusals(w, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        quantize_weights_mx(w, **kw)
