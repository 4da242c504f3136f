"""Which ``nki`` runs our kernels: the real package (device or ``nki.simulate``) or the emulator.

Kernels import NKI from here only::

    from nki_kernels.backend import nki, nl, nisa

``NKI_KERNELS_BACKEND`` chooses:

* unset      -> the real ``nki`` if it is importable (hardware), else the emulator;
* ``emulator``  -> always the nki-kernels emulator;
* ``simulator`` -> the real package's CPU simulator (``nki.simulate``); fails if it is absent;
* ``hardware``  -> the real package on a Neuron device; fails if it is absent.

A value that cannot be used (a typo, or a real backend that is not installed) does not break
``import nki_kernels``: the first op called raises :class:`BackendUnavailable` with the reason
(``require()`` raises it up front; the CLI prints it as one line).
"""
from __future__ import annotations

import importlib
import os

BACKENDS = ("emulator", "simulator", "hardware")


class BackendUnavailable(RuntimeError):
    """The backend asked for with NKI_KERNELS_BACKEND cannot be used on this machine."""


def _real_nki():
    try:
        mod = importlib.import_module("nki")
    except Exception:  # noqa: BLE001 - not installed, or a placeholder that fails to import
        return None
    if getattr(mod, "__nki_kernels_emulator__", False):
        return None
    if not all(hasattr(mod, a) for a in ("jit", "language", "isa")):
        return None  # e.g. the empty PyPI placeholder package
    return mod


def _select():
    choice = os.environ.get("NKI_KERNELS_BACKEND", "").strip().lower()
    if choice and choice not in BACKENDS:
        raise BackendUnavailable(f"NKI_KERNELS_BACKEND must be one of {', '.join(BACKENDS)}; "
                                 f"got {choice!r}")
    if choice == "emulator":
        return "emulator", None
    real = _real_nki()
    if choice in ("simulator", "hardware"):
        if real is None:
            raise BackendUnavailable(
                f"NKI_KERNELS_BACKEND={choice} needs the real `nki` package (Neuron SDK 2.32+, from "
                f"the AWS Neuron package repository); it is not importable here. Unset the variable "
                f"or set NKI_KERNELS_BACKEND=emulator to use the nki-kernels emulator.")
        return choice, real
    if real is not None:
        return "hardware", real
    return "emulator", None


try:
    BACKEND, _real = _select()
    _ERROR = None
except BackendUnavailable as _e:
    BACKEND, _real, _ERROR = "unavailable", None, _e


def require():
    """Raise :class:`BackendUnavailable` when the backend NKI_KERNELS_BACKEND asks for cannot run
    here (the ops call this before anything else)."""
    if _ERROR is not None:
        raise BackendUnavailable(str(_ERROR))


if BACKEND in ("emulator", "unavailable"):     # unavailable: importable, every op refuses
    from . import emulator as nki
    from .emulator import isa as nisa
    from .emulator import language as nl
else:
    nki = _real
    nl = importlib.import_module("nki.language")
    nisa = importlib.import_module("nki.isa")


def lnc_programs():
    """Inside a kernel: (the programs of the launch, this one's id): (1, 0) for a plain launch,
    (2, 0 or 1) at LNC 2."""
    if not nl.program_ndim():
        return 1, 0
    return nl.num_programs(axes=0), nl.program_id(axis=0)


def launch(kernel, *args, lnc: int = 1):
    """Run a jitted kernel on the selected backend with NumPy (or torch) arguments."""
    require()
    k = kernel[lnc] if lnc != 1 else kernel
    if BACKEND == "simulator":
        return nki.simulate(k)(*args)
    return k(*args)


def is_emulated() -> bool:
    return BACKEND == "emulator"
