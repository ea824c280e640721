#!/usr/bin/env bash
# The shipped pair's recipe on one GPU: pre-train the target on the standard library plus every
# permissively licensed installed package, then distill the draft from it on the same token stream.
#
#     bash train/gpu.sh [RUN_DIR]   # env: DEVICE, STAGES, TARGET_MIN, DRAFT_MIN, TARGET_INIT, DRAFT_INIT,
#                                   #      TARGET_LR, TARGET_WARMUP, UNLIKELIHOOD, DRAFT_LAYERS, COMPILE, CORPUS
#
# The shipped pair came from four commands on an H100 (the model card has the numbers); after each
# target run its output replaced models/stdlib-code-target, where the next run starts:
#   1. from scratch:      TARGET_MIN=4.5 DRAFT_MIN=2.6 bash train/gpu.sh runs/gpu
#   2. target, continued: STAGES=target TARGET_INIT=models/stdlib-code-target TARGET_LR=1e-3 TARGET_MIN=4.2 COMPILE=1 bash train/gpu.sh runs/gpu2
#   3. against repetition: STAGES=target TARGET_INIT=models/stdlib-code-target UNLIKELIHOOD=1 TARGET_LR=3e-4 TARGET_WARMUP=20 TARGET_MIN=3.5 bash train/gpu.sh runs/gpu3
#   4. draft, afresh:     STAGES=draft TARGET_OUT=runs/gpu3/target-out DRAFT_LAYERS=2 DRAFT_MIN=6.0 COMPILE=1 bash train/gpu.sh runs/gpu4
# (each fits one 10-minute call on the GPU machine, tokenizing, compiling and loading included).
# The tokenizer is the shipped one (models/stdlib-code-target/tokenizer.json), so the pair keeps
# its vocabulary. The out-of-domain evaluation packages are left out of training.
set -euo pipefail
RUN=${1:-runs/gpu}
DEVICE=${DEVICE:-cuda}
STAGES=${STAGES:-target draft}
TARGET_MIN=${TARGET_MIN:-4.5}
DRAFT_MIN=${DRAFT_MIN:-2.6}
TARGET_LR=${TARGET_LR:-2e-3}
TARGET_OUT=${TARGET_OUT:-$RUN/target-out}
DRAFT_LAYERS=${DRAFT_LAYERS:-1}
CORPUS=${CORPUS:-stdlib site:permissive}
OOD="rich click jsonschema anyio"
EXTRA=()
[[ "${COMPILE:-0}" == 1 ]] && EXTRA+=(--compile)
mkdir -p "$RUN"
if [[ " $STAGES " == *" target "* ]]; then
    INIT=()
    [[ -n "${TARGET_INIT:-}" ]] && INIT=(--init-from "$TARGET_INIT")
    # UNLIKELIHOOD=W: a fine-tuning stage against greedy repetition (train/unlikelihood.py), eager
    UL=()
    [[ -n "${UNLIKELIHOOD:-}" ]] && UL=(--unlikelihood "$UNLIKELIHOOD" --ul-batch 64 --ul-prefix 64 --ul-new 128)
    # shellcheck disable=SC2086 # CORPUS and OOD are word lists
    python -m train.pretrain --device "$DEVICE" --corpus $CORPUS --exclude $OOD --tokens-cache "$RUN/tokens.pt" \
        --tokenizer models/stdlib-code-target --hidden 512 --layers 8 --heads 8 --intermediate 1408 --tie \
        --seq-len 512 --batch-size 64 --lr "$TARGET_LR" --warmup "${TARGET_WARMUP:-200}" --steps 1000000 --max-minutes "$TARGET_MIN" \
        --checkpoint-minutes 60 --run-dir "$RUN/target" --out "$TARGET_OUT" "${INIT[@]}" "${UL[@]}" "${EXTRA[@]}"
fi
if [[ " $STAGES " == *" draft "* ]]; then
    INIT=(--layers "$DRAFT_LAYERS" --hidden 256 --heads 4)  # a draft from --init-from keeps its own shape
    [[ -n "${DRAFT_INIT:-}" ]] && INIT=(--init-from "$DRAFT_INIT")
    # shellcheck disable=SC2086
    python -m train.distill --device "$DEVICE" --corpus $CORPUS --exclude $OOD --tokens-cache "$RUN/tokens.pt" \
        --target "$TARGET_OUT" --target-dtype bfloat16 \
        --seq-len 512 --batch-size 64 --lr 3e-3 --warmup 100 --steps 1000000 --max-minutes "$DRAFT_MIN" \
        --save-dtype bfloat16 --checkpoint-minutes 60 --run-dir "$RUN/draft" --out "$RUN/draft-out" "${INIT[@]}" "${EXTRA[@]}"
fi
