#!/usr/bin/env bash
# Regenerates the Python gRPC code for protos/specdec/v1/*.proto into specdec/v1/.
# `protos/gen.sh --check` fails if the committed generated code is out of date.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$PY" -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/specdec/v1/specdec.proto
if [ "${1:-}" = "--check" ]; then
  for f in specdec_pb2.py specdec_pb2.pyi specdec_pb2_grpc.py; do
    if ! cmp -s "$out/specdec/v1/$f" "specdec/v1/$f"; then
      echo "specdec/v1/$f is stale: run protos/gen.sh" >&2
      exit 1
    fi
  done
  echo "generated code is current"
else
  cp "$out"/specdec/v1/specdec_pb2*.py* specdec/v1/
fi
