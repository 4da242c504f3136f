"""Helpers the emulator tests share: run a body inside a jitted kernel, read a view, load to SBUF."""
from __future__ import annotations

import numpy as np

from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import jit, target
from nki_kernels.emulator import language as nl


def in_kernel(body, *arrays, tgt="trn3"):
    """Run ``body(*hbm_tensors)`` inside a jitted kernel and return what it returned."""
    box = {}

    @jit
    def k(arrs):
        box["r"] = body(*arrs)

    with target(tgt):
        k(tuple(arrays))
    return box["r"]


def val(t):
    """A copy of the elements of view ``t`` (storage dtype)."""
    return np.array(t._read(), copy=True)


def load(h, dtype=None, shape=None):
    """HBM tensor ``h`` -> a new SBUF tile (of ``dtype`` / ``shape`` when given) by one DMA."""
    t = nl.ndarray(shape or h.shape, dtype or h.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=h)
    return t
