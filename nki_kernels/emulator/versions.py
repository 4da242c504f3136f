"""Which NKI version the emulator follows, and what each version deprecated or removed.

The emulator follows one NKI version at a time: the newest, 0.7 (Neuron SDK 2.33), unless
``NKI_EMULATOR_VERSION`` (``0.3`` ... ``0.7``) or ``install(version=...)`` /
``with nki_version("0.3"):`` says otherwise. A feature the followed version deprecated is accepted
with a ``DeprecationWarning``; one it removed is refused with an error naming the version.

Sources for each entry: the NKI release notes and migration guides (Neuron SDK 2.29-2.33), as
summarised in docs/emulator.md ("NKI versions"). Entries marked ``library`` are uses that AWS's
own NKI Library (public head of April 2026, written for NKI 0.3 / SDK 2.29) makes and that its
simulation CI ran; the emulator accepts them under 0.3-0.6 with a warning and refuses them from
the version the migration guides name onwards.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings

from .errors import NkiValidationError

SUPPORTED = ("0.3", "0.4", "0.5", "0.6", "0.7")
DEFAULT = "0.7"
ENV = "NKI_EMULATOR_VERSION"

# feature -> (deprecated in, removed in, what to use instead)
CHANGES = {
    "nl.dynamic_range": ("0.6", "0.7", "nl.fori_loop"),
    "while reg:": ("0.6", "0.7", "nl.while_loop"),
    "integer enum values": ("0.3", "0.7", "the nisa enum members (nisa.dge_mode.none, ...)"),
    "nki.jit(mode=...)": ("0.3", "0.7", "nki.simulate / NEURON_PLATFORM_TARGET_OVERRIDE"),
    "nki.jit(platform_target=...)": ("0.3", "0.7", "NEURON_PLATFORM_TARGET_OVERRIDE"),
    "NumPy or string dtypes inside kernels": ("0.3", "0.7", "nl.* dtype objects"),
    "neuronxcc.nki namespace": ("0.3", "0.4", "import nki, nki.language, nki.isa, nki.typing"),
    "nl.tile_size.total_available_sbuf_size": ("0.4", None, "nl.tile_size.sbuf_fmax_bytes"),
}

_state = threading.local()
_global = [None]


def _parse(v) -> str:
    s = str(v).strip()
    parts = s.split(".")
    if len(parts) >= 2:
        s = f"{int(parts[0])}.{int(parts[1])}"
    if s not in SUPPORTED:
        raise ValueError(f"NKI version {v!r} is not followed by the emulator; supported: "
                         f"{', '.join(SUPPORTED)}")
    return s


def _key(v: str) -> tuple:
    return tuple(int(x) for x in v.split("."))


def current() -> str:
    """The NKI version being followed (``"0.7"`` unless set)."""
    stack = getattr(_state, "stack", None)
    if stack:
        return stack[-1]
    if _global[0] is not None:
        return _global[0]
    env = os.environ.get(ENV)
    return _parse(env) if env else DEFAULT


def set_version(v) -> str:
    """Follow NKI version ``v`` from now on (process-wide); ``None`` goes back to the default."""
    _global[0] = None if v is None else _parse(v)
    return current()


@contextlib.contextmanager
def nki_version(v):
    """Follow NKI version ``v`` inside the block (this thread)."""
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(_parse(v))
    try:
        yield
    finally:
        stack.pop()


def at_least(v) -> bool:
    return _key(current()) >= _key(_parse(v))


def status(feature: str) -> str:
    """``"ok"``, ``"deprecated"`` or ``"removed"`` under the followed version."""
    dep, rem, _ = CHANGES[feature]
    if rem is not None and at_least(rem):
        return "removed"
    if dep is not None and at_least(dep):
        return "deprecated"
    return "ok"


_warned = set()


def check(feature: str, where: str, exc=NkiValidationError) -> None:
    """Refuse ``feature`` if the followed version removed it; warn (once per site) if deprecated."""
    st = status(feature)
    dep, rem, instead = CHANGES[feature]
    if st == "removed":
        raise exc(f"{where}: {feature} removed in NKI {rem} (the emulator follows NKI "
                  f"{current()}; set {ENV}=0.{int(rem.split('.')[1]) - 1} or use {instead})")
    if st == "deprecated":
        key = (feature, where)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"{where}: {feature} deprecated in NKI {dep}"
                          + (f", removed in NKI {rem}" if rem else "") + f"; use {instead}",
                          DeprecationWarning, stacklevel=3)
