"""Operator objects: ``nl.add``, ``nl.exp``, ``nl.maximum`` ...

Kernels pass them as ``op=``/``op0=``/``reduce_op=``; instructions dispatch on identity. One object
may be an ALU operator in one instruction and an activation function in another (``nl.abs``,
``nl.square``, ``nl.relu``, ``nl.rsqrt``, ``nl.reciprocal``; nki-spec §8.1 item 11). Arithmetic is
float32 throughout (nki-spec §5.2). Activation functions are computed exactly in fp32; the
hardware's piecewise-polynomial error is not reproduced (nki-spec §11.3).
"""
from __future__ import annotations

import numpy as np

_F = np.float32


class Op:
    """An NKI operator. ``alu(a, b)`` for ALU use, ``act(x)`` for activation use."""

    __slots__ = ("name", "kind", "alu", "act", "reducible", "identity", "gen", "act_range",
                 "__weakref__")

    def __init__(self, name, kind=None, alu=None, act=None, reducible=False, identity=None, gen=2,
                 act_range=None):
        self.name = name
        self.kind = kind          # 'arith' | 'bitvec' | 'cmp' | 'unary' | None (activation only)
        self.alu = alu
        self.act = act
        self.reducible = reducible
        self.identity = identity  # reduction identity
        self.gen = gen            # min generation as an ALU op
        self.act_range = act_range

    def __repr__(self):
        return f"nl.{self.name}"

    def __call__(self, *args, **kwargs):
        """``nl.add(x, y)``, ``nl.exp(x)``: the experimental tile-returning ops (convenience.py)."""
        from .convenience import call_op
        return call_op(self, args, dict(kwargs))


def _f(x):
    return np.asarray(x, dtype=_F)


def _sig(x):
    with np.errstate(over="ignore"):
        return _F(1) / (_F(1) + np.exp(-x))


def _erf(x):
    # Abramowitz & Stegun 7.1.26 is 1.5e-7 absolute; use the higher-precision W. J. Cody style
    # rational via erfc for |x| large: here a simple, accurate composite is enough for fp32.
    x = np.asarray(x, dtype=np.float64)
    t = 1.0 / (1.0 + 0.5 * np.abs(x))
    y = 1.0 - t * np.exp(-x * x - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (
        0.09678418 + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (
            1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
    return np.where(x >= 0, y, -y).astype(_F)


def _softplus(x):
    with np.errstate(over="ignore"):
        return (np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))).astype(_F)


def _cmp(fn):
    return lambda a, b: fn(a, b).astype(_F)


def _bit(fn):
    return fn


_SQ2 = np.sqrt(2.0)
_SQ2PI = np.sqrt(2.0 / np.pi)


def _gelu(x):
    return (_F(0.5) * x * (_F(1) + _erf(x / _SQ2))).astype(_F)


def _gelu_dx(x):
    return (_F(0.5) * (_F(1) + _erf(x / _SQ2)) + x * np.exp(-x * x / 2) / np.sqrt(2 * np.pi)).astype(_F)


def _gelu_tanh(x):
    return (_F(0.5) * x * (_F(1) + np.tanh(_SQ2PI * (x + _F(0.044715) * x ** 3)))).astype(_F)


def _gelu_sig(x):
    return (x * _sig(_F(1.702) * x)).astype(_F)


def _gelu_sig_dx(x):
    s = _sig(_F(1.702) * x)
    return (s + _F(1.702) * x * s * (_F(1) - s)).astype(_F)


def _silu(x):
    return (x * _sig(x)).astype(_F)


def _silu_dx(x):
    s = _sig(x)
    return (s * (_F(1) + x * (_F(1) - s))).astype(_F)


def _safe(fn):
    def g(x):
        with np.errstate(all="ignore"):
            return np.asarray(fn(x), dtype=_F)
    return g


def _safe2(fn):
    def g(a, b):
        with np.errstate(all="ignore"):
            return np.asarray(fn(a, b), dtype=_F)
    return g


# ---------------------------------------------------------------------------- ALU operators
add = Op("add", "arith", _safe2(np.add), reducible=True, identity=0.0)
subtract = Op("subtract", "arith", _safe2(np.subtract), reducible=False, identity=0.0)
multiply = Op("multiply", "arith", _safe2(np.multiply), reducible=True, identity=1.0)
maximum = Op("maximum", "arith", _safe2(np.maximum), reducible=True, identity=-np.inf)
minimum = Op("minimum", "arith", _safe2(np.minimum), reducible=True, identity=np.inf)
equal = Op("equal", "cmp", _cmp(np.equal))
not_equal = Op("not_equal", "cmp", _cmp(np.not_equal))
greater = Op("greater", "cmp", _cmp(np.greater))
greater_equal = Op("greater_equal", "cmp", _cmp(np.greater_equal))
less = Op("less", "cmp", _cmp(np.less))
less_equal = Op("less_equal", "cmp", _cmp(np.less_equal))
logical_and = Op("logical_and", "arith", _cmp(lambda a, b: (a != 0) & (b != 0)), reducible=True,
                 identity=1.0)
logical_or = Op("logical_or", "arith", _cmp(lambda a, b: (a != 0) | (b != 0)), reducible=True,
                identity=0.0)
logical_xor = Op("logical_xor", "arith", _cmp(lambda a, b: (a != 0) ^ (b != 0)), reducible=True,
                 identity=0.0)
power = Op("power", "arith", _safe2(np.power))
abs_max = Op("abs_max", "arith", lambda a, b: np.where(np.abs(a) > np.abs(b), a, b).astype(_F),
             gen=4)
abs_min = Op("abs_min", "arith", lambda a, b: np.where(np.abs(a) < np.abs(b), a, b).astype(_F),
             gen=4)
# simulator-only on real NKI (no hardware instruction): kept so third-party kernels that use them
# in the simulator run, but they are flagged by the instructions that receive them.
divide = Op("divide", "arith", _safe2(np.divide))
fmod = Op("fmod", "arith", _safe2(np.fmod))
mod = Op("mod", "arith", _safe2(np.mod))
average = Op("average", None)  # only tensor_partition_reduce

invert = Op("invert", "bitvec", lambda a, b: np.invert(a))
bitwise_and = Op("bitwise_and", "bitvec", np.bitwise_and, reducible=True, identity=-1)
bitwise_or = Op("bitwise_or", "bitvec", np.bitwise_or, reducible=True, identity=0)
bitwise_xor = Op("bitwise_xor", "bitvec", np.bitwise_xor, reducible=True, identity=0)
left_shift = Op("left_shift", "bitvec", np.left_shift)
right_shift = Op("right_shift", "bitvec", lambda a, b: (a.view(np.dtype(a.dtype.str.replace(
    "i", "u"))) >> b.astype(np.dtype(a.dtype.str.replace("i", "u")))).view(a.dtype)
    if a.dtype.kind == "i" else np.right_shift(a, b))

# -------------------------------------------------------------------- unary (ALU and/or activation)
abs = Op("abs", "unary", lambda a, b: np.abs(a), act=_safe(np.abs))  # noqa: A001
square = Op("square", "unary", lambda a, b: (a * a).astype(_F), act=_safe(np.square), gen=4)
relu = Op("relu", "unary", lambda a, b: np.maximum(a, 0).astype(_F),
          act=_safe(lambda x: np.maximum(x, 0)), gen=4)
rsqrt = Op("rsqrt", "unary", _safe2(lambda a, b: 1 / np.sqrt(a)), act=_safe(lambda x: 1 / np.sqrt(x)),
           act_range=(2.0 ** -87, 2.0 ** 97))
reciprocal = Op("reciprocal", "unary", _safe2(lambda a, b: 1 / a), act=_safe(lambda x: 1 / x),
                act_range=(2.0 ** -42, 2.0 ** 42))

# ---------------------------------------------------------------------------- activation functions
class _CopyOp(Op):
    """``nl.copy`` is both the identity activation and the callable ``nl.copy(x, dtype=None)``."""

    __slots__ = ()

    def __call__(self, x, dtype=None):
        from .language import _copy_tile
        return _copy_tile(x, dtype)


copy = _CopyOp("copy", act=lambda x: x)
identity = copy
exp = Op("exp", act=_safe(np.exp))
log = Op("log", act=_safe(np.log), act_range=(2.0 ** -64, 2.0 ** 64))
sigmoid = Op("sigmoid", act=_safe(_sig))
tanh = Op("tanh", act=_safe(np.tanh))
gelu = Op("gelu", act=_safe(_gelu))
gelu_dx = Op("gelu_dx", act=_safe(_gelu_dx))
gelu_apprx_tanh = Op("gelu_apprx_tanh", act=_safe(_gelu_tanh))
gelu_apprx_sigmoid = Op("gelu_apprx_sigmoid", act=_safe(_gelu_sig))
gelu_apprx_sigmoid_dx = Op("gelu_apprx_sigmoid_dx", act=_safe(_gelu_sig_dx))
silu = Op("silu", act=_safe(_silu))
silu_dx = Op("silu_dx", act=_safe(_silu_dx))
softplus = Op("softplus", act=_safe(_softplus))
mish = Op("mish", act=_safe(lambda x: x * np.tanh(_softplus(x))))
erf = Op("erf", act=_safe(_erf))
erf_dx = Op("erf_dx", act=_safe(lambda x: 2 / np.sqrt(np.pi) * np.exp(-x * x)))
sign = Op("sign", act=_safe(np.sign))
sin = Op("sin", act=_safe(np.sin), act_range=(-np.pi, np.pi))
cos = Op("cos", act=_safe(np.cos))
arctan = Op("arctan", act=_safe(np.arctan), act_range=(-np.pi / 2, np.pi / 2))
sqrt = Op("sqrt", act=_safe(np.sqrt), act_range=(2.0 ** -116, 2.0 ** 118))
prelu = Op("prelu", act=None)  # activate2 only (slope = relu_param)
bypass = Op("bypass")          # no-op stage in activate2 / tensor-scalar stages

# ops that exist in nl as convenience functions only (not ALU/activation operators here)
negative = Op("negative")
ceil = Op("ceil")
floor = Op("floor")
trunc = Op("trunc")
tan = Op("tan")
logical_not = Op("logical_not")

ALU_OPS = [add, subtract, multiply, maximum, minimum, equal, not_equal, greater, greater_equal, less,
           less_equal, logical_and, logical_or, logical_xor, power, abs_max, abs_min, divide, fmod,
           mod, invert, bitwise_and, bitwise_or, bitwise_xor, left_shift, right_shift, abs, square,
           relu, rsqrt, reciprocal]
ACT_OPS = [o for o in list(globals().values()) if isinstance(o, Op) and o.act is not None]
SIM_ONLY = {divide, fmod, mod}


def is_op(x):
    return isinstance(x, Op)
