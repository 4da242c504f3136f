"""Bench definition of MLA decode (absorbed multi-head latent attention, DeepSeek-V3 dims).

Shapes: ``reference.shapes``: ``default`` runs ``MLA_DEFAULT`` (one small real row: DeepSeek-V3
TP8, H = 16, B = 1, 4K); ``models`` runs ``MLA_MODELS`` (the issue's rows: H = 128 and 16, B = 1 /
32 / 128, 4K and 32K, s_q 1 and 2, bf16 and FP8 caches, paged/64 and contiguous) and
``MLA_TOKEN_MODELS`` (its FP8 rows with per-token scales: one fp32 per cache slot, log-uniform in
2^-4..1); ``fast`` / ``odd`` run ``MLA_FAST`` (toy shapes).

Batch slices: rows whose whole batch holds more than SLICE_TOKENS cached tokens run the first
``SLICE_TOKENS / L`` sequences of the batch (sequences are independent and processed one after
the other, so every engine sees the per-byte work of the whole batch); the shape name says so.
Compulsory bytes (``reference``'s ``bytes_mla_decode``) are the valid latent rows read once
(576 x the cache's item size per token, + 4 bytes of per-token scale) plus q and o, of the
sequences that ran.

Goal (the issue's): at least 80% of the binding roof (TensorE bf16 peak or HBM) on Trn3 for every
row whose full-batch cache read is 8 MB or more; Trn2 reported. The check compares the first and
last sequences with the float64 reference by the attention rule.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels.attention.mla_decode import mla_decode
from nki_kernels.bench.defs import BenchCase, register
from nki_kernels.reference import shapes
from nki_kernels.reference.compare import assert_attention_close
from nki_kernels.reference.mla_decode import bytes_mla_decode, flops_mla_decode, mla_decode_ref

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = {"trn2": ml_dtypes.float8_e4m3, "trn3": ml_dtypes.float8_e4m3fn}
GOAL = {"trn3": 80.0}
GOAL_MIN_BYTES = 8e6          # the goal applies where the full batch reads >= 8 MB of cache
SLICE_TOKENS = 32768          # run at most this many cached tokens (whole sequences)
CHECK_SEQS = 2
KV_SCALE = 0.25
SCALE = 192 ** -0.5


def mla_case(s, target: str) -> BenchCase:
    full = tuple(int(x) for x in s.lens)
    n_run = max(1, min(len(full), SLICE_TOKENS // max(full)))
    lens = full[:n_run]
    fp8 = s.kv_dtype != "bfloat16"
    kv_dt = np.dtype(FP8[target]) if fp8 else BF16
    isz = kv_dt.itemsize
    rank, rope, H, s_q, bs = s.kv_lora_rank, s.rope_dim, s.n_heads, s.q_len, s.page_size
    width = rank + rope
    name = s.name if n_run == len(full) else f"{s.name} ({n_run} of {len(full)} sequences)"
    tok = fp8 and getattr(s, "kv_scale", "tensor") == "token"
    scales = dict(kv_scale=KV_SCALE) if fp8 and not tok else {}

    def make_inputs(rng):
        B = len(lens)
        qn = rng.standard_normal((B, s_q, H, rank), dtype=np.float32).astype(BF16)
        qr = rng.standard_normal((B, s_q, H, rope), dtype=np.float32).astype(BF16)
        if bs:
            need = [-(-L // bs) for L in lens]
            nb = sum(need)
            kv = rng.standard_normal((nb, bs, width), dtype=np.float32).astype(kv_dt)
            perm = rng.permutation(nb).astype(np.int32)
            table = np.zeros((B, max(need)), dtype=np.int32)
            i = 0
            for b, n in enumerate(need):
                table[b, :n] = perm[i:i + n]
                i += n
        else:
            kv = rng.standard_normal((B, max(lens), width), dtype=np.float32).astype(kv_dt)
            table = None
        ks = (2.0 ** rng.uniform(-4.0, 0.0, size=kv.shape[:2])).astype(np.float32) if tok \
            else None
        return qn, qr, kv, np.asarray(lens, dtype=np.int32), table, ks

    def run(qn, qr, kv, seq_lens, table, ks):
        tok_kw = dict(kv_scale=ks) if tok else {}
        return mla_decode(qn, qr, kv, seq_lens, block_table=table, scale=SCALE, lnc=s.lnc,
                          **scales, **tok_kw)

    def check(inputs, out):
        qn, qr, kv, seq_lens, table, ks = inputs
        o, lse = out
        pick = sorted({0, len(lens) - 1})[:CHECK_SEQS]
        sub = [lens[b] for b in pick]
        kk, tt = (kv[pick], None) if table is None else (kv, table[pick])
        kw = dict(block_table=tt, scale=SCALE, **scales)
        deq = None
        if tok:                       # the kernel dequantizes per-token tiles to bf16 (documented)
            kw["kv_scale"] = ks[pick] if table is None else ks
            deq = "bfloat16"
        exact = mla_decode_ref(qn[pick], qr[pick], kk, sub, compute_dtype=np.float64, **kw)
        same = mla_decode_ref(qn[pick], qr[pick], kk, sub, p_dtype="bfloat16",
                              out_dtype="bfloat16", dequant_dtype=deq, **kw)
        assert_attention_close(o[pick], same[0], exact[0], what=f"mla_decode {name}")
        assert_attention_close(lse[pick], same[1], exact[1], what=f"mla_decode {name} lse")

    full_cache = sum(full) * width * isz
    goal = GOAL if full_cache >= GOAL_MIN_BYTES else None
    dims = {"B": len(lens), "s_q": s_q, "H": H, "d_qk": width, "d_v": rank, "L": max(lens),
            "tokens": sum(lens)}
    if bs:
        dims["block"] = bs
    return BenchCase(
        op="mla_decode", shape=name, dims=dims,
        dtype=("fp8 KV per-token" if tok else "fp8 KV") if fp8 else "bf16",
        make_inputs=make_inputs, run=run, flops=flops_mla_decode(lens, s_q, H, rank, rope),
        bytes=bytes_mla_decode(lens, s_q, H, isz, rank, rope, 4 if tok else 0), roof_kind="bf16",
        lnc=s.lnc,
        check=check, goal=goal)


@register("mla_decode")
def cases(tier: str, target: str):
    if tier == "models":
        rows = shapes.MLA_MODELS + shapes.MLA_TOKEN_MODELS
    elif tier == "default":
        rows = shapes.MLA_DEFAULT
    else:
        rows = shapes.MLA_FAST
    for s in rows:
        yield mla_case(s, target)
