"""Flash attention for prefill: ``O = softmax(scale * Q K^T + mask) V`` with an online softmax.

Causal (whole-tile skipping) and non-causal, ``S_q <= S_kv`` with the diagonal aligned to the end,
GQA/MQA without replicating K/V, left sliding window, logit soft-capping, attention sinks, head_dim
64/128/192/256, any sequence length, optional log-sum-exp output. Design note: docs/attention.md.

Per 128 query rows x 2048-key block (two 1024-key score halves), Trn3 first:

* TensorE: ``S = Q K^T`` (one 1024-wide matmul per half on Trn3, 512-wide on Trn2), P^T
  transposes woven between the PV matmuls (Trn3 background transposes then cost no TensorE
  time), ``O += P^T.T @ [V | 1]`` (the ones column carries the softmax row sum);
* Trn3: each score half leaves PSUM through ScalarE (``activate2``) and VectorE
  (``tensor_scalar_reduce``) in parallel, one bank each, scaled on the way out with the row max
  fused; VectorE's ``exponential`` (4x ScalarE) makes P;
* Trn2: VectorE evicts every score with its row max, ScalarE's exp applies the scale;
* half of the P^T (3/4 on Trn2) comes from SBUF->SBUF DMA transposes: no TensorE time, no PSUM
  eviction (the exp and transpose ceilings: docs/attention.md);
* the four stages of consecutive blocks are software-pipelined so that every engine's in-order
  queue holds independent work; PSUM buffers are allocated once and rotated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._limits import P, sbuf_budget
from .._validate import array_like, check_flag, check_lnc, check_no_grad, check_target
from .._validate import dtype_name as _dtype_name
from ..backend import launch, lnc_programs, nisa, nki, nl
from .masks import FP32_MIN, MaskSpec, mask_range_select, row_bounds
from .schedule import Segment, assign_programs, gqa_heads, kv_chunks, prefill_units
from .softmax import SoftmaxState

HEAD_DIMS = (64, 128, 192, 256)
QB = 8             # q-tiles per Q^T DMA transpose and per output DMA (1024 rows)
Q_PREFETCH = 2     # Q^T batches loaded ahead of use (DMA queues are shared with P^T transposes)
KV_PIECE = 8       # 128-key tiles per K^T / V load DMA (the first blocks start before the rest lands)
BANK_COLS = 512    # fp32 columns per 2 KiB PSUM bank: ScalarE and VectorE split S at bank boundaries
HALF = 1024        # keys per score buffer (2 PSUM banks of fp32)
S_BUFS = 3         # score buffers in rotation (2 for d = 256): the PSUM layout is in _Chunk
TP_TILES = 4       # 128-key tiles per P^T PSUM buffer (1 KiB of bf16; 3 tiles for d <= 128):
                   # transposes of the next group do not wait for the eviction of the previous


@dataclass(frozen=True)
class FlashAttentionPlan(nl.NKIObject):
    """Everything the kernel needs besides the tensors (all compile-time values).

    kb: keys per online-softmax block (one max/rescale/O update per block): 2048, computed as
      two 1024-key halves in a ring of fp32 PSUM score buffers, beside rotating P^T and PV
      buffers: the 8 banks (layout in ``_Chunk``). PSUM buffers are allocated once per KV chunk
      and reused, so write-after-read hazards between a block's QK^T and an older block's
      softmax are real dependencies (no PSUM counted twice).
    chunk: keys of K^T / V kept resident in SBUF per pass (the whole sequence when it fits;
      otherwise the softmax state goes through HBM between chunks).
    mm_n: moving free size per QK^T matmul (512 on Trn2, 1024 on Trn3).
    exp_engine: "vector" (Trn3 exponential on pre-scaled scores) or "scalar" (ScalarE exp with
      the scale folded in).
    act_max_frac: share of the unmasked score columns evicted + max-reduced on ScalarE
      (activate2, Trn3), assigned per 512-column PSUM bank; the rest on VectorE.
    dma_tr_frac: share of 1024-key halves whose P^T is made by an SBUF->SBUF DMA transpose (no
      TensorE time, no PSUM eviction); the others use TensorE transposes + one eviction.
    evict_act: share of TensorE-transposed halves whose P^T eviction runs on ScalarE.
    o_update: "stt" (one VectorE op) or "split" (ScalarE rescale + VectorE PSUM add).
    x_sbuf: evict the scaled scores to SBUF in the max pass (frees the PSUM score buffer after
      one pass); otherwise (Trn2 only) ScalarE's exponential reads the raw scores from PSUM.
    lags: software-pipeline lags of the four stages (QK^T, softmax, P^T, PV): block j's PV is
      issued ``lags[3]`` steps after its QK^T, so every engine's in-order queue holds
      independent work and the DMA transposes' latency is hidden.
    """

    causal: bool
    window: int
    softcap: float
    scale: float
    has_sinks: bool
    return_lse: bool
    k_layout: str
    out_dtype: object
    kb: int
    chunk: int
    mm_n: int
    exp_engine: str
    act_max_frac: float
    dma_tr_frac: float
    evict_act: float
    o_update: str
    x_sbuf: bool
    lags: tuple
    v_scale: float = 0.0      # FP8 V (paged_attention): o = v_scale * softmax V; 0 = none
    # paged_attention's options (paged_attention.chunk_options; off here, so flash attention's
    # own instructions are unchanged):
    diag_bias: bool = False   # causal without window / soft-cap: the diagonal band's mask is
                              # one matmul (identity x a [rows, 256] bias tile of 0 / -big)
                              # accumulated onto the scores, so the whole block leaves PSUM in
                              # the fused scale + max pass (no scale pass, no range_select)
    final_psum: bool = False  # a q-tile with one block (and no sink) divides its PV result
                              # straight out of PSUM (no o copy to SBUF)
    te_tail: int = 0          # the chunk's last te_tail blocks make P^T on TensorE only (a DMA
                              # transpose's latency would stretch the kernel's end)

    @property
    def bias_mask(self) -> bool:
        return self.diag_bias and self.causal and not self.window and not self.softcap

    @property
    def xmul(self) -> float:
        """logit = xmul * X, X being what the exponential reads (see softmax.py)."""
        return 1.0 if (self.exp_engine == "vector" or self.softcap) else self.scale

    @property
    def x_scale(self) -> float:
        """X = x_scale * S when the scores are evicted to SBUF (no soft-cap): pre-scaled for the
        VectorE exponential, raw for ScalarE (whose activation applies the scale for free)."""
        return self.scale if self.exp_engine == "vector" else 1.0

    @property
    def scores_in_sbuf(self) -> bool:
        return self.x_sbuf or self.exp_engine == "vector" or bool(self.softcap)


def sbuf_bytes(plan: FlashAttentionPlan, d: int, in_bytes: int = 2) -> int:
    """Per-partition SBUF the kernel keeps live at its peak."""
    DT = -(-d // P)
    kv = DT * plan.chunk * in_bytes + -(-plan.chunk // P) * (d + 1) * in_bytes   # K^T, V_aug
    q = (Q_PREFETCH + 1) * DT * QB * P * in_bytes       # Q^T batches (current + prefetched)
    o = 2 * QB * (d * 2 + 4)                            # output + lse staging
    x = plan.kb * 4 if plan.scores_in_sbuf else 2 * 384 * 4
    depth = plan.lags[-1] + 1
    jobs = depth * (x + plan.kb * 2 + plan.kb * 2)     # X, P, P^T per block in flight
    units = 3 * ((d + 1) * 4 + 16 * 4)                   # softmax states in flight
    return kv + q + o + jobs + units + P * 2 * 2


# Tile choices per (target, regime), from the cost model on Llama-3-8B heads (d = 128, causal,
# one KV-head group; % of the BF16 TensorE peak):
#  trn3: ScalarE and VectorE each evict + max-reduce one PSUM bank of every score half (the
#        banks drain in parallel), VectorE runs the 4x exponential; P^T: half of the 1024-key
#        halves by SBUF->SBUF DMA transpose, the rest TensorE background transposes evicted by
#        ScalarE (S=8192: 70.7% vs 67.7% with a quarter by DMA). Short sequences
#        (S_kv <= 2048) are latency-bound and keep the DMA queues for the output stores: a
#        quarter by DMA (S=2048: 43.8% vs 42.4% at 1/2, 36.9% at 3/4).
#  trn2: VectorE evicts + max-reduces every score (raw units), ScalarE runs the exp with the
#        scale folded in; TensorE transposes are not background on Trn2, so 5/8 of P^T go by DMA
#        transpose (S=4096: 39.0% vs 38.2% at 1/2, 37.3% at 3/4), 1/2 for short sequences
#        (S=2048: 30.5% vs 26.6% at 0, 26.1% at 3/4).
_RECIPES = {
    "trn3": dict(mm_n=HALF, exp_engine="vector", act_max_frac=0.5, dma_tr_frac=0.5,
                 evict_act=1.0, o_update="split", x_sbuf=True, lags=(0, 1, 3, 5)),
    "trn2": dict(mm_n=BANK_COLS, exp_engine="scalar", act_max_frac=0.0, dma_tr_frac=0.625,
                 evict_act=1.0, o_update="stt", x_sbuf=True, lags=(0, 1, 3, 5)),
}
SHORT_KV = 2048
_SHORT = {"trn3": dict(dma_tr_frac=0.25), "trn2": dict(dma_tr_frac=0.5)}


def plan_flash_attention(gen: int, d: int, s_kv: int, *, causal, window, softcap, scale,
                         has_sinks, return_lse, k_layout, out_dtype, sbuf_budget,
                         in_bytes=2, **overrides) -> FlashAttentionPlan:
    """The plan for one call. ``overrides`` replace recipe fields (tuning, tests); ``chunk``
    forces the resident KV chunk (a multiple of 128)."""
    tname = "trn3" if gen >= 4 else "trn2"
    recipe = dict(_RECIPES[tname])
    if s_kv <= SHORT_KV:
        recipe.update(_SHORT[tname])
    recipe.update(overrides)
    kb = recipe.pop("kb", 2 * HALF)
    forced_chunk = recipe.pop("chunk", None)
    lags = tuple(recipe["lags"])
    if not (len(lags) == 4 and lags[0] == 0 and lags[1] == 1 and lags[1] < lags[2] < lags[3]):
        raise ValueError(f"flash_attention: lags must be (0, 1, a, b) with 1 < a < b (the score "
                         f"ring needs the softmax one step after QK^T); got {lags}")
    common = dict(causal=bool(causal), window=int(window or 0), softcap=float(softcap or 0.0),
                  scale=float(scale), has_sinks=bool(has_sinks), return_lse=bool(return_lse),
                  k_layout=k_layout, out_dtype=out_dtype, kb=kb)
    full = -(-s_kv // P) * P
    if forced_chunk is not None:
        if forced_chunk % P or forced_chunk <= 0:
            raise ValueError(f"flash_attention: chunk must be a positive multiple of {P}; "
                             f"got {forced_chunk}")
        return FlashAttentionPlan(chunk=min(forced_chunk, full), **common, **recipe)
    chunk = -(-s_kv // kb) * kb
    while True:
        plan = FlashAttentionPlan(chunk=min(chunk, full), **common, **recipe)
        if sbuf_bytes(plan, d, in_bytes) <= sbuf_budget or chunk <= kb:
            break
        chunk = max(kb, (chunk // 2) // kb * kb)
    if sbuf_bytes(plan, d, in_bytes) > sbuf_budget:
        raise ValueError(f"flash_attention: head_dim={d} does not fit SBUF "
                         f"({sbuf_bytes(plan, d, in_bytes)} bytes per partition needed, "
                         f"{sbuf_budget} available)")
    return plan


# ------------------------------------------------------------------------------------ kernel


@nki.jit
def flash_attention_kernel(q, k, v, sinks, cfg):
    """``O = softmax(scale * Q K^T (soft-capped) + mask (+ sink)) V`` for prefill.

    Dimensions:
      B >= 1; H_q = G * H_kv (GQA group G >= 1, MQA when H_kv = 1); S_q >= 1; S_kv >= S_q when
      causal (diagonal aligned to the end), any S_kv >= 1 otherwise; d in {64, 128, 192, 256}.
    Args:
      q: [B, H_q, S_q, d] HBM, bf16 (or fp16).
      k: [B, H_kv, S_kv, d] HBM (k_layout "bhsd"), or pre-transposed [B, H_kv, d, S_kv] ("bhds":
         K^T rows load with contiguous S_kv-long descriptors, no DMA transpose).
      v: [B, H_kv, S_kv, d] HBM, same dtype as q.
      sinks: None, or [H_q] float32 HBM (one logit per query head, joins the denominator).
      cfg: FlashAttentionPlan (options and tile choices).
    Returns:
      o: [B, H_q, S_q, d] shared HBM in cfg.out_dtype; plus lse [B, H_q, S_q] fp32 (natural log,
      sink included) when cfg.return_lse.
    Notes:
      fp32 scores, max, sums and O accumulation; P rounded to bf16 for P V (the same-precision
      reference does the same). Expected error: within 2x that reference + 1e-3.
    Pseudocode:
      for (b, h_kv) [LNC: q-tiles split over the programs by work]:
        for kv chunk: K^T [d, C] (DMA transposes), V_aug [128, C/128, d+1] (ones column) in SBUF
          for head h of the group, q-tile (Q^T by DMA transpose, 8 q-tiles per transfer):
            m = floor | sink, o = 0          (the blocks below run as a 4-stage software pipeline)
            for block of <= 2048 keys in visit(q-tile)   (causal/window: skipped tiles never appear)
              S = Q^T.T @ K^T[:, block]                          # 2 PSUM score halves (ring of 3)
              X, maxes = evict(scale * S) | range_select(mask)   # fused row maxes, ACT || DVE
              m' = max(m, maxes); P = exp(X - m'); alpha = exp(m - m')
              P^T = DMA transpose | TensorE transposes + eviction
              o = alpha * o + P^T.T @ V_aug[block]              # column d accumulates the row sum
            O[b, h, q-tile] = o[:, :d] / o[:, d];  lse = m + log o[:, d]
    """
    B, Hq, Sq, d = q.shape
    if cfg.k_layout == "bhds":
        Hkv, Skv = k.shape[1], k.shape[3]
    else:
        Hkv, Skv = k.shape[1], k.shape[2]
    DT = -(-d // P)
    out = nl.ndarray((B, Hq, Sq, d), dtype=cfg.out_dtype, buffer=nl.shared_hbm)
    lse = None
    if cfg.return_lse:
        lse = nl.ndarray((B, Hq, Sq), dtype=nl.float32, buffer=nl.shared_hbm)
    spec = MaskSpec(Sq, Skv, cfg.causal, cfg.window)
    chunks = kv_chunks(Skv, cfg.chunk)
    units = prefill_units(spec, B, Hkv, cfg.kb, cfg.chunk)
    programs, pid = lnc_programs()
    mine = assign_programs(units, programs)[pid]
    hbm_state = None
    if len(chunks) > 1:       # softmax state (o with its sum column, m) between KV chunks
        hbm_state = (nl.ndarray((B, Hq, Sq, d + 1), dtype=nl.float32, buffer=nl.hbm),
                     nl.ndarray((B, Hq, Sq, 1), dtype=nl.float32, buffer=nl.hbm))
    ident = nl.shared_identity_matrix(P, dtype=nl.bfloat16)             # [128, 128] for P^T
    groups = []
    for u in mine:
        if (u.b, u.kv_head) not in groups:
            groups.append((u.b, u.kv_head))
    for b, hk in groups:
        my_units = [u for u in mine if u.b == b and u.kv_head == hk]
        run_kv_group(q, out, lse, sinks, hbm_state, ident, spec, chunks, my_units, Hq, Hkv, d,
                     cfg, lambda c0, c1, b=b, hk=hk: _load_kv(k, v, b, hk, c0, c1, d, DT, cfg))
    if cfg.return_lse:
        return out, lse
    return out


def run_kv_group(q, out, lse, sinks, hbm_state, ident, spec, chunks, units, Hq, Hkv, d, cfg,
                 load_kv, store_each=False):
    """Every unit of one (sequence b, KV head) this program runs, chunk by resident KV chunk.

    ``q``, ``out``, ``lse``, ``hbm_state`` are indexed ``[b, h, rows, ...]`` (views of a ragged
    layout work as well); ``load_kv(c0, c1)`` issues the loads of keys ``[c0, c1)`` and returns
    ``(K^T [128, DT, C], V_aug [128, C/128, d+1])`` as :func:`_load_kv` lays them out, or with a
    third item ``need(c)``, called before each QK^T with the end ``c`` of the chunk keys it
    reads (paged_attention's FP8 pages finish K^T on GpSimd as the blocks need it).
    ``store_each``: the last Q^T batch of each chunk stores every q-tile as it ends (one output
    DMA each), so only the last q-tile's store follows the last PV (paged_attention's 2K chunk
    over 0, Trn3: the 8-tile store took 4.5 us after it, one tile's 1.7 us; 114.0 -> 111.3 us
    modeled)."""
    if not units:
        return
    hk = units[0].kv_head
    DT = -(-d // P)
    units = sorted(units, key=lambda u: u.q0)
    for ci, (c0, c1) in enumerate(chunks):
        cu = [u for u in units if u.visits[ci] is not None]
        if not cu:
            continue
        ctx = _Chunk(q, out, lse, sinks, hbm_state, ident, ci, c0, spec, d, DT, cfg)
        ctx.store_each = store_each
        ctx.plan_work([(u, h) for h in gqa_heads(Hq, Hkv, hk) for u in cu])
        ctx.kT, ctx.vs, *need = load_kv(c0, c1)    # DMA queues are FIFO: Q^T batch 0 goes first
        ctx.need = need[0] if need else None
        ctx.run()
        del ctx                     # free its SBUF/PSUM before the next chunk allocates


def _load_kv(k, v, b, hk, c0, c1, d, DT, cfg):
    """Keys [c0, c1) of (b, hk): K^T -> [128, DT, C] (d on partitions; DMA transposes unless K
    comes pre-transposed), V_aug -> [128, C/128, d+1] (key c0 + 128 t + p on partition p of tile
    t; column d = 1 so that P @ V_aug also yields the softmax row sums). Loaded in pieces of
    KV_PIECE tiles, in key order, so the first blocks start before the whole chunk has landed."""
    C = c1 - c0
    nt = -(-C // P)
    nfull = C // P
    kT = nl.ndarray((P, DT, C), dtype=k.dtype, buffer=nl.sbuf)                # [128, DT, C]
    vs = nl.ndarray((P, nt, d + 1), dtype=v.dtype, buffer=nl.sbuf)            # [128, nt, d+1]
    nisa.memset(dst=vs[:, :, d:d + 1], value=1.0, engine=nisa.engine.gpsimd)
    for g0 in range(0, nt, KV_PIECE):
        g1 = min(nt, g0 + KV_PIECE)
        a, z = g0 * P, min(C, g1 * P)
        for c in range(DT):
            dc = min(P, d - c * P)
            if cfg.k_layout == "bhds":
                nisa.dma_copy(dst=kT[0:dc, c, a:z], src=k[b, hk, c * P:c * P + dc, c0 + a:c0 + z])
            else:
                nisa.dma_transpose(dst=kT[0:dc, c, a:z], src=k[b, hk, c0 + a:c0 + z, c * P:c * P + dc])
        f1 = min(g1, nfull)
        if f1 > g0:
            n = f1 - g0
            src = v[b, hk, c0 + g0 * P:c0 + f1 * P, :].reshape((n, P, d)).permute((1, 0, 2))
            nisa.dma_copy(dst=vs[:, g0:f1, 0:d], src=src)
        if f1 < g1:
            r = C - nfull * P
            nisa.dma_copy(dst=vs[0:r, nfull, 0:d], src=v[b, hk, c0 + nfull * P:c1, :])
    return kT, vs


class _Job:
    """One (unit, block) of the software pipeline; holds its tiles between stages."""

    def __init__(self, unit, blk, first, last):
        self.unit = unit
        self.blk = blk
        self.first = first
        self.last = last


class _Batch:
    """Up to QB consecutive q-tiles of one head: one Q^T DMA transpose, one output DMA."""

    def __init__(self, h, units):
        self.h = h
        self.units = units
        self.r0 = units[0].u.q0
        self.r1 = units[-1].u.q0 + units[-1].rows
        self.qT = None
        self.o_stage = None
        self.lse_stage = None
        self.done = 0
        self.ended = 0


class _Unit:
    """One (q-tile, head) of a chunk: its Q^T view, mask bounds and softmax state."""

    def __init__(self, u, h, ci):
        self.u = u
        self.h = h
        self.rows = u.rows
        self.visit = u.visits[ci]
        self.first_chunk = ci == u.first_chunk
        self.last_chunk = ci == u.last_chunk


class _Chunk:
    """All (head, q-tile) units of one resident KV chunk, run as a software pipeline of four
    stages per block: QK^T (TensorE) -> softmax (ScalarE/VectorE/GpSimd) -> P^T (DMA transpose,
    or TensorE transposes + one eviction) -> PV + O update. Stage s of block j is issued at
    step j + lags[s], so every engine's in-order queue holds work from neighbouring blocks."""

    def __init__(self, q, out, lse, sinks, hbm_state, ident, ci, c0, spec, d, DT, cfg):
        self.q, self.out, self.lse, self.sinks = q, out, lse, sinks
        self.hbm_state = hbm_state
        self.kT = self.vs = None
        self.ident = ident
        self.ci, self.c0, self.spec, self.d, self.DT, self.cfg = ci, c0, spec, d, DT, cfg
        self.n_pieces = 0
        self.n_halves = 0
        self.n_evict = 0
        self.next_s = 0
        # PSUM, allocated once per chunk and reused, so every buffer reuse is a real dependency:
        # two rotating PV outputs, the score ring (2 banks per 1024 keys) and 1 KiB P^T quarter
        # buffers (4 key tiles). d <= 192: o 2x<=772 B (1 bank), S 3x2 banks, P^T 2x1 KiB;
        # d = 256: o 2x1028 B (2 banks), S 2x2 banks, P^T 3x1 KiB (its QK^T/PV take twice as
        # long per key, so a 2-deep score ring keeps up).
        self.o_bufs = [nl.ndarray((P, d + 1), dtype=nl.float32, buffer=nl.psum)  # [128, d+1]
                       for _ in range(2)]
        if d <= 128:            # o 2 x 516 B + P^T 3 x 768 B (3 key tiles) in banks 6-7
            n_s, n_tp, self.tp_tiles = S_BUFS, 3, 3
        elif d <= 192:          # o 2 x 772 B + P^T 2 x 1 KiB
            n_s, n_tp, self.tp_tiles = S_BUFS, 2, TP_TILES
        else:                   # o 2 x 1028 B + P^T 3 x 1 KiB, score ring of 2
            n_s, n_tp, self.tp_tiles = 2, 3, TP_TILES
        self.s_bufs = [nl.ndarray((P, HALF), dtype=nl.float32, buffer=nl.psum)   # [128, 1024]
                       for _ in range(n_s)]
        self.tp_bufs = [nl.ndarray((P, self.tp_tiles, P), dtype=nl.bfloat16, buffer=nl.psum)
                        for _ in range(n_tp)]                                      # [128, <=4, 128]
        self.next_tp = 0
        self.next_o = 0
        self.store_each = False
        self.need = None
        self.bias = None
        if cfg.bias_mask:
            self.bias = _diag_bias(cfg.scale)

    # ---------------------------------------------------------------- driver
    def plan_work(self, work):
        """Group the (q-tile, head) units into Q^T batches and blocks; issue Q^T batch 0."""
        batches = []
        for h in sorted({h for _, h in work}):
            run_ = []
            for u, hh in work:
                if hh != h:
                    continue
                if run_ and (len(run_) == QB or run_[-1].u.q0 + run_[-1].rows != u.q0):
                    batches.append(_Batch(h, run_))
                    run_ = []
                run_.append(_Unit(u, h, self.ci))
            if run_:
                batches.append(_Batch(h, run_))
        self.batches = batches
        jobs = []
        for bi, bt in enumerate(batches):
            for i, un in enumerate(bt.units):
                un.batch, un.slot, un.batch_idx = bt, i, bi
                nb = len(un.visit.blocks)
                for j, blk in enumerate(un.visit.blocks):
                    jobs.append(_Job(un, blk, j == 0, j == nb - 1))
        self.jobs = jobs
        for i, job in enumerate(jobs):
            job.tail = i >= len(jobs) - self.cfg.te_tail
        for a in range(Q_PREFETCH):
            self._load_batch(a)

    def run(self):
        jobs = self.jobs
        lags = self.cfg.lags
        n = len(jobs)
        for t in range(n + lags[-1] + 1):
            # emission order per step: the softmax of block t-lags[1] first (it reads score
            # buffers that the QK^T of block t reuses), then the O update of the block whose PV
            # was issued in the previous step (never waiting on this step's matmuls), the first
            # score half of block t, TensorE's mix of P^T transposes (block t-lags[2]) woven
            # between PV matmuls (block t-lags[3]) so the background transposes overlap the
            # matmuls, and last the second score half of block t, whose buffer was read by the
            # softmax of block t-1: the mix sits between that softmax and its reuse
            j1, j2, j3 = t - lags[1], t - lags[2], t - lags[3]
            if 0 <= j1 < n:
                self._softmax(jobs[j1])
            if 0 <= j3 - 1 < n:
                self._pv_finish(jobs[j3 - 1])
            if t < n:
                self._qk(jobs[t], first_half=True)
            self._tensor_mix(jobs[j2] if 0 <= j2 < n else None, jobs[j3] if 0 <= j3 < n else None)
            if t < n:
                self._qk(jobs[t], first_half=False)

    def _load_batch(self, bi):
        if bi >= len(self.batches) or self.batches[bi].qT is not None:
            return
        bt = self.batches[bi]
        u0 = bt.units[0].u
        n = bt.r1 - bt.r0
        qT = nl.ndarray((P, self.DT, n), dtype=self.q.dtype, buffer=nl.sbuf)  # [128, DT, n]
        for c in range(self.DT):
            dc = min(P, self.d - c * P)
            nisa.dma_transpose(dst=qT[0:dc, c, :],
                               src=self.q[u0.b, bt.h, bt.r0:bt.r1, c * P:c * P + dc])
        bt.qT = qT

    # ---------------------------------------------------------------- stage 0: S = Q K^T
    def _qk(self, job, first_half):
        """QK^T of one 1024-key half of the block into the next score buffer of the ring."""
        un, blk, cfg = job.unit, job.blk, self.cfg
        if first_half:
            if job.first:
                self._start_unit(un)
            job.halves = []
        rows, kw = un.rows, blk.width
        h0 = 0 if first_half else HALF
        if h0 >= kw:
            return
        hw = min(HALF, kw - h0)
        kk0 = blk.k0 - self.c0 + h0
        q_off = un.u.q0 - un.batch.r0
        if self.need is not None:
            self.need(kk0 + hw)
        S = self.s_bufs[self.next_s % len(self.s_bufs)]                            # [128, 1024]
        self.next_s += 1
        for n0 in range(0, hw, cfg.mm_n):
            nn = min(cfg.mm_n, hw - n0)
            for c in range(self.DT):
                dc = min(P, self.d - c * P)
                nisa.nc_matmul(dst=S[0:rows, n0:n0 + nn],
                               stationary=un.batch.qT[0:dc, c, q_off:q_off + rows],
                               moving=self.kT[0:dc, c, kk0 + n0:kk0 + n0 + nn], accumulate=(c > 0))
        if self.bias is not None:
            # the causal band: S[i, col] += bias[i, 128 + t], t = key - pos(row 0) (1 <= t <=
            # rows: the band starts after row 0's key and ends at the last row's), -big where
            # t > i: row i does not see the key
            # (split where the QK^T matmuls are: one PSUM bank per matmul on Trn2)
            pos0 = un.u.q0 + self.spec.offset
            for sg in blk.masked:
                a = max(sg.c0, h0)
                while a < min(sg.c1, h0 + hw):
                    z = min(sg.c1, h0 + hw, h0 + (a - h0) // cfg.mm_n * cfg.mm_n + cfg.mm_n)
                    t0 = blk.k0 + a - pos0
                    nisa.nc_matmul(dst=S[0:rows, a - h0:z - h0],
                                   stationary=self.ident[0:rows, 0:rows],
                                   moving=self.bias[0:rows, P + t0:P + t0 + z - a],
                                   accumulate=True)
                    a = z
        job.halves.append((h0, hw, S))

    def _start_unit(self, un):
        cfg, b, h, q0, rows = self.cfg, un.u.b, un.h, un.u.q0, un.rows
        if un.slot == 0:
            for a in range(1, Q_PREFETCH + 1):          # prefetch the next Q^T batches
                self._load_batch(un.batch_idx + a)
        if not un.first_chunk:
            so, sm = self.hbm_state
            un.st = SoftmaxState(rows, self.d, cfg.xmul,
                                 resume=(so[b, h, q0:q0 + rows, :], sm[b, h, q0:q0 + rows, :]))
            return
        sink = None
        if cfg.has_sinks:
            sink = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)         # [rows, 1]
            nisa.dma_copy(dst=sink, src=self.sinks.ap([[0, rows], [1, 1]], offset=h))
        un.st = SoftmaxState(rows, self.d, cfg.xmul, sink=sink)

    # ---------------------------------------------------------------- stage 1: softmax
    def _pick_max_engine(self, width):
        """ScalarE or VectorE for one bank-sized piece: a Bresenham sequence with act_max_frac
        ScalarE picks; at 0.5 the pieces alternate, so both banks of a score buffer drain in
        parallel (``_softmax`` restarts the alternation at every score half)."""
        use_act = _bresenham(self.n_pieces, self.cfg.act_max_frac)
        self.n_pieces += 1
        return "scalar" if use_act else "vector"

    def _bounds(self, un):
        """Per-row first/last visible key of the unit (GpSimd iota), made once."""
        if not hasattr(un, "lo"):
            un.lo = nl.ndarray((un.rows, 1), dtype=nl.float32, buffer=nl.sbuf)     # [rows, 1]
            un.hi = nl.ndarray((un.rows, 1), dtype=nl.float32, buffer=nl.sbuf)     # [rows, 1]
            row_bounds(un.lo, un.hi, self.spec, un.u.q0, un.rows)

    def _pieces(self, job, c0, c1, split_banks=True):
        """(S view, a, z) pieces of block columns [c0, c1): split at halves (different score
        buffers) and, when asked, at PSUM banks."""
        out = []
        for h0, hw, S in job.halves:
            a, z = max(c0, h0), min(c1, h0 + hw)
            if a >= z:
                continue
            cuts = _bank_pieces(a - h0, z - h0) if split_banks else [(a - h0, z - h0)]
            for x, y in cuts:
                out.append((S[0:job.unit.rows, x:y], h0 + x, h0 + y))
        return out

    def _softmax(self, job):
        un, blk, cfg = job.unit, job.blk, self.cfg
        st, rows, kw = un.st, un.rows, blk.width
        p_sb = nl.ndarray((rows, kw), dtype=nl.bfloat16, buffer=nl.sbuf)          # [rows, kw]
        full, masked = blk.full, blk.masked
        if self.bias is not None:      # the band's mask is in the scores already
            full, masked = (Segment(0, kw, False),), ()
        if cfg.scores_in_sbuf:
            # X = logits in SBUF (fp32): scale (or tanh soft-cap) applied on the way out of PSUM
            X = nl.ndarray((rows, kw), dtype=nl.float32, buffer=nl.sbuf)           # [rows, kw]
            if cfg.softcap:
                for Sv, a, z in self._pieces(job, 0, kw, split_banks=False):
                    nisa.activation(dst=X[:, a:z], op=nl.tanh, data=Sv,
                                    scale=cfg.scale / cfg.softcap)
                for s in full:
                    nisa.tensor_scalar_reduce(dst=X[:, s.c0:s.c1], data=X[:, s.c0:s.c1],
                                              op0=nl.multiply, operand0=cfg.softcap,
                                              reduce_op=nl.maximum, reduce_res=st.max_slot())
                for s in masked:
                    nisa.tensor_scalar(dst=X[:, s.c0:s.c1], data=X[:, s.c0:s.c1],
                                       op0=nl.multiply, operand0=cfg.softcap)
            else:
                xs = cfg.x_scale
                for s in full:
                    for Sv, a, z in self._pieces(job, s.c0, s.c1):
                        if a % HALF == 0 and cfg.act_max_frac == 0.5:
                            self.n_pieces = (a // HALF) % 2      # ACT/DVE order per half
                        if self._pick_max_engine(z - a) == "scalar":
                            nisa.activate2(dst=X[:, a:z], op=nl.copy, data=Sv, imm0=xs,
                                           imm1=0.0, op0=nl.multiply, op1=nl.bypass,
                                           reduce_op=nl.maximum, reduce_res=st.max_slot(),
                                           reduce_cmd=nisa.reduce_cmd.reset_reduce)
                        else:
                            nisa.tensor_scalar_reduce(dst=X[:, a:z], data=Sv, op0=nl.multiply,
                                                      operand0=xs, reduce_op=nl.maximum,
                                                      reduce_res=st.max_slot())
                if masked and xs != 1.0:
                    for s in masked:
                        for Sv, a, z in self._pieces(job, s.c0, s.c1, split_banks=False):
                            nisa.activation(dst=X[:, a:z], op=nl.copy, data=Sv, scale=xs)
            if masked:
                self._bounds(un)
            for s in masked:
                if not cfg.softcap and cfg.x_scale == 1.0:
                    # raw scores: mask straight out of PSUM, row max fused (one VectorE op)
                    for Sv, a, z in self._pieces(job, s.c0, s.c1, split_banks=False):
                        mask_range_select(X[:, a:z], Sv, un.lo, un.hi, blk.k0 + a,
                                          reduce_res=st.max_slot())
                else:
                    # mask in place with the row max fused (VectorE; a GpSimd affine_select
                    # would add ~0.5 us of latency to every diagonal block's max)
                    mask_range_select(X[:, s.c0:s.c1], X[:, s.c0:s.c1], un.lo, un.hi,
                                      blk.k0 + s.c0, reduce_res=st.max_slot())
            st.combine_max()
            if cfg.exp_engine == "vector":
                st.exp_rows([(p_sb, X)], "vector")
                alpha = st.rescale_factor("vector")
            else:
                neg = st.neg_max("scalar")
                st.exp_rows([(p_sb, X)], "scalar", neg)
                alpha = st.rescale_factor("scalar", neg)
        else:
            # Trn2: VectorE row max from PSUM; ScalarE exp from PSUM with scale + bias folded in
            exp_pieces = []
            for s in full:
                for Sv, a, z in self._pieces(job, s.c0, s.c1, split_banks=False):
                    nisa.tensor_reduce(dst=st.max_slot(), op=nl.maximum, data=Sv, axis=1)
                    exp_pieces.append((p_sb[:, a:z], Sv))
            if masked:
                self._bounds(un)
            for s in masked:
                for Sv, a, z in self._pieces(job, s.c0, s.c1, split_banks=False):
                    xs = nl.ndarray((rows, z - a), dtype=nl.float32, buffer=nl.sbuf)  # [rows, w]
                    mask_range_select(xs, Sv, un.lo, un.hi, blk.k0 + a, reduce_res=st.max_slot())
                    exp_pieces.append((p_sb[:, a:z], xs))
            st.combine_max()
            neg = st.neg_max("scalar")
            st.exp_rows(exp_pieces, "scalar", neg)
            alpha = st.rescale_factor("scalar", neg)
        st.mark_started()
        job.P, job.alpha = p_sb, alpha
        del job.halves

    # ---------------------------------------------------------------- stages 2+3: TensorE mix
    def _tensor_mix(self, jt, jp):
        """P^T of block ``jt`` (DMA transposes, or TensorE transposes + one eviction per
        1024-key half) and ``P^T.T @ V_aug`` of block ``jp`` (+ the O update), with the TensorE
        instructions of the two interleaved one by one."""
        te_t, post_t = self._transpose_ops(jt) if jt is not None else ([], [])
        te_p = self._pv_ops(jp) if jp is not None else []
        for i in range(max(len(te_t), len(te_p))):
            if i < len(te_p):
                te_p[i]()
            if i < len(te_t):
                te_t[i]()
        for f in post_t:
            f()

    def _transpose_ops(self, job):
        """(TensorE thunks, thunks to run after them) making ``job.pT`` [128, nt, rows]."""
        un, blk, cfg = job.unit, job.blk, self.cfg
        rows, kw, nt = un.rows, blk.width, blk.n_ktiles
        p_sb = job.P
        pT = nl.ndarray((P, nt, rows), dtype=nl.bfloat16, buffer=nl.sbuf)        # [128, nt, rows]
        job.pT = pT
        del job.P
        te, post = [], []
        for h0 in range(0, kw, HALF):
            hw = min(HALF, kw - h0)
            t0, ntt = h0 // P, -(-hw // P)
            use_dma = _bresenham(self.n_halves, cfg.dma_tr_frac) and not job.tail
            self.n_halves += 1
            if use_dma and hw % P == 0:
                # SBUF -> SBUF DMA transpose: [rows, ntt, 128] -> [128, ntt, rows]
                nisa.dma_transpose(dst=pT[:, t0:t0 + ntt, :],
                                   src=p_sb[:, h0:h0 + hw].reshape((rows, ntt, P)))
                continue
            for q0 in range(0, ntt, self.tp_tiles):
                nq = min(self.tp_tiles, ntt - q0)
                tp = self.tp_bufs[self.next_tp % len(self.tp_bufs)]                # [128, <=4, 128]
                self.next_tp += 1
                for t in range(nq):
                    c = h0 + (q0 + t) * P
                    kk = min(P, kw - c)
                    te.append(lambda tp=tp, t=t, kk=kk, c=c: nisa.nc_matmul(
                        dst=tp[0:kk, t, 0:rows], stationary=p_sb[:, c:c + kk],
                        moving=self.ident[0:rows, 0:rows], is_transpose=True))
                use_act = _bresenham(self.n_evict, cfg.evict_act)
                self.n_evict += 1
                eng = nisa.engine.scalar if use_act else nisa.engine.vector
                w = min(nq * P, kw - h0 - q0 * P)
                # evict right after the quarter's transposes: the next quarter may reuse tp
                te[-1] = _chain(te[-1], lambda tp=tp, t0=t0 + q0, w=w, nq=nq, eng=eng:
                                _evict_pT(pT, tp, t0, w, nq, rows, eng))
        return te, post

    def _pv_ops(self, job):
        un, blk = job.unit, job.blk
        rows, kw, nt = un.rows, blk.width, blk.n_ktiles
        o_ps = self.o_bufs[self.next_o % 2][0:rows, :]                           # [rows, d+1]
        self.next_o += 1
        job.o_ps = o_ps
        kt0 = (blk.k0 - self.c0) // P
        pT, vs = job.pT, self.vs
        ops = []
        for t in range(nt):
            kk = min(P, kw - t * P)
            ops.append(lambda t=t, kk=kk: nisa.nc_matmul(
                dst=o_ps, stationary=pT[0:kk, t, :], moving=vs[0:kk, kt0 + t, :],
                accumulate=(t > 0)))
        return ops

    def _pv_finish(self, job):
        un = job.unit
        if (self.cfg.final_psum and job.first and job.last and un.last_chunk
                and un.st.o is None):
            un.st.o = job.o_ps        # o = P @ V_aug of the only block: finalize reads PSUM
        else:
            un.st.accumulate_o(job.o_ps, job.alpha, mode=self.cfg.o_update, copy_engine="vector")
        del job.pT, job.o_ps
        if job.last:
            self._end_unit(un)

    def _end_unit(self, un):
        cfg, b, h, q0, rows, d = self.cfg, un.u.b, un.h, un.u.q0, un.rows, self.d
        bt = un.batch
        bt.ended += 1
        if bt.ended == len(bt.units):
            bt.qT = None                         # every unit of the batch has issued its QK^T
        if not un.last_chunk:
            so, sm = self.hbm_state
            un.st.save(so[b, h, q0:q0 + rows, :], sm[b, h, q0:q0 + rows, :])
            un.st = None
            return
        if bt.o_stage is None:
            bt.o_stage = nl.ndarray((P, len(bt.units), d), dtype=cfg.out_dtype, buffer=nl.sbuf)
            if cfg.return_lse:
                bt.lse_stage = nl.ndarray((P, len(bt.units)), dtype=nl.float32, buffer=nl.sbuf)
        lse_sb = bt.lse_stage[0:rows, un.slot:un.slot + 1] if cfg.return_lse else None
        un.st.finalize(bt.o_stage[0:rows, un.slot, :], lse_sb, out_scale=cfg.v_scale or None)
        un.st = None
        bt.done += 1
        n_end = sum(1 for x in bt.units if x.last_chunk)
        if self.store_each and bt is self.batches[-1]:
            self._store_runs(bt, b, [[un.slot]], free=bt.done == n_end)
        elif bt.done == n_end:
            self._store_batch(bt, b)

    def _store_batch(self, bt, b):
        """One output DMA per run of consecutive finished q-tiles (a ragged last tile alone)."""
        runs, cur = [], []
        for i, x in enumerate(bt.units):
            if x.last_chunk and x.rows == P:
                cur.append(i)
                continue
            if cur:
                runs.append(cur)
                cur = []
            if x.last_chunk:
                runs.append([i])
        if cur:
            runs.append(cur)
        self._store_runs(bt, b, runs)

    def _store_runs(self, bt, b, runs, free=True):
        """The output DMAs of runs of q-tiles (slots) of a batch; ``free``: the last ones."""
        h, d = bt.h, self.d
        for run_ in runs:
            i0, n = run_[0], len(run_)
            a = bt.units[i0].u.q0
            rows = bt.units[i0].rows
            if n == 1:
                nisa.dma_copy(dst=self.out[b, h, a:a + rows, :], src=bt.o_stage[0:rows, i0, :])
                if self.cfg.return_lse:
                    nisa.dma_copy(dst=self.lse[b, h, a:a + rows],
                                  src=bt.lse_stage[0:rows, i0:i0 + 1])
                continue
            dst = self.out[b, h, a:a + n * P, :].reshape((n, P, d)).permute((1, 0, 2))
            nisa.dma_copy(dst=dst, src=bt.o_stage[:, i0:i0 + n, :])
            if self.cfg.return_lse:
                dl = self.lse[b, h, a:a + n * P].reshape((n, P)).permute((1, 0))
                nisa.dma_copy(dst=dl, src=bt.lse_stage[:, i0:i0 + n])
        if free:
            bt.o_stage = bt.lse_stage = None


def _diag_bias(scale):
    """[128, 256] bf16 SBUF: column x is the causal mask of the key at offset t = x - 128 from
    row 0's position: 0 where t <= p (row p sees it), else -big (below any logit by far, and
    finite after the scale, so exp gives 0 and the row max stays finite: every causal row sees
    a key in its first block). GpSimd memset + affine_select, once per KV chunk."""
    big = FP32_MIN * 0.5 / max(1.0, scale)
    bias = nl.ndarray((P, 2 * P), dtype=nl.bfloat16, buffer=nl.sbuf)        # [128, 256]
    nisa.memset(dst=bias, value=0.0, engine=nisa.engine.gpsimd)
    nisa.affine_select(dst=bias, pattern=[[-1, 2 * P]], channel_multiplier=1, on_true_tile=bias,
                       on_false_value=big, cmp_op=nl.greater_equal, offset=P)
    return bias


def _chain(f, g):
    def h():
        f()
        g()
    return h


def _bresenham(i, f):
    """Whether item i of an evenly spread sequence with a share f of picks is picked."""
    return int((i + 1) * f + 1e-9) > int(i * f + 1e-9)


def _evict_pT(pT, tp, t0, hw, ntt, rows, eng):
    """P^T of ``ntt`` key tiles (``hw`` keys): PSUM (bf16) -> SBUF, full tiles in one copy."""
    nfull = hw // P
    if nfull:
        nisa.tensor_copy(dst=pT[:, t0:t0 + nfull, :], src=tp[:, 0:nfull, 0:rows], engine=eng)
    if nfull < ntt:
        kk = hw - nfull * P
        nisa.tensor_copy(dst=pT[0:kk, t0 + nfull, :], src=tp[0:kk, nfull, 0:rows], engine=eng)


def _bank_pieces(c0, c1):
    """Split columns [c0, c1) at PSUM bank boundaries (BANK_COLS fp32 columns)."""
    out = []
    a = c0
    while a < c1:
        z = min(c1, (a // BANK_COLS + 1) * BANK_COLS)
        out.append((a, z))
        a = z
    return out


# ---------------------------------------------------------------------------------------- op
_DTYPES = ("bfloat16", "float16")


def _check_inputs(q, k, v, causal, scale, window, softcap, sinks, k_layout, lnc):
    """Validate at the boundary; every message names the argument, what it got and what works."""
    check_flag("flash_attention", "causal", causal)
    check_no_grad("flash_attention", q, k, v, sinks)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if getattr(t, "ndim", None) != 4:
            raise ValueError(f"flash_attention: {name} must be 4-D; got shape "
                             f"{getattr(t, 'shape', None)}")
    if k_layout not in ("bhsd", "bhds"):
        raise ValueError(f"flash_attention: k_layout must be 'bhsd' ([B, H_kv, S_kv, d]) or "
                         f"'bhds' ([B, H_kv, d, S_kv]); got {k_layout!r}")
    B, Hq, Sq, d = (int(x) for x in q.shape)
    if k_layout == "bhsd":
        Bk, Hkv, Skv, dk = (int(x) for x in k.shape)
    else:
        Bk, Hkv, dk, Skv = (int(x) for x in k.shape)
    Bv, Hv, Sv, dv = (int(x) for x in v.shape)
    if d not in HEAD_DIMS:
        raise ValueError(f"flash_attention: head_dim must be one of "
                         f"{', '.join(map(str, HEAD_DIMS))}; got {d}")
    if (Bk, dk) != (B, d) or (Bv, dv) != (B, d):
        raise ValueError(f"flash_attention: k and v must have batch {B} and head_dim {d} like q; "
                         f"got k.shape={tuple(k.shape)} (k_layout={k_layout!r}), "
                         f"v.shape={tuple(v.shape)}")
    if (Hv, Sv) != (Hkv, Skv):
        raise ValueError(f"flash_attention: v must be [B, H_kv={Hkv}, S_kv={Skv}, d]; got "
                         f"v.shape={tuple(v.shape)}")
    if min(B, Hq, Hkv, Sq, Skv) < 1:
        raise ValueError(f"flash_attention: every dimension must be >= 1; got q.shape="
                         f"{tuple(q.shape)}, k.shape={tuple(k.shape)}")
    if Hq % Hkv:
        raise ValueError(f"flash_attention: H_q ({Hq}) must be a multiple of H_kv ({Hkv})")
    if causal and Sq > Skv:
        raise ValueError(f"flash_attention: causal attention needs S_q <= S_kv (queries continue "
                         f"a prefix); got S_q={Sq}, S_kv={Skv}")
    if Skv >= 2 ** 24:
        raise ValueError(f"flash_attention: S_kv must be < 2^24 (mask indices are fp32); got {Skv}")
    dn = _dtype_name(q)
    if dn not in _DTYPES:
        raise TypeError(f"flash_attention: q.dtype must be one of {', '.join(_DTYPES)}; got {dn}")
    for name, t in (("k", k), ("v", v)):
        if _dtype_name(t) != dn:
            raise TypeError(f"flash_attention: {name}.dtype must equal q.dtype ({dn}); got "
                            f"{_dtype_name(t)}")
    if scale is not None and not (isinstance(scale, (int, float, np.floating))
                                  and math.isfinite(scale) and scale > 0):
        raise ValueError(f"flash_attention: scale must be a finite number > 0 (or None for "
                         f"1/sqrt(head_dim)); got {scale!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer))
                               or window < 1):
        raise ValueError(f"flash_attention: window must be None or an int >= 1 (keys visible "
                         f"including the diagonal); got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float, np.floating))
                                    and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"flash_attention: softcap must be None or a finite number > 0; got "
                         f"{softcap!r}")
    if sinks is not None:
        shp = tuple(array_like("flash_attention", "sinks", sinks).shape)
        if shp != (Hq,):
            raise ValueError(f"flash_attention: sinks must have shape (H_q,) = ({Hq},); got "
                             f"shape {shp}: {sinks!r}"[:300])
    check_lnc("flash_attention", lnc)
    return B, Hq, Sq, d, Hkv, Skv, dn


def flash_attention(q, k, v, *, causal=True, scale=None, window=None, softcap=None, sinks=None,
                    return_lse=False, k_layout="bhsd", lnc=1):
    """Prefill attention ``softmax(scale * Q K^T + mask) V`` on a NeuronCore.

    Args:
      q: [B, H_q, S_q, d] bfloat16 (or float16), d in {64, 128, 192, 256}.
      k: [B, H_kv, S_kv, d], or [B, H_kv, d, S_kv] with ``k_layout="bhds"`` (pre-transposed K:
         contiguous K^T rows, no on-chip transposes of K).
      v: [B, H_kv, S_kv, d]. H_q must be a multiple of H_kv (GQA; MQA when H_kv = 1); query head
         h reads KV head ``h // (H_q / H_kv)``. K/V are never replicated.
      causal: mask keys after each query; the diagonal is aligned to the end (S_q <= S_kv).
      scale: logit scale (default 1/sqrt(d)).
      window: left sliding window in keys, diagonal included (HF ``sliding_window``).
      softcap: logits become ``softcap * tanh(logits / softcap)`` (Gemma-2).
      sinks: [H_q] per-head sink logits (GPT-OSS), added to the softmax denominator.
      return_lse: also return ``lse [B, H_q, S_q]`` float32 (natural log, sink included; to merge
         split-KV partial results give the sinks to one split only).
      lnc: 1, or 2 to split the q-tiles over the two cores of a logical NeuronCore.
    Returns:
      o [B, H_q, S_q, d] in q's dtype (and lse).
    """
    gen = check_target("flash_attention")          # Trn2+: range_select
    check_flag("flash_attention", "return_lse", return_lse)
    B, Hq, Sq, d, Hkv, Skv, dn = _check_inputs(q, k, v, causal, scale, window, softcap, sinks,
                                               k_layout, lnc)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    plan = plan_flash_attention(gen, d, Skv, causal=causal, window=window, softcap=softcap,
                                scale=scale, has_sinks=sinks is not None, return_lse=return_lse,
                                k_layout=k_layout, out_dtype=getattr(nl, dn),
                                sbuf_budget=sbuf_budget())
    sk = None
    if sinks is not None:
        sk = np.ascontiguousarray(array_like("flash_attention", "sinks", sinks))
    res = launch(flash_attention_kernel, q, k, v, sk, plan, lnc=lnc)
    return tuple(res) if return_lse else res
