"""Tile scheduling for attention kernels: which key blocks each query tile visits.

Pure Python on shapes, run at trace time (NKI specialisation), shared by flash attention (prefill),
flash-decoding and paged attention; and the trace-time issue order of a software pipeline's
stages written as generators (:func:`weave`, decode and MLA decode). Nothing here reads tensor
values.

Vocabulary:

* a **q-tile** is up to 128 consecutive query rows (one per partition);
* a **block** is up to ``kb`` consecutive keys processed by one pass of the online softmax; block
  starts are multiples of 128 so that the resident V tiles (128 keys each) line up with the P^T
  tiles of the block;
* a block is split into **segments**: ``full`` columns (visible to every row of the q-tile: no
  mask) and ``masked`` columns (the causal diagonal band and the left-window band, where the
  per-row bounds of :mod:`.masks` apply). Keys that no row of the tile can see are never visited
  (whole-tile skipping), except the < 128 keys of alignment padding below the window, which fall
  in a masked segment.
"""
from __future__ import annotations

from dataclasses import dataclass

from .._limits import P
from .masks import MaskSpec, TileKind, classify


@dataclass(frozen=True)
class Segment:
    """Columns ``[c0, c1)`` of a block (relative to the block start) and whether they need the
    per-row mask."""
    c0: int
    c1: int
    masked: bool

    @property
    def width(self) -> int:
        return self.c1 - self.c0


@dataclass(frozen=True)
class Block:
    """Keys ``[k0, k0 + width)`` of one q-tile's visit, with its segments (in column order)."""
    k0: int
    width: int
    segments: tuple

    @property
    def full(self) -> tuple:
        return tuple(s for s in self.segments if not s.masked)

    @property
    def masked(self) -> tuple:
        return tuple(s for s in self.segments if s.masked)

    @property
    def n_ktiles(self) -> int:
        return -(-self.width // P)


@dataclass(frozen=True)
class QTile:
    """Query rows ``[q0, q0 + rows)`` and the blocks they visit inside keys ``[lo, hi)``."""
    q0: int
    rows: int
    blocks: tuple

    @property
    def keys(self) -> int:
        return sum(b.width for b in self.blocks)


def visit_range(spec: MaskSpec, q0: int, rows: int, k_lo: int = 0, k_hi: int | None = None):
    """Keys ``[start, end)`` a q-tile must visit inside ``[k_lo, k_hi)``: the union of its rows'
    visible ranges, with ``start`` aligned down to a multiple of 128 (V tile alignment).
    Returns None when no row sees any key there (the tile is skipped)."""
    k_hi = spec.s_kv if k_hi is None else k_hi
    lo = max(spec.row_lo(q0), k_lo)
    hi = min(spec.row_hi(q0 + rows - 1) + 1, k_hi)
    if hi <= lo:
        return None
    start = max(k_lo, lo // P * P)
    return start, hi


def block_segments(spec: MaskSpec, q0: int, rows: int, k0: int, k1: int) -> tuple:
    """Segments of keys ``[k0, k1)`` for rows ``[q0, q0 + rows)``: masked bands (causal diagonal,
    left window, alignment padding) and the full middle."""
    full_lo = spec.row_lo(q0 + rows - 1)        # every row sees keys >= full_lo ...
    full_hi = spec.row_hi(q0) + 1              # ... and keys < full_hi
    a, b = max(k0, full_lo), min(k1, full_hi)
    if classify(spec, q0, q0 + rows, k0, k1) is TileKind.FULL:
        return (Segment(0, k1 - k0, False),)
    if b <= a:
        return (Segment(0, k1 - k0, True),)
    segs = []
    if a > k0:
        segs.append(Segment(0, a - k0, True))
    segs.append(Segment(a - k0, b - k0, False))
    if b < k1:
        segs.append(Segment(b - k0, k1 - k0, True))
    return tuple(segs)


def plan_qtile(spec: MaskSpec, q0: int, rows: int, kb: int, k_lo: int = 0,
               k_hi: int | None = None) -> QTile | None:
    """The blocks (at most ``kb`` keys, 128-aligned starts) a q-tile visits inside
    ``[k_lo, k_hi)``, or None if it sees no key there."""
    if kb % P or kb <= 0:
        raise ValueError(f"kb must be a positive multiple of {P}; got {kb}")
    r = visit_range(spec, q0, rows, k_lo, k_hi)
    if r is None:
        return None
    start, end = r
    blocks = []
    k0 = start
    while k0 < end:
        k1 = min(k0 + kb, end)
        blocks.append(Block(k0, k1 - k0, block_segments(spec, q0, rows, k0, k1)))
        k0 = k1
    return QTile(q0, rows, tuple(blocks))


def q_tiles(s_q: int, rows: int = P):
    """``(q0, rows)`` of each q-tile of a sequence of ``s_q`` queries."""
    return [(q0, min(rows, s_q - q0)) for q0 in range(0, s_q, rows)]


def kv_chunks(s_kv: int, chunk: int):
    """``(c0, c1)`` key ranges held resident in SBUF one after the other."""
    return [(c0, min(s_kv, c0 + chunk)) for c0 in range(0, s_kv, chunk)]


def gqa_heads(n_q_heads: int, n_kv_heads: int, kv_head: int):
    """Query heads served by ``kv_head`` (query head h uses KV head ``h // group``): GQA/MQA
    without replicating K/V."""
    g = n_q_heads // n_kv_heads
    return list(range(kv_head * g, (kv_head + 1) * g))


def assign_programs(units, n_programs: int):
    """Split ``units`` (items with a ``.work`` or ``(key, work)`` pairs) over LNC programs:
    longest first onto the least-loaded program (balances causal tiles, whose work grows with
    their position). Returns one list per program, each in the original order."""
    work = [(u[1] if isinstance(u, tuple) else u.work) for u in units]
    order = sorted(range(len(units)), key=lambda i: -work[i])
    load = [0] * n_programs
    owner = [0] * len(units)
    for i in order:
        p = min(range(n_programs), key=lambda j: (load[j], j))
        owner[i] = p
        load[p] += work[i]
    return [[units[i] for i in range(len(units)) if owner[i] == p] for p in range(n_programs)]


@dataclass(frozen=True)
class Unit:
    """One (batch, kv head, q-tile) of work, with its per-chunk visits (None = skipped)."""
    b: int
    kv_head: int
    q0: int
    rows: int
    visits: tuple          # one QTile | None per KV chunk

    @property
    def work(self) -> int:
        return sum(v.keys * self.rows for v in self.visits if v is not None)

    @property
    def first_chunk(self) -> int:
        return next(i for i, v in enumerate(self.visits) if v is not None)

    @property
    def last_chunk(self) -> int:
        return max(i for i, v in enumerate(self.visits) if v is not None)


def prefill_units(spec: MaskSpec, batch: int, n_kv_heads: int, kb: int, chunk: int,
                  rows: int = P):
    """Every (b, kv head, q-tile) unit of a prefill with its visits per KV chunk; units that see
    no key at all are dropped (none exist for valid causal/window masks)."""
    chunks = kv_chunks(spec.s_kv, chunk)
    units = []
    for b in range(batch):
        for hk in range(n_kv_heads):
            for q0, r in q_tiles(spec.s_q, rows):
                visits = tuple(plan_qtile(spec, q0, r, kb, c0, c1) for c0, c1 in chunks)
                if any(v is not None for v in visits):
                    units.append(Unit(b, hk, q0, r, visits))
    return units


# ------------------------------------------------- issue order of a software pipeline's stages
# A stage written as a generator yields between its instructions; the helpers below interleave
# stages at trace time, which fixes the order each engine's in-order queue receives them in.
def steps(g, n):
    """Advance generator ``g`` (or None) by up to ``n`` steps; None once it is exhausted."""
    for _ in range(n):
        if g is None or next(g, StopIteration) is StopIteration:
            return None
    return g


def drain(g):
    """Run generator ``g`` (or None) to its end."""
    for _ in g or ():
        pass


def weave(a, b, ratio, c=None):
    """Run generator ``b`` to its end with one step of ``c`` and then ``ratio`` steps of ``a``
    after each of its steps; ``c`` is then run to its end, ``a`` left where it stops (any may be
    None; with ``b`` None and ``ratio`` 1, ``a`` is run to its end)."""
    if b is None:
        if ratio == 1:
            drain(a)
    else:
        for _ in b:
            c = steps(c, 1)
            a = steps(a, ratio)
    drain(c)
