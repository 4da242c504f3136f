"""NKI Library QoR baselines as a calibration family: the extractor on a small fake test file of
our own (no NKI Library checkout needed) and the modeling hook on a tiny kernel of our own."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from nki_kernels.backend import nisa, nki, nl
from nki_kernels.bench import nkilib_qor as Q
from nki_kernels.emulator import qor_plugin as P
from nki_kernels.emulator import target, trace

# A test file of our own in the layout the extractor reads (parametrize tables, range
# tables); the values are made up.
FAKE = '''
import numpy as np
import pytest


class TestFake:
    # fmt: off
    fake_params = "vnc_degree, seqlen, d, dtype, tpbSgCyclesSum"
    fake_perms = [
        [2, 1024, 64, np.float32, 123e6],
        [1, 16 * 1024, 128, np.float16, 345e7],
        [2, 2048, 64, np.float16, 777e7 * 1.02],
        [2, 4096, 64, np.float16, None],
        [2, 512, 64, np.float16, (None, 11_222_333)],
        [2, 256, 64, np.float16, 1e9],
    ]
    # fmt: on

    @pytest.mark.parametrize(fake_params, fake_perms)
    def test_fake_unit(self, test_manager, vnc_degree, seqlen, d, dtype, tpbSgCyclesSum):
        compiler_args = CompilerArgs(logical_nc_config=vnc_degree)

    other_params = "seqlen, tpbSgCyclesSum"
    other_perms = [[128, 44_555_666]]

    @pytest.mark.parametrize(other_params, other_perms)
    def test_default_lnc(self, seqlen, tpbSgCyclesSum):
        compiler_args = CompilerArgs()


# fmt: off
# Parameters: vnc_degree, batch, hidden,
#             tpbSgCyclesSum, norm_type
RANGE_CASES = [
    [2, 1, 8192, 200000123, NormType.RMS_NORM],
    [1, 4, 8192, 92000000, NormType.RMS_NORM],
    [2, 4, 8192, 0, NormType.RMS_NORM],
    [2, 2, 8192, 210000456, NormType.RMS_NORM],
]
RANGE_CASES_MORE = [
    [2, 8, 8192, 150000789, NormType.NO_NORM],
]
# fmt: on


def unit_config():
    return RANGE_CASES + RANGE_CASES_MORE


class TestRange:
    @range_test_config(unit_config())
    def test_range_unit(self, range_test_options):
        pass
'''


@pytest.fixture
def fake_root(tmp_path):
    f = tmp_path / "test" / "integration" / "test_fake_kernel.py"
    f.parent.mkdir(parents=True)
    f.write_text(FAKE)
    (tmp_path / "test" / "integration" / "test_no_values.py").write_text("def test_x():\n    pass\n")
    return tmp_path


def test_extractor_keeps_measured_values_and_says_why_it_left_others(fake_root):
    data = Q.extract(fake_root, commit="abc")
    rows = {(r["table"], r["index"]): r for r in data["rows"]}
    left = {(e["table"], e["index"]): e["reason"] for e in data["excluded"]}
    r = rows[("fake_perms", 0)]
    assert r["value"] == 123e6 and r["unit"] == "ps" and r["platform"] == "trn2"
    assert r["test"] == "test_fake_unit" and r["params"] == {"vnc_degree": 2, "seqlen": 1024,
                                                             "d": 64, "dtype": "np.float32"}
    assert r["lnc"] == 2 and r["commit"] == "abc" and r["line"] == 10
    assert r["file"] == "test/integration/test_fake_kernel.py"
    assert rows[("fake_perms", 1)]["params"]["seqlen"] == 16384
    assert rows[("fake_perms", 1)]["lnc"] == 1           # logical_nc_config=vnc_degree
    assert "margin" in left[("fake_perms", 2)]
    assert "no value" in left[("fake_perms", 3)]
    pair = rows[("fake_perms", 4)]
    assert pair["value"] == 11222333 and pair["pair_position"] == 1
    assert pair["platform"].startswith("unstated")
    assert "round" in left[("fake_perms", 5)]
    assert rows[("other_perms", 0)]["lnc"] == 2           # CompilerArgs() default on trn2
    # range tables: schema from the comment, shared by the next table of the same width
    rr = rows[("RANGE_CASES", 0)]
    assert rr["kind"] == "range" and rr["test"] == "test_range_unit"
    assert rr["params"]["norm_type"] == "NormType.RMS_NORM" and rr["row_lnc"] == 2
    assert "round" in left[("RANGE_CASES", 1)]            # 92000000 among exact counts
    assert "placeholder" in left[("RANGE_CASES", 2)]
    assert rows[("RANGE_CASES_MORE", 0)]["value"] == 150000789
    assert Q.family_of("test/x/test_attention_cte.py") == "attention_cte"
    assert Q.family_of("test/x/test_mlp_tkg_model_config.py") == "mlp_tkg"


def test_published_table_in_repo_names_its_sources():
    data = Q.load()
    assert len(data["rows"]) >= 300 and data["commit"]
    fams = {r["family"] for r in data["rows"]}
    assert {"attention_cte", "mlp_cte", "mlp_tkg", "qkv_tkg", "rmsnorm_quant"} <= fams
    for r in data["rows"]:
        assert r["value"] > 0 and r["unit"] == "ps" and r["file"].endswith(".py") and r["line"] > 0
        assert r["value_text"] not in ("1e9", "92000000")


@nki.jit
def _tiny(a):
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    for i in range(4):
        t = nl.ndarray((128, 512), a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a[0:128, i * 512:(i + 1) * 512])
        u = nl.ndarray((128, 512), a.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=t)
        nisa.dma_copy(dst=out[0:128, i * 512:(i + 1) * 512], src=u)
    return out


def _item(tmp_path, params, rows=(), traces=None):
    opts = {"--qor-output": str(tmp_path / "r.jsonl"), "--qor-timeout": 30.0, "--qor-traces": traces}
    cfg = SimpleNamespace(getoption=lambda k, d=None: opts.get(k, d), _qor_rows=list(rows))
    return SimpleNamespace(config=cfg, nodeid="test_fake.py::test_k[x]", originalname="test_k",
                           path=Path("test_fake.py"),
                           callspec=SimpleNamespace(params=params, indices={"tpbSgCyclesSum": 0}))


def _drive_hook(item, body):
    """Run the plugin's pytest_runtest_call wrapper around ``body`` as pytest would."""
    gen = P.pytest_runtest_call(item)
    next(gen)
    exc = None
    try:
        body()
    except Exception as e:  # noqa: BLE001
        exc = (type(e), e, None)
    with pytest.raises(StopIteration):
        gen.send(SimpleNamespace(excinfo=exc))


def test_hook_models_the_kernel_run_and_writes_a_record(tmp_path):
    x = np.random.default_rng(0).standard_normal((128, 2048)).astype(np.float32)
    row = {"test": "test_k", "index": 0, "file": "t/test_fake.py", "line": 7, "family": "fake"}
    item = _item(tmp_path, {"seqlen": 128, "tpbSgCyclesSum": (5e6, None)}, [row])
    with target("trn2"):
        _drive_hook(item, lambda: _tiny(x))
        _drive_hook(_item(tmp_path, {"seqlen": 256, "tpbSgCyclesSum": 7e6}),
                    lambda: (_tiny(x), 1 / 0))
        _drive_hook(_item(tmp_path, {"seqlen": 64}), lambda: _tiny(x))  # no value: not recorded
    recs = [json.loads(s) for s in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    ok, bad = recs
    assert ok["outcome"] == "passed" and ok["family"] == "fake" and ok["source"] == "t/test_fake.py:7"
    assert ok["published_ns"] == pytest.approx(5e3) and ok["lnc"] == 1 and ok["target"] == "trn2"
    from nki_kernels.emulator.cost import model_trace
    with target("trn2"), trace() as tr:
        _tiny(x)
    assert ok["modeled_ns"] == pytest.approx(model_trace(tr, "trn2", lnc=1).makespan_ns)
    assert ok["ratio"] == pytest.approx(ok["modeled_ns"] / 5e3)
    assert bad["outcome"] == "failed" and "ZeroDivisionError" in bad["message"]
    fit = Q.fit(recs)
    assert fit["fake"]["n"] == 1 and math.isclose(fit["fake"]["median_abs_ln"],
                                                  abs(math.log(ok["ratio"])))
    assert "| fake | 1 |" in Q.report(recs)
    assert "| fake | test_k | 1 |" in Q.report(recs)     # per test function


def test_kept_traces_remodel_to_the_same_figure_and_follow_parameter_changes(tmp_path):
    x = np.random.default_rng(0).standard_normal((128, 2048)).astype(np.float32)
    with target("trn2"):
        _drive_hook(_item(tmp_path, {"seqlen": 128, "tpbSgCyclesSum": 5e6},
                          traces=str(tmp_path / "tr")), lambda: _tiny(x))
    rec = json.loads((tmp_path / "r.jsonl").read_text())
    assert (tmp_path / "tr" / rec["trace_file"]).exists()
    out = tmp_path / "again.jsonl"
    assert Q.remodel([rec], tmp_path / "tr", out) == 1
    again = json.loads(out.read_text())
    assert again["modeled_ns"] == pytest.approx(rec["modeled_ns"]) and again["nodeid"] == rec["nodeid"]
    Q.remodel([rec], tmp_path / "tr", out, {"dma_bw_q": 11.5})      # half the queue bandwidth
    slow = json.loads(out.read_text())
    assert slow["modeled_ns"] > 1.3 * rec["modeled_ns"]
    assert Q._overrides(["dma_bw_q=11.5", "rename_onchip=false"]) == {"dma_bw_q": 11.5,
                                                                       "rename_onchip": False}


def test_range_rows_match_on_their_numeric_fields():
    rows = [{"params": {"vnc_degree": 2, "batch": 1, "hidden": 8192, "fused_add": False},
             "value": 1.0},
            {"params": {"vnc_degree": 2, "batch": 4, "hidden": 8192, "fused_add": False},
             "value": 2.0}]
    cfg = {"vnc_degree": 2, "batch": 4, "hidden": 8192, "fused_add": 0, "norm_type": 1}
    assert [r["value"] for r in P.match_range_row(cfg, rows)] == [2.0]
    assert P.match_range_row(dict(cfg, batch=3), rows) == []
    # enum members written by name resolve through the test module's names
    import enum

    class NormType(enum.Enum):
        RMS = 1
        LAYER = 2
    rows[1]["params"]["norm_type"] = "NormType.LAYER"
    assert P.match_range_row(cfg, rows, {"NormType": NormType}) == []
    assert P.match_range_row(dict(cfg, norm_type=2), rows, {"NormType": NormType}) == [rows[1]]
