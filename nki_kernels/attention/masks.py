"""Attention masks: causal / left sliding window for a (q-tile, key-range) pair.

Two halves:

* host / trace-time logic (plain Python): :class:`MaskSpec` (which keys each query row sees) and
  :func:`classify` (a tile is FULL, PARTIAL or SKIP);
* kernel helpers that apply the mask to a score tile with one instruction:
  :func:`row_bounds` (per-row first/last visible key as fp32 ``[rows, 1]`` tiles, GpSimd ``iota``),
  :func:`mask_range_select` (VectorE ``range_select``: reads SBUF or PSUM, fuses the row max) and
  :func:`mask_affine_select` (GpSimd ``affine_select``: SBUF only, keeps VectorE free).

Conventions (identical to ``reference/flash_attention.py``): query row ``i`` is at absolute
position ``pos(i) = i + S_kv - S_q``; causal keeps keys ``j <= pos(i)``; ``window = w`` keeps keys
``j > pos(i) - w`` (w keys including the diagonal). Masked scores become ``FP32_MIN``
(-3.4028235e38), the only fill ``range_select`` accepts on hardware; the online softmax keeps its
running max >= a finite floor so that ``exp(FP32_MIN - m)`` is exactly 0.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from ..backend import nisa, nl

FP32_MIN = -3.4028234663852886e38


class TileKind(enum.Enum):
    FULL = "full"          # every (row, key) pair visible: no mask
    PARTIAL = "partial"    # some pairs visible: apply the per-row bounds
    SKIP = "skip"          # no pair visible: never computed


@dataclass(frozen=True)
class MaskSpec:
    """Which keys each query row of one (batch, head) sees.

    s_q, s_kv: sequence lengths (queries are the last ``s_q`` positions of ``s_kv``).
    causal: keep keys at or before the query position.
    window: left sliding window size in keys (0 = none).
    """
    s_q: int
    s_kv: int
    causal: bool = True
    window: int = 0

    @property
    def offset(self) -> int:
        """Absolute position of query row 0 (``S_kv - S_q``)."""
        return self.s_kv - self.s_q

    def row_hi(self, i: int) -> int:
        """Last key row ``i`` sees (inclusive; may be < 0 when it sees none)."""
        if self.causal:
            return min(i + self.offset, self.s_kv - 1)
        return self.s_kv - 1

    def row_lo(self, i: int) -> int:
        """First key row ``i`` sees."""
        if self.window:
            return max(0, i + self.offset - self.window + 1)
        return 0

    @property
    def needs_mask(self) -> bool:
        return self.causal or bool(self.window)


def classify(spec: MaskSpec, q0: int, q1: int, k0: int, k1: int) -> TileKind:
    """Kind of the tile rows ``[q0, q1)`` x keys ``[k0, k1)`` (row bounds are monotone in i)."""
    if q1 <= q0 or k1 <= k0:
        return TileKind.SKIP
    if k0 > spec.row_hi(q1 - 1) or k1 - 1 < spec.row_lo(q0):
        return TileKind.SKIP
    if k0 >= spec.row_lo(q1 - 1) and k1 - 1 <= spec.row_hi(q0):
        return TileKind.FULL
    return TileKind.PARTIAL


# ------------------------------------------------------------------------------ kernel helpers


def row_bounds(lo, hi, spec: MaskSpec, q0: int, rows: int):
    """Fill ``lo``/``hi`` (fp32 SBUF ``[rows, 1]``) with each row's first / last visible key.

    Exact in fp32 below 2^24 keys. Unbounded sides get a bound that never binds (-1 / s_kv)."""
    off = q0 + spec.offset
    if spec.causal:
        nisa.iota(dst=hi[0:rows, :], pattern=[[0, 1]], offset=off, channel_multiplier=1)
    else:
        nisa.iota(dst=hi[0:rows, :], pattern=[[0, 1]], offset=spec.s_kv, channel_multiplier=0)
    if spec.window:
        nisa.iota(dst=lo[0:rows, :], pattern=[[0, 1]], offset=off - spec.window + 1,
                  channel_multiplier=1)
    else:
        nisa.iota(dst=lo[0:rows, :], pattern=[[0, 1]], offset=-1, channel_multiplier=0)


def mask_range_select(dst, src, lo, hi, k_abs0: int, reduce_res=None):
    """``dst[p, j] = src[p, j]`` if ``lo[p] <= k_abs0 + j <= hi[p]`` else FP32_MIN, and the row
    max of the result into ``reduce_res`` (VectorE; ``src`` may be the PSUM score tile)."""
    nisa.range_select(dst=dst, on_true_tile=src, comp_op0=nl.greater_equal,
                      comp_op1=nl.less_equal, bound0=lo, bound1=hi,
                      reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=reduce_res,
                      reduce_op=nl.maximum, range_start=k_abs0, on_false_value=FP32_MIN)


def scale_mask_max(X, S, scale, lo, hi, k_abs0: int, width: int, full: int, max_slot):
    """Scores out of PSUM: ``X[:, :width] = scale * S[:, :width]`` with the row maxes into
    ``max_slot()`` columns; columns ``[full, width)`` masked to each row's keys ``[lo, hi]``
    (``k_abs0`` is column 0's key). Columns before ``full`` (seen by every row) take one fused
    VectorE pass, the masked tail a scale pass and a ``range_select``. ``scale``: a float or a
    ``[rows, 1]`` column; ``full`` = ``width``: no mask."""
    rows = X.shape[0]
    if full:
        nisa.tensor_scalar_reduce(dst=X[:, 0:full], data=S[0:rows, 0:full], op0=nl.multiply,
                                  operand0=scale, reduce_op=nl.maximum, reduce_res=max_slot())
    if full < width:
        Xt = X[:, full:width]
        nisa.tensor_scalar(dst=Xt, data=S[0:rows, full:width], op0=nl.multiply, operand0=scale)
        mask_range_select(Xt, Xt, lo, hi, k_abs0 + full, reduce_res=max_slot())


def mask_affine_select(dst, src, spec: MaskSpec, q0: int, k_abs0: int, rows: int, width: int):
    """The same mask with GpSimd ``affine_select`` (SBUF only): one instruction per active bound
    (causal: ``pos(p) - k >= 0``; window: ``k - pos(p) + w - 1 >= 0``)."""
    cur = src
    off = q0 + spec.offset
    if spec.causal and k_abs0 + width - 1 > off:
        nisa.affine_select(dst=dst, pattern=[[-1, width]], channel_multiplier=1, on_true_tile=cur,
                           on_false_value=FP32_MIN, cmp_op=nl.greater_equal, offset=off - k_abs0)
        cur = dst
    if spec.window and k_abs0 < off + rows - 1 - spec.window + 1:
        nisa.affine_select(dst=dst, pattern=[[1, width]], channel_multiplier=-1, on_true_tile=cur,
                           on_false_value=FP32_MIN, cmp_op=nl.greater_equal,
                           offset=k_abs0 - off + spec.window - 1)
        cur = dst
    if cur is src and dst is not src:
        nisa.tensor_copy(dst=dst, src=src, engine=nisa.engine.gpsimd)
