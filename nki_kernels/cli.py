"""The ``nki-kernels`` command line.

    nki-kernels bench                       # default tier (real model shapes), Trn3
    nki-kernels bench --tier fast           # toy shapes: a smoke run
    nki-kernels bench --target trn2 --op matmul --tier models --json out.jsonl
    nki-kernels bench --tier models --publish   # the published tables (bench/published)
    nki-kernels bench --readme              # regenerate the README table from bench/published
    nki-kernels bench --list                # what would run (all tiers unless --tier)
    nki-kernels bench --measured            # on a trn2/trn3 instance: device time
    nki-kernels profile flash_attention --shape "llama-3-8b S=8192" --tier models
    nki-kernels profile path/to/mod.py:kernel --arg 128x512:bfloat16   # any jitted kernel

See docs/bench.md and docs/profiling.md.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

TARGETS = ("trn3", "trn2")
TIERS = ("default", "fast", "odd", "models")
TIER_HELP = ("shape tier from reference/shapes.py: default = one or two real model shapes per "
             "op (a few minutes on one core); fast = toy shapes (a smoke run); odd = edge "
             "sizes; models = every model shape (tens of minutes per target on one core: the "
             "T = 8192 prefill cases take minutes each; it grows with the ops registered). "
             "--list without --tier: all tiers")


def _parser() -> argparse.ArgumentParser:
    from nki_kernels import __version__
    p = argparse.ArgumentParser(prog="nki-kernels",
                                description="NKI kernels for AWS Trainium: bench and tools.")
    p.add_argument("--version", action="version", version=f"nki-kernels {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    b = sub.add_parser(
        "bench", help="time the kernels and place them on the Trn2/Trn3 roofline",
        description="Run the registered bench cases (bench/defs) for one target and tier; write "
                    "JSON lines, a markdown table and a roofline PNG under bench/results/local/ "
                    "(ignored by git) or --out. Times are modeled (the emulator's cost model) "
                    "unless --measured on a Neuron device.")
    b.add_argument("--target", choices=TARGETS, default="trn3",
                   help="roofline and cost-model target (default trn3)")
    b.add_argument("--op", action="append", metavar="NAME",
                   help="only this op (repeat or comma-separate for several; default all)")
    b.add_argument("--shape", metavar="TEXT",
                   help="only shapes whose name contains TEXT (e.g. '2048^3', 'llama-3-8b')")
    b.add_argument("--dtype", metavar="TEXT",
                   help="only cases whose dtype label contains TEXT (e.g. 'fp8', 'bf16')")
    b.add_argument("--tier", choices=TIERS, default=None, help=TIER_HELP)
    b.add_argument("--json", metavar="PATH", type=Path,
                   help="JSON-lines file to append to (default <out>/results.jsonl)")
    b.add_argument("--out", metavar="DIR", type=Path,
                   help="directory for the JSON lines, the markdown table and the plot "
                        "(default bench/results/local, ignored by git)")
    chk = b.add_mutually_exclusive_group()
    chk.add_argument("--check", dest="check", action="store_true", default=None,
                     help="compare each case's output with the NumPy reference; a wrong output "
                          "posts no number (default: on when CI is set, and with --publish)")
    chk.add_argument("--no-check", dest="check", action="store_false",
                     help="do not compare outputs with the reference")
    b.add_argument("--publish", action="store_true",
                   help="also merge the rows into the published table bench/published/"
                        "<tier>_<target>.jsonl/.md/.png (needs committed code: a clean git sha; "
                        "a run of some ops or shapes replaces only their rows)")
    b.add_argument("--allow-dirty", action="store_true",
                   help="--publish even when the code differs from git HEAD (sha marked +dirty)")
    b.add_argument("--readme", action="store_true",
                   help="regenerate the README performance table from bench/published/"
                        "models_<target>.jsonl and exit (runs nothing)")
    mode = b.add_mutually_exclusive_group()
    mode.add_argument("--measured", action="store_true",
                      help="device time on a Neuron device; fails plainly when none is present")
    mode.add_argument("--modeled", action="store_true",
                      help="cost-model time on the emulator even where the real nki is installed")
    b.add_argument("--warmup", type=int, default=5, help="measured: warm-up runs (default 5)")
    b.add_argument("--repeats", type=int, default=20, help="measured: timed runs (default 20)")
    b.add_argument("--profile", action="store_true",
                   help="write a profile of each row: the modeled timeline (trace JSON and "
                        "summary, docs/profiling.md); measured: a neuron-explorer capture")
    b.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    b.add_argument("--list", action="store_true", help="list the cases and exit")
    b.add_argument("--no-plot", action="store_true", help="skip the roofline PNG")
    b.add_argument("--quiet", action="store_true", help="no progress bar, no table on stdout")
    b.add_argument("--vs-nkilib", metavar="PATH", default=None,
                   help="run AWS NKI Library's kernel for the same problem beside ours (PATH: a "
                        "checkout of github.com/aws-neuron/nki-library); both outputs checked, "
                        "both times (modeled) and the ratio; see docs/bench.md")
    _profile_parser(sub)
    sub.add_parser(
        "simulate-suite", help="run an NKI project's pytest suite on the emulator",
        description="nki-kernels simulate-suite PATH [--nki-version 0.3] [--target trn2] -- "
                    "PYTEST_ARGS: run the project's tests (NKI Library: its --test-mode simulation) "
                    "on the nki-kernels emulator; see docs/conformance.md.")
    sub.add_parser(
        "calibrate", help="model published third-party kernels and compare with their measurements",
        description="nki-kernels calibrate --kernels DIR [--set NAME=VALUE] [--print-fetch]: the "
                    "cost model against published hardware figures; see docs/cost-model.md.")
    return p


def _ops(values):
    if not values:
        return None
    return [name.strip() for v in values for name in v.split(",") if name.strip()]


def main(argv=None) -> int:
    from nki_kernels.backend import BackendUnavailable, require
    try:
        require()
    except BackendUnavailable as e:
        print(f"nki-kernels: {e}", file=sys.stderr)
        return 2
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["calibrate"]:       # its own parser (nki_kernels.bench.calibrate)
        from nki_kernels.bench.calibrate import main as calibrate
        return calibrate(raw[1:])
    if raw[:1] == ["simulate-suite"]:  # everything after PATH goes to pytest: no argparse here
        from nki_kernels.emulator.pytest_plugin import main as simulate_suite
        return simulate_suite(raw[1:])
    args = _parser().parse_args(argv)
    if args.command == "profile":
        return _profile(args)
    if args.command != "bench":
        _parser().print_help(sys.stderr)
        return 2
    return _bench(args)


def _bench(args) -> int:
    # Both choices must be made before nki_kernels.backend (and so `nki`) is imported.
    if args.modeled:
        os.environ["NKI_KERNELS_BACKEND"] = "emulator"
    out_dir = args.out
    if args.measured and not args.list:
        from nki_kernels.bench.harness import default_out_dir
        art = (out_dir or default_out_dir()) / "artifacts"
        os.environ.setdefault("NKI_ARTIFACTS_DIR", str(art.resolve()))
        from nki_kernels.bench import device
        ok, why = device.status()
        if not ok:
            print(f"nki-kernels bench --measured: {why}.\n{device.NO_DEVICE_HELP}",
                  file=sys.stderr)
            return 2
        print(f"nki-kernels bench: measuring on {why}", file=sys.stderr)
    if args.vs_nkilib is not None:             # our kernels beside NKI Library's
        from nki_kernels.bench import vs_nkilib
        return vs_nkilib.main(args)

    from nki_kernels.bench import defs, harness
    ops = _ops(args.op)
    if args.readme:
        try:
            changed = harness.update_readme()
        except harness.BenchError as e:
            print(f"nki-kernels bench --readme: {e}", file=sys.stderr)
            return 2
        print(f"README.md performance table {'regenerated' if changed else 'unchanged'} from "
              f"{harness.published_dir()}", file=sys.stderr)
        return 0
    if args.list:
        return _list(ops, args.tier, args.target, args.shape, args.dtype)
    tier = args.tier or harness.DEFAULT_TIER
    check = args.check
    if check is None:
        check = bool(os.environ.get("CI")) or args.publish
    if args.publish and not check:
        print("nki-kernels bench: --publish checks every output; drop --no-check",
              file=sys.stderr)
        return 2
    json_path = args.json or (out_dir or harness.default_out_dir()) / "results.jsonl"
    run = harness.run
    if args.profile and not args.measured:
        run = _profiled_bench(harness, (out_dir or harness.default_out_dir()) / "profiles",
                              quiet=args.quiet)
    try:
        rows = run(ops, tier, args.target, measured=True if args.measured else None,
                           shape=args.shape, dtype=args.dtype,
                           seed=args.seed, warmup=args.warmup, repeats=args.repeats,
                           profile_dir=(out_dir or harness.default_out_dir()) / "profiles"
                           if args.profile else None,
                           progress=not args.quiet, check=check,
                           on_row=lambda r: harness.write_jsonl([r], json_path))
    except (harness.BenchError, KeyError) as e:
        print(f"nki-kernels bench: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - NoDeviceError, BackendUnavailable: say it plainly
        from nki_kernels.bench.device import NoDeviceError
        if isinstance(e, NoDeviceError) or type(e).__name__ == "BackendUnavailable":
            print(f"nki-kernels bench: {e}", file=sys.stderr)
            return 2
        raise
    if not rows:
        print(f"nki-kernels bench: no cases for ops={ops or 'all'} tier={tier}"
              + (f" shape~{args.shape!r}" if args.shape else "")
              + (f" dtype~{args.dtype!r}" if args.dtype else ""), file=sys.stderr)
        return 2
    subset = bool(ops or args.shape or args.dtype)
    paths = harness.write(rows, out_dir, json_path=json_path, tier=tier, plot=not args.no_plot,
                          subset=subset, append_json=False)
    if not args.quiet:
        print(harness.markdown_table(rows, tier=tier))
    if paths["plot"]:
        plot = f", {paths['plot']}"
    else:
        plot = "" if args.no_plot else " (no plot: pip install 'nki-kernels[bench]')"
    print(f"wrote {paths['json']} (appended), {paths['markdown']}{plot}", file=sys.stderr)
    if args.publish:
        try:
            pub = harness.publish(rows, tier, args.target, allow_dirty=args.allow_dirty,
                                  plot=not args.no_plot)
        except harness.BenchError as e:
            print(f"nki-kernels bench: {e}", file=sys.stderr)
            return 2
        print(f"published {pub['json']}, {pub['markdown']}"
              + (f", {pub['plot']}" if pub["plot"] else ""), file=sys.stderr)
    unavailable = defs.load()
    if unavailable and not ops:
        for mod, err in sorted(unavailable.items()):
            print(f"note: bench/defs/{mod}.py not loaded: {err}", file=sys.stderr)
    return 1 if any(r.get("error") for r in rows) else 0


def _list(ops, tier, target, shape=None, dtype=None) -> int:
    from nki_kernels.bench import defs, harness
    tiers = [tier] if tier else list(TIERS)
    n = 0
    for t in tiers:
        try:
            cases = harness.select(ops, t, target, shape, dtype)
        except harness.BenchError as e:
            print(f"nki-kernels bench: {e}", file=sys.stderr)
            return 2
        for c in cases:
            ai = f"{c.flops / c.bytes:8.1f}" if c.bytes else "       -"
            dtype = c.dtype + (f" LNC={c.lnc}" if c.lnc != 1 else "")
            print(f"{c.op:<16} {t:<7} {c.shape:<34} {c.dims_str:<30} {dtype:<12} "
                  f"AI {ai}  {c.flops / 1e9:10.3f} GFLOP  {c.bytes / 1e6:9.3f} MB")
            n += 1
    print(f"{n} case(s); target {target}; ops: {', '.join(defs.registered()) or 'none'}",
          file=sys.stderr)
    for mod, err in sorted(defs.load().items()):
        print(f"not loaded: bench/defs/{mod}.py ({err})", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------ profile
def _profile_parser(sub):
    p = sub.add_parser(
        "profile", help="engine timeline of a kernel (modeled; --device: neuron-explorer)",
        description="Model an op's bench case (or any jitted kernel) on the emulator and write its "
                    "engine timeline as Chrome/Perfetto trace JSON (ui.perfetto.dev) with a printed "
                    "summary: per-engine busy/idle, critical path, top instructions, DMA "
                    "efficiency, roofline position. All times modeled. See docs/profiling.md.")
    p.add_argument("op", metavar="OP",
                   help="a bench op (nki-kernels bench --list), or a kernel given as "
                        "path/to/module.py:name or package.module:name")
    p.add_argument("--shape", metavar="TEXT", help="only bench shapes whose name contains TEXT")
    p.add_argument("--dtype", metavar="TEXT",
                   help="only bench cases whose dtype label contains TEXT (e.g. 'fp8', 'bf16')")
    p.add_argument("--tier", choices=TIERS, default=None, help="shape tier (default fast)")
    p.add_argument("--target", choices=TARGETS, default="trn3", help="default trn3")
    p.add_argument("--out", metavar="DIR", type=Path,
                   help="output directory (default bench/results/profiles)")
    p.add_argument("--arg", action="append", default=[], metavar="SPEC",
                   help="module kernels: one input, in order, or NAME=SPEC for a keyword: "
                        "SHAPE[:DTYPE] for a random array (128x512:bfloat16; dtype default "
                        "bfloat16) or a Python literal (3, True, 'causal'); without --arg the "
                        "module's profile_inputs() supplies them")
    p.add_argument("--lnc", type=int, choices=(1, 2), default=None,
                   help="bench cases: only those launched at this LNC; module kernels: the LNC "
                        "to launch at (default 1)")
    p.add_argument("--max-events", type=int, default=None, metavar="N",
                   help="aggregate the trace past N boxes (default 100000)")
    p.add_argument("--top", type=int, default=12, help="rows of the top-instructions table")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument("--device", action="store_true",
                   help="on a trn instance: capture with neuron-explorer / neuron-profile and "
                        "print the device summary beside the modeled one")
    p.add_argument("--png", nargs="?", const="", metavar="T0:T1",
                   help="also draw the timeline as a Gantt PNG (matplotlib), optionally only the "
                        "window T0:T1 in us")
    p.add_argument("--quiet", action="store_true", help="no summary on stdout")


def _profile(args) -> int:
    import json

    from nki_kernels.emulator import profile as prof
    out_dir = args.out
    if args.device:
        return _profile_device(args)
    os.environ.setdefault("NKI_KERNELS_BACKEND", "emulator")
    try:
        jobs = _profile_jobs(args)
    except (ValueError, KeyError, ImportError, AttributeError, OSError) as e:
        print(f"nki-kernels profile: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    if out_dir is None:
        from nki_kernels.bench.harness import default_out_dir
        out_dir = default_out_dir() / "profiles"
    from nki_kernels.emulator import target as emulated_target
    kw = {"max_events": args.max_events} if args.max_events else {}
    for label, fn, fargs, fkw, lnc in jobs:
        with emulated_target(args.target):
            p = prof.profile(fn, *fargs, target=args.target, lnc=lnc, name=label, **kw, **fkw)
        paths = p.write(out_dir, f"{prof.slug(label)}_{args.target}")
        if args.png is not None:
            t0, _, t1 = args.png.partition(":")
            png = paths["trace"].with_name(paths["trace"].name.replace(".trace.json", ".png"))
            prof.gantt(json.loads(paths["trace"].read_text()), png,
                       t0_us=float(t0) if t0 else None, t1_us=float(t1) if t1 else None)
            print(f"wrote {png}", file=sys.stderr)
        if not args.quiet:
            print(p.summary(args.top) + "\n")
        print(f"wrote {paths['trace']} (open in ui.perfetto.dev), {paths['summary']}",
              file=sys.stderr)
    return 0


def _profile_jobs(args):
    """[(label, callable, args, kwargs, lnc)] for a bench op or a module kernel."""
    if ":" in args.op:
        return [_module_job(args)]
    from nki_kernels.bench import harness
    tier = args.tier or getattr(harness, "DEFAULT_TIER", "fast")
    try:
        cases = harness.select([args.op], tier, args.target, args.shape, args.dtype)
    except harness.BenchError as e:
        raise ValueError(f"{e} (or give a kernel as path/to/module.py:name)") from None
    cases = [c for c in cases if args.lnc is None or c.lnc == args.lnc]
    if not cases:
        raise ValueError(f"no {args.op} case in tier {tier}"
                         + (f" with a shape containing {args.shape!r}" if args.shape else "")
                         + (f" and a dtype containing {args.dtype!r}" if args.dtype else "")
                         + (f" at LNC {args.lnc}" if args.lnc else "")
                         + "; see nki-kernels bench --list --op " + args.op)
    return [(f"{c.op} {c.shape} {c.dtype}" + (f" LNC={c.lnc}" if c.lnc > 1 else ""), c.run,
             c.make_inputs(harness.case_rng(c, args.seed)), {}, c.lnc) for c in cases]


def _module_job(args):
    import importlib
    import importlib.util

    from nki_kernels import emulator
    emulator.install(force=True)            # third-party kernels `import nki`: the emulator
    mod_name, _, kname = args.op.rpartition(":")
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.is_file():
            raise OSError(f"no such file: {path}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(mod_name)
    if not hasattr(mod, kname):
        raise AttributeError(f"{mod_name} has no kernel {kname!r}")
    fn = getattr(mod, kname)
    if not isinstance(fn, emulator.Kernel):
        fn = emulator.jit(fn)
    rng = __import__("numpy").random.default_rng(args.seed)
    if args.arg:
        pos, kw = [], {}
        for spec in args.arg:
            name, eq, val = spec.partition("=")
            if eq and name.isidentifier():
                kw[name] = _input(val, rng)
            else:
                pos.append(_input(spec, rng))
        fargs = tuple(pos)
    elif hasattr(mod, "profile_inputs"):
        got = mod.profile_inputs()
        fargs, kw = (tuple(got[0]), dict(got[1])) if (
            isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict)) else (
            tuple(got), {})
    else:
        raise ValueError(f"{args.op}: no inputs; pass --arg SHAPE[:DTYPE] per kernel argument "
                         f"or define profile_inputs() in the module (docs/profiling.md)")
    return (kname, fn, fargs, kw, args.lnc or 1)


def _input(spec, rng):
    """SHAPE[:DTYPE] -> random array (normal; integers in [0, 128)); else a Python literal."""
    import ast
    import re

    import numpy as np
    m = re.fullmatch(r"(\d+(?:x\d+)*)(?::(\w+))?", spec.strip())
    if not m:
        try:
            return ast.literal_eval(spec)
        except (ValueError, SyntaxError):
            raise ValueError(f"--arg {spec!r}: expected SHAPE[:DTYPE] (e.g. 128x512:bfloat16) "
                             f"or a Python literal") from None
    shape = tuple(int(d) for d in m.group(1).split("x"))
    name = m.group(2) or "bfloat16"
    import ml_dtypes
    try:
        dt = np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
    except TypeError:
        raise ValueError(f"--arg {spec!r}: unknown dtype {name!r}") from None
    if dt.kind in "iub":
        return rng.integers(0, 128, size=shape).astype(dt)
    return rng.standard_normal(shape).astype(np.float32).astype(dt)


def _profiled_bench(harness, profile_dir, quiet=False):
    """harness.run, one case at a time, writing each modeled row's profile (bench --profile)."""
    from nki_kernels.emulator import profile as prof

    def run(ops=None, tier="fast", target="trn3", **kw):
        if kw.get("measured") or harness.backend_name() != "emulator":
            return harness.run(ops, tier, target, **kw)     # device: neuron-explorer capture
        cases = kw.pop("cases", None) or harness.select(ops, tier, target, kw.get("shape"),
                                                      kw.get("dtype"))
        on_row = kw.pop("on_row", None)         # called once the row has its profile paths
        rows = []
        for c in cases:
            with prof.capture() as got:
                row = harness.run(ops, tier, target, **{**kw, "cases": [c]})[0]
            if got and not row.get("error"):
                trace, schedules, rep = got[-1]
                p = prof.Profile(trace, schedules, rep, name=f"{c.op} {c.shape} {c.dtype}")
                paths = p.write(profile_dir, f"{prof.slug(p.name)}_{target}")
                row["profile"] = {"modeled_trace": str(paths["trace"]),
                                  "modeled_summary": str(paths["summary"])}
                if not quiet:
                    print(f"profile: {paths['trace']}", file=sys.stderr)
            if on_row is not None:
                on_row(row)
            rows.append(row)
        return rows
    return run


def _profile_device(args) -> int:
    """neuron-explorer capture of a bench op on a trn instance, beside the modeled profile.
    Written from the Neuron docs (Neuron Explorer user guide); never run here (no device)."""
    import json
    import subprocess
    import time
    out_dir = args.out
    if out_dir is None:
        from nki_kernels.bench.harness import default_out_dir
        out_dir = default_out_dir() / "profiles"
    from nki_kernels.bench import device
    ok, why = device.status()
    if not ok:
        print(f"nki-kernels profile --device: {why}", file=sys.stderr)
        return 2
    if ":" in args.op:
        print("nki-kernels profile --device: give a bench op (module kernels: modeled only)",
              file=sys.stderr)
        return 2
    if not os.environ.get("NKI_ARTIFACTS_DIR"):   # nki reads it when imported: too late here
        print(f"nki-kernels profile --device: set NKI_ARTIFACTS_DIR (e.g. "
              f"{out_dir / 'artifacts'}) in the environment so that nki keeps the NEFF",
              file=sys.stderr)
        return 2
    if device.profiler() is None:
        print("nki-kernels profile --device: neither neuron-explorer nor neuron-profile is on PATH",
              file=sys.stderr)
        return 2
    from nki_kernels.bench import harness
    from nki_kernels.emulator import profile as prof
    tier = args.tier or getattr(harness, "DEFAULT_TIER", "fast")
    try:
        cases = harness.select([args.op], tier, args.target, args.shape)
    except harness.BenchError as e:
        print(f"nki-kernels profile --device: {e}", file=sys.stderr)
        return 2
    for c in cases:
        label = f"{c.op} {c.shape} {c.dtype}"
        stem = f"{prof.slug(label)}_{args.target}"
        inputs = c.make_inputs(harness.case_rng(c, args.seed))
        t0 = time.time()
        c.run(*inputs)                                   # compile + run: leaves the NEFF
        c.run(*inputs)
        neffs = device._new_neffs(os.environ["NKI_ARTIFACTS_DIR"], t0)
        if not neffs:
            print(f"nki-kernels profile --device: {label}: no NEFF was written", file=sys.stderr)
            return 1
        measured = device.capture_profile(neffs[-1], inputs, out_dir)
        (out_dir / f"{stem}.device.json").write_text(json.dumps(measured, indent=1))
        # the modeled side runs on the emulator, in a child process (kernels here are real nki)
        env = dict(os.environ, NKI_KERNELS_BACKEND="emulator")
        subprocess.run([sys.executable, "-m", "nki_kernels.cli", "profile", c.op, "--tier", tier,
                        "--target", args.target, "--shape", c.shape, "--out", str(out_dir),
                        "--quiet"], env=env, check=True)
        modeled = json.loads((out_dir / f"{stem}.summary.json").read_text())
        print(prof.side_by_side(measured, modeled, label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
