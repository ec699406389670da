#!/usr/bin/env bash
# Batch-1 speed of the continuous-batching engine against the one-request-per-forward engine of
# BASE (default 2a1269f), two interleaved passes; JSON lines on stdout
# (docs/benchmarks/cpu/batch1/batch1.json). Run under flock /tmp/viasd-heavy.lock on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
base="${BASE:-2a1269f}"
old="$(mktemp -d)/old"
git worktree add --detach "$old" "$base" >/dev/null
trap 'git worktree remove --force "$old"' EXIT
for i in 1 2; do
  PYTHONPATH="$old" .venv/bin/python scripts/measure_batch1.py bfloat16 old 2>/dev/null | tail -1
  .venv/bin/python scripts/measure_batch1.py bfloat16 plain 2>/dev/null | tail -1
  .venv/bin/python scripts/measure_batch1.py bfloat16 packed 2>/dev/null | tail -1
done
