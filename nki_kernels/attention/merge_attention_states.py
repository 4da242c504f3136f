"""Merge two attention states over disjoint key sets: the exact flash-decoding combine.

``(o, lse) = merge(o_a, lse_a, o_b, lse_b)`` (FlashInfer ``merge_state``)::

    m   = max(lse_a, lse_b)
    w_a = exp(lse_a - m),  w_b = exp(lse_b - m)
    o   = (w_a o_a + w_b o_b) / (w_a + w_b),   lse = m + ln(w_a + w_b)

Two pieces:

* :func:`merge_states_sb` (kernel helper): folds an unnormalised partial state ``(o_b, m_b, l_b)``
  (SBUF, rows on partitions) into a :class:`~.softmax.SoftmaxState` (sum kept apart,
  ``sum_in_o=False``): what decode kernels do with the parts of a split sequence;
* :func:`merge_attention_states` (op) and its kernel: normalised ``(o, lse)`` pairs in HBM, rows
  packed ``n`` per partition so every DMA moves one long run per partition.

A side with ``lse = -inf`` (no key) contributes nothing; both ``-inf`` give ``o = 0``,
``lse = -inf``.
"""
from __future__ import annotations

import numpy as np

from .._validate import dtype_name as _dtype_name
from ..backend import launch, nisa, nki, nl
from .softmax import M_FLOOR

P = 128
MAX_ROWS_PER_PART = 16      # rows per partition of a merge tile (16 x 128 bf16 = 4 KiB runs)
TINY = 1.0e-30


def merge_states_sb(sm, o_b, m_b, l_b):
    """``sm <- merge(sm, (o_b, m_b, l_b))`` for unnormalised states in X units (see softmax.py):
    ``m = max(m_a, m_b)``, ``o = e^(xmul (m_a - m)) o_a + e^(xmul (m_b - m)) o_b``, same for ``l``.
    ``o_b [rows, d]``, ``m_b``, ``l_b [rows, 1]`` fp32 SBUF; ``sm.o``, ``sm.l`` must exist."""
    rows = sm.rows
    m_a = sm.mp[:, 0:1]
    m = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=m, data1=m_a, data2=m_b, op=nl.maximum)
    nb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nb, data=m, op0=nl.multiply, operand0=-sm.xmul)
    wa = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    wb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=wa, op=nl.exp, data=m_a, bias=nb, scale=sm.xmul)
    nisa.activation(dst=wb, op=nl.exp, data=m_b, bias=nb, scale=sm.xmul)
    nisa.tensor_scalar(dst=sm.o, data=sm.o, op0=nl.multiply, operand0=wa)
    nisa.scalar_tensor_tensor(dst=sm.o, data=o_b, op0=nl.multiply, operand0=wb, op1=nl.add,
                              operand1=sm.o)
    lb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lb, data1=l_b, data2=wb, op=nl.multiply)
    l_new = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=l_new, data=sm.l, op0=nl.multiply, operand0=wa, op1=nl.add,
                              operand1=lb)
    sm.l = l_new
    nisa.tensor_copy(dst=m_a, src=m, engine=nisa.engine.vector)


@nki.jit
def merge_attention_states_kernel(o_a, lse_a, o_b, lse_b, nr):
    """``(o, lse) = merge((o_a, lse_a), (o_b, lse_b))`` row by row.

    Dimensions: N rows (any), d <= 512 per row.
    Args:
      o_a, o_b: [N, d] HBM (bf16 / fp16 / fp32); lse_a, lse_b: [N] fp32 HBM (natural log).
      nr: rows per partition of a full tile (1..16).
    Returns:
      o [N, d] in o_a's dtype, lse [N] fp32.
    Notes:
      fp32 arithmetic; -inf sides weigh 0; a row with both sides -inf gets o = 0, lse = -inf.
    Pseudocode:
      for tile of (up to) 128 x nr rows (row p * nr + j on partition p):
        m = max(la, lb, floor); wa = exp(la - m); wb = exp(lb - m); s = wa + wb
        o = (wa oa + wb ob) / max(s, tiny); lse = m + ln s
    """
    N, d = o_a.shape
    out = nl.ndarray((N, d), dtype=o_a.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((N,), dtype=nl.float32, buffer=nl.shared_hbm)
    tiles = []
    r0 = 0
    while r0 < N:
        left = N - r0
        if left >= P * nr:
            tiles.append((r0, P, nr))
            r0 += P * nr
        elif left >= nr and nr > 1:
            pp = left // nr
            tiles.append((r0, pp, nr))
            r0 += pp * nr
        else:
            pp = min(P, left)
            tiles.append((r0, pp, 1))
            r0 += pp
    for (r0, pp, n) in tiles:
        cnt = pp * n
        oa = nl.ndarray((pp, n, d), dtype=nl.float32, buffer=nl.sbuf)                 # [pp, n, d]
        ob = nl.ndarray((pp, n, d), dtype=nl.float32, buffer=nl.sbuf)
        la = nl.ndarray((pp, n), dtype=nl.float32, buffer=nl.sbuf)                    # [pp, n]
        lb = nl.ndarray((pp, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=oa, src=o_a[r0:r0 + cnt, :].reshape((pp, n, d)))
        nisa.dma_copy(dst=ob, src=o_b[r0:r0 + cnt, :].reshape((pp, n, d)))
        nisa.dma_copy(dst=la, src=lse_a[r0:r0 + cnt].reshape((pp, n)))
        nisa.dma_copy(dst=lb, src=lse_b[r0:r0 + cnt].reshape((pp, n)))
        m = nl.ndarray((pp, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=m, data1=la, data2=lb, op=nl.maximum)
        nisa.tensor_scalar(dst=m, data=m, op0=nl.maximum, operand0=M_FLOOR)
        wa = nl.ndarray((pp, n), dtype=nl.float32, buffer=nl.sbuf)
        wb = nl.ndarray((pp, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=wa, data1=la, data2=m, op=nl.subtract)
        nisa.tensor_tensor(dst=wb, data1=lb, data2=m, op=nl.subtract)
        nisa.activation(dst=wa, op=nl.exp, data=wa)
        nisa.activation(dst=wb, op=nl.exp, data=wb)
        s = nl.ndarray((pp, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=s, data1=wa, data2=wb, op=nl.add)
        ls = nl.ndarray((pp, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=ls, op=nl.log, data=s)
        lo = nl.ndarray((pp, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=lo, data1=m, data2=ls, op=nl.add)
        r = nl.ndarray((pp, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=r, data=s, op0=nl.maximum, operand0=TINY)
        nisa.reciprocal(dst=r, data=r)
        nisa.tensor_tensor(dst=wa, data1=wa, data2=r, op=nl.multiply)
        nisa.tensor_tensor(dst=wb, data1=wb, data2=r, op=nl.multiply)
        nisa.tensor_tensor(dst=oa, data1=oa, data2=wa.expand_dim(2).broadcast(2, d), op=nl.multiply)
        nisa.tensor_tensor(dst=ob, data1=ob, data2=wb.expand_dim(2).broadcast(2, d), op=nl.multiply)
        res = nl.ndarray((pp, n, d), dtype=o_a.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=res, data1=oa, data2=ob, op=nl.add)
        nisa.dma_copy(dst=out[r0:r0 + cnt, :].reshape((pp, n, d)), src=res)
        nisa.dma_copy(dst=lse[r0:r0 + cnt].reshape((pp, n)), src=lo)
    return out, lse


_DTYPES = ("bfloat16", "float16", "float32")


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """Merge two attention results over disjoint key sets of the same queries (exact).

    Args:
      o_a, o_b: [..., d] normalised outputs (bf16, fp16 or fp32; same shape and dtype), e.g.
        ``[B, s_q, H, d]`` from :func:`decode_attention` or ``[B, H, S, d]`` from
        :func:`flash_attention` run on two key ranges (give the sinks to one of them).
      lse_a, lse_b: [...] float32 log-sum-exp (natural log) of each, ``-inf`` for no key.
    Returns:
      ``(o, lse)``: o in o_a's dtype and shape, lse float32.
    """
    op = "merge_attention_states"
    sa, sb = tuple(getattr(o_a, "shape", ())), tuple(getattr(o_b, "shape", ()))
    if len(sa) < 2 or sa != sb:
        raise ValueError(f"{op}: o_a and o_b must have the same shape [..., d] (at least 2-D); got "
                         f"{sa} and {sb}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(getattr(t, "shape", ())) != sa[:-1]:
            raise ValueError(f"{op}: {name} must have shape {sa[:-1]} (o's shape without d); got "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if _dtype_name(t) != "float32":
            raise TypeError(f"{op}: {name}.dtype must be float32; got {_dtype_name(t)}")
    dn = _dtype_name(o_a)
    if dn not in _DTYPES or _dtype_name(o_b) != dn:
        raise TypeError(f"{op}: o_a and o_b must share one dtype of {', '.join(_DTYPES)}; got "
                        f"{dn} and {_dtype_name(o_b)}")
    d = sa[-1]
    if not 1 <= d <= 512:
        raise ValueError(f"{op}: the last dimension d must be 1..512; got {d}")
    N = int(np.prod(sa[:-1]))
    if N == 0:
        return np.asarray(o_a).copy(), np.asarray(lse_a).copy()
    isz = np.dtype(np.float32).itemsize if dn == "float32" else 2
    nr = max(1, min(MAX_ROWS_PER_PART, N // P, 4096 // (d * isz) or 1))
    args = []
    for t, shp in ((o_a, (N, d)), (lse_a, (N,)), (o_b, (N, d)), (lse_b, (N,))):
        if hasattr(t, "reshape"):
            t = t.reshape(shp)
        args.append(t)
    o, lse = launch(merge_attention_states_kernel, *args, nr)
    return np.asarray(o).reshape(sa), np.asarray(lse).reshape(sa[:-1])


__all__ = ["merge_attention_states", "merge_attention_states_kernel", "merge_states_sb"]
