"""Search and top-k (nki-spec §9.7): ``max8``, ``nc_find_index8``, ``nc_match_replace8`` (VectorE)
and ``topk`` (GpSimd, 16-partition snake layout).

Top-k of more than 8 per partition: repeat ``max8`` + ``nc_match_replace8(imm=-inf)``.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from .. import runtime as rt
from ..errors import fail
from ..tensor import NkiTensor
from ._common import emit, on_chip, psum_write_clear, same_shape_pf, tensor

F_MIN, F_MAX = 8, 16384  # elements per partition searched by the VectorE 8-wide search unit


def _search_width(I, role, t):
    F = t.free_size
    if not F_MIN <= F <= F_MAX:
        raise fail(I, role, f"has {F} elements per partition; the 8-wide search needs between "
                            f"{F_MIN} and {F_MAX}")
    return F


def _eight(I, role, t, P):
    if t.shape[0] != P:
        raise fail(I, role, f"has {t.shape[0]} partitions but the data has {P}; they must match")
    if t.free_size != 8:
        raise fail(I, role, f"must hold exactly 8 elements per partition; got shape {t.shape}")


def _not_x4(I, items):
    for role, t in items:
        if t is not None and t.dtype.is_x4:
            raise fail(I, role, f"cannot be an MX packed {t.dtype} tensor")


def _all_ones(dtype):
    return np.iinfo(dtype.np).max if dtype.kind == "uint" else -1


# ------------------------------------------------------------------------------- max8
def max8(dst, src, name=None):
    """``dst[p, :] = the 8 largest values of src[p]`` in descending order (fp32 compare)."""
    I = "max8"
    on_chip(I, "dst", dst)
    on_chip(I, "src", src)
    _not_x4(I, (("dst", dst), ("src", src)))
    P = src.shape[0]
    _search_width(I, "src", src)
    _eight(I, "dst", dst, P)
    if dst.ndim > 3:
        raise fail(I, "dst", f"may have at most two free dims; got shape {dst.shape}")
    x = src.read_f32()
    # spec silent on NaN: we rank NaN below every number (a comparator never picks it as a max);
    # np.sort puts NaN last, so sorting -x ascending gives x descending with NaN at the end.
    top = -np.sort(-x, axis=1)[:, :8]
    dst.write_pf(top)
    psum_write_clear(dst)
    return emit("vector", I, [("src", src)], [("dst", dst)], {"searched": src.free_size}, name)


# ------------------------------------------------------------------------------- nc_find_index8
def nc_find_index8(dst, data, vals, name=None):
    """``dst[p, i]`` = index (flattened free) of the first occurrence of ``vals[p, i]`` in
    ``data[p]``; a value repeated in ``vals`` maps to its successive occurrences in ascending
    order; not found -> all ones (0xFFFFFFFF / 0xFFFF)."""
    I = "nc_find_index8"
    for role, t in (("dst", dst), ("data", data), ("vals", vals)):
        on_chip(I, role, t)
    _not_x4(I, (("data", data), ("vals", vals)))
    P = data.shape[0]
    _search_width(I, "data", data)
    _eight(I, "vals", vals, P)
    _eight(I, "dst", dst, P)
    if dst.dtype not in (dt.uint32, dt.uint16):
        raise fail(I, "dst", f"must be uint32 or uint16; got {dst.dtype}")
    x = data.read_f32()
    v = vals.read_f32()
    # rank[p, i] = how many earlier vals of the row equal vals[p, i] -> which occurrence to report
    same = (v[:, :, None] == v[:, None, :]) & np.tri(8, k=-1, dtype=bool)[None]
    rank = same.sum(axis=2)                                  # [P, 8]
    out = np.empty((P, 8), dtype=np.int64)
    for i in range(8):
        eq = x == v[:, i:i + 1]                              # NaN never matches
        occ = np.cumsum(eq, axis=1, dtype=np.int32)          # occurrence number at each hit
        hit = eq & (occ == rank[:, i:i + 1] + 1)
        out[:, i] = np.where(hit.any(axis=1), hit.argmax(axis=1), _all_ones(dst.dtype))
    out = out.astype(dst.dtype.np)
    dst.write_pf(out, cast=False)
    psum_write_clear(dst)
    return emit("vector", I, [("data", data), ("vals", vals)], [("dst", dst)],
                {"searched": data.free_size}, name)


# ------------------------------------------------------------------------------- nc_match_replace8
def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """``dst = data`` with the first occurrence of each ``vals[p, i]`` replaced by ``imm``.

    The 8 values are processed in reverse (i = 7..0), each against the data as already replaced,
    so a value repeated in ``vals`` takes successive occurrences and its ``dst_idx`` slots hold
    them in descending order (the opposite of ``nc_find_index8``)."""
    I = "nc_match_replace8"
    for role, t in (("dst", dst), ("data", data), ("vals", vals)):
        on_chip(I, role, t)
    _not_x4(I, (("dst", dst), ("data", data), ("vals", vals)))
    same_shape_pf(I, [("data", data), ("dst", dst)])
    P = data.shape[0]
    # spec silent on the data width of match_replace8: we apply the max8/find_index8 limits, since
    # the three instructions share the 8-wide search.
    _search_width(I, "data", data)
    _eight(I, "vals", vals, P)
    if isinstance(imm, NkiTensor) or isinstance(imm, bool) \
            or not isinstance(imm, (int, float, np.integer, np.floating)):
        raise fail(I, "imm", f"must be a Python float (an fp32 immediate); got "
                             f"{type(imm).__name__}")
    if dst_idx is not None:
        on_chip(I, "dst_idx", dst_idx)
        _eight(I, "dst_idx", dst_idx, P)
        # spec silent on dst_idx dtypes: we take those of nc_find_index8 plus int32
        if dst_idx.dtype not in (dt.uint32, dt.uint16, dt.int32):
            raise fail(I, "dst_idx", f"must be uint32, uint16 or int32; got {dst_idx.dtype}")
    native = np.array(data.read_pf(), copy=True)   # copy: dst may alias data
    x = dt.to_f32(native).copy()
    v = vals.read_f32()
    fimm = np.float32(imm)
    replaced = np.zeros(x.shape, dtype=bool)
    idx = np.zeros((P, 8), dtype=np.int64)
    rows = np.arange(P)
    for i in range(7, -1, -1):
        eq = x == v[:, i:i + 1]
        found = eq.any(axis=1)
        pos = eq.argmax(axis=1)
        r, c = rows[found], pos[found]
        x[r, c] = fimm
        replaced[r, c] = True
        idx[:, i] = np.where(found, pos, -1)
    if data.dtype is dst.dtype:
        out = np.where(replaced, dt.cast(np.full(x.shape, fimm, np.float32), dst.dtype), native)
        dst.write_pf(out, cast=False)
    else:
        dst.write_pf(x)
    psum_write_clear(dst)
    writes = [("dst", dst)]
    if dst_idx is not None:
        # spec silent on a value that is not found: all ones, as nc_find_index8 does
        out_idx = np.where(idx >= 0, idx, _all_ones(dst_idx.dtype)).astype(dst_idx.dtype.np)
        dst_idx.write_pf(out_idx, cast=False)
        psum_write_clear(dst_idx)
        writes.append(("dst_idx", dst_idx))
    return emit("vector", I, [("data", data), ("vals", vals)], writes,
                {"searched": data.free_size}, name)


# ------------------------------------------------------------------------------- topk
def topk(val_dst, idx_dst, src, n, name=None):
    """Top-K of each 16-partition group of ``src`` read as a snake (GpSimd, bf16, SBUF).

    Element ``e < n`` of group g lives at partition ``16g + e % 16``, column ``e // 16``.
    ``K = val_dst.F``; ``val_dst`` gets the K largest values in ascending order, ``idx_dst`` their
    snake indices (uint32).

    Uncertain points (nki-spec §9.7 follows the SDK 2.32 docstring; verify on hardware):
      * the 2.32 text says "each partition operates independently" yet reads a 16-partition snake;
        we give every partition of a group the group's top-K (rows 16g..16g+15 identical);
      * the SDK 2.33 docstring describes another contract (a ``sorted=`` flag, results written in
        the snake layout: result j at partition j % 16, column j // 16); not modelled here;
      * ties: spec silent; the lower snake index wins a place, and equal values are listed in
        ascending index order;
      * NaN: spec silent; ranked below every number (chosen only when fewer than K numbers).
    """
    I = "topk"
    for role, t in (("val_dst", val_dst), ("idx_dst", idx_dst), ("src", src)):
        tensor(I, role, t)
        if t.buffer is rt.psum:
            raise fail(I, role, "is in PSUM; GpSimd reads and writes SBUF only")
        on_chip(I, role, t)
    if src.dtype is not dt.bfloat16:
        raise fail(I, "src", f"must be bfloat16; got {src.dtype}")
    if val_dst.dtype is not dt.bfloat16:
        raise fail(I, "val_dst", f"must be bfloat16; got {val_dst.dtype}")
    if idx_dst.dtype is not dt.uint32:
        raise fail(I, "idx_dst", f"must be uint32; got {idx_dst.dtype}")
    P = src.shape[0]
    if P % 16:
        raise fail(I, "src", f"has {P} partitions; topk works on groups of 16 partitions, so the "
                             f"partition count must be a multiple of 16")
    for role, t in (("val_dst", val_dst), ("idx_dst", idx_dst)):
        if t.shape[0] != P:
            raise fail(I, role, f"has {t.shape[0]} partitions but src has {P}; they must match")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise fail(I, "n", f"must be an int; got {n!r}")
    n = int(n)
    if not 8 <= n < 65536:
        raise fail(I, "n", f"must satisfy 8 <= n < 65536; got {n}")
    K = val_dst.free_size
    if not 1 <= K < 32768:
        raise fail(I, "val_dst", f"asks for K = {K} results; 1 <= K < 32768")
    if K > n:
        raise fail(I, "val_dst", f"asks for K = {K} results from only n = {n} elements")
    if idx_dst.free_size != K:
        raise fail(I, "idx_dst", f"has {idx_dst.free_size} elements per partition but val_dst has "
                                 f"K = {K}; they must match")
    X = src.free_size
    if X < -(-n // 16):
        raise fail(I, "src", f"has {X} columns; a snake of n = {n} needs ceil(n / 16) = "
                             f"{-(-n // 16)}")

    x = src.read_f32()
    vals_out = np.empty((P, K), dtype=np.float32)
    idx_out = np.empty((P, K), dtype=np.uint32)
    e = np.arange(n)
    for g in range(P // 16):
        snake = x[16 * g:16 * g + 16, :].T.reshape(-1)[:n]  # element e = [e % 16, e // 16]
        nan = np.isnan(snake)
        key = np.where(nan, np.float32(0), snake)
        best = np.lexsort((e, -key, nan))[:K]              # numbers first, largest, lowest index
        sel = best[np.lexsort((best, key[best], ~nan[best]))]  # ascending value, then index
        vals_out[16 * g:16 * g + 16] = snake[sel][None, :]
        idx_out[16 * g:16 * g + 16] = sel[None, :].astype(np.uint32)
    val_dst.write_pf(vals_out)
    idx_dst.write_pf(idx_out, cast=False)
    return emit("gpsimd", I, [("src", src)], [("val_dst", val_dst), ("idx_dst", idx_dst)],
                {"n": n, "k": K}, name)


__all__ = ["max8", "nc_find_index8", "nc_match_replace8", "topk"]
