"""MoE router: ``weights, ids = router_topk(logits, top_k, ...)`` on ``logits [T, E]``.

Softmax top-k with renormalisation (Qwen3-MoE, Mixtral) and DeepSeek-V3's sigmoid scoring with a
correction bias used for selection only, group-limited selection (the ``topk_groups`` best of
``n_groups`` groups by the sum of their two best scores) and the routed scaling factor.

Tokens sit on partitions (tiles of 128), experts on the free dim, so every step is a per-partition
free-dim operation: the scoring on ScalarE/VectorE, the selection with the 8-wide VectorE search
(``max8`` gives the 8 largest values of a row, ``nc_find_index8`` their first positions,
``nc_match_replace8`` knocks them out for the next 8). Ties go to the lower expert id, because
``nc_find_index8`` maps equal values to their occurrences in ascending order.
"""
from __future__ import annotations

from .._validate import check_2d, check_dtype, check_flag, check_no_grad, check_target, float_vector
from ..backend import launch, nisa, nki, nl

P = 128
KNOCKOUT = -3.0e38      # replaces a chosen value between search rounds (below any score)
MASKED = -1.0e30        # added to the experts of groups that were not kept


def _top8_rounds(src, ts, n, k, idx_out, val_out=None):
    """The k largest entries of ``src [ts, n]`` (fp32, n >= 8), descending, ties to the lower
    index: ``idx_out [ts, >=k]`` fp32 positions (and ``val_out`` their values). ``src`` is
    overwritten by the knock-outs."""
    rounds = -(-k // 8)
    for r in range(rounds):
        v8 = nl.ndarray((ts, 8), dtype=nl.float32, buffer=nl.sbuf)            # [ts, 8]
        nisa.max8(dst=v8, src=src)
        i8 = nl.ndarray((ts, 8), dtype=nl.uint32, buffer=nl.sbuf)             # [ts, 8]
        nisa.nc_find_index8(dst=i8, data=src, vals=v8)
        m = min(8, k - 8 * r)
        nisa.tensor_copy(dst=idx_out[:, 8 * r:8 * r + m], src=i8[:, 0:m])
        if val_out is not None:
            nisa.tensor_copy(dst=val_out[:, 8 * r:8 * r + m], src=v8[:, 0:m])
        if r + 1 < rounds:
            nisa.nc_match_replace8(dst=src, data=src, vals=v8, imm=KNOCKOUT)


@nki.jit
def router_topk_kernel(logits, bias, top_k, softmax, renormalize, n_groups, topk_groups,
                       routed_scaling):
    """``w, ids = topk(score(logits) [+ bias])`` per token.

    Dimensions:
      T >= 1 tokens, 8 <= E <= 16384 experts (padded to 8 inside when smaller), 1 <= k <= E.
    Args:
      logits: [T, E] fp32 or bf16 HBM.  bias: [E] fp32 HBM (selection only) or None.
      top_k, softmax (else sigmoid), renormalize, n_groups / topk_groups (0 = no group limit),
      routed_scaling: compile-time options.
    Returns:
      weights [T, k] fp32, ids [T, k] int32 (descending selection score), shared HBM.
    Notes:
      fp32 throughout. Ties go to the lower expert / group id. Groups need E % n_groups == 0.
    Pseudocode:
      for 128-token tile:
        s = softmax(x) or sigmoid(x)                          # ScalarE exp/sigmoid, VectorE max
        sel = s + bias
        if groups: gs[g] = sum(max8(sel[:, g])[0:2]); keep top topk_groups; sel += MASKED off
        ids = rounds of max8 / find_index8 / match_replace8 on sel (8 per round)
        w = s[ids] (one-hot products when biased, else the max8 values); w /= sum(w); w *= rs
    """
    T, E = logits.shape
    k = top_k
    En = max(E, 8)
    w_out = nl.ndarray((T, k), dtype=nl.float32, buffer=nl.shared_hbm)
    i_out = nl.ndarray((T, k), dtype=nl.int32, buffer=nl.shared_hbm)
    k8 = -(-k // 8) * 8
    bias_sb = None
    if bias is not None:
        bias_sb = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf)          # [128, E]
        nisa.dma_copy(dst=bias_sb, src=bias.reshape((1, E)).broadcast(0, P))
    iota_e = None
    if bias is not None:
        iota_e = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf)           # [128, E]
        nisa.iota(dst=iota_e, pattern=[[1, E]], offset=0)
    G = n_groups
    if G:
        Eg = E // G
        Gn = max(G, 8)
        iota_g = nl.ndarray((P, G), dtype=nl.float32, buffer=nl.sbuf)           # [128, G]
        nisa.iota(dst=iota_g, pattern=[[1, G]], offset=0)
    for t0 in range(0, T, P):
        ts = min(P, T - t0)
        x = nl.ndarray((ts, E), dtype=nl.float32, buffer=nl.sbuf)               # [ts, E]
        nisa.dma_copy(dst=x, src=logits[t0:t0 + ts, :])
        s = nl.ndarray((ts, E), dtype=nl.float32, buffer=nl.sbuf)               # [ts, E] scores
        if softmax:
            mx = nl.ndarray((ts, 1), dtype=nl.float32, buffer=nl.sbuf)          # [ts, 1]
            nisa.tensor_reduce(dst=mx, op=nl.maximum, data=x, axis=1)
            nmx = nl.ndarray((ts, 1), dtype=nl.float32, buffer=nl.sbuf)         # [ts, 1]
            nisa.tensor_scalar(dst=nmx, data=mx, op0=nl.multiply, operand0=-1.0)
            ssum = nl.ndarray((ts, 1), dtype=nl.float32, buffer=nl.sbuf)        # [ts, 1]
            nisa.activation(dst=s, op=nl.exp, data=x, bias=nmx, reduce_op=nl.add,
                            reduce_res=ssum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
            rsum = nl.ndarray((ts, 1), dtype=nl.float32, buffer=nl.sbuf)        # [ts, 1]
            nisa.reciprocal(dst=rsum, data=ssum)
            nisa.tensor_scalar(dst=s, data=s, op0=nl.multiply, operand0=rsum)
        else:
            nisa.activation(dst=s, op=nl.sigmoid, data=x)
        sel = nl.ndarray((ts, En), dtype=nl.float32, buffer=nl.sbuf)           # [ts, En]
        if En > E:
            nisa.memset(dst=sel[:, E:En], value=KNOCKOUT)
        if bias_sb is not None:
            nisa.tensor_tensor(dst=sel[:, 0:E], data1=s, data2=bias_sb[0:ts, :], op=nl.add)
        else:
            nisa.tensor_copy(dst=sel[:, 0:E], src=s)
        if G:
            gs = nl.ndarray((ts, Gn), dtype=nl.float32, buffer=nl.sbuf)         # [ts, Gn]
            if Gn > G:
                nisa.memset(dst=gs[:, G:Gn], value=KNOCKOUT)
            for g in range(G):
                grp = sel[:, g * Eg:(g + 1) * Eg]
                if Eg < 8:
                    pad = nl.ndarray((ts, 8), dtype=nl.float32, buffer=nl.sbuf)   # [ts, 8]
                    nisa.memset(dst=pad, value=KNOCKOUT)
                    nisa.tensor_copy(dst=pad[:, 0:Eg], src=grp)
                    grp = pad
                g8 = nl.ndarray((ts, 8), dtype=nl.float32, buffer=nl.sbuf)      # [ts, 8]
                nisa.max8(dst=g8, src=grp)
                nisa.tensor_tensor(dst=gs[:, g:g + 1], data1=g8[:, 0:1], data2=g8[:, 1:2],
                                   op=nl.add)
            kg = nl.ndarray((ts, -(-topk_groups // 8) * 8), dtype=nl.float32,
                            buffer=nl.sbuf)                                       # [ts, kg8]
            _top8_rounds(gs, ts, Gn, topk_groups, kg)
            keep = nl.ndarray((ts, G), dtype=nl.float32, buffer=nl.sbuf)        # [ts, G] 0/1
            for j in range(topk_groups):
                if j == 0:
                    nisa.tensor_scalar(dst=keep, data=iota_g[0:ts, :], op0=nl.equal,
                                       operand0=kg[:, 0:1])
                else:
                    nisa.scalar_tensor_tensor(dst=keep, data=iota_g[0:ts, :], op0=nl.equal,
                                              operand0=kg[:, j:j + 1], op1=nl.add, operand1=keep)
            pen = nl.ndarray((ts, G), dtype=nl.float32, buffer=nl.sbuf)         # [ts, G]
            nisa.tensor_scalar(dst=pen, data=keep, op0=nl.subtract, operand0=1.0,
                               op1=nl.multiply, operand1=-MASKED)
            sv = sel[:, 0:E].reshape_dim(1, (G, Eg))                              # [ts, G, Eg]
            nisa.tensor_tensor(dst=sv, data1=sv, data2=pen.expand_dim(2).broadcast(2, Eg),
                               op=nl.add)
        idx = nl.ndarray((ts, k8), dtype=nl.float32, buffer=nl.sbuf)            # [ts, k8]
        val = nl.ndarray((ts, k8), dtype=nl.float32, buffer=nl.sbuf)            # [ts, k8]
        _top8_rounds(sel, ts, En, k, idx, val)
        w = val
        if bias_sb is not None:     # the weights are the unbiased scores of the chosen experts
            w = nl.ndarray((ts, k8), dtype=nl.float32, buffer=nl.sbuf)          # [ts, k8]
            for j in range(k):
                oh = nl.ndarray((ts, E), dtype=nl.float32, buffer=nl.sbuf)      # [ts, E]
                nisa.scalar_tensor_tensor(dst=oh, data=iota_e[0:ts, :], op0=nl.equal,
                                          operand0=idx[:, j:j + 1], op1=nl.multiply, operand1=s)
                nisa.tensor_reduce(dst=w[:, j:j + 1], op=nl.add, data=oh, axis=1)
        scale = float(routed_scaling)
        wo = nl.ndarray((ts, k), dtype=nl.float32, buffer=nl.sbuf)              # [ts, k]
        if renormalize:
            tot = nl.ndarray((ts, 1), dtype=nl.float32, buffer=nl.sbuf)         # [ts, 1]
            nisa.tensor_reduce(dst=tot, op=nl.add, data=w[:, 0:k], axis=1)
            nisa.reciprocal(dst=tot, data=tot)
            nisa.tensor_scalar(dst=wo, data=w[:, 0:k], op0=nl.multiply, operand0=tot,
                               op1=nl.multiply, operand1=scale)
        else:
            nisa.tensor_scalar(dst=wo, data=w[:, 0:k], op0=nl.multiply, operand0=scale)
        io = nl.ndarray((ts, k), dtype=nl.int32, buffer=nl.sbuf)                # [ts, k]
        nisa.tensor_copy(dst=io, src=idx[:, 0:k])
        nisa.dma_copy(dst=w_out[t0:t0 + ts, :], src=wo)
        nisa.dma_copy(dst=i_out[t0:t0 + ts, :], src=io)
    return w_out, i_out


def router_topk(logits, top_k, *, scoring="softmax", renormalize=True, n_groups=None,
                topk_groups=None, correction_bias=None, routed_scaling=1.0):
    """Router scores and top-k expert selection on a NeuronCore.

    Args:
      logits: [T, E] float32 or bfloat16 router logits (``x @ W_router``).
      top_k: experts per token, 1 <= top_k <= E.
      scoring: "softmax" (over the E experts) or "sigmoid" (element-wise, DeepSeek-V3).
      renormalize: divide the chosen scores by their sum (Qwen3-MoE ``norm_topk_prob``,
        Mixtral, DeepSeek-V3).
      n_groups, topk_groups: group-limited selection (DeepSeek-V3: 8 and 4): only experts in the
        ``topk_groups`` groups (of E / n_groups consecutive experts) with the largest sum of their
        two best selection scores can be chosen.
      correction_bias: optional [E] added to the scores for the selection only.
      routed_scaling: factor on the final weights (DeepSeek-V3: 2.5).
    Returns:
      (weights [T, top_k] float32, ids [T, top_k] int32), in descending selection score; ties
      go to the lower expert id.
    """
    name = "router_topk"
    check_target(name)
    check_no_grad(name, logits, correction_bias)
    T, E = check_2d(name, "logits", logits)
    check_dtype(name, "logits", logits, ("float32", "bfloat16"))
    if E > 16384:
        raise ValueError(f"{name}: at most 16384 experts are supported; got E={E}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"{name}: top_k must be an int in [1, E={E}]; got {top_k!r}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"{name}: scoring must be 'softmax' or 'sigmoid'; got {scoring!r}")
    if (n_groups is None) != (topk_groups is None):
        raise ValueError(f"{name}: n_groups and topk_groups go together; got n_groups="
                         f"{n_groups!r}, topk_groups={topk_groups!r}")
    G = 0
    if n_groups is not None:
        ok = isinstance(n_groups, int) and not isinstance(n_groups, bool) and n_groups >= 1
        if not ok or E % n_groups or E // n_groups < 2:
            raise ValueError(f"{name}: n_groups must divide E={E} into groups of at least 2 "
                             f"experts; got n_groups={n_groups!r}")
        if isinstance(topk_groups, bool) or not isinstance(topk_groups, int) \
                or not 1 <= topk_groups <= n_groups:
            raise ValueError(f"{name}: topk_groups must be an int in [1, n_groups={n_groups}]; "
                             f"got {topk_groups!r}")
        if top_k > topk_groups * (E // n_groups):
            raise ValueError(f"{name}: top_k={top_k} exceeds the {topk_groups * (E // n_groups)} "
                             f"experts of the {topk_groups} kept groups")
        G = n_groups
    bias = None
    if correction_bias is not None:
        bias = float_vector(name, "correction_bias", correction_bias, E)
    if not isinstance(routed_scaling, (int, float)) or isinstance(routed_scaling, bool):
        raise TypeError(f"{name}: routed_scaling must be a number; got {routed_scaling!r}")
    renormalize = check_flag(name, "renormalize", renormalize)
    return launch(router_topk_kernel, logits, bias, top_k, scoring == "softmax",
                  renormalize, G, topk_groups or 0, float(routed_scaling))


__all__ = ["router_topk", "router_topk_kernel"]
