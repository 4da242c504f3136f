"""MLA decode: multi-head latent attention (DeepSeek-V3 / R1 / V3.2, Kimi-K2) for decode.

With the up-projections absorbed (``q_nope`` already multiplied by W_UK, W_UV applied by the
caller), MLA decode is MQA over one 576-wide latent per token shared by every head:
``s = scale * (q_nope . c_kv + q_rope . k_rope)``, ``o = softmax(s) c_kv`` where the latent row is
``[c_kv (512) | k_rope (64)]``. Design note: docs/attention.md ("MLA decode").

Built on the decode-attention components: the cache layouts and tile loads of :mod:`.kv_cache`
(the latent cache is a one-head cache with ``d = 576``), the split plan of :mod:`.split_kv`, the
online softmax of :mod:`.softmax`, the mask of :mod:`.masks` and the exact merge of
:mod:`.merge_attention_states`.

Per latent tile (``128 T`` tokens of one sequence, one long DMA run per partition; paged: one
register-addressed DMA per page), read from HBM **once**:

* K^T: TensorE transposes of the 576 columns (4 x 128 + 64), key order restored on eviction,
  shared by every row group (all heads see the same keys); packed tiles on Trn3 take some token
  slices by identity matmuls instead (the transposes' background lane bound);
* per row group (128 of the ``s_q x H`` query rows, row ``i H + h``): ``S = Q^T.T K^T`` (5
  accumulating matmuls per 512 keys), scores scaled and row max fused on the way out of PSUM
  (masked with ``range_select`` where the tail or the drafts' diagonal cut the tile), one
  exponential with the row sum fused, P^T by TensorE transposes, ``O = P^T.T V`` with V the
  first 512 columns **of the same SBUF tile**, online softmax carried from tile to tile.

The stages of consecutive (tile, row group) jobs are software-pipelined (K^T, QK^T + softmax,
P^T, PV with lags 0..3) as in decode attention, loads PREFETCH tiles ahead.

FP8 caches: a per-tensor ``kv_scale`` folds into the score scale and the output (the latent is
used as stored, K^T by identity matmuls; packed tiles (few rows) as dim pairs, by TensorE
transposes of the tile viewed as bf16); per-token scales (one fp32 per cache slot) dequantize
each tile once in SBUF to bf16 (``c[p, t, :] * kv_scale`` per partition and token slice, VectorE /
ScalarE), after which the tile runs the bf16 path (TensorE transposes for K^T).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._validate import (
    check_block_table,
    check_decode_lens,
    check_lnc,
    check_target,
    dtype_name,
    is_torch,
    token_scales,
)
from ..backend import launch, lnc_programs, nisa, nki, nl
from ..dense._tiles import identity
from .kv_cache import BLOCK_SIZES, KVLayout, load_kv_tile, load_kv_tile_pages, tokens_per_partition
from .masks import mask_range_select, scale_mask_max
from .merge_attention_states import merge_states_sb
from .schedule import drain, weave
from .softmax import SoftmaxState
from .split_kv import (
    empty_rows,
    fold_apply,
    fold_weights,
    merge_split,
    plan_split_kv,
    slot_selector,
    split_parts,
    transpose_slots,
)

P = 128
D_LATENT = 512        # c_kv: K (first part) and V
D_ROPE = 64           # k_rope: K only
D_QK = D_LATENT + D_ROPE
DT = -(-D_QK // P)    # 5 contraction chunks (4 x 128 + 64)
DP = D_QK // 2        # FP8 K^T as dim pairs (2-byte elements): 288 pairs
DTP = -(-DP // P)     # in 3 chunks (128 + 128 + 32)
MAX_S_Q = 4
MM_N = 512            # score columns per matmul (one fp32 PSUM bank)
TR_GROUP = 8          # 128-key transposes per PSUM buffer
PREFETCH = 2          # latent tiles loaded ahead of the one being computed
DEQ_AHEAD = 1         # per-token FP8: tile j + 1 is dequantized in the step that starts tile j's
                      # K^T, before its transposes (modeled, DeepSeek-V3 H=128 L=32K Trn3: 172.7
                      # us; 2 tiles ahead 174.5; after the step's matmuls 242.6)
LAGS = (0, 2, 3, 4)   # pipeline lags of the stages K^T, QK^T + softmax, P^T, PV (in jobs)
WEAVE = 3             # K^T transposes issued after each QK^T / PV matmul
EVICT_ACT = {3: (0.7, 0.6), 4: (0.7, 0.7)}
# share of the K^T / P^T PSUM evictions on ScalarE (the rest on VectorE) per generation, row
# layout / packed layout (modeled). Row, DeepSeek-V3 H=128 L=32K Trn3, share 0.6 / 0.65 / 0.7 /
# 0.75 / 0.8: 140.7 / 141.5 / 140.3 / 142.1 / 144.0 us; Trn2 219.3 at 0.7, 220.2 at 0.75.
# Packed (00f208f's fold and deferred sums), TP8 H=16 B=1 L=32K / B=32 L=4K paged, share 0.5 /
# 0.6 / 0.65 / 0.7 / 0.75: Trn3 97.7 / 107.3 / 97.7 / 95.4 / 96.5 us and 148.3 / 154.7 / 148.5 /
# 147.0 / 147.0 us; Trn2 at 0.4 / 0.45 / 0.5 / 0.55 / 0.6: 139.6 / 143.5 / 129.6 / 152.6 / 153.4
# and 198.4 / 201.1 / 187.0 / 203.2 / 202.5 us, but the FP8 B=1 L=32K row 160.6 / 163.0 /
# 161.5 / 152.0 / 141.0: Trn2 keeps 0.6.
KT_MM_SLICES = (2, 5, 7)
# Packed tiles on Trn3: K^T of these token slices (of every 128-column chunk) by identity
# matmuls on the PE array, the others by transposes on TensorE's background lane, which with
# every K^T a transpose carried 42 of a tile's 70 TensorE passes. Modeled, TP8 H=16 B=1 L=32K /
# B=32 L=4K paged (us), with the other 2026-11-29 changes: none 90.5 / 123.5, (7) 88.1 / 123.5,
# (3, 7) 88.1 / 123.9, (2, 5, 7) 88.1 / 123.1, (1, 3, 5, 7) 88.4 / 123.8.
# Packed per-tensor FP8 (few rows, both targets): K^T as dim pairs. The FP8 tile viewed as
# bf16 (each element the dims 2i, 2i + 1 of one key, ``.view``, nki-spec 6.3) is transposed by
# TensorE, bit-exact (nki-spec 9.1.3: the transpose moves the bytes, whatever bf16 value they
# spell; so does the same-dtype eviction, nki-spec 5.3): 3 transposes per 128 keys (on Trn3's
# background lane) instead of 5 identity matmuls on the PE array (a TensorE transpose of FP8
# itself yields 16-bit elements, nki-spec 10), and half the eviction elements (bf16, where
# Trn2's identity matmuls wrote fp32 PSUM). QK^T then contracts the even and the odd dims in
# two passes per chunk (the pairs viewed back as FP8, stride-2 moving views; mixed bf16 x FP8
# operands, nki-spec 9.1.1; the spec is silent on a strided moving operand's rate, the cost
# model prices a matmul by its N alone), 6 passes per 512 keys instead of 5. As decode attention's paged
# FP8 K^T on Trn2 (`decode_attention._kT_pairs`). Modeled, TP8 H=16 B=1 L=32K / B=128 L=4K
# paged/64 (us): Trn3 115.3 / 147.7 -> 69.5 / 114.6, Trn2 136.1 / 179.1 -> 100.7 / 148.6.
STT_TAIL = 2
# Packed o updates on Trn3 run split (``o alpha`` on ScalarE, the PSUM add on VectorE), except
# the program's last STT_TAIL + 1 tiles (one VectorE pass each: split, the updates of the tail
# ping-pong between the engines). Modeled TP8 H=16 B=1 L=32K, 1 / 2 / 3: 88.4 / 88.1 / 88.6 us
# (before the fold's weights went ahead of the last update: 2 / 4 / none 88.9 / 89.6 / 89.5).
C_LO, C_HI = 0, 1     # row table columns: first / last visible key of each query row
NCOL = 2              # (packed plans: then, per slice tt of a slot, the last visible partition of
                      # a masked packed tile, see row_table)


@dataclass(frozen=True)
class MLAPlan(nl.NKIObject):
    """Compile-time values of one call.

    B, s_q, H: sequences, new tokens each, heads; layout: latent cache / tile geometry (one head
    of width 576); seq_lens: host lengths; items: work items per program (:mod:`.split_kv`);
    qk_mul: scale x (FP8, per tensor) kv_scale, applied to the scores as they leave PSUM; v_mul:
    the per-tensor FP8 scale applied to the output (1.0 for bf16 and per-token scales).
    tok_scale: per-token FP8 scales (``kv_scale`` an HBM array, tiles dequantized in SBUF);
    deq_cast: per-tensor FP8 tiles cast to bf16 in SBUF (exact) and then run the bf16 path (the
    scale stays in qk_mul / v_mul), chosen where TensorE binds (one row layout of > 64 rows);
    deq_act: share of those dequantization passes on ScalarE (the rest on VectorE); evict_act:
    the ScalarE share of the PSUM evictions (row layout, packed), EVICT_ACT unless per-token.
    W, nslot: few query rows (``s_q H <= 64``): the rows are repeated in ``nslot`` PE column
    tiles of W, each slot takes ``T / nslot`` of a full tile's token slices (its own softmax
    state, merged at the end); nslot = 1: one row layout.
    """
    B: int
    s_q: int
    H: int
    layout: KVLayout
    seq_lens: tuple
    items: tuple
    qk_mul: float
    v_mul: float
    return_lse: bool
    out_dtype: object
    W: int = P
    nslot: int = 1
    tok_scale: bool = False
    deq_cast: bool = False
    deq_act: float = 0.0
    evict_act: tuple = EVICT_ACT[4]

    @property
    def dequant(self) -> bool:
        """FP8 tiles dequantized to bf16 in SBUF (per-token scales or deq_cast), then bf16."""
        return self.tok_scale or self.deq_cast

    @property
    def rows(self) -> int:
        return self.s_q * self.H

    @property
    def n_groups(self) -> int:
        return -(-self.rows // P)

    def group_rows(self, g: int) -> int:
        return min(P, self.rows - g * P)

    @property
    def masked_packed(self) -> bool:
        """Packed, with drafts (s_q > 1): a sequence's last tile, if full, packs masked."""
        return self.nslot > 1 and self.s_q > 1

    @property
    def Ts(self) -> int:
        """Token slices of a full tile per slot (packed tiles)."""
        return self.layout.T // self.nslot


# ------------------------------------------------------------------------------------ kernel


@nki.jit
def mla_decode_kernel(q_nope, q_rope, kv_cache, block_table, rowtab, cfg, kv_scale=None):
    """Absorbed MLA decode.

    Dimensions:
      B >= 1; s_q in 1..4; H heads with s_q * H query rows (any count; 128 per row group);
      latent 576 = 512 (c_kv, also V) + 64 (k_rope); any lengths (host-known, cfg.seq_lens).
    Args:
      q_nope: [B, s_q, H, 512] HBM bf16 (W_UK absorbed); q_rope: [B, s_q, H, 64] HBM bf16.
      kv_cache: [B, S_max, 576] (contiguous) or [num_blocks, block_size, 576] (paged), bf16 or
        FP8 (e4m3 on Trn2, e4m3fn on Trn3).
      block_table: [B, max_blocks] int32 HBM (paged), else None.
      rowtab: [B, n_groups, 128, 2] fp32 HBM: first / last visible key of every query row.
      cfg: MLAPlan.
      kv_scale: cfg.tok_scale: fp32 HBM per-token scales, [B, S_max] (contiguous) or
        [num_blocks, block_size] (paged), else None.
    Returns:
      o [B, s_q, H, 512] (cfg.out_dtype), and lse [B, s_q, H] fp32 (natural log) when
      cfg.return_lse.
    Notes:
      fp32 scores, max, sums and accumulation; P rounded to bf16 for PV. Each latent tile is
      read from HBM once and serves as K (576 columns) and V (its first 512). Cache entries past
      a sequence's end, and pages the block table does not name for it, are never read (nor
      their per-token scales). Per-token FP8: each tile is dequantized to bf16 in SBUF (the
      bf16 rounding of ``c * kv_scale``), then used as a bf16 tile.
    Pseudocode:
      for each work item (b, keys [k0, k1)): Q^T of each row group; state m, l, o
        for tile of 128 T keys: C [128, T, 576] <- DMA (paged: per page through the table)
          [per-token FP8: s [128, T] <- DMA (same pages); C <- bf16(C * s) per token slice]
          K^T [576, 128T] <- TensorE transposes of C (once per tile)
          for row group: S = Q^T.T K^T; X = qk_mul S (| mask); online softmax; P^T;
            O = sum_t P^T[t].T @ C[:, t, 0:512]; o = alpha o + O
        split part: (o, m, l) -> HBM; [LNC=2: barrier; the owner merges the parts]
        o / l (x v_mul) -> out, m + ln l -> lse
    """
    B, s_q, H = cfg.B, cfg.s_q, cfg.H
    out = nl.ndarray((B, s_q, H, D_LATENT), dtype=cfg.out_dtype, buffer=nl.shared_hbm)
    lse = None
    if cfg.return_lse:
        lse = nl.ndarray((B, s_q, H), dtype=nl.float32, buffer=nl.shared_hbm)
    programs, pid = lnc_programs()
    mine = cfg.items[pid]
    split, parts_hbm = split_parts(cfg.items, cfg.n_groups, D_LATENT)
    ident = None
    fp8_stored = kv_cache.dtype not in (nl.bfloat16, nl.float16) and not cfg.dequant
    if fp8_stored and cfg.nslot == 1:    # (packed: K^T as dim pairs by transposes, no identity)
        # FP8 used as stored (per-tensor scale): K^T by matmul with the identity
        ident = nl.shared_identity_matrix(P, dtype=nl.bfloat16)               # [128, 128]
    elif cfg.nslot > 1 and nisa.get_nc_version() >= 4 and not fp8_stored:
        # packed tiles: part of K^T by identity matmuls (KT_MM_SLICES); built on chip, not
        # loaded: a DMA of it queued ahead of the first latent tiles
        ident = identity(nl.bfloat16)                                         # [128, 128]
    if pid == 0:
        empty_rows(out, lse, cfg.seq_lens, cfg.rows, D_LATENT, cfg.out_dtype)
    run = _Run(q_nope, q_rope, kv_cache, block_table, rowtab, out, lse, parts_hbm, split, ident,
               cfg, kv_scale)
    run.items(mine)
    merge_split(run, mine, split, parts_hbm, programs)
    if cfg.return_lse:
        return out, lse
    return out


class _Group:
    """One row group of one work item: Q^T, its row bounds, its softmax state."""

    def __init__(self, g, r0, rows, qT, rt, sm, psm=None):
        self.g, self.r0, self.rows, self.qT, self.rt, self.sm = g, r0, rows, qT, rt, sm
        self.psm = psm                     # the packed slots' state (nslot > 1)
        self.stored = False                # out (and lse) written by stage_pv (store_last)
        self.fold = None                   # the slots' fold weights (fold_exp's ctx), if early


class _Job:
    """One (latent tile, row group) job between its pipeline stages."""

    def __init__(self, it, grp, tile, k0, n, T, packed=False, masked=False):
        self.it, self.grp, self.tile, self.k0, self.n = it, grp, tile, k0, n
        self.packed = packed
        self.masked = masked               # packed, and the drafts' diagonal cuts it (s_q > 1)
        self.npp = -(-n // T)              # partitions holding keys of this tile
        self.ncol = self.npp * T           # score columns (key k0 + c; c >= n masked)
        self.Pm = self.pT = self.alpha = self.O = None


class _Tile:
    """One latent tile in SBUF and (once built) its K^T; per-token FP8: its scales ``s``
    until the tile is dequantized (``c`` is then the bf16 tile)."""

    def __init__(self, c, n, s=None, raw=False):
        self.c, self.n, self.s = c, n, s
        self.raw = raw                     # FP8, to be dequantized to bf16 in SBUF
        self.kT = None


class _Run:
    """Trace-time driver: this program's work items as one stream of prefetched latent tiles."""

    def __init__(self, q_nope, q_rope, kv, block_table, rowtab, out, lse, parts_hbm, split, ident,
                 cfg, kv_scale=None):
        self.qn, self.qr, self.kv, self.bt = q_nope, q_rope, kv, block_table
        self.rowtab, self.out, self.lse, self.parts = rowtab, out, lse, parts_hbm
        self.split = list(split)
        self.ident = ident
        self.cfg = cfg
        self.lay = cfg.layout
        self.fp8 = kv.dtype not in (nl.bfloat16, nl.float16)
        # K^T straight from the FP8 tile, or (per-token scales, deq_cast) from its bf16 copy
        self.kt_fp8 = self.fp8 and not cfg.dequant
        # background transposes (NC-v4): a transpose runs beside a matmul, so P^T is woven into
        # the PV matmuls; before, P^T goes ahead of them
        self.bg_transpose = nisa.get_nc_version() >= 4
        # packed per-tensor FP8: K^T (and Q^T) as dim pairs
        self.pairs = self.kt_fp8 and cfg.nslot > 1
        self.ks = kv_scale
        self.n_evict = 0
        self.n_deq = 0
        self.pending = {}
        # packed plans: the slots' selection matrix of every item's fold (one row group)
        self.sel = slot_selector(cfg.W, cfg.group_rows(0)) if cfg.nslot > 1 else None

    def items(self, mine):
        lay, cfg = self.lay, self.cfg
        tiles = []
        for ii, it in enumerate(mine):
            for k0 in range(it.k0, it.k1, lay.tile_keys):
                tiles.append((ii, k0, min(lay.tile_keys, it.k1 - k0), k0 + lay.tile_keys >= it.k1))
        groups, tabs, loaded = {}, {}, {}
        self.final = mine[-1] if mine else None
        # a lone sequence of a packed plan (TP8 H = 16: the loads bind): its block table and
        # first tile's loads go ahead of its queries and row table, whose triggers had held
        # them back on the Sync queue (modeled, Trn3 B=32 L=32K s_q=2 paged/64: first page
        # load 1.91 -> 1.37 us). Elsewhere the queries lead: with several sequences per program
        # (B=32 / B=128 L=4K paged) or H = 128 (TensorE binds) loads first was slower
        loads_first = cfg.nslot > 1 and len(mine) == 1

        def fetch(j):
            ii, k0, n, _ = tiles[j]
            it = mine[ii]
            first = ii not in tabs                 # the item's first tile
            if first:
                if not loads_first:
                    groups[ii] = self.start(it)
                tabs[ii] = None
                if lay.paged:
                    p0 = it.k0 // lay.block_size
                    npg = -(-it.k1 // lay.block_size) - p0
                    bt = nl.ndarray((1, npg), dtype=nl.int32, buffer=nl.sbuf)     # [1, pages]
                    nisa.dma_copy(dst=bt, src=self.bt[it.b, p0:p0 + npg].reshape((1, npg)))
                    tabs[ii] = bt
            c = nl.ndarray((P, lay.T, 1, D_QK), dtype=self.kv.dtype, buffer=nl.sbuf)
            if lay.paged:
                load_kv_tile_pages([(c, self.kv, self.fp8)], lay, it.b, k0, n, tabs[ii],
                                   it.k0 // lay.block_size)
            else:
                load_kv_tile(c, self.kv, lay, it.b, k0, n, zero_tail=self.fp8)
            s = None
            if cfg.tok_scale:
                s = self.load_scales(it, k0, n, tabs.get(ii))
            loaded[j] = _Tile(c, n, s, raw=cfg.dequant)
            if first and loads_first:
                groups[ii] = self.start(it)

        jobs = [(j, g) for j in range(len(tiles)) for g in range(cfg.n_groups)]
        state = {}
        for step in range(len(jobs) + LAGS[-1]):
            gen_a = gen_b = gen_d = None
            ja = step - LAGS[0]
            if 0 <= ja < len(jobs):
                j, g = jobs[ja]
                for jj in range(j, min(len(tiles), j + PREFETCH + 1)):
                    if jj not in loaded:
                        fetch(jj)
                ii, k0, n, last = tiles[j]
                tile = loaded[j]
                # packed: a full tile; one the drafts' diagonal cuts (s_q > 1) too, masked
                # per slice, if it ends the sequence (its bounds in the row table assume so);
                # else (a partial last tile, or a full one before a few last keys) the row
                # layout
                L = cfg.seq_lens[mine[ii].b]
                masked = k0 + n - 1 > L - cfg.s_q
                packed = (cfg.nslot > 1 and n == lay.tile_keys
                          and (not masked or k0 + n == L))
                masked = packed and masked
                if g == 0:
                    if tile.raw:                           # FP8 to dequantize, not done yet
                        self.dequant(tile)
                    gen_a = self.stage_kT(tile, n, packed)
                    ahead = j + DEQ_AHEAD
                    if ahead in loaded and loaded[ahead].raw:
                        self.dequant(loaded[ahead])
                state[ja] = _Job(mine[ii], groups[ii][g], tile, k0, n, lay.T, packed, masked)
            jb = step - LAGS[1]
            if 0 <= jb < len(jobs):
                job = state[jb]
                gen_b = (self.stage_softmax_packed if job.packed else self.stage_softmax)(job)
            jd = step - LAGS[3]
            done = None
            if 0 <= jd < len(jobs):
                done = state.pop(jd)
                gen_d = (self.stage_pv_packed if done.packed else self.stage_pv)(done)
            # K^T transposes of tile j woven between the matmuls of QK^T (j-2) and PV (j-4), and
            # on Trn3 the P^T transposes of job j-3 (one after each PV matmul, then K^T's): a
            # transpose runs beside a matmul there (background transposes), and P^T issued
            # as a block stalled the PV matmuls behind it (modeled, DeepSeek-V3 H=128 L=32K
            # Trn3: 150.6 -> 142.6 us; on Trn2 it costs 0-8%, so P^T goes first there)
            weave(gen_a, gen_b, WEAVE)
            jc = step - LAGS[2]
            gen_c = None
            if 0 <= jc < len(jobs):
                job = state[jc]
                if job.packed:
                    self.stage_pT_packed(job)
                else:
                    gen_c = self.stage_pT(job)
                    if not self.bg_transpose:
                        drain(gen_c)
                        gen_c = None
            weave(gen_a, gen_d, WEAVE, gen_c)
            drain(gen_a)
            if done is not None:
                j, g = jobs[jd]
                ii, k0, n, last = tiles[j]
                if g == cfg.n_groups - 1:
                    loaded.pop(j)
                    if last:
                        self.finish(done.it, groups.pop(ii))

    # -- per item -------------------------------------------------------------------------------
    def start(self, it):
        cfg = self.cfg
        groups = []
        for g in range(cfg.n_groups):
            r0, rows = g * P, cfg.group_rows(g)
            q_sb = nl.ndarray((P, D_QK), dtype=self.qn.dtype, buffer=nl.sbuf)     # [rows, 576]
            qn = self.qn[it.b].reshape((cfg.rows, D_LATENT))
            qr = self.qr[it.b].reshape((cfg.rows, D_ROPE))
            width = rows
            if cfg.nslot > 1:                    # the rows repeated in every slot, zero padded
                width = P
            # the queries and the row table on a hardware-DGE ring: on the static ring they
            # queued ahead of the first latent tiles (first QK^T matmul 0.5 us later, modeled)
            for s in range(cfg.nslot):
                a = s * cfg.W
                nisa.dma_copy(dst=q_sb[a:a + rows, 0:D_LATENT], src=qn[r0:r0 + rows, :],
                              dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.sync)
                nisa.dma_copy(dst=q_sb[a:a + rows, D_LATENT:D_QK], src=qr[r0:r0 + rows, :],
                              dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.sync)
                if cfg.nslot > 1 and rows < cfg.W:   # (disjoint from the loads: no wait)
                    nisa.memset(dst=q_sb[a + rows:a + cfg.W, :], value=0.0,
                                engine=nisa.engine.gpsimd)
            if self.pairs:
                qT = self._qT_pairs(q_sb, width)
            else:
                qT = nl.ndarray((P, DT, P), dtype=self.qn.dtype, buffer=nl.sbuf)   # [576, rows]
                tq = nl.ndarray((P, DT, P), dtype=self.qn.dtype, buffer=nl.psum)
                for dt in range(DT):
                    dsz = min(P, D_QK - dt * P)
                    nisa.nc_transpose(dst=tq[0:dsz, dt, 0:width],
                                      data=q_sb[0:width, dt * P:dt * P + dsz],
                                      engine=nisa.engine.tensor)
                    nisa.tensor_copy(dst=qT[0:dsz, dt, 0:width], src=tq[0:dsz, dt, 0:width],
                                     engine=nisa.engine.vector)
            # [rows, 2]; packed: [128 slot rows, 2 + Ts] (the masked tile's bounds)
            nr, ncol = (P, NCOL + cfg.Ts) if cfg.masked_packed else (rows, NCOL)
            rt = nl.ndarray((P, ncol), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=rt[0:nr, :], src=self.rowtab[it.b, g, 0:nr, :],
                          dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.sync)
            sm = SoftmaxState(rows, D_LATENT, 1.0, sum_in_o=False)
            psm = None
            if cfg.nslot > 1 and it.keys >= self.lay.tile_keys:   # a whole tile packs too
                psm = SoftmaxState(P, D_LATENT, 1.0, sum_in_o=False)
            groups.append(_Group(g, r0, rows, qT, rt, sm, psm))
        return groups

    def _qT_pairs(self, q_sb, width):
        """Q^T of the even and odd dims, ``[pairs (3 chunks), parity, rows]``: ``[i, ct, j, r]``
        is dim ``2 (128 ct + i) + j`` of row ``r``, meeting K^T pair ``128 ct + i``."""
        qx = nl.ndarray((P, 2, DP), dtype=self.qn.dtype, buffer=nl.sbuf)     # [rows, parity, 288]
        for j in (0, 1):
            nisa.tensor_copy(dst=qx[0:width, j, :], src=q_sb[0:width, j:D_QK:2],
                             engine=nisa.engine.vector)
        tq = nl.ndarray((P, DTP, 2, P), dtype=self.qn.dtype, buffer=nl.psum)
        qT = nl.ndarray((P, DTP, 2, P), dtype=self.qn.dtype, buffer=nl.sbuf)
        for ct in range(DTP):
            csz = min(P, DP - ct * P)
            for j in (0, 1):
                nisa.nc_transpose(dst=tq[0:csz, ct, j, 0:width],
                                  data=qx[0:width, j, ct * P:ct * P + csz],
                                  engine=nisa.engine.tensor)
            nisa.tensor_copy(dst=qT[0:csz, ct, :, 0:width], src=tq[0:csz, ct, :, 0:width],
                             engine=nisa.engine.vector)
        return qT

    def finish(self, it, groups):
        for grp in groups:
            if grp.stored:
                continue
            sm = grp.sm
            if grp.psm is not None and grp.psm.started:   # (no tile packed: nothing to fold)
                cfg = self.cfg
                # the program's last item: o and l stay in the fold's PSUM, which the output
                # division reads (no copy to SBUF)
                ctx = grp.fold or fold_weights(grp.sm, grp.psm, cfg.nslot, cfg.W, grp.rows)
                fold_apply(grp.sm, grp.psm, ctx, grp.rows, self.sel,
                           o_psum=it is self.final and it.n_parts == 1)
            if it.n_parts > 1 and it.part > 0:
                k = self.split.index(it)
                st = nl.ndarray((grp.rows, D_LATENT + 2), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_copy(dst=st[:, 0:D_LATENT], src=sm.o, engine=nisa.engine.gpsimd)
                nisa.tensor_copy(dst=st[:, D_LATENT:D_LATENT + 1], src=sm.mp[:, 0:1],
                                 engine=nisa.engine.gpsimd)
                nisa.tensor_copy(dst=st[:, D_LATENT + 1:D_LATENT + 2], src=sm.l,
                                 engine=nisa.engine.gpsimd)
                nisa.dma_copy(dst=self.parts[k, grp.g, 0:grp.rows, :], src=st)
            elif it.n_parts > 1:
                self.pending[(it.b, grp.g)] = grp        # merged after the barrier
            elif it is self.final:
                self.store_last(it, grp)
            else:
                self.store(it.b, grp)

    def store(self, b, grp):
        """``out = o / l`` (times v_mul in the same pass) and lse. The division goes first:
        VectorE's in-order queue would otherwise wait for ScalarE's log behind the next tiles'
        exponentials."""
        cfg = self.cfg
        o_sb = nl.ndarray((grp.rows, D_LATENT), dtype=cfg.out_dtype, buffer=nl.sbuf)
        l_sb = None
        if cfg.return_lse:
            l_sb = nl.ndarray((grp.rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        grp.sm.finalize(o_sb, l_sb, cfg.v_mul if cfg.v_mul != 1.0 else None)
        nisa.dma_copy(dst=self._rows(self.out, b, grp), src=o_sb)
        if l_sb is not None:
            nisa.dma_copy(dst=self._rows(self.lse, b, grp), src=l_sb)

    def store_last(self, it, grp, O=None, alpha=None, o_a=None):
        """The program's last item: lse and its store first, then ``out = (o alpha + O) / l``
        (``finalize_last``: the update an add to ScalarE's ``o alpha``; or, O None, o final
        already: packed slots folded), the division split by columns over VectorE and ScalarE
        into one tile (packed: on VectorE, from the fold's PSUM), one store. With a last update
        (O given) lse needs only m and l, final before that PV lands. With o final (the fold's
        PSUM) l lands with o, and lse runs on ScalarE alone (log, then ``+ m`` as the bias of
        an activation): its VectorE half had waited there for the log and held the division
        back; stored after o, its store queued behind o's on the same DMA queues."""
        cfg = self.cfg
        if cfg.return_lse:
            if O is None:
                # packed (rows <= W = 32 / 64): written W partitions down (a quadrant / half
                # shift), so that its store runs on other DMA queues than o's (queue k serves
                # partitions 8k..8k+7)
                sh = cfg.W if cfg.W + grp.rows <= P else 0
                lt = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                l_sb = lt[sh:sh + grp.rows, :]
                grp.sm.lse(l_sb, add_engine="scalar")
            else:
                l_sb = nl.ndarray((grp.rows, 1), dtype=nl.float32, buffer=nl.sbuf)
                grp.sm.lse(l_sb)
            nisa.dma_copy(dst=self._rows(self.lse, it.b, grp), src=l_sb)
        o_sb = nl.ndarray((grp.rows, D_LATENT), dtype=cfg.out_dtype, buffer=nl.sbuf)
        h = D_LATENT // 2
        outs = [(o_sb[:, 0:h], 0, h, "vector"), (o_sb[:, h:D_LATENT], h, D_LATENT, "scalar")]
        if grp.psm is not None:
            # o in the fold's PSUM (finish): the halves would read one PSUM bank, which VectorE
            # and ScalarE do not share at once; VectorE alone (modeled 0.1 us faster)
            outs = [(o_sb, 0, D_LATENT, "vector")]
        grp.sm.finalize_last(O, alpha, outs, cfg.v_mul if cfg.v_mul != 1.0 else None, o_a)
        nisa.dma_copy(dst=self._rows(self.out, it.b, grp), src=o_sb)
        grp.stored = True

    def _rows(self, t, b, grp):
        """Row group ``grp``'s rows of sequence ``b`` of ``out`` ([B, s_q, H, 512]) or ``lse``
        ([B, s_q, H]) as ``[rows, 512]`` / ``[rows, 1]``."""
        w = D_LATENT if t is self.out else 1
        return t[b].reshape((self.cfg.rows, w))[grp.r0:grp.r0 + grp.rows, :]

    def merge_owned(self, owned):
        for it in owned:
            for g in range(self.cfg.n_groups):
                grp = self.pending.pop((it.b, g))
                for k, other in enumerate(self.split):
                    if other.b != it.b:
                        continue
                    st = nl.ndarray((grp.rows, D_LATENT + 2), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(dst=st, src=self.parts[k, g, 0:grp.rows, :])
                    merge_states_sb(grp.sm, st[:, 0:D_LATENT], st[:, D_LATENT:D_LATENT + 1],
                                    st[:, D_LATENT + 1:D_LATENT + 2])
                self.store(it.b, grp)

    # -- per-token FP8 scales ---------------------------------------------------------------------
    def load_scales(self, it, k0, n, bt_sb):
        """The per-token scales of keys ``[k0, k0 + n)`` as ``s [128, T]`` fp32 (key ``k0 + p T +
        t`` at ``[p, t]``, the latent tile's layout) by the latent's own loaders: one DMA
        (contiguous) or one per page through the same block-table entries (paged); the partial
        partition's tail zeroed, nothing past the sequence's end read."""
        lay = self.lay
        sl = KVLayout(lay.paged, lay.block_size, 1, 1, lay.T)        # one fp32 per token
        s = nl.ndarray((P, lay.T), dtype=nl.float32, buffer=nl.sbuf)            # [128, T]
        ks = self.ks.reshape((self.ks.shape[0], self.ks.shape[1], 1, 1))
        s4 = s.reshape((P, lay.T, 1, 1))
        if lay.paged:
            load_kv_tile_pages([(s4, ks, True)], sl, it.b, k0, n, bt_sb,
                               it.k0 // lay.block_size)
        else:
            load_kv_tile(s4, ks, sl, it.b, k0, n, zero_tail=True)
        return s

    def dequant(self, tile):
        """``C[p, t, :] <- bf16(C[p, t, :] * s[p, t])``: one pass per token slice with the
        slice's scales as a per-partition operand, a share ``deq_act`` of them on ScalarE (the
        rest on VectorE, whose FP8 -> bf16 pass is 4x fast on Trn3). The partial partition's
        tail is zero in both tiles; partitions past the last key are not touched."""
        T = self.lay.T
        npp = -(-tile.n // T)
        cb = nl.ndarray((P, T, 1, D_QK), dtype=nl.bfloat16, buffer=nl.sbuf)   # [128, T, 576]
        f = self.cfg.deq_act
        for t in range(T):
            i = self.n_deq
            self.n_deq += 1
            act = int((i + 1) * f + 1e-9) > int(i * f + 1e-9)
            eng = nisa.engine.scalar if act else nisa.engine.vector
            if tile.s is None:             # per-tensor: a cast (every FP8 value is a bf16 value)
                nisa.tensor_copy(dst=cb[0:npp, t, 0, :], src=tile.c[0:npp, t, 0, :], engine=eng)
            else:
                nisa.tensor_scalar(dst=cb[0:npp, t, 0, :], data=tile.c[0:npp, t, 0, :],
                                   op0=nl.multiply, operand0=tile.s[0:npp, t:t + 1], engine=eng)
        tile.c, tile.s, tile.raw = cb, None, False

    # -- stages ---------------------------------------------------------------------------------
    def stage_kT(self, tile, n, packed=False):
        """K^T of the whole 576-wide latent tile, ``[576 (5 chunks), 128 T]``, key order restored
        on eviction (column p T + t comes from transpose t of partition p); packed tiles keep the
        slice order (column t 128 + p: each slot's slices are one contiguous run). FP8 used as
        stored (per-tensor scale): by matmul with the identity (fp32 PSUM, bf16 on Trn3), the
        partial partition's tail zeroed at load (packed: as dim pairs, ``_kT_pairs``);
        per-token tiles arrive here as bf16."""
        lay = self.lay
        T = lay.T
        npp = -(-n // T)
        ncol = npp * T
        c = tile.c
        if self.pairs:
            yield from self._kT_pairs(tile, npp, ncol, packed)
            return
        kT = nl.ndarray((P, DT, lay.tile_keys), dtype=nl.bfloat16, buffer=nl.sbuf)  # [576, 128T]
        # FP8: bf16 PSUM where the target has it (Trn3; e4m3fn values are bf16 values: exact)
        tp_dt = (nl.bfloat16 if nisa.get_nc_version() >= 4 else nl.float32) if self.kt_fp8 \
            else c.dtype
        grpn = TR_GROUP // 2 if tp_dt is nl.float32 else TR_GROUP
        for dt in range(DT):
            dsz = min(P, D_QK - dt * P)
            for t0 in range(0, T, grpn):
                t1 = min(T, t0 + grpn)
                tp = nl.ndarray((P, t1 - t0, P), dtype=tp_dt, buffer=nl.psum)
                for t in range(t0, t1):
                    src = c[0:npp, t, 0, dt * P:dt * P + dsz]
                    if self.kt_fp8 or (packed and self.bg_transpose and t in KT_MM_SLICES):
                        nisa.nc_matmul(dst=tp[0:dsz, t - t0, 0:npp], stationary=src,
                                       moving=self.ident[0:npp, 0:npp])
                    else:
                        nisa.nc_transpose(dst=tp[0:dsz, t - t0, 0:npp], data=src,
                                          engine=nisa.engine.tensor)
                    yield
                self._evict_kT(kT, dt, dsz, t0, t1, tp, npp, ncol, packed)
        tile.kT = kT

    def _kT_pairs(self, tile, npp, ncol, packed):
        """FP8 K^T as dim pairs, ``[288 pairs (3 chunks), 128 T]`` bf16 (each element the FP8
        dims ``2i, 2i + 1`` of one key): TensorE transposes of the tile viewed as bf16, evicted
        in key order (row layout) or slice order (packed), as ``stage_kT``."""
        lay = self.lay
        T = lay.T
        c16 = tile.c.view(nl.bfloat16)                                  # [128, T, 1, 288]
        kT = nl.ndarray((P, DTP, lay.tile_keys), dtype=nl.bfloat16, buffer=nl.sbuf)
        for ct in range(DTP):
            csz = min(P, DP - ct * P)
            for t0 in range(0, T, TR_GROUP):
                t1 = min(T, t0 + TR_GROUP)
                tp = nl.ndarray((P, t1 - t0, P), dtype=nl.bfloat16, buffer=nl.psum)
                for t in range(t0, t1):
                    nisa.nc_transpose(dst=tp[0:csz, t - t0, 0:npp],
                                      data=c16[0:npp, t, 0, ct * P:ct * P + csz],
                                      engine=nisa.engine.tensor)
                    yield
                self._evict_kT(kT, ct, csz, t0, t1, tp, npp, ncol, packed)
        tile.kT = kT

    def _evict_kT(self, kT, ck, sz, t0, t1, tp, npp, ncol, packed):
        """Transposes ``t0..t1`` of K^T chunk ``ck`` (``tp [sz, t1 - t0, 128]`` in PSUM) into
        ``kT``: in slice order (packed: column t 128 + p) or key order (column p T + t)."""
        if packed:
            dstv = kT[0:sz, ck, t0 * P:t1 * P].reshape_dim(1, (t1 - t0, P))
            self._evict(dstv, tp[0:sz, :, :])
        else:
            dstv = kT[0:sz, ck, 0:ncol].reshape_dim(1, (npp, self.lay.T))[:, :, t0:t1]
            self._evict(dstv.permute((0, 2, 1)), tp[0:sz, :, 0:npp])

    def _qk_passes(self, grp, kT, r0, W, c0, c1):
        """The contraction passes of ``S[r0:r0+W, c0:c1]``: ``(stationary, moving)`` per pass,
        5 chunks of the 576 dims, or (dim pairs) an even and an odd pass per chunk of pairs."""
        if self.pairs:
            k8 = kT.view(self.kv.dtype)                                   # [pairs, 3, 2 keys]
            for ct in range(DTP):
                csz = min(P, DP - ct * P)
                for j in (0, 1):
                    yield grp.qT[0:csz, ct, j, r0:r0 + W], k8[0:csz, ct, 2 * c0 + j:2 * c1:2]
            return
        for dt in range(DT):
            dsz = min(P, D_QK - dt * P)
            yield grp.qT[0:dsz, dt, r0:r0 + W], kT[0:dsz, dt, c0:c1]

    def stage_softmax(self, job):
        """S = Q^T.T K^T (5 accumulating matmuls per 512 keys, 6 with dim pairs); X = qk_mul S out
        of PSUM with the row max fused (masked where the tile needs it); online-softmax max /
        exp / sums."""
        cfg, lay = self.cfg, self.lay
        grp, ncol, k0 = job.grp, job.ncol, job.k0
        rows = grp.rows
        kT = job.tile.kT
        S = nl.ndarray((P, lay.tile_keys), dtype=nl.float32, buffer=nl.psum)      # [rows, 128T]
        for c0 in range(0, ncol, MM_N):
            c1 = min(ncol, c0 + MM_N)
            for k, (st, mv) in enumerate(self._qk_passes(grp, kT, 0, rows, c0, c1)):
                nisa.nc_matmul(dst=S[0:rows, c0:c1], stationary=st, moving=mv, accumulate=k > 0)
                yield
        sm = grp.sm
        L = cfg.seq_lens[job.it.b]
        X = nl.ndarray((rows, lay.tile_keys), dtype=nl.float32, buffer=nl.sbuf)
        Xv = X[:, 0:ncol]
        # keys before the first draft's diagonal: one fused pass; the tail masked
        full = max(0, min(ncol, L - cfg.s_q + 1 - k0))
        scale_mask_max(X, S, cfg.qk_mul, grp.rt[0:rows, C_LO:C_LO + 1],
                       grp.rt[0:rows, C_HI:C_HI + 1], k0, ncol, full, sm.max_slot)
        Pm = nl.ndarray((rows, lay.tile_keys), dtype=nl.bfloat16, buffer=nl.sbuf)  # [rows, 128T]
        job.alpha = sm.exp_block(Pm[:, 0:ncol], Xv, defer_sum=True)
        job.Pm = Pm

    def stage_pT(self, job):
        """P^T: key p T + t on partition p of slice t (TensorE transposes, evicted to SBUF);
        yields between the transposes of a PSUM buffer."""
        T = self.lay.T
        npp, ncol, rows = job.npp, job.ncol, job.grp.rows
        pT = nl.ndarray((P, T, P), dtype=nl.bfloat16, buffer=nl.sbuf)             # [keys, T, rows]
        pv = job.Pm[:, 0:ncol].reshape_dim(1, (npp, T))
        for t0 in range(0, T, TR_GROUP):
            t1 = min(T, t0 + TR_GROUP)
            tp = nl.ndarray((P, t1 - t0, P), dtype=nl.bfloat16, buffer=nl.psum)
            for t in range(t0, t1):
                nisa.nc_transpose(dst=tp[0:npp, t - t0, 0:rows], data=pv[:, :, t],
                                  engine=nisa.engine.tensor)
                if t < t1 - 1:
                    yield
            self._evict(pT[0:npp, t0:t1, 0:rows], tp[0:npp, :, 0:rows])
        job.Pm = None
        job.pT = pT

    def stage_pv(self, job):
        """O = sum_t P^T[t].T @ C[:, t, 0:512] (V = the latent's first 512 columns, the tile
        already in SBUF), then o = alpha o + O."""
        T = self.lay.T
        rows, n = job.grp.rows, job.n
        sm = job.grp.sm
        # the program's last tile, its rows going straight to `out` (no split part, no packed
        # slots): the kernel ends with its o update, division and store (store_last)
        last = (job.it is self.final and job.k0 + n >= job.it.k1 and job.it.n_parts == 1
                and job.grp.psm is None)
        o_a = sm.prescale_o(job.alpha) if last else None
        O = nl.ndarray((P, D_LATENT), dtype=nl.float32, buffer=nl.psum)            # [rows, 512]
        first = True
        for t in range(T):
            kp = -(-(n - t) // T)             # partitions whose slot t holds a valid key
            if kp <= 0:
                continue
            nisa.nc_matmul(dst=O[0:rows, :], stationary=job.pT[0:kp, t, 0:rows],
                           moving=job.tile.c[0:kp, t, 0, 0:D_LATENT], accumulate=not first)
            first = False
            yield
        job.pT = None
        sm.flush_sum()                  # the deferred l update (decode_attention's reason)
        if last:
            self.store_last(job.it, job.grp, O[0:rows, :], job.alpha, o_a)
        else:
            sm.accumulate_o(O[0:rows, :], job.alpha, mode="stt", copy_engine="vector")

    # -- packed tiles (few rows: nslot PE column tiles side by side) -----------------------------
    def stage_softmax_packed(self, job):
        """Slot s scores its slices ``[s Ts, (s + 1) Ts)`` of a full tile against the rows
        repeated in its PE column tile: ``S[s W + r, c]``, column ``tt 128 + p`` key ``p T + s Ts
        + tt``. No mask, except on a sequence's last tile when the drafts' diagonal cuts it
        (s_q > 1): a row of draft i sees keys up to ``n - s_q + i``, which in slice t are the
        partitions ``p <= (n - s_q + i - t) / T``, a prefix: one ``range_select`` per slice,
        bounds from the row table (``row_table``)."""
        cfg = self.cfg
        W, Ts, kT = cfg.W, cfg.Ts, job.tile.kT
        grp = job.grp
        ncol = Ts * P
        S = nl.ndarray((P, ncol), dtype=nl.float32, buffer=nl.psum)              # [slots, Ts 128]
        # Trn2: at most one fp32 PSUM bank (512 columns) per matmul (2 slots of a T = 16 FP8
        # tile score 1024 columns each); Trn3 takes up to 4096 (nki-spec 9.1.1)
        mm_n = ncol if nisa.get_nc_version() >= 4 else MM_N
        for c0 in range(0, ncol, mm_n):
            c1 = min(ncol, c0 + mm_n)
            passes = [list(self._qk_passes(grp, kT, s * W, W, s * ncol + c0, s * ncol + c1))
                      for s in range(cfg.nslot)]
            for k in range(len(passes[0])):
                for s in range(cfg.nslot):           # slots innermost: their matmuls overlap
                    r0 = s * W
                    st, mv = passes[s][k]
                    nisa.nc_matmul(dst=S[r0:r0 + W, c0:c1], stationary=st, moving=mv,
                                   accumulate=k > 0, tile_position=(0, r0), tile_size=(P, W))
                yield
        sm = grp.psm
        X = nl.ndarray((P, ncol), dtype=nl.float32, buffer=nl.sbuf)
        if job.masked:
            for tt in range(Ts):
                Xt = X[:, tt * P:(tt + 1) * P]
                # the scale on ScalarE (idle at a sequence's end), the mask on VectorE
                nisa.activation(dst=Xt, op=nl.copy, data=S[:, tt * P:(tt + 1) * P],
                                scale=cfg.qk_mul)
                mask_range_select(Xt, Xt, grp.rt[:, C_LO:C_LO + 1],
                                  grp.rt[:, NCOL + tt:NCOL + tt + 1], 0,
                                  reduce_res=sm.max_slot())
        else:
            nisa.tensor_scalar_reduce(dst=X, data=S, op0=nl.multiply, operand0=cfg.qk_mul,
                                      reduce_op=nl.maximum, reduce_res=sm.max_slot())
        Pm = nl.ndarray((P, ncol), dtype=nl.bfloat16, buffer=nl.sbuf)           # [slots, Ts 128]
        # Trn3: VectorE exponentials (4x ScalarE's rate)
        job.alpha = sm.exp_block(Pm, X, defer_sum=True,
                                 engine="vector" if self.bg_transpose else "scalar")
        job.Pm = Pm

    def stage_pT_packed(self, job):
        """P^T of all slots at once: one 128 x 128 transpose per slice of a slot."""
        job.pT = transpose_slots(job.Pm, self.cfg.Ts, self._evict)
        job.Pm = None

    def stage_pv_packed(self, job):
        """O[s W + r] = sum over slot s's slices of P^T.T @ C[:, t, 0:512] (PE column tiles)."""
        cfg = self.cfg
        W, Ts = cfg.W, cfg.Ts
        O = nl.ndarray((P, D_LATENT), dtype=nl.float32, buffer=nl.psum)            # [slots, 512]
        for tt in range(Ts):
            for s in range(cfg.nslot):
                r0 = s * W
                nisa.nc_matmul(dst=O[r0:r0 + W, :], stationary=job.pT[:, tt, r0:r0 + W],
                               moving=job.tile.c[:, s * Ts + tt, 0, 0:D_LATENT],
                               accumulate=tt > 0, tile_position=(0, r0), tile_size=(P, W))
            yield
        job.pT = None
        grp = job.grp
        if job.it is self.final and job.k0 + job.n >= job.it.k1 and not grp.sm.started:
            # the program's last tile, packed: the fold's weights need only the final maxima,
            # so they go ahead of this tile's o update (VectorE's in-order queue; for earlier
            # items VectorE has the next tiles' work to do, and this order was slower)
            cfg = self.cfg
            grp.fold = fold_weights(grp.sm, grp.psm, cfg.nslot, cfg.W, grp.rows)
        job.grp.psm.flush_sum()         # the deferred l update (decode_attention's reason)
        # Trn3: o alpha on ScalarE, the PSUM add on VectorE (which now runs the exponentials)
        tail = job.it is self.final and job.k0 + (STT_TAIL + 1) * self.lay.tile_keys > job.it.k1
        mode = "split" if self.bg_transpose and not tail else "stt"
        job.grp.psm.accumulate_o(O, job.alpha, mode=mode, copy_engine="vector")

    def _evict(self, dst, src):
        """PSUM -> SBUF copies spread over ScalarE (share EVICT_ACT) and VectorE (which also
        takes the score evictions and the accumulator updates)."""
        i = self.n_evict
        f = self.cfg.evict_act[self.cfg.nslot > 1]
        act = int((i + 1) * f + 1e-9) > int(i * f + 1e-9)
        self.n_evict += 1
        nisa.tensor_copy(dst=dst, src=src,
                         engine=nisa.engine.scalar if act else nisa.engine.vector)


# ---------------------------------------------------------------------------------------- op
OP = "mla_decode"
_FP8 = {3: "float8_e4m3", 4: "float8_e4m3fn"}
# Per-token FP8, per generation and (row layout, packed slots): the share of the SBUF
# dequantization passes (one per token slice) on ScalarE, the rest on VectorE (Trn3's VectorE
# converts FP8 -> bf16 in its 4x mode, 4x ScalarE's rate; Trn2's has no fast FP8 mode), and the
# ScalarE share of the PSUM evictions (EVICT_ACT's role; the dequantization moves the balance).
# Modeled, DeepSeek-V3 L=32K, H=128 / H=16 (us), (eviction share, dequantization share):
# Trn3 row (0.75, 0) 172.7, (0.75, 0.375) 165.9, (0.9, 0.25) 161.5, (1, 0.25) 159.9, (1, 0.125)
# 156.1, (1, 0) 158.4; packed (0.6, 0.375) 147.5, (0.8, 0.25) 145.3, (0.9, 0.25) 150.4;
# Trn2 row (0.75, 0.5) 249.4, (0.6, 0.625) 242.5, (0.5, 0.75) 236.7, (0.45, 0.75) 239.7,
# (0.5, 0.875) 242.3; packed (0.6, 0.75) 223.2, (0.5, 0.75) 226.9, (0.6, 0.875) 234.0.
# With P^T woven into PV on Trn3 (2026-11-28), H=128 per-tensor FP8 L=32K at (eviction share,
# dequantization share): (0.6, 0.125) 143.6, (0.7, 0.125) 140.3, (0.75, 0.125) 142.4, (0.8, 0.125)
# 144.4, (1, 0.125) 148.5, (0.7, 0) 143.5, (0.7, 0.25) 143.4.
# Packed on Trn3 re-tuned 2026-11-29 (TP8 H=16 B=1 L=32K, ScalarE-bound at (0.8, 0.25)
# 115.3 us, 31 us of it dequantization at ScalarE's 1x FP8 rate): (0.8, 0.125) 103.6, (0.8, 0)
# 103.2, (0.9, 0) 100.7, (0.85, 0) 100.4; B=128 L=4K paged/64 146.8 -> 140.2.
DEQ_ACT = {3: (0.75, 0.75), 4: (0.125, 0.0)}
TOK_EVICT_ACT = {3: (0.5, 0.6), 4: (0.7, 0.85)}


def _per_token(x) -> bool:
    """``kv_scale`` given as an array of per-token scales (2-D, or more than one value)."""
    shp = getattr(x, "shape", None)
    if shp is None and isinstance(x, (list, tuple)):
        shp = np.shape(x)
    return shp is not None and (len(shp) >= 2 or int(np.prod(shp)) > 1)


def _positive(name, x):
    if is_torch(x):
        x = x.detach().float().cpu().numpy()
    a = np.asarray(x, dtype=np.float64) if not isinstance(x, bool) else None
    if a is None or a.size != 1 or not np.isfinite(a).all() or float(a.reshape(-1)[0]) <= 0:
        raise ValueError(f"{OP}: {name} must be a finite scalar > 0; got {x!r}")
    return float(a.reshape(-1)[0])


def mla_decode(q_nope, q_rope, kv_cache, seq_lens, *, block_table=None, scale, kv_scale=None,
               return_lse=True, lnc=1):
    """Absorbed multi-head latent attention for decode (DeepSeek-V3 / Kimi-K2).

    Args:
      q_nope: [B, s_q, H, 512] bfloat16: the no-RoPE query part already multiplied by the
         absorbed W_UK (per head ``q_nope_h @ W_UK_h``, latent space). s_q in 1..4 (draft i sees
         the cache and drafts 0..i); H any (128 on one device, 16 / 32 under TP8 / TP4).
      q_rope: [B, s_q, H, 64] bfloat16, RoPE applied.
      kv_cache: contiguous [B, S_max, 576] or paged [num_blocks, block_size, 576] (with
         ``block_table``): per token ``[c_kv (512) | k_rope (64)]``, RoPE applied to k_rope;
         bfloat16, or FP8 (float8_e4m3 on Trn2, float8_e4m3fn on Trn3) with ``kv_scale``.
      seq_lens: [B] host integers: tokens per sequence counting the s_q new ones (already in the
         cache); 0 = an empty slot (output 0, lse -inf).
      block_table: [B, max_blocks] int32; logical block n of sequence b is physical block
         ``block_table[b, n]``; entries past a sequence's end are never read. Block sizes 8-256.
      scale: softmax scale (required: DeepSeek uses ``1/sqrt(192)`` times the YaRN mscale^2).
      kv_scale: FP8 caches only: the dequantization scale, either per tensor (a positive
         scalar) or per token: float32 ``[num_blocks, block_size]`` (paged) or ``[B, S_max]``
         (contiguous), one scale per cache slot (the cache's leading dims); latent row t
         dequantizes as ``float(c[t]) * kv_scale[t]`` for K (576) and V (512). Per-token tiles are
         dequantized to bf16 in SBUF. Slots past a sequence's end are never read.
      return_lse: also return lse [B, s_q, H] float32 (natural log, of the scaled logits).
      lnc: 1, or 2 to split the work (long sequences: their keys) over both cores.
    Returns:
      o [B, s_q, H, 512] bfloat16 (the caller applies W_UV), and lse when ``return_lse``.
    """
    gen = check_target(OP)
    for name, t, w in (("q_nope", q_nope, D_LATENT), ("q_rope", q_rope, D_ROPE)):
        shp = getattr(t, "shape", None)
        if shp is None or len(shp) != 4 or int(shp[3]) != w:
            raise ValueError(f"{OP}: {name} must be [B, s_q, H, {w}]; got shape {shp}")
    B, s_q, H, _ = (int(x) for x in q_nope.shape)
    if tuple(int(x) for x in q_rope.shape[:3]) != (B, s_q, H):
        raise ValueError(f"{OP}: q_rope must be [B={B}, s_q={s_q}, H={H}, 64] like q_nope; got "
                         f"{tuple(q_rope.shape)}")
    if not 1 <= s_q <= MAX_S_Q:
        raise ValueError(f"{OP}: s_q (new tokens per sequence) must be 1 to {MAX_S_Q}; got {s_q}")
    if B < 1 or H < 1:
        raise ValueError(f"{OP}: B and H must be >= 1; got B={B}, H={H}")
    for name, t in (("q_nope", q_nope), ("q_rope", q_rope)):
        if dtype_name(t) != "bfloat16":
            raise TypeError(f"{OP}: {name}.dtype must be bfloat16; got {dtype_name(t)}")
    shp = getattr(kv_cache, "shape", None)
    if shp is None or len(shp) != 3 or int(shp[2]) != D_QK:
        raise ValueError(f"{OP}: kv_cache must be [B, S_max, {D_QK}] or [num_blocks, block_size, "
                         f"{D_QK}] (512 latent + 64 rope); got shape {shp}")
    kn = dtype_name(kv_cache)
    fp8 = _FP8.get(gen, _FP8[4])
    if kn not in ("bfloat16", fp8):
        raise TypeError(f"{OP}: kv_cache.dtype must be bfloat16 or {fp8} (FP8 on this target); "
                        f"got {kn}")
    is_fp8 = kn == fp8
    tok = is_fp8 and _per_token(kv_scale)
    if is_fp8:
        if kv_scale is None:
            raise ValueError(f"{OP}: an FP8 kv_cache needs kv_scale (the per-tensor dequantization "
                             f"scale, or per-token scales); got None")
        kvs = 1.0 if tok else _positive("kv_scale", kv_scale)
    else:
        if kv_scale is not None:
            what = "per-token " if _per_token(kv_scale) else ""
            raise ValueError(f"{OP}: {what}kv_scale applies to FP8 caches only; the cache is {kn}")
        kvs = 1.0
    scale = _positive("scale", scale)
    if isinstance(return_lse, (bool, np.bool_)) is False:
        raise TypeError(f"{OP}: return_lse must be a bool; got {return_lse!r}")
    check_lnc(OP, lnc)
    N0, S1 = int(shp[0]), int(shp[1])
    sl = check_decode_lens(OP, seq_lens, B, s_q)
    bt = bs = None
    if block_table is None:
        if N0 != B:
            raise ValueError(f"{OP}: a contiguous kv_cache must be [B={B}, S_max, 576]; got "
                             f"{tuple(shp)} (pass block_table for a paged cache)")
        if sl.max(initial=0) > S1:
            raise ValueError(f"{OP}: seq_lens up to {int(sl.max())} exceed the cache's S_max = {S1}")
    else:
        bt, bs = check_block_table(OP, block_table, sl, shp, BLOCK_SIZES, "kv_cache")
    ks_tok = None
    if tok:
        dims = "[B, S_max]" if bt is None else "[num_blocks, block_size]"
        ks_tok = token_scales(OP, "kv_scale", kv_scale, (N0, S1), dims, sl, bt, bs)
    # per-tensor FP8 with more than 64 query rows (one row layout, TensorE binds): tiles cast to
    # bf16 in SBUF, so K^T takes the bf16 transposes instead of identity matmuls (DeepSeek-V3
    # H=128 L=32K, Trn3 modeled: see docs/attention.md); fewer rows keep FP8 as stored
    deq = is_fp8 and not tok and s_q * H > 64
    # tiles dequantized to bf16 in SBUF: the bf16 tile geometry (SBUF room)
    dq = tok or deq
    T = tokens_per_partition(1, D_QK, 1 if is_fp8 and not dq else 2, bs,
                             max_len=int(sl.max(initial=1)))
    lay = KVLayout(bt is not None, bs or 0, 1, D_QK, T)
    items = plan_split_kv([int(x) for x in sl], lay.tile_keys, lnc, s_q=s_q)
    W, nslot = slots(s_q * H, T)
    plan = MLAPlan(B=B, s_q=s_q, H=H, layout=lay, seq_lens=tuple(int(x) for x in sl), items=items,
                   qk_mul=scale * kvs, v_mul=kvs, return_lse=bool(return_lse),
                   out_dtype=nl.bfloat16, W=W, nslot=nslot, tok_scale=bool(tok), deq_cast=deq,
                   deq_act=DEQ_ACT[gen][nslot > 1] if dq else 0.0,
                   evict_act=TOK_EVICT_ACT[gen] if dq else EVICT_ACT[gen])
    rowtab = row_table(plan)
    extra = (ks_tok,) if tok else ()
    res = launch(mla_decode_kernel, q_nope, q_rope, kv_cache, bt, rowtab, plan, *extra, lnc=lnc)
    return tuple(res) if return_lse else res


def slots(rows: int, T: int):
    """``(W, nslot)``: query rows per PE column tile and tiles side by side. Up to 32 rows: 4
    slots of 32, up to 64: 2 of 64 (when a tile's T slices split evenly), else one layout."""
    for w in (32, 64):
        if rows <= w and T % (P // w) == 0:
            return w, P // w
    return P, 1


def row_table(plan: MLAPlan):
    """Per query row (``i H + h``) of every (sequence, row group): first visible key (-1: no
    window) and last (``L - s_q + i``), fp32 ``[B, n_groups, 128, 2]``; unused rows see none.
    Packed plans with drafts (``masked_packed``, one row group) add ``Ts`` columns for the
    masked packed tile (a sequence's last, full, cut by the drafts' diagonal): on slot row
    ``s W + r`` (draft ``i = r // H``), column ``2 + tt`` is the last partition whose key in
    slice ``t = s Ts + tt`` the row sees, ``floor((128 T - s_q + i - t) / T)``; padding rows
    (``r >= rows``) see all."""
    ncol = NCOL + (plan.Ts if plan.masked_packed else 0)
    tab = np.full((plan.B, plan.n_groups, P, ncol), -1.0, dtype=np.float32)
    r = np.arange(plan.rows)
    for b, L in enumerate(plan.seq_lens):
        hi = (L - plan.s_q + r // plan.H).astype(np.float32)
        flat = tab[b].reshape(plan.n_groups * P, ncol)
        flat[0:plan.rows, C_HI] = hi
    if plan.masked_packed:
        T, Ts, W = plan.layout.T, plan.Ts, plan.W
        q = np.arange(P)
        s, rr = q // W, q % W
        for tt in range(Ts):
            t = s * Ts + tt
            bound = (P * T - plan.s_q + rr // plan.H - t) // T
            tab[:, 0, :, NCOL + tt] = np.where(rr < plan.rows, bound, P).astype(np.float32)
    return tab


__all__ = ["mla_decode", "mla_decode_kernel", "MLAPlan", "row_table"]
