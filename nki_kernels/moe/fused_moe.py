"""Fused MoE: ``y = sum_k w_k * down_k(silu(gate_k(x)) * up_k(x)) (+ shared(x))``.

Two kernels on the weight-stationary GEMM passes of ``nki_kernels.dense`` (docs/moe.md):

* **decode** (T <= 64 by default): one loop iteration per *distinct* chosen expert (a hardware
  ``fori_loop`` over a runtime count); the expert id is loaded into a register and the expert's
  weight tiles are read through a dynamic offset (``select(0, reg)``), once, whatever the number
  of tokens that chose it. All T tokens ride through every chosen expert: at T <= 64 a matmul
  costs its 64-cycle floor anyway, so the extra token columns are free, and a per-token combine
  row (the routing weight, 0 for tokens that did not choose the expert) scales the intermediate.
  The weighted outputs accumulate in an fp32 SBUF tile; nothing is copied in HBM.
* **prefill**: tokens grouped by expert into blocks of ``tb`` tokens (padded); one loop
  iteration per block gathers its token rows (indirect DMA), runs the expert's blockwise GEMMs,
  and scatter-adds the weighted rows into an fp32 HBM accumulator (DMA read-modify-write).

The routing plan (distinct experts, per-expert token lists, padding) is computed on the host from
``topk_ids`` / ``topk_weights`` (as vLLM's ``moe_align_block_size`` and FlashInfer's plan do);
the kernels take it as int32 / fp32 tensors, so a kernel is specialised only on shapes, never on
which experts were chosen.

Weights ``w_gate_up [E, H, 2I]`` (gate = columns ``[0, I)``, up = ``[I, 2I)``), ``w_down [E, I, H]``:
bf16, or FP8 (``float8_e4m3``; ``float8_e4m3fn`` on Trn3) with per-output-channel scales
``[E, 2I]`` / ``[E, H]`` (activations quantized per token inside the kernel, ``double_row``
GEMMs), row-major or tile-major (``tile_expert_weights``: ``tile_weight`` per expert); or, on
Trn3, MXFP8 (``quantize_expert_weights_mx``: gate|up in the MX tile layout of
``mxfp8_matmul``, down chunk-major in NKI's x4 order; x and h MX-quantized with
``quantize_mx``, GEMMs on ``nc_matmul_mx``; docs/moe.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._limits import sbuf_budget
from .._validate import (
    GEN_NAMES,
    check_2d,
    check_dtype,
    check_lnc,
    check_no_grad,
    check_target,
    dtype_name,
    is_torch,
)
from ..backend import launch, lnc_programs, nisa, nki, nl
from ..dense import _tiles as D
from ..dense._tiles import P, cdiv, tile_weight
from ..dense.swiglu_mlp import (
    NCOLS_MAX,
    _evict_y,
    _Fp8,
    _gate_evict,
    _runs,
    _silu_evict,
    _store_y,
    _x_block,
    _x_quantize,
)
from ..quant.mxfp8_matmul import (
    CHUNK,
    MXTensor,
    _load_data_tiles,
    quantize_weights_mx,
)

_FP8 = ("float8_e4m3", "float8_e4m3fn")
DECODE_T_MAX = 64        # default regime switch (docs/moe.md): the 64-cycle matmul floor
TB_CHOICES = (128, 256, 384, 512)   # prefill block sizes the host plan chooses from
TAIL_CHOICES = (0, 64, 128)         # tail block sizes (0 = none); 64 = the matmul floor
BLOCK_COST = 16                     # fixed cost of a block in token-times (plan model, Est)
RIDGE_TOKENS = 149       # Trn3 bf16 / FP8 ridge in tokens per weight stream (docs/dense.md)
RIDGE_TOKENS_TRN2 = 217  # Trn2
DMA_BYTES = 4096         # weight bytes per partition per transfer (8192: no gain, modeled)
RIDGE_TOKENS_MX = 298    # Trn3 MXFP8: 4x the bf16 TensorE rate on 1-byte weights = 2x the bf16 ridge
COMB_RESIDENT_BYTES = 32768  # MX decode: routing plan kept on one partition up to this size
MX_DMA_BYTES = 8192      # MX weight bytes per partition per transfer (whole 128-column tiles)
DECODE_RING = 4          # FP8 decode: weight transfers in flight (slots of a ring allocated
                         # once, _decode_ring; plan_decode_ring). Modeled, Trn3, Qwen3-30B-A3B
                         # T=64: 1492.8 -> 1265.9 us (75.1 -> 88.6% of the HBM roof), T=1 90.0
                         # -> 88.3 (79.7 -> 81.2%)
_MX_FMTS = {"e4m3fn": "float8_e4m3fn_x4", "e5m2": "float8_e5m2_x4"}
ACC_COLS = 1024          # prefill: columns of each fp32 accumulator slab (_Accumulators)


# ------------------------------------------------------------------------------ host side
@dataclass(frozen=True)
class MoEPlan:
    """Tile choices of one call (compile-time; data-independent except ``tb`` in prefill).

    regime: "decode" or "prefill".  tb: tokens per GEMM (decode: T; prefill: the block size).
    combined: gate and up accumulate in the same pass (two sets of accumulators fit PSUM).
    nf_gu, nf_d: feature tiles per pass; kb_gu, kb_d: k-tiles per weight DMA.
    """

    regime: str
    tb: int
    combined: bool
    nf_gu: int
    nf_d: int
    kb_gu: int
    kb_d: int
    fused: bool = False

    def args(self):
        """The kernel's compile-time plan arguments after ``regime, tb``."""
        return (self.combined, self.nf_gu, self.nf_d, self.kb_gu, self.kb_d, self.fused)


def plan_tiles(regime, tb, H, I, w_bytes, tiled) -> MoEPlan:
    """Pass widths and DMA sizes, as ``swiglu_mlp``'s plan picks them for one token block."""
    KT, KI = cdiv(H, P), cdiv(I, P)
    ncap = NCOLS_MAX // P
    fused = 2 * KI <= min(ncap, D.max_tiles_per_pass(tb, 1))
    combined = fused or D.max_tiles_per_pass(tb, 2) >= min(8, KI)
    nf_gu = min(D.max_tiles_per_pass(tb, 2 if combined else 1), ncap, KI)
    # one bank stays free for the output transposes that run while a down pass is live
    nf_d = min(D.max_tiles_per_pass(tb, 1, D.PSUM_BYTES - 2048), ncap, KT)
    cols_gu = P if tiled else (2 * nf_gu * P if fused else nf_gu * P)
    cols_d = P if tiled else nf_d * P
    kb_gu = D.k_tiles_per_dma(cols_gu, w_bytes, H, DMA_BYTES)
    kb_d = D.k_tiles_per_dma(cols_d, w_bytes, I, DMA_BYTES)
    return MoEPlan(regime, tb, combined, nf_gu, nf_d, kb_gu, kb_d, fused)


def _sbuf_need(tb, H, I, w_bytes, fp8, plan, pipelined=True):
    """Per-partition SBUF bytes of one expert step (upper bound): xT, h, the weight ring (3
    transfers in flight), the silu tile, two yT buffers, the gathered rows (FP8: and their
    quantization temporaries), fixed tiles, and what the pipelined loop holds across stages
    (``pipelined``, the routed block loop, which gathers block b + 1 during block b's GEMMs;
    otherwise the shared expert's step, whose rows die before its GEMMs)."""
    KT, KI = cdiv(H, P), cdiv(I, P)
    a = 1 if fp8 else 2
    ring = 3 * 2 * plan.kb_gu * plan.nf_gu * P * w_bytes
    rows = cdiv(tb, P) * H * (5 if fp8 else 2)
    # the pipelined loop holds the next block's drained gate/up passes (FP8: g * a_t and
    # u * scale, fp32; bf16: h) through the down stage, and a few carried rows
    gemm = KI * tb * (3 if fp8 else 2) + ring + plan.nf_gu * tb * 8 + 2 * plan.nf_d * tb * 4
    if not pipelined:   # the rows die once transposed into xT, before the GEMMs start
        return KT * tb * a + max(rows, gemm) + 8 * 1024
    drained = KI * tb * (8 if fp8 else 2) + 4 * tb * 4
    return KT * tb * a + gemm + rows + 8 * 1024 + drained


def _decode_ring_shape(H, I, plan, fp8, tiled):
    """(weights, k-tiles, columns) of each slot of the decode weight ring (``_decode_ring``):
    large enough for a gate/up transfer and for a down transfer (tile-major: ``[128, kn,
    128]``), so that both streams take slots in program order."""
    kn = max(D.transfer_k_tiles(kb, fp8) for kb in (plan.kb_gu, plan.kb_d))
    n = 2 if plan.combined and not plan.fused else 1
    if tiled:
        return n, kn, P
    gu = 2 * I if plan.fused else min(plan.nf_gu * P, I)
    return n, kn, max(gu, min(plan.nf_d * P, H))


def _decode_ring_bytes(H, I, plan, w_bytes, fp8, tiled, ring=DECODE_RING):
    """Per-partition SBUF bytes of a decode weight ring of ``ring`` slots (held from the routed
    loop's first transfer to the end)."""
    n, kn, c = _decode_ring_shape(H, I, plan, fp8, tiled)
    return ring * n * kn * c * w_bytes


def _sbuf_need_decode(T, H, I, S, w_bytes, fp8, plan, ring, Is=0, tiled=False):
    """Per-partition SBUF bytes of ``fused_moe_decode_kernel`` with bf16 / FP8 weights (upper
    bound; tests/test_sbuf_plan.py checks it against the measured peak): the fixed tiles and
    xT (FP8: and its scales), then the larger of the prologue (the gathered rows and their FP8
    quantization) and what follows it: the rows the kernel keeps, the accumulator yacc, and
    the larger of the shared expert's step (``Is`` > 0: its stage tiles, two fresh weight
    transfers live at a time) and the routed loop: the carried tiles (h, FP8's token and down
    channel scales), the weight ring of ``ring`` slots (``_decode_ring_bytes``; 0: a fresh
    tile per transfer instead, two live) and one slot's stage tiles (its plan row, FP8's scale rows and
    columns, the gate/up evictions and |h|max, the quantization temporaries, the down passes'
    outputs). ``S``: slots of the routing plan."""
    KT = cdiv(H, P)
    a = 1 if fp8 else 2
    KTe = KT + (KT % 2 if fp8 else 0)
    fixed = 4 * S + 16 + 3 * 4 * P + 2 * P + 4 * P     # ids, counts, ones, identities, iota
    xT = KTe * T * a + (8 * T if fp8 else 0)
    rows = cdiv(T, P) * H * (5 if fp8 else 2)

    def stage(I_, p_, meta):
        KI_ = cdiv(I_, P)
        KIe_ = KI_ + (KI_ % 2 if fp8 else 0)
        nf = p_.nf_gu
        t = meta + 2 * KI_ * T + 4 * nf * T                 # row, h (FP8: the parts), silu
        if fp8:
            t += 4 * (2 * KI_ + KT) + 4 * (2 * KI_ + KT)    # scale rows, their columns
            t += 4 * nf * T + 2 * nf * T + 6 * 4 * T        # g*a, |h|, hmax/pm/amax/sc/inv/Binv
        else:
            t += 4 * T                                      # wrow broadcast
        t += KIe_ * T * a + 4 * T                           # h quantized (shared: fresh), B
        return t + 2 * 4 * p_.nf_d * T                      # a down pass's yT (and the next's)

    def transfer(I_, p_):
        return max(D.gemm_pass_loads(1, H, [P] * (2 * cdiv(I_, P) if p_.fused else p_.nf_gu),
                                     p_.kb_gu, w_bytes, fp8, tiled)
                   + D.gemm_pass_loads(1, I_, [P] * p_.nf_d, p_.kb_d, w_bytes, fp8, tiled))

    yacc = 4 * KT * T
    KI = cdiv(I, P)
    carried = (KI + (KI % 2 if fp8 else 0)) * T * a + ((4 * T + 4 * KT) if fp8 else 0)
    weights = _decode_ring_bytes(H, I, plan, w_bytes, fp8, tiled, ring) if ring \
        else 2 * transfer(I, plan)      # a fresh tile lands while the previous one is held
    loop = carried + weights + stage(I, plan, 4 * (T + 2 * I + H) if fp8 else 4 * T)
    shared = 0
    if Is:
        sp = plan_tiles("decode", T, H, Is, w_bytes, tiled)
        shared = stage(Is, sp, 0) + 2 * transfer(Is, sp)
    kept = cdiv(T, P) * H * 2       # the rows the kernel keeps (FP8: as FP8-valued bf16)
    return fixed + xT + max(rows, kept + yacc + max(shared, loop))


def plan_decode_ring(T, H, I, S, w_bytes, fp8, plan, budget, Is=0, tiled=False):
    """Slots of the decode weight ring, FP8 weights only (``DECODE_RING``): ``DECODE_RING``,
    fewer if the kernel would not fit ``budget`` with them (``_sbuf_need_decode``), 0 (a fresh
    tile per transfer) if even 2 do not fit. bf16 keeps fresh tiles: modeled with the ring, its
    decode rows moved by -0.4% to +0.4% on Trn3 and were 0.8-1.0% slower on Trn2 (Qwen3-30B-A3B
    T = 1, 8, 64), while no bf16 row missed its goal."""
    if not fp8:
        return 0
    for r in range(DECODE_RING, 1, -1):
        if _sbuf_need_decode(T, H, I, S, w_bytes, fp8, plan, r, Is, tiled) <= budget:
            return r
    return 0


def local_ids(topk_ids, n_local, expert_offset=0):
    """Global ids -> local ids ``[T, k]`` int64, -1 where the id is not a local expert."""
    ids = np.asarray(topk_ids).astype(np.int64) - int(expert_offset)
    return np.where((ids >= 0) & (ids < n_local), ids, -1)


def _combine(lids, w, n_local):
    """Dense routing weights ``[E, T]`` fp32 (an expert listed twice for a token: summed)."""
    T = lids.shape[0]
    c = np.zeros((n_local, T), np.float32)
    t, j = np.nonzero(lids >= 0)
    np.add.at(c, (lids[t, j], t), w[t, j])
    return c


def plan_decode_routing(lids, w, n_local, scales=None):
    """Decode routing plan: (experts [1, S] int32, counts [1, 3] int32, combine [S, T(+2I+H)]).

    ``experts[0, :count]`` are the distinct chosen local experts in ascending order; row s of
    ``combine`` holds the weight of each token for expert ``experts[s]`` (0 if it did not choose
    it), followed, for FP8 (``scales`` = ([E, 2I], [E, H])), by that expert's scale rows, so an
    iteration loads its per-expert vectors in one descriptor (each small DMA in front of the
    weight stream costs a ~1 us bubble on its queue). S = max(2, min(E, T*k)) slots (the
    pipelined loop's view of slots 1.. is never empty), so the shapes depend on (T, k, E) only.
    counts: n = the number of distinct chosen experts, max(n - 1, 0) and min(n, 1) (the loop
    counts of ``_decode_pipelined``)."""
    T, k = lids.shape
    S = max(2, min(n_local, T * k))
    c = _combine(lids, w, n_local)
    chosen = np.unique(lids[lids >= 0])
    experts = np.zeros((1, S), np.int32)
    experts[0, :chosen.size] = chosen
    n_extra = 0 if scales is None else scales[0].shape[1] + scales[1].shape[1]
    comb = np.zeros((S, T + n_extra), np.float32)
    comb[:chosen.size, :T] = c[chosen]
    if scales is not None:
        comb[:chosen.size, T:] = np.concatenate([scales[0][chosen], scales[1][chosen]], axis=1)
    n = chosen.size
    return experts, np.array([[n, max(n - 1, 0), min(n, 1)]], np.int32), comb


def split_expert(n, tb, tt):
    """(full blocks, second-size blocks) covering an expert's ``n`` tokens: ``n // tb`` blocks of
    ``tb``; the rest in tail blocks of ``tt < tb`` tokens when they pad less than one more full
    block (``tt`` = 0: no tail blocks); or, ``tt > tb`` (merged blocks), the expert's last full
    block grown to ``tt`` tokens when the rest fits it (its weights then stream once for all of
    its tokens, where a tail block streams them again)."""
    f, r = divmod(int(n), tb)
    if r == 0:
        return f, 0
    if tt > tb:
        return (f - 1, 1) if f and r <= tt - tb else (f + 1, 0)
    if tt and -(-r // tt) * tt < tb:
        return f, -(-r // tt)
    return f + 1, 0


def choose_blocks(counts, tb_cap, ridge=RIDGE_TOKENS, merge=True):
    """Prefill block sizes ``(tb, tt)``: full blocks of ``tb`` (``TB_CHOICES``, <= tb_cap) and
    tail blocks of ``tt`` (``TAIL_CHOICES``; 0 = none) or (``merge``) merged blocks of
    ``tt = tb + tail`` (``split_expert``; at most ``tb_cap`` and 512 tokens, a matmul's moving
    free size),
    minimising the modeled time ``max(padded tokens, ridge x blocks) + BLOCK_COST x blocks``:
    TensorE works on the padded tokens, the weight stream costs ``ridge`` token-times per block
    (each block re-reads its expert), the two overlap, and every block has a small fixed cost
    (gathers, transposes, scatter-add). Ties go to fewer blocks, then to tails."""
    best = None
    for tb in TB_CHOICES:
        if tb > tb_cap and tb != TB_CHOICES[0]:
            continue
        seconds = [t for t in TAIL_CHOICES if t < tb]
        seconds += [tb + t for t in TAIL_CHOICES if merge and t and tb + t <= min(tb_cap, 512)]
        for tt in seconds:
            full = tails = 0
            for n in counts:
                if n:
                    f, t = split_expert(n, tb, tt)
                    full, tails = full + f, tails + t
            nblk = full + tails
            cost = max(full * tb + tails * tt, ridge * nblk) + BLOCK_COST * nblk
            if best is None or (cost, nblk, tt > tb) < best[:3]:
                best = (cost, nblk, tt > tb, tb, tt)
    return (best[3], best[4]) if best else (TB_CHOICES[0], 0)


def plan_prefill_routing(lids, w, n_local, tb, tt=0, cores=1, ridge=RIDGE_TOKENS):
    """Prefill routing plan: per chosen expert, ``split_expert`` blocks of ``tb`` tokens and
    tail (``tt < tb``) or merged (``tt > tb``) blocks of ``tt`` tokens. Returns one plan per
    block size (the second None when ``tt`` = 0): (block_expert [cores, NB] int32, count
    [cores, 2] int32, gather [cores NB, b] int32, scatter [cores NB, b] int32, weight
    [cores NB, b] fp32), core c's plan in row c of
    the first two and rows [c NB, (c + 1) NB) of the others; count is ``[n, max(n - 1, 0)]``
    (the blocks, and the iterations of the kernel's pipelined loop). Padding slots gather a real
    token of the block (weight 0) and scatter to row T (out of bounds: skipped).
    NB = ceil(T*k / tb) + min(E, T*k) + 1 full block slots, min(E, T*k) * max(1, tb // tt) + 1
    tail / merged slots (at least 2 each): shapes depend on (T, k, E, cores) only.
    ``cores`` > 1 (LNC 2): each expert's blocks all go to one core (its weights are read once),
    the experts dealt largest first to the core with the least work so far (``ridge``: the
    plan model of choose_blocks)."""
    T, k = lids.shape
    c = _combine(lids, w, n_local)
    A = T * k
    # one slot more than blocks can fill: the pipelined loop prepares block n while it runs
    # block n - 1 (a padding slot then)
    sizes = [(tb, max(2, -(-A // tb) + min(n_local, A) + 1))]
    if tt:     # tail blocks (tt < tb), or one merged block per expert (tt > tb)
        sizes.append((tt, max(2, min(n_local, A) * max(1, tb // tt) + 1)))
    plans = []
    for b, NB in sizes:
        plans.append([np.zeros((cores, NB), np.int32), [0] * cores,
                      np.zeros((cores * NB, b), np.int32), np.full((cores * NB, b), T, np.int32),
                      np.zeros((cores * NB, b), np.float32), NB])
    work = []
    for e in np.unique(lids[lids >= 0]):
        toks = np.unique(np.nonzero(lids == e)[0])
        f, t = split_expert(toks.size, tb, tt)
        cost = max(f * tb + t * tt, ridge * (f + t)) + BLOCK_COST * (f + t)
        work.append((cost, int(e), toks, f, t))
    load = [0] * cores
    owner = {}
    for cost, e, *_ in sorted(work, key=lambda a: (-a[0], a[1])):
        core = min(range(cores), key=lambda i: (load[i], i))
        owner[e] = core
        load[core] += cost
    for _, e, toks, f, t in work:          # in expert order within each core
        core = owner[e]
        starts = [(0, b0, tb) for b0 in range(0, f * tb, tb)]
        starts += [(1, f * tb + j * tt, tt) for j in range(t)]
        for which, b0, b in starts:
            pl = plans[which]
            tk = toks[b0:b0 + b]
            nb = pl[1][core]
            r = core * pl[5] + nb
            pl[0][core, nb] = e
            pl[2][r, :] = tk[0]
            pl[2][r, :tk.size] = tk
            pl[3][r, :tk.size] = tk
            pl[4][r, :tk.size] = c[e, tk]
            pl[1][core] = nb + 1
    out = [(pl[0], np.array([[n, max(n - 1, 0)] for n in pl[1]], np.int32), pl[2], pl[3],
            pl[4]) for pl in plans]
    return out[0], (out[1] if tt else None)


def tile_expert_weights(w):
    """Expert weights ``[E, K, N]`` -> tile-major ``[E, N/128, 128, KTe, 128]`` (``tile_weight``
    per expert; host side, once at load time). K, N multiples of 128."""
    shape = tuple(getattr(w, "shape", ()))
    if len(shape) != 3:
        raise ValueError(f"tile_expert_weights: w must be 3-D [E, K, N]; got shape {list(shape)}")
    if is_torch(w):
        import torch
        return torch.stack([tile_weight(w[e]) for e in range(shape[0])])
    return np.stack([tile_weight(np.asarray(w)[e]) for e in range(shape[0])])


# ---------------------------------------------------------------------------- MXFP8 (Trn3)
def down_chunks(I):
    """The chunks of the down projection's contraction (I a multiple of 128): ``[(r0, n, kp)]``
    per 512 rows, ``n`` rows from ``r0``, packed on ``kp = n / 4`` partitions (128, 64 or 32)
    with lane q holding rows ``r0 + kp*q ..`` -- NKI's own x4 convention (four contraction
    rows ``kp`` apart per word). A 384-row tail has no such split (``kp`` = 96 would cut the
    gate/up tiles that produce it), so it takes ``kp`` = 128 with lane 3 empty."""
    out = []
    for r0 in range(0, I, CHUNK):
        n = min(CHUNK, I - r0)
        out.append((r0, n, P if n == 3 * P else n // 4))
    return out


def pack_down_chunks(w):
    """``w_down [I, H]`` -> ``[KC, 512, H]``: chunk c's rows in the packing order of the MX
    tile layout (row ``4p + q`` on partition p, lane q) = ``w[r0 + kp*q + p]`` for the
    chunk's ``(r0, n, kp)`` of :func:`down_chunks`; zero where no row maps (partitions past
    ``kp``, an empty lane).

    Why: the gate/up GEMMs leave h with feature ``128j + p`` on partition p of tile j (or, for
    a narrow tail chunk, sub-tiles of ``kp`` features on partitions 0..kp-1), so lane q of
    chunk c is one whole output tile of the gate/up pass and h is quantized with no data
    movement across partitions; and a tail chunk occupies only ``kp`` partitions, so no zero
    padding is ever streamed from HBM."""
    w = np.asarray(w, np.float32)
    I, H = w.shape
    ch = down_chunks(I)
    out = np.zeros((len(ch), P, 4, H), np.float32)
    for c, (r0, n, kp) in enumerate(ch):
        for q in range(4):
            k = min(kp, max(0, n - kp * q))
            out[c, 0:k, q, :] = w[r0 + kp * q:r0 + kp * q + k]
    return out.reshape(len(ch), CHUNK, H)


def quantize_expert_weights_mx(w_gate_up, w_down, fmt="e4m3fn"):
    """Offline MXFP8 quantization of MoE expert weights for ``fused_moe`` on Trn3 (host NumPy).

    Args:
      w_gate_up: ``[E, H, 2I]`` (or one expert ``[H, 2I]``: a shared expert) float array.
      w_down: ``[E, I, H]`` (or ``[I, H]``). H and I multiples of 128.
      fmt: "e4m3fn" (default) or "e5m2".
    Returns:
      ``(gate_up, down)``, two :class:`MXTensor` whose ``data`` / ``scale`` carry a leading
      expert dim (none for 2-D inputs): gate_up = ``quantize_weights_mx(w_gate_up[e])`` stacked
      (data uint32 ``[E, 128, KT(H) * 2I]``, scale uint8 ``[E, 64, SL(H) * 2I]``, k = H); down =
      chunk-major (data ``[E, 128, KC * H]``: chunk c at columns ``[cH, (c+1)H)``, each the MX
      tile layout with KT = 1 of ``pack_down_chunks(w_down[e])[c]``; scale ``[E, 64,
      SL(I) * H]``: the image rows of chunk c at row offset ``4(c % 4)``, slot ``c // 4``;
      k = I). So a chunk streams in long runs and only its ``kp`` partitions are read.
      Every MX block (32 values, one E8M0 scale) holds weights of one output column.
    """
    name = "quantize_expert_weights_mx"
    f = str(fmt)
    f = f[len("float8_"):] if f.startswith("float8_") else f
    if f not in _MX_FMTS:
        raise ValueError(f"{name}: fmt must be one of {', '.join(_MX_FMTS)}; got {fmt!r}")
    g, d = _as_numpy_f(w_gate_up), _as_numpy_f(w_down)
    if g.ndim != d.ndim or g.ndim not in (2, 3):
        raise ValueError(f"{name}: w_gate_up / w_down must be [E, H, 2I] / [E, I, H] (or one "
                         f"expert [H, 2I] / [I, H]); got shapes {list(g.shape)}, {list(d.shape)}")
    one = g.ndim == 2
    if one:
        g, d = g[None], d[None]
    E, H, I2 = g.shape
    I = I2 // 2
    if I2 % 2 or d.shape != (E, I, H):
        raise ValueError(f"{name}: w_down must be [E, I, H] = {[E, I, H]} for w_gate_up "
                         f"{list(g.shape)}; got {list(d.shape)}")
    if H % P or I % P or min(E, H, I) < 1:
        raise ValueError(f"{name}: H and I must be positive multiples of 128; got H={H}, I={I}")
    gus = [quantize_weights_mx(g[e], f) for e in range(E)]
    dns = [_quantize_down_mx(d[e], f) for e in range(E)]
    out = []
    for qs, k in ((gus, H), (dns, I)):
        data = np.stack([q.data for q in qs])
        scale = np.stack([q.scale for q in qs])
        out.append(MXTensor(data[0] if one else data, scale[0] if one else scale, f, k))
    return tuple(out)


def _quantize_down_mx(w, fmt):
    """One expert's down weight -> MXTensor (chunk-major; see quantize_expert_weights_mx)."""
    I, H = w.shape
    chunks = pack_down_chunks(w)
    KC = chunks.shape[0]
    data = np.empty((P, KC * H), np.uint32)
    img = np.zeros((64, cdiv(KC, 4) * H), np.uint8)
    for c in range(KC):
        q = quantize_weights_mx(chunks[c], fmt)          # KT = 1: data [128, H], image [64, H]
        data[:, c * H:(c + 1) * H] = q.data
        for Q in range(4):                               # rows 16Q + i (o = 0) -> o = c % 4
            img[16 * Q + 4 * (c % 4):16 * Q + 4 * (c % 4) + 4, (c // 4) * H:(c // 4 + 1) * H] = \
                q.scale[16 * Q:16 * Q + 4]
    return MXTensor(data, img, fmt, I)


def _as_numpy_f(a):
    if is_torch(a):
        return a.detach().float().cpu().numpy()
    return np.asarray(a)


def plan_tiles_mx(regime, tb, H, I) -> MoEPlan:
    """MX pass widths: gate and up accumulate together, one PSUM bank kept free (the x / output
    transposes); kb_* = 128-column weight tiles per DMA (~``MX_DMA_BYTES`` per partition)."""
    KT, KI = cdiv(H, P), len(_gu_units(I))
    nf_gu = min(D.max_tiles_per_pass(tb, 2, D.PSUM_BYTES - 2048), KI)
    nf_d = min(D.max_tiles_per_pass(tb, 1, D.PSUM_BYTES - 2048), KT)
    kb_gu = max(1, MX_DMA_BYTES // (cdiv(H, CHUNK) * CHUNK))
    kb_d = max(1, MX_DMA_BYTES // (cdiv(I // P, 4) * CHUNK))
    return MoEPlan(regime, tb, True, nf_gu, nf_d, kb_gu, kb_d, False)


def _sbuf_need_mx(tb, H, I, plan):
    """Per-partition SBUF bytes of one MX expert step (upper bound): gathered rows, the x
    quantization stage, xq, hT, hq, the weight tiles in flight (3 transfers), silu tiles,
    two yT buffers, fixed tiles."""
    KTh, KC = cdiv(H, CHUNK), cdiv(I // P, 4)
    rows = cdiv(tb, P) * H * 2 + 2 * tb * 4 * 2
    xq = KTh * tb * 4 + cdiv(KTh, 4) * tb
    h = 4 * KC * tb * 2 + KC * tb * 4 + cdiv(KC, 4) * tb
    ring = 3 * plan.kb_gu * (KTh * CHUNK + cdiv(KTh, 4) * P)
    return (rows + xq + h + ring + plan.nf_gu * tb * 4 + 2 * plan.nf_d * tb * 4 + 8 * 1024)


def shared_block(need, budget):
    """Token block of the shared expert in prefill: the largest of ``TB_CHOICES`` whose step
    (``need(tb)`` SBUF bytes per partition) fits ``budget``. The shared expert is a dense MLP
    over all T tokens, run block by block after the routed loop (not pipelined with it), and
    every block streams all of its weights: at the routed block size (DeepSeek-V3 EP8,
    T = 4096: 256 tokens) its weight stream is as large as the 32 routed experts'."""
    return max((c for c in TB_CHOICES if need(c) <= budget), default=TB_CHOICES[0])


# ---------------------------------------------------------------------------- kernel side
def _expert_step(xT, A, tb, H, I, wgu, wd, wrow, q, plan, tiled, sink, row_scale=False):
    """One expert: :func:`_gate_up_stage`, FP8's per-token quantization of h, then
    :func:`_down_stage`."""
    h = _gate_up_stage(xT, A, tb, H, I, wgu, wrow, q, plan, tiled)
    B = None
    if q is not None:
        h_parts, hmax, factor = h
        h, B = q.quantize_h(h_parts, hmax, cdiv(I, P), tb, factor, row_scale)
    _down_stage(h, B, tb, H, I, wd, q, plan, tiled, sink)


def _gate_up_stage(xT, A, tb, H, I, wgu, wrow, q, plan, tiled, ring=None):
    """The gate/up half of an expert step on the token columns of ``xT [128, KT, tb]``: the
    gate/up passes -> the weighted intermediate h. ``A``: FP8, the tokens' x scales as the pair
    (row broadcast ``[128, tb]``, row ``[1, tb]``); bf16, None.

    ``wrow``: the per-token weights (None = 1); bf16: broadcast ``[128, tb]``, multiplied into
    h. FP8: the row ``[1, tb]``; h is quantized per token, so the token's weight and its x scale
    ``a_t`` stay out of h and go into the output's token scale B with h's own scale (one
    ``[1, tb]`` product instead of two full passes over h).

    ``wgu`` is the expert's whole gate|up weight (``[H, 2I]`` or tile-major ``[2I/128, ...]``).
    When all 2 x KI accumulator tiles fit one pass (``plan.fused``: decode sizes), gate and up
    stream as *one* weight: a row-major k-tile row is then one run of 2I elements (3 KiB for
    Qwen3-30B-A3B instead of two 1.5 KiB runs at 61% DMA efficiency).

    Returns bf16: the weighted ``hT [128, KI, tb]``; FP8: ``(h_parts, hmax, factor)`` for
    ``_Fp8.quantize_h`` (h unquantized, per pass; the tokens' |h|max; the factor row that goes
    into the token scale B)."""
    KI = cdiv(I, P)
    fp8 = q is not None
    Tp = D.acc_free(tb)
    gu_tiles = D.feature_tiles([(0, I, 0)])
    if fp8:
        A, factor = A                                                           # [128|1, tb]
        h_parts = []
        hmax = nl.ndarray((P, tb), dtype=nl.float32, buffer=nl.sbuf)            # [128, tb]
        if wrow is not None:
            a_row, factor = factor, nl.ndarray((1, tb), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=factor, data1=a_row, data2=wrow, op=nl.multiply,
                               engine=nisa.engine.gpsimd)
    else:
        hT = nl.ndarray((P, KI, tb), dtype=nl.bfloat16, buffer=nl.sbuf)         # [128, KI, tb]
    fused = plan.fused
    if fused:
        passes = [(0, KI)]
    else:
        passes = D.group_passes(gu_tiles, plan.nf_gu)
        if tiled:
            wg, wu = wgu[0:KI], wgu[KI:2 * KI]
        else:
            wg, wu = wgu[:, 0:I], wgu[:, I:2 * I]
    for pi, (i0, i1) in enumerate(passes):
        widths = [gu_tiles[i][1] for i in range(i0, i1)]
        c0 = gu_tiles[i0][0]
        nf = i1 - i0
        if fused:      # gate tiles then up tiles of one weight, one accumulator tensor
            acc = D.gemm_pass([wgu], xT, H, tb, Tp, widths + widths, 0, plan.kb_gu, fp8,
                              tiled=tiled, ring=ring)[0]                         # [128, 2KI, Tp]
            acc_g, acc_u = acc[:, 0:nf, :], acc[:, nf:2 * nf, :]
            del acc    # the views keep it until the evictions below; then the down pass may
            #            take all of PSUM
        elif plan.combined:
            acc_g, acc_u = D.gemm_pass([wg, wu], xT, H, tb, Tp, widths, c0, plan.kb_gu, fp8,
                                       tiled=tiled, ring=ring)
        else:
            acc_g = D.gemm_pass([wg], xT, H, tb, Tp, widths, c0, plan.kb_gu, fp8,
                                tiled=tiled, ring=ring)[0]
        sg = _silu_evict(acc_g, widths, tb, q, A, i0, up_scale=not fp8)          # [128, nf, tb]
        del acc_g
        if wrow is not None and not fp8:   # the routing weight of each token (0: not chosen)
            nisa.tensor_tensor(dst=sg, data1=sg, data2=wrow.expand_dim(1).broadcast(1, nf),
                               op=nl.multiply, engine=nisa.engine.gpsimd)
        if not (fused or plan.combined):
            acc_u = D.gemm_pass([wu], xT, H, tb, Tp, widths, c0, plan.kb_gu, fp8,
                                tiled=tiled, ring=ring)[0]
        if fp8:
            hp = nl.ndarray((P, nf, tb), dtype=nl.bfloat16, buffer=nl.sbuf)    # [128, nf, tb]
            _gate_evict(hp, sg, acc_u, widths, tb, q, i0, 0)
            q.track_max(hmax, hp, tb, pi == 0)
            h_parts.append((i0, i1, hp))
        else:
            _gate_evict(hT, sg, acc_u, widths, tb, None, i0, i0)
        del acc_u, sg
    return (h_parts, hmax, factor) if fp8 else hT


def _down_stage(hT, B, tb, H, I, wd, q, plan, tiled, sink, ring=None):
    """The down half of an expert step: the passes over ``hT [128, KI(e), tb]`` (FP8 codes,
    their token scales ``B``; bf16: B None), each handed to ``sink(acc [128, nf, Tp] PSUM, j0,
    widths, B)``; FP8's down channel scales are read from ``q.ws[2]``."""
    fp8 = q is not None
    Tp = D.acc_free(tb)
    d_tiles = D.feature_tiles([(0, H, 0)])
    for j0, j1 in D.group_passes(d_tiles, plan.nf_d):
        widths = [d_tiles[j][1] for j in range(j0, j1)]
        acc = D.gemm_pass([wd], hT, I, tb, Tp, widths, d_tiles[j0][0], plan.kb_d, fp8,
                          tiled=tiled, ring=ring)[0]
        sink(acc, j0, widths, B)
        del acc


def _decode_pipelined(x, w_gu, w_d, comb, ids_sb, n_sb, xT, A, I, q, plan, tiled, ones, ident_f,
                      sink, ring_depth, turns=()):
    """The decode loop over the chosen experts (bf16 and FP8 weights), software-pipelined by
    one expert: iteration j issues the gate/up stage of slot j + 1 (its scale columns, the
    gate/up GEMM and evictions, FP8's |h|max), the down stage of slot j (its GEMM and the
    accumulation into the sink), then the rest of slot j + 1 (FP8: h quantized per token; bf16:
    h) into the tiles the next iteration's down stage reads. Each engine runs its queue in
    order, so TensorE goes on to slot j + 1's gate/up and slot j's down while VectorE / ScalarE
    / GpSimd finish slot j + 1's h, instead of idling until it is quantized, as an
    expert-serial body does.

    The body of a hardware loop is traced once: the carried tiles (h, FP8's token scales and
    down channel scales) are allocated here. Counts ``n_sb [1, 3]``: n, max(n - 1, 0) and
    min(n, 1); the prologue (slot 0) and the epilogue (slot n - 1) are loops of min(n, 1)
    iterations, so n = 0 runs neither."""
    T, H = x.shape
    KI, KT = cdiv(I, P), cdiv(H, P)
    fp8 = q is not None
    ring = _decode_ring(H, I, plan, fp8, tiled, w_gu.dtype, ring_depth)
    hc = nl.ndarray((P, KI + (KI % 2 if fp8 else 0), T), dtype=q.dtype if fp8 else nl.bfloat16,
                    buffer=nl.sbuf)                                              # [128, KIe, T]
    # FP8: quantize_parts zeroes hc's double_row pad tile itself
    if fp8:
        Bc = nl.ndarray((P, T), dtype=nl.float32, buffer=nl.sbuf)              # [128, T]
        cdc = nl.ndarray((P, KT), dtype=nl.float32, buffer=nl.sbuf)            # [128, KT]

    def gate_up(k, j):
        wgu = w_gu.select(0, _slot_register(ids_sb, k, j))
        meta = nl.ndarray((1, comb.shape[1]), dtype=nl.float32, buffer=nl.sbuf)  # [1, T(+2I+H)]
        nisa.dma_copy(dst=meta, src=_slot_row(comb, k, j))
        if fp8:
            _scale_cols(q, meta[:, T:T + 2 * I], meta[:, T + 2 * I:T + 2 * I + H], I, H,
                        ident_f)
            wrow = meta[:, 0:T]                                                 # [1, T]
        else:
            wrow = _row_broadcast(meta[:, 0:T], T, ones)                        # [128, T]
        return (_gate_up_stage(xT, A, T, H, I, wgu, wrow, q, plan, tiled, ring),
                q and q.ws[2])

    def scales(h, cd):
        """FP8: the token scale rows of h (into tiles of this iteration)."""
        if not fp8:
            return h, cd
        h_parts, hmax, factor = h
        return (h_parts, *q.h_scales(hmax, T, factor)), cd

    def rest(h, cd):
        if fp8:
            h_parts, sc, inv = h
            q.quantize_parts(h_parts, sc, inv, KI, T, out=(hc, Bc))
            nisa.tensor_copy(dst=cdc, src=cd, engine=nisa.engine.gpsimd)
        else:
            nisa.tensor_copy(dst=hc, src=h, engine=nisa.engine.gpsimd)

    def down(k, j):
        wd = w_d.select(0, _slot_register(ids_sb, k, j))
        if fp8:
            q.ws = (None, None, cdc)
        _down_stage(hc, Bc if fp8 else None, T, H, I, wd, q, plan, tiled, sink, ring)

    regs = []
    for c in range(1, 3):
        r = nisa.register_alloc()
        nisa.register_load(dst=r, src=n_sb[0:1, c:c + 1])
        regs.append(r)
    m_reg, one_reg = regs
    nl.fori_loop(0, one_reg, lambda j: rest(*scales(*gate_up(0, j))))

    def step(j):
        h = scales(*gate_up(1, j))      # before down(j): VectorE has the scales ready when
        down(0, j)                      # TensorE reaches rest's broadcasts
        rest(*h)

    nl.fori_loop(0, m_reg, _traced_once(step, ring, turns))
    nl.fori_loop(0, one_reg, lambda j: down(0, m_reg))


def _traced_once(body, ring=None, turns=()):
    """``body`` for ``nl.fori_loop``, as the device runs it: one traced copy, so the Python state
    the body advances (the weight ring's next slot, the eviction engines' turn in the one-element
    lists ``turns``) starts every iteration where it stood when the loop was traced (here)."""
    n0, t0 = ring.n if ring is not None else 0, [t[0] for t in turns]

    def run(j):
        if ring is not None:
            ring.n = n0
        for t, v in zip(turns, t0):
            t[0] = v
        body(j)
    return run


def _decode_ring(H, I, plan, fp8, tiled, dtype, depth):
    """The weight ring of the decode loop (``_decode_ring_shape``), allocated once and shared
    by the gate/up and the down transfers: the k-th transfer of the loop then waits for the
    matmuls that read its slot a ring's depth of transfers back (a window of transfers in
    program order), where a fresh tile per transfer leaves every weight load free to start at
    once under the SBUF bound, queued ahead of the ones the next matmuls wait for. ``depth``
    0: None (fresh tiles)."""
    if not depth:
        return None
    n, kn, c = _decode_ring_shape(H, I, plan, fp8, tiled)
    return D.WeightRing(n, kn, dtype, depth, ncols=c)


def _load_scales(q, s_gu, s_d, e, I, H, ident_f):
    """FP8 per-channel scales of expert ``e`` (rows ``[E, 2I]`` / ``[E, H]``; ``e`` None: the
    vectors ``[2I]`` / ``[H]`` of the shared expert) -> per-partition columns in ``q.ws``.
    Each row arrives in one DMA descriptor (a strided load straight into columns would cost one
    descriptor per partition, ~5% of an FP8 expert's weight stream) and is turned into columns by
    K=1 PE transposes of its 128-element chunks."""
    rows = []
    for src, n in ((s_gu, 2 * I), (s_d, H)):
        row = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)             # [1, n]
        nisa.dma_copy(dst=row, src=src[nl.ds(e, 1), :] if e is not None else src.reshape((1, n)))
        rows.append(row)
    _scale_cols(q, rows[0], rows[1], I, H, ident_f)


def _scale_cols(q, row_gu, row_d, I, H, ident_f):
    """Scale rows ``[1, 2I]``, ``[1, H]`` (SBUF) -> per-partition columns in ``q.ws``."""
    KI = I // P
    cg, cd = _columns(row_gu, 2 * I, ident_f), _columns(row_d, H, ident_f)
    q.ws = (cg[:, 0:KI], cg[:, KI:2 * KI], cd)


def _columns(row, n, ident_f):
    """A row ``[1, n]`` (SBUF fp32, n a multiple of 128) -> ``[128, n/128]``, element
    ``c * 128 + p`` at ``[p, c]`` (K=1 PE transposes, one ScalarE eviction)."""
    ps = nl.ndarray((P, n // P), dtype=nl.float32, buffer=nl.psum)              # [128, n/128]
    for j in range(n // P):
        nisa.nc_matmul(dst=ps[:, j:j + 1], stationary=row[0:1, j * P:(j + 1) * P],
                       moving=ident_f[0:1, 0:1], is_transpose=True)
    col = nl.ndarray((P, n // P), dtype=nl.float32, buffer=nl.sbuf)             # [128, n/128]
    nisa.tensor_copy(dst=col, src=ps, engine=nisa.engine.scalar)
    return col


def _row_broadcast(src_row, n, ones):
    """HBM row view ``[1, n]`` (fp32; or an SBUF row) -> SBUF ``[128, n]``, the same row on every
    partition: one DMA descriptor, then ``ones[1, 128].T @ row`` on TensorE (a broadcast DMA
    would move 128 short runs, one descriptor each)."""
    if src_row.buffer == nl.sbuf:
        row = src_row
    else:
        row = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)             # [1, n]
        nisa.dma_copy(dst=row, src=src_row)
    ps = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum)                  # [128, n]
    nisa.nc_matmul(dst=ps, stationary=ones, moving=row)
    out = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.sbuf)                 # [128, n]
    nisa.tensor_copy(dst=out, src=ps, engine=nisa.engine.scalar)
    return out


def _x_mx(subs, tb, H, ident, x4, out=None):
    """Token rows ``[(s0, ts, x_sb [ts, H] bf16)]`` -> MX activations for ``nc_matmul_mx``:
    ``xq [128, KT, tb]`` x4 (chunk c, partition p, lane q = ``x[t, 512c + 4p + q]``, the MX tile
    layout of the gate/up weight) and their E8M0 scales ``xs [128, SL, tb]`` (quadrant slots).
    Per chunk and sub-tile: four PE transposes of the columns ``q::4``, one interleaving
    eviction, one ``quantize_mx`` (blocks of 32 consecutive hidden values of a token).
    ``out``: the (xq, xs) tiles to write instead of new ones."""
    KT = cdiv(H, CHUNK)
    xq, xs = out if out is not None else (
        nl.ndarray((P, KT, tb), dtype=x4, buffer=nl.sbuf),                      # [128, KT, tb]
        nl.ndarray((P, cdiv(KT, 4), tb), dtype=nl.uint8, buffer=nl.sbuf))       # [128, SL, tb]
    n = 0
    for s0, ts, x_sb in subs:
        for c in range(KT):
            kk = min(P, (H - c * CHUNK) // 4)
            c0 = c * CHUNK
            tp = nl.ndarray((kk, 4, ts), dtype=x_sb.dtype, buffer=nl.psum)       # [kk, 4, ts]
            for q in range(4):
                nisa.nc_matmul(dst=tp[:, q, :], stationary=x_sb[0:ts, c0 + q:c0 + 4 * kk:4],
                               moving=ident[0:ts, 0:ts], is_transpose=True)
            aT = nl.ndarray((kk, ts, 4), dtype=x_sb.dtype, buffer=nl.sbuf)       # [kk, ts, 4]
            eng = nisa.engine.scalar if n % 2 else nisa.engine.vector
            nisa.tensor_copy(dst=aT.permute((0, 2, 1)), src=tp, engine=eng)
            n += 1
            nisa.quantize_mx(dst=xq[0:kk, c, s0:s0 + ts], src=aT,
                             dst_scale=xs[4 * (c % 4):P, c // 4, s0:s0 + ts])
    return xq, xs


def _mx_views(w_gu, s_gu, w_d, s_d, e):
    """MX data (x4 views) and scale images of expert ``e`` (a register; None: as given)."""
    if e is None:
        return w_gu, s_gu, w_d, s_d
    return w_gu.select(0, e), s_gu.select(0, e), w_d.select(0, e), s_d.select(0, e)


# rows 4..7 and 12..15 of each quadrant <- rows 20..23 and 28..31 (the staged scale rows)
_SHUFFLE_SCALES = [16 + i if (i // 4) % 2 else 255 for i in range(16)] + [255] * 16


def _mx_scales(s, shape, dge=None):
    """All the E8M0 scales of one MX weight (image ``s [64, n]`` in HBM) -> SBUF
    ``[128, *shape]`` (image row 16Q + r at partition 32Q + r; ``shape`` covers n bytes), ahead
    of the data, one run per image row (a run per weight group would be shorter than a DMA
    descriptor's fixed cost: ~30% efficiency).

    Scales sit at partitions 0..15 of each quadrant, which only DMA queues 4Q and 4Q+1 serve
    (8 partitions per queue), so those queues would carry every scale byte besides their share
    of the weight stream. Rows 4..7 and 12..15 of each quadrant therefore land 16 partitions
    lower (partitions 20..23, 28..31: queues 4Q+2, 4Q+3) in a staging tile, and one
    ``nc_stream_shuffle`` (VectorE, within each quadrant) moves them up: every queue carries a
    quarter of the quadrant's scale rows.

    ``dge``: None (static descriptors, the weight stream's ring) or a ``nisa.dge_mode`` for these
    loads alone. Decode passes ``swdge``: the GpSimd ring is idle there, and on the weights'
    ring an expert's scale loads (ready only once the previous expert's matmuls have read the
    tile) wait behind the weight transfers already queued, FIFO, and hold its first matmuls."""
    kw = {} if dge is None else dict(dge_mode=dge)
    ws = nl.ndarray((P, *shape), dtype=nl.uint8, buffer=nl.sbuf)               # [128, *shape]
    st = nl.ndarray((P, *shape), dtype=nl.uint8, buffer=nl.sbuf)               # [128, *shape]
    for Q in range(4):
        for r in range(0, 16, 4):
            p = 32 * Q + r + (16 if (r // 4) % 2 else 0)
            nisa.dma_copy(dst=(st if (r // 4) % 2 else ws)[p:p + 4],
                          src=s[16 * Q + r:16 * Q + r + 4, :], **kw)
    nisa.nc_stream_shuffle(dst=ws, src=st, shuffle_mask=_SHUFFLE_SCALES)
    return ws


def _gu_units(I):
    """The gate (or up) output units ``[(col0, width)]``: unit ``4c + q`` is lane q of down
    chunk c (:func:`down_chunks`): a whole 128-column tile, or for a narrow tail chunk a
    ``kp``-column slice of one (its outputs then land on partitions 0..kp-1)."""
    units = []
    for r0, n, kp in down_chunks(I):
        for q in range(4):
            if kp * q < n:
                units.append((r0 + kp * q, kp))
    return units


def _gu_tiles(w, g0, g1, H, x4):
    """Gate|up weight tiles ``[g0, g1)`` (128 columns each) -> SBUF ``[128, g, KT, 128]`` x4."""
    KT = cdiv(H, CHUNK)
    wq = nl.ndarray((P, g1 - g0, KT, P), dtype=x4, buffer=nl.sbuf)             # [128, g, KT, 128]
    _load_data_tiles(w, wq, KT, 0, KT, g0 * P, (g1 - g0) * P)
    return wq


def _gu_pass(w, ws, c_off, units, H, kb, xq, xs, acc, x4, first=None):
    """``acc[0:w_u, u, 0:N] = W[:, c_off + col0_u ..].T @ x`` for the gate (c_off 0) or up
    (c_off I) units of one pass, over the KT(H) chunks of x: MX data ``w [128, KT*2I]`` x4 in
    HBM (the MX tile layout), scales ``ws [128, 2I/128, SL, 128]`` in SBUF; the 128-column
    tiles covering the units load ``kb`` at a time (one contiguous run per partition).
    ``first``: the first group's tile, loaded already (:func:`_gu_tiles`)."""
    KT = cdiv(H, CHUNK)
    N = xq.shape[2]
    t_lo = (c_off + units[0][0]) // P
    t_hi = cdiv(c_off + units[-1][0] + units[-1][1], P)
    for g0 in range(t_lo, t_hi, kb):
        g1 = min(t_hi, g0 + kb)
        wq = first if (g0 == t_lo and first is not None) else _gu_tiles(w, g0, g1, H, x4)
        for u, (col0, wu) in enumerate(units):
            t, off = divmod(c_off + col0, P)
            if not g0 <= t < g1:
                continue
            for c in range(KT):
                kk = min(P, (H - c * CHUNK) // 4)
                o = 4 * (c % 4)
                nisa.nc_matmul_mx(dst=acc[0:wu, u, 0:N], stationary=wq[0:kk, t - g0, c, off:off + wu],
                                  moving=xq[0:kk, c, 0:N],
                                  stationary_scale=ws[o:P, t, c // 4, off:off + wu],
                                  moving_scale=xs[o:P, c // 4, 0:N], accumulate=(c > 0))
        del wq


def _down_pass(w, ds, chunks, j0, nf, kb, hq, hs, acc, x4):
    """``acc[:, f, 0:N] = W_d[:, 128(j0 + f) ..].T @ h`` over the down chunks: MX data ``w
    [128, KC*H]`` x4 chunk-major in HBM (chunk c: columns [cH, (c+1)H)), scales ``ds [128, SL,
    H]`` in SBUF. Per group of ``kb`` tiles: the full chunks in one DMA, a tail chunk's ``kp``
    partitions in a second (its other partitions are never read)."""
    H = w.shape[1] // len(chunks)
    N = hq.shape[2]
    w3 = w.reshape_dim(1, (len(chunks), H))                                   # [128, KC, H]
    nfull = sum(1 for _, _, kp in chunks if kp == P)
    for g0 in range(j0, j0 + nf, kb):
        g1 = min(j0 + nf, g0 + kb)
        c0, gw = g0 * P, (g1 - g0) * P
        wq = nl.ndarray((P, len(chunks), gw), dtype=x4, buffer=nl.sbuf)       # [128, KC, gw]
        if nfull:
            nisa.dma_copy(dst=wq[:, 0:nfull, :], src=w3[:, 0:nfull, c0:c0 + gw])
        for c in range(nfull, len(chunks)):
            kp = chunks[c][2]
            nisa.dma_copy(dst=wq[0:kp, c, :], src=w3[0:kp, c, c0:c0 + gw])
        for j in range(g0, g1):
            for c, (_, _, kp) in enumerate(chunks):
                o = 4 * (c % 4)
                nisa.nc_matmul_mx(dst=acc[:, j - j0, 0:N],
                                  stationary=wq[0:kp, c, (j - g0) * P:(j - g0 + 1) * P],
                                  moving=hq[0:kp, c, 0:N],
                                  stationary_scale=ds[o:P, c // 4, j * P:(j + 1) * P],
                                  moving_scale=hs[o:P, c // 4, 0:N], accumulate=(c > 0))
        del wq


def _slot_register(plan_sb, k, j):
    """A register loaded with entry ``j + k`` of a plan row ``plan_sb [1, S]`` (int32 SBUF; ``j``
    the loop index, 0, or a register; ``k`` the pipelined loops' shift in slots)."""
    r = nisa.register_alloc()
    nisa.register_load(dst=r, src=plan_sb[0:1, k:plan_sb.shape[1]][0:1, nl.ds(j, 1)])
    return r


def _slot_row(a, k, j):
    """Row ``j + k`` of a plan array ``a [S, n]`` (HBM view ``[1, n]``; ``j``, ``k`` as in
    :func:`_slot_register`)."""
    return a[k:a.shape[0], :][nl.ds(j, 1), :]


def _expert_step_mx(xq, xs, tb, H, I, w_gu, s_gu, w_d, s_d, wrow, plan, x4, sink,
                    scale_dge=None):
    """One expert in MXFP8 (Trn3) on the token columns of ``xq``/``xs`` (:func:`_x_mx`):
    :func:`_mx_gate_up` -> :func:`_mx_quantize_h` -> :func:`_mx_down`, each down pass handed to
    ``sink(acc [128, nf, Tp] PSUM, j0, widths, None)``. ``scale_dge``: :func:`_mx_scales`."""
    KC = len(down_chunks(I))
    ds = []
    # DMA queues are FIFO with a few transfers in flight: the scale loads (short) go between
    # weight transfers (long), not in a row ahead of an expert's first weight bytes, where the
    # next transfer's setup latency would show (~0.8 us per expert, modeled)
    hT = _mx_gate_up(xq, xs, tb, H, I, w_gu, s_gu, wrow, plan, x4,
                     lambda: ds.append(_mx_scales(s_d, (cdiv(KC, 4), H), scale_dge)),
                     scale_dge)                                                  # ds [128, SL, H]
    hq = nl.ndarray((P, KC, tb), dtype=x4, buffer=nl.sbuf)                      # [128, KC, tb]
    hs = nl.ndarray((P, cdiv(KC, 4), tb), dtype=nl.uint8, buffer=nl.sbuf)       # [128, SL, tb]
    _mx_quantize_h(hT, I, hq, hs)
    del hT
    _mx_down(w_d, ds[0], I, H, tb, plan, hq, hs, x4, sink)


def _mx_gate_up(xq, xs, tb, H, I, w_gu, s_gu, wrow, plan, x4, after_first=None,
                scale_dge=None):
    """MXFP8 gate/up ``nc_matmul_mx`` passes (weight tiles stationary) over the output units of
    :func:`_gu_units` -> ``hT = wrow * silu(g) * u`` bf16 ``[128, 4KC, tb]`` (unit 4c + q = lane
    q of down chunk c; ``wrow [128, tb]`` or None). The gate/up scales load after the first
    weight tile, and ``after_first`` runs once the first pass's GEMMs are issued (a caller's
    short loads then go between weight transfers). ``scale_dge``: :func:`_mx_scales`."""
    KTh = cdiv(H, CHUNK)
    KC = len(down_chunks(I))
    Tp = D.acc_free(tb)
    hT = nl.ndarray((P, 4 * KC, tb), dtype=nl.bfloat16, buffer=nl.sbuf)        # [128, 4KC, tb]
    gs = None
    units = _gu_units(I)
    if len(units) < 4 * KC:     # the empty lane of a 384-row tail (zero weight rows)
        nisa.memset(dst=hT[:, len(units):4 * KC, :], value=0.0)
    for i0, i1 in D.group_passes(units, plan.nf_gu):
        nf = i1 - i0
        widths = [wu for _, wu in units[i0:i1]]
        acc_g = nl.ndarray((P, nf, Tp), dtype=nl.float32, buffer=nl.psum)        # [128, nf, Tp]
        acc_u = nl.ndarray((P, nf, Tp), dtype=nl.float32, buffer=nl.psum)        # [128, nf, Tp]
        if gs is None:
            t0 = units[i0][0] // P
            t1 = cdiv(units[i1 - 1][0] + units[i1 - 1][1], P)
            first = _gu_tiles(w_gu, t0, min(t0 + plan.kb_gu, t1), H, x4)
            gs = _mx_scales(s_gu, (2 * I // P, cdiv(KTh, 4), P), scale_dge)      # [128, 2I/128, SL, 128]
            _gu_pass(w_gu, gs, 0, units[i0:i1], H, plan.kb_gu, xq, xs, acc_g, x4, first)
        else:
            _gu_pass(w_gu, gs, 0, units[i0:i1], H, plan.kb_gu, xq, xs, acc_g, x4)
        _gu_pass(w_gu, gs, I, units[i0:i1], H, plan.kb_gu, xq, xs, acc_u, x4)
        if after_first is not None:
            after_first()
            after_first = None
        sg = _silu_evict(acc_g, widths, tb, None, None, i0)                     # [128, nf, tb]
        del acc_g
        if wrow is not None:   # the routing weight of each token (0: it did not choose it)
            nisa.tensor_tensor(dst=sg, data1=sg, data2=wrow.expand_dim(1).broadcast(1, nf),
                               op=nl.multiply, engine=nisa.engine.gpsimd)
        _gate_evict(hT, sg, acc_u, widths, tb, None, i0, i0)
        del acc_u, sg
    return hT


def _mx_quantize_h(hT, I, hq, hs):
    """``hT`` (:func:`_mx_gate_up`) -> MX operand ``hq [128, KC, tb]`` x4 and its scales ``hs
    [128, SL, tb]``, per down chunk straight from hT (``quantize_mx`` over ``[kp, tb, 4]``)."""
    for c, (_, _, kp) in enumerate(down_chunks(I)):
        nisa.quantize_mx(dst=hq[0:kp, c, :], src=hT[0:kp, 4 * c:4 * c + 4, :].permute((0, 2, 1)),
                         dst_scale=hs[4 * (c % 4):P, c // 4, :])


def _mx_down(w_d, ds, I, H, tb, plan, hq, hs, x4, sink):
    """The down passes on ``hq``/``hs`` (down scales ``ds`` in SBUF), each handed to
    ``sink(acc [128, nf, Tp] PSUM, j0, widths, None)``."""
    chunks = down_chunks(I)
    Tp = D.acc_free(tb)
    d_tiles = D.feature_tiles([(0, H, 0)])
    for j0, j1 in D.group_passes(d_tiles, plan.nf_d):
        widths = [d_tiles[j][1] for j in range(j0, j1)]
        acc = nl.ndarray((P, j1 - j0, Tp), dtype=nl.float32, buffer=nl.psum)     # [128, nf, Tp]
        _down_pass(w_d, ds, chunks, j0, j1 - j0, plan.kb_d, hq, hs, acc, x4)
        sink(acc, j0, widths, None)
        del acc


@nki.jit
def fused_moe_decode_kernel(x, w_gu, w_d, experts, n_active, comb, s_gu, s_d, sh_gu, sh_d,
                            ss_gu, ss_d, combined, nf_gu, nf_d, kb_gu, kb_d, tiled, fused,
                            mx=None, ring=0):
    """Decode MoE: each distinct chosen expert read once, all tokens through it.

    Dimensions:
      1 <= T <= 128 tokens, H hidden, I expert width, E local experts, S = min(E, T*k) slots.
    Args:
      x: [T, H] bf16 HBM.  w_gu: [E, H, 2I], w_d: [E, I, H] (tiled: [E, 2I/128, 128, KTe, 128],
        [E, H/128, 128, KTe, 128]) bf16 or FP8, HBM.
      experts: [1, S] int32 (the first n_active are the distinct chosen local experts).
      n_active: [1, 3] int32 (n, max(n - 1, 0), min(n, 1)).
      comb: [S, T] fp32 routing weight of each token per slot (FP8: [S, T + 2I + H], the slot's
        expert's gate|up and down scale rows appended).
      s_gu: [E, 2I], s_d: [E, H] fp32 FP8 per-channel scales, else None.
      sh_gu: [H, 2Is], sh_d: [Is, H] shared expert (ss_gu [2Is], ss_d [H] FP8 scales) or None.
      combined, nf_gu, nf_d, kb_gu, kb_d, tiled, fused: from MoEPlan.
      ring: bf16 / FP8, slots of the weight ring (``plan_decode_ring``; 0: fresh tiles).
      mx: None, or the x4 dtype of MXFP8 weights (Trn3): w_gu uint32 [E, 128, KT(H)*2I] and
        w_d uint32 [E, 128, KC*H] (``quantize_expert_weights_mx``: gate|up in the MX tile
        layout, down chunk-major in the x4 order of ``pack_down_chunks``), s_gu uint8
        [E, 64, SL(H)*2I] / s_d [E, 64, SL(I)*H] their scale images; the shared expert
        likewise without the expert dim.
    Returns:
      y: [T, H] bf16, shared HBM.
    Notes:
      fp32 accumulation of the weighted expert sum (SBUF); x, h rounded to bf16 (or FP8 per
      token, or MXFP8 blocks of 32 with ``quantize_mx``) as GEMM inputs.
    Pseudocode:
      xT[h, t] = x[t, h]                                     # PE transposes (FP8: quantized)
      yacc[h, t] = shared(x)[t, h] or 0                      # fp32 SBUF
      fori s in [0, n_active):                                # hardware loop, runtime count
        e = register(experts[s]); w[t] = comb[s, t]
        hT[i, t] = w[t] * silu(Wg[e].T @ xT) * (Wu[e].T @ xT)   # weights via select(0, e)
        yacc[h, t] += (Wd[e].T @ hT)[h, t]
      (bf16 / FP8: pipelined by one expert, _decode_pipelined: the gate/up of s + 1 issued
      ahead of the down of s)
      y[t, h] = transpose(yacc)
    """
    T, H = x.shape
    I = _kernel_width(w_gu, H, tiled, mx)
    KT = cdiv(H, P)
    fp8 = s_gu is not None and mx is None
    plan = MoEPlan("decode", T, combined, nf_gu, nf_d, kb_gu, kb_d, fused)
    y = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    ids_sb = nl.ndarray((1, experts.shape[1]), dtype=nl.int32, buffer=nl.sbuf)   # [1, S]
    nisa.dma_copy(dst=ids_sb, src=experts)
    n_sb = nl.ndarray((1, 3), dtype=nl.int32, buffer=nl.sbuf)                     # [1, 3]
    nisa.dma_copy(dst=n_sb, src=n_active)
    ident = D.identity(nl.bfloat16)
    ident_f = D.identity(nl.float32)
    ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)                 # [1, 128]
    nisa.memset(dst=ones, value=1.0)
    q = _Fp8(w_gu.dtype, None, None) if fp8 else None
    rows = D.x_rows_normalised(x, 0, T)
    if mx is not None:
        xq, xs = _x_mx(rows, T, H, ident, mx)
        w_gu, w_d = w_gu.view(mx), w_d.view(mx)
        if sh_gu is not None:
            sh_gu, sh_d = sh_gu.view(mx), sh_d.view(mx)
    else:
        _x_quantize(rows, q, all_steps=True)
        a_row = nl.ndarray((1, T), dtype=nl.float32, buffer=nl.sbuf) if fp8 else None  # [1, T]
        xT, A = _x_block(rows, T, H, None, ident, ident_f, q, w_gu.dtype, a_row)
        A = (A, a_row) if fp8 else None
    yacc = nl.ndarray((P, KT, T), dtype=nl.float32, buffer=nl.sbuf)                # [128, KT, T]
    nisa.memset(dst=yacc, value=0.0)
    ev = [0]

    def sink(acc, j0, widths, B):
        if B is not None:
            yT = nl.ndarray((P, len(widths), T), dtype=nl.float32, buffer=nl.sbuf)  # [128, nf, T]
            _evict_y(yT, acc, widths, T, q, B, j0, ev)
            src = yT
        else:
            src = acc
        for a, b, nn in _runs(widths):
            nisa.tensor_tensor(dst=yacc[0:nn, j0 + a:j0 + b, :], data1=yacc[0:nn, j0 + a:j0 + b, :],
                               data2=src[0:nn, a:b, 0:T], op=nl.add)

    if sh_gu is not None and mx is not None:     # the shared expert in MXFP8
        Is = sh_gu.shape[1] // (2 * cdiv(H, CHUNK))
        _expert_step_mx(xq, xs, T, H, Is, sh_gu, ss_gu, sh_d, ss_d, None,
                        plan_tiles_mx("decode", T, H, Is), mx, sink)
    elif sh_gu is not None:      # the shared expert: static weights, every token, weight 1
        Is = sh_d.shape[0] if not tiled else sh_gu.shape[0] * P // 2
        if fp8:
            _load_scales(q, ss_gu, ss_d, None, Is, H, ident_f)
        sp = plan_tiles("decode", T, H, Is, 1 if fp8 else 2, tiled)
        _expert_step(xT, A, T, H, Is, sh_gu, sh_d, None, q, sp, tiled, sink)

    widths = [t[1] for t in D.feature_tiles([(0, H, 0)])]
    if mx is None:
        _decode_pipelined(x, w_gu, w_d, comb, ids_sb, n_sb, xT, A, I, q, plan, tiled, ones,
                          ident_f, sink, ring, turns=(ev,))
        if H % P == 0 and T <= P // 8:
            # grouped bf16 transposes, as MX (at T = 1 one instead of 16): the tail after the
            # last weight byte is shorter (T = 1, 8); at T = 64 (two tiles per transpose) the
            # rounding pass over yacc first made it longer (modeled)
            _store_y_bf16(y, ident, yacc, T, widths)
        else:
            _store_y(y, None, ident_f, yacc, 0, T, 0, widths)
        return y

    # MXFP8: one expert per iteration
    comb_sb = None
    if comb.shape[0] * T * 4 <= COMB_RESIDENT_BYTES:
        # the whole plan in one DMA: a per-expert row DMA would sit in front of the weight
        # stream of its queue (~0.5 us each, modeled)
        comb_sb = nl.ndarray((1, comb.shape[0], T), dtype=nl.float32, buffer=nl.sbuf)  # [1, S, T]
        nisa.dma_copy(dst=comb_sb, src=comb.reshape((1, comb.shape[0], T)))

    def body(s):
        e = nisa.register_alloc()
        nisa.register_load(dst=e, src=ids_sb[0:1, nl.ds(s, 1)])
        row = nl.ndarray((1, T), dtype=nl.float32, buffer=nl.sbuf)              # [1, T]
        if comb_sb is not None:     # the slot's row from the resident plan (no DMA)
            nisa.tensor_copy(dst=row, src=comb_sb[0:1, nl.ds(s, 1), :], engine=nisa.engine.gpsimd)
        else:
            nisa.dma_copy(dst=row, src=comb[nl.ds(s, 1), :])
        wrow = _row_broadcast(row, T, ones)                                     # [128, T]
        _expert_step_mx(xq, xs, T, H, I, *_mx_views(w_gu, s_gu, w_d, s_d, e), wrow, plan, mx,
                        sink, scale_dge=nisa.dge_mode.swdge)

    n_reg = nisa.register_alloc()
    nisa.register_load(dst=n_reg, src=n_sb[0:1, 0:1])
    nl.fori_loop(0, n_reg, _traced_once(body, turns=(ev,)))
    _store_y_bf16(y, ident, yacc, T, widths)
    return y


def _store_y_bf16(y, ident, yacc, T, widths):
    """fp32 ``yacc [128, KT, T]`` -> ``y [T, H]`` bf16 (H a multiple of 128): rounded to bf16
    first (VectorE), then bf16 PE transposes of ``g = 128 // T`` feature tiles at once (the
    stationary ``[128, g*T]`` view: out row ``f*T + t`` = ``y[t, 128f ..]``), stored with one
    DMA per group. This epilogue sits on the kernel's tail after the last weight byte, so it
    is kept short: at T = 1 one transpose instead of 16 fp32 ones."""
    KT = len(widths)
    yb = nl.ndarray((P, KT, T), dtype=y.dtype, buffer=nl.sbuf)                   # [128, KT, T]
    nisa.tensor_copy(dst=yb, src=yacc)
    g = max(1, P // T)
    y3 = y.reshape_dim(1, (KT, P))                                              # [T, KT, 128]
    for i, f0 in enumerate(range(0, KT, g)):
        f1 = min(KT, f0 + g)
        m = (f1 - f0) * T
        tp = nl.ndarray((m, P), dtype=y.dtype, buffer=nl.psum)                  # [g*T, 128]
        nisa.nc_matmul(dst=tp, stationary=yb[:, f0:f1, :], moving=ident, is_transpose=True)
        y_sb = nl.ndarray((m, P), dtype=y.dtype, buffer=nl.sbuf)                # [g*T, 128]
        eng = nisa.engine.scalar if i % 2 else nisa.engine.vector
        nisa.tensor_copy(dst=y_sb, src=tp, engine=eng)
        nisa.dma_copy(dst=y3[:, f0:f1, :].permute((1, 0, 2)), src=y_sb)


@nki.jit
def fused_moe_prefill_kernel(x, w_gu, w_d, be_a, n_a, gi_a, si_a, bw_a, be_b, n_b, gi_b, si_b,
                             bw_b, s_gu, s_d, sh_gu, sh_d, ss_gu, ss_d, tiled, plan_a, plan_b,
                             mx=None, sh_tb=None):
    """Prefill MoE: blockwise GEMMs over tokens grouped by expert.

    Dimensions:
      T tokens, H hidden, I expert width, E local experts; NBa full-block slots of tb tokens and
      NBb tail- or merged-block slots of tt tokens (the ``_b`` arrays None: none).
    Args:
      x: [T, H] bf16 HBM; weights and scales as in ``fused_moe_decode_kernel``.
      be_*: [C, NB] int32 expert of each block; n_*: [C, 2] int32 (blocks used n, and
        max(n - 1, 0): the pipelined loop's iterations); row c for core c (C = 1, or 2 at LNC 2).
      gi_*, si_*: [C NB, tb] int32 token rows to gather / to scatter-add to (T = padding,
        skipped); core c's blocks in rows [c NB, (c + 1) NB).
      bw_*: [C NB, tb] fp32 routing weight of each row (0 for padding).
      plan_a, plan_b: (combined, nf_gu, nf_d, kb_gu, kb_d, fused) of each block size.
      mx: None, or the x4 dtype of MXFP8 weights (as in ``fused_moe_decode_kernel``).
      sh_tb: token block of the shared expert (``shared_block``; None: the full block size).
    Returns:
      y: [T, H] bf16, shared HBM.
    Notes:
      The weighted rows are added into an fp32 HBM accumulator by DMA read-modify-write
      (``dma_compute``, fp32 in the DMA engines): the weighted sum is accumulated in fp32.
      LNC 2: each core runs its own experts' blocks (plan_prefill_routing) into its own fp32
      accumulator; after a core barrier, the shared expert for every other token block, or
      (without one) every other 128-row tile of y as the sum of the two accumulators.
      The shared expert runs last, so that its output rows finish y (its fp32 rows plus the
      accumulators' rows, cast to bf16 by the DMA engines) while TensorE computes its next
      block: no pass over the fp32 accumulator trails the kernel.
    Pseudocode:
      y32 = 0                                 # fp32 HBM, in column slabs (_Accumulators)
      for (blocks, tb) in (full blocks, tb), (tail blocks, tt):   # _PrefillPipe's stages:
        front(b):   rows = x[gidx[b]]                         # indirect DMA gather
        prep(b):    xT = transpose(rows) (FP8 / MX: quantized)
        gate_up(b): G, U = Wg[e_b].T @ xT, Wu[e_b].T @ xT     # e_b = register(blk_expert[b])
        rest(b):    hT = silu(G) * U (MX: * bw[b])
        down(b):    y32[sidx[b]] += bw[b] * (hT.T @ Wd[e_b])   # bf16: token rows (FP8:
                                                     # transposed); scatter-add
        front(0); prep(0); gate_up(0); front(1); prep(1); rest(0)
        fori j in [0, n_blocks - 1):                          # hardware loop, runtime count
          front(j+2); gate_up(j+1); down(j); prep(j+2); rest(j+1)   # bf16: prep, then down
        down(n_blocks - 1)
      y = bf16(y32 + shared(x)) (without a shared expert: bf16(y32))   # by token block
    """
    T, H = x.shape
    I = _kernel_width(w_gu, H, tiled, mx)
    fp8 = s_gu is not None and mx is None
    if mx is not None:
        w_gu, w_d = w_gu.view(mx), w_d.view(mx)
        if sh_gu is not None:
            sh_gu, sh_d = sh_gu.view(mx), sh_d.view(mx)
    programs, pid = lnc_programs()
    if be_a.shape[0] != programs:
        raise ValueError(f"fused_moe_prefill_kernel: the plan is for {be_a.shape[0]} cores; "
                         f"launched on {programs}")
    y = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    y32 = _Accumulators(T, H, programs, pid)
    ident = D.identity(nl.bfloat16)
    ident_f = D.identity(nl.float32)
    q = _Fp8(w_gu.dtype, None, None) if fp8 else None
    d_widths = [t[1] for t in D.feature_tiles([(0, H, 0)])]
    loops = []
    for be, nbk, gidx, sidx, bw, pl in ((be_a, n_a, gi_a, si_a, bw_a, plan_a),
                                        (be_b, n_b, gi_b, si_b, bw_b, plan_b)):
        if be is None:
            continue
        NB = be.shape[1]
        be_sb = nl.ndarray((1, NB), dtype=nl.int32, buffer=nl.sbuf)            # [1, NB]
        nisa.dma_copy(dst=be_sb, src=be[pid:pid + 1, :])
        n_sb = nl.ndarray((1, 2), dtype=nl.int32, buffer=nl.sbuf)              # [1, 2]
        nisa.dma_copy(dst=n_sb, src=nbk[pid:pid + 1, :])
        rows = slice(pid * NB, (pid + 1) * NB)
        loops.append((be_sb, n_sb, gidx[rows, :], sidx[rows, :], bw[rows, :],
                      MoEPlan("prefill", gidx.shape[1], *pl)))

    # y32 = 0: the routed experts scatter-add into it (at LNC 2 each core into its own). The
    # zeros take a DMA ring of their own (hardware DGE from Sync; a ring is tied to the trigger
    # engine and descriptor method, NKI DMA guide), served round robin beside the first
    # blocks' weight loads instead of ahead of them
    zero = nl.ndarray((P, ACC_COLS), dtype=nl.float32, buffer=nl.sbuf)         # [128, W]
    nisa.memset(dst=zero, value=0.0)
    for a in range(0, T, P):
        n = min(P, T - a)
        for slab in y32.mine:
            nisa.dma_copy(dst=slab[a:a + n, :], src=zero[0:n, 0:slab.shape[1]],
                          dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.sync)
    del zero

    for be_sb, n_sb, gidx, sidx, bw, plan in loops:
        # the pipelined loop: prologue, n - 1 iterations, the last block's down stage
        pipe = _PrefillPipe(x, w_gu, w_d, I, be_sb, gidx, sidx, bw, s_gu, s_d, q, plan, tiled,
                            y32, ident, ident_f, d_widths, mx)
        pipe.prep(pipe.front(0, 0))
        parts = pipe.gate_up(0, 0)
        pipe.prep(pipe.front(1, 0))
        pipe.rest(0, 0, *parts)

        def step(j, pipe=pipe):
            subs = pipe.front(2, j)
            parts = pipe.gate_up(1, j)
            if pipe.quantized:         # a long prep after the down stage (see front)
                pipe.down(0, j)
                pipe.prep(subs)
            else:
                pipe.prep(subs)
                pipe.down(0, j)
            pipe.rest(1, j, *parts)

        m_reg = nisa.register_alloc()
        nisa.register_load(dst=m_reg, src=n_sb[0:1, 1:2])
        nl.fori_loop(0, m_reg, step)
        pipe.down(0, m_reg)
        del pipe, step, parts          # the loop's tiles are dead: their space is free again
    if programs > 1:                   # both cores' scatter-adds are done before either reads
        for t in y32.all:
            nisa.core_barrier(t, tuple(range(programs)))
    if sh_gu is None:                  # y = bf16(sum of the accumulators), 128 rows at a time
        for i, r0 in enumerate(range(0, T, P)):
            rn = min(P, T - r0)
            r = slice(r0, r0 + rn)
            for g, (a, b) in enumerate(y32.bounds):
                if programs == 1:      # the DMA casts
                    nisa.dma_copy(dst=y[r, a:b], src=y32.mine[g][r, :])
                elif i % programs == pid:  # LNC 2: fp32 add in the DMA engines, then the cast
                    nisa.dma_compute(dst=y[r, a:b], srcs=[c[g][r, :] for c in y32.cores()],
                                     reduce_op=nl.add)
        return y

    # the shared expert last, token block by token block (at LNC 2 every other block): its
    # output rows finish y = bf16(shared(x) + the accumulators' rows), so no pass over y32
    # follows the routed loop
    if mx is not None:
        Is = sh_gu.shape[1] // (2 * cdiv(H, CHUNK))
    else:
        Is = sh_d.shape[0] if not tiled else sh_gu.shape[0] * P // 2
    if fp8:
        _load_scales(q, ss_gu, ss_d, None, Is, H, ident_f)
    for i, (t0, tbs) in enumerate(D.token_blocks(T, sh_tb or loops[0][5].tb)):
        if i % programs != pid:
            continue
        rows = D.x_rows_normalised(x, t0, tbs)
        cols = []

        def put(acc, j0, widths, B, t0=t0, tbs=tbs, cols=cols):
            yT, tc = _evicted_rows(acc, j0, widths, tbs, q, B, ident_f, cols)
            _store_rows(y, ident_f, yT, t0, tbs, d_widths[:j0], widths, None, tc, y32)

        if mx is not None:
            xq, xs = _x_mx(rows, tbs, H, ident, mx)
            _expert_step_mx(xq, xs, tbs, H, Is, sh_gu, ss_gu, sh_d, ss_d, None,
                            plan_tiles_mx("prefill", tbs, H, Is), mx, put)
            continue
        sp = plan_tiles("prefill", tbs, H, Is, 1 if fp8 else 2, tiled)
        _x_quantize(rows, q, all_steps=True)
        a_row = nl.ndarray((1, tbs), dtype=nl.float32, buffer=nl.sbuf) if fp8 else None
        xT, A = _x_block(rows, tbs, H, None, ident, ident_f, q, w_gu.dtype, a_row)
        if not fp8:    # bf16: the token-stationary down GEMM writes y's rows (no transposes)
            hT = _gate_up_stage(xT, None, tbs, H, Is, sh_gu, None, None, sp, tiled)
            _down_token_rows(sh_d, hT, Is, H, tbs, sp, tiled, None,
                             lambda n, c0, y_sb, t0=t0: _finish_rows(y, y_sb, t0 + n * P, c0, y32))
            continue
        _expert_step(xT, (A, a_row), tbs, H, Is, sh_gu, sh_d, None, q, sp, tiled, put, fp8)
    return y


class _Accumulators:
    """The prefill's fp32 accumulator ``y32 [T, H]`` as column slabs of ``ACC_COLS``, each an
    HBM tensor of its own (``mine``: this core's; at LNC 2 ``all``: one ``[cores, T, w]``
    shared tensor per slab, a core's scatter-adds racing the other's otherwise). A scatter-add
    is a DMA read-modify-write of rows known only at run time, so it is ordered after every
    earlier write to its tensor: with one tensor every scatter-add of the kernel waits for the
    previous one (modeled, Qwen3-30B-A3B T=4096 FP8: four per block in a chain, ~19 us a
    block); slabs give a chain per slab, and the column pieces of one pass run side by side."""

    def __init__(self, T, H, programs, pid):
        self.bounds = [(c, min(H, c + ACC_COLS)) for c in range(0, H, ACC_COLS)]
        if programs == 1:
            self.all = None
            self.mine = [nl.ndarray((T, b - a), dtype=nl.float32, buffer=nl.hbm)
                         for a, b in self.bounds]
        else:
            self.all = [nl.ndarray((programs, T, b - a), dtype=nl.float32, buffer=nl.shared_hbm)
                        for a, b in self.bounds]
            self.mine = [t[pid] for t in self.all]
        self.programs = programs

    def cores(self):
        """Every core's slabs: ``[core][slab]``."""
        if self.all is None:
            return [self.mine]
        return [[t[c] for t in self.all] for c in range(self.programs)]

    def pieces(self, c0, n):
        """Columns ``[c0, c0 + n)`` of y32 by slab: ``(slab, its first column, width, column
        from c0)``."""
        out = []
        for g, (a, b) in enumerate(self.bounds):
            lo, hi = max(a, c0), min(b, c0 + n)
            if lo < hi:
                out.append((g, lo - a, hi - lo, lo - c0))
        return out


def _index_col(row, s0, ts):
    """Token indices ``row[0, s0:s0+ts]`` of a plan row (HBM ``[1, tb]``) -> an int32 column
    ``[ts, 1]``, one per partition: the vector offset of a gather or scatter-add."""
    col = nl.ndarray((ts, 1), dtype=nl.int32, buffer=nl.sbuf)                  # [ts, 1]
    nisa.dma_copy(dst=col, src=row[:, s0:s0 + ts])
    return col


class _PrefillPipe:
    """The prefill's block loop (bf16 and FP8 weights), software-pipelined by one block.

    Stages of block b: ``front`` (gather its token rows, quantize them (FP8), PE-transpose them
    into the carried ``xT``), ``gate_up`` (the gate/up GEMM passes, each pass's PSUM drained at
    once: FP8 ``g * a_t`` on VectorE and ``u * channel scale`` on ScalarE; bf16 silu(g) on
    ScalarE and ``silu(g) * u`` on VectorE), ``rest`` (FP8: silu, h, |h|max per token and the
    scales on SBUF; both: h into the carried ``h``, the token's output scale into the carried
    row ``B``) and ``down`` (bf16: the token-stationary down GEMM, its token rows evicted
    scaled by ``B``; FP8: quantize the carried h, the down GEMM passes, evictions with the
    channel scale, transposes to token rows scaled by ``B``; then the scatter-add).

    Iteration b issues gate_up(b), front(b+1), down(b-1), rest(b). Each engine runs its queue in
    order, so TensorE goes on to front(b+1)'s transposes, down(b-1) and gate_up(b+1) while
    VectorE / ScalarE / GpSimd run rest(b), instead of waiting for it as a block-serial body
    does. gate_up(b)'s PSUM is drained ahead of front(b+1) on the engines that run both, so
    down(b-1) and gate_up(b+1) do not share PSUM with it in time. The routing weight and (FP8)
    the token's x scale are not multiplied into h: the down projection is linear per token and
    FP8 quantizes h per token, so both go into ``B``.

    A hardware loop's body is traced once and cannot hand its own tiles to the next iteration:
    the carried tiles (``xT``, ``A``, ``a_row``, ``h``, ``B``, ``inv``) are allocated here,
    outside it. Slots: ``k`` shifts the plan arrays by k blocks, ``j`` is the loop index (or
    0, or a register).
    """

    def __init__(self, x, w_gu, w_d, I, be_sb, gidx, sidx, bw, s_gu, s_d, q, plan, tiled, y32,
                 ident, ident_f, d_widths, mx=None):
        self.x, self.w_gu, self.w_d, self.be_sb = x, w_gu, w_d, be_sb
        self.gidx, self.sidx, self.bw, self.s_gu, self.s_d = gidx, sidx, bw, s_gu, s_d
        self.q, self.plan, self.tiled, self.y32 = q, plan, tiled, y32
        self.ident, self.ident_f, self.d_widths, self.mx = ident, ident_f, d_widths, mx
        H = x.shape[1]
        self.H, self.I = H, I
        self.KT, self.KI, self.tb = cdiv(H, P), cdiv(self.I, P), plan.tb
        self.quantized = q is not None or mx is not None
        fp8 = q is not None
        tb = self.tb
        if mx is not None:     # MXFP8: the carried activations are quantized
            KTh, KC = cdiv(H, CHUNK), len(down_chunks(self.I))
            self.xq = nl.ndarray((P, KTh, tb), dtype=mx, buffer=nl.sbuf)        # [128, KTh, tb]
            self.xs = nl.ndarray((P, cdiv(KTh, 4), tb), dtype=nl.uint8,
                                 buffer=nl.sbuf)                                 # [128, SL, tb]
            self.hq = nl.ndarray((P, KC, tb), dtype=mx, buffer=nl.sbuf)         # [128, KC, tb]
            self.hs = nl.ndarray((P, cdiv(KC, 4), tb), dtype=nl.uint8,
                                 buffer=nl.sbuf)                                 # [128, SL, tb]
            self.ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)    # [1, 128]
            nisa.memset(dst=self.ones, value=1.0)
            return
        KTe = self.KT + (self.KT % 2 if fp8 else 0)
        self.xT = nl.ndarray((P, KTe, tb), dtype=w_gu.dtype if fp8 else x.dtype,
                             buffer=nl.sbuf)                                     # [128, KTe, tb]
        self.h = nl.ndarray((P, self.KI, tb), dtype=nl.bfloat16, buffer=nl.sbuf)  # [128, KI, tb]
        self.B = nl.ndarray((1, tb), dtype=nl.float32, buffer=nl.sbuf)          # [1, tb]
        if fp8:
            self.A = nl.ndarray((P, tb), dtype=nl.float32, buffer=nl.sbuf)      # [128, tb]
            self.a_row = nl.ndarray((1, tb), dtype=nl.float32, buffer=nl.sbuf)  # [1, tb]
            self.inv = nl.ndarray((1, tb), dtype=nl.float32, buffer=nl.sbuf)    # [1, tb]

    def front(self, k, j):
        """The block's token rows gathered from x (indirect DMA) -> [(s0, ts, x_sb [ts, H])],
        handed to :meth:`prep`. Split from it so the loop body issues the gather first and,
        for FP8 / MX, the quantization and transposes after the down stage: TensorE runs in
        program order, and the transposes, behind the gather and VectorE's quantization, held
        the down matmuls (modeled, Qwen3-30B-A3B T=4096 FP8 Trn3: 6907 -> 5642 us). A bf16
        prep is transposes only; after the down stage it was slower (6564 -> 6626 us)."""
        x, H, tb = self.x, self.H, self.tb
        gi_row = _slot_row(self.gidx, k, j)
        subs = []
        for s0 in range(0, tb, P):
            ts = min(P, tb - s0)
            gi = _index_col(gi_row, s0, ts)                                     # [ts, 1]
            x_sb = nl.ndarray((ts, H), dtype=x.dtype, buffer=nl.sbuf)             # [ts, H]
            nisa.dma_copy(dst=x_sb, src=x.ap([[H, ts], [1, H]], offset=0, vector_offset=gi,
                                             indirect_dim=0))
            subs.append((s0, ts, x_sb))
        return subs

    def prep(self, subs):
        """Gathered rows (:meth:`front`) -> the carried x operand (xT; FP8 quantized, with A and
        a_row; MX: xq / xs)."""
        H, tb, q = self.H, self.tb, self.q
        if self.mx is not None:
            _x_mx(subs, tb, H, self.ident, self.mx, out=(self.xq, self.xs))
            return
        if q is None:
            D.x_transposed(subs, tb, H, None, self.ident, out=self.xT)
            return
        _x_quantize(subs, q, all_steps=True)
        q.row_scales(subs, tb, self.ident_f, out=self.A, row=self.a_row)
        D.x_transposed([r[:3] for r in subs], tb, H, None, self.ident, self.w_gu.dtype, True,
                       out=self.xT)

    def gate_up(self, k, j):
        """-> (drained passes [(i0, i1, a, b)], gate / up scale columns, the tokens' output
        factor row: the routing weight, times the x scale for FP8)."""
        I, H, tb, q, plan, tiled = self.I, self.H, self.tb, self.q, self.plan, self.tiled
        KI = self.KI
        fp8 = q is not None
        e = _slot_register(self.be_sb, k, j)
        wgu = self.w_gu.select(0, e)
        Tp = D.acc_free(tb)
        cg = None
        # the routing weights into a tile of this iteration: a DMA into a carried tile would be
        # ready only after that tile's last read, behind the weight loads already queued
        factor = nl.ndarray((1, tb), dtype=nl.float32, buffer=nl.sbuf)          # [1, tb]
        nisa.dma_copy(dst=factor, src=_slot_row(self.bw, k, j))
        if self.mx is not None:
            return self._gate_up_mx(e, factor)
        if fp8:
            row = nl.ndarray((1, 2 * I), dtype=nl.float32, buffer=nl.sbuf)      # [1, 2I]
            nisa.dma_copy(dst=row, src=self.s_gu[nl.ds(e, 1), :])
            cg = _columns(row, 2 * I, self.ident_f)                             # [128, 2KI]
            w, factor = factor, nl.ndarray((1, tb), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=factor, data1=self.a_row, data2=w, op=nl.multiply,
                               engine=nisa.engine.gpsimd)
        gu_tiles = D.feature_tiles([(0, I, 0)])
        if plan.fused:
            passes = [(0, KI)]
        else:
            passes = D.group_passes(gu_tiles, plan.nf_gu)
            wg, wu = (wgu[0:KI], wgu[KI:2 * KI]) if tiled else (wgu[:, 0:I], wgu[:, I:2 * I])
        parts = []
        for i0, i1 in passes:
            widths = [gu_tiles[i][1] for i in range(i0, i1)]
            c0 = gu_tiles[i0][0]
            nf = i1 - i0
            if plan.fused:
                acc = D.gemm_pass([wgu], self.xT, H, tb, Tp, widths + widths, 0, plan.kb_gu,
                                  fp8, tiled=tiled)[0]                           # [128, 2KI, Tp]
                acc_g, acc_u = acc[:, 0:nf, :], acc[:, nf:2 * nf, :]
                del acc
            elif plan.combined:
                acc_g, acc_u = D.gemm_pass([wg, wu], self.xT, H, tb, Tp, widths, c0,
                                           plan.kb_gu, fp8, tiled=tiled)
            else:
                acc_g = D.gemm_pass([wg], self.xT, H, tb, Tp, widths, c0, plan.kb_gu, fp8,
                                    tiled=tiled)[0]
            if fp8:
                ga = nl.ndarray((P, nf, tb), dtype=nl.float32, buffer=nl.sbuf)  # [128, nf, tb]
                nisa.tensor_tensor(dst=ga, data1=acc_g[:, :, 0:tb],
                                   data2=self.A.expand_dim(1).broadcast(1, nf), op=nl.multiply)
            else:
                ga = _silu_evict(acc_g, widths, tb, None, None, i0)             # [128, nf, tb]
            del acc_g
            if not (plan.fused or plan.combined):
                acc_u = D.gemm_pass([wu], self.xT, H, tb, Tp, widths, c0, plan.kb_gu, fp8,
                                    tiled=tiled)[0]
            if fp8:
                u = nl.ndarray((P, nf, tb), dtype=nl.float32, buffer=nl.sbuf)   # [128, nf, tb]
                for f in range(nf):
                    nisa.activation(dst=u[:, f, :], op=nl.copy, data=acc_u[:, f, 0:tb],
                                    scale=cg[:, KI + i0 + f:KI + i0 + f + 1])
                parts.append((i0, i1, ga, u))
            else:
                hp = nl.ndarray((P, nf, tb), dtype=nl.bfloat16, buffer=nl.sbuf)  # [128, nf, tb]
                _gate_evict(hp, ga, acc_u, widths, tb, None, i0, 0)
                parts.append((i0, i1, hp, None))
            del acc_u
        return parts, cg, factor

    def _gate_up_mx(self, e, factor):
        """MXFP8: :func:`_mx_gate_up` into a bf16 tile of this iteration (quantized by
        ``rest``). The routing weight goes into h here, as in the reference: MX scales are
        powers of two shared by 32 values, so unlike FP8's per-token scale they do not absorb
        a per-token factor exactly."""
        w_gu, s_gu, _, _ = _mx_views(self.w_gu, self.s_gu, self.w_d, self.s_d, e)
        wrow = _row_broadcast(factor, self.tb, self.ones)                       # [128, tb]
        hT = _mx_gate_up(self.xq, self.xs, self.tb, self.H, self.I, w_gu, s_gu, wrow,
                         self.plan, self.mx)
        return [hT], None, None

    def rest(self, k, j, parts, cg, factor):
        q, tb = self.q, self.tb
        if self.mx is not None:    # h -> the carried MX operand of the down passes
            _mx_quantize_h(parts[0], self.I, self.hq, self.hs)
            return
        if q is None:
            for i0, i1, hp, _ in parts:
                nisa.tensor_copy(dst=self.h[:, i0:i1, :], src=hp, engine=nisa.engine.gpsimd)
            nisa.tensor_copy(dst=self.B, src=factor, engine=nisa.engine.gpsimd)
            return
        hmax = nl.ndarray((P, tb), dtype=nl.float32, buffer=nl.sbuf)            # [128, tb]
        for n, (i0, i1, ga, u) in enumerate(parts):
            sg = nl.ndarray((P, i1 - i0, tb), dtype=nl.float32, buffer=nl.sbuf)  # [128, nf, tb]
            for f in range(i1 - i0):
                nisa.activation(dst=sg[:, f, :], op=nl.silu, data=ga[:, f, :],
                                scale=cg[:, i0 + f:i0 + f + 1])
            nisa.tensor_tensor(dst=self.h[:, i0:i1, :], data1=sg, data2=u, op=nl.multiply,
                               engine=nisa.engine.gpsimd)
            q.track_max(hmax, self.h[:, i0:i1, :], tb, n == 0)
        q.h_scales(hmax, tb, factor, out=(self.B, self.inv))

    def down(self, k, j):
        q, tb, I, H, plan = self.q, self.tb, self.I, self.H, self.plan
        KI = self.KI
        fp8 = q is not None
        e = _slot_register(self.be_sb, k, j)
        wd = self.w_d.select(0, e)
        si_row = _slot_row(self.sidx, k, j)
        sis = [_index_col(si_row, s0, min(P, tb - s0)) for s0 in range(0, tb, P)]
        if self.mx is not None:
            self._down_mx(e, sis)
            return
        tcols = _token_cols(self.B, tb, self.ident_f)
        if not fp8:    # bf16: the token-stationary down GEMM writes the rows (no transposes)
            _down_token_rows(wd, self.h, I, H, tb, plan, self.tiled, tcols,
                             lambda n, c0, y_sb: _scatter_add(self.y32, y_sb, c0, sis[n]))
            return
        # FP8 keeps the weight-stationary down GEMM and the fp32 transposes: token-stationary,
        # its channel scales lie along the free dim and cost a broadcast and a wider eviction
        # (modeled, Trn3 Qwen3-30B-A3B T=4096 FP8: 5642.5 -> 5673.9 us)
        row = nl.ndarray((1, H), dtype=nl.float32, buffer=nl.sbuf)              # [1, H]
        nisa.dma_copy(dst=row, src=self.s_d[nl.ds(e, 1), :])
        cd = _columns(row, H, self.ident_f)                                     # [128, KT]
        Binv = q.broadcast(self.inv, tb)                                        # [128, tb]
        KIe = KI + KI % 2
        hT = nl.ndarray((P, KIe, tb), dtype=q.dtype, buffer=nl.sbuf)            # [128, KIe, tb]
        if KIe > KI:
            nisa.memset(dst=hT[:, KI:KIe, :], value=0.0)
        half = (KI + 1) // 2           # VectorE and GpSimd quantize a half each
        for a, b, eng in ((0, half, nisa.engine.vector), (half, KI, nisa.engine.gpsimd)):
            if b > a:
                nisa.tensor_tensor(dst=hT[:, a:b, :], data1=self.h[:, a:b, :],
                                   data2=Binv.expand_dim(1).broadcast(1, b - a),
                                   op=nl.multiply, engine=eng)
        d_tiles = D.feature_tiles([(0, H, 0)])
        Tp = D.acc_free(tb)
        for j0, j1 in D.group_passes(d_tiles, plan.nf_d):
            widths = [d_tiles[i][1] for i in range(j0, j1)]
            acc = D.gemm_pass([wd], hT, I, tb, Tp, widths, d_tiles[j0][0], plan.kb_d, fp8,
                              tiled=self.tiled)[0]
            yT = _evict_scaled(acc, widths, tb, cd[:, j0:j1])
            del acc
            _store_rows(self.y32, self.ident_f, yT, 0, tb, self.d_widths[:j0], widths, sis,
                        tcols)

    def _down_mx(self, e, sis):
        H, tb = self.H, self.tb
        _, _, w_d, s_d = _mx_views(self.w_gu, self.s_gu, self.w_d, self.s_d, e)
        ds = _mx_scales(s_d, (cdiv(len(down_chunks(self.I)), 4), H))            # [128, SL, H]
        ev = [0]

        def sink(acc, j0, widths, _):
            yT = _evicted(acc, j0, widths, tb, None, None, ev)
            _store_rows(self.y32, self.ident_f, yT, 0, tb, self.d_widths[:j0], widths, sis)

        _mx_down(w_d, ds, self.I, H, tb, self.plan, self.hq, self.hs, self.mx, sink)


def _kernel_width(w_gu, H, tiled, mx):
    """The expert width I from the gate|up weight's shape."""
    if mx is not None:
        return w_gu.shape[2] // (2 * cdiv(H, CHUNK))
    return w_gu.shape[1] * P // 2 if tiled else w_gu.shape[2] // 2


def _evicted(acc, j0, widths, tb, q, B, ev=None):
    """Down accumulators -> fp32 SBUF ``[128, nf, tb]`` (FP8: channel and token scales)."""
    yT = nl.ndarray((P, len(widths), tb), dtype=nl.float32, buffer=nl.sbuf)   # [128, nf, tb]
    _evict_y(yT, acc, widths, tb, q, B, j0, ev if ev is not None else [0])
    return yT


def _evicted_rows(acc, j0, widths, tb, q, B, ident_f, cols):
    """The row epilogue's eviction: bf16 as ``_evicted``; FP8 (``B`` the token-scale row
    ``[1, tb]``) only the channel scale (``_evict_scaled``), and the token scale as one column
    per 128-token sub-tile (made once into ``cols``), applied after the transposes by
    ``_store_rows``. Returns (yT, cols or None)."""
    if q is None:
        return _evicted(acc, j0, widths, tb, q, B), None
    if not cols:
        cols.extend(_token_cols(B, tb, ident_f))
    return _evict_scaled(acc, widths, tb, q.ws[2][:, j0:j0 + len(widths)]), cols


def _token_cols(row, tb, ident_f):
    """A token row ``[1, tb]`` (SBUF fp32) -> one column ``[ts, 1]`` per 128-token sub-tile
    (K=1 PE transposes): per-partition scalars once the tokens are on partitions."""
    cols = []
    for s0 in range(0, tb, P):
        ts = min(P, tb - s0)
        ps = nl.ndarray((ts, 1), dtype=nl.float32, buffer=nl.psum)              # [ts, 1]
        nisa.nc_matmul(dst=ps, stationary=row[0:1, s0:s0 + ts], moving=ident_f[0:1, 0:1],
                       is_transpose=True)
        col = nl.ndarray((ts, 1), dtype=nl.float32, buffer=nl.sbuf)             # [ts, 1]
        nisa.tensor_copy(dst=col, src=ps, engine=nisa.engine.scalar)
        cols.append(col)
    return cols


def _evict_scaled(acc, widths, tb, c):
    """Down accumulators ``[128, nf, >=tb]`` PSUM -> fp32 SBUF ``[128, nf, tb]`` times the
    channel-scale columns ``c [128, nf]`` (per-partition scalars: ScalarE and VectorE
    alternate)."""
    yT = nl.ndarray((P, len(widths), tb), dtype=nl.float32, buffer=nl.sbuf)   # [128, nf, tb]
    for f, nn in enumerate(widths):
        sc = c[0:nn, f:f + 1]
        if f % 2:
            nisa.activation(dst=yT[0:nn, f, :], op=nl.copy, data=acc[0:nn, f, 0:tb], scale=sc)
        else:
            nisa.tensor_scalar(dst=yT[0:nn, f, :], data=acc[0:nn, f, 0:tb], op0=nl.multiply,
                               operand0=sc)
    return yT


def _store_rows(y32, ident_f, yT, t0, tb, before, widths, sis, tcols=None, accs=None):
    """``yT [features, tokens]`` -> rows of the fp32 accumulator ``y32`` (``_Accumulators``) at
    columns ``[sum(before), + sum(widths))``: fp32 PE transposes (4 feature tiles per PSUM bank),
    then a scatter-add to the rows ``sis[sub-tile]`` of each slab the columns cross (indirect DMA
    read-modify-write, padding rows out of bounds and skipped), or (``sis`` None) the rows t0...
    of ``y32`` (then the bf16 output) finished as ``bf16(rows + every core's accumulator rows)``
    (``dma_compute``: fp32 in the DMA engines, then the cast; ``accs`` the ``_Accumulators``).
    ``tcols``: one per-token scale column ``[ts, 1]`` per sub-tile, applied on the PSUM
    eviction."""
    c0 = sum(before)
    ncols = sum(widths)
    for n, s0 in enumerate(range(0, tb, P)):
        ts = min(P, tb - s0)
        y_sb = nl.ndarray((ts, ncols), dtype=nl.float32, buffer=nl.sbuf)          # [ts, ncols]
        col = 0
        for g0 in range(0, len(widths), 4):
            g1 = min(len(widths), g0 + 4)
            gw = sum(widths[g0:g1])
            tp = D.transposed_group(yT, ident_f, widths, g0, g1, s0, ts)         # [ts, gw]
            _evict_rows(y_sb[:, col:col + gw], tp, None if tcols is None else tcols[n],
                        (g0 // 4) % 2)
            col += gw
        if sis is None:    # the shared expert's rows finish y: its rows plus the accumulators'
            _finish_rows(y32, y_sb, t0 + s0, c0, accs)
            continue
        _scatter_add(y32, y_sb, c0, sis[n])


def _evict_rows(dst, src, tcol, on_act):
    """Token rows out of PSUM into fp32 SBUF, times the per-token scale column ``tcol [ts, 1]``
    (None: a plain copy), on ScalarE (``on_act``) or VectorE."""
    if tcol is None:
        nisa.tensor_copy(dst=dst, src=src,
                         engine=nisa.engine.scalar if on_act else nisa.engine.vector)
    elif on_act:
        nisa.activation(dst=dst, op=nl.copy, data=src, scale=tcol)
    else:
        nisa.tensor_scalar(dst=dst, data=src, op0=nl.multiply, operand0=tcol)


def _finish_rows(y, y_sb, r0, c0, accs):
    """The shared expert's rows ``y_sb [ts, ncols]`` (fp32 SBUF) finish ``y`` rows ``r0..`` at
    columns ``[c0, c0 + ncols)``: ``bf16(rows + every core's accumulator rows)`` (``dma_compute``:
    fp32 in the DMA engines, then the cast; ``accs`` the ``_Accumulators``)."""
    ts, ncols = y_sb.shape
    r = slice(r0, r0 + ts)
    for g, a, w, c in accs.pieces(c0, ncols):
        nisa.dma_compute(dst=y[r, c0 + c:c0 + c + w],
                         srcs=[cs[g][r, a:a + w] for cs in accs.cores()] + [y_sb[:, c:c + w]],
                         reduce_op=nl.add)


def _scatter_add(y32, y_sb, c0, si):
    """Rows ``y_sb [ts, ncols]`` (fp32 SBUF) added into the rows ``si [ts, 1]`` of the
    accumulator ``y32`` (``_Accumulators``) at columns ``[c0, c0 + ncols)``: one indirect DMA
    read-modify-write per slab the columns cross (padding rows out of bounds, skipped)."""
    ts, ncols = y_sb.shape
    for g, a, w, c in y32.pieces(c0, ncols):
        # offset None: the view's own (an .ap offset addresses the allocation, and at LNC 2
        # the slab is this core's slice of the cores' accumulators)
        slab = y32.mine[g]
        dst = slab[:, a:a + w].ap([[slab.shape[1], ts], [1, w]], vector_offset=si,
                                  indirect_dim=0)
        nisa.dma_compute(dst=dst, srcs=[dst, y_sb[:, c:c + w]], reduce_op=nl.add,
                         oob_mode=nisa.oob_mode.skip)


def _down_token_rows(wd, hT, I, H, tb, plan, tiled, tcols, emit):
    """Token-stationary down projection (bf16): ``y[t, cols] = h[:, t].T @ W_d[:, cols]`` with a
    128-token slice of ``hT [128, KI, tb]`` stationary and the weight rows moving, so the GEMM
    writes token rows (tokens on PSUM partitions) and y needs no fp32 PE transposes (modeled at
    4x a bf16 matmul each; NKI spec 9.1.1: dst [M, N] = stationary[K, M].T @ moving[K, N],
    M <= 128, N <= 512). Same PE cycles as the weight-stationary pass for full sub-tiles
    (N = 512 weight columns per matmul instead of N = tb tokens per 128 columns). Per pass of
    ``plan.nf_d`` feature tiles the weight rows stream in as ``gemm_pass`` loads them; then per
    128-token sub-tile n and 512-column group (one fp32 PSUM bank) the k-tiles accumulate, and
    the eviction applies the token's output scale ``tcols[n] [ts, 1]`` (None: none) as a
    per-partition scalar. ``emit(n, c0, y_sb)`` takes each sub-tile's rows ``[ts, ncols]`` of
    the pass (the scatter-add, or the shared expert's finish of y)."""
    KI = cdiv(I, P)
    d_tiles = D.feature_tiles([(0, H, 0)])
    ev = 0
    for j0, j1 in D.group_passes(d_tiles, plan.nf_d):
        widths = [d_tiles[i][1] for i in range(j0, j1)]
        c0, ncols = d_tiles[j0][0], sum(widths)
        # (k-tile, its weight rows [128, w] for the columns [c0 + o, c0 + o + w))
        pieces = []
        if tiled:
            for k0, kn in D._tile_chunks(KI, plan.kb_d, 1):
                for f in range(j1 - j0):
                    w_sb = D._load_weight_tile(wd, j0 + f, k0, kn)            # [128, kn, 128]
                    pieces += [(k0 + j, w_sb[:, j, :], f * P, P) for j in range(kn)]
        else:
            for k0, kn in D.k_chunks(KI, D.transfer_k_tiles(plan.kb_d)):
                w_sb = D._load_weight_rows(wd, I, k0, kn, c0, ncols, False)   # [128, kn, ncols]
                pieces += [(k0 + j, w_sb[:, j, :], 0, ncols) for j in range(kn)]
        for n, s0 in enumerate(range(0, tb, P)):
            ts = min(P, tb - s0)
            y_sb = nl.ndarray((ts, ncols), dtype=nl.float32, buffer=nl.sbuf)     # [ts, ncols]
            for g0 in range(0, ncols, 512):
                gw = min(512, ncols - g0)
                ps = nl.ndarray((ts, gw), dtype=nl.float32, buffer=nl.psum)     # [ts, gw]
                for kt, w_k, o, w in pieces:
                    lo, hi = max(o, g0), min(o + w, g0 + gw)
                    if lo < hi:
                        kk = min(P, I - kt * P)
                        nisa.nc_matmul(dst=ps[:, lo - g0:hi - g0],
                                       stationary=hT[0:kk, kt, s0:s0 + ts],
                                       moving=w_k[0:kk, lo - o:hi - o], accumulate=(kt > 0))
                # no token scale: the shared expert; ScalarE and VectorE take the evictions in turn
                _evict_rows(y_sb[:, g0:g0 + gw], ps, None if tcols is None else tcols[n], ev % 2)
                ev += 1
                del ps
            emit(n, c0, y_sb)


# ---------------------------------------------------------------------------------------- op
def fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, *, shared=None, gate_up_scale=None,
              down_scale=None, shared_scales=None, expert_offset=0, num_global_experts=None,
              regime=None, lnc=1):
    """Routed SwiGLU experts with weighted sum (and an optional shared expert) on a NeuronCore.

    Args:
      x: [T, H] bfloat16 (NumPy / ml_dtypes or CPU torch).
      w_gate_up: [E, H, 2I] (gate = columns [0, I), up = [I, 2I)); w_down: [E, I, H]. All
        bfloat16, or FP8 (float8_e4m3; on Trn3 also float8_e4m3fn) with per-output-channel
        scales gate_up_scale [E, 2I] and down_scale [E, H]. Or tile-major
        (``tile_expert_weights``: [E, 2I/128, 128, KTe, 128], [E, H/128, 128, KTe, 128]).
        Or, on Trn3 only, MXFP8: the pair of :class:`MXTensor` that
        ``quantize_expert_weights_mx(w_gate_up, w_down, fmt)`` returns (E8M0 block scales of 32
        weights inside; H, I multiples of 128); x and the intermediate h are then MX-quantized
        in the kernel (``quantize_mx``) and the GEMMs run on ``nc_matmul_mx``.
      topk_weights: [T, k] float; topk_ids: [T, k] integer global expert ids.
      shared: optional (w_gate_up [H, 2Is], w_down [Is, H]) shared expert, same dtype and layout
        as the experts (FP8: shared_scales = ([2Is], [H]); MXFP8: the MXTensor pair of
        ``quantize_expert_weights_mx(ws_gate_up, ws_down)``), added with weight 1.
      expert_offset: global id of local expert 0 (expert parallelism: this call holds experts
        [expert_offset, expert_offset + E)); ids outside that range contribute nothing.
      num_global_experts: when given, every id must lie in [0, num_global_experts).
      regime: None (automatic: "decode" for T <= 64), "decode" (T <= 128) or "prefill".
      lnc: 1, or 2 (prefill only): the experts are dealt to the two cores of a logical
        NeuronCore, each core streaming its own experts' weights into its own fp32 accumulator.
    Returns:
      y [T, H] bfloat16.
    """
    name = "fused_moe"
    gen = check_target(name)
    if isinstance(w_gate_up, MXTensor) or isinstance(w_down, MXTensor):
        return _fused_moe_mx(x, w_gate_up, w_down, topk_weights, topk_ids, shared, gate_up_scale,
                             down_scale, shared_scales, expert_offset, num_global_experts, regime,
                             lnc)
    check_no_grad(name, x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale,
                  *(shared or ()), *(shared_scales or ()))
    T, H = check_2d(name, "x", x)
    check_dtype(name, "x", x, ("bfloat16",))
    tiled = len(getattr(w_gate_up, "shape", ())) == 5
    E, I = _check_weights(name, H, w_gate_up, w_down, tiled)
    wdt = check_dtype(name, "w_gate_up", w_gate_up, ("bfloat16",) + _FP8)
    got = dtype_name(w_down)
    if got != wdt:
        raise TypeError(f"{name}: w_down.dtype must equal w_gate_up.dtype ({wdt}); got {got}")
    fp8 = wdt in _FP8
    ids, wts = _check_routing(name, T, E, topk_weights, topk_ids, expert_offset,
                              num_global_experts)
    if fp8:
        if wdt == "float8_e4m3fn" and gen < 4:
            raise ValueError(f"{name}: float8_e4m3fn weights need Trn3; on Trn2 use float8_e4m3")
        if H % P or I % P:
            raise ValueError(f"{name}: FP8 weights need hidden and expert sizes that are "
                             f"multiples of 128; got H={H}, I={I}")
        if gate_up_scale is None or down_scale is None:
            raise ValueError(f"{name}: FP8 weights need gate_up_scale [E, 2I] and down_scale "
                             f"[E, H]")
        s_gu = _scales(name, "gate_up_scale", gate_up_scale, (E, 2 * I))
        s_d = _scales(name, "down_scale", down_scale, (E, H))
    else:
        if gate_up_scale is not None or down_scale is not None or shared_scales is not None:
            raise ValueError(f"{name}: gate_up_scale / down_scale / shared_scales are only for "
                             f"FP8 weights (weights are {wdt})")
        s_gu = s_d = None
    sh_gu = sh_d = ss_gu = ss_d = None
    Is = 0
    if shared is not None:
        sh_gu, sh_d, ss_gu, ss_d, Is = _check_shared(name, shared, shared_scales, H, wdt, tiled,
                                                     fp8)
    regime = _regime(name, T, regime)
    lnc = _check_lnc_regime(name, lnc, regime)
    lids = local_ids(ids, E, expert_offset)
    w32 = wts.astype(np.float32)
    wb = 1 if fp8 else 2
    if regime == "decode":
        plan = plan_tiles("decode", T, H, I, wb, tiled)
        experts, n, comb = plan_decode_routing(lids, w32, E, (s_gu, s_d) if fp8 else None)
        ring = plan_decode_ring(T, H, I, experts.shape[1], wb, fp8, plan, sbuf_budget(), Is,
                                tiled)
        return launch(fused_moe_decode_kernel, x, w_gate_up, w_down, experts, n, comb, s_gu,
                      s_d, sh_gu, sh_d, ss_gu, ss_d, plan.combined, plan.nf_gu, plan.nf_d,
                      plan.kb_gu, plan.kb_d, tiled, plan.fused, None, ring)
    counts = np.bincount(lids[lids >= 0].ravel(), minlength=E) if (lids >= 0).any() else []
    budget = sbuf_budget()
    tb_cap = max(c for c in TB_CHOICES
                 if c == TB_CHOICES[0]
                 or _sbuf_need(c, H, I, wb, fp8, plan_tiles("prefill", c, H, I, wb, tiled))
                 <= budget)
    ridge = RIDGE_TOKENS if gen >= 4 else RIDGE_TOKENS_TRN2
    # merged blocks for bf16 only: past 256 tokens gate and up stream apart, and FP8 rows of I
    # bytes (768 for Qwen3-30B-A3B) fall under the DMA descriptor floor (modeled, Trn3
    # Qwen3-30B-A3B T=4096 FP8, with the token-stationary down: 5808.1 us with them, 5673.9
    # without)
    tb, tt = choose_blocks(counts, tb_cap, ridge, merge=not fp8)
    full, tail = plan_prefill_routing(lids, w32, E, tb, tt, lnc, ridge)
    pa = plan_tiles("prefill", tb, H, I, wb, tiled)
    pb = plan_tiles("prefill", tt, H, I, wb, tiled) if tt else None
    sh_tb = shared_block(lambda c: _sbuf_need(c, H, Is, wb, fp8, plan_tiles(
        "prefill", c, H, Is, wb, tiled), False), budget) if Is else None
    return launch(fused_moe_prefill_kernel, x, w_gate_up, w_down, *full,
                  *(tail if tail is not None else (None,) * 5), s_gu, s_d, sh_gu, sh_d, ss_gu,
                  ss_d, tiled, pa.args(), pb.args() if pb else None, None, sh_tb, lnc=lnc)


def _fused_moe_mx(x, w_gate_up, w_down, topk_weights, topk_ids, shared, gate_up_scale,
                  down_scale, shared_scales, expert_offset, num_global_experts, regime, lnc):
    """``fused_moe`` with MXFP8 expert weights (``quantize_expert_weights_mx``; Trn3 only)."""
    name = "fused_moe"
    gen = int(nisa.get_nc_version())
    if gen < 4:
        raise ValueError(f"{name}: MXFP8 expert weights (nc_matmul_mx / quantize_mx) need Trn3 "
                         f"(NeuronCore-v4); the target is {GEN_NAMES.get(gen, f'gen{gen}')}. On "
                         f"Trn2 use FP8 weights (float8_e4m3) with per-channel scales "
                         f"gate_up_scale / down_scale, or bfloat16")
    for arg, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, MXTensor):
            raise TypeError(f"{name}: MXFP8 weights must come as a pair of MXTensor "
                            f"(quantize_expert_weights_mx); {arg} is {type(w).__name__}")
    if gate_up_scale is not None or down_scale is not None or shared_scales is not None:
        raise ValueError(f"{name}: gate_up_scale / down_scale / shared_scales are only for FP8 "
                         f"weights; MXFP8 weights carry their block scales")
    check_no_grad(name, x, topk_weights, topk_ids)
    T, H = check_2d(name, "x", x)
    check_dtype(name, "x", x, ("bfloat16",))
    if H % P:
        raise ValueError(f"{name}: MXFP8 weights need a hidden size that is a multiple of 128; "
                         f"got H={H}")
    fmt = _mx_fmt(name, w_gate_up, w_down)
    g_d, g_s, E, I = _mx_operand(name, "w_gate_up", w_gate_up, 3, H, None)
    d_d, d_s, E2, _ = _mx_operand(name, "w_down", w_down, 3, I, H)
    if E2 != E:
        raise ValueError(f"{name}: w_down holds {E2} experts but w_gate_up {E}")
    ids, wts = _check_routing(name, T, E, topk_weights, topk_ids, expert_offset,
                              num_global_experts)
    sh = (None,) * 4
    Is = 0
    if shared is not None:
        if not isinstance(shared, (tuple, list)) or len(shared) != 2 \
                or not all(isinstance(w, MXTensor) for w in shared):
            raise ValueError(f"{name}: with MXFP8 experts, shared must be a pair of MXTensor "
                             f"(quantize_expert_weights_mx(ws_gate_up [H, 2Is], ws_down [Is, H]))")
        if _mx_fmt(name, *shared) != fmt:
            raise ValueError(f"{name}: the shared expert's MX format must be the experts' "
                             f"({fmt}); got {shared[0].fmt}")
        sg_d, sg_s, _, Is = _mx_operand(name, "shared[0]", shared[0], 2, H, None)
        sd_d, sd_s, _, _ = _mx_operand(name, "shared[1]", shared[1], 2, Is, H)
        sh = (sg_d, sd_d, sg_s, sd_s)
    regime = _regime(name, T, regime)
    lnc = _check_lnc_regime(name, lnc, regime)
    x4 = getattr(nl, _MX_FMTS[fmt])
    lids = local_ids(ids, E, expert_offset)
    w32 = wts.astype(np.float32)
    if regime == "decode":
        plan = plan_tiles_mx("decode", T, H, I)
        experts, n, comb = plan_decode_routing(lids, w32, E)
        return launch(fused_moe_decode_kernel, x, g_d, d_d, experts, n, comb, g_s, d_s, *sh,
                      *plan.args()[:5], False, False, x4)
    counts = np.bincount(lids[lids >= 0].ravel(), minlength=E) if (lids >= 0).any() else []
    budget = sbuf_budget()
    tb_cap = max(c for c in TB_CHOICES if c == TB_CHOICES[0]
                 or _sbuf_need_mx(c, H, I, plan_tiles_mx("prefill", c, H, I)) <= budget)
    tb, tt = choose_blocks(counts, tb_cap, RIDGE_TOKENS_MX, merge=False)   # MX: not measured
    full, tail = plan_prefill_routing(lids, w32, E, tb, tt, lnc, RIDGE_TOKENS_MX)
    pa = plan_tiles_mx("prefill", tb, H, I)
    pb = plan_tiles_mx("prefill", tt, H, I) if tt else None
    sh_tb = shared_block(lambda c: _sbuf_need_mx(c, H, Is, plan_tiles_mx("prefill", c, H, Is)),
                         budget) if Is else None
    return launch(fused_moe_prefill_kernel, x, g_d, d_d, *full,
                  *(tail if tail is not None else (None,) * 5), g_s, d_s, *sh, False,
                  pa.args(), pb.args() if pb else None, x4, sh_tb, lnc=lnc)


def _check_lnc_regime(name, lnc, regime):
    lnc = check_lnc(name, lnc)
    if lnc == 2 and regime != "prefill":
        raise ValueError(f"{name}: lnc=2 is implemented for the prefill regime; this call is "
                         f"{regime} (T <= 64 picks decode unless regime='prefill'); run decode "
                         f"with lnc=1")
    return lnc


def _regime(name, T, regime):
    if regime is None:
        regime = "decode" if T <= DECODE_T_MAX else "prefill"
    if regime not in ("decode", "prefill"):
        raise ValueError(f"{name}: regime must be None, 'decode' or 'prefill'; got {regime!r}")
    if regime == "decode" and T > P:
        raise ValueError(f"{name}: the decode regime takes at most {P} tokens; got T={T}")
    return regime


def _mx_fmt(name, *ws):
    fmts = []
    for w in ws:
        f = str(w.fmt)
        f = f[len("float8_"):] if f.startswith("float8_") else f
        if f not in _MX_FMTS:
            raise ValueError(f"{name}: MX format must be one of {', '.join(_MX_FMTS)}; got "
                             f"{w.fmt!r}")
        fmts.append(f)
    if len(set(fmts)) != 1:
        raise ValueError(f"{name}: w_gate_up and w_down must share one MX format; got {fmts}")
    return fmts[0]


def _mx_operand(name, arg, w, ndim, K, F):
    """Check one MXTensor of expert weights (``ndim`` 3: a leading expert dim, 2: one expert):
    contraction ``K`` (w.k must equal it), ``F`` columns (None: gate|up, 2I with I % 128 == 0).
    Returns (data, scale, E, I or F)."""
    data, scale = _as_numpy(w.data), _as_numpy(w.scale)
    what = "[E, 128, KT*F]" if ndim == 3 else "[128, KT*F]"
    if data.ndim != ndim or data.dtype != np.uint32 or data.shape[-2] != P:
        raise ValueError(f"{name}: {arg}.data must be uint32 {what} (quantize_expert_weights_mx); "
                         f"got {data.dtype} {list(data.shape)}")
    if int(w.k) != K:
        raise ValueError(f"{name}: {arg}.k must be {K} (its contraction length); got {w.k}")
    KT = cdiv(K, CHUNK)
    SL = cdiv(KT, 4)
    if data.shape[-1] % KT:
        raise ValueError(f"{name}: {arg}.data has {data.shape[-1]} words per partition, not a "
                         f"multiple of KT = ceil({K}/512) = {KT}")
    n = data.shape[-1] // KT
    if F is None:
        if n % (2 * P) or n < 2 * P:
            raise ValueError(f"{name}: {arg} must have 2I columns with I a multiple of 128; got "
                             f"{n} columns")
        out = n // 2
    else:
        if n != F:
            raise ValueError(f"{name}: {arg} must have {F} columns; got {n}")
        out = F
    lead = data.shape[:-2]
    want = (*lead, 64, SL * n)
    if scale.shape != want or scale.dtype != np.uint8:
        raise ValueError(f"{name}: {arg}.scale must be uint8 {list(want)}; got {scale.dtype} "
                         f"{list(scale.shape)}")
    return (np.ascontiguousarray(data), np.ascontiguousarray(scale),
            lead[0] if lead else 1, out)


def _check_routing(name, T, E, topk_weights, topk_ids, expert_offset, num_global_experts):
    """(ids [T, k] integer, weights [T, k] float) NumPy, checked."""
    ids = _as_numpy(topk_ids)
    wts = _as_numpy(topk_weights)
    if ids.ndim != 2 or ids.shape[0] != T:
        raise ValueError(f"{name}: topk_ids must be [T, k] with T = x.shape[0] = {T}; got shape "
                         f"{list(ids.shape)}")
    k = ids.shape[1]
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name}: topk_ids must hold integers; got {ids.dtype}")
    if wts.shape != ids.shape:
        raise ValueError(f"{name}: topk_weights must have the shape of topk_ids {list(ids.shape)}; "
                         f"got {list(wts.shape)}")
    if wts.dtype.kind != "f" and dtype_name(wts) != "bfloat16":
        raise TypeError(f"{name}: topk_weights must be a float array; got {wts.dtype}")
    if isinstance(expert_offset, bool) or not isinstance(expert_offset, (int, np.integer)) \
            or expert_offset < 0:
        raise ValueError(f"{name}: expert_offset must be an int >= 0; got {expert_offset!r}")
    if num_global_experts is not None:
        ng = num_global_experts
        if isinstance(ng, bool) or not isinstance(ng, (int, np.integer)) or ng < expert_offset + E:
            raise ValueError(f"{name}: num_global_experts must be an int >= expert_offset + E = "
                             f"{expert_offset + E}; got {num_global_experts!r}")
        if k > ng:
            raise ValueError(f"{name}: top_k = {k} exceeds the {ng} experts")
        bad = (ids < 0) | (ids >= ng)
        if bad.any():
            t, j = np.argwhere(bad)[0]
            raise ValueError(f"{name}: topk_ids[{t}, {j}] = {ids[t, j]} is outside [0, "
                             f"num_global_experts={ng})")
    return ids, wts


def _as_numpy(a):
    if is_torch(a):
        a = a.detach().cpu()
        if str(a.dtype) == "torch.bfloat16":
            a = a.float()
        return a.numpy()
    return np.asarray(a)


def _scales(name, arg, s, shape):
    a = _as_numpy(s)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: {arg} must have shape {list(shape)}; got {list(a.shape)}")
    if a.dtype.kind != "f" and dtype_name(a) != "bfloat16":
        raise TypeError(f"{name}: {arg} must be a float array; got {a.dtype}")
    return np.ascontiguousarray(a.astype(np.float32))


def _kte(k):
    return k // P + (k // P) % 2


def _check_weights(name, H, w_gu, w_d, tiled):
    """Shapes of the expert weights; returns (E, I)."""
    sg, sd = tuple(getattr(w_gu, "shape", ())), tuple(getattr(w_d, "shape", ()))
    if tiled:
        if len(sd) != 5:
            raise ValueError(f"{name}: w_gate_up is tile-major (5-D) so w_down must be too; got "
                             f"shape {list(sd)}")
        if H % P:
            raise ValueError(f"{name}: tile-major weights need H % 128 == 0; got H={H}")
        E, n2 = sg[0], sg[1]
        if n2 % 2 or n2 < 2:
            raise ValueError(f"{name}: tile-major w_gate_up must hold an even number of feature "
                             f"tiles; got shape {list(sg)}")
        I = n2 * P // 2
        want_g, want_d = (E, n2, P, _kte(H), P), (E, H // P, P, _kte(I), P)
        if sg != want_g or sd != want_d:
            raise ValueError(f"{name}: tile-major weights must have shapes {list(want_g)} and "
                             f"{list(want_d)} (tile_expert_weights of [E, H, 2I], [E, I, H]); "
                             f"got {list(sg)} and {list(sd)}")
        return E, I
    if len(sg) != 3 or min(sg) < 1 or sg[1] != H or sg[2] % 2:
        raise ValueError(f"{name}: w_gate_up must be [E, H, 2I] with H = x.shape[1] = {H}; got "
                         f"shape {list(sg)}")
    E, I = sg[0], sg[2] // 2
    if sd != (E, I, H):
        raise ValueError(f"{name}: w_down must be [E, I, H] = {[E, I, H]}; got {list(sd)}")
    return E, I


def _check_shared(name, shared, scales, H, wdt, tiled, fp8):
    if not isinstance(shared, (tuple, list)) or len(shared) != 2:
        raise ValueError(f"{name}: shared must be a pair (w_gate_up [H, 2Is], w_down [Is, H])")
    g, d = shared
    for a, w in (("shared[0]", g), ("shared[1]", d)):
        got = dtype_name(w)
        if got != wdt:
            raise TypeError(f"{name}: {a}.dtype must equal the experts' dtype ({wdt}); got {got}")
    sg, sd = tuple(g.shape), tuple(d.shape)
    if tiled:
        if len(sg) != 4 or sg[0] % 2:
            raise ValueError(f"{name}: with tile-major experts the shared weights must be "
                             f"tile_weight'ed too; got shapes {list(sg)}, {list(sd)}")
        Is = sg[0] * P // 2
        if sg != (sg[0], P, _kte(H), P) or sd != (H // P, P, _kte(Is), P):
            raise ValueError(f"{name}: tile-major shared weights must have shapes "
                             f"{[sg[0], P, _kte(H), P]} and {[H // P, P, _kte(Is), P]}; got "
                             f"{list(sg)}, {list(sd)}")
    else:
        if len(sg) != 2 or sg[0] != H or sg[1] % 2 or sg[1] < 2:
            raise ValueError(f"{name}: shared[0] must be [H, 2Is] with H = {H}; got {list(sg)}")
        Is = sg[1] // 2
        if sd != (Is, H):
            raise ValueError(f"{name}: shared[1] must be [Is, H] = {[Is, H]}; got {list(sd)}")
    if fp8:
        if Is % P:
            raise ValueError(f"{name}: FP8 shared expert needs Is % 128 == 0; got Is={Is}")
        if scales is None or len(scales) != 2:
            raise ValueError(f"{name}: FP8 shared expert needs shared_scales = ([2Is], [H])")
        ss_gu = _scales(name, "shared_scales[0]", scales[0], (2 * Is,))
        ss_d = _scales(name, "shared_scales[1]", scales[1], (H,))
        return g, d, ss_gu, ss_d, Is
    return g, d, None, None, Is


__all__ = ["fused_moe", "fused_moe_decode_kernel", "fused_moe_prefill_kernel", "MoEPlan",
           "quantize_expert_weights_mx", "down_chunks", "pack_down_chunks", "plan_tiles_mx",
           "plan_tiles", "plan_decode_routing", "plan_prefill_routing", "choose_blocks",
           "split_expert",
           "tile_expert_weights", "local_ids"]
