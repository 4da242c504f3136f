"""Target queries, registers / runtime scalars, and LNC synchronisation (nki-spec §3.4, §9.10)."""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from .. import runtime as rt
from ..errors import fail
from ..scalars import NkiScalar, VirtualRegister, runtime_value
from ..tensor import NkiTensor
from ._common import emit, nc_version, need_gen


def get_nc_version():
    """``nc_version.gen3`` on Trn2, ``gen4`` on Trn3 (an IntEnum: compares with ints)."""
    return nc_version(rt.current_gen().nc_version)


def get_nc_sub_version():
    return 0


# ------------------------------------------------------------------------------- registers
def register_alloc(x=None):
    return VirtualRegister(x)


def register_move(dst, src):
    if not isinstance(dst, VirtualRegister):
        raise fail("register_move", "dst", "must be a VirtualRegister")
    dst._v = runtime_value(src)
    dst.initialized = True
    return emit("sync", "register_move", [], [], {}, None)


def _one_elem(I, role, t, allow_x4=False):
    if not isinstance(t, NkiTensor):
        raise fail(I, role, f"must be an NkiTensor; got {type(t).__name__}")
    if t.buffer is rt.psum:
        raise fail(I, role, "must be in SBUF or HBM")
    if t.size != 1:
        raise fail(I, role, f"must hold exactly one element; has shape {t.shape}")
    if t.dtype.is_x4 and not allow_x4:
        raise fail(I, role, f"cannot be a packed {t.dtype} tensor")


def register_load(dst, src):
    I = "register_load"
    _one_elem(I, "src", src)
    if not isinstance(dst, VirtualRegister):
        raise fail(I, "dst", "must be a VirtualRegister")
    v = np.asarray(src._read()).reshape(-1)[0]
    dst._v = int(((int(v) + 2**31) % 2**32) - 2**31)
    dst.initialized = True
    return emit("sync", I, [("src", src)], [], {}, None)


def register_store(dst, src):
    I = "register_store"
    _one_elem(I, "dst", dst)
    if not isinstance(src, VirtualRegister):
        raise fail(I, "src", "must be a VirtualRegister")
    dst._write(dt.cast(np.array([[src._v]], dtype=np.int64), dst.dtype).reshape(dst.shape))
    return emit("sync", I, [], [("dst", dst)], {}, None)


def scalar_load(src):
    I = "scalar_load"
    _one_elem(I, "src", src)
    if src.dtype not in (dt.int32, dt.int64):
        raise fail(I, "src", f"must be int32 or int64; got {src.dtype}")
    v = int(np.asarray(src._read()).reshape(-1)[0])
    return NkiScalar(v, 64 if src.dtype is dt.int64 else 32)


def scalar_store(dst, value):
    I = "scalar_store"
    _one_elem(I, "dst", dst)
    if not isinstance(value, NkiScalar):
        raise fail(I, "value", f"must be an NkiScalar (Python ints are not accepted); got {value!r}")
    want = dt.int64 if value._bits == 64 else dt.int32
    if dst.dtype is not want:
        raise fail(I, "dst", f"has dtype {dst.dtype}; a {value._bits}-bit scalar needs {want}")
    dst._write(np.array(value._v, dtype=want.np).reshape(dst.shape))
    return emit("sync", I, [], [("dst", dst)], {}, None)


# ------------------------------------------------------------------------------- LNC sync
def core_barrier(data, cores, engine=None, name=None):
    """Both programs of an LNC=2 launch wait here (pure synchronisation on ``data``)."""
    I = "core_barrier"
    need_gen(I, 3)
    core = rt.current_core()
    if core.launch.lnc != 2:
        raise fail(I, "cores", "core_barrier needs an LNC=2 launch (kernel[2])")
    if tuple(cores) != (0, 1):
        raise fail(I, "cores", f"must be (0, 1); got {cores!r}")
    if not isinstance(data, NkiTensor) or data.buffer is not rt.shared_hbm:
        raise fail(I, "data", "must be the nl.shared_hbm tensor both cores wrote")
    core.launch.barrier(core, data.storage)
    return emit("gpsimd", I, [("data", data)], [], {"barrier": True}, name)


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=None, name=None):
    """Exchange SBUF tiles between the two cores of an LNC=2 launch."""
    I = "sendrecv"
    need_gen(I, 3)
    core = rt.current_core()
    if core.launch.lnc != 2:
        raise fail(I, "send_to_rank", "sendrecv needs an LNC=2 launch (kernel[2])")
    for role, t in (("src", src), ("dst", dst)):
        if not isinstance(t, NkiTensor) or t.buffer is not rt.sbuf:
            raise fail(I, role, "must be an SBUF tensor")
    if src.shape != dst.shape or src.dtype is not dst.dtype:
        raise fail(I, "dst", f"must match src in shape and dtype ({src.shape} {src.dtype} vs "
                             f"{dst.shape} {dst.dtype})")
    other = 1 - core.program_id
    if send_to_rank != other or recv_from_rank != other:
        raise fail(I, "send_to_rank", f"program {core.program_id} can only exchange with rank {other}")
    data = np.array(src._read(), copy=True)
    got = core.launch.exchange(core, ("sendrecv", pipe_id), data)
    dst._write(got)
    return emit("dma", I, [("src", src)], [("dst", dst)], {"peer": other}, name)
