"""The experimental tile-returning ``nl.*`` ops (nki-spec §7), lowered to ``nisa`` instructions.

Each allocates a new SBUF tile and runs the instruction(s) the NKI documentation says the op lowers
to, so the instruction trace (and the cost model) sees what the compiler would emit:

* element-wise binary ``nl.add(x, y)`` ...: ``tensor_tensor`` (two tiles, same shape: these ops do
  not broadcast) or ``tensor_scalar`` (a tile and a Python number);
* element-wise unary ``nl.exp(x)`` ...: ``activation`` on ScalarE;
* ``nl.matmul(x, y, transpose_x=True)``: ``nc_matmul`` into PSUM, then a copy to SBUF;
  ``transpose_x=False`` first transposes ``x`` on TensorE;
* ``nl.transpose(x)``: ``nc_transpose`` through PSUM;
* ``nl.sum/max/min/mean/prod(x, axis)``: ``tensor_reduce`` over trailing free axes;
* ``nl.broadcast_to(x, shape)``: ``tensor_copy`` from a stride-0 view (NumPy broadcasting rules,
  same rank);
* ``nl.load`` / ``nl.store`` / ``nl.copy`` live in ``language``.
"""
from __future__ import annotations

import numpy as np

from .errors import NkiValidationError
from .tensor import NkiTensor


def _nl():
    from . import language
    return language


def _isa():
    from . import isa
    return isa


def _new(shape, dtype, buffer=None):
    nl = _nl()
    return nl.ndarray(tuple(shape), dtype, buffer=buffer or nl.sbuf)


def _is_tile(x):
    return isinstance(x, NkiTensor)


def call_op(op, args, kwargs):
    """``nl.<op>(x[, y], dtype=None)``."""
    dtype = kwargs.pop("dtype", None)
    if kwargs:
        raise TypeError(f"nl.{op.name}: unexpected arguments {sorted(kwargs)}")
    if len(args) == 2 and op.alu is not None:
        x, y = args
        if _is_tile(x) and _is_tile(y):
            if tuple(x.shape) != tuple(y.shape):
                raise NkiValidationError(
                    f"nl.{op.name}: shapes {tuple(x.shape)} and {tuple(y.shape)} differ; the nl "
                    f"element-wise ops do not broadcast (use nisa.tensor_scalar)")
            out = _new(x.shape, dtype or x.dtype)
            _isa().tensor_tensor(dst=out, data1=x, data2=y, op=op)
            return out
        tile, scalar, rev = (x, y, False) if _is_tile(x) else (y, x, True)
        if not _is_tile(tile):
            raise TypeError(f"nl.{op.name}: at least one operand must be a tile")
        out = _new(tile.shape, dtype or tile.dtype)
        _isa().tensor_scalar(dst=out, data=tile, op0=op, operand0=scalar, reverse0=rev)
        return out
    if len(args) == 1 and _is_tile(args[0]):
        x = args[0]
        out = _new(x.shape, dtype or x.dtype)
        if op.act is not None:
            _isa().activation(dst=out, op=op, data=x)
            return out
        if op.kind == "unary" and op.alu is not None:
            _isa().tensor_scalar(dst=out, data=x, op0=op, operand0=0.0)
            return out
    raise NotImplementedError(f"nl.{op.name}{tuple(type(a).__name__ for a in args)} is not "
                              f"implemented by the nki-kernels emulator; use the nisa instruction")


def transpose(x, dtype=None):
    nl = _nl()
    p, f = x.shape[0], int(np.prod(x.shape[1:]))
    ps = nl.ndarray((f, p), x.dtype if x.dtype in (nl.float32, nl.bfloat16) else nl.float32,
                    buffer=nl.psum)
    _isa().nc_transpose(dst=ps, data=x.reshape((p, f)) if x.ndim != 2 else x)
    out = _new((f, p), dtype or x.dtype)
    _isa().tensor_copy(dst=out, src=ps)
    return out


def matmul(x, y, transpose_x=False):
    """``x.T @ y`` (``transpose_x=True``: x given as [K, M]) or ``x @ y``, as an fp32 SBUF tile."""
    nl = _nl()
    stationary = x if transpose_x else transpose(x)
    k, m = stationary.shape
    n = y.shape[1]
    ps = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
    _isa().nc_matmul(dst=ps, stationary=stationary, moving=y)
    out = _new((m, n), nl.float32)
    _isa().tensor_copy(dst=out, src=ps)
    return out


def _axes(x, axis):
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(a % x.ndim for a in axes)
    return axes


def _reduce(op, name, x, axis, dtype=None, keepdims=False, scale=None):
    axes = _axes(x, axis)
    if 0 in axes:
        raise NkiValidationError(f"nl.{name}: axis {axis}: reductions run over free dims only "
                                 f"(the partition dim 0 is not reducible here)")
    if keepdims:
        shape = [1 if i in axes else s for i, s in enumerate(x.shape)]
    else:
        shape = [s for i, s in enumerate(x.shape) if i not in axes]
        if len(shape) < 2:          # on-chip tiles stay 2-D: [P, 1]
            shape = [x.shape[0], 1]
    out = _new(shape, dtype or x.dtype)
    _isa().tensor_reduce(dst=out, op=op, data=x, axis=axes if len(axes) > 1 else axes[0])
    if scale is not None:
        _isa().tensor_scalar(dst=out, data=out, op0=_nl().multiply, operand0=scale)
    return out


def sum(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _reduce(_nl().add, "sum", x, axis, dtype, keepdims)


def max(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _reduce(_nl().maximum, "max", x, axis, dtype, keepdims)


def min(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _reduce(_nl().minimum, "min", x, axis, dtype, keepdims)


def prod(x, axis, dtype=None, keepdims=False):
    return _reduce(_nl().multiply, "prod", x, axis, dtype, keepdims)


def mean(x, axis, dtype=None, keepdims=False):
    n = int(np.prod([x.shape[a] for a in _axes(x, axis)]))
    return _reduce(_nl().add, "mean", x, axis, dtype, keepdims, scale=1.0 / n)


def broadcast_to(x, shape, dtype=None):
    """NumPy-rule broadcast of an SBUF/PSUM tile to ``shape`` (same rank) into a new SBUF tile."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != x.ndim:
        raise NkiValidationError(f"nl.broadcast_to: shape {shape} must have the rank of the "
                                 f"input {tuple(x.shape)}")
    for have, want in zip(x.shape, shape):
        if have not in (1, want):
            raise NkiValidationError(f"nl.broadcast_to: cannot broadcast {tuple(x.shape)} to "
                                     f"{shape}")
    out = _new(shape, dtype or x.dtype)
    src = x
    if x.shape[0] != shape[0]:
        if x.shape[0] != 1:
            raise NkiValidationError("nl.broadcast_to: partition dim mismatch")
        # partition broadcast: one copy per partition row (the compiler uses a stream shuffle
        # or a broadcast DMA; the values are the same)
        for p in range(shape[0]):
            _isa().tensor_copy(dst=out[p:p + 1], src=_free_broadcast(src, (1,) + shape[1:]))
        return out
    _isa().tensor_copy(dst=out, src=_free_broadcast(src, shape))
    return out


def _free_broadcast(x, shape):
    """A view of ``x`` with size-1 free dims stretched (stride 0) to ``shape``."""
    if tuple(x.shape) == tuple(shape):
        return x
    strides = tuple(0 if have == 1 and want != 1 else st
                    for have, want, st in zip(x.shape, shape, x.strides))
    return NkiTensor(x.storage, x.dtype, tuple(shape), strides=strides, offset=x.offset,
                     name=x.name)


def expand_dims(x, axis):
    return x.expand_dim(axis)
