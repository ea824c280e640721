#!/usr/bin/env bash
# The split topology on one machine: draft and verify services in two network namespaces joined
# by a veth pair, an optional delaying proxy for a chosen RTT, and the load tester on the draft
# host. A thin wrapper around `python -m bench.split` (its docstring has the details). As root:
#
#   deploy/split_topology.sh --target models/stdlib-code-target --draft models/stdlib-code-draft \
#       --rtt-ms 0,10 --out deploy/loadtest -- --concurrency 1,4,16,64 --requests 64 --duration-s 60
#
# Everything after `--` goes to bench.loadtest. Relative paths are relative to where you run it.
# The EXIT trap tears the namespaces down (killing whatever runs in them) even if the Python
# process died hard; SIGINT/SIGTERM are passed on so it tears down itself first. VENV picks the
# virtualenv (default: the repository's .venv).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
ID="$$"

cleanup() { "$PY" -m bench.split --cleanup --id "$ID" || true; }
trap cleanup EXIT

"$PY" -m bench.split --id "$ID" "$@" &
child=$!
# A background child ignores SIGINT, so both signals are passed on as SIGTERM (bench.split tears down on it).
trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 130' INT
trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 143' TERM
wait "$child"
