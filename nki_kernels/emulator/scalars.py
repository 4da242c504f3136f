"""Runtime integers: ``VirtualRegister`` (``nisa.register_alloc``), ``NkiScalar`` (loop indices of
``nl.fori_loop``, ``nisa.scalar_load``) and ``nl.ds``.

On hardware their values are unknown while the kernel is specialised, so the tracer raises
``TypeError`` when Python control flow inspects them. The emulator knows the value, but raises the
same way so that a kernel which passes here does not depend on it (nki-spec §3.4).
"""
from __future__ import annotations

import dis
import functools
import sys


def _wrap32(v: int) -> int:
    return ((int(v) + 2**31) % 2**32) - 2**31


class _Runtime:
    __slots__ = ("_v", "_bits")

    def __init__(self, v, bits=32):
        self._v = int(v)
        self._bits = bits

    def _no(self, what):
        raise TypeError(f"{type(self).__name__}: a runtime value cannot be used in Python {what} "
                        f"(its value is only known on the device); use it as a loop bound, in "
                        f"nl.ds(...) or as an .ap(scalar_offset=...)")

    def __bool__(self):
        self._no("conditions")

    def __int__(self):
        self._no("int()")

    def __index__(self):
        self._no("indexing/range()")

    def __float__(self):
        self._no("float()")

    def __repr__(self):
        return f"{type(self).__name__}(<runtime>)"


class NkiScalar(_Runtime):
    """A traced integer (int32 wraps; int64 allowed as an HBM offset)."""

    def _mk(self, v):
        return NkiScalar(_wrap32(v) if self._bits == 32 else v, self._bits)

    def _val(self, o):
        if isinstance(o, NkiScalar):
            return o._v
        if isinstance(o, VirtualRegister):
            return o._v
        if isinstance(o, int) and not isinstance(o, bool):
            return o
        raise TypeError(f"NkiScalar arithmetic takes Python ints or NkiScalars; got {type(o).__name__}")

    def __add__(self, o):
        return self._mk(self._v + self._val(o))

    __radd__ = __add__

    def __sub__(self, o):
        return self._mk(self._v - self._val(o))

    def __rsub__(self, o):
        return self._mk(self._val(o) - self._v)

    def __mul__(self, o):
        return self._mk(self._v * self._val(o))

    __rmul__ = __mul__

    def __neg__(self):
        return self._mk(-self._v)


class VirtualRegister(_Runtime):
    """A 32-bit engine register (``nisa.register_alloc``)."""

    def __init__(self, v=0):
        super().__init__(_wrap32(v) if v is not None else 0)
        self.initialized = v is not None

    def __bool__(self):
        """``while reg:``, a register-driven loop (``reg != 0``, tested before each iteration):
        NKI 0.3-0.5, deprecated in 0.6, removed in 0.7 (``nl.while_loop``; nki-spec 3.4). Any
        other truth test of a register (``if reg:``) is refused: its value is unknown while the
        kernel is specialised."""
        f = sys._getframe(1)
        if not _loop_test(f.f_code, f.f_lasti):
            self._no("conditions")
        from . import versions
        versions.check("while reg:", "VirtualRegister", exc=TypeError)
        return self._v != 0


@functools.lru_cache(maxsize=256)
def _loop_test(code, lasti) -> bool:
    """Whether the truth test at bytecode offset ``lasti`` of ``code`` is a ``while`` loop's, not
    an ``if``'s: its conditional jump goes back to the loop body (the test CPython repeats at the
    loop's end), or it jumps forward past a jump that goes back to the start of the body it
    guards. Cached: a loop asks once per iteration."""
    ins = list(dis.get_instructions(code))
    at = {i.offset: k for k, i in enumerate(ins)}
    k = at.get(lasti)
    if k is None:
        return False
    cur = ins[k]
    if "JUMP" not in cur.opname or not isinstance(cur.argval, int):
        return False
    if cur.argval < cur.offset:                      # bottom-of-loop test: jumps back
        return True
    body = ins[k + 1].offset if k + 1 < len(ins) else cur.offset
    return any("JUMP" in i.opname and isinstance(i.argval, int) and i.argval <= body
               for i in ins[k + 1:] if i.offset < cur.argval)


def runtime_value(x) -> int:
    """The concrete value of an int, VirtualRegister, NkiScalar (emulator-internal)."""
    if isinstance(x, _Runtime):
        return x._v
    if isinstance(x, bool):
        raise TypeError("a bool is not an offset")
    return int(x)


def is_runtime(x) -> bool:
    return isinstance(x, _Runtime)


class ds:
    """``nl.ds(start, size)``: the slice ``start:start+size``; ``start`` may be a runtime value."""

    __slots__ = ("start", "size")

    def __init__(self, start, size):
        # size 0 is the empty slice start:start (Python's and NumPy's): a view may be empty, an
        # instruction operand may not (isa._common.tensor)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"nl.ds: size must be a non-negative compile-time int; got {size!r}")
        self.start = start
        self.size = size

    def __repr__(self):
        return f"nl.ds({self.start!r}, {self.size})"
