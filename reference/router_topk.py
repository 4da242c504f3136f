"""NumPy reference for ``nki_kernels.router_topk``: MoE router scoring and top-k selection.

Plain fp32 on the whole ``[T, E]`` array. Scoring: softmax over the experts (Qwen3-MoE, Mixtral)
or an element-wise sigmoid (DeepSeek-V3). Selection runs on the scores plus the optional
``correction_bias`` (DeepSeek-V3's load-balancing bias: used to choose, never as a weight), after
the optional group limit (keep the ``topk_groups`` groups of ``E / n_groups`` consecutive experts
with the largest sum of their two best scores; the other experts cannot be chosen). Ties go to the
lower expert (and group) id, as ``torch.topk`` does on CPU. The weights are the scores (without
bias) of the chosen experts, optionally renormalised to sum to 1, times ``routed_scaling``.
"""
from __future__ import annotations

import numpy as np


def _topk_ids(s, k):
    """Indices of the k largest entries of each row, descending, ties to the lower index."""
    return np.argsort(-s, axis=-1, kind="stable")[..., :k]


def router_topk_ref(logits, top_k, *, scoring="softmax", renormalize=True, n_groups=None,
                    topk_groups=None, correction_bias=None, routed_scaling=1.0):
    """Returns ``(weights [T, k] fp32, ids [T, k] int32)``, ids in descending selection score."""
    x = np.asarray(logits).astype(np.float32)
    T, E = x.shape
    if scoring == "softmax":
        z = np.exp(x - x.max(axis=-1, keepdims=True))
        s = z / z.sum(axis=-1, keepdims=True)
    elif scoring == "sigmoid":
        s = np.float32(1.0) / (np.float32(1.0) + np.exp(-x))
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid'; got {scoring!r}")
    sel = s if correction_bias is None else s + np.asarray(correction_bias, np.float32)[None, :]
    if n_groups:
        g = sel.reshape(T, n_groups, E // n_groups)
        top2 = -np.sort(-g, axis=-1)[..., :2].sum(axis=-1)               # [T, G]
        keep = _topk_ids(top2, topk_groups)                                # [T, topk_groups]
        mask = np.zeros((T, n_groups), bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        sel = np.where(np.repeat(mask, E // n_groups, axis=-1), sel, -np.inf)
    ids = _topk_ids(sel, top_k)
    w = np.take_along_axis(s, ids, axis=-1)
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    w = w * np.float32(routed_scaling)
    return w.astype(np.float32), ids.astype(np.int32)


def flops_router_topk(T, E, top_k):
    """Element-wise work only (scoring, selection passes): ~ (4 + top_k / 8) ops per logit."""
    return T * E * (4 + -(-top_k // 8))


def bytes_router_topk(T, E, top_k, logit_itemsize=4):
    """Compulsory HBM traffic: the logits in, the weights and ids out."""
    return T * E * logit_itemsize + T * top_k * 8
