#!/usr/bin/env bash
# A lent GPU's checks in one call: the engine's CUDA tests, then bench.gpu on the Llama-3-8B
# shape with compiled layers (it also times target-only uncompiled, in the same run) and, last, the
# profiler's tables of a target-only session and a generate() (kernels by device time). The logs and
# the report go to $1 (default: bench/results/gpu/run), eight files; budget the call by TEST_S and
# BENCH_S (run 7 on an H100: the tests 121 s, the bench 175 s).
#     bash bench/gpu_check.sh OUT_DIR
set -u -o pipefail
out=${1:-bench/results/gpu/run}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/device.txt"
timeout "${TEST_S:-180}" python3 -m pytest -rfEs -p no:cacheprovider tests/test_graphs.py tests/test_compiled.py \
    tests/test_tree.py::test_a_draft_on_cuda_grows_sampled_trees 2>&1 \
    | grep -E "passed|failed|FAILED|ERROR|SKIPPED|Error" | tee "$out/tests.txt"
echo "tests exit $?"
timeout "${BENCH_S:-360}" python3 -m bench.gpu --shape llama3-8b --device cuda --sessions 1,8,32,64 --repeats 2 \
    --compile-layers --profile --out "$out" 2> "$out/bench_stderr.txt" | tail -40
echo "bench exit $?"
grep -E "compile|captured|Error|error" "$out/bench_stderr.txt" | grep -v '^{' | cut -c1-300 | tail -15
