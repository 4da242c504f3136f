"""Tests for nki_kernels/emulator/isa/vector_ext.py against hand-written NumPy expectations."""
import numpy as np
import pytest

from nki_kernels.emulator import NkiValidationError, jit, target
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator.isa import NkiHardwareWarning

RC = nisa.reduce_cmd
BOTH = ["trn2", "trn3"]
P, F = 64, 32


def rng(seed=0):
    return np.random.default_rng(seed)


def randn(shape, seed=0):
    return rng(seed).standard_normal(shape).astype(np.float32)


def run(body, *arrays, tgt="trn3"):
    """Load each array into SBUF, call ``body(*tiles)`` -> list of on-chip tiles, return them."""

    @jit
    def k(ins):
        tiles = []
        for a in ins:
            t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a)
            tiles.append(t)
        res = []
        for o in body(*tiles):
            if o.buffer is nl.psum:
                s = nl.ndarray(o.shape, o.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=s, src=o)
                o = s
            h = nl.ndarray(o.shape, o.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=h, src=o)
            res.append(h)
        return tuple(res)

    with target(tgt):
        return k(tuple(arrays))


def sb(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.sbuf)


def ps(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.psum)


def to_psum(t):
    p = ps(t.shape, t.dtype)
    nisa.tensor_copy(dst=p, src=t)
    return p


def raises(match):
    return pytest.raises(NkiValidationError, match=match)


# ===================================================================== scalar_tensor_tensor
@pytest.mark.parametrize("tgt", BOTH)
def test_stt_multiply_add(tgt):
    x, c, b = randn((P, F), 1), randn((P, 1), 2), randn((P, F), 3)

    def body(x, c, b):
        o = sb((P, F))
        nisa.scalar_tensor_tensor(dst=o, data=x, op0=nl.multiply, operand0=c, op1=nl.add,
                                  operand1=b)
        return [o]

    (o,) = run(body, x, c, b, tgt=tgt)
    np.testing.assert_allclose(o, x * c + b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tgt", BOTH)
def test_stt_reverse_flags_and_reshaped_operand(tgt):
    x, b = randn((P, F), 4), randn((P, 4, F // 4), 5)

    def body(x, b):
        o = sb((P, F))
        nisa.scalar_tensor_tensor(o, x, nl.subtract, 2.0, nl.subtract, b, reverse0=True,
                                  reverse1=True)
        return [o]

    (o,) = run(body, x, b, tgt=tgt)
    np.testing.assert_allclose(o, b.reshape(P, F) - (2.0 - x), rtol=1e-6, atol=1e-6)


def test_stt_negative():
    x = randn((P, F))

    def shape_mismatch(x):
        o = sb((P, F))
        nisa.scalar_tensor_tensor(o, x, nl.multiply, 1.0, nl.add, sb((P, F + 1)))
        return [o]

    def both_psum(x):
        o = sb((P, F))
        px = to_psum(x)
        nisa.scalar_tensor_tensor(o, px, nl.multiply, 1.0, nl.add, to_psum(x))
        return [o]

    def bitvec(x):
        o = sb((P, F))
        nisa.scalar_tensor_tensor(o, x, nl.bitwise_and, 1, nl.add, x)
        return [o]

    with raises("operand 'operand1' has 33 elements per partition"):
        run(shape_mismatch, x)
    with raises("are both in PSUM"):
        run(both_psum, x)
    with raises("operand 'op0' must be an ALU operator"):
        run(bitvec, x)


# ===================================================================== tensor_scalar_reduce
@pytest.mark.parametrize("tgt", BOTH)
def test_tsr_multiply_max(tgt):
    x, s = randn((P, F), 6), randn((P, 1), 7)

    def body(x, s):
        o, r = sb((P, F)), sb((P, 1))
        nisa.tensor_scalar_reduce(dst=o, data=x, op0=nl.multiply, operand0=s,
                                  reduce_op=nl.maximum, reduce_res=r)
        return [o, r]

    o, r = run(body, x, s, tgt=tgt)
    np.testing.assert_allclose(o, x * s, rtol=1e-6)
    np.testing.assert_allclose(r[:, 0], (x * s).max(axis=1), rtol=1e-6)


@pytest.mark.parametrize("tgt", BOTH)
@pytest.mark.parametrize("op,ref", [(nl.maximum, np.max), (nl.add, np.sum), (nl.minimum, np.min)])
def test_tsr_register_chain_across_tiles(tgt, op, ref):
    a, b = randn((P, F), 8), randn((P, F), 9)

    def body(a, b):
        o1, o2, r = sb((P, F)), sb((P, F)), sb((P, 1))
        nisa.tensor_scalar_reduce(o1, a, nl.add, 1.0, op, reduce_cmd=RC.reset_reduce)
        nisa.tensor_scalar_reduce(o2, b, nl.add, 1.0, op, reduce_res=r, reduce_cmd=RC.reduce)
        return [r]

    (r,) = run(body, a, b, tgt=tgt)
    both = np.concatenate([a + 1, b + 1], axis=1)
    np.testing.assert_allclose(r[:, 0], ref(both, axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tgt", BOTH)
def test_tsr_load_reduce_negate_and_multiply(tgt):
    x = (1 + 0.1 * randn((P, 8), 10)).astype(np.float32)
    init = randn((P, 1), 11)

    def body(x, init):
        o, r1, r2 = sb((P, 8)), sb((P, 1)), sb((P, 1))
        nisa.tensor_scalar_reduce(o, x, nl.multiply, 1.0, nl.add, reduce_res=r1,
                                  reduce_cmd=RC.load_reduce, reduce_init=init,
                                  reduce_res_negate=True)
        nisa.tensor_scalar_reduce(o, x, nl.multiply, 2.0, nl.multiply, reduce_res=r2,
                                  reduce_cmd=RC.load_reduce, reduce_init=3.0)
        return [r1, r2]

    r1, r2 = run(body, x, init, tgt=tgt)
    np.testing.assert_allclose(r1[:, 0], -(init[:, 0] + x.sum(axis=1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r2[:, 0], 3.0 * np.prod(2 * x, axis=1), rtol=1e-5)


def test_tsr_negate_leaves_register_positive():
    a, b = randn((P, F), 12), randn((P, F), 13)

    def body(a, b):
        o, r1, r2 = sb((P, F)), sb((P, 1)), sb((P, 1))
        nisa.tensor_scalar_reduce(o, a, nl.multiply, 1.0, nl.add, reduce_res=r1,
                                  reduce_res_negate=True)
        nisa.tensor_scalar_reduce(o, b, nl.multiply, 1.0, nl.add, reduce_res=r2,
                                  reduce_cmd=RC.reduce)
        return [r1, r2]

    r1, r2 = run(body, a, b)
    np.testing.assert_allclose(r1[:, 0], -a.sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r2[:, 0], a.sum(1) + b.sum(1), rtol=1e-5, atol=1e-5)


def test_tsr_idle_own_reduction_then_reduce_is_poisoned():
    a, b = randn((P, F), 14), randn((P, F), 15)

    def body(a, b):
        o, r1, r2 = sb((P, F)), sb((P, 1)), sb((P, 1))
        nisa.tensor_scalar_reduce(o, a, nl.add, 0.0, nl.maximum, reduce_res=r1,
                                  reduce_cmd=RC.idle)
        nisa.tensor_scalar_reduce(o, b, nl.add, 0.0, nl.maximum, reduce_res=r2,
                                  reduce_cmd=RC.reduce)
        return [r1, r2]

    with pytest.warns(NkiHardwareWarning, match="no reset_reduce/load_reduce initialised"):
        r1, r2 = run(body, a, b)
    np.testing.assert_allclose(r1[:, 0], a.max(1))
    assert np.isnan(r2).all()


def test_tsr_psum_input():
    x = randn((P, F), 16)

    def body(x):
        o, r = sb((P, F)), sb((P, 1))
        nisa.tensor_scalar_reduce(o, to_psum(x), nl.multiply, 0.5, nl.maximum, reduce_res=r)
        return [r]

    (r,) = run(body, x)
    np.testing.assert_allclose(r[:, 0], (0.5 * x).max(1), rtol=1e-6)


def test_tsr_negative():
    x = randn((P, F))

    def call(**kw):
        def body(x):
            args = dict(dst=sb((P, F)), data=x, op0=nl.multiply, operand0=1.0,
                        reduce_op=nl.add, reduce_res=sb((P, 1)))
            args.update({k: (v() if callable(v) and not isinstance(v, type(nl.add)) else v)
                         for k, v in kw.items()})
            nisa.tensor_scalar_reduce(**args)
            return []
        run(body, x)

    with raises("'reverse0' is not supported yet"):
        call(reverse0=True)
    with raises("'reduce_op' must be one of nl.add"):
        call(reduce_op=nl.subtract)
    with raises("'reduce_init' is required with reduce_cmd=load_reduce"):
        call(reduce_cmd=RC.load_reduce)
    with raises(r"'reduce_res' must be a \(64, 1\) tensor"):
        call(reduce_res=lambda: sb((P, 2)))
    with raises("'dst' has 31 elements per partition"):
        call(dst=lambda: sb((P, F - 1)))
    with raises("'op0' must be an ALU operator"):
        call(op0=nl.bitwise_or)
    with raises("'reduce_cmd' got the integer 3"):
        call(reduce_cmd=3)

    def rank5(x):
        d = sb((P, 2, 2, 2, 4))
        nisa.tensor_scalar_reduce(d, x, nl.multiply, 1.0, nl.add, reduce_res=sb((P, 1)))
        return []

    with raises("at most 3 free dims"):
        run(rank5, x)


# ===================================================================== tensor_scalar_cumulative
@pytest.mark.parametrize("tgt", BOTH)
def test_cumulative_add_and_max(tgt):
    x = randn((P, F), 20)

    def body(x):
        o1, o2 = sb((P, F)), sb((P, F))
        nisa.tensor_scalar_cumulative(dst=o1, src=x, op0=nl.multiply, op1=nl.add, imm0=2.0)
        nisa.tensor_scalar_cumulative(o2, x, nl.add, nl.maximum, 1.0)
        return [o1, o2]

    o1, o2 = run(body, x, tgt=tgt)
    exp1 = np.zeros_like(x)
    exp2 = np.zeros_like(x)
    s, m = np.zeros(P, np.float32), np.full(P, -np.inf, np.float32)
    for i in range(F):
        s = s + 2 * x[:, i]
        m = np.maximum(m, x[:, i] + 1)
        exp1[:, i], exp2[:, i] = s, m
    np.testing.assert_allclose(o1, exp1, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(o2, exp2)


def test_cumulative_subtract_order_and_load_reduce():
    x = randn((P, 8), 21)
    imm0 = randn((P, 1), 22)

    def body(x, imm0):
        o = sb((P, 8))
        nisa.tensor_scalar_cumulative(o, x, nl.multiply, nl.subtract, imm0, imm1=5.0,
                                      reduce_cmd=RC.load_reduce)
        return [o]

    (o,) = run(body, x, imm0)
    reg = np.full(P, 5.0, np.float32)
    exp = np.zeros_like(x)
    for i in range(8):  # reg = op1(op0(src, imm0), reg) = src*imm0 - reg
        reg = x[:, i] * imm0[:, 0] - reg
        exp[:, i] = reg
    np.testing.assert_allclose(o, exp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tgt", BOTH)
def test_cumulative_chain_two_tiles(tgt):
    a, b = randn((P, F), 23), randn((P, F), 24)

    def body(a, b):
        o1, o2 = sb((P, F)), sb((P, F))
        nisa.tensor_scalar_cumulative(o1, a, nl.add, nl.add, 0.0, reduce_cmd=RC.reset_reduce)
        nisa.tensor_scalar_cumulative(o2, b, nl.add, nl.add, 0.0, reduce_cmd=RC.reduce)
        return [o1, o2]

    o1, o2 = run(body, a, b, tgt=tgt)
    full = np.cumsum(np.concatenate([a, b], axis=1), axis=1)
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=1), full, rtol=1e-5, atol=1e-5)


def test_cumulative_bf16_io():
    import ml_dtypes
    x = randn((P, 16), 25).astype(ml_dtypes.bfloat16)

    def body(x):
        o = sb((P, 16), nl.bfloat16)
        nisa.tensor_scalar_cumulative(o, x, nl.multiply, nl.add, 1.0)
        return [o]

    (o,) = run(body, x)
    ref = np.cumsum(x.astype(np.float32), axis=1).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(o.astype(np.float32), ref.astype(np.float32))


def test_cumulative_negative():
    x = randn((P, F))
    xi = np.arange(P * F, dtype=np.int32).reshape(P, F)

    def body_for(**kw):
        def body(x):
            args = dict(dst=sb((P, F), x.dtype), src=x, op0=nl.multiply, op1=nl.add, imm0=1.0)
            args.update(kw)
            nisa.tensor_scalar_cumulative(**args)
            return []
        return body

    with raises("operand 'src' has dtype nl.int32"):
        run(body_for(), xi)
    with raises("'op1' must be one of nl.add, nl.subtract"):
        run(body_for(op1=nl.power), x)
    with raises("'reduce_cmd' must be reset_reduce, reduce or load_reduce"):
        run(body_for(reduce_cmd=RC.idle), x)
    with raises("'imm1' is required with reduce_cmd=load_reduce"):
        run(body_for(reduce_cmd=RC.load_reduce), x)

    def mismatch(x):
        nisa.tensor_scalar_cumulative(sb((P, F - 1)), x, nl.multiply, nl.add, 1.0)
        return []

    with raises("'dst' has 31 elements per partition"):
        run(mismatch, x)


# ===================================================================== tensor_tensor_scan
def _scan_ref(a, b, init, f0, f1):
    r = init.astype(np.float32).copy()
    out = np.zeros_like(a)
    for i in range(a.shape[1]):
        r = f1(f0(a[:, i], r), b[:, i]).astype(np.float32)
        out[:, i] = r
    return out


@pytest.mark.parametrize("tgt", BOTH)
def test_tts_linear_recurrence(tgt):
    a = rng(30).uniform(0.5, 1.0, (P, F)).astype(np.float32)
    b = randn((P, F), 31)
    init = randn((P, 1), 32)

    def body(a, b, init):
        o = sb((P, F))
        nisa.tensor_tensor_scan(dst=o, data0=a, data1=b, initial=init, op0=nl.multiply,
                                op1=nl.add)
        return [o]

    (o,) = run(body, a, b, init, tgt=tgt)
    np.testing.assert_allclose(o, _scan_ref(a, b, init[:, 0], np.multiply, np.add),
                               rtol=1e-5, atol=1e-5)


def test_tts_reverse_flags_and_chain():
    a, b = randn((P, 16), 33), randn((P, 16), 34)

    def body(a, b):
        o1, o2 = sb((P, 8)), sb((P, 8))
        nisa.tensor_tensor_scan(o1, a[:, 0:8], b[:, 0:8], 1.5, nl.subtract, nl.subtract,
                                reverse0=True, reverse1=True)
        nisa.tensor_tensor_scan(o2, a[:, 8:16], b[:, 8:16], o1[:, 7:8], nl.subtract, nl.subtract,
                                reverse0=True, reverse1=True)
        return [o1, o2]

    o1, o2 = run(body, a, b)
    # reverse0: op0(r, a) = r - a ; reverse1: op1(b, t) = b - t
    ref = _scan_ref(a, b, np.full(P, 1.5, np.float32), lambda x, r: r - x, lambda t, y: y - t)
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=1), ref, rtol=1e-5, atol=1e-5)


def test_tts_negative():
    a = randn((P, F))

    def both_psum(a):
        nisa.tensor_tensor_scan(sb((P, F)), to_psum(a), to_psum(a), 0.0, nl.multiply, nl.add)
        return []

    def mismatch(a):
        nisa.tensor_tensor_scan(sb((P, F)), a, a[:, 0:F - 2], 0.0, nl.multiply, nl.add)
        return []

    def bitvec(a):
        nisa.tensor_tensor_scan(sb((P, F)), a, a, 0.0, nl.multiply, nl.bitwise_xor)
        return []

    def bad_initial(a):
        nisa.tensor_tensor_scan(sb((P, F)), a, a, sb((P, 2)), nl.multiply, nl.add)
        return []

    with raises("are both in PSUM"):
        run(both_psum, a)
    with raises("operand 'data1' has 30 elements per partition"):
        run(mismatch, a)
    with raises("operand 'op1' must be an ALU operator"):
        run(bitvec, a)
    with raises(r"operand 'initial' must be a \(64, 1\) per-partition tensor"):
        run(bad_initial, a)


# ===================================================================== tensor_partition_reduce
@pytest.mark.parametrize("tgt", BOTH)
def test_tpr_float_ops(tgt):
    x = randn((P, 4, 8), 40)

    def body(x):
        outs = []
        for op in (nl.add, nl.average, nl.maximum):
            o = sb((1, 4, 8))
            nisa.tensor_partition_reduce(dst=o, op=op, data=x)
            outs.append(o)
        return outs

    s, avg, mx = run(body, x, tgt=tgt)
    np.testing.assert_allclose(s[0], x.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(avg[0], x.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(mx[0], x.max(0))


def test_tpr_bitwise():
    x = rng(41).integers(0, 2**31 - 1, (16, 8), dtype=np.int64).astype(np.int32)

    def body(x):
        o1, o2 = sb((1, 8), nl.int32), sb((1, 8), nl.int32)
        nisa.tensor_partition_reduce(o1, nl.bitwise_or, x)
        nisa.tensor_partition_reduce(o2, nl.bitwise_and, x)
        return [o1, o2]

    o1, o2 = run(body, x)
    np.testing.assert_array_equal(o1[0], np.bitwise_or.reduce(x, axis=0))
    np.testing.assert_array_equal(o2[0], np.bitwise_and.reduce(x, axis=0))


def test_tpr_negative():
    x = randn((P, 8))

    def psum_in(x):
        nisa.tensor_partition_reduce(sb((1, 8)), nl.add, to_psum(x))
        return []

    def psum_out(x):
        nisa.tensor_partition_reduce(ps((1, 8)), nl.add, x)
        return []

    def bad_op(x):
        nisa.tensor_partition_reduce(sb((1, 8)), nl.multiply, x)
        return []

    def bad_dst(x):
        nisa.tensor_partition_reduce(sb((2, 8)), nl.add, x)
        return []

    def bad_free(x):
        nisa.tensor_partition_reduce(sb((1, 4)), nl.add, x)
        return []

    def bit_float(x):
        nisa.tensor_partition_reduce(sb((1, 8)), nl.bitwise_or, x)
        return []

    with raises("operand 'data' is in PSUM, which this engine/operand cannot access"):
        run(psum_in, x)
    with raises("operand 'dst' is in PSUM"):
        run(psum_out, x)
    with raises("'op' must be one of nl.add, nl.average"):
        run(bad_op, x)
    with raises("'dst' must have 1 partition"):
        run(bad_dst, x)
    with raises("'dst' has 4 elements per partition"):
        run(bad_free, x)
    with raises("bitwise ops need integer dtypes"):
        run(bit_float, x)


# ===================================================================== bn_stats / bn_aggr
@pytest.mark.parametrize("tgt", BOTH)
def test_bn_stats_layout(tgt):
    x = randn((P, 9), 50)

    def body(x):
        o = sb((P, 6))
        nisa.bn_stats(dst=o, data=x)
        return [o]

    (o,) = run(body, x, tgt=tgt)
    ev, od = x[:, 0::2], x[:, 1::2]
    exp = np.stack([np.full(P, 5.0), ev.mean(1), ev.var(1) * 5,
                    np.full(P, 4.0), od.mean(1), od.var(1) * 4], axis=1)
    np.testing.assert_allclose(o, exp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tgt", BOTH)
def test_bn_stats_chunks_then_aggr(tgt):
    # 3 chunks of unequal size (512, 512, 101) with a large offset: the parallel-variance formula
    x = (100.0 + 3.0 * randn((P, 1125), 51)).astype(np.float32)
    bounds = [(0, 512), (512, 1024), (1024, 1125)]

    def body(x):
        st = sb((P, 6 * len(bounds)))
        for k, (lo, hi) in enumerate(bounds):
            nisa.bn_stats(st[:, 6 * k:6 * k + 6], x[:, lo:hi])
        o = sb((P, 2))
        nisa.bn_aggr(dst=o, data=st)
        return [o]

    (o,) = run(body, x, tgt=tgt)
    xd = x.astype(np.float64)
    np.testing.assert_allclose(o[:, 0], np.mean(xd, axis=1), rtol=1e-6)
    np.testing.assert_allclose(o[:, 1], np.var(xd, axis=1), rtol=1e-4)


def test_bn_aggr_single_stats_psum_and_3d():
    x = randn((P, 4, 16), 52)

    def body(x):
        st = ps((P, 6))
        nisa.bn_stats(st, x)
        o = sb((P, 2))
        nisa.bn_aggr(o, st)
        return [o]

    (o,) = run(body, x)
    flat = x.reshape(P, -1).astype(np.float64)
    np.testing.assert_allclose(o[:, 0], flat.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(o[:, 1], flat.var(1), rtol=1e-5)


def test_bn_negative():
    x = randn((P, 513))

    def too_big(x):
        nisa.bn_stats(sb((P, 6)), x)
        return []

    def bad_stats_dst(x):
        nisa.bn_stats(sb((P, 5)), x[:, 0:16])
        return []

    def bad_aggr_in(x):
        nisa.bn_aggr(sb((P, 2)), x[:, 0:7])
        return []

    def bad_aggr_dst(x):
        nisa.bn_aggr(sb((P, 3)), x[:, 0:6])
        return []

    with raises("bn_stats takes at most tile_size.bn_stats_fmax = 512"):
        run(too_big, x)
    with raises(r"'dst' must hold \(64, 6\) values"):
        run(bad_stats_dst, x)
    with raises("a multiple of 3"):
        run(bad_aggr_in, x)
    with raises(r"'dst' must be \(64, 2\)"):
        run(bad_aggr_dst, x)


# ===================================================================== exponential
def test_exponential_values_and_sum():
    x, m = randn((P, F), 60), randn((P, 1), 61)

    def body(x, m):
        o, r = sb((P, F)), sb((P, 1))
        nisa.exponential(dst=o, src=x, max_value=m, reduce_res=r, reduce_cmd=RC.reset_reduce)
        return [o, r]

    o, r = run(body, x, m)
    e = np.exp(x - m)
    np.testing.assert_allclose(o, e, rtol=1e-6)
    np.testing.assert_allclose(r[:, 0], e.sum(1), rtol=1e-5)


def test_exponential_chained_sum_load_reduce_and_bf16():
    import ml_dtypes
    a, b = randn((P, F), 62), randn((P, F), 63)

    def body(a, b):
        o1 = sb((P, F), nl.bfloat16)
        o2 = sb((P, F), nl.bfloat16)
        r1, r2, r3 = sb((P, 1)), sb((P, 1)), sb((P, 1))
        nisa.exponential(o1, a, max_value=1.0, reduce_cmd=RC.reset_reduce)
        nisa.exponential(o2, b, max_value=1.0, reduce_res=r1, reduce_cmd=RC.reduce)
        nisa.exponential(o2, b, reduce_res=r2, reduce_cmd=RC.load_reduce, reduce_init=10.0)
        nisa.exponential(o2, b, reduce_res=r3, reduce_cmd=RC.reset)
        return [o1, r1, r2, r3]

    o1, r1, r2, r3 = run(body, a, b)
    np.testing.assert_array_equal(o1.astype(np.float32),
                                  np.exp(a - 1.0).astype(ml_dtypes.bfloat16).astype(np.float32))
    # the running sum is of the fp32 values, before the bf16 cast
    np.testing.assert_allclose(r1[:, 0], np.exp(a - 1).sum(1) + np.exp(b - 1).sum(1), rtol=1e-5)
    np.testing.assert_allclose(r2[:, 0], 10.0 + np.exp(b).sum(1), rtol=1e-5)
    np.testing.assert_array_equal(r3[:, 0], 0.0)


def test_register_shared_between_tsr_and_exponential():
    a, b = randn((P, F), 64), randn((P, F), 65)

    def body(a, b):
        o, r = sb((P, F)), sb((P, 1))
        nisa.tensor_scalar_reduce(o, a, nl.multiply, 2.0, nl.add, reduce_cmd=RC.reset_reduce)
        nisa.exponential(o, b, reduce_res=r, reduce_cmd=RC.reduce)
        return [r]

    (r,) = run(body, a, b)
    np.testing.assert_allclose(r[:, 0], (2 * a).sum(1) + np.exp(b).sum(1), rtol=1e-5)


def test_exponential_negative():
    x = randn((P, F))

    def body_for(**kw):
        def body(x):
            args = dict(dst=sb((P, F)), src=x)
            args.update({k: (v() if callable(v) else v) for k, v in kw.items()})
            nisa.exponential(**args)
            return []
        return body

    with raises(r"exponential: this instruction needs Trn3 \(gen4\).*trn2"):
        run(body_for(), x, tgt="trn2")
    with raises("'reduce_init' must be unset or 0.0 unless reduce_cmd=load_reduce"):
        run(body_for(reduce_cmd=RC.reset_reduce, reduce_init=1.0), x)
    with raises("'dst' has 31 elements per partition"):
        run(body_for(dst=lambda: sb((P, F - 1))), x)
    with raises("operand 'dst' has dtype nl.uint32"):
        run(body_for(dst=lambda: sb((P, F), nl.uint32)), x)
    with raises(r"'reduce_res' must be a \(64, 1\) tensor"):
        run(body_for(reduce_res=lambda: sb((P, 2)), reduce_cmd=RC.reset_reduce), x)
    with raises(r"'max_value' must be a \(64, 1\) per-partition tensor"):
        run(body_for(max_value=lambda: sb((P, 2))), x)


# ===================================================================== activate2
def test_activate2_scale_bias_exp():
    x, s, b = randn((P, F), 70), randn((P, 1), 71), randn((P, 1), 72)

    def body(x, s, b):
        o1, o2, o3 = sb((P, F)), sb((P, F)), sb((P, F))
        nisa.activate2(dst=o1, op=nl.exp, data=x, imm0=s, imm1=b, op0=nl.multiply,
                       op1=nl.subtract)
        nisa.activate2(o2, nl.tanh, x, 3.0, 0.5, nl.subtract, nl.bypass, reverse0=True)
        nisa.activate2(o3, nl.copy, x, s, b, nl.multiply, nl.subtract, reverse1=True)
        return [o1, o2, o3]

    o1, o2, o3 = run(body, x, s, b)
    np.testing.assert_allclose(o1, np.exp(x * s - b), rtol=1e-5)
    np.testing.assert_allclose(o2, np.tanh(3.0 - x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(o3, b - x * s, rtol=1e-6, atol=1e-6)


def test_activate2_prelu_relu_param():
    x, alpha = randn((P, F), 73), rng(74).uniform(0, 0.5, (P, 1)).astype(np.float32)

    def body(x, alpha):
        o1, o2 = sb((P, F)), sb((P, F))
        nisa.activate2(o1, nl.prelu, x, None, None, nl.bypass, nl.bypass, relu_param=alpha)
        nisa.activate2(o2, nl.prelu, x, 2.0, None, nl.multiply, None, relu_param=0.1)
        return [o1, o2]

    o1, o2 = run(body, x, alpha)
    np.testing.assert_allclose(o1, np.where(x >= 0, x, alpha * x), rtol=1e-6)
    np.testing.assert_allclose(o2, np.where(x >= 0, 2 * x, 0.1 * 2 * x), rtol=1e-6)


@pytest.mark.parametrize("op,ref", [
    (nl.add, lambda v: v.sum(1)),
    (nl.maximum, lambda v: v.max(1)),
    (nl.minimum, lambda v: v.min(1)),
    (nl.abs_max, lambda v: v[np.arange(P), np.abs(v).argmax(1)]),
    (nl.abs_min, lambda v: v[np.arange(P), np.abs(v).argmin(1)]),
])
def test_activate2_reduce_chain_two_tiles(op, ref):
    a, b = randn((P, F), 75), randn((P, F), 76)

    def body(a, b):
        o, r = sb((P, F)), sb((P, 1))
        nisa.activate2(o, nl.copy, a, 1.0, 0.0, nl.multiply, nl.add, reduce_op=op,
                       reduce_cmd=RC.reset_reduce)
        nisa.activate2(o, nl.copy, b, 1.0, 0.0, nl.multiply, nl.add, reduce_op=op,
                       reduce_res=r, reduce_cmd=RC.reduce)
        return [r]

    (r,) = run(body, a, b)
    np.testing.assert_allclose(r[:, 0], ref(np.concatenate([a, b], axis=1)), rtol=1e-5,
                               atol=1e-5)


def test_activate2_shares_act_register_with_activation():
    a, b = randn((P, F), 77), randn((P, F), 78)

    def body(a, b):
        o, r1, r2 = sb((P, F)), sb((P, 1)), sb((P, 1))
        nisa.activation(o, nl.exp, a, reduce_op=nl.add, reduce_cmd=RC.reset_reduce)
        nisa.activate2(o, nl.exp, b, None, None, None, None, reduce_op=nl.add, reduce_res=r1,
                       reduce_cmd=RC.reduce)
        nisa.activate2(o, nl.exp, b, None, None, None, None, reduce_op=nl.maximum,
                       reduce_res=r2, reduce_cmd=RC.reset)
        return [r1, r2]

    r1, r2 = run(body, a, b)
    np.testing.assert_allclose(r1[:, 0], np.exp(a).sum(1) + np.exp(b).sum(1), rtol=1e-5)
    assert np.all(r2 == -np.inf)


def test_activate2_gpsimd_engine():
    x = randn((P, F), 79)

    def body(x):
        o = sb((P, F))
        nisa.activate2(o, nl.sigmoid, x, 2.0, 1.0, nl.multiply, nl.add, engine=nisa.gpsimd_engine)
        return [o]

    (o,) = run(body, x)
    np.testing.assert_allclose(o, 1 / (1 + np.exp(-(2 * x + 1))), rtol=1e-5, atol=1e-6)


def test_activate2_negative():
    x = randn((P, F))

    def body_for(**kw):
        def body(x):
            args = dict(dst=sb((P, F)), op=nl.exp, data=x, imm0=1.0, imm1=0.0, op0=nl.multiply,
                        op1=nl.add)
            args.update({k: (v() if callable(v) and not isinstance(v, type(nl.add)) else v)
                         for k, v in kw.items()})
            nisa.activate2(**args)
            return []
        return body

    with raises(r"activate2: this instruction needs Trn3 \(gen4\)"):
        run(body_for(), x, tgt="trn2")
    with raises(r"is not a supported combination"):
        run(body_for(op0=nl.add, op1=nl.add), x)
    with raises("'op1' nl.add requires op0 to be set"):
        run(body_for(op0=nl.bypass), x)
    with raises("'reverse1' requires op1 to be set"):
        run(body_for(op1=None, reverse1=True), x)
    with raises("'reverse0' requires op0 to be set"):
        run(body_for(op0=None, op1=None, reverse0=True), x)
    with raises("'reduce_op' must be one of nl.add, nl.maximum"):
        run(body_for(reduce_op=nl.multiply, reduce_cmd=RC.reset_reduce), x)
    with raises("load_reduce is a VectorE command"):
        run(body_for(reduce_op=nl.add, reduce_cmd=RC.load_reduce), x)
    with raises("'reduce_op' is required with reduce_cmd=reduce"):
        run(body_for(reduce_cmd=RC.reduce), x)
    with raises("'op' must be an activation function"):
        run(body_for(op=nl.multiply), x)
    with raises("tensor immediates must share one dtype"):
        run(body_for(imm0=lambda: sb((P, 1)), imm1=lambda: sb((P, 1), nl.bfloat16)), x)
    with raises("'dst' has 30 elements per partition"):
        run(body_for(dst=lambda: sb((P, F - 2))), x)
    with raises("the accumulator is only available on ScalarE"):
        run(body_for(engine=nisa.gpsimd_engine, reduce_op=nl.add,
                     reduce_cmd=RC.reset_reduce), x)
    with raises("'engine' must be scalar or gpsimd"):
        run(body_for(engine=nisa.vector_engine), x)

    def gpsimd_psum(x):
        nisa.activate2(ps((P, F)), nl.exp, x, 1.0, 0.0, nl.multiply, nl.add,
                       engine=nisa.gpsimd_engine)
        return []

    with raises("GpSimd cannot access PSUM"):
        run(gpsimd_psum, x)


# ===================================================================== select_reduce
@pytest.mark.parametrize("tgt", BOTH)
def test_select_reduce_values_and_max(tgt):
    x = randn((P, F), 80)
    pred = (rng(81).random((P, F)) > 0.5).astype(np.uint8)
    fval = randn((P, 1), 82)

    def body(x, pred, fval):
        o1, o2, r = sb((P, F)), sb((P, F)), sb((P, 1))
        nisa.select_reduce(dst=o1, predicate=pred, on_true=x, on_false=fval, reduce_res=r,
                           reduce_cmd=RC.reset_reduce)
        nisa.select_reduce(o2, pred, x, -3.0e38, reverse_pred=True)
        return [o1, o2, r]

    o1, o2, r = run(body, x, pred, fval, tgt=tgt)
    exp1 = np.where(pred != 0, x, fval)
    np.testing.assert_array_equal(o1, exp1)
    np.testing.assert_array_equal(o2, np.where(pred == 0, x, np.float32(-3.0e38)))
    np.testing.assert_array_equal(r[:, 0], exp1.max(1))


def test_select_reduce_chain_and_idle_readout():
    a, b = randn((P, F), 83), randn((P, F), 84)
    pa = (rng(85).random((P, F)) > 0.3).astype(np.int16)
    pb = (rng(86).random((P, F)) > 0.3).astype(np.int16)

    def body(a, b, pa, pb):
        o, r, r_idle = sb((P, F)), sb((P, 1)), sb((P, 1))
        nisa.select_reduce(o, pa, a, -100.0, reduce_cmd=RC.reset_reduce)
        nisa.select_reduce(o, pb, b, -100.0, reduce_res=r, reduce_cmd=RC.reduce)
        nisa.select_reduce(o, pb, b, -100.0, reduce_res=r_idle)
        return [r, r_idle]

    r, r_idle = run(body, a, b, pa, pb)
    sa, sb_ = np.where(pa != 0, a, -100.0), np.where(pb != 0, b, -100.0)
    np.testing.assert_array_equal(r[:, 0], np.maximum(sa.max(1), sb_.max(1)))
    np.testing.assert_array_equal(r_idle[:, 0], sb_.max(1))


def test_select_reduce_negative():
    x = randn((P, F))
    pu8 = np.ones((P, F), np.uint8)
    pf = np.ones((P, F), np.float32)
    xi = np.ones((P, F), np.int32)

    def body_for(**kw):
        def body(x, p):
            args = dict(dst=sb((P, F)), predicate=p, on_true=x, on_false=0.0)
            args.update({k: (v() if callable(v) and not isinstance(v, type(nl.add)) else v)
                         for k, v in kw.items()})
            nisa.select_reduce(**args)
            return []
        return body

    with raises("operand 'predicate' has dtype nl.float32"):
        run(body_for(), x, pf)
    with raises("operand 'on_true' has dtype nl.int32"):
        run(body_for(), xi, pu8)
    with raises("'reduce_op' must be nl.maximum"):
        run(body_for(reduce_op=nl.add), x, pu8)
    with raises("'reduce_res' has dtype nl.int32; it must be a float dtype"):
        run(body_for(reduce_res=lambda: sb((P, 1), nl.int32)), x, pu8)
    with raises("'reduce_cmd' load_reduce needs an initial value"):
        run(body_for(reduce_cmd=RC.load_reduce), x, pu8)
    with raises("'predicate' has 16 elements per partition"):
        run(lambda x, p: (nisa.select_reduce(sb((P, F)), p[:, 0:16], x, 0.0), [])[1], x, pu8)

    def both_psum(x, p):
        nisa.select_reduce(sb((P, F)), to_psum(p), to_psum(x), 0.0)
        return []

    with raises("are both in PSUM"):
        run(both_psum, x, pu8)


# ===================================================================== tensor_copy_predicated
@pytest.mark.parametrize("tgt", BOTH)
def test_copy_predicated_tile_and_scalar(tgt):
    src, old = randn((P, F), 90), randn((P, F), 91)
    pred = (rng(92).random((P, F)) > 0.5).astype(np.uint8)

    def body(src, old, pred):
        o1 = sb((P, F))
        nisa.tensor_copy(o1, old)
        nisa.tensor_copy_predicated(dst=o1, src=src, predicate=pred)
        o2 = sb((P, F))
        nisa.tensor_copy(o2, old)
        nisa.tensor_copy_predicated(o2, 7.5, pred, reverse_pred=True)
        return [o1, o2]

    o1, o2 = run(body, src, old, pred, tgt=tgt)
    np.testing.assert_array_equal(o1, np.where(pred != 0, src, old))
    np.testing.assert_array_equal(o2, np.where(pred == 0, np.float32(7.5), old))


def test_copy_predicated_int32_bit_exact_uint32_pred_psum_dst():
    src = rng(93).integers(-2**31, 2**31 - 1, (P, F), dtype=np.int64).astype(np.int32)
    old = rng(94).integers(-2**31, 2**31 - 1, (P, F), dtype=np.int64).astype(np.int32)
    pred = rng(95).integers(0, 3, (P, F)).astype(np.uint32) * np.uint32(2**30)
    fsrc, fold = randn((P, F), 96), randn((P, F), 97)

    def body(src, old, pred, fsrc, fold):
        o = sb((P, F), nl.int32)
        nisa.tensor_copy(o, old)
        nisa.tensor_copy_predicated(o, src, pred)
        p = to_psum(fold)
        nisa.tensor_copy_predicated(p, fsrc, pred)
        return [o, p]

    o, p = run(body, src, old, pred, fsrc, fold)
    np.testing.assert_array_equal(o, np.where(pred != 0, src, old))
    np.testing.assert_array_equal(p, np.where(pred != 0, fsrc, fold))


def test_copy_predicated_negative():
    x = randn((P, F))
    pu8 = np.ones((P, F), np.uint8)
    pi8 = np.ones((P, F), np.int8)

    def dtype_mismatch(x, p):
        nisa.tensor_copy_predicated(sb((P, F), nl.bfloat16), x, p)
        return []

    def shape_mismatch(x, p):
        nisa.tensor_copy_predicated(sb((P, F)), x, p[:, 0:8])
        return []

    def both_psum(x, p):
        nisa.tensor_copy_predicated(sb((P, F)), to_psum(x), to_psum(p))
        return []

    def bad_src(x, p):
        nisa.tensor_copy_predicated(sb((P, F)), "x", p)
        return []

    with raises("operand 'src' has dtype nl.float32 but 'dst' has nl.bfloat16"):
        run(dtype_mismatch, x, pu8)
    with raises("operand 'predicate' has dtype nl.int8"):
        run(lambda x, p: (nisa.tensor_copy_predicated(sb((P, F)), x, p), [])[1], x, pi8)
    with raises("operand 'predicate' has 8 elements per partition"):
        run(shape_mismatch, x, pu8)
    with raises("are both in PSUM"):
        run(both_psum, x, pu8)
    with raises("'src' must be a tensor or a Python number"):
        run(bad_src, x, pu8)


# ===================================================================== trace
def test_trace_engines_and_opcodes():
    from nki_kernels.emulator import trace
    x = randn((P, 16), 99)
    pred = np.ones((P, 16), np.uint8)

    def body(x, pred):
        o, r = sb((P, 16)), sb((P, 1))
        nisa.scalar_tensor_tensor(o, x, nl.multiply, 1.0, nl.add, x)
        nisa.tensor_scalar_reduce(o, x, nl.multiply, 1.0, nl.add, reduce_res=r)
        nisa.tensor_scalar_cumulative(o, x, nl.multiply, nl.add, 1.0)
        nisa.tensor_tensor_scan(o, x, x, 0.0, nl.multiply, nl.add)
        nisa.tensor_partition_reduce(sb((1, 16)), nl.add, x)
        st = sb((P, 6))
        nisa.bn_stats(st, x)
        nisa.bn_aggr(sb((P, 2)), st)
        nisa.exponential(o, x)
        nisa.activate2(o, nl.exp, x, 1.0, 0.0, nl.multiply, nl.add)
        nisa.select_reduce(o, pred, x, 0.0)
        nisa.tensor_copy_predicated(o, x, pred)
        return [o]

    with trace() as t:
        run(body, x, pred)
    got = {(i.engine, i.opcode) for i in t}
    for eng, opc in [("vector", "scalar_tensor_tensor"), ("vector", "tensor_scalar_reduce"),
                     ("vector", "tensor_scalar_cumulative"), ("vector", "tensor_tensor_scan"),
                     ("gpsimd", "tensor_partition_reduce"), ("vector", "bn_stats"),
                     ("vector", "bn_aggr"), ("vector", "exponential"), ("scalar", "activate2"),
                     ("vector", "select_reduce"), ("vector", "tensor_copy_predicated")]:
        assert (eng, opc) in got
    tsr = next(i for i in t if i.opcode == "tensor_scalar_reduce")
    assert [w.role for w in tsr.writes] == ["dst", "reduce_res"]
