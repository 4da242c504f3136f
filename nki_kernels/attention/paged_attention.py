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
  into PV as FP8 (TensorE takes mixed bf16 / FP8 inputs); FP8 K lands raw, GpSimd casts it and
  one DMA transpose per 128-key tile makes K^T, as the blocks need it. ``k_scale`` folds into
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
KV_PIECE = 8              # 128-key tiles per cast and K^T transpose (Trn2 FP8, several spans)
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
        K^T, V_aug <- its pages (one dynamic-offset DMA per page; FP8: V raw, K cast + transposed)
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
    for hk in sorted({u.kv_head for u in mine}):
        fp = plans[hk] if len(plans) > 1 else plans[0]
        run_kv_group(q4, o4, l4, sinks, hbm_state, ident, spec, chunks,
                     [u for u in mine if u.kv_head == hk], Hq, Hkv, d, fp,
                     lambda c0, c1, hk=hk: _load_kv_pages(k_cache, v_cache, bt_sb, hk, c0, c1,
                                                          q.dtype, cfg, len(chunks) > 1),
                     store_each=True)


def _load_kv_pages(k_cache, v_cache, bt_sb, hk, c0, c1, dtype, cfg, spans=False):
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
    627.9 us). FP8 pages: :func:`_load_kv_pages_fp8` (on Trn2, a request that takes more than
    one resident span, ``spans``: :func:`_load_kv_pages_staged`). ``c0`` is a multiple of the
    block size: pages never straddle a span."""
    if cfg.fp8 and spans and int(nisa.get_nc_version()) < 4:
        return _load_kv_pages_staged(k_cache, v_cache, bt_sb, hk, c0, c1, dtype, cfg)
    if cfg.fp8:
        return _load_kv_pages_fp8(k_cache, v_cache, bt_sb, hk, c0, c1, dtype, cfg)
    d, Hkv, bs = cfg.d, cfg.Hkv, cfg.block_size
    DT = -(-d // P)
    C = c1 - c0
    nt = -(-C // P)
    row = Hkv * d
    kT = nl.ndarray((P, DT, C), dtype=dtype, buffer=nl.sbuf)                  # [128, DT, C]
    vs = nl.ndarray((P, nt, d + 1), dtype=dtype, buffer=nl.sbuf)              # [128, nt, d+1]
    nisa.memset(dst=vs[:, :, d:d + 1], value=1.0, engine=nisa.engine.gpsimd)
    kp = k_cache.reshape((k_cache.shape[0], bs * row))                        # [num_blocks, page]
    vp = v_cache.reshape((v_cache.shape[0], bs * row))
    for j in range(c0 // bs, -(-c1 // bs)):
        reg = bt_sb[0:1, j:j + 1]
        base = j * bs - c0
        for s0 in range(0, min(bs, C - base), P):
            m = min(P, bs - s0, C - base - s0)
            t, p0 = (base + s0) // P, (base + s0) % P
            off = (s0 * Hkv + hk) * d
            _page_kT(kT, kp, reg, off, base + s0, m, d, row)
            # V on ScalarE's hardware-DGE ring (the DGE holds 600 ns per page; ScalarE is idle
            # while the first pages load)
            nisa.dma_copy(dst=vs[p0:p0 + m, t, 0:d], src=vp.ap(
                [[row, m], [1, d]], offset=off, scalar_offset=reg, indirect_dim=0),
                dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.scalar)
    return kT, vs


def _load_kv_pages_fp8(k_cache, v_cache, bt_sb, hk, c0, c1, dtype, cfg):
    """:func:`_load_kv_pages` for FP8 pages. V_aug stays FP8: PV multiplies bf16 P^T by FP8 V
    (TensorE takes mixed fp8 / bf16 inputs; the bf16 value of an FP8 number is exact), so V
    needs no cast. A DMA transpose does not cast, so K^T is made per 128-key tile from a bf16
    copy: raw K lands in the hardware-DGE transpose's 4-D source layout (key 16 b + a of tile t
    on partition 16 (t % 8) + a, group b: 16-partition blocks, so 8 tiles side by side), GpSimd
    casts the tiles, one DMA transpose per tile from Sync writes K^T
    ([16, 1, 8, dc] -> [dc, 1, 8, 16]). The casts and transposes of a tile are issued with the
    first QK^T that reads it (the returned ``need``): issued up front, GpSimd's in-order queue
    held every q-tile's softmax set-up behind the last page's cast (modeled, Trn3, 2K chunk over
    0: 126.4 us with staged K, casts of 8 tiles and SBUF->SBUF transposes on the static ring).
    Raw K goes by the static ring. A 16-key group the request's
    keys only partly fill (its last keys; 8-key pages) loads and transposes on its own rows."""
    d, Hkv, bs = cfg.d, cfg.Hkv, cfg.block_size
    DT = -(-d // P)
    C = c1 - c0
    nt = -(-C // P)
    NB = P // G16
    row = Hkv * d
    kT = nl.ndarray((P, DT, C), dtype=dtype, buffer=nl.sbuf)                  # [128, DT, C]
    vs = nl.ndarray((P, nt, d + 1), dtype=v_cache.dtype, buffer=nl.sbuf)      # [128, nt, d+1]
    nisa.memset(dst=vs[:, :, d:d + 1], value=1.0, engine=nisa.engine.gpsimd)
    k8 = nl.ndarray((P, -(-nt // 8), NB, d), dtype=k_cache.dtype,             # [128, nt/8, 8, d]
                    buffer=nl.sbuf)
    kb = nl.ndarray((P, -(-nt // 8), NB, d), dtype=dtype, buffer=nl.sbuf)     # [128, nt/8, 8, d]
    kp = k_cache.reshape((k_cache.shape[0], bs * row))                        # [num_blocks, page]
    vp = v_cache.reshape((v_cache.shape[0], bs * row))
    # V of the first span on ScalarE's hardware DGE; later spans' tiles wait for SBUF the span
    # before them holds, and an in-order ScalarE trigger waiting there stalls the softmax (chunk
    # over 32K, Trn3: 2321.5 us with every span's V there, 2253.8 with the first only)
    vkw = dict(dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.scalar) if c0 == 0 else {}
    for j in range(c0 // bs, -(-c1 // bs)):
        reg = bt_sb[0:1, j:j + 1]
        base = j * bs - c0
        for s0 in range(0, min(bs, C - base), P):
            m = min(P, bs - s0, C - base - s0)
            t, p0 = (base + s0) // P, (base + s0) % P
            off = (s0 * Hkv + hk) * d
            g, t8 = G16 * (t % 8), t // 8
            k = 0
            while k < m:      # whole 16-key groups in one DMA, a partial group on its own rows
                a, b = (p0 + k) % G16, (p0 + k) // G16
                if a == 0 and m - k >= G16:
                    n = (m - k) // G16 * G16
                    dst, pat = k8[g:g + G16, t8, b:b + n // G16, :], [[row, G16],
                                                                     [G16 * row, n // G16]]
                else:
                    n = min(m - k, G16 - a)
                    dst, pat = k8[g + a:g + a + n, t8, b, :], [[row, n]]
                nisa.dma_copy(dst=dst, src=kp.ap(pat + [[1, d]], offset=off + k * row,
                                                 scalar_offset=reg, indirect_dim=0))
                k += n
            nisa.dma_copy(dst=vs[p0:p0 + m, t, 0:d], src=vp.ap(
                [[row, m], [1, d]], offset=off, scalar_offset=reg, indirect_dim=0), **vkw)
    done = [0]
    full = C // P                                   # tiles of 128 keys

    def need(c):
        """Cast and transpose the tiles holding chunk keys below ``c`` (once each)."""
        want = min(nt, -(-c // P))
        t = done[0]
        while t < want:
            t8 = t // 8
            e = min(want, (t8 + 1) * 8)              # tiles of one 16-partition block row
            ef = min(e, full)
            if ef > t:
                nisa.tensor_copy(dst=kb[G16 * (t % 8):G16 * ((ef - 1) % 8 + 1), t8, :, :],
                                 src=k8[G16 * (t % 8):G16 * ((ef - 1) % 8 + 1), t8, :, :],
                                 engine=nisa.engine.gpsimd)
            for u in range(t, e):
                g, w = G16 * (u % 8), min(P, C - u * P)
                nf, r = w // G16, w % G16
                if u >= full:                        # the last, partial tile
                    if nf:
                        nisa.tensor_copy(dst=kb[g:g + G16, t8, 0:nf, :],
                                         src=k8[g:g + G16, t8, 0:nf, :], engine=nisa.engine.gpsimd)
                    if r:
                        nisa.tensor_copy(dst=kb[g:g + r, t8, nf, :], src=k8[g:g + r, t8, nf, :],
                                         engine=nisa.engine.gpsimd)
                for c_ in range(DT):
                    dc, k0 = min(P, d - c_ * P), u * P
                    if nf:
                        nisa.dma_transpose(
                            dst=kT[0:dc, c_, k0:k0 + nf * G16].reshape((dc, 1, nf, G16)),
                            src=kb[g:g + G16, t8:t8 + 1, 0:nf, c_ * P:c_ * P + dc],
                            dge_mode=nisa.dge_mode.hwdge)
                    if r:
                        nisa.dma_transpose(dst=kT[0:dc, c_, k0 + nf * G16:k0 + w],
                                           src=kb[g:g + r, t8, nf, c_ * P:c_ * P + dc])
            t = e
        done[0] = max(done[0], want)

    return kT, vs, need


def _load_kv_pages_staged(k_cache, v_cache, bt_sb, hk, c0, c1, dtype, cfg):
    """FP8 pages as before 2026-11-29, kept for Trn2 requests over several resident spans (the
    chunk over 32K: 3703.7 us this way, 3707.6 with :func:`_load_kv_pages_fp8`; modeled): raw K
    and V on the static ring, GpSimd casts both to bf16 every KV_PIECE tiles, K^T by SBUF->SBUF
    DMA transposes of those tiles."""
    d, Hkv, bs = cfg.d, cfg.Hkv, cfg.block_size
    DT = -(-d // P)
    C = c1 - c0
    nt = -(-C // P)
    row = Hkv * d
    kT = nl.ndarray((P, DT, C), dtype=dtype, buffer=nl.sbuf)                  # [128, DT, C]
    vs = nl.ndarray((P, nt, d + 1), dtype=dtype, buffer=nl.sbuf)              # [128, nt, d+1]
    nisa.memset(dst=vs[:, :, d:d + 1], value=1.0, engine=nisa.engine.gpsimd)
    kst = nl.ndarray((P, nt, d), dtype=dtype, buffer=nl.sbuf)                 # [128, nt, d]
    k8 = nl.ndarray((P, nt, d), dtype=k_cache.dtype, buffer=nl.sbuf)          # [128, nt, d]
    v8 = nl.ndarray((P, nt, d), dtype=v_cache.dtype, buffer=nl.sbuf)          # [128, nt, d]
    kp = k_cache.reshape((k_cache.shape[0], bs * row))                        # [num_blocks, page]
    vp = v_cache.reshape((v_cache.shape[0], bs * row))
    done_t = 0
    last_page = -(-c1 // bs) - 1
    for j in range(c0 // bs, last_page + 1):
        reg = bt_sb[0:1, j:j + 1]
        base = j * bs - c0
        for s0 in range(0, min(bs, C - base), P):
            m = min(P, bs - s0, C - base - s0)
            t, p0 = (base + s0) // P, (base + s0) % P
            off = (s0 * Hkv + hk) * d
            for dst, src in ((k8, kp), (v8, vp)):
                nisa.dma_copy(dst=dst[p0:p0 + m, t, :], src=src.ap(
                    [[row, m], [1, d]], offset=off, scalar_offset=reg, indirect_dim=0))
        ready = min(C, base + bs) // P              # whole tiles staged so far
        last = j == last_page
        if ready - done_t >= KV_PIECE or last:
            c_end = C if last else ready * P
            for dst, src in ((kst, k8), (vs, v8)):
                if ready > done_t:
                    nisa.tensor_copy(dst=dst[:, done_t:ready, 0:d], src=src[:, done_t:ready, :],
                                     engine=nisa.engine.gpsimd)
                r = c_end - ready * P
                if 0 < r < P:
                    nisa.tensor_copy(dst=dst[0:r, ready, 0:d], src=src[0:r, ready, :],
                                     engine=nisa.engine.gpsimd)
            for c in range(DT):
                dc = min(P, d - c * P)
                if ready > done_t:
                    n = ready - done_t
                    nisa.dma_transpose(dst=kT[0:dc, c, done_t * P:ready * P].reshape((dc, n, P)),
                                       src=kst[:, done_t:ready, c * P:c * P + dc])
                r = C - ready * P
                if last and 0 < r < P:
                    nisa.dma_transpose(dst=kT[0:dc, c, ready * P:C],
                                       src=kst[0:r, ready, c * P:c * P + dc])
            done_t = ready
    return kT, vs


def _page_kT(kT, kp, reg, off, k0, m, d, row):
    """K^T columns [k0, k0 + m) (``m`` keys of one page) straight from the page in HBM: one DMA
    transpose per 128 rows of d. ``m`` a multiple of 16 takes the hardware DGE's 4-D form
    ([16, 1, m/16, dc] -> [dc, 1, m/16, 16], the HWDGE shape rule), triggered from Sync: its own
    DMA ring, so the page transposes do not queue behind the Q^T loads, P^T transposes and
    output stores of the static ring. 8-key pages take the static 2-D form."""
    for c in range(-(-d // P)):
        dc = min(P, d - c * P)
        dst = kT[0:dc, c, k0:k0 + m]
        if m % G16 == 0:
            nisa.dma_transpose(dst=dst.reshape((dc, 1, m // G16, G16)),
                               src=kp.ap([[row, G16], [m * row, 1], [G16 * row, m // G16],
                                          [1, dc]],
                                         offset=off + c * P, scalar_offset=reg, indirect_dim=0),
                               dge_mode=nisa.dge_mode.hwdge)
        else:
            nisa.dma_transpose(dst=dst, src=kp.ap([[row, m], [1, dc]], offset=off + c * P,
                                                  scalar_offset=reg, indirect_dim=0))


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
