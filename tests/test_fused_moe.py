"""fused_moe against its NumPy reference, both regimes and both targets: random routing, all
tokens on one expert, every expert chosen by exactly one token, experts chosen by no token (never
read: checked in the trace's DMA rows), EP shards that sum to the unsharded result, a shared
expert, FP8 (row-major and tile-major) weights, MXFP8 weights on Trn3 (decode, prefill, shared
expert, EP shards, unread experts, refusals), torch inputs, and every refusal."""
import ml_dtypes
import numpy as np
import pytest

from nki_kernels import fused_moe, tile_expert_weights, tile_weight
from nki_kernels.emulator import target, trace
from nki_kernels.moe.fused_moe import (
    choose_blocks,
    down_chunks,
    pack_down_chunks,
    plan_prefill_routing,
    quantize_expert_weights_mx,
)
from nki_kernels.quant.mxfp8_matmul import MXTensor, quantize_weights_mx
from nki_kernels.reference.compare import assert_rows_close, cosine_similarity
from nki_kernels.reference.fused_moe import fused_moe_ref
from nki_kernels.reference.shapes import FAST, ODD, QWEN3_30B_A3B
from nki_kernels.reference.swiglu_mlp import quantize_fp8_per_channel

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3
E4M3FN = ml_dtypes.float8_e4m3fn


def _weights(rng, E, H, I):
    wgu = rng.standard_normal((E, H, 2 * I)).astype(np.float32) / np.sqrt(H)
    wd = rng.standard_normal((E, I, H)).astype(np.float32) / np.sqrt(I)
    return wgu, wd


def _routing(rng, T, E, k):
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.05, 1.0, (T, k)).astype(np.float32)
    return w / w.sum(axis=1, keepdims=True), ids


def _case(rng, T, H, I, E, k):
    x = rng.standard_normal((T, H)).astype(BF16)
    wgu, wd = _weights(rng, E, H, I)
    w, ids = _routing(rng, T, E, k)
    return x, wgu.astype(BF16), wd.astype(BF16), w, ids


def _run(x, wgu, wd, w, ids, regime=None, lnc=1, **kw):
    y = fused_moe(x, wgu, wd, w, ids, regime=regime, lnc=lnc, **kw)
    assert y.shape == x.shape and y.dtype == BF16
    assert_rows_close(y, fused_moe_ref(x, wgu, wd, w, ids, **kw), what=f"y ({regime})")
    return y


# ---------------------------------------------------------------------------- shape tiers
@pytest.mark.parametrize("case", FAST.moe + ODD.moe, ids=lambda c: c.name)
def test_shapes(tgt, rng, case):
    """Decode regime on the tier shapes (ODD: hidden / width not multiples of 128)."""
    T = min(case.tokens, 64)
    _run(*_case(rng, T, case.hidden, case.intermediate, case.n_experts, case.top_k), "decode")


@pytest.mark.parametrize("T,E,k", [(1, 16, 4), (9, 8, 2), (64, 16, 2)])
def test_decode(tgt, rng, T, E, k):
    _run(*_case(rng, T, 256, 256, E, k), "decode")


def test_prefill(tgt, rng):
    """Uneven expert loads, blocks of one expert padded to the block size."""
    _run(*_case(rng, 150, 256, 128, 4, 2), "prefill")


def test_prefill_model_widths(rng):
    """Qwen3-30B-A3B's real expert (H 2048, I 768): a 256-token block whose fused gate|up
    accumulators (12 KiB of PSUM) and 16 down tiles must share PSUM with the output transposes,
    plus a tail block."""
    T = QWEN3_30B_A3B.hidden // 8 + 10
    x, wgu, wd, _, _ = _case(rng, T, QWEN3_30B_A3B.hidden, QWEN3_30B_A3B.moe_intermediate, 2, 1)
    ids = np.zeros((T, 1), np.int32)
    ids[-4:] = 1
    _run(x, wgu, wd, rng.uniform(0.5, 1.5, (T, 1)).astype(np.float32), ids, "prefill")


def test_regimes_agree(rng):
    x, wgu, wd, w, ids = _case(rng, 24, 256, 128, 4, 2)
    yd = _run(x, wgu, wd, w, ids, "decode")
    yp = _run(x, wgu, wd, w, ids, "prefill")
    assert_rows_close(yp, yd.astype(np.float32), norm_tol=6.0, elem_tol=12.0, what="prefill vs decode")


# ---------------------------------------------------------------------------- routing edge cases
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_all_tokens_on_one_expert(rng, regime):
    T = 40 if regime == "decode" else 140       # prefill: more tokens than one block of 128
    x, wgu, wd, _, _ = _case(rng, T, 256, 128, 4, 1)
    ids = np.full((T, 1), 2, np.int32)
    w = rng.uniform(0.5, 1.5, (T, 1)).astype(np.float32)
    _run(x, wgu, wd, w, ids, regime)


@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_every_expert_chosen_once(rng, regime):
    E = 8
    x, wgu, wd, _, _ = _case(rng, E, 256, 128, E, 1)
    ids = rng.permutation(E).astype(np.int32)[:, None]
    _run(x, wgu, wd, np.ones((E, 1), np.float32), ids, regime)


@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_unchosen_experts_are_not_read(rng, regime):
    """Only the chosen experts' weight bytes cross the DMA: HBM bytes read == the chosen experts'
    weights (+ x, routing plan, y accumulator traffic), and no weight row of another expert."""
    E, H, I, T = 16, 256, 384, 6
    x, wgu, wd, _, _ = _case(rng, T, H, I, E, 2)
    ids = np.array([[3, 7], [7, 3], [3, 12], [12, 7], [3, 7], [7, 12]], np.int32)
    w = np.full((T, 2), 0.5, np.float32)
    with trace() as t:
        fused_moe(x, wgu, wd, w, ids, regime=regime)
    rows = {}
    for ins in t:
        if ins.engine == "dma":
            for op in ins.reads:
                if op.shape and tuple(op.shape)[-1:] != () and op.buffer.endswith("hbm"):
                    rows.setdefault(op.alloc, []).append((op.partitions, op.nbytes))
    wbytes = 2 * (3 * H * I)
    # the weight allocations are the only ones whose reads total a multiple of one expert
    per_alloc = {a: sum(n for _, n in v) for a, v in rows.items()}
    expert_reads = {a: v for a, v in rows.items()
                    if per_alloc[a] in (3 * 2 * H * 2 * I, 3 * 2 * I * H)}
    assert len(expert_reads) == 2, per_alloc                  # w_gate_up and w_down, 3 experts
    assert sum(per_alloc[a] for a in expert_reads) == 3 * wbytes
    seen = set()
    for a, v in expert_reads.items():
        span = H if per_alloc[a] == 3 * 2 * H * 2 * I else I      # rows per expert
        for (lo, hi), _ in v:
            assert (hi - 1) // span == lo // span                # a read stays in one expert
            seen.add(lo // span)
    assert seen == {3, 7, 12}


# ---------------------------------------------------------------------------- expert parallelism
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_ep_shards_sum_to_the_whole(rng, regime):
    E, ep = 8, 2
    x, wgu, wd, w, ids = _case(rng, 12, 256, 128, E, 3)
    n = E // ep
    parts = []
    for r in range(ep):
        sl = slice(r * n, (r + 1) * n)
        parts.append(_run(x, wgu[sl], wd[sl], w, ids, regime, expert_offset=r * n).astype(np.float32))
    whole = fused_moe_ref(x, wgu, wd, w, ids).astype(np.float32)
    assert_rows_close(sum(parts).astype(BF16), whole, norm_tol=6.0, elem_tol=12.0,
                      what="sum of EP shards")


def test_ids_outside_the_shard_contribute_nothing(rng):
    x, wgu, wd, w, _ = _case(rng, 4, 256, 128, 4, 2)
    ids = np.array([[-1, 9], [4, 100], [7, -5], [5, 6]], np.int32)   # no local expert at all
    for regime in ("decode", "prefill"):
        y = fused_moe(x, wgu, wd, w, ids, regime=regime)
        assert not np.any(y.astype(np.float32))


# ---------------------------------------------------------------------------- shared expert, FP8
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_shared_expert(tgt, rng, regime):
    x, wgu, wd, w, ids = _case(rng, 10, 256, 128, 4, 2)
    sg, sd = _weights(rng, 1, 256, 256)
    _run(x, wgu, wd, w, ids, regime, shared=(sg[0].astype(BF16), sd[0].astype(BF16)))


def test_shared_block():
    """The shared expert's token block is chosen apart from the routed one: DeepSeek-V3 EP8
    (H 7168, shared width 2048) takes 512 tokens on both targets in bf16 and FP8 (its step
    does not hold a gathered next block), where the routed loop's bound stops at 256 / 384.
    It runs after the routed loop, when the zero tile of the accumulator is dead, so LNC 2
    chooses as LNC 1 does."""
    from nki_kernels.moe.fused_moe import TB_CHOICES, _sbuf_need, plan_tiles, shared_block
    for budget in (int(208 * 1024 * 0.9), int(240 * 1024 * 0.9)):       # Trn2, Trn3
        for wb, fp8 in ((2, False), (1, True)):
            def need(c, pipelined=False, wb=wb, fp8=fp8):
                return _sbuf_need(c, 7168, 2048, wb, fp8,
                                  plan_tiles("prefill", c, 7168, 2048, wb, False), pipelined)
            assert shared_block(need, budget) == 512
            assert need(512, True) > budget
    assert shared_block(lambda c: 1 << 30, 1 << 20) == TB_CHOICES[0]
    assert shared_block(lambda c: 0 if c <= 256 else 1 << 30, 1 << 20) == 256


@pytest.mark.parametrize("lnc", [1, 2])
def test_shared_expert_blocks(tgt, rng, lnc):
    """Prefill with a shared expert over token blocks of its own (T = 1100: three blocks of
    367 tokens, while ~69 tokens per expert make the routed blocks 128): at LNC 2 core 0 takes
    two of them and core 1 one."""
    x, wgu, wd, w, ids = _case(rng, 1100, 256, 128, 16, 1)
    sg, sd = _weights(rng, 1, 256, 256)
    _run(x, wgu, wd, w, ids, "prefill", lnc=lnc, shared=(sg[0].astype(BF16), sd[0].astype(BF16)))


@pytest.mark.slow
def test_shared_expert_blocks_fit_at_lnc2(rng):
    """DeepSeek-V3 widths (H 7168, shared and expert width 2048) at LNC 2 on Trn2, three shared
    blocks of 512 tokens (two on core 0): the shared expert runs after the routed loop, when
    the accumulator's zero tile [128, H] fp32 is dead, so its block needs no room for it (when
    the shared expert ran first, core 0 held that tile beside its second block and 512 was
    refused: SBUF reused)."""
    T, H, I = 1536, 7168, 2048
    x, wgu, wd, w, ids = _case(rng, T, H, I, 2, 1)
    sg, sd = _weights(rng, 1, H, I)
    with target("trn2"):
        _run(x, wgu, wd, w, ids, "prefill", lnc=2,
             shared=(sg[0].astype(BF16), sd[0].astype(BF16)))


def _fp8_case(rng, T, H, I, E, k, dtype, shared=False):
    x = rng.standard_normal((T, H)).astype(BF16)
    wgu, wd = _weights(rng, E, H, I)
    qg = [quantize_fp8_per_channel(a, dtype) for a in wgu]
    qd = [quantize_fp8_per_channel(a, dtype) for a in wd]
    kw = dict(gate_up_scale=np.stack([s for _, s in qg]), down_scale=np.stack([s for _, s in qd]))
    g8, d8 = np.stack([a for a, _ in qg]), np.stack([a for a, _ in qd])
    if shared:
        sg, sd = _weights(rng, 1, H, 128)
        a, sa = quantize_fp8_per_channel(sg[0], dtype)
        b, sb = quantize_fp8_per_channel(sd[0], dtype)
        kw.update(shared=(a, b), shared_scales=(sa, sb))
    w, ids = _routing(rng, T, E, k)
    return x, g8, d8, w, ids, kw


@pytest.mark.parametrize("regime,tiled,shared", [("decode", True, True), ("decode", False, False),
                                                 ("prefill", True, False),
                                                 ("prefill", False, True)])
def test_fp8(tgt, rng, regime, tiled, shared):
    dtype = E4M3FN if tgt == "trn3" else E4M3
    x, g8, d8, w, ids, kw = _fp8_case(rng, 20, 256, 256, 4, 2, dtype, shared)
    ref = fused_moe_ref(x, g8, d8, w, ids, act_dtype=dtype, **kw)
    args = dict(kw)
    if tiled:
        g8, d8 = tile_expert_weights(g8), tile_expert_weights(d8)
        if shared:
            args["shared"] = tuple(tile_weight(a) for a in kw["shared"])
    y = fused_moe(x, g8, d8, w, ids, regime=regime, **args)
    assert cosine_similarity(y.astype(np.float32), ref.astype(np.float32)) > 0.999


def test_fp8_decode_loop_body_is_traced_once(monkeypatch, rng):
    """The device runs one traced copy of a compiled loop's body, so every iteration of the FP8
    decode loop takes the same weight-ring slots (the Python slot counter restarts each
    iteration); advancing it across iterations would model a rotation the device never runs."""
    from nki_kernels.dense import _tiles
    from nki_kernels.emulator import runtime as rt
    seen = []
    take = _tiles.WeightRing.take

    def spy(self, *a, **k):
        body = rt._loop_bodies[-1] if rt._loop_bodies else None
        seen.append((body.key if body else None, id(body), self.n % len(self.slots)))
        return take(self, *a, **k)

    monkeypatch.setattr(_tiles.WeightRing, "take", spy)
    # Qwen3-30B-A3B widths: 11 transfers per iteration on a ring of 4 (not a multiple)
    x, g8, d8, w, ids, kw = _fp8_case(rng, 1, 2048, 768, 8, 6, E4M3FN)
    with target("trn3"):
        fused_moe(x, g8, d8, w, ids, regime="decode", **kw)
    keys = [k for k, _, _ in seen]
    step = max(set(keys), key=keys.count)              # the loop over experts 1 .. n - 1
    per = [s for k, _, s in seen if k == step]
    n_iter = 5                                          # 6 experts: the prologue, 5 steps
    k = len(per) // n_iter
    assert len(per) == k * n_iter and k % len(set(per)) != 0
    assert all(per[i * k:(i + 1) * k] == per[0:k] for i in range(n_iter))
    assert len({b for kk, b, _ in seen if kk == step}) == 1   # one body (the same loop)


# ---------------------------------------------------------------------------- LNC 2 (prefill)
def test_prefill_plan_for_two_cores():
    """Each expert's blocks all on one core, the experts dealt largest first to the core with
    less work; the two cores' blocks are exactly the one-core plan's."""
    rng = np.random.default_rng(3)
    T, E = 600, 6
    lids = np.stack([rng.choice(E, 2, replace=False) for _ in range(T)])
    w = np.full((T, 2), 0.5, np.float32)
    one, _ = plan_prefill_routing(lids, w, E, 128)
    two, _ = plan_prefill_routing(lids, w, E, 128, cores=2)
    NB = one[0].shape[1]
    assert two[0].shape == (2, NB) and two[1].shape == (2, 2) and two[2].shape == (2 * NB, 128)
    n = two[1][:, 0]
    assert n.sum() == one[1][0, 0] and abs(int(n[0]) - int(n[1])) <= 2
    assert two[1][:, 1].tolist() == [max(int(c) - 1, 0) for c in n]
    experts = [set(two[0][c, :n[c]].tolist()) for c in range(2)]
    assert not experts[0] & experts[1] and experts[0] | experts[1] == set(range(E))

    def blocks(pl, rows):
        return sorted((int(pl[0].ravel()[r]), tuple(pl[3][r])) for r in rows)
    rows2 = [c * NB + b for c in range(2) for b in range(n[c])]
    flat = (two[0].ravel(), None, None, two[3])
    assert blocks(flat, rows2) == blocks(one, range(one[1][0, 0]))


@pytest.mark.parametrize("case", ["random", "tail", "one_expert", "shared"])
def test_prefill_lnc2(tgt, rng, case):
    """LNC 2: each core its experts and accumulator, the sum after a core barrier. Uneven loads
    with tail blocks; all tokens on one expert (the other core runs no block); a shared expert
    (token blocks alternate between the cores)."""
    T, kw = 150, {}
    x, wgu, wd, w, ids = _case(rng, T, 256, 128, 4, 2)
    if case == "tail":
        T = 310
        x, wgu, wd, _, _ = _case(rng, T, 256, 128, 4, 1)
        ids = np.where(np.arange(T) < 300, 1, 3).astype(np.int32)[:, None]
        w = rng.uniform(0.5, 1.5, (T, 1)).astype(np.float32)
    elif case == "one_expert":
        ids = np.full((T, 1), 2, np.int32)
        w = rng.uniform(0.5, 1.5, (T, 1)).astype(np.float32)
    elif case == "shared":
        x, wgu, wd, w, ids = _case(rng, 300, 256, 128, 4, 2)
        sg, sd = _weights(rng, 1, 256, 256)
        kw["shared"] = (sg[0].astype(BF16), sd[0].astype(BF16))
    _run(x, wgu, wd, w, ids, "prefill", lnc=2, **kw)


def test_prefill_lnc2_fp8_and_mx(rng):
    dtype = E4M3FN
    x, g8, d8, w, ids, kw = _fp8_case(rng, 140, 256, 256, 4, 2, dtype, shared=True)
    ref = fused_moe_ref(x, g8, d8, w, ids, act_dtype=dtype, **kw)
    with target("trn3"):
        y = fused_moe(x, g8, d8, w, ids, regime="prefill", lnc=2, **kw)
    assert cosine_similarity(y.astype(np.float32), ref.astype(np.float32)) > 0.999
    x, g, d, w, ids, kw = _mx_case(rng, 150, 256, 768, 4, 2, 128)
    with target("trn3"):
        y = fused_moe(x, g, d, w, ids, regime="prefill", lnc=2, **kw)
    ref = fused_moe_ref(x, tuple(g), tuple(d), w, ids,
                        shared=tuple(tuple(a) for a in kw["shared"]))
    assert_rows_close(y, ref, what="y (MX, prefill, LNC 2)")


def test_lnc_refusals(rng):
    x, wgu, wd, w, ids = _case(rng, 8, 256, 128, 4, 2)
    with pytest.raises(ValueError, match=r"fused_moe: lnc=2 is implemented for the prefill "
                                         r"regime; this call is decode"):
        fused_moe(x, wgu, wd, w, ids, lnc=2)
    with pytest.raises(ValueError, match=r"fused_moe: lnc must be 1 or 2; got 3"):
        fused_moe(x, wgu, wd, w, ids, regime="prefill", lnc=3)


def test_tiled_bf16_gives_the_same_bits(rng):
    x, wgu, wd, w, ids = _case(rng, 7, 256, 256, 4, 2)
    a = fused_moe(x, wgu, wd, w, ids)
    b = fused_moe(x, tile_expert_weights(wgu), tile_expert_weights(wd), w, ids)
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_torch_in(rng):
    torch = pytest.importorskip("torch")
    x, wgu, wd, w, ids = _case(rng, 3, 256, 128, 4, 2)
    y = fused_moe(*(torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for a in (x, wgu, wd)),
                  torch.from_numpy(w), torch.from_numpy(ids.astype(np.int64)))
    assert_rows_close(y.float().numpy(), fused_moe_ref(x, wgu, wd, w, ids).astype(np.float32),
                      dtype="bfloat16")


# ---------------------------------------------------------------------------- the plan
def test_block_choice_and_padding():
    assert choose_blocks([256] * 8, 512) == (256, 0)           # one full block per expert
    assert choose_blocks([20, 30], 512) == (128, 0)            # below the ridge: the smallest
    assert choose_blocks([300, 290], 512) == (256, 320)        # one merged block of 320 each
    assert choose_blocks([300, 290], 256) == (256, 64)         # 256 + a 64-token tail each
    assert choose_blocks([500, 500], 256) == (256, 0)          # capped by the SBUF plan
    lids = np.array([[0, 2], [2, -1], [0, 2]])
    w = np.array([[0.25, 0.75], [1.0, 0.3], [0.5, 0.5]], np.float32)
    (be, n, gi, si, bw), tail = plan_prefill_routing(lids, w, 4, 128)
    assert tail is None
    assert int(n[0, 0]) == 2 and be[0, :2].tolist() == [0, 2]
    assert gi[0, :2].tolist() == [0, 2] and si[0, :3].tolist() == [0, 2, 3]   # 3 = padding
    assert bw[1, :3].tolist() == [0.75, 1.0, 0.5] and bw[1, 3] == 0
    lids = np.zeros((150, 1), np.int64)                         # one expert, 150 tokens
    full, tail = plan_prefill_routing(lids, np.ones((150, 1), np.float32), 2, 128, 64)
    assert int(full[1][0, 0]) == 1 and int(tail[1][0, 0]) == 1
    assert tail[3][0, :22].tolist() == list(range(128, 150)) and tail[3][0, 22] == 150


def test_prefill_with_tail_blocks(rng):
    """300 tokens on one expert (+ a few on another): one 256-token block and one 64-token tail
    block, the plan's choice."""
    T = 310
    assert choose_blocks([300, 10], 512) == (256, 64)
    x, wgu, wd, _, _ = _case(rng, T, 256, 128, 4, 1)
    ids = np.where(np.arange(T) < 300, 1, 3).astype(np.int32)[:, None]
    _run(x, wgu, wd, rng.uniform(0.5, 1.5, (T, 1)).astype(np.float32), ids, "prefill")


def test_prefill_merged_blocks(tgt, rng):
    """Experts a little over one 256-token block (Qwen3-30B-A3B's loads at T = 4096): one merged
    block of 320 tokens each instead of a full block plus a 64-token tail block, so each expert's
    weights stream once (the trace's weight reads: each chosen expert's bytes exactly once)."""
    H, I, E = 256, 128, 4
    ids = np.repeat(np.array([0, 1, 3], np.int32), [256, 300, 320])[:, None]
    T = ids.shape[0]
    assert choose_blocks([256, 300, 0, 320], 512) == (256, 320)
    (be, n, _, _, _), (bt, nt, gi, si, _) = plan_prefill_routing(
        ids, np.ones((T, 1), np.float32), E, 256, 320)
    assert be[0, :1].tolist() == [0] and int(n[0, 0]) == 1
    assert bt[0, :2].tolist() == [1, 3] and int(nt[0, 0]) == 2 and gi.shape[1] == 320
    assert si[0, :300].tolist() == list(range(256, 556)) and si[0, 300] == T      # padding
    x, wgu, wd, _, _ = _case(rng, T, H, I, E, 1)
    with trace() as t:
        _run(x, wgu, wd, rng.uniform(0.5, 1.5, (T, 1)).astype(np.float32), ids, "prefill")
    per_alloc = {}
    for ins in t:
        if ins.engine == "dma":
            for op in ins.reads:
                if op.buffer.endswith("hbm"):
                    per_alloc[op.alloc] = per_alloc.get(op.alloc, 0) + op.nbytes
    once = (3 * H * 2 * I * 2, 3 * I * H * 2)          # gate|up and down of 3 experts, once
    assert all(b in per_alloc.values() for b in once), str(sorted(per_alloc.values()))


# ---------------------------------------------------------------------------- refusals
def test_rejects_bad_input(rng):
    x, wgu, wd, w, ids = _case(rng, 4, 256, 128, 4, 2)
    with pytest.raises(TypeError, match=r"fused_moe: x.dtype must be bfloat16; got float32"):
        fused_moe(x.astype(np.float32), wgu, wd, w, ids)
    with pytest.raises(ValueError, match=r"w_gate_up must be \[E, H, 2I\] with H = x.shape\[1\] = 256"):
        fused_moe(x, wgu[:, :128], wd, w, ids)
    with pytest.raises(ValueError, match=r"w_down must be \[E, I, H\] = \[4, 128, 256\]"):
        fused_moe(x, wgu, wd[:3], w, ids)
    with pytest.raises(TypeError, match=r"w_down.dtype must equal w_gate_up.dtype \(bfloat16\)"):
        fused_moe(x, wgu, wd.astype(np.float32), w, ids)
    with pytest.raises(TypeError, match=r"w_gate_up.dtype must be bfloat16 or float8_e4m3"):
        fused_moe(x, wgu.astype(np.float32), wd.astype(np.float32), w, ids)
    with pytest.raises(ValueError, match=r"topk_ids must be \[T, k\] with T = x.shape\[0\] = 4"):
        fused_moe(x, wgu, wd, w, ids[:3])
    with pytest.raises(TypeError, match=r"topk_ids must hold integers; got float32"):
        fused_moe(x, wgu, wd, w, ids.astype(np.float32))
    with pytest.raises(ValueError, match=r"topk_weights must have the shape of topk_ids \[4, 2\]"):
        fused_moe(x, wgu, wd, w[:, :1], ids)
    with pytest.raises(TypeError, match=r"topk_weights must be a float array; got int32"):
        fused_moe(x, wgu, wd, ids, ids)
    with pytest.raises(ValueError, match=r"topk_ids\[0, 1\] = 9 is outside \[0, num_global_experts=8\)"):
        fused_moe(x, wgu, wd, w, np.array([[0, 9], [1, 2], [0, 1], [2, 3]]), num_global_experts=8)
    with pytest.raises(ValueError, match=r"num_global_experts must be an int >= expert_offset \+ E"):
        fused_moe(x, wgu, wd, w, ids, expert_offset=2, num_global_experts=4)
    with pytest.raises(ValueError, match=r"top_k = 2 exceeds the 1 experts"):
        fused_moe(x, wgu[:1], wd[:1], w, ids, num_global_experts=1)
    with pytest.raises(ValueError, match=r"expert_offset must be an int >= 0; got -1"):
        fused_moe(x, wgu, wd, w, ids, expert_offset=-1)
    with pytest.raises(ValueError, match=r"regime must be None, 'decode' or 'prefill'; got 'x'"):
        fused_moe(x, wgu, wd, w, ids, regime="x")
    xb = rng.standard_normal((129, 256)).astype(BF16)
    with pytest.raises(ValueError, match=r"the decode regime takes at most 128 tokens; got T=129"):
        fused_moe(xb, wgu, wd, np.ones((129, 1), np.float32), np.zeros((129, 1), np.int32),
                  regime="decode")
    with pytest.raises(ValueError, match=r"gate_up_scale / down_scale / shared_scales are only for"):
        fused_moe(x, wgu, wd, w, ids, down_scale=np.ones((4, 256), np.float32))
    with pytest.raises(ValueError, match=r"shared\[1\] must be \[Is, H\] = \[64, 256\]"):
        fused_moe(x, wgu, wd, w, ids, shared=(wgu[0, :, :128], wd[0]))
    with pytest.raises(TypeError, match=r"shared\[0\].dtype must equal the experts' dtype"):
        fused_moe(x, wgu, wd, w, ids, shared=(wgu[0].astype(np.float32), wd[0]))
    with pytest.raises(ValueError, match=r"tile-major \(5-D\) so w_down must be too"):
        fused_moe(x, tile_expert_weights(wgu), wd, w, ids)


def test_rejects_fp8_misuse(rng):
    x, g8, d8, w, ids, kw = _fp8_case(rng, 4, 256, 128, 4, 2, E4M3)
    with pytest.raises(ValueError, match=r"FP8 weights need gate_up_scale \[E, 2I\] and down_scale"):
        fused_moe(x, g8, d8, w, ids)
    with pytest.raises(ValueError, match=r"down_scale must have shape \[4, 256\]; got \[4, 128\]"):
        fused_moe(x, g8, d8, w, ids, gate_up_scale=kw["gate_up_scale"],
                  down_scale=kw["down_scale"][:, :128])
    with target("trn2"), pytest.raises(ValueError, match=r"float8_e4m3fn weights need Trn3"):
        fused_moe(x, g8.astype(E4M3FN), d8.astype(E4M3FN), w, ids, **kw)
    with target("trn1"), pytest.raises(ValueError, match=r"fused_moe: target trn1 is not supported"):
        fused_moe(x, g8, d8, w, ids, **kw)
    xo = rng.standard_normal((4, 200)).astype(BF16)
    with pytest.raises(ValueError, match=r"FP8 weights need hidden and expert sizes that are "
                                         r"multiples of 128; got H=200, I=128"):
        fused_moe(xo, np.zeros((4, 200, 256), E4M3), np.zeros((4, 128, 200), E4M3), w, ids, **kw)


# ---------------------------------------------------------------------------- MXFP8 (Trn3)
def _mx_case(rng, T, H, I, E, k, shared_I=0):
    """bf16 x, MXFP8 experts (quantize_expert_weights_mx), random routing."""
    x = rng.standard_normal((T, H)).astype(BF16)
    wgu, wd = _weights(rng, E, H, I)
    g, d = quantize_expert_weights_mx(wgu, wd)
    w, ids = _routing(rng, T, E, k)
    kw = {}
    if shared_I:
        sg, sd = _weights(rng, 1, H, shared_I)
        kw["shared"] = quantize_expert_weights_mx(sg[0], sd[0])
    return x, g, d, w, ids, kw


def _run_mx(x, g, d, w, ids, regime, **kw):
    with target("trn3"):
        y = fused_moe(x, g, d, w, ids, regime=regime, **kw)
    assert y.shape == x.shape and y.dtype == BF16
    ref_kw = dict(kw)
    if "shared" in kw:
        ref_kw["shared"] = tuple(tuple(a) for a in kw["shared"])
    ref = fused_moe_ref(x, tuple(g), tuple(d), w, ids, **ref_kw)
    assert_rows_close(y, ref, what=f"y (MX, {regime})")
    return y


def test_mx_host_layout(rng):
    """gate|up: quantize_weights_mx of each expert, stacked; down: chunk-major, chunk c the
    KT = 1 MX tile layout of its rows in x4 order (lane q of partition p = row r0 + kp*q + p)."""
    assert down_chunks(768) == [(0, 512, 128), (512, 256, 64)]
    assert down_chunks(640)[-1] == (512, 128, 32) and down_chunks(384) == [(0, 384, 128)]
    wgu, wd = _weights(rng, 2, 256, 768)
    g, d = quantize_expert_weights_mx(wgu, wd)
    assert g.data.shape == (2, 128, 1536) and g.scale.shape == (2, 64, 1536) and g.k == 256
    assert d.data.shape == (2, 128, 512) and d.scale.shape == (2, 64, 256) and d.k == 768
    ref = quantize_weights_mx(wgu[1], "e4m3fn")
    np.testing.assert_array_equal(g.data[1], ref.data)
    np.testing.assert_array_equal(g.scale[1], ref.scale)
    ch = pack_down_chunks(wd[1])                     # [KC, 512, H]: row 4p + q of chunk c
    assert ch.shape == (2, 512, 256)
    np.testing.assert_array_equal(ch[0][4 * 5 + 2], wd[1][128 * 2 + 5].astype(np.float32))
    np.testing.assert_array_equal(ch[1][4 * 7 + 3], wd[1][512 + 64 * 3 + 7].astype(np.float32))
    assert not ch[1][4 * 64:].any()                  # partitions 64.. of the tail chunk: empty
    for c in range(2):
        q = quantize_weights_mx(ch[c])
        np.testing.assert_array_equal(d.data[1][:, 256 * c:256 * (c + 1)], q.data)
        np.testing.assert_array_equal(d.scale[1][[16 * Q + 4 * c + i for Q in range(4)
                                                  for i in range(4)]],
                                      q.scale[[16 * Q + i for Q in range(4) for i in range(4)]])
    _, d3 = quantize_expert_weights_mx(wgu[:, :, :768], wd[:, :384])   # a 384-row tail
    ch3 = pack_down_chunks(wd[0, :384])
    assert not ch3[0].reshape(128, 4, 256)[:, 3].any()                  # lane 3 empty


@pytest.mark.parametrize("regime,T,H,I,E,k,sh", [
    ("decode", 5, 384, 384, 8, 2, 0),       # H % 512 != 0 (a 96-partition x chunk); 384-row tail
    ("decode", 33, 256, 640, 4, 2, 128),    # a 128-row tail (32 partitions); a shared expert
    ("prefill", 150, 256, 768, 4, 2, 0),    # uneven loads, blocks padded; a 64-partition tail
    ("prefill", 40, 512, 128, 4, 1, 128),   # a shared expert in prefill
])
def test_mx(rng, regime, T, H, I, E, k, sh):
    x, g, d, w, ids, kw = _mx_case(rng, T, H, I, E, k, sh)
    _run_mx(x, g, d, w, ids, regime, **kw)


@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_mx_all_tokens_on_one_expert(rng, regime):
    T = 40 if regime == "decode" else 140
    x, g, d, _, _, _ = _mx_case(rng, T, 256, 128, 4, 1)
    ids = np.full((T, 1), 2, np.int32)
    _run_mx(x, g, d, rng.uniform(0.5, 1.5, (T, 1)).astype(np.float32), ids, regime)


@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_mx_unchosen_experts_are_not_read(rng, regime):
    """The HBM reads of the MX data and scale images are exactly those of experts 3, 7, 12,
    each read once."""
    E, H, I, T = 16, 256, 384, 6
    x, g, d, _, _, _ = _mx_case(rng, T, H, I, E, 2)
    ids = np.array([[3, 7], [7, 3], [3, 12], [12, 7], [3, 7], [7, 12]], np.int32)
    w = np.full((T, 2), 0.5, np.float32)
    with target("trn3"), trace() as t:
        fused_moe(x, g, d, w, ids, regime=regime)
    per_expert = {a.data[0].nbytes: ("data", 128) for a in (g, d)}
    per_expert.update({a.scale[0].nbytes: ("scale", 64) for a in (g, d)})
    rows = {}
    for ins in t:
        if ins.engine == "dma":
            for op in ins.reads:
                if op.buffer.endswith("hbm"):
                    rows.setdefault(op.alloc, []).append((op.partitions, op.nbytes))
    totals = {a: sum(n for _, n in v) for a, v in rows.items()}
    found = {a: n for a, n in totals.items() if n % 3 == 0 and n // 3 in per_expert}
    assert len(found) == 4, totals             # gate|up and down, data and scales
    for a, n in found.items():
        span = per_expert[n // 3][1]           # rows of one expert in the [E, rows, X] arrays
        seen = set()
        for (lo, hi), _ in rows[a]:
            assert (hi - 1) // span == lo // span
            seen.add(lo // span)
        assert seen == {3, 7, 12}


def test_mx_decode_scale_loads_take_the_software_dge(rng):
    """MX decode: an expert's scale loads are ready only once the previous expert's matmuls
    have read the tile (one traced loop body), and on the weights' static-descriptor ring they
    would then wait, FIFO, behind the weight transfers already queued there and hold the
    expert's first matmuls. The loop's scale loads take GpSimd's software-DGE ring (idle in
    decode); the weight data stays on the static ring, and so do the shared expert's scales
    (loaded before the loop) and prefill's (whose software-DGE ring carries the gathers)."""
    x, g, d, w, ids, kw = _mx_case(rng, 4, 256, 384, 8, 2, shared_I=256)

    def hbm_loads(regime):
        """{(kind, HBM allocation): [dge of each load]}, allocations in first-load order."""
        with target("trn3"), trace() as t:
            fused_moe(x, g, d, w, ids, regime=regime, **kw)
        out = {}
        for ins in t:
            src = [op for op in ins.reads if op.buffer.endswith("hbm")]
            if ins.engine == "dma" and len(src) == 1 and src[0].dtype in ("uint8", "uint32"):
                kind = "scale" if src[0].dtype == "uint8" else "data"
                out.setdefault((kind, src[0].alloc), []).append(ins.attrs.get("dge"))
        return out

    dec = hbm_loads("decode")
    scales = [v for (kind, _), v in dec.items() if kind == "scale"]
    assert len(scales) == 4, dec.keys()        # shared gate|up and down, then the routed two
    assert all("swdge" not in v for v in scales[:2])
    assert all(set(v) == {"swdge"} for v in scales[2:])
    assert all("swdge" not in v for (kind, _), v in dec.items() if kind == "data")
    pre = hbm_loads("prefill")
    assert len([k for k in pre if k[0] == "scale"]) == 4
    assert all("swdge" not in v for (kind, _), v in pre.items() if kind == "scale")


@pytest.mark.slow
@pytest.mark.parametrize("regime,T", [("decode", 8), ("prefill", 300)])
def test_mx_model_widths(rng, regime, T):
    """Qwen3-30B-A3B's real expert (H 2048, I 768: a 256-row down tail on 64 partitions) with 8
    experts and a shared expert of the same width."""
    s = QWEN3_30B_A3B
    x, g, d, w, ids, kw = _mx_case(rng, T, s.hidden, s.moe_intermediate, 8, 2, s.moe_intermediate)
    _run_mx(x, g, d, w, ids, regime, **kw)


def test_mx_ep_shards_sum_to_the_whole(rng):
    E, ep = 8, 2
    x, g, d, w, ids, _ = _mx_case(rng, 12, 256, 128, E, 3)
    n = E // ep
    parts = []
    for r in range(ep):
        sl = slice(r * n, (r + 1) * n)
        gs = MXTensor(g.data[sl], g.scale[sl], g.fmt, g.k)
        ds = MXTensor(d.data[sl], d.scale[sl], d.fmt, d.k)
        parts.append(_run_mx(x, gs, ds, w, ids, "decode", expert_offset=r * n).astype(np.float32))
    whole = fused_moe_ref(x, tuple(g), tuple(d), w, ids).astype(np.float32)
    assert_rows_close(sum(parts).astype(BF16), whole, norm_tol=6.0, elem_tol=12.0,
                      what="sum of MX EP shards")


def test_mx_rejects(rng):
    x, g, d, w, ids, _ = _mx_case(rng, 4, 256, 128, 4, 2)
    with target("trn2"), pytest.raises(ValueError, match=r"fused_moe: MXFP8 expert weights "
                                                         r"\(nc_matmul_mx / quantize_mx\) need Trn3"):
        fused_moe(x, g, d, w, ids)
    with target("trn3"):
        wgu, wd = _weights(rng, 4, 256, 128)
        with pytest.raises(TypeError, match=r"must come as a pair of MXTensor "
                                            r"\(quantize_expert_weights_mx\); w_down is ndarray"):
            fused_moe(x, g, wd.astype(BF16), w, ids)
        bad = MXTensor(g.data.astype(np.int32), g.scale, g.fmt, g.k)
        with pytest.raises(ValueError, match=r"w_gate_up.data must be uint32 \[E, 128, KT\*F\]"):
            fused_moe(x, bad, d, w, ids)
        bad = MXTensor(g.data, g.scale[:, :, :128], g.fmt, g.k)
        with pytest.raises(ValueError, match=r"w_gate_up.scale must be uint8 \[4, 64, 256\]; got "
                                             r"uint8 \[4, 64, 128\]"):
            fused_moe(x, bad, d, w, ids)
        bad = MXTensor(g.data, g.scale, g.fmt, 512)
        with pytest.raises(ValueError, match=r"w_gate_up.k must be 256"):
            fused_moe(x, bad, d, w, ids)
        bad = MXTensor(d.data[:, :, :128], d.scale[:, :, :128], d.fmt, d.k)
        with pytest.raises(ValueError, match=r"w_down must have 256 columns; got 128"):
            fused_moe(x, g, bad, w, ids)
        with pytest.raises(ValueError, match=r"w_down holds 3 experts but w_gate_up 4"):
            fused_moe(x, g, MXTensor(d.data[:3], d.scale[:3], d.fmt, d.k), w, ids)
        with pytest.raises(ValueError, match=r"share one MX format; got \['e4m3fn', 'e5m2'\]"):
            fused_moe(x, g, MXTensor(d.data, d.scale, "e5m2", d.k), w, ids)
        with pytest.raises(ValueError, match=r"MX format must be one of e4m3fn, e5m2; got 'e2m1'"):
            fused_moe(x, g, MXTensor(d.data, d.scale, "e2m1", d.k), w, ids)
        with pytest.raises(ValueError, match=r"gate_up_scale / down_scale / shared_scales are only "
                                             r"for FP8 weights; MXFP8"):
            fused_moe(x, g, d, w, ids, down_scale=np.ones((4, 256), np.float32))
        with pytest.raises(ValueError, match=r"shared must be a pair of MXTensor"):
            fused_moe(x, g, d, w, ids, shared=(wgu[0].astype(BF16), wd[0].astype(BF16)))
        with pytest.raises(TypeError, match=r"fused_moe: x.dtype must be bfloat16; got float32"):
            fused_moe(x.astype(np.float32), g, d, w, ids)
        with pytest.raises(ValueError, match=r"topk_ids must be \[T, k\] with T = x.shape\[0\] = 4"):
            fused_moe(x, g, d, w, ids[:3])
    with pytest.raises(ValueError, match=r"quantize_expert_weights_mx: H and I must be positive "
                                         r"multiples of 128; got H=256, I=100"):
        quantize_expert_weights_mx(np.zeros((2, 256, 200)), np.zeros((2, 100, 256)))
    with pytest.raises(ValueError, match=r"quantize_expert_weights_mx: fmt must be one of"):
        quantize_expert_weights_mx(np.zeros((2, 256, 256)), np.zeros((2, 128, 256)), fmt="e2m1")


# ---------------------------------------------------------------------------- pipelined prefill
@pytest.mark.parametrize("T", [300, 600])
@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_gate_up_in_passes(tgt, rng, T, fp8):
    """I = 2048: at 256-token blocks gate and up accumulate in passes of 8 tiles each (T = 300),
    at 512-token blocks gate then up (T = 600); each with a tail block on a second expert, so
    the pipelined loop carries state between blocks of different plans' passes."""
    H, I, E = 256, 2048, 2
    ids = np.zeros((T, 1), np.int32)
    ids[-10:] = 1
    w = rng.uniform(0.5, 1.5, (T, 1)).astype(np.float32)
    if not fp8:
        x, wgu, wd, _, _ = _case(rng, T, H, I, E, 1)
        _run(x, wgu, wd, w, ids, "prefill")
        return
    dtype = E4M3FN if tgt == "trn3" else E4M3
    x, g8, d8, _, _, kw = _fp8_case(rng, T, H, I, E, 1, dtype)
    ref = fused_moe_ref(x, g8, d8, w, ids, act_dtype=dtype, **kw)
    y = fused_moe(x, g8, d8, w, ids, regime="prefill", **kw)
    assert cosine_similarity(y.astype(np.float32), ref.astype(np.float32)) > 0.999


@pytest.mark.parametrize("tiled", [False, True])
def test_prefill_down_writes_token_rows(tgt, rng, tiled):
    """bf16: the routed and shared experts' down GEMMs hold 128 tokens of h stationary and stream
    the weight rows (512 columns per matmul), so they write token rows: the prefill runs no fp32
    PE transposes of y (only the K = 1 ones of the token-scale row). H = 640: a pass ends in a
    narrow 128-column group; I = 384; a 64-token tail block; a shared expert."""
    T, H, I, E = 330, 640, 384, 3
    ids = np.where(np.arange(T) < 300, 0, 2).astype(np.int32)[:, None]
    w = rng.uniform(0.5, 1.5, (T, 1)).astype(np.float32)
    x, wgu, wd, _, _ = _case(rng, T, H, I, E, 1)
    sg, sd = (a[0].astype(BF16) for a in _weights(rng, 1, H, 256))
    ref = fused_moe_ref(x, wgu, wd, w, ids, shared=(sg, sd))
    if tiled:
        wgu, wd, sg, sd = (tile_expert_weights(wgu), tile_expert_weights(wd), tile_weight(sg),
                           tile_weight(sd))
    with trace() as t:
        y = fused_moe(x, wgu, wd, w, ids, regime="prefill", shared=(sg, sd))
    assert_rows_close(y, ref, what="y (prefill)")
    tr = [i for i in t if i.opcode == "nc_transpose" and i.attrs["in_dtype"] == "float32"]
    assert tr and all(min(i.attrs["P"], i.attrs["F"]) == 1 for i in tr), \
        sorted({(i.attrs["P"], i.attrs["F"]) for i in tr})
    if not tiled:      # tile-major weights move one 128-column tile per matmul
        down = [i for i in t if i.opcode == "nc_matmul" and i.attrs["N"] == 512]
        assert down and all(i.attrs["M"] <= 128 for i in down)


@pytest.mark.parametrize("lnc", [1, 2])
def test_prefill_accumulator_slabs(rng, monkeypatch, lnc):
    """The fp32 accumulator in column slabs narrower than a down pass (160 of H = 384 here, so
    passes and the shared expert's rows cross slab boundaries), at LNC 1 and 2 (a barrier per
    slab), routed and shared experts, bf16 and FP8."""
    import nki_kernels.moe.fused_moe as M
    monkeypatch.setattr(M, "ACC_COLS", 160)
    x, wgu, wd, w, ids = _case(rng, 300, 384, 128, 4, 2)
    sg, sd = _weights(rng, 1, 384, 256)
    with target("trn3"):
        _run(x, wgu, wd, w, ids, "prefill", lnc=lnc,
             shared=(sg[0].astype(BF16), sd[0].astype(BF16)))
        _run(x, wgu, wd, w, ids, "prefill", lnc=lnc)
    x, g8, d8, w, ids, kw = _fp8_case(rng, 140, 384, 256, 4, 2, E4M3FN, shared=True)
    ref = fused_moe_ref(x, g8, d8, w, ids, act_dtype=E4M3FN, **kw)
    with target("trn3"):
        y = fused_moe(x, g8, d8, w, ids, regime="prefill", lnc=lnc, **kw)
    assert cosine_similarity(y.astype(np.float32), ref.astype(np.float32)) > 0.999
