"""NkiTensor: indexing rules, nl.ds, view methods, .ap(), aliasing through views, sentinels.

Every expectation is plain NumPy indexing of the same host array (NKI API reference: NkiTensor
indexing and views). Views are checked by reading their elements (``t._read()``) inside a
kernel and by round trips through instructions (DMA / tensor_copy), so a wrong stride, offset or
shape fails.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from kernel_helpers import in_kernel, load, val

from nki_kernels.emulator import NkiValidationError, jit
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl

BF16 = ml_dtypes.bfloat16


def sbuf_from(a_hbm, dtype=None):
    return load(a_hbm, dtype)


A3 = np.arange(64 * 64 * 64, dtype=np.float32).reshape(64, 64, 64)


# ------------------------------------------------------------------------------ attributes
def test_fresh_tensor_attributes():
    def body():
        t = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, name="t")
        h = nl.ndarray((4, 8, 16), nl.bfloat16, buffer=nl.shared_hbm)
        return (t.shape, t.strides, t.offset, t.ndim, t.size, t.dtype, t.buffer, t.name,
                h.strides, h.size, h.buffer, t.get_pattern(), t.is_contiguous(),
                t.is_indirect())
    (shape, strides, off, ndim, size, dtype, buf, name, hstr, hsize, hbuf, pat, contig,
     ind) = in_kernel(body)
    assert shape == (128, 64) and strides == (64, 1) and off == 0
    assert ndim == 2 and size == 128 * 64
    assert dtype is nl.float32 and buf is nl.sbuf and name == "t"
    assert hstr == (128, 16, 1) and hsize == 512 and hbuf is nl.shared_hbm
    assert pat == [[64, 128], [1, 64]] and contig and not ind


# ------------------------------------------------------------------------------ __getitem__
@pytest.mark.parametrize("buf", ["sbuf", "psum"])
def test_on_chip_index_shapes_spec_examples(buf):
    """A 3-D tile t=(64,64,64) on chip: partition dim first (NKI tensor indexing)."""
    def body():
        t = nl.ndarray((64, 64, 64), nl.float32, buffer=getattr(nl, buf))
        return [t[0, 0, 10].shape, t[:, 0].shape, t[:, 0, 10].shape, t[0, ..., :].shape,
                t[:, :, ::2].shape, t[0].shape, t[3:5, 1].shape]
    got = in_kernel(body)
    assert got == [(1, 1), (64, 64), (64, 1), (1, 64, 64), (64, 64, 32), (1, 64, 64), (2, 64)]


def test_on_chip_index_values():
    def body(a):
        t = sbuf_from(a)
        return [val(v) for v in (t[0, 0, 10], t[:, 0], t[:, 0, 10], t[0, ..., :], t[:, :, ::2],
                                 t[-1, -2, 3:9:3], t[5:9, 1:60:7, 63])]
    got = in_kernel(body, A3)
    exp = [A3[0:1, 0, 10:11], A3[:, 0], A3[:, 0, 10:11], A3[0:1], A3[:, :, ::2],
           A3[63:64, 62, 3:9:3], A3[5:9, 1:60:7, 63]]
    for g, e in zip(got, exp):
        np.testing.assert_array_equal(g, e)


def test_hbm_index_drops_dims():
    h_np = np.arange(4 * 128 * 32, dtype=np.float32).reshape(4, 128, 32)

    def body(h):
        return [(v.shape, val(v)) for v in (h[0, :, :], h[1, 5], h[2, :, 7], h[3, 100, 31],
                                            h[..., 0], h[-1, 1:3])]
    got = in_kernel(body, h_np)
    exp = [h_np[0], h_np[1, 5], h_np[2, :, 7], h_np[3, 100, 31:32], h_np[..., 0], h_np[-1, 1:3]]
    assert got[0][0] == (128, 32)
    assert got[3][0] == (1,)          # HBM results stay >= 1-D
    for (shape, g), e in zip(got, exp):
        assert shape == e.shape
        np.testing.assert_array_equal(g, e)


def test_index_rejects_arrays_negative_steps_and_out_of_range():
    def body():
        t = nl.ndarray((8, 16), nl.float32)
        errs = []
        for key in ((slice(None), slice(None, None, -1)), (slice(None), 16), (8,),
                    (slice(None), np.array([0, 1])), (0, 0, 0)):
            try:
                t[key]
            except IndexError as e:
                errs.append(str(e))
        return errs
    assert len(in_kernel(body)) == 5


# ------------------------------------------------------------------------------ nl.ds
def test_ds_static_equals_slice():
    a = np.arange(32 * 40, dtype=np.float32).reshape(32, 40)

    def body(h):
        t = sbuf_from(h)
        v1, v2 = t[nl.ds(8, 16), nl.ds(4, 8)], h[nl.ds(3, 5), 10]
        return v1.shape, val(v1), v2.shape, val(v2)
    s1, g1, s2, g2 = in_kernel(body, a)
    assert s1 == (16, 8) and s2 == (5,)
    np.testing.assert_array_equal(g1, a[8:24, 4:12])
    np.testing.assert_array_equal(g2, a[3:8, 10])


def test_ds_runtime_start_in_fori_loop():
    """nl.ds(i * 16, 16) with i an NkiScalar: a dynamic view resolved when the DMA runs."""
    a = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) * 0.5

    @jit
    def k(x):
        out = nl.ndarray((64, 8), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((16, 8), nl.float32)

        def body(i):
            nisa.dma_copy(dst=t, src=x[nl.ds(i * 16, 16), :])
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
            nisa.dma_copy(dst=out[nl.ds(i * 16, 16), :], src=t)
        nl.fori_loop(0, 4, body)
        return out
    np.testing.assert_array_equal(k(a), a + 1.0)


def test_ds_runtime_start_is_not_a_python_int():
    def body():
        seen = []

        def loop(i):
            with pytest.raises(TypeError):
                int(i)
            with pytest.raises(TypeError):
                bool(i)
            seen.append(1)
        nl.fori_loop(0, 3, loop)
        return len(seen)
    assert in_kernel(body) == 3


# ------------------------------------------------------------------------------ view methods
B = np.arange(6 * 8 * 10, dtype=np.float32).reshape(6, 8, 10)


def test_slice_select_permute_on_hbm():
    def body(h):
        i = nl.ndarray((1, 1), nl.int32)
        nisa.memset(i, 4)
        views = [h.slice(1, 2, 8, 2), h.slice(0, 1, 3), h.select(1, 3), h.select(2, -1),
                 h.permute((2, 0, 1)), h.select(0, i)]
        return [(v.shape, val(v)) for v in views], h.select(0, i).is_indirect()
    got, dyn = in_kernel(body, B)
    exp = [B[:, 2:8:2], B[1:3], B[:, 3], B[:, :, -1], B.transpose(2, 0, 1), B[4]]
    for (shape, g), e in zip(got, exp):
        assert shape == e.shape
        np.testing.assert_array_equal(g, e)
    assert dyn   # a select by a (1,1) SBUF tensor is a dynamic view


def test_on_chip_view_methods_values():
    a = np.arange(8 * 32, dtype=np.float32).reshape(8, 32)

    def body(h):
        t = sbuf_from(h)
        r3 = t.reshape_dim(1, (4, -1))              # (8, 4, 8)
        views = {
            "reshape_dim": r3,
            "permute": r3.permute((0, 2, 1)),
            "flatten": r3.flatten_dims(1, 2),
            "expand": t.expand_dim(1),
            "squeeze": t.expand_dim(1).squeeze_dim(1),
            "expand_last": t.expand_dim(2),
            "reshape": t.reshape((8, 2, 16)),
            "reshape_m1": t.reshape((8, -1, 4)),
            "rearrange": t.rearrange(("p", ("h", "w")), ("p", "w", "h"), {"h": 4}),
            "rearrange_merge": r3.rearrange(("p", "a", "b"), ("p", ("a", "b"))),
            "slice": t.slice(1, 3, 30, 3),
        }
        return {k: (v.shape, val(v)) for k, v in views.items()}
    got = in_kernel(body, a)
    exp = {
        "reshape_dim": a.reshape(8, 4, 8), "permute": a.reshape(8, 4, 8).transpose(0, 2, 1),
        "flatten": a, "expand": a[:, None, :], "squeeze": a, "expand_last": a[:, :, None],
        "reshape": a.reshape(8, 2, 16), "reshape_m1": a.reshape(8, 8, 4),
        "rearrange": a.reshape(8, 4, 8).transpose(0, 2, 1), "rearrange_merge": a,
        "slice": a[:, 3:30:3],
    }
    for k, e in exp.items():
        assert got[k][0] == e.shape, k
        np.testing.assert_array_equal(got[k][1], e, err_msg=k)


def test_broadcast_view_feeds_an_instruction():
    col = np.arange(16, dtype=np.float32).reshape(16, 1) - 3.5

    def body(h):
        c = sbuf_from(h)
        b = c.broadcast(1, 8)
        out = nl.ndarray((16, 8), nl.float32)
        nisa.tensor_copy(dst=out, src=b)
        return b.shape, b.strides[1], val(out)
    shape, stride, out = in_kernel(body, col)
    assert shape == (16, 8) and stride == 0
    np.testing.assert_array_equal(out, np.broadcast_to(col, (16, 8)))


def test_reshape_and_flatten_reject_copies():
    def body():
        t = nl.ndarray((8, 4, 6), nl.float32)
        p = t.permute((0, 2, 1))
        errs = []
        for f in (lambda: p.reshape((8, 24)), lambda: p.flatten_dims(1, 2),
                  lambda: t.reshape((4, 48))):
            try:
                f()
            except NkiValidationError as e:
                errs.append(str(e))
        ok = t[:, 1:3, :].reshape((8, 12)).shape   # contiguous inner run: no copy needed
        return errs, ok
    errs, ok = in_kernel(body)
    assert len(errs) == 3
    assert "without a copy" in errs[0]
    assert "not contiguous" in errs[1]
    assert "partition dim" in errs[2]
    assert ok == (8, 12)


def test_reshape_hbm_changes_leading_dim():
    def body(h):
        v = h.reshape((48, 10))
        w = h.reshape((6, -1))
        return v.shape, val(v), w.shape, val(w)
    s1, g1, s2, g2 = in_kernel(body, B)
    assert s1 == (48, 10) and s2 == (6, 80)
    np.testing.assert_array_equal(g1, B.reshape(48, 10))
    np.testing.assert_array_equal(g2, B.reshape(6, 80))
    with pytest.raises(ValueError, match="cannot reshape"):
        in_kernel(lambda h: h.reshape((7, 10)), B)


def test_view_dtype_reinterpretation():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 8)).astype(np.float32)

    def body(h):
        t = sbuf_from(h)
        vi = t.view(nl.int32)
        vb = t.view(nl.bfloat16)
        v8 = t.bitcast(nl.uint8)
        back = vb.view(nl.float32)
        rc = t.reinterpret_cast(nl.int32)
        return ((vi.shape, val(vi)), (vb.shape, val(vb)), (v8.shape, val(v8)),
                (back.shape, val(back)), val(rc))
    (si, gi), (sb, gb), (s8, g8), (sf, gf), grc = in_kernel(body, a)
    assert si == (4, 8) and sb == (4, 16) and s8 == (4, 32) and sf == (4, 8)
    np.testing.assert_array_equal(gi, a.view(np.int32))
    np.testing.assert_array_equal(gb.view(np.uint16), a.view(np.uint16))
    np.testing.assert_array_equal(g8, a.view(np.uint8))
    np.testing.assert_array_equal(gf, a)
    np.testing.assert_array_equal(grc, a.view(np.int32))


def test_view_to_wider_dtype_needs_divisible_last_dim():
    def body():
        t = nl.ndarray((4, 6), nl.bfloat16)
        ok = t.view(nl.float32).shape
        with pytest.raises(NkiValidationError, match="divisible by 2"):
            t[:, 1:4].view(nl.float32)
        with pytest.raises(NkiValidationError, match="contiguous"):
            t[:, ::2].view(nl.float32)
        return ok
    assert in_kernel(body) == (4, 3)


# ------------------------------------------------------------------------------ .ap()
def test_ap_scalar_offset_spec_example():
    """A(512,512).ap([[512,128],[1,256]], offset=0, scalar_offset=r, indirect_dim=0) ==
    A[r:r+128, 0:256] (NKI API reference: access patterns, .ap())."""
    a = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)
    r_np = np.array([[37]], dtype=np.int32)

    def body(A, r_hbm):
        r = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=r, src=r_hbm)
        v = A.ap([[512, 128], [1, 256]], offset=0, scalar_offset=r, indirect_dim=0)
        t = nl.ndarray((128, 256), nl.float32)
        nisa.dma_copy(dst=t, src=v)
        # same view with an NkiScalar start (nl.ds) inside a runtime loop
        got = []

        def loop(i):
            u = nl.ndarray((128, 256), nl.float32)
            nisa.dma_copy(dst=u, src=A.ap([[512, 128], [1, 256]], offset=0, scalar_offset=i,
                                          indirect_dim=0))
            w = nl.ndarray((128, 256), nl.float32)
            nisa.dma_copy(dst=w, src=A[nl.ds(i, 128), 0:256])
            got.append((val(u), val(w)))
        nl.fori_loop(100, 102, loop)
        return v.shape, val(t), got
    shape, t, got = in_kernel(body, a, r_np)
    assert shape == (128, 256)
    np.testing.assert_array_equal(t, a[37:165, 0:256])
    for r, (u, w) in zip((100, 101), got):
        np.testing.assert_array_equal(u, a[r:r + 128, 0:256])
        np.testing.assert_array_equal(w, a[r:r + 128, 0:256])


def test_ap_scalar_offset_uses_the_base_tensors_dim_stride():
    """m = stride of indirect_dim of the tensor .ap is called on, not of the pattern."""
    a = np.arange(16 * 8 * 4, dtype=np.float32).reshape(16, 8, 4)

    def body(h):
        v = h.ap([[32, 2], [4, 3], [1, 2]], offset=4, scalar_offset=5, indirect_dim=0)
        w = h.ap([[32, 2], [1, 4]], offset=0, scalar_offset=3, indirect_dim=1)
        return val(v), val(w)
    v, w = in_kernel(body, a)
    flat = a.reshape(-1)
    exp_v = np.array([[[flat[4 + 5 * 32 + 32 * i + 4 * j + k] for k in range(2)]
                       for j in range(3)] for i in range(2)])
    np.testing.assert_array_equal(v, exp_v)
    np.testing.assert_array_equal(w, a[0:2, 3, :])


def test_ap_ignores_the_view_but_inherits_its_offset():
    a = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)

    def body(h):
        sub = h[10:20, 5:9]
        inherit = sub.ap([[16, 2], [1, 3]])           # base = sub.offset
        explicit = sub.ap([[16, 2], [1, 3]], offset=0)
        strided = h.ap([[32, 3], [2, 4]], offset=1)
        return val(inherit), val(explicit), val(strided)
    inherit, explicit, strided = in_kernel(body, a)
    np.testing.assert_array_equal(inherit, a[10:12, 5:8])
    np.testing.assert_array_equal(explicit, a[0:2, 0:3])
    np.testing.assert_array_equal(strided, a.reshape(-1)[1:97].reshape(3, 32)[:, 0:8:2])


def test_ap_on_chip_view_steps_partitions_by_its_own_free_size():
    """On SBUF the first pair steps whole partitions; its step may be the free size of the
    tensor .ap() is called on (NKI Access Patterns guide), here a (4, 8) view of a (4, 16) tile:
    the access still moves one partition (16 elements of the allocation) per step. NKI Library's
    mlp_tkg relies on it (bias with fused gate/up at LNC 2, a device QoR baseline)."""
    a = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)

    def body(h):
        t = sbuf_from(h)
        half = t[:, 8:16]                                   # the second half: offset 8
        v = half.ap([[8, 4], [1, 6]])                       # step 8 = the view's free size
        w = t.ap([[16, 4], [1, 6]], offset=8)               # the same, by the allocation
        return val(v), val(w)
    v, w = in_kernel(body, a)
    np.testing.assert_array_equal(v, a[:, 8:14])
    np.testing.assert_array_equal(w, a[:, 8:14])


def test_ap_dtype_int32_storage_as_bf16():
    """int32 (128,256) viewed as bf16 -> pattern [[512,128],[1,512]]."""
    rng = np.random.default_rng(2)
    bits = rng.integers(-2**31, 2**31 - 1, size=(128, 256), dtype=np.int64).astype(np.int32)

    def body(h):
        t = sbuf_from(h)
        v = t.ap([[512, 128], [1, 512]], dtype=nl.bfloat16)
        out = nl.ndarray((128, 512), nl.bfloat16)
        nisa.tensor_copy(dst=out, src=v)           # same dtype: bit exact
        return v.shape, v.dtype, val(out)
    shape, dtype, out = in_kernel(body, bits)
    assert shape == (128, 512) and dtype is nl.bfloat16
    np.testing.assert_array_equal(out.view(np.uint16), bits.view(np.uint16))


def test_ap_on_chip_partition_offset_and_strides():
    a = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)

    def body(h):
        t = sbuf_from(h)
        quad = t.ap([[64, 4], [1, 64]], offset=32 * 64)      # partitions 32..35
        even = t.ap([[64, 128], [2, 32]])                    # t[:, ::2]
        inner = t.ap([[64, 8], [8, 4], [1, 2]], offset=3)    # 2 free dims
        return val(quad), val(even), val(inner)
    quad, even, inner = in_kernel(body, a)
    np.testing.assert_array_equal(quad, a[32:36])
    np.testing.assert_array_equal(even, a[:, ::2])
    np.testing.assert_array_equal(inner, a[0:8, 3:35].reshape(8, 4, 8)[:, :, 0:2])


# ------------------------------------------------------------------------------ aliasing
def test_writes_through_one_view_visible_through_others():
    def body():
        t = nl.ndarray((8, 16), nl.float32)
        nisa.memset(t, 0.0)
        nisa.memset(t[:, 4:8], 2.5)                          # slice view
        nisa.memset(t.reshape_dim(1, (4, 4))[:, 3, :], -1.0)  # split-dim view: cols 12..15
        nisa.memset(t.ap([[16, 2], [1, 2]], offset=16 * 6), 7.0)  # rows 6,7 cols 0,1
        as_int = val(t.view(nl.int32))
        whole = val(t)
        perm = val(t.reshape_dim(1, (2, 8)).permute((0, 2, 1)))
        return whole, as_int, perm
    whole, as_int, perm = in_kernel(body)
    exp = np.zeros((8, 16), np.float32)
    exp[:, 4:8] = 2.5
    exp[:, 12:16] = -1.0
    exp[6:8, 0:2] = 7.0
    np.testing.assert_array_equal(whole, exp)
    np.testing.assert_array_equal(as_int, exp.view(np.int32))
    np.testing.assert_array_equal(perm, exp.reshape(8, 2, 8).transpose(0, 2, 1))


def test_hbm_write_through_reshaped_view():
    @jit
    def k():
        out = nl.ndarray((4, 6), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 24), nl.float32)
        nisa.iota(t, [[1, 24]])
        nisa.dma_copy(dst=out.reshape((2, 12)), src=t)
        nisa.dma_copy(dst=out.reshape((24,))[5:7], src=t[:, 0:2])  # overwrite 2 elements
        return out
    exp = np.arange(24, dtype=np.float32)
    exp[5:7] = [0, 1]
    np.testing.assert_array_equal(k(), exp.reshape(4, 6))


def test_setitem_copies_into_view():
    def body(h):
        t = nl.ndarray((4, 8), nl.float32)
        t[...] = 0.0
        t[:, 2:4] = 1.5
        u = nl.ndarray((4, 2), nl.float32)
        nisa.memset(u, 9.0)
        t[:, 6:8] = u
        t[0:2, 0:2] = h
        return val(t)
    got = in_kernel(body, np.full((2, 2), 3.0, np.float32))
    exp = np.zeros((4, 8), np.float32)
    exp[:, 2:4] = 1.5
    exp[:, 6:8] = 9.0
    exp[0:2, 0:2] = 3.0
    np.testing.assert_array_equal(got, exp)


# ------------------------------------------------------------------------------ sentinels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3",
                                   "float8_e5m2", "tfloat32"])
@pytest.mark.parametrize("buf", ["sbuf", "psum", "shared_hbm", "private_hbm"])
def test_fresh_float_tensors_are_nan(dtype, buf):
    def body():
        t = nl.ndarray((4, 8), getattr(nl, dtype), buffer=getattr(nl, buf))
        return val(t).astype(np.float32)
    assert np.isnan(in_kernel(body)).all()


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "uint8", "uint16", "uint32"])
def test_fresh_int_tensors_are_4(dtype):
    def body():
        return val(nl.ndarray((4, 8), getattr(nl, dtype))), val(
            nl.ndarray((3,), getattr(nl, dtype), buffer=nl.shared_hbm))
    a, b = in_kernel(body)
    assert (a == 4).all() and (b == 4).all()


def test_reading_unwritten_memory_gives_nan_in_the_output():
    x = np.ones((8, 16), np.float32)

    @jit
    def k(a):
        t = nl.ndarray((8, 16), nl.float32)
        nisa.dma_copy(dst=t[:, 0:10], src=a[:, 0:10])   # columns 10.. never written
        o = nl.ndarray((8, 16), nl.float32)
        nisa.activation(dst=o, op=nl.exp, data=t)
        out = nl.ndarray((8, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o)
        return out
    y = k(x)
    np.testing.assert_allclose(y[:, :10], np.e, rtol=1e-6)
    assert np.isnan(y[:, 10:]).all()


def test_unwritten_output_rows_are_nan_and_zeros_are_zero():
    @jit
    def k():
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        z = nl.zeros((2, 4), nl.float32)
        nisa.dma_copy(dst=out[0:2], src=z)
        return out
    y = k()
    assert (y[0:2] == 0).all() and np.isnan(y[2:]).all()
