"""The README's commands are the ones CI runs."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_block(title):
    text = (ROOT / "README.md").read_text()
    m = re.search(r"```bash\n(.*?)```", text[text.index(title):], re.S)
    cmds = [ln.split("#")[0].strip() for ln in m.group(1).splitlines()]
    return [c for c in cmds if c]


def test_ci_runs_the_readme_test_command():
    cmds = _readme_block("## Quickstart")
    test_cmd = [c for c in cmds if "pytest" in c]
    assert len(test_cmd) == 1
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd[0] in ci, f"{test_cmd[0]!r} is not what .ci/run runs"


def test_ci_installs_like_the_readme():
    cmds = _readme_block("## Quickstart")
    ci = (ROOT / ".ci" / "run").read_text()
    for c in cmds:
        if c.startswith("pip install"):
            assert c.replace("pip install", "python -m pip install -q") in ci, c
