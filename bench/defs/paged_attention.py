"""Bench definition of paged attention (one serving step: a ragged batch of decodes and prompt
chunks over a paged KV cache).

Shapes: ``reference.shapes``: ``models`` runs ``PAGED_MODELS`` (the issue's rows, all paged with
block 64, bf16 and FP8 caches: chunked prefill of Llama-3-8B on one KV-head group, a 2K chunk over
0 / 8K / 32K cached tokens; a mixed step of 32 decodes at 4K + one fresh 2K chunk on 4 of the 8
KV heads, 16 query heads: one full decode row group); ``default`` runs ``PAGED_DEFAULT`` (the
mixed step in bf16: the serving path, both the decode and the prefill paths); ``fast`` / ``odd``
run ``PAGED_FAST`` (toy steps). The shape names say which slice of
the layer ran; every ratio is that of the full layer (the groups are independent).

FLOPs count attended (query, key) pairs only, 4 d per pair, causal and end-aligned within each
request (``reference.paged_attention.flops_paged_attention``); compulsory bytes are the KV tokens
each request reads, once, in the cache dtype, plus q and o (``bytes_paged_attention``).

Goals (the issue's, Trn3; Trn2 reported): the chunk rows at least 60% of the TensorE bf16 peak
(they declare the exponential ceiling of the prefill bench, which never binds on Trn3, so their %
of roof is their % of the TensorE peak); the mixed step at least 70% of the roof of its combined
compulsory work, max(FLOPs / TensorE peak, KV bytes / HBM roof): the harness's binding roof with
no other ceiling declared. The check compares the first and last 128 rows of each chunk and the
first and last decodes with the float64 reference by the attention rule.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels import paged_attention
from nki_kernels.bench.defs import BenchCase, EngineCeiling, check_rows, register
from nki_kernels.reference import shapes
from nki_kernels.reference.compare import assert_attention_close
from nki_kernels.reference.flash_attention import attended_pairs
from nki_kernels.reference.paged_attention import (
    bytes_paged_attention,
    flops_paged_attention,
    paged_attention_ref,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = {"trn2": ml_dtypes.float8_e4m3, "trn3": ml_dtypes.float8_e4m3fn}
GOAL_CHUNK = {"trn3": 60.0}
GOAL_MIXED = {"trn3": 70.0}
# exponentials per second per NeuronCore (as bench/defs/flash_attention.py): ScalarE 128 lanes x
# 1.2 GHz on Trn2, VectorE's exponential (4x) on Trn3
EXP_PER_S = {"trn2": 128 * 1.2e9, "trn3": 4 * 128 * 1.2e9}
CHECK_KEEP = 128              # chunk rows compared at each end of a chunk
KV_SCALE = 0.05               # FP8 cache scales (k and v)


def check_row_ids(q_lens, keep: int = CHECK_KEEP):
    """Rows of the step the check compares: the first and last ``keep`` rows of every chunk and
    the rows of the first and last requests with 1-8 rows (decodes, drafts)."""
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    small = [r for r, n in enumerate(q_lens) if 1 <= n <= 8]
    pick = []
    for r, n in enumerate(q_lens):
        if n > 8:
            pick.append(qsl[r] + check_rows(n, keep))
        elif n and r in (small[:1] + small[-1:]):
            pick.append(qsl[r] + np.arange(n))
    return np.concatenate(pick).astype(np.int64) if pick else np.zeros(0, np.int64)


def paged_case(s: shapes.PagedBenchShape, target: str) -> BenchCase:
    q_lens = tuple(int(x) for x in s.q_lens)
    lens = tuple(int(x) for x in s.seq_lens)
    fp8 = s.kv_dtype != "bfloat16"
    kv_dt = np.dtype(FP8[target]) if fp8 else BF16
    isz = kv_dt.itemsize
    hq, hkv, d, bs = s.n_q_heads, s.n_kv_heads, s.head_dim, s.page_size
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(qsl[-1])
    scales = dict(k_scale=KV_SCALE, v_scale=KV_SCALE) if fp8 else {}
    chunk = len(q_lens) == 1

    def make_inputs(rng):
        q = rng.standard_normal((T, hq, d), dtype=np.float32).astype(BF16)
        need = [-(-L // bs) for L in lens]
        nb = sum(need)
        k = rng.standard_normal((nb, bs, hkv, d), dtype=np.float32).astype(kv_dt)
        v = rng.standard_normal((nb, bs, hkv, d), dtype=np.float32).astype(kv_dt)
        perm = rng.permutation(nb).astype(np.int32)
        table = np.zeros((len(lens), max(need)), dtype=np.int32)
        i = 0
        for r, n in enumerate(need):
            table[r, :n] = perm[i:i + n]
            i += n
        return q, k, v, table, np.asarray(lens, dtype=np.int32), qsl

    def run(q, k, v, table, seq_lens, query_start_loc):
        return paged_attention(q, k, v, table, seq_lens, query_start_loc, lnc=s.lnc, **scales)

    def check(inputs, o):
        rows = check_row_ids(q_lens)
        exact, _ = paged_attention_ref(*inputs, compute_dtype=np.float64, rows=rows, **scales)
        same, _ = paged_attention_ref(*inputs, p_dtype="bfloat16", rows=rows, **scales)
        assert_attention_close(np.asarray(o)[rows], same[rows], exact[rows],
                               what=f"paged_attention {s.name}")

    ceilings = ()
    if chunk:
        exps = sum(attended_pairs(n, L) for n, L in zip(q_lens, lens) if n) * hq
        ceilings = (EngineCeiling("exp (ScalarE trn2 / VectorE trn3)", exps, EXP_PER_S),)
    dims = {"R": len(lens), "T": T, "Hq": hq, "Hkv": hkv, "d": d, "kv_tokens": sum(lens),
            "block": bs}
    return BenchCase(
        op="paged_attention", shape=s.name, dims=dims, dtype="fp8 KV" if fp8 else "bf16",
        make_inputs=make_inputs, run=run,
        flops=flops_paged_attention(lens, qsl, hq, d),
        bytes=bytes_paged_attention(lens, qsl, hq, hkv, d, kv_itemsize=isz), roof_kind="bf16",
        lnc=s.lnc, ceilings=ceilings, check=check,
        goal=(GOAL_CHUNK if chunk else GOAL_MIXED) if s in shapes.PAGED_MODELS else None)


@register("paged_attention")
def cases(tier: str, target: str):
    if tier == "models":
        rows = shapes.PAGED_MODELS
    elif tier == "default":
        rows = shapes.PAGED_DEFAULT
    else:
        rows = shapes.PAGED_FAST
    for s in rows:
        yield paged_case(s, target)
