"""Analytical NeuronCore cost model: emulator trace in, modeled device time out (docs/cost-model.md).

Event-driven, in-order, multi-queue model with a small parameter table (``hardware.CostParams``):

* one in-order queue per compute engine of each core: TensorE (LoadStationary stage overlapping the
  MultiplyMoving stage, 4x4 PE tile slots, dI/dt throttle), ScalarE, VectorE, GpSimd, Sync;
* 16 DMA queues per core. A transfer is split into per-partition descriptors (partitions
  [8k, 8k+8) -> queue k); a queue serves its transfers FIFO at ``(max(b, B_min) + B_fix) / BW_q``
  per descriptor; all queues touching HBM share the per-core HBM cap and, with LNC=2, the per-stack
  cap (fluid sharing: every active queue is slowed proportionally);
* dependencies from overlapping reads/writes (RAW, WAR, WAW) of the same allocation id on
  overlapping partitions and byte ranges; different allocation ids never conflict (fresh tiles in a
  loop body get the compiler's buffer rotation). A consumer on another engine waits a semaphore.

Timing rule for instruction i on queue q::

    ready_i = max_j (end_j + lat_j [+ L_sem across engines])
    start_i = max(free_q, ready_i)       free_q = end_i = start_i + occ_i

DMA triggers with static (compiler-made) descriptors are placed by the compiler's scheduler, so they
are not held in program order behind other DMAs: each takes the first free 64-cycle slot of the
Sync engine at or after its ready time. HW-DGE DMAs from ScalarE and SW-DGE DMAs (GpSimd) are
instructions of those engines' in-order streams. Kernel time = launch overhead + the last end
over all queues.

Public API: :func:`estimate` (run a kernel or op and model it), :func:`model_trace`,
:class:`CostReport`, :func:`dependencies`.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from bisect import bisect_right
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from .. import hardware

__all__ = ["CostReport", "estimate", "model_trace", "dependencies", "ENGINES"]

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "sync", "dma")
_COMPUTE_QUEUES = ("tensor", "vector", "scalar", "gpsimd", "sync")
_FAST16 = frozenset(("bfloat16", "float16"))
_FP8 = frozenset(("float8_e4m3", "float8_e5m2", "float8_e4m3fn"))
_F32 = frozenset(("float32",))
_INF = float("inf")
_EPS = 1e-6  # ns


# ============================================================================== report
@dataclass
class CostReport:
    """What the cost model says about one run. Times in ns; all of it modeled, not measured."""

    target: str
    lnc: int
    total_ns: float                  # device time: launch overhead + makespan, summed over launches
    engine_busy_ns: dict             # per engine, busiest core: time with >= 1 instruction running
    tensor_flops: float              # 2*K*M*N over nc_matmul / nc_matmul_mx (transposes excluded)
    transpose_flops: float           # TensorE transposes (2*P*F*P), the profiler's transpose_flops
    hbm_read_bytes: int
    hbm_write_bytes: int
    hbm_bytes: int
    n_instructions: int
    critical_path: list              # [(engine, opcode, start_ns, end_ns)], compressed
    binding_engine: str              # engine with the largest busy time
    outputs: object = None           # what the run returned
    n_launches: int = 1
    launch_ns: float = 0.0           # launch overhead included per launch
    makespan_ns: float = 0.0         # total_ns without launch overhead
    per_core_busy_ns: list = field(default_factory=list)  # [{engine: ns}] per LNC program
    dma_transfers: int = 0
    dma_bytes: int = 0               # bytes moved by DMA (the larger side of each transfer)
    dma_descriptors: int = 0
    # sum of flops / peak of its mode (one core): TensorE lower bound
    tensor_ideal_ns: float = 0.0
    throttle_ns: float = 0.0         # extra TensorE time from the dI/dt ramp
    flops_by_kind: dict = field(default_factory=dict)  # bf16 | fp8 | mx | fp32 -> flops
    launch_e2e_ns: float = 0.0       # host-side launch overhead per call, NOT in total_ns
    elided: int = 0                  # instructions the compiler drops (dead PSUM memsets)
    sbuf_waits: int = 0              # SBUF tiles that waited for room (``sbuf_bound``)

    @property
    def end_to_end_ns(self) -> float:
        """Kernel time plus the host-side launch overhead of each launch: what a host-side timer
        (neuron-bench style) sees for one call; ``total_ns`` is what a device profile shows."""
        return self.total_ns + self.n_launches * self.launch_e2e_ns

    @property
    def total_us(self) -> float:
        return self.total_ns / 1000.0

    @property
    def cores(self) -> int:
        return max(1, self.lnc)

    def tflops(self) -> float:
        """Achieved matmul TFLOP/s (transposes excluded) over the modeled device time."""
        return self.tensor_flops / self.total_ns / 1000.0 if self.total_ns else 0.0

    def hbm_gbps(self) -> float:
        return self.hbm_bytes / self.total_ns if self.total_ns else 0.0

    def summary(self) -> str:
        cp = hardware.cost_params(self.target)
        lines = [f"modeled device time on {self.target} (LNC={self.lnc}): "
                 f"{self.total_ns / 1000:.3f} us  [analytical cost model, not a measurement]",
                 f"  {self.n_launches} launch(es); end to end with host launch overhead "
                 f"({self.launch_e2e_ns / 1000:.1f} us each): {self.end_to_end_ns / 1000:.3f} us",
                 f"  {self.n_instructions} instructions ({self.elided} dropped as dead); "
                 f"{self.dma_transfers} DMA transfers, {self.dma_descriptors} descriptors; "
                 f"{self.sbuf_waits} SBUF tiles waited for room",
                 "",
                 f"  {'engine (modeled)':<18}{'busy us':>10}{'busy %':>8}"]
        for e in ENGINES:
            b = self.engine_busy_ns.get(e, 0.0)
            pct = 100.0 * b / self.makespan_ns if self.makespan_ns else 0.0
            mark = "  <- binding" if e == self.binding_engine else ""
            lines.append(f"  {e:<18}{b / 1000:>10.3f}{pct:>7.1f}%{mark}")
        peak = cp.tflops_bf16 * self.cores
        lines.append("")
        kinds = ", ".join(f"{k} {v / 1e9:.3g} GFLOP" for k, v in self.flops_by_kind.items() if v)
        lines.append(f"  TensorE: {self.tensor_flops / 1e9:.4g} GFLOP matmul ({kinds or 'none'}), "
                     f"{self.transpose_flops / 1e9:.4g} GFLOP transposes; "
                     f"{self.tflops():.2f} TFLOP/s "
                     f"= {100 * self.tflops() / peak:.1f}% of the bf16 peak {peak:.1f} TF "
                     f"({self.cores} core(s)); throttle +{self.throttle_ns / 1000:.3f} us")
        bw = cp.hbm_bw_gbps * self.cores
        lines.append(f"  HBM: read {self.hbm_read_bytes / 1e6:.4g} MB, write "
                     f"{self.hbm_write_bytes / 1e6:.4g} MB; {self.hbm_gbps():.1f} GB/s = "
                     f"{100 * self.hbm_gbps() / bw:.1f}% of min(HBM share, DMA peak) {bw:.1f} GB/s")
        lines.append("")
        lines.append(f"  critical path (modeled):  {'engine':<8}{'opcode':<28}"
                     f"{'start us':>10}{'end us':>10}")
        for eng, op, s, e in self.critical_path:
            lines.append(f"  {'':<26}{eng:<8}{op:<28}{s / 1000:>10.3f}{e / 1000:>10.3f}")
        return "\n".join(lines)

    def __str__(self):
        return self.summary()


# ============================================================================== public API
def estimate(fn, *args, target="trn3", lnc=1, **kwargs) -> CostReport:
    """Run ``fn`` on the emulator for ``target`` and model its trace.

    ``fn`` is a ``@jit`` kernel (launched as ``fn[lnc](*args)`` when ``lnc == 2``) or any callable
    that launches kernels (an op). The report's ``outputs`` holds what ``fn`` returned.
    """
    from . import runtime as rt
    from .jit import Kernel
    from .trace import trace as _trace

    name = hardware.generation(target).name
    with rt.target(name), _trace() as tr:
        if isinstance(fn, Kernel):
            k = fn[lnc] if (lnc != 1 or fn.grid is not None) else fn
            out = k(*args, **kwargs)
        else:
            out = fn(*args, **kwargs)
    rep = model_trace(tr, name, lnc=lnc)
    rep.outputs = out
    return rep


# Profiler hook (nki_kernels/emulator/profile.py): callables obs(trace, schedules, report), called
# after each model_trace with the schedules it kept (see ``schedules`` below). Reads only.
_observers: list = []


def model_trace(trace, target="trn3", lnc=None, launch_ns=None, schedules=None,
                params=None) -> CostReport:
    """Model a recorded :class:`~nki_kernels.emulator.trace.Trace` on ``target``.

    Launches are split where ``trace.launches[k]["first_instruction"]`` says (``estimate`` records
    ``run_kernel`` records
    it); without that key the whole trace is one schedule paying ``len(launches)`` overheads.
    ``schedules``: a list to which each launch's ``(first, stop, t_launch_ns, _Schedule)`` is
    appended, its DMA queue segments logged (``_DmaSim.log``), for the profiler; times unchanged.
    ``params``: ``{CostParams field: value}`` overrides, for sensitivity studies only.
    """
    if schedules is None and _observers:
        schedules = []
    gen = hardware.generation(target)
    if params:   # what-if runs (nki-kernels calibrate --set NAME=VALUE): never the defaults
        gen = dataclasses.replace(gen, cost=dataclasses.replace(gen.cost, **params))
    cp = gen.cost
    instrs = list(trace.instructions)
    launches = list(getattr(trace, "launches", []) or [])
    bounds = []
    if launches and all("first_instruction" in L for L in launches):
        starts = [L["first_instruction"] for L in launches] + [len(instrs)]
        bounds = [(starts[k], starts[k + 1]) for k in range(len(launches))]
        n_overheads = len(launches)
    else:
        bounds = [(0, len(instrs))]
        n_overheads = max(1, len(launches))
    lnc = max([int(lnc or 1)] + [int(L.get("lnc", 1)) for L in launches])
    L_ns = cp.launch_ns if launch_ns is None else float(launch_ns)

    acc = _Totals()
    t0 = 0.0
    crit = []
    for (a, b) in bounds:
        part = instrs[a:b]
        t_launch = t0 + L_ns
        t0 = t_launch
        if not part:
            continue
        nprog = max(ins.program for ins in part) + 1
        times = None
        pre = None
        if cp.sbuf_bound:
            # which dead tiles free first: from the schedule without the bound, then again from
            # the bounded schedule that gives (the first guess misleads where the bound reshapes
            # the schedule: a kernel whose tiles fit modeled 3x slower, docs/cost-model.md)
            for _ in range(2):
                pre = _Schedule(part, gen, nprog, bound_times=times, like=pre)
                pre.run()
                times = [0.0 if e is None else e for e in pre.end]
        sim = _Schedule(part, gen, nprog, bound_times=times, like=pre)
        if schedules is not None:
            sim.dmasim.log = []
            schedules.append((a, b, t_launch, sim))
        sim.run()
        sim.collect(acc)
        crit.extend((e, o, s + t_launch, x + t_launch) for (e, o, s, x) in sim.critical_path())
        t0 = t_launch + sim.makespan
    t0 += (n_overheads - len(bounds)) * L_ns
    busy = {e: max((c.get(e, 0.0) for c in acc.per_core), default=0.0) for e in ENGINES}
    binding = max(ENGINES, key=lambda e: busy[e]) if any(busy.values()) else "dma"
    rep = CostReport(
        target=gen.name, lnc=lnc, total_ns=t0, engine_busy_ns=busy,
        tensor_flops=acc.flops, transpose_flops=acc.tflops_t,
        hbm_read_bytes=int(acc.hbm_r), hbm_write_bytes=int(acc.hbm_w),
        hbm_bytes=int(acc.hbm_r + acc.hbm_w), n_instructions=len(instrs),
        critical_path=_compress(crit), binding_engine=binding, n_launches=n_overheads,
        launch_ns=L_ns, makespan_ns=t0 - n_overheads * L_ns, per_core_busy_ns=acc.per_core,
        dma_transfers=acc.n_dma, dma_bytes=int(acc.dma_bytes), dma_descriptors=int(acc.n_desc),
        tensor_ideal_ns=acc.ideal, throttle_ns=acc.throttle, flops_by_kind=dict(acc.by_kind),
        launch_e2e_ns=cp.launch_e2e_ns, elided=acc.elided, sbuf_waits=acc.sbuf_waits)
    for obs in list(_observers):
        obs(trace, schedules, rep)
    return rep


def dependencies(trace, target="trn3"):
    """The dependency edges the model uses: for each instruction of ``trace`` (in order), the
    sorted tuple of earlier instruction indices it waits for (RAW, WAR, WAW; within a program)."""
    gen = hardware.generation(target)
    return [it.deps for it in _Schedule(list(trace.instructions), gen, 1 + max(
        [ins.program for ins in trace.instructions] + [0])).items]


# ============================================================================== helpers
class _Totals:
    def __init__(self):
        self.flops = 0.0
        self.tflops_t = 0.0
        self.hbm_r = 0.0
        self.hbm_w = 0.0
        self.n_dma = 0
        self.dma_bytes = 0.0
        self.n_desc = 0
        self.ideal = 0.0
        self.throttle = 0.0
        self.by_kind = {"bf16": 0.0, "fp8": 0.0, "mx": 0.0, "fp32": 0.0}
        self.per_core = []
        self.elided = 0
        self.sbuf_waits = 0


def _compress(rows, limit=20):
    """Merge runs of the same (engine, opcode); keep at most ``limit`` rows (head, gap, tail)."""
    merged = []
    for eng, op, s, e in rows:
        if merged and merged[-1][0] == eng and merged[-1][4] == op:
            m = merged[-1]
            m[3] = max(m[3], e)
            m[5] += 1
        else:
            merged.append([eng, op, s, e, op, 1])
    out = [(m[0], m[1] if m[5] == 1 else f"{m[1]} x{m[5]}", m[2], m[3]) for m in merged]
    if len(out) > limit:
        head, tail = out[: limit // 2], out[-(limit - limit // 2 - 1):]
        gap = out[limit // 2: len(out) - len(tail)]
        out = head + [("...", f"{len(gap)} more steps", gap[0][2], gap[-1][3])] + tail
    return out


class _Calendar:
    """Busy intervals of a shared resource, sorted and disjoint; bookings may come out of order."""

    __slots__ = ("starts", "ends")

    def __init__(self):
        self.starts = []
        self.ends = []

    def earliest(self, t, d):
        s, e = self.starts, self.ends
        i = bisect_right(s, t) - 1
        if i >= 0 and e[i] > t:
            t = e[i]
        i += 1
        n = len(s)
        while i < n and s[i] < t + d:
            if e[i] > t:
                t = e[i]
            i += 1
        return t

    def book(self, t, d):
        if d <= 0:
            return
        s, e = self.starts, self.ends
        i = bisect_right(s, t)
        end = t + d
        # coalesce with touching neighbours so back-to-back bookings stay one interval
        if i > 0 and e[i - 1] >= t - _EPS:
            i -= 1
            t = s[i]
            end = max(end, e[i])
            del s[i], e[i]
        while i < len(s) and s[i] <= end + _EPS:
            end = max(end, e[i])
            del s[i], e[i]
        s.insert(i, t)
        e.insert(i, end)


def _earliest(cals, t, d):
    while True:
        t2 = t
        for c in cals:
            t2 = c.earliest(t2, d)
        if t2 == t:
            return t
        t = t2


def _parts(op):
    return (op.partitions[1] - op.partitions[0]) if op.on_chip else 1


def _free(op):
    return op.nbytes // max(1, op.itemsize) // max(1, _parts(op))


def _inner_stride(op):
    pat = op.pattern[1:] if op.on_chip else op.pattern
    for stride, count in reversed(pat):
        if count > 1:
            return abs(stride)
    return 1


def _contiguous(op):
    return _inner_stride(op) == 1


class _Throttle:
    """TensorE dI/dt limit: u starts at 0.5, ramps to 1 over 3 us, re-engages after a 3 us window
    with PE busy < 50% [D GL]. ``duration(start, work)`` = wall time for ``work`` ns at full rate."""

    def __init__(self, cp):
        self.on = cp.throttle
        self.u0 = cp.throttle_start
        self.R = cp.throttle_ramp_ns
        self.W = cp.throttle_window_ns
        self.idle_max = cp.throttle_window_ns * (1.0 - cp.throttle_threshold)
        self.ep = None
        self.busy = deque()  # merged busy intervals [s, e]

    def duration(self, s, work):
        if not self.on or work <= 0:
            return work
        lo = s - self.W
        while self.busy and self.busy[0][1] <= lo:
            self.busy.popleft()
        if self.ep is None:
            self.ep = s
        else:
            w0 = max(lo, self.ep)
            busy = 0.0
            for (a, b) in self.busy:
                a, b = max(a, w0), min(b, s)
                if b > a:
                    busy += b - a
            if (s - w0) - busy > self.idle_max:
                self.ep = s
        x0 = s - self.ep
        R, u0 = self.R, self.u0
        if x0 >= R:
            return work
        a = (1.0 - u0) / R
        ramp_work = u0 * (R - x0) + 0.5 * a * (R * R - x0 * x0)
        if work >= ramp_work:
            return (R - x0) + (work - ramp_work)
        c = 0.5 * a * x0 * x0 + u0 * x0 + work
        x1 = (-u0 + math.sqrt(u0 * u0 + 2.0 * a * c)) / a
        return x1 - x0

    def record(self, s, e):
        if self.busy and s <= self.busy[-1][1]:
            if e > self.busy[-1][1]:
                self.busy[-1][1] = e
        else:
            self.busy.append([s, e])


# ====================================================================== per-instruction costs
class _Item:
    """One instruction prepared for scheduling."""

    __slots__ = ("i", "ins", "prog", "q", "kind", "occ", "ls", "slots", "bg", "lat_same",
                 "lat_cross", "deps", "partner", "cals", "segs", "issuer", "dge", "fl", "nd", "dead")

    def __init__(self, i, ins):
        self.i = i
        self.ins = ins
        self.prog = ins.program
        self.q = None          # queue ("tensor", ..., "sync"), or "dma" for floating DMA triggers
        self.kind = "cmp"      # cmp | pe | dma
        self.occ = 0.0         # ns on the queue (PE: MM stage at full rate; DMA: trigger cost)
        self.ls = 0.0          # PE LoadStationary ns
        self.slots = None      # PE tile slots
        self.bg = False        # v4 background transpose
        self.lat_same = 0.0
        self.lat_cross = 0.0
        self.deps = ()
        self.partner = None
        self.cals = ()         # shared-resource keys
        self.segs = None       # DMA: [(queue, work_ns, hbm_bytes)]
        self.issuer = None     # DMA: "sp" | "scalar" | "gpsimd"
        self.dge = None        # DMA: HW-DGE instance
        self.fl = None         # (kind, flops) for TensorE
        self.dead = False      # a dead PSUM memset the compiler drops (see _dead_psum_memsets)
        self.nd = 0            # DMA: descriptors (profiler)


def _kind_of(dtypes):
    names = set(dtypes)
    if names & _F32:
        return "fp32"
    if names & _FP8:
        return "fp8"
    return "bf16"


class _Costs:
    """Per-instruction occupancy formulas (docs/cost-model.md) for one generation."""

    def __init__(self, gen):
        self.gen = gen
        self.cp = cp = gen.cost
        self.clk = {"tensor": cp.f_pe, "vector": cp.f_dve, "scalar": cp.f_act, "gpsimd": cp.f_pool,
                    "sync": cp.f_sp}
        self.fast = set(_FAST16) | (set(_FP8) if cp.dve_perf_fp8 else set())
        self.dep = {"vector": cp.dve_dep_cycles / cp.f_dve, "scalar": cp.act_dep_cycles / cp.f_act,
                    "gpsimd": cp.pool_dep_cycles / cp.f_pool, "sync": 0.0}

    # ---------------------------------------------------------------- TensorE
    def pe(self, it, ins):
        cp, a = self.cp, ins.attrs
        op = ins.opcode
        it.kind = "pe"
        if op == "nc_transpose":
            P = int(a.get("P") or (ins.reads[0].partitions[1] - ins.reads[0].partitions[0]))
            F = int(a.get("F") or _free(ins.reads[0]))
            cyc = max(P, min(cp.mm_min_ii, F))
            if a.get("in_dtype") in _F32:
                cyc *= cp.transpose_fp32_factor
            ls = math.ceil(F / cp.ls_speedup)
            it.bg = cp.background_transpose
            it.fl = ("transpose", 2.0 * P * F * P)
            lat = P + cp.mm_latency_cycles
            tile = None
        else:
            first = ins.reads[0] if ins.reads else None
            st = next((o for o in ins.reads if o.role == "stationary"), first)
            mv = next((o for o in ins.reads if o.role == "moving"), st)
            K = int(a.get("K") or (_parts(st) if st else 128))
            M = int(a.get("M") or (_free(st) if st else 128))
            N = int(a.get("N") or (_free(mv) if mv else 1))
            cyc = max(min(cp.mm_min_ii, M), N)
            ls = math.ceil(M / cp.ls_speedup)
            dts = (a.get("in_dtype"), a.get("mov_dtype"))
            if op == "nc_matmul_mx" or a.get("perf_mode") == "mx":
                kind = "mx"
            else:
                kind = _kind_of([d for d in dts if d])
            if kind == "fp32":
                f = cp.fp32_factor * (cp.onezero_factor if a.get("onezero") else 1.0)
                cyc *= f
                ls *= cp.fp32_factor  # spec silent: LoadStationary of fp32 also takes 4 passes
            it.fl = (kind, 2.0 * K * M * N)
            lat = N + cp.mm_latency_cycles
            tile = (a.get("tile_position") or (), a.get("tile_size") or ())
        f_pe = cp.f_pe
        it.occ = cyc / f_pe
        it.ls = ls / f_pe
        it.lat_same = 0.0                 # accumulation chains on TensorE are pipelined
        it.lat_cross = lat / f_pe         # [Est] N_moving + 256 cycles until visible in PSUM
        it.slots = self._slots(tile)

    def _slots(self, tile):
        n = self.cp.pe_tile_slots
        g = self.cp.pe_rows // n
        if not tile or not tile[0] or not tile[1]:
            return tuple(range(n * n))
        (r0, c0), (rs, cs) = tile[0], tile[1]
        rows = range(int(r0) // g, max(int(r0) // g + 1, (int(r0) + int(rs)) // g))
        cols = range(int(c0) // g, max(int(c0) // g + 1, (int(c0) + int(cs)) // g))
        return tuple(r * n + c for r in rows for c in cols)

    # ---------------------------------------------------------------- Vector / Scalar / GpSimd
    def elementwise(self, it, ins, eng):
        """Cycles of one VectorE / ScalarE / GpSimd / Sync instruction (docs/cost-model.md)."""
        cp, op, a = self.cp, ins.opcode, ins.attrs
        MIN = cp.min_ii
        big_reads = [o for o in ins.reads if o.on_chip and _free(o) > 1] or list(ins.reads)
        N = max([_free(o) for o in big_reads] or [0])
        if not N:
            N = max([_free(o) for o in ins.writes] or [1])
        data = big_reads[0] if big_reads else None
        dst = ins.writes[0] if ins.writes else None
        ops_ = [o for o in (data, dst) if o is not None]
        dts = {o.dtype for o in ops_}
        psum = any(o.buffer == "psum" for o in ins.reads + ins.writes)
        sbuf_only = all(o.buffer == "sbuf" for o in ops_)
        contig = all(_contiguous(o) for o in ops_)
        bus = False
        extra = 0
        if eng == "sync":
            cyc = cp.dma_trigger_cycles  # register moves / loads: a sequencer slot [Est]
        elif a.get("barrier"):
            cyc = MIN                    # core_barrier: a semaphore exchange, no data pass [Est]
        elif any(o.indirect for o in ins.reads + ins.writes) and op not in ("local_gather",):
            cyc = max(cp.dynamic_copy_cycles, N)                      # [D ISA26]
        elif eng == "gpsimd":
            if op in ("iota", "affine_select"):
                cyc = cp.pool_start_cycles + N                        # [D ISA26]
            elif op == "local_gather":
                e = max(1, int(a.get("num_elem_per_idx", 1)))
                n_idx = int(a.get("n_idx", N))
                isz = data.itemsize if data else 4
                C = ((28 + 4 * e) / (4 * e)) / min(4 / isz, e)
                cyc = cp.pool_start_cycles + n_idx * e / C            # [D ISA26]
            elif op == "topk":
                cyc = 4 * int(a.get("n", N)) + int(a.get("k", 8))     # [D ISA]
            else:
                cyc = max(MIN, cp.pool_cycles_per_elem * N)           # [Est]
            bus = any(o.buffer == "sbuf" for o in ins.reads + ins.writes)
        elif eng == "scalar":
            if op in ("tensor_scalar", "tensor_copy") and dts and dts <= _FAST16:
                cyc = max(MIN, N / cp.act_bf16_speedup)               # [D AT3] (v4 only)
            else:
                cyc = max(MIN, N)                                      # [D ISA26]
            if (op == "activation_reduce" or a.get("readout")
                    or a.get("reduce") in ("reduce", "reset_reduce")):
                extra = cp.act_accum_cycles                            # [D A2]
        else:  # VectorE
            cyc, bus = self._dve(ins, op, a, N, dts, psum, sbuf_only, contig, data, dst)
            if op == "tensor_scalar_reduce" or (op not in ("tensor_reduce",) and a.get("readout")):
                extra = cp.act_accum_cycles
        if eng != "sync" and any(o.on_chip and _inner_stride(o) * o.itemsize > cp.strided_bytes
                                 for o in ins.reads + ins.writes if _free(o) > 1):
            cyc *= cp.strided_factor                                   # [D A2]
        it.occ = (cyc + extra) / self.clk[eng]
        d = self.dep.get(eng, 0.0)
        it.lat_same = it.lat_cross = d
        return bus

    def _dve(self, ins, op, a, N, dts, psum, sbuf_only, contig, data, dst):
        cp, MIN = self.cp, self.cp.min_ii
        perf = cp.dve_perf_modes
        fast = self.fast
        if op in ("tensor_copy", "tensor_scalar") and perf and dts and dts <= fast:
            m = cp.dve_perf_4x if (sbuf_only and contig) else cp.dve_perf_2x   # [D AT2]
            return max(MIN, N / m), True
        if op == "tensor_tensor":
            ins_ = [o for o in ins.reads if o.role in ("data1", "data2")] or list(ins.reads)
            if any(o.buffer == "psum" for o in ins_):
                return max(MIN, N), False                              # [D ISA26]
            alld = {o.dtype for o in ins_} | ({dst.dtype} if dst else set())
            if (perf and alld <= fast and a.get("op") in ("add", "multiply", "subtract") and contig
                    and all(_contiguous(o) for o in ins_)):
                return max(MIN, N), True                               # [D ISA26, AT2]
            return max(MIN, 2 * N), False
        if op == "tensor_reduce":
            fast_red = dts and dts <= _FAST16 and a.get("op") in ("add", "maximum", "max")
            c = 0.5 if fast_red else 1.0
            return max(MIN, c * N), False                              # [D ISA26]
        if op == "scalar_tensor_tensor":
            ok = (dts and dts <= _FAST16 and a.get("op0") == "subtract"
                  and a.get("op1") == "multiply" and N % 2 == 0)
            return max(MIN, N if ok else 2 * N), False                 # [D ISA26]
        if op == "reciprocal":
            return max(MIN, 8 * N), False                              # [D ISA26]
        if op == "bn_aggr":
            return max(MIN, 13 * N / 3), False                         # [D ISA26]
        if op in ("tensor_tensor_scan",):
            return max(MIN, 2 * N), False                              # [D ISA26]
        if op == "memset":
            v = a.get("value", None)
            zero = v is not None and not isinstance(v, bool) and float(v) == 0.0
            if zero and dts and dts <= _FAST16:
                return max(MIN, N / 2), False                          # [D ISA26]
            return max(MIN, N), False
        if op == "tensor_copy_predicated":
            return max(MIN, N if psum else 2 * N), False               # [D ISA26]
        if op in ("quantize_mx", "exponential"):
            return max(MIN, N / cp.dve_mx_speedup), False              # [D AT3] (v4)
        # tensor_scalar/copy (fp32), bn_stats, range_select, max8, find_index8, transpose,
        # stream_shuffle, dropout, select/scan variants...: max(MIN_II, N) [D ISA26 / Est]
        return max(MIN, N), False

    # ---------------------------------------------------------------- DMA
    def dma(self, it, ins):
        """Descriptors -> per-queue work. Returns (bytes moved, descriptors, hbm_r, hbm_w)."""
        cp, a = self.cp, ins.attrs
        it.kind = "dma"
        # the index tile of a vector-offset gather / scatter orders the DMA (a dependency) but is
        # not moved by it: it sets neither the descriptors nor the bytes
        reads = [o for o in ins.reads if o.role != "index"]
        writes = list(ins.writes)
        ops_all = reads + writes
        hbm_r = sum(o.nbytes for o in reads if not o.on_chip)
        hbm_w = sum(o.nbytes for o in writes if not o.on_chip)
        if ins.opcode == "sendrecv":
            hbm_r = hbm_w = 0
        it.lat_same = it.lat_cross = 0.0
        if a.get("skipped") or not ops_all:
            it.segs = []
            return 0, 0, 0, 0
        nbytes = max(o.nbytes for o in ops_all)
        dst = writes[0] if writes else None
        transpose = bool(a.get("transpose")) or ins.opcode == "dma_transpose"
        eff = 1.0
        if transpose:
            from_hbm = any(not o.on_chip for o in reads)
            eff = cp.dma_transpose_eff_hbm if from_hbm else cp.dma_transpose_eff_sbuf
        if ins.opcode == "sendrecv":
            sb = reads[0] if reads else dst
        else:
            sb = next((o for o in reads if o.on_chip), None)
            if dst is not None and dst.on_chip:
                sb = dst
        if transpose and sb is not None:
            contig = sb.contig_bytes
        else:
            contig = min(o.contig_bytes for o in ops_all)
        contig = max(1, contig)
        hbm = hbm_r + hbm_w
        # dma_compute reads every source through the queues: each is a full transfer's work
        passes = max(1, len(reads)) if ins.opcode == "dma_compute" else 1
        nq, ppq = cp.dma_queues, cp.dma_partitions_per_queue
        bw, bmin, bfix = cp.dma_bw_q, cp.dma_b_min, cp.dma_b_fix
        segs = []
        if transpose and cp.dma_transpose_blocks and dst is not None and dst.on_chip:
            # the 16 queues write the output together, one [128 partitions, 16 contiguous
            # elements] block at a time; a partial block costs a whole one [D AT2]
            P, isz = max(1, _parts(dst)), max(1, dst.itemsize)
            run = max(1, dst.contig_bytes // isz)
            rows = max(1, _free(dst) // run)
            n_blk = math.ceil(P / 128) * rows * math.ceil(run / 16)
            work = passes * n_blk * 128 * 16 * isz / nq / bw / eff
            segs = [(k, work, hbm / nq) for k in range(nq)]
            n_desc = n_blk * nq
        elif sb is not None:
            P = max(1, _parts(sb))
            p0 = sb.partitions[0]
            bpp = nbytes / P
            d = max(1.0, min(contig, bpp))
            nd = max(1, math.ceil(bpp / d - 1e-9))
            db = bpp / nd
            work_pp = passes * nd * (max(db, bmin) + bfix) / bw / eff
            for k in range(p0 // ppq, (p0 + P - 1) // ppq + 1):
                c = min(p0 + P, (k + 1) * ppq) - max(p0, k * ppq)
                if c > 0:
                    segs.append((k % nq, c * work_pp, hbm * c / P))
            n_desc = nd * P
        else:  # HBM -> HBM: split evenly over the queues
            per = nbytes / nq
            d = max(1.0, min(contig, per))
            nd = max(1, math.ceil(per / d - 1e-9))
            db = per / nd
            work = passes * nd * (max(db, bmin) + bfix) / bw / eff
            segs = [(k, work, hbm / nq) for k in range(nq)]
            n_desc = nd * nq
        it.segs = segs
        it.nd = n_desc
        # who triggers it
        dge = a.get("dge", "unknown")
        issuer = a.get("issuer", "unknown")
        # a casting DMA cannot use the hardware DGE (nki-spec 5.3); with a runtime (dynamic)
        # address it needs the software DGE, like an indirect one; static ones keep their
        # compiler-built descriptors
        cast_dyn = a.get("cast") and a.get("dynamic")
        if dge == "swdge" or cast_dyn or (a.get("indirect") and ins.opcode != "sendrecv"):
            it.issuer = "gpsimd"                                       # SW DGE on GpSimd [D DGE]
            it.occ = (cp.swdge_start_cycles + cp.swdge_cycles_per_desc * n_desc) / cp.f_pool
        elif dge == "hwdge" and issuer == "scalar":
            it.issuer = "scalar"
            it.occ = cp.dma_trigger_cycles / cp.f_act
            it.dge = 1
        else:
            it.issuer = "sp"
            it.occ = cp.dma_trigger_cycles / cp.f_sp
            it.dge = 0 if dge == "hwdge" else None
        return nbytes, n_desc, hbm_r, hbm_w


# ============================================================================== dependencies
def _overwrites_psum(ins):
    """True when a TensorE instruction writes its PSUM destination without reading it."""
    if ins.engine != "tensor":
        return False
    a = ins.attrs
    return ins.opcode == "nc_transpose" or bool(a.get("is_transpose")) or bool(a.get("overwrote"))


def _dead_psum_memsets(items):
    """Mark the PSUM memsets whose every byte is overwritten by matmuls before anything reads it.

    NKI's ``nc_matmul(accumulate=None)`` (the default) overwrites a PSUM location on its first
    matmul write and accumulates afterwards, and on gen2/gen3 accumulating onto PSUM that a
    non-matmul instruction wrote is undefined (NKI ISA docs, ``nki.isa.nc_matmul``). So
    the common ``memset(psum, 0)`` before a K loop is dead: its zeros are never read. The compiler
    drops dead stores; the model does the same, so the memset neither occupies VectorE nor makes
    the first matmul of the next tile wait behind the previous tile's PSUM drain on VectorE's
    in-order queue. (The nki-autotune matmul measured at 90.92% MFU on Trn2 with the compiler's
    instruction scheduling off runs such a memset per output tile; with the memset on the critical
    path it could not exceed ~40%.) A memset any byte of which is read, or accumulated onto, first
    stays live.
    """
    pending = {}   # (prog, alloc) -> [[item, p0, p1, lo, hi, covered intervals]]
    for it in items:
        ins = it.ins
        ops = [(o, False) for o in ins.reads] + [(o, True) for o in ins.writes]
        for o, w in ops:
            if o.buffer != "psum":
                continue
            lst = pending.get((it.prog, o.alloc))
            if not lst:
                continue
            p0, p1, lo, hi = o.partitions[0], o.partitions[1], o.extent[0], o.extent[1]
            keep = []
            for m in lst:
                if not (m[1] < p1 and p0 < m[2] and m[3] < hi and lo < m[4]):
                    keep.append(m)
                    continue
                if not (w and _overwrites_psum(ins) and p0 <= m[1] and m[2] <= p1):
                    continue                      # read (or accumulated onto) first: live
                m[5].append((max(lo, m[3]), min(hi, m[4])))
                m[5].sort()
                reach = m[3]
                for a, b in m[5]:
                    if a > reach:
                        break
                    reach = max(reach, b)
                if reach >= m[4]:
                    m[0].dead = True              # fully overwritten before any read
                else:
                    keep.append(m)
            pending[(it.prog, o.alloc)] = keep
        if ins.opcode == "memset" and ins.writes and ins.writes[0].buffer == "psum":
            o = ins.writes[0]
            pending.setdefault((it.prog, o.alloc), []).append(
                [it, o.partitions[0], o.partitions[1], o.extent[0], o.extent[1], []])


def _kills(ins, op):
    """True when write operand ``op`` of ``ins`` starts a new value of its on-chip region: the
    instruction writes it without reading it (no accumulation, no read of the same allocation)."""
    if op.buffer not in ("sbuf", "psum") or ins.attrs.get("barrier"):
        return False
    if ins.engine == "tensor" and not _overwrites_psum(ins):
        return False
    p0, p1, lo, hi = op.partitions[0], op.partitions[1], op.extent[0], op.extent[1]
    for r in ins.reads:
        if r.alloc == op.alloc and r.partitions[0] < p1 and p0 < r.partitions[1] \
                and r.extent[0] < hi and lo < r.extent[1]:
            return False
    return True


def _covered(e, p0, p1, clo, chi, blo, bhi):
    return (p0 <= e[0] and e[1] <= p1 and clo <= (e[2] if e[2] > blo else blo)
            and (e[3] if e[3] < bhi else bhi) <= chi)


def _dependencies(items, rename=True):
    """RAW / WAR / WAW edges from overlapping operand regions of the same (program, allocation).

    Each allocation keeps bucketed lists of its live writes and reads (bucket size ~ the median
    access span). A read scans only the writes; a write scans both, then drops the accesses it
    fully covers within a bucket (they are ordered before it transitively). A read also drops older
    reads of the same region from the same in-order compute queue.

    Live-range renaming (the compiler's address rotation): a write that starts a new value of an
    on-chip region (it writes without reading, see ``_kills``) and covers the earlier accesses of
    that region does not wait for them; it waits for the accesses of the value before those
    (rotation over two buffers). So a tile allocated once outside a loop and rewritten every
    iteration pipelines like a tile allocated in the loop body, as the Neuron compiler's allocator
    (liveness-based, with an AddressRotation pass that ``address=`` pins disable at a measured
    ~48 MFU points; nki-autotune .claude/rules/learnings.md) arranges on hardware. Accesses it
    overlaps without covering keep their edges.
    """
    spans = {}
    for it in items:
        ins = it.ins
        for op in ins.reads:
            spans.setdefault((it.prog, op.alloc), []).append(op.extent[1] - op.extent[0])
        for op in ([] if it.dead else ins.writes):
            spans.setdefault((it.prog, op.alloc), []).append(op.extent[1] - op.extent[0])
    shift = {}
    for key, s in spans.items():
        s.sort()
        med = max(1, s[len(s) // 2])
        shift[key] = max(0, med.bit_length() - 1)
    index = {key: {} for key in spans}

    for it in items:
        if it.dead:
            continue
        ins = it.ins
        is_barrier = ins.attrs.get("barrier")
        reads = [] if is_barrier else ins.reads
        writes = list(ins.writes) + (list(ins.reads) if is_barrier else [])
        deps = set()
        accesses = [(op, False, False) for op in reads] + \
                   [(op, True, rename and _kills(ins, op)) for op in writes]
        plan = []
        for op, w, kill in accesses:
            key = (it.prog, op.alloc)
            buckets = index[key]
            sh = shift[key]
            p0, p1, lo, hi = op.partitions[0], op.partitions[1], op.extent[0], op.extent[1]
            if hi <= lo:
                continue
            b0, b1 = lo >> sh, (hi - 1) >> sh
            plan.append((buckets, sh, p0, p1, lo, hi, b0, b1, w, kill))
            if b1 - b0 < 64 or len(buckets) > (b1 - b0):
                keys = range(b0, b1 + 1)
            else:
                keys = [k for k in buckets if b0 <= k <= b1]
            for bk in keys:
                pair = buckets.get(bk)
                if pair is None:
                    continue
                if kill:
                    blo, bhi = bk << sh, (bk + 1) << sh
                    clo, chi = (lo if lo > blo else blo), (hi if hi < bhi else bhi)
                    for j in (0, 1):
                        for e in pair[j]:
                            if e[0] < p1 and p0 < e[1] and e[2] < hi and lo < e[3] and \
                                    not _covered(e, p0, p1, clo, chi, blo, bhi):
                                deps.add(e[4])
                    for e in pair[2]:
                        if e[0] < p1 and p0 < e[1] and e[2] < hi and lo < e[3]:
                            deps.add(e[4])
                    continue
                for e in pair[0]:
                    if e[0] < p1 and p0 < e[1] and e[2] < hi and lo < e[3]:
                        deps.add(e[4])
                if w:
                    for e in pair[1]:
                        if e[0] < p1 and p0 < e[1] and e[2] < hi and lo < e[3]:
                            deps.add(e[4])
        deps.discard(it.i)
        it.deps = tuple(sorted(deps))
        prune_reads = it.kind != "dma"
        for (buckets, sh, p0, p1, lo, hi, b0, b1, w, kill) in plan:
            entry = (p0, p1, lo, hi, it.i, it.q)
            for bk in range(b0, b1 + 1):
                pair = buckets.get(bk)
                if pair is None:
                    buckets[bk] = [[entry], [], []] if w else [[], [entry], []]
                    continue
                blo, bhi = bk << sh, (bk + 1) << sh
                clo, chi = (lo if lo > blo else blo), (hi if hi < bhi else bhi)
                if w:
                    if kill:   # the covered accesses become the previous value's
                        pair[2] = [e for e in pair[2]
                                   if not _covered(e, p0, p1, clo, chi, blo, bhi)]
                        for j in (0, 1):
                            pair[2].extend(e for e in pair[j]
                                           if _covered(e, p0, p1, clo, chi, blo, bhi))
                    for j in (0, 1):
                        lst = pair[j]
                        if lst:
                            pair[j] = [e for e in lst
                                       if not _covered(e, p0, p1, clo, chi, blo, bhi)]
                    pair[0].append(entry)
                else:
                    lst = pair[1]
                    if prune_reads and lst:
                        q = it.q
                        pair[1] = [e for e in lst if not (
                            e[5] == q and _covered(e, p0, p1, clo, chi, blo, bhi))]
                    pair[1].append(entry)


def _capacity_bound(items, cap, pmax, when):
    """SBUF capacity as a bound on prefetch: edges from a tile's first access to the last
    accesses of earlier tiles whose space it takes. Returns the number of tiles that waited.

    Without it a tile allocated in a loop body gets fresh storage with no tie to the tile that
    last held its addresses, so loads into such tiles run ahead without limit. Here each
    program's SBUF tiles (not those placed by ``address=``) hold space from their first access
    to their last one in program order, as the compiler's liveness-based allocator sees them:
    rows of the bytes their accesses span, over the partitions they touch. A tile whose first
    access does not fit beside the space still held takes the space of tiles dead in program
    order; every access of it that could run first (each DMA, and the first access on each
    in-order engine queue) waits for their last accesses (the last on each in-order engine queue
    and every DMA that touched them). Which dead tiles: those whose last accesses end first in
    ``when`` (each instruction's end in an earlier schedule of the trace), as an allocator that
    always picks the space freed first would; so the bound is optimistic, never a placement guess
    (no fragmentation, no address choice). When even all dead tiles do not make room (the
    kernel's live tiles exceed SBUF: the compiler would spill), the tile is placed anyway;
    spilling is not modeled.
    """
    first, last, rows, parts, final, gate = {}, {}, {}, {}, {}, {}
    for it in items:
        if it.dead:
            continue
        for op in it.ins.reads + it.ins.writes:
            if op.buffer != "sbuf" or op.pinned:
                continue
            key = (it.prog, op.alloc)
            if key not in first:
                first[key] = it.i
                rows[key] = [op.extent[0], op.extent[1]]
                parts[key] = [op.partitions[0], op.partitions[1]]
                final[key] = {}
                gate[key] = {}
            else:
                r, p = rows[key], parts[key]
                r[0], r[1] = min(r[0], op.extent[0]), max(r[1], op.extent[1])
                p[0], p[1] = min(p[0], op.partitions[0]), max(p[1], op.partitions[1])
            last[key] = it.i
            q = it.i if it.kind == "dma" else it.q
            final[key][q] = it.i
            gate[key].setdefault(q, it.i)
    starts, ends = {}, {}
    for key, i in first.items():
        starts.setdefault(i, []).append(key)
    for key, i in last.items():
        ends.setdefault(i, []).append(key)
    usage, dead, freed, dirty = {}, {}, {}, {}
    waited = 0
    for it in items:
        for key in starts.get(it.i, ()):
            use = usage.get(key[0])
            if use is None:
                use = usage[key[0]] = np.zeros(pmax, dtype=np.int64)
                dead[key[0]] = []
                freed[key[0]] = []
                dirty[key[0]] = np.zeros(pmax, dtype=np.int64)
            p0, p1 = parts[key]
            size = rows[key][1] - rows[key][0]
            heap, chunks, dirt = dead[key[0]], freed[key[0]], dirty[key[0]]
            # bytes per partition beyond the room never taken: they come from space that dead
            # tiles free, a tile's worth at a time, and whoever takes part of that space (this
            # tile or a later one) waits for the dead tile's last accesses
            need = np.maximum(0, size - np.maximum(0, cap - use[p0:p1] - dirt[p0:p1]))
            new = set()
            ci = 0
            while need.any():
                if ci == len(chunks):
                    if not heap:
                        break           # live tiles exceed SBUF (the compiler would spill)
                    _, _, old = heapq.heappop(heap)
                    q0, q1 = parts[old]
                    amt = np.zeros(pmax, dtype=np.int64)
                    amt[q0:q1] = rows[old][1] - rows[old][0]
                    use[q0:q1] -= amt[q0:q1]
                    dirt[q0:q1] += amt[q0:q1]
                    chunks.append((amt, tuple(final.pop(old).values())))
                amt, deps = chunks[ci]
                take = np.minimum(amt[p0:p1], need)
                if take.any():
                    new.update(deps)
                    amt[p0:p1] -= take
                    dirt[p0:p1] -= take
                    need -= take
                ci += 1
            if ci:
                chunks[:] = [c for c in chunks if c[0].any()]
            if new:
                waited += 1
                for i in gate[key].values():   # every DMA, and the first access on each queue
                    items[i].deps = tuple(sorted(new.union(items[i].deps)))
            use[p0:p1] += size
        for key in ends.get(it.i, ()):
            free_at = max(when[j] for j in final[key].values())
            heapq.heappush(dead[key[0]], (free_at, last[key], key))
    return waited


# ============================================================================== the schedule
class _Seg:
    __slots__ = ("tr", "k", "work", "hbm", "rate", "f", "start", "el")

    def __init__(self, tr, k, work, hbm):
        self.tr = tr
        self.k = k
        self.work = work
        self.hbm = hbm
        self.rate = hbm / work if work > 0 else 0.0   # HBM bytes per ns at full queue speed
        self.f = 1.0
        self.start = None
        self.el = 0.0


class _Transfer:
    __slots__ = ("i", "prog", "trigger", "el0", "left", "end", "qpred", "qid")

    def __init__(self, i, prog, trigger, el0, n, qid=0):
        self.qid = qid
        self.i = i
        self.prog = prog
        self.trigger = trigger
        self.el0 = el0
        self.left = n
        self.end = None
        self.qpred = None


class _DQueue:
    __slots__ = ("p", "k", "pending", "backlog", "free", "active", "out", "last")

    def __init__(self, p, k, slots):
        self.p = p
        self.k = k
        self.pending = []   # heap (eligible, seq, seg): set up, waiting for the queue
        self.backlog = []   # heap (trigger, seq, seg): triggered, waiting for an outstanding slot
        self.free = [0.0] * slots  # heap: times the outstanding slots became free
        self.active = None
        self.out = 0
        self.last = None


class _DmaSim:
    """16 FIFO queues per core, descriptor-level service, fluid sharing of the HBM caps.

    A triggered transfer takes one of the queue's outstanding slots (setup pipelined) in
    trigger-time order, becomes eligible ``T_dma_lat`` after its setup starts, and is served FIFO
    by eligibility. Transfers are only known once the scheduler has triggered them, so the
    simulation advances one transfer completion at a time (no later trigger can be earlier).
    """

    def __init__(self, cp, nprog):
        self.cp = cp
        self.now = 0.0
        self.K = max(1, cp.dma_outstanding)
        self.Q = [[{} for k in range(cp.dma_queues)] for p in range(nprog)]
        self.active = []
        self.waiting = set()    # idle queues with pending transfers
        self.granting = set()   # queues with a backlog
        self.busy = [0.0] * nprog
        self.cap_nc = cp.hbm_share_gbps
        self.cap_stack = cp.hbm_stack_gbps if nprog > 1 else _INF
        self.nprog = nprog
        self.seq = 0
        self.t_sem = cp.dma_sem_cycles / cp.f_sp
        self.lat = cp.dma_lat_ns
        self.log = None         # profiler: list of (instruction, prog, queue, start, end) or None

    def add(self, tr, segs, dge_end):
        for (k, work, hbm) in segs:
            s = _Seg(tr, k, work, hbm)
            s.el = dge_end
            rings = self.Q[tr.prog][k]
            q = rings.get(tr.qid)
            if q is None:
                q = rings[tr.qid] = _DQueue(tr.prog, k, self.K)
            self.seq += 1
            heapq.heappush(q.backlog, (tr.trigger, self.seq, s))
            self.granting.add(q)

    def pending(self):
        return bool(self.active or self.waiting or self.granting)

    def _grant(self, now):
        K = self.K
        for q in list(self.granting):
            bl = q.backlog
            while bl and q.out < K and bl[0][0] <= now + _EPS:
                trig, sq, s = heapq.heappop(bl)
                slot = heapq.heappop(q.free)
                el = max(max(trig, slot) + self.lat, s.el, s.tr.el0)
                heapq.heappush(q.pending, (el, sq, s))
                q.out += 1
                if q.active is None:
                    self.waiting.add(q)
            if not bl:
                self.granting.discard(q)

    def _next_grant(self):
        t = _INF
        for q in self.granting:
            if q.out < self.K and q.backlog[0][0] < t:
                t = q.backlog[0][0]
        return t

    def run_next(self):
        """Advance to the next transfer completion; return the completed transfers."""
        done = []
        while not done:
            now = self.now
            if self.granting:
                self._grant(now)
            if self.waiting:
                for q in list(self.waiting):
                    el, _, s = q.pending[0]
                    if el <= now + _EPS:
                        heapq.heappop(q.pending)
                        q.active = s
                        s.start = now
                        if now > el + 1e-3 and q.last is not None:
                            s.tr.qpred = q.last
                        self.active.append(s)
                        self.waiting.discard(q)
            if not self.active:
                t = self._next_grant()
                for q in self.waiting:
                    if q.pending[0][0] < t:
                        t = q.pending[0][0]
                if t == _INF:
                    return done
                self.now = max(now, t)
                continue
            # an engine serves its rings round robin [D DMA]: the transfers active on one
            # engine share its speed; then fluid HBM sharing
            act = self.active
            share = Counter((s.tr.prog, s.k) for s in act)
            R = [0.0] * self.nprog
            for s in act:
                R[s.tr.prog] += s.rate / share[(s.tr.prog, s.k)]
            fp = [min(1.0, self.cap_nc / r) if r > 0 else 1.0 for r in R]
            tot = sum(r * f for r, f in zip(R, fp))
            fs = min(1.0, self.cap_stack / tot) if tot > 0 else 1.0
            for s in act:
                s.f = (fp[s.tr.prog] * fs if s.rate > 0 else 1.0) / share[(s.tr.prog, s.k)]
            t = self._next_grant() if self.granting else _INF
            for s in act:
                tc = now + s.work / s.f
                if tc < t:
                    t = tc
            for q in self.waiting:
                el = q.pending[0][0]
                if el < t:
                    t = el
            if t < now:
                t = now
            dt = t - now
            progs = set()
            for s in act:
                s.work -= s.f * dt
                progs.add(s.tr.prog)
            for p in progs:
                self.busy[p] += dt
            self.now = t
            still = []
            for s in act:
                if s.work > _EPS:
                    still.append(s)
                    continue
                q = self.Q[s.tr.prog][s.k][s.tr.qid]
                q.active = None
                q.last = s.tr.i
                if self.log is not None:
                    self.log.append((s.tr.i, s.tr.prog, s.k, s.start, t))
                q.out -= 1
                heapq.heappush(q.free, t)
                if q.pending:
                    self.waiting.add(q)
                tr = s.tr
                tr.left -= 1
                if tr.left == 0:
                    tr.end = t + self.t_sem
                    done.append(tr)
            self.active = still
        return done


class _PEState:
    __slots__ = ("ls_free", "mm_start", "slot_free", "t_free", "throttle", "last", "busy_end",
                 "busy", "extra")

    def __init__(self, cp):
        self.ls_free = 0.0
        self.mm_start = 0.0
        self.slot_free = [0.0] * (cp.pe_tile_slots * cp.pe_tile_slots)
        self.t_free = 0.0
        self.throttle = _Throttle(cp)
        self.last = None
        self.busy_end = 0.0
        self.busy = 0.0
        self.extra = 0.0


class _Schedule:
    """The event-driven schedule of one launch (all LNC programs)."""

    def __init__(self, instrs, gen, nprog, bound_times=None, like=None):
        """``like``: a schedule of the same ``instrs`` that has run; its per-instruction costs and
        dependencies are reused (the bound's edges are added afresh) instead of recomputed."""
        self.gen = gen
        self.cp = gen.cost
        self.nprog = nprog
        if like is None:
            before = set(vars(self))
            self._prepare(instrs)
            self._static = tuple(set(vars(self)) - before)   # what _prepare set, shared by `like`
        else:
            for a in like._static:
                setattr(self, a, getattr(like, a))
            self._static = like._static
            for it, (deps, partner) in zip(self.items, self._base):
                it.deps, it.partner = deps, partner
        items = self.items
        # bound_times: the instructions' ends in an earlier schedule of the same launch, which
        # picks the dead tiles a tile that needs SBUF room takes (model_trace); None: no bound
        self.capacity_waits = _capacity_bound(items, gen.sbuf_usable_bytes, gen.pmax,
                                              bound_times) if bound_times is not None else 0
        self._init_run()

    def _prepare(self, instrs):
        """Per-instruction costs, queues and dependencies (everything but the SBUF bound)."""
        gen, cp = self.gen, self.cp
        self.costs = _Costs(gen)
        self.items = items = [_Item(i, ins) for i, ins in enumerate(instrs)]
        self.n = len(items)
        self.flops = 0.0
        self.tflops_t = 0.0
        self.by_kind = {"bf16": 0.0, "fp8": 0.0, "mx": 0.0, "fp32": 0.0}
        self.ideal = 0.0
        self.hbm_r = self.hbm_w = 0.0
        self.n_dma = 0
        self.dma_bytes = 0.0
        self.n_desc = 0
        peaks = {"bf16": cp.tflops_bf16, "fp8": cp.tflops_fp8, "mx": cp.tflops_mx or cp.tflops_bf16,
                 "fp32": cp.tflops_fp32}
        self.v3 = gen.nc_version >= 3
        barriers = {}
        sendrecvs = {}
        for it in items:
            ins = it.ins
            eng = ins.engine if ins.engine in ENGINES else "vector"
            if eng == "tensor":
                self.costs.pe(it, ins)
                it.q = "tensor"
                kind, fl = it.fl
                if kind == "transpose":
                    self.tflops_t += fl
                else:
                    self.flops += fl
                    self.by_kind[kind] += fl
                    self.ideal += fl / (peaks[kind] * 1000.0)
            elif eng == "dma":
                nb, nd, hr, hw = self.costs.dma(it, ins)
                self.hbm_r += hr
                self.hbm_w += hw
                self.n_dma += 1
                self.dma_bytes += nb
                self.n_desc += nd
                it.q = it.issuer if it.issuer in ("scalar", "gpsimd") else "dma"
                if ins.opcode == "sendrecv":
                    sendrecvs.setdefault(it.prog, []).append(it)
            else:
                bus = self.costs.elementwise(it, ins, eng)
                it.q = eng
                cals = []
                if eng == "sync":
                    cals.append(("sp", it.prog))
                if bus:  # VectorE perf mode and GpSimd SBUF access share a bus [D AT2]
                    cals.append(("bus", it.prog))
                if eng in ("vector", "scalar"):
                    bk = self._psum_banks(ins)
                    cals.extend(("psum", it.prog, b) for b in bk)
                it.cals = tuple(cals)
                if ins.attrs.get("barrier"):
                    barriers.setdefault(it.prog, []).append(it)
        for group in (barriers, sendrecvs):
            if len(group) == 2:
                for a, b in zip(group.get(0, []), group.get(1, [])):
                    a.partner, b.partner = b.i, a.i
        _dead_psum_memsets(items)
        self.elided = sum(1 for it in items if it.dead)
        _dependencies(items, cp.rename_onchip)
        self._base = [(it.deps, it.partner) for it in items]

    def _init_run(self):
        items, n, cp, nprog = self.items, self.n, self.cp, self.nprog
        # queues
        self.qlist = {}
        self.floating = []
        for it in items:
            if it.dead:
                continue
            if it.q == "dma":
                self.floating.append(it.i)
            else:
                self.qlist.setdefault((it.prog, it.q), []).append(it.i)
        self.qpos = {k: 0 for k in self.qlist}
        self.qfree = {k: 0.0 for k in self.qlist}
        self.qlast = {k: None for k in self.qlist}
        self.qbusy = {}
        self.qcov = {}
        self.cal = {}
        self.pe = [_PEState(cp) for _ in range(nprog)]
        self.dmasim = _DmaSim(cp, nprog)
        self.start = [None] * n
        self.end = [None] * n
        self.pred = [None] * n
        self.arrival = [None] * n
        self.pending = [len(it.deps) for it in items]
        self.waiters = [[] for _ in range(n)]
        for it in items:
            for j in it.deps:
                self.waiters[j].append(it.i)
        self.stack = []

    # ------------------------------------------------------------------ helpers
    def _psum_banks(self, ins):
        bank = self.gen.psum_bank_bytes
        out = set()
        for o in ins.reads + ins.writes:
            if o.buffer == "psum":
                if not self.v3:
                    out.add(0)  # NC-v2: VectorE and ScalarE cannot access PSUM in parallel [D A2]
                else:
                    out.update(range(o.extent[0] // bank, max(o.extent[0] // bank + 1,
                                                               -(-o.extent[1] // bank))))
        return out

    def _calendar(self, key):
        c = self.cal.get(key)
        if c is None:
            c = self.cal[key] = _Calendar()
        return c

    def _ready(self, it):
        items, end = self.items, self.end
        sem = self.cp.sem_ns
        best, pred = 0.0, None
        qi = (it.prog, it.q)
        for j in it.deps:
            jt = items[j]
            if (jt.prog, jt.q) == qi and jt.kind != "dma":
                t = end[j] + jt.lat_same
            else:
                t = end[j] + jt.lat_cross
                if jt.kind != "dma" and it.kind != "dma":
                    t += sem
            if t > best:
                best, pred = t, j
        return best, pred

    def _busy(self, key, s, e):
        """Union of busy intervals per (program, engine); starts arrive almost in order."""
        cov = self.qcov.get(key, -_INF)
        if e <= cov:
            return
        self.qbusy[key] = self.qbusy.get(key, 0.0) + (e - max(s, cov))
        self.qcov[key] = e

    def _set_end(self, i, t):
        self.end[i] = t
        for w in self.waiters[i]:
            self.pending[w] -= 1
            if self.pending[w] == 0:
                heapq.heappush(self.stack, w)

    # ------------------------------------------------------------------ main loop
    def run(self):
        for it in self.items:
            if it.dead:                    # dropped by the compiler: takes no time, gates nothing
                self.start[it.i] = 0.0
                self.end[it.i] = 0.0
        for key in self.qlist:
            self._try_queue(key)
        for i in self.floating:
            if self.pending[i] == 0:
                heapq.heappush(self.stack, i)
        while True:
            while self.stack:
                i = heapq.heappop(self.stack)
                it = self.items[i]
                if it.q == "dma":
                    if self.start[i] is None:
                        self._schedule_floating(it)
                else:
                    self._try_queue((it.prog, it.q))
            if self.dmasim.pending():
                for tr in self.dmasim.run_next():
                    self.pred[tr.i] = tr.qpred if tr.qpred is not None else self.pred[tr.i]
                    self._set_end(tr.i, tr.end)
                continue
            if all(e is not None for e in self.end):
                break
            if not self._break_deadlock():
                break
        self.makespan = max([e for e in self.end if e is not None] + [0.0])

    def _break_deadlock(self):
        """A rendezvous whose partner never arrives (mismatched barriers): let it pass alone."""
        for i, it in enumerate(self.items):
            if self.end[i] is None and self.arrival[i] is not None and it.partner is not None:
                p = it.partner
                self.items[p].partner = None
                it.partner = None
                heapq.heappush(self.stack, i)
                return True
        for key, lst in self.qlist.items():
            pos = self.qpos[key]
            if pos < len(lst) and self.pending[lst[pos]] > 0:
                # dependency on an instruction that never finishes: drop it (should not happen)
                self.pending[lst[pos]] = 0
                heapq.heappush(self.stack, lst[pos])
                return True
        return False

    def _rendezvous(self, it, arrival):
        """Both programs must reach a core_barrier / sendrecv. Returns the common start or None."""
        if it.partner is None:
            return arrival
        self.arrival[it.i] = arrival
        pa = self.arrival[it.partner]
        if pa is None:
            return None
        t = max(arrival, pa)
        p = self.items[it.partner]
        if self.start[p.i] is None:
            heapq.heappush(self.stack, p.i)
        return t + self.cp.sem_ns

    def _try_queue(self, key):
        lst = self.qlist[key]
        while self.qpos[key] < len(lst):
            i = lst[self.qpos[key]]
            if self.pending[i] > 0 or self.start[i] is not None:
                if self.start[i] is not None:
                    self.qpos[key] += 1
                    continue
                return
            it = self.items[i]
            if not self._schedule_inorder(it, key):
                return
            self.qpos[key] += 1

    def _schedule_inorder(self, it, key):
        ready, pred = self._ready(it)
        free = self.qfree[key]
        if it.kind == "pe":
            t0 = self._rendezvous(it, max(ready, free)) if it.partner is not None else ready
            if t0 is None:
                return False
            self._schedule_pe(it, max(ready, t0), pred,
                              self._ready_ls(it, t0 if it.partner is not None else 0.0))
            return True
        start = max(free, ready)
        if free > ready:
            pred = self.qlast[key]
        if it.partner is not None:
            t0 = self._rendezvous(it, start)
            if t0 is None:
                return False
            if self.arrival[it.partner] > start + _EPS:
                pred = it.partner          # the other core arrived last: it set the start
            start = t0
        occ = it.occ
        if it.cals:
            cals = [self._calendar(c) for c in it.cals]
            s2 = _earliest(cals, start, occ)
            if s2 > start + _EPS:
                start = s2
            for c in cals:
                c.book(start, occ)
        end = start + occ
        self.qfree[key] = end
        self.qlast[key] = it.i
        self.start[it.i] = start
        self.pred[it.i] = pred
        self._busy(key, start, end)
        if it.kind == "dma":
            self._launch_dma(it, start, end)
        else:
            self._set_end(it.i, end)
        return True

    def _ready_ls(self, it, t0):
        """When the LoadStationary of PE item ``it`` may start: its dependencies on other engines
        and on DMA. An earlier TensorE instruction writing the same PSUM (an accumulation chain)
        binds the MultiplyMoving stage only: LoadStationary reads SBUF into the array and
        overlaps the previous MM whatever its PSUM target ([D A2], docs/cost-model.md)."""
        items, end = self.items, self.end
        sem = self.cp.sem_ns
        best = t0
        qi = (it.prog, it.q)
        for j in it.deps:
            jt = items[j]
            if (jt.prog, jt.q) == qi and jt.kind != "dma":
                continue
            t = end[j] + jt.lat_cross + (sem if jt.kind != "dma" else 0.0)
            best = max(best, t)
        return best

    def _schedule_pe(self, it, ready, pred, ready_ls=None):
        st = self.pe[it.prog]
        ls_start = max(st.ls_free, st.mm_start, ready if ready_ls is None else ready_ls)
        ls_end = ls_start + it.ls
        if it.bg:
            base = st.t_free
        else:
            base = max(st.slot_free[s] for s in it.slots)
        start = max(base, ls_end, ready, st.mm_start)
        # the previous TensorE instruction binds when it delayed the LoadStationary or the MM
        if st.last is not None and (ls_start > ready + _EPS or start > max(ls_end, ready) + _EPS):
            pred = st.last
        dur = st.throttle.duration(start, it.occ)
        end = start + dur
        st.throttle.record(start, end)
        st.extra += dur - it.occ
        st.ls_free = ls_end
        st.mm_start = start
        if it.bg:
            st.t_free = end
        else:
            for s in it.slots:
                st.slot_free[s] = end
        st.last = it.i
        self.start[it.i] = start
        self.pred[it.i] = pred
        self._busy((it.prog, "tensor"), start, end)
        self._set_end(it.i, end)

    def _schedule_floating(self, it):
        ready, pred = self._ready(it)
        if it.partner is not None:
            t0 = self._rendezvous(it, ready)
            if t0 is None:
                return
            if self.arrival[it.partner] > ready + _EPS:
                pred = it.partner
            ready = t0
        sp = self._calendar(("sp", it.prog))
        start = sp.earliest(ready, it.occ)
        sp.book(start, it.occ)
        self.start[it.i] = start
        self.pred[it.i] = pred
        self._launch_dma(it, start, start + it.occ)

    def _launch_dma(self, it, start, issue_end):
        cp = self.cp
        dge_end = 0.0
        if it.dge is not None and cp.hwdge_instances:
            c = self._calendar(("dge", it.prog, it.dge % cp.hwdge_instances))
            ds = c.earliest(start, cp.hwdge_ns)
            c.book(ds, cp.hwdge_ns)
            dge_end = ds + cp.hwdge_ns
        if not it.segs:
            self._set_end(it.i, issue_end)
            return
        el0 = max(start + cp.dma_lat_ns, issue_end, dge_end)
        # the DMA queue (ring) of each engine the transfer goes to: tied to the trigger engine and
        # the descriptor generation [D DMA, "DMA Queues"]
        qid = (it.issuer, it.dge is not None) if cp.dma_ring_per_trigger else 0
        tr = _Transfer(it.i, it.prog, start, el0, len(it.segs), qid)
        self.dmasim.add(tr, it.segs, dge_end)

    # ------------------------------------------------------------------ results
    def collect(self, acc):
        acc.elided += self.elided
        acc.sbuf_waits += self.capacity_waits
        acc.flops += self.flops
        acc.tflops_t += self.tflops_t
        acc.hbm_r += self.hbm_r
        acc.hbm_w += self.hbm_w
        acc.n_dma += self.n_dma
        acc.dma_bytes += self.dma_bytes
        acc.n_desc += self.n_desc
        acc.ideal += self.ideal
        for k, v in self.by_kind.items():
            acc.by_kind[k] += v
        for p in range(self.nprog):
            busy = {e: self.qbusy.get((p, e), 0.0) for e in _COMPUTE_QUEUES}
            # SP slots are booked out of order: use the calendar's union
            sp = self.cal.get(("sp", p))
            busy["sync"] = sum(e - s for s, e in zip(sp.starts, sp.ends)) if sp else 0.0
            busy["dma"] = self.dmasim.busy[p]
            acc.throttle += self.pe[p].extra
            if p < len(acc.per_core):
                for e, v in busy.items():
                    acc.per_core[p][e] = acc.per_core[p].get(e, 0.0) + v
            else:
                acc.per_core.append(busy)

    def critical_path(self):
        if not self.n:
            return []
        last = max(range(self.n), key=lambda i: self.end[i] if self.end[i] is not None else -1)
        rows = []
        seen = set()
        i = last
        while i is not None and i not in seen:
            seen.add(i)
            it = self.items[i]
            eng = it.ins.engine
            rows.append((eng, it.ins.opcode, self.start[i] or 0.0, self.end[i] or 0.0))
            i = self.pred[i]
        rows.reverse()
        return rows
