"""Model NKI Library's QoR cases on the emulator, through their own harness.

Load it beside the emulator's harness plugin::

    nki-kernels simulate-suite /path/to/nki-library --nki-version 0.3 --target trn2 -- \\
        test/integration/nkilib/core/rmsnorm/test_rmsnorm_quant.py \\
        -p nki_kernels.emulator.qor_plugin --qor-output results.jsonl [--qor-timeout 120] \\
        [--qor-min-us 100] [--qor-max-us 300] [--qor-only]

For every test whose parameters carry a published device figure (``tpbSgCyclesSum`` or
``cyclesQoR``), or, for NKI Library's range-test tables, whose configuration matches exactly one
row of ``bench/calibration/nkilib_qor.json`` (``--qor-table``), the test body runs inside
``nki_kernels.emulator.trace()``; the first kernel launch it records is modeled with
``cost.model_trace(trace, target, lnc=...)`` (target and LNC as the launch ran them), and one JSON
line is appended to ``--qor-output``: node id, family, published value (ps) and ns, modeled
makespan (ns), ratio, LNC, binding engine, the test's outcome. Nothing of the kernel or the
harness is changed. ``--qor-only`` deselects tests without a published value, ``--qor-max-us``
/ ``--qor-min-us`` those whose published time is outside the range, and the rest run smallest
published value first.
``--qor-timeout`` stops a test after that many seconds (SIGALRM; recorded as ``timeout``).
``--qor-traces DIR`` also keeps each modeled launch's trace (gzipped pickle, named in the line's
``trace_file``), so ``bench/nkilib_qor.py remodel`` can re-model the cases after a cost-model
change without running the suite again.
All modeled figures are the analytical cost model's, never a measurement.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import signal
import time
from pathlib import Path

import pytest

VALUE_NAMES = ("tpbSgCyclesSum", "cyclesQoR")
# range-test dimension names (NKI Library test files) -> the table's field names
ALIASES = {"b": "batch", "s": "seqlen", "h": "hidden", "i": "intermediate", "vnc": "vnc_degree",
           "fa": "fused_add", "sa": "store_add"}
_DEFAULT_TABLE = Path(__file__).resolve().parents[2] / "bench" / "calibration" / "nkilib_qor.json"


class QorTimeout(Exception):
    """Raised in a test that ran longer than --qor-timeout."""


def pytest_addoption(parser):
    g = parser.getgroup("nki-kernels QoR modeling")
    g.addoption("--qor-output", default=None, help="append one JSON line per QoR case here")
    g.addoption("--qor-table", default=str(_DEFAULT_TABLE),
                help="published values extracted by bench/nkilib_qor.py (range-test matching)")
    g.addoption("--qor-timeout", type=float, default=0.0, help="seconds per test (0: none)")
    g.addoption("--qor-only", action="store_true", help="deselect tests without a published value")
    g.addoption("--qor-max-us", type=float, default=0.0,
                help="deselect cases whose published time exceeds this (us)")
    g.addoption("--qor-min-us", type=float, default=0.0,
                help="deselect cases whose published time is below this (us)")
    g.addoption("--qor-traces", default=None,
                help="keep each modeled launch's trace here (for bench/nkilib_qor.py remodel)")


# --------------------------------------------------------------------------- published values
def _first_number(v):
    if isinstance(v, (tuple, list)):
        for x in v:
            if isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0:
                return float(x)
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return float(v)
    return None


def _norm(v):
    v = getattr(v, "value", v)
    if isinstance(v, bool):
        return int(v)
    return v


def _range_config(item):
    cs = getattr(item, "callspec", None)
    opts = cs.params.get("range_test_options") if cs else None
    tensors = getattr(opts, "tensors", None)
    if not isinstance(tensors, dict):
        return None
    flat = {}
    for sub in tensors.values():
        if isinstance(sub, dict):
            flat.update({ALIASES.get(k, k): _norm(v) for k, v in sub.items()})
    return flat


def _resolve(v, namespace):
    """A table field written as a name (``NormType.RMS_NORM``) as the value the test module gives
    it; numbers and booleans as they are; anything else unresolved (None)."""
    if isinstance(v, (int, float)):
        return _norm(v)
    if isinstance(v, str) and namespace is not None and v.count(".") == 1:
        cls, member = v.split(".")
        obj = getattr(namespace.get(cls), member, None) if cls in namespace else None
        if obj is not None:
            return _norm(obj)
    return None


def match_range_row(config: dict, rows: list[dict], namespace=None):
    """The table rows whose fields all equal the config's (same names): numbers, booleans and,
    given the test module's ``namespace``, enum members written by name."""
    out = []
    for r in rows:
        vals = {k: _resolve(v, namespace) for k, v in r["params"].items() if k in config}
        common = [k for k, v in vals.items() if v is not None]
        if len(common) < 3:
            continue
        if all(vals[k] == config[k] for k in common):
            out.append(r)
    return out


def published_of(item, table_rows):
    """(value in ps, table row or None, how it was found) of a collected test, or None."""
    cs = getattr(item, "callspec", None)
    if cs is None:
        return None
    for name in VALUE_NAMES:
        if name in cs.params:
            v = _first_number(cs.params[name])
            if v is None:
                return None
            idx = getattr(cs, "indices", {}).get(name)
            row = next((r for r in table_rows if r["test"] == item.originalname
                        and r["index"] == idx and Path(r["file"]).name == item.path.name), None)
            return v, row, "parameter"
    cfg = _range_config(item)
    if cfg is None:
        return None
    cands = [r for r in table_rows if Path(r["file"]).name == item.path.name
             and r["test"] == item.originalname]
    mod = getattr(item, "module", None)
    hits = match_range_row(cfg, cands, vars(mod) if mod is not None else None)
    vals = {r["value"] for r in hits}
    if len(vals) == 1:
        return float(hits[0]["value"]), hits[0], f"range row ({len(hits)} identical)"
    return None


# --------------------------------------------------------------------------- hooks
def pytest_configure(config):
    config._qor_rows = []
    path = config.getoption("--qor-table", None)
    if path and os.path.exists(path):
        config._qor_rows = json.loads(Path(path).read_text()).get("rows", [])


def pytest_collection_modifyitems(session, config, items):
    if not (config.getoption("--qor-only") or config.getoption("--qor-max-us")
            or config.getoption("--qor-min-us")):
        return
    keep, drop = [], []
    cap = config.getoption("--qor-max-us") * 1e6   # us -> ps
    floor = config.getoption("--qor-min-us") * 1e6
    for it in items:
        pub = published_of(it, config._qor_rows)
        if pub is None or (cap and pub[0] > cap) or pub[0] < floor:
            drop.append(it)
        else:
            keep.append((pub[0], it))
    keep.sort(key=lambda p: p[0])
    items[:] = [it for _, it in keep]
    if drop:
        config.hook.pytest_deselected(items=drop)


def _first_launch(tr):
    from .trace import Trace
    launches = list(tr.launches)
    if len(launches) <= 1:
        return tr, len(launches)
    one = Trace()
    stop = launches[1].get("first_instruction", len(tr.instructions))
    one.instructions = tr.instructions[:stop]
    one.launches = launches[:1]
    return one, len(launches)


def model_record(tr, published_ps=None, params=None):
    """Model the first launch of a recorded trace: a dict of the figures the report uses.
    ``params``: cost-parameter overrides (``model_trace``'s; sensitivity only)."""
    from .cost import model_trace
    one, n = _first_launch(tr)
    if not one.instructions:
        return {"n_launches": n, "modeled_ns": None}
    L = one.launches[0] if one.launches else {}
    target = L.get("target", "trn2")
    lnc = int(L.get("lnc", 1))
    rep = model_trace(one, target, lnc=lnc, params=params)
    rec = {"target": target, "lnc": lnc, "kernel": L.get("kernel"), "n_launches": n,
           "modeled_ns": rep.makespan_ns, "binding": rep.binding_engine,
           "busy_ns": {k: round(v, 1) for k, v in rep.engine_busy_ns.items() if v},
           "n_instructions": rep.n_instructions, "hbm_bytes": rep.hbm_bytes,
           "tensor_flops": rep.tensor_flops, "throttle_ns": rep.throttle_ns,
           "dma_transfers": rep.dma_transfers, "dma_bytes": rep.dma_bytes,
           "dma_descriptors": rep.dma_descriptors}
    if published_ps:
        rec["ratio"] = rep.makespan_ns / (published_ps / 1e3)
    return rec


def save_trace(tr, folder, key) -> str:
    """Pickle ``tr`` (gzipped) into ``folder`` under a name derived from ``key``; the name."""
    name = hashlib.sha1(key.encode()).hexdigest()[:16] + ".pkl.gz"
    os.makedirs(folder, exist_ok=True)
    with gzip.open(os.path.join(folder, name), "wb") as f:
        pickle.dump(tr, f, protocol=pickle.HIGHEST_PROTOCOL)
    return name


def load_trace(folder, name):
    with gzip.open(os.path.join(folder, name), "rb") as f:
        return pickle.load(f)


def _alarm(signum, frame):
    raise QorTimeout("--qor-timeout reached")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    out = item.config.getoption("--qor-output")
    pub = published_of(item, item.config._qor_rows) if out else None
    if pub is None:
        yield
        return
    from .trace import trace
    limit = item.config.getoption("--qor-timeout")
    old = None
    if limit:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
    t0 = time.time()
    with trace() as tr:
        outcome = yield
    if limit:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    wall = time.time() - t0
    value, row, how = pub
    rec = {"nodeid": item.nodeid, "test": item.originalname,
           "family": (row or {}).get("family") or _family(item.path.name),
           "published_ps": value, "published_ns": value / 1e3, "match": how,
           "source": f"{row['file']}:{row['line']}" if row else None, "wall_s": round(wall, 1),
           "row_lnc": (row or {}).get("row_lnc")}
    exc = outcome.excinfo
    if exc is None:
        rec["outcome"] = "passed"
    else:
        e = exc[1]
        rec["outcome"] = "timeout" if isinstance(e, QorTimeout) else (
            "skipped" if isinstance(e, pytest.skip.Exception) else "failed")
        rec["message"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    if rec["outcome"] in ("passed", "failed") and tr.launches:
        try:
            rec.update(model_record(tr, value))
        except Exception as e:  # noqa: BLE001 - report, never break the suite
            rec["model_error"] = f"{type(e).__name__}: {e}"[:300]
        keep = item.config.getoption("--qor-traces")
        if keep and rec.get("modeled_ns") is not None:
            rec["trace_file"] = save_trace(_first_launch(tr)[0], keep, item.nodeid)
    if rec["outcome"] == "failed" and not tr.launches:
        rec["modeled_ns"] = None
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _family(filename):
    stem = filename.removesuffix(".py").removeprefix("test_")
    return {"output_proj_cte": "output_projection_cte",
            "output_proj_tkg": "output_projection_tkg"}.get(stem, stem)
