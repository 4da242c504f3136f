"""The README's commands are the ones CI runs, and its performance table is the generated one."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_block(title, n=0):
    """The commands of the ``n``-th bash block after heading ``title`` (comments stripped)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text[text.index(title):], re.S)
    cmds = [ln.split("#")[0].strip() for ln in blocks[n].splitlines()]
    return [c for c in cmds if c]


def test_quickstart_is_two_commands_and_ci_runs_them():
    cmds = _readme_block("## Quickstart")
    assert len(cmds) == 2, cmds
    test_cmd = [c for c in cmds if c.endswith(" test")]
    bench_cmd = [c for c in cmds if " bench" in c]
    assert len(test_cmd) == 1 and len(bench_cmd) == 1, cmds
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd[0] in ci, f"{test_cmd[0]!r} is not what .ci/run runs"
    assert any(ln.startswith(bench_cmd[0]) for ln in ci), f"{bench_cmd[0]!r} not in .ci/run"


def test_the_script_installs_like_the_plain_pip_path():
    """The documented pip path (own environment) installs what scripts/run.sh installs, in the
    same order (torch pinned first), and runs the same test command."""
    cmds = _readme_block("## Quickstart", 1)
    script = (ROOT / "scripts" / "run.sh").read_text()
    pips = [c for c in cmds if c.startswith("pip install")]
    assert pips and pips[0] == "pip install torch==2.13.0", pips
    at = -1
    for c in pips:
        line = c.replace("pip install", '"$VENV/bin/python" -m pip install -q')
        assert line in script, c
        assert script.index(line) > at, f"{c!r} runs out of order in scripts/run.sh"
        at = script.index(line)
    pytest_cmd = [c for c in cmds if "pytest" in c]
    assert pytest_cmd == ["python -m pytest -n 2 -q"]
    assert '-m pytest -n 2 -q "$@"' in script


def _published_lines(table):
    """The lines of a generated table that hold published numbers (a bench definition added
    since the last `--readme` only adds lines without any, which do not count)."""
    return [ln for ln in table.splitlines() if "_not run_" not in ln
            and (not ln.startswith("| ") or ln.startswith("| op |") or re.search(r"\| \d+\.\d \| ", ln))]


def test_readme_performance_table_is_generated_from_the_published_json():
    from nki_kernels.bench import harness
    text = (ROOT / "README.md").read_text()
    a = text.index(harness.README_BEGIN) + len(harness.README_BEGIN)
    b = text.index(harness.README_END)
    assert _published_lines(text[a:b]) == _published_lines("\n" + harness.readme_table()), \
        "README table differs from bench/published: run `nki-kernels bench --readme`"


def test_readme_performance_table_lists_each_case_once():
    from nki_kernels.bench.harness import readme_table
    rows = [ln for ln in readme_table().splitlines()
            if ln.startswith("| ") and not ln.startswith("| op |")]
    keys = [tuple(c.strip() for c in ln.split("|")[1:4]) for ln in rows]
    assert rows and len(keys) == len(set(keys))
