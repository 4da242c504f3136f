"""DMA instructions beyond ``dma_copy``: ``dma_transpose`` (nki-spec §9.2.2) and ``dma_compute``
(nki-spec §9.2.3).

dma_transpose permutes by rank only: 2-D ``(1, 0)``, 3-D ``(2, 1, 0)``, 4-D ``(3, 1, 2, 0)``;
``dst`` (SBUF) must have exactly the permuted shape. The copy is bit-exact (no cast). The indirect
gather-transpose reads rows of an HBM ``src`` through ``.ap(vector_offset=idx, indirect_dim=0)``:
``dst = src_base[idx.T.flatten()[:src.shape[0]], ...]`` permuted as above.

dma_compute adds up to 16 sources elementwise in fp32 (row-major order of each view, equal element
counts) and writes ``dst`` with the usual cast. The two read-modify-write forms with a vector
offset are supported: scatter-add ``srcs=[dst_indirect_view, sbuf_src]`` with ``dst`` that same
HBM view, and gather-add ``srcs=[hbm.ap(vector_offset=...), dst]`` with ``dst`` in SBUF.

Spec silent, our choices:
  * dma_transpose outside HWDGE/indirect accepts 2- and 4-byte dtypes (the Trn2 architecture guide
    documents bit-accurate DMA transposes for those); 1- and 8-byte dtypes are rejected.
  * dma_transpose without an indirect src accepts dge_mode unknown and hwdge only (as the API
    docstring lists); the indirect variant accepts unknown and swdge.
  * dma_transpose indirect: the emulator's ``.ap(vector_offset=)`` requires one index row per
    gathered row, so only ``indices`` of shape ``(src.shape[0], 1)`` can be built today; the
    ``(I0, I1)`` form with ``I1 > 1`` needs a change in ``tensor.py``.
  * dma_compute with duplicate indices under ``unique_indices=True``: the last write wins, with an
    ``NkiHardwareWarning`` (undefined on hardware).
"""
from __future__ import annotations

import warnings

import numpy as np

from .. import dtypes as dt
from .. import ops
from .. import runtime as rt
from ..errors import NkiRuntimeError, fail
from ._common import NkiHardwareWarning, as_enum, emit, need_gen
from ._common import dge_mode as DGE
from ._common import oob_mode as OOB
from .dma import _dma_operand

_PERM = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}
_HWDGE_P0 = (1, 2, 4, 8, 16)


def _priority(I, priority):
    if priority is not None:
        need_gen(I, 4, "priority")
        if priority not in (0, 1, 2, 3) or isinstance(priority, bool):
            raise fail(I, "priority", f"must be 0..3; got {priority!r}")


def _static_offsets_ok(I, items):
    """Scalar dynamic offsets out of bounds: a runtime fault (oob_mode.skip is for indirect DMA)."""
    for role, t in items:
        if t._dyn and t._base_offset() is None:
            raise NkiRuntimeError(f"{I}: {role}: {t._oob_msg()}")


# ------------------------------------------------------------------------------- dma_transpose
def dma_transpose(dst, src, axes=None, priority=None, dge_mode=DGE.unknown, oob_mode=OOB.error,
                  name=None):
    """``dst = src`` permuted by rank (2-D (1,0), 3-D (2,1,0), 4-D (3,1,2,0)); dst in SBUF."""
    I = "dma_transpose"
    need_gen(I, 3)
    _dma_operand(I, "dst", dst)
    _dma_operand(I, "src", src)
    if dst.buffer is not rt.sbuf:
        raise fail(I, "dst", f"is in {dst.buffer.name}; dma_transpose writes SBUF")
    dge = as_enum(DGE, dge_mode, I, "dge_mode")
    oob = as_enum(OOB, oob_mode, I, "oob_mode")
    _priority(I, priority)
    if dst.dtype is not src.dtype:
        raise fail(I, "dst", f"has dtype {dst.dtype} but src has {src.dtype}; dma_transpose does "
                             f"not cast")
    rank = src.ndim
    if rank not in _PERM:
        raise fail(I, "src", f"is {rank}-D (shape {src.shape}); dma_transpose takes 2-D, 3-D or "
                             f"4-D tensors")
    perm = _PERM[rank]
    if axes is not None:
        try:
            given = tuple(int(a) for a in axes)
        except TypeError:
            given = None
        if given != perm:
            raise fail(I, "axes", f"{axes!r} is not supported for a {rank}-D src; the only "
                                  f"permutation is {perm} (2-D (1, 0), 3-D (2, 1, 0), 4-D "
                                  f"(3, 1, 2, 0))")
    want = tuple(src.shape[a] for a in perm)
    if dst.shape != want:
        raise fail(I, "dst", f"has shape {dst.shape}; the transpose of src {src.shape} by {perm} "
                             f"is {want} (same rank, exact shape)")
    isz = src.dtype.itemsize
    indirect = src._vec is not None
    if indirect:
        if dge not in (DGE.unknown, DGE.swdge):
            raise fail(I, "dge_mode", f"{dge.name}: the indirect (gather) transpose runs on "
                                      f"software DGE (dge_mode unknown or swdge)")
        if isz != 2:
            raise fail(I, "src", f"has dtype {src.dtype}; the indirect transpose needs a 2-byte "
                                 f"dtype")
        _check_indirect(I, src)
    else:
        if oob is OOB.skip:
            raise fail(I, "oob_mode", "skip is only valid with an indirect (vector_offset) src")
        # none (host-precomputed descriptors) on a static transpose: nki-spec lists it for DMAs
        # without dynamic offsets and is silent on dma_transpose; NKI Library's mlp_tkg bias load
        # (mlp_tkg_gate_up_projection.py, static views only, dynamic ones take a dma_copy) uses it
        # on devices (QoR baselines), so it is accepted
        if dge not in (DGE.unknown, DGE.hwdge, DGE.none):
            raise fail(I, "dge_mode", f"{dge.name}: dma_transpose takes dge_mode unknown, hwdge or "
                                      f"none (swdge only for the indirect gather-transpose)")
        if dge is DGE.none and (dst.is_indirect() or src.is_indirect()):
            raise fail(I, "dge_mode", "none (host-precomputed descriptors) cannot use dynamic "
                                      "offsets")
        if dge is DGE.hwdge:
            _check_hwdge(I, src)
        elif isz not in (2, 4):
            raise fail(I, "src", f"has dtype {src.dtype} ({isz} bytes); DMA transposes move 2- or "
                                 f"4-byte elements")
    _static_offsets_ok(I, [("dst", dst), ("src", src)])
    skip = oob is OOB.skip
    if indirect:
        vals, valid = src._read(oob_skip=skip)
        out = np.transpose(vals, perm)
        if not valid.all():
            m = np.broadcast_to(valid.reshape((-1,) + (1,) * (rank - 1)), src.shape)
            out = np.where(np.transpose(m, perm), out, dst._read())
    else:
        out = np.transpose(np.asarray(src._read()), perm)
    dst._write(out)
    return emit("dma", I, [("src", src)], [("dst", dst)],
                {"dge": dge.name, "transpose": True, "axes": perm, "issuer": "unknown",
                 "priority": priority, "skipped": False, "indirect": indirect, "cast": False}, name)


def _check_hwdge(I, src):
    s = src.shape
    if src.dtype.itemsize != 2:
        raise fail(I, "src", f"has dtype {src.dtype}; a hwdge transpose needs a 2-byte dtype")
    if s[0] not in _HWDGE_P0:
        raise fail(I, "src", f"has shape {s}; a hwdge transpose needs src.shape[0] in "
                             f"{{1, 2, 4, 8, 16}}")
    if len(s) >= 3 and (s[0] * s[-2]) % 16:
        raise fail(I, "src", f"has shape {s}; a 3-D/4-D hwdge transpose needs "
                             f"(src.shape[0] * src.shape[-2]) % 16 == 0")
    # src.shape[-1] <= 128 holds already: it is dst's partition count


def _check_indirect(I, src):
    s = src.shape
    idx = src._vec.source
    if idx.ndim != 2:
        raise fail(I, "src", f"indirect transpose indices must be a 2-D (I0, I1) SBUF tensor; got "
                             f"shape {idx.shape}")
    if idx.dtype is not dt.uint32:
        raise fail(I, "src", f"indirect transpose indices have dtype {idx.dtype}; they must be "
                             f"uint32")
    I0 = idx.shape[0]
    if not (16 <= I0 <= 128) or I0 % 16:
        raise fail(I, "src", f"indirect transpose indices have {I0} partitions; need a multiple of "
                             f"16 in [16, 128]")
    # I1 > 1 (then I0 == 128), I0 * I1 >= src.shape[0] and src.shape[0] % 16 == 0 follow from
    # .ap(vector_offset=) requiring one index row per gathered row (I0 == src.shape[0], I1 == 1);
    # add those checks if tensor.py ever accepts the (I0, I1) form.
    if len(s) == 4 and s[1] != 1 and s[2] != 1:
        raise fail(I, "src", f"has shape {s}; a 4-D indirect transpose needs shape[1] or shape[2] "
                             f"equal to 1")


# ------------------------------------------------------------------------------- dma_compute
def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=OOB.error,
                name=None):
    """``dst = srcs[0] + srcs[1] + ...`` (fp32 in the DMA engines, <= 16 sources, scales 1.0)."""
    I = "dma_compute"
    _dma_operand(I, "dst", dst)
    if not isinstance(srcs, (list, tuple)) or not srcs:
        raise fail(I, "srcs", f"must be a non-empty list of tensors; got {srcs!r}")
    if len(srcs) > 16:
        raise fail(I, "srcs", f"has {len(srcs)} tensors; dma_compute reduces at most 16")
    for i, s in enumerate(srcs):
        _dma_operand(I, f"srcs[{i}]", s)
    if reduce_op is not ops.add:
        raise fail(I, "reduce_op", f"is {reduce_op!r}; dma_compute supports only nl.add")
    if scales is not None:
        if not isinstance(scales, (list, tuple)) or len(scales) != len(srcs):
            raise fail(I, "scales", f"must be None or a list of {len(srcs)} numbers; got "
                                    f"{scales!r}")
        for sc in scales:
            if isinstance(sc, bool) or not isinstance(sc, (int, float, np.integer, np.floating)) \
                    or float(sc) != 1.0:
                raise fail(I, "scales", f"must all be 1.0 (other scales are not supported); got "
                                        f"{list(scales)!r}")
    oob = as_enum(OOB, oob_mode, I, "oob_mode")
    for i, s in enumerate(srcs):
        if s.size != dst.size:
            raise fail(I, f"srcs[{i}]", f"has {s.size} elements (shape {s.shape}) but dst has "
                                        f"{dst.size} (shape {dst.shape}); element counts must be "
                                        f"equal")
    for role, t in [("dst", dst)] + [(f"srcs[{i}]", s) for i, s in enumerate(srcs)]:
        if t.dtype.is_x4:
            raise fail(I, role, f"has MX packed dtype {t.dtype}; dma_compute adds numbers")
    indirect = dst._vec is not None or any(s._vec is not None for s in srcs)
    skip = oob is OOB.skip
    if indirect:
        _check_rmw(I, dst, srcs, unique_indices)
    elif skip:
        raise fail(I, "oob_mode", "skip is only valid with a vector-offset (indirect) operand")
    _static_offsets_ok(I, [("dst", dst)] + [(f"srcs[{i}]", s) for i, s in enumerate(srcs)])
    acc = np.zeros(dst.shape, dtype=np.float32)
    valid = None
    with np.errstate(over="ignore", invalid="ignore"):
        for s in srcs:
            if s._vec is not None:
                vals, valid = s._read(oob_skip=skip)
            else:
                vals = s._read()
            acc = acc + dt.to_f32(np.asarray(vals)).reshape(dst.shape)
    out = dt.cast(acc, dst.dtype)
    if dst._vec is not None:
        dst._write(out, oob_skip=skip)
    elif valid is not None and not valid.all():
        per_row = dst.size // valid.shape[0]
        m = np.repeat(valid, per_row).reshape(dst.shape)
        dst._write(np.where(m, out, np.array(dst._read())))
    else:
        dst._write(out)
    return emit("dma", I, [(f"src{i}", s) for i, s in enumerate(srcs)], [("dst", dst)],
                {"dge": "swdge" if indirect else "unknown", "op": "add", "num_srcs": len(srcs),
                 "rmw": indirect, "indirect": indirect, "issuer": "unknown", "priority": None,
                 "skipped": False, "transpose": False,
                 "cast": any(s.dtype is not dst.dtype for s in srcs)}, name)


def _same_view(a, b):
    return (a.storage is b.storage and a.offset == b.offset and a.shape == b.shape
            and a.strides == b.strides and a.dtype is b.dtype
            and (a._vec is None) == (b._vec is None)
            and (a._vec is None or (a._vec.source is b._vec.source and a._vec.mult == b._vec.mult)))


def _check_rmw(I, dst, srcs, unique_indices):
    """The two vector-offset forms: scatter-add and gather-add (SWDGE, 2 srcs, unique indices)."""
    forms = ("scatter-add: dst=hbm_view.ap(vector_offset=idx), srcs=[that same view, sbuf_src]; "
             "gather-add: dst=sbuf_tile, srcs=[hbm.ap(vector_offset=idx), sbuf_tile]")
    if len(srcs) != 2:
        raise fail(I, "srcs", f"has {len(srcs)} tensors; the vector-offset (read-modify-write) "
                              f"forms take exactly 2 ({forms})")
    if unique_indices is not True:
        raise fail(I, "unique_indices", "must be True for the vector-offset (read-modify-write) "
                                        "forms")
    a, b = srcs
    if b._vec is not None:
        raise fail(I, "srcs[1]", f"must not be indirect ({forms})")
    if dst._vec is not None:
        if not _same_view(dst, a):
            raise fail(I, "srcs[0]", f"must be the same vector-offset view as dst for a "
                                     f"scatter-add ({forms})")
        if b.buffer is not rt.sbuf:
            raise fail(I, "srcs[1]", f"must be in SBUF for a scatter-add ({forms})")
        idx = dst._vec
    else:  # a is the indirect one (b was checked above)
        if dst.buffer is not rt.sbuf or not _same_view(dst, b):
            raise fail(I, "srcs[1]", f"must be dst itself (an SBUF tile) for a gather-add "
                                     f"({forms})")
        idx = a._vec
    rows = np.asarray(idx.source._read()).reshape(-1).astype(np.int64)
    ok = rows[(rows >= 0) & (rows < idx.extent)]
    if np.unique(ok).size != ok.size:
        warnings.warn(f"{I}: duplicate indices with unique_indices=True: undefined on hardware "
                      f"(the emulator keeps the last write)", NkiHardwareWarning, stacklevel=3)


__all__ = ["dma_transpose", "dma_compute"]
