"""Numerics of the core nki.isa instructions against hand-written NumPy expectations.

Inputs are chosen so that the fp32 expectation is exact (small integers, powers of two) wherever
the instruction's result is compared bit for bit; transcendental activations use a tolerance.
References: the NKI API reference (nki.isa instructions, dtypes and casts), AWS Neuron documentation.
"""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from kernel_helpers import in_kernel, load, val

from nki_kernels.emulator import NkiRuntimeError, jit
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator.isa import NkiHardwareWarning

BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(1234)




def ints(shape, lo=-8, hi=9, dtype=np.float32):
    return RNG.integers(lo, hi, size=shape).astype(dtype)


def bf16_rne_bits(x):
    """fp32 -> bf16 bits, round to nearest even, written out by hand (finite inputs)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


# ============================================================================== nc_matmul
def test_matmul_is_stationary_transpose_times_moving():
    K, S, Mv = 32, ints((32, 2, 8)), ints((32, 4, 6))   # M = 16, N = 24 after flattening

    def body(s_h, m_h):
        p = nl.ndarray((16, 4, 6), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(p, load(s_h), load(m_h))
        return val(p)
    got = in_kernel(body, S, Mv)
    exp = S.reshape(K, 16).T @ Mv.reshape(K, 24)
    np.testing.assert_array_equal(got.reshape(16, 24), exp)


def test_matmul_positional_args_and_bf16_inputs_round_first():
    x = RNG.standard_normal((16, 8)).astype(np.float32)
    y = RNG.standard_normal((16, 12)).astype(np.float32)

    def body(a, b):
        p = nl.ndarray((8, 12), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(p, load(a, nl.bfloat16), load(b, nl.bfloat16))
        return val(p)
    got = in_kernel(body, x, y)
    xb = x.astype(BF16).astype(np.float64)
    yb = y.astype(BF16).astype(np.float64)
    np.testing.assert_allclose(got, xb.T @ yb, rtol=1e-6, atol=1e-6)


def test_matmul_accumulate_none_first_write_overwrites_then_accumulates():
    """K loop without memset: the PSUM tile starts as NaN; the first matmul overwrites."""
    S, Mv = ints((3, 16, 8)), ints((3, 16, 10))

    def body(s_h, m_h):
        outs = []
        for _ in range(2):
            p = nl.ndarray((8, 10), nl.float32, buffer=nl.psum)   # fresh every time
            for k in range(3):
                nisa.nc_matmul(p, load(s_h[k]), load(m_h[k]))
            outs.append(val(p))
        return outs
    outs = in_kernel(body, S, Mv)
    exp = sum(S[k].T @ Mv[k] for k in range(3))
    for o in outs:
        np.testing.assert_array_equal(o, exp)


def test_matmul_accumulate_none_tracks_overlapping_regions_per_element():
    S, Mv = ints((8, 4)), ints((8, 6))

    def body(s_h, m_h):
        s, m = load(s_h), load(m_h)
        p = nl.ndarray((4, 10), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(p[:, 0:6], s, m)
        nisa.nc_matmul(p[:, 3:9], s, m)        # overlaps columns 3..5 only
        return val(p)
    got = in_kernel(body, S, Mv)
    r = S.T @ Mv
    exp = np.full((4, 10), np.nan, np.float32)
    exp[:, 0:6] = r
    exp[:, 3:6] += r[:, 0:3]
    exp[:, 6:9] = r[:, 3:6]
    np.testing.assert_array_equal(got, exp)     # column 9 never written: still NaN


def test_matmul_after_non_matmul_write_overwrites_those_elements():
    S, Mv = ints((8, 4)), ints((8, 6))

    def body(s_h, m_h):
        s, m = load(s_h), load(m_h)
        p = nl.ndarray((4, 6), nl.float32, buffer=nl.psum)
        nisa.memset(p, 100.0)
        nisa.nc_matmul(p, s, m)                  # memset is not a matmul write: overwrite
        first = val(p)
        nisa.memset(p[:, 0:2], 7.0)              # clears the 'matmul-written' state there
        nisa.nc_matmul(p, s, m)                  # cols 0..1 overwritten, 2..5 accumulate
        return first, val(p)
    first, second = in_kernel(body, S, Mv)
    r = S.T @ Mv
    np.testing.assert_array_equal(first, r)
    exp = 2 * r
    exp[:, 0:2] = r[:, 0:2]
    np.testing.assert_array_equal(second, exp)


def test_matmul_accumulate_true_and_false():
    S, Mv = ints((8, 4)), ints((8, 6))

    def body(s_h, m_h):
        s, m = load(s_h), load(m_h)
        p = nl.ndarray((4, 6), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(p, s, m, accumulate=False)
        nisa.nc_matmul(p, s, m, accumulate=True)
        nisa.nc_matmul(p, s, m, accumulate=True)
        three = val(p)
        nisa.nc_matmul(p, s, m, accumulate=False)
        return three, val(p)
    three, one = in_kernel(body, S, Mv)
    r = S.T @ Mv
    np.testing.assert_array_equal(three, 3 * r)
    np.testing.assert_array_equal(one, r)


def test_matmul_accumulate_true_on_unwritten_psum_warns():
    def body():
        s = nl.ndarray((4, 4), nl.float32)
        m = nl.ndarray((4, 8), nl.float32)
        nisa.memset(s, 1.0)
        nisa.memset(m, 1.0)
        p = nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
        nisa.memset(p, 1.0)
        with pytest.warns(NkiHardwareWarning, match="accumulate=True"):
            nisa.nc_matmul(p, s, m, accumulate=True)
        return val(p)
    np.testing.assert_array_equal(in_kernel(body), np.full((4, 8), 5.0, np.float32))


def test_matmul_fp8_double_row_trn2():
    """perf_mode=double_row: stationary [K,2,M], moving [K,2,N]; contraction over (k, r)."""
    K, M, N = 16, 8, 12
    S, Mv = ints((K, 2, M), -4, 5), ints((K, 2, N), -4, 5)   # exact in e4m3 / e5m2

    def body(s_h, m_h):
        s = load(s_h, nl.float8_e4m3)
        m = load(m_h, nl.float8_e5m2)
        p = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(p, s, m, perf_mode=nisa.matmul_perf_mode.double_row)
        q = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(q, s, m, perf_mode="double_row")      # string spelling accepted
        return val(p), val(q)
    p, q = in_kernel(body, S, Mv, tgt="trn2")
    exp = np.zeros((M, N), np.float32)
    for k in range(K):
        for r in range(2):
            exp += np.outer(S[k, r], Mv[k, r])
    np.testing.assert_array_equal(p, exp)
    np.testing.assert_array_equal(q, exp)


def test_matmul_bf16_psum_dst_trn3_rounds_each_write():
    """gen4 bf16 PSUM: fp32 result rounded RNE on write; accumulation upcasts, adds, rounds."""
    S = RNG.integers(1, 40, size=(16, 4)).astype(np.float32)
    Mv = RNG.integers(1, 40, size=(16, 8)).astype(np.float32)

    def body(s_h, m_h):
        s, m = load(s_h, nl.bfloat16), load(m_h, nl.bfloat16)
        p = nl.ndarray((4, 8), nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(p, s, m)
        once = val(p)
        nisa.nc_matmul(p, s, m)
        return once, val(p)
    once, twice = in_kernel(body, S, Mv)
    r = S.T @ Mv                                   # exact in fp32 (small ints)
    once_bits = bf16_rne_bits(r)
    assert once.dtype == BF16
    np.testing.assert_array_equal(once.view(np.uint16), once_bits)
    once_f = (once_bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(twice.view(np.uint16), bf16_rne_bits(once_f + r))
    assert not np.array_equal(once_f, r)           # the data really exercised rounding


def test_matmul_n1024_fp32_on_trn3():
    S, Mv = ints((4, 2)), ints((4, 1024))

    def body(s_h, m_h):
        p = nl.ndarray((2, 1024), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(p, load(s_h), load(m_h))
        return val(p)
    np.testing.assert_array_equal(in_kernel(body, S, Mv), S.T @ Mv)


@pytest.mark.parametrize("tgt", ["trn2", "trn3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_matmul_is_transpose_bit_exact_with_nan_inf(tgt, dtype):
    npd = {"float32": np.float32, "bfloat16": BF16, "float16": np.float16}[dtype]
    ubits = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}[dtype]
    x = RNG.standard_normal((16, 8)).astype(np.float32).astype(npd)
    x[0, 0], x[1, 2], x[3, 3], x[5, 7] = np.nan, np.inf, -np.inf, -0.0
    if dtype == "float32":
        x.view(np.uint32)[2, 2] = 0x7FC00123          # NaN payload must survive
    x.view(ubits)[4, 4] = 1                           # smallest subnormal

    def body(h):
        d = nl.ndarray((16, 8), getattr(nl, dtype))
        nisa.dma_copy(dst=d, src=h)
        ident = nl.shared_identity_matrix(16, getattr(nl, dtype))
        p = nl.ndarray((8, 16), getattr(nl, dtype), buffer=nl.psum)
        nisa.nc_matmul(p, d, ident, is_transpose=True)
        return val(p)
    got = in_kernel(body, x, tgt=tgt)
    np.testing.assert_array_equal(got.view(ubits), x.T.view(ubits))


# ============================================================================== nc_transpose
@pytest.mark.parametrize("eng,shape,dst_buf", [("tensor", (64, 48), "psum"),
                                               ("vector", (32, 20), "sbuf"),
                                               ("vector", (16, 32), "psum"),
                                               ("unknown", (8, 8), "sbuf"),
                                               ("unknown", (100, 40), "psum")])
def test_nc_transpose(eng, shape, dst_buf):
    x = RNG.standard_normal(shape).astype(np.float32)
    x[0, 1] = np.nan
    x[1, 0] = -np.inf

    def body(h):
        d = load(h)
        o = nl.ndarray(shape[::-1], nl.float32, buffer=getattr(nl, dst_buf))
        ins = nisa.nc_transpose(o, d, engine=getattr(nisa.engine, eng))
        return val(o), ins
    got, ins = in_kernel(body, x)
    np.testing.assert_array_equal(got.view(np.uint32), x.T.view(np.uint32))
    assert ins.opcode == "nc_transpose"


def test_nc_transpose_int_and_3d_input():
    x = RNG.integers(-2**31, 2**31 - 1, size=(8, 2, 3), dtype=np.int64).astype(np.int32)

    def body(h):
        o = nl.ndarray((6, 8), nl.int32)
        nisa.nc_transpose(o, load(h), engine=nisa.engine.vector)
        return val(o)
    np.testing.assert_array_equal(in_kernel(body, x), x.reshape(8, 6).T)


# ============================================================================== dma_copy
def test_dma_copy_all_directions_and_reshaped_counts():
    x = RNG.standard_normal((8, 12)).astype(np.float32)

    @jit
    def k(a):
        s1 = nl.ndarray((8, 12), nl.float32)
        nisa.dma_copy(dst=s1, src=a)                          # HBM -> SBUF
        s2 = nl.ndarray((4, 24), nl.float32)
        nisa.dma_copy(s2, s1)                                 # SBUF -> SBUF, other shape
        h = nl.ndarray((96,), nl.float32, buffer=nl.hbm)
        nisa.dma_copy(dst=h, src=s2)                          # SBUF -> HBM (1-D)
        out = nl.ndarray((8, 12), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=h)                         # HBM -> HBM
        out2 = nl.ndarray((12, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out2, src=a.permute((1, 0)))        # strided HBM -> HBM
        return out, out2
    o1, o2 = k(x)
    np.testing.assert_array_equal(o1, x)
    np.testing.assert_array_equal(o2, x.T)


def test_dma_cast_fp32_to_bf16_rne():
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 3.0],
                    dtype=np.float32)
    rand = RNG.standard_normal(59).astype(np.float32)
    x = np.concatenate([ties, rand]).reshape(4, 16)

    def body(h):
        return val(load(h, nl.bfloat16))
    got = in_kernel(body, x).view(np.uint16).reshape(-1)
    assert got[:5].tolist() == [0x3F80, 0x3F82, 0xBF80, 0x3F81, 0x4040]
    np.testing.assert_array_equal(got, bf16_rne_bits(x.reshape(-1)))


def test_dma_cast_to_int8_rne_saturating_and_int_to_float():
    x = np.array([[2.5, 3.5, -2.5, 300.0, -300.0, 0.5, 1.5, -0.49]], np.float32)
    big = np.array([[2**24 + 1, -7, 2**31 - 1, 5]], np.int32)

    def body(h, b):
        return val(load(h, nl.int8)), val(load(h, nl.uint8)), val(load(b, nl.float32))
    i8, u8, f = in_kernel(body, x, big)
    assert i8.tolist() == [[2, 4, -2, 127, -128, 0, 2, 0]]
    assert u8.tolist() == [[2, 4, 0, 255, 0, 0, 2, 0]]
    assert f.tolist() == [[16777216.0, -7.0, 2147483648.0, 5.0]]


def test_dma_hwdge_same_dtype_raw_copy():
    x = RNG.integers(0, 2**16, size=(4, 8)).astype(np.uint16)

    def body(h):
        t = nl.ndarray((4, 8), nl.uint16)
        nisa.dma_copy(dst=t, src=h, dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.sync)
        b = nl.ndarray((4, 8), nl.bfloat16)
        nisa.dma_copy(dst=b.view(nl.uint16), src=t, dge_mode=nisa.dge_mode.hwdge)
        return val(t), val(b)
    t, b = in_kernel(body, x, tgt="trn2")
    np.testing.assert_array_equal(t, x)
    np.testing.assert_array_equal(b.view(np.uint16), x)


DATA = np.arange(40 * 6, dtype=np.float32).reshape(40, 6)


def _gather(d, ix, oob):
    i_sb = load(ix)
    rows = nl.ndarray((4, 6), nl.float32)
    nisa.memset(rows, -1.0)
    nisa.dma_copy(dst=rows, src=d.ap([[6, 4], [1, 6]], offset=0, vector_offset=i_sb,
                                     indirect_dim=0), oob_mode=oob)
    return val(rows)


def test_dma_indirect_gather():
    idx = np.array([[3], [0], [39], [7]], np.int32)
    got = in_kernel(lambda d, ix: _gather(d, ix, nisa.oob_mode.error), DATA, idx)
    np.testing.assert_array_equal(got, DATA[[3, 0, 39, 7]])


def test_dma_indirect_gather_oob_skip_leaves_rows_untouched():
    idx = np.array([[3], [40], [39], [-1]], np.int32)
    got = in_kernel(lambda d, ix: _gather(d, ix, nisa.oob_mode.skip), DATA, idx)
    exp = np.full((4, 6), -1.0, np.float32)
    exp[0], exp[2] = DATA[3], DATA[39]
    np.testing.assert_array_equal(got, exp)


def test_dma_indirect_gather_oob_error_raises():
    idx = np.array([[3], [40], [39], [0]], np.int32)
    with pytest.raises(NkiRuntimeError, match="out of bounds"):
        in_kernel(lambda d, ix: _gather(d, ix, nisa.oob_mode.error), DATA, idx)


@pytest.mark.parametrize("oob", ["skip", "error"])
def test_dma_indirect_scatter(oob):
    """Scatter: the vector-offset view is the dst (e.g. a KV-cache update, uint32 max = invalid)."""
    idx = np.array([[5], [2**32 - 1], [0], [17]], np.uint32)
    src = -np.arange(24, dtype=np.float32).reshape(4, 6) - 1
    cache = DATA.copy()

    def body(d, ix, s):
        i_sb = load(ix)
        nisa.dma_copy(dst=d.ap([[6, 4], [1, 6]], offset=0, vector_offset=i_sb, indirect_dim=0),
                      src=load(s), oob_mode=getattr(nisa.oob_mode, oob))
    if oob == "error":
        with pytest.raises(NkiRuntimeError, match="out of bounds"):
            in_kernel(body, cache, idx, src)
        np.testing.assert_array_equal(cache, DATA)     # nothing written back
        return
    in_kernel(body, cache, idx, src)                   # in-place write to the input array
    exp = DATA.copy()
    exp[5], exp[0], exp[17] = src[0], src[2], src[3]
    np.testing.assert_array_equal(cache, exp)


def test_dma_scalar_offset_dynamic_slice_and_oob():
    a = np.arange(8 * 2, dtype=np.float32).reshape(8, 2)

    def body(h):
        got = {}

        def loop(i):
            t = nl.ndarray((4, 2), nl.float32)
            nisa.memset(t, -5.0)
            mode = nisa.oob_mode.skip
            nisa.dma_copy(dst=t, src=h[nl.ds(i * 2, 4), :], oob_mode=mode)
            got[len(got)] = val(t)
        nl.fori_loop(0, 4, loop)           # starts 0, 2, 4, 6: the last one runs past row 8
        t = nl.ndarray((4, 2), nl.float32)
        try:   # default oob_mode.error: rows 5..8 of an 8-row tensor
            nisa.dma_copy(dst=t, src=h[nl.ds(_scalar(5), 4), :])
        except NkiRuntimeError as e:
            got["err"] = str(e)
        return got
    got = in_kernel(body, a)
    for j, start in enumerate((0, 2, 4)):
        np.testing.assert_array_equal(got[j], a[start:start + 4])
    np.testing.assert_array_equal(got[3], np.full((4, 2), -5.0))   # skipped: untouched
    assert "out of bounds" in got["err"]


@pytest.mark.parametrize("oob", ["skip", "error"])
def test_dma_ap_scalar_offset_oob_follows_oob_mode(oob):
    a = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)

    def body(h):
        t = nl.ndarray((4, 4), nl.float32)
        nisa.memset(t, -5.0)
        src = h.ap([[4, 4], [1, 4]], offset=0, scalar_offset=_scalar(14), indirect_dim=0)
        if oob == "error":
            with pytest.raises(NkiRuntimeError, match="out of bounds"):
                nisa.dma_copy(dst=t, src=src)      # rows 14..17 of a 16-row tensor
        else:
            nisa.dma_copy(dst=t, src=src, oob_mode=nisa.oob_mode.skip)
        return val(t)
    np.testing.assert_array_equal(in_kernel(body, a), np.full((4, 4), -5.0, np.float32))


def _scalar(v):
    """An NkiScalar holding ``v`` (scalar_load of an SBUF int32 tile)."""
    t = nl.ndarray((1, 1), nl.int32)
    nisa.memset(t, v)
    return nisa.scalar_load(t)


# ============================================================================== tensor_copy
def test_tensor_copy_same_dtype_bit_exact_int32_and_nan_payload():
    x = np.array([[2**24 + 1, 2**31 - 1, -2**31, 16777219, -3, 0, 7, 2**30 + 3]], np.int32)
    f = np.zeros((1, 4), np.float32)
    f.view(np.uint32)[0] = [0x7FC00123, 0xFF800000, 0x00000001, 0x80000000]

    def body(h, g):
        outs = []
        for eng in ("vector", "gpsimd", "scalar", "unknown"):
            o = nl.ndarray((1, 8), nl.int32)
            nisa.tensor_copy(o, load(h), engine=getattr(nisa.engine, eng))
            outs.append(val(o))
        p = nl.ndarray((1, 4), nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=p, src=load(g))
        o = nl.ndarray((1, 4), nl.float32)
        nisa.tensor_copy(dst=o, src=p)
        return outs, val(o)
    outs, fo = in_kernel(body, x, f, tgt="trn2")
    for o in outs:
        np.testing.assert_array_equal(o, x)
    np.testing.assert_array_equal(fo.view(np.uint32), f.view(np.uint32))


def test_tensor_copy_casts_through_fp32():
    x = np.array([[2**24 + 1, -129, 300, 2**31 - 1]], np.int32)
    y = np.array([[2.5, -3.5, 1e10, 1 + 2**-8]], np.float32)

    def body(h, g):
        f = nl.ndarray((1, 4), nl.float32)
        nisa.tensor_copy(f, load(h))
        i8 = nl.ndarray((1, 4), nl.int8)
        nisa.tensor_copy(i8, load(h))
        i32 = nl.ndarray((1, 4), nl.int32)
        nisa.tensor_copy(i32, load(g))
        b = nl.ndarray((1, 4), nl.bfloat16)
        nisa.tensor_copy(b, load(g))
        return val(f), val(i8), val(i32), val(b)
    f, i8, i32, b = in_kernel(body, x, y)
    assert f.tolist() == [[16777216.0, -129.0, 300.0, 2147483648.0]]
    assert i8.tolist() == [[127, -128, 127, 127]]
    assert i32.tolist() == [[2, -4, 2**31 - 1, 1]]
    np.testing.assert_array_equal(b.view(np.uint16), bf16_rne_bits(y))


# ============================================================================== tensor_tensor
def test_tensor_tensor_arith_in_fp32_cast_on_write():
    a, b = RNG.standard_normal((8, 32)).astype(np.float32), RNG.standard_normal((8, 32)).astype(
        np.float32)

    def body(x, y):
        xa, yb = load(x, nl.bfloat16), load(y)
        res = {}
        for op in ("add", "subtract", "multiply", "maximum", "minimum"):
            o = nl.ndarray((8, 4, 8), nl.float32)              # shapes may differ: same P, F
            nisa.tensor_tensor(o, xa, yb, getattr(nl, op))
            res[op] = val(o).reshape(8, 32)
        ob = nl.ndarray((8, 32), nl.bfloat16)
        nisa.tensor_tensor(dst=ob, data1=xa, data2=yb, op=nl.add)
        res["bf16_out"] = val(ob)
        return res
    res = in_kernel(body, a, b)
    a16 = a.astype(BF16).astype(np.float32)
    exp = {"add": a16 + b, "subtract": a16 - b, "multiply": a16 * b,
           "maximum": np.maximum(a16, b), "minimum": np.minimum(a16, b)}
    for k, e in exp.items():
        np.testing.assert_array_equal(res[k], e, err_msg=k)
    np.testing.assert_array_equal(res["bf16_out"].view(np.uint16), bf16_rne_bits(a16 + b))


def test_tensor_tensor_comparisons_give_one_zero():
    a = np.array([[1.0, 2.0, 3.0, np.nan, -0.0]], np.float32)
    b = np.array([[2.0, 2.0, 1.0, 1.0, 0.0]], np.float32)
    ops = ["equal", "not_equal", "greater", "greater_equal", "less", "less_equal"]

    def body(x, y):
        res = {}
        for op in ops:
            o = nl.ndarray((1, 5), nl.float32)
            nisa.tensor_tensor(o, load(x), load(y), getattr(nl, op))
            u = nl.ndarray((1, 5), nl.uint8)
            nisa.tensor_tensor(u, load(x), load(y), getattr(nl, op))
            res[op] = (val(o), val(u))
        return res
    res = in_kernel(body, a, b)
    exp = {"equal": [0, 1, 0, 0, 1], "not_equal": [1, 0, 1, 1, 0], "greater": [0, 0, 1, 0, 0],
           "greater_equal": [0, 1, 1, 0, 1], "less": [1, 0, 0, 0, 0], "less_equal": [1, 1, 0, 0, 1]}
    for op, e in exp.items():
        f, u = res[op]
        assert f.tolist() == [[float(v) for v in e]], op
        assert u.dtype == np.uint8 and u.tolist() == [e], op


def test_tensor_tensor_bitwise_on_raw_bits():
    a = np.array([[-1, 0x0F0F0F0F, -8, 2**31 - 1, 12345678]], np.int32)
    b = np.array([[0x7FFFFFFF, 0x00FF00FF, 3, 1, 2]], np.int32)

    def body(x, y):
        res = {}
        for op in ("bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift"):
            o = nl.ndarray((1, 5), nl.int32)
            nisa.tensor_tensor(o, load(x), load(y), getattr(nl, op))
            res[op] = val(o)
        return res
    res = in_kernel(body, a, b)
    ua, ub = a.view(np.uint32), b.view(np.uint32)
    assert (res["bitwise_and"] == (a & b)).all()
    assert (res["bitwise_or"] == (a | b)).all()
    assert (res["bitwise_xor"] == (a ^ b)).all()
    assert (res["left_shift"].view(np.uint32) == ((ua << ub) & 0xFFFFFFFF)).all()
    assert (res["right_shift"].view(np.uint32) == (ua >> ub)).all()      # logical
    assert res["right_shift"][0, 2] == 0x1FFFFFFF                         # -8 >>> 3


def test_uint8_invert_wraps():
    x = np.array([[0, 5, 255, 128]], np.uint8)
    y = np.array([[0, 5, -1, 127]], np.int8)

    def body(h, g):
        o = nl.ndarray((1, 4), nl.uint8)
        nisa.tensor_scalar(o, load(h), nl.invert, 0)
        i = nl.ndarray((1, 4), nl.int8)
        nisa.tensor_scalar(i, load(g), nl.invert, 0)
        return val(o), val(i)
    u, i = in_kernel(body, x, y)
    assert u.tolist() == [[255, 250, 0, 127]]
    assert i.tolist() == [[-1, -6, 0, -128]]


def test_tensor_tensor_int32_gpsimd_exact_vs_vector_fp32():
    a = np.array([[2**24 + 1, 2**30 + 7, -(2**24) - 3, 100]], np.int32)
    b = np.array([[1, 5, -1, 2**24 + 1]], np.int32)

    def body(x, y):
        res = {}
        for eng in ("unknown", "gpsimd", "vector"):
            o = nl.ndarray((1, 4), nl.int32)
            nisa.tensor_tensor(o, load(x), load(y), nl.add, engine=getattr(nisa.engine, eng))
            res[eng] = val(o)
        m = nl.ndarray((1, 4), nl.int32)
        nisa.tensor_tensor(m, load(x), load(y), nl.subtract)
        res["sub"] = val(m)
        return res
    res = in_kernel(body, a, b)
    exact = (a.astype(np.int64) + b).astype(np.int32)
    np.testing.assert_array_equal(res["unknown"], exact)       # default: GpSimd for int32
    np.testing.assert_array_equal(res["gpsimd"], exact)
    fp32 = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float64)
    np.testing.assert_array_equal(res["vector"], np.rint(fp32).astype(np.int32))
    assert res["vector"][0, 0] != exact[0, 0]                    # precision really lost
    np.testing.assert_array_equal(res["sub"], (a.astype(np.int64) - b).astype(np.int32))


def test_tensor_tensor_uint32_gpsimd_exact():
    a = np.array([[3_000_000_000, 2**32 - 2, 7, 2**31]], np.uint32)
    b = np.array([[1, 1, 2**31, 5]], np.uint32)

    def body(x, y):
        o = nl.ndarray((1, 4), nl.uint32)
        nisa.tensor_tensor(o, load(x), load(y), nl.add)
        return val(o)
    got = in_kernel(body, a, b)
    np.testing.assert_array_equal(got, (a.astype(np.int64) + b).astype(np.uint32))


# ============================================================================== tensor_scalar
def test_tensor_scalar_immediates_vectors_reverse_and_two_ops():
    x = ints((8, 16))
    col = ints((8, 1), 1, 5)

    def body(h, c):
        d, v = load(h), load(c)
        res = {}

        def ts(key, **kw):
            o = nl.ndarray((8, 16), nl.float32)
            nisa.tensor_scalar(o, d, **kw)
            res[key] = val(o)
        ts("add", op0=nl.add, operand0=2.5)
        ts("mul_vec", op0=nl.multiply, operand0=v)
        ts("rsub", op0=nl.subtract, operand0=10.0, reverse0=True)
        ts("sub", op0=nl.subtract, operand0=10.0)
        ts("two", op0=nl.multiply, operand0=v, op1=nl.add, operand1=0.5)
        ts("two_rev", op0=nl.add, operand0=1.0, op1=nl.subtract, operand1=v, reverse1=True)
        ts("max_vec_rev", op0=nl.maximum, operand0=v, reverse0=True)
        ts("abs", op0=nl.abs, operand0=None)
        ts("cmp", op0=nl.greater, operand0=0.0, op1=nl.multiply, operand1=3.0)
        ts("scalar_eng", op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=1.0,
           engine=nisa.engine.scalar)
        return res
    r = in_kernel(body, x, col)
    exp = {"add": x + 2.5, "mul_vec": x * col, "rsub": 10.0 - x, "sub": x - 10.0,
           "two": x * col + 0.5, "two_rev": col - (x + 1.0), "max_vec_rev": np.maximum(col, x),
           "abs": np.abs(x), "cmp": (x > 0).astype(np.float32) * 3.0, "scalar_eng": x * 2 + 1}
    for k, e in exp.items():
        np.testing.assert_array_equal(r[k], e, err_msg=k)


def test_tensor_scalar_bitwise_ops():
    x = np.array([[0x12345678, -1, 0xF0, 7]], np.int32)

    def body(h):
        o = nl.ndarray((1, 4), nl.int32)
        nisa.tensor_scalar(o, load(h), nl.bitwise_and, 0xFF, op1=nl.left_shift, operand1=4)
        return val(o)
    got = in_kernel(body, x)
    np.testing.assert_array_equal(got, (x & 0xFF) << 4)


# ============================================================================== tensor_reduce
def test_tensor_reduce_axes_ops_negate_keepdims():
    x = ints((4, 3, 8))

    def body(h):
        d = load(h)
        res = {}

        def red(key, op, axis, shape, **kw):
            o = nl.ndarray(shape, nl.float32)
            nisa.tensor_reduce(o, op, d, axis, **kw)
            res[key] = val(o)
        red("sum_last", nl.add, 2, (4, 3))
        red("sum_last_neg_axis", nl.add, -1, (4, 3))
        red("max_all", nl.maximum, (1, 2), (4, 1))
        red("min_all", nl.minimum, [2, 1], (4, 1))
        red("prod", nl.multiply, 2, (4, 3))
        red("neg", nl.add, 2, (4, 3), negate=True)
        red("keep", nl.maximum, 2, (4, 3, 1), keepdims=True)
        return res
    r = in_kernel(body, x)
    exp = {"sum_last": x.sum(2), "sum_last_neg_axis": x.sum(2),
           "max_all": x.max(axis=(1, 2))[:, None], "min_all": x.min(axis=(1, 2))[:, None],
           "prod": x.prod(2), "neg": -x.sum(2), "keep": x.max(2)[:, :, None]}
    for k, e in exp.items():
        np.testing.assert_array_equal(r[k], e, err_msg=k)


def test_tensor_reduce_bitwise_on_raw_ints():
    x = RNG.integers(-2**31, 2**31 - 1, size=(4, 6), dtype=np.int64).astype(np.int32)

    def body(h):
        res = {}
        for op in ("bitwise_or", "bitwise_and", "bitwise_xor"):
            o = nl.ndarray((4, 1), nl.int32)
            nisa.tensor_reduce(o, getattr(nl, op), load(h), axis=1)
            res[op] = val(o)[:, 0]
        return res
    r = in_kernel(body, x)
    np.testing.assert_array_equal(r["bitwise_or"], np.bitwise_or.reduce(x, axis=1))
    np.testing.assert_array_equal(r["bitwise_and"], np.bitwise_and.reduce(x, axis=1))
    np.testing.assert_array_equal(r["bitwise_xor"], np.bitwise_xor.reduce(x, axis=1))


# ============================================================================== memset / iota
def test_memset_values_dtypes_and_buffers():
    def body():
        a = nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
        nisa.memset(a, -1.25)
        b = nl.ndarray((4, 8), nl.int16)
        nisa.memset(b, -300, engine=nisa.engine.gpsimd)
        c = nl.ndarray((4, 8), nl.bfloat16)
        nisa.memset(c, 1 + 2**-8)                 # RNE: tie -> 1.0
        d = nl.ndarray((4, 8), nl.int8)
        nisa.memset(d, 1000)                      # saturates
        e = nl.ndarray((4, 8), nl.float32)
        nisa.memset(e[:, 2:5], 3)                 # int value into a float dst
        return val(a), val(b), val(c), val(d), val(e)
    a, b, c, d, e = in_kernel(body)
    assert (a == -1.25).all() and (b == -300).all() and (d == 127).all()
    assert (c.view(np.uint16) == 0x3F80).all()
    assert (e[:, 2:5] == 3.0).all() and np.isnan(e[:, :2]).all() and np.isnan(e[:, 5:]).all()


def test_iota_patterns():
    def body():
        a = nl.ndarray((4, 8), nl.int32)
        nisa.iota(a, [[1, 8]], offset=3)
        b = nl.ndarray((128, 1), nl.int32)
        nisa.iota(b, [[0, 1]], offset=5, channel_multiplier=2)
        c = nl.ndarray((3, 2, 4), nl.float32)
        nisa.iota(c, [[10, 2], [-1, 4]], offset=0, channel_multiplier=100)
        return val(a), val(b), val(c)
    a, b, c = in_kernel(body)
    np.testing.assert_array_equal(a, np.tile(np.arange(3, 11), (4, 1)))
    np.testing.assert_array_equal(b[:, 0], 5 + 2 * np.arange(128))
    exp = (100 * np.arange(3)[:, None, None] + 10 * np.arange(2)[None, :, None]
           - np.arange(4)[None, None, :]).astype(np.float32)
    np.testing.assert_array_equal(c, exp)


def test_iota_runtime_offset():
    def body():
        got = []
        v = nl.ndarray((2, 4), nl.int32)

        def loop(i):
            nisa.iota(v, [[1, 4]], offset=i * 10, channel_multiplier=100)
            got.append(val(v))
        nl.fori_loop(1, 3, loop)
        return got
    got = in_kernel(body)
    for i, g in zip((1, 2), got):
        np.testing.assert_array_equal(g, i * 10 + 100 * np.arange(2)[:, None] + np.arange(4))


def test_in_place_overlapping_copies_read_before_write():
    def body():
        t = nl.ndarray((2, 8), nl.float32)
        nisa.iota(t, [[1, 8]])
        nisa.tensor_copy(t[:, 1:8], t[:, 0:7])             # shift right by one, in place
        u = nl.ndarray((2, 8), nl.float32)
        nisa.iota(u, [[1, 8]])
        nisa.dma_copy(dst=u[:, 0:7], src=u[:, 1:8])        # shift left by one, in place
        nisa.tensor_scalar(u, u, nl.multiply, 2.0)         # dst aliases data
        return val(t), val(u)
    t, u = in_kernel(body)
    np.testing.assert_array_equal(t[0], [0, 0, 1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(u[1], [2, 4, 6, 8, 10, 12, 14, 14])


# ============================================================================== reciprocal
def test_reciprocal_fp32():
    x = np.array([[2.0, -4.0, 3.0, 0.1, 1e-30, 0.0, -0.0, np.inf]], np.float32)

    def body(h):
        o = nl.ndarray((1, 8), nl.float32)
        nisa.reciprocal(o, load(h))
        p = nl.ndarray((1, 8), nl.float32, buffer=nl.psum)
        nisa.reciprocal(dst=p, data=load(h))
        return val(o), val(p)
    o, p = in_kernel(body, x)
    with np.errstate(divide="ignore"):
        exp = (1.0 / x.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(o, exp, rtol=2**-23)
    assert o[0, 5] == np.inf and o[0, 6] == -np.inf and o[0, 7] == 0.0
    np.testing.assert_array_equal(o, p)


# ============================================================================== activation
def test_activation_scale_and_bias_forms():
    x = RNG.standard_normal((8, 16)).astype(np.float32)
    sc = RNG.standard_normal((8, 1)).astype(np.float32)
    bi = RNG.standard_normal((8, 1)).astype(np.float32)

    def body(h, s, b):
        d, sv, bv = load(h), load(s), load(b, nl.bfloat16)
        res = {}

        def act(key, **kw):
            o = nl.ndarray((8, 16), nl.float32)
            nisa.activation(dst=o, data=d, **kw)
            res[key] = val(o)
        act("copy", op=nl.copy)
        act("exp_scale", op=nl.exp, scale=0.5)
        act("exp_scale_vec", op=nl.exp, scale=sv)
        act("copy_bias_tile", op=nl.copy, bias=bv, scale=2.0)
        act("copy_bias_float", op=nl.copy, bias=0.25, scale=sv)
        act("tanh", op=nl.tanh, bias=bv)
        return res
    r = in_kernel(body, x, sc, bi, tgt="trn2")
    b16 = bi.astype(BF16).astype(np.float32)
    np.testing.assert_array_equal(r["copy"], x)
    np.testing.assert_allclose(r["exp_scale"], np.exp(x * np.float32(0.5)), rtol=1e-6)
    np.testing.assert_allclose(r["exp_scale_vec"], np.exp(x * sc), rtol=1e-6)
    np.testing.assert_array_equal(r["copy_bias_tile"], x * np.float32(2) + b16)
    np.testing.assert_array_equal(r["copy_bias_float"], x * sc + np.float32(0.25))
    np.testing.assert_allclose(r["tanh"], np.tanh(x + b16), rtol=1e-6, atol=1e-7)


def test_activation_reduce_cmd_register_across_calls():
    """ScalarE accumulator (§9.3): reset_reduce, idle (untouched, read out), reduce, reset."""
    xs = [ints((4, 8)) for _ in range(3)]
    s = [x.sum(axis=1, keepdims=True) for x in xs]

    def body(h0, h1, h2):
        d = [load(h) for h in (h0, h1, h2)]
        o = nl.ndarray((4, 8), nl.float32)
        outs = {}

        def rr():
            t = nl.ndarray((4, 1), nl.float32)
            outs[len(outs)] = t
            return t
        RC = nisa.reduce_cmd
        nisa.activation(o, nl.copy, d[0], reduce_op=nl.add, reduce_cmd=RC.reset_reduce)
        nisa.activation(o, nl.copy, d[1], reduce_res=rr(), reduce_cmd=RC.idle)        # 0: s0
        idle_dst = val(o)
        nisa.activation(o, nl.copy, d[1], reduce_op=nl.add, reduce_cmd=RC.reduce)
        nisa.activation(o, nl.copy, d[2], reduce_op=nl.add, reduce_cmd=RC.reduce,
                        reduce_res=rr())                                               # 1: s0+s1+s2
        nisa.activation(o, nl.copy, d[2], reduce_res=rr(), reduce_cmd=RC.idle)         # 2: same
        nisa.activation(o, nl.copy, d[0], reduce_cmd=RC.reset, reduce_res=rr())        # 3: 0
        nisa.activation(o, nl.copy, d[2], reduce_op=nl.add, reduce_cmd=RC.reduce,
                        reduce_res=rr())                                               # 4: s2
        nisa.activation(o, nl.copy, d[1], reduce_op=nl.add, reduce_cmd=RC.reset_reduce,
                        reduce_res=rr())                                               # 5: s1
        nisa.activation(o, nl.copy, d[0], reduce_op=nl.add, reduce_res=rr(),
                        reduce_cmd=RC.idle)                                            # 6: s1
        return idle_dst, {k: val(v) for k, v in outs.items()}
    idle_dst, r = in_kernel(body, *xs)
    np.testing.assert_array_equal(idle_dst, xs[1])
    exp = [s[0], s[0] + s[1] + s[2], s[0] + s[1] + s[2], np.zeros((4, 1)), s[2], s[1], s[1]]
    for i, e in enumerate(exp):
        np.testing.assert_array_equal(r[i], e, err_msg=f"read-out {i}")


def test_activation_reduce():
    x = RNG.standard_normal((8, 16)).astype(np.float32)
    b = RNG.standard_normal((8, 1)).astype(np.float32)

    def body(h, bh):
        o = nl.ndarray((8, 16), nl.float32)
        r = nl.ndarray((8, 1), nl.float32)
        nisa.activation_reduce(o, nl.exp, load(h), nl.add, r, bias=load(bh), scale=-1.0)
        r2 = nl.ndarray((8, 1), nl.float32)
        nisa.activation(o, nl.copy, load(h), reduce_res=r2)   # idle: register unchanged
        return val(o), val(r), val(r2)
    o, r, r2 = in_kernel(body, x, b)
    e = np.exp(-x + b)
    np.testing.assert_array_equal(o, x)
    np.testing.assert_allclose(r, e.sum(axis=1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(r2, r)


# ============================================================================== casts on write
def test_engine_write_cast_fp32_to_bf16_and_int8():
    x = np.array([[1 + 2**-8, 1 + 3 * 2**-8, 2.5, 3.5, 300.0, -300.0, -2.5, 0.5]], np.float32)

    def body(h):
        d = load(h)
        b = nl.ndarray((1, 8), nl.bfloat16)
        nisa.tensor_scalar(b, d, nl.add, 0.0)
        i = nl.ndarray((1, 8), nl.int8)
        nisa.activation(i, nl.copy, d)
        u = nl.ndarray((1, 8), nl.uint8)
        nisa.tensor_tensor(u, d, d, nl.maximum)
        return val(b), val(i), val(u)
    b, i, u = in_kernel(body, x)
    assert b.view(np.uint16)[0, :2].tolist() == [0x3F80, 0x3F82]
    np.testing.assert_array_equal(b.view(np.uint16), bf16_rne_bits(x))
    assert i.tolist() == [[1, 1, 2, 4, 127, -128, -2, 0]]
    assert u.tolist() == [[1, 1, 2, 4, 255, 0, 0, 0]]


# ============================================================================== handles
def test_instructions_return_handles_with_depends_on():
    def body():
        t = nl.ndarray((4, 4), nl.float32)
        a = nisa.memset(t, 0.0)
        b = nisa.tensor_scalar(t, t, nl.add, 1.0).depends_on(a)
        with pytest.raises(TypeError):
            b.depends_on("not an instruction")
        return a.opcode, b.opcode
    assert in_kernel(body) == ("memset", "tensor_scalar")


def test_no_runtime_warnings_from_nan_inputs():
    """NaN sentinels flowing through engines must not leak NumPy RuntimeWarnings."""
    def body():
        t = nl.ndarray((4, 4), nl.float32)
        o = nl.ndarray((4, 4), nl.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            nisa.activation(o, nl.exp, t)
            nisa.tensor_tensor(o, t, t, nl.multiply)
            nisa.reciprocal(o, t)
            i = nl.ndarray((4, 4), nl.int32)
            nisa.tensor_copy(i, t)
        return val(i)
    in_kernel(body)
