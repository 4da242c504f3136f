"""``nki.isa`` for the emulator: every instruction the library uses, with the spec's signatures.

Instructions of the spec that are not implemented are present as functions that raise a clear
``NotImplementedError`` (listed in ``NOT_IMPLEMENTED`` and in docs/emulator.md).
"""
from __future__ import annotations

import importlib

from ..errors import NkiValidationError
from . import constants  # noqa: F401  (nki.isa.constants must exist as a module)
from ._common import (
    NkiHardwareWarning,
    NkiInstruction,
    dge_mode,
    dma_engine,
    engine,
    gpsimd_engine,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
    scalar_engine,
    tensor_engine,
    unknown_engine,
    vector_engine,
)

# Every nki.isa instruction named in nki-spec §9 (SDK 2.32/2.33).
SPEC_INSTRUCTIONS = [
    "nc_matmul", "nc_matmul_mx", "nc_transpose", "dma_copy", "dma_transpose", "dma_compute",
    "tensor_copy", "tensor_copy_predicated", "memset", "iota", "affine_select", "range_select",
    "select_reduce", "tensor_tensor", "tensor_scalar", "scalar_tensor_tensor", "tensor_reduce",
    "tensor_partition_reduce", "tensor_scalar_reduce", "tensor_scalar_cumulative",
    "tensor_tensor_scan", "reciprocal", "exponential", "activation", "activation_reduce",
    "activate2", "bn_stats", "bn_aggr", "max8", "nc_find_index8", "nc_match_replace8", "topk",
    "nonzero_with_count", "sequence_bounds", "quantize_mx", "nc_stream_shuffle", "local_gather",
    "nc_n_gather", "rng", "rand2", "rand_set_state", "rand_get_state", "set_rng_seed", "dropout",
    "core_barrier", "sendrecv", "register_alloc", "register_move", "register_load",
    "register_store", "scalar_load", "scalar_store", "get_nc_version", "get_nc_sub_version",
]

# Modules that implement instructions; each defines functions named as in the spec.
_MODULES = ["tensor_engine", "dma", "vector", "misc", "vector_ext", "selection", "search", "mx",
            "dma_extra", "gpsimd_ext"]

_impl = {}
for _m in _MODULES:
    try:
        _mod = importlib.import_module(f"{__name__}.{_m}")
    except ModuleNotFoundError as e:  # a module not written yet
        if e.name != f"{__name__}.{_m}":
            raise
        continue
    for _n in SPEC_INSTRUCTIONS:
        if hasattr(_mod, _n) and _n not in _impl:
            _impl[_n] = getattr(_mod, _n)


def _missing(n):
    def f(*args, **kwargs):
        raise NotImplementedError(f"nki.isa.{n} is not implemented by the nki-kernels emulator "
                                  f"(see docs/emulator.md for the implemented surface)")
    f.__name__ = n
    f.__qualname__ = n
    return f


NOT_IMPLEMENTED = []
for _n in SPEC_INSTRUCTIONS:
    if _n in _impl:
        globals()[_n] = _impl[_n]
    else:
        globals()[_n] = _missing(_n)
        NOT_IMPLEMENTED.append(_n)

__all__ = SPEC_INSTRUCTIONS + [
    "NkiValidationError", "NkiHardwareWarning", "NkiInstruction", "engine", "reduce_cmd",
    "dge_mode", "oob_mode", "matmul_perf_mode", "nc_version", "dma_engine", "tensor_engine",
    "vector_engine", "scalar_engine", "gpsimd_engine", "unknown_engine", "constants"]
