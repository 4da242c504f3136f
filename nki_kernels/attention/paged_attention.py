"""Paged attention for serving: one ragged batch of decodes, prompt chunks and cached-prefix
prompts over a vLLM paged KV cache, in one kernel; plan once per step, run per layer.

vLLM's unified-attention contract: ``q [T, H_q, d]`` holds the new tokens of ``R`` requests
back to back; request ``r`` owns rows ``query_start_loc[r] : query_start_loc[r + 1]``, the last
``q_len`` positions of its ``seq_lens[r]`` tokens (its prefix is in the cache, and so are its own
new keys, appended before the call). Causal, end-aligned, per request. Design note:
docs/attention.md ("Paged attention").

No new attention code: each request takes the path built for its shape.

* **Decode rows** (``q_len <= 8`` with ``G * q_len <= 128`` query rows per KV head) run
  :mod:`.decode_attention`'s pipeline (``_Run``) on the ragged q / out rows: every KV head of a
  tile in one long-run DMA per partition, GQA heads packed in PE column tiles, split-KV over the
  LNC programs. Requests with the same ``q_len`` form one decode class.
* **Chunk rows** (longer ``q_len``: chunked prefill, prefix caching, whole prompts) run
  :mod:`.flash_attention`'s prefill tiles (``run_kv_group``: 128-row q-tiles x 2048-key blocks,
  whole-tile causal skipping, the four-stage software pipeline) on views of the ragged rows, with
  K^T / V loaded from the paged cache one page at a time (a scalar dynamic offset read from the
  block table in SBUF addresses each page; no gather descriptors): K^T by a DMA transpose
  straight from each page, V (keys on partitions) by hardware-DGE DMAs from ScalarE. FP8 V goes
  into PV as FP8 (TensorE takes mixed bf16 / FP8 inputs); FP8 K pages are cast to bf16 by the DMA
  into an HBM staging and one DMA transpose per 128-key tile makes K^T from it, as the blocks
  need it. ``k_scale`` folds into
  the logit scale of its KV head, ``v_scale`` into the final normalisation. Paged-only options
  of the prefill tiles (:func:`chunk_options`): the causal band masked by a bias matmul, one-
  block q-tiles finalized from PSUM, short chunks' P^T / pipeline choices.

:func:`plan_paged_attention` is the host schedule (which request takes which path, the decode KV
tile and split-KV items, each chunk's resident KV span), a function of the lengths and shapes
only: FlashInfer's plan / run. A model makes it once per step and passes ``plan=`` to every
layer's ``paged_attention`` (and ``decode_attention``); a plan that does not match the call is a
ValueError naming what differs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .._limits import P, sbuf_budget
from .._validate import (
    FP8_KV,
    attention_options,
    check_block_table,
    check_flag,
    check_lnc,
    check_no_grad,
    check_target,
    check_window,
    host_ints,
)
from ..backend import launch, lnc_programs, nisa, nki, nl
from .decode_attention import NCOL, DecodePlan, _Run, decode_schedule, row_table, slot_width
from .flash_attention import SHORT_KV, plan_flash_attention, run_kv_group
from .kv_cache import BLOCK_SIZES, KVLayout
from .masks import MaskSpec
from .schedule import assign_programs, kv_chunks, prefill_units
from .split_kv import merge_split, split_parts

HEAD_DIMS = (64, 128, 192, 256)
DECODE_MAX_Q = 8          # longest q_len that takes the decode path (decode_attention's s_q limit)
G16 = 16                 # keys per group of the hardware-DGE DMA transpose's 4-D form
FP8_FIRST = 2             # FP8 K: 128-key tiles whose pages are cast before the first QK^T (1: 91.3
                          # us, 2 or 4: 91.0; all 16 up front: 92.2; Trn3 2K chunk over 0, modeled)
FP8_AHEAD = 2             # ... and tiles cast past the ones a QK^T reads (1, 2, 4: the same there)
_Q_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class DecodeClass:
    """Decode requests of one ``q_len`` (``s_q``): their request ids, the KV tile geometry and the
    split-KV work items of each program (indices into ``reqs``)."""
    s_q: int
    reqs: tuple
    layout: KVLayout
    items: tuple


@dataclass(frozen=True)
class ChunkRequest:
    """A request on the prefill path: its query rows ``[q0, q0 + q_len)`` of q, its length and
    the keys kept resident in SBUF per pass (``chunk``: the whole sequence when it fits)."""
    r: int
    q0: int
    q_len: int
    seq_len: int
    chunk: int


@dataclass(frozen=True)
class PagedAttentionPlan:
    """The host schedule of one serving step (see :func:`plan_paged_attention`)."""
    seq_lens: tuple
    query_start_loc: tuple
    block_size: int | None
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_itemsize: int
    window: int
    lnc: int
    gen: int
    decode: tuple          # DecodeClass per distinct decode q_len
    chunks: tuple          # ChunkRequest per request on the prefill path

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def describe(self) -> str:
        dec = ", ".join(f"{len(c.reqs)} x q_len {c.s_q}" for c in self.decode) or "none"
        ch = ", ".join(f"{c.q_len} over {c.seq_len - c.q_len}" for c in self.chunks) or "none"
        return f"decode: {dec}; chunks: {ch}"


@dataclass(frozen=True)
class PagedKernelConfig(nl.NKIObject):
    """Compile-time values of one call: the decode classes' DecodePlans (with the offsets of
    their rows in the row table), the chunk requests with one FlashAttentionPlan per KV head
    (k_scale / v_scale differ per head) or one for all."""
    T: int
    Hq: int
    Hkv: int
    d: int
    block_size: int
    window: int
    out_dtype: object
    return_lse: bool
    fp8: bool
    decode: tuple          # DecodePlan per decode class
    rt_offsets: tuple      # first row-table column of each decode class
    chunks: tuple          # ChunkRequest per chunk request
    chunk_plans: tuple     # per chunk request: tuple of FlashAttentionPlan (1 or H_kv)


# ------------------------------------------------------------------------------------ plan


def _qsl_and_lens(op, seq_lens, query_start_loc):
    sl = host_ints(op, "seq_lens", seq_lens).reshape(-1).astype(np.int64)
    qsl = host_ints(op, "query_start_loc", query_start_loc).reshape(-1).astype(np.int64)
    R = sl.shape[0]
    if qsl.shape != (R + 1,):
        raise ValueError(f"{op}: query_start_loc must have R + 1 = {R + 1} entries (one more than "
                         f"seq_lens); got {qsl.shape[0]}")
    if qsl[0] != 0 or np.any(np.diff(qsl) < 0):
        raise ValueError(f"{op}: query_start_loc must start at 0 and be non-decreasing; got "
                         f"{qsl.tolist()}"[:300])
    ql = np.diff(qsl)
    bad = np.nonzero(ql > sl)[0]
    if np.any(sl < 0) or bad.size:
        r = int(bad[0]) if bad.size else int(np.nonzero(sl < 0)[0][0])
        raise ValueError(f"{op}: request {r} has q_len = {int(ql[r])} new tokens but seq_lens = "
                         f"{int(sl[r])}; seq_lens counts the new tokens (q_len <= seq_len)")
    return tuple(int(x) for x in sl), tuple(int(x) for x in qsl)


def plan_paged_attention(seq_lens, query_start_loc, block_size, num_q_heads, num_kv_heads,
                         head_dim, *, window=None, kv_dtype="bfloat16", lnc=1):
    """The schedule of one serving step for :func:`paged_attention` (and ``decode_attention``).

    Args:
      seq_lens: [R] host ints, tokens of each request including its new ones.
      query_start_loc: [R + 1] host ints, 0 = first, non-decreasing, last = T (rows of q).
      block_size: tokens per cache page (8..256, a power of two); None for a contiguous
        ``decode_attention`` cache.
      num_q_heads, num_kv_heads, head_dim: the layer's attention geometry (the same in every
        layer that reuses the plan).
      window: left sliding window (keys visible including the query's own), or None.
      kv_dtype: the cache dtype name ("bfloat16", "float16", or the target's FP8 type).
      lnc: 1, or 2 to spread the work over both cores of a logical NeuronCore.
    Returns:
      PagedAttentionPlan; ``plan.describe()`` says which request takes which path. Host work
      only, computed for the current target.
    """
    op = "plan_paged_attention"
    gen = check_target(op)
    sl, qsl = _qsl_and_lens(op, seq_lens, query_start_loc)
    for name, x in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
            raise ValueError(f"{op}: {name} must be a positive int; got {x!r}")
    Hq, Hkv, d = int(num_q_heads), int(num_kv_heads), int(head_dim)
    if Hq % Hkv:
        raise ValueError(f"{op}: num_q_heads ({Hq}) must be a multiple of num_kv_heads ({Hkv})")
    if d not in HEAD_DIMS:
        raise ValueError(f"{op}: head_dim must be one of {', '.join(map(str, HEAD_DIMS))}; got {d}")
    if block_size is not None and block_size not in BLOCK_SIZES:
        raise ValueError(f"{op}: block_size must be one of {', '.join(map(str, BLOCK_SIZES))} (or "
                         f"None: contiguous cache); got {block_size!r}")
    check_window(op, window)
    check_lnc(op, lnc)
    fp8 = FP8_KV.get(gen, FP8_KV[4])
    kv_name = str(kv_dtype).replace("torch.", "")
    if kv_name not in (*_Q_DTYPES, fp8):
        raise TypeError(f"{op}: kv_dtype must be one of {', '.join((*_Q_DTYPES, fp8))} on this "
                        f"target; got {kv_dtype!r}")
    isz = 1 if kv_name == fp8 else 2
    G = Hq // Hkv
    by_q = {}
    chunks = []
    for r, L in enumerate(sl):
        q_len = qsl[r + 1] - qsl[r]
        if q_len == 0:
            continue
        if q_len <= DECODE_MAX_Q and G * q_len <= P:
            by_q.setdefault(q_len, []).append(r)
        else:
            if block_size is None:
                raise ValueError(f"{op}: request {r} has q_len = {q_len}; a contiguous cache "
                                 f"(block_size None) serves decode batches only (q_len <= "
                                 f"{DECODE_MAX_Q})")
            chunks.append(ChunkRequest(r, qsl[r], q_len, L, _resident_keys(gen, d, L, isz)))
    decode = []
    for s_q in sorted(by_q):
        reqs = tuple(by_q[s_q])
        lens = tuple(sl[r] for r in reqs)
        lay, items = decode_schedule(lens, s_q, Hq, Hkv, d, isz, block_size, window, lnc)
        decode.append(DecodeClass(s_q, reqs, lay, items))
    return PagedAttentionPlan(seq_lens=sl, query_start_loc=qsl, block_size=block_size,
                              num_q_heads=Hq, num_kv_heads=Hkv, head_dim=d, kv_itemsize=isz,
                              window=int(window or 0), lnc=int(lnc), gen=gen,
                              decode=tuple(decode), chunks=tuple(chunks))


def chunk_options(gen, seq_len):
    """flash attention's paged-only options for a chunk request (modeled, Trn3, Llama-3-8B
    2K chunk over 0, bf16: 105.8 -> 90.3 us, all from these):

    * ``diag_bias``: the causal band's mask is one matmul (identity x a 0 / -big bias tile)
      accumulated onto the scores, so the band leaves PSUM in the fused scale + max eviction:
      no ScalarE scale pass and VectorE ``range_select`` per diagonal tile, no GpSimd row bounds
      (105.8 -> 100.2 us; over 8K 627.9 -> 621.0);
    * ``final_psum``: a q-tile with one block (every q-tile of a chunk of <= 2048 keys) divides
      its PV result straight out of PSUM, without the o copy to SBUF (100.2 -> 93.3 with both);
    * chunks of <= SHORT_KV keys on Trn3 (latency-bound): half of the P^T halves by DMA
      transpose instead of a quarter (93.3 -> 92.2), the last two blocks' P^T on TensorE, whose
      transposes end sooner than a DMA's (-> 91.2), and PV one step later
      (``lags = (0, 1, 4, 6)``: -> 90.3; (0, 1, 3, 6) 91.1, (0, 1, 4, 7) 91.3)."""
    opts = dict(diag_bias=True, final_psum=True)
    if gen >= 4 and seq_len <= SHORT_KV:
        opts.update(dma_tr_frac=0.5, te_tail=2, lags=(0, 1, 4, 6))
    return opts


def _resident_keys(gen, d, seq_len, isz):
    """Keys of one KV head kept resident in SBUF per pass of a chunk request: flash attention's
    choice for this length, planned with the options that need the most SBUF (soft-cap, sinks,
    lse). The bf16 staging copy of K (about the size of V) counts as one more byte per key
    element, the raw FP8 K and V pages as one more."""
    fp = plan_flash_attention(gen, d, seq_len, causal=True, window=None, softcap=1.0, scale=1.0,
                              has_sinks=True, return_lse=True, k_layout="bhsd",
                              out_dtype=nl.bfloat16, sbuf_budget=sbuf_budget(),
                              in_bytes=4 if isz == 1 else 3)
    return fp.chunk


def _check_plan(op, plan, seq_lens, qsl, Hq, Hkv, d, isz, block_size, window, lnc, gen):
    if not isinstance(plan, PagedAttentionPlan):
        raise TypeError(f"{op}: plan must come from plan_paged_attention; got "
                        f"{type(plan).__name__}")
    want = dict(seq_lens=seq_lens, query_start_loc=qsl, block_size=block_size, num_q_heads=Hq,
                num_kv_heads=Hkv, head_dim=d, kv_itemsize=isz, window=int(window or 0),
                lnc=int(lnc), gen=gen)
    for k, v in want.items():
        got = getattr(plan, k)
        if got != v:
            what = {"kv_itemsize": "KV dtype size", "gen": "target generation"}.get(k, k)
            raise ValueError(f"{op}: the plan does not match this call: {what} is "
                             f"{str(got)[:120]} in the plan, {str(v)[:120]} here (make one plan "
                             f"per step with plan_paged_attention)")


def decode_schedule_of(plan, op, lens, s_q, Hq, Hkv, d, isz, block_size, window, lnc):
    """``decode_attention(plan=)``: the plan's (layout, items) for a batch of ``len(lens)``
    sequences of ``s_q`` new tokens each, after checking the plan matches."""
    qsl = tuple(i * s_q for i in range(len(lens) + 1))
    _check_plan(op, plan, tuple(lens), qsl, Hq, Hkv, d, isz, block_size, window, lnc,
                int(nisa.get_nc_version()))
    live = [c for c in plan.decode]
    if plan.chunks or len(live) > 1:
        raise ValueError(f"{op}: the plan holds more than one decode batch ({plan.describe()}); "
                         f"use paged_attention")
    if not live:          # every sequence empty
        return decode_schedule(lens, s_q, Hq, Hkv, d, isz, block_size, window, lnc)
    c = live[0]
    if c.reqs != tuple(b for b, L in enumerate(lens) if L):
        raise ValueError(f"{op}: the plan's decode requests {list(c.reqs)[:16]} are not this "
                         f"batch's non-empty sequences")
    # the plan's items index its decode requests; decode_attention indexes the whole batch
    items = tuple(tuple(dataclasses.replace(it, b=c.reqs[it.b]) for it in prog)
                  for prog in c.items)
    return c.layout, items


# ------------------------------------------------------------------------------------ kernel


@nki.jit
def paged_attention_kernel(q, k_cache, v_cache, block_table, rowtab, sinks, cfg):
    """Attention of a ragged serving batch over a paged KV cache.

    Dimensions:
      T >= 1 new tokens of R requests; H_q = G * H_kv; d in {64, 128, 192, 256};
      num_blocks pages of block_size (8..256) tokens.
    Args:
      q: [T, H_q, d] HBM bf16 / fp16 (request r's rows contiguous).
      k_cache, v_cache: [num_blocks, block_size, H_kv, d] HBM, q's dtype or FP8.
      block_table: [R, max_blocks] int32 HBM; only the entries of pages in use are read.
      rowtab: [128, B_dec, n_groups_max, 5] fp32 HBM: the decode classes' row tables side by side
        (decode_attention.row_table), or None without decode rows.
      sinks: [H_q] fp32 HBM sink logits (chunk rows; decode rows take theirs from rowtab), or None.
      cfg: PagedKernelConfig.
    Returns:
      o [T, H_q, d] (cfg.out_dtype), and lse [T, H_q] fp32 when cfg.return_lse.
    Pseudocode:
      for decode class c (requests with q_len = s_q): decode_attention's pipeline over this
        program's split-KV items, q / o rows at the requests' query_start_loc
      for chunk request r: for KV head hk: for resident span [c0, c1) of its keys:
        K^T, V_aug <- its pages (one dynamic-offset DMA per page; FP8: V raw, K cast by
          the DMA into an HBM staging, K^T transposed from it)
        flash attention's q-tile x 2048-key blocks (causal, end-aligned) over the span
      [LNC=2: barrier; the owners merge the split decode parts]
    """
    T, Hq, d = cfg.T, cfg.Hq, cfg.d
    out = nl.ndarray((T, Hq, d), dtype=cfg.out_dtype, buffer=nl.shared_hbm)
    lse = None
    if cfg.return_lse:
        lse = nl.ndarray((T, Hq), dtype=nl.float32, buffer=nl.shared_hbm)
    programs, pid = lnc_programs()
    ident = nl.shared_identity_matrix(P, dtype=nl.bfloat16)                   # [128, 128]
    runs = []
    for ci, dp in enumerate(cfg.decode):
        split, parts = split_parts(dp.items, dp.n_groups, d)
        o0 = cfg.rt_offsets[ci]
        rt = rowtab[:, o0:o0 + dp.B, 0:dp.n_groups, :]
        run = _Run(q, k_cache, v_cache, block_table, rt, out, lse, parts, split, ident, dp)
        run.items(dp.items[pid])
        runs.append((run, dp, split, parts))
    for ch, plans in zip(cfg.chunks, cfg.chunk_plans):
        _chunk_request(q, k_cache, v_cache, block_table, sinks, out, lse, ident, ch, plans, cfg,
                       programs, pid)
    for run, dp, split, parts in runs:
        merge_split(run, dp.items[pid], split, parts, programs)
    if cfg.return_lse:
        return out, lse
    return out


def _chunk_request(q, k_cache, v_cache, block_table, sinks, out, lse, ident, ch, plans, cfg,
                   programs, pid):
    """One request on the prefill path: flash attention's units over views of its rows."""
    Hq, Hkv, d, bs = cfg.Hq, cfg.Hkv, cfg.d, cfg.block_size
    L, S = ch.q_len, ch.seq_len
    q4 = q[ch.q0:ch.q0 + L].permute((1, 0, 2)).expand_dim(0)                  # [1, H_q, L, d]
    o4 = out[ch.q0:ch.q0 + L].permute((1, 0, 2)).expand_dim(0)
    l4 = lse[ch.q0:ch.q0 + L].permute((1, 0)).expand_dim(0) if lse is not None else None
    spec = MaskSpec(L, S, True, cfg.window)
    chunks = kv_chunks(S, ch.chunk)
    units = prefill_units(spec, 1, Hkv, plans[0].kb, ch.chunk)
    mine = assign_programs(units, programs)[pid]
    if not mine:
        return
    hbm_state = None
    if len(chunks) > 1:       # softmax state between resident spans (o with its sum column, m)
        hbm_state = (nl.ndarray((1, Hq, L, d + 1), dtype=nl.float32, buffer=nl.hbm),
                     nl.ndarray((1, Hq, L, 1), dtype=nl.float32, buffer=nl.hbm))
    npg = -(-S // bs)
    bt_sb = nl.ndarray((1, npg), dtype=nl.int32, buffer=nl.sbuf)              # [1, pages]
    nisa.dma_copy(dst=bt_sb, src=block_table[ch.r, 0:npg].reshape((1, npg)))
    heads = sorted({u.kv_head for u in mine})
    ks = _KStage(k_cache, bt_sb, heads, S, q.dtype, cfg) if cfg.fp8 else None   # FP8 K in HBM
    for hk in heads:
        fp = plans[hk] if len(plans) > 1 else plans[0]
        run_kv_group(q4, o4, l4, sinks, hbm_state, ident, spec, chunks,
                     [u for u in mine if u.kv_head == hk], Hq, Hkv, d, fp,
                     lambda c0, c1, hk=hk: _load_kv_pages(k_cache, v_cache, bt_sb, hk, c0, c1,
                                                          q.dtype, cfg, ks),
                     store_each=True)


def _load_kv_pages(k_cache, v_cache, bt_sb, hk, c0, c1, dtype, cfg, ks=None):
    """Keys [c0, c1) of KV head ``hk`` of one request from its pages, laid out as flash
    attention's ``_load_kv``: K^T [128, DT, C] (d on partitions) and V_aug [128, C/128, d+1]
    (key c0 + 128 t + p on partition p of tile t; column d = 1).

    One DMA per page for K and one for V (pages of 256 keys: per 128 keys), addressed by the
    page's block-table entry in ``bt_sb`` (a scalar dynamic offset). K^T comes straight from
    each page by a DMA transpose (:func:`_page_kT`; priced by the [128, 16] blocks it writes, a
    64-key page costs 4 blocks), V by a hardware-DGE DMA triggered from ScalarE, keys on
    partitions. Both leave the static DMA ring to the Q^T loads, P^T transposes and output
    stores, whose transfers (all triggered at the start) used to sit ahead of the K^T of the
    first tiles: on the 2K chunk over 0 the first QK^T started at 25 us, behind every page load
    and the staged K's SBUF->SBUF transposes (modeled, Trn3: 129.1 -> 105.8 us; over 8K 656.6 ->
    627.9 us). FP8 pages: :func:`_load_kv_pages_fp8` (K from the request's bf16 staging ``ks``,
    :class:`_KStage`). ``c0`` is a multiple of the block size: pages never straddle a span."""
    if cfg.fp8:
        return _load_kv_pages_fp8(ks, v_cache, bt_sb, hk, c0, c1, dtype, cfg)
    d, row, kT, vs, vp = _kv_tiles(v_cache, c0, c1, dtype, dtype, cfg)
    nisa.memset(dst=vs[:, :, d:d + 1], value=1.0, engine=nisa.engine.gpsimd)
    kp = k_cache.reshape((k_cache.shape[0], cfg.block_size * row))           # [num_blocks, page]
    for reg, k0, m, off in _page_pieces(bt_sb, hk, c0, c1, cfg):
        t, p0 = k0 // P, k0 % P
        _page_kT(kT, kp, reg, off, k0, m, d, row)
        # V on ScalarE's hardware-DGE ring (the DGE holds 600 ns per page; ScalarE is idle
        # while the first pages load)
        nisa.dma_copy(dst=vs[p0:p0 + m, t, 0:d], src=vp.ap(
            [[row, m], [1, d]], offset=off, scalar_offset=reg, indirect_dim=0),
            dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.scalar)
    return kT, vs


def _kv_tiles(v_cache, c0, c1, k_dtype, v_dtype, cfg):
    """``(d, row, kT, vs, vp)`` of chunk keys ``[c0, c1)``: the head dim, a page row's elements
    (all KV heads), K^T ``[128, DT, C]`` and V_aug ``[128, C/128, d+1]`` in SBUF (column d is
    set to 1 by the caller), and the V cache as ``[num_blocks, page]``."""
    d, C = cfg.d, c1 - c0
    row = cfg.Hkv * d
    kT = nl.ndarray((P, -(-d // P), C), dtype=k_dtype, buffer=nl.sbuf)        # [128, DT, C]
    vs = nl.ndarray((P, -(-C // P), d + 1), dtype=v_dtype, buffer=nl.sbuf)    # [128, nt, d+1]
    vp = v_cache.reshape((v_cache.shape[0], cfg.block_size * row))            # [num_blocks, page]
    return d, row, kT, vs, vp


def _page_pieces(bt_sb, hk, c0, c1, cfg):
    """The pieces of chunk keys ``[c0, c1)`` in page order, at most 128 keys each (pages of 256
    keys: two): ``(reg, k0, m, off)``, the page's block-table entry in ``bt_sb`` (a scalar
    dynamic offset), the piece's first chunk key and key count, and the offset of KV head
    ``hk``'s first row in the page."""
    d, Hkv, bs = cfg.d, cfg.Hkv, cfg.block_size
    C = c1 - c0
    for j in range(c0 // bs, -(-c1 // bs)):
        base = j * bs - c0
        for s0 in range(0, min(bs, C - base), P):
            yield (bt_sb[0:1, j:j + 1], base + s0, min(P, bs - s0, C - base - s0),
                   (s0 * Hkv + hk) * d)


class _KStage:
    """The FP8 K pages of one chunk request, cast to bf16 by the DMA into an HBM staging
    ``[pages * block_size, heads * d]`` (the heads this program runs, ``h0 ..``): one casting
    DMA per page, every head's rows of it at once (a cast with a runtime address runs on the
    software DGE, GpSimd; nki-spec 5.3), as the tiles need them (:meth:`cast_to`). HBM has no
    partitions, so K^T then comes from the staging as from a bf16 page: one hardware-DGE DMA
    transpose per 128-key tile (:func:`_page_kT`), on all 16 DMA queues. Before (2026-11-29),
    raw K landed in SBUF in that transpose's 16-partition source layout, 2 of the 16 queues per
    tile, and GpSimd cast 1024 elements a partition per tile (0.85 us): tile 0 in SBUF at
    8.9 us, the first QK^T at 11.6 us (modeled, Trn3, 2K chunk over 0); now 4.1 us."""

    def __init__(self, k_cache, bt_sb, heads, S, dtype, cfg):
        d, bs = cfg.d, cfg.block_size
        self.h0 = min(heads)
        self.nh = max(heads) - self.h0 + 1
        self.npg = -(-S // bs)
        self.S, self.bs, self.d, self.row = S, bs, d, cfg.Hkv * d
        self.kst = nl.ndarray((self.npg * bs, self.nh * d), dtype=dtype,            # [keys, nh*d]
                              buffer=nl.hbm)
        self.kp = k_cache.reshape((k_cache.shape[0], bs * self.row))            # [num_blocks, page]
        self.bt_sb = bt_sb
        self.done = 0                               # pages cast so far

    def cast_to(self, c):
        """Cast the pages holding request keys below ``c`` (once each)."""
        bs, nd = self.bs, self.nh * self.d
        while self.done < self.npg and self.done * bs < c:
            j = self.done
            m = min(bs, self.S - j * bs)
            nisa.dma_copy(dst=self.kst[j * bs:j * bs + m, :],
                          src=self.kp.ap([[self.row, m], [1, nd]], offset=self.h0 * self.d,
                                         scalar_offset=self.bt_sb[0:1, j:j + 1], indirect_dim=0),
                          dge_mode=nisa.dge_mode.swdge)
            self.done += 1


def _load_kv_pages_fp8(ks, v_cache, bt_sb, hk, c0, c1, dtype, cfg):
    """:func:`_load_kv_pages` for FP8 pages. V_aug stays FP8: PV multiplies bf16 P^T by FP8 V
    (TensorE takes mixed fp8 / bf16 inputs; the bf16 value of an FP8 number is exact), so V
    needs no cast. K^T (a DMA transpose does not cast) comes from the request's bf16 staging in
    HBM (``ks``, :class:`_KStage`): one hardware-DGE transpose per 128-key tile from Sync, issued
    once its pages are cast; the returned ``need(c)`` (called before each QK^T) casts the pages
    up to FP8_AHEAD tiles past the ones it reads, FP8_FIRST tiles are cast up front. Casting
    every page up front held each q-tile's softmax set-up (a GpSimd memset) behind the casts in
    GpSimd's in-order queue (modeled, Trn3, 2K chunk over 0: 92.2 us vs 91.0)."""
    d, row, kT, vs, vp = _kv_tiles(v_cache, c0, c1, dtype, v_cache.dtype, cfg)
    bs, C, nt = cfg.block_size, c1 - c0, -(-(c1 - c0) // P)
    # V of the first span on ScalarE's hardware DGE; later spans' tiles wait for SBUF the span
    # before them holds, and an in-order ScalarE trigger waiting there stalls the softmax (chunk
    # over 32K, Trn3: 2321.5 us with every span's V there, 2253.8 with the first only)
    vkw = dict(dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.scalar) if c0 == 0 else {}
    for reg, k0, m, off in _page_pieces(bt_sb, hk, c0, c1, cfg):
        t, p0 = k0 // P, k0 % P
        nisa.dma_copy(dst=vs[p0:p0 + m, t, 0:d], src=vp.ap(
            [[row, m], [1, d]], offset=off, scalar_offset=reg, indirect_dim=0), **vkw)
    nrow = ks.nh * d
    done = [0]                                      # tiles transposed so far

    def need(c):
        """Cast the pages up to FP8_AHEAD tiles past chunk key ``c``; transpose the tiles whose
        pages are cast (once each)."""
        ks.cast_to(c0 + (min(nt, -(-c // P)) + FP8_AHEAD) * P)
        landed = min(C, ks.done * bs - c0)
        while done[0] < nt and min(C, (done[0] + 1) * P) <= landed:
            k0 = done[0] * P
            _page_kT(kT, ks.kst, None, (c0 + k0) * nrow + (hk - ks.h0) * d, k0,
                     min(C - k0, P), d, nrow)
            done[0] += 1

    ks.cast_to(c0 + FP8_FIRST * P)
    # after the first casts: GpSimd's queue is in order
    nisa.memset(dst=vs[:, :, d:d + 1], value=1.0, engine=nisa.engine.gpsimd)
    need(0)
    return kT, vs, need


def _page_kT(kT, kp, reg, off, k0, m, d, row):
    """K^T columns [k0, k0 + m) (``m`` keys of one page) straight from the page in HBM: one DMA
    transpose per 128 rows of d. ``m`` a multiple of 16 takes the hardware DGE's 4-D form
    ([16, 1, m/16, dc] -> [dc, 1, m/16, 16], the HWDGE shape rule), triggered from Sync: its own
    DMA ring, so the page transposes do not queue behind the Q^T loads, P^T transposes and
    output stores of the static ring. 8-key pages take the static 2-D form. ``reg`` None: a
    static source (the FP8 path's bf16 staging in HBM, :class:`_KStage`)."""
    dyn = dict(scalar_offset=reg, indirect_dim=0) if reg is not None else {}
    for c in range(-(-d // P)):
        dc = min(P, d - c * P)
        dst = kT[0:dc, c, k0:k0 + m]
        if m % G16 == 0:
            nisa.dma_transpose(dst=dst.reshape((dc, 1, m // G16, G16)),
                               src=kp.ap([[row, G16], [m * row, 1], [G16 * row, m // G16],
                                          [1, dc]],
                                         offset=off + c * P, **dyn),
                               dge_mode=nisa.dge_mode.hwdge)
        else:
            nisa.dma_transpose(dst=dst, src=kp.ap([[row, m], [1, dc]], offset=off + c * P,
                                                  **dyn))


# ---------------------------------------------------------------------------------------- op


def _check_inputs(op, q, k_cache, v_cache, block_table, seq_lens, query_start_loc):
    for name, t, nd in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if getattr(t, "ndim", None) != nd:
            raise ValueError(f"{op}: {name} must be {nd}-D; got shape {getattr(t, 'shape', None)}")
    T, Hq, d = (int(x) for x in q.shape)
    if d not in HEAD_DIMS:
        raise ValueError(f"{op}: head_dim must be one of {', '.join(map(str, HEAD_DIMS))}; got {d}")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"{op}: k_cache and v_cache must have the same shape; got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    N0, bs, Hkv, dk = (int(x) for x in k_cache.shape)
    if dk != d:
        raise ValueError(f"{op}: k_cache's head_dim {dk} must equal q's head_dim {d}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"{op}: H_q ({Hq}) must be a multiple of the cache's H_kv ({Hkv})")
    if T < 1:
        raise ValueError(f"{op}: q holds no tokens (T = 0); call it with at least one query row")
    sl, qsl = _qsl_and_lens(op, seq_lens, query_start_loc)
    if qsl[-1] != T:
        raise ValueError(f"{op}: query_start_loc[-1] = {qsl[-1]} must equal q.shape[0] = T = {T}")
    bt, bs = check_block_table(op, block_table, sl, k_cache.shape, BLOCK_SIZES, rows="R")
    return T, Hq, d, Hkv, bs, sl, qsl, bt


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *, plan=None,
                    scale=None, window=None, softcap=None, sinks=None, k_scale=None,
                    v_scale=None, return_lse=False, lnc=1):
    """Attention of a ragged serving batch (decodes, prompt chunks, cached prefixes, in any
    order) over a vLLM paged KV cache: vLLM's unified-attention contract.

    Args:
      q: [T, H_q, d] bfloat16 / float16, the new tokens of R requests back to back; d in
         {64, 128, 192, 256}.
      k_cache, v_cache: [num_blocks, block_size, H_kv, d] (block sizes 8-256, powers of two),
         q's dtype or FP8 (float8_e4m3 on Trn2, float8_e4m3fn on Trn3) with k_scale / v_scale.
         Every request's new keys are already in the cache (kv_cache_append first).
      block_table: [R, max_blocks] int32: logical block n of request r is page
         ``block_table[r, n]``; entries past a request's end are never read, nor their pages.
      seq_lens: [R] host ints, tokens of each request including its new ones.
      query_start_loc: [R + 1] host ints: request r owns rows ``[qsl[r], qsl[r + 1])`` of q,
         its last ``q_len`` positions (causal, end-aligned); q_len 0 is allowed; qsl[R] = T.
      plan: :func:`plan_paged_attention` of this step (made once, reused by every layer); None
         plans here. A plan that does not match the call is a ValueError.
      scale: logit scale (default 1/sqrt(d)). window: left sliding window (keys visible
         including the query's own). softcap: ``c * tanh(logit / c)``. sinks: [H_q] sink logits.
      k_scale, v_scale: FP8 dequantization scales, a scalar or one per KV head (vLLM).
      return_lse: also return lse [T, H_q] float32 (natural log, sink included).
      lnc: 1, or 2 to spread the work over both cores of a logical NeuronCore.
    Returns:
      o [T, H_q, d] in q's dtype (and lse).
    """
    op = "paged_attention"
    gen = check_target(op)
    check_flag(op, "return_lse", return_lse)
    check_no_grad(op, q, k_cache, v_cache, sinks)
    T, Hq, d, Hkv, bs, sl, qsl, bt = _check_inputs(op, q, k_cache, v_cache, block_table,
                                                   seq_lens, query_start_loc)
    check_window(op, window)
    check_lnc(op, lnc)
    qn, kn, is_fp8, ks, vs, scale, softcap, sk = attention_options(
        op, gen, q, k_cache, v_cache, Hq, Hkv, d, scale, softcap, sinks, k_scale, v_scale)
    isz = 1 if is_fp8 else 2
    if plan is None:
        plan = plan_paged_attention(sl, qsl, bs, Hq, Hkv, d, window=window, kv_dtype=kn, lnc=lnc)
    else:
        _check_plan(op, plan, sl, qsl, Hq, Hkv, d, isz, bs, window, lnc, gen)
    out_dtype = getattr(nl, qn)
    # decode classes: decode_attention's plans on the ragged rows, row tables side by side
    dplans, tabs, offs, o0 = [], [], [], 0
    for c in plan.decode:
        W = slot_width(Hq // Hkv * c.s_q)
        dp = DecodePlan(B=len(c.reqs), s_q=c.s_q, Hq=Hq, Hkv=Hkv, d=d, W=W, nslot=P // W,
                        layout=c.layout, seq_lens=tuple(sl[r] for r in c.reqs), items=c.items,
                        window=plan.window, softcap=float(softcap or 0.0),
                        has_sinks=sk is not None, has_vscale=vs is not None,
                        return_lse=bool(return_lse), out_dtype=out_dtype, kt_act=0.5,
                        q_rows=tuple(qsl[r] for r in c.reqs), bt_rows=c.reqs)
        dplans.append(dp)
        tabs.append(row_table(dp, scale, ks, vs, sk))
        offs.append(o0)
        o0 += dp.B
    rowtab = None
    if tabs:
        ng = max(t.shape[2] for t in tabs)
        rowtab = np.zeros((P, o0, ng, NCOL), dtype=np.float32)
        for t, o in zip(tabs, offs):
            rowtab[:, o:o + t.shape[1], 0:t.shape[2], :] = t
    # chunk requests: flash attention's plan for each, one per KV head with FP8 scales
    cplans = []
    for ch in plan.chunks:
        base = plan_flash_attention(gen, d, ch.seq_len, causal=True, window=window,
                                    softcap=softcap, scale=scale, has_sinks=sk is not None,
                                    return_lse=bool(return_lse), k_layout="bhsd",
                                    out_dtype=out_dtype, sbuf_budget=sbuf_budget(),
                                    chunk=ch.chunk, **chunk_options(gen, ch.seq_len))
        if ks is None and vs is None:
            cplans.append((base,))
        else:
            cplans.append(tuple(
                dataclasses.replace(base, scale=scale * (ks[h] if ks is not None else 1.0),
                                    v_scale=float(vs[h]) if vs is not None else 0.0)
                for h in range(Hkv)))
    cfg = PagedKernelConfig(T=T, Hq=Hq, Hkv=Hkv, d=d, block_size=bs, window=plan.window,
                            out_dtype=out_dtype, return_lse=bool(return_lse), fp8=is_fp8,
                            decode=tuple(dplans), rt_offsets=tuple(offs), chunks=plan.chunks,
                            chunk_plans=tuple(cplans))
    res = launch(paged_attention_kernel, q, k_cache, v_cache, bt, rowtab, sk, cfg, lnc=lnc)
    return tuple(res) if return_lse else res


__all__ = ["paged_attention", "plan_paged_attention", "paged_attention_kernel",
           "PagedAttentionPlan"]
