"""The measured path of the bench: device time on a Trainium NeuronCore.

Used when the real ``nki`` package runs kernels on a Neuron device (``nki_kernels.backend.BACKEND
== "hardware"``). Written from the Neuron SDK documentation (the Neuron Explorer /
neuron-profile user guide and the nrtpy benchmark API, AWS Neuron documentation); it has not
been run on a device, because none was available when it was written.

How a case is measured:

1. ``NKI_ARTIFACTS_DIR`` must be set before ``nki`` is imported (``nki-kernels bench --measured``
   sets it to ``<out>/artifacts``), so that running the op leaves ``*.neff`` files behind.
2. The op runs once (compile + first execution), then ``warmup`` + ``repeats`` more times; the
   median wall-clock per call is kept as *host time* (it includes Python and runtime overhead).
3. Each NEFF the op produced is benchmarked with the Neuron runtime's Python binding ``nrtpy``:
   ``NrtpyModel.load_from_neff(neff).benchmark(inputs, warmup_iter, benchmark_iter,
   mode="device")``, which counts NeuronCore compute and DMA time only. That is the device time
   of the row (summed over the NEFFs when an op launches several kernels). ``nrtpy`` and ``nki``
   cannot share one Python environment (SDK 2.33); set ``NKI_KERNELS_NRTPY_PYTHON`` to the
   python of an nrtpy environment and the benchmark runs there in a subprocess.
4. With ``profile_dir``, the last NEFF is also captured with ``neuron-explorer capture
   --profile-nth-exec=2`` (``neuron-profile`` on older SDKs) and summarised with ``view
   --output-format summary-json``; its ``total_time`` is the device time when nrtpy is absent,
   and MFU / MBU (per-stack denominator) / per-engine active % go into the row.

Without nrtpy and without a profiler the row falls back to host wall-clock time and says so.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

NRTPY_PYTHON_ENV = "NKI_KERNELS_NRTPY_PYTHON"
NO_DEVICE_HELP = (
    "Measured timings need a Trainium instance (trn2/trn3) with the Neuron SDK: the real `nki` "
    "package (Neuron SDK 2.32+, from the AWS Neuron package repository), the Neuron driver "
    "(/dev/neuron*) and, for device time, nrtpy and neuron-explorer. Without them, "
    "`nki-kernels bench` (no --measured) reports the emulator's modeled time.")


class NoDeviceError(RuntimeError):
    """The measured path was asked for on a machine without a Neuron device / SDK."""


def status() -> tuple[bool, str]:
    """(True, what was found) when kernels run on a Neuron device here, else (False, why not)."""
    try:
        from nki_kernels import backend
    except Exception as e:  # noqa: BLE001 - BackendUnavailable and friends: report, don't crash
        return False, f"no Neuron device/SDK: {e}"
    if backend.BACKEND == "emulator":
        return False, ("no Neuron device/SDK is present: the real `nki` package is not importable, "
                       "so kernels run on the nki-kernels emulator (modeled time only)")
    if backend.BACKEND == "simulator":
        return False, ("NKI_KERNELS_BACKEND=simulator runs kernels in nki.simulate on the CPU, "
                       "which gives no device time")
    devices = sorted(glob.glob("/dev/neuron*"))
    if not devices:
        return False, ("the `nki` package is installed but no Neuron device is visible "
                       "(no /dev/neuron*): this is not a trn2/trn3 instance, or the Neuron "
                       "driver is not loaded")
    version = getattr(backend.nki, "__version__", "?")
    return True, f"{len(devices)} Neuron device(s), nki {version}"


def require() -> str:
    """Return the device description, or raise NoDeviceError with a plain message."""
    ok, why = status()
    if not ok:
        raise NoDeviceError(f"{why}.\n{NO_DEVICE_HELP}")
    return why


@dataclass
class Measurement:
    device_ns: float | None     # NeuronCore time per execution (None: could not be obtained)
    host_ns: float              # median wall-clock per call of the Python op
    method: str                 # "nrtpy" | "profile" | "host-wallclock"
    neffs: list = field(default_factory=list)
    profile: dict | None = None
    notes: list = field(default_factory=list)

    @property
    def time_ns(self) -> float:
        """The row's time: device time when known, else host wall-clock."""
        return self.device_ns if self.device_ns is not None else self.host_ns


def measure(case, inputs, *, warmup: int = 5, repeats: int = 20,
            profile_dir: str | os.PathLike | None = None) -> Measurement:
    """Run ``case`` on the device and time it (see the module docstring)."""
    require()
    notes = []
    art = os.environ.get("NKI_ARTIFACTS_DIR")
    if not art:
        notes.append("NKI_ARTIFACTS_DIR was not set before nki was imported: no NEFF to benchmark")
    t_start = time.time()
    case.run(*inputs)                                  # compile + first execution
    for _ in range(max(0, warmup - 1)):
        case.run(*inputs)
    host = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        case.run(*inputs)
        host.append((time.perf_counter() - t0) * 1e9)
    host_ns = statistics.median(host)

    neffs = _new_neffs(art, t_start) if art else []
    if art and not neffs:
        notes.append(f"no *.neff written under {art} by this case")
    device_ns, method = None, "host-wallclock"
    if neffs:
        try:
            device_ns = sum(_nrtpy_device_ns(n, inputs, warmup, repeats) for n in neffs)
            method = "nrtpy"
        except _Unavailable as e:
            notes.append(str(e))
        except Exception as e:  # noqa: BLE001 - keep the host time, say what failed
            notes.append(f"nrtpy benchmark failed: {type(e).__name__}: {e}")
    profile = None
    if profile_dir is not None and neffs:
        try:
            profile = capture_profile(neffs[-1], inputs, profile_dir)
        except Exception as e:  # noqa: BLE001
            notes.append(f"profile capture failed: {type(e).__name__}: {e}")
        if device_ns is None and profile and profile.get("total_time"):
            device_ns = float(profile["total_time"]) * 1e9
            method = "profile"
    if device_ns is None:
        notes.append("device time unavailable: reporting host wall-clock (includes host overhead)")
    return Measurement(device_ns, host_ns, method, [str(n) for n in neffs], profile, notes)


# --------------------------------------------------------------------------------- internals


class _Unavailable(RuntimeError):
    pass


def _new_neffs(art_dir, since: float) -> list[Path]:
    found = [p for p in Path(art_dir).rglob("*.neff") if p.stat().st_mtime >= since - 1]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def _raw(a) -> np.ndarray:
    """A contiguous view with a plain NumPy dtype: ml_dtypes arrays (bf16, fp8) are viewed as
    unsigned ints of the same width, since the runtime only sees bytes."""
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "V" or a.dtype.type.__module__.startswith("ml_dtypes"):
        return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
    return a


def _arrays(inputs) -> list[np.ndarray]:
    return [_raw(x) for x in inputs if isinstance(x, np.ndarray)]


# Maps NEFF inputs to the case's arrays in order. Assumption (unverified on hardware): the NEFF of
# an NKI kernel lists its tensor inputs in the kernel's parameter order, which is the order the op
# passes its arrays. When the sizes do not match, the runtime's own auto-allocated inputs are used
# (timing of dense kernels does not depend on the values; gather kernels may).
_NRTPY_SCRIPT = r"""
import json, sys
import numpy as np
from nrtpy import NrtpyModel
neff, npz, warmup, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
arrays = [v for _, v in sorted(np.load(npz).items())]
model = NrtpyModel.load_from_neff(neff, core_id=0)
feeds = {}
for (name, info), a in zip(model.input_tensors_info.items(), arrays):
    if a.nbytes == info.size:
        feeds[name] = a.reshape(tuple(info.shape)) if int(np.prod(info.shape)) == a.size else a
res = model.benchmark(inputs=feeds or None, warmup_iter=warmup, benchmark_iter=repeats,
                      mode="device")
print(json.dumps({"mean_ms": res.mean_ms, "min_ms": res.min_ms}))
"""


def _nrtpy_device_ns(neff: Path, inputs, warmup: int, repeats: int) -> float:
    arrays = _arrays(inputs)
    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, "inputs.npz")
        np.savez(npz, **{f"in{i:03d}": a for i, a in enumerate(arrays)})
        python = os.environ.get(NRTPY_PYTHON_ENV)
        if not python:
            try:
                import nrtpy  # noqa: F401
            except ImportError:
                raise _Unavailable(
                    f"nrtpy is not importable here (it cannot share an environment with nki); set "
                    f"{NRTPY_PYTHON_ENV} to the python of an nrtpy environment") from None
            python = sys.executable
        out = subprocess.run([python, "-c", _NRTPY_SCRIPT, str(neff), npz, str(warmup),
                              str(max(1, repeats))], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else
                           f"exit code {out.returncode}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return float(res["mean_ms"]) * 1e6


# Profile summary fields kept in the row (names from the Neuron Explorer profile schema).
PROFILE_FIELDS = (
    "total_time", "mfu_estimated_percent", "mbu_estimated_percent", "hbm_read_bytes",
    "hbm_write_bytes", "tensor_engine_active_time_percent", "vector_engine_active_time_percent",
    "scalar_engine_active_time_percent", "gpsimd_engine_active_time_percent",
    "dma_active_time_percent", "transpose_flops", "hardware_flops",
    "average_utilization_limit_percent")


def profiler() -> str | None:
    """The profiler CLI on PATH: ``neuron-explorer`` (current) or ``neuron-profile`` (legacy)."""
    return shutil.which("neuron-explorer") or shutil.which("neuron-profile")


def capture_profile(neff, inputs, profile_dir) -> dict:
    """Capture the 2nd execution of ``neff`` and return selected summary fields.

    ``<tool> capture -n k.neff -s k.ntff --profile-nth-exec=2`` then
    ``<tool> view -n k.neff -s <ntff> --output-format summary-json``. MBU there uses one HBM
    stack as denominator (Neuron Explorer profile schema reference); the row labels it so.
    """
    tool = profiler()
    if tool is None:
        raise _Unavailable("neither neuron-explorer nor neuron-profile is on PATH")
    out = Path(profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    neff = Path(neff)
    ntff = out / f"{neff.stem}.ntff"
    cmd = [tool, "capture", "-n", str(neff), "-s", str(ntff), "--profile-nth-exec=2"]
    # Inputs are left to the tool (it allocates them); NEFF input names are only known via nrtpy.
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    # the tool may suffix the trace with the execution number (profile_exec_2.ntff)
    traces = sorted(out.glob(f"{neff.stem}*.ntff"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise RuntimeError(f"{tool} capture wrote no .ntff into {out}")
    view = subprocess.run([tool, "view", "-n", str(neff), "-s", str(traces[-1]),
                           "--output-format", "summary-json"],
                          check=True, capture_output=True, text=True, timeout=900)
    summary = json.loads(view.stdout[view.stdout.find("{"):])
    # the summary is keyed by a run / NEFF name at the top level
    body = next(iter(summary.values())) if summary and all(
        isinstance(v, dict) for v in summary.values()) else summary
    picked = {k: body[k] for k in PROFILE_FIELDS if k in body}
    picked["ntff"] = str(traces[-1])
    picked["mbu_denominator"] = "per HBM stack"
    return picked
