"""Selection and masking (nki-spec §9.6.1-9.6.2): ``affine_select`` (GpSimd) and ``range_select``
(VectorE, Trn2+, with the VectorE accumulator register of §9.3)."""
from __future__ import annotations

import warnings

import numpy as np

from .. import dtypes as dt
from .. import ops
from .. import runtime as rt
from ..errors import fail
from ..tensor import NkiTensor
from ._common import (
    NkiHardwareWarning,
    as_enum,
    dve_register,
    emit,
    need_gen,
    on_chip,
    psum_write_clear,
    same_shape_pf,
    tensor,
)
from ._common import reduce_cmd as RC

FP32_MIN = float(np.finfo(np.float32).min)  # -3.4028235e38, range_select's on_false_value on HW


def _sbuf_only(I, role, t):
    """A GpSimd operand: SBUF only (nki-spec §8.1 item 6), then the usual on-chip checks."""
    tensor(I, role, t)
    if t.buffer is rt.psum:
        raise fail(I, role, "is in PSUM; GpSimd reads and writes SBUF only")
    return on_chip(I, role, t)


def _number(I, role, v):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise fail(I, role, f"must be a Python number; got {type(v).__name__}")
    return v


# ------------------------------------------------------------------------------- affine_select
def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=ops.equal,
                  offset=0, name=None):
    """``dst = on_true_tile where cmp_op(a, 0) else on_false_value`` with the iota pattern
    ``a[p, i..] = offset + p * channel_multiplier + sum(step_k * i_k)`` (GpSimd, SBUF).

    Causal mask (q rows on partitions, keys on the free axis)::

        affine_select(dst, pattern=[[-1, nk]], channel_multiplier=1, on_true_tile=s,
                      on_false_value=-3.4028235e38, cmp_op=nl.greater_equal, offset=q0 - k0)
    """
    I = "affine_select"
    _sbuf_only(I, "dst", dst)
    _sbuf_only(I, "on_true_tile", on_true_tile)
    same_shape_pf(I, [("on_true_tile", on_true_tile), ("dst", dst)])
    for role, t in (("dst", dst), ("on_true_tile", on_true_tile)):
        if t.dtype.is_x4:
            raise fail(I, role, f"cannot be an MX packed {t.dtype} tensor")
    try:
        pat = [tuple(int(x) for x in p) for p in pattern]
    except TypeError:
        raise fail(I, "pattern",
                   f"must be a list of [step, count] pairs; got {pattern!r}") from None
    if not pat or len(pat) > 4 or any(len(p) != 2 for p in pat):
        raise fail(I, "pattern", f"must be 1 to 4 [step, count] pairs; got {pattern!r}")
    if any(c < 1 for _, c in pat):
        raise fail(I, "pattern", f"counts must be >= 1; got {pattern!r}")
    n = 1
    for _, c in pat:
        n *= c
    if n != dst.free_size:
        raise fail(I, "pattern", f"covers {n} elements per partition but dst has {dst.free_size}")
    cm = channel_multiplier
    if isinstance(cm, bool) or not isinstance(cm, (int, np.integer)):
        raise fail(I, "channel_multiplier", f"must be an int; got {channel_multiplier!r}")
    if not isinstance(cmp_op, ops.Op) or cmp_op.kind != "cmp":
        raise fail(I, "cmp_op", f"must be a comparison operator (nl.equal, nl.not_equal, "
                                f"nl.greater, nl.greater_equal, nl.less, nl.less_equal); got "
                                f"{cmp_op!r}")
    if isinstance(on_false_value, NkiTensor):
        raise fail(I, "on_false_value", "must be a Python number (an fp32 immediate), not a tensor")
    _number(I, "on_false_value", on_false_value)
    from ..scalars import is_runtime, runtime_value
    if is_runtime(offset):
        off = runtime_value(offset)
    elif isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise fail(I, "offset", f"must be an int or a register; got {offset!r}")
    else:
        off = int(offset)

    # the iota pattern, computed in int32 like nisa.iota
    P = dst.shape[0]
    vals = np.zeros([c for _, c in pat], dtype=np.int64)
    for k, (step, c) in enumerate(pat):
        sh = [1] * len(pat)
        sh[k] = c
        vals = vals + (np.arange(c, dtype=np.int64) * step).reshape(sh)
    a = off + np.arange(P, dtype=np.int64)[:, None] * int(channel_multiplier) + vals.reshape(1, -1)
    a = ((a + 2**31) % 2**32) - 2**31
    mask = np.asarray(cmp_op.alu(a, np.int64(0))) != 0
    false_f32 = np.full((P, n), on_false_value, dtype=np.float32)
    if on_true_tile.dtype is dst.dtype:
        # same dtype: selected values are copied bit-exactly; the immediate is cast on write
        dst.write_pf(np.where(mask, on_true_tile.read_pf(), dt.cast(false_f32, dst.dtype)),
                     cast=False)
    else:
        dst.write_pf(np.where(mask, on_true_tile.read_f32(), false_f32))
    return emit("gpsimd", I, [("on_true_tile", on_true_tile)], [("dst", dst)],
                {"cmp_op": cmp_op.name}, name)


# ------------------------------------------------------------------------------- range_select
_RANGE_CMP = (ops.equal, ops.less, ops.less_equal, ops.greater, ops.greater_equal)


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1,
                 reduce_cmd=RC.reset_reduce, reduce_res=None, reduce_op=ops.maximum, range_start=0,
                 on_false_value=FP32_MIN, name=None):
    """``dst[p, j] = on_true[p, j] if comp_op0(idx, bound0[p]) and comp_op1(idx, bound1[p]) else
    on_false_value`` with ``idx = range_start + j`` (fp32), plus a max reduction of the row into
    the VectorE accumulator (``reduce_cmd``) and an optional read-out into ``reduce_res (P, 1)``.

    Defaults follow nki-spec §9.6.2 (``reduce_cmd=reset_reduce``, ``on_false_value=FP32_MIN``);
    the published docstring shows ``idle`` / ``0.0`` instead; the spec says HW needs FP32_MIN, so
    any other fill is rejected.
    """
    I = "range_select"
    need_gen(I, 3, "range_select")
    on_chip(I, "dst", dst)
    on_chip(I, "on_true_tile", on_true_tile)
    same_shape_pf(I, [("on_true_tile", on_true_tile), ("dst", dst)])
    if not on_true_tile.dtype.is_float:
        raise fail(I, "on_true_tile", f"has dtype {on_true_tile.dtype}; range_select takes float "
                                      f"data (fp32, bf16, fp16, fp8)")
    if dst.dtype.is_x4:
        raise fail(I, "dst", f"cannot be an MX packed {dst.dtype} tensor")
    for role, o in (("comp_op0", comp_op0), ("comp_op1", comp_op1)):
        if not any(o is c for c in _RANGE_CMP):
            raise fail(I, role, f"must be one of nl.equal, nl.less, nl.less_equal, nl.greater, "
                                f"nl.greater_equal; got {o!r}")
    P, F = dst.shape[0], dst.free_size
    bounds = []
    for role, b in (("bound0", bound0), ("bound1", bound1)):
        if not isinstance(b, NkiTensor):
            raise fail(I, role, f"must be a ({P}, 1) float32 tensor of per-partition bounds; got "
                                f"{type(b).__name__}")
        on_chip(I, role, b)
        if b.shape[0] != P or b.free_size != 1:
            raise fail(I, role, f"must be a ({P}, 1) per-partition tensor; got shape {b.shape}")
        if b.dtype is not dt.float32:
            raise fail(I, role, f"must be float32; got {b.dtype}")
        bounds.append(b.read_f32().reshape(P, 1))
    if reduce_op is not ops.maximum:
        raise fail(I, "reduce_op", f"must be nl.maximum (the only reduction range_select "
                                   f"supports); got {reduce_op!r}")
    cmd = as_enum(RC, reduce_cmd, I, "reduce_cmd")
    if cmd is RC.load_reduce:
        raise fail(I, "reduce_cmd", "load_reduce needs an initial value, which range_select does "
                                    "not take; use reset_reduce (or reduce to continue a chain)")
    _number(I, "on_false_value", on_false_value)
    if np.float32(on_false_value) != np.float32(FP32_MIN):
        raise fail(I, "on_false_value", f"must be FP32_MIN (-3.4028235e38) on hardware; got "
                                        f"{on_false_value!r} (the spec says other fill values are "
                                        f"not supported by the VectorE instruction)")
    _number(I, "range_start", range_start)
    if abs(float(range_start)) + F - 1 >= 2 ** 24:
        warnings.warn(f"{I}: indices range_start + j reach {abs(float(range_start)) + F - 1:.0f}; "
                      f"they are fp32 and stop being exact past 2^24", NkiHardwareWarning,
                      stacklevel=2)
    if reduce_res is not None:
        on_chip(I, "reduce_res", reduce_res)
        if reduce_res.shape[0] != P or reduce_res.free_size != 1:
            raise fail(I, "reduce_res", f"must be ({P}, 1); got {reduce_res.shape}")
        if not reduce_res.dtype.is_float:
            raise fail(I, "reduce_res", f"must have a float dtype (fp32 recommended); got "
                                        f"{reduce_res.dtype}")

    idx = np.float32(range_start) + np.arange(F, dtype=np.float32)[None, :]
    mask = (np.asarray(comp_op0.alu(idx, bounds[0])) != 0) & \
        (np.asarray(comp_op1.alu(idx, bounds[1])) != 0)
    out = np.where(mask, on_true_tile.read_f32(), np.float32(on_false_value)).astype(np.float32)
    dst.write_pf(out)
    psum_write_clear(dst)
    # the register reduces the fp32 results before the cast to dst.dtype: a bf16 dst holds -inf
    # where the register holds FP32_MIN (nki-spec §9.6.2 numerical note)
    part = out.max(axis=1)
    readout = dve_register(I, cmd, ops.maximum, part, P)
    if reduce_res is not None:
        reduce_res.write_pf(readout.reshape(P, 1))
        psum_write_clear(reduce_res)
    reads = [("on_true_tile", on_true_tile), ("bound0", bound0), ("bound1", bound1)]
    writes = [("dst", dst)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    return emit("vector", I, reads, writes,
                {"reduce": cmd.name, "readout": reduce_res is not None}, name)


__all__ = ["affine_select", "range_select", "FP32_MIN"]
