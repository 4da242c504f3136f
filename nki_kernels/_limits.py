"""The two NeuronCore limits every kernel plans with, written once.

* ``P``: SBUF and PSUM have 128 partitions (lanes); a tile's first dimension is at most 128 and
  TensorE contracts over it (``nl.tile_size.pmax`` in NKI).
* ``sbuf_budget()``: the SBUF bytes per partition a kernel's plan may use: the target's capacity
  (``nl.tile_size.sbuf_fmax_bytes``: 192 KiB on Trn2, 256 KiB on Trn3) less a 10% margin left to
  the compiler's own buffers.
"""
from __future__ import annotations

from .backend import nl

P = 128
SBUF_MARGIN = 0.9


def sbuf_budget() -> int:
    """Usable SBUF bytes per partition on the current target (10% margin for the compiler)."""
    return int(nl.tile_size.sbuf_fmax_bytes * SBUF_MARGIN)
