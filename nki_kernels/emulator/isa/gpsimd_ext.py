"""Cross-partition moves, gathers, sparse helpers and dropout (nki-spec §9.2.8-9.2.10, §9.7, §9.9):
``nc_stream_shuffle`` (VectorE), ``local_gather``, ``nc_n_gather``, ``sequence_bounds``,
``nonzero_with_count`` (GpSimd) and ``dropout`` (VectorE). ``iota`` lives in vector.py."""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from .. import runtime as rt
from ..errors import fail
from ..tensor import NkiTensor
from ._common import (
    emit,
    need_gen,
    on_chip,
    psum_write_clear,
    same_shape_pf,
    start_partition,
    tensor,
)

GPSIMD_CORE_PARTITIONS = 16   # each of the 8 GpSimd cores owns 16 consecutive partitions
LOCAL_GATHER_MAX_INDICES = 4096


def _sbuf_only(I, role, t):
    tensor(I, role, t)
    if t.buffer is rt.psum:
        raise fail(I, role, "is in PSUM; GpSimd reads and writes SBUF only")
    return on_chip(I, role, t)


def _int(I, role, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise fail(I, role, f"must be an int; got {v!r}")
    return int(v)


def _same_p(I, items):
    (r0, t0) = items[0]
    for r, t in items[1:]:
        if t.shape[0] != t0.shape[0]:
            raise fail(I, r, f"has {t.shape[0]} partitions but '{r0}' has {t0.shape[0]}; they must "
                             f"match")


# ------------------------------------------------------------------------------- nc_stream_shuffle
def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Within each 32-partition quadrant q: ``dst[32q + i] = src[32q + mask[i]]``;
    ``mask[i] == 255`` leaves dst partition i unchanged (VectorE, SBUF/PSUM, in place allowed)."""
    I = "nc_stream_shuffle"
    on_chip(I, "dst", dst)
    on_chip(I, "src", src)
    if dst.dtype is not src.dtype:
        raise fail(I, "dst", f"has dtype {dst.dtype} but src has {src.dtype}; the shuffle moves "
                             f"raw elements and needs equal dtypes")
    if dst.free_size != src.free_size:
        raise fail(I, "dst", f"has {dst.free_size} elements per partition but src has "
                             f"{src.free_size}; they must match")
    try:
        mask = [int(m) for m in shuffle_mask]
    except TypeError:
        raise fail(I, "shuffle_mask", f"must be a list of 32 ints; got {shuffle_mask!r}") from None
    if len(mask) != 32:
        raise fail(I, "shuffle_mask", f"must have 32 entries (one per partition of a quadrant); "
                                      f"got {len(mask)}")
    bad = [m for m in mask if not (0 <= m < 32 or m == 255)]
    if bad:
        raise fail(I, "shuffle_mask", f"entries must be in [0, 31] or 255 (keep); got {bad[:4]}")
    Ps, Pd = src.shape[0], dst.shape[0]
    A = -(-max(Ps, Pd) // 32) * 32
    allowed = (0,) if A >= 96 else (0, 64) if A == 64 else (0, 32, 64, 96)
    for role, t in (("src", src), ("dst", dst)):
        p0 = start_partition(t)
        if p0 not in allowed:
            raise fail(I, role, f"starts at partition {p0}; a shuffle spanning {A} partitions must "
                                f"start at {' or '.join(str(a) for a in allowed)}")
    # spec silent on mask entries whose source partition is past src: we reject them (the engine
    # would read another tensor's partitions); entries for dst partitions past dst are ignored.
    for j in range(Pd):
        q, i = divmod(j, 32)
        if mask[i] != 255 and q * 32 + mask[i] >= Ps:
            raise fail(I, "shuffle_mask", f"entry {i} = {mask[i]} reads src partition "
                                          f"{q * 32 + mask[i]} (quadrant {q}) but src has only "
                                          f"{Ps} partitions")
    s = np.array(src.read_pf(), copy=True)
    d = np.array(dst.read_pf(), copy=True)
    for j in range(Pd):
        q, i = divmod(j, 32)
        if mask[i] != 255:
            d[j] = s[q * 32 + mask[i]]
    dst.write_pf(d, cast=False)
    psum_write_clear(dst)
    return emit("vector", I, [("src", src)], [("dst", dst)], {}, name)


# ------------------------------------------------------------------------------- local_gather
def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """Per GpSimd core c (partitions 16c..16c+15): ``idx = index[16c:16c+16]`` flattened
    partition-first (Fortran order), first ``num_valid_indices`` kept; every partition p of the
    core gets ``dst[p, j, :] = src_buffer[p, idx[j], :]`` where src is viewed as
    ``(P, groups, num_elem_per_idx)`` (the SDK's NumPy reference; nki-spec §9.2.9)."""
    I = "local_gather"
    for role, t in (("dst", dst), ("src_buffer", src_buffer), ("index", index)):
        _sbuf_only(I, role, t)
    _same_p(I, [("src_buffer", src_buffer), ("index", index), ("dst", dst)])
    P = src_buffer.shape[0]
    C = GPSIMD_CORE_PARTITIONS
    if P % C:
        raise fail(I, "src_buffer", f"has {P} partitions; local_gather works per GpSimd core of "
                                    f"{C} partitions, so P must be a multiple of {C}")
    if index.dtype is not dt.uint16:
        raise fail(I, "index", f"must be uint16; got {index.dtype}")
    if dst.dtype is not src_buffer.dtype:
        raise fail(I, "dst", f"has dtype {dst.dtype} but src_buffer has {src_buffer.dtype}; "
                             f"local_gather does not cast")
    e = _int(I, "num_elem_per_idx", num_elem_per_idx)
    if e not in (1, 2, 4, 8, 16, 32):
        raise fail(I, "num_elem_per_idx", f"must be one of 1, 2, 4, 8, 16, 32; got {e}")
    if src_buffer.free_size % e:
        raise fail(I, "src_buffer", f"has {src_buffer.free_size} elements per partition, not a "
                                    f"multiple of num_elem_per_idx = {e}")
    avail = C * index.free_size
    nv = avail if num_valid_indices is None else _int(I, "num_valid_indices", num_valid_indices)
    if not 1 <= nv <= avail:
        raise fail(I, "num_valid_indices", f"must be in [1, {avail}] (16 partitions x "
                                           f"{index.free_size} indices); got {nv}")
    if nv > LOCAL_GATHER_MAX_INDICES:
        raise fail(I, "num_valid_indices", f"{nv} indices per GpSimd core exceed the maximum "
                                           f"{LOCAL_GATHER_MAX_INDICES}")
    if dst.free_size != nv * e:
        # SDK 2.32 known issue: num_elem_per_idx is ignored unless this holds; we require it
        raise fail(I, "dst", f"has {dst.free_size} elements per partition; it must be "
                             f"num_valid_indices x num_elem_per_idx = {nv} x {e} = {nv * e}")
    G = src_buffer.free_size // e
    src3 = src_buffer.read_pf().reshape(P, G, e)
    ix = index.read_pf().astype(np.int64)
    out = np.empty((P, nv * e), dtype=src3.dtype)
    for c in range(P // C):
        rows = slice(C * c, C * c + C)
        idx = ix[rows].flatten(order="F")[:nv]
        if idx.max(initial=0) >= G:
            bad = int(idx[idx >= G][0])
            raise fail(I, "index", f"GpSimd core {c} has index {bad}, past the {G} groups of "
                                   f"{e} elements in src_buffer (out of bounds is undefined on HW)")
        out[rows] = src3[rows][:, idx, :].reshape(C, nv * e)
    dst.write_pf(out, cast=False)
    return emit("gpsimd", I, [("src_buffer", src_buffer), ("index", index)], [("dst", dst)],
                {"n_idx": nv, "num_elem_per_idx": e}, name)


# ------------------------------------------------------------------------------- nc_n_gather
def nc_n_gather(dst, data, indices, name=None):
    """``dst[p, j] = data[p].flatten()[indices[p, j]]`` (GpSimd, SBUF)."""
    I = "nc_n_gather"
    for role, t in (("dst", dst), ("data", data), ("indices", indices)):
        _sbuf_only(I, role, t)
    _same_p(I, [("data", data), ("indices", indices), ("dst", dst)])
    if indices.dtype is not dt.uint32:
        raise fail(I, "indices", f"must be uint32; got {indices.dtype}")
    if dst.free_size != indices.free_size:
        raise fail(I, "dst", f"has {dst.free_size} elements per partition but indices has "
                             f"{indices.free_size}; they must match")
    if dst.dtype is not data.dtype:
        raise fail(I, "dst", f"has dtype {dst.dtype} but data has {data.dtype}; they must match")
    F = data.free_size
    idx = indices.read_pf().astype(np.int64)
    if idx.size and idx.max() >= F:
        p, j = np.argwhere(idx >= F)[0]
        raise fail(I, "indices", f"[{p}, {j}] = {idx[p, j]} is outside [0, {F}) of data's "
                                 f"partition row")
    out = np.take_along_axis(data.read_pf(), idx, axis=1)
    dst.write_pf(out, cast=False)
    return emit("gpsimd", I, [("data", data), ("indices", indices)], [("dst", dst)], {}, name)


# ------------------------------------------------------------------------------- sequence_bounds
def sequence_bounds(dst, segment_ids, name=None):
    """For each element of ``segment_ids (1, n)``: the [start, end) of its run of equal ids;
    ``dst (1, 2, n)``: row 0 starts, row 1 ends; padding (id 0) -> start n, end -1 (GpSimd)."""
    I = "sequence_bounds"
    _sbuf_only(I, "dst", dst)
    _sbuf_only(I, "segment_ids", segment_ids)
    for role, t in (("segment_ids", segment_ids), ("dst", dst)):
        if t.shape[0] != 1:
            raise fail(I, role, f"must have exactly 1 partition; got shape {t.shape}")
    if segment_ids.dtype not in (dt.float32, dt.int32):
        raise fail(I, "segment_ids", f"must be float32 or int32; got {segment_ids.dtype}")
    if dst.dtype is not segment_ids.dtype:
        raise fail(I, "dst", f"has dtype {dst.dtype}; it must match segment_ids "
                             f"({segment_ids.dtype})")
    n = segment_ids.free_size
    if dst.free_size != 2 * n:
        raise fail(I, "dst", f"must hold 2 x {n} elements (shape (1, 2, {n})); got shape "
                             f"{dst.shape}")
    ids = segment_ids.read_pf()[0]
    if (ids < 0).any():
        raise fail(I, "segment_ids", f"must be non-negative (0 = padding); found "
                                     f"{ids[ids < 0][0]}")
    # a segment is a run of equal consecutive non-zero ids (the SDK reference walks the sequence)
    pos = np.arange(n, dtype=np.int64)
    first = np.ones(n, dtype=bool)
    first[1:] = ids[1:] != ids[:-1]
    last = np.ones(n, dtype=bool)
    last[:-1] = ids[:-1] != ids[1:]
    start = np.maximum.accumulate(np.where(first, pos, 0))
    end = np.minimum.accumulate(np.where(last, pos + 1, n)[::-1])[::-1]
    pad = ids == 0
    start = np.where(pad, n, start)
    end = np.where(pad, -1, end)
    dst.write_pf(np.concatenate([start, end]).reshape(1, 2 * n))
    return emit("gpsimd", I, [("segment_ids", segment_ids)], [("dst", dst)], {}, name)


# ------------------------------------------------------------------------------- nonzero_with_count
def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """On partitions 0, 16, ..., 112 only: ``dst[p, :N]`` = indices (+index_offset) of the N
    nonzero elements of ``src[p]`` in order, ``dst[p, N:F] = padding_val``, ``dst[p, F] = N``.
    Other partitions of dst are left untouched (GpSimd, Trn2+)."""
    I = "nonzero_with_count"
    need_gen(I, 3, "nonzero_with_count")
    _sbuf_only(I, "dst", dst)
    _sbuf_only(I, "src", src)
    _same_p(I, [("src", src), ("dst", dst)])
    if src.dtype not in (dt.float32, dt.int32):
        raise fail(I, "src", f"must be float32 or int32; got {src.dtype}")
    if dst.dtype is not dt.int32:
        raise fail(I, "dst", f"must be int32; got {dst.dtype}")
    F = src.free_size
    if dst.free_size != F + 1:
        raise fail(I, "dst", f"must hold src's {F} elements + 1 count per partition = {F + 1}; got "
                             f"{dst.free_size}")
    off = _int(I, "index_offset", index_offset)
    pad = _int(I, "padding_val", padding_val)
    x = src.read_pf()
    out = np.array(dst.read_pf(), dtype=np.int64, copy=True)
    for p in range(0, src.shape[0], GPSIMD_CORE_PARTITIONS):
        nz = np.flatnonzero(x[p] != 0)   # spec silent on NaN (fp32): NaN != 0, so it counts
        N = nz.size
        out[p, :N] = nz + off
        out[p, N:F] = pad
        out[p, F] = N
    dst.write_pf(out)
    return emit("gpsimd", I, [("src", src)], [("dst", dst)], {}, name)


# ------------------------------------------------------------------------------- dropout
def dropout(dst, data, prob, name=None):
    """``dst = data`` with each element set to 0 with probability ``prob`` (VectorE).

    No 1/(1-p) rescaling (none is documented). The random stream is a NumPy Generator seeded
    per core (program id): deterministic from run to run, but it cannot match the hardware's
    LFSR/XORWOW bits (nki-spec §9.9, §11.3), so tests may only check statistics and the
    prob = 0 / prob = 1 limits.
    """
    I = "dropout"
    on_chip(I, "dst", dst)
    on_chip(I, "data", data)
    same_shape_pf(I, [("data", data), ("dst", dst)])
    if dst.dtype is not data.dtype:
        raise fail(I, "dst", f"has dtype {dst.dtype}; it must match data ({data.dtype})")
    if data.dtype.is_x4:
        raise fail(I, "data", f"cannot be an MX packed {data.dtype} tensor")
    P, F = data.shape[0], data.free_size
    if isinstance(prob, NkiTensor):
        on_chip(I, "prob", prob)
        if prob.shape[0] != P or prob.free_size != 1:
            raise fail(I, "prob", f"must be a ({P}, 1) per-partition tensor; got shape "
                                  f"{prob.shape}")
        if data.dtype.is_int and prob.dtype is not dt.float32:
            raise fail(I, "prob", f"must be float32 when data is an integer type ({data.dtype}); "
                                  f"got {prob.dtype}")
        p = prob.read_f32().reshape(P, 1)
    else:
        if isinstance(prob, bool) or not isinstance(prob, (int, float, np.integer, np.floating)):
            raise fail(I, "prob", f"must be a Python float or a ({P}, 1) tensor; got "
                                  f"{type(prob).__name__}")
        if not 0.0 <= float(prob) <= 1.0:
            raise fail(I, "prob", f"is a drop probability and must be in [0, 1]; got {prob!r}")
        p = np.float32(prob)
    core = rt.current_core()
    gen = getattr(core, "_dropout_rng", None)
    if gen is None:
        gen = np.random.default_rng([0x6E6B6964, core.program_id])
        core._dropout_rng = gen
    u = gen.random((P, F), dtype=np.float32)   # [0, 1): prob 1 drops all, prob 0 keeps all
    drop = u < p
    out = np.array(data.read_pf(), copy=True)
    out[drop] = 0
    dst.write_pf(out, cast=False)
    psum_write_clear(dst)
    reads = [("data", data)] + ([("prob", prob)] if isinstance(prob, NkiTensor) else [])
    return emit("vector", I, reads, [("dst", dst)], {}, name)


__all__ = ["nc_stream_shuffle", "local_gather", "nc_n_gather", "sequence_bounds",
           "nonzero_with_count", "dropout"]
