"""``nki.jit`` and ``nki.simulate`` for the emulator (nki-spec §2).

Calling a jitted kernel with NumPy arrays (or CPU torch tensors) runs it here: arguments become HBM
tensors, the body runs as ordinary Python (each ``nisa`` call executes eagerly), returned
``nl.shared_hbm`` tensors come back as arrays, and inputs the kernel wrote are copied back in place.
"""
from __future__ import annotations

import enum
import functools
import inspect
import os
import threading
import time
import warnings

import numpy as np

from . import collectives
from . import dtypes as dt
from . import runtime as rt
from .errors import NkiValidationError
from .tensor import NkiTensor, hbm_tensor, to_numpy


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def _torch_to_numpy(t):
    import torch
    t = t.detach()
    if t.device.type != "cpu":
        raise TypeError(f"the emulator runs on the CPU; got a tensor on {t.device}")
    special = {torch.bfloat16: (torch.int16, dt.bfloat16.np)}
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            special[getattr(torch, name)] = (torch.uint8, getattr(dt, name).np)
    if t.dtype in special:
        via, npd = special[t.dtype]
        return t.contiguous().view(via).numpy().view(npd)
    return t.contiguous().numpy()


def _numpy_to_torch(a, like=None):
    import torch
    if a.dtype.names:   # x4 host data: torch has no x4 type; its packed uint words
        a = a.view(dt.from_numpy(a.dtype).np)
    if a.dtype == dt.bfloat16.np:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if a.dtype == getattr(dt, name).np and hasattr(torch, name):
            return torch.from_numpy(a.view(np.uint8).copy()).view(getattr(torch, name))
    return torch.from_numpy(np.ascontiguousarray(a))


def _check_arg(name, v):
    if isinstance(v, list):
        raise NkiValidationError(f"kernel argument {name!r} is a list; lists are not allowed as "
                                 f"kernel arguments since NKI 0.3.0 (pass a tuple)")
    ok = (v is None or isinstance(v, (bool, int, float, str, tuple, enum.Enum, dt.NkiDtype,
                                      np.integer, np.floating)) or callable(v)
          or type(v).__name__ == "NKIObject" or hasattr(v, "__dict__"))
    if not ok:
        raise NkiValidationError(f"kernel argument {name!r} has unsupported type "
                                 f"{type(v).__name__}")


class Kernel:
    """A function decorated with ``@nki.jit``. ``kernel[2](...)`` launches it with LNC=2."""

    def __init__(self, fn, grid=None, options=None):
        if isinstance(fn, Kernel):
            raise NkiValidationError(f"nki.jit applied twice to {fn.fn.__name__}")
        self.fn = fn
        self.grid = grid
        self.options = dict(options or {})
        functools.update_wrapper(self, fn)

    def __repr__(self):
        return f"<nki.jit kernel {self.fn.__name__}{'' if self.grid is None else [self.grid]}>"

    def __getitem__(self, grid):
        if isinstance(grid, tuple):
            if len(grid) != 1:
                raise NkiValidationError(f"{self.fn.__name__}[{grid}]: only a single integer LNC "
                                         f"degree is allowed (multi-dimensional SPMD grids were "
                                         f"removed)")
            grid = grid[0]
        if not isinstance(grid, int) or grid not in (1, 2):
            raise NkiValidationError(f"{self.fn.__name__}[{grid!r}]: the launch grid is the LNC "
                                     f"degree and must be 1 or 2")
        return Kernel(self.fn, grid, self.options)

    def __call__(self, *args, **kwargs):
        return run_kernel(self, args, kwargs)


def jit(fn=None, **kwargs):
    """``@nki.jit`` / ``@nki.jit()`` / ``nki.jit(f)``. ``mode=`` and ``platform_target=`` are
    rejected (removed in NKI 0.3.0)."""
    from . import versions
    trace_mode = kwargs.get("mode") == "trace"
    for bad in ("mode", "platform_target"):
        if bad in kwargs:
            versions.check(f"nki.jit({bad}=...)", "nki.jit")
            kwargs = {k: v for k, v in kwargs.items() if k != bad}
    if trace_mode:
        # NKI 0.3's mode="trace": the function is traced into whichever kernel calls it
        kwargs["_trace_mode"] = True
    unknown = set(kwargs) - {"_trace_mode", "compile_config", "specialization_config", "debug_kernel",
                             "show_compiler_tb", "additional_compile_opt",
                             "experimental_flags"}
    if unknown:
        raise TypeError(f"nki.jit: unknown options {sorted(unknown)}")
    if fn is None:
        return lambda f: Kernel(f, options=kwargs)
    return Kernel(fn, options=kwargs)


def simulate(kernel, target=None):
    """``nki.simulate(kernel)(*arrays)``: run on the emulator (numpy in, numpy out)."""
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)

    def call(*args, **kwargs):
        if target is None:
            return k(*args, **kwargs)
        with rt.target(target):
            return k(*args, **kwargs)
    return call


def _lnc_from_env():
    v = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if not v:
        return None
    if v not in ("1", "2"):
        raise NkiValidationError(f"NEURON_LOGICAL_NC_CONFIG must be 1 or 2; got {v!r}")
    return int(v)


# Wall seconds spent in top-level kernel launches since the process started (summed over
# concurrent launches, e.g. the ranks of ``collectives.run_ranks``): the suite runner's log
# reports each test's share, separating the emulator's time from its harness's.
EMULATED_SECONDS = [0.0]
_EMULATED_LOCK = threading.Lock()      # ranks of run_ranks finish on their own threads


def run_kernel(kernel: Kernel, args, kwargs):
    core = rt.maybe_core()
    if core is not None:
        return _inline(kernel, core.launch, args, kwargs)
    t0 = time.perf_counter()
    try:
        return _launch(kernel, args, kwargs)
    finally:
        dt_s = time.perf_counter() - t0
        with _EMULATED_LOCK:
            EMULATED_SECONDS[0] += dt_s


def _launch(kernel: Kernel, args, kwargs):
    gen = rt.current_gen()
    lnc = kernel.grid or _lnc_from_env() or 1
    if lnc == 2 and gen.nc_version < 3:
        raise NkiValidationError(f"{kernel.fn.__name__}: LNC=2 needs Trn2 or Trn3; target is "
                                 f"{gen.name}")
    launch = rt.Launch(gen, lnc, kernel.fn.__name__, grid=kernel.grid is not None,
                       options=kernel.options)
    launch.world, launch.rank = collectives.context()   # run_ranks: this call's rank
    for tr in rt._tracers:
        tr.launches.append({"kernel": kernel.fn.__name__, "target": gen.name, "lnc": lnc,
                            "first_instruction": len(tr.instructions)})
    sig = inspect.signature(kernel.fn)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{kernel.fn.__name__}: {e}") from None
    use_torch = False
    write_back = []
    in_buf = rt.shared_hbm if lnc > 1 else rt.hbm

    def convert(name, v):
        nonlocal use_torch
        if _is_torch(v):
            use_torch = True
            arr = _torch_to_numpy(v)
            t = hbm_tensor(arr, in_buf, name)
            write_back.append((t, v, True))
            return t
        if isinstance(v, np.ndarray):
            t = hbm_tensor(v, in_buf, name)
            write_back.append((t, v, False))
            return t
        if isinstance(v, tuple):
            return tuple(convert(f"{name}[{i}]", x) for i, x in enumerate(v))
        _check_arg(name, v)
        return v

    call_args = {n: convert(n, v) for n, v in bound.arguments.items()}
    launch.io_storages = {id(t.storage) for t, _, _ in write_back}
    results = [None] * lnc
    errors = [None] * lnc

    def program(i):
        try:
            results[i] = launch.run(i, lambda: kernel.fn(**call_args))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[i] = e

    if lnc == 1:
        program(0)
    else:
        rt.run_threads(program, lnc, "nki-program")
    failed = [e for e in errors if e is not None]
    if failed:
        # a program that failed makes the other one fail at its next rendezvous: report the cause
        root = [e for e in failed if not (isinstance(e, NkiValidationError)
                                          and "never reached" in str(e))]
        raise (root or failed)[0]
    for t, orig, is_torch in write_back:
        data = to_numpy(t)
        if is_torch:
            if not np.array_equal(data.view(np.uint8), _torch_to_numpy(orig).view(np.uint8)):
                orig.copy_(_numpy_to_torch(data).reshape(orig.shape))
        elif orig.flags.writeable:
            np.copyto(orig, data.reshape(orig.shape))
    out = results[0]
    inputs = {id(t.storage): (t, orig) for t, orig, _ in write_back}
    return _outputs(kernel, out, use_torch, inputs)


_CONFIGS = ("compile_config", "specialization_config")


def _inline(kernel, launch, args, kwargs):
    """A ``@nki.jit`` kernel called from inside a running kernel is a sub-kernel: it is traced
    into the caller, under the caller's LNC and configuration. NKI Library's head (written for NKI
    0.3) calls ``@nki.jit`` helpers from its kernels (moe_tkg's ``all_expert_mx_impl``), and
    NKI 0.7 documents the rule for them (``nki.compiler.SpecializationConfig``,
    ``allow_nested_config_override``: a nested ``@nki.jit`` sub-kernel whose config disagrees
    with the top-level kernel's raises, or, with that option, warns and inlines under the
    top-level config). The documentation does not say what a launch grid on a sub-kernel means,
    nor how 0.3-0.6 treated a disagreeing config: the emulator refuses the first and, under
    0.3-0.6, inlines the second without a check (not verified on a device)."""
    from . import versions
    name = kernel.fn.__name__
    if kernel.grid is not None:
        raise NkiValidationError(f"{name}[{kernel.grid}]: a sub-kernel called from inside "
                                 f"{launch.kernel_name} runs under that kernel's LNC; a launch grid "
                                 f"applies only to the top-level kernel")
    top = launch.options
    if not kernel.options.get("_trace_mode"):
        differs = [c for c in _CONFIGS if c in kernel.options and kernel.options[c] != top.get(c)]
        if differs:
            spec = top.get("specialization_config")
            msg = (f"{name}: nested @nki.jit sub-kernel's {' and '.join(differs)} differs from the "
                   f"top-level kernel {launch.kernel_name}'s")
            if getattr(spec, "allow_nested_config_override", False) is True:
                warnings.warn(msg + "; inlined under the top-level configuration "
                              "(allow_nested_config_override)", stacklevel=3)
            elif versions.at_least("0.7"):
                raise NkiValidationError(msg + " (set nki.compiler.SpecializationConfig("
                                         "allow_nested_config_override=True) on the top-level "
                                         "kernel to inline it under that configuration)")
    return kernel.fn(*args, **kwargs)


def _outputs(kernel, out, use_torch, inputs=None):
    if out is None:
        return None
    if isinstance(out, NkiTensor):
        aliased = (inputs or {}).get(id(out.storage))
        if aliased is not None and out.shape == aliased[0].shape:
            # an input argument the kernel wrote in place and returns: the output aliases the
            # input (the graph compiler's `<name>.must_alias_input`; nki-spec §2.1)
            arr = to_numpy(out)
            return _numpy_to_torch(arr) if use_torch else arr
        if out.buffer is not rt.shared_hbm:
            raise NkiValidationError(
                f"{kernel.fn.__name__}: returned tensor {out.name!r} is in {out.buffer.name}; kernel "
                f"outputs must be allocated in nl.shared_hbm")
        arr = to_numpy(out)
        return _numpy_to_torch(arr) if use_torch else arr
    if isinstance(out, (tuple, list)):
        return type(out)(_outputs(kernel, o, use_torch, inputs) for o in out)
    raise NkiValidationError(f"{kernel.fn.__name__}: kernels return nl.shared_hbm tensors (or a "
                             f"tuple of them); got {type(out).__name__}")
