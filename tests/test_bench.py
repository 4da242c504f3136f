"""The bench harness: shapes table, roofline math, an end-to-end run, the CLI.

Expected numbers are worked out by hand from the documented per-NeuronCore figures
(docs/cost-model.md, docs/bench.md): TensorE 78.6 TF bf16, 157 fp8, 315 MX (Trn3), 19.7 fp32; memory
min(362.5, 368) = 362.5 GB/s on Trn2, min(612.5, 528) = 528 GB/s on Trn3.
"""
from __future__ import annotations

import json
import math
import sys
import types

import numpy as np
import pytest

from nki_kernels import hardware
from nki_kernels.bench import defs, harness, roofline
from nki_kernels.bench.defs import BenchCase, EngineCeiling
from nki_kernels.reference import shapes

DOC_PEAKS = {("trn2", "bf16"): 78.6, ("trn2", "fp8"): 157.0, ("trn2", "fp32"): 19.7,
             ("trn3", "bf16"): 78.6, ("trn3", "fp8"): 157.0, ("trn3", "mx"): 315.0,
             ("trn3", "fp32"): 19.7}
DOC_BW = {"trn2": 362.5, "trn3": 528.0}


@pytest.fixture
def table_numbers(monkeypatch):
    """Roofline from roofline.py's own table (hardware.py helpers hidden)."""
    monkeypatch.delattr(hardware, "peak_tflops", raising=False)
    monkeypatch.delattr(hardware, "hbm_bw", raising=False)


# ------------------------------------------------------------------------------- shapes table


def test_model_configs_are_the_published_dims():
    m = shapes.LLAMA3_8B
    assert (m.hidden, m.n_q_heads, m.n_kv_heads, m.head_dim, m.intermediate, m.vocab) == \
        (4096, 32, 8, 128, 14336, 128256)
    assert m.qkv_out == 6144 and m.gqa_group == 4
    tp8 = shapes.LLAMA3_70B_TP8
    assert (shapes.LLAMA3_70B.hidden, shapes.LLAMA3_70B.intermediate) == (8192, 28672)
    assert (tp8.hidden, tp8.n_q_heads, tp8.n_kv_heads, tp8.intermediate, tp8.tp) == \
        (8192, 8, 1, 3584, 8)
    q = shapes.QWEN3_30B_A3B
    assert (q.hidden, q.n_q_heads, q.n_kv_heads, q.n_experts, q.top_k, q.moe_intermediate) == \
        (2048, 32, 4, 128, 8, 768)
    q2 = shapes.QWEN3_235B_A22B
    assert (q2.hidden, q2.n_q_heads, q2.n_kv_heads, q2.moe_intermediate) == (4096, 64, 4, 1536)
    d = shapes.DEEPSEEK_V3
    assert (d.hidden, d.n_q_heads, d.n_experts, d.top_k, d.moe_intermediate) == \
        (7168, 128, 256, 8, 2048)
    assert d.is_mla and d.mla_cache_dim == 576 and d.head_dim == 128 + 64
    mx = shapes.MIXTRAL_8X7B
    assert (mx.n_experts, mx.top_k, mx.moe_intermediate, mx.vocab) == (8, 2, 14336, 32000)
    g = shapes.GEMMA3_27B
    assert (g.hidden, g.n_q_heads, g.n_kv_heads, g.head_dim, g.sliding_window) == \
        (5376, 32, 16, 128, 1024)
    assert shapes.GEMMA3_12B.head_dim == 256


def test_tiers_have_every_family_and_builders_use_model_dims():
    for t in shapes.TIERS.values():
        for fam in shapes.FAMILIES:
            assert t.of(fam), f"{t.name}.{fam} is empty"
            names = [s.name for s in t.of(fam)]
            assert len(names) == len(set(names)), f"duplicate shape names in {t.name}.{fam}"
    up = shapes.linear_of(shapes.LLAMA3_8B, 8, "up")
    assert (up.M, up.K, up.N) == (8, 4096, 14336)
    ex = shapes.linear_of(shapes.DEEPSEEK_V3, 64, "expert_up")
    assert (ex.K, ex.N) == (7168, 2048)
    assert any(s.kv_len == 0 for s in shapes.ODD.decode)          # zero-length sequence
    assert any(s.tokens == 0 for s in shapes.ODD.rmsnorm)
    assert shapes.square(4096) in shapes.MODELS.matmul
    assert shapes.square(4096) not in shapes.FAST.matmul           # ~60 s emulated: MODELS only
    with pytest.raises(ValueError, match="tier must be one of"):
        shapes.tier("huge")
    with pytest.raises(ValueError, match="shape family must be one of"):
        shapes.FAST.of("conv")
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        shapes.moe_of(shapes.LLAMA3_8B, 8)
    with pytest.raises(ValueError, match="tp=3 must divide"):
        shapes.LLAMA3_70B.tp_shard(3)


# ----------------------------------------------------------------------------- roofline math


def test_peaks_and_ridges_match_hardware_md(table_numbers):
    for (t, k), v in DOC_PEAKS.items():
        assert roofline.peak_tflops(t, k) == pytest.approx(v)
    assert roofline.hbm_bw("trn2") == 362.5 and roofline.hbm_bw("trn3") == 528.0
    assert round(roofline.ridge("trn2", "bf16")) == 217      # C.1
    assert round(roofline.ridge("trn3", "bf16")) == 149
    assert round(roofline.ridge("trn3", "mx")) == 597        # 315 / 0.528; C.1 rounds 596
    with pytest.raises(ValueError, match="no TensorE mx mode"):
        roofline.peak_tflops("trn2", "mx")
    with pytest.raises(ValueError, match="target must be one of"):
        roofline.hbm_bw("h100")
    with pytest.raises(ValueError, match="roof kind must be one of"):
        roofline.peak_tflops("trn3", "int8")


def test_hardware_module_helpers_are_preferred_and_agree(monkeypatch):
    if hasattr(hardware, "peak_tflops"):          # the real helpers: same documented numbers
        for (t, k), v in DOC_PEAKS.items():
            assert roofline.peak_tflops(t, k) == pytest.approx(v, rel=0.01)
    if hasattr(hardware, "hbm_bw"):
        for t, v in DOC_BW.items():
            assert roofline.hbm_bw(t) == pytest.approx(v, rel=0.01)
    monkeypatch.setattr(hardware, "peak_tflops", lambda t, k: 100.0, raising=False)
    monkeypatch.setattr(hardware, "hbm_bw", lambda t: 250.0, raising=False)
    assert roofline.peak_tflops("trn2", "bf16") == 100.0 and roofline.hbm_bw("trn3") == 250.0


def test_roof_point_compute_bound_4096_cubed(table_numbers):
    flops = 2 * 4096 ** 3                       # 137,438,953,472
    nbytes = 3 * 4096 * 4096 * 2                # 100,663,296 (A, B, C in bf16)
    p = roofline.roof_point(flops, nbytes, 2.0e-3, "trn2", "bf16")
    # TensorE bound 137.44e9 / 78.6e12 = 1.74859 ms > HBM 100.66e6 / 362.5e9 = 0.27769 ms
    assert p.roof == "TensorE bf16"
    assert p.roof_s == pytest.approx(1.748587e-3, rel=1e-5)
    assert p.pct_roof == pytest.approx(87.4293, rel=1e-4)
    assert p.tflops == pytest.approx(68.7195, rel=1e-5)
    assert p.gbps == pytest.approx(50.3316, rel=1e-5)
    assert p.pct_hbm == pytest.approx(13.8846, rel=1e-4)
    assert p.ai == pytest.approx(1365.333, rel=1e-6)
    # LNC=2: both denominators double, so % of roof halves
    p2 = roofline.roof_point(flops, nbytes, 2.0e-3, "trn2", "bf16", lnc=2)
    assert p2.pct_roof == pytest.approx(87.4293 / 2, rel=1e-4)
    # FP8 roof (157 TF): 0.87541 ms
    p8 = roofline.roof_point(flops, nbytes, 2.0e-3, "trn2", "fp8")
    assert p8.pct_roof == pytest.approx(43.7705, rel=1e-4)


def test_roof_point_memory_bound_decode_gemv(table_numbers):
    # 8 x 7168 -> 2048 bf16: flops 234,881,024; bytes (8*7168 + 7168*2048 + 8*2048) * 2
    flops, nbytes = 2 * 8 * 7168 * 2048, (8 * 7168 + 7168 * 2048 + 8 * 2048) * 2
    assert nbytes == 29_507_584
    p = roofline.roof_point(flops, nbytes, 100e-6, "trn3", "bf16")
    # HBM 29,507,584 / 528e9 = 55.886 us > TensorE 2.988 us
    assert p.roof == "HBM"
    assert p.pct_roof == pytest.approx(55.8856, rel=1e-4)
    assert p.gbps == pytest.approx(295.07584, rel=1e-7)
    p2 = roofline.roof_point(flops, nbytes, 100e-6, "trn2", "bf16")
    assert p2.pct_roof == pytest.approx(81.4002, rel=1e-4)     # / 362.5 GB/s


def test_roof_point_engine_ceilings(table_numbers):
    exp = EngineCeiling("ScalarE exp", 1e9, {"trn2": 153.6e9})
    # 1e9 exps at 153.6 G/s = 6.5104 ms beats TensorE 1e9 / 78.6e12 = 12.72 us and HBM 2.76 us
    p = roofline.roof_point(1e9, 1e6, 10e-3, "trn2", "bf16", ceilings=(exp,))
    assert p.roof == "ScalarE exp" and p.pct_roof == pytest.approx(65.1042, rel=1e-5)
    # no rate for trn3: the ceiling does not bind there (TensorE 12.72 us > HBM 1.89 us)
    p3 = roofline.roof_point(1e9, 1e6, 10e-3, "trn3", "bf16", ceilings=(exp,))
    assert p3.roof == "TensorE bf16" and p3.pct_roof == pytest.approx(0.127226, rel=1e-5)
    with pytest.raises(ValueError, match="time must be positive"):
        roofline.roof_point(1.0, 1.0, 0.0, "trn3")


# ------------------------------------------------------------------------------------ harness


class _FakeReport:
    """Stands in for the cost model's CostReport (fixed timings, the op really runs)."""

    def __init__(self, outputs, total_ns, busy, engine):
        self.outputs = outputs
        self.total_ns = total_ns
        self.engine_busy_ns = busy
        self.binding_engine = engine
        self.n_instructions = 7


@pytest.fixture
def fake_cost(monkeypatch):
    calls = []
    timing = {"total_ns": 2000.0, "busy": {"tensor": 400.0, "dma": 1800.0, "vector": 100.0},
              "engine": "dma"}

    def estimate(fn, *args, target="trn3", lnc=1):
        calls.append((target, lnc))
        return _FakeReport(fn(*args), timing["total_ns"], dict(timing["busy"]), timing["engine"])

    mod = types.ModuleType("nki_kernels.emulator.cost")
    mod.estimate = estimate
    monkeypatch.setitem(sys.modules, "nki_kernels.emulator.cost", mod)
    import nki_kernels.emulator as emu
    monkeypatch.setattr(emu, "cost", mod, raising=False)
    return calls, timing


def _tiny_matmul_case():
    from nki_kernels.bench.defs.matmul import matmul_case
    s = shapes.FAST.matmul[0]
    assert (s.M, s.K, s.N) == (128, 256, 512)
    return matmul_case(s, "bf16")


def test_bench_one_tiny_matmul_end_to_end(tmp_path, fake_cost, table_numbers):
    calls, _ = fake_cost
    case = _tiny_matmul_case()
    # flops 2*128*256*512; bytes (128*256 + 256*512)*2 + 128*512*2
    assert case.flops == 33_554_432 and case.bytes == 458_752
    rows = harness.run(cases=[case], target="trn3", progress=False)
    assert calls == [("trn3", 1)]
    (r,) = rows
    assert "error" not in r, r.get("error")
    assert r["source"] == "modeled" and r["target"] == "trn3"
    assert r["time_us"] == pytest.approx(2.0)
    assert r["tflops"] == pytest.approx(16.777216)      # 33,554,432 / 2 us
    assert r["gbps"] == pytest.approx(229.376)          # 458,752 / 2 us
    # HBM 458,752 / 528e9 = 0.868848 us > TensorE 33,554,432 / 78.6e12 = 0.426901 us
    assert r["roof"] == "HBM" and r["pct_roof"] == pytest.approx(43.4424, rel=1e-5)
    assert r["model_bound"] == "DMA" and r["short"] is True
    assert r["git_sha"] and r["date"].startswith("20")

    paths = harness.write(rows, tmp_path, tier="fast")
    lines = paths["json"].read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["shape"] == "128x256x512"
    harness.write(rows, tmp_path, plot=False)                    # JSON lines append
    assert len(paths["json"].read_text().splitlines()) == 2
    md = paths["markdown"].read_text()
    assert "| matmul | 128x256x512 | M=128 K=256 N=512 | bf16 | trn3 | 1 | 2.00 † |" in md
    assert "| 43.4 | HBM | DMA | modeled |" in md
    pytest.importorskip("matplotlib")
    png = paths["plot"]
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_modeled_engine_bound_and_errors(fake_cost, table_numbers):
    _, timing = fake_cost
    timing.update(total_ns=10_000.0, busy={"tensor": 400.0, "vector": 8000.0}, engine="vector")
    case = _tiny_matmul_case()

    def broken(rng):
        raise RuntimeError("boom")

    bad = BenchCase(op="matmul", shape="bad", dims={"M": 1}, dtype="bf16", make_inputs=broken,
                    run=case.run, flops=1.0, bytes=1.0)
    rows = harness.run(cases=[case, bad], target="trn2", progress=False)
    r, e = rows
    # the model's binding engine is reported, but is not a roof: the roof stays the hardware bound
    assert r["roof"] in ("TensorE bf16", "HBM") and r["roof"] != "VectorE"
    assert r["model_bound"] == "VectorE" and r["engine_busy_us"]["vector"] == 8.0
    assert e["error"] == "RuntimeError: boom" and e["time_us"] is None
    assert "- matmul bad bf16: RuntimeError: boom" in harness.markdown_table(rows)


def test_bench_case_validation():
    with pytest.raises(ValueError, match="roof_kind must be one of"):
        BenchCase(op="x", shape="s", dims={}, dtype="int8", make_inputs=None, run=None,
                  flops=1, bytes=1, roof_kind="int8")
    with pytest.raises(ValueError, match="lnc must be 1 or 2"):
        BenchCase(op="x", shape="s", dims={}, dtype="bf16", make_inputs=None, run=None,
                  flops=1, bytes=1, lnc=4)
    with pytest.raises(harness.BenchError, match="no bench definition for op 'nope'"):
        harness.select(["nope"], "fast", "trn3")
    with pytest.raises(harness.BenchError, match="tier must be one of"):
        harness.select(None, "huge", "trn3")


def test_registry_matmul_cases_come_from_the_shapes_table():
    assert "matmul" in defs.registered()
    fast = defs.cases("matmul", "fast", "trn3")
    bf16 = [(c.dims["M"], c.dims["K"], c.dims["N"]) for c in fast if c.dtype == "bf16"]
    assert bf16 == [(s.M, s.K, s.N) for s in shapes.FAST.matmul]
    assert {c.dtype for c in fast} == {"bf16", "fp8"}
    fp8 = next(c for c in fast if c.dtype == "fp8")
    assert fp8.roof_kind == "fp8" and fp8.bytes == 2 * 512 * 512 * 1 + 512 * 512 * 2
    models = defs.cases("matmul", "models", "trn3")
    assert any(c.lnc == 2 for c in models)
    assert max(c.flops for c in fast) < 2 * 4096 ** 3      # keeps the default bench short


def test_progress_bar_plain_lines(capsys):
    import io
    buf = io.StringIO()
    bar = harness.Progress(2, stream=buf)
    bar.start(0, "a")
    bar.done(0, {"op": "matmul", "shape": "s", "dtype": "bf16", "time_us": 1.5})
    bar.start(1, "b")
    bar.done(1, {"op": "matmul", "shape": "t", "dtype": "bf16", "error": "x"})
    bar.close()
    out = buf.getvalue().splitlines()
    assert out[0].startswith("[##############..............] 1/2 matmul s bf16: 1.5 us")
    assert "ERROR" in out[1] and out[2].endswith("1 error(s)")


# ---------------------------------------------------------------------------------------- CLI


def test_cli_list(capsys):
    from nki_kernels.cli import main
    assert main(["bench", "--list", "--op", "matmul", "--tier", "fast"]) == 0
    out, err = capsys.readouterr()
    assert "2048^3" in out and "deepseek-v3 expert_up M=8" in out and "4096^3" not in out
    n = len(defs.cases("matmul", "fast", "trn3"))
    assert f"{n} case(s); target trn3" in err
    assert main(["bench", "--list", "--op", "nope"]) == 2
    assert "no bench definition for op 'nope'" in capsys.readouterr().err


def test_cli_measured_without_device_says_so(tmp_path, monkeypatch, capsys):
    from nki_kernels import backend
    from nki_kernels.cli import main
    if backend.BACKEND != "emulator":
        pytest.skip("a real nki is installed here")
    monkeypatch.setenv("NKI_ARTIFACTS_DIR", str(tmp_path / "art"))
    assert main(["bench", "--measured", "--op", "matmul", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no Neuron device/SDK is present" in err and "Trainium instance" in err
    assert not list(tmp_path.glob("*.md"))                  # nothing ran, nothing written


def test_cli_bench_run_writes_outputs(tmp_path, fake_cost, capsys):
    from nki_kernels.cli import main
    calls, _ = fake_cost
    rc = main(["bench", "--op", "matmul", "--tier", "fast", "--target", "trn2", "--shape",
               "512", "--out", str(tmp_path), "--json", str(tmp_path / "r.jsonl"), "--quiet",
               "--no-plot", "--seed", "3"])
    assert rc == 0
    # --shape 512 keeps 128x256x512 (bf16) and 512^3 (bf16, fp8), not 2048^3
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["shape"], r["dtype"]) for r in rows] == \
        [("128x256x512", "bf16"), ("512^3", "bf16"), ("512^3", "fp8")]
    assert calls == [("trn2", 1)] * 3
    assert {r["target"] for r in rows} == {"trn2"} and all(math.isfinite(r["pct_roof"])
                                                           for r in rows)
    assert (tmp_path / "bench_trn2_fast_subset.md").exists()    # a subset: never the full table
    assert not (tmp_path / "bench_trn2_fast.md").exists()
    assert not list(tmp_path.glob("*.png"))


def test_cli_bench_dtype_filter(tmp_path, fake_cost):
    from nki_kernels.cli import main
    rc = main(["bench", "--op", "matmul", "--tier", "fast", "--target", "trn2", "--shape",
               "512", "--dtype", "fp8", "--out", str(tmp_path), "--json",
               str(tmp_path / "r.jsonl"), "--quiet", "--no-plot"])
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["shape"], r["dtype"]) for r in rows] == [("512^3", "fp8")]
    assert (tmp_path / "bench_trn2_fast_subset.md").exists()    # a dtype subset is a subset


# --------------------------------------------------------------- outputs, publishing, README


def test_default_outputs_are_ignored_by_git():
    import subprocess
    out = harness.default_out_dir()
    assert out.parts[-3:] == ("bench", "results", "local")
    probe = out / "results.jsonl"
    r = subprocess.run(["git", "-C", str(harness.repo_root()), "check-ignore", "-q", str(probe)])
    if r.returncode == 128:
        pytest.skip("not a git checkout")
    assert r.returncode == 0, f"{probe} is not ignored by git"


def test_default_tier_is_real_model_shapes_covering_every_op():
    for fam in shapes.FAMILIES:
        assert set(shapes.DEFAULT.of(fam)) <= set(shapes.MODELS.of(fam)), fam
    ops = defs.registered()
    for op in ("matmul", "qkv_proj", "swiglu_mlp", "rmsnorm_quant", "flash_attention",
               "mxfp8_matmul"):
        assert op in ops and defs.cases(op, "default", "trn3"), op
    dtypes = {c.dtype for c in defs.cases("swiglu_mlp", "default", "trn3")}
    assert dtypes == {"fp8"}                             # the serving path (bf16: tests, models)
    assert harness.DEFAULT_TIER == "default"


def _row(op="matmul", shape="s", dtype="bf16", target="trn3", pct=50.0, goal=None, **kw):
    r = {"op": op, "shape": shape, "dims": {"M": 1}, "dtype": dtype, "target": target, "lnc": 1,
         "source": "modeled", "time_us": 10.0, "tflops": 1.0, "gbps": 100.0, "pct_roof": pct,
         "roof": "HBM", "model_bound": "DMA", "pct_tensor": 1.0, "pct_hbm": pct, "ai": 1.0,
         "flops": 1.0, "bytes": 1.0, "roof_kind": "bf16", "goal": goal, "git_sha": "abc",
         "date": "2026-11-24T00:00:00+00:00", "check": "passed"}
    r.update(kw)
    return r


def test_publish_merges_refuses_dirty_and_unchecked(tmp_path):
    cases = defs.cases("matmul", "fast", "trn3")
    a, b = cases[0], cases[1]
    r1 = _row(shape=a.shape, dtype=a.dtype, time_us=1.0)
    r2 = _row(shape=b.shape, dtype=b.dtype, time_us=2.0)
    harness.publish([r1, r2], "fast", "trn3", tmp_path, plot=False)
    new = _row(shape=a.shape, dtype=a.dtype, time_us=3.0)
    stale = _row(shape="no longer in the tier", time_us=4.0)
    harness.publish([new, stale], "fast", "trn3", tmp_path, plot=False)   # a subset run
    got = {(r["shape"], r["dtype"]): r["time_us"] for r in
           harness.read_jsonl(tmp_path / "fast_trn3.jsonl")}
    assert got == {(a.shape, a.dtype): 3.0, (b.shape, b.dtype): 2.0}       # merged, not replaced
    assert "| 3.00 |" in (tmp_path / "fast_trn3.md").read_text()
    with pytest.raises(harness.BenchError, match="the code differs from git HEAD"):
        harness.publish([_row(git_sha="abc+dirty")], "fast", "trn3", tmp_path, plot=False)
    with pytest.raises(harness.BenchError, match="was not checked against the reference"):
        harness.publish([_row(check="none")], "fast", "trn3", tmp_path, plot=False)
    with pytest.raises(harness.BenchError, match="failed: boom"):
        harness.publish([_row(error="boom")], "fast", "trn3", tmp_path, plot=False)


def test_readme_table_marks_misses_and_cases_not_run(tmp_path):
    cases = defs.cases("qkv_proj", "models", "trn3")
    met = _row("qkv_proj", cases[0].shape, "bf16", pct=85.0, goal=80.0)
    miss = _row("qkv_proj", cases[1].shape, "bf16", pct=66.3, goal=80.0)
    (tmp_path / "models_trn3.jsonl").write_text(json.dumps(met) + "\n" + json.dumps(miss) + "\n")
    table = harness.readme_table(tmp_path)
    lines = table.splitlines()
    row_met = next(ln for ln in lines if f"| {cases[0].shape} |" in ln)
    row_miss = next(ln for ln in lines if f"| {cases[1].shape} |" in ln)
    assert "≥ 80: trn3 ✓" in row_met and "| 85.0 |" in row_met
    assert "trn3 ✗ **miss**" in row_miss and "| 66.3 |" in row_miss
    assert row_met.split(" | ")[3] == "not run"           # trn2: defined, no published row
    mx = next(ln for ln in lines if ln.startswith("| mxfp8_matmul |"))
    assert "| n/a |" in mx                                # no MX matmul on trn2
    assert "1 of 2 rows" not in table and "every case's output checked" in table


def test_bench_check_keeps_a_wrong_kernel_from_posting_a_number(fake_cost, table_numbers):
    from dataclasses import replace
    case = _tiny_matmul_case()
    good = harness.run(cases=[case], target="trn3", progress=False, check=True)[0]
    assert good.get("error") is None and good["check"] == "passed"

    def wrong(a, b):                                     # fast and wrong: 1% off
        out = case.run(a, b)
        return (out.astype(np.float32) * 1.01).astype(out.dtype)

    bad = harness.run(cases=[replace(case, run=wrong)], target="trn3", progress=False,
                      check=True)[0]
    assert bad["time_us"] is None and bad["pct_roof"] is None
    assert bad["error"].startswith("WrongResult: output differs from the reference")


def test_cli_bogus_backend_is_one_line():
    import os
    import subprocess
    env = dict(os.environ, NKI_KERNELS_BACKEND="bogus")
    r = subprocess.run([sys.executable, "-m", "nki_kernels.cli", "bench", "--list"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "nki-kernels: NKI_KERNELS_BACKEND must be one of emulator, simulator, hardware; got 'bogus'"]
    code = ("import numpy as np, nki_kernels\n"
            "nki_kernels.matmul(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "nki_kernels.backend.BackendUnavailable: NKI_KERNELS_BACKEND must be one of emulator, "
        "simulator, hardware; got 'bogus'")


def test_device_raw_views_ml_dtypes_as_uints():
    import ml_dtypes

    from nki_kernels.bench import device
    a = np.ones((2, 3), dtype=ml_dtypes.bfloat16)
    r = device._raw(a)
    assert r.dtype == np.uint16 and r.shape == (2, 3) and int(r[0, 0]) == 0x3F80
    f = np.ones(4, dtype=np.float32)
    assert device._raw(f).dtype == np.float32


def test_bench_tiny_matmul_with_the_real_cost_model():
    pytest.importorskip("nki_kernels.emulator.cost")
    case = _tiny_matmul_case()
    (r,) = harness.run(cases=[case], target="trn3", progress=False)
    assert "error" not in r, r.get("error")
    assert r["source"] == "modeled" and r["time_us"] > 0
    # a modeled time can never beat the roofline
    assert 0 < r["pct_roof"] <= 100.0 and r["pct_tensor"] <= 100.0 and r["pct_hbm"] <= 100.0
    assert r["model_bound"] in roofline.ENGINE_NAMES.values()
