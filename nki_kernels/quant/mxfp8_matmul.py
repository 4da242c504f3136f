"""MXFP8 matmul on Trn3: ``C[M, N] = A[M, K] @ B[K, N]`` with ``nisa.nc_matmul_mx`` (4x BF16 rate).

Each operand is either bf16 (MX-quantized inside the kernel with ``nisa.quantize_mx``) or already
quantized as an :class:`MXTensor` in the "MX tile" layout that ``rmsnorm_quant(quant="mx")`` and
:func:`quantize_weights_mx` produce (docs/low-precision.md). For a matrix ``X[K, F]`` whose rows
are the contraction (``X = A.T`` with F = M, or ``X = B`` with F = N), K zero-padded to
``512 * KT``, columns in tiles of 128 (the last may be narrower, width w):

* ``data`` uint32 ``[128, KT * F]``: partition row p holds, tile after tile, the run ``[KT, w]``
  of words packing ``X[512c + 4p + q, f]`` (q = 0..3 = byte q) for chunk c and column f;
* ``scale`` uint8 ``[64, SL * F]`` (``SL = ceil(KT / 4)``): the SBUF quadrant image of the E8M0
  block scales (blocks of 32 consecutive contraction values) without its unused partitions: row
  ``16Q + 4o + i`` = SBUF partition ``32Q + 4o + i``; per tile the run ``[SL, w]``, element
  ``(s, f)`` = block ``16(4s + o) + 4Q + i`` of column f.

A column tile is therefore one contiguous DMA run per partition; in SBUF chunk c is an x4
``[128, w]`` tile (contraction on partitions) and its 16 scale rows sit at partitions
``32*(r//4) + r%4 + 4*(c%4)`` of slot ``c//4`` (docs/low-precision.md; ``nki.isa.nc_matmul_mx``
in the NKI API reference), so four chunks share a slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .._limits import P, sbuf_budget
from .._validate import GEN_NAMES, check_lnc, check_no_grad, check_target
from .._validate import dtype_name as _dtype_name
from .._validate import is_torch as _is_torch
from ..backend import launch, lnc_programs, nisa, nki, nl

CHUNK = 512        # contraction values per chunk (128 partitions x 4 lanes)
TILE = 128         # columns per tile of the MX layout (and per stationary A tile)
TN = 1024          # moving free size per nc_matmul_mx (fp32 PSUM, 2 banks) ...
TN_DECODE = 512    # ... 512 with one A tile (decode): B streams in 512-column groups, each in
                   # two K halves, so TensorE follows the stream and little is left at the end

_FORMATS = {"e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2"}


class MXTensor(NamedTuple):
    """An MXFP8-quantized matrix ``X[K, F]`` in the MX tile layout (module docstring).

    data: uint32 [128, KT * F];  scale: uint8 [64, SL * F];  fmt: "e4m3fn" | "e5m2";
    k: the logical contraction length K (KT = ceil(K / 512); rows past K are zero padding).
    For ``C = A @ B`` pass ``A.T`` (as ``rmsnorm_quant(quant="mx")`` returns it) and ``B``.
    """

    data: np.ndarray
    scale: np.ndarray
    fmt: str
    k: int

    @property
    def kt(self) -> int:
        return -(-int(self.k) // CHUNK)

    @property
    def shape(self):
        """Logical (K, F)."""
        return (int(self.k), int(self.data.shape[1]) // self.kt)


def _fmt(fmt, what="fmt"):
    f = str(fmt)
    f = f[len("float8_"):] if f.startswith("float8_") else f
    if f not in _FORMATS:
        raise ValueError(f"mxfp8_matmul: {what} must be one of {', '.join(_FORMATS)}; got {fmt!r}")
    return f


def _x4_dtype(fmt):
    return nl.float8_e4m3fn_x4 if fmt == "e4m3fn" else nl.float8_e5m2_x4


# ------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class MXPlan:
    """Tile choices. nb: B columns resident per block (a multiple of 128 unless N < 128). The SBUF
    budget counts every live tile at the peak, double-buffered tiles twice."""

    M: int
    K: int
    N: int
    nb: int
    a_bf16: bool
    b_bf16: bool
    out_bytes: int

    @property
    def kt(self) -> int:
        return -(-self.K // CHUNK)

    @property
    def sl(self) -> int:
        return -(-self.kt // 4)

    @property
    def tn(self) -> int:
        return TN_DECODE if self.M <= TILE else TN

    @property
    def sbuf_bytes(self) -> int:
        kt, sl = self.kt, self.sl
        nbp = -(-self.nb // TILE) * TILE
        b_block = kt * nbp * 4 + sl * nbp                             # x4 data + quadrant scales
        b_stage = 2 * 4 * self.nb * 2 if self.b_bf16 else 0          # bf16 rows of one chunk
        a_tile = 2 * (kt * TILE * 4 + sl * TILE)                     # double-buffered
        a_stage = 2 * (self.K * 2 + 4 * TILE * 2) if self.a_bf16 else 0
        out = 2 * self.nb * self.out_bytes
        n_blocks = -(-self.N // self.nb)
        return (2 if n_blocks > 1 else 1) * b_block + b_stage + a_tile + a_stage + out


def plan_mx(M, K, N, a_bf16, b_bf16, out_bytes, programs, budget) -> MXPlan:
    per_core = -(-N // programs)
    for nb in (4096, 2048, 1024, 512, 256, 128):
        nb = max(1, min(nb, -(-per_core // TILE) * TILE, N))
        p = MXPlan(M, K, N, nb, a_bf16, b_bf16, out_bytes)
        if p.sbuf_bytes <= budget:
            return p
    raise ValueError(f"mxfp8_matmul: K={K} is too large for one resident B block in SBUF "
                     f"({p.sbuf_bytes} bytes per partition needed, {budget} available)")


# ------------------------------------------------------------------------------------ kernel
@nki.jit
def mxfp8_matmul_kernel(a, a_scale, b, b_scale, K, a_x4, b_x4, out_dtype, nb, tn_max):
    """``C = deq(A) @ deq(B)`` with MXFP8 operands on TensorE (Trn3).

    Dimensions:
      M >= 1, N >= 1, K >= 128 and a multiple of 128 (chunks of 512; the last may be partial).
    Args:
      a: bf16 [M, K] HBM (a_scale None), or A.T in the MX tile layout: uint32 [128, KT*M] HBM
         with a_scale uint8 [64, SL*M] HBM.
      b: bf16 [K, N] HBM (b_scale None), or uint32 [128, KT*N] with b_scale uint8 [64, SL*N].
      K: logical contraction length; a_x4 / b_x4: nl.float8_e4m3fn_x4 or nl.float8_e5m2_x4
         (format of the packed operand, or the one bf16 operands are quantized to).
      out_dtype: nl.bfloat16 or nl.float32; nb, tn_max: MXPlan.nb, MXPlan.tn.
    Returns:
      c: [M, N] shared HBM.
    Notes:
      fp32 accumulation in PSUM over all of K (one nc_matmul_mx per 512 contraction values).
      SBUF keeps the layout of HBM: B block [128, tiles, KT, 128], the moving operand of one
      matmul is a strided view across tiles. bf16 B: chunk rows 4p..4p+3 land in partition p in
      one DMA run and quantize_mx reads them through a (q, n) -> (n, q) view. bf16 A: 4 TensorE
      transposes per chunk (columns q::4), evicted with the same interleave, then quantize_mx.
      A-stationary throughout (M even: an odd last tile gets a zero column).
    Pseudocode:
      for n0 in range(0, N, nb):                            # B block resident (LNC: split)
        b_q[p, j, c, n], b_s = load or quantize_mx(B[:, n0:n0+nb])
        for m0 in range(0, M, 128):                         # one A tile
          a_q[p, c, m], a_s = load or (transpose + quantize_mx)(A[m0:m0+128, :])
          for n1 in range(0, nb, TN):
            psum[m, n] = sum_c nc_matmul_mx(a_q[:, c, :], b_q[:, n1/128.., c, :], scales)
            out_sb[m, n1:n1+TN] = psum                     # VectorE / ScalarE alternate
          C[m0:m0+128, n0:n0+nb] = out_sb
    """
    a_bf16 = a_scale is None
    b_bf16 = b_scale is None
    KT = -(-K // CHUNK)
    SL = -(-KT // 4)
    M = a.shape[0] if a_bf16 else a.shape[1] // KT
    N = b.shape[1] if b_bf16 else b.shape[1] // KT
    c = nl.ndarray((M, N), dtype=out_dtype, buffer=nl.shared_hbm)
    ident = nl.shared_identity_matrix(P, dtype=nl.bfloat16) if a_bf16 else None   # [128, 128]
    a_q_hbm = None if a_bf16 else a.view(a_x4)      # [128, KT*M] x4
    b_q_hbm = None if b_bf16 else b.view(b_x4)      # [128, KT*N] x4

    programs, pid = lnc_programs()
    n_blocks = -(-N // nb)
    split_n = n_blocks >= programs      # LNC=2: split the B blocks, else the A tiles

    for bi, n0 in enumerate(range(0, N, nb)):
        if split_n and bi % programs != pid:
            continue
        nbb = min(nb, N - n0)
        ntb = -(-nbb // TILE)
        wl = nbb - (ntb - 1) * TILE                                       # last tile's width
        # B data in two tiles split along K (each DMA'd group then has its own destination
        # tile: no false ordering between the two K halves), scales in one
        kh = KT // 2 if (KT >= 4 and not b_bf16) else KT
        b_parts = [nl.ndarray((P, ntb, k1 - k0, TILE), dtype=b_x4, buffer=nl.sbuf)
                   for k0, k1 in ((0, kh), (kh, KT)) if k1 > k0]      # [128, ntb, KT/2, 128]
        b_s = nl.ndarray((P, ntb, SL, TILE), dtype=nl.uint8, buffer=nl.sbuf)
        if wl < TILE:                     # the ragged tile's padding columns feed unused outputs
            for bp in b_parts:
                nisa.memset(dst=bp[:, ntb - 1, :, wl:TILE], value=0)
            nisa.memset(dst=b_s[:, ntb - 1, :, wl:TILE], value=0)
        groups = _groups(nbb, tn_max)
        my_tiles = [ai for ai, m0 in enumerate(range(0, M, TILE))
                    if split_n or ai % programs == pid]
        # the block's first A tile goes ahead of the B loads in the DMA queues (FIFO): with one
        # A tile (decode) TensorE then follows the B groups as they land
        first = _a_tile(a, a_scale, a_q_hbm, a_x4, ident, K, KT, SL, M, my_tiles[0]) \
            if my_tiles else None
        if b_bf16:
            _quantize_b_block(b, b_parts[0], b_s, K, n0, nbb)
        else:
            if len(my_tiles) == 1:      # decode: weights stream, DMA binds, VectorE is idle
                _load_scale_tiles_balanced(b_scale, b_s, KT, n0, nbb, groups)
            else:
                _load_scale_tiles(b_scale, b_s, KT, n0, nbb)   # the block's scales: 4 long DMAs
            for n1, tn in groups:                    # data: per matmul group and K half
                for h, bp in enumerate(b_parts):
                    _load_data_tiles(b_q_hbm, bp[:, n1 // TILE:, :, :], KT, h * kh,
                                     h * kh + bp.shape[2], n0 + n1, tn)
        for ai in my_tiles:
            m0 = ai * TILE
            mt = min(TILE, M - m0)
            a_q, a_s = first if ai == my_tiles[0] else _a_tile(a, a_scale, a_q_hbm, a_x4, ident,
                                                                K, KT, SL, M, ai)
            mtp = a_q.shape[3]
            # output rows at partitions 0..mt-1 would all go out through the DMA queues that
            # also carry the scales; in decode, spread the column slots over the quadrants
            # (an engine access of <= 32 partitions starts at 0/32/64/96, of <= 64 at 0/64: the NKI
            # architecture guide's start-partition rule)
            decode = len(my_tiles) == 1 and len(groups) > 1
            slots = (4 if mt <= 32 else 2 if mt <= 64 else 1) if decode else 1
            out_sb = nl.ndarray((mt if slots == 1 else P, nbb), dtype=out_dtype,
                                buffer=nl.sbuf)                            # [mt or 128, nbb]
            stores = _stores(groups, nbb, slots)
            for j, (n1, tn) in enumerate(groups):
                j0, j1 = n1 // TILE, -(-(n1 + tn) // TILE)                  # B tiles covered
                acc = nl.ndarray((mtp, (j1 - j0) * TILE), dtype=nl.float32, buffer=nl.psum)
                for kt in range(KT):
                    kk = min(P, (K - kt * CHUNK) // 4)                     # x4 rows
                    o = 4 * (kt % 4)
                    nisa.nc_matmul_mx(dst=acc,
                                      stationary=a_q[0:kk, 0, kt, :],                  # [kk, mtp]
                                      moving=b_parts[int(kt >= kh)][0:kk, j0:j1,
                                                                    kt - kh * int(kt >= kh), :],
                                      stationary_scale=a_s[o:P, 0, kt // 4, :],
                                      moving_scale=b_s[o:P, j0:j1, kt // 4, :],
                                      accumulate=(kt > 0))
                base = (P // slots) * stores[j][0]
                eng = nisa.engine.vector if j % 2 == 0 else nisa.engine.scalar
                nisa.tensor_copy(dst=out_sb[base:base + mt, n1:n1 + tn], src=acc[0:mt, 0:tn],
                                 engine=eng)
                if stores[j][1] is not None:
                    c0, c1 = stores[j][1]
                    nisa.dma_copy(dst=c[m0:m0 + mt, n0 + c0:n0 + c1],
                                  src=out_sb[base:base + mt, c0:c1])
    return c


def _stores(groups, nbb, slots):
    """Per group: (output slot, columns [c0, c1) to store once it is evicted, or None).

    One slot: all but the last two (narrow) groups leave before those are computed, the rest at
    the end. Several slots (decode): slot s holds the groups starting in its share of the
    columns and leaves after its last group."""
    if slots == 1:
        cut = max(0, len(groups) - 3)
        n1, tn = groups[cut]
        out = [(0, None)] * len(groups)
        if len(groups) > 1:
            out[cut] = (0, (0, n1 + tn))
        done = n1 + tn if len(groups) > 1 else 0
        if done < nbb:
            out[-1] = (0, (done, nbb))
        return out
    slot = [min(slots - 1, n1 * slots // nbb) for n1, _ in groups]
    out = []
    for j, (n1, tn) in enumerate(groups):
        last = j + 1 == len(groups) or slot[j + 1] != slot[j]
        first = min(g for g, s_ in zip(groups, slot) if s_ == slot[j])[0]
        out.append((slot[j], (first, n1 + tn) if last else None))
    return out


def _groups(nbb, tn_max):
    """(n1, tn) matmul / DMA groups of a B block: tn_max wide, the last one halved repeatedly
    down to one 128-column tile, so that little work remains after the block's last bytes land."""
    g = [(n1, min(tn_max, nbb - n1)) for n1 in range(0, nbb, tn_max)]
    while len(g) > 1 and g[-1][1] >= 2 * TILE:
        n1, tn = g[-1]
        h = (tn // 2 // TILE) * TILE
        g[-1:] = [(n1, h), (n1 + h, tn - h)]
    return g


def _a_tile(a, a_scale, a_q_hbm, a_x4, ident, K, KT, SL, M, ai):
    """A tile ai (tokens 128 ai ..) as the stationary operand: a_q [128, 1, KT, mtp] x4 (A.T) and
    a_s [128, 1, SL, mtp], mtp = the tile's width rounded up to even (zero column)."""
    m0 = ai * TILE
    mt = min(TILE, M - m0)
    mtp = mt + mt % 2
    a_q = nl.ndarray((P, 1, KT, mtp), dtype=a_x4, buffer=nl.sbuf)        # [128, 1, KT, mtp]
    a_s = nl.ndarray((P, 1, SL, mtp), dtype=nl.uint8, buffer=nl.sbuf)    # [128, 1, SL, mtp]
    if mtp != mt:
        nisa.memset(dst=a_q[:, 0, :, mt:mtp], value=0)
        nisa.memset(dst=a_s[:, 0, :, mt:mtp], value=0)
    if a_scale is None:
        _quantize_a_tile(a, a_q, a_s, ident, K, m0, mt)
    elif mtp == mt:
        _load_tiles(a_q_hbm, a_scale, a_q, a_s, KT, m0, mt)
    else:
        # odd width: load contiguously (one DMA run per partition), then widen on VectorE
        st_q = nl.ndarray((P, 1, KT, mt), dtype=a_x4, buffer=nl.sbuf)    # [128, 1, KT, mt]
        st_s = nl.ndarray((P, 1, SL, mt), dtype=nl.uint8, buffer=nl.sbuf)
        _load_tiles(a_q_hbm, a_scale, st_q, st_s, KT, m0, mt)
        nisa.tensor_copy(dst=a_q.view(nl.uint32)[:, 0, :, 0:mt], src=st_q.view(nl.uint32)[:, 0])
        nisa.tensor_copy(dst=a_s[:, 0, :, 0:mt], src=st_s[:, 0])
    return a_q, a_s


def _load_data_tiles(q_hbm, q_sb, KT, k0, k1, f0, fw):
    """Chunks [k0, k1) of columns [f0, f0+fw) (f0 a multiple of 128) of MX-tile-layout data ->
    q_sb [128, nt, k1-k0, 128]: one run of (k1-k0)*512 bytes per tile and partition."""
    full = fw // TILE
    w = fw - full * TILE
    if full:
        src = q_hbm[:, KT * f0:KT * (f0 + full * TILE)].reshape_dim(1, (full, KT, TILE))
        nisa.dma_copy(dst=q_sb[:, 0:full, :, :], src=src[:, :, k0:k1, :])
    if w:
        src = q_hbm[:, KT * (f0 + full * TILE):KT * (f0 + fw)].reshape_dim(1, (KT, w))
        nisa.dma_copy(dst=q_sb[:, full, :, 0:w], src=src[:, k0:k1, :])


def _load_scale_tiles(s_hbm, s_sb, KT, f0, fw):
    """Scale image columns of [f0, f0+fw) -> s_sb [128, nt, SL, 128], image row 16Q + r to SBUF
    partition 32Q + r: one DMA per quadrant (plus one for a ragged last tile)."""
    SL = -(-KT // 4)
    full = fw // TILE
    w = fw - full * TILE
    for Q in range(4):
        rows = s_hbm[16 * Q:16 * Q + 16, :]
        if full:
            nisa.dma_copy(dst=s_sb[32 * Q:32 * Q + 16, 0:full, :, :],
                          src=rows[:, SL * f0:SL * (f0 + full * TILE)])
        if w:
            nisa.dma_copy(dst=s_sb[32 * Q:32 * Q + 16, full, :, 0:w],
                          src=rows[:, SL * (f0 + full * TILE):SL * (f0 + fw)])


def _load_scale_tiles_balanced(s_hbm, s_sb, KT, f0, fw, groups):
    """As :func:`_load_scale_tiles`, with the DMA work spread over all 16 queues.

    Scales must sit at partitions 0..15 of each quadrant, which are served by DMA queues 4Q and
    4Q+1 only (8 partitions per queue); the A tile's scales and the output rows land there too.
    So only the first quarter of the full tiles (the first group's, needed first) is loaded in
    place; the rest goes to partitions 16..31 of a staging tile (queues 4Q+2, 4Q+3) and
    ``nc_stream_shuffle`` (VectorE, within each quadrant) moves it down 16 partitions, one
    shuffle per matmul group so that the early groups do not wait for the late ones.
    """
    SL = -(-KT // 4)
    full = fw // TILE
    direct = max(1, -(-full // 4)) if full > 1 else full
    _load_scale_tiles(s_hbm, s_sb[:, 0:direct], KT, f0, direct * TILE)
    if fw > full * TILE:                                  # ragged last tile: in place
        _load_scale_tiles(s_hbm, s_sb[:, full:full + 1], KT, f0 + full * TILE, fw - full * TILE)
    ns = full - direct
    if ns <= 0:
        return
    stage = nl.ndarray((P, ns, SL, TILE), dtype=nl.uint8, buffer=nl.sbuf)  # [128, ns, SL, 128]
    for Q in range(4):
        nisa.dma_copy(dst=stage[32 * Q + 16:32 * Q + 32, :, :, :],
                      src=s_hbm[16 * Q:16 * Q + 16, SL * (f0 + direct * TILE):SL * (f0 + full * TILE)])
    down = [16 + i for i in range(16)] + [255] * 16       # dst row i <- src row 16 + i
    for n1, tn in groups:
        j0 = max(direct, n1 // TILE)
        j1 = min(full, -(-(n1 + tn) // TILE))
        if j1 > j0:
            nisa.nc_stream_shuffle(dst=s_sb[:, j0:j1, :, :], src=stage[:, j0 - direct:j1 - direct, :, :],
                                   shuffle_mask=down)


def _load_tiles(q_hbm, s_hbm, q_sb, s_sb, KT, f0, fw):
    """Columns [f0, f0+fw) (f0 a multiple of 128) of an MX-tile-layout operand -> SBUF
    q_sb [128, nt, KT, 128] x4 and s_sb [128, nt, SL, 128] (quadrant scale image). Full tiles move
    in one DMA (one contiguous run per partition), a ragged last tile in a second."""
    full = fw // TILE
    w = fw - full * TILE
    if full:
        nisa.dma_copy(dst=q_sb[:, 0:full, :, :],
                      src=q_hbm[:, KT * f0:KT * (f0 + full * TILE)])
    if w:
        nisa.dma_copy(dst=q_sb[:, full, :, 0:w],
                      src=q_hbm[:, KT * (f0 + full * TILE):KT * (f0 + fw)])
    _load_scale_tiles(s_hbm, s_sb, KT, f0, fw)   # image row 16Q + r -> SBUF partition 32Q + r


def _quantize_b_block(b, b_q, b_s, K, n0, nbb):
    """bf16 B[:, n0:n0+nbb] -> b_q [128, nt, KT, 128] x4 + b_s (quantize_mx per chunk; the x4
    result is written through a view that skips from tile to tile)."""
    full = nbb // TILE
    w = nbb - full * TILE
    for kt in range(-(-K // CHUNK)):
        kk = min(P, (K - kt * CHUNK) // 4)
        stage = nl.ndarray((kk, 4, nbb), dtype=b.dtype, buffer=nl.sbuf)     # [kk, 4, nbb]
        rows = b[kt * CHUNK:kt * CHUNK + 4 * kk, n0:n0 + nbb]                 # [4kk, nbb]
        nisa.dma_copy(dst=stage, src=rows.reshape_dim(0, (kk, 4)))
        o, sl = 4 * (kt % 4), kt // 4
        if full:
            nisa.quantize_mx(dst=b_q[0:kk, 0:full, kt, :],                    # [kk, full, 128]
                             src=stage[:, :, 0:full * TILE].permute((0, 2, 1)),  # [kk, n, 4]
                             dst_scale=b_s[o:P, 0:full, sl, :])
        if w:
            nisa.quantize_mx(dst=b_q[0:kk, full, kt, 0:w],
                             src=stage[:, :, full * TILE:nbb].permute((0, 2, 1)),
                             dst_scale=b_s[o:P, full, sl, 0:w])


def _quantize_a_tile(a, a_q, a_s, ident, K, m0, mt):
    """bf16 A[m0:m0+mt, :] -> a_q [128, 1, KT, mtp] x4 (A.T) + a_s, via TensorE transposes.

    A tile of <= 64 rows (decode) is spread over the quadrants (<= 32 rows) or halves: chunks
    [Q*cq, (Q+1)*cq) at partitions Q*128/nq.. (the start-partition rule: an access of <= 32
    partitions starts at 0/32/64/96). Its load
    then uses all the DMA queues it can rather than the first few, and each transpose takes the
    identity block on the same partitions as its input."""
    KT = -(-K // CHUNK)
    nq = min(KT, 4 if mt <= 32 else 2 if mt <= 64 else 1)
    cq = -(-KT // nq)                                  # chunks per quadrant
    a_sb = nl.ndarray((P if nq > 1 else mt, cq * CHUNK), dtype=a.dtype, buffer=nl.sbuf)
    for Q in range(nq):                            # [128Q/nq + m, k] = A[m0 + m, Q*cq*512 + k]
        k0, k1 = Q * cq * CHUNK, min(K, (Q + 1) * cq * CHUNK)
        if k1 > k0:
            nisa.dma_copy(dst=a_sb[P // nq * Q:P // nq * Q + mt, 0:k1 - k0],
                          src=a[m0:m0 + mt, k0:k1])
    for kt in range(KT):
        kk = min(P, (K - kt * CHUNK) // 4)
        Q, c0 = kt // cq, (kt % cq) * CHUNK
        p0 = P // nq * Q
        tp = nl.ndarray((kk, 4, mt), dtype=a.dtype, buffer=nl.psum)            # [kk, 4, mt]
        for q in range(4):
            nisa.nc_matmul(dst=tp[:, q, :],
                           stationary=a_sb[p0:p0 + mt, c0 + q:c0 + 4 * kk:4],   # [mt, kk]
                           moving=ident[p0:p0 + mt, p0:p0 + mt], is_transpose=True)
        aT = nl.ndarray((kk, mt, 4), dtype=a.dtype, buffer=nl.sbuf)           # [kk, mt, 4]
        eng = nisa.engine.scalar if kt % 2 else nisa.engine.vector
        nisa.tensor_copy(dst=aT.permute((0, 2, 1)), src=tp, engine=eng)
        nisa.quantize_mx(dst=a_q[0:kk, 0, kt, 0:mt], src=aT,
                         dst_scale=a_s[4 * (kt % 4):P, 0, kt // 4, 0:mt])


# ---------------------------------------------------------------------------------------- op
_EMAX = {"e4m3fn": 8, "e5m2": 15}


def _host(x):
    """A NumPy view of a host array (CPU torch integer/float tensors via .numpy())."""
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _need_trn3(op):
    """The op's target check (up front): Trn3 only, with the FP8 alternative named."""
    try:
        check_target(op, ("trn3",))
    except ValueError:
        gen = int(nisa.get_nc_version())
        raise ValueError(f"{op}: MXFP8 (nc_matmul_mx / quantize_mx) needs Trn3 (NeuronCore-v4); "
                         f"the target is {GEN_NAMES.get(gen, f'gen{gen}')}; supported targets: "
                         f"trn3. On Trn2 use matmul() with float8_e4m3 or float8_e5m2 inputs "
                         f"(FP8 double_row)") from None


def _operand(x, name, fmt, transposed):
    """Validate one operand: returns (kernel argument, scale or None, K, F, fmt)."""
    if isinstance(x, MXTensor):
        f = _fmt(x.fmt, f"{name}.fmt")
        data, scale = _host(x.data), _host(x.scale)
        K = int(x.k)
        if K < 1:
            raise ValueError(f"mxfp8_matmul: {name}.k must be >= 1; got {K}")
        KT = -(-K // CHUNK)
        SL = -(-KT // 4)
        if (data.ndim != 2 or data.shape[0] != P or np.dtype(data.dtype) != np.uint32
                or data.shape[1] % KT):
            raise ValueError(f"mxfp8_matmul: {name}.data must be uint32 [128, KT*F] (MX tile "
                             f"layout, KT = ceil(k/512) = {KT}); got {data.dtype} {data.shape}")
        F = data.shape[1] // KT
        if scale.shape != (64, SL * F) or np.dtype(scale.dtype) != np.uint8:
            raise ValueError(f"mxfp8_matmul: {name}.scale must be uint8 [64, SL*F] = "
                             f"[64, {SL * F}] for {name}.data {data.shape} and k={K}; got "
                             f"{scale.dtype} {scale.shape}")
        # hand the caller's arrays to the launcher (torch stays torch: the result then does too)
        args = tuple(t.contiguous() if _is_torch(t) else np.ascontiguousarray(t)
                     for t in (x.data, x.scale))
        return args[0], args[1], K, F, f
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"mxfp8_matmul: {name} must be a 2-D bfloat16 array or an MXTensor; got "
                         f"{type(x).__name__} of shape {getattr(x, 'shape', None)}")
    if _dtype_name(x) != "bfloat16":
        raise TypeError(f"mxfp8_matmul: {name} must be bfloat16 (quantized in the kernel) or an "
                        f"MXTensor (pre-quantized); got {_dtype_name(x)}")
    K, F = (x.shape[1], x.shape[0]) if transposed else tuple(x.shape)
    return x, None, int(K), int(F), _fmt(fmt)


def mxfp8_matmul(a, b, *, out_dtype="bfloat16", fmt="e4m3fn", lnc: int = 1):
    """``C = A @ B`` with MXFP8 operands on a Trn3 NeuronCore (``nc_matmul_mx``).

    Args:
      a: ``[M, K]`` bfloat16 array (NumPy or CPU torch; MX-quantized in the kernel), or an
         :class:`MXTensor` holding ``A.T`` in the K-major layout (``rmsnorm_quant(quant="mx")``).
      b: ``[K, N]`` bfloat16 array, or an :class:`MXTensor` of ``B`` (:func:`quantize_weights_mx`).
      out_dtype: "bfloat16" (default) or "float32".
      fmt: MX element format bf16 operands are quantized to: "e4m3fn" (default) or "e5m2"
         (an MXTensor carries its own).
      lnc: 1, or 2 to split the work over the two cores of a logical NeuronCore.
    Returns:
      ``[M, N]`` array of ``out_dtype`` (fp32 accumulation).
    Raises on Trn2 (no MX TensorE mode) with a message naming Trn3.
    """
    _need_trn3("mxfp8_matmul")
    check_no_grad("mxfp8_matmul", a, b)
    fmt = _fmt(fmt)
    a_arr, a_s, Ka, M, a_fmt = _operand(a, "a", fmt, transposed=True)
    b_arr, b_s, Kb, N, b_fmt = _operand(b, "b", fmt, transposed=False)
    if Ka != Kb:
        raise ValueError(f"mxfp8_matmul: the contraction lengths differ: a has K={Ka}, b has "
                         f"K={Kb}")
    K = Ka
    if min(M, N, K) < 1:
        raise ValueError(f"mxfp8_matmul: all dimensions must be >= 1; got M={M}, K={K}, N={N}")
    if K % 128:
        raise ValueError(f"mxfp8_matmul: K must be a multiple of 128 (the contraction is tiled in "
                         f"x4 groups of 8 partitions); got K={K}")
    if out_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"mxfp8_matmul: out_dtype must be 'bfloat16' or 'float32'; got "
                         f"{out_dtype!r}")
    check_lnc("mxfp8_matmul", lnc)
    budget = sbuf_budget()
    plan = plan_mx(M, K, N, a_s is None, b_s is None, 2 if out_dtype == "bfloat16" else 4, lnc,
                   budget)
    return launch(mxfp8_matmul_kernel, a_arr, a_s, b_arr, b_s, K, _x4_dtype(a_fmt),
                  _x4_dtype(b_fmt), getattr(nl, out_dtype), plan.nb, plan.tn, lnc=lnc)


def quantize_weights_mx(w, fmt="e4m3fn") -> MXTensor:
    """Offline MXFP8 quantization of a weight ``w[K, N]`` into the layout ``mxfp8_matmul`` streams.

    Host-side NumPy (no device): each block of 32 consecutive K values of a column shares one
    E8M0 scale chosen by the hardware ``quantize_mx`` rule (``2**(floor(log2 amax) - (Emax - 1))``,
    Emax 8 for e4m3fn, 15 for e5m2; all-zero block -> 2**-127; a block with NaN/inf -> 0xFF and
    NaN data), values rounded to nearest even; K is zero-padded to a multiple of 512. Gives the
    same bytes as quantizing ``w`` inside the kernel.

    Args:
      w: ``[K, N]`` float array (bf16, fp16 or fp32; NumPy or CPU torch), K a multiple of 128.
      fmt: "e4m3fn" (default) or "e5m2".
    Returns:
      MXTensor(data uint32 [128, KT*N], scale uint8 [64, SL*N], fmt, K) with KT = ceil(K/512),
      SL = ceil(KT/4), in the MX tile layout.
    """
    import ml_dtypes
    fmt = _fmt(fmt, "fmt")
    if _is_torch(w):
        w = w.detach().float().cpu().numpy()
    arr = np.asarray(w)
    if arr.ndim != 2:
        raise ValueError(f"quantize_weights_mx: w must be 2-D [K, N]; got shape {arr.shape}")
    if _dtype_name(arr) not in ("bfloat16", "float16", "float32", "float64"):
        raise TypeError(f"quantize_weights_mx: w must be a float array (bf16, fp16, fp32); got "
                        f"{arr.dtype}")
    K, N = arr.shape
    if K < 1 or N < 1 or K % 128:
        raise ValueError(f"quantize_weights_mx: K must be a positive multiple of 128 and N >= 1; "
                         f"got w.shape={arr.shape}")
    KT = -(-K // CHUNK)
    x = np.zeros((KT * CHUNK, N), np.float32)
    x[:K] = arr.astype(np.float32)
    g = x.reshape(KT * 16, 32, N)                                    # [block, 32, N]
    bad = ~np.isfinite(g).all(axis=1)                               # [block, N]
    with np.errstate(invalid="ignore"):
        amax = np.where(bad, np.float32(1), np.abs(g).max(axis=1)).astype(np.float32)
    bits = amax.view(np.uint32) >> 23                               # biased fp32 exponent
    lg = np.where(bits > 0, bits.astype(np.int64) - 127,           # floor(log2) for normals
                  np.frexp(amax)[1].astype(np.int64) - 1)           # ... and subnormals
    e = np.clip(np.where(amax == 0, -127, lg - (_EMAX[fmt] - 1)), -127, 127)
    scale = np.where(bad, 255, e + 127).astype(np.uint8)
    v = np.ldexp(g, -e[:, None, :].astype(np.int32))                # exact power-of-2 scaling
    elem = ml_dtypes.float8_e4m3fn if fmt == "e4m3fn" else ml_dtypes.float8_e5m2
    byts = np.where(bad[:, None, :], np.float32(np.nan), v).astype(np.float32).astype(elem)
    byts = byts.view(np.uint8).reshape(KT, P, 4, N)                 # [c, p, q, n]
    words = np.zeros((P, KT, N), np.uint32)
    for q in range(4):
        words |= byts[:, :, q, :].transpose(1, 0, 2).astype(np.uint32) << np.uint32(8 * q)
    # MX tile layout: per 128-column tile, [KT, w] words per partition; scales as the SBUF
    # quadrant image (image row 16Q + 4o + i <- block 16(4s + o) + 4Q + i)
    SL = -(-KT // 4)
    img = np.zeros((4, 4, 4, SL, N), np.uint8)                      # [Q, o, i, s, n]
    sc = scale.reshape(KT, 4, 4, N)                                  # [c, Q, i, n]
    for c_ in range(KT):
        img[:, c_ % 4, :, c_ // 4, :] = sc[c_]
    img = img.reshape(64, SL, N)
    data = np.empty((P, KT * N), np.uint32)
    simg = np.empty((64, SL * N), np.uint8)
    for f0 in range(0, N, TILE):
        w = min(TILE, N - f0)
        data[:, KT * f0:KT * (f0 + w)] = words[:, :, f0:f0 + w].reshape(P, KT * w)
        simg[:, SL * f0:SL * (f0 + w)] = img[:, :, f0:f0 + w].reshape(64, SL * w)
    return MXTensor(data, simg, fmt, K)


__all__ = ["MXTensor", "mxfp8_matmul", "quantize_weights_mx", "mxfp8_matmul_kernel", "MXPlan",
           "plan_mx"]
