"""The tiled matmul against its NumPy reference: bf16/fp16/fp32, FP8 double_row, odd and large
shapes, decode and prefill regimes, LNC=2, both targets, and every refusal."""
import ml_dtypes
import numpy as np
import pytest

from nki_kernels.dense.matmul import DECODE_M_MAX, matmul
from nki_kernels.emulator import target
from nki_kernels.reference.compare import assert_matmul_close
from nki_kernels.reference.matmul import matmul_ref
from nki_kernels.reference.shapes import DEFAULT, FAST, MODELS, ODD

BF16 = ml_dtypes.bfloat16


def _models(shapes_, default):
    """Every MODELS shape; those of the DEFAULT tier (one per kernel regime) run by default."""
    return [pytest.param(s, id=s.name, marks=() if s in default else pytest.mark.slow)
            for s in shapes_]


def _inputs(rng, M, K, N, dtype=BF16, scale=1.0):
    a = (rng.standard_normal((M, K)) * scale).astype(dtype)
    b = (rng.standard_normal((K, N)) * scale).astype(dtype)
    return a, b


@pytest.mark.parametrize("case", FAST.matmul + ODD.matmul, ids=lambda c: c.name)
def test_bf16_shapes(tgt, rng, case):
    M, K, N = case.M, case.K, case.N
    a, b = _inputs(rng, M, K, N)
    c = matmul(a, b)
    assert c.shape == (M, N) and c.dtype == BF16
    assert_matmul_close(c, a, b)


def test_reference_agrees_with_rule(rng):
    a, b = _inputs(rng, 64, 300, 200)
    assert_matmul_close(matmul_ref(a, b), a, b)


@pytest.mark.parametrize("dtype,out", [(np.float32, "float32"), (np.float16, "bfloat16"),
                                       (BF16, "float32")])
def test_dtypes(tgt, rng, dtype, out):
    a, b = _inputs(rng, 200, 384, 600, dtype)
    c = matmul(a, b, out_dtype=out)
    assert c.dtype == (np.float32 if out == "float32" else BF16)
    assert_matmul_close(c, a, b)


@pytest.mark.parametrize("fp8", ["float8_e4m3", "float8_e5m2"])
@pytest.mark.parametrize("M", [5, 130])
def test_fp8_double_row(tgt, rng, fp8, M):
    dtype = getattr(ml_dtypes, fp8)
    a, b = _inputs(rng, M, 300, 520, dtype)       # K=300: contraction padded to 512 with zeros
    c = matmul(a, b)
    assert_matmul_close(c, a, b)


def test_fp8_e4m3fn_trn3(rng):
    a, b = _inputs(rng, 140, 256, 256, ml_dtypes.float8_e4m3fn)
    with target("trn3"):
        assert_matmul_close(matmul(a, b), a, b)


@pytest.mark.parametrize("M", [1, 8, DECODE_M_MAX, DECODE_M_MAX + 1, 200])
def test_regimes_and_lnc2(tgt, rng, M):
    a, b = _inputs(rng, M, 384, 2100)
    c1 = matmul(a, b)
    c2 = matmul(a, b, lnc=2)
    assert_matmul_close(c1, a, b)
    np.testing.assert_array_equal(c1.view(np.uint16), c2.view(np.uint16))


def test_large_2048_cube(rng):
    a, b = _inputs(rng, 2048, 2048, 2048)
    with target("trn2"):
        c = matmul(a, b)
    assert_matmul_close(c, a, b)


@pytest.mark.parametrize("case", _models(MODELS.matmul, DEFAULT.matmul))
def test_model_shapes(rng, case):
    M, K, N = case.M, case.K, case.N
    a, b = _inputs(rng, M, K, N)
    assert_matmul_close(matmul(a, b), a, b)


def test_nonfinite_inputs_propagate(rng):
    a, b = _inputs(rng, 130, 256, 520)
    a[3, 7] = np.nan
    a[10, 0] = np.inf
    c = matmul(a, b, out_dtype="float32")
    ref = a.astype(np.float32) @ b.astype(np.float32)
    assert np.array_equal(np.isnan(c), np.isnan(ref))


# ---------------------------------------------------------------------------- refusals
def test_rejects_shape_mismatch(rng):
    a, b = _inputs(rng, 8, 64, 32)
    with pytest.raises(ValueError, match=r"a.shape\[1\] \(K=64\) must equal b.shape\[0\] \(K=32\)"):
        matmul(a, b[:32].T.copy())


def test_rejects_non_2d(rng):
    with pytest.raises(ValueError, match="must be 2-D"):
        matmul(np.zeros((2, 3, 4), BF16), np.zeros((4, 5), BF16))


def test_rejects_dtype_mix(rng):
    a, _ = _inputs(rng, 8, 64, 32)
    with pytest.raises(TypeError, match=r"b.dtype must equal a.dtype \(bfloat16\); got float32"):
        matmul(a, np.zeros((64, 32), np.float32))


def test_rejects_unsupported_dtype():
    with pytest.raises(TypeError, match="a.dtype must be one of .*; got int32"):
        matmul(np.zeros((8, 8), np.int32), np.zeros((8, 8), np.int32))


def test_rejects_bad_out_dtype(rng):
    a, b = _inputs(rng, 8, 64, 32)
    with pytest.raises(ValueError, match="out_dtype must be 'bfloat16' or 'float32'; got 'int8'"):
        matmul(a, b, out_dtype="int8")


@pytest.mark.parametrize("dt", [ml_dtypes.float8_e4m3, ml_dtypes.bfloat16, np.float32],
                         ids=["fp8", "bf16", "fp32"])
def test_rejects_trn1_up_front(rng, dt):
    """Every dtype is refused on Trn1 before any kernel runs (bf16 crashed inside the kernel,
    fp32 ran silently)."""
    a, b = _inputs(rng, 8, 64, 32, dt)
    with target("trn1"), pytest.raises(ValueError, match="matmul: target trn1 is not supported; "
                                                         "supported targets: trn2, trn3"):
        matmul(a, b)


def test_requires_grad_warns_once():
    """Inference-only: a tensor that requires grad is read detached, with one warning per op."""
    torch = pytest.importorskip("torch")
    from nki_kernels import _validate
    _validate._GRAD_WARNED.discard("matmul")
    a = torch.ones((8, 128), dtype=torch.float32, requires_grad=True)
    b = torch.ones((128, 16), dtype=torch.float32)
    with pytest.warns(UserWarning, match="matmul: nki-kernels ops are inference-only"):
        c = matmul(a, b)
    assert np.asarray(c).shape == (8, 16)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        matmul(a, b)                                  # once: no second warning


def test_rejects_e4m3fn_on_trn2(rng):
    a, b = _inputs(rng, 8, 64, 32, ml_dtypes.float8_e4m3fn)
    with target("trn2"), pytest.raises(ValueError, match="float8_e4m3fn inputs need Trn3"):
        matmul(a, b)


def test_rejects_bad_lnc(rng):
    a, b = _inputs(rng, 8, 64, 32)
    with pytest.raises(ValueError, match="lnc must be 1 or 2; got 4"):
        matmul(a, b, lnc=4)
