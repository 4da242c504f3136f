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
