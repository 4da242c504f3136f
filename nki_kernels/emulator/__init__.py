"""The nki-kernels NKI emulator: run NKI kernels on a laptop, with hardware checks.

This package stands in for the ``nki`` package (NKI 0.6/0.7, SDK 2.32/2.33)::

    from nki_kernels.emulator import jit, language as nl, isa as nisa

or, for third-party kernels that ``import nki``::

    import nki_kernels.emulator
    nki_kernels.emulator.install()   # only when the real nki is absent
    import nki, nki.language as nl, nki.isa as nisa

Target generation: ``NEURON_PLATFORM_TARGET_OVERRIDE`` (trn2 | trn3, default trn3), or
``with nki_kernels.emulator.target("trn2"): ...``.
"""
from __future__ import annotations

import sys
import types

from . import isa, language  # noqa: F401
from .errors import NkiRuntimeError, NkiValidationError  # noqa: F401
from .jit import Kernel, jit, simulate  # noqa: F401
from .runtime import current_target_name, target  # noqa: F401
from .tensor import NkiTensor  # noqa: F401
from .trace import Trace, trace  # noqa: F401

__version__ = "0.7.0+emulator"  # the NKI API generation it follows


def estimate(kernel, *args, target="trn3", lnc=1, **kwargs):  # noqa: F811 (the kwarg)
    """Run ``kernel`` on the emulator and return the cost model's report (see ``cost``)."""
    from .cost import estimate as _estimate
    return _estimate(kernel, *args, target=target, lnc=lnc, **kwargs)


# ------------------------------------------------------------------------ nki.compiler / nki.typing
compiler = types.ModuleType("nki.compiler")


class _Config:
    def __init__(self, **kw):
        self.__dict__.update(kw)


compiler.CompileConfig = type("CompileConfig", (_Config,), {})
compiler.SpecializationConfig = type("SpecializationConfig", (_Config,), {})

typing = types.ModuleType("nki.typing")


class _TensorAnnotation:
    def __class_getitem__(cls, shape):
        return cls


typing.tensor = _TensorAnnotation


def _real_nki_present() -> bool:
    import importlib.util
    spec = importlib.util.find_spec("nki")
    if spec is None:
        return False
    mod = sys.modules.get("nki")
    if mod is not None:
        return getattr(mod, "__nki_kernels_emulator__", False) is False and hasattr(mod, "isa")
    try:
        import nki  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken or placeholder package is "absent"
        return False
    real = sys.modules["nki"]
    return hasattr(real, "jit") and hasattr(real, "isa") and hasattr(real, "language")


def install(force: bool = False) -> bool:
    """Register the emulator as ``nki``, ``nki.language``, ``nki.isa`` (and submodules).

    Does nothing and returns False when the real ``nki`` package is importable (unless ``force``),
    so the same script uses hardware or ``nki.simulate`` where they exist.
    """
    if not force and _real_nki_present():
        return False
    me = sys.modules[__name__]
    me.__nki_kernels_emulator__ = True
    sys.modules["nki"] = me
    sys.modules["nki.language"] = language
    sys.modules["nki.isa"] = isa
    sys.modules["nki.isa.constants"] = isa.constants
    sys.modules["nki.compiler"] = compiler
    sys.modules["nki.typing"] = typing
    return True
