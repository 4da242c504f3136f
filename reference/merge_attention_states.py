"""NumPy reference for ``nki_kernels.attention.merge_attention_states``.

Two attention results over disjoint key sets of the same queries, each given as its normalised
output ``o`` and its log-sum-exp ``lse`` (natural log), merge exactly into the result over the
union of the key sets (FlashInfer ``merge_state``, the flash-decoding combine)::

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

A side that saw no key has ``lse = -inf`` and contributes nothing; when both sides are ``-inf``
the merged output is 0 and ``lse = -inf``. Computed in float64 by default.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

_OUT = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def merge_attention_states_ref(o_a, lse_a, o_b, lse_b, *, out_dtype=None, compute_dtype=np.float64):
    """``o_a, o_b [..., d]``, ``lse_a, lse_b [...]`` -> ``(o [..., d], lse [...] float32)``.
    ``out_dtype``: dtype name of ``o`` (default: ``o_a``'s dtype)."""
    ct = compute_dtype
    oa = np.asarray(o_a).astype(ct)
    ob = np.asarray(o_b).astype(ct)
    la = np.asarray(lse_a).astype(ct)
    lb = np.asarray(lse_b).astype(ct)
    m = np.maximum(la, lb)
    empty = np.isneginf(m)
    m_safe = np.where(empty, 0.0, m)
    wa = np.where(np.isneginf(la), 0.0, np.exp(la - m_safe))
    wb = np.where(np.isneginf(lb), 0.0, np.exp(lb - m_safe))
    tot = wa + wb
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(empty, -np.inf, m_safe + np.log(np.where(empty, 1.0, tot)))
        o = (wa[..., None] * oa + wb[..., None] * ob) / np.where(empty, 1.0, tot)[..., None]
    o = np.where(empty[..., None], 0.0, o)
    name = out_dtype or np.dtype(np.asarray(o_a).dtype).name
    return o.astype(_OUT[name]), lse.astype(np.float32)


def bytes_merge_attention_states(rows: int, d: int, itemsize: int = 2) -> int:
    """Compulsory HBM bytes: both (o, lse) inputs read once, the merged (o, lse) written."""
    return 3 * rows * (d * itemsize + 4)


def flops_merge_attention_states(rows: int, d: int) -> int:
    """Two scaled adds per output element (the exponentials are per row)."""
    return 3 * rows * d
