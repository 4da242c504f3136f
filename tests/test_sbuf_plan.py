"""The SBUF figure of the qkv_proj and swiglu_mlp plans is exactly what the kernel holds at its
fullest moment, as the emulator measures it (liveness-based allocation: a tensor takes its space
at its first use and gives it back when the kernel drops its last reference).

The plans walk the kernel's own buffers in the kernel's order (``qkv_sbuf``, ``mlp_sbuf`` on an
``SbufLedger``); a kernel edit that adds, resizes or holds a buffer longer without the same edit
to the walk fails here. One case per regime: decode (packed and row-major x), one token block,
several blocks, token and pair lanes, every head_dim, the k-chunked nest (one and several
chunks and super-blocks), with and without each option; bf16 and FP8 (row-major and
tile-major), combined and separate gate/up, one and two yT buffers.

fused_moe's decode plan is an upper bound (``_sbuf_need_decode``) that holds its weight ring:
checked against the measured peak from above, and from below without the ring's entry.
"""
import ml_dtypes
import numpy as np
import pytest

from nki_kernels._limits import SbufLedger, sbuf_budget
from nki_kernels.backend import launch
from nki_kernels.dense.qkv_proj import plan_qkv, qkv_proj, qkv_sbuf
from nki_kernels.dense.swiglu_mlp import mlp_sbuf, plan_mlp, swiglu_mlp, swiglu_mlp_kernel, tile_weight
from nki_kernels.emulator import target

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3

ALL = dict(norm=True, rope=True, bias=True, residual=True)
NONE = dict(norm=False, rope=False, bias=False, residual=False)

# (target, T, H, n_q, n_kv, head_dim, options); options as ALL / NONE plus qk_norm, rotary_dim,
# rope_layout, k_layout
QKV_CASES = {
    "decode packed": ("trn3", 8, 1024, 8, 2, 128, ALL),
    "decode packed, bare": ("trn3", 8, 1024, 8, 2, 128, NONE),
    "decode rows, qk-norm, kT": ("trn3", 100, 1024, 8, 2, 128,
                                 dict(ALL, qk_norm=True, k_layout="transposed")),
    "decode odd H": ("trn2", 40, 1000, 8, 2, 128, ALL),
    "one block, qk-norm": ("trn3", 256, 1024, 8, 2, 128, dict(ALL, qk_norm=True)),
    "one block, norm at eviction, no bias": ("trn3", 128, 1024, 8, 1, 128,
                                             dict(ALL, bias=False)),
    "one block, norm in front (trn2, 128)": ("trn2", 128, 1024, 8, 1, 128, ALL),
    "token + pair lanes, d64, kT": ("trn3", 200, 1024, 8, 2, 64,
                                    dict(ALL, qk_norm=True, k_layout="transposed")),
    "d256, kT": ("trn3", 200, 1024, 4, 2, 256, dict(ALL, qk_norm=True, k_layout="transposed")),
    "partial interleaved rope, odd H": ("trn3", 300, 1000, 8, 2, 128,
                                        dict(ALL, rotary_dim=96, rope_layout="interleaved")),
    "two blocks": ("trn2", 600, 1024, 16, 4, 128, dict(ALL, qk_norm=True)),
    "two blocks, bare": ("trn3", 600, 1024, 16, 4, 128, NONE),
    "k-chunked, one chunk": ("trn3", 600, 512, 8, 2, 128, dict(ALL, qk_norm=True)),
    "k-chunked, bare": ("trn3", 600, 1024, 8, 2, 128, NONE),
    "k-chunked, DMA transposes": ("trn3", 600, 1024, 8, 2, 128, dict(ALL, residual=False)),
    "k-chunked, 2 super-blocks, 2 chunks": ("trn3", 1100, 2048, 8, 2, 128,
                                            dict(ALL, qk_norm=True)),
    "k-chunked, 2 super-blocks, DMA transposes": ("trn2", 1100, 2048, 8, 2, 128,
                                                  dict(ALL, residual=False, qk_norm=True)),
    "k-chunked, 8 chunks, kT": ("trn3", 700, 4096, 8, 2, 128,
                                dict(ALL, qk_norm=True, k_layout="transposed")),
}
# real model shapes (Llama-3-70B TP8: N = 1280, the k-chunked nest at hidden 8192; Llama-3-8B)
QKV_SLOW = {
    "Llama-3-70B TP8 T=600": ("trn3", 600, 8192, 8, 1, 128, ALL),
    "Llama-3-8B T=600": ("trn2", 600, 4096, 32, 8, 128, ALL),
}


def _qkv(rng, T, H, nq, nkv, d, o):
    N = (nq + 2 * nkv) * d
    x = rng.standard_normal((T, H)).astype(BF16)
    w = (rng.standard_normal((H, N)) * 0.05).astype(BF16)
    kw = {}
    if o["residual"]:
        kw["residual"] = rng.standard_normal((T, H)).astype(BF16)
    if o["bias"]:
        kw["bias"] = rng.standard_normal(N).astype(np.float32)
    if o["norm"]:
        kw["norm_weight"] = np.ones(H, np.float32)
    if o["rope"]:
        kw["positions"] = np.arange(T)
        for k in ("rotary_dim", "rope_layout"):
            if k in o:
                kw[k] = o[k]
    if o.get("qk_norm"):
        kw["q_norm_weight"] = kw["k_norm_weight"] = np.ones(d, np.float32)
    if "k_layout" in o:
        kw["k_layout"] = o["k_layout"]
    qkv_proj(x, w, n_q_heads=nq, n_kv_heads=nkv, head_dim=d, **kw)
    rot = o.get("rotary_dim", d) if o["rope"] else 0
    return plan_qkv(T, H, nq, nkv, d, sbuf_budget(), norm=o["norm"], bias=o["bias"],
                    residual=o["residual"], rot=rot, qk_norm=bool(o.get("qk_norm")),
                    k_transposed=o.get("k_layout") == "transposed")


def _check_qkv(rng, sbuf_peak, case):
    tname, T, H, nq, nkv, d, o = case
    with target(tname):
        plan = _qkv(rng, T, H, nq, nkv, d, o)
    assert plan.sbuf_bytes == sbuf_peak()
    assert plan.sbuf_bytes <= sbuf_budget()


@pytest.mark.parametrize("case", QKV_CASES.values(), ids=QKV_CASES.keys())
def test_qkv_plan_is_the_measured_peak(rng, sbuf_peak, case):
    _check_qkv(rng, sbuf_peak, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", QKV_SLOW.values(), ids=QKV_SLOW.keys())
def test_qkv_plan_is_the_measured_peak_slow(rng, sbuf_peak, case):
    _check_qkv(rng, sbuf_peak, case)


def test_qkv_regimes_covered():
    """The cases above do reach the regimes their names claim."""
    def plan(c):
        tname, T, H, nq, nkv, d, _ = c
        with target(tname):
            return plan_qkv(T, H, nq, nkv, d, sbuf_budget())
    assert plan(QKV_CASES["decode packed"]).decode
    assert plan(QKV_CASES["two blocks"]).tb_max < 600 and not plan(QKV_CASES["two blocks"]).kc
    assert plan(QKV_CASES["k-chunked, one chunk"]).kc == 512 // 128
    assert plan(QKV_CASES["k-chunked, 8 chunks, kT"]).kc == 4096 // 128 // 8
    assert plan(QKV_CASES["k-chunked, 2 super-blocks, 2 chunks"]).kc == 2048 // 128 // 2
    assert plan(QKV_CASES["k-chunked, 2 super-blocks, DMA transposes"]).kc == 2048 // 128 // 2


# (target, T, H, I, fp8, tiled, norm and residual)
MLP_CASES = {
    "bf16 decode, combined": ("trn3", 8, 512, 1024, False, False, True),
    "bf16 separate gate/up, bare": ("trn3", 300, 512, 1024, False, False, False),
    "bf16 two blocks": ("trn3", 600, 512, 1024, False, False, True),
    "bf16 odd sizes": ("trn2", 100, 500, 700, False, False, True),
    "bf16 tile-major": ("trn3", 300, 512, 1024, False, True, True),
    "fp8 decode": ("trn3", 8, 512, 1024, True, False, True),
    "fp8 decode, bare": ("trn3", 8, 512, 1024, True, False, False),
    "fp8 combined, 2 sub-tiles": ("trn3", 130, 512, 1024, True, False, True),
    "fp8 two blocks": ("trn2", 600, 512, 1024, True, False, True),
    "fp8 tile-major": ("trn3", 300, 512, 1024, True, True, True),
    "fp8 tile-major, weight ring": ("trn3", 600, 512, 1024, True, True, True),
    "bf16 tile-major, weight ring": ("trn2", 520, 512, 1024, False, True, True),
}


MLP_SLOW = {
    "Llama-3-8B bf16 T=600": ("trn2", 600, 4096, 14336, False, False, True),
    "Llama-3-70B TP8 fp8 tile-major T=600": ("trn3", 600, 8192, 3584, True, True, True),
}


def _mlp_inputs(rng, T, H, I, fp8, tiled, opts):
    x = rng.standard_normal((T, H)).astype(BF16)
    kw = {}
    if opts:
        kw["norm_weight"] = np.ones(H, np.float32)
        kw["residual"] = rng.standard_normal((T, H)).astype(BF16)
    dt = E4M3 if fp8 else BF16
    ws = [(rng.standard_normal(s) * 0.05).astype(dt) for s in ((H, I), (H, I), (I, H))]
    if fp8:
        kw.update(gate_scale=np.ones(I, np.float32), up_scale=np.ones(I, np.float32),
                  down_scale=np.ones(H, np.float32))
    if tiled:
        ws = [tile_weight(w) for w in ws]
    return x, ws, kw


@pytest.mark.parametrize("case", MLP_CASES.values(), ids=MLP_CASES.keys())
def test_mlp_plan_is_the_measured_peak(rng, sbuf_peak, case):
    _check_mlp(rng, sbuf_peak, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", MLP_SLOW.values(), ids=MLP_SLOW.keys())
def test_mlp_plan_is_the_measured_peak_slow(rng, sbuf_peak, case):
    _check_mlp(rng, sbuf_peak, case)


def _check_mlp(rng, sbuf_peak, case):
    tname, T, H, I, fp8, tiled, opts = case
    with target(tname):
        x, ws, kw = _mlp_inputs(rng, T, H, I, fp8, tiled, opts)
        swiglu_mlp(x, *ws, **kw)
        plan = plan_mlp(T, H, I, 1 if fp8 else 2, fp8, sbuf_budget(), tiled, norm=opts,
                        residual=opts)
        assert plan.sbuf_bytes == sbuf_peak()
        assert plan.sbuf_bytes <= sbuf_budget()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_mlp_plan_one_y_buffer(rng, sbuf_peak, fp8):
    """The y epilogue without double buffering (what the plan falls back to when SBUF is short),
    launched with the plan's other choices."""
    T, H, I = 600, 512, 1024
    with target("trn3"):
        x, ws, kw = _mlp_inputs(rng, T, H, I, fp8, False, True)
        p = plan_mlp(T, H, I, 1 if fp8 else 2, fp8, sbuf_budget())
        sc = [kw.get(k) for k in ("gate_scale", "up_scale", "down_scale")]
        launch(swiglu_mlp_kernel, x, *ws, kw["norm_weight"], kw["residual"], *sc, 1e-6,
               p.tb_max, p.combined, p.nf_gu, p.nf_d, p.kb_gu, p.kb_d, False, False)
        led = mlp_sbuf(T, H, I, p.tb_max, p.combined, p.nf_gu, p.nf_d, p.kb_gu, p.kb_d, False,
                       fp8)
        assert led.peak == sbuf_peak()


def test_ledger():
    led = SbufLedger()
    led.take("a", 100)
    led.take("b", 50)
    led.drop("a")
    led.take("c", 60)
    assert led.peak == 150 and led.at == {"a": 100, "b": 50}
    assert sum(led.live.values()) == 110
    with pytest.raises(KeyError):
        led.take("b", 1)


def test_plans_count_what_they_run():
    """The plan's figure is the walk of its own choices (one source: no separate sum)."""
    with target("trn3"):
        b = sbuf_budget()
    p = plan_qkv(2048, 8192, 8, 1, 128, b)
    # no residual given: the plan bounds both ways (the k-chunked nest's rings without one)
    assert p.sbuf_bytes == max(qkv_sbuf(2048, 8192, 8, 1, 128, p.tb_max, p.nf_max, p.kb, p.kc,
                                        p.ts_max, qk_norm=True, k_transposed=True,
                                        residual=r).peak for r in (True, False))
    m = plan_mlp(2048, 4096, 14336, 2, False, b)
    assert m.sbuf_bytes == mlp_sbuf(2048, 4096, 14336, m.tb_max, m.combined, m.nf_gu, m.nf_d,
                                    m.kb_gu, m.kb_d, m.y_pipe).peak


# fused_moe decode (bf16 / FP8): its plan is an upper bound (``_sbuf_need_decode``), not a walk;
# with FP8 weights it holds the weight ring of the routed loop (``plan_decode_ring``; bf16 keeps
# fresh tiles). (target, T, H, I, E, k, fp8, shared expert width)
MOE_DECODE_CASES = {
    "fp8, Qwen3-30B-A3B widths": ("trn3", 8, 2048, 768, 4, 2, True, 0),
    "fp8, shared expert": ("trn2", 8, 2048, 768, 4, 2, True, 256),
    "bf16": ("trn3", 8, 1024, 512, 4, 2, False, 0),
    "bf16, shared expert": ("trn2", 20, 1024, 512, 4, 2, False, 256),
}


def _moe_decode(rng, T, H, I, E, k, fp8, Is, fp8_dtype):
    from nki_kernels.moe.fused_moe import fused_moe
    from nki_kernels.reference.swiglu_mlp import quantize_fp8_per_channel
    x = rng.standard_normal((T, H)).astype(BF16)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    w = np.full((T, k), 1.0 / k, np.float32)
    ws = [rng.standard_normal((n, a, b)).astype(np.float32) * 0.05
          for n, a, b in ((E, H, 2 * I), (E, I, H), (1, H, 2 * Is), (1, Is, H))[:4 if Is else 2]]
    kw = {}
    if fp8:
        q = [[quantize_fp8_per_channel(m, fp8_dtype) for m in a] for a in ws]
        ws = [np.stack([m for m, _ in a]) for a in q]
        sc = [np.stack([s for _, s in a]) for a in q]
        kw.update(gate_up_scale=sc[0], down_scale=sc[1])
        if Is:
            kw["shared_scales"] = (sc[2][0], sc[3][0])
    else:
        ws = [a.astype(BF16) for a in ws]
    if Is:
        kw["shared"] = (ws[2][0], ws[3][0])
    fused_moe(x, ws[0], ws[1], w, ids, regime="decode", **kw)
    return min(E, T * k)


@pytest.mark.parametrize("case", MOE_DECODE_CASES.values(), ids=MOE_DECODE_CASES.keys())
def test_moe_decode_plan_holds_the_ring(rng, sbuf_peak, case):
    """The decode bound is at least the measured peak, and (FP8) it is so only with the weight
    ring's entry: the bound with a fresh tile per transfer in its place (``ring`` 0, what the
    kernel held before the ring) is below the measured peak. Dropping the ring from the bound,
    or the ring from the kernel, fails here. bf16 plans no ring."""
    from nki_kernels.moe.fused_moe import (
        DECODE_RING,
        _sbuf_need_decode,
        plan_decode_ring,
        plan_tiles,
    )
    tname, T, H, I, E, k, fp8, Is = case
    wb = 1 if fp8 else 2
    with target(tname):
        S = _moe_decode(rng, T, H, I, E, k, fp8, Is,
                        ml_dtypes.float8_e4m3fn if tname == "trn3" else E4M3)
        plan = plan_tiles("decode", T, H, I, wb, False)
        budget = sbuf_budget()
        ring = plan_decode_ring(T, H, I, S, wb, fp8, plan, budget, Is)
        assert ring == (DECODE_RING if fp8 else 0)
        need = _sbuf_need_decode(T, H, I, S, wb, fp8, plan, ring, Is)
        peak = sbuf_peak()
        assert peak <= need <= budget
        if fp8:
            assert _sbuf_need_decode(T, H, I, S, wb, fp8, plan, 0, Is) < peak


def test_moe_decode_plan_shrinks_the_ring():
    """A budget that the ring does not fit takes fewer slots, then fresh tiles (FP8; DeepSeek-V3
    EP8 widths)."""
    from nki_kernels.moe.fused_moe import (
        DECODE_RING,
        _sbuf_need_decode,
        plan_decode_ring,
        plan_tiles,
    )
    T, H, I, S = 64, 7168, 2048, 32
    plan = plan_tiles("decode", T, H, I, 1, False)
    need = [_sbuf_need_decode(T, H, I, S, 1, True, plan, r) for r in range(DECODE_RING + 1)]
    assert plan_decode_ring(T, H, I, S, 1, True, plan, need[DECODE_RING]) == DECODE_RING
    assert plan_decode_ring(T, H, I, S, 1, True, plan, need[DECODE_RING] - 1) == DECODE_RING - 1
    assert plan_decode_ring(T, H, I, S, 1, True, plan, need[2] - 1) == 0
    assert plan_decode_ring(T, H, I, S, 2, False, plan_tiles("decode", T, H, I, 2, False),
                            1 << 30) == 0       # bf16: fresh tiles
