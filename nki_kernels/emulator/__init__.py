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

from . import collectives, isa, language, versions  # noqa: F401
from . import dtypes as _dt
from . import runtime as _runtime
from .errors import NkiRuntimeError, NkiValidationError  # noqa: F401
from .jit import Kernel, jit, simulate  # noqa: F401
from .runtime import current_target_name, target  # noqa: F401
from .tensor import NkiTensor  # noqa: F401
from .trace import Trace, trace  # noqa: F401
from .versions import nki_version  # noqa: F401

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

    def __eq__(self, other):   # by value: sub-kernels' configs are compared with the top-level's
        return type(other) is type(self) and other.__dict__ == self.__dict__

    __hash__ = None

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


compiler.CompileConfig = type("CompileConfig", (_Config,), {})
compiler.SpecializationConfig = type("SpecializationConfig", (_Config,), {})
compiler.__path__ = []           # a package: nki.compiler.frontend below

# nki.compiler.frontend: the Python -> compiler-IR front ends (NKI Library's test harness traces
# kernels with ``ParserFrontend().compile(kernel, inputs=..., target=..., lnc=...)`` in its
# ``trace_only`` tests). Here "compiling" runs the kernel once on the emulator for that target and
# LNC, which traces it: whatever the kernel's own asserts or the emulator's rules refuse is raised,
# and nothing else is produced (no MLIR module: ``module`` is None; no NEFF).
frontend = types.ModuleType("nki.compiler.frontend")


class NKIFrontend:
    """Base of the emulator's front ends; :meth:`compile` traces by running on the emulator."""

    def compile(self, kernel, *, inputs=None, target=None, lnc=1, artifacts_dir=None,
                dump_python_ast=False, output_names=None, **_options):
        run = cpu_simulate(kernel)[int(lnc or 1)]
        gen = str(target) if target else None
        if gen is not None and gen not in ("trn1", "trn2", "trn3", "inf2"):
            gen = None
        if gen:
            with _runtime.target(gen):
                outputs = run(**dict(inputs or {}))
        else:
            outputs = run(**dict(inputs or {}))
        return types.SimpleNamespace(module=None, kernel=kernel, outputs=outputs, target=gen,
                                     lnc=int(lnc or 1), output_names=output_names)


class ParserFrontend(NKIFrontend):
    """NKI 0.3-0.6's AST front end (on the emulator: a run, see :class:`NKIFrontend`)."""


class TracerFrontend(NKIFrontend):
    """NKI 0.7's Python tracer front end (on the emulator: a run, see :class:`NKIFrontend`)."""


frontend.NKIFrontend, frontend.ParserFrontend, frontend.TracerFrontend = (
    NKIFrontend, ParserFrontend, TracerFrontend)
compiler.frontend = frontend

typing = types.ModuleType("nki.typing")


class _TensorAnnotation:
    """``nt.tensor[128, 512]``: an annotation only (the emulator does not check it)."""

    def __class_getitem__(cls, shape):
        return cls


typing.tensor = _TensorAnnotation
typing.mutable_tensor = type("mutable_tensor", (_TensorAnnotation,), {})

# nki.language.dtypes / nki.dtype: the dtype objects (``nki.dtype`` is also the annotation type)
from .dtypes import NkiDtype as dtype  # noqa: E402,F401

language_dtypes = types.ModuleType("nki.language.dtypes")
for _d in _dt.ALL:
    setattr(language_dtypes, _d.name, _d)
    # ``import nki.dtype as nt`` binds the package attribute ``nki.dtype`` (the dtype class, also
    # the annotation type), and NKI Library then reads ``nt.float8_e4m3``: the class carries the
    # dtype names too
    setattr(dtype, _d.name, _d)
language_dtypes.NkiDtype = _dt.NkiDtype
language_dtypes.dtype = _dt.NkiDtype
language.dtypes = language_dtypes

# nki.tensor: the tensor class
tensor = types.ModuleType("nki.tensor")
tensor.NkiTensor = NkiTensor
tensor.Tensor = NkiTensor

# nki.builtin: the namespace NKI installs as ``builtins.builtin`` (language and isa under one name)
builtin = types.ModuleType("nki.builtin")
builtin.language = language
builtin.isa = isa
builtin.lang = language


def cpu_simulate(kernel):
    """``nki.cpu_simulate(kernel)[lnc](**inputs)`` (NKI Library's harness spelling of
    ``nki.simulate``): the target comes from ``NKI_NC_VERSION`` (gen2/gen3/gen4) when set."""
    import os
    k = kernel if isinstance(kernel, Kernel) else Kernel(getattr(kernel, "fn", kernel))

    class _Launcher:
        def __getitem__(self, lnc):
            kk = k[lnc]

            def call(*args, **kwargs):
                gen = os.environ.get("NKI_NC_VERSION")
                if gen:
                    with target(gen):
                        return kk(*args, **kwargs)
                return kk(*args, **kwargs)
            return call

        def __call__(self, *args, **kwargs):
            return self[1](*args, **kwargs)
    return _Launcher()




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


RETIRED_NAMESPACE = ("neuronxcc.nki",)
_RETIRED_MSG = (
    "{name}: the neuronxcc.nki namespace (NKI Beta 1) is retired (its end of support was announced "
    "in Neuron SDK 2.27; from NKI 0.4 / SDK 2.30 a kernel using it is a compile error): kernels "
    "import nki, nki.language and nki.isa instead (see the NKI migration "
    "guide, 'NKI Beta 1 to NKI 0.2.0', in the Neuron documentation). The nki-kernels emulator "
    "implements only the nki namespace.")


class _RetiredNamespaceFinder:
    """Import hook: ``import neuronxcc.nki...`` fails with one clear error, not a bare
    ModuleNotFoundError (only when the real neuronxcc compiler is absent)."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname.startswith("neuronxcc") and versions.status("neuronxcc.nki namespace") != "removed":
            # NKI 0.3 still shipped neuronxcc.nki; NKI Library's head imports its typing module
            # (annotations only): serve that one, refuse the rest of the Beta 1 API
            if fullname in ("neuronxcc", "neuronxcc.nki", "neuronxcc.nki.typing"):
                import importlib.machinery
                return importlib.machinery.ModuleSpec(fullname, _RetiredLoader(),
                                                      is_package=fullname != "neuronxcc.nki.typing")
        if fullname in RETIRED_NAMESPACE or fullname.startswith("neuronxcc.nki."):
            raise ImportError(_RETIRED_MSG.format(name=fullname), name=fullname)
        if fullname == "neuronxcc":  # absent: `import neuronxcc.nki...` must still say why
            raise ModuleNotFoundError(
                "No module named 'neuronxcc' (the Neuron compiler is not installed). If this is "
                "a kernel importing " + _RETIRED_MSG.format(name="neuronxcc.nki"), name=fullname)
        return None


class _RetiredPackage(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(_RETIRED_MSG.format(name=f"{self.__name__}.{name}"))


class _RetiredLoader:
    def create_module(self, spec):
        if spec.name == "neuronxcc.nki.typing":
            versions.check("neuronxcc.nki namespace", "import neuronxcc.nki.typing",
                           exc=ImportError)
            return typing
        m = _RetiredPackage(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def _module_table():
    """Every module name ``install()`` registers, and the object it maps to."""
    return {
        "nki": sys.modules[__name__],
        "nki.language": language,
        "nki.language.dtypes": language_dtypes,
        "nki.dtype": language_dtypes,
        "nki.isa": isa,
        "nki.isa.constants": isa.constants,
        "nki.compiler": compiler,
        "nki.compiler.frontend": frontend,
        "nki.typing": typing,
        "nki.tensor": tensor,
        "nki.builtin": builtin,
        "nki.collectives": collectives,
    }


def install(force: bool = False, version=None) -> bool:
    """Register the emulator as ``nki``, ``nki.language``, ``nki.isa`` (and submodules).

    Does nothing and returns False when the real ``nki`` package is importable (unless ``force``),
    so the same script uses hardware or ``nki.simulate`` where they exist. ``version`` ("0.3" ...
    "0.7") selects the NKI version the emulator follows (default ``NKI_EMULATOR_VERSION`` or 0.7).
    Kernels importing the retired ``neuronxcc.nki`` namespace get one error naming the change.
    """
    if version is not None:
        versions.set_version(version)
    if not force and _real_nki_present():
        return False
    me = sys.modules[__name__]
    me.__nki_kernels_emulator__ = True
    sys.modules.update(_module_table())
    import importlib.util
    try:  # the real compiler (which still ships neuronxcc.nki's error messages) keeps its own
        has_ncc = "neuronxcc" not in sys.modules and importlib.util.find_spec("neuronxcc") is not None
    except (ImportError, ValueError):
        has_ncc = False
    if not has_ncc and not any(isinstance(f, _RetiredNamespaceFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _RetiredNamespaceFinder())
    return True
