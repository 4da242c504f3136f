"""One serving step of a paged-KV engine (vLLM's layout) with nki-kernels, over two layers.

The batch mixes what a serving engine runs in one step:

* request 0: decode (1 new token after 40 cached);
* request 1: chunked prefill (a 96-token chunk of a long prompt, 64 tokens already cached);
* request 2: a 3-token speculative draft (after 17 cached);
* request 3: a new 130-token prompt (nothing cached).

The step: make the schedule once (``plan_paged_attention``), then in every layer append the new
tokens' K/V to the paged cache (``kv_cache_append``, slots from the block table) and run
``paged_attention`` with the same plan. The result is checked against the NumPy reference.
On CPU the kernels run on the nki-kernels emulator (docs/attention.md, "Paged attention").

    python examples/serve_step.py
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_kernels import kv_cache_append, paged_attention, plan_paged_attention
from nki_kernels.reference.paged_attention import paged_attention_ref

BF16 = ml_dtypes.bfloat16
LAYERS, H_Q, H_KV, D, BLOCK, NUM_BLOCKS = 2, 8, 2, 64, 16, 64

cached = [40, 64, 17, 0]          # tokens already in the cache, per request
new = [1, 96, 3, 130]             # tokens of this step, per request
seq_lens = np.array([c + n for c, n in zip(cached, new)])
query_start_loc = np.concatenate([[0], np.cumsum(new)])
T = int(query_start_loc[-1])

# page allocation (the engine's job): enough pages per request, in a shuffled order
rng = np.random.default_rng(0)
free = list(rng.permutation(NUM_BLOCKS))
need = [-(-int(L) // BLOCK) for L in seq_lens]
block_table = np.zeros((len(new), max(need)), dtype=np.int32)
for r, n in enumerate(need):
    block_table[r, :n] = [free.pop() for _ in range(n)]

# slot of every new token: page * block_size + offset (vLLM's slot_mapping)
slot_mapping = np.concatenate([
    [block_table[r, p // BLOCK] * BLOCK + p % BLOCK for p in range(cached[r], int(seq_lens[r]))]
    for r in range(len(new))]).astype(np.int64)

plan = plan_paged_attention(seq_lens, query_start_loc, BLOCK, H_Q, H_KV, D)
print("plan:", plan.describe())

worst = 0.0
for layer in range(LAYERS):
    k_cache = np.zeros((NUM_BLOCKS, BLOCK, H_KV, D), dtype=BF16)
    v_cache = np.zeros_like(k_cache)
    # the prefix of each request, as earlier steps left it in the cache
    for r, c in enumerate(cached):
        for p in range(c):
            slot = divmod(int(block_table[r, p // BLOCK]) * BLOCK + p % BLOCK, BLOCK)
            k_cache[slot] = rng.standard_normal((H_KV, D)).astype(BF16)
            v_cache[slot] = rng.standard_normal((H_KV, D)).astype(BF16)
    # this step's projections (a model's qkv_proj would make them)
    q = rng.standard_normal((T, H_Q, D)).astype(BF16)
    k = rng.standard_normal((T, H_KV, D)).astype(BF16)
    v = rng.standard_normal((T, H_KV, D)).astype(BF16)

    kv_cache_append(k, v, k_cache, v_cache, slot_mapping)                  # in place
    o = paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, plan=plan)

    ref, _ = paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, query_start_loc)
    err = float(np.abs(o.astype(np.float32) - ref.astype(np.float32)).max())
    worst = max(worst, err)
    print(f"layer {layer}: o {tuple(o.shape)} {o.dtype}, max |error| vs reference {err:.2e}")
print(f"max error over {LAYERS} layers {worst:.2e}")
