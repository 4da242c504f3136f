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


class SbufLedger:
    """The SBUF a kernel holds, per partition, as its plan walks the kernel's buffers in the
    order the kernel takes and releases them: ``take(name, bytes)`` where the kernel first
    writes a buffer, ``drop(name)`` where its last reference goes. ``peak`` is the fullest
    moment (the figure a plan checks against ``sbuf_budget()``), ``at`` its live buffers.

    All of a kernel's SBUF tensors start at partition 0, so the bytes per partition of the
    fullest partition are the sum over live buffers."""

    def __init__(self):
        self.live = {}
        self.used = 0
        self.peak = 0
        self.at = {}

    def take(self, name, nbytes):
        if name in self.live:
            raise KeyError(f"SbufLedger: {name!r} is already live")
        self.live[name] = int(nbytes)
        self.used += int(nbytes)
        if self.used > self.peak:
            self.peak, self.at = self.used, dict(self.live)

    def drop(self, *names):
        for name in names:
            self.used -= self.live.pop(name)

    def has(self, name):
        return name in self.live
