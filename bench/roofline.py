"""Roofline math for the bench: peaks, the binding roof of a row, and the roofline plot.

Denominators (docs/bench.md, "How a row is computed"; figures and sources in docs/cost-model.md):

* compute roof: per-NeuronCore TensorE peak for the operand kind x cores used (LNC);
* memory roof: min(HBM share per NC, DMA practical peak per NC) x cores used;
* engine ceilings a bench case declares (e.g. ScalarE exp throughput for attention), and, for a
  modeled row, the busy time of a non-TensorE/DMA engine when the cost model says it binds.

Never the chip marketing figure. The numbers come from ``nki_kernels.hardware`` when it provides
``peak_tflops(target, kind)`` / ``hbm_bw(target)``; the table below holds the same documented
per-NC figures for when it does not (yet).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("bf16", "fp8", "mx", "fp32")

# Per NeuronCore (NeuronCore-v3 / v4 pages of the AWS Neuron documentation; derivation in
# docs/cost-model.md): TensorE 128x128 at 2.4 GHz -> 78.6 TF bf16, fp8
# double_row 2x, MXFP8/MXFP4 4x (Trn3 only), fp32 1/4 rate. None = not supported on that target.
_PEAK_TFLOPS = {
    "trn2": {"bf16": 78.6, "fp8": 157.0, "mx": None, "fp32": 19.7},
    "trn3": {"bf16": 78.6, "fp8": 157.0, "mx": 315.0, "fp32": 19.7},
}
# GB/s per NC: min(HBM share = chip HBM / 8, DMA practical peak = 16 queues x B/ns) [A.2, C.1]
_HBM_SHARE = {"trn2": 362.5, "trn3": 612.5}
_DMA_PEAK = {"trn2": 368.0, "trn3": 528.0}

# Display names of the cost model's engines.
ENGINE_NAMES = {"tensor": "TensorE", "vector": "VectorE", "scalar": "ScalarE",
                "gpsimd": "GpSimdE", "sync": "SyncE", "dma": "DMA"}
TARGETS = ("trn2", "trn3")


def _target(target: str) -> str:
    t = str(target).lower()
    aliases = {"gen3": "trn2", "gen4": "trn3"}
    t = aliases.get(t, t)
    if t not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}; got {target!r}")
    return t


def _hardware_helper(name):
    try:
        from nki_kernels import hardware
    except ImportError:  # pragma: no cover - hardware.py is part of the package
        return None
    return getattr(hardware, name, None)


def peak_tflops(target: str, kind: str) -> float:
    """TensorE dense peak of ONE NeuronCore in TFLOP/s for operand ``kind`` (bf16|fp8|mx|fp32)."""
    t = _target(target)
    if kind not in KINDS:
        raise ValueError(f"roof kind must be one of {', '.join(KINDS)}; got {kind!r}")
    helper = _hardware_helper("peak_tflops")
    value = helper(t, kind) if helper is not None else _PEAK_TFLOPS[t][kind]
    if not value:
        raise ValueError(f"{t} has no TensorE {kind} mode (MX matmul needs Trn3)")
    return float(value)


def hbm_bw(target: str) -> float:
    """Memory roof of ONE NeuronCore in GB/s: min(HBM share, DMA practical peak)."""
    t = _target(target)
    helper = _hardware_helper("hbm_bw")
    if helper is not None:
        return float(helper(t))
    return min(_HBM_SHARE[t], _DMA_PEAK[t])


@dataclass(frozen=True)
class EngineCeiling:
    """A non-TensorE throughput limit a bench case declares: ``work`` units at ``per_second``
    units/s per NeuronCore on each target. Example: attention's exps on ScalarE,
    ``EngineCeiling("ScalarE exp", n_exp, {"trn2": 153.6e9, "trn3": 153.6e9})``."""
    name: str
    work: float
    per_second: dict

    def seconds(self, target: str, lnc: int = 1) -> float:
        rate = self.per_second.get(_target(target))
        if not rate:
            return 0.0
        return self.work / (rate * lnc)


@dataclass(frozen=True)
class RoofPoint:
    """Where one measured or modeled run sits against the roofs of its target."""
    tflops: float          # achieved useful TFLOP/s
    gbps: float            # achieved compulsory GB/s
    ai: float              # arithmetic intensity, FLOP per compulsory HBM byte (inf if no bytes)
    roof: str              # the binding roof: "TensorE bf16", "HBM", or an engine ceiling name
    roof_s: float          # the binding roof's lower bound on the run time, seconds
    pct_roof: float        # 100 * roof_s / time
    pct_tensor: float      # achieved / TensorE peak (x lnc), %
    pct_hbm: float         # achieved / memory roof (x lnc), %


def roof_point(flops: float, nbytes: float, time_s: float, target: str, kind: str = "bf16",
               lnc: int = 1, ceilings=()) -> RoofPoint:
    """Place a run of ``flops`` useful FLOPs and ``nbytes`` compulsory bytes taking ``time_s``.

    The binding roof is the largest lower bound on the time among: TensorE at ``kind`` peak,
    the memory roof, and each declared ``ceilings`` entry (work the op must do on one engine
    divided by that engine's documented rate, e.g. exps / ScalarE exp throughput). Roofs come from
    the hardware and the op, never from how a kernel happens to use its engines.
    % of roof = that bound / time (100% = running at the roof).
    """
    if time_s <= 0:
        raise ValueError(f"time must be positive; got {time_s}")
    peak = peak_tflops(target, kind) * 1e12 * lnc
    bw = hbm_bw(target) * 1e9 * lnc
    bounds = [(f"TensorE {kind}", flops / peak), ("HBM", nbytes / bw)]
    bounds += [(c.name, c.seconds(target, lnc)) for c in ceilings]
    # ties go to the earlier entry (TensorE, then HBM): max() keeps the first maximum
    roof, roof_s = max(bounds, key=lambda b: b[1])
    tflops = flops / time_s / 1e12
    gbps = nbytes / time_s / 1e9
    return RoofPoint(
        tflops=tflops, gbps=gbps, ai=(flops / nbytes) if nbytes else math.inf,
        roof=roof, roof_s=roof_s, pct_roof=100.0 * roof_s / time_s,
        pct_tensor=100.0 * flops / time_s / peak, pct_hbm=100.0 * nbytes / time_s / bw)


def ridge(target: str, kind: str = "bf16") -> float:
    """Ridge point (FLOP/B) of one NC: TensorE peak / memory roof."""
    return peak_tflops(target, kind) * 1e12 / (hbm_bw(target) * 1e9)


# ------------------------------------------------------------------------------------------ plot


def plot(rows, path, target: str, title: str | None = None) -> bool:
    """Write a log-log roofline PNG (arithmetic intensity vs TFLOP/s) of ``rows`` (dicts from the
    harness) for ``target``. Roofs and points are per NeuronCore: an LNC=2 row is drawn at its
    TFLOP/s / 2. Only the TensorE roofs of the dtypes the rows use are drawn, and the memory roof
    as its own line. Points are numbered (one colour per op) and listed beside the plot with
    % of roof, op, shape and dtype, so labels never pile up. Returns False, with nothing written,
    when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t = _target(target)
    pts = [r for r in rows if r.get("target") == t and r.get("time_us") and r.get("flops")
           and r.get("bytes")]
    kinds = [k for k in KINDS if _supported(t, k) and any(r.get("roof_kind") == k for r in pts)]
    kinds = kinds or ["bf16"]
    n = len(pts)
    per_col = 40
    ncols = max(1, -(-n // per_col))
    height = max(5.0, 0.9 + 0.155 * min(n, per_col))
    fig = plt.figure(figsize=(7.5 + 4.2 * ncols, height), dpi=110)
    ax = fig.add_axes((0.07, 0.1, 0.88 * 7.0 / (7.5 + 4.2 * ncols), 0.8))
    ais = [r["flops"] / r["bytes"] for r in pts]
    lo = min([0.5] + [a / 2 for a in ais])
    hi = max([4 * ridge(t, k) for k in kinds] + [a * 2 for a in ais])
    bw = hbm_bw(t)
    top = max(peak_tflops(t, k) for k in kinds)
    styles = {"bf16": "-", "fp8": "--", "mx": "-.", "fp32": ":"}
    for kind in kinds:
        peak = peak_tflops(t, kind)
        r0 = peak * 1e3 / bw                                  # ridge point
        ax.plot([r0, hi], [peak, peak], styles[kind], color="0.3", lw=1.3,
                label=f"TensorE {kind} {peak:.1f} TF/s")
    ax.plot([lo, top * 1e3 / bw], [lo * bw / 1e3, top], "-", color="tab:red", lw=1.3, alpha=0.7,
            label=f"memory roof {bw:g} GB/s")
    ops = sorted({r["op"] for r in pts})
    cmap = plt.get_cmap("tab10")
    colour = {op: cmap(i % 10) for i, op in enumerate(ops)}
    entries = []
    for i, r in enumerate(pts, 1):
        x, y = r["flops"] / r["bytes"], r["tflops"] / r.get("lnc", 1)
        marker = "s" if r.get("source") == "measured" else "o"
        ax.scatter([x], [y], color=colour[r["op"]], marker=marker, s=22, zorder=3)
        ax.annotate(str(i), (x, y), fontsize=6.5, xytext=(3, 2), textcoords="offset points",
                    color="0.15")
        lnc = f" LNC={r['lnc']}" if r.get("lnc", 1) != 1 else ""
        pct = f"{r['pct_roof']:.0f}%" if r.get("pct_roof") is not None else "-"
        entries.append((i, r["op"], f"{i:>2} {pct:>4}  {r['op']}: {r['shape']}, {r['dtype']}{lnc}"))
    for op in ops:
        ax.scatter([], [], color=colour[op], marker="o", s=22, label=op)
    if any(r.get("source") == "measured" for r in pts):
        ax.scatter([], [], color="0.5", marker="s", s=22, label="measured (squares)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP / compulsory HBM byte)")
    ax.set_ylabel("TFLOP/s per NeuronCore")
    ax.set_title(title or f"nki-kernels roofline, {t} (modeled; per NeuronCore)", fontsize=10)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    x0 = 0.07 + 0.88 * 7.0 / (7.5 + 4.2 * ncols) + 0.02
    colw = (1 - x0) / ncols
    for c in range(ncols):
        chunk = entries[c * per_col:(c + 1) * per_col]
        for j, (_, op, text) in enumerate(chunk):
            step = min(0.8 / max(1, min(n, per_col) - 1), 0.04)
            fig.text(x0 + c * colw, 0.9 - j * step,
                     text[:64], fontsize=6.5, color=colour[op], va="center", family="monospace")
    fig.savefig(path)
    plt.close(fig)
    return True


def _supported(target: str, kind: str) -> bool:
    try:
        peak_tflops(target, kind)
    except ValueError:
        return False
    return True
