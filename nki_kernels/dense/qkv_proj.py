"""Fused QKV projection: ``q, k, v = rope(qk_norm(split(rmsnorm(x + residual) @ W_qkv + b)))``.

One kernel for prefill and decode (see docs/dense.md): weight-stationary GEMM passes with the
output features on partitions (``_tiles.gemm_pass``), then an epilogue that transposes the
results to "lanes" (one output row of ``head_dim`` elements per partition) where the per-head
RMSNorm (Qwen3 QK-norm) and RoPE are free-dim operations.

Output layouts (what the attention kernels read; ``AttentionShape`` in reference/shapes.py is
``[batch, heads, seq, head_dim]`` and these are the batch-1 slices):

* ``q [n_q_heads, T, head_dim]``, ``v [n_kv_heads, T, head_dim]``;
* ``k [n_kv_heads, T, head_dim]`` (``k_layout="heads"``) or ``[n_kv_heads, head_dim, T]``
  (``k_layout="transposed"``: the contraction of ``q @ k.T`` already on the partition axis);
* with ``residual``: also ``h = x + residual [T, H]``, the new residual stream.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .._limits import SbufLedger, sbuf_budget
from .._validate import (
    check_2d,
    check_dtype,
    check_eps,
    check_no_grad,
    check_target,
    float_vector,
)
from ..backend import launch, nisa, nki, nl
from . import _tiles as D
from ._tiles import P, cdiv

DECODE_T_MAX = 128   # T < 128 tokens: one block, (head, token) lanes; see QKVPlan
NCOLS_MAX = 4096     # weight columns per pass: 8 KiB bf16 rows per k-tile in SBUF
HEAD_DIMS = (64, 128, 256)
W_BYTES_PREFILL = 4096   # weight bytes per partition per transfer from 128 tokens (8 KiB below):
                         # there a transfer's matmuls take ~85% of its DMA time, so TensorE
                         # finishes the stream one transfer after its last byte; half the
                         # transfer, half that tail (Llama-3-70B TP8 T=128, modeled: Trn3
                         # 55.96 -> 55.12 us, Trn2 75.72 -> 75.04)


@dataclass(frozen=True)
class QKVPlan:
    """Tile choices for one call.

    tb_max: tokens per block (<= 512; less when SBUF is short: hidden 8192 on Trn2). T <= 512
      is one block and the weights stream from HBM exactly once (the decode regime for
      T < 128, and up to one PSUM bank of tokens). Larger T is cut into balanced blocks of
      <= 512 tokens, and the weights stream once per block: at 512 tokens per block the weight
      traffic needs 217/512 = 42% (Trn2) and 149/512 = 29% (Trn3) of the TensorE time, so
      prefill stays TensorE-bound.
    decode: T < 128: x loaded packed over all DMA queues, the norm's sum of squares taken from
      the transposes (off the critical path), (head, token) pair lanes in the epilogue.
    nf_max: feature tiles (of 128) per GEMM pass: as many accumulators of [128, Tp] fp32 as
      PSUM holds (8 at 512 tokens, 32 at 128, all of N at decode sizes). The weight rows of a
      pass are read in runs of nf_max*128 elements (2 KiB at 512 tokens).
    kb: weight k-tiles per DMA (about 8 KiB per partition per transfer; 4 KiB from 128 tokens,
      W_BYTES_PREFILL).
    sbuf_bytes: the most SBUF per partition the kernel holds at once with these choices
      (``qkv_sbuf``: its buffers walked in its order; equal to the emulator's measured peak).
    kc, ts_max: the k-chunked nest for narrow projections (N <= 2048, T > 256, e.g. Llama-3-70B
      at TP8: N = 1280). There the passes above would read 1280 B weight runs (2 passes of 5
      tiles) at 51% DMA efficiency and stream W per 512 tokens: DMA-bound on Trn2. Instead W
      streams once per super-block of ts_max = 1024 tokens, kc k-tiles at a time, and the
      partial sums of the chunks add up in SBUF (one VectorE add per output element and chunk:
      1/kc of the TensorE work).
    """

    T: int
    H: int
    N: int
    tb_max: int
    nf_max: int
    kb: int
    decode: bool
    sbuf_bytes: int
    kc: int = 0
    ts_max: int = 0


KC_TS = 1024         # tokens per super-block of the k-chunked nest
KC_GROUP = 256       # tokens per PSUM accumulation group of the k-chunked nest
KC_RING = 2          # without a residual, the k-chunked nest's per-chunk transfers (weight
                     # chunk, x^T chunk, sum-of-squares rows) land in rings of this many buffers
                     # allocated once: each load then waits for the reads of its buffer's last
                     # contents instead of all of them starting at once and queueing ahead of
                     # the ones the next matmuls need. Modeled (Llama-3-70B TP8, Trn2): T=512
                     # 174.4 -> 169.0 us, T=2048 628.1 -> 606.6, T=8192 2543.6 -> 2350.4 (Trn3
                     # T=8192 2410.9 -> 2321.9, T <= 2048 the same); 3 slots 1-2% slower. With
                     # a residual (PE transposes) rings were 2-10% slower or faster by shape:
                     # that path keeps fresh tiles


def plan_qkv(T, H, n_q, n_kv, head_dim, sbuf_budget, tb_max=D.TB_MAX, **options) -> QKVPlan:
    """Largest token block (multiple of 64, <= tb_max) whose SBUF fits (narrow N: one pass per
    block first); the k-chunked nest for narrow N at prefill sizes (8 k-tiles per chunk first).

    The SBUF figure is ``qkv_sbuf`` of the candidate: the kernel's own buffers walked in its
    order, the peak of what it holds at once. ``options``: the keyword flags of ``qkv_sbuf``
    (norm, bias, residual, rot, qk_norm, k_transposed); by default all on, and residual both
    ways (without one the k-chunked nest holds rings, with one it holds more rows), so the figure
    bounds every call of that shape."""
    opts = dict(norm=True, bias=True, rot=None, qk_norm=True, k_transposed=True)
    opts.update(options)
    variants = [opts] if "residual" in opts else [dict(opts, residual=r) for r in (True, False)]

    def need(*args):
        return max(qkv_sbuf(T, H, n_q, n_kv, head_dim, *args, **v).peak for v in variants)
    d = head_dim
    N = (n_q + 2 * n_kv) * d
    KT = cdiv(H, P)
    nt = len(_qkv_tiles(n_q, n_kv, d))
    if T > KC_GROUP and H % P == 0 and N <= 2048 and nt * KC_GROUP * 4 <= D.PSUM_BYTES:
        # from 257 tokens (Llama-3-70B TP8, modeled: T=384 128.4 / 139.5 us on Trn3 / Trn2,
        # against 155.1 / 174.6 in token blocks; T=256 stays in one block: 95.7 / 103.8 against
        # 92.4 / 118.2). 4 k-tiles per chunk first for a single super-block (the first chunk is
        # the GEMM's prologue: T=512 161.8 / 169.1 us, 8 k-tiles 164.6 / 172.8), 8 beyond
        # (T=8192 2329.7 / 2359.4 us, 4 k-tiles 2342.4 / 2394.2)
        for kc in ((4, 8, 16, 2, 1) if T <= KC_TS else (8, 16, 4, 2, 1)):
            if KT % kc:
                continue
            sb = need(D.TB_MAX, nt, 1, kc, KC_TS)
            if sb <= sbuf_budget:
                return QKVPlan(T, H, N, D.TB_MAX, nt, 1, False, sb, kc, KC_TS)
    cands = list(range(tb_max, 63, -64))
    if N <= 2048:
        # narrow N, where the k-chunked nest does not apply: blocks whose accumulators hold
        # all of N (one pass per block) first
        one = [t for t in cands
               if D.max_tiles_per_pass(max(b for _, b in D.token_blocks(T, t)), 1) >= nt]
        cands = one + [t for t in cands if t not in one]
    best = None
    for tbm in cands:
        tb = max(b for _, b in D.token_blocks(T, tbm))
        nf = D.max_tiles_per_pass(tb, 1)
        if head_dim == 256:
            nf -= nf % 2
        nf = min(nf, NCOLS_MAX // P, cdiv(N, P))
        kb = D.k_tiles_per_dma(nf * P, 2, H, W_BYTES_PREFILL if T >= DECODE_T_MAX else 8192)
        sb = need(tbm, nf, kb)
        if sb <= sbuf_budget:
            return QKVPlan(T, H, N, tbm, nf, kb, T < DECODE_T_MAX, sb)
        best = sb if best is None else min(best, sb)
    raise ValueError(f"qkv_proj: hidden={H} needs {best} bytes of SBUF per partition even at 64 "
                     f"tokens per block; {sbuf_budget} available")


def _row_norm(T, nblocks, npasses, nf, tb, gen):
    """A single prefill block in a single pass takes the RMSNorm scale at the GEMM's eviction:
    its rows are transposed as loaded and the ScalarE sum of squares runs beside the transposes
    instead of in front of them; the per-token scale is broadcast along the accumulators' free
    dim (two PSUM banks, beside the pass's accumulators) halfway through the pass.

    It pays where the first matmuls wait for the norm: Trn3 from 128 tokens, Trn2 from 256
    (Llama-3-70B TP8, modeled: T=128 64.7 -> 59.6 us on Trn3, 80.5 -> 81.9 on Trn2, whose
    weight stream at 128 tokens outlasts the norm and then only sees the longer eviction; T=256
    108.5 -> 95.7 and 115.7 -> 103.8)."""
    return (T >= DECODE_T_MAX and nblocks == 1 and npasses == 1
            and nf * D.acc_free(tb) * 4 + 2 * D.PSUM_BANK <= D.PSUM_BYTES
            and (T >= 2 * P or gen >= 4))


# ------------------------------------------------------------------------------ SBUF plan
EARLY_EPILOGUE_T = 32    # below it a pass's stores are small, and moving them into the weight
                         # stream costs more than it saves (Llama-3-8B T=8 modeled 148.4 ->
                         # 150.0 us on Trn2 with it, T=32 153.2 -> 151.3)


def _epilogue_in_pass(nf, tb):
    """The previous pass's epilogue runs inside a pass of ``nf`` accumulator tiles (after its
    first weight chunk) for blocks of at least EARLY_EPILOGUE_T tokens, when the accumulators
    leave it two PSUM banks: its transposes take one."""
    return tb >= EARLY_EPILOGUE_T and nf * D.acc_free(tb) * 4 + 2 * D.PSUM_BANK <= D.PSUM_BYTES


def qkv_sbuf(T, H, n_q, n_kv, d, tb_max, nf_max, kb, kc=0, ts_max=0, *, norm=True,
             bias=True, residual=True, rot=None, qk_norm=False, k_transposed=False, gen=None):
    """The kernel's SBUF buffers (bytes per partition) in the order ``qkv_proj_kernel`` takes
    and releases them, for these tile choices and options: an ``SbufLedger`` whose ``peak`` is
    the plan's figure. ``rot``: rotary dims (default d; 0 = no RoPE). ``gen``: the NeuronCore
    version (default: the current target's).

    It follows the kernel step by step (same helpers for blocks, passes, k-chunks and lanes),
    so a change to one is a change to the other; tests/test_sbuf_plan.py checks the figure
    against the emulator's measured peak in every regime."""
    led = SbufLedger()
    gen = int(nisa.get_nc_version()) if gen is None else gen
    rot = d if rot is None else rot
    N = (n_q + 2 * n_kv) * d
    KT = cdiv(H, P)
    tiles = _qkv_tiles(n_q, n_kv, d)
    passes = D.group_passes(tiles, nf_max, 2 if d == 256 else 1)
    x_first = not kc and T >= DECODE_T_MAX
    w0 = 0
    if not kc:   # the head of the weight stream, prefetched (after the rows at prefill sizes)
        i0, i1 = passes[0]
        w0 = D.gemm_pass_loads(1, H, [t[1] for t in tiles[i0:i1]], kb, 2)[0]
    if not kc and not x_first:
        led.take("w", w0)
    _consts_sbuf(led, tiles, H, norm, bias, 4 * d if qk_norm else 0)
    ep = _EpilogueSbuf(led, tiles, d, rot, qk_norm, k_transposed,
                       [(0, len(tiles))] if kc else passes)
    if kc:
        _kchunk_sbuf(led, ep, T, H, N, len(tiles), kc, ts_max, norm, residual)
        return led
    blocks = D.token_blocks(T, tb_max)
    late_norm = norm and T < DECODE_T_MAX
    row_norm = False
    r = D.pack_factor(T, H) if T < DECODE_T_MAX else 1
    if r > 1:                                           # x_packed_transposed
        led.take("x_packed", 2 * H // r)
        if residual:
            led.take("r_packed", 2 * H // r)
            led.drop("r_packed")
        led.take("xT", 2 * KT * T)
        if late_norm:
            led.take("squares", 2 * KT * T)
        led.drop("x_packed")
    else:                                               # x_rows_normalised, x_transposed
        row_norm = norm and _row_norm(T, len(blocks), len(passes), len(tiles), blocks[0][1],
                                      gen)
        rows = D.rows_sbuf(led, "rows", blocks[0][1], H, residual,
                           norm and not late_norm and not row_norm)
        if x_first:
            led.take("w", w0)
        if late_norm:
            led.take("squares", 2 * KT * T)
        led.take("xT", 2 * KT * blocks[0][1])
        if row_norm:                                    # _rstd per sub-tile, kept as columns
            for k in range(len(rows)):
                D.rstd_sbuf(led, H)
                led.live[("col", k)] = led.live.pop("rstd")
        led.drop(*rows)
    if late_norm:                                       # norm_rows
        led.take("ones", 2 * P)
        led.take("rrow", 4 * T)
        led.drop("ones", "squares")
    ncols = len(rows) if row_norm else 0

    def broadcast():                                    # _row_broadcast (row_norm)
        led.take("row", 4 * blocks[0][1])
        led.drop(*[("col", k) for k in range(ncols)])
        led.take("ones_row", 4 * P)
        led.take("rrow", 4 * blocks[0][1])
        led.drop("row", "ones_row")

    pending = None
    for bi, (_, tb) in enumerate(blocks):
        last = bi + 1 == len(blocks)
        if not last:
            rows = D.rows_sbuf(led, "rows", blocks[bi + 1][1], H, residual, norm)
        blk = ep.block(bi, tb)
        for pi, (i0, i1) in enumerate(passes):
            early = pending if pi > 0 and _epilogue_in_pass(i1 - i0, tb) else None

            def run_early(e=early, b=blk):
                ep.run(*e)
                ep.release(e, b)

            D.gemm_pass_sbuf(led, 1, H, [t[1] for t in tiles[i0:i1]], kb, 2,
                             prefetched=(bi == 0 and pi == 0), mid=run_early if early else None,
                             halfway=broadcast if row_norm else None)
            if early:
                pending = None
            hT = ("hT", bi, pi)
            # _evict_pass: rrow scaling into a temporary first, unless it goes straight out
            tmp = (late_norm or row_norm) and (bias or any(t[1] < P for t in tiles[i0:i1]))
            if tmp:
                led.take("evict_tmp", 4 * (i1 - i0) * tb)
            led.take(hT, 2 * (i1 - i0) * tb)
            if tmp:
                led.drop("evict_tmp")
            if pi + 1 == len(passes) and not last:      # the next block's transposes
                led.drop("xT")
                led.take("xT", 2 * KT * blocks[bi + 1][1])
                led.drop(*rows)
            if pending is not None:
                ep.run(*pending)
                ep.release(pending, blk)
            pending = (blk, hT, i0, i1)
        if last:
            led.drop("xT")
    ep.run(*pending)
    return led


def _head_lanes(nh, d, kind, k_transposed):
    """A group of nh heads of one kind in a block of one token per partition goes out in
    (head, token group) lanes (``_Ctx._head_lanes``): head_dim 128 (a feature tile per head),
    nh > 1 dividing 128, not the transposed k."""
    return nh > 1 and P % nh == 0 and d == P and not (kind == 1 and k_transposed)


def _epilogue_runs(tiles, i0, i1, R, d, k_transposed):
    """The epilogue's groups of a pass: ``(f, g, kind, nh, head)`` per run of tiles of one kind,
    ``head`` when it goes out in head lanes (R == 1). Head-lane groups go last: the other
    groups' stores (one 256-B row per head and token, priced at the descriptor floor) then run
    while the head lanes' RoPE does, instead of queueing behind their store (Llama-3-70B TP8
    T=128, modeled: Trn3 55.50 -> 55.12 us, Trn2 75.83 -> 75.04). In decode (pair lanes) the
    tile order stays: smallest first there was slower (T=1 47.98 -> 48.26 on Trn3)."""
    runs = []
    for f, g, kind in _kind_runs(tiles, i0, i1):
        nh = (tiles[g - 1][0] + tiles[g - 1][1] - tiles[f][0]) // d
        runs.append((f, g, kind, nh, R == 1 and _head_lanes(nh, d, kind, k_transposed)))
    return sorted(runs, key=lambda r: r[4])


def _kind_runs(tiles, i0, i1):
    """``(f, g, kind)`` per run of consecutive tiles ``[f, g)`` of one kind in ``[i0, i1)``."""
    f = i0
    while f < i1:
        g = f
        while g < i1 and tiles[g][2] == tiles[f][2]:
            g += 1
        yield f, g, tiles[f][2]
        f = g


def _head_lane_sizes(tiles, passes, d, k_transposed):
    """The head counts of the head-lane groups of a one-token-per-partition block (one RoPE
    table each)."""
    return sorted({r[3] for i0, i1 in passes for r in _epilogue_runs(tiles, i0, i1, 1, d,
                                                                     k_transposed) if r[4]})


def _qkv_tiles(n_q, n_kv, d):
    N = (n_q + 2 * n_kv) * d
    return D.feature_tiles([(0, n_q * d, 0), (n_q * d, (n_q + n_kv) * d, 1),
                            ((n_q + n_kv) * d, N, 2)])


def _consts_sbuf(led, tiles, H, norm, bias, qk_row):
    """The identities, the norm weight / bias columns and the QK-norm rows (``qk_row`` bytes
    each)."""
    D.identity_sbuf(led, "ident", 2)
    D.identity_sbuf(led, "ident_f", 4)
    if norm:
        D.col_vector_sbuf(led, "gamma_T", H)
    if bias:                                                    # load_tile_vector
        for k in range(len({t[2] for t in tiles})):
            led.take("col_rows", 4 * P)
            if k == 0:
                led.take("bias_T", 4 * len(tiles))
            led.drop("col_rows")
    if qk_row:
        led.take("q_norm_row", qk_row)
        led.take("k_norm_row", qk_row)


class _EpilogueSbuf:
    """The SBUF of ``_Ctx``: RoPE tables per token block, and per epilogue the lane staging,
    the QK-norm / RoPE temporaries of ``_lanes`` and the transposed-k staging."""

    def __init__(self, led, tiles, d, rot, qk_norm, k_transposed, passes):
        self.led, self.tiles, self.d, self.rot = led, tiles, d, rot
        self.qk_norm, self.k_transposed = qk_norm, k_transposed
        self.hl_sizes = _head_lane_sizes(tiles, passes, d, k_transposed)

    def block(self, key, tb):
        R = tb // P
        blk = {"key": key, "R": R, "r": tb - R * P, "names": []}
        if self.rot and R:
            blk["names"].append(("tab", key))
            self.led.take(blk["names"][-1], 4 * 2 * R * (self.rot // 2))
            for nh in self.hl_sizes if R == 1 else ():       # _head_table
                self.led.take("tabT", 4 * P)
                blk["names"].append(("htab", key, nh))
                self.led.take(blk["names"][-1], 4 * 2 * nh * (self.rot // 2))
                self.led.drop("tabT")
        return blk

    def release(self, pending, blk):
        self.led.drop(pending[1])
        if pending[0] is not blk:
            self.led.drop(*pending[0]["names"])

    def lane_tmp(self, G, kind, slots=False):
        """Temporaries of one ``_lanes`` call (all live at its end); ``slots``: tables per
        slot (head lanes)."""
        d, h2 = self.d, self.rot // 2
        if kind == 2 or (not self.rot and not self.qk_norm):
            return 0
        t = 4 * (2 * G * d + 2 * G) if self.qk_norm else 0        # sq, xs; ss, rq
        if self.rot:                                              # a, b, a2, b2; tables
            t += 4 * 4 * G * h2 + (4 * 4 * h2 * (G if slots else 1) if self.qk_norm else 0)
        return t

    def run(self, blk, hT, i0, i1):
        led, tiles, d = self.led, self.tiles, self.d
        nd = d // min(d, P)
        for f, g, kind, nh, head in _epilogue_runs(tiles, i0, i1, blk["R"], d,
                                                   self.k_transposed):
            kT = kind == 1 and self.k_transposed
            if head:                                    # _head_lanes
                spc = min(max(1, 1024 // d), cdiv(nh, 2))
                led.take("stage", 2 * nh * d)
                for c0 in range(0, nh, spc):
                    led.take("lanes", self.lane_tmp(min(spc, nh - c0), kind, slots=True))
                    led.drop("lanes")
                led.drop("stage")
            elif blk["R"]:                              # _token_lanes
                R = blk["R"]
                hpc = max(1, 1024 // d)
                led.take("stage", 2 * nh * R * d)
                for c0 in range(0, nh, hpc):
                    led.take("lanes", self.lane_tmp(min(hpc, nh - c0), kind))
                    led.drop("lanes")
                if kT:
                    led.take("kT", 2 * nd * nh * P * R)
                    led.drop("kT")
                led.drop("stage")
            if blk["r"]:                                # _pair_lanes
                r = blk["r"]
                if d == 256:
                    units = [1 for _ in range(f, g, 2)]
                else:
                    units = [tiles[ft][1] // d for ft in range(f, g)]
                gmax = max(1, P // r)
                u = 0
                while u < len(units):
                    hpu = units[u]
                    v = u
                    while v < len(units) and v - u < gmax and units[v] == hpu:
                        v += 1
                    ng = v - u
                    if self.rot and ("ptab", blk["key"], ng) not in blk["names"]:
                        blk["names"].append(("ptab", blk["key"], ng))
                        led.take(blk["names"][-1], 4 * 2 * (self.rot // 2))
                    led.take("stage", 2 * hpu * d)
                    led.take("lanes", self.lane_tmp(hpu, kind))
                    led.drop("lanes")
                    if kT:
                        led.take("kT", 2 * nd * ng * hpu * r)
                        led.drop("kT")
                    led.drop("stage")
                    u = v


def _kchunk_sbuf(led, ep, T, H, N, nt, kc, ts_max, norm, residual):
    """``_kchunk_nest``: per super-block the fp32 accumulators, per k-chunk one weight chunk
    and the transposed activations of this chunk and the next (without a residual: the KC_RING
    rings of weight chunks, x^T chunks and sum-of-squares rows, held throughout); the epilogue
    of each group of 256 tokens runs behind the next group."""
    nch = H // P // kc
    dma_t = not residual
    pending = []
    old = []
    if dma_t:
        tmax = max(b for _, b in D.token_blocks(T, ts_max))
        led.take("kc_rings", KC_RING * 2 * kc * (N + tmax + (P if norm else 0)))
    for si, (_, tsb) in enumerate(D.token_blocks(T, ts_max)):
        subs = [min(P, tsb - r0) for r0 in range(0, tsb, P)]
        led.drop(*old)                              # the previous super-block's ssq, acc, scale
        old = ["acc_sb"]
        if not dma_t:
            _kc_xT_sbuf(led, "xT_next", len(subs), kc, tsb, nch, norm, residual, 0, old)
        for ci in range(nch):
            last = ci + 1 == nch
            if not dma_t:
                led.take("w_sb", 2 * kc * N)
            if dma_t and norm:                          # _kc_chunk_ssq
                for k in range(len(subs)):
                    led.take("sq", 2 * kc * P)
                    if ci == 0:
                        led.take(("ssq", k), 4 * nch)
                        old.append(("ssq", k))
                    led.drop("sq")
            if not dma_t:
                led.live["xT"] = led.live.pop("xT_next")
                if not last:
                    _kc_xT_sbuf(led, "xT_next", len(subs), kc, tsb, nch, norm, residual, ci + 1,
                                old)
            for g0 in range(0, tsb, KC_GROUP):
                gn = min(KC_GROUP, tsb - g0)
                if last and norm and g0 == 0:           # _rstd_rows, _row_broadcast
                    for k in range(len(subs)):
                        if k:
                            led.drop("ss")
                        led.take("ss", 4)
                        led.take(("r", k), 4)
                    D.identity_sbuf(led, "ident_f2", 4)
                    led.take("row", 4 * tsb)
                    led.take("ones_row", 4 * P)
                    led.take("scale", 4 * tsb)
                    led.drop("ident_f2", "row", "ones_row", "ss",
                             *[("r", k) for k in range(len(subs))])
                    old.append("scale")
                if ci == 0 and g0 == 0:
                    led.take("acc_sb", 4 * nt * tsb)
                if last:
                    hT = ("hT", si, g0)
                    led.take(hT, 2 * nt * gn)
                    for args in pending:
                        ep.run(*args)
                    blk = ep.block((si, g0), gn)
                    for args in pending:
                        ep.release(args, blk)
                    pending = [(blk, hT, 0, nt)]
            if not dma_t:
                led.drop("xT", "w_sb")
            if ci == 0 and pending and nch > 1:   # the previous super-block's last group
                for args in pending:
                    ep.run(*args)
                    ep.release(args, None)
                pending = []
    for args in pending:
        ep.run(*args)


def _kc_xT_sbuf(led, name, nsub, kc, tsb, nch, norm, residual, ci, old):
    """``_kc_chunk_xT``: per sub-tile the chunk's rows (+ residual), their squares (the partial
    sums of squares ``ssq`` are placed by the first chunk), then xT [128, kc, tsb]."""
    if norm:
        led.take("g_T", 4 * kc)
    for k in range(nsub):
        led.take("xc", 2 * kc * P)
        if residual:
            led.take("rc", 2 * kc * P)
            led.drop("rc")
        if norm:
            led.take("sq", 2 * kc * P)
            if ci == 0:
                led.take(("ssq", k), 4 * nch)
                old.append(("ssq", k))
            led.drop("sq")
        if k == 0:
            led.take(name, 2 * kc * tsb)
        led.drop("xc")
    if norm:
        led.drop("g_T")


# ------------------------------------------------------------------------------------ kernel
@nki.jit
def qkv_proj_kernel(x, w, bias, residual, norm_w, q_norm_w, k_norm_w, cos, sin,
                    n_q, n_kv, d, eps, qk_eps, rot, interleaved, k_transposed,
                    tb_max, nf_max, kb, kc=0, ts_max=0):
    """``[q | k | v] = rmsnorm(x + residual) @ W + b``, QK-norm and RoPE, split into heads.

    Dimensions:
      T >= 1 tokens; H >= 1 hidden; d = head_dim in {64, 128, 256};
      N = (n_q + 2 n_kv) * d; rot = rotary dims (even, <= d; 0 = no RoPE).
    Args:
      x: [T, H] bf16 HBM.  w: [H, N] bf16 HBM.  bias: [N] fp32 HBM or None.
      residual: [T, H] bf16 HBM or None (fused add; the sum is also returned).
      norm_w: [H] fp32 HBM or None (no RMSNorm in front).
      q_norm_w, k_norm_w: [d] fp32 HBM or None (per-head RMSNorm of q and k, eps qk_eps).
      cos, sin: [T, rot/2] fp32 HBM (one angle per rotated pair) or None.
      interleaved: pairs (2i, 2i+1) (GPT-J) instead of (i, i + rot/2) (Llama / NeoX).
      k_transposed: k as [n_kv, d, T] instead of [n_kv, T, d].
      tb_max, nf_max, kb, kc, ts_max: from QKVPlan (kc > 0: the k-chunked nest for narrow N).
    Returns:
      q [n_q, T, d], k [n_kv, T, d] or [n_kv, d, T], v [n_kv, T, d] (bf16, shared HBM),
      and h [T, H] when residual is given.
    Notes:
      fp32 accumulation; the normalised activations and the projection are rounded to bf16
      before the epilogue (QK-norm and RoPE run in fp32 from there).
    Pseudocode:
      for t0 in token blocks (<= 512):
        xT[h, t] = gamma[h] * rmsnorm(x + r)[t, h]          # rows on partitions, PE transposes
        for pass in column passes (nf tiles of 128 features):
          acc[f, t] = sum_k W[k, cols_f].T @ xT[k, t]       # weight-stationary, PSUM fp32
          hT[f, t] = bf16(acc + bias)
          epilogue(previous pass): lanes = transpose(hT)    # [tokens | (head, token), d]
            q, k: qk_norm, rope along the free dim -> staging -> DMA
    """
    T, H = x.shape
    N = w.shape[1]
    KT = cdiv(H, P)
    bf16 = nl.bfloat16
    q_out = nl.ndarray((n_q, T, d), dtype=bf16, buffer=nl.shared_hbm)
    k_shape = (n_kv, d, T) if k_transposed else (n_kv, T, d)
    k_out = nl.ndarray(k_shape, dtype=bf16, buffer=nl.shared_hbm)
    v_out = nl.ndarray((n_kv, T, d), dtype=bf16, buffer=nl.shared_hbm)
    h_out = None
    if residual is not None:
        h_out = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    outs = (q_out, k_out, v_out)

    segs = [(0, n_q * d, 0), (n_q * d, (n_q + n_kv) * d, 1), ((n_q + n_kv) * d, N, 2)]
    tiles = D.feature_tiles(segs)
    passes = D.group_passes(tiles, nf_max, 2 if d == 256 else 1)
    first = None
    # the head of the weight stream goes out before any other load; at prefill sizes the first
    # block's rows go first (the GEMM waits for their transposes, not for the weight stream)
    x_first = not kc and T >= DECODE_T_MAX

    def prefetch():
        i0, i1 = passes[0]
        return D.prefetch_weights([w], H, kb, tiles[i0][0], sum(t[1] for t in tiles[i0:i1]))
    if not kc and not x_first:
        first = prefetch()
    ident = D.identity(bf16)
    ident_f = D.identity(nl.float32)
    gamma_T = D.load_col_vector(norm_w, H, nl.float32, ident=ident_f) if norm_w is not None \
        else None
    bias_T = D.load_tile_vector(bias, tiles, ident=ident_f) if bias is not None else None
    qk_g = [None, None, None]
    if q_norm_w is not None:
        qk_g[0] = D.load_row_broadcast(q_norm_w, P, nl.float32)           # [128, d]
        qk_g[1] = D.load_row_broadcast(k_norm_w, P, nl.float32)           # [128, d]
    ctx = _Ctx(outs, tiles, d, rot, interleaved, k_transposed, cos, sin, qk_g, qk_eps, ident, T,
               [(0, len(tiles))] if kc else passes, ident_f)

    if kc:
        _kchunk_nest(x, w, residual, h_out, norm_w, gamma_T, eps, tiles, bias_T, ctx, kc,
                     ts_max)
        if residual is not None:
            return q_out, k_out, v_out, h_out
        return q_out, k_out, v_out
    blocks = D.token_blocks(T, tb_max)
    norm = norm_w is not None
    # decode: the norm's sum of squares runs on the transposes (norm_rows), beside the GEMM
    late_norm = norm and T < DECODE_T_MAX
    sq = nl.ndarray((P, KT, T), dtype=bf16, buffer=nl.sbuf) if late_norm else None  # [128, KT, T]
    r = D.pack_factor(T, H) if T < DECODE_T_MAX else 1
    row_norm = norm and _row_norm(T, len(blocks), len(passes), len(tiles), blocks[0][1],
                                  nisa.get_nc_version())
    rrow = None
    if r > 1:
        xT = D.x_packed_transposed(x, T, r, residual, h_out, gamma_T, ident, sq)  # [128, KT, T]
    else:
        rows = D.x_rows_normalised(x, blocks[0][0], blocks[0][1], residual, h_out,
                                   norm and not late_norm and not row_norm, eps)
        if x_first:
            first = prefetch()
        xT = D.x_transposed(rows, blocks[0][1], H, gamma_T, ident, squares=sq)  # [128, KT, tb]
        if row_norm:
            cols = [D._rstd(xs, ts, H, eps) for _, ts, xs in rows]            # [ts, 1] each
            subs0 = [(s0, ts) for s0, ts, _ in rows]
        del rows
    if late_norm:
        rrow = D.norm_rows(sq, H, T, eps)                                     # [128, T]
    del sq
    scale = []

    def broadcast():   # row_norm: the per-token scale, halfway through the (single) pass
        scale.append(_row_broadcast(cols, subs0, blocks[0][1], ident_f))

    pending = None
    ev = 0
    for bi, (t0, tb) in enumerate(blocks):
        last = bi + 1 == len(blocks)
        if not last:   # next block's loads and norm overlap this block's GEMM
            rows = D.x_rows_normalised(x, blocks[bi + 1][0], blocks[bi + 1][1], residual, h_out,
                                       norm, eps)
        Tp = D.acc_free(tb)
        blk = ctx.block(t0, tb)
        for pi, (i0, i1) in enumerate(passes):
            # the previous pass's epilogue runs inside this pass, after its first weight chunk
            # (its transposes then overlap this pass's weight stream instead of waiting for it),
            # when this pass's accumulators leave it two PSUM banks (its transposes take one)
            widths = [tiles[i][1] for i in range(i0, i1)]
            early = pending if pi > 0 and _epilogue_in_pass(i1 - i0, tb) else None
            acc = D.gemm_pass([w], xT, H, tb, Tp, widths, tiles[i0][0], kb, first=first,
                              mid=(lambda e=early: ctx.epilogue(*e)) if early else None,
                              halfway=broadcast if row_norm else None)[0]
            if scale:
                rrow = scale.pop()
            if early:
                pending = None
            first = None
            hT = nl.ndarray((P, i1 - i0, tb), dtype=bf16, buffer=nl.sbuf)  # [128, nf, tb]
            ev = _evict_pass(hT, acc, tiles, i0, i1, tb, bias_T, ev, rrow)
            del acc
            if pi + 1 == len(passes) and not last:
                # the next block's transposes and their evictions go ahead of the pending
                # epilogue, so its VectorE work does not delay the next GEMM
                del xT
                xT = D.x_transposed(rows, blocks[bi + 1][1], H, gamma_T, ident)
                del rows
            if pending is not None:
                ctx.epilogue(*pending)
            pending = (blk, hT, i0, i1)
        if last:
            del xT
    ctx.epilogue(*pending)
    if residual is not None:
        return q_out, k_out, v_out, h_out
    return q_out, k_out, v_out


def _kchunk_nest(x, w, residual, h_out, norm_w, gamma_T, eps, tiles, bias_T, ctx, kc, ts_max):
    """Narrow projections (N <= 2048: all feature tiles of 256 tokens fit PSUM) with many
    tokens: stream W once per super-block of ts_max tokens instead of once per 512.

    Per k-chunk of kc k-tiles: the chunk's columns of x times gamma, transposed, and the matching
    W rows. Without a residual x^T comes by one DMA transpose per chunk (k-tile j = columns
    (k0 + j)*128 + p, W row (k0 + j)*128 + p on partition p: runs of N elements); with one,
    h = x + r is formed in SBUF and PE-transposed (k-tile j = columns k0*128 + p*kc + j, so that
    partition p's W rows are one contiguous run of kc*N elements); for each group of 256 tokens all
    feature tiles accumulate the chunk in PSUM and the chunks add up in SBUF fp32. The RMSNorm
    scale is per token, so it is applied once at the end (a [128, tokens] row tile): the
    sum-of-squares pre-pass runs beside the GEMM instead of in front of it.
    Pseudocode:
      for s0 in super-blocks (1024 tokens):
        rstd[t] = rsqrt(mean(h[t]^2) + eps)                    # ScalarE, off the critical path
        for k0 in chunks: for g in groups of 256:
          acc_sb[f, g] += W[chunk, f].T @ (gamma * h)T[chunk, g]
        epilogue(bf16(acc_sb * rstd + bias)) per 512 tokens (behind the next super-block)
    """
    T, H = x.shape
    N = w.shape[1]
    KT = H // P
    nt = len(tiles)
    ident = ctx.ident
    norm = norm_w is not None
    chunks = list(range(0, KT, kc))
    # without a residual the chunks' transposes go by DMA (HBM -> SBUF, 128 contiguous elements
    # per source row), off TensorE; with one, h = x + r is formed in SBUF and PE-transposed
    dma_t = residual is None
    pending = []
    ev = 0
    nch = len(chunks)
    w_ring = xT_ring = xc_ring = None
    if dma_t:   # KC_RING
        tmax = max(b for _, b in D.token_blocks(T, ts_max))
        w_ring = _ring((P, kc, N), w.dtype)                                     # [128, kc, N]
        xT_ring = _ring((P, kc, tmax), nl.bfloat16)                             # [128, kc, tmax]
        xc_ring = _ring((P, kc * P), x.dtype) if norm else None                 # [128, kc*128]
    for s0, tsb in D.token_blocks(T, ts_max):
        subs = [(r0, min(P, tsb - r0)) for r0 in range(0, tsb, P)]
        # per sub-tile and chunk: partial sums of squares of h (ScalarE, beside the GEMM)
        ssq = [nl.ndarray((ts, nch), dtype=nl.float32, buffer=nl.sbuf) for _, ts in subs] \
            if norm else None                                                   # [ts, nch] each
        acc_sb = nl.ndarray((P, nt, tsb), dtype=nl.float32, buffer=nl.sbuf)  # [128, nt, tsb]
        scale = None

        def chunk_xT(k0, ci, s0=s0, tsb=tsb, subs=subs, ssq=ssq):
            if dma_t:   # its sums of squares are taken after the chunk's weights are on their way
                return _kc_chunk_xT_dma(x, gamma_T, s0, tsb, k0, kc, next(xT_ring))
            return _kc_chunk_xT(x, residual, h_out, norm_w, s0, subs, k0, kc, ident, ssq, ci)
        xT_next = chunk_xT(0, 0)
        for ci, k0 in enumerate(chunks):
            last = ci + 1 == nch
            w_sb = next(w_ring) if dma_t else \
                nl.ndarray((P, kc, N), dtype=w.dtype, buffer=nl.sbuf)           # [128, kc, N]
            if dma_t:   # k-tile j on partition p: row (k0 + j) * 128 + p, as the DMA transposes
                src = w[k0 * P:(k0 + kc) * P, :].reshape_dim(0, (kc, P)).permute((1, 0, 2))
            else:       # partition p: rows k0 * 128 + p * kc + j, one run of kc * N elements
                src = w[k0 * P:(k0 + kc) * P, :].reshape_dim(0, (P, kc))
            nisa.dma_copy(dst=w_sb, src=src)
            if dma_t and norm:
                _kc_chunk_ssq(x, s0, subs, k0, kc, ssq, ci, xc_ring)
            xT, xT_next = xT_next, None
            if not last:   # the next chunk's transposes go ahead of this GEMM
                xT_next = chunk_xT(chunks[ci + 1], ci + 1)
            for g0 in range(0, tsb, KC_GROUP):
                gn = min(KC_GROUP, tsb - g0)
                ps = nl.ndarray((P, nt, KC_GROUP), dtype=nl.float32, buffer=nl.psum)  # [128, nt, 256]
                for j in range(kc):
                    for f, (c0, nn, _) in enumerate(tiles):
                        nisa.nc_matmul(dst=ps[0:nn, f, 0:gn], stationary=w_sb[:, j, c0:c0 + nn],
                                       moving=xT[:, j, g0:g0 + gn], accumulate=(j > 0))
                if last and norm and scale is None:
                    # rstd as a row tile, its TensorE broadcast behind the first group's
                    # matmuls (the last partial sums of squares and adds are done by then)
                    scale = _rstd_rows(ssq, subs, tsb, H, eps)                    # [128, tsb]
                acc = acc_sb[:, :, g0:g0 + gn]
                if ci == 0:
                    nisa.tensor_copy(dst=acc, src=ps[:, :, 0:gn], engine=nisa.engine.scalar)
                else:
                    nisa.tensor_tensor(dst=acc, data1=ps[:, :, 0:gn], data2=acc, op=nl.add)
                del ps
                if last:   # finish this group now; its epilogue runs behind the next group
                    hT = nl.ndarray((P, nt, gn), dtype=nl.bfloat16, buffer=nl.sbuf)  # [128, nt, gn]
                    if scale is not None:
                        nisa.tensor_tensor(dst=hT if bias_T is None else acc, data1=acc,
                                           op=nl.multiply,
                                           data2=scale[:, g0:g0 + gn].expand_dim(1).broadcast(1, nt),
                                           engine=nisa.engine.gpsimd)   # SBUF only: off VectorE
                    if scale is None or bias_T is not None:
                        ev = _evict_pass(hT, acc, tiles, 0, nt, gn, bias_T, ev)
                    _epilogues(ctx, pending)
                    pending = [(ctx.block(s0 + g0, gn), hT, 0, nt)]
                    del hT   # pending holds it, no longer
                del acc      # (a view of acc_sb: it would outlive the super-block)
            del xT, w_sb
            if ci == 0 and pending and nch > 1:   # the previous super-block's last epilogue
                _epilogues(ctx, pending)
                pending = []
    _epilogues(ctx, pending)


def _ring(shape, dtype):
    """KC_RING SBUF buffers of ``shape``, allocated once, handed out in turn."""
    return itertools.cycle([nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf) for _ in range(KC_RING)])


def _epilogues(ctx, pending):
    """The pending epilogues (a function: a loop variable of the caller would hold the last
    one's tiles past their use)."""
    for args in pending:
        ctx.epilogue(*args)


def _kc_chunk_xT(x, residual, h_out, norm_w, s0, subs, k0, kc, ident, ssq, ci):
    """Columns [k0*128, (k0+kc)*128) of h = x (+ residual, also written to h_out) for the
    super-block's tokens -> xT [128, kc, tsb] with xT[p, j, t] = gamma * h[t, k0*128 + p*kc + j]
    (ScalarE evictions, the gamma column of each k-tile as the per-partition scale), and the
    partial sums of squares of these columns into ssq[sub-tile][:, ci]."""
    tsb = subs[-1][0] + subs[-1][1]
    c0, c1 = k0 * P, (k0 + kc) * P
    xT = nl.ndarray((P, kc, tsb), dtype=nl.bfloat16, buffer=nl.sbuf)          # [128, kc, tsb]
    g_T = None
    if norm_w is not None:
        g_T = nl.ndarray((P, kc), dtype=nl.float32, buffer=nl.sbuf)           # [128, kc]
        nisa.dma_copy(dst=g_T, src=norm_w[c0:c1].reshape((P, kc)))
    for r0, ts in subs:
        t0 = s0 + r0
        xc = nl.ndarray((ts, kc * P), dtype=x.dtype, buffer=nl.sbuf)          # [ts, kc*128]
        nisa.dma_copy(dst=xc, src=x[t0:t0 + ts, c0:c1])
        if residual is not None:
            rc = nl.ndarray((ts, kc * P), dtype=residual.dtype, buffer=nl.sbuf)  # [ts, kc*128]
            nisa.dma_copy(dst=rc, src=residual[t0:t0 + ts, c0:c1])
            nisa.tensor_tensor(dst=xc, data1=xc, data2=rc, op=nl.add)
            del rc
            nisa.dma_copy(dst=h_out[t0:t0 + ts, c0:c1], src=xc)
        if ssq is not None:
            _sum_squares(xc, ssq[r0 // P][:, ci:ci + 1])
        tp = nl.ndarray((P, kc, ts), dtype=nl.bfloat16, buffer=nl.psum)      # [128, kc, ts]
        for j in range(kc):
            nisa.nc_matmul(dst=tp[:, j, :], stationary=xc[:, j:j + kc * (P - 1) + 1:kc],
                           moving=ident[0:ts, 0:ts], is_transpose=True)
        for j in range(kc):
            if g_T is not None:
                nisa.activation(dst=xT[:, j, r0:r0 + ts], op=nl.copy, data=tp[:, j, :],
                                scale=g_T[:, j:j + 1])
            else:
                nisa.tensor_copy(dst=xT[:, j, r0:r0 + ts], src=tp[:, j, :],
                                 engine=nisa.engine.scalar)
        del xc   # released before the next sub-tile's rows
    return xT


def _kc_chunk_xT_dma(x, gamma_T, s0, tsb, k0, kc, buf):
    """Columns [k0*128, (k0+kc)*128) of x for the super-block's tsb tokens -> xT [128, kc, tsb]
    (a view of the ring buffer ``buf``) with xT[p, j, t] = gamma * x[t, (k0 + j)*128 + p]: one
    DMA transpose (HBM -> SBUF), then gamma per k-tile in SBUF (VectorE and GpSimd in turn)."""
    c0, c1 = k0 * P, (k0 + kc) * P
    xT = buf[:, :, 0:tsb]                                                       # [128, kc, tsb]
    nisa.dma_transpose(dst=xT, src=x[s0:s0 + tsb, c0:c1].reshape_dim(1, (kc, P)))  # [tsb, kc, 128]
    if gamma_T is not None:
        for j in range(kc):
            nisa.tensor_tensor(dst=xT[:, j, :], data1=xT[:, j, :],
                               data2=gamma_T[:, k0 + j:k0 + j + 1].broadcast(1, tsb),
                               op=nl.multiply,
                               engine=nisa.engine.vector if j % 2 == 0 else nisa.engine.gpsimd)
    return xT


def _kc_chunk_ssq(x, s0, subs, k0, kc, ssq, ci, ring):
    """The partial sums of squares of columns [k0*128, (k0+kc)*128) per sub-tile of tokens into
    ssq[sub-tile][:, ci] (the rows as they are in HBM, into buffers of ``ring``; ScalarE square
    with the accumulator)."""
    c0, c1 = k0 * P, (k0 + kc) * P
    for r0, ts in subs:
        t0 = s0 + r0
        xc = next(ring)[0:ts]                                                   # [ts, kc*128]
        nisa.dma_copy(dst=xc, src=x[t0:t0 + ts, c0:c1])
        _sum_squares(xc, ssq[r0 // P][:, ci:ci + 1])
        del xc


def _sum_squares(xc, dst):
    """dst [ts, 1] = sum of xc [ts, n]^2 along the free dim (ScalarE square, accumulator reset;
    the squares land in a discarded scratch tile)."""
    sq = nl.ndarray(xc.shape, dtype=nl.bfloat16, buffer=nl.sbuf)               # [ts, n] discarded
    nisa.activation(dst=sq, op=nl.square, data=xc, reduce_op=nl.add, reduce_res=dst,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)


def _rstd_rows(ssq, subs, tsb, H, eps):
    """Partial sums of squares [ts, chunks] per sub-tile -> rsqrt(sum / H + eps) as a row tile
    [128, tsb] (the per-token scale along the free dim of the feature-major accumulators)."""
    rstd = []
    for (_, ts), q in zip(subs, ssq):
        ss = nl.ndarray((ts, 1), dtype=nl.float32, buffer=nl.sbuf)              # [ts, 1]
        nisa.tensor_reduce(dst=ss, op=nl.add, data=q, axis=1)
        r = nl.ndarray((ts, 1), dtype=nl.float32, buffer=nl.sbuf)               # [ts, 1]
        nisa.activation(dst=r, op=nl.rsqrt, data=ss, scale=1.0 / H, bias=float(eps))
        rstd.append(r)
    return _row_broadcast(rstd, subs, tsb)


def _row_broadcast(cols, subs, tsb, ident_f=None):
    """Per-token columns [ts, 1] (one per sub-tile) -> [128, tsb] fp32, every partition the
    same row: PE transposes into one row, then ones[1, 128].T @ row. ``ident_f``: an fp32
    identity to use (else one is built: two GpSimd instructions). ``cols`` is emptied (the
    caller's list too: the columns die with their transposes)."""
    f32 = nl.float32
    if ident_f is None:
        ident_f = D.identity(f32)
    row = nl.ndarray((1, tsb), dtype=f32, buffer=nl.sbuf)                     # [1, tsb]
    for (r0, ts), c in zip(subs, cols):
        tp = nl.ndarray((1, ts), dtype=f32, buffer=nl.psum)                   # [1, ts]
        nisa.nc_matmul(dst=tp, stationary=c, moving=ident_f[0:ts, 0:ts], is_transpose=True)
        nisa.tensor_copy(dst=row[:, r0:r0 + ts], src=tp)
    cols.clear()
    ones = nl.ndarray((1, P), dtype=f32, buffer=nl.sbuf)                      # [1, 128]
    nisa.memset(dst=ones, value=1.0)
    out = nl.ndarray((P, tsb), dtype=f32, buffer=nl.sbuf)                     # [128, tsb]
    for g0 in range(0, tsb, 512):
        gn = min(512, tsb - g0)
        ps = nl.ndarray((P, gn), dtype=f32, buffer=nl.psum)                   # [128, gn]
        nisa.nc_matmul(dst=ps, stationary=ones, moving=row[:, g0:g0 + gn])
        nisa.tensor_copy(dst=out[:, g0:g0 + gn], src=ps)
    return out


def _evict_pass(hT, acc, tiles, i0, i1, tb, bias_T, ev, rrow=None):
    """PSUM accumulators -> bf16 SBUF (+ bias, a per-partition scalar in this layout).

    Without bias: runs of up to 4 equal-width tiles per instruction; with bias: one instruction
    per tile. Alternates VectorE and ScalarE (different PSUM banks run in parallel).
    rrow [128, tb]: per-token RMSNorm scale (decode), multiplied in first (VectorE)."""
    if rrow is not None:
        nf = i1 - i0
        if bias_T is None and all(tiles[f][1] == P for f in range(i0, i1)):
            # one VectorE pass per kind, scaled straight into the bf16 output: the epilogue's
            # transposes of the first kind start after its own eviction (Llama-3-70B TP8
            # T=128 on Trn3, modeled: 55.28 -> 55.12 us)
            for f, g, _ in _kind_runs(tiles, i0, i1):
                a, b = f - i0, g - i0
                nisa.tensor_tensor(dst=hT[:, a:b, 0:tb], data1=acc[:, a:b, 0:tb],
                                   data2=rrow[:, 0:tb].expand_dim(1).broadcast(1, b - a),
                                   op=nl.multiply)
            return ev
        tmp = nl.ndarray((P, nf, tb), dtype=nl.float32, buffer=nl.sbuf)        # [128, nf, tb]
        nisa.tensor_tensor(dst=tmp, data1=acc[:, :, 0:tb], data2=rrow.expand_dim(1).broadcast(1, nf),
                           op=nl.multiply)
        acc = tmp
    f = i0
    while f < i1:
        nn = tiles[f][1]
        g = f
        while g < i1 and tiles[g][1] == nn and g - f < 4:
            g += 1
        a, b = f - i0, g - i0
        if bias_T is None:
            eng = nisa.engine.vector if ev % 2 == 0 else nisa.engine.scalar
            nisa.tensor_copy(dst=hT[0:nn, a:b, 0:tb], src=acc[0:nn, a:b, 0:tb], engine=eng)
            ev += 1
        else:
            for j in range(a, b):
                bcol = bias_T[0:nn, i0 + j:i0 + j + 1]                           # [nn, 1]
                if ev % 2 == 0:
                    nisa.tensor_scalar(dst=hT[0:nn, j, 0:tb], data=acc[0:nn, j, 0:tb],
                                       op0=nl.add, operand0=bcol)
                else:
                    nisa.activation(dst=hT[0:nn, j, 0:tb], op=nl.copy, data=acc[0:nn, j, 0:tb],
                                    bias=bcol)
                ev += 1
        f = g
    return ev


class _Ctx:
    """Epilogue state of one launch: output tensors, tile list, RoPE / QK-norm parameters."""

    def __init__(self, outs, tiles, d, rot, interleaved, k_transposed, cos, sin, qk_g, qk_eps,
                 ident, T, passes, ident_f):
        self.outs = outs
        self.tiles = tiles
        self.ident_f = ident_f
        # head counts of the (head, token group) lane groups of one-token-per-partition blocks
        self.hl_sizes = _head_lane_sizes(tiles, passes, d, k_transposed)
        self.d = d
        self.rot = rot
        self.h2 = rot // 2
        self.interleaved = interleaved
        self.k_transposed = k_transposed
        self.cos, self.sin = cos, sin
        self.qk_g = qk_g
        self.qk_eps = qk_eps
        self.ident = ident
        self.T = T
        self.ev = 0

    # ------------------------------------------------------------------ block-level tables
    def block(self, t0, tb):
        """Lane layout of a token block: R tokens per partition on 128 partitions (token lanes:
        partition p, slot j <-> token t0 + R*p + j) for the first 128*R tokens (at R = 1 head
        lanes for groups of heads, ``_head_lanes``), and the remaining r < 128 tokens as (unit,
        token) pair lanes. RoPE tables for all three."""
        R = tb // P
        r = tb - R * P
        blk = {"t0": t0, "tb": tb, "R": R, "r": r, "tab": None, "ptab": {}, "htab": {}}
        if self.rot and R:
            h2 = self.h2
            tab = nl.ndarray((P, 2, R, h2), dtype=nl.float32, buffer=nl.sbuf)  # [128, cos|sin, R, h2]
            for i, src in enumerate((self.cos, self.sin)):
                nisa.dma_copy(dst=tab[:, i, :, :],
                              src=src[t0:t0 + P * R, :].reshape_dim(0, (P, R)))
            blk["tab"] = tab
            if R == 1:
                for nh in self.hl_sizes:
                    blk["htab"][nh] = self._head_table(tab, nh)
        return blk

    def _head_table(self, tab, nh):
        """RoPE table of head lanes of nh heads, [128, cos|sin, nh, h2]: lane h*G + g, slot j <-
        token t0 + g*nh + j (G = 128 / nh), from the token table on TensorE: one fp32 transpose
        to [2*h2, 128 tokens], then per slot a transpose of columns j, j + nh, ... repeated for
        each head (a stride-0 dim of the stationary). Loaded by DMA instead, the lanes' copies of
        each row would move nh times the table through the queues the weights stream on
        (Llama-3-70B TP8 T=128, 8 q heads: 512 KB, +1.0 us modeled on Trn3). The evictions are
        VectorE's: TensorE, in order, waits for them before the GEMM, and ScalarE is busy with
        the RMSNorm's sums of squares there (Trn3 on ScalarE: 60.77 us instead of 55.12)."""
        f32 = nl.float32
        h2, G = self.h2, P // nh
        n = 2 * h2
        tp = nl.ndarray((n, P), dtype=f32, buffer=nl.psum)                     # [2*h2, 128]
        nisa.nc_matmul(dst=tp, stationary=tab.reshape((P, n)), moving=self.ident_f,
                       is_transpose=True)
        tabT = nl.ndarray((n, P), dtype=f32, buffer=nl.sbuf)                  # [2*h2, 128]
        nisa.tensor_copy(dst=tabT, src=tp, engine=nisa.engine.vector)
        del tp
        out = nl.ndarray((P, 2, nh, h2), dtype=f32, buffer=nl.sbuf)           # [128, 2, nh, h2]
        spb = max(1, D.PSUM_BANK // (4 * n))         # slots per fp32 PSUM bank
        for j0 in range(0, nh, spb):
            cn = min(spb, nh - j0)
            ps = nl.ndarray((P, cn, n), dtype=f32, buffer=nl.psum)            # [128, cn, 2*h2]
            for j in range(j0, j0 + cn):
                src = tabT[:, j:j + nh * (G - 1) + 1:nh].expand_dim(1).broadcast(1, nh)
                nisa.nc_matmul(dst=ps[:, j - j0, :], stationary=src,          # [2*h2, nh, G]
                               moving=self.ident_f[0:n, 0:n], is_transpose=True)
            nisa.tensor_copy(dst=out[:, :, j0:j0 + cn, :].permute((0, 2, 1, 3)),
                             src=ps.reshape((P, cn, 2, h2)), engine=nisa.engine.vector)
        return out

    def pair_table(self, blk, g):
        """RoPE table of pair lanes: lane (u, t) <- token t0 + 128R + t, for g units."""
        key = g
        if key not in blk["ptab"]:
            r, h2 = blk["r"], self.h2
            lo = blk["t0"] + blk["R"] * P
            tab = nl.ndarray((g * r, 2, h2), dtype=nl.float32, buffer=nl.sbuf)   # [g*r, 2, h2]
            for i, src in enumerate((self.cos, self.sin)):
                s = src[lo:lo + r, :].reshape((1, r, h2)).broadcast(0, g)
                nisa.dma_copy(dst=tab[:, i, :], src=s)
            blk["ptab"][key] = tab
        return blk["ptab"][key]

    # ------------------------------------------------------------------ epilogue of one pass
    def epilogue(self, blk, hT, i0, i1):
        """Transposes of the pass's feature tiles into lanes, QK-norm / RoPE, output DMAs."""
        for f, g, kind, nh, head in _epilogue_runs(self.tiles, i0, i1, blk["R"], self.d,
                                                   self.k_transposed):
            if head:
                self._head_lanes(blk, hT, i0, f, nh, kind)
            elif blk["R"]:
                self._token_lanes(blk, hT, i0, f, g, kind)
            if blk["r"]:
                self._pair_lanes(blk, hT, i0, f, g, kind)

    def _head_range(self, f, g):
        """Global head offset within its kind and head count of tiles [f, g)."""
        d = self.d
        c0 = self.tiles[f][0]
        c1 = self.tiles[g - 1][0] + self.tiles[g - 1][1]
        kind = self.tiles[f][2]
        base = {0: 0, 1: self._nq() * d, 2: (self._nq() + self._nkv()) * d}[kind]
        return (c0 - base) // d, (c1 - c0) // d

    def _nq(self):
        return self.outs[0].shape[0]

    def _nkv(self):
        return self.outs[2].shape[0]

    def _token_lanes(self, blk, hT, i0, f, g, kind):
        """Tokens on partitions (R per partition), heads of tiles [f, g) along the free dim."""
        d, R, t0 = self.d, blk["R"], blk["t0"]
        h0, nh = self._head_range(f, g)
        stage = nl.ndarray((P, nh, R, d), dtype=nl.bfloat16, buffer=nl.sbuf)   # [128, nh, R, d]
        hpc = max(1, 1024 // d)                      # heads per PSUM chunk (one bf16 bank)
        out = self.outs[kind]
        # one token per partition (head counts that do not divide 128; the others go out in
        # head lanes): the heads go out in two halves, each as soon as it is done (the first
        # half's DMA overlaps the second half's lanes)
        split = R == 1 and nh > 1 and d == P and not (kind == 1 and self.k_transposed)
        if split:
            hpc = min(hpc, cdiv(nh, 2))
        for j in range(R):
            for c0 in range(0, nh, hpc):
                cn = min(hpc, nh - c0)
                X = nl.ndarray((P, cn * d), dtype=nl.bfloat16, buffer=nl.psum)  # [128, cn*d]
                col = 0
                fa = f + (c0 * d) // P
                fb = f + cdiv((c0 + cn) * d, P)
                for ft in range(fa, fb):
                    nn = self.tiles[ft][1]
                    nisa.nc_matmul(dst=X[:, col:col + nn],
                                   stationary=hT[0:nn, ft - i0, j:j + R * (P - 1) + 1:R],
                                   moving=self.ident[0:nn, 0:nn], is_transpose=True)
                    col += nn
                tab = None
                if blk["tab"] is not None:
                    tab = (blk["tab"][:, 0, j, :], blk["tab"][:, 1, j, :])
                self._lanes(X.reshape((P, cn, d)), stage[:, c0:c0 + cn, j, :], P, cn, kind, tab)
                if split:
                    dst = out[h0 + c0:h0 + c0 + cn, t0:t0 + P, :].permute((1, 0, 2))
                    nisa.dma_copy(dst=dst, src=stage[:, c0:c0 + cn, 0, :])
        if split:
            return
        if kind == 1 and self.k_transposed:
            self._store_kT_token(stage, blk, h0, nh)
            return
        dst = out[h0:h0 + nh, t0:t0 + P * R, :].reshape_dim(1, (P, R)).permute((1, 0, 2, 3))
        nisa.dma_copy(dst=dst, src=stage)

    def _head_lanes(self, blk, hT, i0, f, nh, kind):
        """One token per partition (R == 1), nh heads of one kind: lanes are (head, token group)
        pairs instead, partition h*G + g holding tokens t0 + g*nh ... t0 + g*nh + nh - 1 of head
        h (G = 128 / nh groups, nh slots), so that each partition stores one run of nh*d
        elements instead of nh runs of d. Slot j is one PE transpose of the nh tiles' tokens j,
        j + nh, ... (a strided stationary [128, nh, G]).

        Token lanes store a 256-B row per head and token, each descriptor priced at the 1.5 KiB
        floor: Llama-3-70B TP8 T=128 spent 5.3 us of its 58.6 on the stores after the last
        matmul (Trn3, modeled). With 2 KiB runs: 57.44 -> 55.12 us on Trn3, 78.48 -> 75.04 on
        Trn2 (with the rest of this path as it is); Llama-3-8B T=128 (its second pass: 8 q, 8 k,
        8 v heads) 121.0 -> 113.3 / 172.4 -> 161.0."""
        d, t0 = self.d, blk["t0"]
        h0 = self._head_range(f, f + nh)[0]
        G = P // nh
        stage = nl.ndarray((P, nh, d), dtype=nl.bfloat16, buffer=nl.sbuf)      # [128, nh, d]
        # slots per PSUM chunk: half of them (at most a bf16 bank), so that GpSimd combines the
        # first half's RoPE while VectorE multiplies the second's (Llama-3-70B TP8 T=128,
        # modeled: Trn3 55.55 -> 55.12 us, Trn2 75.40 -> 75.04)
        spc = min(max(1, 1024 // d), cdiv(nh, 2))
        tab = blk["htab"].get(nh)
        for j0 in range(0, nh, spc):
            cn = min(spc, nh - j0)
            X = nl.ndarray((P, cn, d), dtype=nl.bfloat16, buffer=nl.psum)      # [128, cn, d]
            for j in range(j0, j0 + cn):
                src = hT[:, f - i0:f - i0 + nh, j:j + nh * (G - 1) + 1:nh]     # [128, nh, G]
                nisa.nc_matmul(dst=X[:, j - j0, :], stationary=src, moving=self.ident,
                               is_transpose=True)
            t = None if tab is None else (tab[:, 0, j0:j0 + cn, :], tab[:, 1, j0:j0 + cn, :])
            self._lanes(X, stage[:, j0:j0 + cn, :], P, cn, kind, t)
        dst = self.outs[kind][h0:h0 + nh, t0:t0 + P, :].reshape_dim(1, (G, nh))  # [nh, G, nh, d]
        nisa.dma_copy(dst=dst, src=stage)

    def _pair_lanes(self, blk, hT, i0, f, g, kind):
        """Leftover r < 128 tokens: lanes are (unit, token) pairs, unit = a feature tile of
        128/d heads (d <= 128) or one 256-wide head (two tiles)."""
        d, r = self.d, blk["r"]
        lo = blk["t0"] + blk["R"] * P
        h0, nh = self._head_range(f, g)
        units = []   # (first tile, n tiles, heads in unit)
        if d == 256:
            units = [(ft, 2, 1) for ft in range(f, g, 2)]
        else:
            units = [(ft, 1, self.tiles[ft][1] // d) for ft in range(f, g)]
        gmax = max(1, P // r)
        u = 0
        hh = h0
        while u < len(units):
            hpu = units[u][2]
            v = u
            while v < len(units) and v - u < gmax and units[v][2] == hpu:
                v += 1
            ng = v - u
            L = ng * r
            X = nl.ndarray((L, hpu * d), dtype=nl.bfloat16, buffer=nl.psum)   # [L, hpu*d]
            fu = units[u][0] - i0
            s0 = lo - blk["t0"]
            if d == 256:   # even tiles: dims 0..127 of each head, odd tiles: 128..255
                for half in range(2):
                    src = hT[:, fu + half:fu + half + 2 * ng - 1:2, s0:s0 + r]   # [128, ng, r]
                    nisa.nc_matmul(dst=X[:, half * P:(half + 1) * P], stationary=src,
                                   moving=self.ident, is_transpose=True)
            else:
                nn = hpu * d
                src = hT[0:nn, fu:fu + ng, s0:s0 + r]                             # [nn, ng, r]
                nisa.nc_matmul(dst=X, stationary=src, moving=self.ident[0:nn, 0:nn],
                               is_transpose=True)
            stage = nl.ndarray((L, hpu, d), dtype=nl.bfloat16, buffer=nl.sbuf)   # [L, hpu, d]
            tab = None
            if self.rot:
                pt = self.pair_table(blk, ng)
                tab = (pt[:, 0, :], pt[:, 1, :])
            self._lanes(X.reshape((L, hpu, d)), stage, L, hpu, kind, tab)
            nheads = ng * hpu
            if kind == 1 and self.k_transposed:
                self._store_kT_pair(stage, lo, r, hh, ng, hpu, L)
            else:
                out = self.outs[kind]
                dst = out[hh:hh + nheads, lo:lo + r, :].reshape_dim(0, (ng, hpu)).permute(
                    (0, 2, 1, 3))
                nisa.dma_copy(dst=dst, src=stage)
            del stage   # the next unit group's stage does not overlap this one
            hh += nheads
            u = v

    # ------------------------------------------------------------------ lane math
    def _lanes(self, X, S, L, G, kind, tab):
        """X: PSUM [L, G, d] bf16 -> S: SBUF [L, G, d] bf16 view.

        q, k: optional per-head RMSNorm (sum of squares along d, rsqrt on ScalarE), then RoPE
        on the first rot dims: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), pairs (i, i + rot/2)
        or (2i, 2i + 1). v: a copy."""
        d, rot, h2 = self.d, self.rot, self.h2
        if kind == 2 or (not rot and self.qk_g[kind] is None):
            eng = nisa.engine.scalar if self.ev % 2 else nisa.engine.vector
            self.ev += 1
            nisa.tensor_copy(dst=S, src=X, engine=eng)
            return
        f32 = nl.float32
        src = X
        gam = self.qk_g[kind]
        if gam is not None:
            sq = nl.ndarray((L, G, d), dtype=f32, buffer=nl.sbuf)               # [L, G, d]
            nisa.activation(dst=sq, op=nl.square, data=X)
            ss = nl.ndarray((L, G), dtype=f32, buffer=nl.sbuf)                  # [L, G]
            nisa.tensor_reduce(dst=ss, op=nl.add, data=sq, axis=2)
            rq = nl.ndarray((L, G), dtype=f32, buffer=nl.sbuf)                  # [L, G]
            nisa.activation(dst=rq, op=nl.rsqrt, data=ss, scale=1.0 / d, bias=float(self.qk_eps))
            xs = nl.ndarray((L, G, d), dtype=f32, buffer=nl.sbuf)               # [L, G, d]
            nisa.tensor_tensor(dst=xs, data1=X, data2=rq.expand_dim(2).broadcast(2, d),
                               op=nl.multiply)
            src = xs
        if not rot:      # QK-norm only
            nisa.tensor_tensor(dst=S, data1=src, data2=_bc(gam[0:L, :], G), op=nl.multiply)
            return
        if self.interleaved:
            i1, i2 = slice(0, rot, 2), slice(1, rot, 2)
        else:
            i1, i2 = slice(0, h2), slice(h2, rot)
        cos, sin = tab
        if gam is not None:   # fold the QK-norm weight into the tables
            c1, s1, c2, s2 = (nl.ndarray(cos.shape, dtype=f32, buffer=nl.sbuf) for _ in range(4))
            g1, g2 = gam[0:L, i1], gam[0:L, i2]
            if len(cos.shape) == 3:   # head lanes: a table row per slot
                g1, g2 = _bc(g1, G), _bc(g2, G)
            nisa.tensor_tensor(dst=c1, data1=cos, data2=g1, op=nl.multiply)
            nisa.tensor_tensor(dst=s1, data1=sin, data2=g1, op=nl.multiply)
            nisa.tensor_tensor(dst=c2, data1=cos, data2=g2, op=nl.multiply)
            nisa.tensor_tensor(dst=s2, data1=sin, data2=g2, op=nl.multiply)
        else:
            c1 = c2 = cos
            s1 = s2 = sin
        x1, x2 = src[:, :, i1], src[:, :, i2]
        a = nl.ndarray((L, G, h2), dtype=f32, buffer=nl.sbuf)                   # [L, G, h2]
        b = nl.ndarray((L, G, h2), dtype=f32, buffer=nl.sbuf)                   # [L, G, h2]
        nisa.tensor_tensor(dst=a, data1=x1, data2=_bc(c1, G), op=nl.multiply)
        nisa.tensor_tensor(dst=b, data1=x2, data2=_bc(s2, G), op=nl.multiply)
        # the combines read SBUF only: GpSimd takes them (spec: tensor_tensor runs on "Vector
        # Engine or GpSimd Engine"; float math in fp32 on either), relieving VectorE
        nisa.tensor_tensor(dst=S[:, :, i1], data1=a, data2=b, op=nl.subtract,
                           engine=nisa.engine.gpsimd)
        a2 = nl.ndarray((L, G, h2), dtype=f32, buffer=nl.sbuf)                  # [L, G, h2]
        b2 = nl.ndarray((L, G, h2), dtype=f32, buffer=nl.sbuf)                  # [L, G, h2]
        nisa.tensor_tensor(dst=a2, data1=x2, data2=_bc(c2, G), op=nl.multiply)
        nisa.tensor_tensor(dst=b2, data1=x1, data2=_bc(s1, G), op=nl.multiply)
        nisa.tensor_tensor(dst=S[:, :, i2], data1=a2, data2=b2, op=nl.add,
                           engine=nisa.engine.gpsimd)
        if rot < d:
            if gam is not None:
                nisa.tensor_tensor(dst=S[:, :, rot:d], data1=src[:, :, rot:d],
                                   data2=_bc(gam[0:L, rot:d], G), op=nl.multiply)
            else:
                nisa.tensor_copy(dst=S[:, :, rot:d], src=src[:, :, rot:d],
                                 engine=nisa.engine.scalar)

    # ------------------------------------------------------------------ transposed k
    def _store_kT_token(self, stage, blk, h0, nh):
        """Token-lane k [128, nh, R, d] -> k[h, :, t0 : t0 + 128 R] via transposes back."""
        d, R, t0 = self.d, blk["R"], blk["t0"]
        dp = min(d, P)
        nd = d // dp
        kT = nl.ndarray((dp, nd, nh, P * R), dtype=nl.bfloat16, buffer=nl.sbuf)  # [dp, nd, nh, 128R]
        for hh in range(nh):
            for j in range(R):
                for c in range(nd):
                    tp = nl.ndarray((dp, P), dtype=nl.bfloat16, buffer=nl.psum)   # [dp, 128]
                    nisa.nc_matmul(dst=tp, stationary=stage[:, hh, j, c * dp:(c + 1) * dp],
                                   moving=self.ident, is_transpose=True)
                    nisa.tensor_copy(dst=kT[:, c, hh, j:j + R * (P - 1) + 1:R], src=tp)
        k = self.outs[1]
        dst = k[h0:h0 + nh, :, t0:t0 + P * R].reshape_dim(1, (nd, dp)).permute((2, 1, 0, 3))
        nisa.dma_copy(dst=dst, src=kT)

    def _store_kT_pair(self, stage, lo, r, hh, ng, hpu, L):
        """Pair-lane k [L=(unit, t), hpu, d] -> k[h, :, lo:lo + r]."""
        d = self.d
        dp = min(d, P)
        nd = d // dp
        kT = nl.ndarray((dp, nd, ng, hpu, r), dtype=nl.bfloat16, buffer=nl.sbuf)
        for s in range(hpu):
            for c in range(nd):
                tp = nl.ndarray((dp, L), dtype=nl.bfloat16, buffer=nl.psum)       # [dp, L]
                nisa.nc_matmul(dst=tp, stationary=stage[:, s, c * dp:(c + 1) * dp],
                               moving=self.ident[0:L, 0:L], is_transpose=True)
                nisa.tensor_copy(dst=kT[:, c, :, s, :], src=tp)
        k = self.outs[1]
        nh = ng * hpu
        dst = k[hh:hh + nh, :, lo:lo + r].reshape_dim(1, (nd, dp)).reshape_dim(0, (ng, hpu))
        dst = dst.permute((3, 2, 0, 1, 4))                    # [dp, nd, ng, hpu, r]
        nisa.dma_copy(dst=dst, src=kT)


def _bc(t, G):
    """[L, n] -> [L, G, n] view with stride 0 along G ([L, G, n] tables as they are)."""
    if len(t.shape) == 3:
        return t
    return t.expand_dim(1).broadcast(1, G)


# ---------------------------------------------------------------------------------------- op
class QKVOutput(NamedTuple):
    q: object          # [n_q_heads, T, head_dim]
    k: object          # [n_kv_heads, T, head_dim] or [n_kv_heads, head_dim, T]
    v: object          # [n_kv_heads, T, head_dim]
    residual: object   # x + residual [T, H] when a residual was fused, else None


def rope_cos_sin(positions, rotary_dim, theta):
    """cos, sin [T, rotary_dim // 2] fp32 of ``positions * theta ** (-2i / rotary_dim)``."""
    pos = np.asarray(positions, dtype=np.float64).reshape(-1)
    inv = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    ang = pos[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def qkv_proj(x, w_qkv, *, n_q_heads, n_kv_heads, head_dim, bias=None, residual=None,
             norm_weight=None, eps=1e-6, q_norm_weight=None, k_norm_weight=None,
             qk_norm_eps=None, positions=None, rope_theta=10000.0, cos=None, sin=None,
             rotary_dim=None, rope_layout="half", k_layout="heads") -> QKVOutput:
    """Fused QKV projection (RMSNorm + QKV GEMM + QK-norm + RoPE) on a NeuronCore.

    Args:
      x: [T, H] bfloat16 (NumPy / ml_dtypes or CPU torch).
      w_qkv: [H, (n_q_heads + 2 n_kv_heads) * head_dim] bfloat16, columns q | k | v.
      n_q_heads, n_kv_heads: heads (n_q_heads a multiple of n_kv_heads); head_dim 64, 128 or 256.
      bias: optional [(n_q + 2 n_kv) * head_dim] float vector.
      residual: optional [T, H] bfloat16 added to x before the norm; the sum is returned.
      norm_weight: optional [H] RMSNorm weight (gamma); eps its epsilon. None = no norm.
      q_norm_weight, k_norm_weight: optional [head_dim] per-head RMSNorm weights of q and k
        (Qwen3 QK-norm; both or neither); qk_norm_eps defaults to eps.
      positions: optional [T] integer positions -> RoPE with rope_theta; or cos, sin:
        [T, rotary_dim // 2] tables (one angle per rotated pair). Neither = no RoPE.
      rotary_dim: rotated dims per head (even, <= head_dim; default head_dim).
      rope_layout: "half" (pairs (i, i + rotary_dim/2), Llama / NeoX) or "interleaved"
        (pairs (2i, 2i+1), GPT-J).
      k_layout: "heads" (k [n_kv, T, d]) or "transposed" (k [n_kv, d, T]).
    Returns:
      QKVOutput(q, k, v, residual) with bfloat16 q [n_q, T, d], k, v [n_kv, T, d] (k as
      [n_kv, d, T] when transposed); residual is x + residual, or None.
    """
    name = "qkv_proj"
    check_target(name)
    check_no_grad(name, x, w_qkv, bias, residual, norm_weight, q_norm_weight, k_norm_weight,
                  cos, sin)
    T, H = check_2d(name, "x", x)
    check_dtype(name, "x", x, ("bfloat16",))
    for a, v in (("n_q_heads", n_q_heads), ("n_kv_heads", n_kv_heads)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: {a} must be a positive int; got {v!r}")
    if n_q_heads % n_kv_heads:
        raise ValueError(f"{name}: n_q_heads ({n_q_heads}) must be a multiple of n_kv_heads "
                         f"({n_kv_heads})")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{name}: head_dim must be one of 64, 128, 256; got {head_dim}")
    N = (n_q_heads + 2 * n_kv_heads) * head_dim
    Hw, Nw = check_2d(name, "w_qkv", w_qkv)
    if (Hw, Nw) != (H, N):
        raise ValueError(f"{name}: w_qkv must be [H, (n_q_heads + 2 n_kv_heads) * head_dim] = "
                         f"[{H}, {N}]; got {list(w_qkv.shape)}")
    check_dtype(name, "w_qkv", w_qkv, ("bfloat16",))
    if bias is not None:
        bias = float_vector(name, "bias", bias, N)
    if residual is not None:
        if tuple(residual.shape) != (T, H):
            raise ValueError(f"{name}: residual must have the shape of x {[T, H]}; got "
                             f"{list(residual.shape)}")
        check_dtype(name, "residual", residual, ("bfloat16",))
    if norm_weight is not None:
        norm_weight = float_vector(name, "norm_weight", norm_weight, H)
    check_eps(name, eps)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError(f"{name}: q_norm_weight and k_norm_weight must be given together")
    if q_norm_weight is not None:
        q_norm_weight = float_vector(name, "q_norm_weight", q_norm_weight, head_dim)
        k_norm_weight = float_vector(name, "k_norm_weight", k_norm_weight, head_dim)
    qk_eps = eps if qk_norm_eps is None else qk_norm_eps
    check_eps(name, qk_eps, "qk_norm_eps")
    if rope_layout not in ("half", "interleaved"):
        raise ValueError(f"{name}: rope_layout must be 'half' or 'interleaved'; got "
                         f"{rope_layout!r}")
    if k_layout not in ("heads", "transposed"):
        raise ValueError(f"{name}: k_layout must be 'heads' or 'transposed'; got {k_layout!r}")
    rot = head_dim if rotary_dim is None else rotary_dim
    if not isinstance(rot, (int, np.integer)) or rot < 2 or rot % 2 or rot > head_dim:
        raise ValueError(f"{name}: rotary_dim must be an even int in [2, head_dim={head_dim}]; "
                         f"got {rotary_dim!r}")
    if positions is not None and (cos is not None or sin is not None):
        raise ValueError(f"{name}: pass positions (with rope_theta) or cos/sin tables, not both")
    if (cos is None) != (sin is None):
        raise ValueError(f"{name}: cos and sin must be given together")
    if positions is not None:
        pos = np.asarray(positions)
        if pos.shape != (T,) or pos.dtype.kind not in "iu":
            raise ValueError(f"{name}: positions must be an integer array of shape [{T}]; got "
                             f"shape {list(pos.shape)} dtype {pos.dtype}")
        if not (isinstance(rope_theta, (int, float)) and rope_theta > 1):
            raise ValueError(f"{name}: rope_theta must be a float > 1; got {rope_theta!r}")
        cos, sin = rope_cos_sin(pos, rot, float(rope_theta))
    elif cos is not None:
        cos = np.asarray(cos, dtype=np.float32)
        sin = np.asarray(sin, dtype=np.float32)
        for a, t in (("cos", cos), ("sin", sin)):
            if t.shape != (T, rot // 2):
                raise ValueError(f"{name}: {a} must be [T, rotary_dim // 2] = [{T}, {rot // 2}]; "
                                 f"got {list(t.shape)}")
    else:
        rot = 0
    plan = plan_qkv(T, H, n_q_heads, n_kv_heads, head_dim, sbuf_budget(),
                    norm=norm_weight is not None, bias=bias is not None,
                    residual=residual is not None, rot=rot,
                    qk_norm=q_norm_weight is not None, k_transposed=k_layout == "transposed")
    res = launch(qkv_proj_kernel, x, w_qkv, bias, residual, norm_weight, q_norm_weight,
                 k_norm_weight, cos, sin, n_q_heads, n_kv_heads, head_dim, float(eps),
                 float(qk_eps), rot, rope_layout == "interleaved", k_layout == "transposed",
                 plan.tb_max, plan.nf_max, plan.kb, plan.kc, plan.ts_max)
    q, k, v = res[0], res[1], res[2]
    return QKVOutput(q, k, v, res[3] if residual is not None else None)
