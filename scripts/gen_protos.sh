#!/usr/bin/env bash
# Regenerate the committed gRPC stubs viasd/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py from protos/.
#   bash scripts/gen_protos.sh          writes into the repository
#   OUT=/tmp/x bash scripts/gen_protos.sh   writes into /tmp/x (tests/unit/test_protos.py checks freshness this way)
# Needs grpcio-tools (the [dev] extra), pinned to the grpcio runtime's version.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
py="${PYTHON:-python}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then py=.venv/bin/python; fi
mkdir -p "$out"
# protos/ mirrors the package (protos/viasd/v1/*.proto, package viasd.v1), so the generated
# imports (`from viasd.v1 import generation_pb2`) are right without post-processing.
"$py" -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" protos/viasd/v1/*.proto
