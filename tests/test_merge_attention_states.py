"""merge_attention_states against its NumPy reference, -inf sides, odd row counts, and the
flash-decoding identity: attention over keys [0, a) merged with attention over [a, L) equals
attention over [0, L) (decode_attention on two slices of a contiguous cache, sinks in one part).
"""
import ml_dtypes
import numpy as np
import pytest

from nki_kernels import decode_attention, merge_attention_states
from nki_kernels.reference.compare import assert_attention_close
from nki_kernels.reference.decode_attention import decode_attention_ref
from nki_kernels.reference.merge_attention_states import (
    bytes_merge_attention_states,
    merge_attention_states_ref,
)

BF16 = ml_dtypes.bfloat16


@pytest.mark.parametrize("shape, dt", [((2, 1, 8, 128), BF16), ((300, 64), np.float32),
                                       ((3, 5, 17, 256), np.float16), ((2100, 128), BF16)])
def test_against_reference(tgt, rng, shape, dt):
    oa = rng.standard_normal(shape).astype(dt)
    ob = rng.standard_normal(shape).astype(dt)
    la = (rng.standard_normal(shape[:-1]) * 5).astype(np.float32)
    lb = (rng.standard_normal(shape[:-1]) * 5).astype(np.float32)
    flat_a, flat_b = la.reshape(-1), lb.reshape(-1)
    flat_a[::7] = -np.inf                       # side a saw no key
    flat_b[::11] = -np.inf                      # side b saw no key (some rows: neither)
    o, lse = merge_attention_states(oa, la, ob, lb)
    ro, rl = merge_attention_states_ref(oa, la, ob, lb)
    assert o.shape == shape and o.dtype == oa.dtype and lse.dtype == np.float32
    assert np.array_equal(np.isneginf(lse), np.isneginf(rl))
    fin = np.isfinite(rl)
    np.testing.assert_allclose(lse[fin], rl[fin], rtol=0, atol=1e-5)
    u = 2.0 ** -8 if dt != np.float32 else 2.0 ** -20
    err = np.abs(o.astype(np.float32) - ro.astype(np.float32))
    mag = np.abs(oa.astype(np.float32)).max() + np.abs(ob.astype(np.float32)).max()
    assert err.max() <= 2 * u * mag
    both = np.isneginf(la) & np.isneginf(lb)
    assert np.all(o[both].astype(np.float32) == 0)


def test_split_equals_unsplit(tgt, rng):
    """Flash-decoding: decode over keys [0, a) and [a, L) of one cache, merged, equals decode
    over [0, L); the sinks join one part only."""
    B, Hq, Hkv, d, L, a = 2, 8, 2, 128, 700, 300
    q = rng.standard_normal((B, 1, Hq, d)).astype(BF16)
    k = rng.standard_normal((B, L, Hkv, d)).astype(BF16)
    v = rng.standard_normal((B, L, Hkv, d)).astype(BF16)
    sinks = np.linspace(-2, 2, Hq).astype(np.float32)
    oa, la = decode_attention(q, k[:, :a], v[:, :a], [a, a], sinks=sinks, return_lse=True)
    ob, lb = decode_attention(q, np.ascontiguousarray(k[:, a:]), np.ascontiguousarray(v[:, a:]),
                              [L - a, L - a], return_lse=True)
    o, lse = merge_attention_states(oa, la, ob, lb)
    full, flse = decode_attention(q, k, v, [L, L], sinks=sinks, return_lse=True)
    exact, else_ = decode_attention_ref(q, k, v, [L, L], sinks=sinks, return_lse=True,
                                        compute_dtype=np.float64)
    same = decode_attention_ref(q, k, v, [L, L], sinks=sinks, p_dtype="bfloat16")
    # the parts' outputs are rounded to bf16 before the merge: one more rounding than unsplit
    assert_attention_close(o, same, exact, floor=4e-3)
    np.testing.assert_allclose(lse, flse, rtol=0, atol=1e-4)
    np.testing.assert_allclose(lse, else_, rtol=0, atol=1e-4)
    np.testing.assert_allclose(o.astype(np.float32), full.astype(np.float32), rtol=0, atol=8e-3)


def test_bytes():
    assert bytes_merge_attention_states(10, 64, 2) == 3 * 10 * (128 + 4)


@pytest.mark.parametrize("args, err, msg", [
    (dict(o_b=np.zeros((2, 4, 64), BF16)), ValueError, "same shape"),
    (dict(lse_a=np.zeros((2, 4), np.float32)), ValueError, "lse_a must have shape"),
    (dict(lse_b=np.zeros((2, 3), np.float16)), TypeError, "lse_b.dtype must be float32"),
    (dict(o_a=np.zeros((2, 3, 64), np.int32), o_b=np.zeros((2, 3, 64), np.int32)), TypeError,
     "share one dtype"),
    (dict(o_a=np.zeros((2, 3, 1024), BF16), o_b=np.zeros((2, 3, 1024), BF16)), ValueError,
     "1..512"),
    (dict(o_a=np.zeros((5,), BF16), o_b=np.zeros((5,), BF16)), ValueError, "at least 2-D"),
])
def test_refusals(args, err, msg):
    kw = dict(o_a=np.zeros((2, 3, 64), BF16), lse_a=np.zeros((2, 3), np.float32),
              o_b=np.zeros((2, 3, 64), BF16), lse_b=np.zeros((2, 3), np.float32))
    kw.update(args)
    with pytest.raises(err, match=msg):
        merge_attention_states(**kw)
