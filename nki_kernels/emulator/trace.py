"""Instruction trace: what each ``nisa`` call did, as the cost model needs it.

Recording is off unless a :func:`trace` context is open, so a plain test run pays nothing for it.
Each record names the engine, the opcode, every operand (memory, allocation, dtype, shape, partition
range, byte extent, contiguous run length, access pattern) and instruction attributes (matmul
K/M/N, perf mode, DMA mode, ...).
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field

from . import runtime as rt


@dataclass(slots=True)
class Operand:
    role: str            # "dst", "src", "stationary", "moving", "data", "bias", ...
    buffer: str          # "sbuf" | "psum" | "private_hbm" | "shared_hbm"
    alloc: int           # allocation id: equal ids are the same physical buffer
    dtype: str
    itemsize: int
    shape: tuple
    partitions: tuple    # on-chip (p_lo, p_hi); HBM: rows (r_lo, r_hi) of the allocation's shape
    extent: tuple        # (lo, hi) byte range within each partition row / HBM row
    contig_bytes: int    # bytes of the innermost contiguous run (DMA descriptor size)
    nbytes: int          # bytes this operand touches (elements * itemsize)
    indirect: bool = False
    pattern: tuple = ()  # ((stride, count), ...) in elements, outermost first
    pinned: bool = False  # on-chip, placed by ``address=``: not counted against SBUF capacity

    @property
    def on_chip(self):
        return self.buffer in ("sbuf", "psum")

    @property
    def runs(self):
        """Number of contiguous runs (descriptors) of ``contig_bytes``."""
        return max(1, self.nbytes // max(1, self.contig_bytes))


@dataclass(slots=True)
class Instruction:
    seq: int
    program: int
    engine: str          # "tensor" | "vector" | "scalar" | "gpsimd" | "sync" | "dma"
    opcode: str
    reads: list
    writes: list
    attrs: dict = field(default_factory=dict)
    name: str | None = None
    src: tuple | None = None   # (file, line, function) of the kernel code that issued it


class Trace:
    """The instructions of one or more kernel launches, in program order per core."""

    def __init__(self):
        self.instructions: list[Instruction] = []
        self.launches: list[dict] = []

    def __len__(self):
        return len(self.instructions)

    def __iter__(self):
        return iter(self.instructions)

    def by_engine(self):
        out = {}
        for ins in self.instructions:
            out.setdefault(ins.engine, []).append(ins)
        return out

    def summary(self):
        counts = {}
        for ins in self.instructions:
            counts[(ins.engine, ins.opcode)] = counts.get((ins.engine, ins.opcode), 0) + 1
        return counts


@contextlib.contextmanager
def trace():
    """Record every instruction executed inside the block: ``with trace() as t: kernel(x)``."""
    t = Trace()
    rt._tracers.append(t)
    try:
        yield t
    finally:
        rt._tracers.remove(t)


def operand(role, t) -> Operand:
    """Describe tensor view ``t`` as an Operand (only called while tracing)."""
    st = t.storage
    isz = t.dtype.itemsize
    shape = t.shape
    strides = t.strides
    indirect = t.is_indirect()
    off = t._base_offset()
    if off is None:
        off = t.offset
    # innermost contiguous run
    run = 1
    expect = 1
    dims = list(zip(shape, strides))
    first_free = 1 if st.buffer.on_chip else 0
    for n, s in reversed(dims[first_free:]):
        if n == 1:
            continue
        if s == expect:
            run *= n
            expect *= n
        else:
            break
    if t._vec is not None:
        run = min(run, max(1, t.size // max(1, shape[0])))
    nbytes = t.size * isz
    sid, addr, p0 = rt.trace_alloc(st)
    if st.buffer.on_chip:
        pe = st.row_bytes // isz if isz else 1
        p_lo = p0 + off // pe if pe else 0
        p_hi = p_lo + (shape[0] if shape else 1)
        f0 = off % pe if pe else 0
        lo = hi = f0
        for n, s in dims[1:]:
            if s >= 0:
                hi += s * (n - 1)
            else:
                lo += s * (n - 1)
        extent = (addr + lo * isz, addr + (hi + 1) * isz)
        parts = (p_lo, p_hi)
    else:
        parts, extent = _hbm_rect(t, st, off, isz, dims)
    return Operand(role, st.buffer.name, sid, t.dtype.name, isz, shape, parts, extent,
                   run * isz, nbytes, indirect, tuple(zip(strides, shape)), st.pinned)


def _hbm_rect(t, st, off, isz, dims):
    """An HBM access as a rectangle of the allocation: (rows, byte range within a row), rows of
    ``st.pitch`` bytes (the last dim of the allocated shape). Column blocks of a row-major matrix
    are then disjoint, as the addresses they touch are; the dependency edges of the cost model
    come from these rectangles (a superset of the bytes touched, never a subset)."""
    pitch = max(1, st.pitch)
    if t._vec is not None:
        return (0, max(1, -(-st.nbytes // pitch))), (0, pitch)      # any row may be touched
    lo, hi = t._bounds(off)
    b_lo, b_hi = lo * isz, (hi + 1) * isz
    r0, c0 = divmod(off * isz, pitch)
    r_lo = r_hi = 0
    c_lo = c_hi = 0
    for n, s in dims:
        if n == 1:
            continue
        d = s * isz * (n - 1)
        if (s * isz) % pitch == 0:
            r_lo, r_hi = r_lo + min(d, 0) // pitch, r_hi + max(d, 0) // pitch
        else:
            c_lo, c_hi = c_lo + min(d, 0), c_hi + max(d, 0)
    if 0 <= c0 + c_lo and c0 + c_hi + isz <= pitch:
        return (r0 + r_lo, r0 + r_hi + 1), (c0 + c_lo, c0 + c_hi + isz)
    return (b_lo // pitch, (b_hi - 1) // pitch + 1), (0, pitch)   # rows spanned, whole rows


_EMULATOR_DIR = os.path.dirname(os.path.abspath(__file__))


def _issuer():
    """(file, line, function) of the innermost frame outside the emulator: the kernel source
    line that issued the instruction (a few frame hops; only paid while tracing)."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_EMULATOR_DIR + os.sep):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno, f.f_code.co_name) if f is not None else None


def record(engine, opcode, reads, writes, attrs=None, name=None):
    """Append an instruction to every open trace. ``reads``/``writes``: [(role, tensor)]."""
    core = rt.maybe_core()
    # an indirect DMA also reads its index tile (the gather waits for the index load)
    extra = [("index", t._vec.source) for _, t in list(reads) + list(writes)
             if t is not None and getattr(t, "_vec", None) is not None]
    ins = Instruction(0, core.program_id if core else 0, engine, opcode,
                      [operand(r, t) for r, t in list(reads) + extra if t is not None],
                      [operand(r, t) for r, t in writes if t is not None], attrs or {}, name,
                      _issuer())
    for tr in rt._tracers:
        ins.seq = len(tr.instructions)
        tr.instructions.append(ins)
    return ins
