"""Shared tiling for the dense-layer kernels (``qkv_proj``, ``swiglu_mlp``).

Both ops run one loop nest (docs/dense.md):

* token blocks of at most ``TB_MAX`` tokens; per block the activations are loaded row-major
  (tokens on partitions), optionally residual-added and RMS-normalised there (the norm reduces
  along the free dim), then transposed on TensorE into ``xT [128, KT, tb]`` (the contraction on
  partitions) with the norm weight applied per partition while evicting the transposes;
* weight-stationary GEMM passes: a pass holds ``nf`` output-feature tiles of 128 in PSUM
  (``acc [128, nf, Tp]`` fp32, features on partitions, tokens on the free dim) and streams the
  weight rows ``W[k-tile, c0:c0+nf*128]`` from HBM once per token block. The weight tile is the
  stationary operand (128 x 128, LoadStationary in the background) and ``xT`` the moving one, so
  a matmul costs ``max(64, tb)`` cycles: the 64-cycle floor at decode sizes, full rate from 64
  tokens up. Per-output-channel quantities (bias, FP8 weight scales) are per-partition scalars
  of this layout and cost nothing at the PSUM eviction.

Host-side helpers here are plain Python (plans, tile lists); kernel-side helpers take and return
NKI tensors and are called from inside ``@nki.jit`` kernels.
"""
from __future__ import annotations

from .._limits import P
from ..backend import nisa, nl

TB_MAX = 512            # tokens per block: one 2 KiB fp32 PSUM bank per accumulator tile
PSUM_BYTES = 16 * 1024  # per partition (8 banks x 2 KiB)
PSUM_BANK = 2 * 1024
T_GROUP = 8             # transposes evicted together (one bf16 PSUM bank of [128, 8, 128])
SQ_CHUNK = 2048         # columns per ScalarE sum-of-squares instruction (bounds its scratch)


# ------------------------------------------------------------------------------- host side
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def token_blocks(T: int, tb_max: int = TB_MAX):
    """Balanced token blocks ``[(t0, tb)]`` of at most ``tb_max`` tokens."""
    nblk = cdiv(T, tb_max)
    tb = cdiv(T, nblk)
    return [(t0, min(tb, T - t0)) for t0 in range(0, T, tb)]


def feature_tiles(segments):
    """Tiles of at most 128 features that never straddle a segment.

    segments: [(c0, c1, tag)] contiguous column ranges (q / k / v heads, or one range).
    Returns [(c0, width, tag)] in column order.
    """
    tiles = []
    for c0, c1, tag in segments:
        for c in range(c0, c1, P):
            tiles.append((c, min(P, c1 - c), tag))
    return tiles


def group_passes(tiles, nf_max, align=1):
    """Consecutive tiles grouped into the fewest GEMM passes of at most ``nf_max`` tiles, of
    balanced sizes (10 tiles at 8 per pass -> 5 + 5, not 8 + 2: a pass reads its weight rows in
    runs of its width, and a narrow pass would be DMA-bound).

    ``align``: pass boundaries fall on multiples of ``align`` tiles (2 keeps the two halves of
    a 256-wide head in one pass).
    """
    n = len(tiles)
    nf_max = max(align, nf_max - nf_max % align)
    npass = cdiv(n, nf_max)
    size = cdiv(cdiv(n, npass), align) * align
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def acc_free(tb: int) -> int:
    """Free size of one accumulator tile: a power of two >= tb, so that on Trn2 no matmul
    output straddles a 2 KiB PSUM bank."""
    return pow2_at_least(max(1, tb))


def max_tiles_per_pass(tb: int, n_weights: int, budget: int = PSUM_BYTES) -> int:
    """Accumulator tiles of ``n_weights`` weights that fit ``budget`` bytes of PSUM."""
    return max(1, budget // (acc_free(tb) * 4 * n_weights))


def k_tiles_per_dma(ncols: int, itemsize: int, K: int, target_bytes: int = 8192) -> int:
    """Weight k-tiles per DMA so that each transfer moves ~``target_bytes`` per partition."""
    return max(1, min(cdiv(K, P), cdiv(target_bytes, ncols * itemsize)))


# ------------------------------------------------------------------------------- kernel side
def identity(dtype, *dtypes):
    """A [128, 128] identity in SBUF built on GpSimd (iota + compare): no DMA, so it never
    queues in front of the weight stream. With more dtypes, a tuple of identities, one per
    dtype, from one iota."""
    idx = nl.ndarray((P, P), dtype=nl.int32, buffer=nl.sbuf)                  # [128, 128]
    nisa.iota(dst=idx, pattern=[[1, P]], offset=0, channel_multiplier=-1)    # j - p
    outs = []
    for dt in (dtype, *dtypes):
        out = nl.ndarray((P, P), dtype=dt, buffer=nl.sbuf)                    # [128, 128]
        nisa.tensor_scalar(dst=out, data=idx, op0=nl.equal, operand0=0.0)
        outs.append(out)
    return outs[0] if not dtypes else tuple(outs)


def load_col_vector(v, n, dtype=None, v0=0, out=None, col0=0, ident=None):
    """HBM vector ``v[v0:v0+n]`` -> SBUF ``[128, cdiv(n, 128)]`` with ``v[v0 + t*128 + p]`` at
    ``[p, t]`` (into columns ``col0...`` of ``out`` when given).

    Used for per-partition scalars of the transposed layout (norm weight over H, bias / FP8
    scales over output features); the tail of a partial last column is zero.
    Loaded row-major (``[nt, 128]``, 512-byte runs) and transposed on TensorE: a strided DMA
    straight into the column layout would move 4-byte runs, one descriptor per element.
    """
    nt = cdiv(n, P)
    f32 = nl.float32
    if out is None:
        out = nl.ndarray((P, nt), dtype=dtype or f32, buffer=nl.sbuf)     # [128, nt]
    if ident is None:
        ident = identity(f32)
    for c0 in range(0, nt, P):
        cn = min(P, nt - c0)
        rows = nl.ndarray((cn, P), dtype=f32, buffer=nl.sbuf)               # [cn, 128]
        full = min(cn, n // P - c0)
        if full < cn:
            nisa.memset(dst=rows[full:cn, :], value=0.0)
        a = v0 + c0 * P
        if full:
            nisa.dma_copy(dst=rows[0:full, :], src=v[a:a + full * P].reshape((full, P)))
        if full < cn:
            r = n - (c0 + full) * P
            b = a + full * P
            nisa.dma_copy(dst=rows[full:full + 1, 0:r], src=v[b:b + r].reshape((1, r)))
        tp = nl.ndarray((P, cn), dtype=f32, buffer=nl.psum)                 # [128, cn]
        nisa.nc_matmul(dst=tp, stationary=rows, moving=ident[0:cn, 0:cn], is_transpose=True)
        nisa.tensor_copy(dst=out[:, col0 + c0:col0 + c0 + cn], src=tp)
    return out


def load_tile_vector(v, tiles, dtype=None, ident=None):
    """Per-feature vector ``v [N]`` -> SBUF ``[128, len(tiles)]``: column f holds the values of
    feature tile f (``feature_tiles`` order; tiles restart at every segment boundary)."""
    out = nl.ndarray((P, len(tiles)), dtype=dtype or nl.float32, buffer=nl.sbuf)  # [128, nt]
    f = 0
    while f < len(tiles):
        g = f
        while g < len(tiles) and tiles[g][2] == tiles[f][2]:
            g += 1
        c0 = tiles[f][0]
        n = tiles[g - 1][0] + tiles[g - 1][1] - c0
        load_col_vector(v, n, dtype, v0=c0, out=out, col0=f, ident=ident)
        f = g
    return out


def load_row_broadcast(v, L, dtype=None, chunks=1):
    """HBM vector ``v [n]`` -> SBUF ``[L, n]`` with the same row in every partition (in
    ``chunks`` column ranges, one DMA each, so a consumer can start on the first)."""
    n = v.shape[0]
    out = nl.ndarray((L, n), dtype=dtype or v.dtype, buffer=nl.sbuf)     # [L, n]
    row = v.reshape((1, n))
    w = -(-n // chunks)
    for c0 in range(0, n, w):
        c1 = min(n, c0 + w)
        nisa.dma_copy(dst=out[:, c0:c1], src=row[:, c0:c1].broadcast(0, L))
    return out


def x_rows_normalised(x, t0, tb, residual=None, h_out=None, norm=False, eps=1e-6):
    """Stage 1 of a token block (DMA, ScalarE, VectorE): rows ``x[t0:t0+tb]`` -> SBUF.

    Per sub-tile of <= 128 tokens (tokens on partitions): ``h = x + residual`` (written to
    ``h_out``), then ``h * rsqrt(mean(h^2) + eps)`` in bf16 when ``norm`` (in place). The sum
    of squares is one ScalarE pass (activation square, the accumulate register carried across
    column chunks), the scale one VectorE pass. The norm weight is applied later, per
    partition, in ``x_transposed``.
    Returns ``[(s0, ts, tile [ts, H])]``.
    """
    H = x.shape[1]
    subs = []
    for s0 in range(0, tb, P):
        ts = min(P, tb - s0)
        x_sb = _rows_plus_residual(x, t0 + s0, ts, residual, h_out)          # [ts, H]
        if norm:
            rstd = _rstd(x_sb, ts, H, eps)
            nisa.tensor_scalar(dst=x_sb, data=x_sb, op0=nl.multiply, operand0=rstd)
            del rstd
        subs.append((s0, ts, x_sb))
    return subs


def x_rows_stats(x, r0, ts, residual=None, h_out=None, norm=False, eps=1e-6):
    """Rows ``x[r0:r0+ts]`` (+ residual, written to ``h_out``) -> rstd column ``[ts, 1]`` fp32
    (None without norm). The rows themselves are not kept."""
    H = x.shape[1]
    x_sb = _rows_plus_residual(x, r0, ts, residual, h_out)                  # [ts, H]
    if not norm:
        return None
    return _rstd(x_sb, ts, H, eps)


def _rows_plus_residual(x, r0, ts, residual=None, h_out=None):
    """Rows ``x[r0:r0+ts]`` -> SBUF ``[ts, H]``; with a residual, ``x + residual`` (bf16), also
    written to ``h_out`` (the updated residual)."""
    H = x.shape[1]
    x_sb = nl.ndarray((ts, H), dtype=x.dtype, buffer=nl.sbuf)               # [ts, H]
    nisa.dma_copy(dst=x_sb, src=x[r0:r0 + ts, :])
    if residual is not None:
        r_sb = nl.ndarray((ts, H), dtype=residual.dtype, buffer=nl.sbuf)    # [ts, H]
        nisa.dma_copy(dst=r_sb, src=residual[r0:r0 + ts, :])
        nisa.tensor_tensor(dst=x_sb, data1=x_sb, data2=r_sb, op=nl.add)
        del r_sb
        nisa.dma_copy(dst=h_out[r0:r0 + ts, :], src=x_sb)
    return x_sb


def _rstd(x_sb, ts, H, eps):
    """rsqrt(mean(x^2) + eps) per partition: ScalarE square with the accumulate register,
    carried across column chunks (bounded scratch)."""
    ss = nl.ndarray((ts, 1), dtype=nl.float32, buffer=nl.sbuf)              # [ts, 1]
    for c0 in range(0, H, SQ_CHUNK):
        cw = min(SQ_CHUNK, H - c0)
        sq = nl.ndarray((ts, cw), dtype=nl.bfloat16, buffer=nl.sbuf)        # [ts, cw] discarded
        last = c0 + cw >= H
        nisa.activation(dst=sq, op=nl.square, data=x_sb[:, c0:c0 + cw], reduce_op=nl.add,
                        reduce_res=ss if last else None,
                        reduce_cmd=(nisa.reduce_cmd.reset_reduce if c0 == 0
                                    else nisa.reduce_cmd.reduce))
        del sq   # released before the next chunk's scratch
    rstd = nl.ndarray((ts, 1), dtype=nl.float32, buffer=nl.sbuf)            # [ts, 1]
    nisa.activation(dst=rstd, op=nl.rsqrt, data=ss, scale=1.0 / H, bias=float(eps))
    return rstd


def x_transposed(subs, tb, H, gamma_T=None, ident=None, out_dtype=None, pad_even=False,
                 squares=None, out=None):
    """Stage 2 of a token block (TensorE, evictions on VectorE / ScalarE): the sub-tiles of
    ``x_rows_normalised`` -> ``xT [128, KT, tb]`` with ``xT[p, kt, t] = x[t, kt*128 + p]``,
    times ``gamma[kt*128 + p]`` when ``gamma_T [128, KT]`` is given.

    Rows of a partial last k-tile past ``H`` are left unset (the GEMM never reads them), unless
    ``pad_even`` (FP8 double_row): then they are zero and KT is rounded up to even with a zero
    k-tile. ``out_dtype``: dtype of xT (FP8: the sub-tiles already hold FP8-representable
    values in bf16, so the eviction cast is exact). ``squares``: a ``[128, KT, tb]`` bf16 tile
    that receives x^2 (without gamma; rows past H zero) for ``norm_rows``. ``out``: write into
    this ``[128, KTe, tb]`` tile (one allocated outside a hardware loop) instead of a new one.
    """
    KT = cdiv(H, P)
    dt = subs[0][2].dtype
    KTe = KT + (KT % 2 if pad_even else 0)
    xT = out if out is not None else nl.ndarray((P, KTe, tb), dtype=out_dtype or dt,
                                                buffer=nl.sbuf)              # [128, KTe, tb]
    if pad_even and H % P:
        nisa.memset(dst=xT[H % P:P, KT - 1, :], value=0.0)
    if KTe > KT:
        nisa.memset(dst=xT[:, KT:KTe, :], value=0.0)
    if ident is None:
        ident = identity(dt)
    if squares is not None and H % P:
        nisa.memset(dst=squares[H % P:P, KT - 1, :], value=0.0)
    ev = 0
    for s0, ts, xs in subs:
        for g0 in range(0, KT, T_GROUP):
            gn = min(T_GROUP, KT - g0)
            tp = nl.ndarray((P, gn, ts), dtype=dt, buffer=nl.psum)         # [128, gn, ts]
            for j in range(gn):
                kt = g0 + j
                kk = min(P, H - kt * P)
                nisa.nc_matmul(dst=tp[0:kk, j, :], stationary=xs[:, kt * P:kt * P + kk],
                               moving=ident[0:ts, 0:ts], is_transpose=True)
            if squares is not None:
                full = gn if (g0 + gn) * P <= H else gn - 1
                if full:
                    nisa.activation(dst=squares[:, g0:g0 + full, s0:s0 + ts], op=nl.square,
                                    data=tp[:, 0:full, :])
                if full < gn:
                    kk = H - (g0 + full) * P
                    nisa.activation(dst=squares[0:kk, g0 + full:g0 + gn, s0:s0 + ts],
                                    op=nl.square, data=tp[0:kk, full:gn, :])
            full = gn if (g0 + gn) * P <= H else gn - 1          # k-tiles with all 128 rows
            dst = xT[:, g0:g0 + full, s0:s0 + ts]
            if full:
                _evict_scaled(dst, tp[:, 0:full, :], gamma_T, g0, full, ts, ev)
                ev += 1
            if full < gn:
                kk = H - (g0 + full) * P
                _evict_scaled(xT[0:kk, g0 + full:g0 + gn, s0:s0 + ts], tp[0:kk, full:gn, :],
                              None if gamma_T is None else gamma_T[0:kk, :], g0 + full, 1, ts, ev)
                ev += 1
    return xT


def _evict_scaled(dst, src, gamma_T, g0, n, ts, ev):
    """PSUM transposes -> SBUF, times the per-partition gamma column of each k-tile.

    Alternates VectorE (one instruction, gamma broadcast along tokens) and ScalarE (one
    activation per k-tile with the gamma column as its per-partition scale)."""
    if gamma_T is None:
        eng = nisa.engine.vector if ev % 2 == 0 else nisa.engine.scalar
        nisa.tensor_copy(dst=dst, src=src, engine=eng)
        return
    if ev % 2 == 0:
        g = gamma_T[:, g0:g0 + n].expand_dim(2).broadcast(2, ts)           # [p, n, ts]
        nisa.tensor_tensor(dst=dst, data1=src, data2=g, op=nl.multiply)
    else:
        for j in range(n):
            nisa.activation(dst=dst[:, j, :], op=nl.copy, data=src[:, j, :],
                            scale=gamma_T[:, g0 + j:g0 + j + 1])


def pack_factor(T, H):
    """Row chunks per token for small T: the largest power of two r with r*T <= 128 and
    r dividing H/128 (1 = no packing)."""
    KT = H // P if H % P == 0 else 0
    r = 1
    while KT and r * 2 * T <= P and KT % (r * 2) == 0:
        r *= 2
    return r


def x_packed_transposed(x, T, r, residual=None, h_out=None, gamma_T=None, ident=None,
                        squares=None):
    """Decode-size activations ``x [T, H]`` (T * r <= 128) -> ``xT [128, KT, T]`` (times gamma).

    Loaded packed: partition ``c*T + t`` holds columns ``[c*H/r, (c+1)*H/r)`` of token t, so
    the load spreads over all DMA queues instead of T partitions (one queue) that every weight
    transfer would wait behind. A transpose of the 128-column block j of the packed tile gives
    ``[128, r, T]`` = the k-tiles ``c*(H/128r) + j`` for all c. The residual sum (written to
    h_out) works on the packed layout. ``squares`` receives x^2 as in ``x_transposed``."""
    H = x.shape[1]
    KT = H // P
    W = H // r                      # columns per chunk
    J = W // P                      # k-tiles per chunk
    L = r * T
    dt = x.dtype

    def packed(t):                  # HBM [T, H] -> view [(c, t), W]
        return t[0:T, :].reshape_dim(1, (r, W)).permute((1, 0, 2))

    x_sb = nl.ndarray((L, W), dtype=dt, buffer=nl.sbuf)                      # [r*T, W]
    nisa.dma_copy(dst=x_sb, src=packed(x))
    if residual is not None:
        r_sb = nl.ndarray((L, W), dtype=residual.dtype, buffer=nl.sbuf)     # [r*T, W]
        nisa.dma_copy(dst=r_sb, src=packed(residual))
        nisa.tensor_tensor(dst=x_sb, data1=x_sb, data2=r_sb, op=nl.add)
        del r_sb
        nisa.dma_copy(dst=packed(h_out), src=x_sb)
    if ident is None:
        ident = identity(dt)
    xT = nl.ndarray((P, KT, T), dtype=dt, buffer=nl.sbuf)                    # [128, KT, T]
    for j in range(J):
        tp = nl.ndarray((P, r, T), dtype=dt, buffer=nl.psum)                # [128, r, T]
        nisa.nc_matmul(dst=tp, stationary=x_sb[:, j * P:(j + 1) * P], moving=ident[0:L, 0:L],
                       is_transpose=True)
        dst = xT[:, j:j + J * (r - 1) + 1:J, :]                              # k-tiles c*J + j
        if gamma_T is not None:
            g = gamma_T[:, j:j + J * (r - 1) + 1:J].expand_dim(2).broadcast(2, T)
            nisa.tensor_tensor(dst=dst, data1=tp, data2=g, op=nl.multiply)
        else:
            nisa.tensor_copy(dst=dst, src=tp, engine=nisa.engine.scalar)
        if squares is not None:
            nisa.activation(dst=squares[:, j:j + J * (r - 1) + 1:J, 0:T], op=nl.square, data=tp)
    return xT


def norm_rows(squares, H, T, eps):
    """``squares [128, KT, >=T]`` (x^2, transposed) -> ``rsqrt(mean(x^2) + eps)`` as a row tile
    ``[128, T]`` fp32: ``ones[128, 128].T @ squares`` sums over the partitions (the hidden
    dim) and leaves the per-token sum on every partition, i.e. already broadcast along the
    free dim of the feature-major GEMM outputs. Used in decode, where the row-major ScalarE
    pass of ``x_rows_normalised`` (free size H) would sit in front of the first matmul."""
    KT = cdiv(H, P)
    ones = nl.ndarray((P, P), dtype=nl.bfloat16, buffer=nl.sbuf)             # [128, 128]
    nisa.memset(dst=ones, value=1.0)
    ss = nl.ndarray((P, T), dtype=nl.float32, buffer=nl.psum)                 # [128, T]
    for kt in range(KT):
        nisa.nc_matmul(dst=ss, stationary=ones, moving=squares[:, kt, 0:T], accumulate=(kt > 0))
    rrow = nl.ndarray((P, T), dtype=nl.float32, buffer=nl.sbuf)               # [128, T]
    nisa.activation(dst=rrow, op=nl.rsqrt, data=ss, scale=1.0 / H, bias=float(eps))
    return rrow


def k_chunks(KT, kb, step=1):
    """Weight k-tiles per transfer: kb each, the last transfer a single k-tile (pair for
    double_row), so that little GEMM work remains after the final DMA of a pass."""
    out = []
    k0 = 0
    while k0 < KT:
        n = min(kb, KT - k0)
        if k0 + n == KT and n > step and k0 + n - step > k0:
            out.append((k0, n - step))
            out.append((k0 + n - step, step))
        else:
            out.append((k0, n))
        k0 += n
    return out


def transfer_k_tiles(kb, double_row=False):
    """k-tiles per weight transfer of ``gemm_pass`` for a plan's ``kb``: double_row rounds it
    down to whole pairs, at least one."""
    step = 2 if double_row else 1
    return max(step, kb - kb % step)


def prefetch_weights(ws, K, kb, c0, ncols, double_row=False, tiled=False):
    """The first transfer of a pass, issued ahead of everything else (decode: it is the head of
    the weight stream). Pass the result to ``gemm_pass(first=...)``."""
    step = 2 if double_row else 1
    KTe = cdiv(K, P) + (cdiv(K, P) % 2 if double_row else 0)
    kb = transfer_k_tiles(kb, double_row)
    k0, kn = k_chunks(KTe, kb, step)[0]
    if tiled:
        k0, kn = _tile_chunks(KTe, kb, step)[0]
        return [_load_weight_tile(w, c0 // P, k0, kn) for w in ws]
    return [_load_weight_rows(w, K, k0, kn, c0, ncols, double_row) for w in ws]


class WeightRing:
    """Weight transfer buffers that ``gemm_pass(ring=...)`` reuses across passes: ``depth`` slots
    of ``nweights`` tiles ``[128, kn, ncols]`` each (tile-major: ``ncols`` = 128), allocated once.
    A transfer into a slot is then ordered after the matmuls that read the slot ``depth``
    transfers back, where a tile allocated per transfer leaves every weight load of the kernel
    free to start at once, queued ahead of the ones the next matmuls wait for."""

    def __init__(self, nweights, kn, dtype, depth=2, ncols=P):
        self.kn, self.ncols = kn, ncols
        self.slots = [[nl.ndarray((P, kn, ncols), dtype=dtype, buffer=nl.sbuf)  # [128, kn, ncols]
                       for _ in range(nweights)] for _ in range(depth)]
        self.n = 0

    def take(self, nweights, kn, ncols=P):
        """The next slot's first ``nweights`` buffers, as ``[128, kn, ncols]`` views."""
        assert nweights <= len(self.slots[0]) and kn <= self.kn and ncols <= self.ncols, \
            (nweights, kn, ncols)
        slot = self.slots[self.n % len(self.slots)]
        self.n += 1
        return [b[:, 0:kn, 0:ncols] for b in slot[:nweights]]


def gemm_pass(ws, xT, K, T, Tp, widths, c0, kb, double_row=False, first=None, tiled=False,
              mid=None, halfway=None, ring=None):
    """Weight-stationary GEMM pass: for each weight ``w [K, N]`` in ``ws``,
    ``acc[f][0:nn_f, 0:T] = w[:, cols_f].T @ x[0:T, :].T`` accumulated over K in PSUM.

    ``widths``: feature tile widths (each <= 128) of the columns ``[c0, c0 + sum(widths))``.
    ``xT [128, KT, >=T]`` holds the activations transposed (contraction on partitions).
    Weight rows are streamed from HBM ``kb`` k-tiles per DMA (runs of ``sum(widths)`` elements).
    tiled: the weights are in the tile-major layout of :func:`tile_weight` (``[N/128, 128, KTe,
    128]``); each DMA then moves ``kb`` k-tiles of one feature tile, one run of ``kb * 128``
    elements per partition whatever the pass width.
    double_row: FP8 operands, k-tiles paired into a contraction of 256 (``xT`` and the weights
    padded with zeros to an even number of k-tiles).
    first: the list ``prefetch_weights`` returned for this pass; gemm_pass empties it (takes the
    chunks over), so the prefetched chunk is released after its last matmul, not at the end of
    the pass.
    mid: called once the first weight chunk's matmuls are issued (a previous pass's epilogue:
    its TensorE transposes then run while this pass's weights stream in, instead of after them).
    halfway: called once half of the weight chunks' matmuls are issued (TensorE work whose input
    comes late, e.g. the RMSNorm row broadcast behind ScalarE's sum of squares: issued there it
    neither stalls the first matmuls nor lengthens the pass's tail).
    Returns one PSUM tensor ``[128, nf, Tp]`` fp32 per weight.
    """
    nf = len(widths)
    ncols = sum(widths)
    KT = cdiv(K, P)
    step = 2 if double_row else 1
    KTe = KT + (KT % 2 if double_row else 0)
    perf = nisa.matmul_perf_mode.double_row if double_row else nisa.matmul_perf_mode.none
    accs = [nl.ndarray((P, nf, Tp), dtype=nl.float32, buffer=nl.psum) for _ in ws]  # [128, nf, Tp]
    kb = transfer_k_tiles(kb, double_row)
    chunks = k_chunks(KTe, kb, step)
    # (k-chunk, feature tiles it feeds, column offset of the tiles in its SBUF tile)
    if tiled:   # chunk by chunk (the next GEMM may wait for its input chunk by chunk)
        work = [(ch, [f], 0) for ch in _tile_chunks(KTe, kb, step) for f in range(nf)]
    else:
        work = [(ch, list(range(nf)), None) for ch in chunks]
    for wi, ((k0, kn), fs, _) in enumerate(work):
        if wi == 0 and first is not None:
            w_sbs = list(first)
            first.clear()   # the caller's list too: the chunk dies after its last matmul
        elif tiled:
            bufs = ring.take(len(ws), kn) if ring is not None else [None] * len(ws)
            w_sbs = [_load_weight_tile(w, c0 // P + fs[0], k0, kn, into=b)
                     for w, b in zip(ws, bufs)]
        else:
            bufs = ring.take(len(ws), kn, ncols) if ring is not None else [None] * len(ws)
            w_sbs = [_load_weight_rows(w, K, k0, kn, c0, ncols, double_row, into=b)
                     for w, b in zip(ws, bufs)]
        for j in range(0, kn, step):
            kt = k0 + j
            kk = P if double_row else min(P, K - kt * P)
            for w_sb, acc in zip(w_sbs, accs):
                for f in fs:
                    nn = widths[f]
                    off = 0 if tiled else sum(widths[:f])
                    if double_row:
                        stat = w_sb[:, j:j + 2, off:off + nn]                  # [128, 2, nn]
                        mov = xT[:, kt:kt + 2, 0:T]                            # [128, 2, T]
                    else:
                        stat = w_sb[0:kk, j, off:off + nn]                     # [kk, nn]
                        mov = xT[0:kk, kt, 0:T]                                # [kk, T]
                    nisa.nc_matmul(dst=acc[0:nn, f, 0:T], stationary=stat, moving=mov,
                                   accumulate=(kt > 0), perf_mode=perf)
        if mid is not None:
            mid()
            mid = None
        if halfway is not None and wi + 1 >= len(work) // 2:
            halfway()
            halfway = None
    return accs


def transposed_group(yT, ident_f, widths, g0, g1, s0, ts):
    """Feature tiles ``g0..g1`` (at most 4: one fp32 PSUM bank) of ``yT [128, nf, tokens]`` for
    tokens ``s0..s0+ts``, transposed on TensorE into one PSUM tile ``[ts, sum(widths[g0:g1])]``
    (fp32 transpose mode against the identity ``ident_f``): the row-major epilogue's input."""
    gw = sum(widths[g0:g1])
    tp = nl.ndarray((ts, gw), dtype=nl.float32, buffer=nl.psum)           # [ts, gw]
    o = 0
    for f in range(g0, g1):
        nn = widths[f]
        nisa.nc_matmul(dst=tp[:, o:o + nn], stationary=yT[0:nn, f, s0:s0 + ts],
                       moving=ident_f[0:nn, 0:nn], is_transpose=True)
        o += nn
    return tp


def _tile_chunks(KTe, kb, step):
    """Balanced k-chunks of at most ``kb`` k-tiles (tile-major weights: every run is long; the
    last transfer of a pass is one tile's chunk, small anyway)."""
    size = cdiv(KTe // step, cdiv(KTe, kb)) * step
    return [(k0, min(size, KTe - k0)) for k0 in range(0, KTe, size)]


def _load_weight_tile(w, ft, k0, kn, into=None):
    """Tile-major weight ``w[ft, p, k0:k0+kn, :]`` -> SBUF ``[128, kn, 128]``: one contiguous run
    of ``kn * 128`` elements per partition (zero rows past K are part of the layout);
    ``into``: the buffer (a ring slot's view), else a new tile."""
    w_sb = nl.ndarray((P, kn, P), dtype=w.dtype, buffer=nl.sbuf) \
        if into is None else into                                           # [128, kn, 128]
    nisa.dma_copy(dst=w_sb, src=w[ft, :, k0:k0 + kn, :])
    return w_sb


def tile_weight(w):
    """A weight ``w [K, N]`` (K, N multiples of 128; bf16 or FP8; NumPy or CPU torch) in the
    tile-major layout ``swiglu_mlp`` streams at full DMA efficiency: ``[N/128, 128, KTe, 128]``
    with ``out[f, p, kt, c] = w[kt*128 + p, f*128 + c]``, KTe = K/128 rounded up to even (a zero
    k-tile for FP8 double_row). Host-side, once per weight (at model load)."""
    shape = tuple(getattr(w, "shape", ()))
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1 or shape[0] % P or shape[1] % P:
        raise ValueError(f"tile_weight: w must be 2-D [K, N] with K and N positive multiples of "
                         f"128; got shape {list(shape)}")
    K, N = shape
    KT = K // P
    KTe = KT + KT % 2
    if type(w).__module__.startswith("torch"):
        import torch
        u = w.detach().contiguous()
        out = torch.zeros((N // P, P, KTe, P), dtype=u.dtype)
        out[:, :, 0:KT, :] = u.reshape(KT, P, N // P, P).permute(2, 1, 0, 3)
        return out
    import numpy as np
    a = np.asarray(w)
    out = np.zeros((N // P, P, KTe, P), dtype=a.dtype)
    out[:, :, 0:KT, :] = a.reshape(KT, P, N // P, P).transpose(2, 1, 0, 3)
    return out


def _load_weight_rows(w, K, k0, kn, c0, ncols, double_row, into=None):
    """``w[(k0+j)*128 + p, c0:c0+ncols]`` -> SBUF ``[128, kn, ncols]`` (zero rows past K when
    double_row pads the contraction); ``into``: the buffer (a ring slot's view), else a new tile."""
    w_sb = nl.ndarray((P, kn, ncols), dtype=w.dtype, buffer=nl.sbuf) \
        if into is None else into                                           # [128, kn, ncols]
    full = max(0, min(kn, K // P - k0))                                     # complete k-tiles
    if full:
        src = w[k0 * P:(k0 + full) * P, c0:c0 + ncols].reshape_dim(0, (full, P)).permute((1, 0, 2))
        nisa.dma_copy(dst=w_sb[:, 0:full, :], src=src)
    for j in range(full, kn):
        r0 = (k0 + j) * P
        kk = max(0, min(P, K - r0))
        if kk:
            nisa.dma_copy(dst=w_sb[0:kk, j, :], src=w[r0:r0 + kk, c0:c0 + ncols])
        if double_row and kk < P:
            nisa.memset(dst=w_sb[kk:P, j, :], value=0.0)
    return w_sb


# ------------------------------------------------------------------ SBUF of the helpers above
# The plans walk a kernel's buffers on an ``SbufLedger`` (nki_kernels/_limits.py); these are
# the steps of the kernel-side helpers, each next to nothing but the code it mirrors.
def identity_sbuf(led, name, itemsize):
    """``identity``: the int32 iota, then the identity; the iota is released."""
    led.take("iota", 4 * P)
    led.take(name, itemsize * P)
    led.drop("iota")


def col_vector_sbuf(led, name, n):
    """``load_col_vector`` into a new fp32 ``[128, cdiv(n, 128)]``: a row tile per 128 columns,
    one at a time."""
    nt = cdiv(n, P)
    for c0 in range(0, nt, P):
        led.take("col_rows", 4 * P)
        if c0 == 0:
            led.take(name, 4 * nt)
        led.drop("col_rows")


def rows_sbuf(led, prefix, tb, H, residual, norm):
    """``x_rows_normalised``: one [ts, H] bf16 tile per sub-tile of 128 tokens (kept), the
    residual rows and the norm's scratch released as it goes. Returns the kept names."""
    names = []
    for k in range(cdiv(tb, P)):
        names.append((prefix, k))
        led.take(names[-1], 2 * H)
        if residual:
            led.take("r_rows", 2 * H)
            led.drop("r_rows")
        if norm:
            rstd_sbuf(led, H)
            led.drop("rstd")
    return names


def rstd_sbuf(led, H):
    """``_rstd``: ScalarE squares in chunks (scratch), the sum, then "rstd" (left live)."""
    for c0 in range(0, H, SQ_CHUNK):
        led.take("sq", 2 * min(SQ_CHUNK, H - c0))
        if c0 + SQ_CHUNK >= H:
            led.take("ss", 4)
        led.drop("sq")
    led.take("rstd", 4)
    led.drop("ss")


def gemm_pass_loads(nweights, K, widths, kb, itemsize, double_row=False, tiled=False):
    """Bytes per partition of each weight transfer of ``gemm_pass`` (all weights together)."""
    KT = cdiv(K, P)
    step = 2 if double_row else 1
    KTe = KT + (KT % 2 if double_row else 0)
    kb = transfer_k_tiles(kb, double_row)
    if tiled:
        return [nweights * kn * P * itemsize for _, kn in _tile_chunks(KTe, kb, step)
                for _ in widths]
    return [nweights * kn * sum(widths) * itemsize for _, kn in k_chunks(KTe, kb, step)]


def gemm_pass_sbuf(led, nweights, K, widths, kb, itemsize, double_row=False, tiled=False,
                   prefetched=False, mid=None, halfway=None, ring=False):
    """``gemm_pass``: each weight transfer lands while the previous one is still held (double
    buffering); with ``prefetched`` the first one (``prefetch_weights``, name "w") is live;
    ``mid`` runs while the first one is held, ``halfway`` after half of the transfers, as
    ``gemm_pass(mid=..., halfway=...)`` do. ``ring``: the transfers land in a ``WeightRing``
    (the caller's ledger holds it for the whole kernel), so only a prefetched first one is
    taken here."""
    prev = None
    loads = gemm_pass_loads(nweights, K, widths, kb, itemsize, double_row, tiled)
    for ci, nb in enumerate(loads):
        name = "w" if ci == 0 and prefetched else ("w", ci)
        if name != "w" and not ring:
            led.take(name, nb)
        if prev is not None:
            led.drop(prev)
        prev = name if name == "w" or not ring else None
        if mid is not None:
            mid()
            mid = None
        if halfway is not None and ci + 1 >= len(loads) // 2:
            halfway()
            halfway = None
    if prev is not None:
        led.drop(prev)
