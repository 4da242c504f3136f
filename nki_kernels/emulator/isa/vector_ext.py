"""More VectorE / ScalarE / GpSimd instructions (nki-spec §9.2.5, §9.4.3, §9.5.3-9.5.10, §9.6.3):
``scalar_tensor_tensor``, ``tensor_scalar_reduce``, ``tensor_scalar_cumulative``,
``tensor_tensor_scan``, ``tensor_partition_reduce``, ``bn_stats``, ``bn_aggr``, ``exponential``,
``activate2``, ``select_reduce``, ``tensor_copy_predicated``.

Accumulator registers (nki-spec §9.3): the VectorE register ``core.dve_acc`` is shared by
``tensor_scalar_reduce``, ``tensor_scalar_cumulative``, ``exponential`` and ``select_reduce``
(and ``range_select``); the ScalarE register ``core.act_acc`` by ``activation`` and ``activate2``.
Register reductions combine the fp32 results (before the cast into ``dst``).
"""
from __future__ import annotations

import warnings

import numpy as np

from .. import dtypes as dt
from .. import ops
from .. import runtime as rt
from ..errors import fail
from ..tensor import NkiTensor
from ._common import (
    REDUCE_IDENTITY,
    NkiHardwareWarning,
    alu_op,
    as_enum,
    combine_acc,
    dve_register,
    emit,
    gen,
    mask_view,
    need_gen,
    not_both_psum,
    on_chip,
    psum_write_clear,
    reduce_rows,
    same_shape_pf,
    scalar_or_vector,
)
from ._common import engine as ENG
from ._common import reduce_cmd as RC

_ARITH = ("arith", "cmp", "unary")


# ------------------------------------------------------------------------------- helpers
def _gpsimd_ok(I, items):
    for role, t in items:
        if isinstance(t, NkiTensor) and t.buffer is rt.psum:
            raise fail(I, role, "is in PSUM; GpSimd cannot access PSUM")


def _max_rank(I, items, rank=4):
    for role, t in items:
        if t.ndim > rank:
            raise fail(I, role, f"has shape {t.shape}: at most {rank - 1} free dims (rank {rank}) "
                                f"are supported")


def _dtype_in(I, role, t, allowed, what):
    if t.dtype not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise fail(I, role, f"has dtype {t.dtype}; {what} must be one of {names}")


def _reduce_res(I, reduce_res, P, float_only=False):
    if reduce_res is None:
        return
    on_chip(I, "reduce_res", reduce_res)
    if reduce_res.shape[0] != P or reduce_res.free_size != 1:
        raise fail(I, "reduce_res", f"must be a ({P}, 1) tensor; got shape {reduce_res.shape}")
    if float_only and not reduce_res.dtype.is_float:
        raise fail(I, "reduce_res", f"has dtype {reduce_res.dtype}; it must be a float dtype")


def _write_res(reduce_res, values):
    if reduce_res is None:
        return
    reduce_res.write_pf(np.asarray(values, dtype=np.float32).reshape(-1, 1))
    psum_write_clear(reduce_res)


def _tensor_reads(*items):
    return [(r, t) for r, t in items if isinstance(t, NkiTensor)]



def _row_reduce(op, x):
    """Reduce [P, F] f32 rows with ``op`` as a left fold (abs_max/abs_min: ties go to the later
    element, as ``op(acc, x_j)`` returns ``x_j`` on equal magnitudes)."""
    if op in (ops.abs_max, ops.abs_min):
        a = np.abs(x)
        best = a.max(axis=1) if op is ops.abs_max else a.min(axis=1)
        hit = (a == best[:, None])[:, ::-1]
        j = x.shape[1] - 1 - np.argmax(hit, axis=1)
        return x[np.arange(x.shape[0]), j].astype(np.float32)
    return np.asarray(reduce_rows(op, x), dtype=np.float32)


# ----------------------------------------------------------------------------- scalar_tensor_tensor
def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False,
                         name=None):
    """``dst = (data op0 operand0) op1 operand1`` with a per-partition ``operand0`` and a full-tile
    ``operand1`` (VectorE)."""
    I = "scalar_tensor_tensor"
    on_chip(I, "dst", dst)
    on_chip(I, "data", data)
    on_chip(I, "operand1", operand1)
    same_shape_pf(I, [("data", data), ("operand1", operand1), ("dst", dst)])
    not_both_psum(I, "data", data, "operand1", operand1)
    op0 = alu_op(I, "op0", op0, kinds=_ARITH)
    op1 = alu_op(I, "op1", op1, kinds=("arith", "cmp"))
    P = data.shape[0]
    v0 = scalar_or_vector(I, "operand0", operand0, P, allow_none=op0.kind == "unary")
    if v0 is None:
        v0 = np.float32(0)
    x = data.read_f32()
    b = operand1.read_f32()
    with np.errstate(all="ignore"):
        t = op0.alu(v0, x) if reverse0 else op0.alu(x, v0)
        t = np.asarray(t, dtype=np.float32)
        y = op1.alu(b, t) if reverse1 else op1.alu(t, b)
    dst.write_pf(np.asarray(y, dtype=np.float32))
    psum_write_clear(dst)
    return emit("vector", I, _tensor_reads(("data", data), ("operand0", operand0),
                                           ("operand1", operand1)),
                [("dst", dst)], {"op0": op0.name, "op1": op1.name}, name)


# ----------------------------------------------------------------------------- tensor_scalar_reduce
_TSR_REDUCE = (ops.add, ops.multiply, ops.maximum, ops.minimum)


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=RC.reset_reduce, reduce_init=None, reduce_res_negate=False,
                         name=None):
    """``dst = data op0 operand0`` and ``reduce_op`` of it over the free dims, combined with the
    VectorE accumulator per ``reduce_cmd``; ``reduce_res`` (P, 1) receives the result."""
    I = "tensor_scalar_reduce"
    on_chip(I, "dst", dst)
    on_chip(I, "data", data)
    same_shape_pf(I, [("data", data), ("dst", dst)])
    _max_rank(I, [("data", data), ("dst", dst)])
    op0 = alu_op(I, "op0", op0, kinds=_ARITH)
    if reverse0:
        raise fail(I, "reverse0", "is not supported yet by tensor_scalar_reduce (nki-spec §9.5.6); "
                                  "use tensor_scalar with reverse0 and a separate tensor_reduce")
    if reduce_op not in _TSR_REDUCE:
        raise fail(I, "reduce_op", f"must be one of nl.add, nl.multiply, nl.maximum, nl.minimum; "
                                   f"got {reduce_op!r}")
    cmd = as_enum(RC, reduce_cmd, I, "reduce_cmd")
    P = data.shape[0]
    init = None
    if cmd is RC.load_reduce:
        if reduce_init is None:
            raise fail(I, "reduce_init", "is required with reduce_cmd=load_reduce")
        init = scalar_or_vector(I, "reduce_init", reduce_init, P)
    _reduce_res(I, reduce_res, P)
    v0 = scalar_or_vector(I, "operand0", operand0, P, allow_none=op0.kind == "unary")
    if v0 is None:
        v0 = np.float32(0)
    with np.errstate(all="ignore"):
        y = np.asarray(op0.alu(data.read_f32(), v0), dtype=np.float32)
    dst.write_pf(y)
    psum_write_clear(dst)
    part = _row_reduce(reduce_op, y)
    res = dve_register(I, cmd, reduce_op, part, P, init)
    if reduce_res is not None:
        _write_res(reduce_res, -res if reduce_res_negate else res)
    writes = [("dst", dst)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    return emit("vector", I, _tensor_reads(("data", data), ("operand0", operand0),
                                           ("reduce_init", reduce_init)),
                writes, {"op0": op0.name, "reduce_op": reduce_op.name, "reduce": cmd.name,
                         "readout": reduce_res is not None}, name)


# ------------------------------------------------------------------------- tensor_scalar_cumulative
_CUM_OP1 = (ops.add, ops.subtract, ops.multiply, ops.maximum, ops.minimum)
_CUM_DTYPES = (dt.bfloat16, dt.float16, dt.float32, dt.float8_e4m3, dt.float8_e4m3fn,
               dt.float8_e5m2, dt.uint8, dt.uint16, dt.int8, dt.int16)


def tensor_scalar_cumulative(dst, src, op0, op1, imm0, imm1=None, reduce_cmd=RC.reset_reduce,
                             name=None):
    """Per-partition prefix scan: ``reg = op1(op0(src[i], imm0), reg); dst[i] = reg`` with ``reg``
    the VectorE accumulator initialised per ``reduce_cmd``."""
    I = "tensor_scalar_cumulative"
    on_chip(I, "dst", dst)
    on_chip(I, "src", src)
    same_shape_pf(I, [("src", src), ("dst", dst)])
    _dtype_in(I, "src", src, _CUM_DTYPES, "input dtypes (no 32-bit integers)")
    _dtype_in(I, "dst", dst, _CUM_DTYPES, "output dtypes (no 32-bit integers)")
    op0 = alu_op(I, "op0", op0, kinds=_ARITH)
    if op1 not in _CUM_OP1:
        raise fail(I, "op1", f"must be one of nl.add, nl.subtract, nl.multiply, nl.maximum, "
                             f"nl.minimum; got {op1!r}")
    cmd = as_enum(RC, reduce_cmd, I, "reduce_cmd")
    if cmd not in (RC.reset_reduce, RC.reduce, RC.load_reduce):
        raise fail(I, "reduce_cmd", f"must be reset_reduce, reduce or load_reduce (the scan needs "
                                    f"an initial register value); got {cmd.name}")
    P = src.shape[0]
    v0 = scalar_or_vector(I, "imm0", imm0, P, allow_none=op0.kind == "unary")
    if v0 is None:
        v0 = np.float32(0)
    init = None
    if cmd is RC.load_reduce:
        if imm1 is None:
            raise fail(I, "imm1", "is required with reduce_cmd=load_reduce (the initial register "
                                  "value)")
        init = scalar_or_vector(I, "imm1", imm1, P)
    # spec silent on imm1 with other commands: it is ignored.
    core = rt.current_core()
    acc = core.dve_acc[:P]
    if cmd is RC.reset_reduce:
        reg = np.full(P, REDUCE_IDENTITY[op1], dtype=np.float32)
    elif cmd is RC.load_reduce:
        reg = np.broadcast_to(np.asarray(init, dtype=np.float32).reshape(-1), (P,)).copy()
    else:
        if not core.dve_acc_valid:
            warnings.warn(f"{I}: reduce_cmd=reduce continues a VectorE accumulator that no "
                          f"reset_reduce/load_reduce initialised (or an idle VectorE instruction "
                          f"may have clobbered it)", NkiHardwareWarning, stacklevel=2)
        reg = acc.copy()
    with np.errstate(all="ignore"):
        y = np.asarray(op0.alu(src.read_f32(), v0), dtype=np.float32)
        out = _scan(op1, y, reg)
    dst.write_pf(out)
    psum_write_clear(dst)
    acc[...] = out[:, -1]
    core.dve_acc_valid = True
    return emit("vector", I, _tensor_reads(("src", src), ("imm0", imm0), ("imm1", imm1)),
                [("dst", dst)], {"op0": op0.name, "op1": op1.name, "reduce": cmd.name}, name)


def _scan(op1, y, reg):
    """``reg = op1(y[:, i], reg)`` for each column i, keeping every step (sequential fp32)."""
    col = reg.reshape(-1, 1).astype(np.float32)
    if op1 is ops.add:
        return np.cumsum(np.concatenate([col, y], axis=1), axis=1, dtype=np.float32)[:, 1:]
    if op1 is ops.multiply:
        return np.cumprod(np.concatenate([col, y], axis=1), axis=1, dtype=np.float32)[:, 1:]
    if op1 is ops.maximum:
        return np.maximum.accumulate(np.concatenate([col, y], axis=1), axis=1)[:, 1:]
    if op1 is ops.minimum:
        return np.minimum.accumulate(np.concatenate([col, y], axis=1), axis=1)[:, 1:]
    out = np.empty_like(y)
    r = col[:, 0]
    for i in range(y.shape[1]):
        r = np.asarray(op1.alu(y[:, i], r), dtype=np.float32)
        out[:, i] = r
    return out


# ------------------------------------------------------------------------------- tensor_tensor_scan
def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False,
                       name=None):
    """``r[i] = op1(op0(data0[i], r[i-1]), data1[i])`` per partition, ``r[-1] = initial``."""
    I = "tensor_tensor_scan"
    for r, t in (("dst", dst), ("data0", data0), ("data1", data1)):
        on_chip(I, r, t)
    same_shape_pf(I, [("data0", data0), ("data1", data1), ("dst", dst)])
    not_both_psum(I, "data0", data0, "data1", data1)
    op0 = alu_op(I, "op0", op0, kinds=("arith", "cmp"))
    op1 = alu_op(I, "op1", op1, kinds=("arith", "cmp"))
    P = data0.shape[0]
    init = scalar_or_vector(I, "initial", initial, P)
    a = data0.read_f32()
    b = data1.read_f32()
    out = np.empty_like(a)
    r = np.broadcast_to(np.asarray(init, dtype=np.float32).reshape(-1), (P,)).astype(np.float32)
    with np.errstate(all="ignore"):
        for i in range(a.shape[1]):
            t = op0.alu(r, a[:, i]) if reverse0 else op0.alu(a[:, i], r)
            t = np.asarray(t, dtype=np.float32)
            r = np.asarray(op1.alu(b[:, i], t) if reverse1 else op1.alu(t, b[:, i]),
                           dtype=np.float32)
            out[:, i] = r
    dst.write_pf(out)
    psum_write_clear(dst)
    return emit("vector", I, _tensor_reads(("data0", data0), ("data1", data1),
                                           ("initial", initial)),
                [("dst", dst)], {"op0": op0.name, "op1": op1.name}, name)


# -------------------------------------------------------------------------- tensor_partition_reduce
_TPR_OPS = (ops.add, ops.average, ops.maximum, ops.bitwise_or, ops.bitwise_and)


def tensor_partition_reduce(dst, op, data, name=None):
    """``dst[0, f] = op over partitions p of data[p, f]`` (GpSimd, SBUF only)."""
    I = "tensor_partition_reduce"
    on_chip(I, "dst", dst, psum=False)
    on_chip(I, "data", data, psum=False)
    if op not in _TPR_OPS:
        raise fail(I, "op", f"must be one of nl.add, nl.average, nl.maximum, nl.bitwise_or, "
                            f"nl.bitwise_and; got {op!r}")
    if dst.shape[0] != 1:
        raise fail(I, "dst", f"must have 1 partition (the reduction over partitions); got shape "
                             f"{dst.shape}")
    if dst.free_size != data.free_size:
        raise fail(I, "dst", f"has {dst.free_size} elements per partition (shape {dst.shape}) but "
                             f"'data' has {data.free_size} (shape {data.shape}); they must match")
    P = data.shape[0]
    if op.kind == "bitvec":
        for r, t in (("data", data), ("dst", dst)):
            if not t.dtype.is_int:
                raise fail(I, r, f"has dtype {t.dtype}; bitwise ops need integer dtypes")
        x = data.read_pf()
        fn = np.bitwise_or if op is ops.bitwise_or else np.bitwise_and
        r = fn.reduce(x, axis=0, keepdims=True)
        dst.write_pf(np.asarray(r).astype(x.dtype).astype(dst.dtype.np), cast=False)
    else:
        x = data.read_f32()
        if op is ops.maximum:
            r = x.max(axis=0, keepdims=True)
        else:
            r = x.sum(axis=0, keepdims=True, dtype=np.float32)
            if op is ops.average:
                r = r / np.float32(P)
        dst.write_pf(np.asarray(r, dtype=np.float32))
    return emit("gpsimd", I, [("data", data)], [("dst", dst)], {"op": op.name, "partitions": P},
                name)


# ------------------------------------------------------------------------------- bn_stats / bn_aggr
def bn_stats(dst, data, name=None):
    """Per partition ``[n, mean, M2]`` of the even-, then the odd-indexed free elements (6 values).
    """
    I = "bn_stats"
    on_chip(I, "dst", dst)
    on_chip(I, "data", data)
    P = data.shape[0]
    fmax = gen().bn_stats_fmax
    if data.free_size > fmax:
        raise fail(I, "data", f"has {data.free_size} elements per partition; bn_stats takes at "
                              f"most tile_size.bn_stats_fmax = {fmax}")
    if dst.shape[0] != P or dst.free_size != 6:
        raise fail(I, "dst", f"must hold ({P}, 6) values [count, mean, count*var] for the even- "
                             f"and odd-indexed elements; got shape {dst.shape}")
    x = data.read_f32()
    cols = []
    for part in (x[:, 0::2], x[:, 1::2]):
        n = part.shape[1]
        if n == 0:  # spec silent: an empty group reports count 0, mean 0, M2 0
            cols += [np.zeros(P, np.float32)] * 3
            continue
        mean = part.mean(axis=1, dtype=np.float32)
        m2 = ((part - mean[:, None]) ** 2).sum(axis=1, dtype=np.float32)
        cols += [np.full(P, n, np.float32), mean, m2]
    dst.write_pf(np.stack(cols, axis=1).astype(np.float32))
    psum_write_clear(dst)
    return emit("vector", I, [("data", data)], [("dst", dst)], {"elements": data.free_size}, name)


def bn_aggr(dst, data, name=None):
    """Combine ``(count, mean, M2)`` triples into ``[mean, population variance]`` per partition."""
    I = "bn_aggr"
    on_chip(I, "dst", dst)
    on_chip(I, "data", data)
    P = data.shape[0]
    F = data.free_size
    if F % 3 != 0:
        raise fail(I, "data", f"has {F} elements per partition; it must hold whole (count, mean, "
                              f"M2) triples (a multiple of 3, e.g. k bn_stats outputs of 6)")
    if dst.shape[0] != P or dst.free_size != 2:
        raise fail(I, "dst", f"must be ({P}, 2) [mean, variance]; got shape {dst.shape}")
    t = data.read_f32().reshape(P, F // 3, 3).astype(np.float64)
    n = np.zeros(P)
    mean = np.zeros(P)
    m2 = np.zeros(P)
    for k in range(F // 3):  # Chan et al. parallel combination
        nb, mb, m2b = t[:, k, 0], t[:, k, 1], t[:, k, 2]
        tot = n + nb
        safe = np.where(tot > 0, tot, 1.0)
        d = mb - mean
        mean = np.where(tot > 0, mean + d * nb / safe, mean)
        m2 = m2 + m2b + d * d * n * nb / safe
        n = tot
    # spec silent: a partition with no elements reports mean 0, variance 0
    var = np.where(n > 0, m2 / np.where(n > 0, n, 1.0), 0.0)
    dst.write_pf(np.stack([mean, var], axis=1).astype(np.float32))
    psum_write_clear(dst)
    return emit("vector", I, [("data", data)], [("dst", dst)], {"groups": F // 3}, name)


# ------------------------------------------------------------------------------- exponential
_EXP_DST = (dt.float8_e4m3, dt.float8_e5m2, dt.float16, dt.bfloat16, dt.float32, dt.tfloat32,
            dt.int8, dt.int16, dt.int32, dt.uint8, dt.uint16)
_EXP_SRC = _EXP_DST + (dt.uint32,)


def exponential(dst, src, max_value=0.0, reduce_res=None, reduce_cmd=RC.idle, reduce_init=0.0,
                name=None):
    """``dst = exp(src - max_value)`` on VectorE (Trn3), with an optional running sum in the
    VectorE accumulator and a ``reduce_res`` read-out."""
    I = "exponential"
    need_gen(I, 4)
    on_chip(I, "dst", dst)
    on_chip(I, "src", src)
    same_shape_pf(I, [("src", src), ("dst", dst)])
    _max_rank(I, [("src", src), ("dst", dst)])
    _dtype_in(I, "dst", dst, _EXP_DST, "exponential outputs")
    _dtype_in(I, "src", src, _EXP_SRC, "exponential inputs")
    cmd = as_enum(RC, reduce_cmd, I, "reduce_cmd")
    P = src.shape[0]
    m = scalar_or_vector(I, "max_value", max_value, P)
    init = None
    if cmd is RC.load_reduce:
        init = scalar_or_vector(I, "reduce_init", 0.0 if reduce_init is None else reduce_init, P)
    elif reduce_init is not None and (isinstance(reduce_init, NkiTensor) or reduce_init != 0.0):
        raise fail(I, "reduce_init", f"must be unset or 0.0 unless reduce_cmd=load_reduce; got "
                                     f"{reduce_init!r} with reduce_cmd={cmd.name}")
    _reduce_res(I, reduce_res, P)
    with np.errstate(all="ignore"):
        y = np.exp(src.read_f32() - m).astype(np.float32)
    dst.write_pf(y)
    psum_write_clear(dst)
    res = dve_register(I, cmd, ops.add, _row_reduce(ops.add, y), P, init)
    _write_res(reduce_res, res)
    writes = [("dst", dst)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    return emit("vector", I, _tensor_reads(("src", src), ("max_value", max_value),
                                           ("reduce_init", reduce_init)),
                writes, {"reduce": cmd.name, "readout": reduce_res is not None}, name)


# ------------------------------------------------------------------------------- activate2
_ACT2_COMBOS = {(ops.multiply, ops.add), (ops.multiply, ops.subtract), (ops.multiply, ops.bypass),
                (ops.add, ops.bypass), (ops.subtract, ops.bypass), (ops.bypass, ops.bypass)}
_ACT2_REDUCE = (ops.add, ops.maximum, ops.minimum, ops.abs_max, ops.abs_min)


def activate2(dst, op, data, imm0, imm1, op0, op1, relu_param=0.0, reverse0=False, reverse1=False,
              reduce_op=None, reduce_res=None, reduce_cmd=RC.idle, engine=ENG.scalar, name=None):
    """``out = op((data op0 imm0) op1 imm1)`` on ScalarE (Trn3), with an optional ``reduce_op``
    reduction into the ScalarE accumulator. ``engine=gpsimd`` (SDK 2.33) runs without registers."""
    I = "activate2"
    need_gen(I, 4)
    on_chip(I, "dst", dst)
    on_chip(I, "data", data)
    same_shape_pf(I, [("data", data), ("dst", dst)])
    if not isinstance(op, ops.Op) or (op.act is None and op is not ops.prelu):
        raise fail(I, "op", f"must be an activation function such as nl.exp, nl.silu or nl.prelu; "
                            f"got {op!r}")
    op0 = ops.bypass if op0 is None else op0
    op1 = ops.bypass if op1 is None else op1
    if op0 is ops.bypass and op1 is not ops.bypass:
        raise fail(I, "op1", f"{op1!r} requires op0 to be set (op0 is bypass)")
    if (op0, op1) not in _ACT2_COMBOS:
        raise fail(I, "op0', 'op1", f"({op0!r}, {op1!r}) is not a supported combination; allowed: "
                                    f"(multiply, add), (multiply, subtract), (multiply, bypass), "
                                    f"(add, bypass), (subtract, bypass), (bypass, bypass)")
    if reverse0 and op0 is ops.bypass:
        raise fail(I, "reverse0", "requires op0 to be set")
    if reverse1 and op1 is ops.bypass:
        raise fail(I, "reverse1", "requires op1 to be set")
    if isinstance(imm0, NkiTensor) and isinstance(imm1, NkiTensor) and imm0.dtype is not imm1.dtype:
        raise fail(I, "imm1", f"has dtype {imm1.dtype} but 'imm0' has {imm0.dtype}; tensor "
                              f"immediates must share one dtype")
    cmd = as_enum(RC, reduce_cmd, I, "reduce_cmd")
    e = as_enum(ENG, engine, I, "engine")
    if e is ENG.unknown:
        e = ENG.scalar
    if e not in (ENG.scalar, ENG.gpsimd):
        raise fail(I, "engine", f"must be scalar or gpsimd; got {e.name}")
    if e is ENG.gpsimd:
        _gpsimd_ok(I, [("dst", dst), ("data", data)])
        if reduce_op is not None or reduce_res is not None or cmd is not RC.idle:
            raise fail(I, "reduce_cmd", "the accumulator is only available on ScalarE")
    if reduce_op is not None and reduce_op not in _ACT2_REDUCE:
        raise fail(I, "reduce_op", f"must be one of nl.add, nl.maximum, nl.minimum, nl.abs_max, "
                                   f"nl.abs_min; got {reduce_op!r}")
    if cmd is RC.load_reduce:
        raise fail(I, "reduce_cmd", "load_reduce is a VectorE command; ScalarE supports idle, "
                                    "reset, reduce, reset_reduce")
    if cmd in (RC.reduce, RC.reset_reduce) and reduce_op is None:
        raise fail(I, "reduce_op", f"is required with reduce_cmd={cmd.name}")
    P = data.shape[0]
    _reduce_res(I, reduce_res, P)
    v0 = scalar_or_vector(I, "imm0", imm0, P) if op0 is not ops.bypass else None
    v1 = scalar_or_vector(I, "imm1", imm1, P) if op1 is not ops.bypass else None
    alpha = scalar_or_vector(I, "relu_param", relu_param, P)
    v = data.read_f32()
    with np.errstate(all="ignore"):
        if v0 is not None:
            v = np.asarray(op0.alu(v0, v) if reverse0 else op0.alu(v, v0), dtype=np.float32)
        if v1 is not None:
            v = np.asarray(op1.alu(v1, v) if reverse1 else op1.alu(v, v1), dtype=np.float32)
        if op is ops.prelu:
            out = np.where(v >= 0, v, alpha * v).astype(np.float32)
        else:  # spec silent: relu_param only affects nl.prelu
            out = np.asarray(op.act(v), dtype=np.float32)
    dst.write_pf(out)
    psum_write_clear(dst)
    acc = rt.current_core().act_acc[:P]
    if cmd in (RC.reset, RC.reset_reduce):
        acc[...] = REDUCE_IDENTITY[reduce_op] if reduce_op is not None else 0.0
    if cmd in (RC.reduce, RC.reset_reduce):
        acc[...] = combine_acc(reduce_op, acc, _row_reduce(reduce_op, out))
    if reduce_res is not None:
        _write_res(reduce_res, acc.copy())
    writes = [("dst", dst)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    return emit(e.name, I, _tensor_reads(("data", data), ("imm0", imm0), ("imm1", imm1),
                                         ("relu_param", relu_param)),
                writes, {"op": op.name, "op0": op0.name, "op1": op1.name, "reduce": cmd.name,
                         "reduce_op": reduce_op.name if reduce_op is not None else None,
                         "readout": reduce_res is not None}, name)


# ------------------------------------------------------------------------------- select_reduce
_SEL_PRED = (dt.int8, dt.uint8, dt.int16, dt.uint16)


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=RC.idle,
                  reduce_op=ops.maximum, reverse_pred=False, name=None):
    """``dst = where(predicate != 0 (xor reverse_pred), on_true, on_false)`` with an optional max
    reduction of ``dst`` through the VectorE accumulator into ``reduce_res``."""
    I = "select_reduce"
    for r, t in (("dst", dst), ("predicate", predicate), ("on_true", on_true)):
        on_chip(I, r, t)
    same_shape_pf(I, [("on_true", on_true), ("predicate", predicate), ("dst", dst)])
    not_both_psum(I, "on_true", on_true, "predicate", predicate)
    _dtype_in(I, "predicate", predicate, _SEL_PRED, "predicates")
    if on_true.dtype in (dt.tfloat32, dt.int32, dt.uint32) or on_true.dtype.is_x4:
        raise fail(I, "on_true", f"has dtype {on_true.dtype}; tfloat32, int32, uint32 and packed "
                                 f"types are not supported")
    if reduce_op is not ops.maximum:
        raise fail(I, "reduce_op", f"must be nl.maximum (the only select_reduce reduction); got "
                                   f"{reduce_op!r}")
    cmd = as_enum(RC, reduce_cmd, I, "reduce_cmd")
    if cmd is RC.load_reduce:
        # spec silent on an initial value for select_reduce: no reduce_init parameter exists
        raise fail(I, "reduce_cmd", "load_reduce needs an initial value and select_reduce has no "
                                    "reduce_init; use reset_reduce or reduce")
    P = on_true.shape[0]
    f = scalar_or_vector(I, "on_false", on_false, P)
    _reduce_res(I, reduce_res, P, float_only=True)
    mask = predicate.read_pf() != 0
    if reverse_pred:
        mask = ~mask
    y = np.where(mask, on_true.read_f32(), f).astype(np.float32)
    dst.write_pf(y)
    psum_write_clear(dst)
    res = dve_register(I, cmd, reduce_op, _row_reduce(reduce_op, y), P)
    _write_res(reduce_res, res)
    writes = [("dst", dst)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    return emit("vector", I, _tensor_reads(("predicate", predicate), ("on_true", on_true),
                                           ("on_false", on_false)),
                writes, {"reduce": cmd.name, "readout": reduce_res is not None}, name)


# --------------------------------------------------------------------------- tensor_copy_predicated
_COPY_PRED = (dt.uint8, dt.uint16, dt.uint32)


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """``dst = src`` where ``predicate != 0`` (xor ``reverse_pred``); other elements unchanged."""
    I = "tensor_copy_predicated"
    on_chip(I, "dst", dst)
    on_chip(I, "predicate", predicate)
    if dst.dtype.is_x4:
        raise fail(I, "dst", f"cannot be a packed {dst.dtype} tensor")
    if isinstance(src, NkiTensor):
        on_chip(I, "src", src)
        same_shape_pf(I, [("src", src), ("predicate", predicate), ("dst", dst)])
        not_both_psum(I, "src", src, "predicate", predicate)
        if src.dtype is not dst.dtype:
            raise fail(I, "src", f"has dtype {src.dtype} but 'dst' has {dst.dtype}; they must "
                                 f"match")
        vals = src.read_pf()
    else:
        same_shape_pf(I, [("predicate", predicate), ("dst", dst)])
        if isinstance(src, bool) or not isinstance(src, (int, float, np.integer, np.floating)):
            raise fail(I, "src", f"must be a tensor or a Python number; got {type(src).__name__}")
        if dst.dtype.is_int:
            vals = dt.cast(np.asarray([src], dtype=np.int64 if isinstance(src, (int, np.integer))
                                      else np.float32), dst.dtype)[0]
        else:
            vals = dt.cast(np.asarray([src], dtype=np.float32), dst.dtype)[0]
    _dtype_in(I, "predicate", predicate, _COPY_PRED, "predicates")
    mask = predicate.read_pf() != 0
    if reverse_pred:
        mask = ~mask
    out = np.where(mask, vals, dst.read_pf()).astype(dst.dtype.np)
    dst.write_pf(out, cast=False)
    if dst.buffer is rt.psum and dst.storage.mm_written is not None:
        mask_view(dst)[mask.reshape(dst.shape)] = False  # only the copied elements were written
    return emit("vector", I, _tensor_reads(("src", src), ("predicate", predicate), ("dst", dst)),
                [("dst", dst)], {"reverse_pred": bool(reverse_pred)}, name)


__all__ = ["scalar_tensor_tensor", "tensor_scalar_reduce", "tensor_scalar_cumulative",
           "tensor_tensor_scan", "tensor_partition_reduce", "bn_stats", "bn_aggr", "exponential",
           "activate2", "select_reduce", "tensor_copy_predicated"]
