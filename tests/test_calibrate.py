"""The calibration harness (nki-kernels calibrate): the published-points table and the run on a
folder of kernels, here two tiny kernels of our own written into a temporary folder."""
import json
import math

import pytest

from nki_kernels.bench import calibrate as C

KERNEL = '''
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def k(a, b):
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    for i in range({n}):
        t = nl.ndarray((128, 512), a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a[0:128, 0:512])
        u = nl.ndarray((128, 512), a.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=t)
        nisa.dma_copy(dst=out[0:128, 0:512], src=u)
    return out
'''


def test_published_points_name_their_source():
    points = C.load_points()
    assert len(points) >= 10
    for p in points:
        assert p["metric"] in ("mfu", "time_us")
        assert p["source"].startswith("https://")
        assert p["target"] in ("trn2", "trn3") and p["lnc"] in (1, 2)
        assert p["repo"].count("/") == 1 and p["path"].endswith(".py")
    assert len({p["id"] for p in points}) == len(points)


def test_harness_reports_ratio_and_ordering(tmp_path, capsys):
    pts = []
    for i, (n, pub) in enumerate([(4, 10.0), (16, 30.0)]):
        path = f"k{i}.py"
        f = tmp_path / "ours+calib" / path
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(KERNEL.format(n=n))
        pts.append({"id": f"k{i}", "family": "copy", "repo": "ours/calib", "commit": "HEAD",
                    "path": path, "inputs": [[128, 512, "float32"], [128, 512, "float32"]],
                    "flops": 0, "target": "trn2", "lnc": 1, "metric": "time_us",
                    "published": pub, "source": "https://example.invalid"})
    pts.append(dict(pts[0], id="gone", path="missing.py"))
    data = tmp_path / "points.json"
    data.write_text(json.dumps({"points": pts}))
    results = C.run(C.load_points(data), tmp_path)
    ok = [r for r in results if r.status == "ok"]
    assert [r.point["id"] for r in ok] == ["k0", "k1"]
    assert [r.status for r in results if r.point["id"] == "gone"] == ["missing"]
    for r in ok:
        assert r.ratio == pytest.approx(r.modeled_ns / (r.point["published"] * 1e3))
    fit = C.fit(results)["copy"]
    assert fit["n"] == 2 and fit["pairs"] == 1 and fit["ordered"] == 1   # 16 copies take longer
    assert fit["median_abs_ln"] == pytest.approx(
        sorted(abs(math.log(r.ratio)) for r in ok)[0] / 2 + sorted(
            abs(math.log(r.ratio)) for r in ok)[1] / 2)
    # what-if runs change the model, never the defaults
    slow = C.run(C.load_points(data)[:1], tmp_path, params={"dma_bw_q": 2.3})
    assert slow[0].modeled_ns > ok[0].modeled_ns
    assert C.main(["--kernels", str(tmp_path), "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert "pairs ordered as on hardware: 1/1" in out and "missing" in out


def _point(pid, path, published, metric="time_us", family="copy", **extra):
    return {"id": pid, "family": family, "repo": "ours/calib", "commit": "HEAD", "path": path,
            "inputs": [[128, 512, "float32"], [128, 512, "float32"]], "flops": 0,
            "target": "trn2", "lnc": 1, "metric": metric, "published": published,
            "source": "https://example.invalid", **extra}


def test_mixed_metrics_are_ordered_by_time_and_ties_only_between_mfu_points():
    def res(pid, metric, published, pub_ns, mod_ns):
        return C.Result({"id": pid, "family": "f", "metric": metric, "published": published},
                        "ok", modeled_ns=mod_ns, published_ns=pub_ns)
    a = res("a", "mfu", 60.0, 100.0, 100.0)
    b = res("b", "mfu", 61.0, 98.0, 120.0)      # within 2 MFU points of a: a tie, counted as good
    c = res("c", "time_us", 0.2, 200.0, 90.0)   # slowest on hardware, fastest in the model
    assert C.ordered_pairs([a, b]) == (1, 1)
    assert C.ordered_pairs([a, c]) == (0, 1)    # an MFU and a time point: compared in time
    assert C.ordered_pairs([a, b, c]) == (1, 3)
    c.modeled_ns = 300.0
    assert C.ordered_pairs([a, b, c]) == (3, 3)
    assert C.fit([a, b, c])["f"]["median_abs_ln"] == pytest.approx(abs(math.log(1.2 * 100 / 98)))


def test_failing_and_heavy_points_are_reported_not_crashed(tmp_path):
    root = tmp_path / "ours+calib"
    root.mkdir()
    (root / "ok.py").write_text(KERNEL.format(n=2))
    (root / "beta1.py").write_text("import neuronxcc.nki.language as nl\n")
    (root / "boom.py").write_text(KERNEL.format(n=2).replace("return out", "raise KeyError('x')"))
    pts = [_point("ok", "ok.py", 5.0), _point("beta1", "beta1.py", 5.0),
           _point("boom", "boom.py", 5.0), _point("big", "ok.py", 5.0, heavy="needs 12 GB"),
           _point("gone", "nothing_here.py", 5.0)]
    by_id = {r.point["id"]: r for r in C.run(pts, tmp_path)}
    assert {k: r.status for k, r in by_id.items()} == {
        "ok": "ok", "beta1": "error", "boom": "error", "big": "skipped", "gone": "missing"}
    assert "neuronxcc" in by_id["beta1"].message and "KeyError" in by_id["boom"].message
    assert "needs 12 GB" in by_id["big"].message
    assert C.fit(list(by_id.values()))["copy"]["n"] == 1
    big = C.run(pts[3:4], tmp_path, heavy=True)[0]
    assert big.status == "ok" and big.modeled_ns == pytest.approx(by_id["ok"].modeled_ns)
    assert "skipped" in C.table(list(by_id.values()))


def test_main_selects_points_by_id_and_runs_heavy_on_request(tmp_path, capsys):
    root = tmp_path / "ours+calib"
    root.mkdir()
    (root / "ok.py").write_text(KERNEL.format(n=2))
    data = tmp_path / "points.json"
    data.write_text(json.dumps({"points": [_point("ok", "ok.py", 5.0),
                                           _point("big", "ok.py", 5.0, heavy="slow")]}))
    base = ["--kernels", str(tmp_path), "--data", str(data)]
    assert C.main(base + ["--id", "big"]) == 0
    out = capsys.readouterr().out
    assert "| big |" in out and "skipped" in out and "| ok |" not in out
    assert C.main(base + ["--id", "big", "--heavy"]) == 0
    out = capsys.readouterr().out
    assert "skipped" not in out and "copy: n=1" in out


PKG_UTIL = '''
import nki.isa as nisa
from nki_kernels.emulator import versions

SEEN = []


def copy_through(dst, src):
    SEEN.append(versions.current())
    nisa.tensor_copy(dst=dst, src=src)
'''

PKG_KERNEL = '''
import nki
import nki.isa as nisa
import nki.language as nl

from ..util import copy_through


@nki.jit
def kern(a):
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((128, 512), a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a[0:128, 0:512])
    u = nl.ndarray((128, 512), a.dtype, buffer=nl.sbuf)
    copy_through(u, t)
    nisa.dma_copy(dst=out[0:128, 0:512], src=u)
    return out
'''


def test_package_kernel_runs_under_its_nki_version(tmp_path, monkeypatch):
    import sys

    from nki_kernels.emulator import versions
    monkeypatch.setattr(sys, "path", list(sys.path))       # run() puts import_root on sys.path
    pkg = tmp_path / "ours+lib" / "src" / "calibpkg_t"
    (pkg / "core").mkdir(parents=True)
    for f in ("__init__.py", "core/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "util.py").write_text(PKG_UTIL)
    (pkg / "core" / "kern.py").write_text(PKG_KERNEL)
    pt = dict(_point("pkg", "src/calibpkg_t/core/kern.py", 5.0), repo="ours/lib",
              inputs=[[128, 512, "float32"]], import_root="src", nki_version="0.3")
    before = versions.current()
    try:
        (r,) = C.run([pt], tmp_path)
        assert r.status == "ok", r.message
        util = sys.modules["calibpkg_t.util"]   # imported by dotted name: the relative import resolved
        assert util.SEEN == ["0.3"] and versions.current() == before
        assert r.modeled_ns > 0
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "calibpkg_t"]:
            del sys.modules[name]


def test_print_fetch_extracts_a_package_once():
    pts = [_point("a", "src/pkg/x.py", 1.0, import_root="src"),
           _point("b", "src/pkg/y.py", 2.0, import_root="src"), _point("c", "k.py", 3.0)]
    cmds = C.fetch_commands(pts, "/kern")
    assert len(cmds) == 2
    assert cmds[0] == ('mkdir -p "/kern/ours+calib" && git -C "$CLONE_ours_calib" archive HEAD src '
                       '| tar -x -C "/kern/ours+calib"')
    assert cmds[1].endswith('show HEAD:k.py > "/kern/ours+calib/k.py"')
