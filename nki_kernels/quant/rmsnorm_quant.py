"""RMSNorm + quantize: ``y = x / sqrt(mean(x^2) + eps) * gamma``, then FP8 per token or MXFP8.

The entry of the low-precision path: FP8 data for Trn2's double_row matmul (``float8_e4m3`` /
``float8_e5m2``; Trn3 also ``float8_e4m3fn``) with one fp32 scale per token, or MXFP8 (Trn3)
in the MX tile layout ``mxfp8_matmul`` consumes. Optional fused residual add (``x + residual``,
returned as the updated residual). The exact rounding steps are in ``reference/rmsnorm_quant.py``
and docs/low-precision.md.

Every full pass over a 128 x H tile costs about as much engine time as the tile's HBM traffic,
so the passes are spread over the engines (each keeps about one):
  FP8, T >= 8, bf16 gamma, no residual ("transposed"): x.T by DMA transpose; TensorE h * gamma
    and the sum of squares (Gram diagonal); ScalarE (+ VectorE 1 in 5) evicts g with an abs-max;
    VectorE (Trn2: GpSimd) scales and casts.
  FP8 otherwise ("rows"): ScalarE sum of squares; GpSimd g = h * gamma; VectorE abs-max;
    VectorE (Trn2: GpSimd) scales and casts. A residual is added by the DMA engines (dma_compute).
    A lone tile (dynamic scaling) runs in 1024-column chunks so loads, passes and stores
    overlap, its scale-and-cast pass split over ScalarE, VectorE and (Trn2) GpSimd.
  MX (Trn3): ScalarE sum of squares; GpSimd y1 = h * rstd; TensorE transposes; VectorE evicts
    times gamma (ScalarE 1 in 8) and runs quantize_mx. A lone tile spreads these over the
    engines a next tile would have kept busy.
"""
from __future__ import annotations

from dataclasses import dataclass

from .._limits import P, sbuf_budget
from .._validate import check_eps, check_lnc, check_no_grad, check_target
from .._validate import dtype_name as _dtype_name
from ..backend import launch, lnc_programs, nisa, nki, nl
from ..dense._tiles import identity
from .mxfp8_matmul import CHUNK, MXTensor

AMAX_FLOOR = 2.0 ** -100      # rows with max|g| below this are scaled as if it were this
FP8_MAX = {"float8_e4m3": 240.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
DT_BLOCKS = 16                # 128-column blocks per DMA transpose: 4 KiB SBUF rows per partition
FIRST_DT_BLOCKS = 4           # the first tile's first DMA transpose: TensorE starts sooner
G_BLOCKS = 8                  # 128-column blocks of g per PSUM tile (2 banks; x2 buffers + Gram)
GRAM_COLS = 64                # tokens per diagonal Gram block (one PE column tile each)
ACT_EVICT_EVERY = 8           # MX: ScalarE evicts one 512-column chunk in 8, VectorE the others
LONE_ACT_EVERY = 2            # MX, a lone tile (ScalarE idle after the sum of squares): ScalarE
LONE_Y1_ACT_EVERY = 4         # evicts one chunk in 2 and makes y1 = h * rstd for one chunk in 4
                              # (GpSimd the others). Modeled, 128 x 7168 (us): 18.9 (8 / none),
                              # 18.2 (2 / none), 17.7 (2 / 4); 3 / 3: 19.2, 4 / 4: 18.9
DVE_EVICT_EVERY = 5           # FP8 transposed, Trn3: VectorE evicts one g chunk in 5, ScalarE the
                              # others. With the Gram's diagonal blocks only (GRAM_COLS), modeled
                              # Llama-3-8B / 70B T=2048, Gemma-3-27B T=512, 70B T=32768 (us):
                              # every 3: 69.9 / 114.9 / 28.2 / 1671; 4: 70.8 / 115.9 / 26.9 /
                              # 1672; 5: 67.4 / 113.1 / 27.6 / 1650; 6: 67.4 / 113.0 / 28.5 / 1650
FP32_MIN = -3.4028234663852886e38
TRANSPOSED_MIN_T = 8          # tokens from which FP8 (bf16 gamma, no residual) takes the transposed
                              # layout. Modeled, rows -> transposed, T = 8 / 128 (us): H = 7168
                              # Trn3 15.4 -> 13.1 / 13.7, Trn2 19.9 -> 17.5 / 17.6; H = 4096 Trn3
                              # 11.1 -> 10.0 / 10.6, Trn2 14.1 -> 12.0 / 13.2. Below 8 rows the
                              # rows layout's loads shrink with T: T = 1, H = 7168, Trn2 15.3 vs
                              # 16.4 (T = 2..6 depends on H and the target; T = 7 transposed wins)
ROW_CHUNK = 1024              # columns per chunk when one 128-row tile is all there is (pass 1)
Q_CHUNK = 2048                # columns per quantize-and-store chunk (pass 2): 2 KiB fp8 rows


# ------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class RMSQuantPlan:
    """Layout and buffering of one call (sizes: bytes per partition of SBUF).

    transposed (FP8, no residual, bf16 gamma, T >= 8): x arrives as x.T blocks
      [128 h, 16, tokens] by DMA transpose, so TensorE computes h * gamma (against diag(gamma))
      and the sum of squares (Gram diagonal) and the engines keep one pass each. Per tile: x.T
      (2H), g (2H), q (H); diag(gamma) blocks (2H) once.
    rows (otherwise): tokens on partitions. Per tile h (2H), g (2H), q (H); gamma broadcast to
      the partitions in use (2H or 4H). A residual is added by the DMA engines into h.
    MX: rows layout; per tile h (2H), y1 (2H), the x4 output [128, H/512, 128] (H bytes) and its
      scales.
    double: fresh tiles per iteration (double buffering) if the budget allows, else one reused set.
    """

    T: int
    H: int
    quant: str
    residual: bool
    gamma_bytes: int
    transposed: bool = False
    double: bool = True

    @property
    def sbuf_bytes(self) -> int:
        H = self.H
        res = 0                       # the residual is added by the DMA engines into h
        bufs = 2 if self.double else 1
        scales = 4 * (-(-self.T // P)) + 8 * P
        if self.quant == "fp8":
            # one tile of <= 128 rows runs in column chunks: two [128, ROW_CHUNK] bf16 scratch
            # tiles and the per-chunk partial sums and maxima
            chunked = 0
            if not self.transposed and self.T <= P:
                chunked = 4 * ROW_CHUNK + 8 * (-(-H // ROW_CHUNK))
            return bufs * (5 * H + res) + self.gamma_bytes * H + scales + chunked
        kt = H // CHUNK
        out = kt * P * 4 + (-(-kt // 4)) * P
        return bufs * (4 * H + res + out + 8 * P) + 16 * kt + 2 * P


def plan_rmsnorm_quant(T, H, quant, residual, gamma_bytes, budget) -> RMSQuantPlan:
    # transposed from TRANSPOSED_MIN_T tokens, a lone tile too: from 8 rows on, the rows layout's
    # loads (x and the gamma broadcast, as many bytes again) keep each DMA queue's 8 partitions
    # full whatever T, while x.T moves 16-token blocks and needs no gamma broadcast; its one-off
    # diag(gamma) build is H/128 VectorE ops of 64 cycles
    transposed = quant == "fp8" and not residual and gamma_bytes == 2 and T >= TRANSPOSED_MIN_T
    for double in (True, False):
        p = RMSQuantPlan(T, H, quant, residual, gamma_bytes, transposed, double)
        if p.sbuf_bytes <= budget:
            return p
    raise ValueError(f"rmsnorm_quant: H={H} needs {p.sbuf_bytes} bytes per partition of SBUF even "
                     f"single-buffered; {budget} are available")


# ------------------------------------------------------------------------------- shared parts
def _load_rows(h_sb, x, residual, res_hbm, t0, tt, c0=0, c1=None):
    """h_sb [tt, c0:c1] = x rows [t0, t0+tt), columns [c0, c1) (default all); with a residual,
    h = bf16(x + residual) is formed by the DMA engines on the way in (dma_compute, fp32 add: no
    engine pass) and stored back as the updated residual."""
    c1 = x.shape[1] if c1 is None else c1
    rows, cols = slice(t0, t0 + tt), slice(c0, c1)
    if residual is None:
        nisa.dma_copy(dst=h_sb[:, cols], src=x[rows, cols])
        return
    nisa.dma_compute(dst=h_sb[:, cols], srcs=[x[rows, cols], residual[rows, cols]],
                     reduce_op=nl.add)
    nisa.dma_copy(dst=res_hbm[rows, cols], src=h_sb[:, cols])


def _col_chunks(H, size):
    """``[(c0, c1)]`` column ranges of at most ``size`` covering [0, H)."""
    return [(c0, min(H, c0 + size)) for c0 in range(0, H, size)]


def _load_sum_squares_chunked(h_sb, sq_sb, x, residual, res_hbm, t0, tt):
    """A lone tile's load and sum of squares in ROW_CHUNK-column chunks, so ScalarE and VectorE
    (idle until the back half) sum alternate chunks as they land (per-chunk fp32 partial sums,
    added on VectorE; modeled, MX 128 x 7168: 20.6 -> 18.9 us); squares land in ``sq_sb``.
    Returns ss [tt, 1] fp32."""
    bounds = _col_chunks(h_sb.shape[1], ROW_CHUNK)
    parts = nl.ndarray((tt, len(bounds)), dtype=nl.float32, buffer=nl.sbuf)
    for j, (c0, c1) in enumerate(bounds):
        _load_rows(h_sb, x, residual, res_hbm, t0, tt, c0, c1)
        if j % 2:
            nisa.tensor_scalar_reduce(dst=sq_sb[:, c0:c1], data=h_sb[:, c0:c1], op0=nl.square,
                                      operand0=None, reduce_op=nl.add,
                                      reduce_res=parts[:, j:j + 1])
        else:
            nisa.activation(dst=sq_sb[:, c0:c1], op=nl.square, data=h_sb[:, c0:c1],
                            reduce_op=nl.add, reduce_res=parts[:, j:j + 1],
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)
    ss = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=ss, data=parts, op=nl.add, axis=1)
    return ss


def _sum_squares_act(h_sb, sq_sb):
    """[tt, 1] fp32 sum of h^2 along the free dim on ScalarE (squares land in ``sq_sb``)."""
    ss = nl.ndarray((h_sb.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sq_sb, op=nl.square, data=h_sb, reduce_op=nl.add, reduce_res=ss,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    return ss


def _row_consts(H, eps):
    """(1/H, eps) as [128, 1] fp32 tiles, so the per-row scalars can run on GpSimd."""
    inv_h = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=inv_h, value=1.0 / H)
    eps_t = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=eps_t, value=float(eps))
    return inv_h, eps_t


def _rstd(ss, consts):
    """(rstd, z) [tt, 1] fp32 on GpSimd (off the busy VectorE stream, no ScalarE table switch):
    z = ss - ss (0, or NaN when the row held inf/NaN), v = ss * (1/H) + eps,
    rstd = rsqrt(v) + z."""
    tt = ss.shape[0]
    inv_h, eps_t = consts
    pool = nisa.engine.gpsimd
    z = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=z, data1=ss, data2=ss, op=nl.subtract, engine=pool)
    v = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=v, data1=ss, data2=inv_h[0:tt, :], op=nl.multiply, engine=pool)
    nisa.tensor_tensor(dst=v, data1=v, data2=eps_t[0:tt, :], op=nl.add, engine=pool)
    rstd = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd, data=v, op0=nl.rsqrt, operand0=None, op1=nl.add, operand1=z,
                       engine=pool)
    return rstd, z


# ------------------------------------------------------------------------------- FP8 kernel
@nki.jit
def rmsnorm_quant_fp8_kernel(x, gamma, residual, eps, fp8_dtype, fp8_max, static_scale,
                             transposed, double):
    """FP8 per-token RMSNorm quantization: ``q = fp8(g * k)``, ``g = bf16(h * gamma)``,
    ``k = fp8_max / max|g|`` (dynamic) or ``rstd / static_scale`` (static, saturating).

    Dimensions:
      T >= 1 tokens; H a multiple of 128 (SBUF permitting, up to 32768).
    Args:
      x: [T, H] bf16 HBM; gamma: [H] bf16 or fp32 HBM; residual: [T, H] bf16 HBM or None.
      eps: float; fp8_dtype: nl.float8_e4m3 | nl.float8_e4m3fn | nl.float8_e5m2 (fp8_max its
      largest finite value); static_scale: float or None (dynamic per-token scaling);
      transposed, double: RMSQuantPlan.
    Returns:
      q [T, H] fp8, scale [T, 1] fp32 (dequant = q * scale) and, with a residual, the updated
      residual [T, H] bf16 (all shared HBM).
    Notes:
      Dynamic scaling makes the data independent of rstd: scale = max(m, 2^-100)/fp8_max * rstd.
      A row holding inf/NaN (or whose sum of squares overflows) comes out all NaN. Scales of all
      tiles stay in SBUF and are written at the end through a TensorE transpose (512 B rows).
      Engines (transposed layout): TensorE h*gamma and Gram; Trn3 ScalarE evicts with an abs-max
      accumulator (activate2) and VectorE scales and casts; Trn2 ScalarE evicts, VectorE takes
      the abs-max, GpSimd scales and casts.
    Pseudocode:
      dg[:, b, :] = diag(gamma[128b : 128b+128])              # bf16, once
      for t0 in range(0, T, 128):                             # LNC=2: alternate tiles
        xT[h, b, t] = x[t0 + t, 128b + h]                     # DMA transpose, 16 blocks per DMA
        for b: gram += xT[:, b].T @ xT[:, b];  g_ps[:, b] = xT[:, b].T @ dg[:, b]   # TensorE
        g = bf16(g_ps), m = max|g| (ScalarE [+ VectorE]);  ss = diag(gram)
        rstd = rsqrt(ss/H + eps);  k = fp8_max / max(m, 2^-100);  s_all[:, i] = ...
        q = fp8(g * k);  q_hbm[t0:t0+128] = q
      scale_hbm = transpose(s_all)                            # TensorE, 128 scales per row
    """
    T, H = x.shape
    q_hbm = nl.ndarray((T, H), dtype=fp8_dtype, buffer=nl.shared_hbm)
    s_hbm = nl.ndarray((T, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    res_hbm = None
    if residual is not None:
        res_hbm = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    gen = nisa.get_nc_version()
    programs, pid = lnc_programs()
    NT = -(-T // P)
    mine = [i for i in range(NT) if i % programs == pid]
    s_all = nl.ndarray((P, max(1, len(mine))), dtype=nl.float32, buffer=nl.sbuf)  # [128, NTl]
    consts = _row_consts(H, eps)

    lone = not transposed and len(mine) == 1 and static_scale is None  # column chunks (below)
    if transposed:
        dg = None                 # built by the first tile, its gamma load ahead of the x.T ones
        # built on-chip (bf16 for diag(gamma), uint8 for the Gram's diagonal predicate): loaded
        # by DMA (nl.shared_identity_matrix) they took 2 of the 3 transfers a DMA ring holds per
        # queue ahead of the first x.T transposes (modeled: TensorE started at 4.2 us, 1.7 with
        # the rest of the start-up, on Trn3's Gemma-3-27B T = 512)
        ident, sel = identity(nl.bfloat16, nl.uint8)                # [128, 128] bf16, uint8
    else:
        GP = min(P, T)                                    # partitions the tiles will use
        gam_sb = nl.ndarray((GP, H), dtype=gamma.dtype, buffer=nl.sbuf)           # [GP, H]
        if not lone:
            nisa.dma_copy(dst=gam_sb, src=gamma.reshape((1, H)).broadcast(0, GP))
    if not double and not lone:
        a_one = nl.ndarray((P, H), dtype=x.dtype, buffer=nl.sbuf)     # h, or x.T as [128, NB, P]
        g_one = nl.ndarray((P, H), dtype=nl.bfloat16, buffer=nl.sbuf)
        q_one = nl.ndarray((P, H), dtype=fp8_dtype, buffer=nl.sbuf)

    for li, i in enumerate(mine):
        t0 = i * P
        tt = min(P, T - t0)
        if lone:
            _rows_tile_chunked(x, gamma, residual, res_hbm, q_hbm, gam_sb, t0, tt, consts,
                               s_all[0:tt, 0:1], fp8_dtype, fp8_max, gen)
            continue
        if double:
            g_sb = nl.ndarray((tt, H), dtype=nl.bfloat16, buffer=nl.sbuf)         # [tt, H]
            q_sb = nl.ndarray((tt, H), dtype=fp8_dtype, buffer=nl.sbuf)           # [tt, H]
        else:
            g_sb, q_sb = g_one[0:tt, :], q_one[0:tt, :]
        m = None
        if transposed:
            if double:
                xT = nl.ndarray((P, H // P, tt), dtype=x.dtype, buffer=nl.sbuf)   # [128, NB, tt]
            else:
                xT = a_one.reshape((P, H // P, P))[:, :, 0:tt]
            ss, m, dg = _gamma_and_gram(x, xT, dg, (ident, sel), g_sb, t0, tt, gen, gamma,
                                        first=li == 0)
        else:
            if double:
                h_sb = nl.ndarray((tt, H), dtype=x.dtype, buffer=nl.sbuf)         # [tt, H]
            else:
                h_sb = a_one[0:tt, :]
            _load_rows(h_sb, x, residual, res_hbm, t0, tt)
            nisa.tensor_tensor(dst=g_sb, data1=h_sb, data2=gam_sb[0:tt, :], op=nl.multiply,
                               engine=nisa.engine.gpsimd)
            ss = _sum_squares_act(h_sb, q_sb)
        rstd, z = _rstd(ss, consts)
        # the last tile has nothing after it to overlap: its scale-and-cast pass is split over
        # the engines and stored chunk by chunk
        _quantize_rows(g_sb, q_sb, m, rstd, z, s_all[0:tt, li:li + 1], fp8_max, static_scale,
                       gen, q_hbm[t0:t0 + tt, :], chunked=li == len(mine) - 1)

    _store_row_scales(s_hbm, s_all, mine, T, programs)
    if residual is not None:
        return q_hbm, s_hbm, res_hbm
    return q_hbm, s_hbm


def _rows_tile_chunked(x, gamma, residual, res_hbm, q_hbm, gam_sb, t0, tt, consts, s_col,
                       fp8_dtype, fp8_max, gen):
    """One tile of ``tt`` <= 128 rows (dynamic scaling) in column chunks, so loads, passes and
    stores overlap instead of running one after the other over the whole row.

    Pass 1, per chunk as it lands: x (and gamma, broadcast to the partitions) by DMA; GpSimd
    g = bf16(h * gamma); ScalarE sum of h^2 and VectorE max|g| into per-chunk columns. Then the
    row scalars (ss, m: one small reduce each; rstd, k, scale). Pass 2, per chunk:
    q = fp8(g * k) spread over ScalarE (activation copy with a per-row scale), GpSimd and VectorE
    in proportion to their speed, and stored as it is made. The data q is the whole-row path's
    (a maximum is exact in any order); ss adds per-chunk fp32 partial sums of the same squares,
    a different order than one running sum (the same value on rows whose sums are exact).
    """
    H = x.shape[1]
    bounds = _col_chunks(H, ROW_CHUNK)
    nc = len(bounds)
    h_sb = nl.ndarray((tt, H), dtype=x.dtype, buffer=nl.sbuf)                   # [tt, H]
    g_sb = nl.ndarray((tt, H), dtype=nl.bfloat16, buffer=nl.sbuf)              # [tt, H]
    q_sb = nl.ndarray((tt, H), dtype=fp8_dtype, buffer=nl.sbuf)                # [tt, H]
    sq = nl.ndarray((tt, ROW_CHUNK), dtype=nl.bfloat16, buffer=nl.sbuf)       # ScalarE scratch
    ab = nl.ndarray((tt, ROW_CHUNK), dtype=nl.bfloat16, buffer=nl.sbuf)       # VectorE scratch
    ss_parts = nl.ndarray((tt, nc), dtype=nl.float32, buffer=nl.sbuf)
    m_parts = nl.ndarray((tt, nc), dtype=nl.float32, buffer=nl.sbuf)
    g_row = gamma.reshape((1, H))
    # no residual: gamma by hardware DGE, on its own DMA ring (x and gamma on one ring left the
    # queues idle between chunks: a ring holds 3 transfers a queue; modeled, T = 7, H = 7168,
    # Trn3: 16.1 -> 14.6 us); with one, the two rings sharing the queues delay the first chunk
    g_kw = {} if residual is not None else dict(dge_mode=nisa.dge_mode.hwdge,
                                                engine=nisa.engine.sync)
    for j, (c0, c1) in enumerate(bounds):
        w = c1 - c0
        nisa.dma_copy(dst=gam_sb[0:tt, c0:c1], src=g_row[:, c0:c1].broadcast(0, tt), **g_kw)
        _load_rows(h_sb, x, residual, res_hbm, t0, tt, c0, c1)
        nisa.tensor_tensor(dst=g_sb[:, c0:c1], data1=h_sb[:, c0:c1], data2=gam_sb[0:tt, c0:c1],
                           op=nl.multiply, engine=nisa.engine.gpsimd)
        nisa.activation(dst=sq[:, 0:w], op=nl.square, data=h_sb[:, c0:c1], reduce_op=nl.add,
                        reduce_res=ss_parts[:, j:j + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.tensor_scalar_reduce(dst=ab[:, 0:w], data=g_sb[:, c0:c1], op0=nl.abs, operand0=0.0,
                                  reduce_op=nl.maximum, reduce_res=m_parts[:, j:j + 1])
    ss = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=ss, data=ss_parts, op=nl.add, axis=1)
    m = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=m, data=m_parts, op=nl.maximum, axis=1)
    rstd, z = _rstd(ss, consts)
    _quantize_rows(g_sb, q_sb, m, rstd, z, s_col, fp8_max, None, gen, q_hbm[t0:t0 + tt, :],
                   chunked=True, scale_first=True)


def _quantize_store_chunks(g_sb, q_sb, k, q_dst, gen):
    """q = fp8(g * k) in Q_CHUNK-column store chunks, each split over the engines by rate
    (_pass2_split) and stored into ``q_dst`` as soon as it is made."""
    for c0, c1 in _col_chunks(g_sb.shape[1], Q_CHUNK):
        for eng, a0, a1 in _pass2_split(c0, c1, gen):
            if eng == "scalar":
                nisa.activation(dst=q_sb[:, a0:a1], op=nl.copy, data=g_sb[:, a0:a1], scale=k)
            elif eng == "gpsimd":
                nisa.tensor_tensor(dst=q_sb[:, a0:a1], data1=g_sb[:, a0:a1],
                                   data2=k.broadcast(1, a1 - a0), op=nl.multiply,
                                   engine=nisa.engine.gpsimd)
            else:
                nisa.tensor_scalar(dst=q_sb[:, a0:a1], data=g_sb[:, a0:a1], op0=nl.multiply,
                                   operand0=k)
        nisa.dma_copy(dst=q_dst[:, c0:c1], src=q_sb[:, c0:c1])


# elements per ns of a q = fp8(g * k) pass, as the cost model prices them (docs/cost-model.md): Trn2
# ScalarE and GpSimd ~1.2, VectorE ~0.95 (no fast mode with an fp8 output); Trn3 VectorE ~4.9
# (fp8 is a fast-mode type), ScalarE ~1.15 (its 2x bf16 rate needs a bf16 output), and GpSimd is
# left out: its SBUF accesses share a bus with VectorE's fast mode
_PASS2_RATE = {3: (("scalar", 1.2), ("gpsimd", 1.2), ("vector", 0.95)),
               4: (("vector", 4.9), ("scalar", 1.15))}


def _pass2_split(c0, c1, gen):
    """``(engine, a0, a1)`` column ranges of [c0, c1) in proportion to the engines' rates (whole
    multiples of 32 columns, the rest to the last engine)."""
    rates = _PASS2_RATE[4 if gen >= 4 else 3]
    total = sum(r for _, r in rates)
    out, a0 = [], c0
    for n, (eng, r) in enumerate(rates):
        a1 = c1 if n == len(rates) - 1 else min(c1, a0 + int((c1 - c0) * r / total) // 32 * 32)
        if a1 > a0:
            out.append((eng, a0, a1))
        a0 = a1
    return out


def _gamma_diag(gamma, NB, ident):
    """dg [128, NB, 128] bf16 with dg[:, b, :] = diag(gamma[128b : 128b + 128]): gamma's columns
    [128, NB] by one DMA transpose (a few 16-element blocks per queue, issued before the x.T
    ones: no DMA of gamma rows and an identity, no TensorE transpose), then VectorE scales the
    identity per block in block order (64 cycles a block in 4x mode: ahead of TensorE, which
    the 128 cycles a block on GpSimd held back through the first tile, modeled)."""
    gTb = nl.ndarray((P, NB), dtype=gamma.dtype, buffer=nl.sbuf)                 # [128, NB]
    nisa.dma_transpose(dst=gTb, src=gamma.reshape((NB, P)))
    gT = nl.ndarray((P, NB), dtype=nl.float32, buffer=nl.sbuf)                   # [128, NB]
    nisa.tensor_copy(dst=gT, src=gTb)
    dg = nl.ndarray((P, NB, P), dtype=nl.bfloat16, buffer=nl.sbuf)               # [128, NB, 128]
    for b in range(NB):
        nisa.tensor_scalar(dst=dg[:, b, :], data=ident, op0=nl.multiply, operand0=gT[:, b:b + 1])
    return dg


def _gamma_and_gram(x, xT, dg, idents, g_sb, t0, tt, gen, gamma, first=False):
    """Transposed layout, one tile: x.T blocks by DMA transpose; TensorE g = x * gamma and the
    Gram matrix; the g chunks are evicted to bf16 with a running abs-max. Trn3: ScalarE evicts
    with its abs-max accumulator (activate2) and VectorE takes one chunk in DVE_EVICT_EVERY (copy,
    then abs-max from the floor); Trn2: ScalarE evicts, and VectorE takes each chunk's abs-max as
    it is evicted in the first tile, while later tiles leave it to the caller (m None).
    ``first`` (the kernel's first tile, nothing to overlap its load with): the first DMA
    transpose moves FIRST_DT_BLOCKS blocks, so TensorE starts sooner; ``dg`` None: built here
    (from ``gamma``), its small DMA transpose issued ahead of the tile's x.T ones.
    Returns (ss, m, dg) with m = max|g| (possibly signed, or floored) or None."""
    H = x.shape[1]
    NB = H // P
    cuts = list(range(0, NB, DT_BLOCKS))
    if first and NB > FIRST_DT_BLOCKS:
        cuts = sorted(set([0, FIRST_DT_BLOCKS] + cuts[1:]))
    if dg is None:
        dg = _gamma_diag(gamma, NB, idents[0])                          # [128, NB, 128]
    for b0, b1 in zip(cuts, cuts[1:] + [NB]):
        nb = b1 - b0
        src = x[t0:t0 + tt, b0 * P:(b0 + nb) * P].reshape_dim(1, (nb, P))      # [tt, nb, 128]
        nisa.dma_transpose(dst=xT[:, b0:b0 + nb, :], src=src)                  # [128, nb, tt]
    # Trn3: the Gram matrix's diagonal blocks only, tokens [64 i, 64 i + 64) against themselves
    # in PE column tile i (the two matmuls run side by side: half the PE time of the full
    # [tt, tt], where TensorE binds); Trn2, where it does not, keeps one matmul (modeled: the
    # split cost its rows 0.5-0.8%)
    gc = GRAM_COLS if gen >= 4 else P
    halves = [(c0, min(tt, c0 + gc)) for c0 in range(0, tt, gc)]
    gram = nl.ndarray((tt, gc), dtype=nl.float32, buffer=nl.psum)             # [tt, gc]
    chunks = list(range(0, NB, G_BLOCKS))
    on_dve = [c0 for i, c0 in enumerate(chunks)
              if gen >= 4 and len(chunks) > 1 and i % DVE_EVICT_EVERY == DVE_EVICT_EVERY - 1]
    on_act = [c0 for c0 in chunks if c0 not in on_dve]
    m_act = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf) if gen >= 4 else None
    m_dve = [nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf) for _ in on_dve]
    # Trn2, first tile: VectorE's abs-max chunk by chunk as ScalarE evicts (the pipeline fills
    # sooner), as |g| (bf16 in and out: 4x mode) then a max into bf16 (exact: the max of bf16
    # values; bf16 in and out: N/2 cycles), 3/4 of a tensor_scalar_reduce (N); later tiles take
    # it in one pass (fewer instructions on the busiest engine, and no 4x-mode |g| pass waiting
    # for GpSimd's scale-and-cast on their shared SBUF bus: modeled, Gemma-3-27B T = 512 36.9 ->
    # 43.6 us with it)
    per_chunk = gen < 4 and first
    m_parts = None
    if per_chunk:
        m_parts = nl.ndarray((tt, len(chunks)), dtype=nl.bfloat16, buffer=nl.sbuf)
    for c0 in chunks:
        gb = min(G_BLOCKS, NB - c0)
        g_ps = nl.ndarray((tt, gb * P), dtype=nl.float32, buffer=nl.psum)      # [tt, gb*128]
        for b in range(c0, c0 + gb):
            for h0, h1 in halves:
                kw = dict(tile_position=(0, h0), tile_size=(P, gc)) if gc < P else {}
                nisa.nc_matmul(dst=gram[h0:h1, 0:h1 - h0], stationary=xT[:, b, h0:h1],
                               moving=xT[:, b, h0:h1], accumulate=b > 0, **kw)
            nisa.nc_matmul(dst=g_ps[:, (b - c0) * P:(b - c0 + 1) * P], stationary=xT[:, b, :],
                           moving=dg[:, b, :], accumulate=False)
        cols = g_sb[:, c0 * P:(c0 + gb) * P]
        if gen < 4:
            nisa.activation(dst=cols, op=nl.copy, data=g_ps)
            if per_chunk:
                i = chunks.index(c0)
                junk = nl.ndarray((tt, gb * P), dtype=nl.bfloat16, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=junk, data=cols, op0=nl.abs, operand0=0.0)
                nisa.tensor_reduce(dst=m_parts[:, i:i + 1], op=nl.maximum, data=junk, axis=1)
        elif c0 in on_dve:
            nisa.tensor_copy(dst=cols, src=g_ps, engine=nisa.engine.vector)
            junk = nl.ndarray((tt, gb * P), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.tensor_scalar_reduce(dst=junk, data=cols, op0=nl.abs, operand0=0.0,
                                      reduce_op=nl.maximum, reduce_res=m_dve[on_dve.index(c0)],
                                      reduce_cmd=nisa.reduce_cmd.load_reduce,
                                      reduce_init=AMAX_FLOOR)
        else:
            first, last = c0 == on_act[0], c0 == on_act[-1]
            cmd = nisa.reduce_cmd.reset_reduce if first else nisa.reduce_cmd.reduce
            nisa.activate2(dst=cols, op=nl.copy, data=g_ps, imm0=0.0, imm1=0.0, op0=None,
                           op1=None, reduce_op=nl.abs_max, reduce_cmd=cmd,
                           reduce_res=m_act if last else None)
    sel = idents[1]
    junk = nl.ndarray((tt, gc), dtype=nl.float32, buffer=nl.sbuf)
    ss = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
    for h0, h1 in halves:            # the diagonal: column p - h0 of row p
        nisa.select_reduce(dst=junk[h0:h1, 0:h1 - h0], predicate=sel[h0:h1, h0:h1],
                           on_true=gram[h0:h1, 0:h1 - h0], on_false=FP32_MIN,
                           reduce_res=ss[h0:h1, :], reduce_cmd=nisa.reduce_cmd.reset_reduce,
                           reduce_op=nl.maximum)
    m = m_act
    if per_chunk:
        m = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=m, data=m_parts, op=nl.maximum, axis=1)
    for md in m_dve:                   # |m_act| combined with the floored VectorE maxima
        mm = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=mm, data=m, op0=nl.abs, operand0=0.0, op1=nl.maximum,
                           operand1=md)
        m = mm
    return ss, m, dg


def _quantize_rows(g_sb, q_sb, m, rstd, z, s_col, fp8_max, static_scale, gen, q_dst,
                   chunked=False, scale_first=False):
    """q_sb = fp8(g * k) with the per-row k, stored into ``q_dst``, and the row scales into
    ``s_col``. ``chunked`` (dynamic scaling): the pass is split over the engines and stored in
    column chunks (_quantize_store_chunks), for a tile with nothing after it to overlap.

    Dynamic: m = max|g| (given, possibly signed, or a VectorE abs-max pass here),
    mc = bf16(max(|m|, 2^-100)), k = (1/mc) * fp8_max + z, scale = mc * (1/fp8_max) * rstd.
    Static: k = rstd * (1/static_scale), q = fp8(clamp(g * k)). The pass over g runs on VectorE
    on Trn3 (fp8 is a fast-mode type there) and on GpSimd on Trn2."""
    tt, H = g_sb.shape[0], g_sb.shape[1]
    k = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
    if static_scale is None:
        if m is None:
            m = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar_reduce(dst=q_sb, data=g_sb, op0=nl.abs, operand0=0.0,
                                      reduce_op=nl.maximum, reduce_res=m)
        # bf16 mc: rounding is monotonic, so bf16(max|g|) = max|bf16(g)| whether the abs-max
        # accumulator saw g before or after its cast to bf16 (spec silent on which).
        mc = _row_k(m, z, k, fp8_max)
        if scale_first:
            _scale_col(mc, rstd, s_col, fp8_max)
        if chunked:
            _quantize_store_chunks(g_sb, q_sb, k, q_dst, gen)
        elif gen >= 4:
            nisa.tensor_scalar(dst=q_sb, data=g_sb, op0=nl.multiply, operand0=k)
        else:
            nisa.tensor_tensor(dst=q_sb, data1=g_sb, data2=k.broadcast(1, H), op=nl.multiply,
                               engine=nisa.engine.gpsimd)
        # the scale after the pass: VectorE's in-order stream does not wait there for rstd
        # (GpSimd), which k does not need (modeled: 0.4 us a tile on Trn3)
        if not scale_first:
            _scale_col(mc, rstd, s_col, fp8_max)
        if chunked:
            return
    else:
        nisa.tensor_scalar(dst=k, data=rstd, op0=nl.multiply, operand0=1.0 / static_scale)
        nisa.memset(dst=s_col, value=float(static_scale))
        t32 = nl.ndarray((tt, H), dtype=nl.float32, buffer=nl.sbuf)              # [tt, H]
        nisa.tensor_scalar(dst=t32, data=g_sb, op0=nl.multiply, operand0=k, op1=nl.minimum,
                           operand1=fp8_max)
        nisa.tensor_scalar(dst=q_sb, data=t32, op0=nl.maximum, operand0=-fp8_max)
    nisa.dma_copy(dst=q_dst, src=q_sb)


def _row_k(m, z, k, fp8_max):
    """Dynamic per-row factors from m = max|g| (possibly signed): mc = bf16(max(|m|, 2^-100)),
    k = (1/mc) * fp8_max + z. Returns mc (the caller forms scale = mc * (1/fp8_max) * rstd)."""
    tt = m.shape[0]
    mc = nl.ndarray((tt, 1), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=mc, data=m, op0=nl.abs, operand0=0.0, op1=nl.maximum,
                       operand1=AMAX_FLOOR)
    r = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=r, data=mc)
    nisa.tensor_scalar(dst=k, data=r, op0=nl.multiply, operand0=fp8_max, op1=nl.add,
                       operand1=z)
    return mc


def _scale_col(mc, rstd, s_col, fp8_max):
    """The row scales: s_col = mc * (1/fp8_max) * rstd."""
    nisa.tensor_scalar(dst=s_col, data=mc, op0=nl.multiply, operand0=1.0 / fp8_max,
                       op1=nl.multiply, operand1=rstd)


def _store_row_scales(s_hbm, s_all, mine, T, programs):
    """s_all[p, li] (scale of token mine[li]*128 + p) -> s_hbm [T, 1] through TensorE transposes:
    one 512 B row per tile, not one 4-byte descriptor per token (those cost 0.57 us a queue on
    Trn2, modeled); a ragged tile of fewer than 8 rows (one DMA queue's) directly. Stored by
    hardware DGE: its own DMA ring, not behind the last tile's stores for a transfer slot."""
    full = [li for li, i in enumerate(mine) if (i + 1) * P <= T]
    n_full = T // P
    rows = s_hbm[0:n_full * P, :].reshape((n_full, P)) if n_full else None       # [NT, 128]
    hw = dict(dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.sync)
    for c0 in range(0, len(full), P):
        nc = min(P, len(full) - c0)
        tp = nl.ndarray((nc, P), dtype=nl.float32, buffer=nl.psum)                 # [nc, 128]
        nisa.nc_transpose(dst=tp, data=s_all[:, c0:c0 + nc], engine=nisa.engine.tensor)
        sT = nl.ndarray((nc, P), dtype=nl.float32, buffer=nl.sbuf)                 # [nc, 128]
        nisa.tensor_copy(dst=sT, src=tp)
        i0 = mine[full[c0]]
        nisa.dma_copy(dst=rows[i0:i0 + programs * (nc - 1) + 1:programs, :], src=sT, **hw)
    for li in range(len(mine)):
        if li in full:
            continue
        t0 = mine[li] * P
        tt = min(P, T - t0)
        if tt < 8:            # a few rows, all on one DMA queue: stored as they are
            nisa.dma_copy(dst=s_hbm[t0:t0 + tt, :], src=s_all[0:tt, li:li + 1], **hw)
            continue
        tp = nl.ndarray((1, tt), dtype=nl.float32, buffer=nl.psum)                 # [1, tt]
        nisa.nc_transpose(dst=tp, data=s_all[0:tt, li:li + 1], engine=nisa.engine.tensor)
        sT = nl.ndarray((1, tt), dtype=nl.float32, buffer=nl.sbuf)                 # [1, tt]
        nisa.tensor_copy(dst=sT, src=tp)
        nisa.dma_copy(dst=s_hbm[t0:t0 + tt, :].reshape((1, tt)), src=sT, **hw)


# ------------------------------------------------------------------------------- MX kernel
@nki.jit
def rmsnorm_quant_mx_kernel(x, gamma, residual, eps, mx_x4, double):
    """MXFP8 RMSNorm quantization (Trn3): ``y = bf16(bf16(h * rstd) * gamma)``, MX blocks of 32
    consecutive H values per token, in the MX tile layout ``mxfp8_matmul`` reads for A.T.

    Dimensions:
      T >= 1 tokens; H a multiple of 512 (SBUF permitting, up to 32768).
    Args:
      x: [T, H] bf16 HBM; gamma: [H] bf16 or fp32 HBM; residual: [T, H] bf16 HBM or None.
      eps: float; mx_x4: nl.float8_e4m3fn_x4 | nl.float8_e5m2_x4; double: RMSQuantPlan.double.
    Returns:
      data uint32 [128, (H/512) T], scale uint8 [64, ceil(H/2048) T] (and the updated residual),
      shared HBM; one 128-token tile = one contiguous run per partition in both.
    Notes:
      The hardware quantize_mx scale rule (2x the OCP MX sample algorithm; docs/low-precision.md).
      TensorE transposes are bit-exact, so a NaN/inf stays in its own token (whose outputs are all
      NaN).
      Engines: ScalarE sum of squares (+ one chunk in 8 of the evictions), GpSimd y1, TensorE
      transposes, VectorE evictions times gamma and quantize_mx; DMA the residual add.
    Pseudocode:
      gT[p, q, c] = gamma[512c + 4p + q]                      # 4 TensorE transposes, once
      for t0 in range(0, T, 128):                             # LNC=2: alternate tiles; skewed
        h = x[t0:t0+128] (+ residual);  ss = sum(h^2) (ScalarE)
        rstd = rsqrt(ss/H + eps);  y1 = bf16(h * rstd)        # GpSimd, per 512 columns
        for c in range(H/512):
          tp[p, q, t] = y1[t, 512c + 4p + q]                  # 4 transposes (columns q::4)
          yT[p, t, q] = bf16(tp[p, q, t] * gT[p, q, c])        # VectorE (ScalarE 1 in 8)
          q_sb[:, c, t], s_sb = quantize_mx(yT)               # VectorE
        data[:, tile t0] = q_sb;  scale[:, tile t0] = s_sb      # 1 + 4 DMAs
    """
    T, H = x.shape
    KT = H // CHUNK
    SL = -(-KT // 4)
    data_hbm = nl.ndarray((P, KT * T), dtype=nl.uint32, buffer=nl.shared_hbm)
    scale_hbm = nl.ndarray((64, SL * T), dtype=nl.uint8, buffer=nl.shared_hbm)
    res_hbm = None
    if residual is not None:
        res_hbm = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    data_x4 = data_hbm.view(mx_x4)                                               # [128, KT*T]
    programs, pid = lnc_programs()
    ident = gT = None             # made after the first tile's loads are issued (same DMA rings)
    consts = _row_consts(H, eps)
    if not double:
        h_one = nl.ndarray((P, H), dtype=x.dtype, buffer=nl.sbuf)
        y_one = nl.ndarray((P, H), dtype=nl.bfloat16, buffer=nl.sbuf)
        q_one = nl.ndarray((P, KT, P), dtype=mx_x4, buffer=nl.sbuf)
        s_one = nl.ndarray((P, SL, P), dtype=nl.uint8, buffer=nl.sbuf)

    tiles = [(t0, min(P, T - t0)) for i, t0 in enumerate(range(0, T, P)) if i % programs == pid]
    lone = len(tiles) == 1
    # Skewed loop, per iteration: load + sum of squares of tile j; the back half (transposes,
    # evictions, quantize_mx, stores) of tile j-1; then rstd and y1 = h * rstd of tile j
    # (GpSimd, one instruction per 512 columns so the transposes can start on the first ones).
    # ScalarE's sum of squares never waits behind its evictions, VectorE's evictions never
    # behind tile j's scalar ops.
    pending = None
    for j in range(len(tiles) + 1):
        if j < len(tiles):
            t0, tt = tiles[j]
            if double:
                h_sb = nl.ndarray((tt, H), dtype=x.dtype, buffer=nl.sbuf)         # [tt, H]
                y1 = nl.ndarray((tt, H), dtype=nl.bfloat16, buffer=nl.sbuf)       # [tt, H]
            else:
                h_sb, y1 = h_one[0:tt, :], y_one[0:tt, :]
            if lone:                      # a lone tile: the sum of squares follows the chunks in
                ss = _load_sum_squares_chunked(h_sb, y1, x, residual, res_hbm, t0, tt)
            else:
                _load_rows(h_sb, x, residual, res_hbm, t0, tt)
                ss = _sum_squares_act(h_sb, y1)
            if gT is None:
                ident = nl.shared_identity_matrix(P, dtype=nl.bfloat16)               # [128, 128]
                gT = _gamma_columns(gamma, KT)                                       # [128, 4, KT]
        if pending is not None:
            (pt0, ptt), py1 = pending
            if double:
                q_sb = nl.ndarray((P, KT, ptt), dtype=mx_x4, buffer=nl.sbuf)      # [128, KT, tt]
                s_sb = nl.ndarray((P, SL, ptt), dtype=nl.uint8, buffer=nl.sbuf)   # [128, SL, tt]
            else:
                q_sb, s_sb = q_one[:, :, 0:ptt], s_one[:, :, 0:ptt]
            if KT % 4:                    # image rows of the chunks past KT in the last slot
                nisa.memset(dst=s_sb[:, SL - 1, :], value=0)
            def store(sl0, sl1, pt0=pt0, ptt=ptt, q_sb=q_sb, s_sb=s_sb):
                """Chunks [4 sl0, 4 sl1) of the tile: data and (SBUF partition 32Q + r -> scale
                image row 16Q + r) their scale slots. A lone tile's data goes by hardware DGE
                (its own DMA ring): on one ring with the 4 scale stores of each slot, the 3
                outstanding transfers a ring holds per queue left the queues idle between slots
                (modeled, 128 x 7168: 17.7 -> 17.2 us)."""
                k0, k1 = 4 * sl0, min(KT, 4 * sl1)
                kw = dict(dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.sync) if lone else {}
                nisa.dma_copy(dst=data_x4[:, KT * pt0 + k0 * ptt:KT * pt0 + k1 * ptt],
                              src=q_sb[:, k0:k1, :], **kw)
                for Q in range(4):
                    nisa.dma_copy(dst=scale_hbm[16 * Q:16 * Q + 16,
                                                SL * pt0 + sl0 * ptt:SL * pt0 + sl1 * ptt],
                                  src=s_sb[32 * Q:32 * Q + 16, sl0:sl1, :])

            if lone:                      # chunks in order, stored as slots fill
                _mx_tile_back(py1, q_sb, s_sb, gT, ident, ptt, KT,
                              on_slot=lambda sl: store(sl, sl + 1))
            else:
                _mx_tile_back(py1, q_sb, s_sb, gT, ident, ptt, KT)
                store(0, SL)
            pending = None
        if j < len(tiles):
            rstd, _ = _rstd(ss, consts)
            for c in range(KT):
                cols = slice(c * CHUNK, (c + 1) * CHUNK)
                if lone and c % LONE_Y1_ACT_EVERY == LONE_Y1_ACT_EVERY - 1:
                    nisa.activation(dst=y1[:, cols], op=nl.copy, data=h_sb[:, cols], scale=rstd)
                else:
                    nisa.tensor_tensor(dst=y1[:, cols], data1=h_sb[:, cols],
                                       data2=rstd.broadcast(1, CHUNK), op=nl.multiply,
                                       engine=nisa.engine.gpsimd)
            pending = (tiles[j], y1)
    if residual is not None:
        return data_hbm, scale_hbm, res_hbm
    return data_hbm, scale_hbm


def _mx_tile_back(y1, q_sb, s_sb, gT, ident, tt, KT, on_slot=None):
    """One tile's back half: per 512 columns, 4 TensorE transposes (columns q::4) to
    [128 p, 4 q, tt], the eviction times gamma into [128, tt, 4], and quantize_mx into the tile's
    x4 output and quadrant scales. ScalarE evicts one chunk in ACT_EVICT_EVERY (issued first:
    its stream reaches them right after the next tile's sum of squares); VectorE evicts the rest,
    quantizing chunk c after evicting chunk c+1 (never waiting on the instruction it just issued)
    and ScalarE's chunks last.

    ``on_slot(sl)`` (a lone tile: no next tile to overlap): every chunk is transposed, evicted
    and quantized in order, ScalarE's in their place, and ``on_slot`` is called as each scale
    slot of four chunks is complete, so the stores start while the rest is made."""
    every = ACT_EVICT_EVERY if on_slot is None else LONE_ACT_EVERY
    act = [kt for kt in range(KT) if kt % every == every // 2]
    held = [None]

    def transposed(kt):
        # a whole 2 KiB bank per tile: VectorE and ScalarE evictions of different chunks then
        # never share a bank (same-bank accesses of the two engines serialise). The previous
        # chunk's bank is held until this one is allocated, so consecutive chunks alternate banks
        bank = nl.ndarray((P, 2, 4, tt), dtype=nl.bfloat16, buffer=nl.psum)
        held[0] = bank
        tp = bank[:, 0, :, :]                                                     # [128, 4, tt]
        for q in range(4):
            nisa.nc_matmul(dst=tp[:, q, :],
                           stationary=y1[:, kt * CHUNK + q:(kt + 1) * CHUNK:4],     # [tt, 128]
                           moving=ident[0:tt, 0:tt], is_transpose=True)
        return tp

    def evict_act(kt):
        tp = transposed(kt)
        yq = nl.ndarray((P, 4, tt), dtype=nl.bfloat16, buffer=nl.sbuf)             # [128, 4, tt]
        for q in range(4):        # four contiguous slabs: no interleaved writes to order
            nisa.activation(dst=yq[:, q, :], op=nl.copy, data=tp[:, q, :],
                            scale=gT[:, q, kt:kt + 1])
        return yq.permute((0, 2, 1))                                              # [128, tt, 4]

    def evict_dve(kt):
        tp = transposed(kt)
        yT = nl.ndarray((P, tt, 4), dtype=nl.bfloat16, buffer=nl.sbuf)             # [128, tt, 4]
        g_b = gT[:, :, kt].expand_dim(2).broadcast(2, tt)                          # [128, 4, tt]
        nisa.tensor_tensor(dst=yT.permute((0, 2, 1)), data1=tp, data2=g_b, op=nl.multiply)
        return yT

    def quantize(kt, yT):
        nisa.quantize_mx(dst=q_sb[:, kt, :], src=yT,
                         dst_scale=s_sb[4 * (kt % 4):P, kt // 4, :])
        if on_slot is not None and (kt % 4 == 3 or kt == KT - 1):
            on_slot(kt // 4)

    if on_slot is None:
        done = [(kt, evict_act(kt)) for kt in act]
        order = [kt for kt in range(KT) if kt not in act]
    else:
        done, order = [], range(KT)
    prev = None
    for kt in order:
        yT = evict_act(kt) if kt in act else evict_dve(kt)
        if prev is not None:
            quantize(*prev)
        prev = (kt, yT)
    if prev is not None:
        quantize(*prev)
    for kt, yT in done:
        quantize(kt, yT)


def _gamma_columns(gamma, KT):
    """gT [128, 4, KT] fp32 with gT[p, q, c] = gamma[512c + 4p + q]: gamma loaded as KT rows of 512
    (one DMA), then 4 TensorE transposes of the columns q::4."""
    g_rows = nl.ndarray((KT, CHUNK), dtype=gamma.dtype, buffer=nl.sbuf)          # [KT, 512]
    nisa.dma_copy(dst=g_rows, src=gamma.reshape((KT, CHUNK)))
    ident = nl.shared_identity_matrix(KT, dtype=gamma.dtype)                      # [KT, KT]
    tp = nl.ndarray((P, 4, KT), dtype=gamma.dtype, buffer=nl.psum)               # [128, 4, KT]
    for q in range(4):
        nisa.nc_matmul(dst=tp[:, q, :], stationary=g_rows[:, q:CHUNK:4], moving=ident,
                       is_transpose=True)
    gT = nl.ndarray((P, 4, KT), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=gT, src=tp)
    return gT


# ---------------------------------------------------------------------------------------- op
def _check(cond, msg):
    if not cond:
        raise ValueError(f"rmsnorm_quant: {msg}")


def rmsnorm_quant(x, gamma, *, residual=None, eps=1e-6, quant="fp8", fp8_dtype=None,
                  static_scale=None, mx_fmt="e4m3fn", lnc: int = 1):
    """RMSNorm of ``x`` (optionally ``x + residual``) times ``gamma``, quantized for a matmul.

    Args:
      x: ``[T, H]`` bfloat16 (NumPy or CPU torch), T >= 1.
      gamma: ``[H]`` bfloat16 or float32.
      residual: optional ``[T, H]`` bfloat16; then ``h = bf16(x + residual)`` is normalized and
         also returned (the updated residual).
      eps: added to the mean square, > 0 (default 1e-6).
      quant: "fp8" (per-token FP8, H a multiple of 128) or "mx" (MXFP8, Trn3, H a multiple of 512).
      fp8_dtype: "float8_e4m3" (Trn2's FP8 matmul format, max 240), "float8_e5m2", or (Trn3 only)
         "float8_e4m3fn" (max 448). Default: float8_e4m3 on Trn2, float8_e4m3fn on Trn3.
      static_scale: optional positive float: FP8 data = saturate(y / static_scale) instead of
         per-token absmax scaling.
      mx_fmt: "e4m3fn" (default) or "e5m2" for quant="mx".
      lnc: 1, or 2 to split the tokens over the two cores of a logical NeuronCore.
    Returns:
      quant="fp8": ``(q [T, H] fp8, scale [T, 1] float32)`` with ``y ~ q * scale``;
      quant="mx": an ``MXTensor`` of ``y.T`` in the MX tile layout (data uint32
      [128, (H/512) T], scale uint8 [64, ceil(H/2048) T]) -- pass it as ``a`` to ``mxfp8_matmul``.
      With a residual, a tuple whose last element is the updated residual ``[T, H]`` bf16.
    """
    gen = check_target("rmsnorm_quant")
    check_no_grad("rmsnorm_quant", x, gamma, residual)
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"rmsnorm_quant: x must be 2-D [T, H]; got shape "
                         f"{getattr(x, 'shape', None)}")
    T, H = (int(d) for d in x.shape)
    if _dtype_name(x) != "bfloat16":
        raise TypeError(f"rmsnorm_quant: x must be bfloat16; got {_dtype_name(x)}")
    _check(T >= 1, f"T (x.shape[0]) must be >= 1; got {T}")
    if quant not in ("fp8", "mx"):
        raise ValueError(f"rmsnorm_quant: quant must be 'fp8' or 'mx'; got {quant!r}")
    mult = 128 if quant == "fp8" else CHUNK
    _check(H >= mult and H % mult == 0,
           f"H (x.shape[1]) must be a positive multiple of {mult} for quant={quant!r}; got {H}")
    if getattr(gamma, "ndim", None) != 1 or int(gamma.shape[0]) != H:
        raise ValueError(f"rmsnorm_quant: gamma must be 1-D of length H={H}; got shape "
                         f"{getattr(gamma, 'shape', None)}")
    if _dtype_name(gamma) not in ("bfloat16", "float32"):
        raise TypeError(f"rmsnorm_quant: gamma must be bfloat16 or float32; got "
                        f"{_dtype_name(gamma)}")
    if residual is not None:
        if tuple(getattr(residual, "shape", ())) != (T, H):
            raise ValueError(f"rmsnorm_quant: residual must have x's shape ({T}, {H}); got "
                             f"{getattr(residual, 'shape', None)}")
        if _dtype_name(residual) != "bfloat16":
            raise TypeError(f"rmsnorm_quant: residual must be bfloat16; got "
                            f"{_dtype_name(residual)}")
    check_eps("rmsnorm_quant", eps)
    check_lnc("rmsnorm_quant", lnc)
    budget = sbuf_budget()
    gbytes = 2 if _dtype_name(gamma) == "bfloat16" else 4
    plan = plan_rmsnorm_quant(T, H, quant, residual is not None, gbytes, budget)

    if quant == "mx":
        if gen < 4:
            raise ValueError(f"rmsnorm_quant: quant='mx' (MXFP8, quantize_mx) needs Trn3 "
                             f"(NeuronCore-v4); the target is gen{gen} (Trn2): use quant='fp8'")
        if fp8_dtype is not None or static_scale is not None:
            raise ValueError("rmsnorm_quant: fp8_dtype and static_scale apply to quant='fp8' only")
        fmt = str(mx_fmt)
        if fmt not in ("e4m3fn", "e5m2"):
            raise ValueError(f"rmsnorm_quant: mx_fmt must be 'e4m3fn' or 'e5m2'; got {mx_fmt!r}")
        x4 = nl.float8_e4m3fn_x4 if fmt == "e4m3fn" else nl.float8_e5m2_x4
        out = launch(rmsnorm_quant_mx_kernel, x, gamma, residual, float(eps), x4, plan.double,
                     lnc=lnc)
        mx = MXTensor(out[0], out[1], fmt, H)
        return (mx, out[2]) if residual is not None else mx

    if fp8_dtype is None:
        fp8_dtype = "float8_e4m3fn" if gen >= 4 else "float8_e4m3"
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"rmsnorm_quant: fp8_dtype must be one of {', '.join(FP8_MAX)}; got "
                         f"{fp8_dtype!r}")
    if fp8_dtype == "float8_e4m3fn" and gen < 4:
        raise ValueError("rmsnorm_quant: fp8_dtype='float8_e4m3fn' (OCP E4M3) needs Trn3; Trn2's "
                         "FP8 matmul consumes float8_e4m3 (max 240) and float8_e5m2")
    if static_scale is not None:
        ok = isinstance(static_scale, (int, float)) and not isinstance(static_scale, bool)
        if not ok or not (0 < static_scale < float("inf")):
            raise ValueError(f"rmsnorm_quant: static_scale must be a positive finite float; got "
                             f"{static_scale!r}")
        static_scale = float(static_scale)
    return launch(rmsnorm_quant_fp8_kernel, x, gamma, residual, float(eps),
                  getattr(nl, fp8_dtype), FP8_MAX[fp8_dtype], static_scale, plan.transposed,
                  plan.double, lnc=lnc)


__all__ = ["rmsnorm_quant", "rmsnorm_quant_fp8_kernel", "rmsnorm_quant_mx_kernel",
           "RMSQuantPlan", "plan_rmsnorm_quant", "AMAX_FLOOR", "FP8_MAX"]
