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
from .merge_attention_states import merge_states_sb

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
    s holds its share of the full tiles' keys on partitions ``[s W, s W + rows)``; slot 0 merges
    in place, the others are moved to partitions ``[0, rows)`` by SBUF-to-SBUF DMAs first
    (exact log-sum-exp merges). ``sm`` must have started."""
    d = sm.d
    for s in range(nslot):
        a = s * W
        if s == 0:
            merge_states_sb(sm, psm.o[0:rows, :], psm.mp[0:rows, 0:1], psm.l[0:rows, :])
            continue
        st = nl.ndarray((rows, d + 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=st[:, 0:d], src=psm.o[a:a + rows, :])
        nisa.dma_copy(dst=st[:, d:d + 1], src=psm.mp[a:a + rows, 0:1])
        nisa.dma_copy(dst=st[:, d + 1:d + 2], src=psm.l[a:a + rows, :])
        merge_states_sb(sm, st[:, 0:d], st[:, d:d + 1], st[:, d + 1:d + 2])
