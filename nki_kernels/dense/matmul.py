"""Tiled matrix multiply: ``C[M, N] = A[M, K] @ B[K, N]`` (bf16, fp16, fp32; fp8 double_row on Trn2+).

The first kernel of the library and the model the others follow: ISA-first NKI, tile choices as
data with the SBUF budget computed in code, one validating Python-facing function.

Matmul naming contract (README): TensorE computes ``dst = stationary.T @ moving`` with the
contraction on the partition axis of both operands; a tile named ``*T`` / ``lhsT`` holds a
transposed operand ([K, M]).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from .._limits import P, sbuf_budget
from .._validate import check_lnc, check_no_grad, check_target
from .._validate import dtype_name as _dtype_name
from .._validate import is_torch as _is_torch
from ..backend import launch, lnc_programs, nisa, nki, nl

TN = 512           # moving free size per matmul (one 2 KiB fp32 PSUM bank)
A_CHUNK = 2048     # A columns loaded per DMA in prefill (4 KiB per partition in bf16)
DECODE_M_MAX = 64  # M <= 64: weight-stationary orientation (see MatmulPlan.decode)
A_RING = 3         # prefill: A row staging buffers (rows run two tiles ahead of the transposes)


@dataclass(frozen=True)
class MatmulPlan:
    """Tile choices for one call (all sizes in elements).

    decode (M <= 64): B tiles take the stationary slot and A^T (M columns) the moving slot, so each
      128x128 weight tile costs the 64-cycle MM floor instead of 512 cycles and TensorE stays well
      under the time the weights take to stream from HBM. B streams in [128, nb] chunks (4 KiB
      DMA rows in bf16) that are used once.
    prefill: a block of nb columns of B stays resident (all of K) and every 128-row tile of A
      passes over it; nb <= 2048 keeps the block's accumulators in 4 PSUM banks.
    double_row: FP8 inputs on gen3+, contraction 256 per instruction.
    """

    M: int
    K: int
    N: int
    decode: bool
    nb: int
    kt: int            # contraction tiles of 128 (even when double_row)
    double_row: bool
    in_bytes: int
    out_bytes: int

    @property
    def sbuf_bytes(self) -> int:
        """Per-partition SBUF the kernel keeps live at its peak.

        Resident blocks are counted twice: the next one is allocated (and its DMA overlaps
        compute) while the current one is still in use, i.e. double buffering."""
        if self.decode:
            aT = self.kt * self.M * self.in_bytes
            a_rows = min(self.K, A_CHUNK) * max(self.in_bytes, 2) * 2
            b_chunks = B_CHUNKS_LIVE * 2 * self.nb * self.in_bytes
            out = 2 * (self.nb * self.out_bytes + (self.nb // P) * self.M * 4)
            return aT + a_rows + b_chunks + out
        b_block = 2 * self.kt * self.nb * self.in_bytes
        aT = 2 * self.kt * P * self.in_bytes           # current and prefetched row tile
        a_rows = 3 * self.K * max(self.in_bytes, 2)    # staged rows run two tiles ahead
        out = 2 * self.nb * self.out_bytes
        return b_block + aT + a_rows + out


B_CHUNKS_LIVE = 3  # decode: B chunks in flight (DMA of the next ones overlaps use of this one)


def plan_matmul(M, K, N, in_bytes, out_bytes, double_row, sbuf_budget) -> MatmulPlan:
    kt = -(-K // P)
    if double_row and kt % 2:
        kt += 1
    decode = M <= DECODE_M_MAX
    # Widest block that fits: 2048 columns give 4 KiB DMA rows in bf16 (97% DMA efficiency),
    # amortise the A transposes over 4 PSUM banks of output, and keep 4 accumulators in PSUM.
    for nb in (2048, 1024, 512, 256, 128):
        nb = min(nb, -(-N // 128) * 128)
        p = MatmulPlan(M, K, N, decode, nb, kt, double_row, in_bytes, out_bytes)
        if p.sbuf_bytes <= sbuf_budget:
            return p
    raise ValueError(f"matmul: K={K} is too large for one resident B block in SBUF "
                     f"({p.sbuf_bytes} bytes per partition needed, {sbuf_budget} available)")


@nki.jit
def matmul_kernel(a, b, out_dtype, nb, decode, double_row):
    """``C = A @ B``.

    Dimensions:
      M >= 1, K >= 1, N >= 1 (any sizes; ragged edge tiles are handled).
    Args:
      a: [M, K] HBM, bf16/fp16/fp32 or fp8 (fp8: float8_e4m3 / e5m2, + e4m3fn on Trn3).
      b: [K, N] HBM, same dtype family as a.
      out_dtype: nl dtype of C (bf16 or fp32).
      nb, decode, double_row: from MatmulPlan (host side).
    Returns:
      c: [M, N] shared HBM.
    Notes:
      fp32 accumulation in PSUM across all of K. FP8 uses perf_mode=double_row (contraction 256).
    Pseudocode:
      for n0 in range(0, N, nb):                       # B block resident in SBUF
        b_sb[k, kt, n] = B[kt*128 + k, n0 + n]
        prefill (M > 64): for m0 in range(0, M, 128):
          aT[k, kt, m] = transpose(A[m0 + m, kt*128 + k])   # TensorE transposes, 4 per PSUM bank
          for n1 in range(0, nb, 512):
            psum[m, n] = sum_kt aT[:, kt, m].T @ b_sb[:, kt, n1:n1+512]
          c[m0:m0+128, n0:n0+nb] = out_sb
        decode (M <= 64): aT once; for n1 in range(0, nb, 128):
          psum[n, m] = sum_kt b_sb[:, kt, n1:n1+128].T @ aT[:, kt, :M]   # weight-stationary
          out_sb[m, n1:n1+128] = transpose(psum)
    """
    M, K = a.shape
    N = b.shape[1]
    KT = -(-K // P)
    step = 2 if double_row else 1
    if double_row and KT % 2:
        KT += 1
    perf = nisa.matmul_perf_mode.double_row if double_row else nisa.matmul_perf_mode.none
    fp8_in = double_row or a.dtype in (nl.float8_e4m3, nl.float8_e5m2, nl.float8_e4m3fn)
    tdt = nl.bfloat16 if fp8_in else a.dtype          # dtype the A transposes run in
    c = nl.ndarray((M, N), dtype=out_dtype, buffer=nl.shared_hbm)
    ident = nl.shared_identity_matrix(P, dtype=tdt)  # [128, 128]

    programs, pid = lnc_programs()

    if decode:
        aT = _load_a_transposed(a, 0, M, KT, tdt, ident, double_row)       # [128, KT, M]
        for i, n0 in enumerate(range(0, N, nb)):
            if i % programs == pid:                     # LNC=2: blocks alternate between cores
                _decode_block(c, aT, b, n0, min(nb, N - n0), M, KT, K, double_row, perf,
                              out_dtype)
        return c

    m_tiles = [m0 for i, m0 in enumerate(range(0, M, P)) if i % programs == pid]
    # A rows stage in a ring of A_RING buffers allocated once, so a tile's row load is ordered
    # after the transposes that last read its buffer: the kernel states its staging depth
    # rather than leaving every row load of the kernel free to start at once (tiles allocated
    # in the loop have no such order, and their loads fill the DMA queues ahead of the next
    # B block)
    ring = itertools.cycle([[nl.ndarray((P, min(A_CHUNK, K - c0)), dtype=a.dtype,
                                        buffer=nl.sbuf)                           # [128, cw]
                             for c0 in range(0, K, A_CHUNK)] for _ in range(A_RING)])
    rows_of = lambda i: _load_a_rows(a, m_tiles[i], min(P, M - m_tiles[i]), tdt,  # noqa: E731
                                     into=next(ring))

    tr_of = lambda i, r: _transpose_rows(r, min(P, M - m_tiles[i]), KT, K, a.dtype, tdt,  # noqa
                                         ident, double_row)
    for n0 in range(0, N, nb):
        nbb = min(nb, N - n0)
        NT = -(-nbb // TN)
        if not m_tiles:
            break
        # A rows of the first two tiles are requested before the B block (their DMAs are not
        # queued behind it); rows run two tiles ahead, transposes one tile ahead of the matmuls
        rows = {0: rows_of(0)}
        if len(m_tiles) > 1:
            rows[1] = rows_of(1)
        aT = tr_of(0, rows.pop(0))                                         # [128, KT, mm]
        b_sb = _load_b_block(b, n0, nbb, KT, K, double_row)                # [128, KT, nbb]
        acc = nl.ndarray((P, NT, TN), dtype=nl.float32, buffer=nl.psum)  # NT banks [128, NT, 512]
        for i, m0 in enumerate(m_tiles):
            mm = min(P, M - m0)
            # prefetch: the next tile's transposes go ahead of this tile's matmuls, so TensorE
            # never waits for their copy back to SBUF
            nxt = tr_of(i + 1, rows.pop(i + 1)) if i + 1 < len(m_tiles) else None
            if i + 2 < len(m_tiles):
                rows[i + 2] = rows_of(i + 2)
            # k-outer over the block's accumulators: the first matmuls need only the first
            # contraction tile of B, so compute follows B's arrival
            for kt in range(0, KT, step):
                kk = P if double_row else min(P, K - kt * P)
                if double_row:
                    stat = aT[:, kt:kt + 2, 0:mm]                        # [128, 2, mm]
                else:
                    stat = aT[0:kk, kt, 0:mm]                            # [kk, mm]
                for j in range(NT):
                    n1 = j * TN
                    nn = min(TN, nbb - n1)
                    if double_row:
                        mov = b_sb[:, kt:kt + 2, n1:n1 + nn]             # [128, 2, nn]
                    else:
                        mov = b_sb[0:kk, kt, n1:n1 + nn]                 # [kk, nn]
                    nisa.nc_matmul(dst=acc[0:mm, j, 0:nn], stationary=stat, moving=mov,
                                   accumulate=(kt > 0), perf_mode=perf)
            out_sb = nl.ndarray((mm, nbb), dtype=out_dtype, buffer=nl.sbuf)  # [mm, nbb]
            for j in range(NT):
                n1 = j * TN
                nn = min(TN, nbb - n1)
                # evict PSUM -> SBUF with the output cast; alternate engines to balance load
                eng = nisa.engine.vector if j % 2 == 0 or nisa.get_nc_version() < 3 \
                    else nisa.engine.scalar
                nisa.tensor_copy(dst=out_sb[:, n1:n1 + nn], src=acc[0:mm, j, 0:nn], engine=eng)
            nisa.dma_copy(dst=c[m0:m0 + mm, n0:n0 + nbb], src=out_sb)
            aT = nxt
    return c


def _load_b_block(b, n0, nbb, KT, K, double_row):
    """B[:, n0:n0+nbb] -> SBUF [128, KT, nbb], contraction index kt*128 + partition."""
    b_sb = nl.ndarray((P, KT, nbb), dtype=b.dtype, buffer=nl.sbuf)
    for kt in range(KT):
        kk = min(P, K - kt * P)
        if kk <= 0:
            nisa.memset(dst=b_sb[:, kt, :], value=0.0)   # double_row padding of the contraction
            continue
        if kk < P and double_row:
            nisa.memset(dst=b_sb[kk:P, kt, :], value=0.0)
        nisa.dma_copy(dst=b_sb[0:kk, kt, :], src=b[kt * P:kt * P + kk, n0:n0 + nbb])
    return b_sb


def _load_a_rows(a, m0, mm, tdt, into=None):
    """DMA rows A[m0:m0+mm, :] into SBUF staging chunks [mm, <=2048] (fp8 converted to bf16);
    ``into``: the chunk buffers to load into (a ring slot, [128, cw] each), else fresh tiles."""
    K = a.shape[1]
    chunks = []
    for j, c0 in enumerate(range(0, K, A_CHUNK)):
        cw = min(A_CHUNK, K - c0)
        if into is None:
            a_sb = nl.ndarray((mm, cw), dtype=a.dtype, buffer=nl.sbuf)    # [mm, cw]
        else:
            a_sb = into[j][0:mm, :]
        nisa.dma_copy(dst=a_sb, src=a[m0:m0 + mm, c0:c0 + cw])
        if tdt != a.dtype:
            a_t = nl.ndarray((mm, cw), dtype=tdt, buffer=nl.sbuf)     # fp8 -> bf16 (exact)
            nisa.tensor_copy(dst=a_t, src=a_sb)
            a_sb = a_t
        chunks.append((c0, cw, a_sb))
    return chunks


def _transpose_rows(chunks, mm, KT, K, dtype, tdt, ident, double_row):
    """Staged A rows -> aT [128, KT, mm] (contraction on partitions) via TensorE transposes."""
    aT = nl.ndarray((P, KT, mm), dtype=dtype, buffer=nl.sbuf)
    if double_row and K < KT * P:
        k_full = K // P
        nisa.memset(dst=aT[:, k_full:KT, :], value=0.0)
    for c0, cw, a_t in chunks:
        # four 128-column blocks per PSUM tile, then one copy back to SBUF
        for g0 in range(0, cw, 4 * P):
            gw = min(4 * P, cw - g0)
            nblk = -(-gw // P)
            tp = nl.ndarray((P, nblk, mm), dtype=tdt, buffer=nl.psum)  # [128, nblk, mm]
            for j in range(nblk):
                kk = min(P, gw - j * P)
                nisa.nc_matmul(dst=tp[0:kk, j, :], stationary=a_t[:, g0 + j * P:g0 + j * P + kk],
                               moving=ident[0:mm, 0:mm], is_transpose=True)
            kt0 = (c0 + g0) // P
            full = gw // P
            if full:
                nisa.tensor_copy(dst=aT[:, kt0:kt0 + full, :], src=tp[:, 0:full, :])
            if full < nblk:
                kk = gw - full * P
                nisa.tensor_copy(dst=aT[0:kk, kt0 + full, :], src=tp[0:kk, full, :])
    return aT


def _load_a_transposed(a, m0, mm, KT, tdt, ident, double_row):
    """Rows A[m0:m0+mm, :] -> aT [128, KT, mm]."""
    return _transpose_rows(_load_a_rows(a, m0, mm, tdt), mm, KT, a.shape[1], a.dtype, tdt, ident,
                           double_row)


def _decode_block(c, aT, b, n0, nbb, M, KT, K, double_row, perf, out_dtype):
    """Weight-stationary: psum[n, m] = sum_k B[k, n].T @ A^T[k, m], then transpose to [m, n].

    B streams through SBUF in [128, nbb] chunks (one per contraction tile, used once); each chunk
    feeds the weight-stationary matmuls of all its 128-column tiles."""
    NT = -(-nbb // P)
    step = 2 if double_row else 1
    acc = nl.ndarray((P, NT, M), dtype=nl.float32, buffer=nl.psum)      # [128 n, NT, M]
    for kt in range(0, KT, step):
        b_t = nl.ndarray((P, step, nbb), dtype=b.dtype, buffer=nl.sbuf)  # [128, step, nbb]
        for r in range(step):
            kk = min(P, K - (kt + r) * P)
            if kk < P:
                nisa.memset(dst=b_t[max(kk, 0):P, r, :], value=0.0)      # contraction padding
            if kk > 0:
                k0 = (kt + r) * P
                nisa.dma_copy(dst=b_t[0:kk, r, :], src=b[k0:k0 + kk, n0:n0 + nbb])
        kk = P if double_row else min(P, K - kt * P)
        for j in range(NT):
            n1 = j * P
            nn = min(P, nbb - n1)
            if double_row:
                stat = b_t[:, :, n1:n1 + nn]                                # [128, 2, nn]
                mov = aT[:, kt:kt + 2, 0:M]                                 # [128, 2, M]
            else:
                stat = b_t[0:kk, 0, n1:n1 + nn]                             # [kk, nn]
                mov = aT[0:kk, kt, 0:M]                                     # [kk, M]
            nisa.nc_matmul(dst=acc[0:nn, j, :], stationary=stat, moving=mov,
                           accumulate=(kt > 0), perf_mode=perf)
    # [n, m] -> [m, n]: one PSUM->SBUF copy, then TensorE transposes four 128-column tiles per bank
    cT = nl.ndarray((P, NT, M), dtype=nl.float32, buffer=nl.sbuf)         # [128 n, NT, M]
    nisa.tensor_copy(dst=cT, src=acc)
    ident_f = nl.shared_identity_matrix(P, dtype=nl.float32)
    out_sb = nl.ndarray((M, nbb), dtype=out_dtype, buffer=nl.sbuf)        # [M, nbb]
    for g in range(0, NT, 4):
        gw = min(4, NT - g)
        tp = nl.ndarray((M, 4, P), dtype=nl.float32, buffer=nl.psum)      # [M, 4, 128]
        for j in range(g, g + gw):
            nn = min(P, nbb - j * P)
            nisa.nc_matmul(dst=tp[:, j - g, 0:nn], stationary=cT[0:nn, j, :],
                           moving=ident_f[0:nn, 0:nn], is_transpose=True)
        w = min(gw * P, nbb - g * P)
        if w == gw * P:
            nisa.tensor_copy(dst=out_sb[:, g * P:g * P + w], src=tp[:, 0:gw, :])
        else:
            for j in range(g, g + gw):
                nn = min(P, nbb - j * P)
                nisa.tensor_copy(dst=out_sb[:, j * P:j * P + nn], src=tp[:, j - g, 0:nn])
    nisa.dma_copy(dst=c[0:M, n0:n0 + nbb], src=out_sb)


# ---------------------------------------------------------------------------------------- op
_FP8 = ("float8_e4m3", "float8_e5m2", "float8_e4m3fn")
_SUPPORTED = ("bfloat16", "float16", "float32") + _FP8
_ITEMSIZE = {"bfloat16": 2, "float32": 4}


def matmul(a, b, *, out_dtype=None, lnc: int = 1):
    """``C = A @ B`` on a NeuronCore.

    Args:
      a: [M, K] array (NumPy or CPU torch): bfloat16, float16, float32, or FP8 (float8_e4m3,
         float8_e5m2; float8_e4m3fn on Trn3). FP8 runs the double_row path (Trn2+).
      b: [K, N] array, same dtype as ``a``.
      out_dtype: "bfloat16" or "float32" (default: bfloat16 for 16-bit and FP8 inputs, float32
         for float32 inputs).
      lnc: 1, or 2 to split the work over the two cores of a logical NeuronCore.
    Returns:
      [M, N] array of ``out_dtype``.
    """
    gen = check_target("matmul")
    check_no_grad("matmul", a, b)
    if getattr(a, "ndim", None) != 2 or getattr(b, "ndim", None) != 2:
        raise ValueError(f"matmul: a and b must be 2-D; got a.shape={getattr(a, 'shape', None)}, "
                         f"b.shape={getattr(b, 'shape', None)}")
    M, K = a.shape
    K2, N = b.shape
    if K != K2:
        raise ValueError(f"matmul: a.shape[1] (K={K}) must equal b.shape[0] (K={K2})")
    if min(M, K, N) < 1:
        raise ValueError(f"matmul: all dimensions must be >= 1; got M={M}, K={K}, N={N}")
    an, bn = _dtype_name(a), _dtype_name(b)
    if an not in _SUPPORTED:
        raise TypeError(f"matmul: a.dtype must be one of {', '.join(_SUPPORTED)}; got {an}")
    if bn != an:
        raise TypeError(f"matmul: b.dtype must equal a.dtype ({an}); got {bn}")
    check_lnc("matmul", lnc)
    double_row = an in _FP8
    if an == "float8_e4m3fn" and gen < 4:
        raise ValueError("matmul: float8_e4m3fn inputs need Trn3; on Trn2 use float8_e4m3")
    if out_dtype is None:
        out_dtype = "float32" if an == "float32" else "bfloat16"
    if out_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"matmul: out_dtype must be 'bfloat16' or 'float32'; got {out_dtype!r}")
    in_bytes = np.dtype(a.dtype).itemsize if not _is_torch(a) else a.element_size()
    out_nl = getattr(nl, out_dtype)
    budget = sbuf_budget()
    plan = plan_matmul(M, K, N, in_bytes, _ITEMSIZE[out_dtype], double_row, budget)
    return launch(matmul_kernel, a, b, out_nl, plan.nb, plan.decode, plan.double_row, lnc=lnc)

