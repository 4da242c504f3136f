"""Shared machinery for the ``nki.isa`` instructions: enums, the instruction handle, operand checks.

Every check raises :class:`NkiValidationError` naming the instruction, the operand and the limit.
"""
from __future__ import annotations

import enum
import warnings

import numpy as np

from .. import ops
from .. import runtime as rt
from .. import trace as tr
from ..errors import NkiValidationError, fail
from ..tensor import NkiTensor


# ------------------------------------------------------------------------------------------ enums
class engine(enum.Enum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class reduce_cmd(enum.Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):
    none = "none"
    double_row = "double_row"


class nc_version(enum.IntEnum):
    gen2 = 2
    gen3 = 3
    gen4 = 4


class dma_engine(enum.Enum):
    dma = 1
    gpsimd_dma = 2


tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown


class NkiHardwareWarning(UserWarning):
    """Something legal in the emulator that the hardware may handle differently (nki-spec §11)."""


def as_enum(cls, value, instr, param):
    """Accept enum members (and for some params the member's name as a string); reject ints."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value in cls.__members__:
        return cls[value]
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        from .. import versions
        if versions.status("integer enum values") == "removed":
            raise fail(instr, param, f"got the integer {value}; integer enum values are rejected "
                                     f"(removed in NKI 0.7; the emulator follows NKI "
                                     f"{versions.current()}): pass nisa.{cls.__name__}.<member>")
        try:
            member = cls(int(value))
        except ValueError:
            raise fail(instr, param, f"got the integer {value}, which is no nisa.{cls.__name__} "
                                     f"value ({', '.join(f'{m.name}={m.value}' for m in cls)})") \
                from None
        versions.check("integer enum values", f"{instr}: operand {param!r}")
        return member
    raise fail(instr, param, f"must be a nisa.{cls.__name__} member "
                             f"({', '.join(cls.__members__)}); got {value!r}")


# ------------------------------------------------------------------------------------------ handle
class NkiInstruction:
    """What every ``nisa`` call returns; ``depends_on`` is accepted (execution is sequential)."""

    __slots__ = ("opcode", "name", "record")

    def __init__(self, opcode, name=None, record=None):
        self.opcode, self.name, self.record = opcode, name, record

    def depends_on(self, *producers):
        for p in producers:
            if not isinstance(p, NkiInstruction):
                raise TypeError(f"depends_on takes instruction handles; got {type(p).__name__}")
        return self

    def __repr__(self):
        return f"NkiInstruction({self.opcode}{', ' + self.name if self.name else ''})"


def emit(engine_name, opcode, reads, writes, attrs=None, name=None):
    """Record the instruction in open traces and return its handle."""
    for role, t in (*reads, *writes):
        if isinstance(t, NkiTensor) and 0 in t.shape:
            tensor(opcode, role, t)  # raises: an empty operand
    rec = tr.record(engine_name, opcode, reads, writes, attrs, name) if rt._tracers else None
    core = rt.maybe_core()
    if core is not None and core.launch.lnc > 1:
        shared = [[(r, t) for r, t in ops if isinstance(t, NkiTensor) and t.buffer is rt.shared_hbm]
                  for ops in (reads, writes)]
        if shared[0] or shared[1]:
            if not (attrs or {}).get("barrier"):
                core.launch.shared_access(core, opcode, *shared,
                                          collective=bool((attrs or {}).get("collective")))
            core.launch.step(core)
    return NkiInstruction(opcode, name, rec)


# ------------------------------------------------------------------------------------------ checks
def gen():
    return rt.current_core().gen


def need_gen(instr, min_version, what=None):
    g = gen()
    if g.nc_version < min_version:
        names = {3: "Trn2 (gen3)", 4: "Trn3 (gen4)"}
        raise NkiValidationError(f"{instr}: {what or 'this instruction'} needs {names[min_version]} "
                                 f"or newer; the target is {g.name} (gen{g.nc_version})")


def tensor(instr, role, t):
    if not isinstance(t, NkiTensor):
        raise fail(instr, role, f"must be an NkiTensor; got {type(t).__name__}")
    if 0 in t.shape:
        # an empty view (t[0:0], nl.ds(i, 0)) may be made, e.g. for a core with no work, but the
        # documentation gives no instruction a zero-size access pattern: refused until it does
        raise fail(instr, role, f"is an empty view (shape {tuple(t.shape)}); an instruction needs "
                                f"at least one element per operand")
    return t


def on_chip(instr, role, t, psum=True, sbuf=True):
    """An SBUF/PSUM compute operand: partition limit, contiguous partitions, row containment."""
    tensor(instr, role, t)
    b = t.buffer
    if not b.on_chip:
        raise fail(instr, role, f"is in {b.name}; compute instructions read and write only "
                                f"SBUF{' or PSUM' if psum else ''}")
    if b is rt.psum and not psum:
        raise fail(instr, role, "is in PSUM, which this engine/operand cannot access")
    if b is rt.sbuf and not sbuf:
        raise fail(instr, role, "must be in PSUM")
    if t._vec is not None:
        raise fail(instr, role, "is a vector-offset (DMA gather/scatter) view; only DMA takes those")
    P = t.shape[0]
    pmax = gen().pmax
    if P > pmax:
        raise fail(instr, role, f"has partition dimension {P}, exceeding the maximum {pmax}")
    if t.ndim >= 1 and P > 1 and t.strides[0] != t.part_elems:
        raise fail(instr, role, f"must address contiguous partitions (partition stride "
                                f"{t.strides[0]} != per-partition size {t.part_elems})")
    off = t._base_offset()
    if off is not None and t.part_elems:
        f0 = off % t.part_elems
        lo = hi = f0
        for n, s in zip(t.shape[1:], t.strides[1:]):
            if s >= 0:
                hi += s * (n - 1)
            else:
                lo += s * (n - 1)
        if lo < 0 or hi >= t.part_elems:
            raise fail(instr, role, f"free-dim access [{lo}, {hi}] leaves its partition row of "
                                    f"{t.part_elems} elements (shape {t.shape}, strides {t.strides})")
        p_lo = t.storage.p0 + off // t.part_elems
        if p_lo + P > pmax:
            raise fail(instr, role, f"spans partitions [{p_lo}, {p_lo + P}), past {pmax}")
    nfree = _merged_free_dims(t)
    if nfree > 4:
        raise fail(instr, role, f"needs {nfree} free-dim access-pattern entries after merging "
                                f"contiguous dims; the hardware supports at most 4")
    for n in t.shape[1:]:
        if n > 65535:
            raise fail(instr, role, f"has a free dim of {n}; access-pattern counts are 16-bit "
                                    f"(<= 65535)")
    return t


def _merged_free_dims(t):
    dims = [(n, s) for n, s in zip(t.shape[1:], t.strides[1:]) if n != 1]
    if not dims:
        return 1
    k = 1
    for (_, s1), (n2, s2) in zip(dims, dims[1:]):
        if s1 != n2 * s2:
            k += 1
    return k


def start_partition(t):
    off = t._base_offset() or 0
    return t.storage.p0 + (off // t.part_elems if t.part_elems else 0)


def quadrant_rule(instr, role, t):
    """nki-spec §8.1 item 10: <=32 partitions start at 0/32/64/96, <=64 at 0/64, >64 at 0.
    Documented for NC-v2 and normally enforced by the allocator: we warn, not fail."""
    P = t.shape[0]
    p0 = start_partition(t)
    ok = (p0 % 32 == 0) if P <= 32 else (p0 % 64 == 0) if P <= 64 else p0 == 0
    if not ok:
        warnings.warn(f"{instr}: operand '{role}' starts at partition {p0} with {P} partitions; "
                      f"engines expect starts at 0/32/64/96 (<=32), 0/64 (<=64) or 0 (>64)",
                      NkiHardwareWarning, stacklevel=4)


def same_shape_pf(instr, items):
    """Equal partition count and equal elements per partition (nki-spec §8.1 item 4)."""
    (r0, t0) = items[0]
    for r, t in items[1:]:
        if t.shape[0] != t0.shape[0]:
            raise fail(instr, r, f"has {t.shape[0]} partitions but '{r0}' has {t0.shape[0]}; they "
                                 f"must match")
        if t.free_size != t0.free_size:
            raise fail(instr, r, f"has {t.free_size} elements per partition (shape {t.shape}) but "
                                 f"'{r0}' has {t0.free_size} (shape {t0.shape}); they must match")


def not_both_psum(instr, a_role, a, b_role, b):
    if isinstance(a, NkiTensor) and isinstance(b, NkiTensor) and a.buffer is rt.psum \
            and b.buffer is rt.psum:
        raise fail(instr, f"{a_role}', '{b_role}", "are both in PSUM; at most one input may be")


def scalar_or_vector(instr, role, v, P, allow_none=False):
    """A per-partition operand: Python number or an on-chip (P, 1) tensor. Returns f32 [P,1]|float."""
    if v is None:
        if allow_none:
            return None
        raise fail(instr, role, "is required")
    if isinstance(v, NkiTensor):
        on_chip(instr, role, v)
        if v.shape[0] != P or v.free_size != 1:
            raise fail(instr, role, f"must be a ({P}, 1) per-partition tensor; got shape {v.shape}")
        return v.read_f32().reshape(P, 1)
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise fail(instr, role, f"must be a Python number or a ({P}, 1) tensor; got {type(v).__name__}")
    return np.float32(v)


def alu_op(instr, role, op, allow_none=False, kinds=("arith", "cmp", "unary", "bitvec")):
    if op is None and allow_none:
        return None
    if not isinstance(op, ops.Op) or op.kind is None or op.kind not in kinds:
        raise fail(instr, role, f"must be an ALU operator such as nl.add or nl.multiply; got {op!r}")
    if op.gen > gen().nc_version:
        need_gen(instr, op.gen, f"{op!r} as an ALU operator")
    if op in ops.SIM_ONLY:
        warnings.warn(f"{instr}: {op!r} has no hardware instruction (simulator-only in NKI); "
                      f"use nisa.reciprocal + multiply", NkiHardwareWarning, stacklevel=4)
    return op


def apply_alu(op, a, b):
    """Apply an ALU op in fp32 (bitvec ops work on the raw integer values)."""
    return op.alu(a, b)


def reduce_rows(op, x):
    """Reduce a [P, F] f32 array along F with ALU op ``op``."""
    if op is ops.add:
        return x.sum(axis=1, dtype=np.float32)
    if op is ops.maximum:
        return x.max(axis=1)
    if op is ops.minimum:
        return x.min(axis=1)
    if op is ops.multiply:
        return x.prod(axis=1, dtype=np.float32)
    acc = x[:, 0]
    for j in range(1, x.shape[1]):
        acc = op.alu(acc, x[:, j])
    return acc


def engine_name(e):
    return {engine.tensor: "tensor", engine.vector: "vector", engine.scalar: "scalar",
            engine.gpsimd: "gpsimd", engine.sync: "sync", engine.dma: "dma",
            engine.unknown: "vector"}[e]


def psum_write_clear(t):
    """A non-matmul write into PSUM: those bytes are no longer 'matmul-written'."""
    if t.buffer is rt.psum and t.storage.mm_written is not None:
        mask_view(t)[...] = False


def mask_view(t):
    """The PSUM matmul-written flags of view ``t`` (one flag at each element's first byte)."""
    from numpy.lib.stride_tricks import as_strided
    off = t._base_offset()
    isz = t.dtype.itemsize
    m = t.storage.mm_written
    return as_strided(m[off * isz:], shape=t.shape, strides=[s * isz for s in t.strides],
                      writeable=True)


# ---------------------------------------------------------------------------------------- registers
RC = reduce_cmd
REDUCE_IDENTITY = {ops.add: 0.0, ops.subtract: 0.0, ops.multiply: 1.0, ops.maximum: -np.inf,
                   ops.minimum: np.inf, ops.abs_max: 0.0, ops.abs_min: np.inf}


def combine_acc(op, acc, part):
    with np.errstate(all="ignore"):
        return np.asarray(op.alu(acc.astype(np.float32), part.astype(np.float32)), dtype=np.float32)


def dve_register(I, cmd, op, part, P, init=None):
    """Apply ``reduce_cmd`` to the VectorE register with this instruction's row reduction ``part``.
    Returns the value a ``reduce_res`` read-out receives."""
    core = rt.current_core()
    acc = core.dve_acc[:P]
    if cmd is RC.idle:
        # nki-spec §9.3/§11.2: even idle may clobber the VectorE accumulators; poison them so that
        # a later reduce_cmd=reduce that relies on them shows NaN (and warns). A reduce_res read-out
        # with idle gets this instruction's own reduction (spec silent; the pre-register behaviour).
        acc[...] = np.nan
        core.dve_acc_valid = False
        return part
    if cmd is RC.reduce and not core.dve_acc_valid:
        warnings.warn(f"{I}: reduce_cmd=reduce continues a VectorE accumulator that no "
                      f"reset_reduce/load_reduce initialised (or an idle VectorE instruction may "
                      f"have clobbered it); start each chain with reset_reduce",
                      NkiHardwareWarning, stacklevel=3)
    if cmd in (RC.reset, RC.reset_reduce):
        acc[...] = REDUCE_IDENTITY[op] if op is not None else 0.0
    elif cmd is RC.load_reduce:
        acc[...] = np.broadcast_to(np.asarray(init, dtype=np.float32).reshape(-1), (P,))
    if cmd is not RC.reset:
        acc[...] = combine_acc(op, acc, part)
    core.dve_acc_valid = True
    return acc.copy()
