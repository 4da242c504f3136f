"""The ``nki-kernels`` command line.

    nki-kernels bench                       # FAST tier, all ops, Trn3, modeled on the emulator
    nki-kernels bench --target trn2 --op matmul --tier models --json out.jsonl
    nki-kernels bench --list                # what would run (all tiers unless --tier)
    nki-kernels bench --measured            # on a trn2/trn3 instance: device time

See docs/bench.md.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

TARGETS = ("trn3", "trn2")
TIERS = ("fast", "odd", "models")


def _parser() -> argparse.ArgumentParser:
    from nki_kernels import __version__
    p = argparse.ArgumentParser(prog="nki-kernels",
                                description="NKI kernels for AWS Trainium: bench and tools.")
    p.add_argument("--version", action="version", version=f"nki-kernels {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    b = sub.add_parser(
        "bench", help="time the kernels and place them on the Trn2/Trn3 roofline",
        description="Run the registered bench cases (bench/defs) for one target and tier; write "
                    "JSON lines, a markdown table and a roofline PNG under bench/results/.")
    b.add_argument("--target", choices=TARGETS, default="trn3",
                   help="roofline and cost-model target (default trn3)")
    b.add_argument("--op", action="append", metavar="NAME",
                   help="only this op (repeat or comma-separate for several; default all)")
    b.add_argument("--shape", metavar="TEXT",
                   help="only shapes whose name contains TEXT (e.g. '2048^3', 'llama-3-8b')")
    b.add_argument("--tier", choices=TIERS, default=None,
                   help="shape tier from reference/shapes.py (default fast; --list: all)")
    b.add_argument("--json", metavar="PATH", type=Path,
                   help="JSON-lines file to append to (default <out>/results.jsonl)")
    b.add_argument("--out", metavar="DIR", type=Path,
                   help="directory for the markdown table and the plot (default bench/results)")
    mode = b.add_mutually_exclusive_group()
    mode.add_argument("--measured", action="store_true",
                      help="device time on a Neuron device; fails plainly when none is present")
    mode.add_argument("--modeled", action="store_true",
                      help="cost-model time on the emulator even where the real nki is installed")
    b.add_argument("--warmup", type=int, default=5, help="measured: warm-up runs (default 5)")
    b.add_argument("--repeats", type=int, default=20, help="measured: timed runs (default 20)")
    b.add_argument("--profile", action="store_true",
                   help="measured: also capture a profile (neuron-explorer, 2nd execution)")
    b.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    b.add_argument("--list", action="store_true", help="list the cases and exit")
    b.add_argument("--no-plot", action="store_true", help="skip the roofline PNG")
    b.add_argument("--quiet", action="store_true", help="no progress bar, no table on stdout")
    return p


def _ops(values):
    if not values:
        return None
    return [name.strip() for v in values for name in v.split(",") if name.strip()]


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
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

    from nki_kernels.bench import defs, harness
    ops = _ops(args.op)
    if args.list:
        return _list(ops, args.tier, args.target, args.shape)
    tier = args.tier or "fast"
    try:
        rows = harness.run(ops, tier, args.target, measured=True if args.measured else None,
                           shape=args.shape,
                           seed=args.seed, warmup=args.warmup, repeats=args.repeats,
                           profile_dir=(out_dir or harness.default_out_dir()) / "profiles"
                           if args.profile else None,
                           progress=not args.quiet)
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
              + (f" shape~{args.shape!r}" if args.shape else ""), file=sys.stderr)
        return 2
    paths = harness.write(rows, out_dir, json_path=args.json, tier=tier, plot=not args.no_plot)
    if not args.quiet:
        print(harness.markdown_table(rows, tier=tier))
    if paths["plot"]:
        plot = f", {paths['plot']}"
    else:
        plot = "" if args.no_plot else " (no plot: pip install 'nki-kernels[bench]')"
    print(f"wrote {paths['json']} (appended), {paths['markdown']}{plot}", file=sys.stderr)
    unavailable = defs.load()
    if unavailable and not ops:
        for mod, err in sorted(unavailable.items()):
            print(f"note: bench/defs/{mod}.py not loaded: {err}", file=sys.stderr)
    return 1 if any(r.get("error") for r in rows) else 0


def _list(ops, tier, target, shape=None) -> int:
    from nki_kernels.bench import defs, harness
    tiers = [tier] if tier else list(TIERS)
    n = 0
    for t in tiers:
        try:
            cases = harness.select(ops, t, target, shape)
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


if __name__ == "__main__":
    sys.exit(main())
