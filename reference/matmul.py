"""NumPy reference for ``nki_kernels.matmul``: C = A @ B in float32, cast to the output dtype."""
from __future__ import annotations

import ml_dtypes
import numpy as np


def matmul_ref(a, b, out_dtype="bfloat16"):
    """``A [M, K] @ B [K, N]`` with inputs upcast exactly to fp32, fp32 accumulation."""
    c = np.asarray(a).astype(np.float32) @ np.asarray(b).astype(np.float32)
    return c.astype(ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.float32)


def flops_matmul(M, K, N):
    return 2 * M * K * N


def bytes_matmul(M, K, N, in_itemsize, out_itemsize):
    """Compulsory HBM traffic: read A and B once, write C once."""
    return (M * K + K * N) * in_itemsize + M * N * out_itemsize
