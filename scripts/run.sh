#!/usr/bin/env bash
# One entry point from a fresh clone: the first use creates a local virtual environment (.venv)
# with the pinned CPU build of torch and this package, later uses reuse it.
#
#   scripts/run.sh bench [ARGS]     nki-kernels bench ARGS (default tier, Trn3, modeled)
#   scripts/run.sh test [ARGS]      the test suite (pytest -n 2 -q ARGS)
#   scripts/run.sh publish          models tier on trn3 and trn2 into bench/published, then the
#                                   README performance table (needs committed code)
#   scripts/run.sh readme           regenerate the README table from bench/published only
#   scripts/run.sh setup            only create / update .venv
#
# PYTHON picks the interpreter (default python3, else python); NKI_KERNELS_VENV the directory.
# The venv never sees the system's site-packages, so what is installed there does not matter.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV="${NKI_KERNELS_VENV:-.venv}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
STAMP="$VENV/.nki-kernels-installed"

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "setting up $VENV (first use: pinned CPU torch and the package)..." >&2
        if ! "$PY" -m venv "$VENV" 2>/dev/null; then
            # no venv module (e.g. Debian without python3-venv): virtualenv from pip instead
            rm -rf "$VENV"
            "$PY" -m pip install -q --user virtualenv
            "$PY" -m virtualenv -q "$VENV"
        fi
    fi
    if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
        # torch first and pinned: the CPU wheel; any other torch spec pulls the CUDA build
        "$VENV/bin/python" -m pip install -q torch==2.13.0
        "$VENV/bin/python" -m pip install -q -e ".[test,bench]"
        touch "$STAMP"
    fi
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
    setup) setup ;;
    bench) setup; exec "$VENV/bin/nki-kernels" bench "$@" ;;
    test) setup; exec "$VENV/bin/python" -m pytest -n 2 -q "$@" ;;
    publish)
        setup
        for t in trn3 trn2; do
            "$VENV/bin/nki-kernels" bench --tier models --target "$t" --publish --quiet "$@"
        done
        exec "$VENV/bin/nki-kernels" bench --readme ;;
    readme) setup; exec "$VENV/bin/nki-kernels" bench --readme ;;
    *) sed -n '2,15p' "$0" >&2; exit 2 ;;
esac
