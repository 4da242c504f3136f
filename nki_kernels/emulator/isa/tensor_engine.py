"""TensorE instructions: ``nc_matmul``, ``nc_transpose`` (nki-spec §9.1)."""
from __future__ import annotations

import warnings

import numpy as np

from .. import dtypes as dt
from .. import runtime as rt
from ..errors import fail
from ._common import (
    NkiHardwareWarning,
    as_enum,
    emit,
    gen,
    mask_view,
    matmul_perf_mode,
    need_gen,
    on_chip,
    tensor,
)
from ._common import engine as Engine

_MM_IN = {"float8_e4m3", "float8_e5m2", "bfloat16", "float16", "tfloat32", "float32"}
_FP8 = {"float8_e4m3", "float8_e5m2", "float8_e4m3fn"}


def _check_bank(instr, dst, g):
    """gen2/gen3: a matmul output stays inside one 2 KiB PSUM bank (nki-spec §10)."""
    st = dst.storage
    isz = dst.itemsize
    off = dst._base_offset()
    pe = dst.part_elems
    f0 = off % pe
    hi = f0 + sum(s * (n - 1) for n, s in zip(dst.shape[1:], dst.strides[1:]) if s > 0)
    lo_b = st.addr + f0 * isz
    hi_b = st.addr + (hi + 1) * isz
    bank = g.psum_bank_bytes
    if g.nc_version < 4 and lo_b // bank != (hi_b - 1) // bank:
        raise fail(instr, "dst", f"spans PSUM bytes [{lo_b}, {hi_b}) of each partition, crossing a "
                                 f"{bank}-byte bank boundary; on {g.name} a matmul output must stay "
                                 f"inside one bank (N <= 512 fp32 elements, bank-aligned)")


def _accumulate(instr, dst, result, accumulate):
    """Write ``result`` [M, N] f32 into PSUM ``dst`` with the accumulate semantics of §9.1.1.

    Returns True when no element accumulated (every element of ``dst`` was overwritten): the
    cost model needs it to tell a dead PSUM memset (one the first matmul overwrites) from a live one.
    """
    mask = mask_view(dst).reshape(dst.shape[0], -1)
    cur = dst.read_f32()
    if accumulate is None:
        overwrote = not mask.any()
        out = np.where(mask, cur + result, result)
    elif accumulate:
        overwrote = False
        if not mask.all():
            warnings.warn(f"{instr}: accumulate=True onto PSUM elements of {dst.name!r} that no "
                          f"matmul wrote: undefined on hardware", NkiHardwareWarning, stacklevel=3)
        out = cur + result
    else:
        overwrote = True
        out = result
    dst.write_pf(out)
    mv = mask_view(dst)
    mv[...] = True
    return overwrote


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(),
              perf_mode=matmul_perf_mode.none, name=None):
    """``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` on TensorE, fp32 accumulation in PSUM."""
    I = "nc_matmul"
    g = gen()
    tensor(I, "dst", dst)
    tensor(I, "stationary", stationary)
    tensor(I, "moving", moving)
    on_chip(I, "stationary", stationary, psum=False)
    on_chip(I, "moving", moving, psum=False)
    on_chip(I, "dst", dst, sbuf=False)
    perf_mode = as_enum(matmul_perf_mode, perf_mode, I, "perf_mode")
    if accumulate not in (None, True, False):
        raise fail(I, "accumulate", f"must be None, True or False; got {accumulate!r}")
    sd, md = stationary.dtype, moving.dtype
    for role, d in (("stationary", sd), ("moving", md)):
        ok = d.name in _MM_IN or (d.name == "float8_e4m3fn" and g.e4m3fn_matmul)
        if not ok:
            extra = " (float8_e4m3fn needs Trn3)" if d.name == "float8_e4m3fn" else ""
            raise fail(I, role, f"has dtype {d}; matmul inputs are float8_e4m3, float8_e5m2, "
                                f"bfloat16, float16, tfloat32, float32{extra}")
    if {sd.name, md.name} == {"float8_e4m3", "float8_e4m3fn"}:
        raise fail(I, "moving", "mixes float8_e4m3 (legacy) with float8_e4m3fn (OCP); not allowed")
    f32ish = {"float32", "tfloat32"}
    if (sd.name in f32ish) != (md.name in f32ish):
        raise fail(I, "moving", f"dtype {md} with stationary {sd}: if one input is fp32/tf32 the "
                                f"other must be too")
    K = stationary.shape[0]
    if moving.shape[0] != K:
        raise fail(I, "moving", f"has {moving.shape[0]} partitions (contraction K) but stationary "
                                f"has {K}; they must match")
    double = perf_mode is matmul_perf_mode.double_row
    if double:
        need_gen(I, 3, "perf_mode=double_row")
        if sd.name not in _FP8 or md.name not in _FP8:
            raise fail(I, "perf_mode", f"double_row needs FP8 inputs; got stationary {sd}, "
                                       f"moving {md}")
        if is_transpose or tile_position or tile_size:
            raise fail(I, "perf_mode", "double_row cannot be combined with is_transpose or PE tiling")
        for role, t in (("stationary", stationary), ("moving", moving)):
            if t.ndim < 3 or t.shape[1] != 2:
                raise fail(I, role, f"must be shaped [K, 2, ...] for double_row (the first free dim "
                                    f"is exactly 2); got {t.shape}")
        M = stationary.free_size // 2
        N = moving.free_size // 2
    else:
        M = stationary.free_size
        N = moving.free_size
    if K > g.pmax:
        raise fail(I, "stationary", f"contraction K={K} exceeds {g.pmax} partitions")
    if M > g.gemm_stationary_fmax:
        raise fail(I, "stationary", f"has free size M={M}; the stationary operand allows at most "
                                    f"{g.gemm_stationary_fmax}")
    # PE tiling
    if tile_position or tile_size:
        if not (tile_position and tile_size):
            raise fail(I, "tile_position", "tile_position and tile_size must be given together")
        (r0, c0), (rs, cs) = tile_position, tile_size
        allowed = (32, 64, 128) if g.nc_version >= 3 else (64, 128)
        if rs not in allowed or cs not in allowed:
            raise fail(I, "tile_size", f"{tuple(tile_size)}: row/column tile sizes must be one of "
                                       f"{allowed} on {g.name}")
        if r0 % rs or c0 % cs or r0 + rs > 128 or c0 + cs > 128:
            raise fail(I, "tile_position", f"{tuple(tile_position)} must be multiples of the tile "
                                           f"size {tuple(tile_size)} inside the 128x128 array")
        if K > rs or M > cs:
            raise fail(I, "tile_size", f"K={K}, M={M} do not fit the PE tile {tuple(tile_size)}")
    # destination
    if dst.shape[0] != M or dst.free_size != N:
        exp = f"[{M}, {N}]" if not is_transpose else f"[{M}, {K}]"
        if not (is_transpose and dst.shape[0] == M and dst.free_size == K):
            raise fail(I, "dst", f"has shape {dst.shape}; stationary {stationary.shape} x moving "
                                 f"{moving.shape} produce {exp} (partitions = stationary free size)")
    if is_transpose:
        return _transpose_mode(I, dst, stationary, moving, g, name)
    if dst.dtype is dt.float32:
        nmax = g.gemm_moving_fmax_fp32_dst
    elif dst.dtype is dt.bfloat16 and g.bf16_psum:
        nmax = g.gemm_moving_fmax_bf16_dst
    else:
        raise fail(I, "dst", f"has dtype {dst.dtype}; matmul writes float32 PSUM"
                             f"{' or bfloat16' if g.bf16_psum else ' on ' + g.name}")
    if N > nmax:
        raise fail(I, "moving", f"has free size N={N}; the limit is {nmax} for a {dst.dtype} PSUM "
                                f"output on {g.name}")
    _check_bank(I, dst, g)
    s = stationary.read_f32()
    m = moving.read_f32()
    if double:
        s = s.reshape(K * 2, M)   # rows (k, r): [K, 2, M] flattened per partition
        m = m.reshape(K * 2, N)
    with np.errstate(invalid="ignore", over="ignore"):   # inf/NaN inputs propagate, as on HW
        result = s.T @ m
    overwrote = _accumulate(I, dst, result, accumulate)
    return emit("tensor", "nc_matmul", [("stationary", stationary), ("moving", moving)],
                [("dst", dst)], {"K": K * (2 if double else 1), "M": M, "N": N,
                                 "in_dtype": sd.name, "mov_dtype": md.name,
                                 "perf_mode": perf_mode.value, "accumulate": accumulate,
                                 "overwrote": overwrote,
                                 "tile_position": tuple(tile_position),
                                 "tile_size": tuple(tile_size),
                                 "onezero": bool(is_stationary_onezero or is_moving_onezero)}, name)


def _transpose_mode(I, dst, data, ident, g, name):
    """``is_transpose=True``: ``dst = data.T`` bit-exactly, with ``moving`` an identity (gen3+)."""
    K, M = data.shape[0], data.free_size
    if ident.free_size != K or ident.shape[0] != K:
        raise fail(I, "moving", f"must be a {K}x{K} identity for is_transpose; got {ident.shape}")
    idv = ident.read_f32()
    if not np.array_equal(idv, np.eye(K, dtype=np.float32)):
        raise fail(I, "moving", "must hold an identity matrix for is_transpose=True")
    if dst.shape[0] != M or dst.free_size != K:
        raise fail(I, "dst", f"must be [{M}, {K}] for the transpose of a {data.shape} tile")
    if g.nc_version < 3:
        # gen2: a profiler hint only; the result is an fp32 matmul against the identity
        if dst.dtype is not dt.float32:
            raise fail(I, "dst", "must be float32 on gen2 (is_transpose is only a hint there)")
        dst.write_pf(data.read_f32().T)
    else:
        if data.dtype.is_fp8:
            raise NotImplementedError(
                "nc_matmul(is_transpose=True) on FP8 input (16-bit output with the upper byte zero "
                "per nki-spec §9.1.1) is not implemented: the spec does not settle the layout")
        if dst.dtype is not data.dtype:
            raise fail(I, "dst", f"has dtype {dst.dtype}; transpose mode writes the input dtype "
                                 f"{data.dtype}")
        dst.write_pf(data.read_pf().T, cast=False)
    mask_view(dst)[...] = True
    return emit("tensor", "nc_transpose", [("stationary", data), ("moving", ident)],
                [("dst", dst)], {"P": K, "F": M, "in_dtype": data.dtype.name, "mode": "pe"}, name)


def nc_transpose(dst, data, engine=Engine.unknown, name=None):
    """2-D partition<->free transpose: TensorE (SBUF->PSUM, <=128x128) or VectorE (<=32x32)."""
    I = "nc_transpose"
    eng = as_enum(Engine, engine, I, "engine")
    tensor(I, "dst", dst)
    tensor(I, "data", data)
    P, F = data.shape[0], data.free_size
    if eng.name == "unknown":
        eng = Engine.vector if (P <= 32 and F <= 32 and dst.buffer is rt.sbuf) else Engine.tensor
    if eng.name == "tensor":
        on_chip(I, "data", data, psum=False)
        on_chip(I, "dst", dst, sbuf=False)
        if P > 128 or F > 128:
            raise fail(I, "data", f"is [{P}, {F}]; TensorE transposes at most 128x128")
    elif eng.name == "vector":
        on_chip(I, "data", data)
        on_chip(I, "dst", dst)
        if P > 32 or F > 32:
            raise fail(I, "data", f"is [{P}, {F}]; VectorE transposes at most 32x32")
    else:
        raise fail(I, "engine", f"must be tensor, vector or unknown; got {eng}")
    if dst.shape[0] != F or dst.free_size != P:
        raise fail(I, "dst", f"has shape {dst.shape}; the transpose of {data.shape} is [{F}, {P}]")
    if dst.dtype is not data.dtype:
        raise fail(I, "dst", f"has dtype {dst.dtype}; nc_transpose keeps the dtype {data.dtype}")
    # Unsettled: FP8 data on TensorE. nki-spec 9.1.3 gives nc_transpose the input dtype, but its
    # transpose-mode note (9.1.1, "gen3 fp8 input -> 16-bit elements with upper 8 bits zero")
    # says the PE array writes FP8 as 16-bit elements. We follow 9.1.3 (an FP8 dst gets the
    # bytes). The FP8 K^T of decode_attention and mla_decode avoid it (bf16-viewed dim pairs).
    dst.write_pf(data.read_pf().T, cast=False)
    if dst.buffer is rt.psum:
        mask_view(dst)[...] = eng.name == "tensor"
    return emit(eng.name, "nc_transpose", [("data", data)], [("dst", dst)],
                {"P": P, "F": F, "in_dtype": data.dtype.name,
                 "mode": "pe" if eng.name == "tensor" else "dve"}, name)


__all__ = ["nc_matmul", "nc_transpose"]
