"""The modeled profiler (nki_kernels/emulator/profile.py) and `nki-kernels profile`."""
import json
import textwrap
from collections import Counter, defaultdict

import ml_dtypes
import numpy as np
import pytest

from nki_kernels.cli import main
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import jit, trace
from nki_kernels.emulator import language as nl
from nki_kernels.emulator.cost import dependencies, estimate
from nki_kernels.emulator.profile import LANES, profile, profile_trace, side_by_side

BF16 = ml_dtypes.bfloat16


@jit
def small(a, b):
    """Two loads, a matmul, PSUM evacuation on VectorE, an activation on ScalarE, a store."""
    ta = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=ta, src=a)
    tb = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tb, src=b)
    p = nl.ndarray((a.shape[1], b.shape[1]), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=p, stationary=ta, moving=tb)
    s = nl.ndarray(p.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=s, src=p)
    o = nl.ndarray(p.shape, a.dtype, buffer=nl.sbuf)
    nisa.activation(dst=o, op=nl.exp, data=s)
    out = nl.ndarray(p.shape, a.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=o)
    return out


@jit
def chain(x, n):
    """``n`` alternating VectorE / ScalarE steps on one tile (many small instructions)."""
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    for i in range(n):
        if i % 2:
            nisa.activation(dst=t, op=nl.exp, data=t)
        else:
            nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=0.5)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@jit
def two_cores(x):
    pid = nl.program_id(0)
    rows = x.shape[0] // nl.num_programs()
    t = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[pid * rows:(pid + 1) * rows, :])
    nisa.activation(dst=t, op=nl.exp, data=t)


def _inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((128, 128)).astype(BF16),
            rng.standard_normal((128, 256)).astype(BF16))


@pytest.fixture(scope="module")
def small_profile():
    a, b = _inputs()
    with trace() as tr:
        small(a, b)
    return profile(small, a, b, target="trn3"), tr


def _tracks(doc):
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    return names


def test_trace_is_valid_trace_event_json(small_profile, tmp_path):
    p, _ = small_profile
    paths = p.write(tmp_path, "small")
    doc = json.loads(paths["trace"].read_text())
    assert isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] == "ns"
    names = _tracks(doc)
    flows = defaultdict(list)
    for e in doc["traceEvents"]:
        assert e["ph"] in ("M", "X", "s", "f") and isinstance(e["pid"], int)
        assert isinstance(e["tid"], int) and isinstance(e["name"], str)
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0 and (e["pid"], e["tid"]) in names
        if e["ph"] in "sf":
            flows[e["id"]].append(e["ph"])
    assert flows and all(sorted(v) == ["f", "s"] for v in flows.values())
    assert "not a measurement" in doc["otherData"]["note"]
    assert json.loads(paths["summary"].read_text())["total_ns"] == p.report.total_ns


def test_every_instruction_once_on_its_engine_without_overlap(small_profile):
    p, tr = small_profile
    doc = p.trace_json()
    names = _tracks(doc)
    boxes = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "instruction"]
    seqs = Counter(e["args"]["seq"] for e in boxes)
    assert sorted(seqs) == list(range(len(tr))) and set(seqs.values()) == {1}
    issuer = {"scalar": LANES["scalar"], "gpsimd": LANES["gpsimd"]}
    for e in boxes:
        ins = tr.instructions[e["args"]["seq"]]
        lane = names[(e["pid"], e["tid"])]
        if ins.engine == "dma":             # the trigger, on the engine that issued it
            assert lane == issuer.get(ins.attrs.get("issuer"), LANES["sync"])
        else:
            assert lane.split(" #")[0].startswith(LANES[ins.engine])
        assert e["args"]["opcode"] == ins.opcode and e["args"]["src"].endswith("(small)")
        assert "test_profile.py:" in e["args"]["src"]
    # DMA queue segments: each DMA's data on the DMA queue tracks
    segs = {e["args"]["seq"] for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "dma"}
    assert segs == {i for i, ins in enumerate(tr) if ins.engine == "dma"}
    by_track = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            by_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for lst in by_track.values():
        lst.sort()
        assert all(b[0] >= a[1] - 1e-9 for a, b in zip(lst, lst[1:]))


def test_dependency_edges_are_the_models(small_profile):
    p, tr = small_profile
    deps = dependencies(tr, "trn3")
    doc = p.trace_json()
    boxes = {e["args"]["seq"]: e for e in doc["traceEvents"]
             if e["ph"] == "X" and e["cat"] == "instruction"}
    for i, d in enumerate(deps):
        assert boxes[i]["args"]["deps"] == list(d)
        w = boxes[i]["args"]["wait_on"]
        assert w is None or w in d or tr.instructions[w].engine == tr.instructions[i].engine \
            or tr.instructions[i].engine == "dma"
    # the matmul waits for a load; the copy waits for the matmul: arrows end on them
    ends = {(e["pid"], e["tid"], e["ts"]) for e in doc["traceEvents"] if e["ph"] == "f"}
    mm = next(b for b in boxes.values() if b["name"] == "nc_matmul")
    cp = next(b for b in boxes.values() if b["name"] == "tensor_copy")
    assert (mm["pid"], mm["tid"], mm["ts"]) in ends and (cp["pid"], cp["tid"], cp["ts"]) in ends


def test_summary_totals_equal_the_estimate(small_profile):
    p, _ = small_profile
    rep = estimate(small, *_inputs(), target="trn3")
    d = p.summary_dict()
    assert d["total_ns"] == rep.total_ns and d["makespan_ns"] == rep.makespan_ns
    assert d["engine_busy_ns"] == rep.engine_busy_ns
    assert d["n_instructions"] == rep.n_instructions and d["binding_engine"] == rep.binding_engine
    assert d["dma"]["bytes"] == rep.dma_bytes and d["dma"]["descriptors"] == rep.dma_descriptors
    assert d["tensor_flops"] == rep.tensor_flops == 2 * 128 * 128 * 256
    for e in ("tensor", "vector", "scalar"):
        assert d["per_core"][0][e]["busy_ns"] == rep.per_core_busy_ns[0][e]
    # the boxes on the engine tracks add up to the model's busy time
    doc = p.trace_json()
    names = _tracks(doc)
    per_lane = defaultdict(float)
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "instruction":
            per_lane[names[(e["pid"], e["tid"])]] += e["dur"] * 1000
    for e in ("tensor", "vector", "scalar"):
        assert per_lane[LANES[e]] == pytest.approx(rep.per_core_busy_ns[0][e], rel=1e-6)
    text = p.summary()
    assert f"{rep.total_ns / 1000:.3f} us" in text and "not a measurement" in text
    for part in ("per-engine busy / idle", "critical path", "top instructions", "DMA:",
                 "roofline"):
        assert part in text
    assert d["top"][0]["src"].split(":")[0].endswith("test_profile.py")
    assert 0 < d["dma"]["descriptor_efficiency"] <= 1


@jit
def zeroed_psum(a, b):
    """memset(psum, 0) then a matmul that overwrites it: the compiler drops the memset."""
    ta = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=ta, src=a)
    tb = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tb, src=b)
    p = nl.ndarray((a.shape[1], b.shape[1]), nl.float32, buffer=nl.psum)
    nisa.memset(dst=p, value=0.0)
    nisa.nc_matmul(dst=p, stationary=ta, moving=tb)
    s = nl.ndarray(p.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=s, src=p)
    out = nl.ndarray(p.shape, nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=s)
    return out


def test_dropped_instructions_have_no_box():
    p = profile(zeroed_psum, *_inputs(), target="trn3")
    doc = p.trace_json()
    seqs = {e["args"]["seq"] for e in doc["traceEvents"]
            if e["ph"] == "X" and e["cat"] == "instruction"}
    elided = doc["otherData"]["elided"]
    assert len(elided) == getattr(p.report, "elided", 0)
    assert seqs | set(elided) == set(range(p.report.n_instructions)) and not seqs & set(elided)


@jit
def loads(x, n):
    """``n`` loads of ``x`` competing for the same DMA queues, each consumed by VectorE."""
    for _ in range(n):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)


def test_wait_arrows_point_forward_in_time():
    p = profile(loads, np.ones((128, 4096), np.float32), 6, target="trn3")
    doc = p.trace_json()
    s = {e["id"]: e["ts"] for e in doc["traceEvents"] if e["ph"] == "s"}
    f = {e["id"]: e["ts"] for e in doc["traceEvents"] if e["ph"] == "f"}
    assert s and s.keys() == f.keys()
    assert all(f[k] >= s[k] - 1e-6 for k in s)


def test_lnc2_one_process_per_core():
    x = np.ones((256, 512), np.float32)
    p = profile(two_cores, x, target="trn2", lnc=2)
    doc = p.trace_json()
    pids = {e["pid"] for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "instruction"}
    assert pids == {0, 1} and len(p.summary_dict()["per_core"]) == 2
    assert "core 1 busy us" in p.summary()


def test_aggregation_past_the_limit():
    x = np.ones((128, 512), np.float32)
    with trace() as tr:
        chain(x, 200)
    full = profile_trace(tr, "trn3")
    small_doc = profile_trace(tr, "trn3", max_events=40).trace_json()
    assert not full.trace_json()["otherData"]["aggregated"]
    assert small_doc["otherData"]["aggregated"]
    xs = [e for e in small_doc["traceEvents"] if e["ph"] == "X" and e["cat"] != "launch"]
    assert len(xs) <= 40 and any(e["cat"] == "aggregate" for e in xs)
    names = _tracks(small_doc)
    counted = sum(e["args"].get("count", 1) for e in xs
                  if not names[(e["pid"], e["tid"])].startswith("DMA q"))
    assert counted == len(tr)
    # the summary always uses every instruction
    assert profile_trace(tr, "trn3", max_events=40).summary_dict() == full.summary_dict()


def test_side_by_side_device_and_model():
    modeled = {"total_ns": 2000.0, "engine_busy_ns": {"tensor": 1000.0, "dma": 1500.0},
               "hbm_bytes": 4096}
    device = {"total_time": 4e-6, "tensor_engine_active_time_percent": 50.0,
              "hbm_read_bytes": 2048, "hbm_write_bytes": 2048}
    text = side_by_side(device, modeled, "k")
    row = next(r for r in text.splitlines() if r.strip().startswith("total time"))
    assert row.split()[-3:] == ["4.000", "2.000", "2.00"]
    row = next(r for r in text.splitlines() if r.strip().startswith("tensor active"))
    assert row.split()[-3:] == ["2.000", "1.000", "2.00"]


# ------------------------------------------------------------------------------------------ CLI
def _smallest_matmul():
    from nki_kernels.bench import harness
    cases = harness.select(["matmul"], "fast", "trn3")
    return min(cases, key=lambda c: c.flops).shape


def test_cli_profile_op(tmp_path, capsys):
    shape = _smallest_matmul()
    assert main(["profile", "no_such_op", "--out", str(tmp_path)]) == 2
    assert "no_such_op" in capsys.readouterr().err
    assert main(["profile", "matmul", "--tier", "fast", "--shape", shape,
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "modeled profile of matmul" in out and "critical path" in out
    traces = list(tmp_path.glob("*.trace.json"))
    assert traces and json.loads(traces[0].read_text())["traceEvents"]
    # --dtype and --lnc narrow the bench cases; none left is an error naming the filters
    assert main(["profile", "matmul", "--tier", "fast", "--shape", shape, "--dtype", "nope",
                 "--out", str(tmp_path)]) == 2
    assert "dtype containing 'nope'" in capsys.readouterr().err
    assert main(["profile", "matmul", "--tier", "fast", "--shape", shape, "--lnc", "2",
                 "--out", str(tmp_path)]) == 2
    assert "at LNC 2" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    assert main(["profile", "matmul", "--tier", "fast", "--shape", shape, "--png", "0:5",
                 "--quiet", "--out", str(tmp_path)]) == 0
    png = next(tmp_path.glob("*.png")).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_cli_profile_module_kernel(tmp_path, capsys):
    mod = tmp_path / "thirdparty.py"
    mod.write_text(textwrap.dedent("""
        import numpy as np
        import nki
        import nki.isa as nisa
        import nki.language as nl

        @nki.jit
        def scale(x, factor):
            t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=factor)
            out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=t)
            return out

        def profile_inputs():
            return (np.ones((128, 64), np.float32), 2.0)
        """))
    out = tmp_path / "out"
    assert main(["profile", f"{mod}:scale", "--arg", "128x256:float32", "--arg", "3.0",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "modeled profile of scale" in text and "thirdparty.py:" in text
    assert main(["profile", f"{mod}:scale", "--out", str(out), "--quiet"]) == 0  # profile_inputs
    doc = json.loads(next(out.glob("scale_*.trace.json")).read_text())
    assert any(e.get("args", {}).get("opcode") == "tensor_scalar" for e in doc["traceEvents"])
    assert main(["profile", f"{mod}:nope", "--out", str(out)]) == 2


def test_cli_profile_device_without_device_is_one_line(tmp_path, capsys):
    assert main(["profile", "matmul", "--device", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nki-kernels profile --device:") and "\n" not in err
    assert "no Neuron device" in err or "not" in err


def test_cli_bench_profile_writes_each_row(tmp_path, capsys):
    shape = _smallest_matmul()
    rc = main(["bench", "--op", "matmul", "--tier", "fast", "--shape", shape, "--profile",
               "--out", str(tmp_path), "--no-plot", "--quiet"])
    assert rc == 0
    traces = list((tmp_path / "profiles").glob("*.trace.json"))
    assert traces
    row = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-1])
    summary = json.loads(open(row["profile"]["modeled_summary"]).read())
    assert summary["total_ns"] == pytest.approx(row["time_us"] * 1000)
