"""MX instructions (quantize_mx, nc_matmul_mx) and the extra DMA instructions (dma_transpose,
dma_compute) of the emulator, against the independent NumPy reference in reference/mx.py and
plain np.transpose / fp32 sums."""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from nki_kernels.emulator import NkiRuntimeError, NkiValidationError, jit, target, trace
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator.isa import mx as mx_mod
from nki_kernels.reference import mx as ref

BF16 = ml_dtypes.bfloat16
FMT = {"e4m3": (nl.float8_e4m3fn_x4, "float8_e4m3fn"), "e5m2": (nl.float8_e5m2_x4, "float8_e5m2"),
       "fp4": (nl.float4_e2m1fn_x4, "float4_e2m1fn")}
FILL = 171  # marker byte for scale partitions quantize_mx must not touch


# ------------------------------------------------------------------------------------ helpers
def run_quantize(x, out_dt, scale_dt=nl.float8_e8m0fnu, scale_parts=None, offset=0):
    """quantize_mx of the [P, F] array x (bf16/fp16); returns (x4 words, scale buffer bytes)."""
    P, F = x.shape
    SP = scale_parts or P
    in_dt = nl.bfloat16 if x.dtype == BF16 else nl.float16

    @jit
    def k(a):
        src = nl.ndarray((P, F), in_dt, buffer=nl.sbuf)
        nisa.dma_copy(dst=src, src=a)
        d = nl.ndarray((P, F // 4), out_dt, buffer=nl.sbuf)
        sc = nl.ndarray((SP + offset, F // 4), nl.uint8, buffer=nl.sbuf)
        nisa.memset(dst=sc, value=FILL)
        view = sc[offset:, :] if scale_dt is nl.uint8 else sc[offset:, :].view(scale_dt)
        nisa.quantize_mx(dst=d, src=src, dst_scale=view)
        od = nl.ndarray((P, F // 4), out_dt, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=od, src=d)
        os_ = nl.ndarray((SP + offset, F // 4), nl.uint8, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=os_, src=sc)
        return od, os_

    return k(x)


def run_matmul(sw, ss, mw, ms, s_dt, m_dt, scale_dt=nl.uint8, dst_dt=nl.float32, acc=(None,),
               tile_position=None, tile_size=None, s_p0=0, sc_p0=0):
    """nc_matmul_mx on HBM words/scale buffers; ``acc`` lists the accumulate flag of each call."""
    K, M = sw.shape
    N = mw.shape[1]
    SPs, SPm = ss.shape[0], ms.shape[0]

    @jit
    def k(a, b, c, d):
        st = nl.ndarray((s_p0 + K, M), s_dt, buffer=nl.sbuf)
        mv = nl.ndarray((s_p0 + K, N), m_dt, buffer=nl.sbuf)
        nisa.dma_copy(dst=st[s_p0:, :], src=a.view(s_dt))
        nisa.dma_copy(dst=mv[s_p0:, :], src=c.view(m_dt))
        s_sc = nl.ndarray((sc_p0 + SPs, M), nl.uint8, buffer=nl.sbuf)
        m_sc = nl.ndarray((sc_p0 + SPm, N), nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sc[sc_p0:, :], src=b)
        nisa.dma_copy(dst=m_sc[sc_p0:, :], src=d)
        ps = nl.ndarray((M, N), dst_dt, buffer=nl.psum)
        for flag in acc:
            nisa.nc_matmul_mx(dst=ps, stationary=st[s_p0:, :], moving=mv[s_p0:, :],
                              stationary_scale=s_sc[sc_p0:, :].view(scale_dt),
                              moving_scale=m_sc[sc_p0:, :].view(scale_dt),
                              tile_position=tile_position, tile_size=tile_size, accumulate=flag)
        sb = nl.ndarray((M, N), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=ps)
        out = nl.ndarray((M, N), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=sb)
        return out

    return k(sw, ss, mw, ms)


def mx_operand(rng, K, F, fmt, spread=6):
    """Random [4K, F] matrix quantized by the reference: (words, scale buffer [K, F], values,
    scales)."""
    X = rng.standard_normal((4 * K, F)).astype(np.float32)
    X *= np.exp2(rng.integers(-spread, spread + 1, size=(1, F))).astype(np.float32)
    vals, sc = ref.quantize_mx(X, fmt)
    return ref.pack_x4(vals, fmt), ref.place_scales(sc, partitions=K), vals, sc


# ------------------------------------------------------------------------------ quantize_mx
def key_x4(key):
    return {"e4m3": "float8_e4m3fn_x4", "e5m2": "float8_e5m2_x4"}[key]


def _check_quant(x, key, out):
    out_dt, fmt = FMT[key]
    words, sbuf_bytes = out
    P = x.shape[0]
    vals, scales = ref.quantize_mx_tile(x.astype(np.float32), fmt)
    # x4 outputs reach the host in their x4 dtype (named after the type, no arithmetic)
    assert str(words.dtype) == f"[('{key_x4(key)}', '<f4')]"
    np.testing.assert_array_equal(words.view(np.uint32), ref.pack_x4(vals, fmt))
    rows = ref.scale_partitions(P // 8)
    np.testing.assert_array_equal(sbuf_bytes[rows], scales)
    others = np.setdiff1d(np.arange(sbuf_bytes.shape[0]), rows)
    assert (sbuf_bytes[others] == FILL).all()
    return vals, scales


@pytest.mark.parametrize("key", ["e4m3", "e5m2"])
def test_quantize_mx_bit_exact_adversarial(rng, key):
    x = rng.standard_normal((128, 64)).astype(np.float32)
    x *= np.exp2(rng.integers(-30, 30, size=(128, 16)).repeat(4, axis=1)).astype(np.float32)
    x[8:16, :] = 0.0                                     # whole groups of zeros
    x[3, :] = 0.0                                        # one zero row inside groups
    x[16:24, 0:8] = rng.uniform(-1, 1, (8, 8)) * 2.0**-128   # bf16 subnormals (clamped exponent)
    x[24:32, 8:12] = rng.uniform(-3.3e38, 3.3e38, (8, 4))     # near the bf16 maximum
    x[40:48, 12:16] = 2.0**-133                          # smallest bf16 subnormal
    x[48:56, 16:20] = rng.choice([-1, 1], (8, 4)) * (1 + np.arange(4) / 8.0)  # rounding ties
    xb = x.astype(BF16)
    vals, scales = _check_quant(xb, key, run_quantize(xb, FMT[key][0]))
    assert scales[1, 0] == 0 and (vals[8:16] == 0).all()
    assert scales[2, 0] == 0                             # 2**-128 groups clamp to 2**-127
    # the largest |v| of every finite group lands in [2**(Emax-1), 2**Emax] (rounding may reach
    # 2**Emax, still below the format maximum: no saturation)
    emax = ref.EMAX[FMT[key][1]]
    amax = np.abs(vals.reshape(16, 8, 16, 4)).max(axis=(1, 3))
    ok = (scales > 0)
    assert ((amax[ok] >= 2.0 ** (emax - 1)) & (amax[ok] <= 2.0 ** emax)).all()


def test_quantize_mx_fp16_uint8_scales_and_nan_group(rng):
    x = (rng.standard_normal((32, 16)) * 100).astype(np.float16)
    x[0:8, 4:8] = np.float16(6e-8)                       # fp16 subnormals
    x[8, 0] = np.nan
    x[16, 8] = np.inf
    words, sb = run_quantize(x, nl.float8_e4m3fn_x4, scale_dt=nl.uint8, scale_parts=4)
    vals, scales = _check_quant(x, "e4m3", (words, sb))
    assert sb.shape[0] == 4 and scales[1, 0] == 255 and scales[2, 2] == 255
    assert np.isnan(vals[8:16, 0]).all()


def test_quantize_mx_scale_offset_writes_own_band(rng):
    x = rng.standard_normal((64, 32)).astype(BF16)
    words, sb = run_quantize(x, nl.float8_e4m3fn_x4, scale_parts=60, offset=4)
    vals, scales = ref.quantize_mx_tile(x.astype(np.float32), "float8_e4m3fn")
    rows = ref.scale_partitions(8, offset=4)
    np.testing.assert_array_equal(sb[rows], scales)
    assert (sb[np.setdiff1d(np.arange(64), rows)] == FILL).all()


def test_quantize_mx_trace_attrs(rng):
    x = rng.standard_normal((32, 16)).astype(BF16)
    with trace() as t:
        run_quantize(x, nl.float8_e5m2_x4)
    ins = [i for i in t if i.opcode == "quantize_mx"][0]
    assert ins.engine == "vector" and ins.attrs["F"] == 16 and ins.attrs["out_dtype"] == \
        "float8_e5m2_x4"


# -------------------------------------------------------------------------------- nc_matmul_mx
@pytest.mark.parametrize("ks,km,K,M,N", [("e4m3", "e4m3", 128, 64, 96),
                                         ("e5m2", "e4m3", 64, 32, 40),
                                         ("fp4", "e5m2", 32, 16, 24), ("fp4", "fp4", 96, 8, 16)])
def test_nc_matmul_mx_matches_reference(rng, ks, km, K, M, N):
    sw, ss, sv, ssc = mx_operand(rng, K, M, FMT[ks][1])
    mw, ms, mvv, msc = mx_operand(rng, K, N, FMT[km][1])
    out = run_matmul(sw, ss, mw, ms, FMT[ks][0], FMT[km][0], scale_dt=nl.float8_e8m0fnu)
    exp = ref.mx_matmul(sv, ssc, mvv, msc)
    np.testing.assert_allclose(out, exp, rtol=1e-5, atol=1e-6 * np.abs(exp).max())
    assert np.abs(exp).max() > 0                       # a non-trivial product


def test_nc_matmul_mx_random_bytes_and_scales(rng):
    """Every finite e4m3fn byte and arbitrary scale bytes, uint8 scale dtype."""
    K, M, N = 32, 8, 16
    b = rng.integers(0, 256, size=(K, M, 4)).astype(np.uint8)
    b[(b & 0x7F) == 0x7F] = 0x11                       # no NaN encodings
    sv = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mvv = rng.choice([-2.0, -0.5, 0.0, 0.25, 1.5, 448.0], size=(K, N, 4)).astype(np.float32)
    ssc = rng.integers(100, 150, size=(K // 8, M)).astype(np.uint8)
    msc = rng.integers(100, 150, size=(K // 8, N)).astype(np.uint8)
    out = run_matmul(ref.pack_x4(sv, "float8_e4m3fn"), ref.place_scales(ssc, 32),
                     ref.pack_x4(mvv, "float8_e4m3fn"), ref.place_scales(msc, 32),
                     nl.float8_e4m3fn_x4, nl.float8_e4m3fn_x4)
    exp = ref.mx_matmul(sv, ssc, mvv, msc)
    np.testing.assert_allclose(out, exp, rtol=1e-5, atol=1e-6 * np.abs(exp).max())


def test_nc_matmul_mx_accumulate_semantics_and_bf16_dst(rng):
    sw, ss, sv, ssc = mx_operand(rng, 32, 16, "float8_e4m3fn", spread=1)
    mw, ms, mvv, msc = mx_operand(rng, 32, 8, "float8_e4m3fn", spread=1)
    exp = ref.mx_matmul(sv, ssc, mvv, msc)
    tol = dict(rtol=1e-5, atol=1e-5 * np.abs(exp).max())
    dts = (nl.float8_e4m3fn_x4, nl.float8_e4m3fn_x4)
    np.testing.assert_allclose(run_matmul(sw, ss, mw, ms, *dts, acc=(None, None)), 2 * exp, **tol)
    np.testing.assert_allclose(run_matmul(sw, ss, mw, ms, *dts, acc=(None, False)), exp, **tol)
    np.testing.assert_allclose(run_matmul(sw, ss, mw, ms, *dts, acc=(False, True, True)),
                               3 * exp, **tol)
    bf = run_matmul(sw, ss, mw, ms, *dts, dst_dt=nl.bfloat16)
    np.testing.assert_array_equal(bf, exp.astype(BF16).astype(np.float32))


def test_nc_matmul_mx_row_tiling_and_partition_offsets(rng):
    """K=32 data at partitions 32..63 on row tile 1; scale views at partition 36 (offset 4)."""
    sw, ss, sv, ssc = mx_operand(rng, 32, 16, "float8_e5m2")
    mw, ms, mvv, msc = mx_operand(rng, 32, 24, "float8_e5m2")
    out = run_matmul(sw, ss[:4], mw, ms[:4], nl.float8_e5m2_x4, nl.float8_e5m2_x4,
                     tile_position=(32, 0), tile_size=(32, 128), s_p0=32, sc_p0=36)
    exp = ref.mx_matmul(sv, ssc, mvv, msc)
    np.testing.assert_allclose(out, exp, rtol=1e-5, atol=1e-6 * np.abs(exp).max())


@pytest.mark.parametrize("K", [64, 128])
def test_quantize_then_matmul_shared_scale_buffer(rng, K):
    """Two tiles share one scale buffer: stationary at quadrant offset 0, moving at offset 4."""
    M, N = 32, 48
    Xs = rng.standard_normal((4 * K, M)).astype(BF16).astype(np.float32)
    Xm = (rng.standard_normal((4 * K, N)) * 1e3).astype(BF16).astype(np.float32)
    Ts, Tm = ref.to_tile_layout(Xs).astype(BF16), ref.to_tile_layout(Xm).astype(BF16)

    @jit
    def k(a, b):
        sa = nl.ndarray((K, 4 * M), nl.bfloat16, buffer=nl.sbuf)
        sb_ = nl.ndarray((K, 4 * N), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        nisa.dma_copy(dst=sb_, src=b)
        qs = nl.ndarray((K, M), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        qm = nl.ndarray((K, N), nl.float8_e5m2_x4, buffer=nl.sbuf)
        scales = nl.ndarray((K, N), nl.float8_e8m0fnu, buffer=nl.sbuf)
        nisa.quantize_mx(dst=qs, src=sa, dst_scale=scales[0:, :M])
        nisa.quantize_mx(dst=qm, src=sb_, dst_scale=scales[4:, :])
        ps = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst=ps, stationary=qs, moving=qm, stationary_scale=scales[0:, :M],
                          moving_scale=scales[4:, :])
        o = nl.ndarray((M, N), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=ps)
        out = nl.ndarray((M, N), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o)
        raw = nl.ndarray((K, N), nl.uint8, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=raw, src=scales.view(nl.uint8))
        return out, raw

    out, raw = k(Ts, Tm)
    sv, ssc = ref.quantize_mx(Xs, "float8_e4m3fn")
    mvv, msc = ref.quantize_mx(Xm, "float8_e5m2")
    np.testing.assert_array_equal(raw[ref.scale_partitions(K // 8), :M], ssc)
    np.testing.assert_array_equal(raw[ref.scale_partitions(K // 8, offset=4)], msc)
    exp = ref.mx_matmul(sv, ssc, mvv, msc)
    np.testing.assert_allclose(out, exp, rtol=1e-5, atol=1e-6 * np.abs(exp).max())
    # quantization error stays at the fp8 level
    err = np.abs(exp - Xs.T @ Xm).max() / np.abs(Xs.T @ Xm).max()
    assert err < 0.1


def test_nc_matmul_mx_trace_attrs(rng):
    sw, ss, _, _ = mx_operand(rng, 64, 16, "float8_e4m3fn")
    mw, ms, _, _ = mx_operand(rng, 64, 32, "float8_e4m3fn")
    with trace() as t:
        run_matmul(sw, ss, mw, ms, nl.float8_e4m3fn_x4, nl.float8_e4m3fn_x4)
    ins = [i for i in t if i.opcode == "nc_matmul_mx"][0]
    a = ins.attrs
    assert ins.engine == "tensor" and (a["K"], a["M"], a["N"]) == (256, 16, 32)
    assert a["perf_mode"] == "mx" and a["in_dtype"] == "float8_e4m3fn_x4"
    assert 2 * a["K"] * a["M"] * a["N"] == ref.flops_mx_matmul(256, 16, 32)


# ------------------------------------------------------------------------ MX negative tests
def _mx_kernel(K=32, M=16, N=16, s_dt=nl.float8_e4m3fn_x4, m_dt=nl.float8_e4m3fn_x4,
               dst_shape=None, dst_dt=nl.float32, dst_buf=nl.psum, ss_shape=None, ms_shape=None,
               s_dt_scale=nl.uint8, ss_p0=0, mK=None, st_buf=nl.sbuf, **kw):
    """Build tiles from scratch (no data needed: validation runs before any read)."""

    @jit
    def k():
        st = nl.ndarray((K, M), s_dt, buffer=st_buf)
        mv = nl.ndarray((mK or K, N), m_dt, buffer=nl.sbuf)
        ssb = nl.ndarray(ss_shape or (K, M), nl.uint8, buffer=nl.sbuf)
        ms_ = nl.ndarray(ms_shape or (K, N), nl.uint8, buffer=nl.sbuf)
        ps = nl.ndarray(dst_shape or (M, N), dst_dt, buffer=dst_buf)
        nisa.nc_matmul_mx(dst=ps, stationary=st, moving=mv,
                          stationary_scale=ssb[ss_p0:, :].view(s_dt_scale), moving_scale=ms_, **kw)

    return k


@pytest.mark.parametrize("kw,match", [
    (dict(s_dt=nl.bfloat16), "stationary' has dtype nl.bfloat16"),
    (dict(m_dt=nl.uint32), "moving' has dtype nl.uint32"),
    (dict(mK=64), "moving' has 64 partitions"),
    (dict(K=16, ss_shape=(16, 16), ms_shape=(16, 16)), "K=16 partitions; nc_matmul_mx needs a "
                                                        "multiple of 32"),
    (dict(M=15, ss_shape=(32, 15)), "M=15; nc_matmul_mx needs M even"),
    (dict(M=130, ss_shape=(32, 130), dst_shape=(128, 16)), "M=130"),
    (dict(dst_shape=(16, 8)), "dst' has shape"),
    (dict(dst_dt=nl.float16), "dst' has dtype nl.float16"),
    (dict(dst_buf=nl.sbuf), "dst' must be in PSUM"),
    (dict(st_buf=nl.psum), "stationary' is in PSUM"),
    (dict(s_dt_scale=nl.int8), "stationary_scale' has dtype nl.int8"),
    (dict(ss_shape=(32, 8)), "stationary_scale' has 8 elements per partition"),
    (dict(K=64, ss_shape=(8, 16), ms_shape=(64, 16)), "must span at least 36 partitions"),
    (dict(ss_shape=(34, 16), ss_p0=2), "quadrant offset 0, 4, 8 or 12"),
    (dict(ss_shape=(48, 16), ss_p0=16), "starts at partition 16"),
    (dict(accumulate="yes"), "accumulate' must be None, True or False"),
    (dict(tile_size=(32, 128)), "must be given together"),
    (dict(tile_position=(0, 0), tile_size=(32, 64)), "row tiling only"),
    (dict(tile_position=(0, 32), tile_size=(32, 128)), "start column 0"),
    (dict(tile_position=(16, 0), tile_size=(32, 128)), "multiple of the row size"),
    (dict(K=64, tile_position=(0, 0), tile_size=(32, 128)), "does not fit the row tile"),
])
def test_nc_matmul_mx_rejects(kw, match):
    with pytest.raises(NkiValidationError, match=match):
        _mx_kernel(**kw)()


def test_nc_matmul_mx_free_size_limit(monkeypatch):
    """N above the PSUM limit (unreachable with real PSUM capacity: shrink the limit to test it)."""
    real_gen = mx_mod.gen
    monkeypatch.setattr(mx_mod, "gen", lambda: dataclasses.replace(
        real_gen(), gemm_moving_fmax_fp32_dst=8))
    with pytest.raises(NkiValidationError, match="N=16; the limit is 8"):
        _mx_kernel()()


def test_mx_gen_gate_on_trn2():
    @jit
    def k():
        st = nl.ndarray((32, 16), nl.uint32, buffer=nl.sbuf).view(nl.float8_e4m3fn_x4)
        sc = nl.ndarray((32, 16), nl.uint8, buffer=nl.sbuf)
        ps = nl.ndarray((16, 16), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst=ps, stationary=st, moving=st, stationary_scale=sc, moving_scale=sc)

    @jit
    def q():
        src = nl.ndarray((32, 16), nl.bfloat16, buffer=nl.sbuf)
        d = nl.ndarray((32, 4), nl.uint32, buffer=nl.sbuf).view(nl.float8_e4m3fn_x4)
        sc = nl.ndarray((32, 4), nl.uint8, buffer=nl.sbuf)
        nisa.quantize_mx(dst=d, src=src, dst_scale=sc)

    with target("trn2"):
        with pytest.raises(NkiValidationError, match="nc_matmul_mx: this instruction needs Trn3"):
            k()
        with pytest.raises(NkiValidationError, match="quantize_mx: this instruction needs Trn3"):
            q()


def _q_kernel(P=32, F=16, src_dt=nl.bfloat16, dst_dt=nl.float8_e4m3fn_x4, dst_shape=None,
              sc_shape=None, sc_p0=0, src_buf=nl.sbuf, sc_dt=nl.uint8):
    @jit
    def k():
        src = nl.ndarray((P, F), src_dt, buffer=src_buf)
        d = nl.ndarray(dst_shape or (P, max(F // 4, 1)), dst_dt, buffer=nl.sbuf)
        sc = nl.ndarray(sc_shape or (P, max(F // 4, 1)), sc_dt, buffer=nl.sbuf)
        nisa.quantize_mx(dst=d, src=src, dst_scale=sc[sc_p0:, :])

    return k


@pytest.mark.parametrize("kw,match", [
    (dict(src_dt=nl.float32), "src' has dtype nl.float32; quantize_mx reads float16 or bfloat16"),
    (dict(dst_dt=nl.float4_e2m1fn_x4), "no fp4 output"),
    (dict(dst_dt=nl.bfloat16), "dst' has dtype nl.bfloat16"),
    (dict(P=16, sc_shape=(16, 4)), "src' has 16 partitions; quantize_mx needs a multiple of 32"),
    (dict(F=6, dst_shape=(32, 1), sc_shape=(32, 1)), "src' has 6 elements per partition"),
    (dict(dst_shape=(32, 8)), "dst' has shape \\(32, 8\\)"),
    (dict(src_buf=nl.psum), "src' is in PSUM"),
    (dict(sc_dt=nl.float16), "dst_scale' has dtype nl.float16"),
    (dict(P=64, sc_shape=(8, 4)), "must span at least 36 partitions"),
    (dict(sc_shape=(40, 4), sc_p0=8), None),  # offset 8 is legal
    (dict(sc_shape=(40, 4), sc_p0=6), "quadrant offset"),
])
def test_quantize_mx_rejects(kw, match):
    if match is None:
        _q_kernel(**kw)()
        return
    with pytest.raises(NkiValidationError, match=match):
        _q_kernel(**kw)()


# ------------------------------------------------------------------------------- dma_transpose
def _transpose_kernel(shape, np_dt, nl_dt, via_sbuf=False, **kw):
    perm = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}[len(shape)]
    oshape = tuple(shape[a] for a in perm)

    @jit
    def k(a):
        src = a
        if via_sbuf:
            src = nl.ndarray(shape, nl_dt, buffer=nl.sbuf)
            nisa.dma_copy(dst=src, src=a)
        d = nl.ndarray(oshape, nl_dt, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=src, **kw)
        out = nl.ndarray(oshape, nl_dt, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=d)
        return out

    return k, perm


@pytest.mark.parametrize("shape,np_dt,nl_dt,via_sbuf,kw", [
    ((64, 32), np.float32, nl.float32, False, {}),
    ((64, 32), BF16, nl.bfloat16, True, {}),
    ((4, 8, 16), np.float32, nl.float32, False, dict(axes=(2, 1, 0))),
    ((6, 5, 24), BF16, nl.bfloat16, True, {}),
    ((2, 3, 5, 8), np.float32, nl.float32, False, dict(axes=[3, 1, 2, 0])),
    ((16, 100), BF16, nl.bfloat16, False, dict(dge_mode=nisa.dge_mode.hwdge)),
    ((2, 8, 64), np.float16, nl.float16, False, dict(dge_mode=nisa.dge_mode.hwdge)),
    ((4, 2, 4, 32), BF16, nl.bfloat16, False, dict(dge_mode=nisa.dge_mode.hwdge, priority=1)),
    ((64, 32), BF16, nl.bfloat16, False, dict(dge_mode=nisa.dge_mode.none)),   # NKI Library mlp_tkg
])
def test_dma_transpose_matches_numpy(rng, tgt, shape, np_dt, nl_dt, via_sbuf, kw):
    if "priority" in kw and tgt == "trn2":
        pytest.skip("priority is gen4-only")
    x = rng.standard_normal(shape).astype(np_dt)
    k, perm = _transpose_kernel(shape, np_dt, nl_dt, via_sbuf, **kw)
    y = k(x)
    np.testing.assert_array_equal(y.view(np.uint8), np.transpose(x, perm).copy().view(np.uint8))


def test_dma_transpose_gen_gate_and_trace(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    k, _ = _transpose_kernel((8, 16), np.float32, nl.float32)
    with target("trn1"):
        with pytest.raises(NkiValidationError, match="dma_transpose: this instruction needs Trn2"):
            k(x)
    with trace() as t:
        k(x)
    ins = [i for i in t if i.opcode == "dma_transpose"][0]
    assert ins.engine == "dma" and ins.attrs["transpose"] is True and ins.attrs["dge"] == "unknown"


def _bad_transpose(src_shape=(16, 32), dst_shape=None, src_dt=nl.bfloat16, dst_dt=None,
                   src_buf=nl.shared_hbm, dst_buf=nl.sbuf, **kw):
    @jit
    def k():
        src = nl.ndarray(src_shape, src_dt, buffer=src_buf)
        dshape = dst_shape or tuple(reversed(src_shape))
        d = nl.ndarray(dshape, dst_dt or src_dt, buffer=dst_buf)
        nisa.dma_transpose(dst=d, src=src, **kw)

    return k


HW = nisa.dge_mode.hwdge


@pytest.mark.parametrize("kw,match", [
    (dict(dst_buf=nl.shared_hbm), "dst' is in shared_hbm; dma_transpose writes SBUF"),
    (dict(src_shape=(16, 32), src_buf=nl.psum), "src' is in PSUM"),
    (dict(dst_dt=nl.float16), "does not cast"),
    (dict(src_shape=(32,), dst_shape=(32, 1)), "1-D"),
    (dict(axes=(0, 1)), "axes' \\(0, 1\\) is not supported"),
    (dict(src_shape=(4, 8, 16), dst_shape=(16, 4, 8)), "exact shape"),
    (dict(src_shape=(4, 8, 16), dst_shape=(16, 8, 4), axes=(1, 2, 0)), "not supported"),
    (dict(src_dt=nl.int8), "2- or 4-byte"),
    (dict(src_dt=nl.float32, dge_mode=HW), "hwdge transpose needs a 2-byte dtype"),
    (dict(src_shape=(3, 32), dge_mode=HW), "src.shape\\[0\\] in"),
    (dict(src_shape=(2, 4, 32), dst_shape=(32, 4, 2), dge_mode=HW), "% 16 == 0"),
    (dict(dge_mode=nisa.dge_mode.swdge), "dge_mode' swdge"),
    (dict(oob_mode=nisa.oob_mode.skip), "skip is only valid with an indirect"),
    (dict(priority=5), "must be 0..3"),
])
def test_dma_transpose_rejects(kw, match):
    with pytest.raises(NkiValidationError, match=match):
        _bad_transpose(**kw)()


def test_dma_transpose_priority_needs_trn3():
    with target("trn2"):
        with pytest.raises(NkiValidationError, match="priority needs Trn3"):
            _bad_transpose(priority=0)()


def _gather_transpose(idx_dt=nl.uint32, dt_=nl.bfloat16, **kw):
    @jit
    def k(table, idx):
        ix = nl.ndarray((16, 1), idx_dt, buffer=nl.sbuf)
        nisa.dma_copy(dst=ix, src=idx)
        d = nl.ndarray((32, 16), dt_, buffer=nl.sbuf)
        nisa.memset(dst=d, value=-1.0)
        src = table.view(dt_).ap([[32, 16], [1, 32]], offset=0, vector_offset=ix, indirect_dim=0)
        nisa.dma_transpose(dst=d, src=src, **kw)
        out = nl.ndarray((32, 16), dt_, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=d)
        return out

    return k


def test_dma_transpose_indirect_gather(rng):
    table = rng.standard_normal((64, 32)).astype(BF16)
    idx = rng.permutation(64)[:16].astype(np.uint32).reshape(16, 1)
    y = _gather_transpose()(table, idx)
    np.testing.assert_array_equal(y.astype(np.float32), table[idx[:, 0]].T.astype(np.float32))
    bad = idx.copy()
    bad[5, 0] = 1000
    y = _gather_transpose(oob_mode=nisa.oob_mode.skip)(table, bad)
    exp = table[np.where(bad[:, 0] < 64, bad[:, 0], 0)].T.astype(np.float32)
    exp[:, 5] = -1.0
    np.testing.assert_array_equal(y.astype(np.float32), exp)
    with pytest.raises(NkiRuntimeError, match="out of bounds"):
        _gather_transpose()(table, bad)


@pytest.mark.parametrize("kw,match", [
    (dict(idx_dt=nl.int32), "must be uint32"),
    (dict(dge_mode=HW), "software DGE"),
])
def test_dma_transpose_indirect_rejects(rng, kw, match):
    table = rng.standard_normal((64, 32)).astype(BF16)
    idx = np.arange(16, dtype=np.uint32 if kw.get("idx_dt") is not nl.int32 else np.int32)
    with pytest.raises(NkiValidationError, match=match):
        _gather_transpose(**kw)(table, idx.reshape(16, 1))


def test_dma_transpose_indirect_rejects_4byte(rng):
    table = rng.standard_normal((64, 16)).astype(np.float32)
    with pytest.raises(NkiValidationError, match="indirect transpose needs a 2-byte dtype"):
        _gather_transpose(dt_=nl.float32)(table, np.arange(16, dtype=np.uint32).reshape(16, 1))


# -------------------------------------------------------------------------------- dma_compute
def test_dma_compute_sums(rng, tgt):
    a = rng.standard_normal((64, 32)).astype(np.float32)
    b = rng.standard_normal((32, 64)).astype(np.float32)     # same count, other shape
    c = rng.standard_normal((64, 32)).astype(BF16)

    @jit
    def k(x, y, z):
        ys = nl.ndarray((32, 64), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ys, src=y)
        d = nl.ndarray((64, 32), nl.float32, buffer=nl.sbuf)
        nisa.dma_compute(dst=d, srcs=[x, ys, z], reduce_op=nl.add, scales=[1.0, 1, 1.0])
        out = nl.ndarray((64, 32), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=d)
        out16 = nl.ndarray((64, 32), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_compute(dst=out16, srcs=(x, z), reduce_op=nl.add)
        return out, out16

    out, out16 = k(a, b, c)
    exp = (a + b.reshape(64, 32)) + c.astype(np.float32)
    np.testing.assert_array_equal(out, exp)
    np.testing.assert_array_equal(out16, (a + c.astype(np.float32)).astype(BF16))


def test_dma_compute_sixteen_sources(rng):
    xs = rng.standard_normal((16, 8, 8)).astype(np.float32)

    @jit
    def k(x):
        d = nl.ndarray((8, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_compute(dst=d, srcs=[x[i] for i in range(16)], reduce_op=nl.add)
        out = nl.ndarray((8, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=d)
        return out

    exp = xs[0].copy()
    for i in range(1, 16):
        exp = exp + xs[i]
    np.testing.assert_array_equal(k(xs), exp)


def test_dma_compute_gather_add_and_scatter_add(rng):
    table = rng.standard_normal((32, 16)).astype(np.float32)
    base = rng.standard_normal((8, 16)).astype(np.float32)
    idx = np.array([3, 30, 7, 0, 12, 5, 31, 18], dtype=np.int32).reshape(8, 1)

    @jit
    def k(t, b, i):
        ix = nl.ndarray((8, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ix, src=i)
        acc = nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=acc, src=b)
        gathered = t.ap([[16, 8], [1, 16]], offset=0, vector_offset=ix, indirect_dim=0)
        nisa.dma_compute(dst=acc, srcs=[gathered, acc], reduce_op=nl.add)   # gather-add
        out_tab = nl.ndarray((32, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_tab, src=t)
        rows = out_tab.ap([[16, 8], [1, 16]], offset=0, vector_offset=ix, indirect_dim=0)
        nisa.dma_compute(dst=rows, srcs=[rows, acc], reduce_op=nl.add)      # scatter-add
        out_acc = nl.ndarray((8, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_acc, src=acc)
        return out_acc, out_tab

    out_acc, out_tab = k(table, base, idx)
    exp_acc = table[idx[:, 0]] + base
    np.testing.assert_array_equal(out_acc, exp_acc)
    exp_tab = table.copy()
    exp_tab[idx[:, 0]] += exp_acc
    np.testing.assert_array_equal(out_tab, exp_tab)


def _bad_compute(n=2, shapes=None, bufs=None, op=nl.add, dst_shape=(8, 8), **kw):
    @jit
    def k():
        srcs = [nl.ndarray((shapes or {}).get(i, (8, 8)), nl.float32,
                           buffer=(bufs or {}).get(i, nl.sbuf)) for i in range(n)]
        d = nl.ndarray(dst_shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_compute(dst=d, srcs=srcs, reduce_op=op, **kw)

    return k


@pytest.mark.parametrize("kw,match", [
    (dict(n=17), "has 17 tensors; dma_compute reduces at most 16"),
    (dict(n=0), "must be a non-empty list"),
    (dict(op=nl.multiply), "supports only nl.add"),
    (dict(scales=[1.0, 2.0]), "must all be 1.0"),
    (dict(scales=[1.0]), "list of 2 numbers"),
    (dict(shapes={1: (8, 4)}), "element counts must be equal"),
    (dict(bufs={0: nl.psum}), "srcs\\[0\\]' is in PSUM"),
    (dict(oob_mode=nisa.oob_mode.skip), "skip is only valid with a vector-offset"),
])
def test_dma_compute_rejects(kw, match):
    with pytest.raises(NkiValidationError, match=match):
        _bad_compute(**kw)()


@pytest.mark.parametrize("form,match", [
    ("three", "exactly 2"),
    ("not_unique", "unique_indices' must be True"),
    ("gather_other", "must be dst itself"),
    ("scatter_other", "same vector-offset view as dst"),
])
def test_dma_compute_rmw_rejects(form, match):
    @jit
    def k(t):
        ix = nl.ndarray((8, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=ix, value=1)
        acc = nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf)
        other = nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf)
        g = t.ap([[16, 8], [1, 16]], offset=0, vector_offset=ix, indirect_dim=0)
        if form == "three":
            nisa.dma_compute(dst=acc, srcs=[g, acc, other], reduce_op=nl.add)
        elif form == "not_unique":
            nisa.dma_compute(dst=acc, srcs=[g, acc], reduce_op=nl.add, unique_indices=False)
        elif form == "gather_other":
            nisa.dma_compute(dst=acc, srcs=[g, other], reduce_op=nl.add)
        else:
            g2 = t.ap([[16, 8], [1, 16]], offset=16, vector_offset=ix, indirect_dim=0)
            nisa.dma_compute(dst=g, srcs=[g2, acc], reduce_op=nl.add)

    with pytest.raises(NkiValidationError, match=match):
        k(np.zeros((32, 16), np.float32))


def test_dma_compute_duplicate_indices_warn():
    @jit
    def k(t):
        ix = nl.ndarray((8, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=ix, value=1)
        acc = nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)
        g = t.ap([[16, 8], [1, 16]], offset=0, vector_offset=ix, indirect_dim=0)
        nisa.dma_compute(dst=g, srcs=[g, acc], reduce_op=nl.add)

    with pytest.warns(nisa.NkiHardwareWarning, match="duplicate indices"):
        k(np.zeros((32, 16), np.float32))


def test_dma_transpose_indirect_3d_and_rank_rules(rng):
    table = rng.standard_normal((64, 32)).astype(BF16)
    idx = rng.permutation(64)[:16].astype(np.uint32).reshape(16, 1)

    def make(pattern, oshape, ishape=(16, 1)):
        @jit
        def k(t, i):
            ix = nl.ndarray(ishape, nl.uint32, buffer=nl.sbuf)
            nisa.dma_copy(dst=ix, src=i)
            d = nl.ndarray(oshape, nl.bfloat16, buffer=nl.sbuf)
            src = t.ap(pattern, offset=0, vector_offset=ix, indirect_dim=0)
            nisa.dma_transpose(dst=d, src=src)
            out = nl.ndarray(oshape, nl.bfloat16, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=d)
            return out
        return k

    y = make([[32, 16], [16, 2], [1, 16]], (16, 2, 16))(table, idx)
    exp = np.transpose(table[idx[:, 0]].reshape(16, 2, 16), (2, 1, 0))
    np.testing.assert_array_equal(y.astype(np.float32), exp.astype(np.float32))
    with pytest.raises(NkiValidationError, match="4-D indirect transpose needs shape\\[1\\] or"):
        make([[32, 16], [16, 2], [8, 2], [1, 8]], (8, 2, 2, 16))(table, idx)
    with pytest.raises(NkiValidationError, match="multiple of 16 in \\[16, 128\\]"):
        make([[32, 8], [1, 32]], (32, 8), ishape=(8, 1))(table, idx[:8])
    with pytest.raises(NkiValidationError, match="must be a 2-D \\(I0, I1\\) SBUF tensor"):
        make([[32, 16], [1, 32]], (32, 16), ishape=(16, 1, 1))(table, idx.reshape(16, 1, 1))


def test_dynamic_offset_out_of_bounds_is_a_runtime_error(rng):
    x = rng.standard_normal((32, 16)).astype(np.float32)

    @jit
    def kt(a):
        r = nisa.register_alloc(30)
        d = nl.ndarray((16, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=a[nl.ds(r, 8), :])

    @jit
    def kc(a):
        r = nisa.register_alloc(30)
        d = nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf)
        nisa.dma_compute(dst=d, srcs=[a[nl.ds(r, 8), :]], reduce_op=nl.add)

    for k in (kt, kc):
        with pytest.raises(NkiRuntimeError, match="dynamic offset out of bounds"):
            k(x)


def test_nc_matmul_mx_rejects_bad_tile_tuple():
    with pytest.raises(NkiValidationError, match="are \\(row, column\\) pairs"):
        _mx_kernel(tile_position=(0,), tile_size=(32, 128))()


def test_dma_compute_more_rejects():
    @jit
    def kx():
        a = nl.ndarray((8, 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        d = nl.ndarray((8, 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        nisa.dma_compute(dst=d, srcs=[a, a], reduce_op=nl.add)

    with pytest.raises(NkiValidationError, match="has MX packed dtype"):
        kx()

    @jit
    def ks(t, u):
        ix = nl.ndarray((8, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=ix, value=1)
        g = t.ap([[16, 8], [1, 16]], offset=0, vector_offset=ix, indirect_dim=0)
        nisa.dma_compute(dst=g, srcs=[g, u], reduce_op=nl.add)

    with pytest.raises(NkiValidationError, match="must be in SBUF for a scatter-add"):
        ks(np.zeros((32, 16), np.float32), np.zeros((8, 16), np.float32))

    @jit
    def kb(t):
        ix = nl.ndarray((8, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=ix, value=1)
        acc = nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf)
        g = t.ap([[16, 8], [1, 16]], offset=0, vector_offset=ix, indirect_dim=0)
        nisa.dma_compute(dst=acc, srcs=[acc, g], reduce_op=nl.add)

    with pytest.raises(NkiValidationError, match="srcs\\[1\\]' must not be indirect"):
        kb(np.zeros((32, 16), np.float32))
