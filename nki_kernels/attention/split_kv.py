"""Split-KV (flash-decoding) planning: which keys of which sequence each program processes.

Pure Python on host-known sequence lengths (FlashInfer's plan-once / run-per-layer model: the
plan depends on ``seq_lens`` only, so one plan serves every layer of a decode step). Nothing here
reads tensor values on the device.

A **work item** is keys ``[k0, k1)`` of sequence ``b``: part ``part`` of ``n_parts`` of that
sequence. Parts of one sequence processed by different programs (LNC=2 cores) leave partial
softmax states that are merged exactly through the log-sum-exp
(:mod:`nki_kernels.attention.merge_attention_states`); parts in the same program simply continue
one online softmax.

How the split is chosen (:func:`plan_split_kv`): with one program every sequence is one item (a
NeuronCore's engines already overlap consecutive KV tiles of one sequence: the online-softmax
chain between tiles is three small instructions). With ``n`` programs the work (keys x KV heads)
is balanced: a sequence longer than a program's fair share (total / n) is cut into
``ceil(length / share)`` tile-aligned parts, then items go longest first onto the least-loaded
program (LPT), so 1 x 128K splits in two halves, 64 x 2K stays whole and is spread 32 + 32, and
one 128K sequence beside 63 of 1K splits the long one in halves and lets the short ones even the
loads out (each part is one more state to merge, so nothing is split that need not be).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..backend import nisa, nl

P = 128


@dataclass(frozen=True)
class WorkItem(nl.NKIObject):
    """Keys ``[k0, k1)`` of sequence ``b``; part ``part`` of ``n_parts``; run by ``program``."""
    b: int
    k0: int
    k1: int
    part: int
    n_parts: int
    program: int

    @property
    def keys(self) -> int:
        return self.k1 - self.k0


def first_key(length: int, s_q: int, window: int | None, tile_keys: int) -> int:
    """First key any query of a sequence can see (sliding window), aligned down to a tile."""
    if not window:
        return 0
    lo = max(0, length - s_q - window + 1)
    return lo // tile_keys * tile_keys


def plan_split_kv(seq_lens, tile_keys: int, n_programs: int = 1, *, s_q: int = 1,
                  window: int | None = None) -> tuple:
    """Work items of a decode batch, one tuple per program (each in batch order).

    ``seq_lens``: host ints (0 = an empty slot: no item). ``tile_keys``: keys per KV tile (split
    points are multiples of it)."""
    spans = []
    for b, L in enumerate(seq_lens):
        L = int(L)
        if L > 0:
            spans.append((b, first_key(L, s_q, window, tile_keys), L))
    if not spans:
        return tuple(() for _ in range(n_programs))
    if n_programs == 1:
        return (tuple(WorkItem(b, k0, k1, 0, 1, 0) for b, k0, k1 in spans),)
    total = sum(k1 - k0 for _, k0, k1 in spans)
    share = total / n_programs
    pieces = []
    for b, k0, k1 in spans:
        n = k1 - k0
        parts = 1
        if n > share and n > tile_keys:
            parts = min(-(-n // tile_keys), math.ceil(n / share))
        per = -(-n // parts)
        step = -(-per // tile_keys) * tile_keys
        cuts = list(range(k0, k1, step)) + [k1]
        for i in range(len(cuts) - 1):
            pieces.append((b, cuts[i], cuts[i + 1], i, len(cuts) - 1))
    load = [0] * n_programs
    owner = {}
    for pc in sorted(pieces, key=lambda x: -(x[2] - x[1])):
        p = min(range(n_programs), key=lambda j: (load[j], j))
        owner[pc] = p
        load[p] += pc[2] - pc[1]
    return tuple(tuple(WorkItem(*pc, owner[pc]) for pc in pieces if owner[pc] == p)
                 for p in range(n_programs))


# ------------------------------------------------------------------------------ kernel helpers


def split_parts(items, n_groups: int, width: int):
    """The parts (not the first) of split sequences, which leave partial softmax states, and their
    shared HBM home ``[parts, n_groups, 128, width + 2]`` fp32 (o unnormalised, m, l), or
    ``([], None)`` when nothing is split."""
    split = [it for prog in items for it in prog if it.n_parts > 1 and it.part > 0]
    if not split:
        return split, None
    return split, nl.ndarray((len(split), n_groups, P, width + 2), dtype=nl.float32,
                             buffer=nl.shared_hbm)


def merge_split(run, mine, split, parts, programs: int):
    """After this program's items: with LNC=2 a barrier (the other core's parts are in HBM), then
    ``run`` merges the parts of every split sequence whose first part this program ran."""
    if not split:
        return
    if programs > 1:
        nisa.core_barrier(data=parts, cores=(0, 1))
    run.merge_owned([it for it in mine if it.n_parts > 1 and it.part == 0])


def empty_rows(out, lse, seq_lens, n: int, width: int, out_dtype):
    """Sequences of length 0: their ``n`` output rows ``out[b]`` (``[.., width]``) get 0 and lse
    -inf."""
    empty = [b for b, L in enumerate(seq_lens) if L == 0]
    if not empty:
        return
    r = min(P, n)
    z = nl.ndarray((r, width), dtype=out_dtype, buffer=nl.sbuf)
    nisa.memset(dst=z, value=0.0, engine=nisa.engine.gpsimd)
    zl = None
    if lse is not None:
        zl = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=zl, value=-np.inf, engine=nisa.engine.gpsimd)
    for b in empty:
        flat = out[b].reshape((n, width))
        for r0 in range(0, n, P):
            k = min(P, n - r0)
            nisa.dma_copy(dst=flat[r0:r0 + k, :], src=z[0:k, :])
            if zl is not None:
                nisa.dma_copy(dst=lse[b].reshape((n, 1))[r0:r0 + k, :], src=zl[0:k, :])


# ------------------------------------------------------ packed slots (split-KV in a row group)


def transpose_slots(Pm, Ts: int, evict):
    """P^T of a packed tile's ``[128 rows (all slots), Ts 128]`` probabilities: one 128 x 128
    TensorE transpose per slice, evicted by ``evict(dst, src)``; ``[keys, Ts, slots]`` bf16."""
    tp = nl.ndarray((P, Ts, P), dtype=nl.bfloat16, buffer=nl.psum)
    for tt in range(Ts):
        nisa.nc_transpose(dst=tp[:, tt, :], data=Pm[:, tt * P:(tt + 1) * P],
                          engine=nisa.engine.tensor)
    pT = nl.ndarray((P, Ts, P), dtype=nl.bfloat16, buffer=nl.sbuf)               # [keys, Ts, slots]
    evict(pT, tp)
    return pT


def fold_slots(sm, psm, nslot: int, W: int, rows: int):
    """Fold the packed slots' states into the row state ``sm`` (partitions ``[0, rows)``): slot
    s holds its share of the full tiles' keys on partitions ``[s W, s W + rows)``.

    The slots are moved onto partitions ``[0, rows)`` by two exact TensorE transposes (fp32
    transpose mode): the state ``[128, c]`` to ``[c, 128]`` (evicted once), then each slot's
    columns ``[c, rows]`` back to ``[rows, c]`` in PSUM, where the merge reads them (an SBUF-to-
    SBUF DMA per slot waited ~2 us of DMA latency at the end of every item). Then every state
    (the slots, and ``sm`` if it has started: an item whose tiles all ran packed leaves it
    empty) is merged in one exact log-sum-exp pass: ``m = max_i m_i``,
    ``w_i = e^(xmul (m_i - m))``, ``o = sum_i w_i o_i``, ``l = sum_i w_i l_i``."""
    d = sm.d
    n = nslot + (1 if sm.started else 0)
    f32 = nl.float32
    # m and l side by side: one transpose pair moves both
    ml = nl.ndarray((P, 2), dtype=f32, buffer=nl.sbuf)                           # [128, 2]
    nisa.tensor_copy(dst=ml[:, 0:1], src=psm.mp[:, 0:1], engine=nisa.engine.vector)
    nisa.tensor_copy(dst=ml[:, 1:2], src=psm.l, engine=nisa.engine.vector)
    chunks = [(c0, min(d, c0 + P)) for c0 in range(0, d, P)]
    t_ps = nl.ndarray((P, len(chunks) + 1, P), dtype=f32, buffer=nl.psum)      # [c, chunk, 128]
    tT = nl.ndarray((P, len(chunks) + 1, P), dtype=f32, buffer=nl.sbuf)
    nisa.nc_transpose(dst=t_ps[0:2, 0, :], data=ml, engine=nisa.engine.tensor)
    for k, (c0, c1) in enumerate(chunks):
        nisa.nc_transpose(dst=t_ps[0:c1 - c0, k + 1, :], data=psm.o[:, c0:c1],
                          engine=nisa.engine.tensor)
    nisa.tensor_copy(dst=tT[0:2, 0, :], src=t_ps[0:2, 0, :], engine=nisa.engine.vector)
    for k, (c0, c1) in enumerate(chunks):
        nisa.tensor_copy(dst=tT[0:c1 - c0, k + 1, :], src=t_ps[0:c1 - c0, k + 1, :],
                         engine=nisa.engine.scalar if k % 2 else nisa.engine.vector)
    ml_ps = nl.ndarray((rows, nslot, 2), dtype=f32, buffer=nl.psum)             # [rows, slot, 2]
    for s in range(nslot):
        nisa.nc_transpose(dst=ml_ps[:, s, :], data=tT[0:2, 0, s * W:s * W + rows],
                          engine=nisa.engine.tensor)
    srcs = [psm.o[0:rows, :]]
    for s in range(1, nslot):
        o_ps = nl.ndarray((rows, d), dtype=f32, buffer=nl.psum)                  # [rows, d]
        for k, (c0, c1) in enumerate(chunks):
            nisa.nc_transpose(dst=o_ps[:, c0:c1], data=tT[0:c1 - c0, k + 1, s * W:s * W + rows],
                              engine=nisa.engine.tensor)
        srcs.append(o_ps)
    st = nl.ndarray((rows, n, 2), dtype=f32, buffer=nl.sbuf)                     # [rows, n, 2]
    nisa.tensor_copy(dst=st[:, 0:nslot, :], src=ml_ps, engine=nisa.engine.vector)
    if sm.started:
        nisa.tensor_copy(dst=st[:, nslot, 0:1], src=sm.mp[:, 0:1], engine=nisa.engine.vector)
        nisa.tensor_copy(dst=st[:, nslot, 1:2], src=sm.l, engine=nisa.engine.vector)
        srcs.append(sm.o)
    ms, ls = st[:, :, 0], st[:, :, 1]
    m = nl.ndarray((rows, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=m, data=ms, op=nl.maximum, axis=1)
    nb = nl.ndarray((rows, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nb, data=m, op0=nl.multiply, operand0=-sm.xmul)
    w = nl.ndarray((rows, n), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=w, op=nl.exp, data=ms, bias=nb, scale=sm.xmul)
    o = nl.ndarray((rows, d), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=o, data=srcs[0], op0=nl.multiply, operand0=w[:, 0:1])
    for i in range(1, n):
        nisa.scalar_tensor_tensor(dst=o, data=srcs[i], op0=nl.multiply, operand0=w[:, i:i + 1],
                                  op1=nl.add, operand1=o)
    wl = nl.ndarray((rows, n), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=wl, data1=w, data2=ls, op=nl.multiply)
    l_new = nl.ndarray((rows, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=l_new, data=wl, op=nl.add, axis=1)
    sm.o, sm.l = o, l_new
    nisa.tensor_copy(dst=sm.mp[:, 0:1], src=m, engine=nisa.engine.vector)
    sm.mark_started()
