#!/usr/bin/env bash
# Create .venv, install via-sd with its serving and test extras, and fetch built-in models.
#   bash scripts/setup.sh            the embedded default pair (Qwen2.5-Coder 0.5B -> 1.5B, ~1.6 GB)
#   bash scripts/setup.sh test       the small test model only (SmolLM2-135M, ~100 MB)
# VENV (default .venv), PYTHON (default python3) and EXTRAS (default serve,dev; the image: serve) may be overridden.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-default}"
venv="${VENV:-.venv}"

if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check --upgrade pip
# torch first, pinned: a bare `torch` requirement could pull a multi-GB CUDA build on a CPU box.
# On a GPU machine install the CUDA build of the same version before running this script.
"$py" -m pip install -q --disable-pip-version-check torch==2.13.0
"$py" -m pip install -q --disable-pip-version-check -e ".[${EXTRAS:-serve,dev}]"

case "$what" in
  default) "$venv/bin/viasd" models fetch qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct ;;
  test)    "$venv/bin/viasd" models fetch smollm2-135m-instruct ;;
  none)    ;;
  *) echo "usage: $0 [default|test|none]" >&2; exit 2 ;;
esac
