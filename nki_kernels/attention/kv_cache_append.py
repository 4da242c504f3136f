"""Append the new tokens' K/V to a paged (vLLM) KV cache, in place: ``cache[slot[t]] = kv[t]``.

``kv_cache_append(k, v, k_cache, v_cache, slot_mapping, k_scale=, v_scale=)`` writes token ``t``'s
row (all its KV heads, ``H_kv * d`` contiguous elements of the cache) to slot
``slot_mapping[t] = block * block_size + offset``; ``-1`` skips the token (vLLM's padding). Nothing
else in the caches changes. An FP8 cache stores ``fp8(clamp(x / scale, -max, max))`` per KV head.

Layout on chip: the host cuts the tokens into segments, each of runs of r tokens going to r
consecutive slots (r = 1: single tokens; up to 64 where a prompt chunk fills its pages in order;
see segments()). In a segment, run ``u = p * nt + j`` sits on partition ``p``, column ``j`` (``nt
= ceil(runs / 128)``); the table of each run's first slot arrives in one DMA. Each column (up to
128 runs, one per partition) is loaded, quantised if the cache is FP8, and written by one
indirect DMA per cache: a scatter through ``vector_offset`` (software DGE) in which partition
``p``'s run goes to cache rows ``slot[u] .. slot[u] + r - 1``, one descriptor of ``r * H_kv * d *
itemsize`` bytes.

What bounds it (modeled): two scatters into the same cache are ordered (an indirect write may
touch any row, so the compiler cannot prove them disjoint: a write-after-write edge), so each
cache's scatters form a chain whose links cost the GpSimd descriptor generation, the DMA latency
and the transfer. The K and V chains run side by side; the loads run ahead of them, NBUF columns
deep.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .._validate import check_no_grad, check_target, dtype_name, host_ints, is_torch, kv_scales
from ..backend import launch, nisa, nki, nl

P = 128
# Load buffers per cache (columns loaded ahead of the scatters). The load of column j + NBUF waits
# for column j's scatter (the buffer is reused), so loads are issued between the scatters instead
# of all at the start, where they would fill the DMA queues ahead of the first scatter (FIFO).
# Llama-3-8B T = 2048 bf16, Trn3 modeled: NBUF 2 -> 43.2 us, 3 -> 44.8 us, a fresh buffer per
# column (all loads first) -> 50.7 us; loading 2 or 4 columns per DMA: 53.6 / 68.7 us.
NBUF = 2
MAX_ROW = 4096         # H_kv * d elements per token: SBUF of a column (bf16 in, clamped, fp8)
MAX_TOKENS = 65536     # tokens per call (slot table [128, nt] int32 on chip: <= 2 KiB/partition)
_KV_DTYPES = ("bfloat16", "float16")
_FP8 = {3: "float8_e4m3", 4: "float8_e4m3fn"}          # the cache FP8 of Trn2 / Trn3
_FP8_MAX = {"float8_e4m3": 240.0, "float8_e4m3fn": 448.0}


# Runs: where r consecutive tokens go to r consecutive slots (a prompt chunk fills its pages in
# order), one descriptor moves the run's r rows: r times fewer scatters per cache (fewer links in
# the chain above) and longer descriptors. The host cuts the tokens into segments of one run
# length each (segments()): runs of r where at least 128 of them (FP8: 129, two columns, so the
# quantisation of one column overlaps the DMAs of another) follow each other, single tokens
# elsewhere, skipped tokens (-1) at a segment's ends dropped. r is bounded by RUN_BYTES per
# partition and buffer (input dtype). Modeled (Trn3 unless said), whole pages, T = 2048:
# Llama-3-8B bf16 r = 1 / 2 / 8 / 16: 43.2 / 35.3 / 33.7 / 33.6 us; FP8 r = 2 / 4 / 8: 32.0 /
# 27.4 / 26.2 us (Trn2: 41.5 / 37.3 / 42.3 us), r = 16 (one column): 47.5 us. Llama-3-70B TP8
# (256-byte rows) bf16 r = 1 / 8 / 16: 40.4 / 7.3 / 6.2 us.
RUNS = (64, 32, 16, 8, 4, 2)
RUN_BYTES = 16384


@dataclass(frozen=True)
class AppendPlan(nl.NKIObject):
    """Compile-time geometry of one append.

    segs: ``(t0, U, r, nt, col0)`` per segment: tokens ``t0 .. t0 + U r - 1`` in U runs of r
    (run ``u``'s r tokens go to r consecutive slots); run ``u = p * nt + j`` on partition p,
    column ``col0 + j`` of the slot table. NT: slot-table columns. fp8_max: the FP8 cache's
    clamp bound (0.0: the cache has k's dtype, no quantisation); per_head: one scale per KV head
    (else one for all heads).
    """
    T: int
    segs: tuple
    NT: int
    fp8_max: float
    per_head: bool


def segments(slots, row: int, itemsize: int = 2, fp8: bool = False) -> list:
    """Cut the tokens into ``(t0, U, r)`` segments (greedy, left to right): at each token the
    longest r of RUNS (``r * row * itemsize <= RUN_BYTES``) whose runs from there (runs of r
    consecutive slots) number at least 128 (FP8: 129) starts a run segment as long as its runs
    last; if such a segment starts within the next max(RUNS) tokens instead (a chunk that starts
    mid-page reaches a page boundary), single tokens fill up to it. Single tokens form r = 1
    segments; skipped tokens at the ends of a single-token segment are dropped (never loaded)."""
    s = np.asarray(slots, dtype=np.int64).reshape(-1)
    T = s.size
    need = P + 1 if fp8 else P
    rs = [r for r in RUNS if r * row * itemsize <= RUN_BYTES and r * need <= T]
    nxt = np.zeros(T, bool)                      # slot[t + 1] == slot[t] + 1, both valid
    if T > 1:
        nxt[:-1] = (s[1:] == s[:-1] + 1) & (s[:-1] >= 0)
    brk = np.concatenate([[0], np.cumsum(~nxt)])  # brk[b] - brk[a]: breaks in [a, b)
    chain = {}                                   # r -> runs of r one after the other from t
    for r in rs:
        ok = np.zeros(T, bool)                   # tokens t .. t + r - 1: consecutive slots
        ok[:T - r + 1] = (brk[r - 1:T] - brk[:T - r + 1] == 0) & (s[:T - r + 1] >= 0)
        n = np.zeros(T + r, np.int64)
        for c in range(r):                       # per residue class: length of the ones from t
            g = ok[c::r]
            zeros = np.append(np.flatnonzero(~g), g.size)
            n[c:T:r] = zeros[np.searchsorted(zeros, np.arange(g.size))] - np.arange(g.size)
        chain[r] = n

    def runs_from(t, r):
        return int(chain[r][t])

    def best(t):
        for r in rs:
            n = runs_from(t, r)
            if n >= need:
                return r, n
        return 1, 0

    segs, single = [], None

    def flush(end):
        nonlocal single
        if single is not None:
            a, b = single, end
            while a < b and s[a] < 0:
                a += 1
            while b > a and s[b - 1] < 0:
                b -= 1
            if b > a:
                segs.append((a, b - a, 1))
            single = None

    cand = np.zeros(T, bool)                     # a run segment may start at t
    for r in rs:
        cand |= chain[r][:T] >= need
    starts = np.flatnonzero(cand)
    lookahead = max(rs, default=1)
    t = 0
    while t < T:
        i = int(np.searchsorted(starts, t))
        if i == starts.size:                     # single tokens to the end
            if single is None:
                single = t
            break
        if starts[i] > t:                        # single tokens up to the next run segment
            if single is None:
                single = t
            t = int(starts[i])
        r, n = best(t)
        for dt in range(1, lookahead):           # a longer run length a few tokens later
            if t + dt >= T:                      # (the next page boundary)?
                break
            r2, n2 = best(t + dt)
            if r2 > r:
                if single is None:
                    single = t
                t += dt
                r, n = r2, n2
                break
        flush(t)
        segs.append((t, n, r))
        t += n * r
    flush(T)
    return segs


def plan_append(T: int, segs, fp8_max: float = 0.0, per_head: bool = False) -> AppendPlan:
    out, col = [], 0
    for (t0, U, r) in segs:
        nt = -(-U // P)
        out.append((int(t0), int(U), int(r), nt, col))
        col += nt
    return AppendPlan(T=T, segs=tuple(out), NT=max(1, col), fp8_max=float(fp8_max),
                      per_head=bool(per_head))


@nki.jit
def kv_cache_append_kernel(k, v, k_cache, v_cache, slots, qtab, plan):
    """``k_cache[slot[t]] = q(k[t])``, ``v_cache[slot[t]] = q(v[t])`` for every token with a slot.

    Dimensions: T tokens (1..65536) in segments of runs of r (1..64) tokens, H_kv heads,
    d head_dim, H_kv * d <= 4096; num_blocks x block_size slots.
    Args:
      k, v: [T, H_kv, d] bf16 / fp16, HBM.
      k_cache, v_cache: [num_blocks, block_size, H_kv, d] HBM, k's dtype or FP8 (written in place).
      slots: [128, NT] int32 HBM: the first slot of run ``p * nt + j`` of a segment at ``[p,
        col0 + j]`` (its r tokens go to r consecutive slots); skipped tokens and padding hold -1
        (bits 0xFFFFFFFF: out of bounds, so never written).
      qtab: [128, 6 H_kv] fp32 HBM (FP8 only, else None), the same on every partition: for
        c = 0 (K), 1 (V) and head h, column ``c H_kv + h`` holds ``1 / scale``, column
        ``(2 + c) H_kv + h`` the clamp bound B of the input and ``(4 + c) H_kv + h`` holds -B.
      plan: AppendPlan.
    Returns:
      (k_cache, v_cache), written in place.
    Notes:
      bf16 / fp16 caches: the rows are copied bit for bit. FP8: ``fp8(clip(x * inv, -M, M))``
      (inv = fp32(1 / scale), product in fp32, RNE) exactly, computed as ``fp8(clamp(x, -B, B)
      * inv)``: the clamp on VectorE, the multiply on VectorE (Trn3) or ScalarE (Trn2). No other
      byte of the caches is written: a skipped run's transfer is dropped by the DMA
      (oob_mode.skip).
    Pseudocode:
      idx[128, NT] = slots                                       # one DMA
      for (t0, U, r, nt, col0) in segments:
        for j in 0..nt-1:                                        # column j: runs p * nt + j
          for x, cache in (k, k_cache), (v, v_cache):
            x_sb[p, :, :] = x[t0 + (p nt + j) r ...]             # [r, H*d], buffer j % NBUF
            if fp8: x_sb = fp8(clamp(x_sb, -B[h], B[h]) * inv[h])  # VectorE (Trn2: x ScalarE)
            cache_rows[idx[p, col0 + j] ...+ r] = x_sb[p]        # scatter; oob runs dropped
    """
    T, H, d = k.shape
    row = H * d
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    M = plan.fp8_max
    fp8 = M > 0.0
    x_rows = (k.reshape((T, row)), v.reshape((T, row)))                 # [T, H*d]
    c_rows = (k_cache.reshape((n_slots, row)), v_cache.reshape((n_slots, row)))   # [slots, H*d]

    idx = nl.ndarray((P, plan.NT), dtype=nl.int32, buffer=nl.sbuf)       # [128, NT] slot table
    nisa.dma_copy(dst=idx, src=slots)
    tab = None
    if fp8:
        tab = nl.ndarray((P, 6 * H), dtype=nl.float32, buffer=nl.sbuf)  # [128, 6 H_kv]
        nisa.dma_copy(dst=tab, src=qtab)
    # the FP8 multiply: VectorE's fast mode covers bf16 -> fp8 on Trn3 only; on Trn2 ScalarE
    # takes it (the clamp stays on VectorE), so the two engines share the work
    mul_engine = nisa.engine.vector if nisa.get_nc_version() >= 4 else nisa.engine.scalar

    for (t0, U, r, nt, col0) in plan.segs:
        full = U // nt               # partitions holding nt runs
        rem = U % nt                 # runs on partition `full` (columns 0..rem-1), if any
        x_runs = (x_rows[0][t0:t0 + U * r, :].reshape((U, r * row)),     # [U, r*H*d]
                  x_rows[1][t0:t0 + U * r, :].reshape((U, r * row)))
        bufs = nl.ndarray((P, 2, NBUF, r, row), dtype=k.dtype, buffer=nl.sbuf)  # [128,K|V,NBUF,r,H*d]
        for j in range(nt):
            cnt = full + (1 if j < rem else 0)  # partitions with a run in column j
            for w in range(2):
                x_sb = bufs[:, w, j % NBUF, :, :]                         # [128, r, H*d]
                if full > 0:
                    src = x_runs[w][0:full * nt, :].reshape((full, nt, r * row))[:, j, :]
                    nisa.dma_copy(dst=x_sb[0:full, :, :], src=src)
                if j < rem:
                    u0 = full * nt + j
                    nisa.dma_copy(dst=x_sb[full:full + 1, :, :], src=x_runs[w][u0:u0 + 1, :])
                out_sb = x_sb
                if fp8:
                    # fp8(clip(x * inv, -M, M)), inv = fp32(1 / scale), computed as
                    # fp8(clamp(x, -B, B) * inv) with B (host: _clamp_bound) the largest input
                    # value whose fp32 product with inv is <= M and still rounds to M: inputs
                    # above B saturate to M and B gives M; inputs up to B never exceed M, so no
                    # clip is needed and the cast never meets an out-of-range value (its
                    # overflow behaviour is not documented). The clamp is exact (B is an input
                    # value) and both steps keep 8/16-bit data (VectorE's fast modes). -0 stays
                    # -0.
                    xc_sb = nl.ndarray((P, r, row), dtype=k.dtype, buffer=nl.sbuf)  # clamped x
                    out_sb = nl.ndarray((P, r, row), dtype=k_cache.dtype, buffer=nl.sbuf)
                    heads = range(H) if plan.per_head else range(1)
                    width = d if plan.per_head else row
                    for h in heads:
                        cs = slice(h * width, (h + 1) * width)
                        ci, cb, cn = w * H + h, (2 + w) * H + h, (4 + w) * H + h
                        nisa.tensor_scalar(dst=xc_sb[0:cnt, :, cs], data=x_sb[0:cnt, :, cs],
                                           op0=nl.minimum, operand0=tab[0:cnt, cb:cb + 1],
                                           op1=nl.maximum, operand1=tab[0:cnt, cn:cn + 1],
                                           engine=nisa.engine.vector)
                        nisa.tensor_scalar(dst=out_sb[0:cnt, :, cs], data=xc_sb[0:cnt, :, cs],
                                           op0=nl.multiply, operand0=tab[0:cnt, ci:ci + 1],
                                           engine=mul_engine)
                # Skipped tokens: slot -1 (bits 0xFFFFFFFF, uint32 max) is out of bounds [0,
                # n_slots), and with oob_mode.skip the DMA drops that row's transfer, leaving
                # the cache untouched (nki-spec 6.4 / 9.2.1: oob_mode.skip "skips out-of-range
                # rows, used e.g. for KV-cache scatter with invalid positions = uint32 max"; NKI
                # Library's MoE kernels skip tokens with an int32 index of -1 the same way). The
                # host checks every slot to be -1 or in range, so no valid token is ever dropped
                # and no compaction pass (a prefix sum on chip, or a host copy of K/V) is needed.
                # A run's r rows are consecutive slots, i.e. consecutive rows of the flattened
                # cache (slot s + 1 is the row after s, across a page boundary too): one
                # descriptor per run.
                c = col0 + j
                dst = c_rows[w].ap([[row, cnt], [1, r * row]], offset=0,
                                   vector_offset=idx[0:cnt, c:c + 1], indirect_dim=0)
                nisa.dma_copy(dst=dst, src=out_sb[0:cnt, :, :], oob_mode=nisa.oob_mode.skip)
    return k_cache, v_cache


# ---------------------------------------------------------------------------------------- op
def _shape(x):
    s = getattr(x, "shape", None)
    return None if s is None else tuple(int(n) for n in s)


def _slots(op, slot_mapping, T, n_slots):
    """slot_mapping as host int64 [T]: -1 or a slot in range, no slot twice."""
    a = host_ints(op, "slot_mapping", slot_mapping)
    if a.shape != (T,):
        raise ValueError(f"{op}: slot_mapping must have shape ({T},) (one slot per token of k); "
                         f"got {list(a.shape)}")
    a = a.astype(np.int64)
    bad = a[(a < -1) | (a >= n_slots)]
    if bad.size:
        raise ValueError(f"{op}: slot_mapping values must be -1 (skip) or slots in [0, "
                         f"{n_slots}) (num_blocks * block_size); got {bad[:4].tolist()}")
    u, n = np.unique(a[a >= 0], return_counts=True)
    if np.any(n > 1):
        raise ValueError(f"{op}: slot_mapping has duplicated slots {u[n > 1][:4].tolist()}; "
                         f"each slot may be written once per call")
    return a


def _inv_scales(op, name, s, H):
    """1 / scale in fp32 per KV head [H_kv], from a positive scalar or one per KV head."""
    if s is None:
        raise ValueError(f"{op}: {name} is required for an FP8 cache (stored = fp8(x / "
                         f"{name})); got None")
    a = kv_scales(op, name, s, H).astype(np.float32)
    with np.errstate(over="ignore", divide="ignore"):
        inv = np.float32(1.0) / a
    if not np.all(np.isfinite(inv)) or np.any(a <= 0):
        raise ValueError(f"{op}: {name} must be a positive float32 whose reciprocal is finite; "
                         f"got {np.asarray(s).tolist() if not is_torch(s) else s.tolist()}")
    return inv


def _clamp_bound(op, name, inv, M, in_dtype, fp8_dtype):
    """B: the largest finite input value (``in_dtype``) whose fp32 product with ``inv`` is <= M
    and rounds to M in ``fp8_dtype``; then ``fp8(clamp(x, -B, B) * inv) == fp8(clip(x * inv,
    -M, M))`` for every finite x: above B the product exceeds M (clipped to M), and B gives M;
    up to B it never exceeds M. The largest finite input when no input reaches M."""
    dt = np.dtype(in_dtype)
    top = float(ml_dtypes.finfo(dt).max)
    inv = np.float32(inv)
    c = M / float(inv)
    if c >= top:
        cand = np.array([top], dt)
    else:
        bits = np.array([c], dt).view(np.uint16).astype(np.int64)
        cand = np.clip(bits + np.arange(-4, 5), 0, 0x7FFF).astype(np.uint16).view(dt)
    vals = cand.astype(np.float32)
    vals = vals[np.isfinite(vals) & (vals * inv <= np.float32(M))]
    B = np.float32(vals.max()) if vals.size else np.float32(0)
    f8 = np.dtype(getattr(ml_dtypes, fp8_dtype))
    if not (B == np.float32(top) and B * inv <= M) and \
            float(np.array(B * inv).astype(f8).astype(np.float32)) != M:
        raise ValueError(f"{op}: {name} = {1 / float(inv)!r} is too small for {dt.name} inputs "
                         f"(x / {name} saturates {fp8_dtype} for inputs below the smallest "
                         f"normal number)")
    return B


def kv_cache_append(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """Write the new tokens' K/V into their cache slots, in place (vLLM's reshape_and_cache).

    Args:
      k, v: [T, H_kv, d] bfloat16 / float16 (NumPy or torch), the new tokens' keys and values.
      k_cache, v_cache: [num_blocks, block_size, H_kv, d], C-contiguous, writable; k's dtype or
        the target's FP8 (float8_e4m3 on Trn2, float8_e4m3fn on Trn3) with k_scale / v_scale.
      slot_mapping: [T] integers: token t goes to slot ``block * block_size + offset``; -1 skips
        it. Slots must be distinct within a call (-1 excepted).
      k_scale, v_scale: FP8 caches only: a positive scalar or one per KV head ([H_kv]); the
        cache stores ``fp8(clamp(x * (1 / scale), -max, max))`` (max 240 on Trn2, 448 on Trn3),
        the reciprocal taken in fp32.
    Returns:
      (k_cache, v_cache): the same objects, written in place. Rows of other slots keep every
      byte.
    """
    op = "kv_cache_append"
    gen = check_target(op)
    check_no_grad(op, k, v)
    for name, t, nd in (("k", k, 3), ("v", v, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        s = _shape(t)
        if s is None or len(s) != nd:
            what = "[T, H_kv, d]" if nd == 3 else "[num_blocks, block_size, H_kv, d]"
            raise ValueError(f"{op}: {name} must be a {nd}-D array {what}; got shape {s}")
    if _shape(v) != _shape(k):
        raise ValueError(f"{op}: k and v must have the same shape [T, H_kv, d]; got {_shape(k)} "
                         f"and {_shape(v)}")
    if _shape(v_cache) != _shape(k_cache):
        raise ValueError(f"{op}: k_cache and v_cache must have the same shape; got "
                         f"{_shape(k_cache)} and {_shape(v_cache)}")
    T, H, d = _shape(k)
    nb, bs, Hc, dc = _shape(k_cache)
    if (Hc, dc) != (H, d):
        raise ValueError(f"{op}: the caches' [H_kv, d] must equal k's ({H}, {d}); got "
                         f"({Hc}, {dc})")
    if min(H, d, nb, bs) < 1:
        raise ValueError(f"{op}: H_kv, d, num_blocks and block_size must be >= 1; got k "
                         f"{_shape(k)}, k_cache {_shape(k_cache)}")
    if H * d > MAX_ROW:
        raise ValueError(f"{op}: H_kv * d must be at most {MAX_ROW} elements per token; got "
                         f"{H} * {d} = {H * d}")
    if T > MAX_TOKENS:
        raise ValueError(f"{op}: at most {MAX_TOKENS} tokens per call; got T = {T}")
    kn, vn = dtype_name(k), dtype_name(v)
    if kn not in _KV_DTYPES or vn != kn:
        raise TypeError(f"{op}: k and v must share one dtype of {', '.join(_KV_DTYPES)}; got "
                        f"{kn} and {vn}")
    fp8 = _FP8[gen]
    cn, cvn = dtype_name(k_cache), dtype_name(v_cache)
    if cn != cvn or cn not in (kn, fp8):
        raise TypeError(f"{op}: k_cache and v_cache must both be {kn} (k's dtype) or {fp8} (FP8 "
                        f"on this target); got {cn} and {cvn}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not is_torch(c) and not isinstance(c, np.ndarray):
            raise TypeError(f"{op}: {name} must be a NumPy array or a torch tensor (written in "
                            f"place); got {type(c).__name__}")
        flags = getattr(c, "flags", None)
        if flags is not None and not flags.writeable:
            raise ValueError(f"{op}: {name} is read-only; the cache is written in place")
        contiguous = c.is_contiguous() if is_torch(c) else bool(flags.c_contiguous)
        if not contiguous:
            raise ValueError(f"{op}: {name} must be C-contiguous (its slots are rows of "
                             f"H_kv * d elements written in place); got a strided view")
    if k_cache is v_cache or (isinstance(k_cache, np.ndarray) and np.shares_memory(k_cache, v_cache)):
        raise ValueError(f"{op}: k_cache and v_cache must be distinct arrays")
    is_fp8 = cn == fp8
    if not is_fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError(f"{op}: k_scale / v_scale apply to FP8 caches only; the cache is {cn}")
    slots = _slots(op, slot_mapping, T, nb * bs)
    qtab = None
    per_head = False
    if is_fp8:
        ik = _inv_scales(op, "k_scale", k_scale, H)
        iv = _inv_scales(op, "v_scale", v_scale, H)
        per_head = bool(np.any(ik != ik[0]) or np.any(iv != iv[0]))
        in_dt = ml_dtypes.bfloat16 if kn == "bfloat16" else np.float16
        bk = [_clamp_bound(op, "k_scale", x, _FP8_MAX[fp8], in_dt, fp8) for x in ik]
        bv = [_clamp_bound(op, "v_scale", x, _FP8_MAX[fp8], in_dt, fp8) for x in iv]
        row = np.concatenate([ik, iv, bk, bv, -np.float32(bk), -np.float32(bv)]).astype(np.float32)
        qtab = np.ascontiguousarray(np.broadcast_to(row[None, :], (P, 6 * H)))
    if T == 0 or not np.any(slots >= 0):
        return k_cache, v_cache                    # nothing to write
    plan = plan_append(T, segments(slots, H * d, 2, is_fp8), _FP8_MAX[fp8] if is_fp8 else 0.0,
                       per_head)
    tab = np.full((P, plan.NT), -1, dtype=np.int32)
    for (t0, U, r, nt, col0) in plan.segs:     # the first slot of each run, run p * nt + j
        first = np.full(P * nt, -1, dtype=np.int64)
        first[:U] = slots[t0:t0 + U * r:r]
        tab[:, col0:col0 + nt] = first.reshape(P, nt)
    launch(kv_cache_append_kernel, k, v, k_cache, v_cache, tab, qtab, plan)
    return k_cache, v_cache


__all__ = ["kv_cache_append", "kv_cache_append_kernel", "AppendPlan", "plan_append", "segments"]
