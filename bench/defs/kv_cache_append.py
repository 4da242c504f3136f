"""Bench definition of the KV-cache append (one layer's new K/V into a paged cache, in place).

Shapes: ``reference.shapes``: ``models`` runs ``KV_APPEND_MODELS`` (Llama-3-8B and Llama-3-70B
TP8, a decode step of 64 sequences and a 2K prefill chunk, block 64, bf16 and FP8 caches; a
mixed step of 32 decodes and a 2K chunk, Llama-3-8B);
``default`` runs ``KV_APPEND_DEFAULT`` (the Llama-3-8B chunk, bf16); ``fast`` / ``odd`` run
``KV_APPEND_FAST`` (toy shapes).

The op moves data only: the roof is HBM (flops 0). Compulsory bytes (``bytes_kv_cache_append``):
K and V read once, the slot mapping read, the new rows written to both caches. Slots: a decode
step puts each token at a random offset of its own random page; a prefill chunk fills whole
pages taken in shuffled order. No goal is set (the issue gives none for this op). The check
compares every byte of both caches (sentinel-filled before the call) with the NumPy reference.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels.attention.kv_cache_append import kv_cache_append
from nki_kernels.bench.defs import BenchCase, register
from nki_kernels.reference import shapes
from nki_kernels.reference.kv_cache_append import (
    bytes_kv_cache_append,
    flops_kv_cache_append,
    kv_cache_append_ref,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = {"trn2": np.dtype(ml_dtypes.float8_e4m3), "trn3": np.dtype(ml_dtypes.float8_e4m3fn)}
SENTINEL = 0xFF            # every byte of a fresh cache (a NaN in bf16 and both FP8 formats)
K_SCALE, V_SCALE = 0.02, 0.03
SPARE_PAGES = 2            # the cache holds this many times the pages the call writes


def kv_append_case(s, target: str) -> BenchCase:
    fp8 = s.kv_dtype != "bfloat16"
    cdt = FP8[target] if fp8 else BF16
    T, H, d, bs = s.tokens, s.n_kv_heads, s.head_dim, s.block_size
    nd = s.decodes                       # single decode tokens before the chunk
    pages = nd + (-(-(T - nd) // bs) if s.prefill else T - nd)
    nb = max(2, SPARE_PAGES * pages)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE) if fp8 else {}

    def fresh_cache():
        return np.full((nb, bs, H, d * cdt.itemsize), SENTINEL, np.uint8).view(cdt)

    def make_inputs(rng):
        k = rng.standard_normal((T, H, d), dtype=np.float32).astype(BF16)
        v = rng.standard_normal((T, H, d), dtype=np.float32).astype(BF16)
        order = rng.permutation(nb)[:pages]
        # decodes: one token per sequence, at a random offset of its page
        slots = order[:nd] * bs + rng.integers(0, bs, nd)
        if s.prefill:                # a chunk: whole pages, in shuffled page order
            chunk = (order[nd:, None] * bs + np.arange(bs)[None, :]).reshape(-1)[:T - nd]
        else:
            chunk = order[nd:] * bs + rng.integers(0, bs, T - nd)
        slots = np.concatenate([slots, chunk])
        return k, v, fresh_cache(), fresh_cache(), slots.astype(np.int64)

    def run(k, v, k_cache, v_cache, slots):
        return kv_cache_append(k, v, k_cache, v_cache, slots, **scales)

    def check(inputs, out):
        k, v, k_cache, v_cache, slots = inputs
        want_k, want_v = kv_cache_append_ref(k, v, fresh_cache(), fresh_cache(), slots, **scales)
        for name, got, want in (("k_cache", out[0], want_k), ("v_cache", out[1], want_v)):
            if not np.array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8)):
                raise AssertionError(f"kv_cache_append {s.name}: {name} differs from the "
                                     f"reference")

    dims = {"T": T, "H_kv": H, "d": d, "block": bs, "slots": nb * bs}
    if nd:
        dims["decodes"] = nd
    return BenchCase(
        op="kv_cache_append", shape=s.name, dims=dims, dtype="fp8 KV" if fp8 else "bf16",
        make_inputs=make_inputs, run=run, flops=flops_kv_cache_append(T, H, d),
        bytes=bytes_kv_cache_append(T, H, d, 2, cdt.itemsize), roof_kind="bf16", check=check)


@register("kv_cache_append")
def cases(tier: str, target: str):
    if tier == "models":
        rows = shapes.KV_APPEND_MODELS
    elif tier == "default":
        rows = shapes.KV_APPEND_DEFAULT
    else:
        rows = shapes.KV_APPEND_FAST
    for s in rows:
        yield kv_append_case(s, target)
