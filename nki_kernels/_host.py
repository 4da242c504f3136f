"""Host-side argument inspection shared by the ops (never used inside kernels)."""
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
