"""Negative tests: one for every hardware / API check raised by the emulator core.

Covered files: isa/tensor_engine.py, isa/dma.py, isa/vector.py, isa/misc.py, isa/_common.py,
language.py, runtime.py, tensor.py, jit.py. Each case asserts the exception type and a message
fragment naming the instruction (or API) and the operand. Checks that the public API cannot reach
(the emulator's own views never produce them) are exercised through the internal ``NkiTensor``
constructor and marked "defensive".

Most cases are bodies run inside a one-line kernel: ``@case(match, ...)`` registers them.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from nki_kernels.emulator import NkiRuntimeError, NkiValidationError, jit, target
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator.isa import NkiHardwareWarning
from nki_kernels.emulator.tensor import NkiTensor

CASES = []


def case(match, exc=NkiValidationError, tgt="trn3", lnc=None):
    """Register a kernel body that must raise ``exc`` with a message matching ``match``."""
    def deco(fn):
        CASES.append(pytest.param(fn, exc, match, tgt, lnc, id=fn.__name__))
        return fn
    return deco


def sb(shape, dtype=nl.float32, **kw):
    return nl.ndarray(shape, dtype, buffer=nl.sbuf, **kw)


def ps(shape, dtype=nl.float32, **kw):
    return nl.ndarray(shape, dtype, buffer=nl.psum, **kw)


def hb(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.hbm)


def idx_tile(values, dtype=nl.int32):
    t = sb((len(values), 1), dtype)
    for p, v in enumerate(values):
        nisa.memset(t[p:p + 1, :], v)
    return t


def q(s):
    return re.escape(s)


# ======================================================================= isa/tensor_engine.py
@case(r"nc_matmul: operand 'dst' spans PSUM bytes \[1024, 3072\).*crossing a 2048-byte bank",
      tgt="trn2")
def mm_bank_crossing_trn2():
    p = ps((4, 1024))                      # two banks; a 512-wide window starting mid-bank
    nisa.nc_matmul(p[:, 256:768], sb((8, 4)), sb((8, 512)))


@case(q("nc_matmul: operand 'accumulate' must be None, True or False"))
def mm_accumulate_not_bool():
    nisa.nc_matmul(ps((4, 8)), sb((8, 4)), sb((8, 8)), accumulate="yes")


@case(q("nc_matmul: operand 'stationary' has dtype nl.int8; matmul inputs are"))
def mm_int_input():
    nisa.nc_matmul(ps((4, 8)), sb((8, 4), nl.int8), sb((8, 8), nl.bfloat16))


@case(r"nc_matmul: operand 'moving' has dtype nl.float8_e4m3fn.*needs Trn3", tgt="trn2")
def mm_e4m3fn_on_trn2():
    nisa.nc_matmul(ps((4, 8)), sb((8, 4), nl.float8_e5m2), sb((8, 8), nl.float8_e4m3fn))


@case(q("nc_matmul: operand 'moving' mixes float8_e4m3 (legacy) with float8_e4m3fn"))
def mm_mix_e4m3_legacy_ocp():
    nisa.nc_matmul(ps((4, 8)), sb((8, 4), nl.float8_e4m3), sb((8, 8), nl.float8_e4m3fn))


@case(r"nc_matmul: operand 'moving' dtype nl.bfloat16 with stationary nl.float32: if one "
      r"input is fp32/tf32 the other must be too")
def mm_fp32_with_bf16():
    nisa.nc_matmul(ps((4, 8)), sb((8, 4)), sb((8, 8), nl.bfloat16))


@case(r"nc_matmul: operand 'moving' has 16 partitions \(contraction K\) but stationary has 8")
def mm_k_mismatch():
    nisa.nc_matmul(ps((4, 8)), sb((8, 4)), sb((16, 8)))


@case(q("nc_matmul: operand 'perf_mode' double_row needs FP8 inputs"), tgt="trn2")
def mm_double_row_bf16():
    nisa.nc_matmul(ps((4, 8)), sb((8, 2, 4), nl.bfloat16), sb((8, 2, 8), nl.bfloat16),
                   perf_mode="double_row")


@case(q("nc_matmul: perf_mode=double_row needs Trn2 (gen3) or newer; the target is trn1"),
      tgt="trn1")
def mm_double_row_trn1():
    nisa.nc_matmul(ps((4, 8)), sb((8, 2, 4), nl.float8_e4m3), sb((8, 2, 8), nl.float8_e4m3),
                   perf_mode=nisa.matmul_perf_mode.double_row)


@case(q("nc_matmul: operand 'perf_mode' double_row cannot be combined with is_transpose"))
def mm_double_row_transpose():
    nisa.nc_matmul(ps((4, 8)), sb((8, 2, 4), nl.float8_e4m3), sb((8, 2, 8), nl.float8_e4m3),
                   perf_mode="double_row", is_transpose=True)


@case(r"nc_matmul: operand 'stationary' must be shaped \[K, 2, \.\.\.\] for double_row",
      tgt="trn2")
def mm_double_row_wrong_layout():
    nisa.nc_matmul(ps((4, 8)), sb((8, 4, 2), nl.float8_e4m3), sb((8, 2, 8), nl.float8_e5m2),
                   perf_mode="double_row")


@case(r"nc_matmul: operand 'moving' must be shaped \[K, 2, \.\.\.\] for double_row", tgt="trn2")
def mm_double_row_moving_2d():
    nisa.nc_matmul(ps((4, 8)), sb((8, 2, 4), nl.float8_e4m3), sb((8, 16), nl.float8_e5m2),
                   perf_mode="double_row")


@case(r"nc_matmul: operand 'stationary' has free size M=256; the stationary operand allows "
      r"at most 128")
def mm_m_over_128():
    nisa.nc_matmul(ps((128, 8)), sb((8, 256)), sb((8, 8)))


@case(q("nc_matmul: operand 'tile_position' tile_position and tile_size must be given together"))
def mm_tile_position_alone():
    nisa.nc_matmul(ps((4, 8)), sb((8, 4)), sb((8, 8)), tile_position=(0, 0))


@case(r"nc_matmul: operand 'tile_size' \(32, 32\): row/column tile sizes must be one of "
      r"\(64, 128\) on trn1", tgt="trn1")
def mm_tile_32_on_trn1():
    nisa.nc_matmul(ps((4, 8)), sb((8, 4)), sb((8, 8)), tile_position=(0, 0), tile_size=(32, 32))


@case(r"nc_matmul: operand 'tile_position' \(0, 48\) must be multiples of the tile size")
def mm_tile_position_unaligned():
    nisa.nc_matmul(ps((4, 8)), sb((8, 4)), sb((8, 8)), tile_position=(0, 48), tile_size=(64, 64))


@case(q("nc_matmul: operand 'tile_size' K=128, M=4 do not fit the PE tile (64, 128)"))
def mm_tile_too_small():
    nisa.nc_matmul(ps((4, 8)), sb((128, 4)), sb((128, 8)), tile_position=(0, 0),
                   tile_size=(64, 128))


@case(r"nc_matmul: operand 'dst' has shape \(4, 16\); stationary \(8, 4\) x moving \(8, 8\) "
      r"produce \[4, 8\]")
def mm_dst_shape():
    nisa.nc_matmul(ps((4, 16)), sb((8, 4)), sb((8, 8)))


@case(q("nc_matmul: operand 'dst' has dtype nl.bfloat16; matmul writes float32 PSUM on trn2"),
      tgt="trn2")
def mm_bf16_dst_trn2():
    nisa.nc_matmul(ps((4, 8), nl.bfloat16), sb((8, 4), nl.bfloat16), sb((8, 8), nl.bfloat16))


@case(q("nc_matmul: operand 'dst' has dtype nl.int32; matmul writes float32 PSUM or bfloat16"))
def mm_int_dst_trn3():
    nisa.nc_matmul(ps((4, 8), nl.int32), sb((8, 4)), sb((8, 8)))


@case(q("nc_matmul: operand 'moving' has free size N=1024; the limit is 512 for a nl.float32 "
        "PSUM output on trn2"), tgt="trn2")
def mm_n_over_512_trn2():
    nisa.nc_matmul(ps((4, 1024)), sb((8, 4)), sb((8, 1024)))


@case(q("nc_matmul: operand 'moving' must be a 8x8 identity for is_transpose"))
def mm_transpose_moving_not_square():
    nisa.nc_matmul(ps((4, 16)), sb((8, 4)), nl.zeros((8, 16), nl.float32), is_transpose=True)


@case(q("nc_matmul: operand 'moving' must hold an identity matrix for is_transpose=True"))
def mm_transpose_moving_not_identity():
    nisa.nc_matmul(ps((4, 8)), sb((8, 4)), nl.ones((8, 8), nl.float32), is_transpose=True)


@case(q("nc_matmul: operand 'dst' must be float32 on gen2 (is_transpose is only a hint there)"),
      tgt="trn1")
def mm_transpose_trn1_bf16_dst():
    nisa.nc_matmul(ps((4, 8), nl.bfloat16), sb((8, 4), nl.bfloat16),
                   nl.shared_identity_matrix(8, nl.bfloat16), is_transpose=True)


@case(q("nc_matmul: operand 'dst' has dtype nl.bfloat16; transpose mode writes the input dtype "
        "nl.float32"), tgt="trn2")
def mm_transpose_dtype_change():
    nisa.nc_matmul(ps((4, 8), nl.bfloat16), sb((8, 4)), nl.shared_identity_matrix(8, nl.float32),
                   is_transpose=True)


@case(q("nc_transpose: operand 'data' is [128, 256]; TensorE transposes at most 128x128"))
def ntr_tensor_too_big():
    nisa.nc_transpose(ps((128, 256)), sb((128, 256)), engine=nisa.engine.tensor)


@case(q("nc_transpose: operand 'data' is [64, 16]; VectorE transposes at most 32x32"))
def ntr_vector_too_big():
    nisa.nc_transpose(sb((16, 64)), sb((64, 16)), engine=nisa.engine.vector)


@case(q("nc_transpose: operand 'engine' must be tensor, vector or unknown"))
def ntr_gpsimd_engine():
    nisa.nc_transpose(sb((8, 8)), sb((8, 8)), engine=nisa.engine.gpsimd)


@case(q("nc_transpose: operand 'dst' has shape (8, 16); the transpose of (8, 16) is [16, 8]"))
def ntr_dst_shape():
    nisa.nc_transpose(sb((8, 16)), sb((8, 16)), engine=nisa.engine.vector)


@case(q("nc_transpose: operand 'dst' has dtype nl.bfloat16; nc_transpose keeps the dtype"))
def ntr_dst_dtype():
    nisa.nc_transpose(ps((16, 8), nl.bfloat16), sb((8, 16)), engine=nisa.engine.tensor)


@case(q("nc_transpose: operand 'data' is in PSUM, which this engine/operand cannot access"))
def ntr_tensor_from_psum():
    nisa.nc_transpose(ps((16, 8)), ps((8, 16)), engine=nisa.engine.tensor)


@case(q("nc_matmul: operand 'stationary' is in PSUM, which this engine/operand cannot access"))
def mm_reads_psum():
    nisa.nc_matmul(ps((4, 8)), ps((8, 4)), sb((8, 8)))


@case(q("nc_matmul: operand 'dst' must be in PSUM"))
def mm_writes_sbuf():
    nisa.nc_matmul(sb((4, 8)), sb((8, 4)), sb((8, 8)))


# ======================================================================= isa/dma.py
@case(q("dma_copy: operand 'src' is in PSUM; DMA cannot read or write PSUM"))
def dma_src_psum():
    nisa.dma_copy(dst=sb((4, 8)), src=ps((4, 8)))


@case(q("dma_copy: operand 'dst' is in PSUM; DMA cannot read or write PSUM"))
def dma_dst_psum():
    nisa.dma_copy(dst=ps((4, 8)), src=hb((4, 8)))


@case(q("dma_copy: operand 'dst' has 32 elements (shape (4, 8)) but src has 36"))
def dma_count_mismatch():
    nisa.dma_copy(dst=sb((4, 8)), src=hb((6, 6)))


@case(q("dma_copy: operand 'priority' must be 0..3; got 4"))
def dma_priority_range():
    nisa.dma_copy(dst=sb((4, 8)), src=hb((4, 8)), priority=4)


@case(q("dma_copy: priority needs Trn3 (gen4) or newer; the target is trn2"), tgt="trn2")
def dma_priority_trn2():
    nisa.dma_copy(dst=sb((4, 8)), src=hb((4, 8)), priority=0)


@case(q("dma_copy: operand 'dst' both dst and src are vector-offset views"))
def dma_both_indirect():
    i = idx_tile([0, 1])
    a, b = hb((4, 8)), hb((4, 8))
    nisa.dma_copy(dst=a.ap([[8, 2], [1, 8]], vector_offset=i),
                  src=b.ap([[8, 2], [1, 8]], vector_offset=i))


@case(q("dma_copy: operand 'dge_mode' hwdge: vector-offset (indirect) DMA needs software DGE"))
def dma_indirect_hwdge():
    i = idx_tile([0, 1])
    nisa.dma_copy(dst=sb((2, 8)), src=hb((4, 8)).ap([[8, 2], [1, 8]], vector_offset=i),
                  dge_mode=nisa.dge_mode.hwdge)


@case(q("dma_copy: operand 'dst' dtype nl.bfloat16 differs from src nl.float32; hwdge copies "
        "raw bytes"))
def dma_hwdge_cast():
    nisa.dma_copy(dst=sb((4, 8), nl.bfloat16), src=hb((4, 8)), dge_mode=nisa.dge_mode.hwdge)


@case(q("dma_copy: dge_mode=hwdge needs Trn2 (gen3) or newer; the target is trn1"), tgt="trn1")
def dma_hwdge_trn1():
    nisa.dma_copy(dst=sb((4, 8)), src=hb((4, 8)), dge_mode=nisa.dge_mode.hwdge)


@case(q("dma_copy: operand 'engine' hwdge DMAs are triggered from engine.sync or engine.scalar; "
        "got gpsimd"))
def dma_hwdge_gpsimd_engine():
    nisa.dma_copy(dst=sb((4, 8)), src=hb((4, 8)), dge_mode=nisa.dge_mode.hwdge,
                  engine=nisa.engine.gpsimd)


@case(q("dma_copy: operand 'engine' is only valid with dge_mode=hwdge"))
def dma_engine_without_hwdge():
    nisa.dma_copy(dst=sb((4, 8)), src=hb((4, 8)), engine=nisa.engine.sync)


@case(q("dma_copy: operand 'dge_mode' none (host-precomputed descriptors) cannot use dynamic"))
def dma_dge_none_dynamic():
    r = idx_tile([1])
    nisa.dma_copy(dst=sb((2, 8)), src=hb((4, 8)).ap([[8, 2], [1, 8]], scalar_offset=r),
                  dge_mode=nisa.dge_mode.none)


@case(q("dma_copy: operand 'dst' DMA cannot cast MX packed types (nl.float8_e4m3fn_x4 -> "
        "nl.uint32)"))
def dma_x4_cast():
    nisa.dma_copy(dst=sb((4, 8), nl.uint32), src=sb((4, 8), nl.float8_e4m3fn_x4))


@case(r"dma_copy: src: dynamic offset out of bounds on .*with oob_mode.error", exc=NkiRuntimeError)
def dma_scalar_offset_oob():
    r = idx_tile([3])
    nisa.dma_copy(dst=sb((2, 8)), src=hb((4, 8))[nl.ds(nisa.scalar_load(r), 2), :])


@case(r"dma_copy: operand 'src' has partition dimension 256, exceeding the maximum 128")
def dma_partitions_defensive():
    t = sb((128, 4))
    nisa.dma_copy(dst=hb((256, 2)), src=NkiTensor(t.storage, t.dtype, (256, 2), (2, 1)))


@case(q("dma_copy: operand 'oob_mode' got the integer 1; integer enum values are rejected"))
def dma_int_enum():
    nisa.dma_copy(dst=sb((4, 8)), src=hb((4, 8)), oob_mode=1)


@case(q("dma_copy: operand 'dge_mode' must be a nisa.dge_mode member"))
def dma_bad_enum_string():
    nisa.dma_copy(dst=sb((4, 8)), src=hb((4, 8)), dge_mode="fast")


@case(q("dma_copy: operand 'src' must be an NkiTensor; got ndarray"))
def dma_numpy_src():
    nisa.dma_copy(dst=sb((4, 8)), src=np.zeros((4, 8), np.float32))


# ======================================================================= isa/vector.py
@case(q("tensor_tensor: operand 'engine' scalar cannot run tensor_tensor; allowed: vector, "
        "gpsimd"))
def tt_scalar_engine():
    nisa.tensor_tensor(sb((4, 8)), sb((4, 8)), sb((4, 8)), nl.add, engine=nisa.engine.scalar)


@case(q("tensor_tensor: operand 'dst' is in PSUM; GpSimd cannot access PSUM"))
def tt_gpsimd_psum():
    nisa.tensor_tensor(ps((4, 8)), sb((4, 8)), sb((4, 8)), nl.add, engine=nisa.engine.gpsimd)


@case(q("tensor_tensor: operand 'dst' has dtype nl.float32; bitwise ops need integer dtypes"))
def tt_bitwise_float():
    nisa.tensor_tensor(sb((4, 8)), sb((4, 8), nl.int32), sb((4, 8), nl.int32), nl.bitwise_and)


@case(q("tensor_tensor: operand 'data2' has 8 partitions but 'data1' has 4; they must match"))
def tt_partition_mismatch():
    nisa.tensor_tensor(sb((4, 8)), sb((4, 8)), sb((8, 4)), nl.add)


@case(q("tensor_tensor: operand 'data2' has 16 elements per partition (shape (4, 16)) but "
        "'data1' has 8"))
def tt_free_mismatch():
    nisa.tensor_tensor(sb((4, 8)), sb((4, 8)), sb((4, 16)), nl.add)


@case(q("tensor_tensor: operand 'data1', 'data2' are both in PSUM; at most one input may be"))
def tt_both_psum():
    nisa.tensor_tensor(sb((4, 8)), ps((4, 8)), ps((4, 8)), nl.add)


@case(q("tensor_tensor: operand 'data1' is in private_hbm; compute instructions read and write "
        "only SBUF or PSUM"))
def tt_hbm_operand():
    nisa.tensor_tensor(sb((4, 8)), hb((4, 8)), sb((4, 8)), nl.add)


@case(q("tensor_tensor: operand 'op' must be an ALU operator such as nl.add"))
def tt_activation_op():
    nisa.tensor_tensor(sb((4, 8)), sb((4, 8)), sb((4, 8)), nl.exp)


@case(q("tensor_tensor: operand 'op' must be an ALU operator such as nl.add or nl.multiply; "
        "got <ufunc 'add'>"))
def tt_numpy_ufunc():
    nisa.tensor_tensor(sb((4, 8)), sb((4, 8)), sb((4, 8)), np.add)


@case(q("tensor_tensor: nl.abs_max as an ALU operator needs Trn3 (gen4) or newer"), tgt="trn2")
def tt_abs_max_trn2():
    nisa.tensor_tensor(sb((4, 8)), sb((4, 8)), sb((4, 8)), nl.abs_max)


@case(q("tensor_scalar: operand 'op1' op1 and operand1 must both be given or both be None"))
def ts_op1_without_operand():
    nisa.tensor_scalar(sb((4, 8)), sb((4, 8)), nl.add, 1.0, op1=nl.multiply)


@case(q("tensor_scalar: operand 'op1' op0 and op1 must both be bitwise or both be arithmetic"))
def ts_mixed_bitwise():
    nisa.tensor_scalar(sb((4, 8), nl.int32), sb((4, 8), nl.int32), nl.bitwise_and, 3,
                       op1=nl.add, operand1=1)


@case(q("tensor_scalar: operand 'operand0' must be None or 0 for the unary operator nl.abs"))
def ts_unary_operand():
    nisa.tensor_scalar(sb((4, 8)), sb((4, 8)), nl.abs, 2.0)


@case(q("tensor_scalar: operand 'engine' nl.rsqrt as an ALU operator runs on GpSimd"))
def ts_rsqrt_vector():
    nisa.tensor_scalar(sb((4, 8)), sb((4, 8)), nl.rsqrt, 0.0, engine=nisa.engine.vector)


@case(q("tensor_scalar: operand 'engine' ScalarE tensor_scalar needs Trn2 or newer"), tgt="trn1")
def ts_scalar_engine_trn1():
    nisa.tensor_scalar(sb((4, 8)), sb((4, 8)), nl.multiply, 2.0, engine=nisa.engine.scalar)


@case(q("tensor_scalar: operand 'engine' ScalarE on trn2 supports only (multiply, add)"),
      tgt="trn2")
def ts_scalar_engine_combo_trn2():
    nisa.tensor_scalar(sb((4, 8)), sb((4, 8)), nl.subtract, 2.0, engine=nisa.engine.scalar)


@case(q("tensor_scalar: operand 'engine' bitwise tensor_scalar runs on VectorE only"))
def ts_bitwise_gpsimd():
    nisa.tensor_scalar(sb((4, 8), nl.int32), sb((4, 8), nl.int32), nl.bitwise_or, 1,
                       engine=nisa.engine.gpsimd)


@case(q("tensor_scalar: operand 'operand0' must be a (4, 1) tensor; got (4, 2)"))
def ts_bitwise_operand_shape():
    nisa.tensor_scalar(sb((4, 8), nl.int32), sb((4, 8), nl.int32), nl.bitwise_or,
                       sb((4, 2), nl.int32))


@case(q("tensor_scalar: operand 'operand0' must be an integer for a bitwise op; got 1.5"))
def ts_bitwise_float_operand():
    nisa.tensor_scalar(sb((4, 8), nl.int32), sb((4, 8), nl.int32), nl.left_shift, 1.5)


@case(q("tensor_scalar: operand 'operand0' is required"))
def ts_operand_none():
    nisa.tensor_scalar(sb((4, 8)), sb((4, 8)), nl.add, None)


@case(q("tensor_scalar: operand 'operand0' must be a (4, 1) per-partition tensor; got shape "
        "(4, 2)"))
def ts_vector_operand_shape():
    nisa.tensor_scalar(sb((4, 8)), sb((4, 8)), nl.add, sb((4, 2)))


@case(q("tensor_scalar: operand 'operand1' must be a Python number or a (4, 1) tensor; got str"))
def ts_operand_string():
    nisa.tensor_scalar(sb((4, 8)), sb((4, 8)), nl.add, 1.0, op1=nl.add, operand1="2")


@case(q("tensor_scalar: operand 'data' is in PSUM; GpSimd cannot access PSUM"))
def ts_rsqrt_gpsimd_psum():
    nisa.tensor_scalar(sb((4, 8)), ps((4, 8)), nl.rsqrt, None)


@case(q("tensor_copy: operand 'engine' ScalarE tensor_copy needs Trn2 or newer"), tgt="trn1")
def tc_scalar_trn1():
    nisa.tensor_copy(sb((4, 8)), sb((4, 8)), engine=nisa.engine.scalar)


@case(q("tensor_copy: operand 'dst' cannot convert MX packed data (nl.float8_e4m3fn_x4 -> "
        "nl.uint32)"))
def tc_x4_cast():
    nisa.tensor_copy(sb((4, 8), nl.uint32), sb((4, 8), nl.float8_e4m3fn_x4))


@case(q("tensor_copy: operand 'src' is in PSUM; GpSimd cannot access PSUM"))
def tc_gpsimd_psum():
    nisa.tensor_copy(sb((4, 8)), ps((4, 8)), engine=nisa.engine.gpsimd)


@case(q("tensor_copy: operand 'engine' tensor cannot run tensor_copy"))
def tc_tensor_engine():
    nisa.tensor_copy(sb((4, 8)), sb((4, 8)), engine=nisa.engine.tensor)


@case(q("tensor_copy: operand 'engine' got the integer 5; integer enum values are rejected"))
def tc_int_engine():
    nisa.tensor_copy(sb((4, 8)), sb((4, 8)), engine=5)


@case(q("tensor_reduce: operand 'op' nl.subtract is not a reduction operator"))
def tr_subtract():
    nisa.tensor_reduce(sb((4, 1)), nl.subtract, sb((4, 8)), axis=1)


@case(q("tensor_reduce: operand 'op' must be an ALU operator"))
def tr_comparison_op():
    nisa.tensor_reduce(sb((4, 1)), nl.greater, sb((4, 8)), axis=1)


@case(q("tensor_reduce: operand 'axis' the partition axis (0) cannot be reduced"))
def tr_axis0():
    nisa.tensor_reduce(sb((1, 8)), nl.add, sb((4, 8)), axis=0)


@case(q("tensor_reduce: operand 'axis' 1: reduction axes must be the trailing free dims"))
def tr_axis_not_trailing():
    nisa.tensor_reduce(sb((4, 8)), nl.add, sb((4, 2, 8)), axis=1)


@case(q("tensor_reduce: operand 'dst' has shape (4, 8); reducing (4, 2, 8) over (2,) gives 4 x 2"))
def tr_dst_shape():
    nisa.tensor_reduce(sb((4, 8)), nl.add, sb((4, 2, 8)), axis=2)


@case(q("memset: operand 'value' must be a Python number; got str"))
def ms_string_value():
    nisa.memset(sb((4, 8)), "1")


@case(q("memset: operand 'value' MX packed nl.float8_e4m3fn_x4 can only be memset to 0"))
def ms_x4_nonzero():
    nisa.memset(sb((4, 8), nl.float8_e4m3fn_x4), 1)


@case(q("memset: operand 'value' must be an int for the integer dtype nl.int32; got 1.5"))
def ms_float_into_int():
    nisa.memset(sb((4, 8), nl.int32), 1.5)


@case(q("memset: operand 'dst' is in PSUM; GpSimd cannot access PSUM"))
def ms_gpsimd_psum():
    nisa.memset(ps((4, 8)), 0.0, engine=nisa.engine.gpsimd)


@case(q("activation_reduce: operand 'reduce_res' is required"))
def ar_no_reduce_res():
    nisa.activation_reduce(sb((4, 8)), nl.exp, sb((4, 8)), nl.add, None)


@case(q("activation: operand 'op' must be an activation function such as nl.exp"))
def act_alu_op():
    nisa.activation(sb((4, 8)), nl.add, sb((4, 8)))


@case(q("activation: operand 'engine' must be scalar (or gpsimd on Trn3); got vector"))
def act_vector_engine():
    nisa.activation(sb((4, 8)), nl.exp, sb((4, 8)), engine=nisa.engine.vector)


@case(q("activation: activation on GpSimd needs Trn3 (gen4) or newer"), tgt="trn2")
def act_gpsimd_trn2():
    nisa.activation(sb((4, 8)), nl.exp, sb((4, 8)), engine=nisa.engine.gpsimd)


@case(q("activation: operand 'reduce_cmd' the accumulator is only available on ScalarE"))
def act_gpsimd_reduce():
    nisa.activation(sb((4, 8)), nl.exp, sb((4, 8)), engine=nisa.engine.gpsimd,
                    reduce_op=nl.add, reduce_cmd=nisa.reduce_cmd.reset_reduce)


@case(q("activation: operand 'bias' a Python float bias needs Trn2 or newer"), tgt="trn1")
def act_float_bias_trn1():
    nisa.activation(sb((4, 8)), nl.exp, sb((4, 8)), bias=0.5)


@case(q("activation: operand 'bias' cannot be tfloat32"))
def act_tf32_bias():
    nisa.activation(sb((4, 8)), nl.exp, sb((4, 8)), bias=sb((4, 1), nl.tfloat32))


@case(q("activation: operand 'bias' must be a (4, 1) per-partition tensor; got shape (4, 8)"))
def act_bias_full_tile():
    nisa.activation(sb((4, 8)), nl.exp, sb((4, 8)), bias=sb((4, 8)))


@case(q("activation: operand 'reduce_op' must be nl.add (ScalarE registers only sum)"))
def act_reduce_max():
    nisa.activation(sb((4, 8)), nl.exp, sb((4, 8)), reduce_op=nl.maximum,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)


@case(q("activation: operand 'reduce_op' is required with reduce_cmd=reduce"))
def act_reduce_without_op():
    nisa.activation(sb((4, 8)), nl.exp, sb((4, 8)), reduce_cmd=nisa.reduce_cmd.reduce)


@case(q("activation: operand 'reduce_cmd' load_reduce is a VectorE command"))
def act_load_reduce():
    nisa.activation(sb((4, 8)), nl.exp, sb((4, 8)), reduce_op=nl.add,
                    reduce_cmd=nisa.reduce_cmd.load_reduce)


@case(q("activation: operand 'reduce_cmd' got the integer 3; integer enum values are rejected"))
def act_int_reduce_cmd():
    nisa.activation(sb((4, 8)), nl.exp, sb((4, 8)), reduce_op=nl.add, reduce_cmd=3)


@case(q("activation: operand 'reduce_res' must be (4, 1); got (4, 2)"))
def act_reduce_res_shape():
    nisa.activation(sb((4, 8)), nl.exp, sb((4, 8)), reduce_op=nl.add,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=sb((4, 2)))


@case(q("iota: operand 'pattern' must be 1 to 4 [step, count] pairs"))
def iota_five_dims():
    nisa.iota(sb((4, 1)), [[1, 1]] * 5)


@case(q("iota: operand 'pattern' covers 4 elements per partition but dst has 8"))
def iota_count():
    nisa.iota(sb((4, 8), nl.int32), [[1, 4]])


@case(q("iota: operand 'dst' is in PSUM, which this engine/operand cannot access"))
def iota_psum():
    nisa.iota(ps((4, 8), nl.int32), [[1, 8]])


@case(q("reciprocal: operand 'dst' has 16 elements per partition"))
def recip_shape():
    nisa.reciprocal(sb((4, 16)), sb((4, 8)))


# ======================================================================= isa/misc.py
@case(q("register_move: operand 'dst' must be a VirtualRegister"))
def reg_move_bad_dst():
    nisa.register_move(5, 3)


@case(q("register_load: operand 'src' must be an NkiTensor; got int"))
def reg_load_not_tensor():
    nisa.register_load(nisa.register_alloc(0), 5)


@case(q("register_load: operand 'src' must be in SBUF or HBM"))
def reg_load_psum():
    nisa.register_load(nisa.register_alloc(0), ps((1, 1), nl.int32))


@case(q("register_load: operand 'src' must hold exactly one element; has shape (1, 2)"))
def reg_load_two():
    nisa.register_load(nisa.register_alloc(0), sb((1, 2), nl.int32))


@case(q("register_load: operand 'src' cannot be a packed nl.float8_e4m3fn_x4 tensor"))
def reg_load_x4():
    nisa.register_load(nisa.register_alloc(0), sb((1, 1), nl.float8_e4m3fn_x4))


@case(q("register_load: operand 'dst' must be a VirtualRegister"))
def reg_load_bad_dst():
    nisa.register_load(None, sb((1, 1), nl.int32))


@case(q("register_store: operand 'src' must be a VirtualRegister"))
def reg_store_bad_src():
    nisa.register_store(sb((1, 1), nl.int32), 3)


@case(q("scalar_load: operand 'src' must be int32 or int64; got nl.int16"))
def scalar_load_int16():
    nisa.scalar_load(sb((1, 1), nl.int16))


@case(q("scalar_store: operand 'value' must be an NkiScalar (Python ints are not accepted)"))
def scalar_store_int():
    nisa.scalar_store(sb((1, 1), nl.int32), 3)


@case(q("scalar_store: operand 'dst' has dtype nl.int64; a 32-bit scalar needs nl.int32"))
def scalar_store_dtype():
    t = sb((1, 1), nl.int32)
    nisa.memset(t, 3)
    nisa.scalar_store(sb((1, 1), nl.int64), nisa.scalar_load(t))


@case(q("core_barrier: operand 'cores' core_barrier needs an LNC=2 launch (kernel[2])"))
def barrier_lnc1():
    nisa.core_barrier(nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm), (0, 1))


@case(q("core_barrier: this instruction needs Trn2 (gen3) or newer; the target is trn1"),
      tgt="trn1")
def barrier_trn1():
    nisa.core_barrier(nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm), (0, 1))


@case(q("core_barrier: operand 'cores' must be (0, 1); got (0, 2)"), lnc=2)
def barrier_bad_cores():
    nisa.core_barrier(nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm), (0, 2))


@case(q("core_barrier: operand 'data' must be the nl.shared_hbm tensor both cores wrote"), lnc=2)
def barrier_private_data():
    nisa.core_barrier(hb((2, 2)), (0, 1))


@case(q("sendrecv: operand 'send_to_rank' sendrecv needs an LNC=2 launch (kernel[2])"))
def sendrecv_lnc1():
    t = sb((4, 8))
    nisa.sendrecv(t, sb((4, 8)), 1, 1, 0)


@case(q("sendrecv: operand 'src' must be an SBUF tensor"), lnc=2)
def sendrecv_hbm_src():
    nisa.sendrecv(hb((4, 8)), sb((4, 8)), 1 - nl.program_id(0), 1 - nl.program_id(0), 0)


@case(q("sendrecv: operand 'dst' must match src in shape and dtype"), lnc=2)
def sendrecv_shape_mismatch():
    o = 1 - nl.program_id(0)
    nisa.sendrecv(sb((4, 8)), sb((4, 8), nl.bfloat16), o, o, 0)


@case(q("sendrecv: operand 'send_to_rank' program 0 can only exchange with rank 1"), lnc=2)
def sendrecv_to_self():
    me = nl.program_id(0)
    nisa.sendrecv(sb((4, 8)), sb((4, 8)), me, me, 0)


# ======================================================================= isa/_common.py
@case(q("tensor_copy: operand 'src' must be an NkiTensor; got ndarray"))
def common_not_tensor():
    nisa.tensor_copy(sb((4, 8)), np.zeros((4, 8), np.float32))


@case(q("nc_matmul: operand 'perf_mode' got the integer 1; integer enum values are rejected"))
def common_int_perf_mode():
    nisa.nc_matmul(ps((4, 8)), sb((8, 4)), sb((8, 8)), perf_mode=1)


@case(q("tensor_copy: operand 'src' is a vector-offset (DMA gather/scatter) view"))
def common_vector_offset_defensive():
    # defensive: vector-offset views only exist on HBM, which on_chip rejects first
    t = sb((4, 8))
    i = idx_tile([0, 1, 2, 3])
    v = NkiTensor(t.storage, t.dtype, (4, 8), (8, 1),
                  vec=hb((4, 8)).ap([[8, 4], [1, 8]], vector_offset=i)._vec)
    nisa.tensor_copy(sb((4, 8)), v)


@case(q("tensor_copy: operand 'src' has partition dimension 256, exceeding the maximum 128"))
def common_partitions_defensive():
    t = sb((128, 8))
    nisa.tensor_copy(sb((128, 8)), NkiTensor(t.storage, t.dtype, (256, 4), (4, 1)))


@case(q("tensor_copy: operand 'src' must address contiguous partitions (partition stride 16 != "
        "per-partition size 8)"))
def common_partition_stride_defensive():
    t = sb((8, 8))
    nisa.tensor_copy(sb((4, 8)), NkiTensor(t.storage, t.dtype, (4, 8), (16, 1)))


@case(q("tensor_copy: operand 'src' free-dim access [0, 15] leaves its partition row of 8 "
        "elements"))
def common_free_access_leaves_row():
    nisa.tensor_copy(sb((4, 16)), sb((4, 8)).ap([[8, 4], [1, 16]]))


@case(q("tensor_copy: operand 'src' spans partitions [126, 130), past 128"))
def common_partition_overflow():
    nisa.tensor_copy(sb((4, 8)), sb((128, 8)).ap([[8, 4], [1, 8]], offset=126 * 8))


@case(q("tensor_copy: operand 'src' needs 5 free-dim access-pattern entries after merging"))
def common_five_free_dims_defensive():
    # defensive: public views have at most 5 dims, i.e. at most 4 free dims
    t = sb((2, 64))
    v = NkiTensor(t.storage, t.dtype, (2, 2, 2, 2, 2, 2), (64, 40, 12, 5, 3, 1))
    nisa.tensor_copy(sb((2, 32)), v)


@case(q("tensor_copy: operand 'dst' has a free dim of 70000; access-pattern counts are 16-bit"))
def common_free_dim_count():
    t = sb((1, 70000), nl.uint8)
    nisa.tensor_copy(t, t)


@case(q("tensor_scalar: nl.divide has no hardware instruction"), exc=NkiHardwareWarning)
def common_sim_only_op_warns():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", NkiHardwareWarning)
        nisa.tensor_scalar(sb((4, 8)), sb((4, 8)), nl.divide, 2.0)


# ======================================================================= language.py
@case(q("nl.ndarray: on-chip (sbuf) tensors are at least 2-D [partitions, free...]; got shape "
        "(8,)"))
def lang_1d_on_chip():
    sb((8,))


@case(q("nl.ndarray: sbuf tensor 'big' has 256 partitions (dim 0); the maximum is 128"))
def lang_partitions_over_128():
    sb((256, 4), name="big")


@case(q("nl.ndarray: psum tensor '' has 129 partitions (dim 0); the maximum is 128"))
def lang_psum_partitions_over_128():
    ps((129, 4))


@case(q("nl.ndarray: MX packed dtype nl.float8_e4m3fn_x4 needs Trn3 (gen4); target is trn2"),
      tgt="trn2")
def lang_x4_trn2():
    sb((4, 8), nl.float8_e4m3fn_x4)


@case(q("nl.ndarray: PSUM tensor 'p' needs 16388 bytes per partition; PSUM has 16384"))
def lang_psum_too_wide():
    ps((128, 4097), name="p")


@case(q("nl.ndarray: address= is only for SBUF/PSUM tensors"))
def lang_address_hbm():
    nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm, address=(0, 0))


@case(q("nl.fori_loop cannot be used inside nl.no_reorder()"))
def lang_fori_in_no_reorder():
    with nl.no_reorder():
        nl.fori_loop(0, 2, lambda i: None)


@case(q("nl.fori_loop: step must be a positive compile-time int; got 0"))
def lang_fori_step0():
    nl.fori_loop(0, 2, lambda i: None, step=0)


@case(q("nl.fori_loop: body_fun must return None"))
def lang_fori_returns():
    nl.fori_loop(0, 2, lambda i: i)


@case(q("nl.while_loop: body_fun must return the next condition register"))
def lang_while_returns_tensor():
    nl.while_loop(nisa.register_alloc(1), lambda r: sb((1, 1)))


@case(r"nl.ndarray: dtype must be an NKI dtype object.*NumPy dtypes and strings are not accepted",
      exc=TypeError)
def lang_numpy_dtype():
    nl.ndarray((4, 8), np.float32)


@case(r"nl.ndarray: dtype must be an NKI dtype object", exc=TypeError)
def lang_string_dtype():
    nl.ndarray((4, 8), "bfloat16")


@case(r"nl.ndarray: buffer must be nl.sbuf.*strings are rejected since NKI 0.3.0", exc=TypeError)
def lang_string_buffer():
    nl.ndarray((4, 8), nl.float32, buffer="sbuf")


@case(r"nl.ndarray: shape entries must be positive", exc=ValueError)
def lang_zero_shape():
    sb((4, 0))


@case(r"nl.add: shapes \(4, 8\) and \(4, 1\) differ; the nl element-wise ops do not broadcast")
def lang_convenience_op():
    nl.add(sb((4, 8)), sb((4, 1)))


@case(r"nki.isa.nc_matmul_mx is not implemented|nc_matmul_mx", exc=(NotImplementedError,
                                                                     NkiValidationError))
def lang_missing_instruction():
    nisa.nc_matmul_mx(ps((4, 8)), sb((32, 4)), sb((32, 8)), sb((4, 4), nl.uint8),
                      sb((4, 8), nl.uint8))


# ======================================================================= runtime.py
@case(r"nl.ndarray: SBUF tensor 'x' at address=\(0, 200000\) with 32000 bytes per partition ends "
      r"past the usable 212992 bytes per partition on trn2", tgt="trn2")
def rt_sbuf_address_past_end():
    sb((4, 8000), name="x", address=(0, 200000))


@case(q("nl.ndarray: SBUF tensor 'y' spans partitions [100, 164), past the 128 partitions"))
def rt_sbuf_partitions_past_end():
    sb((64, 8), name="y", address=(100, 0))


@case(q("'a' (sbuf) allocated at test_checks.py:") + r"\d+" + q(" is used after its space was "
        "reused: its space went to 'b' allocated at test_checks.py:") + r"\d+" + q(", which did not "
        "fit beside the live sbuf tiles (240000 bytes per partition needed, the limit is 212992 "
        "usable bytes per partition on trn2)"), tgt="trn2")
def rt_sbuf_capacity():
    a = sb((128, 30000), name="a")
    b = sb((128, 30000), name="b")
    nisa.memset(a, 0.0)       # SBUF space is taken at first use (liveness): both used, both live
    nisa.memset(b, 0.0)       # b takes a's space (a could be dead: the compiler frees after last use)
    nisa.memset(a, 1.0)       # ... it is not: both live at once, over capacity
    del a, b


@case(r"nl.ndarray: SBUF capacity exceeded on trn2: allocating b of 220000 bytes per partition "
      r"needs 220000 bytes per partition .* limit is 212992", tgt="trn2")
def rt_sbuf_tile_over_capacity():
    b = sb((128, 55000), name="b")
    nisa.memset(b, 0.0)


@case(q("nl.ndarray: PSUM address free offset 1024 must be a multiple of the 2048-byte bank size"))
def rt_psum_address_unaligned():
    ps((4, 8), address=(0, 1024))


@case(q("nl.ndarray: PSUM tensor 'q' ends at byte 18432, past the 16384 bytes per partition"))
def rt_psum_address_past_end():
    ps((4, 1024), name="q", address=(0, 14336))


@case(r"nl.ndarray: PSUM capacity exceeded on trn3: no room for p8 of 2048 bytes per partition "
      r"\(16384 of 16384 bytes per partition live in 8 tiles")
def rt_psum_nine_banks():
    # nine separate allocations (not one statement run nine times), all live at once
    live = [ps((128, 512), name="p0"), ps((128, 512), name="p1"), ps((128, 512), name="p2"),
            ps((128, 512), name="p3"), ps((128, 512), name="p4"), ps((128, 512), name="p5"),
            ps((128, 512), name="p6"), ps((128, 512), name="p7"), ps((128, 512), name="p8")]
    del live


@case(r"nl.ndarray: shared_hbm allocation #0 is \(4, 4\) nl.float32 in one program and \(8, 8\) "
      r"nl.float32 in the other", lnc=2)
def rt_shared_alloc_mismatch():
    n = 4 if nl.program_id(0) == 0 else 8
    nl.ndarray((n, n), nl.float32, buffer=nl.shared_hbm)


@case(r"k: program 0 waits at a core_barrier/sendrecv that program 1 never reached", lnc=2)
def rt_barrier_deadlock():
    out = nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm)
    if nl.program_id(0) == 0:
        nisa.core_barrier(out, (0, 1))


# ======================================================================= tensor.py
@case(q("view of '': 6 dims; NKI views have at most 5"))
def t_six_dims():
    hb((2, 2, 2, 2, 2)).expand_dim(0)


@case(q("indexing: 'd' is an indirect (vector_offset) view, which cannot be re-indexed"))
def t_index_indirect():
    i = idx_tile([0, 1])
    d = nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="d")
    d.ap([[8, 2], [1, 8]], vector_offset=i)[0]


@case(q("reshape: 'd' is an indirect (vector_offset) view"))
def t_reshape_indirect():
    i = idx_tile([0, 1])
    d = nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="d")
    d.ap([[8, 2], [1, 8]], vector_offset=i).reshape((16,))


@case(q("indexing 't': partition dim slices must be contiguous (step 1); got step 2"))
def t_partition_step():
    sb((8, 8), name="t")[::2]


@case(q("broadcast: on-chip tensors cannot change the partition dim (dim 0)"))
def t_broadcast_dim0():
    sb((1, 8)).broadcast(0, 4)


@case(q("squeeze_dim: on-chip tensors cannot change the partition dim (dim 0)"))
def t_squeeze_dim0():
    sb((1, 8)).squeeze_dim(0)


@case(q("reshape_dim: on-chip tensors cannot change the partition dim (dim 0)"))
def t_reshape_dim0():
    sb((8, 8)).reshape_dim(0, (2, 4))


@case(q("select: on-chip tensors cannot select on the partition dim"))
def t_select_dim0():
    sb((8, 8)).select(0, 1)


@case(q("select: on-chip tensors cannot change the partition dim (dim 0)"))
def t_select_dynamic_dim0():
    sb((8, 8)).select(0, idx_tile([1]))


@case(q("permute: on-chip tensors must keep the partition dim first"))
def t_permute_dim0():
    sb((8, 4)).permute((1, 0))


@case(q("expand_dim: on-chip tensors keep the partition dim first"))
def t_expand_dim0():
    sb((8, 4)).expand_dim(0)


@case(q("flatten_dims: on-chip tensors keep the partition dim"))
def t_flatten_dim0():
    sb((8, 4)).flatten_dims(0, 1)


@case(q("flatten_dims: dims 1..2 of 't' are not contiguous"))
def t_flatten_noncontig():
    sb((8, 4, 6), name="t").permute((0, 2, 1)).flatten_dims(1, 2)


@case(q("reshape: on-chip tensors keep the partition dim; (8, 4) -> (4, 8) changes it"))
def t_reshape_partition():
    sb((8, 4)).reshape((4, 8))


@case(q("reshape: the layout of 't' (shape (8, 6, 4), strides (24, 1, 6)) does not allow shape "
        "(8, 24) without a copy"))
def t_reshape_copy():
    sb((8, 4, 6), name="t").permute((0, 2, 1)).reshape((8, 24))


@case(q("view: the last dim of 't' must be contiguous to reinterpret nl.float32 as nl.bfloat16"))
def t_view_noncontig():
    sb((4, 8), name="t")[:, ::2].view(nl.bfloat16)


@case(q("view: not allowed after a dynamic select / ds"))
def t_view_after_ds():
    h = hb((4, 8))

    def body(i):
        h[nl.ds(i, 2), :].view(nl.bfloat16)
    nl.fori_loop(0, 1, body)


@case(q("view: 't' of shape (4, 3) (nl.bfloat16) cannot be viewed as nl.float32: sizes and "
        "offsets must be divisible by 2"))
def t_view_indivisible():
    sb((4, 3), nl.bfloat16, name="t").view(nl.float32)


@case(q("ap on 'h': scalar_offset and vector_offset are mutually exclusive"))
def t_ap_both_offsets():
    i = idx_tile([0, 1])
    nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="h").ap(
        [[8, 2], [1, 8]], scalar_offset=idx_tile([0]), vector_offset=i)


@case(q("ap on 'h': every count must be positive"))
def t_ap_zero_count():
    nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="h").ap([[8, 0], [1, 8]])


@case(q("ap on 't': on-chip access patterns must address whole partitions: the first [stride, "
        "count] pair's stride must be the free size of the tensor (8) or of its allocation (8) "
        "in nl.float32 elements; got 16"))
def t_ap_partition_stride():
    sb((8, 8), name="t").ap([[16, 4], [1, 8]])


@case(q("ap on 't': on-chip access patterns must address whole partitions: the first [stride, "
        "count] pair's stride must be the free size of the tensor (4) or of its allocation (8) "
        "in nl.float32 elements; got 6"))
def t_ap_partition_stride_view():
    sb((8, 8), name="t")[:, 0:4].ap([[6, 4], [1, 4]])


@case(q("ap on 't': partition count 129 exceeds 128"))
def t_ap_partition_count():
    sb((128, 8), name="t").ap([[8, 129], [1, 8]])


@case(q("ap on 'h': 6 dims; at most 5"))
def t_ap_six_dims():
    nl.ndarray((64,), nl.float32, buffer=nl.hbm, name="h").ap([[32, 2], [16, 2], [8, 2],
                                                               [4, 2], [2, 2], [1, 2]])


@case(q("ap on 'h': indirect_dim 2 out of range"))
def t_ap_indirect_dim_range():
    nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="h").ap(
        [[8, 2], [1, 8]], scalar_offset=idx_tile([0]), indirect_dim=2)


@case(q("ap on 't': vector_offset is only valid on HBM tensors (DMA gather/scatter)"))
def t_ap_vector_offset_sbuf():
    sb((4, 8), name="t").ap([[8, 2], [1, 8]], vector_offset=idx_tile([0, 1]))


@case(q("ap on 'h': vector_offset needs indirect_dim=0"))
def t_ap_vector_offset_dim1():
    nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="h").ap(
        [[8, 2], [1, 8]], vector_offset=idx_tile([0, 1]), indirect_dim=1)


@case(q("ap on 'h': vector_offset has 3 rows but the pattern's first count is 2"))
def t_ap_vector_offset_rows():
    nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="h").ap(
        [[8, 2], [1, 8]], vector_offset=idx_tile([0, 1, 2]))


@case(q("ap on 'h': vector_offset must be an SBUF tensor"))
def t_ap_vector_offset_hbm():
    nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="h").ap(
        [[8, 2], [1, 8]], vector_offset=nl.ndarray((2, 1), nl.int32, buffer=nl.hbm))


@case(q("ap on 'h': vector_offset must have an integer dtype; got nl.float32"))
def t_ap_vector_offset_float():
    nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="h").ap(
        [[8, 2], [1, 8]], vector_offset=sb((2, 1)))


@case(q("ap on 'h': scalar_offset must have shape (1, 1); got (2, 1)"))
def t_ap_scalar_offset_shape():
    nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="h").ap(
        [[8, 2], [1, 8]], scalar_offset=idx_tile([0, 1]))


@case(r"ap on 'h': scalar_offset must be a \(1,1\) SBUF int tensor", exc=TypeError)
def t_ap_scalar_offset_float():
    nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="h").ap([[8, 2], [1, 8]],
                                                               scalar_offset=1.5)


@case(r"dynamic offset out of bounds on 't': \(value, extent, size\) = \[\(6, 8, 4\)\]",
      exc=NkiRuntimeError)
def t_dynamic_oob_in_compute():
    t = sb((4, 8), name="t")

    def body(i):
        nisa.tensor_copy(sb((4, 4)), t[:, nl.ds(i, 4)])
    nl.fori_loop(6, 7, body)


@case(q("access to 'h' is out of bounds: elements [0, 27] of an allocation of 16 nl.float32 "
        "elements"))
def t_access_out_of_allocation():
    h = nl.ndarray((4, 4), nl.float32, buffer=nl.hbm, name="h")
    nisa.dma_copy(sb((4, 16)), h.ap([[4, 4], [1, 16]]))


@case(q("gather/scatter on 'h' reaches outside the allocation of 240 elements"))
def t_gather_outside_allocation():
    h = nl.ndarray((40, 6), nl.float32, buffer=nl.hbm, name="h")
    nisa.dma_copy(sb((2, 12)), h.ap([[6, 2], [1, 12]], vector_offset=idx_tile([0, 39])))


@case(q("indirect read of 'h': vector_offset rows [1] are out of bounds [0, 4) with "
        "oob_mode.error"), exc=NkiRuntimeError)
def t_indirect_read_oob():
    h = nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="h")
    nisa.dma_copy(sb((2, 8)), h.ap([[8, 2], [1, 8]], vector_offset=idx_tile([0, 4])))


@case(q("indirect write to 'h': vector_offset rows [0] are out of bounds [0, 4) with "
        "oob_mode.error"), exc=NkiRuntimeError)
def t_indirect_write_oob():
    h = nl.ndarray((4, 8), nl.float32, buffer=nl.hbm, name="h")
    nisa.dma_copy(h.ap([[8, 2], [1, 8]], vector_offset=idx_tile([-1, 2])), nl.zeros((2, 8),
                                                                                    nl.float32))


@case(q("'t': MX packed nl.float8_e4m3fn_x4 data can only be read by nc_matmul_mx, DMA and view()"))
def t_read_x4_in_compute():
    t = sb((4, 8), nl.float8_e4m3fn_x4, name="t")
    nisa.tensor_tensor(sb((4, 8)), t, t, nl.add)


@case(r"slice step must be >= 1 in NKI; got -1", exc=IndexError)
def t_negative_step():
    hb((4, 8))[::-1]


@case(r"nl.ds size 16 exceeds dim 0", exc=IndexError)
def t_ds_too_big():
    h = hb((8, 8))
    nl.fori_loop(0, 1, lambda i: h[nl.ds(i, 16)] and None)


@case(q("dma_copy: operand 'src' is an empty view (shape (0, 8))"))
def t_empty_view_operand():
    # the view itself may be made (a core with no rows, nl.ds(i, 0)); no instruction takes it
    h = hb((8, 8))
    assert h[nl.ds(3, 0)].shape == (0, 8) and h[8:8].shape == (0, 8)
    nisa.dma_copy(dst=sb((1, 8)), src=h[nl.ds(3, 0)])


@case(q("tensor_copy: operand 'src' is an empty view (shape (4, 0))"))
def t_empty_view_compute():
    nisa.tensor_copy(sb((4, 8)), sb((4, 8))[:, 2:2])


@case(r"nl.ds: size must be a non-negative compile-time int; got -1", exc=ValueError)
def t_ds_negative():
    hb((8, 8))[nl.ds(0, -1)]


@case(r"NkiTensor.indirect .* is not implemented", exc=NotImplementedError)
def t_indirect_not_implemented():
    sb((4, 8)).indirect(idx_tile([0, 1, 2, 3]))


# ======================================================================= run them
@pytest.mark.parametrize("body,exc,match,tgt,lnc", CASES)
def test_check(body, exc, match, tgt, lnc):
    @jit
    def k():
        body()

    kern = k[lnc] if lnc else k
    with target(tgt), pytest.raises(exc, match=match):
        kern()


# ======================================================================= jit.py and friends
def _noop():
    pass


def test_list_kernel_argument_rejected():
    @jit
    def k(xs):
        pass
    with pytest.raises(NkiValidationError, match=q("kernel argument 'xs' is a list; lists are "
                                                   "not allowed as kernel arguments")):
        k([1, 2])
    k((1, 2))   # tuples are fine


def test_unsupported_kernel_argument_type_rejected():
    @jit
    def k(s):
        pass
    with pytest.raises(NkiValidationError, match=q("kernel argument 's' has unsupported type set")):
        k({1, 2})


def test_jit_applied_twice_rejected():
    with pytest.raises(NkiValidationError, match=q("nki.jit applied twice to f")):
        def f():
            pass
        jit(jit(f))




@pytest.mark.parametrize("grid,msg", [(3, "k[3]: the launch grid is the LNC degree and must be "
                                          "1 or 2"),
                                      ((2, 2), "k[(2, 2)]: only a single integer LNC degree"),
                                      ("2", "k['2']: the launch grid"),
                                      (8, "k[8]: the launch grid")])
def test_bad_launch_grid_rejected(grid, msg):
    @jit
    def k():
        pass
    with pytest.raises(NkiValidationError, match=q(msg)):
        k[grid]


@pytest.mark.parametrize("kw", ["mode", "platform_target"])
def test_removed_jit_options_rejected(kw):
    with pytest.raises(NkiValidationError, match=q(f"nki.jit: nki.jit({kw}=...) removed in NKI 0.7")):
        jit(_noop, **{kw: "simulation"})


def test_unknown_jit_option_rejected():
    with pytest.raises(TypeError, match=q("nki.jit: unknown options ['fast']")):
        jit(_noop, fast=True)


def test_lnc_env_value_rejected(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "3")
    with pytest.raises(NkiValidationError, match=q("NEURON_LOGICAL_NC_CONFIG must be 1 or 2; "
                                                   "got '3'")):
        jit(_noop)()


def test_lnc2_on_trn1_rejected():
    with target("trn1"), pytest.raises(NkiValidationError,
                                       match=q("_noop: LNC=2 needs Trn2 or Trn3; target is trn1")):
        jit(_noop)[2]()


@pytest.mark.parametrize("buf", ["hbm", "private_hbm", "sbuf"])
def test_output_not_in_shared_hbm_rejected(buf):
    @jit
    def k():
        return nl.ndarray((4, 4), nl.float32, buffer=getattr(nl, buf))
    where = "private_hbm" if buf == "hbm" else buf
    with pytest.raises(NkiValidationError, match=rf"k: returned tensor .* is in {where}; kernel "
                                                  r"outputs must be allocated in nl.shared_hbm"):
        k()


def test_non_tensor_output_rejected():
    @jit
    def k():
        return 3
    with pytest.raises(NkiValidationError, match=q("k: kernels return nl.shared_hbm tensors (or a "
                                                   "tuple of them); got int")):
        k()


def test_unsupported_array_dtype_rejected():
    @jit
    def k(a):
        pass
    with pytest.raises(TypeError, match="arrays of dtype complex64 cannot be passed"):
        k(np.zeros(4, np.complex64))


def test_wrong_arity_reports_kernel_name():
    @jit
    def k(a):
        pass
    with pytest.raises(TypeError, match="^k: "):
        k()


def test_on_chip_allocation_outside_a_kernel_rejected():
    with pytest.raises(RuntimeError, match="only valid inside a kernel"):
        nl.program_id(0)


def test_program_id_axis_rejected():
    @jit
    def k():
        nl.program_id(1)
    with pytest.raises(ValueError, match=q("nl.program_id: only axis 0 exists")):
        k()


def test_target_name_rejected():
    with pytest.raises(ValueError, match="target must be one of"):
        with target("trn9"):
            pass


# ------------------------------------------------------------------------- capacity: positives
def test_psum_eight_banks_fit_and_are_freed():
    @jit
    def k():
        tiles = [ps((128, 512)) for _ in range(8)]         # all 8 banks
        del tiles
        again = [ps((128, 512)) for _ in range(8)]          # freed: fits again
        big = None
        del again
        big = ps((128, 4096))                               # all 16 KiB in one tile
        return None if big is not None else None
    k()


def test_sbuf_allocation_in_loop_body_is_freed():
    @jit
    def k():
        for _ in range(20):                                 # 20 x 80 KiB >> 208 KiB usable
            t = sb((128, 20480))
            nisa.memset(t[:, 0:4], 0.0)
    with target("trn2"):
        k()


def test_sbuf_large_loop_body_tile_is_reused():
    @jit
    def k():
        for _ in range(3):
            t = sb((128, 30000))                            # 120000 B, > half of 212992
            nisa.memset(t[:, 0:4], 0.0)
            p = ps((128, 2560))                             # 5 of the 8 PSUM banks
            nisa.memset(p[:, 0:4], 0.0)
    with target("trn2"):
        k()


def test_loop_body_tile_kept_past_its_iteration_is_a_capacity_error():
    """Once fixed, the overflow must still be reported when the earlier tile is really live."""
    @jit
    def k():
        kept = []
        for i in range(2):
            t = sb((128, 30000), name=f"t{i}")
            kept.append(t)
        for t in kept:
            nisa.memset(t[:, 0:4], 0.0)
        nisa.memset(kept[0][:, 0:4], 1.0)   # t0 used again while t1 is live: both must fit
    with target("trn2"), pytest.raises(NkiValidationError,
                                       match="'t0' .*used after its space was reused"):
        k()


def test_psum_refusal_names_the_allocating_line():
    """A capacity refusal names the kernel line that allocated the tile, as the user wrote it."""
    @jit
    def k():
        tiles = []
        for i in range(9):
            t = nl.ndarray((128, 512), nl.float32, buffer=nl.psum, name=f"acc{i}")   # ALLOC
            nisa.memset(t, 0.0)
            tiles.append(t)
        for t in tiles:
            nisa.memset(t, 1.0)     # all nine read after all were written: 9 banks of 8
    line = next(i for i, text in enumerate(open(__file__), 1) if text.rstrip().endswith("# ALLOC"))
    at = f"allocated at test_checks.py:{line}"
    with target("trn2"), pytest.raises(NkiValidationError) as err:
        k()
    assert str(err.value).startswith(f"'acc0' (psum) {at} is used after its space was reused: "
                                     f"the statement that allocated it at test_checks.py:{line} "
                                     "ran again (a later loop iteration)"), str(err.value)
