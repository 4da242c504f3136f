"""Bench definition of decode attention (flash-decoding over contiguous and paged KV caches).

Shapes: ``reference.shapes``: tiers ``fast`` / ``odd`` use ``.decode`` (small, paged with the
shape's page size); ``default`` uses ``DECODE_DEFAULT`` (one row: Llama-3-8B B=8, 2K,
paged/64); ``models`` uses ``DECODE_MODELS`` (the issue's rows: Llama-3-8B at B = 1 / 8 / 64 and
2K-128K, Llama-3-70B TP8, a skewed 1 x 128K + 63 x 1K batch, paged (block 64) and contiguous,
bf16 and FP8 caches, s_q = 4, LNC=2).

Model slices: rows whose cache would not fit the emulator's memory run a slice of the KV heads,
4 of 8 (one full row group: every engine sees the per-byte work of the whole layer, whose other
row group is identical and runs after it; up to 600 MB of cache) or fewer; the shape name says
so. Compulsory bytes are the
KV actually read (valid tokens only, in the cache dtype) plus q and o (``reference``'s
``bytes_decode_attention``), of the slice that ran.

Goal (the issue's): at least 85% of the HBM roof on Trn3 and Trn2 for every row whose full-layer
cache read is 8 MB or more. The check compares with the float64 reference by the attention rule
(first and last sequences of big batches).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels.attention.decode_attention import decode_attention
from nki_kernels.bench.defs import BenchCase, register
from nki_kernels.reference import shapes
from nki_kernels.reference.compare import assert_attention_close
from nki_kernels.reference.decode_attention import (
    bytes_decode_attention,
    decode_attention_ref,
    flops_decode_attention,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = {"trn2": ml_dtypes.float8_e4m3, "trn3": ml_dtypes.float8_e4m3fn}
GOAL = {"trn2": 85.0, "trn3": 85.0}
GOAL_MIN_BYTES = 8e6          # the goal applies where the full layer reads >= 8 MB of cache
SLICE_BYTES = 300e6           # run a slice of the KV heads above this much cache ...
SLICE_MAX = 600e6             # ... the largest slice that still fits (4 heads: one row group)
CHECK_SEQS = 2                # sequences compared with the reference (first and last)


def _kv_heads_run(h_kv: int, tokens: int, d: int, isz: int) -> int:
    """All KV heads up to SLICE_BYTES of cache; else 4 (one full row group: the per-byte engine
    work of the whole layer) up to SLICE_MAX; else fewer (a half-full row group does more
    TensorE / VectorE work per byte than the layer: such rows understate the kernel)."""
    if 2 * tokens * h_kv * d * isz <= SLICE_BYTES:
        return h_kv
    for n, cap in ((4, SLICE_MAX), (2, SLICE_MAX), (1, SLICE_MAX)):
        if n <= h_kv and h_kv % n == 0 and 2 * tokens * n * d * isz <= cap:
            return n
    return 1


def decode_case(s, target: str) -> BenchCase:
    if isinstance(s, shapes.DecodeShape):          # fast / odd tiers: small paged shapes
        lens = tuple([s.kv_len + s.q_len] * s.batch)
        s = shapes.DecodeBenchShape(s.name, lens, s.q_len, s.n_q_heads, s.n_kv_heads,
                                    s.head_dim, s.page_size)
    lens = tuple(int(x) for x in s.lens)
    fp8 = s.kv_dtype != "bfloat16"
    kv_dt = np.dtype(FP8[target]) if fp8 else BF16
    isz = kv_dt.itemsize
    d, s_q = s.head_dim, s.q_len
    hkv = _kv_heads_run(s.n_kv_heads, sum(lens), d, isz)
    G = s.n_q_heads // s.n_kv_heads
    hq = G * hkv
    name = s.name if hkv == s.n_kv_heads else f"{s.name} ({hkv} of {s.n_kv_heads} KV heads)"
    bs = s.page_size
    scales = dict(k_scale=0.05, v_scale=0.05) if fp8 else {}

    def make_inputs(rng):
        B = len(lens)
        q = rng.standard_normal((B, s_q, hq, d), dtype=np.float32).astype(BF16)
        if bs:
            need = [-(-L // bs) for L in lens]
            nb = sum(need)
            k = rng.standard_normal((nb, bs, hkv, d), dtype=np.float32).astype(kv_dt)
            v = rng.standard_normal((nb, bs, hkv, d), dtype=np.float32).astype(kv_dt)
            perm = rng.permutation(nb).astype(np.int32)
            table = np.zeros((B, max(need)), dtype=np.int32)
            i = 0
            for b, n in enumerate(need):
                table[b, :n] = perm[i:i + n]
                i += n
        else:
            S = max(lens)
            k = rng.standard_normal((B, S, hkv, d), dtype=np.float32).astype(kv_dt)
            v = rng.standard_normal((B, S, hkv, d), dtype=np.float32).astype(kv_dt)
            table = None
        return q, k, v, np.asarray(lens, dtype=np.int32), table

    def run(q, k, v, seq_lens, table):
        return decode_attention(q, k, v, seq_lens, block_table=table, lnc=s.lnc, **scales)

    def check(inputs, o):
        q, k, v, seq_lens, table = inputs
        pick = sorted({0, len(lens) - 1})[:CHECK_SEQS]
        sub_lens = [lens[b] for b in pick]
        if table is None:
            kk, vv, tt = k[pick], v[pick], None
        else:
            kk, vv, tt = k, v, table[pick]
        exact = decode_attention_ref(q[pick], kk, vv, sub_lens, block_table=tt,
                                     compute_dtype=np.float64, **scales)
        same = decode_attention_ref(q[pick], kk, vv, sub_lens, block_table=tt,
                                    p_dtype="bfloat16", **scales)
        assert_attention_close(o[pick], same, exact, what=f"decode_attention {name}")

    full_cache = 2 * sum(lens) * s.n_kv_heads * d * isz
    goal = GOAL if full_cache >= GOAL_MIN_BYTES else None
    dims = {"B": len(lens), "s_q": s_q, "Hq": hq, "Hkv": hkv, "d": d,
            "L": max(lens), "tokens": sum(lens)}
    if bs:
        dims["block"] = bs
    return BenchCase(
        op="decode_attention", shape=name, dims=dims, dtype="fp8 KV" if fp8 else "bf16",
        make_inputs=make_inputs, run=run,
        flops=flops_decode_attention(lens, s_q, hq, d),
        bytes=bytes_decode_attention(lens, s_q, hq, hkv, d, isz), roof_kind="bf16",
        lnc=s.lnc, check=check, goal=goal)


@register("decode_attention")
def cases(tier: str, target: str):
    if tier == "models":
        rows = shapes.DECODE_MODELS
    elif tier == "default":
        rows = shapes.DECODE_DEFAULT
    else:
        rows = shapes.tier(tier).decode
    for s in rows:
        yield decode_case(s, target)
