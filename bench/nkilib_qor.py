"""NKI Library's per-test device baselines (``tpbSgCyclesSum``) as a calibration family.

NKI Library's integration tests carry, per parametrized case, the device-profile figure its CI
compares runs against (``tpbSgCyclesSum``; ``cyclesQoR`` in the QKV TKG file). This module reads
those test files **as data** (Python's ``ast``, nothing imported or executed) and writes one row
per case with a usable value to ``bench/calibration/nkilib_qor.json``; rows left out are listed
apart with the reason. ``report`` joins the table with the JSON lines that
``nki_kernels.emulator.qor_plugin`` writes while NKI Library's own harness runs on the emulator,
and prints the fit per kernel family. Every modeled figure is the analytical cost model's.

    python bench/nkilib_qor.py extract NKILIB_ROOT [--commit SHA] [--out PATH]
    python bench/nkilib_qor.py report RESULTS.jsonl [RESULTS.jsonl ...] [--family NAME]

Unit and platform (from the harness at the commit read; see docs/cost-model.md):

* ``TpbSgCyclesSum`` is ``CycleCount`` of the profiled graph per physical core from
  ``neuron-profile``'s show-session JSON, IQR-filtered over runs, max over the cores of the logical
  core (test/utils/metrics_collector.py). The harness labels it a count ("cycles", test/README.md);
  the values scale as picoseconds of kernel time (attention_cte causal 16K d=64: 1.96e9 vs
  1947 us measured elsewhere), so the table stores them as ``ps`` and the report converts to ns.
* Platform: ``--platform-target`` defaults to ``trn2`` (test/conftest.py) and ``CompilerArgs``
  to ``Platforms.TRN2`` with LNC 2 when ``logical_nc_config`` is not given
  (test/utils/common_dataclasses.py). A value given as a pair ``(a, b)`` has no documented meaning
  of its positions; the row keeps both and is flagged ``pair``.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import re
import statistics
import sys
from pathlib import Path

DATA = Path(__file__).with_name("calibration") / "nkilib_qor.json"
VALUE_NAMES = ("tpbSgCyclesSum", "cyclesQoR")
DEFAULT_LNC = {"trn2": 2, "trn3": 2}   # CompilerArgs without logical_nc_config
LNC_NAMES = ("vnc_degree", "lnc_degree", "lnc", "vnc")
FAMILIES = (  # test file stem -> kernel family
    ("test_attention_cte", "attention_cte"), ("test_mlp_cte", "mlp_cte"),
    ("test_mlp_tkg", "mlp_tkg"), ("test_qkv_tkg", "qkv_tkg"), ("test_qkv_cte", "qkv_cte"),
    ("test_rmsnorm_quant", "rmsnorm_quant"), ("test_output_proj_cte", "output_projection_cte"),
    ("test_output_proj_tkg", "output_projection_tkg"),
    ("test_find_nonzero_indices_with_count", "find_nonzero_indices"),
)


def family_of(path: str) -> str:
    stem = Path(path).stem.replace("_model_config", "")
    for prefix, fam in FAMILIES:
        if stem == prefix:
            return fam
    return stem.removeprefix("test_")


# --------------------------------------------------------------------------- reading literals
class _Src:
    def __init__(self, text):
        self.text = text
        self.lines = text.splitlines()

    def seg(self, node):
        return ast.get_source_segment(self.text, node) or ast.dump(node)


def _value(node, src):
    """A literal of a test table as JSON-able data: numbers and arithmetic on them, booleans,
    None, tuples / lists; names and calls become their source text (``NormType.RMS_NORM``)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        return [_value(e, src) for e in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _value(node.operand, src)
        return -v if isinstance(v, (int, float)) else src.seg(node)
    if isinstance(node, ast.BinOp):
        a, b = _value(node.left, src), _value(node.right, src)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) \
                and not isinstance(a, bool) and not isinstance(b, bool):
            ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b,
                   ast.FloorDiv: lambda: a // b, ast.Div: lambda: a / b}
            f = ops.get(type(node.op))
            if f:
                return f()
    return src.seg(node)


def _sig_digits(literal: str) -> int:
    """Significant digits of a number as written (``92000000`` -> 2, ``683_281_265`` -> 9,
    ``196e7`` -> 3, ``1e9`` -> 1)."""
    s = literal.replace("_", "").lower().lstrip("+-")
    mant = s.split("e")[0].replace(".", "").lstrip("0")
    return len(mant.rstrip("0")) or 1


def _one_digit_as_written(literal: str) -> bool:
    """``1e9``, ``2e8``, ``1000000000``: one digit and a power of ten (not ``60e6``, a figure
    rounded to the two digits its table uses)."""
    s = literal.replace("_", "").lower()
    return bool(re.fullmatch(r"\d(\.0*)?e\d+|\d0{5,}", s))


def _margin(node) -> bool:
    """``950e7 * 1.02``-style values: a figure with a margin applied."""
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and any(
        isinstance(x, ast.Constant) and isinstance(x.value, float) and 0.5 < x.value < 2.0
        for x in (node.left, node.right))


# --------------------------------------------------------------------------- schemas
def _names(s: str) -> list[str]:
    return [n.strip() for n in re.split(r"[,\s]+", s.strip(" []#")) if n.strip()]


def _comment_schema(src: _Src, lineno: int) -> list[str] | None:
    """Names listed in the comment block right above line ``lineno`` (1-based)."""
    block = []
    i = lineno - 2
    while i >= 0 and src.lines[i].strip().startswith("#"):
        line = src.lines[i].strip().lstrip("#").strip()
        if not line.startswith("fmt:"):
            block.insert(0, line)
        i -= 1
    text = " ".join(block)
    if not any(v in text for v in VALUE_NAMES):
        return None
    head = text.split(",")[0]
    return _names(text[head.rfind(":") + 1:] if ":" in head else text)


def _docstring_schema(tree) -> list[str] | None:
    doc = ast.get_docstring(tree) or ""
    m = re.search(r"Config format:\s*\{?[^\[]*\[\[?([^\]]*)\]", doc, re.S)
    if m and any(v in m.group(1) for v in VALUE_NAMES):
        return _names(m.group(1))
    return None


def _row_nodes(node):
    """The rows of a table literal: a list of lists/tuples, or a dict of such lists."""
    if isinstance(node, (ast.List, ast.Tuple)):
        rows = [e for e in node.elts if isinstance(e, (ast.List, ast.Tuple))]
        return [(None, r) for r in rows] if rows and len(rows) == len(node.elts) else []
    if isinstance(node, ast.Dict):
        out = []
        for k, v in zip(node.keys, node.values):
            for _, r in _row_nodes(v):
                out.append((ast.unparse(k) if k is not None else None, r))
        return out
    return []


# --------------------------------------------------------------------------- the extractor
def _functions(tree):
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield n


def _refs(fn) -> set[str]:
    return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}


def _lnc_rule(fn, src):
    """How a test function sets LNC: ('param', name) | ('default',) | ('config',) | None."""
    if fn is None:
        return None
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and src.seg(n.func).endswith("CompilerArgs"):
            for kw in n.keywords:
                if kw.arg == "logical_nc_config":
                    if isinstance(kw.value, ast.Name):
                        return ("param", kw.value.id)
                    return ("config", src.seg(kw.value))
            return ("default",)
    return None


def extract_file(path: Path, rel: str, commit: str | None = None):
    """(rows, excluded) of one test file."""
    text = Path(path).read_text()
    src = _Src(text)
    tree = ast.parse(text)
    assigns = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            assigns[n.targets[0].id] = n
    funcs = list(_functions(tree))
    # parametrize(PARAMS, PERMS) pairs -> (names, test function)
    pairing = {}
    for fn in funcs:
        for d in fn.decorator_list:
            if isinstance(d, ast.Call) and src.seg(d.func).endswith("parametrize") and len(d.args) >= 2:
                a0, a1 = d.args[0], d.args[1]
                names = None
                if isinstance(a0, ast.Constant) and isinstance(a0.value, str):
                    names = _names(a0.value)
                elif isinstance(a0, ast.Name) and a0.id in assigns and isinstance(
                        assigns[a0.id].value, ast.Constant):
                    names = _names(assigns[a0.id].value.value)
                if names and isinstance(a1, ast.Name):
                    pairing[a1.id] = (names, fn)
    doc_schema = _docstring_schema(tree)
    rows, excluded = [], []
    fam = family_of(rel)
    last_schema = {}   # row length -> the schema of the last table of that width (shared comment)
    for name, node in sorted(assigns.items(), key=lambda kv: kv[1].lineno):
        table = _row_nodes(node.value)
        if not table:
            continue
        width = len(table[0][1].elts)
        if name in pairing:
            names, fn, kind = pairing[name][0], pairing[name][1], "parametrize"
        else:
            names = _comment_schema(src, node.lineno) or doc_schema or last_schema.get(width)
            fn, kind = None, "range"
            if names:   # the test function reaching this table (directly or via a helper)
                users = [f for f in funcs if name in _refs(f)]
                tests = [f for f in users if f.name.startswith("test_")]
                for u in users:
                    tests += [f for f in funcs if f.name.startswith("test_")
                              and any(u.name in _refs(dd) for dd in f.decorator_list
                                      if isinstance(dd, ast.AST))]
                fn = tests[0] if tests else None
        if not names or not any(v in names for v in VALUE_NAMES):
            continue
        last_schema[len(names)] = names
        vname = next(v for v in VALUE_NAMES if v in names)
        vi = names.index(vname)
        values_written = []
        for _, r in table:
            if len(r.elts) == len(names):
                values_written.append(r.elts[vi])
        digits = [_sig_digits(src.seg(v)) for v in values_written
                  if isinstance(v, ast.Constant) and isinstance(v.value, (int, float))
                  and not isinstance(v.value, bool) and v.value]
        exact_table = bool(digits) and statistics.median(digits) >= 6
        lnc_rule = _lnc_rule(fn, src)
        for idx, (group, r) in enumerate(table):
            where = {"file": rel, "line": r.lineno, "table": name, "index": idx}
            if len(r.elts) != len(names):
                excluded.append({**where, "reason": f"row has {len(r.elts)} fields, schema "
                                                    f"{len(names)}"})
                continue
            params = {n: _value(e, src) for n, e in zip(names, r.elts)}
            vnode = r.elts[vi]
            raw = params.pop(vname)
            pair = None
            if isinstance(vnode, ast.Tuple):
                pair = raw
                present = [(i, v) for i, v in enumerate(raw) if isinstance(v, (int, float))]
                if not present:
                    excluded.append({**where, "reason": "no value (None)"})
                    continue
                pos, raw = present[0]
                vnode = vnode.elts[pos]
            reason = None
            if raw is None or isinstance(raw, str):
                reason = "no value" if raw is None else f"not a number: {raw}"
            elif _margin(vnode):
                reason = f"value with a margin: {src.seg(vnode)}"
            elif not raw or raw <= 0:
                reason = f"placeholder {raw}"
            else:
                d = _sig_digits(src.seg(vnode)) if isinstance(vnode, ast.Constant) else 9
                if exact_table and d <= 3:
                    reason = f"round hand-set threshold {src.seg(vnode)} in a table of measured counts"
                elif d == 1 and _one_digit_as_written(src.seg(vnode)):
                    reason = f"round hand-set threshold {src.seg(vnode)}"
            if reason:
                excluded.append({**where, "reason": reason})
                continue
            lnc, lnc_basis = None, ""
            row_lnc = next((params[n] for n in LNC_NAMES if n in params), None)
            if kind == "range":
                lnc, lnc_basis = None, "range-test table: the LNC run is recorded by qor_plugin"
            elif lnc_rule and lnc_rule[0] == "param":
                lnc = params.get(lnc_rule[1])
                lnc_basis = f"CompilerArgs(logical_nc_config={lnc_rule[1]})"
            elif lnc_rule and lnc_rule[0] == "default":
                lnc, lnc_basis = DEFAULT_LNC["trn2"], "CompilerArgs() default on trn2"
            else:
                lnc, lnc_basis = row_lnc, "the row's LNC field"
            row = {"family": fam, "file": rel, "line": r.lineno, "table": name, "index": idx,
                   "test": fn.name if fn else None, "kind": kind, "params": params,
                   "lnc": lnc, "lnc_basis": lnc_basis, "row_lnc": row_lnc,
                   "platform": "trn2" if pair is None else "unstated (pair)",
                   "value": raw, "unit": "ps", "value_name": vname, "value_text": src.seg(vnode)}
            if group:
                row["group"] = group
            if pair is not None:
                row["pair"] = pair
                row["pair_position"] = pos
            if commit:
                row["commit"] = commit
            rows.append(row)
    return rows, excluded


def _drop_copied(rows):
    """Rows of one file sharing an exact value written with >= 6 significant digits while their
    parameters differ: a baseline copied from one case to others, not a measurement of each."""
    seen = {}
    for r in rows:
        if _sig_digits(r["value_text"]) >= 6:
            seen.setdefault((r["file"], r["value"]), []).append(r)
    bad = {id(r) for rs in seen.values() if len(rs) > 1
           and len({json.dumps(x["params"], sort_keys=True) for x in rs}) > 1 for r in rs}
    keep = [r for r in rows if id(r) not in bad]
    gone = [{"file": r["file"], "line": r["line"], "table": r["table"], "index": r["index"],
             "reason": f"exact value {r['value_text']} shared by rows with other parameters "
                       f"(a copied baseline)"} for r in rows if id(r) in bad]
    return keep, gone


def extract(root: Path, commit: str | None = None) -> dict:
    root = Path(root)
    rows, excluded = [], []
    for p in sorted((root / "test").rglob("test_*.py")):
        text = p.read_text(errors="replace")
        if not any(v in text for v in VALUE_NAMES):
            continue
        rel = str(p.relative_to(root))
        r, e = extract_file(p, rel, commit)
        rows += r
        excluded += e
    rows, copied = _drop_copied(rows)
    excluded += copied
    return {"source": "github.com/aws-neuron/nki-library", "commit": commit,
            "unit": "ps (TpbSgCyclesSum: neuron-profile CycleCount, max over physical cores)",
            "rows": rows, "excluded": excluded}


# --------------------------------------------------------------------------- report
def load(path: Path = DATA) -> dict:
    return json.loads(Path(path).read_text())


def read_results(paths) -> list[dict]:
    out = {}
    for p in paths:
        for line in Path(p).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out[r["nodeid"]] = r   # the last run of a case wins
    return list(out.values())


def one_per_row(results) -> list[dict]:
    """One record per published row: where several harness cases matched the same table row
    (range tests whose generated cases differ in fields the table does not carry), the case with
    the median modeled time stands for the row (``n_cases`` says how many matched)."""
    groups, out = {}, []
    for r in results:
        if r.get("source") and r.get("outcome") == "passed" and r.get("modeled_ns"):
            groups.setdefault(r["source"], []).append(r)
        else:
            out.append(r)
    for rs in groups.values():
        rs = sorted(rs, key=lambda r: r["modeled_ns"])
        out.append(dict(rs[(len(rs) - 1) // 2], n_cases=len(rs)))
    return out


def _pairs(sel):
    good = total = 0
    for i in range(len(sel)):
        for j in range(i + 1, len(sel)):
            a, b = sel[i], sel[j]
            dp = a["published_ns"] - b["published_ns"]
            if dp == 0:
                continue
            total += 1
            good += dp * (a["modeled_ns"] - b["modeled_ns"]) > 0
    return good, total


def _fitted(r) -> bool:
    """A passing case with both a modeled and a published time."""
    return bool(r.get("modeled_ns") and r.get("published_ns") and r.get("outcome") == "passed")


def fit(results) -> dict:
    ok = [r for r in results if _fitted(r)]
    out = {}
    for fam in sorted({r["family"] for r in ok}) + ["all"]:
        sel = [r for r in ok if fam == "all" or r["family"] == fam]
        lr = [math.log(r["modeled_ns"] / r["published_ns"]) for r in sel]
        good, total = _pairs(sel)
        out[fam] = {"n": len(sel), "median_abs_ln": statistics.median(abs(x) for x in lr),
                    "median_ratio": math.exp(statistics.median(lr)),
                    "ordered": good, "pairs": total}
        if len(sel) >= 3:   # t_pub ~ a + b * t_model: a fixed cost the model lacks shows as a > 0
            xs = [r["modeled_ns"] / 1e3 for r in sel]
            ys = [r["published_ns"] / 1e3 for r in sel]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            sxx = sum((x - mx) ** 2 for x in xs)
            if sxx > 0:
                b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
                out[fam].update(intercept_us=my - b * mx, slope=b)
    return out


BANDS = ((100.0, "< 100 us"), (300.0, "100-300 us"), (1000.0, "300-1000 us"), (math.inf, ">= 1 ms"))


def breakdown(results) -> dict:
    """Ratios t_model / t_pub grouped by (family, LNC, published-time band)."""
    out = {}
    for r in results:
        if not _fitted(r):
            continue
        us = r["published_ns"] / 1e3
        band = next(name for hi, name in BANDS if us < hi)
        out.setdefault((r["family"], r.get("lnc"), band), []).append(
            r["modeled_ns"] / r["published_ns"])
    order = {name: i for i, (_, name) in enumerate(BANDS)}
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, order[kv[0][2]])))


def by_test(results) -> dict:
    """Ratios t_model / t_pub grouped by (family, test function): one test function fixes the
    kernel's call (layouts, options, how the harness launches it), so a group whose ratio departs
    from its family's points at that call or at how its baselines were taken."""
    out = {}
    for r in results:
        if _fitted(r):
            test = r.get("test") or r["nodeid"].split("::")[-1].split("[")[0]
            out.setdefault((r["family"], test), []).append(r["modeled_ns"] / r["published_ns"])
    return dict(sorted(out.items()))


def report(results, family=None) -> str:
    if family:
        results = [r for r in results if r["family"] == family]
    results = one_per_row(results)
    lines = ["| family | n | median \\|ln(t_model/t_pub)\\| | median t_model/t_pub | pairs ordered "
             "| t_pub ~ a + b t_model (us) |", "|---|---:|---:|---:|---:|---|"]
    for fam, s in fit(results).items():
        ab = f"{s['intercept_us']:.1f} + {s['slope']:.2f} t" if "slope" in s else ""
        lines.append(f"| {fam} | {s['n']} | {s['median_abs_ln']:.3f} | {s['median_ratio']:.2f} | "
                     f"{s['ordered']}/{s['pairs']} | {ab} |")
    lines += ["", "| family | LNC | published time | n | median t_model/t_pub |",
              "|---|---:|---|---:|---:|"]
    for (fam, lnc, band), rs in breakdown(results).items():
        lines.append(f"| {fam} | {lnc} | {band} | {len(rs)} | "
                     f"{math.exp(statistics.median(math.log(x) for x in rs)):.2f} |")
    lines += ["", "| family | test | n | median t_model/t_pub | median \\|ln\\| |",
              "|---|---|---:|---:|---:|"]
    for (fam, test), rs in by_test(results).items():
        lns = [math.log(x) for x in rs]
        lines.append(f"| {fam} | {test} | {len(rs)} | {math.exp(statistics.median(lns)):.2f} | "
                     f"{statistics.median(abs(x) for x in lns):.3f} |")
    lines += ["", "| case | LNC | published (us) | modeled (us) | ratio | binds | outcome |",
              "|---|---:|---:|---:|---:|---|---|"]
    for r in sorted(results, key=lambda r: (r["family"], r.get("published_ns") or 0)):
        pub = f"{r['published_ns'] / 1e3:.1f}" if r.get("published_ns") else "-"
        mod = f"{r['modeled_ns'] / 1e3:.1f}" if r.get("modeled_ns") else "-"
        rat = f"{r['modeled_ns'] / r['published_ns']:.2f}" if r.get("modeled_ns") and \
            r.get("published_ns") else "-"
        case = r["nodeid"].split("::")[-1] + (f" (1 of {r['n_cases']})" if r.get("n_cases", 1) > 1
                                               else "")
        lines.append(f"| {case} | {r.get('lnc', '')} | {pub} | {mod} | {rat} | "
                     f"{r.get('binding', '')} | {r['outcome']}"
                     f"{': ' + r['message'][:70] if r.get('message') else ''} |")
    return "\n".join(lines)


def _overrides(items) -> dict:
    out = {}
    for it in items:
        name, _, text = it.partition("=")
        out[name] = json.loads(text.lower()) if text.lower() in ("true", "false") else float(text)
    return out


def remodel(results, traces: Path, out: Path, params=None) -> int:
    """Re-model each result whose trace was kept (``--qor-traces``) with today's cost model (and
    ``params`` overrides); results without a trace are left out. Returns the count written."""
    from nki_kernels.emulator.qor_plugin import load_trace, model_record
    n = 0
    with open(out, "w") as f:
        for r in results:
            if not r.get("trace_file"):
                continue
            rec = dict(r)
            rec.update(model_record(load_trace(traces, r["trace_file"]), r.get("published_ps"),
                                    params=params or None))
            f.write(json.dumps(rec) + "\n")
            n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/nkilib_qor.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract", help="read NKI Library's test files into the data table")
    e.add_argument("root", type=Path, help="an NKI Library checkout (its root folder)")
    e.add_argument("--commit", help="the commit the checkout is at (recorded per row)")
    e.add_argument("--out", type=Path, default=DATA)
    r = sub.add_parser("report", help="fit per family from qor_plugin results (JSON lines)")
    r.add_argument("results", type=Path, nargs="+")
    r.add_argument("--family", help="only this kernel family (attention_cte, mlp_cte, ...)")
    r.add_argument("--table", type=Path, default=DATA, help="the extracted table")
    m = sub.add_parser("remodel", help="re-model results kept with --qor-traces on today's model")
    m.add_argument("results", type=Path, nargs="+")
    m.add_argument("--traces", type=Path, required=True, help="the --qor-traces folder")
    m.add_argument("--out", type=Path, required=True, help="JSON lines written here")
    m.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="cost-parameter override (sensitivity only; repeatable)")
    a = ap.parse_args(argv)
    if a.cmd == "remodel":
        n = remodel(read_results(a.results), a.traces, a.out, _overrides(a.set))
        print(f"{n} cases re-modeled -> {a.out}")
        return 0
    if a.cmd == "extract":
        data = extract(a.root, a.commit)
        a.out.write_text(json.dumps(data, indent=1) + "\n")
        fams = {}
        for row in data["rows"]:
            fams[row["family"]] = fams.get(row["family"], 0) + 1
        print(f"{len(data['rows'])} rows ({fams}), {len(data['excluded'])} left out -> {a.out}")
        return 0
    print("NKI Library baselines vs the cost model (modeled: analytical cost model)")
    res = read_results(a.results)
    if a.table.exists():   # only rows the table keeps (copied baselines etc. left out)
        keep = {f"{r['file']}:{r['line']}" for r in load(a.table)["rows"]}
        dropped = [r for r in res if r.get("source") and r["source"] not in keep]
        res = [r for r in res if not r.get("source") or r["source"] in keep]
        if dropped:
            print(f"({len(dropped)} results on rows the table leaves out are not counted)")
    print(report(res, a.family))
    return 0


if __name__ == "__main__":
    sys.exit(main())
