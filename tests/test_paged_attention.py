"""Paged attention (ragged mixed batches over a paged KV cache) against its NumPy reference.

Batches come from the seeded builders of ``paged_batches``: idle requests, empty slots, decodes,
speculative drafts and prompt chunks over cached prefixes, block sizes 16-128, shuffled pages,
NaN in every slot no request owns (free pages, page tails) and junk past each block-table row's
pages. Cross-checks: a batch equal to one prefill matches ``flash_attention``, a batch of decodes
matches ``decode_attention`` on the same paged cache, a prefix + chunk matches the last rows of the
whole prompt's prefill. GQA / MHA, sliding window, soft-cap, sinks, lse, FP8 caches (per-tensor and
per-head scales), every draft length and the decode path's row limit, a chunk longer than one
SBUF pass, LNC=2, views and torch inputs, plan reuse across layers (and by decode_attention) and
mismatched plans, every refusal, the bench's fast rows (its model rows: slow); both targets.

The reference itself is checked first (against the decode and flash references, request by
request), so a kernel failure points at the kernel.

Accuracy rule (reference/compare.py): kernel error <= 2 x the error of a same-precision reference
(probabilities rounded to bf16 for P @ V, the denominator their sum) + 1e-3, both against a
float64 reference; lse by the same rule; NaN / inf positions must match (a NaN read from a page
the request does not own shows).
"""
import ml_dtypes
import numpy as np
import pytest
from paged_batches import BF16, build, random_batch

from nki_kernels import paged_attention, plan_paged_attention
from nki_kernels.reference.compare import assert_attention_close
from nki_kernels.reference.decode_attention import (
    bytes_decode_attention,
    decode_attention_ref,
    flops_decode_attention,
)
from nki_kernels.reference.flash_attention import flash_attention_ref, flops_flash_attention
from nki_kernels.reference.paged_attention import (
    bytes_paged_attention,
    flops_paged_attention,
    paged_attention_ref,
)

FP8 = {"trn2": ml_dtypes.float8_e4m3, "trn3": ml_dtypes.float8_e4m3fn}
OP = "paged_attention"


def _ref(b, **kw):
    """(float64 o, lse), (same-precision o, lse) of batch ``b``."""
    exact = paged_attention_ref(*b.args, compute_dtype=np.float64, **kw)
    same = paged_attention_ref(*b.args, p_dtype="bfloat16", **kw)
    return exact, same


def _check(out, b, what=OP, **kw):
    o, lse = out
    (e, el), (s, sl) = _ref(b, **kw)
    assert o.shape == b.q.shape and o.dtype == b.q.dtype, (o.shape, o.dtype)
    assert lse.shape == b.q.shape[:2] and lse.dtype == np.float32, (lse.shape, lse.dtype)
    assert_attention_close(o, s, e, what=what)
    empty = np.isneginf(el)
    assert np.array_equal(np.isneginf(lse), empty), "lse: -inf rows differ"
    assert_attention_close(lse[~empty], sl[~empty], el[~empty], what=f"{what} lse")


def _run(b, **kw):
    out = paged_attention(*b.args, return_lse=True, **kw)
    _check(out, b, **{k: x for k, x in kw.items() if k not in ("plan", "lnc")})
    return out


def _f(x):
    return np.asarray(x, dtype=np.float32)


# ------------------------------------------------------------------- the reference, checked


@pytest.mark.parametrize("seed", range(4))
def test_ref_matches_decode_and_flash_refs(seed):
    """Request by request, the paged reference equals the decode reference on the same paged
    cache and the flash reference on the request's dense K/V (float64: to rounding)."""
    rng = np.random.default_rng(seed)
    b = random_batch(rng, Hq=4, Hkv=2, d=32, max_chunk=60, max_prefix=150)
    kw = [{}, dict(window=9), dict(softcap=4.0, sinks=np.linspace(-1, 1, 4)),
          dict(window=40, sinks=np.ones(4))][seed]
    o, lse = paged_attention_ref(*b.args, compute_dtype=np.float64, out_dtype="float32", **kw)
    assert np.isfinite(o).all() and np.isfinite(lse[:b.query_start_loc[-1]]).all()
    o16, _ = paged_attention_ref(*b.args, compute_dtype=np.float64, **kw)   # q's dtype (bf16)
    assert o16.dtype == b.q.dtype
    for r, n in enumerate(b.q_lens):
        if n == 0:
            continue
        L = int(b.seq_lens[r])
        qr = b.q[b.rows(r)]
        od, ld = decode_attention_ref(qr[None], b.k_cache, b.v_cache, [L],
                                      block_table=b.block_table[r:r + 1], return_lse=True,
                                      compute_dtype=np.float64, **kw)
        # both round the same float64 result to bf16: equal up to a rounding tie
        np.testing.assert_allclose(_f(o16[b.rows(r)]), _f(od[0]), rtol=2.0 ** -8, atol=1e-6)
        np.testing.assert_allclose(lse[b.rows(r)], ld[0], rtol=1e-6, atol=1e-6)
        kd = b.k[r].transpose(1, 0, 2)[None]            # [1, Hkv, L, d]
        vd = b.v[r].transpose(1, 0, 2)[None]
        of, lf = flash_attention_ref(qr.transpose(1, 0, 2)[None], kd, vd, return_lse=True,
                                     compute_dtype=np.float64, out_dtype="float32", **kw)
        np.testing.assert_allclose(o[b.rows(r)], of[0].transpose(1, 0, 2), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(lse[b.rows(r)], lf[0].T, rtol=1e-6, atol=1e-6)


def test_ref_fp8_scales_and_rows():
    """FP8 pages dequantized by per-head scales equal the float32 cache times the scales; the
    ``rows`` subset computes only those rows."""
    rng = np.random.default_rng(5)
    f8 = ml_dtypes.float8_e4m3fn
    b = build(rng, [3, 0, 40], [50, 9, 40], 4, 2, 64, 16, kv_dtype=f8)
    ks, vs = np.array([0.5, 2.0]), np.array([3.0, 0.25])
    o, lse = paged_attention_ref(*b.args, k_scale=ks, v_scale=vs, compute_dtype=np.float64)
    kc = _f(b.k_cache) * ks[None, None, :, None]
    vc = _f(b.v_cache) * vs[None, None, :, None]
    o2, lse2 = paged_attention_ref(b.q, kc, vc, *b.args[3:], compute_dtype=np.float64)
    np.testing.assert_array_equal(_f(o), _f(o2))
    np.testing.assert_allclose(lse, lse2, rtol=1e-6)
    rows = [0, 2, 10]
    o3, lse3 = paged_attention_ref(*b.args, k_scale=ks, v_scale=vs, compute_dtype=np.float64,
                                   rows=rows)
    np.testing.assert_array_equal(_f(o3)[rows], _f(o)[rows])
    assert np.all(_f(o3)[1] == 0) and np.all(np.isneginf(lse3[1]))


def test_flops_bytes():
    """A batch of one prefill counts flash's FLOPs; a batch of decodes counts decode's FLOPs and
    bytes; idle requests read nothing; a window bounds the keys read."""
    assert flops_paged_attention([300], [0, 300], 4, 128) == flops_flash_attention(1, 4, 300, 300,
                                                                                    128)
    assert flops_paged_attention([700], [0, 300], 4, 128, window=64) == \
        flops_flash_attention(1, 4, 300, 700, 128, window=64)
    lens = [5, 4096, 77]
    qsl = [0, 2, 4, 6]
    assert flops_paged_attention(lens, qsl, 8, 64) == flops_decode_attention(lens, 2, 8, 64)
    assert bytes_paged_attention(lens, qsl, 8, 2, 64, kv_itemsize=1) == \
        bytes_decode_attention(lens, 2, 8, 2, 64, kv_itemsize=1)
    # an idle request (no rows) adds neither bytes nor FLOPs
    assert bytes_paged_attention(lens + [999], qsl + [6], 8, 2, 64) == \
        bytes_paged_attention(lens, qsl, 8, 2, 64)
    assert flops_paged_attention(lens + [999], qsl + [6], 8, 64) == \
        flops_paged_attention(lens, qsl, 8, 64)
    # window 100 over a 10-row chunk at the end of 1000 keys: keys 891..999
    kv = bytes_paged_attention([1000], [0, 10], 1, 1, 1, q_itemsize=0, window=100)
    assert kv == 2 * 109 * 2


# --------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches(tgt, seed):
    rng = np.random.default_rng(100 + seed)
    Hq, Hkv, d = [(4, 1, 64), (8, 2, 128), (4, 4, 64), (8, 1, 128), (2, 1, 64), (16, 2, 64)][seed]
    b = random_batch(rng, Hq=Hq, Hkv=Hkv, d=d, junk=["mixed", "oob", "nan", "neg"][seed % 4])
    _run(b)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_with_options(tgt, seed):
    """Random batches with a random mix of window, soft-cap, sinks, scale and an FP8 cache."""
    rng = np.random.default_rng(200 + seed)
    Hkv = int(rng.choice([1, 2]))
    Hq = Hkv * int(rng.choice([1, 4, 8]))
    fp8 = bool(rng.random() < 0.5)
    b = random_batch(rng, Hq=Hq, Hkv=Hkv, d=int(rng.choice([64, 128])), max_chunk=150,
                     max_prefix=300, kv_dtype=FP8[tgt] if fp8 else BF16)
    kw = {}
    if rng.random() < 0.5:
        kw["window"] = int(rng.integers(1, 200))
    if rng.random() < 0.5:
        kw["softcap"] = float(rng.uniform(5, 30))
    if rng.random() < 0.5:
        kw["sinks"] = rng.uniform(-2, 3, Hq).astype(np.float32)
    if rng.random() < 0.3:
        kw["scale"] = float(rng.uniform(0.05, 0.2))
    if fp8:
        kw["k_scale"] = rng.uniform(0.5, 2, Hkv) if rng.random() < 0.5 else 0.7
        kw["v_scale"] = float(rng.uniform(0.5, 2))
    _run(b, **kw)


def test_every_draft_length_and_a_chunk(tgt):
    """q_len 1..8 (each a decode class of its own) and a 9-row chunk in one step, block 16."""
    rng = np.random.default_rng(21)
    q_lens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = build(rng, q_lens, [n + 37 * n for n in q_lens], 8, 2, 64, 16)
    _run(b, window=50)


def test_decode_path_row_limit(tgt):
    """G = 32 query heads per KV head: q_len 4 fills 128 rows (decode path), q_len 5 and 8 do not
    (chunk path), next to a decode and a 9-row chunk."""
    rng = np.random.default_rng(22)
    b = build(rng, [4, 5, 1, 8, 9], [90, 200, 33, 8, 300], 32, 1, 64, 32)
    _run(b, sinks=np.linspace(-1, 1, 32).astype(np.float32))


def test_chunk_over_more_keys_than_sbuf_holds(tgt):
    """d = 256, FP8 pages: 9000 keys exceed the keys one pass keeps resident on Trn3 (4096)."""
    rng = np.random.default_rng(23)
    b = build(rng, [40, 1], [9000, 700], 2, 1, 256, 64, kv_dtype=FP8[tgt])
    _run(b, k_scale=0.5, v_scale=0.25)


def test_lnc2(tgt):
    rng = np.random.default_rng(24)
    b = build(rng, [1, 1, 130, 3], [2000, 5, 400, 90], 8, 2, 64, 32)
    sinks = np.array([0.0, 1.0, -2.0, 0.5] * 2, np.float32)
    o2, l2 = _run(b, lnc=2, sinks=sinks)
    o1, l1 = _run(b, lnc=1, sinks=sinks)
    np.testing.assert_allclose(_f(o2), _f(o1), atol=2e-2, rtol=0)


def test_decode_attention_takes_the_plan(tgt):
    """decode_attention(plan=) with the step's plan of a decode batch equals the plan-free call;
    a plan holding a chunk, or of other lengths, is refused."""
    from nki_kernels import decode_attention
    rng = np.random.default_rng(25)
    s_q, lens = 2, [2, 77, 300]
    b = build(rng, [s_q] * 3, lens, 8, 2, 64, 16)
    q4 = b.q.reshape(3, s_q, 8, 64)
    plan = plan_paged_attention(b.seq_lens, b.query_start_loc, 16, 8, 2, 64)
    kw = dict(block_table=b.block_table, return_lse=True)
    o1, l1 = decode_attention(q4, b.k_cache, b.v_cache, b.seq_lens, plan=plan, **kw)
    o0, l0 = decode_attention(q4, b.k_cache, b.v_cache, b.seq_lens, **kw)
    np.testing.assert_array_equal(_f(o1), _f(o0))
    np.testing.assert_array_equal(l1, l0)
    mixed = plan_paged_attention([2, 77, 300], [0, 2, 4, 40], 16, 8, 2, 64)
    other = plan_paged_attention([2, 78, 300], [0, 2, 4, 6], 16, 8, 2, 64)
    for bad in (mixed, other):
        with pytest.raises(ValueError, match=r"decode_attention.*plan"):
            decode_attention(q4, b.k_cache, b.v_cache, b.seq_lens, plan=bad, **kw)


def test_every_kind_in_one_batch(tgt):
    """Idle, empty, decode, drafts, a fresh chunk and a chunk over a prefix, in that order, with
    block 16 (many pages per request)."""
    rng = np.random.default_rng(7)
    b = build(rng, [0, 0, 1, 5, 130, 70, 1], [90, 0, 1, 300, 130, 270, 513], 8, 2, 64, 16)
    _run(b)


def test_single_prefill_matches_flash(tgt):
    """One request whose whole prompt is the chunk = a causal prefill: matches flash_attention
    on the same (dense) data."""
    from nki_kernels import flash_attention
    rng = np.random.default_rng(8)
    S, Hq, Hkv, d = 300, 4, 1, 128
    b = build(rng, [S], [S], Hq, Hkv, d, 64)
    o, lse = _run(b)
    qf = b.q.transpose(1, 0, 2)[None]
    kf, vf = b.k[0].transpose(1, 0, 2)[None], b.v[0].transpose(1, 0, 2)[None]
    of, lf = flash_attention(qf, kf, vf, causal=True, return_lse=True)
    exact, el = flash_attention_ref(qf, kf, vf, compute_dtype=np.float64, return_lse=True)
    assert_attention_close(o.transpose(1, 0, 2)[None], of, exact, what="paged vs flash")
    assert_attention_close(lse.T[None], lf, el, what="paged vs flash lse")


@pytest.mark.parametrize("bs, d", [(64, 128), (16, 256), (8, 64)])
def test_chunk_kT_straight_from_pages(tgt, bs, d):
    """A chunk with a q-dtype cache takes K^T straight from its pages: one DMA transpose per page
    (and 128 rows of d) reading the cache, in the hardware DGE's 4-D form for pages of 16 keys or
    more (the static 2-D form for 8-key pages), no staged copy of K; its V pages are hardware-DGE
    DMAs triggered from ScalarE; the last Q^T batch stores each q-tile alone (docs/attention.md,
    "Where the time goes")."""
    from nki_kernels.emulator.trace import trace
    rng = np.random.default_rng(31)
    Hq, L, S = 2, 300, 384                       # 3 q-tiles per head; S a multiple of every bs
    b = build(rng, [L], [S], Hq, 1, d, bs)
    with trace() as t:
        _run(b)
    DT, pages = -(-d // 128), S // bs
    page_kT = [i for i in t if i.opcode == "dma_transpose" and not i.reads[0].on_chip
               and i.reads[0].shape[0] == min(bs, 16)]
    assert len(page_kT) == pages * DT, len(page_kT)
    assert all(i.attrs["dge"] == ("hwdge" if bs >= 16 else "unknown") for i in page_kT)
    k_copies = [i for i in t if i.opcode == "dma_copy" and not i.reads[0].on_chip
                and i.writes[0].on_chip and i.writes[0].shape == (bs, d)]
    assert len(k_copies) == pages                # V only: K is never staged
    assert all(i.attrs["dge"] == "hwdge" and i.attrs["issuer"] == "scalar" for i in k_copies)
    stores = [i for i in t if i.opcode == "dma_copy" and not i.writes[0].on_chip
              and i.writes[0].dtype == "bfloat16" and i.writes[0].shape[-1] == d]
    assert len(stores) == 2 + 3, len(stores)     # head 0: 2 full tiles + the ragged one; head 1:
                                                 # one per q-tile


@pytest.mark.parametrize("fp8", [False, True])
def test_chunk_band_mask_by_matmul_and_fp8_v_in_pv(tgt, fp8):
    """Chunk rows (causal, no window or soft-cap) mask each q-tile's diagonal band by one matmul of
    the identity with the 0 / -big bias tile, accumulated onto the scores: no range_select, no
    row-bound iotas; a q-tile of one block divides its PV result straight out of PSUM (no o copy
    to SBUF). FP8 pages: V goes into PV as FP8 (no cast of V); K is cast to bf16 by the DMA, one
    software-DGE HBM -> HBM copy per page into a staging, and K^T comes from one hardware-DGE
    transpose per 128-key tile of that staging, not from SBUF: no engine casts K
    (docs/attention.md, "Paged attention", "Where the time goes")."""
    from nki_kernels.emulator.trace import trace
    rng = np.random.default_rng(32)
    Hq, L, S, d = 2, 300, 384, 128               # 3 q-tiles per head, one block each
    kw = dict(kv_dtype=FP8[tgt]) if fp8 else {}
    b = build(rng, [L], [S], Hq, 1, d, 64, **kw)
    scales = dict(k_scale=0.05, v_scale=0.05) if fp8 else {}
    with trace() as t:
        _run(b, **scales)
    assert not [i for i in t if i.opcode in ("range_select", "iota")]
    bias = [i for i in t if i.opcode == "affine_select"]
    assert len(bias) == 1
    band = [i for i in t if i.opcode == "nc_matmul" and i.reads[1].alloc == bias[0].writes[0].alloc]
    assert len(band) == 3 * Hq, len(band)        # one band per q-tile and head
    assert all(i.attrs["accumulate"] for i in band)
    o_copies = [i for i in t if i.opcode == "tensor_copy" and i.reads[0].buffer == "psum"
                and i.reads[0].shape[-1] == d + 1]
    assert not o_copies
    recips = [i for i in t if i.opcode == "reciprocal"]
    assert len(recips) == 3 * Hq and all(i.reads[0].buffer == "psum" for i in recips)
    if fp8:
        pv = [i for i in t if i.opcode == "nc_matmul" and i.reads[1].shape[-1] == d + 1]
        assert pv and all(i.attrs["mov_dtype"] == np.dtype(FP8[tgt]).name for i in pv)
        casts = [i for i in t if i.opcode == "dma_copy" and not i.reads[0].on_chip
                 and not i.writes[0].on_chip and i.reads[0].dtype != i.writes[0].dtype]
        assert len(casts) == S // 64 and all(i.attrs["dge"] == "swdge" for i in casts)
        staging = casts[0].writes[0].alloc
        assert all(i.writes[0].alloc == staging for i in casts)
        kT = [i for i in t if i.opcode == "dma_transpose"
              and any(r.alloc == staging for r in i.reads)]
        assert len(kT) == S // 128 and all(i.attrs["dge"] == "hwdge" for i in kT)
        assert not [i for i in t if i.opcode == "dma_transpose" and i.reads[0].on_chip
                    and i.reads[0].shape[0] == 16]
        assert not [i for i in t if i.opcode == "tensor_copy" and i.engine == "gpsimd"]


def test_decodes_match_decode_attention(tgt):
    """A batch of decodes (s_q = 1, then s_q = 3 drafts) = decode_attention on the same paged
    cache and table."""
    from nki_kernels import decode_attention
    rng = np.random.default_rng(9)
    for s_q, lens in ((1, [1, 64, 65, 400]), (3, [3, 100, 257])):
        b = build(rng, [s_q] * len(lens), lens, 8, 2, 128, 32)
        o, lse = _run(b, sinks=np.linspace(-2, 2, 8))
        R = len(lens)
        od, ld = decode_attention(b.q.reshape(R, s_q, 8, 128), b.k_cache, b.v_cache, b.seq_lens,
                                  block_table=b.block_table, sinks=np.linspace(-2, 2, 8),
                                  return_lse=True)
        exact, el = decode_attention_ref(b.q.reshape(R, s_q, 8, 128), b.k_cache, b.v_cache,
                                         b.seq_lens, block_table=b.block_table,
                                         sinks=np.linspace(-2, 2, 8), compute_dtype=np.float64,
                                         return_lse=True)
        assert_attention_close(o.reshape(od.shape), od, exact, what="paged vs decode")
        assert_attention_close(lse.reshape(ld.shape), ld, el, what="paged vs decode lse")


@pytest.mark.parametrize("prefix", [0, 64, 200])
def test_prefix_plus_chunk_equals_full_prefill(tgt, prefix):
    """A chunk over a cached prefix gives the last rows of the whole prompt's prefill."""
    from nki_kernels import flash_attention
    rng = np.random.default_rng(10 + prefix)
    S, Hq, Hkv, d = 330, 4, 1, 64
    full = build(rng, [S], [S], Hq, Hkv, d, 32)
    b = build(rng, [S - prefix], [S], Hq, Hkv, d, 32)
    b.q[:] = full.q[prefix:]
    b.k_cache, b.v_cache, b.block_table = full.k_cache, full.v_cache, full.block_table
    b.k, b.v = full.k, full.v
    o, _ = _run(b)
    qf = full.q.transpose(1, 0, 2)[None]
    kf, vf = full.k[0].transpose(1, 0, 2)[None], full.v[0].transpose(1, 0, 2)[None]
    of = flash_attention(qf, kf, vf, causal=True)[0, :, prefix:].transpose(1, 0, 2)
    exact = flash_attention_ref(qf, kf, vf, compute_dtype=np.float64)[0, :, prefix:]
    assert_attention_close(o, of, exact.transpose(1, 0, 2), what="chunk vs full prefill")


@pytest.mark.parametrize("Hq,Hkv", [(8, 1), (8, 2), (2, 2), (16, 4)])
def test_gqa(tgt, Hq, Hkv):
    rng = np.random.default_rng(Hq * 10 + Hkv)
    b = build(rng, [1, 20, 2, 0], [100, 150, 9, 40], Hq, Hkv, 64, 16)
    _run(b)


@pytest.mark.parametrize("window", [1, 5, 64, 1000])
def test_window(tgt, window):
    """Windows smaller than a draft group, than a chunk, than a page, and larger than the batch."""
    rng = np.random.default_rng(window)
    b = build(rng, [1, 8, 150, 1], [300, 40, 350, 1], 4, 1, 64, 32)
    _run(b, window=window)


def test_softcap_sinks(tgt):
    rng = np.random.default_rng(11)
    b = build(rng, [1, 4, 90], [200, 60, 290], 8, 2, 64, 64, q_scale=3.0)
    _run(b, softcap=20.0, sinks=np.linspace(-1, 3, 8).astype(np.float32))


def test_sinks_dominate(tgt):
    """Sinks far above every logit: the rows' weights all but vanish (o ~ 0, lse ~ sink)."""
    rng = np.random.default_rng(12)
    b = build(rng, [1, 40], [70, 100], 4, 1, 64, 16)
    _run(b, sinks=np.full(4, 30.0, np.float32))


def test_huge_logits_scale(tgt):
    rng = np.random.default_rng(13)
    b = build(rng, [1, 60], [260, 130], 4, 1, 64, 16, q_scale=60.0, kv_scale=3.0)
    _run(b, scale=1.0)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_head_dims(tgt, d):
    rng = np.random.default_rng(d)
    b = build(rng, [2, 70], [130, 100], 2, 1, d, 64)
    _run(b)


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_cache(tgt, per_head):
    """FP8 K/V (the target's format) at the format's largest magnitude in places, per-tensor or
    per-head scales, decodes and a chunk."""
    f8 = FP8[tgt]
    lim = float(ml_dtypes.finfo(f8).max)
    rng = np.random.default_rng(14)
    b = build(rng, [1, 3, 100], [300, 3, 180], 8, 2, 128, 32, kv_dtype=f8)
    for cache in (b.k_cache, b.v_cache):
        p = b.block_table[0, 0]
        cache[p, :20:7] = np.asarray(lim if cache is b.k_cache else -lim, np.float32).astype(f8)
    ks = np.array([0.004, 0.02]) if per_head else 0.01
    vs = np.array([0.5, 0.002]) if per_head else 0.003
    _run(b, k_scale=ks, v_scale=vs)


def test_fp16(tgt):
    rng = np.random.default_rng(15)
    b = build(rng, [1, 30], [50, 30], 4, 1, 64, 16, q_dtype=np.float16, kv_dtype=np.float16)
    _run(b)


def test_views_lists_and_torch(rng):
    """Non-contiguous q and block-table views, lengths as lists; CPU torch tensors in, torch out."""
    torch = pytest.importorskip("torch")
    b = build(rng, [1, 0, 50, 3], [64, 10, 128, 99], 4, 1, 64, 32)
    (e, _), (s, _) = _ref(b)
    wide = np.full((b.block_table.shape[0], 2 * b.block_table.shape[1]), 10 ** 6, np.int32)
    wide[:, ::2] = b.block_table
    qbig = np.zeros(b.q.shape[:2] + (128,), b.q.dtype)
    qbig[..., 3:67] = b.q
    o = paged_attention(qbig[..., 3:67], b.k_cache, b.v_cache, wide[:, ::2], list(b.seq_lens),
                        list(b.query_start_loc))
    assert_attention_close(o, s, e)

    def t(x):
        return torch.from_numpy(_f(x)).to(torch.bfloat16)
    o = paged_attention(t(b.q), t(b.k_cache), t(b.v_cache), torch.from_numpy(b.block_table),
                        torch.from_numpy(b.seq_lens), torch.from_numpy(b.query_start_loc))
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16
    assert_attention_close(o.float().numpy(), s, e)


def test_plan_reuse_across_layers(tgt):
    """One plan, two layers (different q / K / V, same lengths and pages): each layer equals its
    plan-free call and the reference."""
    q_lens, lens = [1, 0, 6, 120], [210, 33, 6, 300]
    layers = [build(np.random.default_rng(s), q_lens, lens, 8, 2, 64, 32) for s in (1, 2)]
    layers[1].block_table[:] = layers[0].block_table          # the step's one table
    b0, b1 = layers
    b1.k_cache, b1.v_cache = _repage(b0, b1.k), _repage(b0, b1.v)
    plan = plan_paged_attention(b0.seq_lens, b0.query_start_loc, 32, 8, 2, 64)
    for b in (b0, b1):
        with_plan = _run(b, plan=plan)
        without = paged_attention(*b.args, return_lse=True)
        np.testing.assert_array_equal(_f(with_plan[0]), _f(without[0]))
        np.testing.assert_array_equal(with_plan[1], without[1])


def _repage(b, dense):
    """``dense`` per-request arrays written into the pages of ``b``'s table (NaN elsewhere)."""
    c = np.full(b.k_cache.shape, np.nan, np.float32).astype(b.k_cache.dtype)
    bs = b.block_size
    for r, x in enumerate(dense):
        for n in range(-(-len(x) // bs)):
            m = min(bs, len(x) - n * bs)
            c[b.block_table[r, n], :m] = x[n * bs:n * bs + m]
    return c


@pytest.mark.parametrize("change", ["seq_lens", "query_start_loc", "block_size", "heads",
                                    "head_dim", "window"])
def test_mismatched_plan_refused(tgt, change):
    rng = np.random.default_rng(17)
    b = build(rng, [1, 50], [100, 60], 4, 1, 64, 16)
    a = dict(seq_lens=b.seq_lens, query_start_loc=b.query_start_loc, block_size=16,
             num_q_heads=4, num_kv_heads=1, head_dim=64)
    kw = {}
    if change == "seq_lens":
        a["seq_lens"] = b.seq_lens + 1
    elif change == "query_start_loc":
        a["query_start_loc"] = np.array([0, 2, 51])
        a["seq_lens"] = np.array([101, 60])
    elif change == "block_size":
        a["block_size"] = 32
    elif change == "heads":
        a["num_q_heads"], a["num_kv_heads"] = 8, 2
    elif change == "head_dim":
        a["head_dim"] = 128
    else:
        kw["window"] = 16
    plan = plan_paged_attention(a.pop("seq_lens"), a.pop("query_start_loc"), a.pop("block_size"),
                                a.pop("num_q_heads"), a.pop("num_kv_heads"), a.pop("head_dim"),
                                **kw)
    with pytest.raises(ValueError, match=rf"{OP}.*plan"):
        paged_attention(*b.args, plan=plan)


# ------------------------------------------------------------------------------ refusals


def _bad():
    rng = np.random.default_rng(18)
    return build(rng, [1, 30], [40, 30], 4, 1, 64, 16, spare=1)


def _call(b, **over):
    a = dict(zip(("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc"),
                 b.args))
    a.update(over)
    kw = {k: a.pop(k) for k in list(a) if k not in ("q", "k_cache", "v_cache", "block_table",
                                                      "seq_lens", "query_start_loc")}
    return paged_attention(a["q"], a["k_cache"], a["v_cache"], a["block_table"], a["seq_lens"],
                           a["query_start_loc"], **kw)


@pytest.mark.parametrize("qsl", [[0, 31, 30], [0, 1], [0, 1, 30, 31], [1, 2, 31], [0, 1, 29],
                                 [0, 1, 32]],
                         ids=["decreasing", "short", "long", "first-not-0", "last<T", "last>T"])
def test_bad_query_start_loc(tgt, qsl):
    b = _bad()
    lens = np.array([40, 32])            # every q_len <= seq_len, within the table's pages
    with pytest.raises(ValueError, match=rf"{OP}.*query_start_loc"):
        _call(b, query_start_loc=np.array(qsl), seq_lens=lens)


def test_q_len_above_seq_len(tgt):
    b = _bad()
    with pytest.raises(ValueError, match=rf"{OP}.*seq_len"):
        _call(b, seq_lens=np.array([40, 29]))


def test_bad_seq_lens_length(tgt):
    b = _bad()
    with pytest.raises(ValueError, match=rf"{OP}.*seq_lens"):
        _call(b, seq_lens=np.array([40, 30, 5]))


def test_block_table_too_small(tgt):
    b = _bad()
    with pytest.raises(ValueError, match=rf"{OP}.*block.table"):
        _call(b, block_table=b.block_table[:, :2])          # request 0 needs 3 pages of 16
    with pytest.raises(ValueError, match=rf"{OP}.*block.table"):
        _call(b, block_table=b.block_table[:1])              # one row for two requests


@pytest.mark.parametrize("entry", [-1, "num_blocks"])
def test_block_table_entry_out_of_range(tgt, entry):
    b = _bad()
    t = b.block_table.copy()
    t[0, 1] = b.k_cache.shape[0] if entry == "num_blocks" else -1
    with pytest.raises(ValueError, match=rf"{OP}.*block_table"):
        _call(b, block_table=t)


def test_bad_dtypes(tgt):
    b = _bad()
    with pytest.raises(TypeError, match=rf"{OP}.*q"):
        _call(b, q=_f(b.q))
    with pytest.raises(TypeError, match=rf"{OP}.*k_cache"):
        _call(b, k_cache=b.k_cache.astype(np.float16), v_cache=b.v_cache.astype(np.float16))
    with pytest.raises(TypeError, match=rf"{OP}.*v_cache"):
        _call(b, v_cache=b.v_cache.astype(FP8[tgt]))
    with pytest.raises(TypeError, match=rf"{OP}.*block_table"):
        _call(b, block_table=b.block_table.astype(np.float32))
    with pytest.raises(ValueError, match=rf"{OP}.*k_scale"):
        _call(b, k_scale=0.5)                                 # a scale on a bf16 cache


def test_bad_shapes(tgt):
    b = _bad()
    with pytest.raises(ValueError, match=rf"{OP}.*q"):
        _call(b, q=b.q[None])
    with pytest.raises(ValueError, match=rf"{OP}.*(k_cache|cache's head_dim)"):
        _call(b, k_cache=b.k_cache[..., :32], v_cache=b.v_cache[..., :32])
    two = dict(k_cache=np.concatenate([b.k_cache] * 2, axis=2),
               v_cache=np.concatenate([b.v_cache] * 2, axis=2))
    with pytest.raises(ValueError, match=rf"{OP}"):
        _call(b, q=b.q[:, :3], **two)                        # H_q = 3 over H_kv = 2
    with pytest.raises(ValueError, match=rf"{OP}.*sinks"):
        _call(b, sinks=np.zeros(3, np.float32))


def test_bad_options_and_geometry(tgt):
    b = _bad()
    with pytest.raises(ValueError, match=rf"{OP}.*(T = 0|no tokens)"):
        _call(b, q=b.q[:0], query_start_loc=np.array([0, 0, 0]))
    with pytest.raises(ValueError, match=rf"{OP}.*window"):
        _call(b, window=0)
    with pytest.raises(ValueError, match=rf"{OP}.*lnc"):
        _call(b, lnc=3)
    with pytest.raises(ValueError, match=rf"{OP}.*head_dim"):
        _call(b, q=b.q[..., :48], k_cache=b.k_cache[..., :48], v_cache=b.v_cache[..., :48])
    with pytest.raises(ValueError, match=rf"{OP}.*block_size"):
        _call(b, k_cache=b.k_cache[:, :12], v_cache=b.v_cache[:, :12])
    with pytest.raises(TypeError, match=rf"{OP}.*plan"):
        _call(b, plan={"seq_lens": (40, 30)})


@pytest.mark.parametrize("change", ["kv_dtype", "lnc"])
def test_plan_of_other_options_refused(tgt, change):
    b = _bad()
    kw = {"kv_dtype": FP8[tgt].__name__} if change == "kv_dtype" else {"lnc": 2}
    plan = plan_paged_attention(b.seq_lens, b.query_start_loc, 16, 4, 1, 64, **kw)
    with pytest.raises(ValueError, match=rf"{OP}.*plan"):
        _call(b, plan=plan)


def _bench_rows():
    from nki_kernels.reference.shapes import PAGED_FAST, PAGED_MODELS
    return [pytest.param(x, id=x.name, marks=() if x in PAGED_FAST else pytest.mark.slow)
            for x in PAGED_FAST + PAGED_MODELS]


@pytest.mark.parametrize("shape", _bench_rows())
def test_bench_rows(tgt, shape):
    """The bench's cases (reference/shapes.py PAGED_*), run and checked as ``bench --check``
    does; the bench's compulsory FLOPs / bytes are the reference's."""
    from nki_kernels.bench.defs.paged_attention import paged_case
    c = paged_case(shape, tgt)
    qsl = np.concatenate([[0], np.cumsum(shape.q_lens)])
    assert c.flops == flops_paged_attention(shape.seq_lens, qsl, shape.n_q_heads, shape.head_dim)
    inputs = c.make_inputs(np.random.default_rng(0))
    c.check(inputs, c.run(*inputs))


# ------------------------------------------------------------------------------------ slow


@pytest.mark.slow
def test_big_mixed_batch(tgt):
    """Chunks of 1000 and 2000 over 3K / 0 prefixes among 30 decodes at 1-5K, block 128, d 128."""
    rng = np.random.default_rng(19)
    lens = [int(x) for x in rng.integers(1, 5000, 30)]
    b = build(rng, [1] * 30 + [1000, 2000], lens + [4000, 2000], 8, 2, 128, 128)
    _run(b)


@pytest.mark.slow
def test_long_prefix_window_fp8(tgt):
    rng = np.random.default_rng(20)
    b = build(rng, [300, 1, 1], [9000, 9000, 70], 4, 1, 128, 64, kv_dtype=FP8[tgt])
    _run(b, window=4096, k_scale=0.02, v_scale=0.05)
