"""The bench harness: run registered cases, place them on the roofline, write the results.

For each case of ``bench/defs`` (op x shape x dtype) on one target:

* modeled (the emulator backend): run the op under the cost model
  (``nki_kernels.emulator.cost.estimate``) and take its ``total_ns``;
* measured (a Neuron device): ``bench/device.py`` -- device time from the Neuron runtime, after
  warm-up, over repeats, with an optional profile capture;

then TFLOP/s and GB/s from the reference's FLOP and byte counters, % of the binding roof and the
roof's name (``roofline.roof_point``); with ``check`` the op's output is compared with the NumPy
reference first, and a case that fails posts no number.

Where results go:

* a user's run: JSON lines appended to ``results.jsonl`` (git sha and date on every line), a
  markdown table ``bench_<target>_<tier>.md`` and a roofline plot ``roofline_<target>_<tier>.png``
  under ``bench/results/local/`` (ignored by git) or the directory the user names; a run of some
  ops or shapes only writes ``..._subset.md`` and never replaces a full table;
* published tables (``publish``): ``bench/published/<tier>_<target>.jsonl`` / ``.md`` / ``.png``,
  written only when asked for, from a checkout whose code is committed (clean git sha); a subset
  run replaces its own rows and keeps the others;
* the README's performance table is generated from the published JSON (``readme_table``).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from nki_kernels.bench import defs, roofline

# below ~10 us, launch overhead (microseconds per call) and TensorE's power ramp-up dominate a
# kernel on a device (NKI performance guide, AWS Neuron documentation)
SHORT_KERNEL_US = 10.0
TIER_NAMES = ("default", "fast", "odd", "models")
DEFAULT_TIER = "default"
# what the code that produces a number is: a change elsewhere (docs, tests) keeps the sha clean
CODE_PATHS = ("nki_kernels", "reference", "bench", "pyproject.toml",
              ":(exclude)bench/published", ":(exclude)bench/results")


class BenchError(RuntimeError):
    """A bench request that cannot run here (message is meant for the user, as is)."""


# ------------------------------------------------------------------------------ environment


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def default_out_dir() -> Path:
    """``bench/results/local`` of the source checkout (ignored by git); ``./bench-results`` for an
    installed wheel."""
    here = Path(__file__).resolve().parent
    if "site-packages" not in here.parts and os.access(here, os.W_OK):
        return here / "results" / "local"
    return Path.cwd() / "bench-results"


def published_dir() -> Path:
    """``bench/published`` of the source checkout: the tables the README cites."""
    return Path(__file__).resolve().parent / "published"


def git_sha() -> str:
    """Short HEAD sha of the checkout, ``+dirty`` when the code (``CODE_PATHS``: the package,
    the references, the bench) differs from HEAD; ``unknown`` outside git. Read-only: no index
    refresh (GIT_OPTIONAL_LOCKS=0)."""
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")
    root = str(repo_root())
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"], env=env,
                             capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", root, "diff", "--quiet", "HEAD", "--", *CODE_PATHS],
                               env=env, capture_output=True, timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha.stdout.strip() + ("+dirty" if dirty else "")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def backend_name() -> str:
    from nki_kernels import backend
    return backend.BACKEND


# ---------------------------------------------------------------------------------- selection


def select(ops=None, tier: str = DEFAULT_TIER, target: str = "trn3", shape: str | None = None,
           dtype: str | None = None):
    """The cases to run: registered ``ops`` (all when None) in ``tier`` for ``target``, only
    shapes whose name contains ``shape`` and dtype labels that contain ``dtype`` when given."""
    if tier not in TIER_NAMES:
        raise BenchError(f"tier must be one of {', '.join(TIER_NAMES)}; got {tier!r}")
    known = defs.registered()
    errors = defs.load()
    wanted = list(ops) if ops else known
    out = []
    for op in wanted:
        if op not in known:
            hint = ""
            if op in errors:
                hint = f" (its definition bench/defs/{op}.py failed to import: {errors[op]})"
            raise BenchError(f"no bench definition for op {op!r}{hint}; registered: "
                             f"{', '.join(known) or 'none'}")
        out.extend(c for c in defs.cases(op, tier, target)
                   if (not shape or shape in c.shape) and (not dtype or dtype in c.dtype))
    return out


def case_rng(case, seed: int = 0):
    """A generator seeded by (seed, op, shape, dtype): the same inputs whatever else runs."""
    key = zlib.crc32(f"{case.op}|{case.shape}|{case.dtype}".encode())
    return np.random.default_rng([seed, key])


# -------------------------------------------------------------------------------- running


def run_modeled(case, target: str, inputs) -> dict:
    """Cost-model time of one case on the emulator."""
    from nki_kernels.emulator import target as emulated_target
    from nki_kernels.emulator.cost import estimate
    with emulated_target(target):
        rep = estimate(case.run, *inputs, target=target, lnc=case.lnc)
    busy = {k: float(v) for k, v in dict(getattr(rep, "engine_busy_ns", {}) or {}).items()}
    engine = getattr(rep, "binding_engine", None)
    return {"time_ns": float(rep.total_ns), "engine_busy_ns": busy, "binding_engine": engine,
            "n_instructions": getattr(rep, "n_instructions", None),
            "outputs": getattr(rep, "outputs", None)}


def run_measured(case, inputs, *, warmup: int, repeats: int, profile_dir=None) -> dict:
    """Device time of one case (see bench/device.py)."""
    from nki_kernels.bench import device
    m = device.measure(case, inputs, warmup=warmup, repeats=repeats, profile_dir=profile_dir)
    return {"time_ns": m.time_ns, "host_ns": m.host_ns, "method": m.method, "neffs": m.neffs,
            "profile": m.profile, "notes": m.notes}


def make_row(case, target: str, source: str, res: dict | None, *, sha: str, date: str,
             error: str | None = None) -> dict:
    """One result line. ``res`` is what run_modeled / run_measured returned (None on error)."""
    row = {
        "op": case.op, "shape": case.shape, "dims": dict(case.dims), "dtype": case.dtype,
        "target": target, "lnc": case.lnc, "source": source,
        "time_us": None, "tflops": None, "gbps": None, "pct_roof": None, "roof": None,
        "model_bound": None, "pct_tensor": None, "pct_hbm": None,
        "ai": (case.flops / case.bytes) if case.bytes else None,
        "flops": case.flops, "bytes": case.bytes, "roof_kind": case.roof_kind,
        "goal": case.goal_for(target), "git_sha": sha, "date": date,
    }
    if error is not None or res is None:
        row["error"] = error or "no result"
        return row
    time_s = res["time_ns"] * 1e-9
    eng = res.get("binding_engine")
    if eng:
        # reported beside the roof, never used as one: an engine's busy time measures how the
        # kernel spends it, so counting it as a roof would reward wasted work
        row["model_bound"] = roofline.ENGINE_NAMES.get(eng, str(eng))
    pt = roofline.roof_point(case.flops, case.bytes, time_s, target, case.roof_kind, case.lnc,
                             case.ceilings)
    row.update(time_us=res["time_ns"] / 1e3, tflops=pt.tflops, gbps=pt.gbps,
               pct_roof=pt.pct_roof, roof=pt.roof, pct_tensor=pt.pct_tensor, pct_hbm=pt.pct_hbm,
               short=res["time_ns"] / 1e3 < SHORT_KERNEL_US)
    if "engine_busy_ns" in res:
        row["engine_busy_us"] = {k: v / 1e3 for k, v in res["engine_busy_ns"].items()}
        row["n_instructions"] = res.get("n_instructions")
    for k in ("host_ns", "method", "neffs", "profile", "notes"):
        if res.get(k) is not None:
            row["host_us" if k == "host_ns" else k] = (res[k] / 1e3 if k == "host_ns" else res[k])
    return row


def check_output(case, inputs, output) -> str:
    """Compare one case's output with its reference: "passed", "none" (the definition has no
    check); raises AssertionError (or what the check raises) when they differ."""
    if case.check is None:
        return "none"
    case.check(inputs, output)
    return "passed"


def run(ops=None, tier: str = DEFAULT_TIER, target: str = "trn3", *,
        measured: bool | None = None, shape: str | None = None, dtype: str | None = None,
        seed: int = 0, warmup: int = 5,
        repeats: int = 20, profile_dir=None, progress: bool = True, cases=None,
        check: bool = False, on_row=None) -> list[dict]:
    """Run the bench and return its rows (nothing is written; see ``write``).

    ``measured``: None follows the backend (hardware -> measured, emulator -> modeled); True
    requires a Neuron device (``device.NoDeviceError`` otherwise); False requires the emulator.
    ``cases`` overrides the selection (a list of BenchCase). ``check``: compare each case's
    output with the NumPy reference (the modeled run's own output; on a device, one extra call)
    and post no number for a case whose output is wrong. ``on_row(row)`` is called as each case
    finishes (the CLI appends it to the JSON lines at once, so a long run that is stopped keeps
    what it measured).
    """
    roofline._target(target)  # validate early
    backend = backend_name()
    if measured is None:
        measured = backend == "hardware"
    if measured:
        from nki_kernels.bench import device
        device.require()
    elif backend != "emulator":
        raise BenchError(f"modeled time needs the emulator backend, but NKI_KERNELS_BACKEND "
                         f"selects {backend!r}; run with NKI_KERNELS_BACKEND=emulator (or "
                         f"`nki-kernels bench --modeled`), or pass --measured on a device")
    selected = list(cases) if cases is not None else select(ops, tier, target, shape, dtype)
    source = "measured" if measured else "modeled"
    sha, date = git_sha(), now_iso()
    rows = []
    bar = Progress(len(selected), enabled=progress)
    for i, case in enumerate(selected):
        bar.start(i, f"{case.op} {case.shape} {case.dtype}")
        inputs = None
        try:
            inputs = case.make_inputs(case_rng(case, seed))
            checked = None
            if measured:
                if check:
                    checked = _checked(case, inputs, case.run(*inputs))
                res = run_measured(case, inputs, warmup=warmup, repeats=repeats,
                                   profile_dir=profile_dir)
            else:
                res = run_modeled(case, target, inputs)
                out = res.pop("outputs", None)
                if check:
                    checked = _checked(case, inputs, out)
                del out
            row = make_row(case, target, source, res, sha=sha, date=date)
            if checked is not None:
                row["check"] = checked
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
            row = make_row(case, target, source, None, sha=sha, date=date,
                           error=f"{type(e).__name__}: {e}")
        del inputs
        rows.append(row)
        if on_row is not None:
            on_row(row)
        bar.done(i, row)
    bar.close()
    return rows


class WrongResult(AssertionError):
    """The op's output differs from its reference: the case posts no number."""


def _checked(case, inputs, output) -> str:
    try:
        return check_output(case, inputs, output)
    except AssertionError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise WrongResult(f"output differs from the reference: {msg}") from None


# ---------------------------------------------------------------------------------- outputs


def write_jsonl(rows, path) -> Path:
    """Append ``rows`` to the JSON-lines file ``path`` (one object per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r, default=_json_default, sort_keys=False) + "\n")
    return path


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, Path):
        return str(x)
    return str(x)


def _fmt(v, spec):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def goal_cell(pct, goal) -> str:
    """``≥ 80% ✓`` when met, ``≥ 80% ✗ miss`` when missed, ``-`` when no goal is set."""
    if goal is None:
        return "-"
    if pct is None:
        return f"≥ {goal:g}% (no result)"
    return f"≥ {goal:g}% ✓" if pct >= goal else f"≥ {goal:g}% ✗ miss"


def markdown_table(rows, *, tier: str | None = None) -> str:
    """The markdown report of ``rows``: header (target, date, sha, denominators), one table."""
    if not rows:
        return "_no bench rows_\n"
    targets = sorted({r["target"] for r in rows})
    sources = sorted({r["source"] for r in rows})
    kinds = {r["roof_kind"] for r in rows}
    shas = sorted({r["git_sha"] for r in rows})
    dates = sorted({r["date"][:10] for r in rows})
    lines = [
        f"# nki-kernels bench: {', '.join(targets)}" + (f", tier {tier}" if tier else ""),
        "",
        f"{' to '.join(dict.fromkeys([dates[0], dates[-1]]))}, git {', '.join(shas)}, time "
        f"{' / '.join(sources)} "
        f"({'emulator cost model' if sources == ['modeled'] else 'Neuron device'}).",
        "Denominators per NeuronCore x cores used (LNC): TensorE "
        + ", ".join(f"{k} {roofline.peak_tflops(t, k):g} TF ({t})" for t in targets
                    for k in roofline.KINDS if k in kinds and roofline._supported(t, k))
        + "; memory " + ", ".join(f"{roofline.hbm_bw(t):g} GB/s ({t})" for t in targets)
        + " = min(HBM share, DMA peak).",
        "",
        "| op | shape | dims | dtype | target | LNC | time (us) | TFLOP/s | GB/s | % of roof | "
        "binding roof | bound in model | source | goal |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for r in rows:
        dims = " ".join(f"{k}={v}" for k, v in r["dims"].items())
        if r.get("error"):
            lines.append(f"| {r['op']} | {r['shape']} | {dims} | {r['dtype']} | {r['target']} | "
                         f"{r['lnc']} | error | | | | | | {r['source']} | "
                         f"{goal_cell(None, r.get('goal'))} |")
            continue
        t = _fmt(r["time_us"], ".2f") + (" †" if r.get("short") else "")
        lines.append(
            f"| {r['op']} | {r['shape']} | {dims} | {r['dtype']} | {r['target']} | {r['lnc']} | "
            f"{t} | "
            f"{_fmt(r['tflops'], '.2f')} | {_fmt(r['gbps'], '.1f')} | "
            f"{_fmt(r['pct_roof'], '.1f')} | {r['roof']} | {r.get('model_bound') or '-'} | "
            f"{r['source']} | {goal_cell(r['pct_roof'], r.get('goal'))} |")
    notes = []
    if any(r.get("short") for r in rows):
        notes.append(f"† shorter than {SHORT_KERNEL_US:g} us: fixed launch overhead and the "
                     f"TensorE dI/dt ramp dominate such kernels on hardware.")
    if any(r.get("check") == "passed" for r in rows):
        notes.append("Outputs checked against the NumPy reference (--check).")
    errs = [r for r in rows if r.get("error")]
    if errs:
        notes.append("Errors:")
        notes += [f"- {r['op']} {r['shape']} {r['dtype']}: {r['error']}" for r in errs]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def write(rows, out_dir=None, *, json_path=None, tier: str | None = None,
          plot: bool = True, subset: bool = False, append_json: bool = True) -> dict:
    """Write the JSON lines (appended), the markdown table and the roofline PNG of ``rows``
    under ``out_dir`` (default ``bench/results/local``). ``subset``: the run left out some ops
    or shapes of the tier, so its table and plot get their own ``_subset`` names and never
    replace a full table. ``append_json=False``: the JSON lines were appended already (as the cases
    ran). Returns {"json": path, "markdown": path, "plot": path or None}."""
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    jpath = Path(json_path or out / "results.jsonl")
    paths = {"json": write_jsonl(rows, jpath) if append_json else jpath}
    targets = sorted({r["target"] for r in rows}) or ["trn3"]
    tag = "_".join(targets) + (f"_{tier}" if tier else "") + ("_subset" if subset else "")
    md = out / f"bench_{tag}.md"
    md.write_text(markdown_table(rows, tier=tier))
    paths["markdown"] = md
    paths["plot"] = None
    if plot:
        png = out / f"roofline_{tag}.png"
        if roofline.plot(rows, png, targets[0], title=_plot_title(targets[0], tier)):
            paths["plot"] = png
    return paths


def _plot_title(target, tier):
    return f"nki-kernels roofline, {target}" + (f", tier {tier}" if tier else "") + \
        " (modeled unless marked; per NeuronCore)"


# ------------------------------------------------------------------------------- publishing


def row_key(r) -> tuple:
    return (r["op"], r["shape"], r["dtype"], r.get("lnc", 1))


def read_jsonl(path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def publish(rows, tier: str, target: str, out_dir=None, *, allow_dirty: bool = False,
            plot: bool = True) -> dict:
    """Merge ``rows`` into the published table of (tier, target) and rewrite it.

    The published JSON holds one row per case of the tier (``bench/published/<tier>_<target>
    .jsonl``); rows of this run replace the rows of the same cases, the others are kept, and
    rows of cases the tier no longer has are dropped. So a run of one op or shape refreshes those
    rows and never replaces the full table. Refuses rows stamped ``+dirty`` or ``unknown``
    (uncommitted code) and rows not checked against the reference unless ``allow_dirty``, and
    rows that failed. Returns {"json", "markdown", "plot"} paths.
    """
    out = Path(out_dir) if out_dir is not None else published_dir()
    for r in rows:
        if r["target"] != target:
            raise BenchError(f"publish: row of target {r['target']} in a {target} table")
        if not allow_dirty and (r["git_sha"].endswith("+dirty") or r["git_sha"] == "unknown"):
            raise BenchError(
                f"publish: the code differs from git HEAD (sha {r['git_sha']}); commit first "
                f"(published numbers name the commit that made them), or pass --allow-dirty")
        if r.get("error"):
            raise BenchError(f"publish: {r['op']} {r['shape']} {r['dtype']} failed: {r['error']}")
        if r.get("check") != "passed" and not allow_dirty:
            raise BenchError(f"publish: {r['op']} {r['shape']} {r['dtype']} was not checked "
                             f"against the reference (check: {r.get('check')})")
    jpath = out / f"{tier}_{target}.jsonl"
    known = [row_key({"op": c.op, "shape": c.shape, "dtype": c.dtype, "lnc": c.lnc})
             for c in select(None, tier, target)]
    merged = {row_key(r): r for r in read_jsonl(jpath)}
    merged.update({row_key(r): r for r in rows})
    order = {k: i for i, k in enumerate(known)}
    kept = sorted((r for k, r in merged.items() if k in order), key=lambda r: order[row_key(r)])
    out.mkdir(parents=True, exist_ok=True)
    jpath.write_text("".join(json.dumps(r, default=_json_default) + "\n" for r in kept))
    md = out / f"{tier}_{target}.md"
    md.write_text(markdown_table(kept, tier=tier))
    paths = {"json": jpath, "markdown": md, "plot": None}
    if plot:
        png = out / f"roofline_{tier}_{target}.png"
        if roofline.plot(kept, png, target, title=_plot_title(target, tier)):
            paths["plot"] = png
    return paths


# ---------------------------------------------------------------------- README performance table

README_BEGIN = "<!-- performance table: generated by `nki-kernels bench --readme`; do not edit -->"
README_END = "<!-- end of generated performance table -->"


def _achieved(r) -> str:
    if r["roof"] and r["roof"].startswith("TensorE"):
        return f"{r['tflops']:.1f} TF/s"
    return f"{r['gbps']:.0f} GB/s"


def readme_table(published=None, tier: str = "models", targets=("trn2", "trn3")) -> str:
    """The README's performance table: every row of the published ``tier`` tables, one line per
    case with each target's time, achieved rate and % of roof, and the goal met or missed."""
    src = Path(published) if published is not None else published_dir()
    per = {t: {row_key(r): r for r in read_jsonl(src / f"{tier}_{t}.jsonl")} for t in targets}
    defined = {t: [row_key({"op": c.op, "shape": c.shape, "dtype": c.dtype, "lnc": c.lnc})
                   for c in select(None, tier, t)] for t in targets}
    keys = {}                                       # ordered set: trn3's order first
    for t in reversed(targets):                     # (it has every op)
        keys.update(dict.fromkeys(defined[t] + list(per[t])))
    rows = [r for t in targets for r in per[t].values()]
    if not rows:
        return "_no published bench rows: run `make publish`_\n"
    shas = sorted({r["git_sha"] for r in rows})
    if len(shas) > 3:                               # runs spread over commits: first and last
        by_date = [r["git_sha"] for r in sorted(rows, key=lambda r: r["date"])]
        shas = [f"{by_date[0]} to {by_date[-1]} ({len(shas)} commits)"]
    dates = sorted({r["date"][:10] for r in rows})
    head = " | ".join(f"{t}: time (us) | {t}: achieved | {t}: % of roof" for t in targets)
    checked = sum(r.get("check") == "passed" for r in rows)
    checked_txt = ("every case's output checked against the NumPy reference" if checked == len(rows)
                   else f"{checked} of {len(rows)} rows checked against the NumPy reference")
    lines = [
        f"Modeled on {' to '.join(dict.fromkeys([dates[0], dates[-1]]))} with the code of git "
        f"{', '.join(shas)}; tier `{tier}`; {checked_txt}; launch overhead charged per call: "
        f"{_launch_txt(targets)}. Full tables: `bench/published/`.",
        "",
        f"| op | shape | dtype | {head} | roof | bound in model | goal (% of roof) |",
        "|---|---|---|" + "---:|---:|---:|" * len(targets) + "---|---|---|",
    ]
    for k in keys:
        op, shape, dtype, lnc = k
        cells, roofs, bounds, goals = [], [], [], []
        for t in targets:
            r = per[t].get(k)
            if r is None:
                cells.append(("not run" if k in defined[t] else "n/a") + " | | ")
                continue
            if r.get("error"):
                cells.append("error | | ")
                goals.append(f"{t} no result")
                continue
            cells.append(f"{r['time_us']:.1f} | {_achieved(r)} | {r['pct_roof']:.1f}")
            roofs.append(r["roof"])
            bounds.append(r.get("model_bound") or "-")
            if r.get("goal") is not None:
                mark = "✓" if r["pct_roof"] >= r["goal"] else "✗ **miss**"
                goals.append((t, r["goal"], mark))
        goal = "-"
        if goals:
            g = {x[1] for x in goals if isinstance(x, tuple)}
            gtxt = "/".join(f"≥ {v:g}" for v in sorted(g))
            marks = [f"{t} {m}" for (t, _, m) in (x for x in goals if isinstance(x, tuple))]
            marks += [x for x in goals if isinstance(x, str)]
            goal = f"{gtxt}: {', '.join(marks)}"
        lnc_txt = f" LNC={lnc}" if lnc != 1 else ""
        lines.append(f"| {op} | {shape} | {dtype}{lnc_txt} | {' | '.join(cells)} | "
                     f"{' / '.join(dict.fromkeys(roofs)) or '-'} | "
                     f"{' / '.join(dict.fromkeys(bounds)) or '-'} | {goal} |")
    if any("| not run |" in ln for ln in lines):
        lines += ["", "_not run_: a case of the tier that has no published row yet (`make publish` "
                  "runs them all)."]
    return "\n".join(lines) + "\n"


def _launch_txt(targets) -> str:
    try:
        from nki_kernels import hardware
        return ", ".join(f"{hardware.generation(t).cost.launch_ns / 1e3:g} us ({t})"
                         for t in targets)
    except (ImportError, AttributeError, KeyError, ValueError):
        return "see docs/cost-model.md"


def update_readme(readme=None, published=None) -> bool:
    """Rewrite the generated performance table of the README in place; True when it changed."""
    path = Path(readme) if readme is not None else repo_root() / "README.md"
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise BenchError(f"{path} has no generated-table markers ({README_BEGIN!r} ... "
                         f"{README_END!r})")
    a = text.index(README_BEGIN) + len(README_BEGIN)
    b = text.index(README_END)
    new = text[:a] + "\n" + readme_table(published) + text[b:]
    if new != text:
        path.write_text(new)
    return new != text


# --------------------------------------------------------------------------------- progress


class Progress:
    """A plain stderr progress bar: redrawn in place on a terminal, one line per case otherwise."""

    def __init__(self, total: int, stream=None, enabled: bool = True, width: int = 28):
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.t_case = self.t0
        self.errors = 0

    def _bar(self, done: int) -> str:
        fill = int(self.width * done / max(1, self.total))
        return "[" + "#" * fill + "." * (self.width - fill) + f"] {done}/{self.total}"

    def start(self, i: int, label: str):
        self.t_case = time.perf_counter()
        if self.enabled and self.tty:
            elapsed = self.t_case - self.t0
            msg = f"\r{self._bar(i)} {elapsed:5.0f}s  {label}"
            self.stream.write(msg[:120].ljust(120))
            self.stream.flush()

    def done(self, i: int, row: dict):
        if row.get("error"):
            self.errors += 1
        if self.enabled and not self.tty:
            dt = time.perf_counter() - self.t_case
            what = "ERROR" if row.get("error") else f"{row['time_us']:.1f} us"
            self.stream.write(f"{self._bar(i + 1)} {row['op']} {row['shape']} {row['dtype']}: "
                              f"{what} ({dt:.1f} s)\n")
            self.stream.flush()

    def close(self):
        if not self.enabled:
            return
        total = time.perf_counter() - self.t0
        end = f"{self._bar(self.total)} done in {total:.0f}s"
        if self.errors:
            end += f", {self.errors} error(s)"
        self.stream.write(("\r" + end.ljust(120) if self.tty else end) + "\n")
        self.stream.flush()
