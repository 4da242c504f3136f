"""NumPy reference for ``nki_kernels.attention.kv_cache_append`` (vLLM's reshape_and_cache).

Token ``t``'s keys and values (``[H_kv, d]``, all heads) go to slot ``slot_mapping[t]`` of the
paged caches ``[num_blocks, block_size, H_kv, d]``, i.e. block ``slot // block_size``, offset
``slot % block_size``; slot ``-1`` skips the token. Every other byte of the caches is kept.

A cache in k's dtype stores the values unchanged. An FP8 cache stores, per KV head ``h``::

    fp8(clip(float32(x) * (1 / scale[h]), -max, max))      # round to nearest even

with ``1 / scale[h]`` the float32 reciprocal of the float32 scale (the engines multiply by it:
they have no divide), ``max`` the format's largest finite value (240 for float8_e4m3, 448 for
float8_e4m3fn). For a power-of-two scale this is exactly ``fp8(clip(x / scale))``.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np


def quantize_fp8_ref(x, scale, fp8_dtype):
    """``x [..., H_kv, d]`` -> FP8 codes with a scalar or per-head ``scale`` (see module doc)."""
    dt = np.dtype(getattr(ml_dtypes, fp8_dtype) if isinstance(fp8_dtype, str) else fp8_dtype)
    H = np.shape(x)[-2]
    s = np.broadcast_to(np.asarray(scale, dtype=np.float32).reshape(-1), (H,))
    inv = (np.float32(1.0) / s)[:, None]                      # [H_kv, 1] float32
    top = np.float32(ml_dtypes.finfo(dt).max)
    y = np.asarray(x).astype(np.float32) * inv                # float32 product, rounded once
    return np.clip(y, -top, top).astype(dt)


def kv_cache_append_ref(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """New caches (copies; the inputs are not changed): ``cache[slot[t]] = k[t]`` (quantised to
    the cache's FP8 with ``k_scale`` / ``v_scale`` when the cache is FP8), ``-1`` skipped."""
    slots = np.asarray(slot_mapping).astype(np.int64).reshape(-1)
    out = []
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = np.asarray(x)
        new = np.array(cache, copy=True)
        H, d = new.shape[2], new.shape[3]
        rows = new.reshape(-1, H, d)                          # [num_blocks * block_size, H, d]
        if new.dtype.itemsize == 1:
            vals = quantize_fp8_ref(x, scale, new.dtype)
        else:
            vals = x.astype(new.dtype)
        for t, s in enumerate(slots):
            if s >= 0:
                rows[s] = vals[t]
        out.append(new)
    return out[0], out[1]


def bytes_kv_cache_append(T: int, h_kv: int, d: int, in_itemsize: int = 2,
                          cache_itemsize: int = 2, written: int | None = None) -> int:
    """Compulsory HBM bytes: K and V of the ``T`` tokens read once, the slot mapping (int32)
    read, the ``written`` tokens' rows (default: all T) written to both caches."""
    written = T if written is None else written
    return 2 * T * h_kv * d * in_itemsize + 4 * T + 2 * written * h_kv * d * cache_itemsize


def flops_kv_cache_append(T: int, h_kv: int, d: int) -> int:
    """No matmul work: the op is a data move (an FP8 cache adds a multiply and a clamp per
    element on the vector engines, not counted)."""
    return 0
