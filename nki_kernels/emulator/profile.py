"""Modeled engine timeline of a kernel: Chrome / Perfetto trace JSON and a printed summary.

The cost model (``cost.py``) already places every instruction of an emulated kernel on its engine.
This module reads those schedules through a small interface and shows them:

* :func:`profile` runs a ``@jit`` kernel (or any callable that launches kernels) exactly as
  :func:`cost.estimate` does and returns a :class:`Profile`; :func:`profile_trace` models a trace
  recorded with ``emulator.trace()``;
* ``Profile.trace_json()`` is a Trace Event Format document (opens in ui.perfetto.dev or
  chrome://tracing): one process per NeuronCore (LNC program), one track per engine (TensorE,
  VectorE, ScalarE, GpSimd, Sync) and per DMA queue (q00-q15); every instruction is a box with its
  opcode, operands (buffer, dtype, shape, bytes), the kernel source line that issued it, the
  dependency edges the model used (``deps``) and the one that bound its start (``wait_on``); flow
  arrows join an instruction to the dependency on another track that made its engine wait;
* ``Profile.summary()``: per-engine busy / idle time, the critical path, the top instructions by
  engine time, DMA efficiency (bytes against descriptor sizes) and the roofline position. Its totals
  are the :class:`~nki_kernels.emulator.cost.CostReport`'s (the same numbers ``estimate`` prints).

Every time here is **modeled** (analytical cost model), never measured.

Interface to the cost model (all read-only): ``model_trace(..., schedules=list)`` appends
``(first, stop, t_launch_ns, sched)`` per launch; from ``sched`` this module reads ``items[i]``
(``.ins``, ``.q``, ``.kind``, ``.issuer``, ``.occ``, ``.deps``, ``.segs``, ``.nd``, ``.bg``),
``start`` / ``end`` / ``pred`` (per instruction, ns from the launch) and ``dmasim.log``
(``(instruction, program, queue, start, end)`` per served DMA queue segment);
``cost._observers`` lets :func:`capture` see the schedules of any ``estimate`` call.

Large kernels: past ``max_events`` boxes (instructions + DMA queue segments, default
:data:`MAX_EVENTS`) each track is cut into equal time bins and the boxes of one bin merge into
one (``"<opcode> x<n>"``, with counts, busy time and the top opcodes / source lines in its args);
only the critical path keeps its flow arrows. The summary always uses every instruction.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections import defaultdict
from pathlib import Path

from .. import hardware

__all__ = ["MAX_EVENTS", "Profile", "capture", "profile", "profile_trace", "LANES"]

MAX_EVENTS = 100_000
# track order and display names; DMA queues follow as "DMA q00".."DMA q15"
LANES = {"launch": "Launch overhead", "tensor": "TensorE (PE)",
         "tensor_bg": "TensorE (PE) background transposes", "vector": "VectorE (DVE)",
         "scalar": "ScalarE (ACT)", "gpsimd": "GpSimd (POOL)", "sync": "Sync (SP)"}
_ISSUER_LANE = {"sp": "sync", "scalar": "scalar", "gpsimd": "gpsimd"}
_NOTE = "modeled by the nki-kernels analytical cost model, not a measurement"


# ====================================================================================== capture
@contextlib.contextmanager
def capture():
    """Collect ``(trace, schedules, report)`` for every ``model_trace`` call in the block (e.g. the
    ``estimate`` calls of a bench run)."""
    from . import cost
    got = []

    def obs(trace, schedules, rep):
        got.append((trace, schedules, rep))

    cost._observers.append(obs)
    try:
        yield got
    finally:
        cost._observers.remove(obs)


def profile(fn, *args, target="trn3", lnc=1, max_events=MAX_EVENTS, name=None, **kwargs):
    """Run ``fn`` on the emulator like :func:`cost.estimate` and return its :class:`Profile`.

    ``fn``: a ``@jit`` kernel (launched as ``fn[lnc]`` when ``lnc == 2``), a third-party kernel
    jitted with the emulator's ``nki.jit``, or an op that launches kernels.
    """
    from .cost import estimate
    with capture() as got:
        rep = estimate(fn, *args, target=target, lnc=lnc, **kwargs)
    trace, schedules, _ = got[-1]
    return Profile(trace, schedules, rep, max_events=max_events,
                   name=name or getattr(getattr(fn, "fn", fn), "__name__", "kernel"))


def profile_trace(trace, target="trn3", lnc=None, max_events=MAX_EVENTS, name="kernel"):
    """Profile of a trace recorded with ``emulator.trace()``."""
    from .cost import model_trace
    schedules = []
    rep = model_trace(trace, target, lnc=lnc, schedules=schedules)
    return Profile(trace, schedules, rep, max_events=max_events, name=name)


# ===================================================================================== helpers
def _fmt_bytes(n):
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:.3g} {unit}"
    return f"{int(n)} B"


def _operand(o):
    shape = "x".join(str(int(d)) for d in o.shape) or "scalar"
    return f"{o.role}: {o.buffer} {o.dtype}[{shape}] {o.nbytes} B"


_SRC_CACHE: dict = {}


def _src(src):
    """'path/to/file.py:123 (function)', relative to the working directory when below it."""
    if not src:
        return "?"
    s = _SRC_CACHE.get(src)
    if s is None:
        f, line, func = src
        try:
            rel = os.path.relpath(f)
            f = rel if not rel.startswith("..") else f
        except ValueError:
            pass
        s = _SRC_CACHE[src] = f"{f}:{line} ({func})"
    return s


class _Box:
    __slots__ = ("seq", "prog", "lane", "start", "end", "cat", "sub")

    def __init__(self, seq, prog, lane, start, end, cat):
        self.seq, self.prog, self.lane, self.start, self.end, self.cat = \
            seq, prog, lane, start, end, cat
        self.sub = 0


def _lane_order(lane):
    keys = list(LANES)
    if lane in LANES:
        return keys.index(lane)
    return len(keys) + int(lane[1:])        # "q07"


def _lane_name(lane):
    return LANES.get(lane) or f"DMA {lane}"


# ===================================================================================== profile
class Profile:
    """The modeled timeline of one run (all launches, all cores). See the module docstring."""

    def __init__(self, trace, schedules, report, *, max_events=MAX_EVENTS, name="kernel"):
        self.report = report
        self.name = name
        self.max_events = int(max_events)
        self.cp = hardware.cost_params(report.target)
        self.instructions = list(trace.instructions)
        n = len(self.instructions)
        self.start = [0.0] * n          # absolute ns (launch overheads included)
        self.end = [0.0] * n            # instruction done (DMA: transfer complete)
        self.busy_end = [0.0] * n       # end of its box on its engine (DMA: trigger)
        self.lane = [""] * n
        self.pred = [None] * n
        self.deps = [()] * n
        self.desc = [0] * n
        self.work = [0.0] * n           # DMA: queue time at full speed (ns)
        self.boxes = []
        self.launch_boxes = []
        self.crit = []
        self.elided = []                # instructions the model drops (dead PSUM memsets): no box
        for (a, b, t0, sim) in schedules or []:
            self._read(a, b, t0, sim)
        self._assign_sublanes()

    # ------------------------------------------------------------------ reading the schedule
    def _read(self, a, b, t0, sim):
        L = self.report.launch_ns
        self.launch_boxes.append((t0 - L, t0, self.report.n_launches))
        boxes = self.boxes
        for i, it in enumerate(sim.items):
            g = a + i
            ins = it.ins
            s = (sim.start[i] or 0.0) + t0
            e = (sim.end[i] if sim.end[i] is not None else sim.start[i] or 0.0) + t0
            self.start[g], self.end[g] = s, e
            self.pred[g] = None if sim.pred[i] is None else a + sim.pred[i]
            self.deps[g] = tuple(a + j for j in it.deps)
            if it.kind == "dma":
                lane = _ISSUER_LANE.get(it.issuer, "sync")
                be = s + it.occ
                self.desc[g] = int(getattr(it, "nd", 0) or 0)
                self.work[g] = sum(w for (_, w, _) in (it.segs or ()))
            else:
                lane = it.q or ins.engine
                if lane == "tensor" and it.bg:
                    lane = "tensor_bg"              # Trn3: transposes on their own PE lane
                be = e
            self.lane[g], self.busy_end[g] = lane, be
            if getattr(it, "dead", False):
                self.elided.append(g)
                continue
            boxes.append(_Box(g, ins.program, lane, s, be, "instruction"))
        for (i, prog, k, st, en) in (sim.dmasim.log or ()):
            boxes.append(_Box(a + i, prog, f"q{k:02d}", st + t0, en + t0, "dma"))
        # critical path of this launch: follow the binding dependency back from the last end
        ends = [(sim.end[i] if sim.end[i] is not None else -1.0) for i in range(sim.n)]
        if ends:
            i = max(range(sim.n), key=ends.__getitem__)
            seen, path = set(), []
            while i is not None and i not in seen:
                seen.add(i)
                path.append(a + i)
                i = sim.pred[i]
            self.crit.extend(reversed(path))

    def _assign_sublanes(self):
        """Boxes that overlap on one engine (TensorE tile slots, background transposes) go to extra
        tracks of that engine ("TensorE (PE) #2"), so that no track has overlapping boxes."""
        self.tracks = defaultdict(list)     # (prog, lane, sub) -> boxes sorted by start
        by_lane = defaultdict(list)
        for bx in self.boxes:
            by_lane[(bx.prog, bx.lane)].append(bx)
        for (prog, lane), lst in by_lane.items():
            lst.sort(key=lambda x: (x.start, x.end))
            ends = []
            for bx in lst:
                k = next((j for j, e in enumerate(ends) if e <= bx.start + 1e-6), None)
                if k is None:
                    k = len(ends)
                    ends.append(0.0)
                ends[k] = bx.end
                bx.sub = k
                self.tracks[(prog, lane, k)].append(bx)

    # ------------------------------------------------------------------ summary numbers
    def summary_dict(self, top=12):
        """The summary as plain data (JSON-able); totals come from the CostReport."""
        rep, cp = self.report, self.cp
        mk = rep.makespan_ns
        cores = []
        for busy in rep.per_core_busy_ns:
            cores.append({e: {"busy_ns": float(busy.get(e, 0.0)),
                              "idle_ns": float(max(0.0, mk - busy.get(e, 0.0))),
                              "busy_pct": 100.0 * busy.get(e, 0.0) / mk if mk else 0.0}
                          for e in busy})
        # DMA queues: busy time per queue (union of its segments), per core
        qbusy = defaultdict(float)
        for (prog, lane, _), lst in self.tracks.items():
            if lane.startswith("q"):
                qbusy[(prog, lane)] += sum(b.end - b.start for b in lst)
        # critical path composition
        # (each step counts from where the previous one ended: a DMA waiting on its queue was
        # triggered before its queue predecessor finished)
        crit_by = defaultdict(float)
        prev = self.start[self.crit[0]] if self.crit else 0.0
        for g in self.crit:
            eng = "dma" if self.instructions[g].engine == "dma" else self.lane[g]
            eng = "tensor" if eng == "tensor_bg" else eng
            crit_by[eng] += max(0.0, self.end[g] - max(self.start[g], prev))
            prev = max(prev, self.end[g])
        crit_time = (self.end[self.crit[-1]] - self.start[self.crit[0]]) if self.crit else 0.0
        # top instructions: engine time per (engine, opcode, source line)
        groups = defaultdict(lambda: [0, 0.0])
        dma_time = defaultdict(float)
        for bx in self.boxes:
            if bx.cat == "dma":
                dma_time[bx.seq] += bx.end - bx.start
        for g, ins in enumerate(self.instructions):
            if ins.engine == "dma":
                key, t = ("dma", ins.opcode, _src(ins.src)), dma_time.get(g, 0.0)
            else:
                key = (self.lane[g].replace("_bg", ""), ins.opcode, _src(ins.src))
                t = self.busy_end[g] - self.start[g]
            gr = groups[key]
            gr[0] += 1
            gr[1] += t
        top_rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
        busy_all = {e: sum(c.get(e, 0.0) for c in rep.per_core_busy_ns) for e in
                    ("tensor", "vector", "scalar", "gpsimd", "sync")}
        busy_all["dma"] = sum(qbusy.values())     # DMA rows: share of all queues' busy time
        # DMA efficiency
        bw = cp.dma_bw_q
        sizes = defaultdict(lambda: [0, 0.0])       # bucket -> [descriptors, bytes]
        tot_b = tot_d = 0
        tot_w = 0.0
        per_src = defaultdict(lambda: [0, 0, 0.0])  # src -> [bytes, descriptors, work]
        for g, ins in enumerate(self.instructions):
            if ins.engine != "dma" or not self.desc[g]:
                continue
            nb = max([o.nbytes for o in list(ins.reads) + list(ins.writes)] or [0])
            nd = self.desc[g]
            tot_b += nb
            tot_d += nd
            tot_w += self.work[g]
            avg = nb / nd
            bucket = next(lbl for lim, lbl in _DESC_BUCKETS if avg < lim)
            sizes[bucket][0] += nd
            sizes[bucket][1] += nb
            ps = per_src[_src(ins.src)]
            ps[0] += nb
            ps[1] += nd
            ps[2] += self.work[g]
        q_time = sum(qbusy.values())
        dma = {
            "transfers": rep.dma_transfers, "bytes": rep.dma_bytes,
            "descriptors": rep.dma_descriptors,
            "avg_descriptor_bytes": tot_b / tot_d if tot_d else 0.0,
            # bytes / (queue time at full speed x per-queue bandwidth): descriptor overheads
            "descriptor_efficiency": tot_b / (tot_w * bw) if tot_w else 0.0,
            # bytes / (queue busy time x per-queue bandwidth): also HBM sharing and stalls
            "queue_efficiency": tot_b / (q_time * bw) if q_time else 0.0,
            "queue_bw_gbps": bw,
            "size_buckets": {k: {"descriptors": v[0], "bytes": v[1]}
                             for k, v in sorted(sizes.items(), key=lambda kv: _BUCKET_ORDER[kv[0]])},
            "worst_sources": [
                {"src": s, "bytes": v[0], "descriptors": v[1],
                 "avg_descriptor_bytes": v[0] / v[1], "efficiency": v[0] / (v[2] * bw)}
                for s, v in sorted(per_src.items(), key=lambda kv: -(kv[1][2] - kv[1][0] / bw))[:5]
                if v[2] > 0],
            "queue_busy_ns": {f"core{p} {lane}": t for (p, lane), t in sorted(qbusy.items())},
        }
        # roofline
        kinds = {k: v for k, v in rep.flops_by_kind.items() if v}
        kind = max(kinds, key=kinds.get) if kinds else "bf16"
        peak = (hardware.peak_tflops(rep.target, kind) or hardware.peak_tflops(rep.target, "bf16"))
        peak *= rep.cores
        hbm = hardware.hbm_bw(rep.target) * rep.cores
        ai = rep.tensor_flops / rep.hbm_bytes if rep.hbm_bytes else math.inf
        ridge = peak * 1000.0 / hbm
        roof = min(peak, ai * hbm / 1000.0) if math.isfinite(ai) else peak
        t_min = max(rep.tensor_flops / (peak * 1000.0), rep.hbm_bytes / hbm)
        roofline = {"kind": kind, "peak_tflops": peak, "hbm_gbps": hbm, "ai": ai,
                    "ridge": ridge, "bound": "compute" if ai >= ridge else "memory",
                    "roof_tflops": roof, "tflops": rep.tflops(), "gbps": rep.hbm_gbps(),
                    "pct_roof": 100.0 * rep.tflops() / roof if roof and rep.tensor_flops else None,
                    "lower_bound_ns": t_min,
                    "pct_of_bound_time": 100.0 * t_min / rep.total_ns if rep.total_ns else None}
        return {
            "name": self.name, "target": rep.target, "lnc": rep.lnc, "note": _NOTE,
            "total_ns": rep.total_ns, "makespan_ns": mk, "launch_ns": rep.launch_ns,
            "n_launches": rep.n_launches, "n_instructions": rep.n_instructions,
            "elided": len(self.elided),
            "end_to_end_ns": float(getattr(rep, "end_to_end_ns", rep.total_ns)),
            "engine_busy_ns": dict(rep.engine_busy_ns), "binding_engine": rep.binding_engine,
            "per_core": cores,
            "critical_path": {"time_ns": crit_time, "instructions": len(self.crit),
                              "by_engine_ns": dict(crit_by),
                              "steps": [list(r) for r in rep.critical_path]},
            "top": [{"engine": k[0], "opcode": k[1], "src": k[2], "count": v[0], "time_ns": v[1],
                     "pct_of_engine": 100.0 * v[1] / busy_all[k[0]] if busy_all.get(k[0]) else 0.0}
                    for k, v in top_rows],
            "dma": dma, "roofline": roofline,
            "tensor_flops": rep.tensor_flops, "hbm_bytes": rep.hbm_bytes,
        }

    def summary(self, top=12) -> str:
        """The printed summary (modeled)."""
        d = self.summary_dict(top)
        us = 1e-3
        out = [f"modeled profile of {d['name']} on {d['target']} (LNC={d['lnc']}): "
               f"{d['total_ns'] * us:.3f} us  [{_NOTE}]",
               f"  {d['n_launches']} launch(es) x {d['launch_ns'] * us:.2f} us overhead + "
               f"{d['makespan_ns'] * us:.3f} us makespan; {d['n_instructions']} instructions"
               + (f" ({d['elided']} dropped by the compiler as dead)" if d["elided"] else ""),
               f"  end to end with the host-side launch overhead: {d['end_to_end_ns'] * us:.3f} us",
               "", "  per-engine busy / idle (modeled):"]
        hdr = f"    {'engine':<16}" + "".join(
            f"{'core ' + str(p) + ' busy us':>16}{'busy %':>8}{'idle us':>10}"
            for p in range(len(d["per_core"])))
        out.append(hdr)
        for e in ("tensor", "vector", "scalar", "gpsimd", "sync", "dma"):
            row = f"    {_lane_name(e) if e != 'dma' else 'DMA (any queue)':<16}"
            for c in d["per_core"]:
                v = c.get(e, {"busy_ns": 0.0, "busy_pct": 0.0, "idle_ns": d["makespan_ns"]})
                row += f"{v['busy_ns'] * us:>16.3f}{v['busy_pct']:>7.1f}%{v['idle_ns'] * us:>10.3f}"
            out.append(row + ("  <- binding" if e == d["binding_engine"] else ""))
        cp_ = d["critical_path"]
        out += ["", f"  critical path: {cp_['instructions']} instructions over "
                f"{cp_['time_ns'] * us:.3f} us; engine time on it: " + ", ".join(
                    f"{_lane_name(k) if k != 'dma' else 'DMA'} {v * us:.3f} us"
                    for k, v in sorted(cp_["by_engine_ns"].items(), key=lambda kv: -kv[1]))
                + " (the rest: dependency latency and semaphores)"]
        for eng, op, s, e in cp_["steps"]:
            out.append(f"    {eng:<8}{op:<34}{s * us:>10.3f} -> {e * us:>10.3f} us")
        out += ["", "  top instructions by engine time (modeled; DMA: time summed over its queues):"]
        for r in d["top"]:
            out.append(f"    {r['time_ns'] * us:>10.3f} us {r['pct_of_engine']:>5.1f}% of "
                       f"{r['engine']:<7} {r['count']:>6} x {r['opcode']:<22} {r['src']}")
        m = d["dma"]
        out += ["", f"  DMA: {m['transfers']} transfers, {_fmt_bytes(m['bytes'])}, "
                f"{m['descriptors']} descriptors (avg {m['avg_descriptor_bytes']:.0f} B); "
                f"descriptor efficiency {100 * m['descriptor_efficiency']:.1f}% "
                f"(bytes / queue time at {m['queue_bw_gbps']:g} GB/s per queue), "
                f"with HBM sharing and stalls {100 * m['queue_efficiency']:.1f}%"]
        if m["size_buckets"]:
            out.append("    descriptor sizes: " + ", ".join(
                f"{k}: {v['descriptors']} ({_fmt_bytes(v['bytes'])})"
                for k, v in m["size_buckets"].items()))
        for w in m["worst_sources"][:3]:
            out.append(f"    {100 * w['efficiency']:5.1f}% efficient, avg "
                       f"{w['avg_descriptor_bytes']:.0f} B/descriptor, {_fmt_bytes(w['bytes'])}: "
                       f"{w['src']}")
        r = d["roofline"]
        ai = f"{r['ai']:.1f}" if math.isfinite(r["ai"]) else "inf"
        pct = f"{r['pct_roof']:.1f}% of the roof" if r["pct_roof"] is not None else "no matmul"
        if d["tensor_flops"]:
            where = (f"AI {ai} FLOP/B vs ridge {r['ridge']:.0f} -> {r['bound']}-bound; "
                     f"{r['tflops']:.2f} TFLOP/s of roof {r['roof_tflops']:.2f} ({pct}), ")
        else:
            where = "no matmul FLOPs: HBM roof; "
        out += ["", f"  roofline ({r['kind']}, {d['lnc']} core(s)): {where}"
                f"{r['gbps']:.1f} GB/s of {r['hbm_gbps']:.0f}; "
                f"roofline lower bound {r['lower_bound_ns'] * us:.3f} us = "
                f"{r['pct_of_bound_time'] or 0:.1f}% of the modeled time"]
        return "\n".join(out)

    __str__ = summary

    # ------------------------------------------------------------------ trace events
    def trace_json(self) -> dict:
        """The timeline as a Trace Event Format document (``ts``/``dur`` in us)."""
        us = 1e-3
        ev = []
        tids = {}
        procs = sorted({k[0] for k in self.tracks} | {0})
        for p in procs:
            ev.append({"ph": "M", "name": "process_name", "pid": p, "tid": 0,
                       "args": {"name": f"NeuronCore {p} (modeled)"}})
            ev.append({"ph": "M", "name": "process_sort_index", "pid": p, "tid": 0,
                       "args": {"sort_index": p}})
        keys = sorted(self.tracks, key=lambda k: (k[0], _lane_order(k[1]), k[2]))
        launch_key = (0, "launch", 0)
        launches = [b for b in self.launch_boxes if b[1] > b[0]]
        for key in ([launch_key] if launches else []) + keys:
            p, lane, sub = key
            tid = 1 + _lane_order(lane) * 16 + sub
            tids[key] = tid
            ev.append({"ph": "M", "name": "thread_name", "pid": p, "tid": tid,
                       "args": {"name": _lane_name(lane) + (f" #{sub + 1}" if sub else "")}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": p, "tid": tid,
                       "args": {"sort_index": tid}})
        for (s, e, _) in launches:
            ev.append({"ph": "X", "name": "launch overhead", "cat": "launch", "pid": 0,
                       "tid": tids[launch_key], "ts": s * us, "dur": (e - s) * us})
        n_boxes = len(self.boxes)
        aggregated = n_boxes > self.max_events
        crit = set(self.crit)
        if not aggregated:
            for key in keys:
                for bx in self.tracks[key]:
                    ev.append(self._event(bx, tids[key]))
        else:
            span = max([b.end for b in self.boxes] + [1.0])
            width = span * len(keys) / max(1, self.max_events - len(keys))
            for key in keys:
                ev.extend(self._binned(self.tracks[key], tids[key], width))
        # flow arrows: dependency on another track that bound the start
        box_of = {}
        seg_last = {}
        segs_of = defaultdict(list)
        for key in keys:
            for bx in self.tracks[key]:
                if bx.cat == "instruction":
                    box_of[bx.seq] = (bx, tids[key])
                    continue
                segs_of[bx.seq].append((bx, tids[key]))
                if bx.seq not in seg_last or seg_last[bx.seq][0].end < bx.end:
                    seg_last[bx.seq] = (bx, tids[key])
        fid = 0
        for g, p in enumerate(self.pred):
            if p is None or g not in box_of or (aggregated and g not in crit):
                continue
            dst, dtid = box_of[g]
            src, stid = seg_last.get(p) or box_of.get(p, (None, None))
            if src is None:
                continue
            if dst.start < src.end - 1e-3 and g in segs_of:
                # a DMA triggered before its binding dependency ended waited on a queue: the
                # arrow goes to the first of its queue segments that started after it
                later = [b for b in segs_of[g] if b[0].start >= src.end - 1e-3]
                if later:
                    dst, dtid = min(later, key=lambda b: b[0].start)
            if stid == dtid and src.prog == dst.prog:
                continue            # same track: queue order, not a wait
            fid += 1
            t_s = max(src.start, src.end - 1e-3) * us
            ev.append({"ph": "s", "id": fid, "name": "wait", "cat": "dependency", "pid": src.prog,
                       "tid": stid, "ts": t_s})
            ev.append({"ph": "f", "bp": "e", "id": fid, "name": "wait", "cat": "dependency",
                       "pid": dst.prog, "tid": dtid, "ts": dst.start * us})
        rep = self.report
        return {"traceEvents": ev, "displayTimeUnit": "ns",
                "otherData": {"generator": "nki-kernels profile", "note": _NOTE,
                              "kernel": self.name, "target": rep.target, "lnc": rep.lnc,
                              "total_ns": rep.total_ns, "n_instructions": rep.n_instructions,
                              "boxes": n_boxes, "aggregated": aggregated,
                              "elided": self.elided,
                              "max_events": self.max_events, "flows": fid}}

    def _args(self, g):
        ins = self.instructions[g]
        a = {"seq": g, "engine": ins.engine, "opcode": ins.opcode, "src": _src(ins.src),
             "reads": [_operand(o) for o in ins.reads], "writes": [_operand(o) for o in ins.writes],
             "bytes": int(sum(o.nbytes for o in list(ins.reads) + list(ins.writes))),
             "deps": list(self.deps[g]), "wait_on": self.pred[g],
             "end_us": self.end[g] * 1e-3}
        if ins.name:
            a["name"] = ins.name
        if self.desc[g]:
            a["descriptors"] = self.desc[g]
        for k in ("K", "M", "N", "perf_mode", "dge", "issuer", "op"):
            v = ins.attrs.get(k)
            if v is not None and not isinstance(v, (list, dict)):
                a[k] = v if isinstance(v, (int, float, bool)) else str(v)
        return a

    def _event(self, bx, tid):
        us = 1e-3
        ins = self.instructions[bx.seq]
        if bx.cat == "dma":
            args = {"seq": bx.seq, "opcode": ins.opcode, "src": _src(ins.src),
                    "transfer_descriptors": self.desc[bx.seq]}
            name = ins.opcode
        else:
            args = self._args(bx.seq)
            name = ins.opcode + (" (DMA trigger)" if ins.engine == "dma" else "")
        return {"ph": "X", "name": name, "cat": bx.cat, "pid": bx.prog, "tid": tid,
                "ts": bx.start * us, "dur": max(0.0, bx.end - bx.start) * us, "args": args}

    def _binned(self, boxes, tid, width):
        """Merge the boxes of one track that start in the same ``width``-ns bin."""
        us = 1e-3
        out = []
        run = []

        def flush():
            if not run:
                return
            if len(run) == 1:
                out.append(self._event(run[0], tid))
            else:
                ops = defaultdict(int)
                srcs = defaultdict(int)
                for bx in run:
                    ins = self.instructions[bx.seq]
                    ops[ins.opcode] += 1
                    srcs[_src(ins.src)] += 1
                top_op = max(ops, key=ops.get)
                out.append({"ph": "X", "name": f"{top_op} x{len(run)}", "cat": "aggregate",
                            "pid": run[0].prog, "tid": tid, "ts": run[0].start * us,
                            "dur": (run[-1].end - run[0].start) * us,
                            "args": {"count": len(run), "first_seq": run[0].seq,
                                     "last_seq": run[-1].seq,
                                     "busy_us": sum(b.end - b.start for b in run) * us,
                                     "opcodes": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:5]),
                                     "src": dict(sorted(srcs.items(), key=lambda kv: -kv[1])[:5])}})
            run.clear()

        cur = None
        for bx in boxes:
            b = int(bx.start // width)
            if b != cur:
                flush()
                cur = b
            run.append(bx)
        flush()
        return out

    # ------------------------------------------------------------------ files
    def write(self, out_dir, stem=None) -> dict:
        """Write ``<stem>.trace.json`` (Perfetto), ``<stem>.summary.json`` and ``.summary.txt``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = stem or slug(self.name)
        paths = {"trace": out / f"{stem}.trace.json", "summary": out / f"{stem}.summary.json",
                 "text": out / f"{stem}.summary.txt"}
        with open(paths["trace"], "w") as f:
            json.dump(self.trace_json(), f, separators=(",", ":"))
        paths["summary"].write_text(json.dumps(self.summary_dict(), indent=1, default=float))
        paths["text"].write_text(self.summary() + "\n")
        return paths


_DESC_BUCKETS = ((512, "< 512 B"), (2048, "512 B-2 KB"), (8192, "2-8 KB"),
                 (65536, "8-64 KB"), (math.inf, ">= 64 KB"))
_BUCKET_ORDER = {lbl: k for k, (_, lbl) in enumerate(_DESC_BUCKETS)}


def slug(text) -> str:
    """A file-name stem for an op / shape label."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", str(text)).strip("_") or "kernel"


# ================================================================================ device path
_DEVICE_ENGINES = (("tensor", "tensor_engine"), ("vector", "vector_engine"),
                   ("scalar", "scalar_engine"), ("gpsimd", "gpsimd_engine"), ("dma", "dma"))


def side_by_side(device: dict, modeled: dict, label: str = "") -> str:
    """A neuron-explorer summary (the fields ``bench/device.py`` keeps: ``total_time`` in s,
    ``*_active_time_percent``, HBM bytes) beside a modeled ``summary_dict``: per-engine active
    time and total time, with the device / model ratio that calibrates the cost model."""
    t_dev = float(device.get("total_time") or 0.0) * 1e9
    rows = [("total time us", t_dev or None, modeled["total_ns"])]
    for eng, key in _DEVICE_ENGINES:
        pct = device.get(f"{key}_active_time_percent")
        rows.append((f"{eng} active us", pct / 100.0 * t_dev if pct is not None and t_dev else None,
                     modeled["engine_busy_ns"].get(eng, 0.0)))
    hbm = [device.get("hbm_read_bytes"), device.get("hbm_write_bytes")]
    out = [f"{label}: device (neuron-explorer) vs modeled (cost model)",
           f"  {'':<18}{'device':>12}{'modeled':>12}{'dev/model':>11}"]
    for name, d, m in rows:
        ratio = f"{d / m:>11.2f}" if d and m else f"{'-':>11}"
        dv = f"{d / 1000:>12.3f}" if d is not None else f"{'-':>12}"
        out.append(f"  {name:<18}{dv}{m / 1000:>12.3f}{ratio}")
    if all(h is not None for h in hbm):
        out.append(f"  {'HBM bytes':<18}{sum(hbm):>12.4g}{modeled['hbm_bytes']:>12.4g}")
    return "\n".join(out)


# ====================================================================================== picture
_COLOURS = {"nc_matmul": 0, "nc_matmul_mx": 0, "nc_transpose": 1, "dma_copy": 14,
            "dma_transpose": 15, "tensor_copy": 9, "activation": 10, "activate2": 11,
            "exponential": 4, "tensor_scalar": 5, "tensor_tensor": 2, "tensor_reduce": 3,
            "tensor_scalar_reduce": 6, "memset": 7, "iota": 13, "reciprocal": 12,
            "range_select": 16, "activation_reduce": 17, "tensor_tensor_scan": 18,
            "affine_select": 19, "bn_stats": 8}


def _colour(op, palette):
    """A stable colour per opcode: fixed for the common ones, hashed for the rest."""
    import zlib
    return palette[_COLOURS.get(op, zlib.crc32(op.encode()) % len(palette))]


def gantt(doc, png, *, t0_us=None, t1_us=None, title=None, arrows=True, arrows_max=400,
          width=12.0):
    """Render a trace document (``Profile.trace_json()`` or a loaded ``.trace.json``) as a Gantt
    chart PNG: one row per track, boxes coloured by opcode, the dependency arrows in grey when the
    window holds at most ``arrows_max`` of them; the window ``[t0_us, t1_us]`` zooms in. Needs
    matplotlib (``pip install 'nki-kernels[bench]'``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(doc, Profile):
        doc = doc.trace_json()
    ev = doc["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev
             if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in ev
             if e["ph"] == "M" and e["name"] == "process_name"}
    xs = [e for e in ev if e["ph"] == "X"]
    lo = min([e["ts"] for e in xs] + [0.0]) if t0_us is None else t0_us
    hi = max([e["ts"] + e["dur"] for e in xs] + [lo + 1e-3]) if t1_us is None else t1_us
    used = sorted({(e["pid"], e["tid"]) for e in xs if e["ts"] < hi and e["ts"] + e["dur"] > lo})
    row = {k: i for i, k in enumerate(used)}
    multi = len({p for p, _ in used}) > 1
    colours = {}
    palette = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(width, 0.9 + 0.28 * len(used)))
    bars = defaultdict(list)
    for e in xs:
        k = (e["pid"], e["tid"])
        if k not in row or e["ts"] >= hi or e["ts"] + e["dur"] <= lo:
            continue
        op = e["name"].split(" ")[0]
        colours.setdefault(op, _colour(op, palette))
        bars[(row[k], op)].append((e["ts"], max(e["dur"], (hi - lo) * 2e-4)))
    for (r, op), spans in bars.items():
        ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=colours[op], edgecolors="none")
    starts = {e["id"]: e for e in ev if e["ph"] == "s"}
    pairs = [(starts[e["id"]], e) for e in ev if e["ph"] == "f" and e["id"] in starts]
    pairs = [(s, e) for s, e in pairs if (s["pid"], s["tid"]) in row and (e["pid"], e["tid"]) in row
             and lo <= s["ts"] <= hi and lo <= e["ts"] <= hi]
    if arrows and len(pairs) <= arrows_max:
        for s, e in pairs:
            ax.annotate("", xy=(e["ts"], row[(e["pid"], e["tid"])]),
                        xytext=(s["ts"], row[(s["pid"], s["tid"])]),
                        arrowprops={"arrowstyle": "->", "color": "0.35", "lw": 0.6,
                                    "alpha": 0.7})
    ax.set_yticks(range(len(used)))
    ax.set_yticklabels([(procs.get(p, str(p)).split(" (")[0] + ": " if multi else "")
                        + names.get((p, t), str(t)) for p, t in used], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(lo, hi)
    ax.set_xlabel("modeled time (us)")
    ax.set_title(title or f"{doc.get('otherData', {}).get('kernel', '')} (modeled timeline)",
                 fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), fontsize=6, ncol=min(6, len(colours)), loc="upper center",
              bbox_to_anchor=(0.5, -0.12 - 0.6 / max(4, len(used))), frameon=False)
    ax.grid(axis="x", lw=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
