"""nki.collectives across ranks: ``collectives.run_ranks`` runs one launch per rank, and each
collective is checked against plain NumPy on the ranks' inputs (nki-spec §9.10; the API text of
the SDK's nki/api/nki/collectives/__init__.py)."""
from __future__ import annotations

import numpy as np
import pytest

from nki_kernels.emulator import NkiValidationError, jit, target
from nki_kernels.emulator import collectives as ncc
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator.collectives import ReplicaGroup, run_ranks

RNG = np.random.default_rng(7)


def _hbm_collective(fn, out_shape=None):
    """A kernel: input -> shared_hbm src, ``fn(src, dst)``, dst -> output."""
    @jit
    def k(x, rg):
        shape = out_shape(x.shape, rg) if out_shape else x.shape
        src = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm, name="src")
        dst = nl.ndarray(shape, dtype=x.dtype, buffer=nl.shared_hbm, name="dst")
        out = nl.ndarray(shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=src, src=x)
        fn(src, dst, rg)
        nisa.dma_copy(dst=out, src=dst)
        return out
    return k


def _run(kernel, xs, rg, lnc=1, tgt="trn2"):
    with target(tgt):
        return [np.asarray(o) for o in run_ranks(kernel[lnc], [dict(x=x, rg=rg) for x in xs])]


@pytest.mark.parametrize("lnc", [1, 2])
def test_all_reduce_sums_every_rank(lnc):
    xs = RNG.standard_normal((4, 128, 32)).astype(np.float32)
    k = _hbm_collective(lambda s, d, rg: ncc.all_reduce([s], [d], rg, nl.add))
    outs = _run(k, xs, ReplicaGroup([[0, 1, 2, 3]]), lnc)
    for o in outs:
        np.testing.assert_allclose(o, xs.sum(0), rtol=1e-6, atol=1e-6)


def test_all_reduce_max_in_two_disjoint_groups():
    xs = RNG.standard_normal((4, 16, 8)).astype(np.float32)
    k = _hbm_collective(lambda s, d, rg: ncc.all_reduce([s], [d], rg, nl.maximum))
    outs = _run(k, xs, ReplicaGroup([[0, 2], [1, 3]]))
    for r, o in enumerate(outs):
        g = [0, 2] if r in (0, 2) else [1, 3]
        np.testing.assert_array_equal(o, np.maximum(xs[g[0]], xs[g[1]]))


def test_all_gather_hbm_concatenates_in_group_order():
    xs = RNG.standard_normal((3, 8, 16)).astype(np.float32)
    k = _hbm_collective(lambda s, d, rg: ncc.all_gather([s], [d], rg, 0),
                        lambda shp, rg: (shp[0] * len(rg.groups[0]), shp[1]))
    outs = _run(k, xs, ReplicaGroup([[2, 0, 1]]))
    for o in outs:
        np.testing.assert_array_equal(o, np.concatenate([xs[2], xs[0], xs[1]], 0))


@pytest.mark.parametrize("lnc", [1, 2])
def test_all_gather_sbuf_along_the_free_dim(lnc):
    @jit
    def k(x, rg):
        H, W = x.shape
        a = nl.ndarray((H, W), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x)
        b = nl.ndarray((H, 2 * W), dtype=x.dtype, buffer=nl.sbuf)
        ncc.all_gather([a], [b], rg, 1)
        out = nl.ndarray((H, 2 * W), dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=b)
        return out
    xs = RNG.standard_normal((2, 64, 32)).astype(np.float32)
    for o in _run(k, xs, ReplicaGroup([[0, 1]]), lnc):
        np.testing.assert_array_equal(o, np.concatenate([xs[0], xs[1]], 1))


def test_reduce_scatter_gives_each_rank_its_chunk_of_the_sum():
    xs = RNG.standard_normal((2, 64, 8)).astype(np.float32)
    k = _hbm_collective(lambda s, d, rg: ncc.reduce_scatter([s], [d], rg, 0, nl.add),
                        lambda shp, rg: (shp[0] // 2, shp[1]))
    outs = _run(k, xs, ReplicaGroup([[0, 1]]))
    total = xs[0] + xs[1]
    np.testing.assert_allclose(outs[0], total[:32], rtol=1e-6)
    np.testing.assert_allclose(outs[1], total[32:], rtol=1e-6)


def test_all_to_all_exchanges_chunks():
    xs = RNG.standard_normal((4, 8, 4)).astype(np.float32)
    k = _hbm_collective(lambda s, d, rg: ncc.all_to_all([s], [d], rg, 0))
    outs = _run(k, xs, ReplicaGroup([[0, 1, 2, 3]]))
    for j, o in enumerate(outs):       # rank j gets chunk j (2 rows) of every rank, in order
        np.testing.assert_array_equal(o, np.concatenate([x[2 * j:2 * j + 2] for x in xs], 0))


def test_collective_permute_follows_the_pairs():
    xs = RNG.standard_normal((3, 8, 8)).astype(np.float32)
    pairs = [(0, 1), (1, 2), (2, 0)]
    k = _hbm_collective(lambda s, d, rg: ncc.collective_permute([s], [d], pairs))
    outs = _run(k, xs, None)
    for s, t in pairs:
        np.testing.assert_array_equal(outs[t], xs[s])


@pytest.mark.parametrize("lnc", [1, 2])
def test_ring_all_gather_with_implicit_permute_and_processing_rank(lnc):
    """A ring all-gather written the documented way: at step i, place the chunk of the rank
    ``current_processing_rank_id(i)`` names, then pass it on with the implicit permute."""
    n = 4

    @jit
    def k(x, rg):
        H, W = x.shape
        out = nl.ndarray((n, H, W), dtype=x.dtype, buffer=nl.shared_hbm)
        bufs = [nl.ndarray((H, W), dtype=x.dtype, buffer=nl.shared_hbm, name=f"b{i}")
                for i in range(2)]
        nisa.dma_copy(dst=bufs[0], src=x)
        for i in range(n):
            r = ncc.collective_permute_implicit_current_processing_rank_id(i, rg)
            nisa.dma_copy(dst=out.ap(pattern=[[W, H], [1, W]], scalar_offset=r, indirect_dim=0),
                          src=bufs[i % 2])
            if i + 1 < n:
                ncc.collective_permute_implicit([[bufs[i % 2]]], [[bufs[(i + 1) % 2]]], rg)
        return out
    xs = RNG.standard_normal((n, 16, 8)).astype(np.float32)
    for o in _run(k, xs, ReplicaGroup([list(range(n))]), lnc):
        np.testing.assert_array_equal(o, xs)


def test_implicit_permute_reduce_sends_the_reduced_sources():
    @jit
    def k(x, rg):
        a = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm, name="a")
        d = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm, name="d")
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=a, src=x)
        ncc.collective_permute_implicit_reduce([[a]], [[a]], [[d]], rg, nl.add)
        nisa.dma_copy(dst=out, src=d)
        return out
    xs = RNG.standard_normal((3, 8, 8)).astype(np.float32)
    outs = _run(k, xs, ReplicaGroup([[0, 1, 2]]))
    for r in range(3):                  # predecessor in the ring 0 -> 1 -> 2 -> 0
        np.testing.assert_allclose(outs[r], 2 * xs[(r - 1) % 3], rtol=1e-6)


def test_rank_id_is_a_register_per_rank():
    @jit
    def k(x, rg):
        _, H, W = x.shape
        out = nl.ndarray((H, W), dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x.ap(pattern=[[W, H], [1, W]], scalar_offset=ncc.rank_id(),
                                        indirect_dim=0))
        return out
    x = RNG.standard_normal((3, 4, 8)).astype(np.float32)
    outs = _run(k, [x] * 3, None)
    for r, o in enumerate(outs):
        np.testing.assert_array_equal(o, x[r])
    assert ncc.rank_id() == 0          # outside a kernel


# ------------------------------------------------------------------------------------ refusals
def _refused(kernel, xs, rg, match, lnc=1, tgt="trn2"):
    with pytest.raises(NkiValidationError, match=match):
        _run(kernel, xs, rg, lnc, tgt)


def test_a_group_larger_than_the_run_is_refused_naming_run_ranks():
    k = _hbm_collective(lambda s, d, rg: ncc.all_reduce([s], [d], rg, nl.add))
    x = np.ones((8, 8), np.float32)
    with target("trn2"), pytest.raises(NkiValidationError, match="run_ranks"):
        k(x, ReplicaGroup([[0, 1]]))


def test_ranks_issuing_different_collectives_are_refused():
    @jit
    def k(x, rg):
        src = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm, name="src")
        dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm, name="dst")
        nisa.dma_copy(dst=src, src=x)
        if x.shape[1] == 8:
            ncc.all_reduce([src], [dst], rg, nl.add)
        else:
            ncc.all_to_all([src], [dst], rg, 0)
        return dst
    with target("trn2"), pytest.raises(NkiValidationError, match="same collectives"):
        run_ranks(k, [dict(x=np.ones((8, 8), np.float32), rg=ReplicaGroup([[0, 1]])),
                      dict(x=np.ones((8, 4), np.float32), rg=ReplicaGroup([[0, 1]]))])


def test_a_rank_that_skips_a_collective_is_reported():
    @jit
    def k(x, rg, skip):
        src = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm, name="src")
        dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm, name="dst")
        nisa.dma_copy(dst=src, src=x)
        if not skip:
            ncc.all_reduce([src], [dst], rg, nl.add)
        return dst
    x, rg = np.ones((8, 8), np.float32), ReplicaGroup([[0, 1]])
    with target("trn2"), pytest.raises(NkiValidationError, match="ended without reaching"):
        run_ranks(k, [dict(x=x, rg=rg, skip=False), dict(x=x, rg=rg, skip=True)])


def test_kernel_arguments_cannot_be_collective_operands():
    @jit
    def k(x, rg):
        dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm, name="dst")
        ncc.all_reduce([x], [dst], rg, nl.add)
        return dst
    _refused(k, [np.ones((8, 8), np.float32)] * 2, ReplicaGroup([[0, 1]]), "kernel argument")


def test_documented_limits_are_refused():
    x2 = [np.ones((8, 8), np.float32)] * 2
    rg = ReplicaGroup([[0, 1]])
    # all_gather on HBM: collective_dim 0 only
    k = _hbm_collective(lambda s, d, rg: ncc.all_gather([s], [d], rg, 1),
                        lambda shp, rg: (shp[0], shp[1] * 2))
    _refused(k, x2, rg, "collective_dim")
    # reduction op: add / minimum / maximum only
    k = _hbm_collective(lambda s, d, rg: ncc.all_reduce([s], [d], rg, nl.multiply))
    _refused(k, x2, rg, "nl.add, nl.minimum or nl.maximum")
    # all_gather destination of the wrong shape
    k = _hbm_collective(lambda s, d, rg: ncc.all_gather([s], [d], rg, 0))
    _refused(k, x2, rg, "gathering 2 ranks")

    @jit
    def sb(x, rg):            # all_to_all takes HBM tensors only
        a = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        b = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x)
        ncc.all_to_all([a], [b], rg, 0)
        return x
    _refused(sb, x2, rg, "HBM tensors only")

    @jit
    def mixed(x, rg):         # HBM and SBUF mixed
        a = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        b = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm, name="b")
        nisa.dma_copy(dst=a, src=x)
        ncc.all_reduce([a], [b], rg, nl.add)
        return b
    _refused(mixed, x2, rg, "mixes HBM and SBUF")


def test_collectives_need_trn2_or_newer():
    k = _hbm_collective(lambda s, d, rg: ncc.all_reduce([s], [d], rg, nl.add))
    _refused(k, [np.ones((8, 8), np.float32)], ReplicaGroup([[0]]), "NeuronCore-v3", tgt="trn1")


def test_variable_length_collectives_say_they_are_not_emulated():
    with pytest.raises(NotImplementedError, match="all_gather_v"):
        ncc.all_gather_v([], [], ReplicaGroup([[0]]), None)
