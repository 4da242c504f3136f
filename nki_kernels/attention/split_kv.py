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


def slot_selector(W: int, rows: int):
    """fp32 ``[128, rows]`` selection matrix ``S[s W + r, r] = 1`` (``r < rows <= W``), else 0:
    as a matmul's stationary it adds row ``r`` of every slot into output row ``r``.
    ``v = 128 + p - r`` (GpSimd iota), then ``(v & (W - 1)) == 0`` on VectorE (bitwise ALU ops
    run there only; W is a power of two and ``p - r`` lies in ``(-W, 128)``, so only the slots'
    rows match). No operand depends on data: the two small passes fill VectorE's wait for the
    fold's first transpose."""
    idx = nl.ndarray((P, rows), dtype=nl.int32, buffer=nl.sbuf)
    nisa.iota(dst=idx, pattern=[[-1, rows]], offset=P, channel_multiplier=1)
    nisa.tensor_scalar(dst=idx, data=idx, op0=nl.bitwise_and, operand0=W - 1)
    sel = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=sel, data=idx, op0=nl.equal, operand0=0)
    return sel


def fold_slots(sm, psm, nslot: int, W: int, rows: int, sel):
    """Fold the packed slots' states into the row state ``sm`` (partitions ``[0, rows)``):
    slot s holds its share of the full tiles' keys on partitions ``[s W, s W + rows)``.

    Every state (the slots, and ``sm`` if it has started: an item whose tiles all ran packed
    leaves it empty) is merged in one exact log-sum-exp pass, ``m = max_i m_i``,
    ``w_i = e^(xmul (m_i - m))``, ``o = sum_i w_i o_i``, ``l = sum_i w_i l_i``, in few dependent
    steps (the fold is the tail of a lone long sequence): the slots' maxima go to one partition
    by an exact TensorE transpose (fp32), are reduced across the slots (and the row state) and
    subtracted there, and come back as a column for one exponential; the weighted ``[o | l]``
    of all 128 slot rows is then summed onto rows ``[0, rows)`` by one fp32 matmul against the
    selection matrix of :func:`slot_selector` (0/1 weights: each output is a sum of ``nslot``
    fp32 products, as exact as adds; a 0/1 stationary takes the documented
    ``is_stationary_onezero`` hint, which halves an fp32 matmul's time). Rows of a slot past
    ``rows`` (zero queries) hold finite states and are weighted 0. ``sel``:
    :func:`slot_selector` ``(W, rows)``, built once by the caller at the kernel's start, where it
    waits for nothing.

    Three steps, which a caller may issue apart (same instructions, same order as one call):
    :func:`fold_max` and :func:`fold_exp` need only the final maxima (the weights),
    :func:`fold_apply` the final ``o`` and ``l``. (Issuing both weight steps together as soon
    as the maxima are final, before the item's last P V products, modeled no better: the
    transposes back then wait in TensorE's in-order queue for VectorE ahead of those products;
    decode_attention issues the two one pipeline step apart.)"""
    fold_apply(sm, psm, fold_weights(sm, psm, nslot, W, rows), rows, sel)


def fold_weights(sm, psm, nslot: int, W: int, rows: int):
    """:func:`fold_max` then :func:`fold_exp` (the weights, from the final maxima): returns
    :func:`fold_apply`'s ``ctx``."""
    return fold_exp(sm, fold_max(sm, psm, nslot, W, rows), rows)


def fold_max(sm, psm, nslot: int, W: int, rows: int):
    """:func:`fold_slots`, step 1: the maxima on one partition (TensorE transpose), their max
    across the slots and ``m_i - m`` of every state there. Returns :func:`fold_exp`'s ``ctx``."""
    f32 = nl.float32
    started = sm.started
    # the maxima on one partition: [1, 128] of the slots (+ [1, rows] of the row state)
    n_m = P + (rows if started else 0)
    mT = nl.ndarray((1, n_m), dtype=f32, buffer=nl.psum)
    nisa.nc_transpose(dst=mT[0:1, 0:P], data=psm.mp[:, 0:1], engine=nisa.engine.tensor)
    if started:
        nisa.nc_transpose(dst=mT[0:1, P:P + rows], data=sm.mp[:, 0:1], engine=nisa.engine.tensor)
    ms = nl.ndarray((1, n_m), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=ms, src=mT, engine=nisa.engine.vector)
    # m per row position across the slots (and the row state), then m_i - m for every state
    mr = nl.ndarray((1, W), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=mr, data1=ms[0:1, 0:W], data2=ms[0:1, W:2 * W], op=nl.maximum)
    for s in range(2, nslot):
        nisa.tensor_tensor(dst=mr, data1=mr, data2=ms[0:1, s * W:(s + 1) * W], op=nl.maximum)
    if started:
        nisa.tensor_tensor(dst=mr[0:1, 0:rows], data1=mr[0:1, 0:rows],
                           data2=ms[0:1, P:P + rows], op=nl.maximum)
    e = nl.ndarray((1, n_m), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=e[0:1, 0:P].reshape_dim(1, (nslot, W)),
                       data1=ms[0:1, 0:P].reshape_dim(1, (nslot, W)),
                       data2=mr.reshape_dim(1, (1, W)).broadcast(1, nslot), op=nl.subtract)
    if started:
        nisa.tensor_tensor(dst=e[0:1, P:P + rows], data1=ms[0:1, P:P + rows],
                           data2=mr[0:1, 0:rows], op=nl.subtract)
    return started, e, mr


def fold_exp(sm, ctx, rows: int):
    """:func:`fold_slots`, step 2 (``ctx`` from :func:`fold_max`): back to partitions
    (TensorE transposes), the slots' weights ``w_i`` (one exponential) and ``m`` for the row
    state. Returns :func:`fold_apply`'s ``ctx``."""
    f32 = nl.float32
    started, e, mr = ctx
    eT = nl.ndarray((P, 3), dtype=f32, buffer=nl.psum)
    nisa.nc_transpose(dst=eT[:, 0:1], data=e[0:1, 0:P], engine=nisa.engine.tensor)
    if started:
        nisa.nc_transpose(dst=eT[0:rows, 1:2], data=e[0:1, P:P + rows],
                          engine=nisa.engine.tensor)
    nisa.nc_transpose(dst=eT[0:rows, 2:3], data=mr[0:1, 0:rows], engine=nisa.engine.tensor)
    w = nl.ndarray((P, 2), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=w[:, 0:1], op=nl.exp, data=eT[:, 0:1], scale=sm.xmul)
    return started, eT, w


def fold_apply(sm, psm, ctx, rows: int, sel, o_psum=False):
    """:func:`fold_slots`, step 3 (``ctx`` from :func:`fold_exp`): the weighted slot states
    summed onto the rows (selection matmul), the row state's share added, the new max stored.
    ``o_psum``: where the row state has not started, leave ``o`` and ``l`` in the matmul's PSUM
    tile instead of copying them to SBUF (for a caller whose next and last use of them is the
    output division, which reads PSUM)."""
    d = sm.d
    f32 = nl.float32
    started, eT, w = ctx
    # the weighted slot states [o | l], summed onto rows [0, rows) by the selection matmul
    ol = nl.ndarray((P, d + 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ol[:, 0:d], data=psm.o, op0=nl.multiply, operand0=w[:, 0:1])
    nisa.tensor_scalar(dst=ol[:, d:d + 1], data=psm.l, op0=nl.multiply, operand0=w[:, 0:1])
    acc = nl.ndarray((rows, d + 1), dtype=f32, buffer=nl.psum)
    bank = nl.tile_size.psum_fmax                       # fp32 columns of one PSUM bank
    for c0 in range(0, d + 1, bank):
        c1 = min(d + 1, c0 + bank)
        nisa.nc_matmul(dst=acc[:, c0:c1], stationary=sel, moving=ol[:, c0:c1],
                       is_stationary_onezero=True)
    if started:     # + w o and w l of the row state (its rows are the outputs' partitions)
        o = nl.ndarray((rows, d + 1), dtype=f32, buffer=nl.sbuf)
        nisa.activation(dst=w[0:rows, 1:2], op=nl.exp, data=eT[0:rows, 1:2], scale=sm.xmul)
        nisa.scalar_tensor_tensor(dst=o[:, 0:d], data=sm.o, op0=nl.multiply,
                                  operand0=w[0:rows, 1:2], op1=nl.add, operand1=acc[:, 0:d])
        nisa.scalar_tensor_tensor(dst=o[:, d:d + 1], data=sm.l, op0=nl.multiply,
                                  operand0=w[0:rows, 1:2], op1=nl.add, operand1=acc[:, d:d + 1])
    elif o_psum:
        o = acc
    else:
        o = nl.ndarray((rows, d + 1), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=acc, engine=nisa.engine.vector)
    nisa.tensor_copy(dst=sm.mp[:, 0:1], src=eT[0:rows, 2:3], engine=nisa.engine.scalar)
    sm.o, sm.l = o[:, 0:d], o[:, d:d + 1]
    sm.mark_started()
