"""Seeded builders of ragged serving batches over a paged KV cache (tests of paged_attention).

A batch mixes idle requests (pages in the cache, no query row this step), empty slots (no pages,
no rows), decodes (1 row), speculative drafts (2-8 rows) and prompt chunks (up to a few hundred
rows) over cached prefixes. The cache is adversarial: physical pages are shuffled, every slot no
request owns is NaN (free pages and the tail of each request's last page), and each block-table
row holds junk past the entries its request uses (an out-of-range page id, -1, or a NaN page).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
KINDS = ("idle", "empty", "decode", "spec", "chunk")


@dataclass
class Batch:
    """One step: q [T, Hq, d], paged caches, block_table [R, max_blocks], host seq_lens [R] and
    query_start_loc [R + 1]; ``k``, ``v``: each request's dense keys/values [L, Hkv, d] (cache
    dtype) as written into the pages."""
    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    block_table: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)

    @property
    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.seq_lens,
                self.query_start_loc)

    @property
    def q_lens(self):
        return np.diff(self.query_start_loc)

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def rows(self, r):
        return slice(int(self.query_start_loc[r]), int(self.query_start_loc[r + 1]))


def page(rng, dense, bs, spare=3, junk="mixed"):
    """Write per-request ``dense [L_r, H, d]`` arrays into a shuffled paged cache
    ``[num_blocks, bs, H, d]`` (NaN everywhere else, ``spare`` extra NaN pages); returns
    (cache, table). ``junk`` fills table entries past each request's pages: "oob" an out-of-range
    page id, "neg" -1, "nan" a NaN page's id, "mixed" all three."""
    H, d = dense[0].shape[1:] if dense else (1, 64)
    dt = dense[0].dtype if dense else np.dtype(BF16)
    need = [-(-len(x) // bs) for x in dense]
    nb = sum(need) + max(spare, 1)
    perm = rng.permutation(nb)
    cache = np.full((nb, bs, H, d), np.nan, dtype=np.float32).astype(dt)
    free = perm[sum(need):]                                # pages no request owns (NaN)
    width = max(need + [1]) + 2
    table = np.empty((len(dense), width), dtype=np.int32)
    for r in range(len(dense)):
        for n in range(width):
            use = junk if junk != "mixed" else ("oob", "nan", "neg")[(r + n) % 3]
            table[r, n] = {"oob": nb + 7 + n, "neg": -1}.get(use, free[(r + n) % len(free)])
    i = 0
    for r, x in enumerate(dense):
        for n in range(need[r]):
            p = perm[i]
            i += 1
            table[r, n] = p
            m = min(bs, len(x) - n * bs)
            cache[p, :m] = x[n * bs:n * bs + m]
    return cache, table


def build(rng, q_lens, seq_lens, Hq, Hkv, d, bs, *, kv_dtype=BF16, q_dtype=BF16, spare=3,
          junk="mixed", q_scale=1.0, kv_scale=1.0) -> Batch:
    """A batch of given ``q_lens`` / ``seq_lens`` (seq_len counts the request's new tokens)."""
    q_lens = [int(x) for x in q_lens]
    seq_lens = [int(x) for x in seq_lens]
    assert all(s >= n >= 0 for n, s in zip(q_lens, seq_lens))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(qsl[-1])
    q = (rng.standard_normal((T, Hq, d)) * q_scale).astype(q_dtype)
    k = [(rng.standard_normal((L, Hkv, d)) * kv_scale).astype(kv_dtype) for L in seq_lens]
    v = [(rng.standard_normal((L, Hkv, d)) * kv_scale).astype(kv_dtype) for L in seq_lens]
    prng = np.random.default_rng(int(rng.integers(1 << 31)))
    kc, table = page(prng, k, bs, spare, junk)
    # V gets the same page assignment as K (one table): rebuild V's cache from K's table
    vc = np.full(kc.shape, np.nan, dtype=np.float32).astype(kv_dtype)
    for r, x in enumerate(v):
        for n in range(-(-len(x) // bs)):
            m = min(bs, len(x) - n * bs)
            vc[table[r, n], :m] = x[n * bs:n * bs + m]
    return Batch(q, kc, vc, table, np.asarray(seq_lens, dtype=np.int32), qsl, k, v)


def random_lens(rng, n_req, max_chunk=200, max_prefix=400, kinds=KINDS):
    """(q_lens, seq_lens) of ``n_req`` requests of random kinds; at least one query row."""
    q_lens, seq_lens = [], []
    for _ in range(n_req):
        kind = kinds[int(rng.integers(len(kinds)))]
        prefix = int(rng.integers(0, max_prefix + 1))
        if kind == "empty":
            n, prefix = 0, 0
        elif kind == "idle":
            n, prefix = 0, max(prefix, 1)
        elif kind == "decode":
            n = 1
        elif kind == "spec":
            n = int(rng.integers(2, 9))
        else:
            n = int(rng.integers(9, max_chunk + 1))
            if rng.random() < 0.3:
                prefix = 0                                   # a fresh prompt's first chunk
        q_lens.append(n)
        seq_lens.append(prefix + n)
    if sum(q_lens) == 0:
        q_lens[-1] += 1
        seq_lens[-1] += 1
    return q_lens, seq_lens


def random_batch(rng, n_req=None, Hq=4, Hkv=1, d=64, bs=None, max_chunk=200, max_prefix=400,
                 **kw) -> Batch:
    """A random mixed batch: 1-8 requests, block size 16-128 (power of two)."""
    n_req = int(rng.integers(1, 9)) if n_req is None else n_req
    bs = int(rng.choice([16, 32, 64, 128])) if bs is None else bs
    q_lens, seq_lens = random_lens(rng, n_req, max_chunk, max_prefix)
    return build(rng, q_lens, seq_lens, Hq, Hkv, d, bs, **kw)
