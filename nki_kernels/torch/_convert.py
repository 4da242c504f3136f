"""Zero-copy moves between CPU torch tensors and NumPy / ml_dtypes arrays (same storage).

torch has no ``float8_e4m3`` (Trn2's FP8 matmul format, max 240): such arrays travel as
``torch.uint8`` bit patterns, and a ``uint8`` tensor is reinterpreted as that format where an op
says so.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

# torch dtype -> (an integer dtype of the same size, the ml_dtypes type)
_BITS = {
    torch.bfloat16: (torch.int16, np.int16, ml_dtypes.bfloat16),
    torch.float8_e4m3fn: (torch.uint8, np.uint8, ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: (torch.uint8, np.uint8, ml_dtypes.float8_e5m2),
}
_FROM_NP = {np.dtype(nd).name: (npint, tdt) for tdt, (_, npint, nd) in _BITS.items()}

# dtype names of the NumPy-facing API <-> torch dtypes
TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
               "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
               "float8_e4m3": torch.uint8}


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def to_numpy(t, like: str | None = None):
    """A NumPy view of a CPU tensor (no copy; non-contiguous views stay strided). ``like``
    reinterprets uint8 bits as an FP8 format NumPy knows and torch does not."""
    if t is None:
        return None
    t = t.detach()
    if t.dtype in _BITS:
        tint, _, nd = _BITS[t.dtype]
        return t.view(tint).numpy().view(nd)
    a = t.numpy()
    if like is not None and a.dtype == np.uint8:
        return a.view(getattr(ml_dtypes, like))
    return a


def to_torch(a):
    """A CPU tensor sharing ``a``'s memory (a copy only if ``a`` is read-only)."""
    if a is None:
        return None
    if isinstance(a, torch.Tensor):
        return a
    a = np.asarray(a)
    if not a.flags.writeable:
        a = a.copy()
    name = a.dtype.name
    if name in _FROM_NP:
        npint, tdt = _FROM_NP[name]
        return torch.from_numpy(a.view(npint)).view(tdt)
    if name == "float8_e4m3":
        return torch.from_numpy(a.view(np.uint8))
    return torch.from_numpy(a)
