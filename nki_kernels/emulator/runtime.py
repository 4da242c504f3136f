"""Execution state of the emulator: target generation, per-core state, storage and allocators.

One ``Launch`` is one call of a jitted kernel; it owns one ``Core`` per LNC program (SBUF/PSUM
allocators, ScalarE/VectorE accumulator registers) and the HBM storage the programs share.
The current core is thread-local, because LNC=2 runs each program in its own thread.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import warnings
import weakref

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .. import hardware
from . import dtypes as dt
from .errors import NkiValidationError

_tls = threading.local()
_target_override: list[str] = []


# ----------------------------------------------------------------------------- target selection
def current_target_name() -> str:
    """Target of the running kernel, else an explicit override, else the env var, else trn3."""
    core = getattr(_tls, "core", None)
    if core is not None:
        return core.gen.name
    if _target_override:
        return _target_override[-1]
    env = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    if env:
        return hardware.generation(env).name
    return hardware.DEFAULT_TARGET


def current_gen() -> hardware.Generation:
    return hardware.generation(current_target_name())


@contextlib.contextmanager
def target(name: str):
    """Run everything inside the block for ``name`` (``"trn2"``, ``"trn3"``)."""
    _target_override.append(hardware.generation(name).name)
    try:
        yield
    finally:
        _target_override.pop()


# ----------------------------------------------------------------------------- buffers
class MemoryRegion:
    """``nl.sbuf``, ``nl.psum``, ``nl.private_hbm`` (= ``nl.hbm``), ``nl.shared_hbm``."""

    def __init__(self, name: str, on_chip: bool):
        self.name = name
        self.on_chip = on_chip

    def __repr__(self):
        return f"nl.{self.name}"

    @property
    def is_hbm(self):
        return not self.on_chip


sbuf = MemoryRegion("sbuf", True)
psum = MemoryRegion("psum", True)
private_hbm = MemoryRegion("private_hbm", False)
hbm = private_hbm
shared_hbm = MemoryRegion("shared_hbm", False)


def as_buffer(buffer, where: str) -> MemoryRegion:
    if isinstance(buffer, MemoryRegion):
        return buffer
    raise TypeError(f"{where}: buffer must be nl.sbuf, nl.psum, nl.hbm, nl.private_hbm or "
                    f"nl.shared_hbm; got {buffer!r} (strings are rejected since NKI 0.3.0)")


# ----------------------------------------------------------------------------- storage
_alloc_ids = itertools.count(1)
_uses = itertools.count(1)    # a clock of tensor accesses: Storage.last_use

# Compiled (hardware) loops: ``nl.fori_loop``, ``nl.while_loop``, ``nl.dynamic_range``. The
# compiler generates a single copy of the body and the hardware iterates over it (NKI docs,
# "NKI Dynamic Loops"; the body is traced once, nki-spec 3.3), so each tensor allocated in the
# body is one buffer for every iteration. The emulator runs the body once per iteration and
# gives each iteration fresh storage (the numbers are the same); the trace names the k-th
# allocation of every iteration by the first iteration's k-th (``trace_alloc``), so the cost
# model orders an iteration's writes after the previous iterations' accesses of that buffer
# and counts its SBUF space once, as on the device.
_loop_bodies = []                 # innermost last
_loop_ids = itertools.count()
_loop_alias = {}                  # (body key, k) -> (alloc id, addr, p0, nbytes, buffer)


class _LoopBody:
    __slots__ = ("key", "seq")

    def __init__(self, key):
        self.key = key
        self.seq = 0


@contextlib.contextmanager
def loop_body():
    """Run a compiled loop's iterations inside this; call ``next_iteration`` before each."""
    parent = _loop_bodies[-1] if _loop_bodies else None
    if parent is None:
        key = ("loop", next(_loop_ids))
    else:                          # a nested loop: the same one in every outer iteration
        key = (parent.key, parent.seq)
        parent.seq += 1
    body = _LoopBody(key)
    _loop_bodies.append(body)
    try:
        yield body
    finally:
        _loop_bodies.remove(body)


def next_iteration(body):
    body.seq = 0


def trace_alloc(st):
    """(alloc id, addr, p0) the trace gives storage ``st``: its own, or for an allocation in a
    compiled loop's body, the first iteration's allocation of the same place in the body."""
    key = st.loop_key
    if key is None:
        return st.id, st.addr, st.p0
    a = _loop_alias.setdefault(key, (st.id, st.addr, st.p0, st.nbytes, st.buffer))
    if a[3] != st.nbytes or a[4] is not st.buffer:     # not the same allocation after all
        return st.id, st.addr, st.p0
    return a[0], a[1], a[2]


class Storage:
    """One allocation: raw bytes plus where it lives.

    On-chip storage is ``partitions`` rows of ``row_bytes`` bytes; HBM storage is linear.
    ``mm_written`` (PSUM only) marks bytes last written by a matmul, for ``accumulate=None``.
    """

    __slots__ = ("id", "buffer", "raw", "nbytes", "partitions", "row_bytes", "name", "core",
                 "p0", "addr", "mm_written", "dtype", "site", "retired", "pitch", "pending",
                 "last_use", "pinned", "loop_key", "__weakref__")

    def __init__(self, buffer, nbytes, dtype, name="", partitions=1, row_bytes=None, core=None):
        self.id = next(_alloc_ids)
        self.buffer = buffer
        self.nbytes = int(nbytes)
        self.raw = np.empty(self.nbytes, dtype=np.uint8)
        self.partitions = partitions
        self.row_bytes = row_bytes if row_bytes is not None else self.nbytes
        self.name = name
        self.core = core
        self.p0 = 0            # start partition (address=) for on-chip
        self.addr = 0          # byte offset within a partition (on-chip) after placement
        self.mm_written = None
        self.dtype = dtype
        self.site = None       # allocating statement (kernel call stack), on-chip only
        self.retired = None    # why its space went to a later allocation (the error if used)
        self.last_use = 0      # _uses tick of the latest access (0: never used)
        self.pitch = self.nbytes  # HBM: bytes of one row (last dim) of the allocated shape
        self.pending = None    # SBUF: the allocator that places it at its first use
        self.pinned = False    # on-chip, placed by ``address=`` (the kernel owns the placement)
        self.loop_key = None   # (compiled loop body, k): its k-th allocation (``trace_alloc``)
        if _loop_bodies:
            b = _loop_bodies[-1]
            self.loop_key = (b.key, b.seq)
            b.seq += 1

    def __repr__(self):
        return f"<{self.buffer.name} alloc #{self.id} {self.name!r} {self.nbytes} B>"


class OnChipAllocator:
    """Capacity accounting for SBUF or PSUM of one core.

    SBUF: per-partition byte usage of live allocations must stay within the usable bytes per
    partition (allocations start at partition 0 unless ``address=`` says otherwise; fragmentation
    is not modelled). PSUM: first-fit into 2 KiB banks; a tile of <= 2 KiB is never split across
    banks, larger tiles take whole consecutive banks; 16 KiB per partition in all.
    Allocations are released when the Python object dies (an allocation inside a loop body is
    freed when it goes out of use), which is what lets the compiler rotate buffers.

    The compiler frees a tile after its last use, which an eager emulator cannot know. When an
    allocation does not fit, the emulator first retires the earlier tiles of the same statement
    (loop rotation), then the tiles unused for longest (least recently used first; tiles never
    used yet are kept), until it fits. A retired tile that is used again raises: at that point
    the tiles in use truly exceeded the capacity, unless the compiler would have picked other
    victims (the emulator takes the least recently used: it may refuse, never wrongly accept).
    Placement is unchanged for any kernel whose live tiles fit, so the cost model's PSUM banks
    are too.

    SBUF space is taken by liveness, as the compiler's allocator does: a tensor occupies space from
    its first use (the first instruction that reads or writes it), so a buffer that is allocated
    but never used takes none, and one allocated before an earlier buffer's last use does not
    overlap it unless both are used while live. (``address=`` tensors are placed where they say.)
    """

    def __init__(self, region: MemoryRegion, gen: hardware.Generation):
        self.region = region
        self.gen = gen
        if region is sbuf:
            self.capacity = gen.sbuf_usable_bytes
            self.usage = np.zeros(gen.pmax, dtype=np.int64)
            self.peak = 0
        else:
            self.capacity = gen.psum_bytes_per_partition
            self.bank_fill = [[] for _ in range(gen.psum_num_banks)]  # list of (lo, hi, id) per bank
            self.peak = 0
        self.live = {}
        self.sites = {}   # id -> (allocating statement, weakref to Storage)

    def allocate(self, st: Storage, address):
        st.site = _call_site()
        st.pinned = address is not None
        if self.region is sbuf and address is None:
            st.pending = self          # placed at its first use (place())
        elif self.region is sbuf:
            self._alloc_sbuf(st, address)
        else:
            self._alloc_psum(st, address)
        self.sites[st.id] = (st.site, weakref.ref(st))
        weakref.finalize(st, self.release, st.id)

    def place(self, st: Storage):
        """Take the space of an SBUF tensor at its first use (liveness-based allocation)."""
        st.pending = None
        self._alloc_sbuf(st, None)

    def _retire_site(self, site, keep=None, used=True):
        """Out of space while the statement that allocates ``site`` runs again (a later loop
        iteration, its previous tile still bound to the loop's variable): the compiler gives each
        iteration the same buffer, so retire the earlier tiles; using one later is an error.
        ``used``: only tiles already used (a previous iteration's buffer); tiles not used yet are
        retired only when nothing else frees room (a list of tiles being prepared is live)."""
        old = [(sid, ref()) for sid, (s, ref) in self.sites.items() if s == site]
        old = [(sid, st) for sid, st in old if st is not None and st is not keep
               and sid in self.live and bool(st.last_use) == used]
        for sid, st in old:
            st.retired = (f"the statement that allocated it{_where(site)} ran again (a later "
                          f"loop iteration) while it was live, and both did not fit "
                          f"({self.region.name} capacity exceeded); keep fewer tiles live or "
                          f"allocate it once outside the loop")
            self.release(sid)
        return bool(old)

    def _make_room(self, st, first, detail):
        """Out of space for ``st``: retire tiles in the order the class docstring gives (the
        statement's previous iterations on the ``first`` attempt only, then the least recently
        used tile, then the statement's unused tiles). True when something was retired."""
        if first and self._retire_site(st.site, keep=st):
            return True
        return self._retire_lru(st, detail) or self._retire_site(st.site, keep=st, used=False)

    def _pinned(self, sid):
        """Placed by ``address=`` (the kernel owns the placement): never retired."""
        rec = self.live[sid]
        return rec is None if self.region is psum else rec[2] == 0

    def _retire_lru(self, st, detail):
        """Out of space for ``st``: retire the live tile unused for longest (taken for dead, as
        the compiler frees a tile after its last use). False when no used tile is left."""
        best = None
        for sid, (_, ref) in self.sites.items():
            o = ref()
            if o is None or o is st or sid not in self.live or not o.last_use or \
                    o.pending is not None or self._pinned(sid):
                continue
            if best is None or o.last_use < best.last_use:
                best = o
        if best is None:
            return False
        best.retired = (f"its space went to {st.name or 'a later tile'!r}"
                        f"{_allocated_at(st.site)}, which did not fit beside the live "
                        f"{self.region.name} tiles ({detail}); unused since, it "
                        f"was taken for dead (the compiler frees a tile after its last use). Keep "
                        f"fewer tiles live at once")
        self.release(best.id)
        return True

    def _alloc_sbuf(self, st, address, retry=True):
        p0 = 0
        if address is not None:
            p0, st.addr = int(address[0]), int(address[1])
            if st.addr + st.row_bytes > self.capacity:
                raise NkiValidationError(
                    f"nl.ndarray: SBUF tensor {st.name!r} at address={address} with {st.row_bytes} "
                    f"bytes per partition ends past the usable {self.capacity} bytes per partition "
                    f"on {self.gen.name}")
        st.p0 = p0
        hi = p0 + st.partitions
        if hi > self.gen.pmax:
            raise NkiValidationError(f"nl.ndarray: SBUF tensor {st.name!r} spans partitions "
                                     f"[{p0}, {hi}), past the {self.gen.pmax} partitions")
        if address is None:
            new = self.usage[p0:hi] + st.row_bytes
            if new.max(initial=0) > self.capacity:
                if self._make_room(st, retry, f"{int(new.max())} bytes per partition needed, "
                                              f"the limit is {self.capacity} usable bytes per "
                                              f"partition on {self.gen.name}"):
                    return self._alloc_sbuf(st, address, retry=False)
                raise NkiValidationError(
                    f"nl.ndarray: SBUF capacity exceeded on {self.gen.name}: allocating "
                    f"{st.name or 'a tensor'} of {st.row_bytes} bytes per partition needs "
                    f"{int(new.max())} bytes per partition with the live allocations; the limit is "
                    f"{self.capacity} usable bytes per partition "
                    f"({len(self.live)} live SBUF tensors)")
            self.usage[p0:hi] = new
            self.peak = max(self.peak, int(new.max(initial=0)))
            self.live[st.id] = (p0, hi, st.row_bytes)
        else:
            self.live[st.id] = (p0, hi, 0)  # pinned: the kernel owns the placement

    def _alloc_psum(self, st, address, retry=True):
        bank = self.gen.psum_bank_bytes
        nb = self.gen.psum_num_banks
        size = st.row_bytes
        if address is not None:
            p0, off = int(address[0]), int(address[1])
            if off % bank:
                raise NkiValidationError(f"nl.ndarray: PSUM address free offset {off} must be a "
                                         f"multiple of the {bank}-byte bank size")
            st.p0, st.addr = p0, off
            if off + size > self.capacity:
                raise NkiValidationError(f"nl.ndarray: PSUM tensor {st.name!r} ends at byte "
                                         f"{off + size}, past the {self.capacity} bytes per partition")
            self.live[st.id] = None
            return
        if size > bank:
            need = -(-size // bank)
            for b0 in range(nb - need + 1):
                if all(not self.bank_fill[b] for b in range(b0, b0 + need)):
                    for b in range(b0, b0 + need):
                        self.bank_fill[b].append((0, bank, st.id))
                    st.addr = b0 * bank
                    self.live[st.id] = [(b, 0, bank) for b in range(b0, b0 + need)]
                    self._peak()
                    return
        else:
            for b in range(nb):
                lo = 0
                for (a, z, _) in sorted(self.bank_fill[b]):
                    if a - lo >= size:
                        break
                    lo = max(lo, z)
                if lo + size <= bank:
                    self.bank_fill[b].append((lo, lo + size, st.id))
                    st.addr = b * bank + lo
                    self.live[st.id] = [(b, lo, lo + size)]
                    self._peak()
                    return
        used = sum(z - a for fill in self.bank_fill for (a, z, _) in fill)
        if self._make_room(st, retry, f"{size} bytes per partition needed, {used} of "
                                      f"{self.capacity} live in {len(self.live)} tiles on "
                                      f"{self.gen.name}"):
            return self._alloc_psum(st, address, retry=False)
        raise NkiValidationError(
            f"nl.ndarray: PSUM capacity exceeded on {self.gen.name}: no room for {st.name or 'a tile'} "
            f"of {size} bytes per partition ({used} of {self.capacity} bytes per partition live in "
            f"{len(self.live)} tiles; a tile of <= {bank} bytes must fit inside one of the "
            f"{nb} banks)")

    def _peak(self):
        used = sum(z - a for fill in self.bank_fill for (a, z, _) in fill)
        self.peak = max(self.peak, used)

    def release(self, sid):
        self.sites.pop(sid, None)
        rec = self.live.pop(sid, None)
        if rec is None:
            return
        if self.region is sbuf:
            p0, hi, nbytes = rec
            self.usage[p0:hi] -= nbytes
        else:
            for (b, _, _) in rec:
                self.bank_fill[b] = [t for t in self.bank_fill[b] if t[2] != sid]


_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def _where(site):
    """``site``'s innermost kernel line as text, e.g. ' at kernel.py:42'; '' when unknown."""
    if not site:
        return ""
    code, lasti = site[0]
    for start, end, line in code.co_lines():
        if start <= lasti < end and line is not None:
            return f" at {os.path.basename(code.co_filename)}:{line}"
    return ""


def _allocated_at(site):
    """' allocated at kernel.py:42' for a tile allocated at ``site``; '' when unknown."""
    w = _where(site)
    return " allocated" + w if w else ""


def _call_site():
    """The allocating call: (code, bytecode offset) of every kernel-side frame on the stack."""
    site = []
    f = sys._getframe(2)
    while f is not None:
        if not f.f_code.co_filename.startswith(_PKG_DIR):
            site.append((f.f_code, f.f_lasti))
        f = f.f_back
    return tuple(site)


class Core:
    """State of one NeuronCore running one program of a launch."""

    def __init__(self, launch, program_id: int):
        self.launch = launch
        self.gen = launch.gen
        self.program_id = program_id
        self.sbuf = OnChipAllocator(sbuf, self.gen)
        self.psum = OnChipAllocator(psum, self.gen)
        # Engine accumulator registers (nki-spec §9.3): one fp32 value per partition lane.
        self.act_acc = np.zeros(self.gen.pmax, dtype=np.float32)
        self.dve_acc = np.zeros(self.gen.pmax, dtype=np.float32)
        self.dve_acc_valid = False
        self.identity_cache = {}
        self.barrier_count = 0
        self.collective_seq = 0          # nki.collectives issued by this program so far


class Launch:
    """One kernel call: its generation, LNC degree, and the programs' cores.

    LNC=2 programs run in two threads that pass a baton, so exactly one runs at a time and the
    run is deterministic: a program hands over at ``core_barrier``/``sendrecv`` or when it ends.
    """

    def __init__(self, gen: hardware.Generation, lnc: int, kernel_name: str, grid: bool = False,
                 options=None):
        self.gen = gen
        self.lnc = lnc
        self.grid = grid
        self.kernel_name = kernel_name
        self.options = dict(options or {})   # the kernel's nki.jit options (configs)
        self.cores = [Core(self, i) for i in range(lnc)]
        self.cv = threading.Condition()
        self.turn = 0
        self.done = [False] * lnc
        self.arrived = [0] * lnc
        self.mailbox = {}
        self.shared = []         # shared_hbm allocations, matched across programs by order
        self.world, self.rank = None, 0   # nki.collectives: the run_ranks world and this rank
        self.io_storages = set()          # storage ids of the kernel's array arguments
        self.shared_idx = [0] * lnc
        self.race_tags = {}      # shared storage id -> [program, byte] epoch + 1 of last write
        self.race_sync = {}      # shared storage id -> core_barriers on it passed, per program
        self.race_seen = set()   # shared storage ids already warned about
        self.race_global = [0] * lnc     # collectives passed, per program (a barrier on all)

    # ---- scheduling
    def _wait_turn(self, i):
        while self.turn != i:
            self.cv.wait()

    def run(self, i, fn):
        with self.cv:
            self._wait_turn(i)
        try:
            with running(self.cores[i]):
                return fn()
        finally:
            with self.cv:
                self.done[i] = True
                if self.lnc > 1 and not self.done[1 - i]:
                    self.turn = 1 - i
                self.cv.notify_all()

    def step(self, core):
        """LNC=2: after an instruction that touched shared HBM, let the other program run up to
        its next such instruction. The two cores run the same code at the same time, so their
        shared-HBM traffic interleaves; running program 0 to its end first would let program 1's
        writes land after program 0's later ones (a zero-fill of a shared output erasing the
        other core's stores)."""
        if self.lnc < 2:
            return
        i = core.program_id
        o = 1 - i
        with self.cv:
            if self.done[o] or self.turn != i:
                return
            self.turn = o
            self.cv.notify_all()
            while self.turn != i and not self.done[o]:
                self.cv.wait()
            self.turn = i

    def _rendezvous(self, core, ready):
        """Hand the baton to the other program until ``ready()``; fail if it ended first."""
        i = core.program_id
        o = 1 - i
        with self.cv:
            while not ready():
                if self.done[o]:
                    raise NkiValidationError(
                        f"{self.kernel_name}: program {i} waits at a core_barrier/sendrecv that "
                        f"program {o} never reached (divergent control flow deadlocks the device)")
                self.turn = o
                self.cv.notify_all()
                while self.turn != i and not self.done[o]:
                    self.cv.wait()
                self.turn = i

    def barrier(self, core, storage=None):
        i = core.program_id
        self.arrived[i] += 1
        k = self.arrived[i]
        self._rendezvous(core, lambda: self.arrived[1 - i] >= k)
        if storage is not None:
            self.race_sync.setdefault(storage.id, [0] * self.lnc)[i] += 1

    # ---- cross-core races on shared HBM
    def shared_access(self, core, opcode, reads, writes, collective=False):
        """LNC=2: one instruction's shared-HBM reads against the other program's writes. The
        two cores run concurrently and only a ``core_barrier`` on a tensor orders their accesses
        to it (nki-spec 9.10: ``data`` is the tensor both cores wrote; only what depends on it
        waits): reading bytes the other core wrote since the last barrier on that tensor is a
        race, undefined on hardware. The emulator runs the programs in an order of its own and
        reads a value anyway; it warns (NkiHardwareWarning) once per tensor. Granularity: bytes.
        Per byte and program: the epoch (barriers on the tensor passed) of its last write.
        Not a race: bytes the reader itself wrote since its last barrier on the tensor (a kernel
        that does not shard its output writes it from both cores, the same values). Not
        checked: two cores writing the same bytes, a write over bytes the other core reads.
        ``collective``: a collective (nki.collectives), which every rank reaches before any goes
        on: a barrier on every tensor."""
        i = core.program_id
        if collective:
            self.race_global[i] += 1
        for role, t, write in [(r, t, False) for r, t in reads] + [(r, t, True) for r, t in writes]:
            st = t.storage
            tags = self.race_tags.get(st.id)
            if tags is None and not write:
                continue
            if tags is None:
                tags = self.race_tags[st.id] = np.zeros((self.lnc, st.nbytes), np.uint16)
            sync = [n + g for n, g in zip(self.race_sync.get(st.id, [0] * self.lnc),
                                          self.race_global)]
            v, idx = _byte_tags(tags, t)
            if v is None:
                continue
            if write:
                if idx is None:
                    v[i] = sync[i] + 1
                else:
                    tags[i, idx] = sync[i] + 1
                continue
            o = 1 - i
            bad = ((v[o] > sync[i]) & (v[i] != sync[i] + 1)).any(axis=-1)     # per element
            if bad.any() and st.id not in self.race_seen:
                self.race_seen.add(st.id)
                from .isa._common import NkiHardwareWarning
                warnings.warn(
                    f"{opcode}: operand {role!r}: program {i} reads {int(bad.sum())} element(s) "
                    f"of {t.name!r} (shared_hbm) that program {1 - i} wrote with no core_barrier "
                    f"on {t.name!r} in between: the two cores race (undefined on hardware; the "
                    f"emulator's order of the programs decides the value)", NkiHardwareWarning,
                    stacklevel=4)

    def exchange(self, core, key, data):
        i = core.program_id
        n = self.arrived[i] = self.arrived[i] + 1
        self.mailbox[(key, i, n)] = data
        self._rendezvous(core, lambda: (key, 1 - i, n) in self.mailbox)
        return self.mailbox[(key, 1 - i, n)]

    def shared_storage(self, core, shape, dtype, name):
        """The k-th shared_hbm allocation of each program is the same tensor (same code, LNC=2)."""
        k = self.shared_idx[core.program_id]
        self.shared_idx[core.program_id] += 1
        if k < len(self.shared):
            st, shp, dty = self.shared[k]
            if shp != tuple(shape) or dty is not dtype:
                raise NkiValidationError(
                    f"nl.ndarray: shared_hbm allocation #{k} is {shp} {dty} in one program and "
                    f"{tuple(shape)} {dtype} in the other; both programs must allocate the same "
                    f"shared tensors")
            return st
        st = new_storage(shared_hbm, shape, dtype, name=name)
        self.shared.append((st, tuple(shape), dtype))
        return st


def _byte_tags(tags, t):
    """The per-byte tag rows ``tags`` [programs, nbytes] at the bytes of the view ``t``:
    [programs, elements..., itemsize], a strided view (index None) for a static view, or a copy
    with the flat byte index for an indirect one (skipped, out-of-bounds rows left out).
    (None, None) when a dynamic offset is out of bounds."""
    isz = t.dtype.np.itemsize
    if t._vec is not None:
        addrs, valid = t._row_addresses()
        ok = np.broadcast_to(valid.reshape((-1,) + (1,) * (addrs.ndim - 1)), addrs.shape)
        idx = (addrs[ok].reshape(-1, 1) * isz + np.arange(isz)).ravel()
        return tags[:, idx].reshape(tags.shape[0], -1, isz), idx
    off = t._base_offset()
    if off is None:
        return None, None
    # strided from the first element, as NkiTensor._np views the data (negative strides
    # included: the access itself was bounds-checked)
    row, step = tags.strides
    v = as_strided(tags[:, off * isz:], shape=(tags.shape[0],) + t.shape + (isz,),
                   strides=(row,) + tuple(s * isz * step for s in t.strides) + (step,))
    return v, None


def current_core() -> Core:
    core = getattr(_tls, "core", None)
    if core is None:
        raise RuntimeError("this NKI call is only valid inside a kernel run by nki.jit / nki.simulate")
    return core


def run_threads(fn, n, name):
    """``fn(i)`` for ``i`` in ``range(n)``, one thread each (named ``name-i``), each following
    the caller's NKI version; waits for all."""
    from . import versions
    v = versions.current()

    def run(i):
        with versions.nki_version(v):
            fn(i)
    threads = [threading.Thread(target=run, args=(i,), name=f"{name}-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def maybe_core():
    return getattr(_tls, "core", None)


@contextlib.contextmanager
def running(core: Core):
    prev = getattr(_tls, "core", None)
    _tls.core = core
    try:
        yield core
    finally:
        _tls.core = prev


# ----------------------------------------------------------------------------- trace hook
_tracers: list = []


def tracing() -> bool:
    return bool(_tracers)


def new_storage(buffer: MemoryRegion, shape, dtype: dt.NkiDtype, name="", address=None,
                fill=True) -> Storage:
    """Allocate sentinel-filled storage for ``shape`` in ``buffer`` (on-chip: shape[0] partitions)."""
    n = 1
    for s in shape:
        n *= int(s)
    nbytes = n * dtype.itemsize
    core = maybe_core()
    if buffer.on_chip:
        parts = int(shape[0])
        row = nbytes // parts if parts else 0
        st = Storage(buffer, nbytes, dtype, name=name, partitions=parts, row_bytes=row, core=core)
        if core is None:
            raise RuntimeError(f"nl.ndarray: on-chip ({buffer.name}) tensors can only be created "
                               f"inside a running kernel")
        (core.sbuf if buffer is sbuf else core.psum).allocate(st, address)
        if buffer is psum:
            st.mm_written = np.zeros(nbytes, dtype=bool)
    else:
        st = Storage(buffer, nbytes, dtype, name=name, core=core)
        if len(shape) >= 2 and int(shape[-1]) > 0:
            st.pitch = int(shape[-1]) * dtype.itemsize
    if fill:
        dt.sentinel_fill(st.raw, dtype)
    return st
