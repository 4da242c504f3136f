"""``nki-kernels bench --vs-nkilib PATH`` (bench/vs_nkilib.py): our kernels beside NKI Library's.

The default tests need no NKI Library checkout: PATH errors, the host layout adapters (ours ->
theirs -> ours), the row / table / JSON format, and that a side whose output fails the check
(or that has no equivalent, or does not import) posts no time. ``test_real_pairs`` runs real
pairs against a checkout named by ``NKILIB_PATH`` (slow; skipped otherwise).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import ml_dtypes
import numpy as np
import pytest

from nki_kernels import cli
from nki_kernels.bench import harness
from nki_kernels.bench import vs_nkilib as V
from nki_kernels.bench.defs import BenchCase

BF16 = np.dtype(ml_dtypes.bfloat16)


# ------------------------------------------------------------------------------ PATH


def _checkout(tmp_path):
    core = tmp_path / "nki-library" / "src" / "nkilib_src" / "nkilib" / "core"
    core.mkdir(parents=True)
    for d in (core.parent.parent, core.parent, core):
        (d / "__init__.py").write_text("")
    return tmp_path / "nki-library"


@pytest.mark.parametrize("kind", ["missing", "file", "empty"])
def test_bad_path_is_a_clear_error(tmp_path, kind):
    p = tmp_path / "x"
    if kind == "file":
        p.write_text("")
    elif kind == "empty":
        p.mkdir()
    with pytest.raises(harness.BenchError) as e:
        V.find_nkilib(p)
    msg = str(e.value)
    assert "--vs-nkilib PATH" in msg and str(p) in msg
    assert "src/nkilib_src/nkilib/core" in msg and "expected a checkout" in msg


def test_cli_bad_path_exits_2(tmp_path, capsys):
    rc = cli.main(["bench", "--vs-nkilib", str(tmp_path / "nope"), "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--vs-nkilib PATH" in err and "nope" in err


def test_checkout_and_installed_package_are_found(tmp_path):
    lib = V.find_nkilib(_checkout(tmp_path))
    assert lib.kind == "checkout" and lib.prefix == "nkilib_src.nkilib"
    assert lib.sys_path == (tmp_path / "nki-library" / "src").resolve()
    pkg = tmp_path / "site" / "nkilib"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    inst = V.find_nkilib(pkg)
    assert inst.kind == "installed" and inst.prefix == "nkilib"


def test_unparsable_module_is_unavailable_not_a_crash(tmp_path, monkeypatch):
    root = _checkout(tmp_path)
    bad = root / "src" / "nkilib_src" / "nkilib" / "core" / "broken.py"
    bad.write_text("def f(:\n")
    lib = V.find_nkilib(root)
    monkeypatch.setattr(V, "_standins", [True])          # no emulator install in this process
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    try:
        with pytest.raises(V.Unavailable, match="does not parse.*own bug"):
            V.load(lib, "core.broken")
        with pytest.raises(V.Unavailable, match="failed to import"):
            V.load(lib, "core.absent")
    finally:                        # the toy package must not shadow a real one later
        for name in set(sys.modules) - before:
            if name.startswith("nkilib_src"):
                del sys.modules[name]


def test_unknown_op_is_refused():
    with pytest.raises(harness.BenchError, match="no NKI Library pair for op 'matmul'"):
        V.select(["matmul"], "default", "trn2")


# ------------------------------------------------------------------------------ adapters


def test_rmsnorm_adapters_round_trip():
    rng = np.random.default_rng(0)
    T, H = 5, 256
    q = rng.standard_normal((T, H)).astype(ml_dtypes.float8_e4m3)
    s = rng.uniform(0.01, 1.0, (T, 1)).astype(np.float32)
    theirs = V.rmsnorm_to_ours_layout(q, s)
    assert theirs.shape == (1, T, H + 4) and theirs.dtype == q.dtype
    q2, s2 = V.rmsnorm_from_theirs(theirs, T, H)
    np.testing.assert_array_equal(q2.view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(s2, s)
    x = rng.standard_normal((T, H)).astype(BF16)
    g = rng.standard_normal(H).astype(BF16)
    h1, g1 = V.rmsnorm_to_theirs(x, g, 1)
    h2, g2 = V.rmsnorm_to_theirs(x, g, 2)
    assert h1.shape == (1, T, H) and g1.shape == (H,) and g2.shape == (1, H)
    np.testing.assert_array_equal(h2.reshape(T, H).view(np.uint16), x.view(np.uint16))


def test_mlp_adapters_untile_and_scales():
    from nki_kernels.dense.swiglu_mlp import tile_weight
    rng = np.random.default_rng(1)
    T, H, I = 3, 256, 384
    x = rng.standard_normal((T, H)).astype(BF16)
    ws = [rng.standard_normal(sh).astype(ml_dtypes.float8_e4m3) for sh in ((H, I), (H, I), (I, H))]
    sc = [rng.uniform(0.1, 1, n).astype(np.float32) for n in (I, I, H)]
    inputs = (x, np.ones(H, np.float32), *[tile_weight(w) for w in ws], *sc)
    got_w, got_s = V.mlp_weights_to_theirs(inputs, I)
    for a, b in zip(got_w, ws):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    for a, b in zip(got_s, sc):
        assert a.shape == (128, b.size)
        np.testing.assert_array_equal(a, np.broadcast_to(b, a.shape))
    out = rng.standard_normal((1, T, H)).astype(BF16)
    y = V.mlp_from_theirs([out], x)
    np.testing.assert_allclose(y.astype(np.float32), (out[0].astype(np.float32)
                                                      + x.astype(np.float32)), rtol=1e-2)


def test_qkv_adapters_round_trip():
    from nki_kernels.reference.qkv_proj import rope_tables
    rng = np.random.default_rng(2)
    T, nq, nkv, d = 4, 4, 2, 8
    q, k, v = (rng.standard_normal((n, T, d)).astype(np.float32) for n in (nq, nkv, nkv))
    r = V.qkv_from_theirs(V.qkv_to_theirs_output(q, k, v), T, nq, nkv, d)
    for a, b in ((r.q, q), (r.k, k), (r.v, v)):
        np.testing.assert_array_equal(a, b)
    cos, sin = V.rope_caches_to_theirs(np.arange(T), d, 500000.0)
    c0, s0 = rope_tables(np.arange(T), d, 500000.0)
    assert cos.shape == (1, T, d)
    np.testing.assert_array_equal(cos[0, :, :d // 2], c0)
    np.testing.assert_array_equal(sin[0, :, d // 2:], s0)


def test_attention_adapters_layout_and_gqa():
    rng = np.random.default_rng(3)
    B, Hq, Hkv, S, d = 2, 4, 2, 6, 8
    q = rng.standard_normal((B, Hq, S, d)).astype(BF16)
    k = rng.standard_normal((B, Hkv, S, d)).astype(BF16)
    v = rng.standard_normal((B, Hkv, S, d)).astype(BF16)
    qf, kf, vf = V.attention_to_theirs(q, k, v, None)
    assert qf.shape == (B * Hq, S, d) and kf.shape == (B * Hkv, d, S) and vf.shape == (B * Hkv, S, d)
    g = Hq // Hkv
    for b in range(B):
        for h in range(Hq):
            kb = (b * Hq + h) // g             # their GQA mapping of the flattened q batch
            np.testing.assert_array_equal(kf[kb].T.view(np.uint16), k[b, h // g].view(np.uint16))
            np.testing.assert_array_equal(vf[kb].view(np.uint16), v[b, h // g].view(np.uint16))
    np.testing.assert_array_equal(V.attention_from_theirs(qf, B, Hq).view(np.uint16),
                                  q.view(np.uint16))
    q2, _, _ = V.attention_to_theirs(q, k, v, 0.25)   # a power of two: exact in bf16
    np.testing.assert_array_equal(q2.astype(np.float32), qf.astype(np.float32) * 0.25)


# ------------------------------------------------------------------------------ rows


def _toy_case(check):
    return BenchCase(op="rmsnorm_quant", shape="toy T=4", dims={"T": 4, "H": 128},
                     dtype="bf16->fp8", make_inputs=lambda rng: (np.ones((4, 128), np.float32),),
                     run=lambda x: x, flops=7 * 4 * 128, bytes=4 * 128 * 3, check=check)


def _fake_pair(theirs_out, *, their_error=None, variants=("",)):
    def ours(case, lnc):
        return case.run

    def theirs(lib, case, inputs, lnc, variant=""):
        if their_error is not None:
            raise their_error
        return V.Launch.one("fake_kernel", None, (), {}, lambda out: out)
    return V.Pair("rmsnorm_quant", "core/rmsnorm", (1, 2), ours, theirs, variants), theirs_out


def _rows(monkeypatch, pair, theirs_out, check, lnc=1):
    def ours_modeled(case, target, inputs):
        return {"time_ns": 2000.0, "engine_busy_ns": {"vector": 1500.0},
                "binding_engine": "vector", "n_instructions": 9, "outputs": inputs[0]}

    def theirs_modeled(launch, target, lnc):
        return {"time_ns": 5000.0, "engine_busy_ns": {}, "binding_engine": "dma",
                "n_instructions": 3, "outputs": theirs_out}
    monkeypatch.setattr(harness, "run_modeled", ours_modeled)
    monkeypatch.setattr(V, "_modeled_theirs", theirs_modeled)
    return V.run_one(None, pair, _toy_case(check), lnc, "trn2", sha="abc", date="2026-11-25T00:00")


def _check(inputs, out):
    np.testing.assert_allclose(out, inputs[0], err_msg="toy check")


def test_row_format_both_pass(monkeypatch, tmp_path):
    pair, good = _fake_pair(np.ones((4, 128), np.float32))
    (row,) = _rows(monkeypatch, pair, good, _check, lnc=2)
    assert row["kind"] == "vs_nkilib" and row["lnc"] == 2 and row["source"] == "modeled"
    assert row["ours"]["time_us"] == pytest.approx(2.0)
    assert row["nkilib"]["time_us"] == pytest.approx(5.0)
    assert row["ratio_theirs_over_ours"] == pytest.approx(2.5)
    assert row["ours"]["check"] == row["nkilib"]["check"] == "passed"
    assert row["ours"]["pct_roof"] > row["nkilib"]["pct_roof"] > 0
    md = V.markdown_table([row], tier="default")
    assert "| rmsnorm_quant | fake_kernel | toy T=4 | bf16->fp8 | trn2 | 2 | 2.00 | 5.00 |" in md
    assert "| 2.50 | ✓ passed | ✓ passed |" in md and "modeled" in md
    paths = V.write([row], tmp_path, tier="default")
    (back,) = V.rows_from_jsonl(paths["json"])
    assert back["ratio_theirs_over_ours"] == pytest.approx(2.5)
    assert paths["markdown"].name == "vs_nkilib_trn2_default.md"
    assert json.loads(paths["json"].read_text().splitlines()[0])["git_sha"] == "abc"


def test_failing_nkilib_check_posts_no_time(monkeypatch):
    pair, bad = _fake_pair(np.full((4, 128), 3.0, np.float32))
    (row,) = _rows(monkeypatch, pair, bad, _check)
    assert row["ours"]["time_us"] == pytest.approx(2.0)
    assert row["nkilib"]["time_us"] is None and row["nkilib"]["pct_roof"] is None
    assert row["nkilib"]["check"] == "failed"
    assert row["nkilib"]["error"].startswith("wrong result: output differs from the reference")
    assert row["ratio_theirs_over_ours"] is None
    md = V.markdown_table([row])
    line = next(ln for ln in md.splitlines() if ln.startswith("| rmsnorm_quant"))
    assert "| 2.00 | - |" in line and "✗ failed" in line and "5.00" not in line
    assert "NKI Library: wrong result" in md


@pytest.mark.parametrize("exc, cell, prefix", [
    (V.NoEquivalent("no MXFP8 output"), "n/a", "no equivalent: no MXFP8 output"),
    (V.Unavailable("mlp.py does not parse"), "not run", "unavailable: mlp.py does not parse"),
    (AssertionError("head_dim > 128"), "refused", "refused or failed: AssertionError"),
])
def test_no_equivalent_unavailable_refused_post_no_time(monkeypatch, exc, cell, prefix):
    pair, out = _fake_pair(None, their_error=exc)
    (row,) = _rows(monkeypatch, pair, out, _check)
    assert row["nkilib"]["time_us"] is None and row["ratio_theirs_over_ours"] is None
    assert row["nkilib"]["error"].startswith(prefix)
    assert row["ours"]["check"] == "passed"
    assert f"| {cell} |" in V.markdown_table([row])


def test_variants_share_one_run_of_ours(monkeypatch):
    pair, good = _fake_pair(np.ones((4, 128), np.float32), variants=("cte", "tkg"))
    calls = []
    orig = V._side

    def counting(case_l, target, source, inputs, run, **kw):
        calls.append(run.__name__)
        return orig(case_l, target, source, inputs, run, **kw)
    monkeypatch.setattr(V, "_side", counting)
    rows = _rows(monkeypatch, pair, good, _check)
    assert len(rows) == 2 and calls.count("ours_run") == 1
    assert all(r["ratio_theirs_over_ours"] == pytest.approx(2.5) for r in rows)


def test_pairs_select_default_tier_without_a_checkout():
    sel = V.select(None, "default", "trn3")
    ops = {c.op for _, c in sel}
    assert ops == {"rmsnorm_quant", "swiglu_mlp", "qkv_proj", "flash_attention",
                   "decode_attention", "fused_moe"}
    assert all(p.op == c.op for p, c in sel)
    assert V.select(["rmsnorm_quant"], "default", "trn3", shape="llama")[0][1].shape.startswith(
        "llama-3-8b")


# ------------------------------------------------------------------------------ real pairs


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("NKILIB_PATH"), reason="set NKILIB_PATH to a checkout of "
                    "github.com/aws-neuron/nki-library")
@pytest.mark.parametrize("op", ["rmsnorm_quant", "qkv_proj"])
def test_real_pairs(op):
    lib = V.find_nkilib(os.environ["NKILIB_PATH"])
    rows = V.run(lib, [op], "default", "trn2", progress=False, lncs=(1,))
    assert rows
    for r in rows:
        if r["dtype"].endswith("mxfp8"):
            assert r["nkilib"]["error"].startswith("no equivalent")
            continue
        assert r["ours"]["check"] == "passed", r["ours"]
        if r["nkilib"]["error"]:
            assert r["nkilib"]["time_us"] is None
        else:
            assert r["nkilib"]["check"] == "passed"
            assert r["ratio_theirs_over_ours"] == pytest.approx(
                r["nkilib"]["time_us"] / r["ours"]["time_us"])


def test_other_regime_variant_row_is_left_out(monkeypatch):
    def theirs(lib, case, inputs, lnc, variant=""):
        if variant == "tkg":
            raise V.OtherRegime("qkv_tkg serves T <= 96")
        return V.Launch.one("cte_kernel", None, (), {}, lambda out: out)
    pair = V.Pair("rmsnorm_quant", "core/x", (1,), lambda c, n: c.run, theirs, ("cte", "tkg"))
    rows = _rows(monkeypatch, pair, np.ones((4, 128), np.float32), _check)
    assert [r["nkilib_kernel"] for r in rows] == ["cte_kernel"]
    assert "_other_regime" not in rows[0]


def test_cli_refuses_publish_with_vs_nkilib(tmp_path, capsys):
    rc = cli.main(["bench", "--vs-nkilib", str(_checkout(tmp_path)), "--publish", "--quiet"])
    assert rc == 2
    assert "--publish does not apply to --vs-nkilib" in capsys.readouterr().err


def test_measured_stages_add_and_chain(monkeypatch):
    """The --measured path (never run on a device): each stage is timed with its own arrays as
    the NEFF inputs, times add up, and a stage gets the previous stage's output."""
    seen = []

    def fake_measured(case, inputs, **kw):
        seen.append(tuple(inputs))
        case.run(*inputs)
        return {"time_ns": 1000.0}
    monkeypatch.setattr(harness, "run_measured", fake_measured)
    x = np.arange(4.0)
    launch = V.Launch("two", [V.Stage(lambda a: a + 1, lambda _p: ((x,), {})),
                              V.Stage(lambda a, s=1: a * s, lambda p: ((p,), {"s": 3}))],
                      lambda out: out)
    res, out = V._measured_theirs(launch, _toy_case(None), 1)
    assert res["time_ns"] == 2000.0
    np.testing.assert_array_equal(out, (x + 1) * 3)
    assert seen[0][0] is x and np.array_equal(seen[1][0], x + 1)


# ------------------------------------------------------------------------------ decode / MoE


def _their_tkg(a):
    """NKI Library's attention_tkg semantics (their docstring and torch reference), in NumPy over
    the adapter's operands: prior slots j < pos visible, the last s_active slots replaced by the
    active keys / values with a causal mask, softmax of q . k (no scale: q comes scaled)."""
    d, B2, G, s = a["d"], a["bs"], a["q_head"], a["s_active"]
    S = a["s_prior"]
    q = a["q"].astype(np.float64).reshape(d, B2, G, s)
    ka = a["k_active"].astype(np.float64).reshape(d, B2, s)
    va = a["v_active"].astype(np.float64).reshape(B2, s, d)
    if a["table"] is None:
        kp = a["k_prior"].astype(np.float64)[:, 0]
        vp = a["v_prior"].astype(np.float64)[:, 0]
    else:
        kp = a["k_prior"].astype(np.float64)[a["table"].astype(np.int64)].reshape(B2, S, d)
        vp = a["v_prior"].astype(np.float64)[a["table"].astype(np.int64)].reshape(B2, S, d)
    kp, vp = kp.copy(), vp.copy()
    kp[:, S - s:] = ka.transpose(1, 2, 0)
    vp[:, S - s:] = va
    out = np.zeros((B2, G, d, s))
    for b in range(B2):
        vis = np.zeros((S, s), bool)
        vis[:int(a["pos"][b, 0])] = True
        vis[S - s:] = a["mask"][:, b, 0, :].astype(bool)
        for g in range(G):
            sc = kp[b] @ q[:, b, g, :]                          # [S, s]
            sc = np.where(vis, sc, -np.inf)
            p = np.exp(sc - sc.max(axis=0))
            out[b, g] = (vp[b].T @ p) / p.sum(axis=0)
    return out


@pytest.mark.parametrize("paged", [False, True])
def test_decode_adapters_fold_heads_and_match_the_reference(paged):
    from nki_kernels.reference.decode_attention import decode_attention_ref
    rng = np.random.default_rng(4)
    B, s_q, Hkv, G, d, L, bs = 2, 2, 2, 3, 8, 256, 64
    q = rng.standard_normal((B, s_q, Hkv * G, d)).astype(BF16)
    if paged:
        nb = B * L // bs
        k, v = (rng.standard_normal((nb, bs, Hkv, d)).astype(BF16) for _ in range(2))
        table = rng.permutation(nb).astype(np.int32).reshape(B, L // bs)
    else:
        k, v = (rng.standard_normal((B, L, Hkv, d)).astype(BF16) for _ in range(2))
        table = None
    lens = np.array([L, L], np.int32)
    a = V.decode_to_theirs(q, k, v, lens, table, scale=d ** -0.5)
    B2 = B * Hkv
    assert a["q"].shape == (d, B2 * G * s_q) and a["k_active"].shape == (d, B2 * s_q)
    assert a["v_active"].shape == (B2, 1, s_q, d) and a["mask"].shape == (s_q, B2, G, s_q)
    assert a["s_prior"] == L and (a["block_len"] == (bs if paged else 0))
    if paged:
        assert a["k_prior"].shape == (B * L // bs * Hkv, bs, d) and a["table"].dtype == np.uint32
    else:
        assert a["k_prior"].shape == (B2, 1, L, d)
        kt = V.decode_to_theirs(q, k, v, lens, None, scale=d ** -0.5, k_transposed=True)
        np.testing.assert_array_equal(kt["k_prior"].view(np.uint16),
                                      a["k_prior"].transpose(0, 1, 3, 2).view(np.uint16))
    np.testing.assert_array_equal(a["pos"], np.full((B2, s_q), L - s_q, np.float32))
    got = V.decode_from_theirs(_their_tkg(a).astype(BF16), B, Hkv)
    want = decode_attention_ref(q, k, v, lens, block_table=table, compute_dtype=np.float64)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=0.02)
    # a wrong head fold would pair query heads with another group's KV head
    wrong = V.decode_from_theirs(_their_tkg(a).astype(BF16)[:, ::-1], B, Hkv)
    assert np.abs(wrong.astype(np.float32) - want.astype(np.float32)).max() > 0.05


def test_decode_fp8_scales_and_their_dtype():
    rng = np.random.default_rng(5)
    B, s_q, Hkv, G, d, L = 1, 1, 1, 2, 8, 128
    q = rng.standard_normal((B, s_q, G, d)).astype(BF16)
    k, v = (rng.standard_normal((B, L, Hkv, d)).astype(ml_dtypes.float8_e4m3fn) for _ in range(2))
    a = V.decode_to_theirs(q, k, v, [L], None, scale=0.25, k_scale=0.5,
                           kv_dtype=ml_dtypes.float8_e4m3)
    assert a["k_prior"].dtype == np.dtype(ml_dtypes.float8_e4m3)
    np.testing.assert_array_equal(a["k_prior"][0, 0].astype(np.float32),
                                  k[0, :, 0].astype(np.float32))
    np.testing.assert_array_equal(a["q"][:, 0].astype(np.float32),
                                  q[0, 0, 0].astype(np.float32) * 0.125)
    o = np.ones((1, G, d, 1), BF16)
    np.testing.assert_array_equal(V.decode_from_theirs(o, 1, 1, v_scale=0.5).astype(np.float32),
                                  np.full((1, 1, G, d), 0.5, np.float32))


def _case(op, dtype="bf16", **dims):
    return BenchCase(op=op, shape="toy", dims=dims, dtype=dtype, make_inputs=None, run=None,
                     flops=1, bytes=1, check=None)


def test_decode_skewed_batch_and_moe_variants_have_no_equivalent():
    lens = np.array([4096, 128], np.int32)
    with pytest.raises(V.NoEquivalent, match="one s_prior for the whole batch"):
        V._theirs_decode_attention(None, _case("decode_attention"), (None, None, None, lens, None),
                                   1)
    with pytest.raises(V.OtherRegime, match="block KV"):       # K pre-transposed: flat KV only
        V._theirs_decode_attention(None, _case("decode_attention"),
                                   (None, None, None, lens[:1], np.zeros((1, 2))), 1, "kT")
    x = np.zeros((4, 8), BF16)
    ids = np.zeros((4, 2), np.int32)
    c = _case("fused_moe", T=4, E=8)
    with pytest.raises(V.NoEquivalent, match="shared expert"):
        V._theirs_fused_moe(None, c, (x, None, ids, None, None, "sg", "sd"), 1, "selective")
    with pytest.raises(V.NoEquivalent, match="MX"):
        V._theirs_fused_moe(None, _case("fused_moe", "mx", T=4, E=8), (x, None, ids, None, None),
                            1, "selective")
    big = _case("fused_moe", T=4096, E=8)
    for variant in ("selective", "all"):          # prefill: moe_cte's variants
        with pytest.raises(V.OtherRegime):
            V._theirs_fused_moe(None, big, (x, None, ids, None, None), 1, variant)
    with pytest.raises(V.OtherRegime):            # decode: moe_tkg's
        V._theirs_fused_moe(None, c, (x, None, ids, None, None), 1, "cte256")
    # a reason every variant shares gives one row: the regime's first variant
    with pytest.raises(V.NoEquivalent, match="two cores only"):
        V._theirs_fused_moe(None, big, (x, None, ids, None, None), 1, "cte256")
    with pytest.raises(V.OtherRegime, match="two cores only"):
        V._theirs_fused_moe(None, big, (x, None, ids, None, None), 1, "cte512")
    with pytest.raises(V.NoEquivalent, match="moe_cte has no shared expert"):
        V._theirs_fused_moe(None, big, (x, None, ids, None, None, "sg", "sd"), 2, "cte256")
    fp8 = _case("fused_moe", "fp8", T=4096, E=8)
    with pytest.raises(V.NoEquivalent, match="moe_cte's FP8 weights"):
        V._theirs_fused_moe(None, fp8, (x, None, ids, None, None, "s1", "s2"), 2, "cte256")


def test_moe_cte_blocks():
    """Each expert's tokens in token order in blocks of B, padding slots at row T; the fewest
    blocks; dense affinities with a zero padding row."""
    ids = np.array([[0, 2], [2, 1], [0, 2], [2, 0]], np.int32)
    w = np.array([[0.3, 0.7], [0.6, 0.4], [0.5, 0.5], [0.9, 0.1]], np.float32)
    tpos, b2e, aff = V.moe_blocks_to_theirs(w, ids, 4, 2)
    assert b2e.ravel().tolist() == [0, 0, 1, 2, 2]       # expert 3: no block
    assert tpos.tolist() == [0, 2, 3, 4, 1, 4, 0, 1, 2, 3]
    assert aff.shape == (5, 4) and not aff[4].any()
    assert aff[1, 2] == np.float32(0.6) and aff[3, 0] == np.float32(0.1) and aff[0, 1] == 0


def test_moe_adapters_layout_and_routing():
    from nki_kernels.reference.fused_moe import fused_moe_ref
    rng = np.random.default_rng(6)
    T, H, I, E, k = 5, 16, 8, 4, 2
    x = rng.standard_normal((T, H)).astype(BF16)
    wgu = (rng.standard_normal((E, H, 2 * I)) * 0.3).astype(BF16)
    wd = (rng.standard_normal((E, I, H)) * 0.3).astype(BF16)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1, (T, k)).astype(np.float32)
    gu, dn = V.moe_weights_to_theirs(wgu, wd)
    assert gu.shape == (E, H, 2, I) and dn.shape == (E, I, H)
    aff, idx = V.moe_routing_to_theirs(w, ids, E)
    assert aff.shape == (T, E) and idx.dtype == np.int32
    np.testing.assert_array_equal(aff.sum(axis=1), w.sum(axis=1))
    # their POST_SCALE selective formula over their layout
    y = np.zeros((T, H), np.float32)
    for t in range(T):
        a = x[t].astype(np.float32)
        for j in range(k):
            e = idx[t, j]
            g, u = a @ gu[e, :, 0].astype(np.float32), a @ gu[e, :, 1].astype(np.float32)
            y[t] += aff[t, e] * ((g / (1 + np.exp(-g)) * u) @ dn[e].astype(np.float32))
    ref = fused_moe_ref(x, wgu, wd, w, ids).astype(np.float32)
    np.testing.assert_allclose(y, ref, rtol=2e-2, atol=2e-2)
    sc = V.moe_weights_to_theirs(wgu, wd, np.arange(E * 2 * I, dtype=np.float32).reshape(E, -1),
                                 np.ones((E, H), np.float32))
    assert sc[2].shape == (E, 2, I) and sc[2][1, 1, 0] == 2 * I + I
    with pytest.raises(V.NoEquivalent, match="outside"):
        V.moe_routing_to_theirs(w, ids + E, E)


def test_decode_rows_run_at_their_own_lnc():
    pair = V.PAIRS["decode_attention"]
    assert pair.case_lncs(_case("decode_attention")) == (1,)
    two = dataclasses.replace(_case("decode_attention"), lnc=2)
    assert pair.case_lncs(two) == (2,)
    assert V.PAIRS["rmsnorm_quant"].case_lncs(two) == (1, 2)


def test_fused_moe_fp8_check_can_fail():
    from nki_kernels.reference.fused_moe import fused_moe_ref
    from nki_kernels.reference.swiglu_mlp import quantize_fp8_per_channel
    rng = np.random.default_rng(7)
    T, H, I, E, k = 6, 64, 32, 4, 2
    x = rng.standard_normal((T, H)).astype(BF16)
    gq, gs = zip(*(quantize_fp8_per_channel(rng.standard_normal((H, 2 * I)).astype(np.float32)
                                            * H ** -0.5, ml_dtypes.float8_e4m3) for _ in range(E)))
    dq, ds = zip(*(quantize_fp8_per_channel(rng.standard_normal((I, H)).astype(np.float32)
                                            * I ** -0.5, ml_dtypes.float8_e4m3) for _ in range(E)))
    wgu, wd, sgu, sd = np.stack(gq), np.stack(dq), np.stack(gs), np.stack(ds)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1, (T, k)).astype(np.float32)
    inputs = (x, w, ids, wgu, wd, sgu, sd)
    assert V._fused_moe_fp8_check(_case("fused_moe", "bf16")) is None
    check = V._fused_moe_fp8_check(_case("fused_moe", "fp8"))
    check(inputs, fused_moe_ref(x, wgu, wd, w, ids, gate_up_scale=sgu, down_scale=sd))
    with pytest.raises(AssertionError, match="cosine similarity"):     # routing weights swapped
        check(inputs, fused_moe_ref(x, wgu, wd, w[:, ::-1], ids, gate_up_scale=sgu,
                                    down_scale=sd))


def test_pair_check_replaces_the_bench_check_for_both_sides(monkeypatch):
    pair, good = _fake_pair(np.ones((4, 128), np.float32))

    def strict(case):
        def check(inputs, out):
            raise AssertionError("pair check")
        return check
    (row,) = _rows(monkeypatch, dataclasses.replace(pair, check=strict), good, _check)
    assert row["ours"]["check"] == row["nkilib"]["check"] == "failed"
    assert "pair check" in row["nkilib"]["error"]
    (row,) = _rows(monkeypatch, dataclasses.replace(pair, check=lambda c: None), good, _check)
    assert row["ours"]["check"] == row["nkilib"]["check"] == "passed"
