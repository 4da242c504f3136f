"""``nki.collectives``: collective communication between ranks (nki-spec §9.10; the API text is
the SDK's ``nki/api/nki/collectives/__init__.py``).

A kernel runs as one rank per call. ``run_ranks(call, per_rank_kwargs)`` runs a world of ranks,
one thread each, every rank its own launch (its own HBM, SBUF and, at LNC=2, two programs); a
collective is a rendezvous of the ranks of the caller's replica-group row. Outside
``run_ranks`` a kernel is rank 0 of a world of one, and a collective over a group of more than
one rank is refused (it would wait forever on a device).

What the documentation leaves open, and what the emulator does (not verified on a device):

* LNC=2: each physical core issues the collective; program *p* of a rank meets program *p* of
  the other ranks (so SBUF collectives exchange each core's own tiles, and HBM collectives on a
  shared tensor are done once per core with the same result).
* Reductions (``all_reduce``, ``reduce_scatter``, ``collective_permute_implicit_reduce``) run in
  fp32 (int64 for integer tensors) over the ranks in replica-group order, then round once to the
  destination dtype. The hardware's reduction order and intermediate precision are not
  documented.
* The ring of ``collective_permute_implicit`` is the replica-group row in order (each rank sends
  to the next, the last to the first), on every channel. On a device the runtime picks the ring
  from the topology; kernels are meant to ask
  ``collective_permute_implicit_current_processing_rank_id`` rather than assume it.
* Cost model: a collective is priced as a local DMA of the bytes it reads and writes; the
  transfer between devices is not modeled.
* ``all_gather_v`` and ``all_to_all_v`` (metadata-driven) are not emulated: they raise
  ``NotImplementedError`` naming themselves.
"""
from __future__ import annotations

import threading

import numpy as np

from . import runtime as rt
from .errors import NkiValidationError, fail

_ctx = threading.local()
_WAIT_S = 600.0        # a rank waiting this long at one collective is reported as a deadlock


class ReplicaGroup:
    """A group of ranks taking part in a collective: a list of disjoint rank-id lists."""

    def __init__(self, groups=None, *args, **kwargs):
        self.groups = [list(g) for g in groups] if groups is not None else [[0]]
        self.args, self.kwargs = args, kwargs
        seen = [r for g in self.groups for r in g]
        if len(seen) != len(set(seen)):
            raise ValueError(f"ReplicaGroup: sub-groups must not overlap; got {self.groups}")

    def __repr__(self):
        return f"ReplicaGroup({self.groups})"


# ------------------------------------------------------------------------------------ the world
class _World:
    """The ranks of one ``run_ranks`` call and their collective rendezvous."""

    def __init__(self, n):
        self.n = n
        self.cv = threading.Condition()
        self.posted = {}          # ((program, seq), rank) -> (what, payload)
        self.taken = {}           # ((program, seq), group) -> ranks that have read the meeting
        self.ended = set()

    def end(self, rank):
        with self.cv:
            self.ended.add(rank)
            self.cv.notify_all()

    def meet(self, rank, program, seq, what, group, payload):
        key = (program, seq)
        with self.cv:
            self.posted[(key, rank)] = (what, payload)
            self.cv.notify_all()
            while True:
                missing = [r for r in group if (key, r) not in self.posted]
                if not missing:
                    break
                gone = [r for r in missing if r in self.ended]
                if gone:
                    raise NkiValidationError(
                        f"nki.collectives.{what}: rank {rank} (program {program}) waits at its "
                        f"collective #{seq} for rank(s) {gone}, which ended without reaching it "
                        f"(every rank of the group must issue the same collectives in the same "
                        f"order; on a device this deadlocks)")
                if not self.cv.wait(timeout=_WAIT_S):
                    raise NkiValidationError(
                        f"nki.collectives.{what}: rank {rank} waited {_WAIT_S:.0f} s at its "
                        f"collective #{seq} for rank(s) {missing} (deadlock)")
            got = {r: self.posted[(key, r)] for r in group}
            tk = (key, tuple(group))      # disjoint groups meet at the same (program, seq)
            done = self.taken.setdefault(tk, set())
            done.add(rank)
            if len(done) == len(group):
                for r in group:
                    del self.posted[(key, r)]
                del self.taken[tk]
        other = [(r, w) for r, (w, _) in got.items() if w != what]
        if other:
            r, w = other[0]
            raise NkiValidationError(f"nki.collectives.{what}: rank {rank}'s collective #{seq} is "
                                     f"{what}, rank {r}'s is {w}: the ranks of a group must issue "
                                     f"the same collectives in the same order")
        return {r: p for r, (_, p) in got.items()}


def context():
    """(world, rank) of the calling thread: set by ``run_ranks``, else (None, 0)."""
    return getattr(_ctx, "world", None), getattr(_ctx, "rank", 0)


def run_ranks(call, per_rank_kwargs):
    """Run ``call(**per_rank_kwargs[r])`` as rank ``r`` of a world of ``len(per_rank_kwargs)``
    ranks, all at once (one thread each), and return the ranks' results in rank order.

    ``call`` launches a kernel, e.g. ``nki.simulate(kernel)`` or ``kernel[2]``. The ranks meet
    at each ``nki.collectives`` call; a rank that fails makes the ranks waiting for it fail at
    their next collective, and the first real failure is raised.
    """
    from . import versions
    n = len(per_rank_kwargs)
    if n < 1:
        raise ValueError("run_ranks: per_rank_kwargs must hold one dict of arguments per rank")
    world = _World(n)
    version = versions.current()
    results, errors = [None] * n, [None] * n

    def rank_main(r):
        _ctx.world, _ctx.rank = world, r
        try:
            with versions.nki_version(version):
                results[r] = call(**per_rank_kwargs[r])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e
        finally:
            world.end(r)

    rt.run_threads(rank_main, n, "nki-rank")
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        root = [(r, e) for r, e in failed if "ended without reaching" not in str(e)]
        r, e = (root or failed)[0]
        if n > 1:
            e.add_note(f"(rank {r} of {n})")
        raise e
    return results


# ------------------------------------------------------------------------------------ helpers
def _caller(what, replica_group, allow_none=False):
    """The calling program's core and launch, and its rank's row of ``replica_group`` (None
    for a None group where ``allow_none``: a collective_permute without pairs)."""
    core = rt.maybe_core()
    if core is None:
        raise NkiValidationError(f"nki.collectives.{what}: called outside a kernel")
    launch = core.launch
    n_world = launch.world.n if launch.world is not None else 1
    group = None if replica_group is None and allow_none else \
        _group(what, replica_group, launch.rank, n_world)
    return core, launch, group


def rank_id(name=None):
    """The calling rank's id (a register inside a kernel; 0 for a single rank)."""
    from .scalars import VirtualRegister
    core = rt.maybe_core()
    if core is None:
        return 0
    return VirtualRegister(core.launch.rank)


def _group(what, replica_group, rank, n_world):
    if not isinstance(replica_group, ReplicaGroup):
        raise fail(what, "replica_group", f"must be an nki.collectives.ReplicaGroup; got "
                                          f"{type(replica_group).__name__}")
    for g in replica_group.groups:
        if rank in g:
            bad = [r for r in g if not 0 <= r < n_world]
            if bad:
                raise fail(what, "replica_group",
                           f"names rank(s) {bad}, but the run has {n_world} rank(s) (0..{n_world - 1})"
                           + ("; run the ranks together with nki_kernels.emulator.run_ranks"
                              if n_world == 1 else ""))
            return g
    raise fail(what, "replica_group", f"{replica_group.groups} has no group holding rank {rank}")


def _tensors(what, role, ts, n=None):
    from .tensor import NkiTensor
    if not isinstance(ts, (list, tuple)) or not ts:
        raise fail(what, role, f"must be a non-empty list of tensors; got {ts!r}")
    for t in ts:
        if not isinstance(t, NkiTensor):
            raise fail(what, role, f"must hold NKI tensors; got {type(t).__name__}")
        if t.buffer is rt.psum:
            raise fail(what, role, "is in PSUM; collectives take HBM or SBUF tensors")
    if n is not None and len(ts) != n:
        raise fail(what, role, f"must hold {n} tensor(s) (one per source); got {len(ts)}")
    return list(ts)


def _memory(what, srcs, dsts, hbm_only=False, single=False):
    """All on HBM or all on SBUF; coalescing (several tensors) only on HBM."""
    on_sbuf = [t.buffer is rt.sbuf for t in srcs + dsts]
    if any(on_sbuf) and not all(on_sbuf):
        raise fail(what, "dsts", "mixes HBM and SBUF tensors; all must be on HBM or all on SBUF")
    sbuf = all(on_sbuf)
    if sbuf and hbm_only:
        raise fail(what, "srcs", "is on SBUF; this collective takes HBM tensors only")
    if single and len(srcs) != 1:
        raise fail(what, "srcs", f"must hold exactly one tensor (coalesced communication is not "
                                 f"supported here); got {len(srcs)}")
    if sbuf and len(srcs) > 1:
        raise fail(what, "srcs", f"holds {len(srcs)} SBUF tensors; coalesced collectives "
                                 f"(several tensors) need HBM tensors")
    io = rt.current_core().launch.io_storages
    for role, ts in (("srcs", srcs), ("dsts", dsts)):
        for t in ts:
            if id(t.storage) in io:
                raise fail(what, role, f"{t.name or 'a tensor'} is a kernel argument; a collective "
                                       f"cannot read or write the kernel's I/O tensors (copy it "
                                       f"to an nl.shared_hbm tensor first)")
    return sbuf


def _dim(what, dim, sbuf, allowed_hbm=(0,), allowed_sbuf=(0,)):
    allowed = allowed_sbuf if sbuf else allowed_hbm
    if dim not in allowed:
        where = "SBUF" if sbuf else "HBM"
        raise fail(what, "collective_dim", f"must be one of {list(allowed)} for {where} tensors; "
                                           f"got {dim!r}")


def _reduce_op(what, op):
    from . import ops
    table = {id(ops.add): np.add, id(ops.minimum): np.minimum, id(ops.maximum): np.maximum}
    f = table.get(id(op))
    if f is None:
        raise fail(what, "op", f"must be nl.add, nl.minimum or nl.maximum; got "
                               f"{getattr(op, 'name', op)!r}")
    return f


def _wide(a):
    a = np.asarray(a)
    if a.dtype.kind in "iub":
        return a.astype(np.int64)
    return a.astype(np.float32)


def _same(what, role, got, want):
    for r, shapes in got.items():
        if shapes != want:
            raise fail(what, role, f"differ between ranks: {shapes} on rank {r}, {want} here "
                                   f"(every rank passes tensors of the same shapes and dtypes)")


def _start(what, replica_group, allow_none=False):
    """Checks common to every collective; returns (core, world, rank, group, seq)."""
    core, launch, group = _caller(what, replica_group, allow_none)
    if core.gen.nc_version < 3:
        raise NkiValidationError(f"nki.collectives.{what}: needs NeuronCore-v3 or newer "
                                 f"(Trn2+); target is {core.gen.name}")
    seq = core.collective_seq
    core.collective_seq = seq + 1
    return core, launch.world, launch.rank, group, seq


def _emit(what, srcs, dsts, name, **attrs):
    from .isa._common import emit
    return emit("dma", what, [(f"srcs[{i}]", t) for i, t in enumerate(srcs)],
                [(f"dsts[{i}]", t) for i, t in enumerate(dsts)], {"collective": True, **attrs},
                name)


def _sig(ts):
    return [(tuple(t.shape), str(t.dtype)) for t in ts]


def _share(what, core, world, rank, group, seq, srcs, data=None, role="srcs"):
    """Meet the group: every rank's copy of its sources (``data``, else the tensors read now),
    checked to have this rank's shapes and dtypes. Returns {rank: [arrays]}."""
    if data is None:
        data = [np.array(s._read(), copy=True) for s in srcs]
    payload = (_sig(srcs), data)
    got = {rank: payload} if world is None else \
        world.meet(rank, core.program_id, seq, what, group, payload)
    _same(what, role, {r: p[0] for r, p in got.items()}, _sig(srcs))
    return {r: p[1] for r, p in got.items()}


def _split(what, srcs, group):
    """The sources split along dim 0 into one chunk per rank of the group; returns its size."""
    g = len(group)
    for i, s in enumerate(srcs):
        if s.shape[0] % g:
            raise fail(what, f"srcs[{i}]", f"dim 0 ({s.shape[0]}) does not split into {g} ranks")
    return g


def _reduce(f, parts):
    """Fold ``f`` over the arrays in order, in fp32 (int64 for integers)."""
    acc = None
    for x in parts:
        x = _wide(x)
        acc = x if acc is None else f(acc, x)
    return acc


def _write(t, arr):
    t._write(np.asarray(arr).astype(t.dtype.np, copy=False).reshape(t.shape))


def _check_dtypes(what, srcs, dsts):
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        if s.dtype is not d.dtype:
            raise fail(what, f"dsts[{i}]", f"has dtype {d.dtype}, srcs[{i}] {s.dtype}: a "
                                           f"collective does not convert dtypes")


# ------------------------------------------------------------------------------------ collectives
def all_reduce(srcs, dsts, replica_group, op, priority=None, name=None):
    """dsts[i] = op over the group's ranks of srcs[i] (element-wise)."""
    what = "all_reduce"
    srcs, dsts = _tensors(what, "srcs", srcs), _tensors(what, "dsts", dsts, len(srcs))
    f = _reduce_op(what, op)
    core, world, rank, group, seq = _start(what, replica_group)
    _memory(what, srcs, dsts)
    _check_dtypes(what, srcs, dsts)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        if s.shape != d.shape:
            raise fail(what, f"dsts[{i}]", f"has shape {d.shape}; srcs[{i}] is {s.shape}")
    got = _share(what, core, world, rank, group, seq, srcs)
    for i, d in enumerate(dsts):
        _write(d, _reduce(f, [got[r][i] for r in group]))
    return _emit(what, srcs, dsts, name, ranks=len(group))


def all_gather(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    """dsts[i] = the group's srcs[i] concatenated along ``collective_dim`` in group order."""
    what = "all_gather"
    srcs, dsts = _tensors(what, "srcs", srcs), _tensors(what, "dsts", dsts, len(srcs))
    core, world, rank, group, seq = _start(what, replica_group)
    sbuf = _memory(what, srcs, dsts)
    _dim(what, collective_dim, sbuf, (0,), (0, 1))
    _check_dtypes(what, srcs, dsts)
    g = len(group)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        want = list(s.shape)
        want[collective_dim] *= g
        if list(d.shape) != want:
            raise fail(what, f"dsts[{i}]", f"has shape {d.shape}; gathering {g} ranks' "
                                           f"{s.shape} along dim {collective_dim} gives {tuple(want)}")
    got = _share(what, core, world, rank, group, seq, srcs)
    for i, d in enumerate(dsts):
        _write(d, np.concatenate([got[r][i] for r in group], axis=collective_dim))
    return _emit(what, srcs, dsts, name, ranks=g)


def reduce_scatter(srcs, dsts, replica_group, collective_dim, op, priority=None, name=None):
    """Reduce srcs[i] over the group with ``op``, split it into one chunk per rank along
    ``collective_dim``; dsts[i] = the chunk at this rank's position in the group."""
    what = "reduce_scatter"
    srcs, dsts = _tensors(what, "srcs", srcs), _tensors(what, "dsts", dsts, len(srcs))
    f = _reduce_op(what, op)
    core, world, rank, group, seq = _start(what, replica_group)
    sbuf = _memory(what, srcs, dsts)
    _dim(what, collective_dim, sbuf)
    _check_dtypes(what, srcs, dsts)
    g = _split(what, srcs, group)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        want = (s.shape[0] // g, *s.shape[1:])
        if tuple(d.shape) != want:
            raise fail(what, f"dsts[{i}]", f"has shape {d.shape}; one of {g} chunks of "
                                           f"{s.shape} along dim 0 is {want}")
    got = _share(what, core, world, rank, group, seq, srcs)
    pos = group.index(rank)
    for i, d in enumerate(dsts):
        c = d.shape[0]
        _write(d, _reduce(f, [got[r][i][pos * c:(pos + 1) * c] for r in group]))
    return _emit(what, srcs, dsts, name, ranks=g)


def all_to_all(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    """Split srcs[i] into one chunk per rank along dim 0; rank at position j of the group
    receives chunk j of every rank, concatenated in group order."""
    what = "all_to_all"
    srcs, dsts = _tensors(what, "srcs", srcs), _tensors(what, "dsts", dsts, len(srcs))
    core, world, rank, group, seq = _start(what, replica_group)
    _memory(what, srcs, dsts, hbm_only=True)
    _dim(what, collective_dim, False)
    _check_dtypes(what, srcs, dsts)
    g = _split(what, srcs, group)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        if tuple(d.shape) != tuple(s.shape):
            raise fail(what, f"dsts[{i}]", f"has shape {d.shape}; srcs[{i}] is {s.shape}")
    got = _share(what, core, world, rank, group, seq, srcs)
    pos = group.index(rank)
    for i, d in enumerate(dsts):
        c = d.shape[0] // g
        _write(d, np.concatenate([got[r][i][pos * c:(pos + 1) * c] for r in group], axis=0))
    return _emit(what, srcs, dsts, name, ranks=g)


def collective_permute(srcs, dsts, source_target_pairs, priority=None, name=None):
    """Each (source, target) pair sends source's srcs[0] into target's dsts[0]; a rank that is
    no pair's target keeps its dsts."""
    what = "collective_permute"
    srcs, dsts = _tensors(what, "srcs", srcs), _tensors(what, "dsts", dsts, len(srcs))
    pairs = [tuple(p) for p in source_target_pairs]
    if any(len(p) != 2 for p in pairs):
        raise fail(what, "source_target_pairs", f"must be (source, target) pairs; got {pairs}")
    targets = [t for _, t in pairs]
    if len(set(targets)) != len(targets):
        raise fail(what, "source_target_pairs", f"names a target twice: {pairs}")
    members = sorted({r for p in pairs for r in p})
    core, world, rank, _, seq = _start(what, ReplicaGroup([members]) if members else None,
                                      allow_none=True)
    _memory(what, srcs, dsts, hbm_only=True, single=True)
    _check_dtypes(what, srcs, dsts)
    if srcs[0].shape != dsts[0].shape:
        raise fail(what, "dsts[0]", f"has shape {dsts[0].shape}; srcs[0] is {srcs[0].shape}")
    if rank not in members:
        raise fail(what, "source_target_pairs", f"{pairs} does not name rank {rank}, which "
                                                f"issued the collective")
    got = _share(what, core, world, rank, members, seq, srcs)
    for s, t in pairs:
        if t == rank:
            _write(dsts[0], got[s][0])
    return _emit(what, srcs, dsts, name, ranks=len(members))


def _channels(what, srcs_by_channel, dsts_by_channel, channel_ids, extra=()):
    ids = list(channel_ids)
    if ids != list(range(len(ids))) or not ids:
        raise fail(what, "channel_ids", f"must be consecutive integers from 0; got {ids}")
    if len(ids) > 4:
        raise fail(what, "channel_ids", f"asks for {len(ids)} channels; at most 4 exist (4 for "
                                        f"a group of every device in a node, 2 otherwise)")
    out = []
    for role, lists in (("srcs_by_channel", srcs_by_channel), *extra,
                        ("dsts_by_channel", dsts_by_channel)):
        if not isinstance(lists, (list, tuple)) or len(lists) != len(ids):
            raise fail(what, role, f"must hold one list per channel ({len(ids)}); got {lists!r}")
        ts = []
        for c, inner in enumerate(lists):
            inner = _tensors(what, f"{role}[{c}]", inner)
            if len(inner) != 1:
                raise fail(what, f"{role}[{c}]", f"must hold exactly one tensor; got {len(inner)}")
            ts.append(inner[0])
        out.append(ts)
    return out


def _ring(group, rank, step=1):
    pos = group.index(rank)
    return group[(pos - step) % len(group)]


def collective_permute_implicit(srcs_by_channel, dsts_by_channel, replica_group, channel_ids=(0,),
                                priority=None, name=None):
    """Ring step: each rank sends each channel's source to its successor in the ring and
    receives its predecessor's into the channel's destination."""
    what = "collective_permute_implicit"
    srcs, dsts = _channels(what, srcs_by_channel, dsts_by_channel, channel_ids)
    core, world, rank, group, seq = _start(what, replica_group)
    for c, (s, d) in enumerate(zip(srcs, dsts)):
        _memory(what, [s], [d])
        _check_dtypes(what, [s], [d])
        if s.shape != d.shape:
            raise fail(what, f"dsts_by_channel[{c}]", f"has shape {d.shape}; the source is {s.shape}")
    got = _share(what, core, world, rank, group, seq, srcs, role="srcs_by_channel")
    prev = _ring(group, rank)
    for c, d in enumerate(dsts):
        _write(d, got[prev][c])
    return _emit(what, srcs, dsts, name, ranks=len(group))


def collective_permute_implicit_reduce(srcs0_by_channel, srcs1_by_channel, dsts_by_channel,
                                       replica_group, op, channel_ids=(0,), priority=None,
                                       name=None):
    """Ring step with a reduction: each rank sends ``op(srcs0, srcs1)`` of each channel to its
    successor and receives its predecessor's into the channel's destination."""
    what = "collective_permute_implicit_reduce"
    srcs0, srcs1, dsts = _channels(what, srcs0_by_channel, dsts_by_channel, channel_ids,
                                   extra=(("srcs1_by_channel", srcs1_by_channel),))
    f = _reduce_op(what, op)
    core, world, rank, group, seq = _start(what, replica_group)
    for c, (a, b, d) in enumerate(zip(srcs0, srcs1, dsts)):
        _memory(what, [a, b], [d])
        _check_dtypes(what, [a, b], [d, d])
        if not a.shape == b.shape == d.shape:
            raise fail(what, f"dsts_by_channel[{c}]", f"sources {a.shape}, {b.shape} and "
                                                      f"destination {d.shape} must match")
    mine = [_reduce(f, [a._read(), b._read()]) for a, b in zip(srcs0, srcs1)]
    got = _share(what, core, world, rank, group, seq, srcs0, mine, "srcs0_by_channel")
    prev = _ring(group, rank)
    for c, d in enumerate(dsts):
        _write(d, got[prev][c])
    return _emit(what, srcs0 + srcs1, dsts, name, ranks=len(group))


def collective_permute_implicit_current_processing_rank_id(iteration_id, replica_group,
                                                           channel_id=0, name=None):
    """The rank whose data a rank holds after ``iteration_id`` ring steps (its own at 0), as a
    register."""
    from .scalars import VirtualRegister, is_runtime
    what = "collective_permute_implicit_current_processing_rank_id"
    core, launch, group = _caller(what, replica_group)
    rank = launch.rank
    if not 0 <= channel_id < 4:
        raise fail(what, "channel_id", f"must be 0..3; got {channel_id!r}")
    it = iteration_id._v if is_runtime(iteration_id) else int(iteration_id)
    return VirtualRegister(_ring(group, rank, it))


def _not_emulated(n):
    def f(*args, **kwargs):
        raise NotImplementedError(f"nki.collectives.{n}: the metadata-driven variable-length "
                                  f"collectives are not emulated")
    f.__name__ = f.__qualname__ = n
    return f


all_gather_v = _not_emulated("all_gather_v")
all_to_all_v = _not_emulated("all_to_all_v")

__all__ = ["ReplicaGroup", "rank_id", "all_reduce", "all_gather", "all_gather_v",
           "reduce_scatter", "all_to_all", "all_to_all_v", "collective_permute",
           "collective_permute_implicit", "collective_permute_implicit_reduce",
           "collective_permute_implicit_current_processing_rank_id", "run_ranks"]
