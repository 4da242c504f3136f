"""``nki.collectives``: the names NKI 0.2+ defines for collective communication (nki-spec §9.10).

Collectives move data between NeuronCores of different ranks (devices or logical cores in a
replica group). The emulator runs one rank, so only the names exist here: ``ReplicaGroup`` can be
built and inspected, ``rank_id()`` is 0, and every data-moving collective raises
``NotImplementedError`` naming itself (kernels that use them import and trace up to that call).
"""
from __future__ import annotations


class ReplicaGroup:
    """A group of ranks taking part in a collective (a list of rank-id lists)."""

    def __init__(self, groups=None, *args, **kwargs):
        self.groups = [list(g) for g in groups] if groups is not None else [[0]]
        self.args, self.kwargs = args, kwargs

    def __repr__(self):
        return f"ReplicaGroup({self.groups})"


def rank_id(*args, **kwargs):
    """The calling rank's id: the emulator runs a single rank."""
    return 0


_COLLECTIVES = [
    "all_reduce", "all_gather", "all_gather_v", "reduce_scatter", "all_to_all", "all_to_all_v",
    "collective_permute", "collective_permute_implicit",
    "collective_permute_implicit_current_processing_rank_id", "send", "recv", "broadcast",
]


def _missing(n):
    def f(*args, **kwargs):
        raise NotImplementedError(f"nki.collectives.{n}: collectives between ranks are not "
                                  f"emulated (the emulator runs a single rank)")
    f.__name__ = f.__qualname__ = n
    return f


for _n in _COLLECTIVES:
    globals()[_n] = _missing(_n)

__all__ = ["ReplicaGroup", "rank_id"] + _COLLECTIVES
