"""MLA decode against its NumPy references: the absorbed form and the unabsorbed one computed from
W_DKV / W_UK / W_UV-style weights (a small random DeepSeek-style config: latent 512, rope 64, nope
128, v 128 per head), so the absorption convention is pinned; paged caches with NaN in every slot
a sequence does not own and shuffled block tables, contiguous caches, s_q 1..4, the packed
few-row layout (H s_q <= 64) and the row layout, empty / length-1 sequences, FP8 caches with a
per-tensor scale or per-token scales (NaN in the scales of every slot a sequence does not own),
LNC=2 split-KV, both targets; every refusal. Lengths up to 65536 run behind ``-m slow``.

Accuracy rule (reference/compare.py): kernel error <= 2 x the error of a same-precision reference
(probabilities rounded to bf16 for P @ V, output rounded to bf16) + 1e-3, both against a float64
reference; lse by the same rule. Per-token FP8 scales: the kernel dequantizes each tile to bf16 in
SBUF (documented), so its same-precision reference rounds the dequantized latent rows to bf16
too (``dequant_dtype``); the float64 reference does not.
"""
import ml_dtypes
import numpy as np
import pytest

from nki_kernels import mla_decode
from nki_kernels.attention.mla_decode import slots
from nki_kernels.emulator import target
from nki_kernels.reference.compare import assert_attention_close
from nki_kernels.reference.mla_decode import (
    MLAConfig,
    absorb_q,
    apply_w_uv,
    bytes_mla_decode,
    flops_mla_decode,
    latent_rows,
    mla_decode_ref,
    mla_unabsorbed_ref,
    random_weights,
)
from nki_kernels.reference.shapes import (
    DEEPSEEK_V3,
    MLA_MODELS,
    MLA_TOKEN_MODELS,
    mla_decode_of,
)

BF16 = ml_dtypes.bfloat16
FP8 = {"trn2": ml_dtypes.float8_e4m3, "trn3": ml_dtypes.float8_e4m3fn}
SCALE = 192 ** -0.5


def _paged(rng, rows, lens, bs, dtype, spare=3):
    """A paged cache holding ``rows[b]`` ([L_b, 576] float32) in shuffled pages; every slot no
    sequence owns (page tails, spare pages) is NaN; table entries past the end are garbage."""
    need = [-(-L // bs) for L in lens]
    nb = sum(need) + spare
    cache = np.full((nb, bs, 576), np.nan, dtype=np.float32)
    perm = rng.permutation(nb)
    table = np.full((len(lens), max(need) + 2), -5, dtype=np.int32)
    i = 0
    for b, (L, n) in enumerate(zip(lens, need)):
        pages = perm[i:i + n]
        i += n
        table[b, :n] = pages
        flat = np.full((n * bs, 576), np.nan, dtype=np.float32)
        flat[:L] = rows[b]
        cache[pages] = flat.reshape(n, bs, 576)
    return cache.astype(dtype), table


def _inputs(rng, B, s_q, H, lens, bs=None, dtype=BF16, S_max=None):
    qn = rng.standard_normal((B, s_q, H, 512), dtype=np.float32).astype(BF16)
    qr = rng.standard_normal((B, s_q, H, 64), dtype=np.float32).astype(BF16)
    rows = [rng.standard_normal((L, 576), dtype=np.float32) for L in lens]
    if bs:
        kv, table = _paged(rng, rows, lens, bs, dtype)
    else:
        S = S_max or max(max(lens), 1) + 3
        kv = np.full((B, S, 576), np.nan, dtype=np.float32)     # past each length: NaN
        for b, r in enumerate(rows):
            kv[b, :len(r)] = r
        kv, table = kv.astype(dtype), None
    return qn, qr, kv, table


def _check(qn, qr, kv, lens, table=None, kv_scale=None, lnc=1, what="mla_decode"):
    o, lse = mla_decode(qn, qr, kv, np.asarray(lens), block_table=table, scale=SCALE,
                        kv_scale=kv_scale, lnc=lnc)
    assert o.shape == qn.shape and np.dtype(o.dtype) == np.dtype(BF16)
    assert lse.shape == qn.shape[:3] and lse.dtype == np.float32
    kw = dict(block_table=table, scale=SCALE, kv_scale=kv_scale)
    exact = mla_decode_ref(qn, qr, kv, lens, compute_dtype=np.float64, **kw)
    tok = np.ndim(kv_scale) == 2                 # per-token: tiles dequantized to bf16
    same = mla_decode_ref(qn, qr, kv, lens, p_dtype="bfloat16", out_dtype="bfloat16",
                          dequant_dtype="bfloat16" if tok else None, **kw)
    assert_attention_close(o, same[0], exact[0], what=what)
    live = np.asarray(lens) > 0                  # empty slots: lse -inf, checked by the caller
    assert_attention_close(lse[live], same[1][live], exact[1][live], what=f"{what} lse")
    return o, lse


# ------------------------------------------------------------------ absorption convention pinned


def test_absorbed_reference_equals_unabsorbed_reference():
    rng = np.random.default_rng(1)
    cfg = MLAConfig(heads=3)
    w_dkv, w_kr, w_uk, w_uv = random_weights(cfg, rng)
    lens = [37, 5]
    x = [rng.standard_normal((L, cfg.hidden)) for L in lens]
    cache = np.zeros((2, 40, cfg.cache_dim), dtype=np.float32)
    for b, L in enumerate(lens):
        cache[b, :L] = latent_rows(x[b], w_dkv, w_kr, np.arange(L))
    qh = rng.standard_normal((2, 2, cfg.heads, cfg.nope_dim))
    qr = rng.standard_normal((2, 2, cfg.heads, cfg.rope_dim))
    o_u, lse_u = mla_unabsorbed_ref(qh, qr, cache, lens, w_uk, w_uv, scale=cfg.softmax_scale)
    o_lat, lse_a = mla_decode_ref(absorb_q(qh, w_uk).astype(np.float64), qr, cache, lens,
                                  scale=cfg.softmax_scale, compute_dtype=np.float64)
    np.testing.assert_allclose(apply_w_uv(o_lat, w_uv), o_u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse_a, lse_u, rtol=1e-5, atol=1e-5)
    # a wrong convention (W_UK applied on the other side) would not agree
    wrong = np.einsum("bshn,hnl->bshl", qh, np.swapaxes(w_uk, 1, 2)[:, :, ::-1])
    o_w, _ = mla_decode_ref(wrong, qr, cache, lens, scale=cfg.softmax_scale,
                            compute_dtype=np.float64)
    assert np.abs(apply_w_uv(o_w, w_uv) - o_u).max() > 1e-3


def test_kernel_agrees_with_unabsorbed_mla(tgt):
    """DeepSeek-style weights: hidden -> W_DKV / W_KR latent cache (paged, NaN-poisoned,
    shuffled), per-head q_nope absorbed through W_UK; the kernel's o_lat through W_UV matches the
    unabsorbed computation."""
    rng = np.random.default_rng(2)
    cfg = MLAConfig(heads=4)
    w_dkv, w_kr, w_uk, w_uv = random_weights(cfg, rng)
    lens = [1100, 130]
    rows = [latent_rows(rng.standard_normal((L, cfg.hidden)), w_dkv, w_kr, np.arange(L))
            for L in lens]
    kv, table = _paged(rng, rows, lens, 64, BF16)
    s_q = 2
    qh = rng.standard_normal((2, s_q, cfg.heads, cfg.nope_dim)).astype(np.float32)
    qr = rng.standard_normal((2, s_q, cfg.heads, cfg.rope_dim)).astype(BF16)
    q_lat = absorb_q(qh, w_uk).astype(BF16)
    o_lat, lse = mla_decode(q_lat, qr, kv, lens, block_table=table, scale=cfg.softmax_scale)
    kvf = kv.astype(np.float32)
    exact, lse_x = mla_unabsorbed_ref(qh, qr.astype(np.float32), kvf, lens, w_uk, w_uv,
                                      block_table=table, scale=cfg.softmax_scale)
    same, lse_s = mla_decode_ref(q_lat, qr, kv, lens, block_table=table, p_dtype="bfloat16",
                                 out_dtype="bfloat16", scale=cfg.softmax_scale)
    assert_attention_close(apply_w_uv(o_lat, w_uv), apply_w_uv(same, w_uv), exact,
                           what="mla_decode vs unabsorbed")
    assert_attention_close(lse, lse_s, lse_x, what="mla_decode lse vs unabsorbed")


# ---------------------------------------------------------------------------- layouts, lengths

CASES = [
    # B, s_q, H, lens, block size (None = contiguous)
    pytest.param(2, 1, 16, [1100, 1], 16, id="H16-paged16-packed4-L1"),
    # whole tiles (1024 / 2048 keys): every tile packed, the row state starts from the slots
    pytest.param(2, 1, 16, [2048, 3072], 64, id="H16-paged64-whole-tiles"),
    pytest.param(2, 1, 16, [1024, 7], None, id="H16-contig-one-whole-tile"),
    pytest.param(1, 2, 32, [1200], 64, id="H32-sq2-paged64-packed2"),
    # the drafts' diagonal in a full last tile: packed and masked per slice (T = 8 and T = 4);
    # a full tile cut by it but not last (a key follows): row layout
    pytest.param(1, 2, 16, [2048], 64, id="H16-sq2-paged64-masked-packed"),
    pytest.param(2, 4, 16, [1024, 0], None, id="H16-sq4-contig-masked-packed2"),
    pytest.param(1, 3, 16, [1025], None, id="H16-sq3-cut-tile-not-last"),
    pytest.param(3, 4, 32, [4, 0, 261], None, id="H32-sq4-contig-empty"),
    pytest.param(1, 1, 128, [777], 32, id="H128-paged32"),
    pytest.param(1, 3, 48, [140], None, id="H48-sq3-two-row-groups"),
]


@pytest.mark.parametrize("B, s_q, H, lens, bs", CASES)
def test_mla_decode_layouts(tgt, B, s_q, H, lens, bs):
    rng = np.random.default_rng(len(lens) * 7 + H + s_q)
    qn, qr, kv, table = _inputs(rng, B, s_q, H, lens, bs)
    o, lse = _check(qn, qr, kv, lens, table, what=f"mla_decode {tgt}")
    for b, L in enumerate(lens):
        if L == 0:
            assert np.all(o[b].astype(np.float32) == 0) and np.all(np.isneginf(lse[b]))


def test_program_ends_with_a_split_division(tgt):
    """The program's last tile (row layout, not split): lse and its store go ahead of the o
    update, the update adds the PSUM block to ``o alpha`` (prescaled on ScalarE), and the
    division by l is split by columns over VectorE and ScalarE into the one tile the kernel's
    last store reads. Earlier items keep the update and ``finalize`` on VectorE. The values are
    checked here and by every other test."""
    from nki_kernels.emulator.trace import trace
    rng = np.random.default_rng(11)
    lens = [900, 1500]
    qn, qr, kv, table = _inputs(rng, 2, 1, 128, lens, 64)
    with trace() as t:
        _check(qn, qr, kv, lens, table, what=f"mla_decode {tgt}")
    ins = list(t)
    stores = [i for i in ins if i.engine == "dma" and i.writes
              and i.writes[0].buffer.endswith("hbm") and i.writes[0].shape[-1] == 512]
    assert len(stores) == 2                                 # one per sequence
    src = stores[-1].reads[0].alloc
    writers = [(i.engine, i.opcode, i.writes[0].extent) for i in ins
               if i.writes and i.writes[0].alloc == src]
    assert sorted(w[:2] for w in writers) == [("scalar", "activation"),
                                              ("vector", "tensor_scalar")]
    (a0, a1), (b0, b1) = sorted(w[2] for w in writers)
    assert a1 <= b0                                         # disjoint column halves
    first = [(i.engine, i.opcode) for i in ins
             if i.writes and i.writes[0].alloc == stores[0].reads[0].alloc]
    assert first == [("vector", "tensor_scalar")]           # earlier items: VectorE only
    last = ins.index(stores[-1])
    lse_store = [k for k, i in enumerate(ins) if i.engine == "dma" and i.writes
                 and i.writes[0].buffer.endswith("hbm") and i.writes[0].shape[-1] == 1]
    assert any(i.engine == "vector" and i.opcode == "tensor_tensor"   # the update, after
               for i in ins[lse_store[-1]:last])                         # lse's store


def _h16_s_q2_paged_trace(tgt, seed):
    """One 2048-token sequence, s_q = 2, H = 16 (packed), paged/64, checked against the
    references under a trace; returns its instructions."""
    from nki_kernels.emulator.trace import trace
    rng = np.random.default_rng(seed)
    lens = [2048]
    qn, qr, kv, table = _inputs(rng, 1, 2, 16, lens, 64)
    with trace() as t:
        _check(qn, qr, kv, lens, table, what=f"mla_decode {tgt}")
    return list(t)


def test_drafts_last_tile_packs(tgt):
    """With drafts (s_q > 1) a sequence's last tile, when full, runs packed like the others:
    the drafts' diagonal is masked per slot slice (``range_select`` over the 128 slot rows, one
    per slice), not in the row layout (a ``range_select`` over the s_q H rows). On Trn3 the
    packed exponentials run on VectorE and part of K^T by identity matmuls."""
    ins = _h16_s_q2_paged_trace(tgt, 5)
    rs = [i for i in ins if i.opcode == "range_select"]
    assert len(rs) == 2                            # one per slice of a slot (Ts = 2)
    assert all(i.writes[0].partitions == (0, 128) for i in rs)
    if tgt == "trn3":
        assert any(i.engine == "vector" and i.opcode == "exponential" for i in ins)
        assert not any(i.engine == "scalar" and i.opcode == "activation"   # (the fold's
                       and i.attrs.get("op") == "exp" and i.writes[0].shape[-1] > 1  # [128, 1]
                       for i in ins)                                       # weights only)
        assert any(i.opcode == "nc_matmul" and i.attrs.get("M") == 128
                   and i.attrs.get("N") == 128 for i in ins)      # K^T by identity matmuls


def test_packed_program_start_and_end_orders(tgt):
    """Packed plans (TP8 H = 16, DMA-bound): the first item's block table and its first tile's
    page loads are issued ahead of its queries (on the static ring they followed the queries'
    triggers, and the loads the kernel is bound by started ~0.5 us later, modeled). At the end,
    o left in the fold's PSUM: lse on ScalarE alone (no VectorE pass ahead of the division) and
    its store reads partitions apart from o's (other DMA queues: behind o's store on the same
    queues it ended the program ~0.2 us later). The values are checked here and elsewhere."""
    ins = _h16_s_q2_paged_trace(tgt, 7)
    dma = [i for i in ins if i.engine == "dma"]
    assert dma[0].writes[0].dtype == "int32"                     # the block table first
    q_load = next(k for k, i in enumerate(dma) if i.reads[0].buffer.endswith("hbm")
                  and i.reads[0].dtype == "bfloat16" and not i.attrs.get("dynamic"))
    pages = [i for i in dma[:q_load] if i.attrs.get("dynamic")]
    assert len(pages) == 1024 // 64                              # the first tile's pages
    hbm_out = [i for i in dma if i.writes[0].buffer.endswith("hbm")]
    o_st, = (i for i in hbm_out if i.writes[0].shape[-1] == 512)
    l_st, = (i for i in hbm_out if i.writes[0].shape[-1] == 1)
    (o0, o1), (l0, l1) = o_st.reads[0].partitions, l_st.reads[0].partitions
    assert o1 <= l0 or l1 <= o0                                  # disjoint partitions (queues)
    writers = {i.engine for i in ins if i.writes and i.writes[0].alloc == l_st.reads[0].alloc}
    assert writers == {"scalar"}


def test_slot_plan():
    assert slots(16, 8) == (32, 4)
    assert slots(32, 8) == (32, 4)
    assert slots(48, 8) == (64, 2)
    assert slots(64, 16) == (64, 2)
    assert slots(16, 2) == (64, 2)          # 4 slots need T % 4 == 0
    assert slots(16, 1) == (128, 1)
    assert slots(128, 8) == (128, 1)


@pytest.mark.parametrize("H, lens", [(16, [2200]), (128, [700])], ids=["H16-fp8", "H128-cast"])
def test_mla_decode_fp8(tgt, H, lens):
    # H=16: FP8 K^T by identity matmuls; H=128 (> 64 rows): tiles cast to bf16 in SBUF (deq_cast)
    rng = np.random.default_rng(5)
    dt = FP8[tgt]
    qn, qr, kv, table = _inputs(rng, 1, 1, H, lens, 64, dtype=dt)
    # range limits of the format, scaled back by kv_scale
    kv[0, 0, 0:4] = np.array([448.0 if tgt == "trn3" else 240.0, -2.0 ** -6, 0.0, 1.0],
                             dtype=np.float32).astype(dt)
    _check(qn, qr, kv, lens, table, kv_scale=0.125, what=f"mla_decode fp8 {tgt}")


def test_fp8_packed_kT_as_dim_pairs(tgt):
    """Per-tensor FP8, packed (TP8 H = 16): K^T is taken as dim pairs, by TensorE transposes
    of the FP8 tile viewed as bf16 (3 per 128 keys: 128 + 128 + 32 pairs), not by identity
    matmuls (5 per 128 keys), and QK^T contracts the even and the odd dims in two passes per
    chunk (FP8 moving views, bf16 Q^T of the even / odd dims), 6 passes; PV reads V from the
    FP8 tile. Values checked too (with the format's range limits in the cache)."""
    from nki_kernels.emulator.trace import trace
    rng = np.random.default_rng(9)
    lens = [2100]                            # a full packed tile (T = 16) and a partial one
    dt = FP8[tgt]
    qn, qr, kv, table = _inputs(rng, 1, 1, 16, lens, 64, dtype=dt)
    kv[0, 0, 0:4] = np.array([448.0 if tgt == "trn3" else 240.0, -2.0 ** -6, 0.0, 1.0],
                             dtype=np.float32).astype(dt)
    with trace() as t:
        _check(qn, qr, kv, lens, table, kv_scale=0.25, what=f"mla_decode fp8 {tgt}")
    ins = list(t)
    f8 = np.dtype(dt).name
    latent = {i.writes[0].alloc for i in ins if i.opcode == "dma_copy" and i.writes
              and i.writes[0].dtype == f8}                 # the latent tiles in SBUF
    kt_tr = [i for i in ins if i.opcode == "nc_transpose" and i.reads[0].alloc in latent]
    kt_mm = [i for i in ins if i.opcode == "nc_matmul" and i.attrs.get("in_dtype") == f8]
    qk8 = [i for i in ins if i.opcode == "nc_matmul" and i.attrs.get("in_dtype") == "bfloat16"
           and i.attrs.get("mov_dtype") == f8 and i.reads[1].alloc not in latent]
    pv8 = [i for i in ins if i.opcode == "nc_matmul" and i.attrs.get("mov_dtype") == f8
           and i.reads[1].alloc in latent]
    assert pv8                                              # V straight from the FP8 tile
    assert not kt_mm                                        # no identity matmul
    assert all(i.reads[0].dtype == "bfloat16" for i in kt_tr)
    assert len(kt_tr) == 2 * 16 * 3          # 2 tiles x 16 slices x 3 chunks of pairs
    assert sorted({i.reads[0].partitions[1] - i.reads[0].partitions[0] for i in kt_tr}) \
        == [4, 128]                                         # keys per transpose
    assert {i.attrs.get("K") for i in qk8} == {128, 32}     # pair chunks 128, 128, 32
    assert len(qk8) == 4 * 6 + 6             # packed: 4 slots x 6 passes; row layout: 6


def test_fp8_packed_two_slots_of_64_rows(tgt):
    """Per-tensor FP8 with 64 query rows (s_q = 4, H = 16: two PE column tiles of 64): a slot
    scores 8 slices of a T = 16 tile, 1024 columns, which Trn2 takes in matmuls of one fp32
    PSUM bank (512 columns) each; it was refused there before."""
    rng = np.random.default_rng(4)
    lens = [2500]
    qn, qr, kv, table = _inputs(rng, 1, 4, 16, lens, dtype=FP8[tgt])
    _check(qn, qr, kv, lens, table, kv_scale=0.5, what=f"mla_decode fp8 s_q=4 {tgt}")


def _token_scales(rng, kv, lens, table=None, lo=-8.0, hi=4.0):
    """Per-token scales 2^lo..2^hi (log-uniform) shaped like the cache's leading dims, NaN in
    every slot a sequence does not read (past its length; paged: unused pages and page tails)."""
    lead = kv.shape[:2]
    ks = (2.0 ** rng.uniform(lo, hi, size=lead)).astype(np.float32)
    used = np.zeros(lead, dtype=bool)
    for b, L in enumerate(lens):
        if table is None:
            used[b, :L] = True
        else:
            j = np.arange(L)
            used[table[b, j // lead[1]], j % lead[1]] = True
    ks[~used] = np.nan
    return ks


TOKEN_CASES = [
    # B, s_q, H, lens, block size (None = contiguous)
    pytest.param(2, 1, 16, [1100, 1], 16, id="H16-paged16-packed"),
    pytest.param(1, 1, 16, [2048], None, id="H16-contig-whole-tile"),
    pytest.param(1, 2, 128, [777], 32, id="H128-sq2-paged32"),
    pytest.param(3, 2, 16, [300, 0, 40], None, id="H16-sq2-contig-empty"),
    pytest.param(1, 1, 128, [600], None, id="H128-contig"),
]


@pytest.mark.parametrize("B, s_q, H, lens, bs", TOKEN_CASES)
def test_mla_decode_fp8_per_token(tgt, B, s_q, H, lens, bs):
    """Per-token scales spanning 2^-8..2^4 (NaN where unread), shuffled NaN-poisoned pages."""
    rng = np.random.default_rng(11 + H + s_q + len(lens))
    qn, qr, kv, table = _inputs(rng, B, s_q, H, lens, bs, dtype=FP8[tgt])
    ks = _token_scales(rng, kv, lens, table)
    o, lse = _check(qn, qr, kv, lens, table, kv_scale=ks, what=f"mla_decode fp8/token {tgt}")
    assert np.isfinite(o.astype(np.float32)).all()
    for b, L in enumerate(lens):
        if L == 0:
            assert np.all(o[b].astype(np.float32) == 0) and np.all(np.isneginf(lse[b]))
    # the scales count: the largest scale of the longest sequence divided by 64 changes its output
    b = int(np.argmax(lens))
    ks2 = ks.copy()
    j = np.arange(lens[b])
    slots = (np.full_like(j, b), j) if table is None else (table[b, j // kv.shape[1]],
                                                           j % kv.shape[1])
    k = int(np.argmax(ks[slots]))
    ks2[slots[0][k], slots[1][k]] /= 64.0
    o2, _ = mla_decode(qn, qr, kv, np.asarray(lens), block_table=table, scale=SCALE, kv_scale=ks2)
    assert not np.array_equal(o2[b].astype(np.float32), o[b].astype(np.float32))


def test_per_token_constant_scale_equals_per_tensor(tgt):
    """A constant per-token scale gives the per-tensor result: exactly representable (2^-2,
    the bf16 dequantization is then exact) up to fp32 summation order; any constant (0.3) by
    the accuracy rule on both paths."""
    rng = np.random.default_rng(12)
    lens = [900, 130]
    qn, qr, kv, table = _inputs(rng, 2, 1, 16, lens, 64, dtype=FP8[tgt])
    for c in (0.25, 0.3):
        ks = np.full(kv.shape[:2], c, dtype=np.float32)
        o_t, l_t = _check(qn, qr, kv, lens, table, kv_scale=ks, what=f"per-token {c}")
        o_s, l_s = _check(qn, qr, kv, lens, table, kv_scale=c, what=f"per-tensor {c}")
        if c == 0.25:
            np.testing.assert_allclose(o_t.astype(np.float32), o_s.astype(np.float32),
                                       rtol=2.0 ** -7, atol=1e-3)   # one bf16 rounding apart
            np.testing.assert_allclose(l_t, l_s, rtol=1e-5, atol=1e-5)


def test_per_token_reference_paths_agree():
    """The per-token reference: absorbed and unabsorbed agree, and scales change the result as
    a per-row multiply of the latent (a paged cache and its contiguous copy agree)."""
    rng = np.random.default_rng(13)
    cfg = MLAConfig(heads=2)
    _, _, w_uk, w_uv = random_weights(cfg, rng)
    lens = [70, 33]
    rows = [rng.standard_normal((L, 576)).astype(np.float32) for L in lens]
    kv_p, table = _paged(rng, rows, lens, 16, np.float32)
    ks_p = _token_scales(rng, kv_p, lens, table)
    kv_c = np.zeros((2, 70, 576), np.float32)
    ks_c = np.zeros((2, 70), np.float32)
    for b, L in enumerate(lens):
        kv_c[b, :L] = rows[b]
        j = np.arange(L)
        ks_c[b, :L] = ks_p[table[b, j // 16], j % 16]
    qh = rng.standard_normal((2, 1, 2, cfg.nope_dim))
    qr = rng.standard_normal((2, 1, 2, cfg.rope_dim))
    o_u, l_u = mla_unabsorbed_ref(qh, qr, kv_p, lens, w_uk, w_uv, block_table=table,
                                  scale=cfg.softmax_scale, kv_scale=ks_p)
    o_a, l_a = mla_decode_ref(absorb_q(qh, w_uk).astype(np.float64), qr, kv_c, lens,
                              scale=cfg.softmax_scale, kv_scale=ks_c, compute_dtype=np.float64)
    np.testing.assert_allclose(apply_w_uv(o_a, w_uv), o_u, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(l_a, l_u, rtol=1e-5, atol=1e-5)
    scaled = kv_c * ks_c[:, :, None]
    o_1, _ = mla_decode_ref(absorb_q(qh, w_uk).astype(np.float64), qr, scaled, lens,
                            scale=cfg.softmax_scale, compute_dtype=np.float64)
    np.testing.assert_allclose(o_1, o_a, rtol=1e-5, atol=1e-6)


def test_mla_decode_fp8_per_token_lnc2():
    """LNC=2 with per-token scales: the parts of a long sequence dequantize their own tiles."""
    rng = np.random.default_rng(14)
    lens = [2100, 40]
    with target("trn3"):
        qn, qr, kv, table = _inputs(rng, 2, 1, 16, lens, 128, dtype=FP8["trn3"])
        ks = _token_scales(rng, kv, lens, table)
        _check(qn, qr, kv, lens, table, kv_scale=ks, lnc=2, what="mla_decode fp8/token lnc=2")


@pytest.mark.parametrize("lens", [[2100, 40], [2048, 40]], ids=["partial-tail", "whole-tiles"])
def test_mla_decode_lnc2_split(lens):
    """LNC=2: the long sequence is cut in parts run on both cores and merged (whole tiles: every
    part's tiles pack and its row state starts from the folded slots)."""
    rng = np.random.default_rng(6)
    qn, qr, kv, table = _inputs(rng, 2, 1, 16, lens, 128)
    with target("trn3"):
        _check(qn, qr, kv, lens, table, lnc=2, what="mla_decode lnc=2")


def test_lengths_are_independent_of_the_rest_of_the_cache():
    """Changing cache rows past a sequence's length (or other sequences) changes nothing."""
    rng = np.random.default_rng(8)
    lens = [600, 90]
    qn, qr, kv, _ = _inputs(rng, 2, 1, 16, lens, S_max=700)
    a, _ = mla_decode(qn, qr, kv, lens, scale=SCALE)
    kv2 = kv.copy()
    kv2[0, 600:] = BF16(7.0)
    kv2[1, 90:] = BF16(-3.0)
    b, _ = mla_decode(qn, qr, kv2, lens, scale=SCALE)
    np.testing.assert_array_equal(a.astype(np.float32), b.astype(np.float32))
    kv2[0, 599] = BF16(50.0)                 # the last valid row does count
    c, _ = mla_decode(qn, qr, kv2, lens, scale=SCALE)
    assert not np.array_equal(a[0].astype(np.float32), c[0].astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("L, H, s_q, bs", [(65536, 16, 1, 64), (16384, 128, 2, None),
                                           (40000, 32, 2, 256)])
def test_mla_decode_long(tgt, L, H, s_q, bs):
    rng = np.random.default_rng(L)
    qn, qr, kv, table = _inputs(rng, 1, s_q, H, [L], bs)
    _check(qn, qr, kv, [L], table, what=f"mla_decode L={L}")


@pytest.mark.slow
def test_mla_decode_long_fp8_per_token(tgt):
    rng = np.random.default_rng(16)
    L = 65536
    qn, qr, kv, table = _inputs(rng, 1, 1, 16, [L], 64, dtype=FP8[tgt])
    ks = _token_scales(rng, kv, [L], table)
    _check(qn, qr, kv, [L], table, kv_scale=ks, what=f"mla_decode fp8/token L={L}")


# ------------------------------------------------------------------------------- bench, shapes


def test_bench_formulas_and_rows():
    lens = [4096, 100]
    assert flops_mla_decode(lens, 2, 16) == 2.0 * 2 * 16 * 4196 * (512 + 512 + 64)
    assert bytes_mla_decode(lens, 1, 16, 2) == 4196 * 576 * 2 + 2 * 16 * 576 * 2 + 2 * 16 * 512 * 2
    s = mla_decode_of(DEEPSEEK_V3, 32768, batch=32, page_size=64, kv_dtype="fp8")
    assert s.n_heads == 128 and s.kv_lora_rank + s.rope_dim == 576 and s.batch == 32
    heads = {r.n_heads for r in MLA_MODELS}
    assert heads == {128, 16}
    assert {r.q_len for r in MLA_MODELS} == {1, 2}
    assert {r.batch for r in MLA_MODELS} == {1, 32, 128}
    assert {max(r.lens) for r in MLA_MODELS} == {4096, 32768}
    assert {r.kv_dtype for r in MLA_MODELS} == {"bfloat16", "fp8"}
    assert bytes_mla_decode(lens, 1, 16, 1, token_scale_bytes=4) == \
        4196 * (576 + 4) + 2 * 16 * 576 * 2 + 2 * 16 * 512 * 2
    assert {(r.kv_dtype, r.kv_scale) for r in MLA_TOKEN_MODELS} == {("fp8", "token")}
    assert {r.n_heads for r in MLA_TOKEN_MODELS} == {128, 16}
    assert all("fp8 per-token" in r.name for r in MLA_TOKEN_MODELS)
    assert {r.kv_scale for r in MLA_MODELS} == {"tensor"}
    with pytest.raises(ValueError, match="no multi-head latent attention"):
        from nki_kernels.reference.shapes import LLAMA3_8B
        mla_decode_of(LLAMA3_8B, 4096)


# ---------------------------------------------------------------------------------- refusals


def _ok(B=1, s_q=1, H=16, L=8):
    rng = np.random.default_rng(0)
    qn = rng.standard_normal((B, s_q, H, 512), dtype=np.float32).astype(BF16)
    qr = rng.standard_normal((B, s_q, H, 64), dtype=np.float32).astype(BF16)
    kv = rng.standard_normal((B, L, 576), dtype=np.float32).astype(BF16)
    return qn, qr, kv


def test_refusals():
    qn, qr, kv = _ok()
    lens = np.array([8])
    E = (ValueError, TypeError)

    def bad(match, *args, **kw):
        a = dict(zip(("qn", "qr", "kv", "lens"), (qn, qr, kv, lens)))
        a.update(dict(zip(("qn", "qr", "kv", "lens"), args)))
        kw.setdefault("scale", SCALE)
        with pytest.raises(E, match=match):
            mla_decode(a["qn"], a["qr"], a["kv"], a["lens"], **kw)

    bad(r"mla_decode: q_nope must be \[B, s_q, H, 512\]", qn[..., :256])
    bad(r"mla_decode: q_rope must be \[B, s_q, H, 64\]", qn, qr[..., :32])
    bad(r"q_rope must be \[B=1, s_q=1, H=16, 64\] like q_nope", qn, np.concatenate([qr, qr], 2))
    q5, r5, _ = _ok(s_q=5)
    bad(r"s_q \(new tokens per sequence\) must be 1 to 4; got 5", q5, r5)
    bad(r"q_nope.dtype must be bfloat16; got float32", qn.astype(np.float32))
    bad(r"q_rope.dtype must be bfloat16; got float16", qn, qr.astype(np.float16))
    bad(r"kv_cache must be \[B, S_max, 576\]", qn, qr, kv[..., :512])
    bad(r"kv_cache.dtype must be bfloat16 or float8_e4m3fn", qn, qr, kv.astype(np.float32))
    bad(r"an FP8 kv_cache needs kv_scale", qn, qr, kv.astype(ml_dtypes.float8_e4m3fn))
    bad(r"kv_scale applies to FP8 caches only", kv_scale=0.5)
    bad(r"kv_scale must be a finite scalar > 0", qn, qr, kv.astype(ml_dtypes.float8_e4m3fn),
        kv_scale=-1.0)
    bad(r"scale must be a finite scalar > 0; got nan", scale=float("nan"))
    bad(r"scale must be a finite scalar > 0; got 0", scale=0)
    bad(r"return_lse must be a bool", return_lse=1)
    bad(r"lnc must be 1 or 2; got 3", lnc=3)
    bad(r"seq_lens must be an integer array; got dtype float64", qn, qr, kv, np.array([8.0]))
    bad(r"seq_lens must have one length per sequence \(B = 1\)", qn, qr, kv, np.array([8, 8]))
    bad(r"seq_lens must be 0 \(an empty slot\) or >= s_q", qn, qr, kv, np.array([-1]))
    bad(r"seq_lens up to 9 exceed the cache's S_max = 8", qn, qr, kv, np.array([9]))
    bad(r"a contiguous kv_cache must be \[B=1, S_max, 576\]", qn, qr,
        np.concatenate([kv, kv], 0))
    pages = np.zeros((4, 16, 576), dtype=BF16)
    bad(r"block_size \(kv_cache.shape\[1\]\) must be one of", qn, qr, np.zeros((4, 12, 576), BF16),
        block_table=np.zeros((1, 2), np.int32))
    bad(r"block_table must be \[B=1, max_blocks\]", qn, qr, pages,
        block_table=np.zeros((2, 2), np.int32))
    bad(r"block_table must be an integer array", qn, qr, pages,
        block_table=np.zeros((1, 2), np.float32))
    bad(r"exceed the block table's capacity 1 blocks x 16", qn, qr, pages, np.array([17]),
        block_table=np.zeros((1, 1), np.int32))
    bad(r"block_table\[0\] has entries out of range \[0, 4\)", qn, qr, pages,
        block_table=np.array([[4, 0]], np.int32))
    with target("trn2"):
        bad(r"kv_cache.dtype must be bfloat16 or float8_e4m3 \(FP8 on this target\); got "
            r"float8_e4m3fn", qn, qr, kv.astype(ml_dtypes.float8_e4m3fn), kv_scale=1.0)
    with target("trn1"):
        bad(r"mla_decode", qn, qr, kv)
    # per-token FP8 scales
    f8 = kv.astype(ml_dtypes.float8_e4m3fn)
    ok = np.full((1, 8), 0.5, np.float32)
    bad(r"mla_decode: per-token kv_scale applies to FP8 caches only; the cache is bfloat16",
        kv_scale=ok)
    bad(r"kv_scale \(per-token scales\) must be \[B, S_max\] = \[1, 8\] like the cache's "
        r"leading dims; got shape \[1, 7\]", qn, qr, f8, kv_scale=ok[:, :7])
    bad(r"kv_scale \(per-token scales\) must be \[B, S_max\] = \[1, 8\].*got shape \[8\]",
        qn, qr, f8, kv_scale=ok[0])
    bad(r"kv_scale \(per-token scales\) must be a float32 array \[B, S_max\]; got list", qn, qr,
        f8, kv_scale=ok.tolist())
    bad(r"kv_scale \(per-token scales\) dtype must be float32; got float64", qn, qr, f8,
        kv_scale=ok.astype(np.float64))
    bad(r"kv_scale \(per-token scales\) dtype must be float32; got bfloat16", qn, qr, f8,
        kv_scale=ok.astype(BF16))
    for v, got in ((0.0, "0.0"), (-1.0, "-1.0"), (np.nan, "nan"), (np.inf, "inf")):
        z = ok.copy()
        z[0, 5] = v
        bad(rf"kv_scale must be finite and > 0 for every token read; sequence 0 token 5 has "
            rf"{got}", qn, qr, f8, kv_scale=z)
    z = ok.copy()
    z[0, 5] = np.nan                                   # past the length: never read, accepted
    o, _ = mla_decode(qn, qr, f8, np.array([5]), scale=SCALE, kv_scale=z)
    assert np.isfinite(o.astype(np.float32)).all()
    pg = np.zeros((4, 16, 576), dtype=ml_dtypes.float8_e4m3fn)
    bad(r"kv_scale \(per-token scales\) must be \[num_blocks, block_size\] = \[4, 16\]",
        qn, qr, pg, block_table=np.zeros((1, 1), np.int32), kv_scale=np.ones((1, 8), np.float32))
    with pytest.raises(TypeError):
        mla_decode(qn, qr, kv, lens)                     # scale is required (keyword-only)


def test_torch_op_passes_per_token_scales():
    """torch.ops.nki_kernels.mla_decode takes per-token scales as ``kv_token_scale`` (the float
    ``kv_scale`` stays per tensor) and gives the NumPy op's result; both at once is refused."""
    torch = pytest.importorskip("torch")
    import nki_kernels.torch  # noqa: F401  (registers the ops)
    rng = np.random.default_rng(15)
    lens = [300, 41]
    with target("trn3"):
        qn, qr, kv, table = _inputs(rng, 2, 1, 16, lens, 32, dtype=FP8["trn3"])
        ks = _token_scales(rng, kv, lens, table)
        want = mla_decode(qn, qr, kv, np.asarray(lens), block_table=table, scale=SCALE,
                          kv_scale=ks)

        def t(a):
            return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16) \
                if np.dtype(a.dtype) == np.dtype(BF16) else torch.from_numpy(a)

        args = (t(qn), t(qr), torch.from_numpy(kv.view(np.uint8)).view(torch.float8_e4m3fn),
                torch.tensor(lens, dtype=torch.int32), SCALE)
        o, lse = torch.ops.nki_kernels.mla_decode(*args, block_table=torch.from_numpy(table),
                                                  kv_token_scale=torch.from_numpy(ks))
        np.testing.assert_array_equal(o.float().numpy(), want[0].astype(np.float32))
        np.testing.assert_array_equal(lse.numpy(), want[1])
        with pytest.raises(ValueError, match="pass kv_scale \\(per tensor\\) or kv_token_scale"):
            torch.ops.nki_kernels.mla_decode(*args, block_table=torch.from_numpy(table),
                                             kv_scale=0.5, kv_token_scale=torch.from_numpy(ks))
