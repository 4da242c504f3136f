"""Elementwise and reduction instructions on VectorE / ScalarE / GpSimd (nki-spec §9.2.4-9.5.9):
``tensor_tensor``, ``tensor_scalar``, ``tensor_copy``, ``tensor_reduce``, ``memset``, ``reciprocal``,
``activation``, ``activation_reduce``, ``iota``."""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from .. import ops
from .. import runtime as rt
from ..errors import fail
from ._common import (
    alu_op,
    apply_alu,
    as_enum,
    emit,
    gen,
    need_gen,
    not_both_psum,
    on_chip,
    psum_write_clear,
    reduce_rows,
    same_shape_pf,
    scalar_or_vector,
    tensor,
)
from ._common import engine as ENG
from ._common import reduce_cmd as RC


def _engine(I, requested, allowed, default):
    e = as_enum(ENG, requested, I, "engine")
    if e is ENG.unknown:
        return default
    if e not in allowed:
        raise fail(I, "engine", f"{e.name} cannot run {I}; allowed: "
                                f"{', '.join(a.name for a in allowed)}")
    return e


def _gpsimd_ok(I, items):
    for role, t in items:
        if t is not None and t.buffer is rt.psum:
            raise fail(I, role, "is in PSUM; GpSimd cannot access PSUM")


def _ename(e):
    return e.name


# ------------------------------------------------------------------------------- tensor_tensor
def tensor_tensor(dst, data1, data2, op, engine=ENG.unknown, name=None):
    """``dst = data1 op data2`` elementwise (same partitions, same elements per partition)."""
    I = "tensor_tensor"
    for r, t in (("dst", dst), ("data1", data1), ("data2", data2)):
        on_chip(I, r, t)
    same_shape_pf(I, [("data1", data1), ("data2", data2), ("dst", dst)])
    not_both_psum(I, "data1", data1, "data2", data2)
    op = alu_op(I, "op", op, kinds=("arith", "cmp", "bitvec"))
    all_int32 = all(t.dtype in (dt.int32, dt.uint32) for t in (dst, data1, data2))
    no_psum = all(t.buffer is not rt.psum for t in (dst, data1, data2))
    default = ENG.gpsimd if (op is ops.power or (all_int32 and no_psum)) else ENG.vector
    e = _engine(I, engine, (ENG.vector, ENG.gpsimd), default)
    if e is ENG.gpsimd:
        _gpsimd_ok(I, [("dst", dst), ("data1", data1), ("data2", data2)])
    if op.kind == "bitvec":
        _int_dtypes(I, (("dst", dst), ("data1", data1), ("data2", data2)))
        a = data1.read_pf()
        dst.write_pf(_bitvec(op, a, data2.read_pf(), dst.dtype), cast=False)
    elif e is ENG.gpsimd and all_int32 and op.kind != "cmp" and op is not ops.power:
        a = data1.read_pf().astype(np.int64)
        b = data2.read_pf().astype(np.int64)
        dst.write_pf(_int_alu(op, a, b, dst.dtype))
    else:
        dst.write_pf(apply_alu(op, data1.read_f32(), data2.read_f32()))
    psum_write_clear(dst)
    return emit(_ename(e), I, [("data1", data1), ("data2", data2)], [("dst", dst)],
                {"op": op.name}, name)


def _int_dtypes(I, items):
    for r, t in items:
        if not t.dtype.is_int:
            raise fail(I, r, f"has dtype {t.dtype}; bitwise ops need integer dtypes")


def _bitvec(op, a, b, out_dtype, reverse=False):
    """Bitwise ops on raw integer bits in the first input's type; results wrap into ``out_dtype``."""
    b = np.asarray(b).astype(a.dtype)
    r = op.alu(b, a) if reverse else op.alu(a, b)
    return np.asarray(r).astype(a.dtype).astype(out_dtype.np)


def _int_alu(op, a, b, out_dtype):
    """GpSimd native integer path: exact int math, results wrap to 32 bits (of ``out_dtype``)."""
    table = {ops.add: np.add, ops.subtract: np.subtract, ops.multiply: np.multiply,
             ops.maximum: np.maximum, ops.minimum: np.minimum}
    fn = table.get(op)
    if fn is None:
        return op.alu(a.astype(np.float32), b.astype(np.float32))
    r = fn(a, b) % 2**32
    return r if out_dtype is dt.uint32 else ((r + 2**31) % 2**32) - 2**31


# ------------------------------------------------------------------------------- tensor_scalar
_SCALAR_GEN3 = {(ops.multiply, ops.add), (ops.multiply, None), (ops.add, None)}


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=ENG.unknown, name=None):
    """``dst = (data op0 operand0) op1 operand1`` with per-partition or immediate operands."""
    I = "tensor_scalar"
    on_chip(I, "dst", dst)
    on_chip(I, "data", data)
    same_shape_pf(I, [("data", data), ("dst", dst)])
    op0 = alu_op(I, "op0", op0)
    op1 = alu_op(I, "op1", op1, allow_none=True)
    if (op1 is None) != (operand1 is None) and not (op1 is not None and op1.kind == "unary"):
        raise fail(I, "op1", "op1 and operand1 must both be given or both be None")
    if op1 is not None and (op0.kind == "bitvec") != (op1.kind == "bitvec"):
        raise fail(I, "op1", "op0 and op1 must both be bitwise or both be arithmetic")
    P = data.shape[0]
    for role, o, v in (("operand0", op0, operand0), ("operand1", op1, operand1)):
        if o is not None and o.kind == "unary" and v not in (None, 0, 0.0):
            raise fail(I, role, f"must be None or 0 for the unary operator {o!r}; got {v!r}")
    default = ENG.gpsimd if op0 is ops.rsqrt or op1 is ops.rsqrt else ENG.vector
    e = _engine(I, engine, (ENG.vector, ENG.scalar, ENG.gpsimd), default)
    if (op0 is ops.rsqrt or op1 is ops.rsqrt) and e is not ENG.gpsimd:
        raise fail(I, "engine", "nl.rsqrt as an ALU operator runs on GpSimd (engine=gpsimd)")
    if e is ENG.gpsimd:
        _gpsimd_ok(I, [("dst", dst), ("data", data)])
    if e is ENG.scalar:
        g = gen()
        if g.nc_version < 3:
            raise fail(I, "engine", "ScalarE tensor_scalar needs Trn2 or newer")
        if g.nc_version == 3 and (op0, op1) not in _SCALAR_GEN3:
            raise fail(I, "engine", f"ScalarE on {g.name} supports only (multiply, add), "
                                    f"(multiply, None), (add, None); got ({op0}, {op1})")
    if op0.kind == "bitvec":
        if e is not ENG.vector:
            raise fail(I, "engine", "bitwise tensor_scalar runs on VectorE only")
        _int_dtypes(I, (("dst", dst), ("data", data)))
        x = data.read_pf()
        x = _bitvec(op0, x, _int_operand(I, "operand0", operand0, P), data.dtype, reverse0)
        if op1 is not None:
            x = _bitvec(op1, x, _int_operand(I, "operand1", operand1, P), data.dtype, reverse1)
        dst.write_pf(x.astype(dst.dtype.np), cast=False)
    else:
        x = data.read_f32()
        v0 = scalar_or_vector(I, "operand0", operand0, P, allow_none=op0.kind == "unary")
        x = _apply(op0, x, v0, reverse0)
        if op1 is not None:
            v1 = scalar_or_vector(I, "operand1", operand1, P, allow_none=op1.kind == "unary")
            x = _apply(op1, x, v1, reverse1)
        dst.write_pf(x)
    psum_write_clear(dst)
    return emit(_ename(e), I, [("data", data)] + _tensor_operands(operand0, operand1),
                [("dst", dst)], {"op0": op0.name, "op1": op1.name if op1 else None}, name)


def _apply(op, x, v, reverse):
    if v is None:
        v = np.float32(0)
    return op.alu(v, x) if reverse else op.alu(x, v)


def _int_operand(I, role, v, P):
    from ..tensor import NkiTensor
    if isinstance(v, NkiTensor):
        on_chip(I, role, v)
        if v.shape[0] != P or v.free_size != 1:
            raise fail(I, role, f"must be a ({P}, 1) tensor; got {v.shape}")
        return v.read_pf().reshape(P, 1)
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise fail(I, role, f"must be an integer for a bitwise op; got {v!r}")
    return np.int64(v)


def _tensor_operands(*vals):
    from ..tensor import NkiTensor
    return [(f"operand{i}", v) for i, v in enumerate(vals) if isinstance(v, NkiTensor)]


# ------------------------------------------------------------------------------- tensor_copy
def tensor_copy(dst, src, engine=ENG.unknown, name=None):
    """Copy ``src`` into ``dst`` (bit-exact when dtypes match, else cast through fp32)."""
    I = "tensor_copy"
    on_chip(I, "dst", dst)
    on_chip(I, "src", src)
    same_shape_pf(I, [("src", src), ("dst", dst)])
    e = _engine(I, engine, (ENG.vector, ENG.scalar, ENG.gpsimd), ENG.vector)
    if e is ENG.gpsimd:
        _gpsimd_ok(I, [("dst", dst), ("src", src)])
    if e is ENG.scalar and gen().nc_version < 3:
        raise fail(I, "engine", "ScalarE tensor_copy needs Trn2 or newer (use activation(op=nl.copy))")
    if src.dtype is dst.dtype:
        dst.write_pf(src.read_pf(), cast=False)
    else:
        if src.dtype.is_x4 or dst.dtype.is_x4:
            raise fail(I, "dst", f"cannot convert MX packed data ({src.dtype} -> {dst.dtype})")
        dst.write_pf(src.read_f32())
    psum_write_clear(dst)
    return emit(_ename(e), I, [("src", src)], [("dst", dst)], {}, name)


# ------------------------------------------------------------------------------- tensor_reduce
def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce ``data`` along trailing free axes (VectorE)."""
    I = "tensor_reduce"
    on_chip(I, "dst", dst)
    on_chip(I, "data", data)
    op = alu_op(I, "op", op, kinds=("arith", "bitvec"))
    if not op.reducible:
        raise fail(I, "op", f"{op!r} is not a reduction operator (add, multiply, maximum, minimum, "
                            f"logical and/or/xor, bitwise and/or/xor)")
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    nd = data.ndim
    axes = tuple(sorted(a % nd for a in axes))
    if 0 in axes:
        raise fail(I, "axis", "the partition axis (0) cannot be reduced; transpose first or use "
                              "tensor_partition_reduce")
    if axes != tuple(range(nd - len(axes), nd)):
        raise fail(I, "axis", f"{axis}: reduction axes must be the trailing free dims ending at the "
                              f"last dim of the {nd}-D input")
    P = data.shape[0]
    kept = 1
    for d in range(1, nd - len(axes)):
        kept *= data.shape[d]
    if dst.shape[0] != P or dst.free_size != kept:
        raise fail(I, "dst", f"has shape {dst.shape}; reducing {data.shape} over {axes} gives "
                             f"{P} x {kept} elements")
    red = 1
    for a in axes:
        red *= data.shape[a]
    if op.kind == "bitvec":
        x = data.read_pf().reshape(P, kept, red).astype(np.int64)
        fn = {ops.bitwise_and: np.bitwise_and, ops.bitwise_or: np.bitwise_or,
              ops.bitwise_xor: np.bitwise_xor}[op]
        r = fn.reduce(x, axis=2)
        dst.write_pf(r)
    else:
        x = data.read_f32().reshape(P * kept, red)
        r = reduce_rows(op, x).reshape(P, kept)
        if negate:
            r = -r
        dst.write_pf(r)
    psum_write_clear(dst)
    return emit("vector", I, [("data", data)], [("dst", dst)], {"op": op.name, "reduced": red}, name)


# ------------------------------------------------------------------------------ memset / reciprocal
def memset(dst, value, engine=ENG.unknown, name=None):
    """Fill ``dst`` with a compile-time constant (VectorE or GpSimd)."""
    I = "memset"
    on_chip(I, "dst", dst)
    e = _engine(I, engine, (ENG.vector, ENG.gpsimd), ENG.vector)
    if e is ENG.gpsimd:
        _gpsimd_ok(I, [("dst", dst)])
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise fail(I, "value", f"must be a Python number; got {type(value).__name__}")
    if dst.dtype.is_x4:
        if value != 0:
            raise fail(I, "value", f"MX packed {dst.dtype} can only be memset to 0; got {value!r}")
        dst.write_pf(np.zeros((dst.shape[0], dst.free_size), dst.dtype.np), cast=False)
    elif dst.dtype.is_int:
        if isinstance(value, (float, np.floating)) and float(value).is_integer():
            value = int(value)  # an integral float (memset(value=0.0) on uint32) is that integer
        if not isinstance(value, (int, np.integer)):
            raise fail(I, "value", f"must be an int for the integer dtype {dst.dtype}; got {value!r}")
        dst.write_pf(np.full((dst.shape[0], dst.free_size), int(value), dtype=np.int64))
    else:
        dst.write_pf(np.full((dst.shape[0], dst.free_size), value, dtype=np.float32))
    psum_write_clear(dst)
    return emit(_ename(e), I, [], [("dst", dst)], {"value": value}, name)


def reciprocal(dst, data, name=None):
    """``dst = 1 / data`` in fp32 on VectorE."""
    I = "reciprocal"
    on_chip(I, "dst", dst)
    on_chip(I, "data", data)
    same_shape_pf(I, [("data", data), ("dst", dst)])
    with np.errstate(divide="ignore"):
        dst.write_pf(np.float32(1) / data.read_f32())
    psum_write_clear(dst)
    return emit("vector", I, [("data", data)], [("dst", dst)], {}, name)


# ------------------------------------------------------------------------------- activation
def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=RC.idle, engine=ENG.scalar, name=None):
    """``dst = op(data * scale + bias)`` on ScalarE, with optional sum into the ACT registers."""
    return _activation("activation", dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd,
                       engine, name)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """``activation`` with ``reduce_cmd=reset_reduce`` and ``reduce_res`` read-out."""
    if reduce_res is None:
        raise fail("activation_reduce", "reduce_res", "is required")
    return _activation("activation_reduce", dst, op, data, bias, scale, reduce_op, reduce_res,
                       RC.reset_reduce, ENG.scalar, name)


def _activation(I, dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd, engine, name):
    g = gen()
    on_chip(I, "dst", dst)
    on_chip(I, "data", data)
    same_shape_pf(I, [("data", data), ("dst", dst)])
    if not isinstance(op, ops.Op) or op.act is None:
        raise fail(I, "op", f"must be an activation function such as nl.exp or nl.silu; got {op!r}")
    cmd = as_enum(RC, reduce_cmd, I, "reduce_cmd")
    e = as_enum(ENG, engine, I, "engine")
    if e is ENG.unknown:
        e = ENG.scalar
    if e not in (ENG.scalar, ENG.gpsimd):
        raise fail(I, "engine", f"must be scalar (or gpsimd on Trn3); got {e.name}")
    if e is ENG.gpsimd:
        need_gen(I, 4, "activation on GpSimd")
        _gpsimd_ok(I, [("dst", dst), ("data", data)])
        if reduce_op is not None or reduce_res is not None or cmd is not RC.idle:
            raise fail(I, "reduce_cmd", "the accumulator is only available on ScalarE")
    P = data.shape[0]
    if isinstance(bias, (int, float)) and not isinstance(bias, bool):
        if g.nc_version < 3:
            raise fail(I, "bias", "a Python float bias needs Trn2 or newer; pass a (P, 1) tile")
    if bias is not None and not isinstance(bias, (int, float)):
        if getattr(bias, "dtype", None) is dt.tfloat32:
            raise fail(I, "bias", "cannot be tfloat32")
    b = scalar_or_vector(I, "bias", bias, P, allow_none=True)
    s = scalar_or_vector(I, "scale", scale, P)
    x = data.read_f32()
    with np.errstate(all="ignore"):
        y = x * s
        if b is not None:
            y = y + b
        out = op.act(y.astype(np.float32))
    dst.write_pf(out)
    psum_write_clear(dst)
    core = rt.current_core()
    if reduce_op is not None and reduce_op is not ops.add:
        raise fail(I, "reduce_op", f"must be nl.add (ScalarE registers only sum); got {reduce_op!r}")
    if cmd is not RC.idle and reduce_op is None and cmd is not RC.reset:
        raise fail(I, "reduce_op", f"is required with reduce_cmd={cmd.name}")
    acc = core.act_acc[:P]
    if cmd in (RC.reset, RC.reset_reduce):
        acc[...] = 0.0
    if cmd in (RC.reduce, RC.reset_reduce):
        acc += out.sum(axis=1, dtype=np.float32)
    if cmd is RC.load_reduce:
        raise fail(I, "reduce_cmd", "load_reduce is a VectorE command; ScalarE supports idle, reset, "
                                    "reduce, reset_reduce")
    if reduce_res is not None:
        on_chip(I, "reduce_res", reduce_res)
        if reduce_res.shape[0] != P or reduce_res.free_size != 1:
            raise fail(I, "reduce_res", f"must be ({P}, 1); got {reduce_res.shape}")
        reduce_res.write_pf(acc.reshape(P, 1).copy())
        psum_write_clear(reduce_res)
    reads = [("data", data)] + [(r, t) for r, t in (("bias", bias), ("scale", scale))
                                if hasattr(t, "storage")]
    writes = [("dst", dst)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    return emit(_ename(e), I, reads, writes,
                {"op": op.name, "reduce": cmd.name, "readout": reduce_res is not None}, name)


# ------------------------------------------------------------------------------- iota
def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """``dst[p, ...] = offset + p * channel_multiplier + sum(step_k * i_k)`` (int32, GpSimd)."""
    I = "iota"
    on_chip(I, "dst", dst, psum=False)
    from ..scalars import is_runtime, runtime_value
    pat = [tuple(int(x) for x in p) for p in pattern]
    if not pat or len(pat) > 4 or any(len(p) != 2 for p in pat):
        raise fail(I, "pattern", f"must be 1 to 4 [step, count] pairs; got {pattern!r}")
    n = 1
    for _, c in pat:
        n *= c
    if n != dst.free_size:
        raise fail(I, "pattern", f"covers {n} elements per partition but dst has {dst.free_size}")
    off = runtime_value(offset) if is_runtime(offset) else int(offset)
    P = dst.shape[0]
    vals = np.zeros([c for _, c in pat], dtype=np.int64)
    for k, (step, c) in enumerate(pat):
        sh = [1] * len(pat)
        sh[k] = c
        vals = vals + (np.arange(c, dtype=np.int64) * step).reshape(sh)
    full = off + np.arange(P, dtype=np.int64)[:, None] * int(channel_multiplier) + vals.reshape(1, -1)
    full = ((full + 2**31) % 2**32) - 2**31  # computed in int32
    if dst.dtype.is_int:
        dst.write_pf(full)
    else:
        dst.write_pf(full.astype(np.float32))
    return emit("gpsimd", I, [], [("dst", dst)], {}, name)


__all__ = ["tensor_tensor", "tensor_scalar", "tensor_copy", "tensor_reduce", "memset",
           "reciprocal", "activation", "activation_reduce", "iota", "tensor"]
