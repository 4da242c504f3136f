"""Trn3 microscaling (MX) instructions: ``quantize_mx`` (VectorE) and ``nc_matmul_mx`` (TensorE),
nki-spec §9.1.2 and §9.8. Both need Trn3 (gen4).

Data. ``*_x4`` tensors hold one 32-bit (fp8) or 16-bit (fp4) container per element; lane ``q`` of
a container is byte ``q`` (fp8, little-endian) or nibble ``q`` = bits ``4q..4q+3`` (fp4). For a
matmul operand ``[K, F]`` of x4 elements the effective contraction is ``4K``: element ``(k, f, q)``
is contraction row ``q*K + k`` (the layout convention of §9.1.2).

Scaling groups. One scale byte (``float8_e8m0fnu`` or ``uint8``; value ``2**(byte - 127)``) covers
8 partitions x 1 x4 element = 32 values: data partitions ``8r..8r+7`` of x4 column ``f`` use scale
row ``r`` of column ``f``, ``0 <= r < K/8``.

How a scale *view* maps onto partitions (our reading of §9.1.2 and of the quantize_mx docs):
  * The scale view is an ordinary SBUF view whose free size equals the data's free size (F). Its
    partition dim is *not* the logical row index ``r``: the rows are spread over SBUF quadrants.
  * Let ``p0`` be the absolute start partition of the scale view and ``o = p0 % 32`` (must be one of
    0, 4, 8, 12: "scales live in the first 16 partitions of each quadrant"). The quadrant base is
    ``p0 - o``. Scale row ``r`` lives at absolute partition
    ``(p0 - o) + 32*(r // 4) + (r % 4) + o``, i.e. at view partition ``32*(r // 4) + (r % 4)``.
    So slicing one ``[K, F]`` scale buffer as ``buf[0:]``, ``buf[4:]``, ``buf[8:]``, ``buf[12:]``
    lets up to four tiles share it, each in its own 4-partition band of every quadrant.
  * The view must contain every partition it addresses: at least ``32*((R-1)//4) + (R-1)%4 + 1``
    partitions for ``R = K/8`` rows (4 for K=32, 36 for K=64, 68 for K=96, 100 for K=128). This
    matches the documented allocation rule (``(K/8, F)`` when K <= 32, else ``(K, F)``) and the
    documented ``buf[4:, :]`` sharing idiom. A ``(K/8, F)`` view for K > 32 is rejected (spec
    unsure whether hardware reads past such a view; we require the view to cover it).
  * quantize_mx writes only those R partitions of the view; the others keep their contents.

quantize_mx scale rule (the hardware's, 2x the OCP sample algorithm): for each group, ``amax =
max|v|``; ``X = 2**(floor(log2 amax) - (Emax - 1))`` with Emax = 8 (e4m3fn) / 15 (e5m2);
``amax == 0 -> X = 2**-127`` (byte 0); data = RNE(v / X) in the lane format (never saturates:
``amax / X < 2**Emax``).

nc_matmul_mx math: ``S[q*K + k, m] = lane_q(stationary[k, m]) * 2**(s_scale[k//8, m] - 127)`` in
fp32, likewise ``V`` for moving, then ``dst (op)= S.T @ V`` with fp32 accumulation; ``accumulate``
as in ``nc_matmul``.

Spec silent, our choices (listed again in the report):
  * quantize_mx: a group holding NaN/inf gets scale byte 0xFF (NaN in e8m0) and NaN data.
  * quantize_mx: bf16 inputs so small that ``floor(log2 amax) - (Emax-1) < -127`` clamp the scale
    exponent to -127 (byte 0); the values then round in the lane format as usual.
  * nc_matmul_mx: scale byte 0xFF decodes as NaN for both ``float8_e8m0fnu`` and ``uint8``.
  * nc_matmul_mx: products are formed from fp32-dequantized operands, so an operand whose scaled
    value leaves the fp32 range (e.g. 448 * 2**127) becomes inf here; the hardware's internal
    range is undocumented.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import dtypes as dt
from ..errors import fail
from ._common import emit, gen, need_gen, on_chip, start_partition, tensor
from .tensor_engine import _accumulate, _check_bank

_MX_DATA = ("float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4")
_QUANT_EMAX = {"float8_e4m3fn_x4": 8, "float8_e5m2_x4": 15}
_SCALE_DTYPES = ("float8_e8m0fnu", "uint8")
_QUAD_OFFSETS = (0, 4, 8, 12)


def _scale_partitions(R):
    """View partition index of each logical scale row ``r`` (quadrant distribution)."""
    r = np.arange(R)
    return 32 * (r // 4) + (r % 4)


def _check_scale_view(I, role, t, R, F):
    """Validate a scale view for ``R`` logical rows x ``F`` columns; return the row partitions."""
    tensor(I, role, t)
    on_chip(I, role, t, psum=False)
    if t.dtype.name not in _SCALE_DTYPES:
        raise fail(I, role, f"has dtype {t.dtype}; MX scales are float8_e8m0fnu (preferred) or "
                            f"uint8")
    if t.free_size != F:
        raise fail(I, role, f"has {t.free_size} elements per partition (shape {t.shape}); it "
                            f"needs one scale per x4 data column, i.e. {F}")
    o = start_partition(t) % 32
    if o not in _QUAD_OFFSETS:
        raise fail(I, role, f"starts at partition {start_partition(t)} (offset {o} inside its "
                            f"32-partition quadrant); scale views must start at quadrant offset "
                            f"0, 4, 8 or 12")
    rows = _scale_partitions(R)
    span = int(rows[-1]) + 1
    if t.shape[0] < span:
        raise fail(I, role, f"has {t.shape[0]} partitions but its {R} scale rows are spread over "
                            f"quadrants (row r at view partition 32*(r//4) + r%4), so the view "
                            f"must span at least {span} partitions; allocate the scale buffer with "
                            f"as many partitions as the data when K > 32")
    return rows


def _scale_bytes(t, rows):
    """The scale bytes [R, F] (uint8) of scale view ``t``."""
    return np.ascontiguousarray(t.read_pf()[rows]).view(np.uint8)


def _scale_factors(b):
    """2**(b - 127) in fp32; byte 0xFF -> NaN (spec silent for uint8: we follow e8m0)."""
    with np.errstate(over="ignore"):
        f = np.ldexp(np.float32(1.0), b.astype(np.int32) - 127).astype(np.float32)
    return np.where(b == 0xFF, np.float32(np.nan), f).astype(np.float32)


def _dequantize(t, scale, rows):
    """x4 tensor [K, F] + its scale view -> fp32 [4K, F] with row ``q*K + k``."""
    K = t.shape[0]
    vals = dt.unpack_x4(t.read_pf(), t.dtype)                   # [K, F, 4]
    f = _scale_factors(_scale_bytes(scale, rows))               # [K/8, F]
    with np.errstate(over="ignore", invalid="ignore"):
        vals = vals * np.repeat(f, 8, axis=0)[:, :, None]
    return np.ascontiguousarray(vals.transpose(2, 0, 1)).reshape(4 * K, -1).astype(np.float32)


# ------------------------------------------------------------------------------- quantize_mx
def quantize_mx(dst, src, dst_scale, name=None):
    """Quantize a bf16/fp16 SBUF tile to MXFP8: packed x4 data in ``dst`` plus one scale per
    8-partition x 4-element group in ``dst_scale`` (quadrant layout, see the module docstring)."""
    I = "quantize_mx"
    need_gen(I, 4)
    tensor(I, "dst", dst)
    tensor(I, "src", src)
    on_chip(I, "src", src, psum=False)
    on_chip(I, "dst", dst, psum=False)
    if src.dtype not in (dt.bfloat16, dt.float16):
        raise fail(I, "src", f"has dtype {src.dtype}; quantize_mx reads float16 or bfloat16")
    if dst.dtype.name not in _QUANT_EMAX:
        fp4 = dst.dtype is dt.float4_e2m1fn_x4
        extra = " (no fp4 output: quantize MXFP4 offline)" if fp4 else ""
        raise fail(I, "dst", f"has dtype {dst.dtype}; quantize_mx writes float8_e4m3fn_x4 or "
                             f"float8_e5m2_x4{extra}")
    P, F = src.shape[0], src.free_size
    if P % 32:
        raise fail(I, "src", f"has {P} partitions; quantize_mx needs a multiple of 32 (<= 128)")
    if F % 4:
        raise fail(I, "src", f"has {F} elements per partition; quantize_mx needs a multiple of 4")
    if dst.shape[0] != P or dst.free_size != F // 4:
        raise fail(I, "dst", f"has shape {dst.shape}; a [{P}, {F}] source packs into {P} "
                             f"partitions x {F // 4} x4 elements")
    rows = _check_scale_view(I, "dst_scale", dst_scale, P // 8, F // 4)
    emax = _QUANT_EMAX[dst.dtype.name]

    g = src.read_f32().reshape(P // 8, 8, F // 4, 4)            # [group row, part, col, lane]
    with np.errstate(invalid="ignore"):
        amax = np.abs(g).max(axis=(1, 3))                        # [P/8, F/4]
    finite = np.isfinite(g).all(axis=(1, 3))
    _, e = np.frexp(np.where(finite, amax, 0).astype(np.float32))  # amax = m * 2**e, m in [.5, 1)
    # NKI >= 0.5 documents a scale twice the OCP sample algorithm's, 2^(floor(log2 amax) - (Emax-1)),
    # so the data fits without saturating; NKI 0.3/0.4 (and NKI Library's goldens of that era)
    # use the OCP scale 2^(floor(log2 amax) - Emax) and saturate to the format's max
    from .. import versions
    ocp = not versions.at_least("0.5")
    xexp = (e.astype(np.int64) - 1) - (emax if ocp else emax - 1)
    xexp = np.where(amax == 0, -127, xexp)
    xexp = np.clip(xexp, -127, 127)                              # spec silent below 2**-127
    sbytes = np.where(finite, xexp + 127, 0xFF).astype(np.uint8)
    q = np.ldexp(g.astype(np.float64), -xexp[:, None, :, None]).astype(np.float32)
    if ocp:
        fmax = float(ml_dtypes.finfo(dst.dtype.lane_np).max)
        q = np.clip(q, -fmax, fmax)
    q = np.where(finite[:, None, :, None], q, np.float32(np.nan))
    dst.write_pf(dt.pack_x4(q.reshape(P, F // 4, 4), dst.dtype), cast=False)

    view = dst_scale._np()
    for r, p in enumerate(rows):
        view[p] = sbytes[r].view(dst_scale.dtype.np).reshape(dst_scale.shape[1:])
    return emit("vector", I, [("src", src)], [("dst", dst), ("dst_scale", dst_scale)],
                {"P": P, "F": F, "N": F, "in_dtype": src.dtype.name, "out_dtype": dst.dtype.name,
                 "perf_mode": "mx"}, name)


# ------------------------------------------------------------------------------- nc_matmul_mx
def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None,
                 tile_size=None, accumulate=None, name=None):
    """``dst[M, N] (+)= deq(stationary)[4K, M].T @ deq(moving)[4K, N]`` on TensorE (MXFP8/MXFP4),
    fp32 accumulation in PSUM."""
    I = "nc_matmul_mx"
    need_gen(I, 4)
    g = gen()
    for role, t in (("dst", dst), ("stationary", stationary), ("moving", moving),
                    ("stationary_scale", stationary_scale), ("moving_scale", moving_scale)):
        tensor(I, role, t)
    on_chip(I, "stationary", stationary, psum=False)
    on_chip(I, "moving", moving, psum=False)
    on_chip(I, "dst", dst, sbuf=False)
    if accumulate not in (None, True, False):
        raise fail(I, "accumulate", f"must be None, True or False; got {accumulate!r}")
    for role, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype.name not in _MX_DATA:
            raise fail(I, role, f"has dtype {t.dtype}; nc_matmul_mx takes float8_e5m2_x4, "
                                f"float8_e4m3fn_x4 or float4_e2m1fn_x4 (use nc_matmul for "
                                f"unpacked types)")
    K = stationary.shape[0]
    if moving.shape[0] != K:
        raise fail(I, "moving", f"has {moving.shape[0]} partitions (contraction K) but stationary "
                                f"has {K}; they must match")
    if K % 32 or K > g.pmax:
        raise fail(I, "stationary", f"has K={K} partitions; nc_matmul_mx needs a multiple of 32, "
                                    f"at most {g.pmax} (effective contraction 4K <= 512)")
    M = stationary.free_size
    N = moving.free_size
    if M % 2 or M > g.gemm_stationary_fmax:
        raise fail(I, "stationary", f"has free size M={M}; nc_matmul_mx needs M even and <= "
                                    f"{g.gemm_stationary_fmax}")
    # row tiling only
    tp = tuple(tile_position) if tile_position not in (None, ()) else ()
    ts = tuple(tile_size) if tile_size not in (None, ()) else ()
    if tp or ts:
        if not (tp and ts):
            raise fail(I, "tile_position", "tile_position and tile_size must be given together")
        if len(tp) != 2 or len(ts) != 2:
            raise fail(I, "tile_size", f"tile_position/tile_size are (row, column) pairs; got "
                                       f"{tp}, {ts}")
        (r0, c0), (rs, cs) = tp, ts
        if rs not in (32, 64, 128) or cs != 128:
            raise fail(I, "tile_size", f"{ts}: nc_matmul_mx supports row tiling only: row size "
                                       f"32, 64 or 128 and column size 128")
        if c0 != 0 or r0 % rs or r0 + rs > 128:
            raise fail(I, "tile_position", f"{tp}: the start row must be a multiple of the row "
                                           f"size {rs} inside the 128 PE rows and the start "
                                           f"column 0")
        if K > rs:
            raise fail(I, "tile_size", f"K={K} does not fit the row tile of {rs} rows")
    if dst.shape[0] != M or dst.free_size != N:
        raise fail(I, "dst", f"has shape {dst.shape}; stationary {stationary.shape} x moving "
                             f"{moving.shape} produce [{M}, {N}]")
    if dst.dtype is dt.float32:
        nmax = g.gemm_moving_fmax_fp32_dst
    elif dst.dtype is dt.bfloat16 and g.bf16_psum:
        nmax = g.gemm_moving_fmax_bf16_dst
    else:
        raise fail(I, "dst", f"has dtype {dst.dtype}; nc_matmul_mx writes float32 or bfloat16 PSUM")
    if N > nmax:
        raise fail(I, "moving", f"has free size N={N}; the limit is {nmax} for a {dst.dtype} PSUM "
                                f"output")
    _check_bank(I, dst, g)
    rows_s = _check_scale_view(I, "stationary_scale", stationary_scale, K // 8, M)
    rows_m = _check_scale_view(I, "moving_scale", moving_scale, K // 8, N)
    s = _dequantize(stationary, stationary_scale, rows_s)      # [4K, M]
    v = _dequantize(moving, moving_scale, rows_m)              # [4K, N]
    with np.errstate(invalid="ignore", over="ignore"):
        result = s.T @ v
    overwrote = _accumulate(I, dst, result.astype(np.float32), accumulate)
    return emit("tensor", I, [("stationary", stationary), ("moving", moving),
                              ("stationary_scale", stationary_scale),
                              ("moving_scale", moving_scale)], [("dst", dst)],
                {"K": 4 * K, "K_x4": K, "M": M, "N": N, "in_dtype": stationary.dtype.name,
                 "mov_dtype": moving.dtype.name, "perf_mode": "mx", "accumulate": accumulate,
                 "overwrote": overwrote, "tile_position": tp, "tile_size": ts, "onezero": False}, name)


__all__ = ["quantize_mx", "nc_matmul_mx"]
