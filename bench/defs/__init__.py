"""Bench definitions: one module per op in this package, each registering its cases.

A definition module turns the shapes of ``nki_kernels.reference.shapes`` into ``BenchCase``s::

    from nki_kernels.bench.defs import BenchCase, register
    from nki_kernels.reference import shapes

    @register("rmsnorm_quant")
    def cases(tier, target):
        for s in shapes.tier(tier).rmsnorm:
            yield BenchCase(op="rmsnorm_quant", shape=s.name, dims={"T": s.tokens, ...},
                            dtype="bf16", make_inputs=..., run=..., flops=..., bytes=...,
                            roof_kind="bf16")

``cases(tier, target)`` yields the cases of one tier (``fast`` | ``odd`` | ``models``) for one
target; it must be cheap (no input arrays are built until a case runs). Shapes come from the
shared table only, never written into a definition. The harness imports every module of this
package (``load()``); a module that fails to import (its op is not written yet) is reported by
``nki-kernels bench --list`` instead of breaking the bench.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nki_kernels.bench.roofline import KINDS, EngineCeiling

__all__ = ["BenchCase", "EngineCeiling", "register", "registered", "cases", "load", "check_rows"]


@dataclass(frozen=True, eq=False)
class BenchCase:
    """One (op, shape, dtype) point of the bench.

    op          registered op name ("matmul")
    shape       shape name from reference/shapes.py ("2048^3", "deepseek-v3 expert_up M=8")
    dims        named dims for the report ({"M": 8, "K": 7168, "N": 2048})
    dtype       input dtype label ("bf16", "fp8", "mxfp8", "fp32")
    make_inputs rng -> tuple of positional arguments for ``run`` (NumPy arrays)
    run         the Python-facing op, called as run(*inputs); returns the op's output
    flops       useful FLOPs (the reference's flops_<op>; causal counts attended pairs only)
    bytes       compulsory HBM bytes (the reference's bytes_<op>: inputs read once + outputs)
    roof_kind   TensorE peak that applies: "bf16" | "fp8" | "mx" | "fp32"
    lnc         NeuronCores the op runs on (1 or 2): roofs are multiplied by it
    ceilings    EngineCeiling entries for non-TensorE limits (exp throughput, ...)
    goal        {target: % of roof} the op's goal for this case on each target ({} = none set);
                the README table marks each row met or missed against it
    check       (inputs, output) -> None: compares the op's output with the NumPy reference and
                raises AssertionError when they differ (``nki-kernels bench --check``); None =
                the definition has no check
    """

    op: str
    shape: str
    dims: Mapping[str, int]
    dtype: str
    make_inputs: Callable[[Any], tuple]
    run: Callable[..., Any]
    flops: float
    bytes: float
    roof_kind: str = "bf16"
    lnc: int = 1
    ceilings: tuple[EngineCeiling, ...] = ()
    goal: Mapping[str, float] | None = None
    check: Callable[[tuple, Any], None] | None = None

    def __post_init__(self):
        if self.roof_kind not in KINDS:
            raise ValueError(f"{self.op} {self.shape}: roof_kind must be one of "
                             f"{', '.join(KINDS)}; got {self.roof_kind!r}")
        if self.lnc not in (1, 2):
            raise ValueError(f"{self.op} {self.shape}: lnc must be 1 or 2; got {self.lnc}")
        if self.flops < 0 or self.bytes < 0:
            raise ValueError(f"{self.op} {self.shape}: flops and bytes must be >= 0")

    def goal_for(self, target: str) -> float | None:
        """The goal (% of roof) on ``target``, None when none is set."""
        return (self.goal or {}).get(target)

    @property
    def dims_str(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.dims.items())


def check_rows(n: int, keep: int = 256):
    """Row indices a bench check compares: all of ``n`` rows up to ``2 * keep``, else the first and
    the last ``keep`` (each row of these ops is computed independently, so the first and last
    row blocks exercise the first and last tiles of every loop at a fraction of the cost)."""
    import numpy as np
    if n <= 2 * keep:
        return np.arange(n)
    return np.concatenate([np.arange(keep), np.arange(n - keep, n)])


CasesFn = Callable[[str, str], Iterable[BenchCase]]
_REGISTRY: dict[str, CasesFn] = {}
_LOAD_ERRORS: dict[str, str] = {}
_loaded = False


def register(op: str, cases_fn: CasesFn | None = None):
    """Register ``cases_fn(tier, target) -> iterable of BenchCase`` for ``op``; usable as a
    decorator (``@register("matmul")``). Registering the same op twice replaces it."""
    def deco(fn):
        _REGISTRY[op] = fn
        return fn
    return deco(cases_fn) if cases_fn is not None else deco


def load() -> dict[str, str]:
    """Import every definition module of this package once; return {module: import error}."""
    global _loaded
    if not _loaded:
        _loaded = True
        for info in pkgutil.iter_modules(__path__):
            if info.name.startswith("_"):
                continue
            try:
                importlib.import_module(f"{__name__}.{info.name}")
            except Exception as e:  # noqa: BLE001 - an op not written yet must not stop the bench
                _LOAD_ERRORS[info.name] = f"{type(e).__name__}: {e}"
    return dict(_LOAD_ERRORS)


def registered() -> list[str]:
    """Registered op names, sorted."""
    load()
    return sorted(_REGISTRY)


def cases(op: str, tier: str, target: str) -> list[BenchCase]:
    """The cases of ``op`` for one tier and target."""
    load()
    if op not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise KeyError(f"no bench definition for op {op!r}; registered: {known}")
    out = list(_REGISTRY[op](tier, target))
    for c in out:
        if not isinstance(c, BenchCase):
            raise TypeError(f"bench definition of {op!r} yielded {type(c).__name__}, "
                            f"not BenchCase")
    return out
