"""Decode attention (flash-decoding) over a contiguous or paged KV cache.

``o = softmax(scale * q K^T (soft-capped) + mask (+ sink)) V`` for one to eight new tokens per
sequence, GQA/MQA (every query head of a KV head shares one pass over its cache), any number of
KV heads per call, sequences of any length in any order, bf16/fp16 or FP8 caches (per-tensor or
per-KV-head scales), sliding window, soft-capping, sinks, ``lse`` output. Design note:
docs/attention.md ("Decode attention").

Per KV tile (``128 T`` keys of one sequence, all KV heads, one long DMA run per partition; paged:
gathered through the block table, :mod:`.kv_cache`):

* TensorE transposes each head's keys to K^T (``[d, keys]``, key order restored on eviction);
  FP8 contiguous caches instead bring K^T in by DMA transposes of dim pairs (2-byte elements)
  and run QK^T as an even-dim and an odd-dim pass (:func:`.kv_cache.load_kT_pairs`);
* query rows are packed on partitions in slots of W = 32 / 64 / 128 rows, one slot per KV head
  (its ``G x s_q`` rows), ``128 / W`` heads per row group: QK^T and PV of the heads of a group
  run in separate PE column tiles (``tile_position``), side by side;
* the scores of a whole tile leave PSUM in one pass (scaled, row max fused; masked with
  ``range_select`` where the tail, the drafts' diagonal or the window cut the tile), one
  exponential with the row sum fused, one TensorE transpose per 128 keys for P^T, and the
  online softmax of :mod:`.softmax` carries the state from tile to tile.

Split-KV: :mod:`.split_kv` plans the work items; with LNC=2 long sequences are cut in parts run
on both cores, and the parts' states are merged exactly through the log-sum-exp after a core
barrier (:func:`.merge_attention_states.merge_states_sb`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._validate import (
    attention_options,
    check_block_table,
    check_decode_lens,
    check_lnc,
    check_window,
)
from ..backend import launch, lnc_programs, nisa, nki, nl
from .kv_cache import (
    BLOCK_SIZES,
    KVLayout,
    load_kT_pairs,
    load_kv_tile,
    load_kv_tile_pages,
    page_rows,
    pair_heads,
    tokens_per_partition,
)
from .masks import mask_range_select, scale_mask_max
from .merge_attention_states import merge_states_sb
from .schedule import drain
from .softmax import M_FLOOR, SoftmaxState
from .split_kv import (
    WorkItem,
    empty_rows,
    fold_apply,
    fold_exp,
    fold_max,
    merge_split,
    plan_split_kv,
    slot_selector,
    split_parts,
    transpose_slots,
)

P = 128
HEAD_DIMS = (64, 128, 192, 256)
MAX_S_Q = 8
MM_N = 512            # score columns per QK^T matmul (one fp32 PSUM bank)
TR_GROUP = 8          # 128-key transposes per PSUM buffer (2 KiB of bf16)
PREFETCH = 2          # KV tiles loaded ahead of the one being computed
K_RING = PREFETCH + 2  # FP8 K^T pair buffers reused tile after tile: a tile's K^T loads wait for
                       # the QK^T reads (stage B) of the tile K_RING back (one slot fewer would let
                       # the program write a buffer before its last read)
V_BEHIND = 1          # V loads issued this many tiles behind K loads (row layout): the last K lands
                      # before the last V (1: 84.7 -> 80.6 us on Llama-3-8B B=1 L=8K, Trn3; 113 ->
                      # 108 Trn2; 2 for every plan cost the Llama-3-8B rows 0.3-0.5%; all modeled)
PACKED_V_BEHIND = {3: 3, 4: 4}  # packed one-KV-head plans, by NeuronCore version (Trn2 3, Trn3 4):
                      # their per-tile K chain (K^T, scores, softmax, P^T) outlasts a tile's DMA, so
                      # K loads run this many tiles ahead of V (K prefetched as far) and the last
                      # tiles' chains start sooner. Llama-3-70B TP8, modeled, B=1 L=32K / B=8 L=8K
                      # paged/64: Trn2 2 (as before): 55.07 / 108.30 us, 3: 53.61 / 107.01, 4:
                      # 53.82 / 109.31; Trn3 2: 40.67 / 90.66, 3: 40.07 / 91.80, 4: 39.82 / 90.84;
                      # 5 (before the Q^T and identity changes): 55.92 / 113.10, 41.40 / 92.78
SWDGE_EVERY = 4       # one-KV-head paged plans: one page in 4 through the software DGE (Llama-3-70B
                      # TP8 B=8 L=8K paged/64, Trn3 modeled: 122.1 us with every page on Sync; 1 in
                      # 2 / 3 / 4 / 5 / 6 / 8: 166.7 / 111.0 / 100.0 / 102.9 / 105.8 / 108.9 us;
                      # Trn2 126.3 -> 125.1 us; for every paged plan it cost MLA H=128 paged 1.9%)
LAGS = (0, 1, 2, 3)   # pipeline lags (in jobs) of the stages K^T, QK^T + softmax, P^T, PV: every
                      # PSUM eviction has a whole step to finish before TensorE needs its result
FOLD_LAGS = (2, 3)    # packed plans: the fold's weight steps (split_kv.fold_max: the slots'
                      # maxima across slots; fold_exp: back to partitions, exp) need only the
                      # final maxima; they are issued at the start of the pipeline steps this many
                      # jobs after the item's last job (ahead of its P^T, and of its PV), and only
                      # the weighted sum (fold_apply) waits for the last PV. Llama-3-70B TP8,
                      # Trn3 modeled: B=1 L=32K 43.1 -> 41.6 us, B=8 L=8K paged/64 97.2 ->
                      # 92.2 us. Lags (2, 2): 42.4 us (B=1), the transposes back wait in TensorE's
                      # queue ahead of the last P^T; (1, 3): 41.8 us; both steps after the last
                      # PV (fold_slots, before): 43.1 us
# Paged gather: "page" (a register-addressed DMA per page) models at 73% of the HBM roof on
# Llama-3-8B B=8 L=2K paged/64 (Trn3) against 0.1% for "vector" (one software-DGE gather per tile):
# the cost model sizes the gather's descriptors by its 4-byte index reads (see the design note).
GATHER = "page"
# row table columns (host-built fp32 [B, n_groups, 128, NCOL])
C_LO, C_HI, C_QK, C_V, C_SINK = 0, 1, 2, 3, 4
NCOL = 5


@dataclass(frozen=True)
class DecodePlan(nl.NKIObject):
    """Everything the kernel needs besides the tensors (compile-time values).

    W: query rows per slot (one KV head's ``G * s_q`` rows, padded to a PE column tile);
    nslot: slots per row group (``128 / W``); layout: cache / tile geometry; items: the work
    items of each program (:func:`.split_kv.plan_split_kv`); seq_lens: host lengths;
    xmul: logit = xmul * X (softcap c, else 1: scores are scaled when they leave PSUM);
    kt_act: share of K^T evictions on ScalarE (the rest VectorE).
    gather: paged caches only: "page" (one DMA per page addressed by a register loaded from the
      block table) or "vector" (one software-DGE gather per tile, row indices built on chip).
    """
    B: int
    s_q: int
    Hq: int
    Hkv: int
    d: int
    W: int
    nslot: int
    layout: KVLayout
    seq_lens: tuple
    items: tuple
    window: int
    softcap: float
    has_sinks: bool
    has_vscale: bool
    return_lse: bool
    out_dtype: object
    kt_act: float
    gather: str = "page"
    q_rows: tuple = ()        # ragged q / out (paged_attention): [T, H_q, d], sequence b's rows
                              # at q_rows[b]:q_rows[b] + s_q; () = [B, s_q, H_q, d]
    bt_rows: tuple = ()       # block-table row of sequence b (() = row b)

    @property
    def G(self) -> int:
        return self.Hq // self.Hkv

    @property
    def rows(self) -> int:
        return self.G * self.s_q

    @property
    def n_groups(self) -> int:
        return -(-self.Hkv // self.nslot)

    @property
    def xmul(self) -> float:
        return self.softcap if self.softcap else 1.0

    def row_off(self, b: int) -> int:
        """First partition of a slot's rows for sequence ``b``: rotated by 8 partitions (one DMA
        queue) from sequence to sequence where the slot has room, so the small Q loads and
        output stores of consecutive sequences land on different queues."""
        n_pos = (self.W - self.rows) // 8 + 1
        return (b % n_pos) * 8

    def group_heads(self, g: int):
        return list(range(g * self.nslot, min(self.Hkv, (g + 1) * self.nslot)))

    @property
    def packed(self) -> bool:
        """One KV head and room for more slots (Llama-3-70B TP8, MQA): full tiles spread their
        token slices over all ``nslot`` PE column tiles, the head's rows repeated in each (own
        softmax state per slot, merged at the end); masked and partial tiles keep the row
        layout."""
        return self.Hkv == 1 and self.nslot > 1 and self.layout.T % self.nslot == 0

    @property
    def Ts(self) -> int:
        """Token slices of a packed tile per slot."""
        return self.layout.T // self.nslot

    def slots_of(self, g: int):
        """``(slot, head)`` of every slot with query rows: the heads of the row group, or in a
        packed plan the one head in every slot."""
        if self.packed:
            return [(s, 0) for s in range(self.nslot)]
        return list(enumerate(self.group_heads(g)))

    def table_row(self, b: int) -> int:
        return self.bt_rows[b] if self.bt_rows else b

    def rows_of(self, t, b: int):
        """Sequence ``b``'s ``[s_q, ...]`` rows of q, out or lse (batched or ragged layout)."""
        if not self.q_rows:
            return t[b]
        r = self.q_rows[b]
        return t[r:r + self.s_q]


def sbuf_bytes(T: int, h_kv: int, d: int, itemsize: int, nslot: int) -> int:
    """Per-partition SBUF the kernel keeps live at its peak (estimate): K and V tiles in flight
    (PREFETCH + 2 each; FP8 K^T pairs: the ring of K_RING) and the buffers of two jobs per
    stage pair (K^T of a row group's heads, X fp32 + P bf16, P^T)."""
    kb = P * T
    dt = -(-d // P)
    kv = 2 * (PREFETCH + 2) * T * h_kv * d * itemsize
    jobs = 2 * (nslot * dt * kb * 2) + 2 * (kb * 4 + kb * 2) + 2 * (T * P * 2)
    return kv + jobs + 4 * 1024


def fp8_pairs(cfg: DecodePlan, kv_dtype):
    """``(d/2, heads per transpose)`` where FP8 K^T is taken as dim pairs, else None: row layout
    (not packed plans), d / 2 divides 128; paged caches (TensorE transposes of the pairs) on
    Trn2 only and where every row group holds whole pair tiles. Trn3's identity matmul writes
    bf16 PSUM, and there the pairs' doubled QK^T passes cost more than the transposes save
    (Llama-3-8B B=8 L=2K paged/64 FP8, modeled: Trn2 187.3 -> 152.3 us, Trn3 117.8 -> 125.1)."""
    if kv_dtype in (nl.bfloat16, nl.float16) or cfg.packed:
        return None
    pairs = pair_heads(cfg.d)
    if pairs is None:
        return None
    if cfg.layout.paged and (nisa.get_nc_version() >= 4
                             or (cfg.nslot % pairs[1] and cfg.n_groups > 1)):
        return None
    return pairs


def slot_width(rows: int) -> int:
    for w in (32, 64, 128):
        if rows <= w:
            return w
    raise ValueError(f"decode_attention: H_q / H_kv * s_q = {rows} query rows per KV head; at "
                     f"most 128 are supported")


# ------------------------------------------------------------------------------------ kernel


@nki.jit
def decode_attention_kernel(q, k_cache, v_cache, block_table, rowtab, cfg):
    """``o = softmax(scale * q K^T (+ mask, soft-cap, sink)) V`` for decode.

    Dimensions:
      B >= 1 sequences; s_q in 1..8 new tokens each; H_q = G * H_kv with G * s_q <= 128;
      d in {64, 128, 192, 256}; any lengths (host-known, in cfg.seq_lens; 0 = empty slot).
    Args:
      q: [B, s_q, H_q, d] HBM, bf16 / fp16.
      k_cache, v_cache: [B, S_max, H_kv, d] (contiguous) or [num_blocks, block_size, H_kv, d]
        (paged) HBM, q's dtype or fp8 (e4m3 on Trn2, e4m3fn on Trn3).
      block_table: [B, max_blocks] int32 HBM (paged), else None.
      rowtab: [128, B, n_groups, 5] fp32 HBM (partition-major: one DMA, one run per partition),
        per query row of a row group: first and last
        visible key, qk scale (scale * k_scale of its head, / softcap), v_scale, sink logit.
      cfg: DecodePlan.
    Returns:
      o [B, s_q, H_q, d] (cfg.out_dtype), and lse [B, s_q, H_q] fp32 when cfg.return_lse.
    Notes:
      fp32 scores, max, sums and accumulation; P rounded to bf16 for PV; expected error within
      2x a reference that rounds P the same way + 1e-3. The block table is read on the device
      (only the entries of pages in use); cache entries past a sequence's end are never read.
    Pseudocode:
      for each work item (b, keys [k0, k1)) of this program, tiles prefetched PREFETCH ahead:
        Q^T of every row group (TensorE transpose); state m = floor | sink, l, o
        for tile of 128T keys: K, V [128, T, H_kv, d] <- DMA (paged: gather through idx)
          for row group: for its heads: K^T (TensorE transposes) -> S[slot rows] = Q^T.T K^T
            X = scale * S (max fused) | range_select(mask); m' = max(m, max); P = exp(X - m')
            P^T (TensorE transposes); O[slot rows] = sum_t P^T.T @ V[t, head]; o = a o + O
        part of a split sequence: (o, m, l) -> HBM; [LNC=2: barrier, owner merges the parts]
        o / l -> out, m + ln l -> lse
    """
    B, s_q, Hq, d = cfg.B, cfg.s_q, cfg.Hq, cfg.d
    out = nl.ndarray((B, s_q, Hq, d), dtype=cfg.out_dtype, buffer=nl.shared_hbm)
    lse = None
    if cfg.return_lse:
        lse = nl.ndarray((B, s_q, Hq), dtype=nl.float32, buffer=nl.shared_hbm)
    programs, pid = lnc_programs()
    mine = cfg.items[pid]
    split, parts_hbm = split_parts(cfg.items, cfg.n_groups, d)
    # the identity (one DMA of 128 rows of 256 B: queue time at the start) only where it is used:
    # FP8 K^T by matmul (no pairs), and the last sequence's stores with s_q > 1 (_store_by_draft)
    ident = None
    fp8 = k_cache.dtype not in (nl.bfloat16, nl.float16)
    if (fp8 and fp8_pairs(cfg, k_cache.dtype) is None) or s_q > 1:
        ident = nl.shared_identity_matrix(P, dtype=nl.bfloat16)               # [128, 128]
    if pid == 0:
        empty_rows(out, lse, cfg.seq_lens, s_q * Hq, d, cfg.out_dtype)
    run = _Run(q, k_cache, v_cache, block_table, rowtab, out, lse, parts_hbm, split, ident, cfg)
    run.items(mine)
    merge_split(run, mine, split, parts_hbm, programs)
    if cfg.return_lse:
        return out, lse
    return out


class _Group:
    """One row group of one work item: Q^T, its row table, its softmax state."""

    def __init__(self, g, heads, rows, qT, rt, sm):
        self.g = g
        self.heads = heads
        self.rows = rows
        self.qT = qT
        self.rt = rt
        self.sm = sm


def _tile_stream(mine, lay):
    """``(item index, tile number, k0, keys, last of its item)`` of every KV tile in order."""
    tiles = []
    for ii, it in enumerate(mine):
        for c, k0 in enumerate(range(it.k0, it.k1, lay.tile_keys)):
            tiles.append((ii, c, k0, min(lay.tile_keys, it.k1 - k0), k0 + lay.tile_keys >= it.k1))
    return tiles


def _table_row(block_table, it, lay, row):
    """The block-table entries of the pages item ``it`` reads: int32 SBUF ``[1, pages]``, one
    contiguous DMA (entries past the sequence's end are not read)."""
    p0 = it.k0 // lay.block_size
    n = -(-it.k1 // lay.block_size) - p0
    bt = nl.ndarray((1, n), dtype=nl.int32, buffer=nl.sbuf)                     # [1, pages]
    nisa.dma_copy(dst=bt, src=block_table[row, p0:p0 + n].reshape((1, n)))
    return bt


class _Job:
    """One (KV tile, row group) job between its pipeline stages."""

    def __init__(self, it, grp, kt, vt, k0, n, lay, packed=False):
        self.it, self.grp, self.kt, self.vt, self.k0, self.n = it, grp, kt, vt, k0, n
        self.packed = packed
        self.lay = lay                       # this tile's geometry (ramp pieces: smaller T)
        self.npp = -(-n // lay.T)            # partitions holding keys of this tile
        self.ncol = self.npp * lay.T         # score columns (key k0 + c; c >= n masked)
        self.kTs = self.Pm = self.pT = self.alpha = None


class _Run:
    """Trace-time driver: the work items of one program as a stream of prefetched KV tiles."""

    def __init__(self, q, k_cache, v_cache, block_table, rowtab, out, lse, parts_hbm, split,
                 ident, cfg):
        self.q, self.kc, self.vc, self.bt = q, k_cache, v_cache, block_table
        self.out, self.lse, self.parts = out, lse, parts_hbm
        nb, ng = rowtab.shape[1], rowtab.shape[2]
        self.rt_all = nl.ndarray((P, nb, ng, NCOL), dtype=nl.float32, buffer=nl.sbuf)
        # the row table: 128 descriptors of B n_groups 20 bytes, each at the descriptor floor.
        # Contiguous caches load it behind the first K tile (one DMA, 16 queues), whose arrival it
        # delayed by ~0.4 us on every queue (Llama-3-8B B=1 L=2K, Trn3 modeled: 26.27 -> 25.88
        # us); paged ones first (behind the first tile's page DMAs: 107.0 -> 107.2 us on
        # Llama-3-70B TP8 B=8 L=8K paged/64, Trn2)
        self.rowtab = rowtab                                            # [128, B, groups, 5]
        if cfg.layout.paged:
            self._load_rowtab()
        self.split = list(split)
        self.ident = ident
        self.cfg = cfg
        self.lay = cfg.layout
        self.DT = -(-cfg.d // P)
        self.n_evict = 0
        # FP8 K^T as dim pairs (2-byte elements; QK^T then takes an even-dim and an odd-dim
        # pass): row-layout tiles. Contiguous caches bring the pairs in by DMA transposes, paged
        # ones transpose the loaded tile on TensorE (one DMA transpose per page and head pair
        # modeled at 523 vs 202 us on Llama-3-8B B=8 L=2K paged/64, Trn2), see stage_kT
        self.fp8 = k_cache.dtype not in (nl.bfloat16, nl.float16)
        self.pairs = fp8_pairs(cfg, k_cache.dtype)
        self.kT_dma = self.pairs is not None and not cfg.layout.paged
        # one KV head: a page is a few partitions, one small DMA per page and cache, and the Sync
        # triggers bind (Llama-3-70B TP8 B=8 L=8K paged/64); one page in SWDGE_EVERY goes
        # through the software DGE on GpSimd instead
        self.swdge_every = SWDGE_EVERY if cfg.packed else 0
        # packed plans: the slots' selection matrix of every item's fold (rows = W: one head)
        self.sel = slot_selector(cfg.W, cfg.W) if cfg.packed else None
        # Q^T by hardware-DGE DMA transposes (2-byte q, d <= 128; the hwdge shape rule, nki-spec
        # 9.2.2: a 3-D [s_q, G, d] source needs s_q in {1, 2, 4, 8, 16} and s_q G a multiple of
        # 16; with s_q = 1 the 2-D [G, d] form needs G in {1, 2, 4, 8, 16} (SDK 2.32)). The 2-D
        # form: Llama-3-8B B=1 L=2K Trn3 26.44 -> 26.27 us, Llama-3-70B TP8 B=1 L=32K 41.35 ->
        # 40.46 (with the row loads, 256 B descriptors at the descriptor floor, on one queue per
        # slot); not FP8 caches, whose paged path modeled slower with it (Llama-3-8B B=8 L=2K
        # paged/64 FP8, Trn3: 117.8 -> 123.0 us)
        self.q_dma_t = (not self.pairs and cfg.d <= P and q.dtype.itemsize == 2
                        and ((cfg.s_q in (1, 2, 4, 8, 16) and (cfg.s_q * cfg.G) % 16 == 0)
                             or (cfg.s_q == 1 and cfg.G in (1, 2, 4, 8, 16) and not self.fp8)))

    # -- the tile stream ------------------------------------------------------------------------
    def items(self, mine):
        """Every KV tile of this program's items in one stream: tile j's loads are issued
        PREFETCH tiles ahead (an item's Q / row-table loads just before its first tile's), and
        the three stages of a (tile, row group) job -- K^T, QK^T + softmax, P^T + PV -- run with
        lags LAGS, so each engine's in-order queue always holds independent work."""
        lay = self.lay
        tiles = _tile_stream(mine, lay)          # (item, tile number, k0, keys, last of item)
        idx = {}
        groups = {}
        loaded = {}
        # FP8 K^T pairs load into a ring of K_RING buffers allocated once: each K^T load is
        # then ordered after the QK^T reads of the tile K_RING back, where fresh tiles per KV tile
        # leave every K^T transpose of the kernel free to start at once, queued ahead of the
        # loads the next jobs wait for (Llama-3-8B B=1 L=32K FP8, Trn2 modeled: 235.7 -> 205.1 us).
        # Tiles of the other paths stay fresh: a ring there serialises the TensorE K^T path
        # (bf16 rows modeled 2-25% slower)
        ring = [[nl.ndarray((P, lay.tile_keys), dtype=nl.uint16, buffer=nl.sbuf)  # [(h, i), keys]
                 for _ in range(0, lay.h_kv, self.pairs[1])]
                for _ in range(K_RING)] if self.kT_dma else None

        def fetch(j, which):
            """Issue the K ("k") or V ("v") loads of tile j; V runs ``vb`` tiles behind K, so
            the queues deliver each tile's K first (stage A needs it three steps before stage D
            needs V) and the last K lands before the last V."""
            ii, c, k0, n, _ = tiles[j]
            it = mine[ii]
            if ii not in groups:
                groups[ii] = self.start(it)
                if self.cfg.gather == "vector":
                    row = self.cfg.table_row(it.b)
                    idx[ii] = [page_rows(self.bt, row, a, min(it.k1 - a, P * lay.tile_keys), lay)
                               for a in range(it.k0, it.k1, P * lay.tile_keys)]
                elif lay.paged:
                    idx[ii] = _table_row(self.bt, it, lay, self.cfg.table_row(it.b))
            cache = self.kc if which == "k" else self.vc
            if which == "k" and self.kT_dma:
                hpt = self.pairs[1]
                t = ring[j % K_RING]
                for kT, h0 in zip(t, range(0, lay.h_kv, hpt)):
                    load_kT_pairs(kT, cache, lay, it.b, k0, n, h0, min(hpt, lay.h_kv - h0))
                loaded.setdefault(j, {})[which] = t
                self._load_rowtab()
                return
            t = nl.ndarray((P, lay.T, lay.h_kv, lay.d), dtype=cache.dtype, buffer=nl.sbuf)
            zero = self.fp8 and which == "k"                            # K^T by matmul
            if lay.paged and self.cfg.gather == "page":
                load_kv_tile_pages([(t, cache, zero)], lay, it.b, k0, n, idx[ii],
                                   it.k0 // lay.block_size, swdge_every=self.swdge_every)
            else:
                col = idx[ii][c // P][:, c % P:c % P + 1] if lay.paged else None
                load_kv_tile(t, cache, lay, it.b, k0, n, col, zero_tail=zero)
            loaded.setdefault(j, {})[which] = t
            self._load_rowtab()

        vb = PACKED_V_BEHIND[int(nisa.get_nc_version())] if self.cfg.packed else V_BEHIND

        def prefetch(j):
            # K loads PREFETCH tiles ahead, or as far ahead of V as packed plans run them
            last = min(len(tiles) - 1, j + max(PREFETCH, vb))
            for jj in range(j, last + 1):
                if "k" not in loaded.get(jj, {}):
                    fetch(jj, "k")
                jv = jj - vb if jj < len(tiles) - 1 else jj           # the last V follows K
                for v in range(j, jv + 1):
                    if "v" not in loaded.get(v, {}):
                        fetch(v, "v")
            if "v" not in loaded.get(j, {}):
                fetch(j, "v")

        jobs = [(j, gi) for j in range(len(tiles)) for gi in range(self.cfg.n_groups)]

        def fold_early(ji, part):
            """Step ``part`` of the fold weights of the packed groups of the item whose last job
            is ``ji`` (their maxima are final once that job's softmax is issued)."""
            if not 0 <= ji < len(jobs):
                return
            j, gi = jobs[ji]
            ii, _, _, _, last = tiles[j]
            if not last or gi != self.cfg.n_groups - 1:
                return
            for grp in groups[ii]:
                if grp.psm is None:
                    continue
                if part == 0:
                    grp.fold = fold_max(grp.sm, grp.psm, self.cfg.nslot, self.cfg.W, grp.rows)
                else:
                    grp.fold = fold_exp(grp.sm, grp.fold, grp.rows)

        state = {}
        steps = len(jobs) + LAGS[-1]
        for step in range(steps):
            for part, lag in enumerate(FOLD_LAGS):
                fold_early(step - lag, part)
            ja, jd = step - LAGS[0], step - LAGS[3]
            gen_a = gen_d = None
            if 0 <= ja < len(jobs):
                j, gi = jobs[ja]
                ii, c, k0, n, last = tiles[j]
                prefetch(j)
                kt, vt = loaded[j]["k"], loaded[j]["v"]
                if c == 0:
                    self.ready(mine[ii], groups[ii][gi])
                state[ja] = _Job(mine[ii], groups[ii][gi], kt, vt, k0, n, lay,
                                 self._packs(mine[ii], k0, n))
                gen_a = self.stage_kT(state[ja])
                if gi == self.cfg.n_groups - 1:
                    loaded.pop(j)
            done = None
            if 0 <= jd < len(jobs):
                done = state.pop(jd)
                gen_d = (self.stage_pv_packed if done.packed else self.stage_pv)(done)
            # per step: A(j), B(j-1), C(j-2), D(j-3). (Weaving A's K^T transposes between D's
            # PV matmuls, for Trn3's background transposes, modeled slower: 112 vs 85 us on
            # Llama-3-8B B=1 L=8K -- A waits for its tile's DMA and held the PV matmuls back.)
            drain(gen_a)
            for stage in (1, 2):
                ji = step - LAGS[stage]
                if 0 <= ji < len(jobs):
                    job = state[ji]
                    if stage == 1:
                        (self.stage_softmax_packed if job.packed else self.stage_softmax)(job)
                    else:
                        (self.stage_pT_packed if job.packed else self.stage_pT)(job)
            drain(gen_d)
            if done is not None:
                self.stage_accumulate(done)
                j, gi = jobs[jd]
                ii, c, k0, n, last = tiles[j]
                if last and gi == self.cfg.n_groups - 1:
                    # packed items fold their slots here too: by TensorE transposes, nothing
                    # queues behind the prefetched KV (the SBUF-to-SBUF DMAs they took before
                    # had to wait for the program's last loads)
                    self.finish(done.it, groups.pop(ii), last=ii == len(mine) - 1)

    def _load_rowtab(self):
        """The row table's one DMA, the first time it is called."""
        if self.rowtab is not None:
            nisa.dma_copy(dst=self.rt_all, src=self.rowtab)             # [128, B, groups, 5]
            self.rowtab = None

    # -- per item ---------------------------------------------------------------------------------
    def start(self, it):
        """Issue the Q and row-table loads of an item (with its first tile's loads, so they wait
        behind nothing later); the Q^T transposes and the state come with its first job
        (:meth:`ready`), so TensorE's in-order queue never waits for a DMA still queued."""
        cfg = self.cfg
        groups = []
        for g in range(cfg.n_groups):
            heads = cfg.group_heads(g)
            rows = len(heads) * cfg.W
            rt = self.rt_all[:, it.b, g, :]                                        # [128, 5]
            grp = _Group(g, heads, rows, None, rt, None)
            groups.append(grp)
            if self.q_dma_t:
                # Q^T straight from HBM: one hardware-DGE DMA transpose per slot of its G heads'
                # [s_q, G, d] rows into [d, G, s_q] (the rows' order g s_q + i; s_q = 1: [G, d]
                # into [d, G]), instead of G s_q loads of d-element rows (one descriptor each)
                # and a TensorE transpose. Packed plans load slot 0 only; ready() copies its
                # columns to the other slots (one trigger per item, not one per slot: Llama-3-70B
                # TP8 B=8 L=8K paged/64, Trn2 modeled 107.28 -> 107.01 us)
                qT = nl.ndarray((P, self.DT, P), dtype=self.q.dtype, buffer=nl.sbuf)  # [d, 1, rows]
                width = P if cfg.packed else rows
                if cfg.rows < cfg.W or rows < P:
                    nisa.memset(dst=qT[:, 0, 0:width], value=0.0, engine=nisa.engine.gpsimd)
                for s, h in cfg.slots_of(g)[:1 if cfg.packed else None]:
                    c0 = s * cfg.W + cfg.row_off(it.b)
                    src = cfg.rows_of(self.q, it.b)[:, h * cfg.G:(h + 1) * cfg.G, :]  # [s_q, G, d]
                    dst = qT[0:cfg.d, 0, c0:c0 + cfg.rows].reshape_dim(1, (cfg.G, cfg.s_q))
                    if cfg.s_q == 1 and cfg.G in (1, 2, 4, 8, 16):       # (else the 3-D form)
                        src, dst = src[0], qT[0:cfg.d, 0, c0:c0 + cfg.G]        # [G, d] -> [d, G]
                    nisa.dma_transpose(dst=dst, src=src, dge_mode=nisa.dge_mode.hwdge)
                grp.qT = qT
                continue
            q_sb = nl.ndarray((P, cfg.d), dtype=self.q.dtype, buffer=nl.sbuf)          # [128, d]
            if cfg.rows < cfg.W or rows < P:
                nisa.memset(dst=q_sb, value=0.0, engine=nisa.engine.gpsimd)
            for s, h in cfg.slots_of(g):
                src = cfg.rows_of(self.q, it.b)[:, h * cfg.G:(h + 1) * cfg.G, :].permute((1, 0, 2))
                r0 = s * cfg.W + cfg.row_off(it.b)
                # hardware DGE from the sync engine: a DMA queue of its own (a queue is tied to the
                # trigger engine and the descriptor method, NKI DMA guide), so the small Q loads do
                # not wait behind the first KV tiles on the static-descriptor queue (B=1 L=2K,
                # Trn3 modeled: 29.3 -> 26.5 us)
                nisa.dma_copy(dst=q_sb[r0:r0 + cfg.rows, :], src=src, dge_mode=nisa.dge_mode.hwdge,
                              engine=nisa.engine.sync)
            grp.q_sb = q_sb
        return groups

    def ready(self, it, grp):
        """Q^T (TensorE transpose of the slot-packed rows, unless :meth:`start` loaded it by DMA
        transposes) and the softmax state of a group."""
        cfg = self.cfg
        rows = grp.rows
        width = P if cfg.packed else rows              # packed: the rows of every slot
        if grp.qT is None:                             # (else start loaded it transposed)
            (self._ready_pairs if self.pairs else self._ready_dims)(grp, width)
        elif cfg.packed:
            # slot 0's Q^T columns (and zeros) copied to the other slots
            qv = grp.qT[0:cfg.d, 0, 0:P].reshape_dim(1, (cfg.nslot, cfg.W))        # [d, slot, W]
            nisa.tensor_copy(dst=qv[:, 1:cfg.nslot, :],
                             src=qv[:, 0, :].expand_dim(1).broadcast(1, cfg.nslot - 1),
                             engine=nisa.engine.vector)
        grp.q_sb = None
        grp.psm = None                                 # the packed slots' state, if any
        sink = grp.rt[0:rows, C_SINK:C_SINK + 1] if cfg.has_sinks and it.part == 0 else None
        grp.sm = SoftmaxState(rows, cfg.d, cfg.xmul, sink=sink, sum_in_o=False)

    def _ready_dims(self, grp, width):
        """Q^T ``[d, DT, rows]``: one TensorE transpose per 128 dims."""
        cfg, q_sb = self.cfg, grp.q_sb
        qT = nl.ndarray((P, self.DT, P), dtype=self.q.dtype, buffer=nl.sbuf)       # [d, DT, rows]
        tq = nl.ndarray((P, self.DT, P), dtype=self.q.dtype, buffer=nl.psum)
        for dt in range(self.DT):
            dsz = min(P, cfg.d - dt * P)
            nisa.nc_transpose(dst=tq[0:dsz, dt, 0:width], data=q_sb[0:width, dt * P:dt * P + dsz],
                              engine=nisa.engine.tensor)
            nisa.tensor_copy(dst=qT[0:dsz, dt, 0:width], src=tq[0:dsz, dt, 0:width],
                             engine=nisa.engine.vector)
        grp.qT = qT

    def _ready_pairs(self, grp, width):
        """Q^T of the even and odd dims ``[(hh, i), parity, rows]``, repeated for each of the
        heads that share a K^T pairs tile, so the partitions of head ``h``'s pairs meet its own
        (``(h % hpt) d/2 + i``): dims ``2i + parity``."""
        cfg, q_sb = self.cfg, grp.q_sb
        dp, hpt = self.pairs
        qx = nl.ndarray((P, 2, P), dtype=self.q.dtype, buffer=nl.sbuf)     # [rows, parity, (hh, i)]
        for j in (0, 1):
            for hh in range(hpt):
                nisa.tensor_copy(dst=qx[0:width, j, hh * dp:(hh + 1) * dp],
                                 src=q_sb[0:width, j:cfg.d:2], engine=nisa.engine.vector)
        tq = nl.ndarray((P, 2, P), dtype=self.q.dtype, buffer=nl.psum)
        qT = nl.ndarray((P, 2, P), dtype=self.q.dtype, buffer=nl.sbuf)     # [(hh, i), parity, rows]
        for j in (0, 1):
            nisa.nc_transpose(dst=tq[:, j, 0:width], data=qx[0:width, j, :],
                              engine=nisa.engine.tensor)
        nisa.tensor_copy(dst=qT[:, :, 0:width], src=tq[:, :, 0:width], engine=nisa.engine.vector)
        grp.qT = qT

    def finish(self, it, groups, last=False):
        cfg = self.cfg
        for grp in groups:
            if grp.psm is not None:
                # the packed slots' states into the row state (the weights: items()); the
                # program's last whole item leaves the folded o, l in PSUM, where the output
                # division reads them: one copy fewer on the kernel's tail (B=1 L=32K above:
                # 41.6 -> 41.45 us)
                fold_apply(grp.sm, grp.psm, grp.fold, grp.rows, self.sel,
                           o_psum=last and it.n_parts == 1 and not cfg.has_vscale)
                grp.psm = grp.fold = None
            sm = grp.sm
            if it.n_parts > 1 and it.part > 0:
                k = self.split.index(it)
                dst = self.parts[k, grp.g, 0:grp.rows, :]
                st = nl.ndarray((grp.rows, cfg.d + 2), dtype=nl.float32, buffer=nl.sbuf)
                # on VectorE: on GpSimd's in-order queue these copies (which wait for the part's
                # last PV) held back the next item's Q memset and, through it, its Q load, which
                # then queued behind the prefetched KV (1x128K + 63x1K at LNC=2: 500 -> 413 us,
                # Trn3 modeled)
                nisa.tensor_copy(dst=st[:, 0:cfg.d], src=sm.o, engine=nisa.engine.vector)
                nisa.tensor_copy(dst=st[:, cfg.d:cfg.d + 1], src=sm.mp[:, 0:1],
                                 engine=nisa.engine.vector)
                nisa.tensor_copy(dst=st[:, cfg.d + 1:cfg.d + 2], src=sm.l,
                                 engine=nisa.engine.vector)
                nisa.dma_copy(dst=dst, src=st)
                continue
            if it.n_parts > 1:
                grp.keep = True          # merged with the other parts after the barrier
                self.pending = getattr(self, "pending", {})
                self.pending[(it.b, grp.g)] = grp
                continue
            self.store(it.b, grp, last)

    def store(self, b, grp, last=False):
        """``o`` (and lse) of sequence ``b``'s rows of a row group to HBM. ``last``: nothing of
        this program follows (its last item, or the merges after the barrier)."""
        cfg = self.cfg
        sm = grp.sm
        if cfg.has_vscale:
            nisa.tensor_scalar(dst=sm.o, data=sm.o, op0=nl.multiply,
                               operand0=grp.rt[0:grp.rows, C_V:C_V + 1])
        o_sb = nl.ndarray((grp.rows, cfg.d), dtype=cfg.out_dtype, buffer=nl.sbuf)   # [rows, d]
        l_sb = None
        if cfg.return_lse:
            l_sb = nl.ndarray((grp.rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        sm.finalize(o_sb, l_sb)
        # the program's last stores with s_q > 1 in draft order (one DMA per draft, not per head);
        # earlier items keep the per-head DMAs: their transposes would wait in TensorE's
        # in-order queue for this item's last PV and hold the next item's K^T (s_q = 4 B=8
        # Trn3, modeled: 151.2 us either way when every item took this path)
        by_draft = last and cfg.s_q > 1 and cfg.d <= P
        if by_draft:
            self._store_by_draft(b, grp, o_sb)
        for s, h in enumerate(grp.heads):
            r0 = s * cfg.W + cfg.row_off(b)
            if not by_draft:
                dst = cfg.rows_of(self.out, b)[:, h * cfg.G:(h + 1) * cfg.G, :].permute((1, 0, 2))
                nisa.dma_copy(dst=dst, src=o_sb[r0:r0 + cfg.rows, :])
            if l_sb is not None:
                dl = cfg.rows_of(self.lse, b)[:, h * cfg.G:(h + 1) * cfg.G].permute((1, 0))
                nisa.dma_copy(dst=dl, src=l_sb[r0:r0 + cfg.rows, :])

    def _store_by_draft(self, b, grp, o_sb):
        """``o`` of a row group with s_q > 1 drafts, one DMA per draft. A slot's rows are
        (q-head g of its KV head, draft t), so one head's rows of ``out[b]`` ``[s_q, H_q, d]``
        interleave with the other heads' and every per-head DMA spans rows the others span too:
        the model orders such DMAs one after another by their row ranges (the 8 stores of the
        last Llama-3-8B B=8 s_q=4 sequence ran 1.7 us each, one after another, at the end of the
        kernel; whether the compiler also orders them is not documented). Here o is PE-transposed
        to ``[d, rows]``, its columns are copied into (draft, head, g) order on the way out of
        PSUM, and a second transpose brings the rows back: draft t of the group's heads is then
        one contiguous block of partitions and one contiguous block of ``out[b]``."""
        cfg = self.cfg
        n, G, sq, d = len(grp.heads), cfg.G, cfg.s_q, cfg.d
        R, m = o_sb.shape[0], sq * n * G
        ident = nl.shared_identity_matrix(P, dtype=o_sb.dtype)     # one per dtype and kernel
        tp = nl.ndarray((d, R), dtype=o_sb.dtype, buffer=nl.psum)                  # [d, rows]
        nisa.nc_matmul(dst=tp, stationary=o_sb, moving=ident[0:R, 0:R], is_transpose=True)
        oT = nl.ndarray((d, sq, n, G), dtype=o_sb.dtype, buffer=nl.sbuf)          # [d, t, s, g]
        nisa.tensor_copy(dst=oT, src=tp.ap([[R, d], [1, sq], [cfg.W, n], [sq, G]],
                                           offset=cfg.row_off(b)))
        tp2 = nl.ndarray((m, d), dtype=o_sb.dtype, buffer=nl.psum)                 # [(t, s, g), d]
        nisa.nc_matmul(dst=tp2, stationary=oT.reshape((d, m)), moving=ident[0:d, 0:d],
                       is_transpose=True)
        o2 = nl.ndarray((m, d), dtype=o_sb.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o2, src=tp2)
        h0 = grp.heads[0]
        for t in range(sq):
            nisa.dma_copy(dst=cfg.rows_of(self.out, b)[t, h0 * G:(h0 + n) * G, :],
                          src=o2[t * n * G:(t + 1) * n * G, :])

    def merge_owned(self, owned):
        """Merge the parts of each split sequence whose part 0 this program ran."""
        cfg = self.cfg
        pending = getattr(self, "pending", {})
        for it in owned:
            for g in range(cfg.n_groups):
                grp = pending[(it.b, g)]
                sm = grp.sm
                for k, other in enumerate(self.split):
                    if other.b != it.b:
                        continue
                    st = nl.ndarray((grp.rows, cfg.d + 2), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(dst=st, src=self.parts[k, g, 0:grp.rows, :])
                    merge_states_sb(sm, st[:, 0:cfg.d], st[:, cfg.d:cfg.d + 1],
                                    st[:, cfg.d + 1:cfg.d + 2])
                self.store(it.b, grp, last=True)

    # -- per tile and row group: three pipeline stages ----------------------------------------
    def stage_kT(self, job):
        """K^T of each head of the group, key order restored on eviction (column p*T + t comes
        from transpose t of partition p). A generator: yields after each transpose. FP8 K^T
        pairs come by DMA (nothing to do) or by :meth:`_kT_pairs`."""
        if self.kT_dma:
            job.kTs = job.kt
            return
        if self.pairs:
            yield from self._kT_pairs(job)
            return
        cfg, lay, DT = self.cfg, job.lay, self.DT
        T, npp, ncol, kt = lay.T, job.npp, job.ncol, job.kt
        fp8 = self.fp8                   # K^T by a matmul with the identity (below)
        # FP8 K^T by a matmul with the identity: bf16 PSUM where the target has it (Trn3; every
        # e4m3fn value is a bf16 value, so exact), half the eviction bytes of fp32
        tp_dt = (nl.bfloat16 if nisa.get_nc_version() >= 4 else nl.float32) if fp8 else kt.dtype
        job.kTs = []
        for h in job.grp.heads:
            kT = nl.ndarray((P, DT, lay.tile_keys), dtype=nl.bfloat16 if fp8 else kt.dtype,
                            buffer=nl.sbuf)                                      # [d, DT, 128T]
            for dt in range(DT):
                dsz = min(P, cfg.d - dt * P)
                grpn = TR_GROUP // 2 if tp_dt is nl.float32 else TR_GROUP
                for t0 in range(0, T, grpn):
                    t1 = min(T, t0 + grpn)
                    tp = nl.ndarray((P, t1 - t0, P), dtype=tp_dt, buffer=nl.psum)
                    for t in range(t0, t1):
                        src = kt[0:npp, t, h, dt * P:dt * P + dsz]
                        if fp8:
                            nisa.nc_matmul(dst=tp[0:dsz, t - t0, 0:npp], stationary=src,
                                           moving=self.ident[0:npp, 0:npp])
                        else:
                            nisa.nc_transpose(dst=tp[0:dsz, t - t0, 0:npp], data=src,
                                              engine=nisa.engine.tensor)
                        yield
                    if job.packed:       # transpose order: column t*128 + p (slot s: slices
                        dstv = kT[0:dsz, dt, t0 * P:t1 * P].reshape_dim(1, (t1 - t0, P))
                        self._evict(dstv, tp[0:dsz, :, :])       # [s Ts, (s+1) Ts) together)
                    else:
                        dstv = kT[0:dsz, dt, 0:ncol].reshape_dim(1, (npp, T))[:, :, t0:t1]
                        self._evict(dstv.permute((0, 2, 1)), tp[0:dsz, :, 0:npp])
            job.kTs.append(kT)

    def _kT_pairs(self, job):
        """FP8 K^T pairs of the group's heads by TensorE: the loaded tile viewed as bf16 (each
        element the dims ``2i, 2i + 1`` of one head, ``.view``, nki-spec 6.3) is transposed
        ``hpt`` heads at a time, ``[keys, (hh, i)]`` -> ``[(hh, i), keys]``: the layout of
        :func:`.kv_cache.load_kT_pairs`, so QK^T takes its even / odd-dim passes. A TensorE
        transpose is bit-exact on gen3+ (nki-spec 9.1.3: it moves the fp8 bytes, whatever the
        bf16 value they spell) and so is a same-dtype tensor_copy out of PSUM (nki-spec 5.3,
        "Bit-exact copies"; the spec is silent on bf16 subnormal patterns, which it calls
        bit-exact like any other). Half the
        transposes and eviction elements of one transpose per head, and 16-bit PSUM on Trn2 where
        the identity matmul wrote fp32. A generator: yields after each transpose."""
        lay = job.lay
        T, npp, ncol = lay.T, job.npp, job.ncol
        dp, hpt = self.pairs
        k16 = job.kt.view(nl.bfloat16)                                    # [128, T, H_kv, d/2]
        job.kTs = {}
        heads = job.grp.heads
        for h0 in range(heads[0], heads[-1] + 1, hpt):       # (groups hold whole pair tiles)
            C = (min(h0 + hpt, heads[-1] + 1) - h0) * dp
            kT = nl.ndarray((P, lay.tile_keys), dtype=nl.bfloat16, buffer=nl.sbuf)  # [(hh,i), keys]
            for t0 in range(0, T, TR_GROUP):
                t1 = min(T, t0 + TR_GROUP)
                tp = nl.ndarray((P, t1 - t0, P), dtype=nl.bfloat16, buffer=nl.psum)
                for t in range(t0, t1):
                    src = k16[0:npp, t, h0:h0 + C // dp, :]                          # [keys, C]
                    nisa.nc_transpose(dst=tp[0:C, t - t0, 0:npp], data=src,
                                      engine=nisa.engine.tensor)
                    yield
                dstv = kT[0:C, 0:ncol].reshape_dim(1, (npp, T))[:, :, t0:t1]
                self._evict(dstv.permute((0, 2, 1)), tp[0:C, :, 0:npp])
            job.kTs[h0 // hpt] = kT

    def stage_softmax(self, job):
        """S = Q^T.T @ K^T per slot (PE column tiles side by side); scores out of PSUM in one
        pass (X in logit units, or tanh units with a soft-cap; row max fused, masked where the
        tile needs it); online-softmax max / exp / sums."""
        cfg, lay, DT = self.cfg, job.lay, self.DT
        grp, ncol, k0 = job.grp, job.ncol, job.k0
        rows, W = grp.rows, cfg.W
        tiled = W < P
        S = nl.ndarray((P, lay.tile_keys), dtype=nl.float32, buffer=nl.psum)      # [rows, 128T]
        for c0 in range(0, ncol, MM_N):          # slots innermost: consecutive matmuls use
            c1 = min(ncol, c0 + MM_N)            # different PE column tiles and overlap
            if self.pairs:                       # even dims, then odd dims (PE row tiles)
                dp, hpt = self.pairs
                for j in (0, 1):
                    for s, h in enumerate(grp.heads):
                        r0, p0 = s * W, (h % hpt) * dp
                        kT8 = job.kTs[h // hpt].view(self.kc.dtype)        # [(hh, i), 2 keys]
                        kw = dict(tile_position=(p0, r0), tile_size=(dp, W)) \
                            if (tiled or dp < P) else {}
                        nisa.nc_matmul(dst=S[r0:r0 + W, c0:c1],
                                       stationary=grp.qT[p0:p0 + dp, j, r0:r0 + W],
                                       moving=kT8[p0:p0 + dp, 2 * c0 + j:2 * c1:2],
                                       accumulate=j > 0, **kw)
                continue
            for dt in range(DT):
                dsz = min(P, cfg.d - dt * P)
                for s, kT in enumerate(job.kTs):
                    r0 = s * W
                    kw = dict(tile_position=(0, r0), tile_size=(P, W)) if tiled else {}
                    nisa.nc_matmul(dst=S[r0:r0 + W, c0:c1], stationary=grp.qT[0:dsz, dt, r0:r0 + W],
                                   moving=kT[0:dsz, dt, c0:c1], accumulate=dt > 0, **kw)
        job.kTs = None
        sm = grp.sm
        L = cfg.seq_lens[job.it.b]
        masked = (k0 + ncol - 1 > L - cfg.s_q) or (cfg.window and k0 < L - cfg.window)
        X = nl.ndarray((rows, lay.tile_keys), dtype=nl.float32, buffer=nl.sbuf)
        lo = grp.rt[0:rows, C_LO:C_LO + 1]
        hi = grp.rt[0:rows, C_HI:C_HI + 1]
        qk = grp.rt[0:rows, C_QK:C_QK + 1]
        Xv = X[:, 0:ncol]
        if cfg.softcap:
            nisa.activation(dst=Xv, op=nl.tanh, data=S[0:rows, 0:ncol], scale=qk)
            mask_range_select(Xv, Xv, lo, hi, k0, reduce_res=sm.max_slot())
        else:
            # keys every row sees (before the first draft's diagonal, no window cut) take the
            # fused pass; only the tail is masked
            full = ncol
            if masked:
                full = 0 if (cfg.window and k0 < L - cfg.window) else \
                    max(0, min(ncol, L - cfg.s_q + 1 - k0))
            scale_mask_max(X, S, qk, lo, hi, k0, ncol, full, sm.max_slot)
        del S
        Pm = nl.ndarray((rows, lay.tile_keys), dtype=nl.bfloat16, buffer=nl.sbuf)  # [rows, 128T]
        job.alpha = sm.exp_block(Pm[:, 0:ncol], Xv, defer_sum=True)
        job.Pm = Pm

    def stage_pT(self, job):
        """P^T: key p*T + t on partition p of slice t (TensorE transposes, evicted to SBUF)."""
        lay = job.lay
        npp, ncol, T, rows = job.npp, job.ncol, lay.T, job.grp.rows
        pT = nl.ndarray((P, T, P), dtype=nl.bfloat16, buffer=nl.sbuf)             # [keys, T, rows]
        pv = job.Pm[:, 0:ncol].reshape_dim(1, (npp, T))
        for t0 in range(0, T, TR_GROUP):
            t1 = min(T, t0 + TR_GROUP)
            tp = nl.ndarray((P, t1 - t0, P), dtype=nl.bfloat16, buffer=nl.psum)
            for t in range(t0, t1):
                nisa.nc_transpose(dst=tp[0:npp, t - t0, 0:rows], data=pv[:, :, t],
                                  engine=nisa.engine.tensor)
            self._evict(pT[0:npp, t0:t1, 0:rows], tp[0:npp, :, 0:rows])
        job.Pm = None
        job.pT = pT

    def stage_pv(self, job):
        """O[slot rows] = sum_t P^T[t].T @ V[t, head] (PE column tiles), then o = alpha o + O.
        A generator: yields after each slice t."""
        cfg, lay = self.cfg, job.lay
        grp, n, vt, pT = job.grp, job.n, job.vt, job.pT
        T, W = lay.T, cfg.W
        tiled = W < P
        O = nl.ndarray((P, cfg.d), dtype=nl.float32, buffer=nl.psum)              # [rows, d]
        for t in range(T):                       # slots innermost (PE column tiles overlap)
            kp = -(-(n - t) // T)                # partitions whose slot t holds a valid key
            if kp <= 0:
                continue
            for s, h in enumerate(grp.heads):
                r0 = s * W
                kw = dict(tile_position=(0, r0), tile_size=(P, W)) if tiled else {}
                nisa.nc_matmul(dst=O[r0:r0 + W, 0:cfg.d], stationary=pT[0:kp, t, r0:r0 + W],
                               moving=vt[0:kp, t, h, :], accumulate=t > 0, **kw)
            yield
        job.O = O

    def stage_accumulate(self, job):
        """o = alpha o + O (VectorE), issued after the step's other ScalarE/VectorE work."""
        sm = job.grp.psm if job.packed else job.grp.sm      # (packed: all 128 slot rows)
        sm.flush_sum()                   # l = alpha l + sum p, deferred off the softmax's chain
        sm.accumulate_o(job.O[0:sm.rows, :], job.alpha, mode="stt", copy_engine="vector")
        job.O = None

    # -- packed tiles (one KV head: its rows repeated in every PE column tile) ----------------
    def _packs(self, it, k0, n):
        """Whether a tile runs packed: a packed plan, a full tile, and no row needs a mask in it
        (before the drafts' diagonal, inside every window)."""
        cfg = self.cfg
        if not cfg.packed or n != self.lay.tile_keys:
            return False
        L = cfg.seq_lens[it.b]
        return k0 + n - 1 <= L - cfg.s_q and not (cfg.window and k0 < L - cfg.window)

    def stage_softmax_packed(self, job):
        """Slot s scores its token slices ``[s Ts, (s + 1) Ts)`` of the tile (columns
        ``tt * 128 + p``: key ``k0 + p T + s Ts + tt``) against the head's rows repeated in its
        PE column tile; one softmax pass over all 128 partitions (each slot its own state)."""
        cfg, DT = self.cfg, self.DT
        W, Ts, grp = cfg.W, cfg.Ts, job.grp
        kT = job.kTs[0]
        ncol = Ts * P
        S = nl.ndarray((P, ncol), dtype=nl.float32, buffer=nl.psum)              # [slots, Ts 128]
        for dt in range(DT):
            dsz = min(P, cfg.d - dt * P)
            for s in range(cfg.nslot):            # slots innermost: their matmuls overlap
                r0 = s * W
                nisa.nc_matmul(dst=S[r0:r0 + W, :], stationary=grp.qT[0:dsz, dt, r0:r0 + W],
                               moving=kT[0:dsz, dt, s * ncol:(s + 1) * ncol], accumulate=dt > 0,
                               tile_position=(0, r0), tile_size=(P, W))
        job.kTs = None
        if grp.psm is None:
            grp.psm = SoftmaxState(P, cfg.d, cfg.xmul, sum_in_o=False)
        sm = grp.psm
        X = nl.ndarray((P, ncol), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=X, data=S, op0=nl.multiply,
                                  operand0=grp.rt[:, C_QK:C_QK + 1], reduce_op=nl.maximum,
                                  reduce_res=sm.max_slot())
        del S
        Pm = nl.ndarray((P, ncol), dtype=nl.bfloat16, buffer=nl.sbuf)           # [slots, Ts 128]
        job.alpha = sm.exp_block(Pm, X, defer_sum=True)
        job.Pm = Pm

    def stage_pT_packed(self, job):
        """P^T of all slots at once: one 128 x 128 transpose per slice of a slot."""
        job.pT = transpose_slots(job.Pm, self.cfg.Ts, self._evict)
        job.Pm = None

    def stage_pv_packed(self, job):
        """O[s W + r] = sum over slot s's slices of P^T.T @ V[:, s Ts + tt] (PE column tiles).
        A generator: yields after each slice."""
        cfg = self.cfg
        W, Ts = cfg.W, cfg.Ts
        O = nl.ndarray((P, cfg.d), dtype=nl.float32, buffer=nl.psum)              # [slots, d]
        for tt in range(Ts):
            for s in range(cfg.nslot):
                r0 = s * W
                nisa.nc_matmul(dst=O[r0:r0 + W, :], stationary=job.pT[:, tt, r0:r0 + W],
                               moving=job.vt[:, s * Ts + tt, 0, :], accumulate=tt > 0,
                               tile_position=(0, r0), tile_size=(P, W))
            yield
        job.pT = None
        job.O = O

    def _evict(self, dst, src):
        """PSUM -> SBUF copies spread over ScalarE and VectorE (share cfg.kt_act on ScalarE)."""
        f = self.cfg.kt_act
        i = self.n_evict
        self.n_evict += 1
        act = int((i + 1) * f + 1e-9) > int(i * f + 1e-9)
        nisa.tensor_copy(dst=dst, src=src,
                         engine=nisa.engine.scalar if act else nisa.engine.vector)


# ---------------------------------------------------------------------------------------- op


def _check_inputs(q, k_cache, v_cache, seq_lens, block_table, window, lnc):
    op = "decode_attention"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if getattr(t, "ndim", None) != 4:
            raise ValueError(f"{op}: {name} must be 4-D; got shape {getattr(t, 'shape', None)}")
    B, s_q, Hq, d = (int(x) for x in q.shape)
    if d not in HEAD_DIMS:
        raise ValueError(f"{op}: head_dim must be one of {', '.join(map(str, HEAD_DIMS))}; got {d}")
    if not 1 <= s_q <= MAX_S_Q:
        raise ValueError(f"{op}: q must hold 1 to {MAX_S_Q} new tokens per sequence (s_q); got {s_q}")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"{op}: k_cache and v_cache must have the same shape; got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    N0, S1, Hkv, dk = (int(x) for x in k_cache.shape)
    if dk != d:
        raise ValueError(f"{op}: k_cache head_dim {dk} must equal q's head_dim {d}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"{op}: H_q ({Hq}) must be a multiple of the cache's H_kv ({Hkv})")
    slot_width(Hq // Hkv * s_q)
    sl = check_decode_lens(op, seq_lens, B, s_q)
    if block_table is None:
        if N0 != B:
            raise ValueError(f"{op}: a contiguous k_cache must be [B={B}, S_max, H_kv, d]; got "
                             f"{tuple(k_cache.shape)} (pass block_table for a paged cache)")
        if sl.max(initial=0) > S1:
            raise ValueError(f"{op}: seq_lens up to {int(sl.max())} exceed the cache's S_max = {S1}")
        bt = bs = None
    else:
        bt, bs = check_block_table(op, block_table, sl, k_cache.shape, BLOCK_SIZES)
    check_window(op, window)
    check_lnc(op, lnc)
    return B, s_q, Hq, d, Hkv, sl, bt, bs


def decode_attention(q, k_cache, v_cache, seq_lens, *, block_table=None, scale=None, window=None,
                     softcap=None, sinks=None, k_scale=None, v_scale=None, return_lse=False,
                     lnc=1, plan=None):
    """Decode attention over a contiguous or paged (vLLM) KV cache, flash-decoding style.

    Args:
      q: [B, s_q, H_q, d] bfloat16 / float16; s_q in 1..8 new tokens per sequence (s_q > 1:
         speculative drafts; draft i sees the cache and drafts 0..i).
      k_cache, v_cache: contiguous [B, S_max, H_kv, d], or paged [num_blocks, block_size, H_kv, d]
         with ``block_table``; q's dtype, or FP8 (float8_e4m3 on Trn2, float8_e4m3fn on Trn3) with
         ``k_scale`` / ``v_scale``.
      seq_lens: [B] host integers: valid tokens per sequence, counting the s_q new ones (already
         written to the cache); 0 marks an empty slot (output 0, lse -inf). The kernel is
         specialised on them (plan once per decode step, run per layer).
      block_table: [B, max_blocks] int32: logical block n of sequence b is physical block
         ``block_table[b, n]``, any order; entries past a sequence's end are never read, nor are
         the pages they point to. Block sizes 8 to 256 (powers of two).
      scale: logit scale (default 1/sqrt(d)). window: left sliding window (keys visible including
         the query's own). softcap: ``c * tanh(logit / c)``. sinks: [H_q] sink logits (GPT-OSS).
      k_scale, v_scale: FP8 dequantization scales, a scalar or one per KV head (vLLM).
      return_lse: also return lse [B, s_q, H_q] float32 (natural log, sink included).
      lnc: 1, or 2 to split the work (long sequences: their KV) over both cores of a logical core.
      plan: a :func:`~nki_kernels.plan_paged_attention` plan of this batch (``query_start_loc``
         ``= [0, s_q, 2 s_q, ...]``), made once per decode step and reused by every layer; it
         must match the call (lengths, heads, head_dim, block size, KV dtype, window, lnc,
         target), else ValueError.
    Returns:
      o [B, s_q, H_q, d] in q's dtype (and lse).
    """
    op = "decode_attention"
    B, s_q, Hq, d, Hkv, sl, bt, bs = _check_inputs(q, k_cache, v_cache, seq_lens, block_table,
                                                   window, lnc)
    gen = int(nisa.get_nc_version())
    if gen < 3:
        raise ValueError(f"{op}: needs Trn2 or Trn3 (range_select); target is gen{gen}")
    qn, kn, is_fp8, ks, vs, scale, softcap, sk = attention_options(
        op, gen, q, k_cache, v_cache, Hq, Hkv, d, scale, softcap, sinks, k_scale, v_scale)
    isz = 1 if is_fp8 else 2
    lens = tuple(int(x) for x in sl)
    if plan is not None:
        from .paged_attention import decode_schedule_of
        lay, items = decode_schedule_of(plan, "decode_attention", lens, s_q, Hq, Hkv, d, isz, bs,
                                        window, lnc)
    else:
        lay, items = decode_schedule(lens, s_q, Hq, Hkv, d, isz, bs, window, lnc)
    W = slot_width(Hq // Hkv * s_q)
    plan = DecodePlan(B=B, s_q=s_q, Hq=Hq, Hkv=Hkv, d=d, W=W, nslot=P // W, layout=lay,
                      seq_lens=lens, items=items, window=int(window or 0),
                      softcap=float(softcap or 0.0), has_sinks=sk is not None,
                      has_vscale=vs is not None, return_lse=bool(return_lse),
                      out_dtype=getattr(nl, qn), kt_act=0.5, gather=GATHER)
    rowtab = row_table(plan, scale, ks, vs, sk)
    res = launch(decode_attention_kernel, q, k_cache, v_cache, bt, rowtab, plan, lnc=lnc)
    return tuple(res) if return_lse else res


def decode_schedule(lens, s_q, Hq, Hkv, d, isz, block_size, window, lnc):
    """The host schedule of a decode batch (plan once per step, run per layer): the KV tile
    geometry (``T`` tokens per partition: long runs, a few tiles per program, SBUF budget) and
    the split-KV work items of every program. ``lens``: host lengths; ``block_size`` None for a
    contiguous cache."""
    T = tokens_per_partition(Hkv, d, isz, block_size, max_len=max([1, *lens]),
                             total=sum(lens) // lnc)
    W = slot_width(Hq // Hkv * s_q)
    budget = int(nl.tile_size.sbuf_fmax_bytes * 0.8)
    while T > 1 and sbuf_bytes(T, Hkv, d, isz, P // W) > budget:
        T //= 2
    lay = KVLayout(block_size is not None, block_size or 0, Hkv, d, T)
    return lay, plan_split_kv(list(lens), lay.tile_keys, lnc, s_q=s_q, window=window)


def row_table(plan: DecodePlan, scale, k_scale, v_scale, sinks):
    """The per-row constants of every (sequence, row group), fp32 ``[128, B, n_groups, 5]``:
    first / last visible key, qk scale (``scale * k_scale[head]``, divided by the soft-cap),
    v_scale and sink logit. Unused rows see nothing and carry scale 0."""
    tab = np.zeros((plan.B, plan.n_groups, P, NCOL), dtype=np.float32)
    tab[..., C_LO] = -1.0
    tab[..., C_HI] = -1.0
    tab[..., C_SINK] = M_FLOOR
    for b, L in enumerate(plan.seq_lens):
        for g in range(plan.n_groups):
            for s, h in plan.slots_of(g):
                for gg in range(plan.G):
                    for i in range(plan.s_q):
                        r = s * plan.W + plan.row_off(b) + gg * plan.s_q + i
                        pos = L - plan.s_q + i
                        tab[b, g, r, C_HI] = pos
                        tab[b, g, r, C_LO] = max(0, pos - plan.window + 1) if plan.window else -1
                        qs = scale * (k_scale[h] if k_scale is not None else 1.0)
                        tab[b, g, r, C_QK] = qs / plan.softcap if plan.softcap else qs
                        tab[b, g, r, C_V] = v_scale[h] if v_scale is not None else 1.0
                        if sinks is not None:
                            tab[b, g, r, C_SINK] = sinks[h * plan.G + gg]
    return np.ascontiguousarray(tab.transpose(2, 0, 1, 3))


__all__ = ["decode_attention", "decode_attention_kernel", "DecodePlan", "WorkItem", "row_table"]
