"""The input checks every op shares (host side, never used inside kernels).

Messages name the op, the argument, what it got and what is supported.
"""
from __future__ import annotations

import numpy as np


def is_torch(x) -> bool:
    """A torch tensor, recognised without importing torch."""
    return type(x).__module__.split(".")[0] == "torch"


def dtype_name(x) -> str:
    """The dtype name of a NumPy/ml_dtypes array or a torch tensor: 'bfloat16', 'float8_e4m3fn'..."""
    if is_torch(x):
        return str(x.dtype).replace("torch.", "")
    return np.dtype(x.dtype).name


def check_2d(op, name, a):
    shape = getattr(a, "shape", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"{op}: {name} must be a 2-D array; got shape {shape}")
    if min(shape) < 1:
        raise ValueError(f"{op}: {name} must have positive dimensions; got {list(shape)}")
    return int(shape[0]), int(shape[1])


def check_dtype(op, name, a, allowed):
    got = dtype_name(a)
    if got not in allowed:
        raise TypeError(f"{op}: {name}.dtype must be {' or '.join(allowed)}; got {got}")
    return got


def float_vector(op, name, v, n):
    """A float vector of length n as a contiguous fp32 NumPy array (it is small: H or N)."""
    if is_torch(v):
        v = v.detach().float().numpy()
    a = np.asarray(v)
    if a.shape != (n,):
        raise ValueError(f"{op}: {name} must be a vector of length {n}; got shape {list(a.shape)}")
    if a.dtype.kind not in "fV" and dtype_name(a) != "bfloat16":
        raise TypeError(f"{op}: {name} must be a float vector; got {a.dtype}")
    return np.ascontiguousarray(a.astype(np.float32))
