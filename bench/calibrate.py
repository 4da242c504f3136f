"""Calibrate the cost model on published hardware measurements of kernels we did not write.

``nki-kernels calibrate --kernels DIR`` runs every point of ``bench/calibration/published.json``
whose kernel file is present under ``DIR/<owner>+<name>/<path>`` (the layout ``fetch`` gives;
``--print-fetch`` prints the git commands that put each file there from a clone), unchanged,
through the emulator (``nki_kernels.emulator.install()``), models it with the cost model and prints
published vs modeled, the ratio, and how many pairs of kernels the model orders as the hardware
does. The third-party code never enters this repository: only the published figures and their
sources do.

Agreement is measured in time: ``ratio = t_modeled / t_published`` (for an MFU point,
``t = flops / (MFU * peak)``). A family's fit is the median ``|ln ratio|``; a pair of points of
one family is ordered correctly when the model ranks their times as the hardware did, or when the
published figures are within ``tie`` of each other (2 MFU points for the GEMM ladder).

A point whose kernel lives in a package (NKI Library's ``nkilib``) names ``import_root``, the
folder inside its repository that goes on ``sys.path``: the kernel module is then imported by its
dotted name, so its package-relative imports resolve, and ``--print-fetch`` extracts that whole
folder. ``nki_version`` runs the point under the NKI version its code was written for (NKI
Library's head: 0.3); ``metric`` is ``mfu`` or ``time_us`` (kernel time as a device profile shows
it).

``--set NAME=VALUE`` re-models with one cost parameter changed (``dma_b_min=1024``): a
sensitivity study, never a change of the defaults (those change only by a mechanism with a public
source; see docs/cost-model.md).
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DATA = Path(__file__).with_name("calibration") / "published.json"
TIE_MFU = 2.0   # published MFU points this close may be ordered either way (issue 12)


@dataclass
class Result:
    point: dict
    status: str                      # "ok" | "missing" | "refused" | "error" | "skipped"
    modeled_ns: float = math.nan
    published_ns: float = math.nan
    modeled_mfu: float = math.nan
    message: str = ""
    busy: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.modeled_ns / self.published_ns

    @property
    def family(self) -> str:
        return self.point["family"]


def load_points(path: Path = DATA) -> list[dict]:
    return json.loads(Path(path).read_text())["points"]


def repo_dir(root: Path, point: dict) -> Path:
    return Path(root) / point["repo"].replace("/", "+")


def kernel_file(root: Path, point: dict) -> Path:
    return repo_dir(root, point) / point["path"]


def fetch_commands(points, root: Path) -> list[str]:
    """Shell commands that put each point's kernel file under ``root`` from a clone of its repo
    (``CLONE_<owner>_<name>`` is the clone's git directory, e.g. what ``fetch`` brings); a point
    with ``import_root`` gets that whole folder (its package), once per repository and commit."""
    out, seen = [], set()
    for p in points:
        dst = kernel_file(root, p)
        var = "CLONE_" + p["repo"].replace("/", "_").replace("-", "_")
        if p.get("import_root"):
            key = (p["repo"], p["commit"], p["import_root"])
            if key in seen:
                continue
            seen.add(key)
            rd = repo_dir(root, p)
            out.append(f'mkdir -p "{rd}" && git -C "${var}" archive {p["commit"]} '
                       f'{p["import_root"]} | tar -x -C "{rd}"')
            continue
        out.append(f'mkdir -p "{dst.parent}" && git -C "${var}" show {p["commit"]}:{p["path"]} '
                   f'> "{dst}"')
    return out


def _peak_flops(target: str) -> float:
    from nki_kernels import hardware
    return hardware.peak_tflops(target, "bf16") * 1e12


def _inputs(point: dict, fn) -> list:
    import ml_dtypes
    rng = np.random.default_rng(0)
    spec = point.get("inputs")
    if spec == "from_kernel":   # every parameter a [2048, 2048] bf16 matrix (the ladder's shape)
        n = len(inspect.signature(fn).parameters)
        spec = [[2048, 2048, "bfloat16"]] * n
    out = []
    for *shape, dt in spec:
        dtype = ml_dtypes.bfloat16 if dt == "bfloat16" else np.dtype(dt)
        out.append(rng.standard_normal(shape).astype(dtype))
    return out


def _import_package_module(path: Path, import_root: Path):
    """Import ``path`` by its dotted name under ``import_root`` (put first on ``sys.path``), so a
    kernel inside a package keeps its relative imports."""
    rel = path.resolve().relative_to(import_root.resolve()).with_suffix("")
    root = str(import_root.resolve())
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(".".join(rel.parts))


def _load_kernel(path: Path, name: str | None, import_root: Path | None = None):
    from nki_kernels import emulator
    if import_root is not None:
        mod = _import_package_module(path, import_root)
    else:
        modname = "nki_calibration_" + str(abs(hash(str(path))))
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        spec.loader.exec_module(mod)
    kernels = {k: v for k, v in vars(mod).items() if isinstance(v, emulator.Kernel)}
    if name:
        return kernels[name]
    if not kernels:
        raise LookupError(f"{path}: no @nki.jit kernel found")
    return list(kernels.values())[-1]


def trace_point(point: dict, root: Path):
    """Run one published kernel on the emulator (``install()`` done); returns its trace."""
    import contextlib

    from nki_kernels.emulator import runtime as rt
    from nki_kernels.emulator import versions
    from nki_kernels.emulator.trace import trace as _trace
    ver = point.get("nki_version")
    with versions.nki_version(ver) if ver else contextlib.nullcontext():
        iroot = point.get("import_root")
        k = _load_kernel(kernel_file(root, point), point.get("kernel"),
                         repo_dir(root, point) / iroot if iroot else None)
        args = _inputs(point, k.fn)
        with rt.target(point["target"]), _trace() as tr:
            kk = k[point["lnc"]] if point.get("lnc", 1) != 1 else k
            kk(*args, **point.get("kwargs", {}))
    return tr


def run(points, root: Path, params=None, traces=None, heavy=False) -> list[Result]:
    """Model every point whose file is present. ``traces`` (dict) caches traces between calls.
    A point marked ``heavy`` (its emulation exceeds a laptop's memory or time) is reported as
    skipped, with the reason, unless ``heavy``."""
    from nki_kernels.emulator import NkiValidationError, install
    from nki_kernels.emulator.cost import model_trace
    install()                    # the published kernels `import nki`: the emulator stands in
    traces = {} if traces is None else traces
    results = []
    for p in points:
        if not kernel_file(root, p).exists():
            results.append(Result(p, "missing", message=str(kernel_file(root, p))))
            continue
        if p.get("heavy") and not heavy:
            results.append(Result(p, "skipped", message="heavy (--heavy runs it): " + p["heavy"]))
            continue
        try:
            if p["id"] not in traces:
                traces[p["id"]] = trace_point(p, root)
            rep = model_trace(traces[p["id"]], p["target"], lnc=p.get("lnc", 1), params=params)
        except NkiValidationError as e:
            results.append(Result(p, "refused", message=str(e)))
            continue
        except Exception as e:  # noqa: BLE001 - a third-party kernel may fail in any way
            results.append(Result(p, "error", message=f"{type(e).__name__}: {e}"))
            continue
        flops = rep.tensor_flops if p.get("flops") == "from_trace" else float(p["flops"])
        peak = _peak_flops(p["target"]) * max(1, p.get("lnc", 1))
        if p["metric"] == "mfu":
            pub_ns = flops / (p["published"] / 100.0 * peak) * 1e9
        else:                        # "time_us"
            pub_ns = p["published"] * 1e3
        kern_ns = rep.makespan_ns    # kernel time as a profiler shows it (no launch overhead)
        results.append(Result(p, "ok", modeled_ns=kern_ns, published_ns=pub_ns,
                              modeled_mfu=100.0 * flops / (kern_ns * 1e-9) / peak,
                              busy={e: v for e, v in rep.engine_busy_ns.items() if v}))
    return results


def ordered_pairs(results, tie_mfu=TIE_MFU):
    """(correct, total) over pairs of ok points of one family."""
    ok = [r for r in results if r.status == "ok"]
    good = total = 0
    for i in range(len(ok)):
        for j in range(i + 1, len(ok)):
            a, b = ok[i], ok[j]
            if a.family != b.family:
                continue
            total += 1
            if (a.point["metric"] == b.point["metric"] == "mfu"
                    and abs(a.point["published"] - b.point["published"]) <= tie_mfu):
                good += 1
                continue
            if (a.published_ns - b.published_ns) * (a.modeled_ns - b.modeled_ns) > 0:
                good += 1
    return good, total


def fit(results) -> dict:
    """Per family and overall: n, median |ln ratio|, pairs ordered correctly."""
    fams = sorted({r.family for r in results if r.status == "ok"})
    out = {}
    for f in fams + ["all"]:
        sel = [r for r in results if r.status == "ok" and (f == "all" or r.family == f)]
        if not sel:
            continue
        good, total = ordered_pairs(sel)
        out[f] = {"n": len(sel), "median_abs_ln": statistics.median(abs(math.log(r.ratio))
                                                                   for r in sel),
                  "ordered": good, "pairs": total}
    return out


def table(results) -> str:
    lines = ["| point | published | modeled | t_model / t_pub | binding (modeled) |",
             "|---|---:|---:|---:|---|"]
    for r in results:
        p = r.point
        unit = "% MFU" if p["metric"] == "mfu" else " us"
        if r.status != "ok":
            lines.append(f"| {p['id']} | {p['published']}{unit} | {r.status} | | {r.message[:80]} |")
            continue
        mod = (f"{r.modeled_mfu:.1f}% MFU" if p["metric"] == "mfu"
               else f"{r.modeled_ns / 1e3:.1f} us")
        bind = max(r.busy, key=r.busy.get) if r.busy else ""
        lines.append(f"| {p['id']} | {p['published']}{unit} | {mod} | {r.ratio:.2f} | {bind} |")
    return "\n".join(lines)


def report(results) -> str:
    parts = [table(results), ""]
    for fam, s in fit(results).items():
        parts.append(f"{fam}: n={s['n']}, median |ln(t_model/t_pub)| = {s['median_abs_ln']:.3f}, "
                     f"pairs ordered as on hardware: {s['ordered']}/{s['pairs']}")
    return "\n".join(parts)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="nki-kernels calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", type=Path, required=True,
                    help="folder holding <owner>+<name>/<path> kernel files of the published set")
    ap.add_argument("--data", type=Path, default=DATA, help="published points (JSON)")
    ap.add_argument("--family", help="only points of this family")
    ap.add_argument("--id", action="append", default=[], metavar="ID",
                    help="only this point (repeatable)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="what-if: re-model with a cost parameter changed (repeatable)")
    ap.add_argument("--print-fetch", action="store_true",
                    help="print the git commands that place the kernel files, then exit")
    ap.add_argument("--heavy", action="store_true",
                    help="also run the points marked heavy (emulation needs > 8 GB or > 10 min)")
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    a = ap.parse_args(argv)
    points = [p for p in load_points(a.data) if (not a.family or p["family"] == a.family)
              and (not a.id or p["id"] in a.id)]
    if a.print_fetch:
        print("\n".join(fetch_commands(points, a.kernels)))
        return 0
    params = {}
    for kv in a.set:
        k, _, v = kv.partition("=")
        params[k.strip()] = float(v) if "." in v or "e" in v.lower() else int(v)
    results = run(points, a.kernels, params or None, heavy=a.heavy)
    print("Cost model vs published hardware measurements (modeled: analytical cost model)"
          + (f"; what-if {params}" if params else ""))
    print(report(results))
    missing = [r for r in results if r.status == "missing"]
    if missing:
        print(f"\n{len(missing)} kernel file(s) missing under {a.kernels}; "
              f"--print-fetch shows how to place them")
    if a.json:
        a.json.write_text(json.dumps([{"id": r.point["id"], "status": r.status,
                                       "published_ns": r.published_ns, "modeled_ns": r.modeled_ns,
                                       "message": r.message} for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
