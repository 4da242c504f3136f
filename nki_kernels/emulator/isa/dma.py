"""DMA instructions: ``dma_copy`` (nki-spec §9.2.1). ``dma_transpose``/``dma_compute`` live in
``dma_extra.py``."""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from .. import runtime as rt
from ..errors import NkiRuntimeError, fail
from ._common import as_enum, emit, gen, need_gen, tensor
from ._common import dge_mode as DGE
from ._common import engine as ENG
from ._common import oob_mode as OOB


def _dma_operand(I, role, t):
    tensor(I, role, t)
    if t.buffer is rt.psum:
        raise fail(I, role, "is in PSUM; DMA cannot read or write PSUM (since NKI 0.3.0): copy to "
                            "SBUF with tensor_copy first")
    if t.on_chip and t.shape[0] > gen().pmax:
        raise fail(I, role, f"has partition dimension {t.shape[0]}, exceeding the maximum "
                            f"{gen().pmax}")


def dma_copy(dst, src, priority=None, oob_mode=OOB.error, dge_mode=DGE.unknown,
             engine=ENG.unknown, name=None):
    """``dst = src`` over the row-major order of each view (HBM<->SBUF, HBM<->HBM, SBUF<->SBUF)."""
    I = "dma_copy"
    _dma_operand(I, "dst", dst)
    _dma_operand(I, "src", src)
    oob = as_enum(OOB, oob_mode, I, "oob_mode")
    dge = as_enum(DGE, dge_mode, I, "dge_mode")
    eng = as_enum(ENG, engine, I, "engine")
    if dst.size != src.size:
        raise fail(I, "dst", f"has {dst.size} elements (shape {dst.shape}) but src has {src.size} "
                             f"(shape {src.shape}); dma_copy needs equal element counts")
    if priority is not None:
        need_gen(I, 4, "priority")
        if priority not in (0, 1, 2, 3):
            raise fail(I, "priority", f"must be 0..3; got {priority!r}")
    indirect = dst._vec is not None or src._vec is not None
    if dst._vec is not None and src._vec is not None:
        raise fail(I, "dst", "both dst and src are vector-offset views; only one side may be indirect")
    if indirect and dge not in (DGE.unknown, DGE.swdge):
        raise fail(I, "dge_mode", f"{dge.name}: vector-offset (indirect) DMA needs software DGE "
                                  f"(dge_mode unknown or swdge)")
    if dge is DGE.hwdge:
        need_gen(I, 3, "dge_mode=hwdge")
        if dst.dtype is not src.dtype:
            raise fail(I, "dst", f"dtype {dst.dtype} differs from src {src.dtype}; hwdge copies raw "
                                 f"bytes and needs identical dtypes (reinterpret with .view())")
        if eng not in (ENG.sync, ENG.scalar, ENG.unknown):
            raise fail(I, "engine", f"hwdge DMAs are triggered from engine.sync or engine.scalar; got "
                                    f"{eng.name}")
    elif eng is not ENG.unknown:
        raise fail(I, "engine", "is only valid with dge_mode=hwdge")
    if dge is DGE.none and (dst.is_indirect() or src.is_indirect()):
        raise fail(I, "dge_mode", "none (host-precomputed descriptors) cannot use dynamic offsets")
    if (dst.dtype.is_x4 or src.dtype.is_x4) and dst.dtype is not src.dtype:
        raise fail(I, "dst", f"DMA cannot cast MX packed types ({src.dtype} -> {dst.dtype}); copy raw "
                             f"bits with matching dtypes")
    skip = oob is OOB.skip
    # resolve scalar dynamic offsets: out of bounds -> error or skip the whole transfer
    for role, t in (("dst", dst), ("src", src)):
        if t._dyn and t._base_offset() is None:
            if skip:
                return _record(I, dst, src, dge, eng, priority, name, skipped=True)
            raise NkiRuntimeError(f"{I}: {role}: {t._oob_msg()}")
    if src._vec is not None:
        vals, valid = src._read(oob_skip=skip)
        vals = _convert(vals, src.dtype, dst.dtype)
        if valid.all():
            dst._write(vals.reshape(dst.shape))
        else:
            per_row = src.size // src.shape[0]
            m = np.repeat(valid, per_row).reshape(dst.shape)
            old = np.array(dst._read())
            dst._write(np.where(m, vals.reshape(dst.shape), old))
    else:
        vals = src._read()
        vals = _convert(np.asarray(vals), src.dtype, dst.dtype)
        if dst._vec is not None:
            dst._write(vals.reshape(dst.shape), oob_skip=skip)
        else:
            dst._write(vals.reshape(dst.shape))
    return _record(I, dst, src, dge, eng, priority, name)


def _convert(vals, sd, dd):
    if sd is dd:
        return vals
    if sd.is_int and dd.is_int and sd.itemsize <= 2 and dd.itemsize >= 4:
        return vals.astype(dd.np)  # exact through fp32 anyway
    return dt.cast(dt.to_f32(vals), dd)


def _record(I, dst, src, dge, eng, priority, name, skipped=False):
    return emit("dma", "dma_copy", [("src", src)], [("dst", dst)],
                {"dge": dge.name, "issuer": eng.name, "priority": priority, "skipped": skipped,
                 "indirect": dst._vec is not None or src._vec is not None,
                 "dynamic": bool(dst._dyn or src._dyn),
                 "cast": dst.dtype is not src.dtype}, name)
