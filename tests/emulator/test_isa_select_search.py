"""Emulator: selection / search / GpSimd helper instructions (nki-spec §9.2.8-9.2.10, §9.6.1-9.6.2,
§9.7, §9.9) against hand-written NumPy expectations."""
import ml_dtypes
import numpy as np
import pytest

from nki_kernels.emulator import NkiValidationError, jit, target, trace
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl

FMIN = np.float32(-3.4028235e38)
BF16 = ml_dtypes.bfloat16


def run(body, *inputs, tgt="trn3"):
    """Load each input into an SBUF tile of the same shape/dtype, call ``body(*tiles)``, which
    returns a list of on-chip tiles; copy them to HBM and return them as NumPy arrays."""

    @jit
    def k(ins):
        tiles = []
        for a in ins:
            t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a)
            tiles.append(t)
        outs = body(*tiles)
        res = []
        for o in outs:
            if o.buffer is nl.psum:
                s = nl.ndarray(o.shape, o.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=s, src=o)
                o = s
            h = nl.ndarray(o.shape, o.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=h, src=o)
            res.append(h)
        return tuple(res)

    with target(tgt):
        return k(tuple(inputs))


def tile(shape, dtype=nl.float32, buffer=nl.sbuf):
    return nl.ndarray(shape, dtype, buffer=buffer)


def rng(seed=0):
    return np.random.default_rng(seed)


# ============================================================================ affine_select
@pytest.mark.parametrize("dst_dtype", [nl.float32, nl.bfloat16])
def test_affine_select_causal_mask(dst_dtype):
    nq, nk, q0, k0 = 64, 96, 32, 16
    s = rng(1).standard_normal((nq, nk)).astype(np.float32)

    def body(st):
        o = tile((nq, nk), dst_dtype)
        nisa.affine_select(dst=o, pattern=[[-1, nk]], channel_multiplier=1, on_true_tile=st,
                           on_false_value=-3.4028235e38, cmp_op=nl.greater_equal, offset=q0 - k0)
        return [o]

    (got,) = run(body, s)
    qpos = q0 + np.arange(nq)[:, None]
    kpos = k0 + np.arange(nk)[None, :]
    want = np.where(kpos <= qpos, s, FMIN)
    if dst_dtype is nl.bfloat16:
        want = want.astype(BF16)          # FP32_MIN rounds to -inf in bf16
        assert np.isneginf(got.astype(np.float32)[0, -1])
    np.testing.assert_array_equal(got, want)
    assert (got.astype(np.float32)[:, :17] > -1e30).all()  # keys <= q0 always visible


def test_affine_select_multidim_pattern_and_cmp():
    P, A, B = 16, 3, 4
    x = rng(2).standard_normal((P, A, B)).astype(np.float32)

    def body(xt):
        o1 = tile((P, A, B))
        o2 = tile((P, A * B))
        nisa.affine_select(o1, [[4, A], [1, B]], -2, xt, 7.5, cmp_op=nl.less, offset=5)
        nisa.affine_select(o2, [[4, A], [1, B]], -2, xt, 0.0, cmp_op=nl.equal, offset=5)
        return [o1, o2]

    o1, o2 = run(body, x)
    want1 = np.empty_like(x)
    want2 = np.empty((P, A * B), np.float32)
    for p in range(P):
        for a in range(A):
            for b in range(B):
                v = 5 - 2 * p + 4 * a + b
                want1[p, a, b] = x[p, a, b] if v < 0 else 7.5
                want2[p, a * B + b] = x[p, a, b] if v == 0 else 0.0
    np.testing.assert_array_equal(o1, want1)
    np.testing.assert_array_equal(o2, want2)


def test_affine_select_int_dst_saturates_fill():
    x = np.arange(16 * 8, dtype=np.int32).reshape(16, 8)

    def body(xt):
        o = tile((16, 8), nl.int32)
        nisa.affine_select(o, [[1, 8]], 0, xt, -3.4028235e38, cmp_op=nl.greater_equal, offset=-4)
        return [o]

    (got,) = run(body, x)
    want = np.where(np.arange(8)[None, :] - 4 >= 0, x, np.iinfo(np.int32).min)
    np.testing.assert_array_equal(got, want)


def _affine(bad):
    x = np.zeros((16, 8), np.float32)

    def body(xt):
        kw = dict(dst=tile((16, 8)), pattern=[[1, 8]], channel_multiplier=1, on_true_tile=xt,
                  on_false_value=0.0, cmp_op=nl.greater_equal)
        kw.update(bad(xt))
        nisa.affine_select(**kw)
        return []

    run(body, x)


@pytest.mark.parametrize("bad, msg", [
    (lambda xt: {"dst": tile((16, 8), buffer=nl.psum)}, "GpSimd reads and writes SBUF only"),
    (lambda xt: {"pattern": [[1, 4]]}, "covers 4 elements per partition"),
    (lambda xt: {"pattern": [[1, 2]] * 5}, "1 to 4"),
    (lambda xt: {"pattern": [[1, 0], [1, 8]]}, "counts must be >= 1"),
    (lambda xt: {"cmp_op": nl.add}, "comparison operator"),
    (lambda xt: {"channel_multiplier": 1.5}, "channel_multiplier' must be an int"),
    (lambda xt: {"on_false_value": xt}, "not a tensor"),
    (lambda xt: {"on_false_value": "x"}, "must be a Python number"),
    (lambda xt: {"offset": 1.5}, "offset' must be an int"),
    (lambda xt: {"dst": tile((16, 9)), "pattern": [[1, 9]]}, "elements per partition"),
])
def test_affine_select_rejects(bad, msg):
    with pytest.raises(NkiValidationError, match=msg):
        _affine(bad)


# ============================================================================ range_select
def _bounds(P, F, seed):
    r = rng(seed)
    lo = r.integers(0, F, size=(P, 1)).astype(np.float32)
    hi = lo + r.integers(0, 12, size=(P, 1)).astype(np.float32)
    return lo, hi


def test_range_select_per_partition_bounds():
    P, F, start = 32, 40, 3
    x = rng(3).standard_normal((P, F)).astype(np.float32)
    lo, hi = _bounds(P, F, 4)
    hi[5] = lo[5]  # an empty range on partition 5: whole row is the fill value

    def body(xt, lot, hit):
        o = tile((P, F))
        r = tile((P, 1))
        nisa.range_select(dst=o, on_true_tile=xt, comp_op0=nl.greater_equal, comp_op1=nl.less,
                          bound0=lot, bound1=hit, reduce_cmd=nisa.reduce_cmd.reset_reduce,
                          reduce_res=r, range_start=start)
        return [o, r]

    o, r = run(body, x, lo, hi, tgt="trn2")
    idx = start + np.arange(F)[None, :]
    mask = (idx >= lo) & (idx < hi)
    want = np.where(mask, x, FMIN)
    np.testing.assert_array_equal(o, want)
    np.testing.assert_array_equal(r[:, 0], want.max(axis=1))
    assert r[5, 0] == FMIN


def test_range_select_chained_reduce_and_bf16_fill():
    P, F = 16, 24
    r = rng(5)
    x1 = r.standard_normal((P, F)).astype(np.float32)
    x2 = r.standard_normal((P, F)).astype(np.float32) + 0.5
    lo = r.integers(0, 2 * F, size=(P, 1)).astype(np.float32)
    hi = lo + 10
    lo[3], hi[3] = 1000, 1000  # partition 3 never selects anything

    def body(a, b, lot, hit):
        o1, o2 = tile((P, F), nl.bfloat16), tile((P, F), nl.bfloat16)
        res = tile((P, 1))
        nisa.range_select(o1, a, nl.greater_equal, nl.less_equal, lot, hit,
                          reduce_cmd=nisa.reduce_cmd.reset_reduce, range_start=0)
        nisa.range_select(o2, b, nl.greater_equal, nl.less_equal, lot, hit,
                          reduce_cmd=nisa.reduce_cmd.reduce, reduce_res=res, range_start=F)
        return [o1, o2, res]

    o1, o2, res = run(body, x1, x2, lo, hi, tgt="trn2")
    j = np.arange(2 * F)[None, :]
    full = np.concatenate([x1, x2], axis=1)
    want = np.where((j >= lo) & (j <= hi), full, FMIN)
    np.testing.assert_array_equal(np.concatenate([o1, o2], axis=1), want.astype(BF16))
    np.testing.assert_array_equal(res[:, 0], want.max(axis=1))
    assert np.isneginf(o1.astype(np.float32)[3]).all()   # bf16 dst: FP32_MIN -> -inf
    assert res[3, 0] == FMIN                               # fp32 register keeps FP32_MIN


def test_range_select_idle_readout_and_reduce_warning():
    P, F = 16, 8
    x = rng(6).standard_normal((P, F)).astype(np.float32)
    lo = np.zeros((P, 1), np.float32)
    hi = np.full((P, 1), 4, np.float32)

    def body(xt, lot, hit):
        o = tile((P, F))
        r1, r2 = tile((P, 1)), tile((P, 1))
        nisa.range_select(o, xt, nl.greater_equal, nl.less, lot, hit,
                          reduce_cmd=nisa.reduce_cmd.idle, reduce_res=r1)
        with pytest.warns(nisa.NkiHardwareWarning, match="no reset_reduce"):
            nisa.range_select(o, xt, nl.greater_equal, nl.less, lot, hit,
                              reduce_cmd=nisa.reduce_cmd.reduce, reduce_res=r2)
        return [r1, r2]

    r1, r2 = run(body, x, lo, hi)
    np.testing.assert_array_equal(r1[:, 0], x[:, :4].max(axis=1))
    assert np.isnan(r2).all()   # idle clobbered the register: the chain shows NaN


def _range(bad, tgt="trn2"):
    P, F = 16, 8
    x = np.zeros((P, F), np.float32)
    b = np.zeros((P, 1), np.float32)

    def body(xt, bt):
        kw = dict(dst=tile((P, F)), on_true_tile=xt, comp_op0=nl.greater_equal, comp_op1=nl.less,
                  bound0=bt, bound1=bt)
        kw.update(bad(xt, bt))
        nisa.range_select(**kw)
        return []

    run(body, x, b, tgt=tgt)


@pytest.mark.parametrize("bad, msg", [
    (lambda x, b: {"on_false_value": 0.0}, "must be FP32_MIN"),
    (lambda x, b: {"on_false_value": float("-inf")}, "must be FP32_MIN"),
    (lambda x, b: {"reduce_op": nl.add}, "must be nl.maximum"),
    (lambda x, b: {"comp_op0": nl.not_equal}, "comp_op0' must be one of"),
    (lambda x, b: {"comp_op1": nl.add}, "comp_op1' must be one of"),
    (lambda x, b: {"bound0": 3.0}, "bound0' must be a \\(16, 1\\) float32 tensor"),
    (lambda x, b: {"bound1": tile((16, 2))}, "per-partition tensor"),
    (lambda x, b: {"bound1": tile((16, 1), nl.bfloat16)}, "must be float32"),
    (lambda x, b: {"reduce_cmd": nisa.reduce_cmd.load_reduce}, "load_reduce"),
    (lambda x, b: {"reduce_cmd": 3}, "integer enum values are rejected"),
    (lambda x, b: {"on_true_tile": tile((16, 8), nl.int32)}, "float data"),
    (lambda x, b: {"reduce_res": tile((16, 2))}, "reduce_res' must be \\(16, 1\\)"),
    (lambda x, b: {"reduce_res": tile((16, 1), nl.int32)}, "float dtype"),
    (lambda x, b: {"dst": tile((16, 9))}, "elements per partition"),
])
def test_range_select_rejects(bad, msg):
    with pytest.raises(NkiValidationError, match=msg):
        _range(bad)


def test_range_select_needs_trn2():
    with pytest.raises(NkiValidationError, match="needs Trn2"):
        _range(lambda x, b: {}, tgt="trn1")


def test_range_select_warns_past_2_24():
    with pytest.warns(nisa.NkiHardwareWarning, match="2\\^24"):
        _range(lambda x, b: {"range_start": 2.0 ** 24})


# ============================================================================ max8
def test_max8_descending_with_duplicates_3d_src():
    P = 16
    x = rng(7).integers(-20, 20, size=(P, 5, 10)).astype(np.float32)  # many duplicates

    def body(xt):
        o = tile((P, 8))
        ob = tile((P, 2, 4), nl.bfloat16)
        nisa.max8(dst=o, src=xt)
        nisa.max8(ob, xt)
        return [o, ob]

    o, ob = run(body, x)
    want = np.sort(x.reshape(P, 50), axis=1)[:, ::-1][:, :8]
    np.testing.assert_array_equal(o, want)
    np.testing.assert_array_equal(ob.reshape(P, 8), want.astype(BF16))


@pytest.mark.parametrize("src_shape, dst_shape, msg", [
    ((4, 7), (4, 8), "between 8 and 16384"),
    ((4, 16385), (4, 8), "between 8 and 16384"),
    ((4, 16), (4, 9), "exactly 8 elements"),
    ((4, 16), (8, 8), "has 8 partitions but the data has 4"),
    ((4, 16), (4, 2, 2, 2), "at most two free dims"),
])
def test_max8_rejects(src_shape, dst_shape, msg):
    def body():
        nisa.max8(tile(dst_shape), tile(src_shape))
        return []

    with pytest.raises(NkiValidationError, match=msg):
        run(body)


# ============================================================================ nc_find_index8
def _find_ref(data, vals, ones):
    """Loop reference: the k-th repeat of a value in vals takes its k-th occurrence in data."""
    out = np.full(vals.shape, ones, dtype=np.int64)
    for p in range(data.shape[0]):
        for i in range(8):
            k = int(np.sum(vals[p, :i] == vals[p, i]))
            occ = [j for j in range(data.shape[1]) if data[p, j] == vals[p, i]]
            if k < len(occ):
                out[p, i] = occ[k]
    return out


def test_find_index8_ties_and_missing():
    data = np.array([[5, 1, 5, 2, 5, 3, 0, 9, 4, 4]], np.float32)
    vals = np.array([[5, 5, 9, 7, 5, 5, 1, 2]], np.float32)
    r = rng(8)
    data2 = r.integers(0, 6, size=(8, 30)).astype(np.float32)
    vals2 = r.integers(0, 8, size=(8, 8)).astype(np.float32)

    def body(d, v, d2, v2):
        o = tile((1, 8), nl.uint32)
        o16 = tile((1, 8), nl.uint16)
        o2 = tile((8, 8), nl.uint32)
        nisa.nc_find_index8(dst=o, data=d, vals=v)
        nisa.nc_find_index8(o16, d, v)
        nisa.nc_find_index8(o2, d2, v2)
        return [o, o16, o2]

    o, o16, o2 = run(body, data, vals, data2, vals2)
    U32 = 0xFFFFFFFF
    np.testing.assert_array_equal(o[0], [0, 2, 7, U32, 4, U32, 1, 3])
    np.testing.assert_array_equal(o16[0], [0, 2, 7, 0xFFFF, 4, 0xFFFF, 1, 3])
    np.testing.assert_array_equal(o2, _find_ref(data2, vals2, U32))


@pytest.mark.parametrize("dst, data, vals, msg", [
    (((4, 8), nl.float32), (4, 16), (4, 8), "must be uint32 or uint16"),
    (((4, 8), nl.int32), (4, 16), (4, 8), "must be uint32 or uint16"),
    (((4, 8), nl.uint32), (4, 16), (4, 4), "'vals' must hold exactly 8"),
    (((4, 8), nl.uint32), (4, 4), (4, 8), "between 8 and 16384"),
    (((4, 8), nl.uint32), (4, 16), (2, 8), "'vals' has 2 partitions"),
])
def test_find_index8_rejects(dst, data, vals, msg):
    def body():
        nisa.nc_find_index8(tile(*dst), tile(data), tile(vals))
        return []

    with pytest.raises(NkiValidationError, match=msg):
        run(body)


# ============================================================================ nc_match_replace8
def test_match_replace8_reverse_order_ties_in_place():
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8],
                     [8, 1, 1, 6, 6, 0, 2, 2, 2, 9, 9]], np.float32)
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8],
                     [1, 1, 1, 6, 7, 2, 9, 2]], np.float32)

    def body(d, v):
        idx = tile((2, 8), nl.uint32)
        nisa.nc_match_replace8(dst=d, data=d, vals=v, imm=-1.0, dst_idx=idx)  # in place
        return [d, idx]

    out, idx = run(body, data, vals)
    U32 = 0xFFFFFFFF
    # row 0: the example of the SDK docstring; row 1: a third '1' and a '7' are missing
    np.testing.assert_array_equal(idx[0], [2, 10, 9, 8, 7, 6, 5, 4])
    np.testing.assert_array_equal(idx[1], [U32, 2, 1, 3, U32, 7, 9, 6])
    want = data.copy()
    want[0, [2, 4, 5, 6, 7, 8, 9, 10]] = -1
    want[1, [1, 2, 3, 6, 7, 9]] = -1
    np.testing.assert_array_equal(out, want)


def test_topk16_via_max8_and_match_replace8():
    P, F = 32, 64
    x = rng(9).permutation(P * F).reshape(P, F).astype(np.float32) * 0.37 - 300  # distinct

    def body(xt):
        m1, m2 = tile((P, 8)), tile((P, 8))
        i1, i2 = tile((P, 8), nl.uint32), tile((P, 8), nl.uint32)
        work = tile((P, F))
        nisa.max8(dst=m1, src=xt)
        nisa.nc_match_replace8(dst=work, data=xt, vals=m1, imm=float("-inf"), dst_idx=i1)
        nisa.max8(dst=m2, src=work)
        nisa.nc_match_replace8(dst=work, data=work, vals=m2, imm=float("-inf"), dst_idx=i2)
        return [m1, m2, i1, i2, work]

    m1, m2, i1, i2, work = run(body, x)
    order = np.argsort(-x, axis=1, kind="stable")[:, :16]
    want = np.sort(x, axis=1)[:, ::-1][:, :16]
    np.testing.assert_array_equal(np.concatenate([m1, m2], axis=1), want)
    np.testing.assert_array_equal(np.concatenate([i1, i2], axis=1), order)
    assert (np.isneginf(work).sum(axis=1) == 16).all()


@pytest.mark.parametrize("kw, msg", [
    (lambda: {"imm": "x"}, "imm' must be a Python float"),
    (lambda: {"imm": tile((4, 1))}, "imm' must be a Python float"),
    (lambda: {"dst_idx": tile((4, 8), nl.float32)}, "uint32, uint16 or int32"),
    (lambda: {"dst_idx": tile((4, 7), nl.uint32)}, "'dst_idx' must hold exactly 8"),
    (lambda: {"dst": tile((4, 15))}, "elements per partition"),
    (lambda: {"data": tile((4, 7)), "dst": tile((4, 7))}, "between 8 and 16384"),
    (lambda: {"vals": tile((4, 9))}, "'vals' must hold exactly 8"),
])
def test_match_replace8_rejects(kw, msg):
    def body():
        args = dict(dst=tile((4, 16)), data=tile((4, 16)), vals=tile((4, 8)), imm=0.0)
        args.update(kw())
        nisa.nc_match_replace8(**args)
        return []

    with pytest.raises(NkiValidationError, match=msg):
        run(body)


# ============================================================================ topk
def test_topk_snake_groups():
    P, n, X, K = 32, 40, 4, 10
    r = rng(10)
    src = np.full((P, X), 1e30, np.float32)      # slots past n hold huge values: must be ignored
    snakes = []
    for g in range(P // 16):
        v = (r.permutation(200)[:n] - 100).astype(np.float32)  # distinct, exact in bf16
        snakes.append(v)
        for e in range(n):
            src[16 * g + e % 16, e // 16] = v[e]
    src = src.astype(BF16)

    def body(st):
        vd = tile((P, K), nl.bfloat16)
        idd = tile((P, K), nl.uint32)
        nisa.topk(val_dst=vd, idx_dst=idd, src=st, n=n)
        return [vd, idd]

    vd, idd = run(body, src)
    for g, v in enumerate(snakes):
        top = np.argsort(v)[-K:]                   # ascending value, the K largest
        for p in range(16 * g, 16 * g + 16):
            np.testing.assert_array_equal(idd[p], top)
            np.testing.assert_array_equal(vd[p].astype(np.float32), v[top])


@pytest.mark.parametrize("kw, msg", [
    (lambda: {"src": tile((16, 4), nl.float32)}, "'src' must be bfloat16"),
    (lambda: {"val_dst": tile((16, 4), nl.float32)}, "'val_dst' must be bfloat16"),
    (lambda: {"idx_dst": tile((16, 4), nl.int32)}, "'idx_dst' must be uint32"),
    (lambda: {"src": tile((24, 4), nl.bfloat16), "val_dst": tile((24, 4), nl.bfloat16),
              "idx_dst": tile((24, 4), nl.uint32)}, "multiple of 16"),
    (lambda: {"n": 7}, "8 <= n < 65536"),
    (lambda: {"n": 65536, "src": tile((16, 4096), nl.bfloat16)}, "8 <= n < 65536"),
    (lambda: {"n": 8.0}, "'n' must be an int"),
    (lambda: {"n": 8, "val_dst": tile((16, 9), nl.bfloat16), "idx_dst": tile((16, 9), nl.uint32)},
     "from only n = 8"),
    (lambda: {"idx_dst": tile((16, 5), nl.uint32)}, "they must match"),
    (lambda: {"n": 80}, "ceil\\(n / 16\\) = 5"),
    (lambda: {"src": tile((16, 4), nl.bfloat16, nl.psum)}, "SBUF only"),
    (lambda: {"idx_dst": tile((32, 4), nl.uint32)}, "'idx_dst' has 32 partitions"),
])
def test_topk_rejects(kw, msg):
    def body():
        args = dict(val_dst=tile((16, 4), nl.bfloat16), idx_dst=tile((16, 4), nl.uint32),
                    src=tile((16, 4), nl.bfloat16), n=64)
        args.update(kw())
        nisa.topk(**args)
        return []

    with pytest.raises(NkiValidationError, match=msg):
        run(body)


# ============================================================================ nc_stream_shuffle
def test_stream_shuffle_quadrants_keep_broadcast_in_place():
    P, F = 64, 6
    x = np.arange(P * F, dtype=np.float32).reshape(P, F)
    old = -np.ones((P, F), np.float32)
    row = rng(11).standard_normal((1, F)).astype(np.float32)
    mask = [31 - i for i in range(32)]
    mask[3] = 255
    mask[7] = 255

    def body(xt, ot, rt_):
        nisa.nc_stream_shuffle(dst=ot, src=xt, shuffle_mask=mask)
        b = tile((32, F))
        nisa.nc_stream_shuffle(b, rt_, [0] * 32)
        ip = tile((P, F))
        nisa.tensor_copy(dst=ip, src=xt)
        nisa.nc_stream_shuffle(ip, ip, [(i + 1) % 32 for i in range(32)])  # rotate, in place
        return [ot, b, ip]

    o, b, ip = run(body, x, old, row)
    want = old.copy()
    want_ip = np.empty_like(x)
    for q in range(2):
        for i in range(32):
            if mask[i] != 255:
                want[32 * q + i] = x[32 * q + mask[i]]
            want_ip[32 * q + i] = x[32 * q + (i + 1) % 32]
    np.testing.assert_array_equal(o, want)
    np.testing.assert_array_equal(b, np.repeat(row, 32, axis=0))
    np.testing.assert_array_equal(ip, want_ip)


@pytest.mark.parametrize("kw, msg", [
    (lambda s, d: {"dst": tile((32, 4), nl.bfloat16)}, "needs equal dtypes"),
    (lambda s, d: {"dst": tile((32, 5))}, "elements per partition"),
    (lambda s, d: {"shuffle_mask": [0] * 31}, "must have 32 entries"),
    (lambda s, d: {"shuffle_mask": [0] * 31 + [40]}, "\\[0, 31\\] or 255"),
    (lambda s, d: {"shuffle_mask": 5}, "list of 32 ints"),
    (lambda s, d: {"src": tile((1, 4)), "shuffle_mask": [1] * 32}, "src has only 1 partitions"),
    (lambda s, d: {"src": tile((128, 4))[32:96], "dst": tile((128, 4))[0:64]},
     "starts at partition 32"),
    (lambda s, d: {"src": tile((128, 4))[0:32], "dst": tile((128, 4))[16:48]},
     "starts at partition 16"),
])
def test_stream_shuffle_rejects(kw, msg):
    def body():
        args = dict(dst=tile((32, 4)), src=tile((32, 4)), shuffle_mask=list(range(32)))
        args.update(kw(args["src"], args["dst"]))
        nisa.nc_stream_shuffle(**args)
        return []

    with pytest.raises(NkiValidationError, match=msg):
        run(body)


# ============================================================================ local_gather
def test_local_gather_per_core_fortran_order():
    P, G, e, m, nv = 32, 12, 2, 2, 20
    r = rng(12)
    src = r.standard_normal((P, G * e)).astype(np.float32)
    index = r.integers(0, G, size=(P, m)).astype(np.uint16)

    def body(st, it):
        o = tile((P, nv * e))
        nisa.local_gather(dst=o, src_buffer=st, index=it, num_elem_per_idx=e,
                          num_valid_indices=nv)
        return [o]

    (o,) = run(body, src, index)
    want = np.empty((P, nv * e), np.float32)
    for c in range(P // 16):
        # indices are read down the 16 partitions of the core first, then along the free dim
        seq = [int(index[16 * c + q, col]) for col in range(m) for q in range(16)][:nv]
        for p in range(16 * c, 16 * c + 16):
            want[p] = np.concatenate([src[p, g * e:(g + 1) * e] for g in seq])
    np.testing.assert_array_equal(o, want)


def test_local_gather_default_all_indices_bf16():
    P, G = 16, 8
    src = rng(13).standard_normal((P, G)).astype(BF16)
    index = np.arange(16, dtype=np.uint16).reshape(16, 1) % G

    def body(st, it):
        o = tile((P, 16), nl.bfloat16)
        nisa.local_gather(o, st, it)
        return [o]

    (o,) = run(body, src, index)
    np.testing.assert_array_equal(o, src[:, np.arange(16) % G])


@pytest.mark.parametrize("kw, msg", [
    (lambda: {"index": tile((16, 1), nl.uint32)}, "'index' must be uint16"),
    (lambda: {"dst": tile((16, 16), nl.bfloat16)}, "does not cast"),
    (lambda: {"num_elem_per_idx": 3}, "one of 1, 2, 4, 8, 16, 32"),
    (lambda: {"num_elem_per_idx": 16, "src_buffer": tile((16, 24)), "dst": tile((16, 256))},
     "not a multiple of"),
    (lambda: {"num_valid_indices": 17}, "must be in \\[1, 16\\]"),
    (lambda: {"dst": tile((16, 15))}, "num_valid_indices x num_elem_per_idx"),
    (lambda: {"index": tile((16, 260), nl.uint16), "dst": tile((16, 4160))},
     "exceed the maximum 4096"),
    (lambda: {"src_buffer": tile((24, 32)), "index": tile((24, 1), nl.uint16),
              "dst": tile((24, 16))}, "multiple of 16"),
    (lambda: {"index": tile((32, 1), nl.uint16)}, "'index' has 32 partitions"),
    (lambda: {"src_buffer": tile((16, 32), buffer=nl.psum)}, "SBUF only"),
])
def test_local_gather_rejects(kw, msg):
    def body():
        args = dict(dst=tile((16, 16)), src_buffer=tile((16, 32)), index=tile((16, 1), nl.uint16))
        args.update(kw())
        nisa.local_gather(**args)
        return []

    with pytest.raises(NkiValidationError, match=msg):
        run(body)


def test_local_gather_rejects_out_of_bounds_index():
    index = np.full((16, 1), 40, np.uint16)

    def body(it):
        s = tile((16, 32))
        nisa.memset(s, 0.0)
        nisa.local_gather(tile((16, 16)), s, it)
        return []

    with pytest.raises(NkiValidationError, match="index 40, past the 32 groups"):
        run(body, index)


# ============================================================================ nc_n_gather
def test_n_gather_per_partition():
    P = 8
    r = rng(14)
    data = r.standard_normal((P, 3, 5)).astype(BF16)
    idx = r.integers(0, 15, size=(P, 7)).astype(np.uint32)

    def body(dt_, it):
        o = tile((P, 7), nl.bfloat16)
        nisa.nc_n_gather(dst=o, data=dt_, indices=it)
        return [o]

    (o,) = run(body, data, idx)
    want = np.stack([data[p].reshape(-1)[idx[p]] for p in range(P)])
    np.testing.assert_array_equal(o, want)


@pytest.mark.parametrize("kw, msg", [
    (lambda: {"indices": tile((4, 6), nl.int32)}, "must be uint32"),
    (lambda: {"dst": tile((4, 6), nl.bfloat16)}, "they must match"),
    (lambda: {"dst": tile((4, 5))}, "elements per partition"),
    (lambda: {"indices": tile((2, 6), nl.uint32)}, "'indices' has 2 partitions"),
    (lambda: {"data": tile((4, 10), buffer=nl.psum)}, "SBUF only"),
])
def test_n_gather_rejects(kw, msg):
    def body():
        args = dict(dst=tile((4, 6)), data=tile((4, 10)), indices=tile((4, 6), nl.uint32))
        args.update(kw())
        nisa.nc_n_gather(**args)
        return []

    with pytest.raises(NkiValidationError, match=msg):
        run(body)


def test_n_gather_rejects_out_of_row_index():
    idx = np.zeros((4, 6), np.uint32)
    idx[2, 3] = 10

    def body(it):
        d = tile((4, 10))
        nisa.memset(d, 1.0)
        nisa.nc_n_gather(tile((4, 6)), d, it)
        return []

    with pytest.raises(NkiValidationError, match="\\[2, 3\\] = 10 is outside \\[0, 10\\)"):
        run(body, idx)


# ============================================================================ sequence_bounds
@pytest.mark.parametrize("npdt", [np.int32, np.float32])
def test_sequence_bounds(npdt):
    ids = np.array([[1, 1, 2, 2, 2, 0, 0, 3, 1, 1, 0, 4]], npdt)
    n = ids.shape[1]

    def body(it):
        o = tile((1, 2, n), nl.int32 if npdt is np.int32 else nl.float32)
        nisa.sequence_bounds(dst=o, segment_ids=it)
        return [o]

    (o,) = run(body, ids)
    start = [0, 0, 2, 2, 2, 12, 12, 7, 8, 8, 12, 11]
    end = [2, 2, 5, 5, 5, -1, -1, 8, 10, 10, -1, 12]
    np.testing.assert_array_equal(o[0], np.array([start, end], npdt))


@pytest.mark.parametrize("kw, msg", [
    (lambda: {"segment_ids": tile((2, 8), nl.int32), "dst": tile((2, 2, 8), nl.int32)},
     "exactly 1 partition"),
    (lambda: {"dst": tile((1, 2, 8), nl.float32)}, "must match segment_ids"),
    (lambda: {"segment_ids": tile((1, 8), nl.bfloat16), "dst": tile((1, 2, 8), nl.bfloat16)},
     "float32 or int32"),
    (lambda: {"dst": tile((1, 2, 7), nl.int32)}, "must hold 2 x 8"),
    (lambda: {"dst": tile((1, 2, 8), nl.int32, nl.psum)}, "SBUF only"),
])
def test_sequence_bounds_rejects(kw, msg):
    def body():
        args = dict(dst=tile((1, 2, 8), nl.int32), segment_ids=tile((1, 8), nl.int32))
        args.update(kw())
        nisa.sequence_bounds(**args)
        return []

    with pytest.raises(NkiValidationError, match=msg):
        run(body)


def test_sequence_bounds_rejects_negative_id():
    ids = np.array([[1, 1, -2, 0]], np.int32)

    def body(it):
        nisa.sequence_bounds(tile((1, 2, 4), nl.int32), it)
        return []

    with pytest.raises(NkiValidationError, match="non-negative"):
        run(body, ids)


# ============================================================================ nonzero_with_count
def test_nonzero_with_count_partitions_0_16():
    P, F = 32, 10
    src = np.zeros((P, F), np.float32)
    src[0, [1, 4, 5, 9]] = [2.0, -1.0, 0.5, 7.0]
    src[16, :] = 1.0
    src[1, :] = 3.0   # not a GpSimd core's first partition: ignored

    def body(st):
        o = tile((P, F + 1), nl.int32)
        nisa.memset(o, 77)
        nisa.nonzero_with_count(dst=o, src=st, index_offset=100, padding_val=-1)
        return [o]

    (o,) = run(body, src, tgt="trn2")
    want = np.full((P, F + 1), 77, np.int32)
    want[0] = [101, 104, 105, 109, -1, -1, -1, -1, -1, -1, 4]
    want[16] = list(range(100, 110)) + [10]
    np.testing.assert_array_equal(o, want)


def test_nonzero_with_count_int32_empty_row():
    src = np.zeros((16, 8), np.int32)

    def body(st):
        o = tile((16, 9), nl.int32)
        nisa.memset(o, 5)
        nisa.nonzero_with_count(o, st, padding_val=-7)
        return [o]

    (o,) = run(body, src)
    np.testing.assert_array_equal(o[0], [-7] * 8 + [0])
    np.testing.assert_array_equal(o[1:], 5)


@pytest.mark.parametrize("kw, msg", [
    (lambda: {"dst": tile((16, 8), nl.int32)}, "\\+ 1 count per partition = 9"),
    (lambda: {"dst": tile((16, 9), nl.float32)}, "'dst' must be int32"),
    (lambda: {"src": tile((16, 8), nl.bfloat16)}, "float32 or int32"),
    (lambda: {"index_offset": 1.5}, "'index_offset' must be an int"),
    (lambda: {"padding_val": None}, "'padding_val' must be an int"),
    (lambda: {"dst": tile((8, 9), nl.int32)}, "'dst' has 8 partitions"),
    (lambda: {"src": tile((16, 8), buffer=nl.psum)}, "SBUF only"),
])
def test_nonzero_with_count_rejects(kw, msg):
    def body():
        args = dict(dst=tile((16, 9), nl.int32), src=tile((16, 8)))
        args.update(kw())
        nisa.nonzero_with_count(**args)
        return []

    with pytest.raises(NkiValidationError, match=msg):
        run(body)


def test_nonzero_with_count_needs_trn2():
    def body():
        nisa.nonzero_with_count(tile((16, 9), nl.int32), tile((16, 8)))
        return []

    with pytest.raises(NkiValidationError, match="needs Trn2"):
        run(body, tgt="trn1")


# ============================================================================ dropout
def test_dropout_limits_rate_and_per_partition_prob():
    P, F = 128, 256
    x = rng(15).standard_normal((P, F)).astype(np.float32) + 10.0   # never 0 before dropout
    pp = np.where(np.arange(P) % 2 == 0, 0.0, 1.0).astype(np.float32).reshape(P, 1)

    def body(xt, pt):
        keep, drop, some, per = (tile((P, F)) for _ in range(4))
        nisa.dropout(dst=keep, data=xt, prob=0.0)
        nisa.dropout(dst=drop, data=xt, prob=1.0)
        nisa.dropout(dst=some, data=xt, prob=0.3)
        nisa.dropout(dst=per, data=xt, prob=pt)
        return [keep, drop, some, per]

    keep, drop, some, per = run(body, x, pp)
    np.testing.assert_array_equal(keep, x)
    np.testing.assert_array_equal(drop, 0.0)
    dropped = some == 0
    assert abs(dropped.mean() - 0.3) < 0.02          # 32768 draws: sd ~ 0.0025
    np.testing.assert_array_equal(some[~dropped], x[~dropped])   # kept values are not rescaled
    np.testing.assert_array_equal(per[0::2], x[0::2])
    np.testing.assert_array_equal(per[1::2], 0.0)
    again = run(body, x, pp)[2]
    np.testing.assert_array_equal(again, some)       # deterministic per core seed


def test_dropout_int_data_with_fp32_prob_tile():
    x = np.arange(1, 16 * 64 + 1, dtype=np.int32).reshape(16, 64)
    pr = np.full((16, 1), 0.5, np.float32)

    def body(xt, pt):
        o = tile((16, 64), nl.int32)
        nisa.dropout(o, xt, pt)
        return [o]

    (o,) = run(body, x, pr)
    kept = o != 0
    np.testing.assert_array_equal(o[kept], x[kept])
    assert 0.35 < kept.mean() < 0.65


@pytest.mark.parametrize("kw, msg", [
    (lambda: {"prob": 1.5}, "must be in \\[0, 1\\]"),
    (lambda: {"prob": -0.1}, "must be in \\[0, 1\\]"),
    (lambda: {"prob": "0.5"}, "Python float or a \\(16, 1\\) tensor"),
    (lambda: {"prob": tile((16, 2))}, "per-partition tensor"),
    (lambda: {"dst": tile((16, 8), nl.bfloat16)}, "it must match data"),
    (lambda: {"dst": tile((16, 7))}, "elements per partition"),
    (lambda: {"data": tile((16, 8), nl.int32), "dst": tile((16, 8), nl.int32),
              "prob": tile((16, 1), nl.bfloat16)}, "must be float32 when data is an integer"),
])
def test_dropout_rejects(kw, msg):
    def body():
        args = dict(dst=tile((16, 8)), data=tile((16, 8)), prob=0.5)
        args.update(kw())
        nisa.dropout(**args)
        return []

    with pytest.raises(NkiValidationError, match=msg):
        run(body)


# ============================================================================ engines in the trace
def test_trace_engines():
    x = np.zeros((16, 16), np.float32)

    def body(xt):
        o = tile((16, 16))
        m = tile((16, 8))
        nisa.affine_select(o, [[1, 16]], 0, xt, 0.0)
        nisa.max8(m, xt)
        return []

    with trace() as tr:
        run(body, x)
    ops_ = {(i.opcode, i.engine) for i in tr}
    assert ("affine_select", "gpsimd") in ops_ and ("max8", "vector") in ops_
