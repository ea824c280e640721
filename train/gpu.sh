#!/usr/bin/env bash
# The shipped pair's recipe on one GPU (an H100 trained the target in 4.5 minutes and the draft in
# 2.6; with tokenizing and loading, about 9 minutes): pre-train the target from scratch on the
# standard library plus every permissively licensed installed package, then distill the draft
# from it, on the same token stream.
#
#     bash train/gpu.sh [RUN_DIR]        # env: DEVICE, TARGET_MIN, DRAFT_MIN, CORPUS
#
# The tokenizer is the shipped one (models/stdlib-code-target/tokenizer.json), so the pair keeps
# its vocabulary. The out-of-domain evaluation packages are left out of training.
set -euo pipefail
RUN=${1:-runs/gpu}
DEVICE=${DEVICE:-cuda}
TARGET_MIN=${TARGET_MIN:-4.5}
DRAFT_MIN=${DRAFT_MIN:-2.6}
CORPUS=${CORPUS:-stdlib site:permissive}
OOD="rich click jsonschema anyio"
mkdir -p "$RUN"
# shellcheck disable=SC2086 # CORPUS and OOD are word lists
python -m train.pretrain --device "$DEVICE" --corpus $CORPUS --exclude $OOD --tokens-cache "$RUN/tokens.pt" \
    --tokenizer models/stdlib-code-target --hidden 512 --layers 8 --heads 8 --intermediate 1408 --tie \
    --seq-len 512 --batch-size 64 --lr 2e-3 --warmup 200 --steps 1000000 --max-minutes "$TARGET_MIN" \
    --checkpoint-minutes 60 --run-dir "$RUN/target" --out "$RUN/target-out"
# shellcheck disable=SC2086
python -m train.distill --device "$DEVICE" --corpus $CORPUS --exclude $OOD --tokens-cache "$RUN/tokens.pt" \
    --target "$RUN/target-out" --target-dtype bfloat16 --layers 1 --hidden 256 --heads 4 \
    --seq-len 512 --batch-size 64 --lr 3e-3 --warmup 100 --steps 1000000 --max-minutes "$DRAFT_MIN" \
    --save-dtype bfloat16 --checkpoint-minutes 60 --run-dir "$RUN/draft" --out "$RUN/draft-out"
