"""SwiGLU MLP: ``y = residual + (silu(xn @ W_gate) * (xn @ W_up)) @ W_down``, ``xn = rmsnorm(x)``.

One kernel for prefill and decode (docs/dense.md), on the weight-stationary GEMM passes of
``_tiles``: gate and up produce ``hT [I, tokens]`` directly in the layout the down projection
contracts over (I on partitions), so the intermediate never leaves SBUF and never needs a
transpose; only the output ``yT [H, tokens]`` is transposed back to ``y [T, H]``.

Weights in bf16, or FP8 (``float8_e4m3`` on Trn2 and Trn3, ``float8_e4m3fn`` on Trn3) with one
fp32 scale per output channel. With FP8 weights the activations (the normalised x and the
intermediate h) are quantized to the same FP8 format per token inside the kernel, and the
GEMMs run ``double_row`` (contraction 256 per instruction, 2x the bf16 rate).
"""
from __future__ import annotations

from dataclasses import dataclass

from .._limits import SbufLedger, sbuf_budget
from .._validate import (
    check_2d,
    check_dtype,
    check_eps,
    check_no_grad,
    check_target,
    float_vector,
)
from .._validate import dtype_name as _dtype_name
from ..backend import launch, nisa, nki, nl
from . import _tiles as D
from ._tiles import P, cdiv, tile_weight

NCOLS_MAX = 4096        # weight columns per pass: 8 KiB bf16 rows per k-tile in SBUF
RING = 2                # weight transfers: buffers reused across passes (_tiles.WeightRing),
RING_MIN_T = 512        # from this many tokens (TensorE-bound passes). Modeled with the SBUF bound,
                        # Trn2, T=2048: Llama-3-70B TP8 FP8 tile-major 3018.6 -> 2739.2 us,
                        # row-major 3193.8 -> 2983.0, Llama-3-8B FP8 row-major 5788.6 -> 5042.7,
                        # bf16 9769.4 -> 9387.5; at T <= 128 (weight-stream-bound) the ring cost
                        # 1-12% (tile-major FP8)
FP8_TB_PREF = 384       # FP8 tile-major prefill of several blocks: tokens per block first
_FP8 = ("float8_e4m3", "float8_e4m3fn")
FP8_MAX = {"float8_e4m3": 240.0, "float8_e4m3fn": 448.0}


@dataclass(frozen=True)
class MLPPlan:
    """Tile choices for one call.

    tb_max: tokens per block (<= 512, the largest multiple of 64 whose SBUF fits: the
      intermediate hT [128, I/128, tb] stays resident for the block). T <= tb_max is one block
      and every weight streams from HBM once (decode); larger T re-streams the weights once per
      block, which costs ridge/tb of the TensorE time (42% on Trn2 at 512 tokens).
    y_pipe: the transposes of down pass p run after pass p+1's GEMM (two yT buffers), so
      TensorE never waits for an eviction; off when SBUF is short (Llama-3-8B on Trn2).
    combined: gate and up accumulate in the same pass (when 2 x 8 accumulator tiles of
      [128, Tp] fp32 fit PSUM, i.e. tb <= 256); else a gate pass then an up pass per I-block,
      so each pass still reads weight rows in 2 KiB runs.
    nf_gu, nf_d: feature tiles per pass for gate/up and for down.
    kb_gu, kb_d: weight k-tiles per DMA (tiled: of one feature tile, ~4 KiB per partition).
    sbuf_bytes: the most SBUF per partition the kernel holds at once with these choices
      (``mlp_sbuf``: its buffers walked in its order; equal to the emulator's measured peak).
    tiled: weights in the tile-major layout of ``tile_weight``.
    """

    T: int
    H: int
    I: int
    tb_max: int
    combined: bool
    nf_gu: int
    nf_d: int
    kb_gu: int
    kb_d: int
    fp8: bool
    y_pipe: bool
    sbuf_bytes: int
    tiled: bool = False


def plan_mlp(T, H, I, w_bytes, fp8, sbuf_budget, tiled=False, *, norm=True,
             residual=True) -> MLPPlan:
    """Largest token block (multiple of 64, <= 512) whose SBUF fits, preferring a double-
    buffered y epilogue at equal block size.

    The SBUF figure is ``mlp_sbuf`` of the candidate: the kernel's own buffers walked in its
    order, the peak of what it holds at once (norm, residual: the call's options; by default
    on, which bounds the calls without them)."""
    KT, KI = cdiv(H, P), cdiv(I, P)
    best = None
    cands = list(range(512, 63, -64))
    if fp8 and tiled and T > D.TB_MAX:
        # FP8 tile-major prefill of several blocks (weights stream at full DMA efficiency, the
        # GEMM binds): blocks of at most 384 tokens first (Llama-3-8B, T = 2048: 6 blocks of 342
        # tokens 4862.7 us, 4 of 512 4888.3 us; at T = 512 one block of 512 is the faster,
        # 1262.6 us against 1281.2 us for 2 of 256; Trn3, modeled). Row-major FP8 streams at
        # ~42% efficiency and wants fewer, larger blocks (Llama-3-70B TP8, T = 2048: 512 tokens
        # 2704.9 us, 384 tokens 2716.0 us)
        cands = [FP8_TB_PREF] + [c for c in cands if c != FP8_TB_PREF]
    for tb_max in cands:
        tb = max(b for _, b in D.token_blocks(T, tb_max))
        combined = D.max_tiles_per_pass(tb, 2) >= 8
        ncap = NCOLS_MAX // P
        nf_gu = min(D.max_tiles_per_pass(tb, 2 if combined else 1), ncap, KI)
        nf_d = min(D.max_tiles_per_pass(tb, 1), ncap, KT)
        cols_gu, cols_d = (P, P) if tiled else (nf_gu * P, nf_d * P)   # per weight transfer
        kb_gu = D.k_tiles_per_dma(cols_gu, w_bytes, H, 4096)
        kb_d = D.k_tiles_per_dma(cols_d, w_bytes, I, 4096)
        for y_pipe in (True, False):
            sb = mlp_sbuf(T, H, I, tb_max, combined, nf_gu, nf_d, kb_gu, kb_d, y_pipe, fp8,
                          tiled, norm=norm, residual=residual).peak
            if sb <= sbuf_budget:
                return MLPPlan(T, H, I, tb_max, combined, nf_gu, nf_d, kb_gu, kb_d, fp8,
                               y_pipe, sb, tiled)
            best = sb if best is None else min(best, sb)
        if tb < 64:
            break
    raise ValueError(f"swiglu_mlp: hidden={H}, intermediate={I} need {best} bytes of SBUF per "
                     f"partition even at 64 tokens per block; {sbuf_budget} available")


# ------------------------------------------------------------------------------ SBUF plan
def _ring_shapes(nw, kb_gu, kb_d, nf_gu, nf_d, fp8, tiled):
    """(weights, k-tiles, columns) of each weight ring: tile-major, one ring shared by every
    pass; row-major, one for the gate/up passes and one for the down passes."""
    step = 2 if fp8 else 1
    kn_gu, kn_d = max(kb_gu, step), max(kb_d, step)
    if tiled:
        return [(nw, max(kn_gu, kn_d), P)]
    return [(nw, kn_gu, nf_gu * P), (1, kn_d, nf_d * P)]


def _ring_bytes(nw, kb_gu, kb_d, nf_gu, nf_d, fp8, tiled, wb):
    return sum(RING * n * kn * cols * wb
               for n, kn, cols in _ring_shapes(nw, kb_gu, kb_d, nf_gu, nf_d, fp8, tiled))


def _weight_rings(nw, kb_gu, kb_d, nf_gu, nf_d, fp8, tiled, dtype):
    """The gate/up ring and the down ring (tile-major: the same one)."""
    rings = [D.WeightRing(n, kn, dtype, RING, ncols=cols)
             for n, kn, cols in _ring_shapes(nw, kb_gu, kb_d, nf_gu, nf_d, fp8, tiled)]
    return rings[0], rings[-1]


def mlp_sbuf(T, H, I, tb_max, combined, nf_gu, nf_d, kb_gu, kb_d, y_pipe, fp8=False,
             tiled=False, *, norm=True, residual=True):
    """The kernel's SBUF buffers (bytes per partition) in the order ``swiglu_mlp_kernel``
    takes and releases them, for these tile choices and options: an ``SbufLedger`` whose
    ``peak`` is the plan's figure.

    It follows the kernel step by step (same helpers for blocks, passes and k-chunks), so a
    change to one is a change to the other; tests/test_sbuf_plan.py checks the figure against
    the emulator's measured peak in every regime."""
    led = SbufLedger()
    KT, KI = cdiv(H, P), cdiv(I, P)
    wb = 1 if fp8 else 2
    nw = 2 if combined else 1
    gu_tiles = D.feature_tiles([(0, I, 0)])
    gu_passes = D.group_passes(gu_tiles, nf_gu)
    d_tiles = D.feature_tiles([(0, H, 0)])
    d_passes = D.group_passes(d_tiles, nf_d)
    i0, i1 = gu_passes[0]
    led.take("w", D.gemm_pass_loads(nw, H, [t[1] for t in gu_tiles[i0:i1]], kb_gu, wb, fp8,
                                    tiled)[0])
    ring = T >= RING_MIN_T
    if ring:                              # the weight rings (_weight_rings), held to the end
        led.take("ring", _ring_bytes(nw, kb_gu, kb_d, nf_gu, nf_d, fp8, tiled, wb))
    blocks = D.token_blocks(T, tb_max)
    rows = D.rows_sbuf(led, "rows", blocks[0][1], H, False, norm) if fp8 else None
    D.identity_sbuf(led, "ident", 2)
    D.identity_sbuf(led, "ident_f", 4)
    if norm and not fp8:
        D.col_vector_sbuf(led, "gamma_T", H)
    if fp8:   # _Fp8: weight scales as columns, the norm weight as a row, a row of ones
        for name, n in (("s_gate", I), ("s_up", I), ("s_down", H)):
            D.col_vector_sbuf(led, name, n)
        if norm:
            led.take("gamma_row", 4 * H)
        led.take("ones", 4 * P)
        led.take("sel", 4 * 4 * P)        # the quad layout's selector rows

    nc = GAMMA_CHUNKS if norm else 1      # _Fp8's column ranges

    def quantize_step(k):                 # _Fp8.quantize_rows, one sub-tile
        for n in ("mx", "mn", ("sc", k), "inv"):
            led.take(n, 4)
        led.take("amax", 4 * nc + (4 if nc > 1 else 0))
        led.take("xq", H)
        led.take(("xqb", k), 2 * H)
        led.drop(("rows", k), "mx", "mn", "amax", "inv", "xq")

    def x_block(tb, rows):                # _x_block, then rows_next = None
        if fp8:                           # row_scales, then the FP8 xT (double_row padding)
            led.take("a_row", 4 * tb)
            led.take("A", 4 * tb)
            led.drop("a_row")
            led.take("xT", (KT + KT % 2) * tb)
            led.drop(*[n for k in range(len(rows)) for n in (("xqb", k), ("sc", k))])
        else:
            led.take("xT", 2 * KT * tb)
            led.drop(*rows)

    if not fp8:
        rows = D.rows_sbuf(led, "rows", blocks[0][1], H, False, norm)
    for k in range(len(rows) if fp8 else 0):
        quantize_step(k)
    x_block(blocks[0][1], rows)
    pending = None
    for bi, (_, tb) in enumerate(blocks):
        last_block = bi + 1 == len(blocks)
        for pi, (i0, i1) in enumerate(gu_passes):
            widths = [gu_tiles[i][1] for i in range(i0, i1)]
            nf = i1 - i0
            D.gemm_pass_sbuf(led, nw, H, widths, kb_gu, wb, fp8, tiled,
                             prefetched=(bi == 0 and pi == 0), ring=ring)
            if fp8:                       # _silu_evict: token scale, then silu
                led.take("ga", 4 * nf * tb)
                led.take("sg", 4 * nf * tb)
                led.drop("ga")
            else:
                led.take("sg", 4 * nf * tb)
            if not combined:
                D.gemm_pass_sbuf(led, 1, H, widths, kb_gu, wb, fp8, tiled, ring=ring)
            if fp8:                       # h of the pass in bf16, its running max and min
                led.take(("hp", pi), 2 * nf * tb)
                if pi == 0:
                    led.take("hmax", 4 * tb)
                    led.take("hmin", 4 * tb)
            elif pi == 0:
                led.take("hT", 2 * KI * tb)
            led.drop("sg")
        led.drop("xT", *(["A"] if fp8 else []))
        if fp8:                           # quantize_h (the scales in the quad layout)
            for n in ("h_amax", "h_sc", "h_inv"):
                led.take(n, 4 * min(P, tb))
            for n in ("B", "Binv"):
                led.take(n, 4 * tb)
            led.take("hT", (KI + KI % 2) * tb)
            for pi in range(len(gu_passes)):
                led.drop(("hp", pi))
            led.drop("h_amax", "h_sc", "h_inv", "Binv", "hmax", "hmin")
        if not last_block:
            tnb = blocks[bi + 1][1]
            if not fp8:
                rows = D.rows_sbuf(led, "rows", tnb, H, False, norm)
        qsteps = []
        for pi, (j0, j1) in enumerate(d_passes):
            widths = [d_tiles[j][1] for j in range(j0, j1)]
            last = pi + 1 == len(d_passes)
            D.gemm_pass_sbuf(led, 1, I, widths, kb_d, wb, fp8, tiled, ring=ring)
            yT = ("yT", bi, pi)
            led.take(yT, 4 * (j1 - j0) * tb)
            if not last_block and pi == 0 and fp8:   # the next block's rows, then its steps
                rows = D.rows_sbuf(led, "rows", tnb, H, False, norm)
                qsteps = list(range(len(rows)))
            if last and not last_block:
                while qsteps:
                    quantize_step(qsteps.pop(0))
                x_block(tnb, rows)
            if pending is not None:
                _store_y_sbuf(led, pending[1], pending[2], residual)
                led.drop(pending[0])
            pending = (yT, tb, sum(widths))
            if not y_pipe:
                _store_y_sbuf(led, tb, sum(widths), residual)
                led.drop(yT)
                pending = None
            if qsteps and not last:
                quantize_step(qsteps.pop(0))
        led.drop("hT", *(["B"] if fp8 else []))
    if pending is not None:
        _store_y_sbuf(led, pending[1], pending[2], residual)
    return led


def _store_y_sbuf(led, tb, ncols, residual):
    """``_store_y``: per sub-tile of 128 tokens the residual rows and the output rows."""
    for _ in range(0, tb, P):
        if residual:
            led.take("r_sb", 2 * ncols)
        led.take("y_sb", 2 * ncols)
        led.drop("y_sb", *(["r_sb"] if residual else []))


# ------------------------------------------------------------------------------------ kernel
@nki.jit
def swiglu_mlp_kernel(x, w_gate, w_up, w_down, norm_w, residual, s_gate, s_up, s_down, eps,
                      tb_max, combined, nf_gu, nf_d, kb_gu, kb_d, y_pipe, tiled=False):
    """``y = residual + (silu(xn @ Wg) * (xn @ Wu)) @ Wd`` with ``xn = rmsnorm(x) * gamma``.

    Dimensions:
      T >= 1 tokens, H >= 1 hidden, I >= 1 intermediate.
    Args:
      x: [T, H] bf16 HBM.  w_gate, w_up: [H, I] HBM.  w_down: [I, H] HBM; bf16, or FP8 with
        s_gate, s_up: [I] fp32 and s_down: [H] fp32 per-output-channel scales (else None).
        tiled: the three weights are in the tile-major layout of ``tile_weight``
        ([I/128, 128, KTe(H), 128] and [H/128, 128, KTe(I), 128]).
      norm_w: [H] fp32 HBM or None (no RMSNorm).  residual: [T, H] bf16 HBM or None.
      eps: RMSNorm epsilon.  tb_max, combined, nf_gu, nf_d, kb_gu, kb_d, y_pipe: from MLPPlan.
    Returns:
      y: [T, H] bf16, shared HBM.
    Notes:
      fp32 accumulation; xn and h are rounded to bf16 (or quantized per token to FP8) as GEMM
      inputs; silu and the product run in fp32 on the PSUM eviction.
    Pseudocode:
      for t0 in token blocks (<= tb_max):
        xT[h, t] = gamma[h] * rmsnorm(x)[t, h]             # rows on partitions, PE transposes
        for I-block:                                       # weight-stationary passes
          g[i, t], u[i, t] = sum_k Wg/Wu[k, i].T @ xT[k, t]
          hT[i, t] = silu(g * sg[i]) * u * su[i]           # PSUM eviction, ScalarE + VectorE
        for H-block:
          yT[j, t] = sd[j] * sum_i Wd[i, j].T @ hT[i, t]
          y[t, j] = transpose(yT)[t, j] + residual[t, j]   # PE transposes (fp32), DMA out
    """
    T, H = x.shape
    I = w_gate.shape[0] * P if tiled else w_gate.shape[1]
    KI = cdiv(I, P)
    fp8 = s_gate is not None
    y = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    gu_tiles = D.feature_tiles([(0, I, 0)])
    gu_passes = D.group_passes(gu_tiles, nf_gu)
    i0, i1 = gu_passes[0]
    first = D.prefetch_weights([w_gate, w_up] if combined else [w_gate], H, kb_gu,
                               gu_tiles[i0][0], sum(t[1] for t in gu_tiles[i0:i1]), fp8, tiled)
    ring = ring_d = None
    if T >= RING_MIN_T:
        ring, ring_d = _weight_rings(2 if combined else 1, kb_gu, kb_d, nf_gu, nf_d, fp8, tiled,
                                     w_gate.dtype)
    d_tiles = D.feature_tiles([(0, H, 0)])
    norm = norm_w is not None
    blocks = D.token_blocks(T, tb_max)
    # FP8 loads the first block's rows ahead of its constants: the norm weight goes out as a
    # row broadcast to every partition (4 H bytes each), which would hold the rows back.
    rows_next = D.x_rows_normalised(x, blocks[0][0], blocks[0][1], None, None, norm, eps) \
        if fp8 else None
    ident = D.identity(nl.bfloat16)
    ident_f = D.identity(nl.float32)
    gamma_T = D.load_col_vector(norm_w, H, nl.float32, ident=ident_f) if norm and not fp8 \
        else None
    q = None
    if fp8:   # per-channel weight scales as columns; the norm weight as a row (per token amax)
        q = _Fp8(w_gate.dtype, (D.load_col_vector(s_gate, I, ident=ident_f),
                                D.load_col_vector(s_up, I, ident=ident_f),
                                D.load_col_vector(s_down, H, ident=ident_f)),
                 D.load_row_broadcast(norm_w, P, nl.float32, chunks=GAMMA_CHUNKS) if norm
                 else None, GAMMA_CHUNKS, ident_f=ident_f)
    else:
        rows_next = D.x_rows_normalised(x, blocks[0][0], blocks[0][1], None, None, norm, eps)
    _x_quantize(rows_next, q, all_steps=True)
    xT, A = _x_block(rows_next, blocks[0][1], H, gamma_T, ident, ident_f, q, w_gate.dtype)
    rows_next = None
    pending = None
    qsteps = []
    ev = [0]
    for bi, (t0, tb) in enumerate(blocks):
        Tp = D.acc_free(tb)
        if fp8:
            h_parts = []
            hmax = (nl.ndarray((P, tb), dtype=nl.float32, buffer=nl.sbuf),   # [128, tb] max h
                    nl.ndarray((P, tb), dtype=nl.float32, buffer=nl.sbuf))   # [128, tb] min h
        else:
            hT = nl.ndarray((P, KI, tb), dtype=nl.bfloat16, buffer=nl.sbuf)  # [128, KI, tb]
        for pi, (i0, i1) in enumerate(gu_passes):
            widths = [gu_tiles[i][1] for i in range(i0, i1)]
            c0 = gu_tiles[i0][0]
            if combined:
                acc_g, acc_u = D.gemm_pass([w_gate, w_up], xT, H, tb, Tp, widths, c0, kb_gu, fp8,
                                           first, tiled, ring=ring)
                first = None
                sg = _silu_evict(acc_g, widths, tb, q, A, i0)
                del acc_g
            else:
                acc_g = D.gemm_pass([w_gate], xT, H, tb, Tp, widths, c0, kb_gu, fp8, first,
                                    tiled, ring=ring)[0]
                first = None
                sg = _silu_evict(acc_g, widths, tb, q, A, i0)
                del acc_g
                acc_u = D.gemm_pass([w_up], xT, H, tb, Tp, widths, c0, kb_gu, fp8,
                                    tiled=tiled, ring=ring)[0]
            if fp8:
                hp = nl.ndarray((P, i1 - i0, tb), dtype=nl.bfloat16, buffer=nl.sbuf)  # [128, nf, tb]
                _gate_evict(hp, sg, acc_u, widths, tb, q, i0, 0)
                q.track_minmax(hmax, hp, tb, pi == 0)
                h_parts.append((i0, i1, hp))
                del hp   # h_parts holds it until quantize_h, no longer
            else:
                _gate_evict(hT, sg, acc_u, widths, tb, None, i0, i0)
            del acc_u, sg
        del xT, A
        B = None
        if fp8:   # per-token scale of h: max over partitions, then quantize every pass tile
            hT, B = q.quantize_h(h_parts, hmax, KI, tb, per_tile=True)
            del h_parts, hmax
        if bi + 1 < len(blocks) and not fp8:   # next block's loads and norm overlap its down GEMM
            tn0, tnb = blocks[bi + 1]
            rows_next = D.x_rows_normalised(x, tn0, tnb, None, None, norm, eps)
        dpasses = D.group_passes(d_tiles, nf_d)
        for pi, (j0, j1) in enumerate(dpasses):
            widths = [d_tiles[j][1] for j in range(j0, j1)]
            c0 = d_tiles[j0][0]
            acc = D.gemm_pass([w_down], hT, I, tb, Tp, widths, c0, kb_d, fp8, tiled=tiled,
                              ring=ring_d)[0]
            yT = nl.ndarray((P, j1 - j0, tb), dtype=nl.float32, buffer=nl.sbuf)  # [128, nf, tb]
            _evict_y(yT, acc, widths, tb, q, B, j0, ev)
            del acc
            last = pi + 1 == len(dpasses)
            if bi + 1 < len(blocks) and pi == 0:
                if fp8:
                    # the next block's rows after the first down pass's evictions: issued
                    # earlier, their norm (VectorE) and its SBUF traffic held up the
                    # quantization of h (GpSimd) that the down GEMM waits for
                    tn0, tnb = blocks[bi + 1]
                    rows_next = D.x_rows_normalised(x, tn0, tnb, None, None, norm, eps)
                # FP8: the next block's per-token quantization, one sub-tile per down pass
                # (below), so it overlaps this block's down GEMM without holding up the
                # evictions and residual adds (VectorE) behind it
                qsteps = _x_quantize(rows_next, q)
            if last and bi + 1 < len(blocks):
                while qsteps:
                    qsteps.pop(0)()
                # the next block's transposes go ahead of the pending epilogue
                xT, A = _x_block(rows_next, blocks[bi + 1][1], H, gamma_T, ident, ident_f, q,
                                 w_gate.dtype)
                rows_next = None
            if pending is not None:
                _store_y(y, residual, ident_f, *pending)
            pending = (yT, t0, tb, c0, widths)
            if not y_pipe:
                _store_y(y, residual, ident_f, *pending)
                pending = None
            del yT
            if qsteps and not last:
                qsteps.pop(0)()
        del hT, B
    if pending is not None:
        _store_y(y, residual, ident_f, *pending)
    return y


def _x_quantize(rows, q, all_steps=False):
    """FP8: quantize the rows of a token block per token, in place in the ``rows`` list (each
    entry gains its scale column). Returns the steps (one per sub-tile) still to be called in
    order; all of them are run here with ``all_steps``. bf16: nothing to do."""
    if q is None:
        return []
    steps = q.quantize_rows(rows)
    while all_steps and steps:
        steps.pop(0)()
    return steps


def _x_block(rows, tb, H, gamma_T, ident, ident_f, q, wdtype, row=None):
    """``_x_quantize`` output -> (xT [128, KT(e), tb], per-token scales A or None) on TensorE.
    FP8: xT in the weights' FP8 format with double_row padding; ``row``: a ``[1, tb]`` tile that
    receives the scales as a row too."""
    if q is None:
        return D.x_transposed(rows, tb, H, gamma_T, ident), None
    A = q.row_scales(rows, tb, ident_f, row=row)
    return D.x_transposed([r[:3] for r in rows], tb, H, None, ident, wdtype, True), A


# FP8 with RMSNorm: the norm weight's row broadcast (4 H bytes per partition) arrives in this
# many column ranges, and the first block's weight multiply, |x|max and quantize passes run per
# range, so they start on the first range instead of after the whole broadcast.
GAMMA_CHUNKS = 4


class _Fp8:
    """Per-token activation quantization for the FP8 (double_row) path.

    Scales: ``x ~ a_t * xq[t, :]`` with ``a_t = max_h |x[t, h]| / FP8_MAX`` (the norm weight
    included), the same for the intermediate h (``b_t``); the weights carry per-output-channel
    scales. Per-token scales vary along the free dim of the feature-major GEMM outputs, so they
    are applied as row tiles ``[128, tb]`` broadcast to all partitions by a K=1 matmul.
    """

    def __init__(self, dtype, wscales, gamma_row, gamma_chunks=1, ident_f=None):
        self.dtype = dtype
        self.fmax = 448.0 if dtype == nl.float8_e4m3fn else 240.0
        self.ws = wscales
        self.gamma_row = gamma_row
        self.gamma_chunks = 1 if gamma_row is None else gamma_chunks
        self.ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)     # [1, 128]
        nisa.memset(dst=self.ones, value=1.0)
        self.sel = None
        if ident_f is not None:   # sel[k, q, :] = (k == q): a [4, 128] tile's row q to all
            self.sel = nl.ndarray((4, 4, P), dtype=nl.float32, buffer=nl.sbuf)  # [4, 4, 128]
            for q in range(4):
                nisa.tensor_copy(dst=self.sel[:, q, :], src=ident_f[0:4, q:q + 1].broadcast(1, P))

    def scale_and_inverse(self, amax, n, factor=None, out=None):
        """amax [p, n] -> (amax / fmax (* factor [p, n]), fmax / max(amax, 1e-30)) fp32, into
        the tiles ``out`` when given."""
        sc, inv = out if out is not None else (
            nl.ndarray((amax.shape[0], n), dtype=nl.float32, buffer=nl.sbuf),
            nl.ndarray((amax.shape[0], n), dtype=nl.float32, buffer=nl.sbuf))
        if factor is None:
            nisa.tensor_scalar(dst=sc, data=amax, op0=nl.multiply, operand0=1.0 / self.fmax)
        else:
            nisa.scalar_tensor_tensor(dst=sc, data=amax, op0=nl.multiply,
                                      operand0=1.0 / self.fmax, op1=nl.multiply,
                                      operand1=factor)
        nisa.tensor_scalar(dst=inv, data=amax, op0=nl.maximum, operand0=1e-30)
        nisa.reciprocal(dst=inv, data=inv)
        nisa.tensor_scalar(dst=inv, data=inv, op0=nl.multiply, operand0=self.fmax)
        return sc, inv

    def broadcast(self, row, tb, out=None):
        """row [1, tb] fp32 -> [128, tb] fp32 (ones[1, 128].T @ row on TensorE), into ``out``
        when given; a quad-layout row ``[nq, 128]`` (:meth:`_quad_scales`) by one K = nq
        matmul per 128 tokens against the selector rows."""
        ps = nl.ndarray((P, tb), dtype=nl.float32, buffer=nl.psum)           # [128, tb]
        if row.shape[0] > 1:   # [nq, 128]: token q*128 + c at (q, c)
            nq = row.shape[0]
            for q in range(nq):
                w = min(P, tb - q * P)
                nisa.nc_matmul(dst=ps[:, q * P:q * P + w], stationary=self.sel[0:nq, q, :],
                               moving=row[0:nq, 0:w])
        else:
            nisa.nc_matmul(dst=ps, stationary=self.ones, moving=row)
        if out is None:
            out = nl.ndarray((P, tb), dtype=nl.float32, buffer=nl.sbuf)      # [128, tb]
        nisa.tensor_copy(dst=out, src=ps)
        return out

    def quantize_rows(self, subs):
        """Token-major rows ``subs[i] = (s0, ts, xn [ts, H])`` -> one step per sub-tile that
        replaces ``subs[i]`` by ``(s0, ts, xqb, sc)``: FP8-valued bf16 rows (for the PE
        transposes) and the per-token scale column (``row_scales`` makes a row tile of them).

        A step's full-width passes are spread over GpSimd (norm weight in place, bf16 copy),
        VectorE (|x|max) and ScalarE (quantize), each per column range of the norm weight's
        broadcast (``gamma_chunks``; one range without a norm weight); the
        caller spaces the steps out so that VectorE's evictions never queue behind them all."""
        H = subs[0][2].shape[1] if subs else 0
        cw = max(1, -(-H // self.gamma_chunks))
        cols = [(c0, min(H, c0 + cw)) for c0 in range(0, H, cw)]     # column ranges
        if self.gamma_row is not None:      # all sub-tiles now, in place: no step waits on it
            for _, ts, xn in subs:
                for c0, c1 in cols:
                    nisa.tensor_tensor(dst=xn[:, c0:c1], data1=xn[:, c0:c1],
                                       data2=self.gamma_row[0:ts, c0:c1],
                                       op=nl.multiply, engine=nisa.engine.gpsimd)

        def step(i):
            s0, ts, xn = subs[i]
            # |x|max in one VectorE pass; its |x| output goes to the bf16 tile that later takes
            # the FP8 values (exact: |x| of bf16 data is bf16), so no extra tile is needed
            xqb = nl.ndarray((ts, H), dtype=nl.bfloat16, buffer=nl.sbuf)       # [ts, H]
            amax = nl.ndarray((ts, len(cols)), dtype=nl.float32, buffer=nl.sbuf)  # [ts, nc]
            for k, (c0, c1) in enumerate(cols):
                nisa.tensor_scalar_reduce(dst=xqb[:, c0:c1], data=xn[:, c0:c1], op0=nl.abs,
                                          operand0=0.0, reduce_op=nl.maximum,
                                          reduce_res=amax[:, k:k + 1])
            if len(cols) > 1:
                am = nl.ndarray((ts, 1), dtype=nl.float32, buffer=nl.sbuf)     # [ts, 1]
                nisa.tensor_reduce(dst=am, data=amax, op=nl.maximum, axis=1)
                amax = am
            sc, inv = self.scale_and_inverse(amax, 1)
            xq = nl.ndarray((ts, H), dtype=self.dtype, buffer=nl.sbuf)         # [ts, H] fp8
            for c0, c1 in cols:
                nisa.activation(dst=xq[:, c0:c1], op=nl.copy, data=xn[:, c0:c1], scale=inv)
                nisa.tensor_copy(dst=xqb[:, c0:c1], src=xq[:, c0:c1], engine=nisa.engine.gpsimd)
            subs[i] = (s0, ts, xqb, sc)

        return [lambda i=i: step(i) for i in range(len(subs))]

    def row_scales(self, subs, tb, ident_f, out=None, row=None):
        """The scale columns of ``quantize_rows`` -> row-broadcast scales A [128, tb]
        (TensorE transposes, then a K=1 broadcast matmul); ``out`` / ``row``: tiles to write A
        and the row [1, tb] into."""
        a_row = row if row is not None else nl.ndarray((1, tb), dtype=nl.float32,
                                                       buffer=nl.sbuf)       # [1, tb]
        for s0, ts, _, sc in subs:
            tp = nl.ndarray((1, ts), dtype=nl.float32, buffer=nl.psum)         # [1, ts]
            nisa.nc_matmul(dst=tp, stationary=sc, moving=ident_f[0:ts, 0:ts], is_transpose=True)
            nisa.tensor_copy(dst=a_row[:, s0:s0 + ts], src=tp)
        return self.broadcast(a_row, tb, out)

    def track_minmax(self, hmm, hp, tb, first):
        """hmm = (hmax, hmin) [128, tb] each: the running max and min of h over the pass's tiles
        (and earlier passes), one GpSimd op per tile: each waits only for its own tile's eviction,
        so the last pass's tracking trails its last eviction by one op."""
        hmax, hmin = hmm
        for f in range(hp.shape[1]):
            if first and f == 0:
                nisa.tensor_copy(dst=hmax, src=hp[:, 0, :], engine=nisa.engine.gpsimd)
                nisa.tensor_copy(dst=hmin, src=hp[:, 0, :], engine=nisa.engine.gpsimd)
                continue
            nisa.tensor_tensor(dst=hmax, data1=hmax, data2=hp[:, f, :], op=nl.maximum,
                               engine=nisa.engine.gpsimd)
            nisa.tensor_tensor(dst=hmin, data1=hmin, data2=hp[:, f, :], op=nl.minimum,
                               engine=nisa.engine.gpsimd)

    def track_max(self, hmax, hp, tb, first):
        """hmax[p, t] = max over the pass's tiles (and earlier passes) of |h|."""
        nf = hp.shape[1]
        ab = nl.ndarray((P, nf, tb), dtype=nl.bfloat16, buffer=nl.sbuf)      # [128, nf, tb]
        nisa.tensor_scalar(dst=ab, data=hp, op0=nl.abs, operand0=None)
        if first:
            nisa.tensor_reduce(dst=hmax, op=nl.maximum, data=ab.permute((0, 2, 1)), axis=2)
        else:
            pm = nl.ndarray((P, tb), dtype=nl.float32, buffer=nl.sbuf)       # [128, tb]
            nisa.tensor_reduce(dst=pm, op=nl.maximum, data=ab.permute((0, 2, 1)), axis=2)
            nisa.tensor_tensor(dst=hmax, data1=hmax, data2=pm, op=nl.maximum)

    def quantize_h(self, h_parts, hmax, KI, tb, factor=None, row=False, per_tile=False):
        """bf16 pass tiles of h -> hq [128, KIe, tb] FP8 (zero pad tile for double_row) and the
        row-broadcast scales B [128, tb] (``row``: the row [1, tb] itself), times
        ``factor [1, tb]``: per-token factors left out of h, which per-token quantization
        absorbs (:meth:`h_scales`, then :meth:`quantize_parts`)."""
        sc, inv = self.h_scales(hmax, tb, factor)
        return self.quantize_parts(h_parts, sc, inv, KI, tb, row, per_tile=per_tile)

    def h_scales(self, hmax, tb, factor=None, out=None):
        """The tokens' |h|max over partitions ``hmax [128, tb]`` -> the rows (scale (times
        ``factor``), inverse) ``[1, tb]`` (GpSimd's partition reduce, then VectorE), into the
        tiles ``out`` when given."""
        if isinstance(hmax, tuple):
            return self._quad_scales(hmax, tb, factor, out)
        amax = nl.ndarray((1, tb), dtype=nl.float32, buffer=nl.sbuf)         # [1, tb]
        nisa.tensor_partition_reduce(dst=amax, op=nl.maximum, data=hmax)
        return self.scale_and_inverse(amax, tb, factor, out)

    def _quad_scales(self, hmm, tb, factor=None, out=None):
        """:meth:`h_scales` from :meth:`track_minmax`'s ``(max h, min h)``, in the quad layout
        ``[nq, 128]`` (token ``q*128 + c`` at ``(q, c)``; :meth:`broadcast` takes it): each
        VectorE step then runs over 128 elements per partition instead of ``tb`` on one
        (the reciprocal costs 8 cycles an element: 4.3 us for a 512-token row on Trn2)."""
        assert self.sel is not None, "_Fp8(ident_f=...) builds the quad layout's selector"
        mx, mn = hmm
        nisa.scalar_tensor_tensor(dst=mx, data=mn, op0=nl.multiply, operand0=-1.0,
                                  op1=nl.maximum, operand1=mx)              # |h|max, in place
        nq, n = cdiv(tb, P), min(P, tb)     # (up to 128 tokens: the plain row [1, tb])
        amax = nl.ndarray((nq, n), dtype=nl.float32, buffer=nl.sbuf)           # [nq, n]
        if nq > 1 and tb % P:   # the last row's tail: the broadcast's K = nq matmuls read it
            nisa.memset(dst=amax, value=1.0)                                   # (0 x NaN)
        for q in range(nq):
            w = min(P, tb - q * P)
            nisa.tensor_partition_reduce(dst=amax[q:q + 1, 0:w], op=nl.maximum,
                                         data=mx[:, q * P:q * P + w])
        return self.scale_and_inverse(amax, n, factor, out)

    def quantize_parts(self, h_parts, sc, inv, KI, tb, row=False, out=None, per_tile=False):
        """h's pass tiles -> (hq, B) with the scale rows of :meth:`h_scales` (broadcast on
        TensorE); ``out``: the tiles (hq, B) to write (not with ``row``)."""
        B = sc if row else self.broadcast(sc, tb, None if out is None else out[1])
        Binv = self.broadcast(inv, tb)
        KIe = KI + KI % 2
        hq = nl.ndarray((P, KIe, tb), dtype=self.dtype, buffer=nl.sbuf) if out is None \
            else out[0]                                                      # [128, KIe, tb]
        if KIe > KI:
            nisa.memset(dst=hq[:, KI:KIe, :], value=0.0)
        n = 0
        while h_parts:   # each part is released once quantized
            i0, i1, hp = h_parts.pop(0)
            # VectorE and GpSimd (SBUF operands only) alternate: the down GEMM consumes the
            # parts in order, faster than one engine alone produces them. per_tile: one tile
            # at a time, all on GpSimd, so the first matmul waits for one tile, and VectorE
            # keeps to the down passes' evictions
            for a, b in ([(i, i + 1) for i in range(i0, i1)] if per_tile else [(i0, i1)]):
                eng = nisa.engine.gpsimd if n % 2 or per_tile else nisa.engine.vector
                nisa.tensor_tensor(dst=hq[:, a:b, :], data1=hp[:, a - i0:b - i0, :],
                                   data2=Binv.expand_dim(1).broadcast(1, b - a), op=nl.multiply,
                                   engine=eng)
                n += 1
        return hq, B


def _runs(widths):
    """Runs [(a, b, nn)] of equal-width tiles."""
    out = []
    a = 0
    while a < len(widths):
        b = a
        while b < len(widths) and widths[b] == widths[a]:
            b += 1
        out.append((a, b, widths[a]))
        a = b
    return out


def _silu_evict(acc, widths, tb, q, A, i0, up_scale=True):
    """silu(gate) on ScalarE straight from PSUM -> SBUF fp32 [128, nf, tb]. FP8: the token
    scale (VectorE, row tile A) and the channel scale (ScalarE scale column) go in first,
    and the result carries the token scale of up as well: silu(g) * a_t (``up_scale``; without
    it the caller applies a_t later, e.g. folded into the scale of the per-token quantized h)."""
    nf = len(widths)
    sg = nl.ndarray((P, nf, tb), dtype=nl.float32, buffer=nl.sbuf)          # [128, nf, tb]
    if q is None:
        for a, b, nn in _runs(widths):
            nisa.activation(dst=sg[0:nn, a:b, :], op=nl.silu, data=acc[0:nn, a:b, 0:tb])
        return sg
    ga = nl.ndarray((P, nf, tb), dtype=nl.float32, buffer=nl.sbuf)          # [128, nf, tb]
    Ab = A.expand_dim(1).broadcast(1, nf)
    nisa.tensor_tensor(dst=ga, data1=acc[:, :, 0:tb], data2=Ab, op=nl.multiply)
    for f in range(nf):
        nisa.activation(dst=sg[:, f, :], op=nl.silu, data=ga[:, f, :],
                        scale=q.ws[0][:, i0 + f:i0 + f + 1])
    if up_scale:
        nisa.tensor_tensor(dst=sg, data1=sg, data2=Ab, op=nl.multiply)
    return sg


def _gate_evict(hT, sg, acc_u, widths, tb, q, i0, k0):
    """hT[k0 + f] = silu(g) * u (* channel scale of up) on VectorE, one PSUM input, rounded to
    bf16."""
    for a, b, nn in _runs(widths):
        if q is None:
            nisa.tensor_tensor(dst=hT[0:nn, k0 + a:k0 + b, :], data1=acc_u[0:nn, a:b, 0:tb],
                               data2=sg[0:nn, a:b, :], op=nl.multiply)
        else:
            for f in range(a, b):
                nisa.scalar_tensor_tensor(dst=hT[0:nn, k0 + f, :], data=acc_u[0:nn, f, 0:tb],
                                          op0=nl.multiply,
                                          operand0=q.ws[1][0:nn, i0 + f:i0 + f + 1],
                                          op1=nl.multiply, operand1=sg[0:nn, f, :])


def _evict_y(yT, acc, widths, tb, q, B, j0, ev):
    """Down-projection accumulators -> fp32 SBUF, alternating VectorE / ScalarE. FP8: times the
    channel scale (per partition) and the token scale of h (row tile B) on VectorE."""
    for a, b, nn in _runs(widths):
        if q is not None:
            for f in range(a, b):
                nisa.scalar_tensor_tensor(dst=yT[0:nn, f, :], data=acc[0:nn, f, 0:tb],
                                          op0=nl.multiply,
                                          operand0=q.ws[2][0:nn, j0 + f:j0 + f + 1],
                                          op1=nl.multiply, operand1=B[0:nn, :])
            continue
        for c in range(a, b, 4):
            e = min(b, c + 4)
            eng = nisa.engine.vector if ev[0] % 2 == 0 else nisa.engine.scalar
            nisa.tensor_copy(dst=yT[0:nn, c:e, :], src=acc[0:nn, c:e, 0:tb], engine=eng)
            ev[0] += 1


def _store_y(y, residual, ident_f, yT, t0, tb, c0, widths):
    """yT [features, tokens] -> y[t0:t0+tb, c0:c0+ncols] (+ residual): fp32 PE transposes of
    up to 4 feature tiles per PSUM bank, the residual added on the eviction."""
    ncols = sum(widths)
    for s0 in range(0, tb, P):
        ts = min(P, tb - s0)
        y_sb = nl.ndarray((ts, ncols), dtype=y.dtype, buffer=nl.sbuf)       # [ts, ncols]
        r_sb = None
        if residual is not None:
            r_sb = nl.ndarray((ts, ncols), dtype=residual.dtype, buffer=nl.sbuf)  # [ts, ncols]
            nisa.dma_copy(dst=r_sb, src=residual[t0 + s0:t0 + s0 + ts, c0:c0 + ncols])
        col = 0
        for g0 in range(0, len(widths), 4):
            g1 = min(len(widths), g0 + 4)
            gw = sum(widths[g0:g1])
            tp = D.transposed_group(yT, ident_f, widths, g0, g1, s0, ts)         # [ts, gw]
            if r_sb is not None:
                nisa.tensor_tensor(dst=y_sb[:, col:col + gw], data1=tp,
                                   data2=r_sb[:, col:col + gw], op=nl.add)
            else:
                eng = nisa.engine.scalar if (g0 // 4) % 2 else nisa.engine.vector
                nisa.tensor_copy(dst=y_sb[:, col:col + gw], src=tp, engine=eng)
            col += gw
        nisa.dma_copy(dst=y[t0 + s0:t0 + s0 + ts, c0:c0 + ncols], src=y_sb)


# ---------------------------------------------------------------------------------------- op
def swiglu_mlp(x, w_gate, w_up, w_down, *, norm_weight=None, eps=1e-6, residual=None,
               gate_scale=None, up_scale=None, down_scale=None):
    """SwiGLU MLP ``residual + (silu(xn @ w_gate) * (xn @ w_up)) @ w_down`` on a NeuronCore.

    With FP8 weights the op is W8A8: besides the weights (per output channel), it quantizes the
    activations to the weights' FP8 dtype per token (the normalised ``xn`` before the gate / up
    GEMMs, and the SwiGLU product ``h`` before the down GEMM), with fp32 accumulation and the
    scales applied on eviction. bf16 weights keep the activations in bf16.

    Args:
      x: [T, H] bfloat16 (NumPy / ml_dtypes or CPU torch).
      w_gate, w_up: [H, I]; w_down: [I, H]. All bfloat16, or all FP8 (float8_e4m3; on Trn3
        also float8_e4m3fn) with per-output-channel scales gate_scale, up_scale [I] and
        down_scale [H] (the dequantized weight is w * scale[column]). Or all three passed
        through ``tile_weight`` once at load time (H, I multiples of 128): the tile-major
        layout streams in long DMA runs; the fast path for FP8 prefill on Trn2 (docs/dense.md).
      norm_weight: optional [H] RMSNorm weight in front (eps its epsilon). None = no norm.
      residual: optional [T, H] bfloat16 added to the output (pass x for x + mlp(norm(x))).
    Returns:
      y [T, H] bfloat16.
    """
    name = "swiglu_mlp"
    gen = check_target(name)
    check_no_grad(name, x, w_gate, w_up, w_down, norm_weight, residual, gate_scale, up_scale,
                  down_scale)
    T, H = check_2d(name, "x", x)
    check_dtype(name, "x", x, ("bfloat16",))
    tiled = len(getattr(w_gate, "shape", ())) == 4
    if tiled:
        I = _check_tiled(name, H, w_gate, w_up, w_down)
    else:
        Hg, I = check_2d(name, "w_gate", w_gate)
        if Hg != H:
            raise ValueError(f"{name}: w_gate must be [H, I] with H = x.shape[1] = {H}; got "
                             f"{list(w_gate.shape)}")
        if tuple(w_up.shape) != (H, I):
            raise ValueError(f"{name}: w_up must have the shape of w_gate {[H, I]}; got "
                             f"{list(w_up.shape)}")
        if tuple(w_down.shape) != (I, H):
            raise ValueError(f"{name}: w_down must be [I, H] = {[I, H]}; got "
                             f"{list(w_down.shape)}")
    wdt = check_dtype(name, "w_gate", w_gate, ("bfloat16",) + _FP8)
    for a, w in (("w_up", w_up), ("w_down", w_down)):
        got = _dtype_name(w)
        if got != wdt:
            raise TypeError(f"{name}: {a}.dtype must equal w_gate.dtype ({wdt}); got {got}")
    fp8 = wdt in _FP8
    sc = (gate_scale, up_scale, down_scale)
    if fp8:
        if wdt == "float8_e4m3fn" and gen < 4:
            raise ValueError(f"{name}: float8_e4m3fn weights need Trn3; on Trn2 use "
                             f"float8_e4m3")
        if H % P or I % P:
            raise ValueError(f"{name}: FP8 weights need hidden and intermediate sizes that are "
                             f"multiples of 128; got H={H}, I={I}")
        if any(s is None for s in sc):
            raise ValueError(f"{name}: FP8 weights need gate_scale [I], up_scale [I] and "
                             f"down_scale [H]")
        sc = (float_vector(name, "gate_scale", gate_scale, I),
              float_vector(name, "up_scale", up_scale, I),
              float_vector(name, "down_scale", down_scale, H))
    elif any(s is not None for s in sc):
        raise ValueError(f"{name}: gate_scale/up_scale/down_scale are only for FP8 weights "
                         f"(weights are {wdt})")
    if norm_weight is not None:
        norm_weight = float_vector(name, "norm_weight", norm_weight, H)
    check_eps(name, eps)
    if residual is not None:
        if tuple(residual.shape) != (T, H):
            raise ValueError(f"{name}: residual must have the shape of x {[T, H]}; got "
                             f"{list(residual.shape)}")
        check_dtype(name, "residual", residual, ("bfloat16",))
    wb = 1 if fp8 else 2
    plan = plan_mlp(T, H, I, wb, fp8, sbuf_budget(), tiled, norm=norm_weight is not None,
                    residual=residual is not None)
    return launch(swiglu_mlp_kernel, x, w_gate, w_up, w_down, norm_weight, residual,
                  sc[0], sc[1], sc[2], float(eps), plan.tb_max, plan.combined, plan.nf_gu,
                  plan.nf_d, plan.kb_gu, plan.kb_d, plan.y_pipe, tiled)


def _check_tiled(name, H, w_gate, w_up, w_down):
    """Shapes of tile-major weights (``tile_weight``); returns I."""
    def kte(k):
        return k // P + (k // P) % 2
    for a, w in (("w_up", w_up), ("w_down", w_down)):
        if len(getattr(w, "shape", ())) != 4:
            raise ValueError(f"{name}: w_gate is tile-major (4-D, tile_weight) so {a} must be "
                             f"too; got shape {list(getattr(w, 'shape', ()))}")
    if H % P:
        raise ValueError(f"{name}: tile-major weights need a hidden size that is a multiple of "
                         f"128; got H={H}")
    nt = int(w_gate.shape[0])
    I = nt * P
    want = {"w_gate": (nt, P, kte(H), P), "w_up": (nt, P, kte(H), P),
            "w_down": (H // P, P, kte(I), P)}
    for a, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if tuple(w.shape) != want[a]:
            raise ValueError(f"{name}: tile-major {a} must have shape {list(want[a])} "
                             f"(tile_weight of a [{'H, I' if a != 'w_down' else 'I, H'}] = "
                             f"[{H if a != 'w_down' else I}, {I if a != 'w_down' else H}] "
                             f"weight); got {list(w.shape)}")
    return I


__all__ = ["swiglu_mlp", "swiglu_mlp_kernel", "plan_mlp", "MLPPlan", "tile_weight"]
