"""router_topk against its NumPy reference (both targets): softmax / sigmoid scoring, renormalised
or not, DeepSeek-V3 group-limited selection with a correction bias and routed scaling, k > 8
(several search rounds), E < 8, multi-tile T; ties against torch; every refusal."""
import ml_dtypes
import numpy as np
import pytest

from nki_kernels import router_topk
from nki_kernels.emulator import target
from nki_kernels.reference.router_topk import router_topk_ref
from nki_kernels.reference.shapes import DEEPSEEK_V3, QWEN3_30B_A3B

BF16 = ml_dtypes.bfloat16


def _check(logits, k, **kw):
    w, ids = router_topk(logits, k, **kw)
    wr, ir = router_topk_ref(logits, k, **kw)
    assert w.shape == (logits.shape[0], k) and w.dtype == np.float32
    assert ids.shape == (logits.shape[0], k) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids, ir)
    np.testing.assert_allclose(w, wr, rtol=2e-6, atol=1e-7)
    return w, ids


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (130, 64, 8), (5, 128, 10), (7, 4, 2)],
                         ids=["T1-E8-k2", "T130-E64-k8", "T5-E128-k10", "E4-k2"])
@pytest.mark.parametrize("renorm", [True, False])
def test_softmax(tgt, rng, T, E, k, renorm):
    _check(rng.standard_normal((T, E)).astype(np.float32) * 3, k, renormalize=renorm)


def test_bf16_logits_and_model_widths(tgt, rng):
    E, k = QWEN3_30B_A3B.n_experts, QWEN3_30B_A3B.top_k
    _check(rng.standard_normal((9, E)).astype(BF16), k)


@pytest.mark.parametrize("groups", [None, (8, 4), (8, 3)], ids=["nogroups", "g8of4", "g8of3"])
def test_sigmoid_deepseek(tgt, rng, groups):
    """DeepSeek-V3 routing at its real width (256 experts, top 8, 8 groups keep 4, bias, x2.5)."""
    E, k = DEEPSEEK_V3.n_experts, DEEPSEEK_V3.top_k
    kw = dict(scoring="sigmoid", correction_bias=rng.standard_normal(E).astype(np.float32) * 0.3,
              routed_scaling=2.5)
    if groups:
        kw.update(n_groups=groups[0], topk_groups=groups[1])
    w, ids = _check(rng.standard_normal((20, E)).astype(np.float32), k, **kw)
    if groups:   # every chosen expert lies in one of the kept groups
        assert all(len(set(r // (E // groups[0]))) <= groups[1] for r in ids)
    np.testing.assert_allclose(w.sum(axis=1), 2.5, rtol=1e-5)


def test_small_groups_and_no_renorm(tgt, rng):
    """Groups of 2 experts (padded to the 8-wide search inside), sigmoid without renorm."""
    _check(rng.standard_normal((3, 16)).astype(np.float32), 3, scoring="sigmoid",
           renormalize=False, n_groups=8, topk_groups=2)


def test_ties_go_to_the_lower_id(tgt):
    """Rows with tied logits: the chosen ids are the lowest tied ids, in ascending order, as
    torch.sort(stable=True) orders them. torch.topk on CPU does not promise this (for a row of
    zeros it returns ids from the middle of the row): its values must agree, not its ids."""
    torch = pytest.importorskip("torch")
    E, k = 64, 8
    x = np.zeros((4, E), np.float32)
    x[1, [3, 9, 40, 41, 63]] = 2.0                       # five tied maxima, then zeros
    x[2, ::2] = 1.0                                      # 32 tied, k among them
    x[3] = np.repeat(np.arange(8, dtype=np.float32), 8)  # tied blocks of 8
    want = torch.sort(torch.from_numpy(x), dim=1, descending=True, stable=True).indices
    for kw in ({}, {"scoring": "sigmoid"}):
        w, ids = _check(x, k, **kw)
        np.testing.assert_array_equal(ids, want[:, :k].numpy())
        vals = torch.topk(torch.from_numpy(x), k).values.numpy()
        np.testing.assert_array_equal(np.take_along_axis(x, ids, 1), vals)
        np.testing.assert_array_equal(ids[0], np.arange(8))
        np.testing.assert_array_equal(ids[1], [3, 9, 40, 41, 63, 0, 1, 2])
    # groups of 8: group 5 (two maxima) wins, groups 0, 1, 7 tie (one maximum each): group 0
    _, ids = _check(x, k, scoring="sigmoid", n_groups=8, topk_groups=2)
    np.testing.assert_array_equal(ids[1], [3, 40, 41, 0, 1, 2, 4, 5])


def test_no_ties_matches_torch_topk(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((16, 128)).astype(np.float32)
    _, ids = router_topk(x, 8)
    ref = torch.topk(torch.softmax(torch.from_numpy(x), dim=-1), 8)
    np.testing.assert_array_equal(ids, ref.indices.numpy())


def test_torch_in(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((4, 32)).astype(np.float32)
    w, ids = router_topk(torch.from_numpy(x), 4)
    wr, ir = router_topk_ref(x, 4)
    np.testing.assert_array_equal(ids, ir)
    np.testing.assert_allclose(w, wr, rtol=2e-6)


def test_rejects_bad_input(rng):
    x = rng.standard_normal((4, 16)).astype(np.float32)
    with pytest.raises(ValueError, match=r"router_topk: top_k must be an int in \[1, E=16\]; got 17"):
        router_topk(x, 17)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, E=16\]; got 0"):
        router_topk(x, 0)
    with pytest.raises(ValueError, match=r"scoring must be 'softmax' or 'sigmoid'; got 'relu'"):
        router_topk(x, 2, scoring="relu")
    with pytest.raises(TypeError, match=r"logits.dtype must be float32 or bfloat16; got int32"):
        router_topk(x.astype(np.int32), 2)
    with pytest.raises(ValueError, match=r"logits must be a 2-D array; got shape \(16,\)"):
        router_topk(x[0], 2)
    with pytest.raises(ValueError, match=r"n_groups and topk_groups go together"):
        router_topk(x, 2, n_groups=4)
    with pytest.raises(ValueError, match=r"n_groups must divide E=16 into groups of at least 2"):
        router_topk(x, 2, n_groups=3, topk_groups=1)
    with pytest.raises(ValueError, match=r"topk_groups must be an int in \[1, n_groups=4\]; got 5"):
        router_topk(x, 2, n_groups=4, topk_groups=5)
    with pytest.raises(ValueError, match=r"top_k=5 exceeds the 4 experts of the 1 kept groups"):
        router_topk(x, 5, n_groups=4, topk_groups=1)
    with pytest.raises(ValueError, match=r"correction_bias must be a vector of length 16"):
        router_topk(x, 2, correction_bias=np.zeros(8, np.float32))
    with pytest.raises(TypeError, match=r"routed_scaling must be a number"):
        router_topk(x, 2, routed_scaling="2")
    with pytest.raises(TypeError, match=r"renormalize must be True or False; got 'no'"):
        router_topk(x, 2, renormalize="no")
    with target("trn1"), pytest.raises(ValueError, match=r"router_topk: target trn1 is not "):
        router_topk(x, 2)
    with pytest.raises(ValueError, match=r"at most 16384 experts are supported; got E=16385"):
        router_topk(np.zeros((1, 16385), np.float32), 2)
