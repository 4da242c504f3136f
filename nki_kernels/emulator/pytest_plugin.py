"""Run an NKI project's own pytest suite on the nki-kernels emulator.

Two spellings of the same thing::

    python -m nki_kernels.emulator.pytest_plugin PATH [--nki-version 0.3] [--target trn2] -- ARGS
    nki-kernels simulate-suite PATH [--nki-version 0.3] [--target trn2] -- ARGS

or, inside a project whose harness you drive yourself, ``pytest -p nki_kernels.emulator.pytest_plugin``.

Loading the plugin (before any conftest) installs the emulator as ``nki`` (``install()``), and
registers, in this process only, stand-ins for what NKI harnesses import but no public package
provides. Every stand-in is harness plumbing; none is a kernel or a golden value:

* ``nki_cpu_simulator`` (and ``.nki``, ``.nki.language``, ...): aliases of the emulator's modules,
  the names NKI Library's ``test/utils/simulation_setup.py`` imports in ``--test-mode simulation``.
* ``neuron_dtypes``: host-side casts for input generators and goldens (``static_cast``,
  ``sizeinbytes``, ``finfo``, ``is_float_type``, the MX ``*_x4`` container dtypes), built on
  ml_dtypes and the emulator's own x4 packing; also served as
  ``neuronxcc.starfish.support.dtype`` when the Neuron compiler is absent.
* Harness modules NKI Library's public tree lacks (``test/utils/scripts/remote_lock_scripts``,
  ``test/utils/perf_analysis_private``: remote core locking and trace analysis for hardware runs).
* Remote-host and metrics plumbing the harness imports at start-up but never calls in simulation
  mode, only when the real package is not installed: ``fabric2``, ``paramiko``,
  ``aws_embedded_metrics``, ``plotext``, ``pytest_html``, ``file_classifier`` (empty modules whose
  attributes are inert placeholders).

* Two harness bugs fixed in-process: its simulation path reads ``Orchestrator._compiled_kernel``,
  which only the (skipped) compilation step sets (the class gets a ``None`` default); and it runs
  a single rank, so a test of collectives over several ranks runs all its ranks together on the
  emulator (``nki_kernels.emulator.collectives.run_ranks``), each rank's outputs written where
  the harness's hardware path puts them (``output_worker_<rank>/``).

Nothing is installed on disk and no file of the project is copied or edited. The NKI version the
emulator follows is ``--nki-version`` (or ``NKI_EMULATOR_VERSION``); NKI Library's public head
was written for NKI 0.3.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types

import ml_dtypes
import numpy as np

# --------------------------------------------------------------------------- neuron_dtypes stand-in
_X4 = ("float8_e4m3fn_x4", "float8_e5m2_x4", "float4_e2m1fn_x4")


def _nki_x4(dtype):
    from . import dtypes as dt
    meta = getattr(np.dtype(dtype), "metadata", None) if not isinstance(dtype, dt.NkiDtype) else None
    if isinstance(dtype, dt.NkiDtype):
        return dtype if dtype.is_x4 else None
    if meta and meta.get("nki_dtype") in _X4:
        return dt.by_name(meta["nki_dtype"])
    return None


def static_cast(arr, dtype):
    """Cast host data to ``dtype`` with round-to-nearest-even (ml_dtypes rules). Casting floats to
    an MX x4 dtype packs groups of four along the last axis; casting x4 data to a float dtype
    unpacks it (last axis times four)."""
    from . import dtypes as dt
    a = np.asarray(arr)
    src_x4 = _nki_x4(a.dtype)
    dst_x4 = _nki_x4(dtype)
    if src_x4 is not None and dst_x4 is None:
        vals = dt.unpack_x4(a.view(src_x4.np), src_x4)
        return vals.reshape(a.shape[:-1] + (a.shape[-1] * 4,)).astype(np.dtype(dtype))
    if dst_x4 is not None:
        if src_x4 is not None:
            return a.view(dst_x4.dtype)
        if a.shape[-1] % 4:
            raise ValueError(f"static_cast to {dst_x4.name}: the last axis ({a.shape[-1]}) must be "
                             f"a multiple of 4")
        vals = a.astype(np.float32).reshape(a.shape[:-1] + (a.shape[-1] // 4, 4))
        return dt.pack_x4(vals, dst_x4).view(dst_x4.dtype)
    target = np.dtype(dtype)
    if a.dtype.kind == "f" or a.dtype in _ML_FLOATS:
        if target.kind in "iu":
            info = np.iinfo(target)
            v = np.rint(a.astype(np.float64))
            v = np.nan_to_num(v, nan=0.0, posinf=info.max, neginf=info.min)
            return np.clip(v, info.min, info.max).astype(target)
    return a.astype(target)


_ML_FLOATS = {np.dtype(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3, ml_dtypes.float8_e4m3fn,
                                    ml_dtypes.float8_e5m2, ml_dtypes.float8_e8m0fnu)}


def sizeinbytes(dtype):
    return np.dtype(dtype).itemsize


def is_float_type(dtype):
    d = np.dtype(dtype)
    return d.kind == "f" or d in _ML_FLOATS


def finfo(dtype):
    d = np.dtype(dtype)
    return ml_dtypes.finfo(d) if d in _ML_FLOATS else np.finfo(d)


def _neuron_dtypes_module(name="neuron_dtypes"):
    from . import dtypes as dt
    m = types.ModuleType(name)
    m.__doc__ = "nki-kernels stand-in for host-side dtype casts (harness plumbing, in-process only)"
    m.static_cast = static_cast
    m.sizeinbytes = sizeinbytes
    m.is_float_type = is_float_type
    m.finfo = finfo
    m.bfloat16 = m.bfloat = np.dtype(ml_dtypes.bfloat16)
    for n in ("float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"):
        setattr(m, n, np.dtype(getattr(ml_dtypes, n)))
    m.float8e4 = m.float8_e4m3
    m.float8e5 = m.float8_e5m2
    for n in _X4:
        setattr(m, n, dt.by_name(n).dtype)
    for n in ("float16", "float32", "int8", "int16", "int32", "uint8", "uint16", "uint32"):
        setattr(m, n, np.dtype(n))
    return m


# --------------------------------------------------------------------------- inert plumbing stand-ins
_PLUMBING = ("fabric2", "paramiko", "aws_embedded_metrics", "plotext", "pytest_html",
             "file_classifier")
# modules NKI Library's harness imports that its public tree lacks (remote core locking, private
# trace analysis), matched by the end of the dotted name
_PRIVATE_HELPERS = (".utils.scripts", ".utils.perf_analysis_private")


class _Inert:
    """Placeholder for any attribute of an absent plumbing package (class, function, value)."""

    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Inert()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __mro_entries__(self, bases):  # usable as a base class
        return (object,)


class _InertModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            return type(name, (Exception if name.endswith(("Exception", "Error")) else object,),
                        {"__init__": lambda self, *a, **k: None})
        return _Inert()


class _PlumbingFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: serves inert modules for plumbing packages and private harness
    helpers only when no real finder found them."""

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if top not in _PLUMBING and not fullname.endswith(_PRIVATE_HELPERS) \
                and not any(fullname.endswith(h + ".") or (h + ".") in fullname
                            for h in _PRIVATE_HELPERS):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        m = _InertModule(spec.name)
        m.__path__ = []
        m.__nki_kernels_standin__ = True
        return m

    def exec_module(self, module):
        pass


# --------------------------------------------------------------------------- installation
def install_standins(version=None):
    """Install the emulator as ``nki`` and register the stand-ins listed in the module docstring."""
    from .. import emulator as emu
    if "neuronxcc" not in sys.modules and importlib.util.find_spec("neuronxcc") is None:
        ncc = types.ModuleType("neuronxcc")
        ncc.__path__ = []
        ncc.__nki_kernels_standin__ = True
        sys.modules["neuronxcc"] = ncc
        for n in ("neuronxcc.starfish", "neuronxcc.starfish.support"):
            sub = types.ModuleType(n)
            sub.__path__ = []
            sys.modules[n] = sub
        sys.modules["neuronxcc.starfish.support.dtype"] = _neuron_dtypes_module(
            "neuronxcc.starfish.support.dtype")
    emu.install(force=True, version=version)
    if importlib.util.find_spec("neuron_dtypes") is None if "neuron_dtypes" not in sys.modules \
            else False:
        sys.modules["neuron_dtypes"] = _neuron_dtypes_module()
    pkg = types.ModuleType("nki_cpu_simulator")
    pkg.__path__ = []
    pkg.__nki_kernels_standin__ = True
    pkg.nki = emu
    sys.modules["nki_cpu_simulator"] = pkg
    for name, mod in emu._module_table().items():
        sys.modules["nki_cpu_simulator." + name] = mod
    if not any(isinstance(f, _PlumbingFinder) for f in sys.meta_path):
        sys.meta_path.append(_PlumbingFinder())
    return emu


# Loaded as a pytest plugin (-p nki_kernels.emulator.pytest_plugin): install before any conftest.
if os.environ.get("NKI_KERNELS_NO_STANDINS") != "1":
    install_standins(os.environ.get("NKI_EMULATOR_VERSION") or None)


def _patch_harness_bugs():
    """In-process fixes of NKI Library harness bugs that only show in simulation mode.

    * ``Orchestrator._rename_neff_outputs_to_python_names`` reads ``self._compiled_kernel``, which
      only the compilation step (skipped in simulation) sets: give the class a ``None`` default.
    * Its simulation path runs one rank (``simulate_kernel`` calls ``.items()`` on a
      ``PerRankLazyInputGenerator``): a test with ``collective_ranks > 1`` runs every rank at once
      on the emulator (``collectives.run_ranks``) and writes each rank's outputs to
      ``output_worker_<rank>/``, the layout of the harness's own hardware path, which its
      validator reads.
    """
    for name, mod in list(sys.modules.items()):
        if name.endswith("utils.test_orchestrator"):
            orch = getattr(mod, "Orchestrator", None)
            if orch is None:
                continue
            if not hasattr(orch, "_compiled_kernel"):
                orch._compiled_kernel = None
            run = getattr(orch, "_run_simulator_inference", None)
            if run is not None and not getattr(run, "_nki_kernels_ranks", False):
                orch._run_simulator_inference = _multi_rank(run, mod)


def _multi_rank(single, orch_mod):
    """``Orchestrator._run_simulator_inference`` that runs all ranks of a collective test."""
    import importlib

    def run(self, kernel_under_test):
        n = getattr(kernel_under_test.inference_args, "collective_ranks", 1) or 1
        if n <= 1:
            return single(self, kernel_under_test)
        try:
            return _simulate_ranks(self, kernel_under_test, n)
        except Exception as e:
            exc = getattr(orch_mod, "InferenceException", RuntimeError)
            raise exc(str(e)) from e

    def _simulate_ranks(self, kut, n):
        from . import collectives
        sim = importlib.import_module(".simulation_setup", orch_mod.__package__)
        inputs = kut.kernel_input
        per_rank = [inputs.for_rank(r) if hasattr(inputs, "for_rank") else dict(inputs or {})
                    for r in range(n)]
        os.environ["NKI_NC_VERSION"] = kut.compiler_input.platform_target.get_nc_gen()
        lnc = kut.compiler_input.logical_nc_config
        # each rank through the harness's own one-rank call (its argument names, its outputs)
        results = collectives.run_ranks(
            lambda **kw: sim.simulate_kernel(kut.kernel_func, kw, lnc), per_rank)
        if kut.validation_args is None:
            raise ValueError("Simulation mode requires validation_args to verify outputs")
        out_dir = os.path.join(self.fs_config.artifacts_output_directory_path,
                               orch_mod.INF_ARTIFACT_DIR_NAME)
        for r, outs in enumerate(results):
            golden = sim.normalize_golden_output(kut.validation_args.golden_output, r)
            if len(outs) != len(golden):
                raise RuntimeError(f"rank {r}: kernel returned {len(outs)} outputs but expected "
                                   f"{len(golden)} ({list(golden)})")
            tensors = {name: np.asarray(o, dtype=g.dtype)
                       for name, o, g in zip(golden, outs, golden.values())}
            self.__dump_tensors__(os.path.join(out_dir, f"output_worker_{r}"), tensors,
                                  lambda name: name)
        return out_dir

    run._nki_kernels_ranks = True
    return run


def pytest_sessionstart(session):
    _patch_harness_bugs()


def pytest_collection_finish(session):
    _patch_harness_bugs()


_CPU = {}


def pytest_runtest_call(item):
    import time

    from .jit import EMULATED_SECONDS
    _CPU[item.nodeid] = (time.process_time(), EMULATED_SECONDS[0])


def pytest_runtest_logreport(report):
    """With ``NKI_SUITE_TIMES=path``: one tab-separated line per test phase (outcome, wall
    seconds, first line of the failure, CPU seconds of the call, wall seconds of the call
    inside the emulator's kernel launches) appended as it finishes, so partial runs can be
    tallied and timed independently of the machine's load, and the emulator's share of a test
    told from its harness's (input generation, goldens, comparison)."""
    path = os.environ.get("NKI_SUITE_TIMES")
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    msg = ""
    if report.outcome == "failed":
        text = str(report.longrepr).strip().splitlines()
        errs = [t for t in text if t.startswith("E ")]
        msg = (errs[-1] if errs else (text[-1] if text else ""))[:300]
    elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        msg = str(report.longrepr[2])[:120]
    import time

    from .jit import EMULATED_SECONDS
    cpu0, emu0 = _CPU.pop(report.nodeid, (time.process_time(), EMULATED_SECONDS[0]))
    cpu, emu = time.process_time() - cpu0, EMULATED_SECONDS[0] - emu0
    with open(path, "a") as f:
        f.write(f"{report.nodeid}\t{report.when}\t{report.outcome}\t{report.duration:.2f}\t"
                f"{msg}\t{cpu:.2f}\t{emu:.3f}\n")


def pytest_report_header(config):
    from . import versions
    return (f"nki: the nki-kernels emulator (following NKI {versions.current()}), with in-process "
            f"harness stand-ins (docs/emulator.md)")


# --------------------------------------------------------------------------- the command
def build_command(path, pytest_args, target=None, simulation_flags=True):
    """The pytest command line ``main`` runs for a project at ``path``."""
    cmd = [sys.executable, "-m", "pytest", "-p", "nki_kernels.emulator.pytest_plugin"]
    if simulation_flags and os.path.exists(os.path.join(path, "test", "utils",
                                                        "simulation_setup.py")):
        # NKI Library's harness: its simulation mode and target flags
        if not any(a.startswith("--test-mode") for a in pytest_args):
            cmd += ["--test-mode", "simulation"]
        if target and not any(a.startswith("--platform-target") for a in pytest_args):
            cmd += ["--platform-target", target]
    return cmd + list(pytest_args)


def main(argv=None):
    import argparse
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(
        prog="python -m nki_kernels.emulator.pytest_plugin",
        description="Run an NKI project's pytest suite on the nki-kernels emulator "
                    "(arguments after -- go to pytest).")
    p.add_argument("path", help="the project's checkout (for NKI Library: its root folder)")
    p.add_argument("--nki-version", default=None,
                   help="NKI version to follow (0.3 ... 0.7; default NKI_EMULATOR_VERSION or 0.7; "
                        "NKI Library's public head needs 0.3)")
    p.add_argument("--target", default=None, choices=["trn2", "trn3"],
                   help="target generation (NEURON_PLATFORM_TARGET_OVERRIDE and, for NKI Library, "
                        "--platform-target)")
    a = p.parse_args(argv)
    path = os.path.abspath(a.path)
    if not os.path.isdir(path):
        p.error(f"{a.path}: no such folder")
    env = dict(os.environ)
    # The emulator's matrix products are small (one 128-row tile): BLAS threads only contend with
    # each other and with xdist workers (10x slower measured on a busy 2-core machine). Set before
    # NumPy loads, i.e. in the child's environment.
    for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(v, "1")
    if a.nki_version:
        from . import versions
        env[versions.ENV] = versions._parse(a.nki_version)
    if a.target:
        env["NEURON_PLATFORM_TARGET_OVERRIDE"] = a.target
    paths = [path] + ([os.path.join(path, "src")] if os.path.isdir(os.path.join(path, "src")) else [])
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(paths + [here] + ([env["PYTHONPATH"]]
                                                          if env.get("PYTHONPATH") else []))
    cmd = build_command(path, extra, a.target)
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=path, env=env)


if __name__ == "__main__":
    sys.exit(main())
