"""Decode attention against its NumPy reference: contiguous and paged caches (NaN in every slot a
sequence does not own, shuffled tables), GQA/MQA, speculative s_q up to 8 with windows smaller
than the drafts, soft-cap, sinks, lse, FP8 caches at their range limits, head_dim 64-256,
empty / length-1 / very mixed batches, LNC=2 split-KV, both targets; the split planner and the
KV tile geometry; every refusal.

Accuracy rule (reference/compare.py): kernel error <= 2 x the error of a same-precision
reference (probabilities rounded to bf16 for P @ V) + 1e-3, both against a float64 reference;
lse by the same rule; NaN / inf positions must match.
"""
import ml_dtypes
import numpy as np
import pytest

from nki_kernels import decode_attention
from nki_kernels.attention.kv_cache import KVLayout, tokens_per_partition
from nki_kernels.attention.split_kv import plan_split_kv
from nki_kernels.reference.compare import assert_attention_close
from nki_kernels.reference.decode_attention import (
    bytes_decode_attention,
    decode_attention_ref,
    flops_decode_attention,
)
from nki_kernels.reference.shapes import FAST, ODD

BF16 = ml_dtypes.bfloat16
FP8 = {"trn2": ml_dtypes.float8_e4m3, "trn3": ml_dtypes.float8_e4m3fn}


def _paged(rng, dense, lens, bs, spare=3):
    """A paged copy of ``dense [B, S, H, d]``: shuffled physical blocks, NaN in every slot no
    sequence owns (unused pages and the tail of each last page), ``spare`` extra NaN pages."""
    B, _, H, d = dense.shape
    need = [-(-int(L) // bs) for L in lens]
    nb = sum(need) + spare
    perm = rng.permutation(nb)
    cache = np.full((nb, bs, H, d), np.nan, dtype=np.float32).astype(dense.dtype)
    table = np.full((B, max(need + [1]) + 2), nb + 7, dtype=np.int32)   # junk past the end
    i = 0
    for b, L in enumerate(lens):
        for n in range(need[b]):
            p = perm[i]
            i += 1
            table[b, n] = p
            m = min(bs, int(L) - n * bs)
            cache[p, :m] = dense[b, n * bs:n * bs + m]
    return cache, table


def _inputs(rng, B, s_q, Hq, Hkv, d, lens, kv_dtype=BF16, q_scale=1.0, kv_scale=1.0):
    S = max(list(lens) + [1]) + 3
    q = (rng.standard_normal((B, s_q, Hq, d)) * q_scale).astype(BF16)
    k = (rng.standard_normal((B, S, Hkv, d)) * kv_scale).astype(kv_dtype)
    v = (rng.standard_normal((B, S, Hkv, d)) * kv_scale).astype(kv_dtype)
    for b, L in enumerate(lens):             # poison the contiguous cache past each length
        k[b, L:] = np.nan
        v[b, L:] = np.nan
    return q, k, v


def _check(out, q, k, v, lens, **kw):
    o, lse = out
    exact, else_ = decode_attention_ref(q, k, v, lens, return_lse=True, compute_dtype=np.float64,
                                       **kw)
    same, slse = decode_attention_ref(q, k, v, lens, return_lse=True, p_dtype="bfloat16", **kw)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == np.float32
    assert_attention_close(o, same, exact)
    empty = np.isneginf(else_)                 # rows that see no key: lse -inf exactly
    assert np.array_equal(np.isneginf(lse), empty)
    assert_attention_close(lse[~empty], slse[~empty], else_[~empty], what="lse")


def _run(q, k, v, lens, bs=None, rng=None, lnc=1, **kw):
    if bs:
        k, table = _paged(np.random.default_rng(7), k, lens, bs)
        v, _ = _paged(np.random.default_rng(7), v, lens, bs)
        kw["block_table"] = table
    out = decode_attention(q, k, v, np.asarray(lens), return_lse=True, lnc=lnc, **kw)
    _check(out, q, k, v, lens, **kw)
    return out


# ------------------------------------------------------------------------------ correctness


@pytest.mark.parametrize("bs", [None, 16, 64])
def test_gqa_mixed_lengths(tgt, rng, bs):
    """Lengths 1, 17 and 300 in one batch (one tile, a partial tile, several tiles)."""
    lens = [1, 17, 300]
    q, k, v = _inputs(rng, 3, 1, 8, 2, 128, lens)
    _run(q, k, v, lens, bs)


@pytest.mark.parametrize("s_q, bs, lnc, opts", [
    (1, None, 1, {}), (1, 64, 1, {"sinks": True}), (2, 16, 1, {}), (1, None, 2, {}),
    (1, 32, 1, {"window": 2500}), (1, None, 1, {"whole": True}),
    (1, 64, 1, {"whole": True, "sinks": True}), (1, None, 2, {"whole": True})])
def test_one_kv_head_packed_slots(tgt, rng, s_q, bs, lnc, opts):
    """One KV head (Llama-3-70B TP8 / MQA): full unmasked tiles spread their token slices over
    the four PE column tiles (the head's rows in each, a softmax state per slot, folded at the
    end); masked and partial tiles keep the row layout. The case must take the packed path.
    ``whole``: the first sequence is a whole number of tiles, so every one of its tiles runs
    packed and the row state starts from the folded slots."""
    from nki_kernels.attention.decode_attention import DecodePlan, decode_schedule, slot_width
    opts = dict(opts)
    lens = [4100, 6000, 17]
    Hq = 8
    if opts.pop("whole", False):
        tk = decode_schedule(lens, s_q, Hq, 1, 128, 2, bs, None, lnc)[0].tile_keys
        lens = [3 * tk, tk + 5, 17]
    lay, items = decode_schedule(lens, s_q, Hq, 1, 128, 2, bs, opts.get("window"), lnc)
    W = slot_width(Hq * s_q)
    plan = DecodePlan(B=3, s_q=s_q, Hq=Hq, Hkv=1, d=128, W=W, nslot=128 // W, layout=lay,
                      seq_lens=tuple(lens), items=items, window=0, softcap=0.0, has_sinks=False,
                      has_vscale=False, return_lse=True, out_dtype=None, kt_act=0.5)
    assert plan.packed and max(lens) > 2 * lay.tile_keys, (lay, plan.nslot)
    q, k, v = _inputs(rng, 3, s_q, Hq, 1, 128, lens)
    kw = dict(opts)
    if kw.pop("sinks", False):
        kw["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    _run(q, k, v, lens, bs, lnc=lnc, **kw)


def _packed_one_kv_head(rng, tgt, n_tiles):
    """Two sequences of ``n_tiles`` and 2 whole tiles, 8 q heads on one KV head (d 128: every
    tile packed), run on ``tgt`` under a trace and checked against the references. Returns the
    trace, each instruction's source function, and ``(lens, tile_keys)``."""
    from nki_kernels.attention.decode_attention import decode_schedule
    from nki_kernels.emulator.runtime import target
    from nki_kernels.emulator.trace import trace
    Hq, d = 8, 128
    tk = decode_schedule([8192], 1, Hq, 1, d, 2, None, None, 1)[0].tile_keys
    lens = [n_tiles * tk, 2 * tk]
    q, k, v = _inputs(rng, 2, 1, Hq, 1, d, lens)
    with target(tgt), trace() as t:
        o = decode_attention(q, k, v, np.array(lens, np.int32))
    ref = decode_attention_ref(q, k, v, lens, p_dtype="bfloat16")
    exact = decode_attention_ref(q, k, v, lens, compute_dtype=np.float64)
    assert_attention_close(o, ref, exact)
    return t, [ins.src[2] if ins.src else "" for ins in t], (lens, tk)


def test_packed_fold_weights_before_last_pv(rng):
    """A packed item's fold (the slots' states into the row state) needs only the final maxima
    for its weights: their two steps (``fold_max``, ``fold_exp``) are issued before the item's
    last P V products, and only the weighted sum (``fold_apply``) after them. The program's last
    item leaves the folded o and l in PSUM for the output division (no copy to SBUF)."""
    t, fn, (lens, _) = _packed_one_kv_head(rng, "trn3", 3)
    pv = [i for i, f in enumerate(fn) if f == "stage_pv_packed"]
    steps = {f: [i for i, g in enumerate(fn) if g == f] for f in ("fold_max", "fold_exp",
                                                                  "fold_apply")}
    assert all(len(v) for v in steps.values()), steps
    # one fold per item: split the instructions at the first fold_apply of each item
    ends = [i for i in steps["fold_apply"] if fn[i - 1] != "fold_apply"]
    assert len(ends) == len(lens)
    start = 0
    for end in ends:
        last_pv = max(i for i in pv if start <= i < end)
        w = [i for i in steps["fold_max"] + steps["fold_exp"] if start <= i < end]
        assert w and max(w) < last_pv, (max(w), last_pv)
        start = end
    rec = [ins for ins in t if ins.src and ins.src[2] == "finalize" and ins.opcode == "reciprocal"]
    assert len(rec) == len(lens)
    assert "psum" in rec[-1].reads[0].buffer           # the last item: l read from PSUM
    assert "psum" not in rec[0].reads[0].buffer


def test_one_kv_head_loads(rng):
    """A one-KV-head (packed) plan with s_q = 1: each item's Q^T comes from HBM by one 2-D DMA
    transpose (``[G, d]`` into slot 0, copied on chip to the other slots), with no Q row loads,
    no TensorE transpose of Q and no identity matrix loaded (bf16 cache); and its K loads run
    ``PACKED_V_BEHIND`` (3 on Trn2) tiles ahead of the V loads, so the program's last K lands
    ahead of its last 4 V tiles and the last tiles' K chains (K^T, scores, softmax, P^T) start
    sooner. The values are checked by the packed tests above."""
    from nki_kernels.attention.decode_attention import PACKED_V_BEHIND
    Hq, d = 8, 128
    t, fn, (lens, tk) = _packed_one_kv_head(rng, "trn2", 6)
    dmas = [ins for ins in t if ins.engine == "dma" and ins.writes[0].buffer == "sbuf"]
    # Q: one DMA transpose per item, nothing else reads q; no TensorE transposes of Q
    qT = [ins for ins in dmas if ins.opcode == "dma_transpose"]
    assert len(qT) == len(lens) and {ins.reads[0].shape for ins in qT} == {(Hq, d)}
    q_id = qT[0].reads[0].alloc
    assert [ins for ins in dmas if ins.reads[0].alloc == q_id] == qT
    assert "_ready_dims" not in fn
    assert not [ins for ins in t if ins.engine == "dma" and ins.src and
                ins.src[2] == "decode_attention_kernel" and ins.writes[0].buffer == "sbuf"]
    # KV: one DMA per tile and cache, the last K ahead of the last 4 V tiles (K 3 tiles ahead)
    kv = [ins.reads[0].alloc for ins in dmas if ins.src and ins.src[2] == "load_kv_tile"]
    assert len(kv) == 2 * sum(lens) // tk
    k_id = kv[0]
    last_k = max(i for i, a in enumerate(kv) if a == k_id)
    assert len(kv) - 1 - last_k == 4 and PACKED_V_BEHIND[3] == 3


def test_vector_gather(tgt, rng, monkeypatch):
    """The software-DGE form of the paged gather (row indices built on chip from the table)."""
    from nki_kernels.attention import decode_attention as mod
    monkeypatch.setattr(mod, "GATHER", "vector")
    lens = [300, 1]
    q, k, v = _inputs(rng, 2, 1, 8, 2, 128, lens)
    _run(q, k, v, lens, 16)


@pytest.mark.parametrize("bs", [32, 128])
def test_paged_block_sizes(tgt, rng, bs):
    lens = [bs * 3 + 5, 2]
    q, k, v = _inputs(rng, 2, 1, 4, 1, 128, lens)
    _run(q, k, v, lens, bs)


def test_drafts_window_smaller_than_drafts(tgt, rng):
    """s_q = 8 speculative tokens, window 5 < 8: each draft sees its own band only."""
    lens = [8, 700]
    q, k, v = _inputs(rng, 2, 8, 4, 1, 64, lens)
    _run(q, k, v, lens, 64, window=5)


def test_last_sequence_stored_by_draft(rng):
    """With s_q > 1 drafts a per-KV-head store of o spans rows of out[b] ([s_q, H_q, d]) that
    every other head's store spans too, and such DMAs are ordered one after another. The
    program's last sequence (nothing after it to hide them) is stored one DMA per draft and row
    group instead, each a contiguous block of out that no other store of it overlaps; earlier
    sequences keep one DMA per head. The values are checked by the other drafts tests."""
    from nki_kernels.emulator.runtime import target
    from nki_kernels.emulator.trace import trace
    B, s_q, Hq, Hkv, d = 3, 4, 8, 2, 64
    lens = [300, 520, 410]
    q, k, v = _inputs(rng, B, s_q, Hq, Hkv, d, lens)
    with target("trn3"), trace() as t:
        o = decode_attention(q, k, v, np.array(lens, np.int32))
    ref = decode_attention_ref(q, k, v, lens, p_dtype="bfloat16")
    exact = decode_attention_ref(q, k, v, lens, compute_dtype=np.float64)
    assert_attention_close(o, ref, exact)
    rows = Hq * s_q                        # rows of out per sequence ([B * s_q * H_q, d] rows)
    stores = {}
    for ins in t:
        w = ins.writes[0] if ins.writes else None
        if ins.engine == "dma" and w is not None and w.buffer.endswith("hbm") and w.shape[-1] == d:
            stores.setdefault(w.partitions[0] // rows, []).append(w.partitions)
    by_draft = [b for b, v in stores.items() if len(v) == s_q]
    assert len(by_draft) == 1 and len(stores) == B             # one row group: 2 KV heads
    spans = sorted(stores.pop(by_draft[0]))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))      # disjoint row ranges
    for v in stores.values():                                      # the others: per head,
        assert len(v) == Hkv and v[0][0] < v[1][1] and v[1][0] < v[0][1]   # overlapping


def test_softcap_sinks_drafts(tgt, rng):
    lens = [4, 500]
    q, k, v = _inputs(rng, 2, 4, 8, 2, 128, lens, q_scale=3.0)
    _run(q, k, v, lens, softcap=20.0, sinks=np.linspace(-1, 3, 8).astype(np.float32))


@pytest.mark.parametrize("d", [64, 192, 256])
def test_head_dims(tgt, rng, d):
    lens = [130, 7]
    q, k, v = _inputs(rng, 2, 2, 2, 1, d, lens)
    _run(q, k, v, lens, 16 if d == 64 else None)


def test_huge_logits(tgt, rng):
    """|logit| ~ 1e4: the running max keeps every exponential finite."""
    lens = [260, 3]
    q, k, v = _inputs(rng, 2, 1, 4, 1, 128, lens, q_scale=60.0, kv_scale=3.0)
    _run(q, k, v, lens, 16, scale=1.0)


def test_empty_and_single(tgt, rng):
    """seq_len 0 (an empty slot): output 0, lse -inf; seq_len 1."""
    lens = [0, 1, 0]
    q, k, v = _inputs(rng, 3, 1, 4, 2, 128, lens)
    o, lse = _run(q, k, v, lens, 16)
    assert np.all(np.asarray(o[0], np.float32) == 0) and np.all(np.isneginf(lse[0]))


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_cache_range_limits(tgt, rng, per_head):
    """FP8 K/V with values at the format's largest finite magnitude, per-tensor or per-head
    scales, paged with a partial last tile."""
    f8 = FP8[tgt]
    lim = float(ml_dtypes.finfo(f8).max)
    lens = [3, 300]
    q, k, v = _inputs(rng, 2, 2, 8, 2, 128, lens, kv_dtype=f8)
    k[1, :40:7] = np.asarray(lim, dtype=np.float32).astype(f8)
    v[1, 1:40:5] = np.asarray(-lim, dtype=np.float32).astype(f8)
    ks = np.array([0.004, 0.02]) if per_head else 0.01
    vs = np.array([0.5, 0.002]) if per_head else 0.003
    _run(q, k, v, lens, 32, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("d, Hkv, bs, pairs", [
    (128, 3, None, True), (64, 5, None, True), (256, 2, None, True), (192, 2, None, False),
    (128, 2, 64, False)])
def test_fp8_k_pairs(tgt, rng, d, Hkv, bs, pairs):
    """FP8 K^T by DMA transposes of dim pairs: the heads that share a transpose (two at d = 128,
    four at 64, one at 256; a partial last group with odd H_kv), 16-key blocks with a partial last
    block (lengths 2, 17, 300, 1100), s_q = 2, a contiguous cache poisoned past each length.
    d = 192 and paged caches keep the TensorE transposes; the path is checked on the trace."""
    from nki_kernels.emulator.trace import trace
    f8 = FP8[tgt]
    lens = [2, 17, 300, 1100]
    q, k, v = _inputs(rng, 4, 2, 2 * Hkv, Hkv, d, lens, kv_dtype=f8)
    with trace() as tr:
        _run(q, k, v, lens, bs, k_scale=0.05, v_scale=0.5)
    n_dma_t = sum(ins.opcode == "dma_transpose" for ins in tr)
    assert (n_dma_t > 0) == pairs, n_dma_t


@pytest.mark.parametrize("d, Hq, Hkv, s_q, pe_pairs", [
    (128, 6, 3, 2, True), (64, 20, 5, 1, True), (256, 4, 2, 2, True),
    (64, 64, 4, 8, False)])
def test_fp8_paged_k_pairs_by_tensor_engine(tgt, rng, d, Hq, Hkv, s_q, pe_pairs):
    """Paged FP8 K on Trn2: the loaded tile viewed as bf16 dim pairs is transposed on TensorE
    (heads sharing a transpose: two at d = 128, four at 64, one at 256; a partial last pair
    tile with odd H_kv; partial last tiles, lengths 2 (or s_q), 17, 300, 1100) and QK^T takes
    the even / odd-dim passes; no FP8 K goes through a matmul with the identity. Trn3,
    and row groups that split a pair tile (d = 64 with one head per row group), keep the identity
    matmul. Checked on the trace and against the reference."""
    from nki_kernels.emulator.trace import trace
    f8 = FP8[tgt]
    lens = [max(2, s_q), 17, 300, 1100]
    q, k, v = _inputs(rng, 4, s_q, Hq, Hkv, d, lens, kv_dtype=f8)
    with trace() as tr:
        _run(q, k, v, lens, 16, k_scale=0.05, v_scale=0.5)
    # the identity matmul takes the FP8 keys as its stationary operand
    fp8_stationary = sum(ins.opcode == "nc_matmul" and ins.attrs.get("in_dtype") == f8.__name__
                         for ins in tr)
    assert (fp8_stationary == 0) == (pe_pairs and tgt == "trn2"), fp8_stationary


def test_lnc2_split_matches(tgt, rng):
    """LNC=2: the long sequence is split over both cores and merged through the lse; sinks go to
    one part only."""
    lens = [3000, 5, 0]
    q, k, v = _inputs(rng, 3, 2, 4, 1, 128, lens)
    sinks = np.array([0.0, 1.0, -2.0, 0.5], np.float32)
    o2, l2 = _run(q, k, v, lens, 16, lnc=2, sinks=sinks)
    o1, l1 = _run(q, k, v, lens, 16, lnc=1, sinks=sinks)
    np.testing.assert_allclose(np.asarray(o2, np.float32), np.asarray(o1, np.float32),
                               atol=2e-2, rtol=0)


def test_torch_inputs(rng):
    torch = pytest.importorskip("torch")
    lens = [20, 3]
    q, k, v = _inputs(rng, 2, 1, 4, 1, 64, lens)
    tq = torch.from_numpy(np.asarray(q, np.float32)).to(torch.bfloat16)
    tk = torch.from_numpy(np.nan_to_num(np.asarray(k, np.float32))).to(torch.bfloat16)
    tv = torch.from_numpy(np.nan_to_num(np.asarray(v, np.float32))).to(torch.bfloat16)
    o = decode_attention(tq, tk, tv, torch.tensor(lens, dtype=torch.int32))
    o = o.float().numpy() if hasattr(o, "numpy") else np.asarray(o, np.float32)
    ref = decode_attention_ref(q, np.nan_to_num(k), np.nan_to_num(v), lens, compute_dtype=np.float64)
    same = decode_attention_ref(q, np.nan_to_num(k), np.nan_to_num(v), lens, p_dtype="bfloat16")
    assert_attention_close(o, same, ref)


@pytest.mark.parametrize("s", FAST.decode + ODD.decode, ids=lambda s: s.name)
def test_shapes_table(s, rng):
    lens = [s.kv_len + s.q_len] * s.batch
    if s.kv_len == 0 and s.batch > 1:
        lens[0] = 0
    q, k, v = _inputs(rng, s.batch, s.q_len, s.n_q_heads, s.n_kv_heads, s.head_dim, lens)
    _run(q, k, v, lens, s.page_size)


@pytest.mark.slow
def test_lengths_1_17_40000(tgt, rng):
    """The issue's skewed batch: lengths 1, 17 and 40000 (paged, block 128)."""
    lens = [1, 40000, 17]
    q, k, v = _inputs(rng, 3, 1, 2, 1, 64, lens)
    _run(q, k, v, lens, 128)


# ------------------------------------------------------------------------------ plan pieces


def test_split_planner():
    one = plan_split_kv([131072], 1024, 2)
    assert [sum(i.keys for i in p) for p in one] == [65536, 65536]
    assert all(i.n_parts == 2 for p in one for i in p)
    many = plan_split_kv([2048] * 64, 1024, 2)
    assert all(i.n_parts == 1 for p in many for i in p)
    assert [len(p) for p in many] == [32, 32]
    skew = plan_split_kv([131072] + [1024] * 63, 1024, 2)
    loads = [sum(i.keys for i in p) for p in skew]
    assert abs(loads[0] - loads[1]) <= 1024 and sum(loads) == 131072 + 63 * 1024
    (only,), = plan_split_kv([0, 5], 128, 1)
    assert (only.b, only.k0, only.k1, only.n_parts) == (1, 0, 5, 1)     # empty slots: no item
    win = plan_split_kv([5000], 1024, 1, s_q=1, window=100)
    assert win[0][0].k0 == 4096           # keys before the window's tile are never visited


def test_tile_geometry():
    assert tokens_per_partition(8, 128, 2) == 8          # 16 KiB runs
    assert tokens_per_partition(1, 128, 2) == 16         # capped at MAX_T
    assert tokens_per_partition(8, 128, 2, block_size=4) == 4
    assert tokens_per_partition(8, 128, 2, max_len=200) == 2
    assert tokens_per_partition(8, 128, 2, total=2048) == 4      # 4 tiles for the pipeline
    assert tokens_per_partition(1, 128, 2, total=128) == 16      # ... but runs >= 4 KiB
    lay = KVLayout(True, 64, 8, 128, 8)
    assert (lay.tile_keys, lay.R, lay.row) == (1024, 8, 8192)


def test_counters():
    assert bytes_decode_attention([10, 0], 1, 4, 2, 64, 2) == 2 * 10 * 2 * 64 * 2 + 2 * 2 * 4 * 64 * 2
    assert flops_decode_attention([3], 2, 1, 8) == 4 * 8 * (2 + 3)
    assert flops_decode_attention([10], 1, 1, 8, window=4) == 4 * 8 * 4


# ------------------------------------------------------------------------------ refusals


def _base(rng):
    q, k, v = _inputs(rng, 2, 1, 4, 2, 128, [5, 9])
    return q, k, v


@pytest.mark.parametrize("change, err, msg", [
    (dict(block_table=np.array([[99, 0], [1, 2]], np.int32)), ValueError, "out of range"),
    (dict(block_table=np.array([[0], [1]], np.int32)), ValueError, "capacity"),
    (dict(seq_lens=[5, 100]), ValueError, "S_max"),
    (dict(seq_lens=[5]), ValueError, "seq_lens must have one length"),
    (dict(seq_lens=[5, -1]), ValueError, "seq_lens must be 0"),
    (dict(window=0), ValueError, "window"),
    (dict(lnc=3), ValueError, "lnc"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(k_scale=0.5), ValueError, "FP8 caches only"),
    (dict(sinks=np.zeros(3, np.float32)), ValueError, "sinks"),
])
def test_refusals(rng, change, err, msg):
    q, k, v = _base(rng)
    lens = change.pop("seq_lens", [5, 9])
    if "block_table" in change:
        k = rng.standard_normal((4, 8, 2, 128)).astype(BF16)
        v = k
    with pytest.raises(err, match=msg):
        decode_attention(q, k, v, lens, **change)


def test_refusals_shapes(rng):
    q, k, v = _base(rng)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        decode_attention(q[..., :96], k[..., :96], v[..., :96], [5, 9])
    with pytest.raises(ValueError, match="multiple of the cache's H_kv"):
        decode_attention(q[:, :, :3], k, v, [5, 9])
    with pytest.raises(ValueError, match="1 to 8 new tokens"):
        decode_attention(np.concatenate([q] * 9, axis=1), k, v, [9, 9])
    with pytest.raises(ValueError, match=">= s_q"):
        decode_attention(np.concatenate([q] * 4, axis=1), k, v, [3, 9])
    with pytest.raises(ValueError, match="query rows per KV head"):
        big = np.zeros((1, 8, 64, 128), BF16)
        decode_attention(big, k[:1, :, :2], v[:1, :, :2], [9])
    with pytest.raises(ValueError, match="block_size"):
        kk = np.zeros((4, 24, 2, 128), BF16)
        decode_attention(q, kk, kk, [5, 9], block_table=np.zeros((2, 2), np.int32))
    with pytest.raises(TypeError, match="q.dtype"):
        decode_attention(q.astype(np.float32), k, v, [5, 9])
    with pytest.raises(TypeError, match="k_cache and v_cache"):
        decode_attention(q, k.astype(np.float16), v.astype(np.float16), [5, 9])
    with pytest.raises(ValueError, match="same shape"):
        decode_attention(q, k, v[:, :5], [5, 9])
    with pytest.raises(TypeError, match="integer"):
        decode_attention(q, k, v, [5.0, 9.0])


def test_refusal_fp8_scale_count(tgt, rng):
    q, k, v = _base(rng)
    f8 = FP8[tgt]
    k8, v8 = np.nan_to_num(k).astype(f8), np.nan_to_num(v).astype(f8)
    with pytest.raises(ValueError, match="H_kv = 2"):
        decode_attention(q, k8, v8, [5, 9], k_scale=np.ones(3))
    with pytest.raises(ValueError, match="finite and > 0"):
        decode_attention(q, k8, v8, [5, 9], v_scale=0.0)
    other = FP8["trn3" if tgt == "trn2" else "trn2"]
    with pytest.raises(TypeError, match="FP8 on this target"):
        decode_attention(q, np.nan_to_num(k).astype(other), np.nan_to_num(v).astype(other), [5, 9])
