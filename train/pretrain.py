"""Pre-training the shipped TARGET model: a Llama-style causal LM on the stdlib corpus.

    python -m train.pretrain --out models/stdlib-code-target --run-dir runs/target \
        --max-minutes 72 [--corpus stdlib package:numpy my_code/] [--init-from DIR]

Trains (or reuses, if ``--tokenizer`` already exists) the byte-level BPE tokenizer on the
training split, builds a ``LlamaForCausalLM`` of the requested size, and trains it with the
resumable loop in ``train.loop``: running the same command again resumes from
``RUN_DIR/checkpoint.pt``.  ``--init-from DIR`` starts from a trained model (and its tokenizer)
instead of random weights, to train it further, e.g. on a wider corpus. ``--unlikelihood W``
adds the sequence-level unlikelihood of repeated n-grams in the model's own greedy continuations
(``train/unlikelihood.py``): a fine-tuning stage against greedy repetition.  The result is written
as a Hugging Face directory (bf16 safetensors, tokenizer, config with EOS and
max_position_embeddings).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from train import corpus, export, loop
from train.loop import causal_lm_loss
from train.architecture import target_config
from train.data import WindowSampler, corpus_tokens
from train.tokenizer import train_on_documents
from train.unlikelihood import make_loss


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="final Hugging Face model directory")
    ap.add_argument("--run-dir", default="runs/target", help="checkpoints and loss log")
    ap.add_argument("--tokenizer", default="runs/tokenizer", help="tokenizer dir (trained if missing)")
    ap.add_argument("--corpus", nargs="+", default=["stdlib"],
                    help="'stdlib', 'package:NAME' (an installed package's .py files), 'site:permissive' "
                         "(every installed package with a permissive license), files or directories")
    ap.add_argument("--exclude", nargs="*", default=[], help="packages 'site:permissive' leaves out")
    ap.add_argument("--tokens-cache", default=None, help="save the token stream here, reuse it if present")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--init-from", default=None, help="continue from this Hugging Face model directory (its tokenizer too)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--no-tests", action="store_true", help="leave the stdlib test packages out")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--max-positions", type=int, default=1024)
    ap.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--no-bf16", action="store_true", help="train in float32 (no bf16 autocast)")
    ap.add_argument("--checkpoint-minutes", type=float, default=5.0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the training step (pays on a GPU)")
    ap.add_argument("--unlikelihood", type=float, default=0.0, metavar="W",
                    help="add W x the sequence-level unlikelihood of repeated n-grams in greedy continuations "
                         "(train/unlikelihood.py; a fine-tuning stage, eager only)")
    ap.add_argument("--ul-batch", type=int, default=32, help="windows whose starts are continued per step")
    ap.add_argument("--ul-prefix", type=int, default=64, help="tokens of each start")
    ap.add_argument("--ul-new", type=int, default=96, help="greedy tokens continued from each start")
    ap.add_argument("--ul-ngram", type=int, default=4, help="n of the repeated n-grams penalized")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.unlikelihood and args.compile:
        ap.error("--unlikelihood decodes inside the training step: it runs eagerly, without --compile")
    if args.unlikelihood and not (0 < args.ul_prefix < args.seq_len and 0 < args.ul_batch <= args.batch_size):
        ap.error("--ul-prefix must be in (0, --seq-len) and --ul-batch in (0, --batch-size]")

    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    include_tests = not args.no_tests
    specs = corpus.expand(args.corpus, args.exclude)
    tok_dir = Path(args.init_from or args.tokenizer)
    if not (tok_dir / "tokenizer.json").exists():
        tok = train_on_documents(corpus.documents(specs, "train", include_tests=include_tests),
                                 args.vocab_size, args.max_positions)
        tok.save_pretrained(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    tokens, rows = corpus_tokens(tokenizer, specs, "train", include_tests, args.tokens_cache)
    n_files = sum(r["files"] for r in rows)
    print(f"corpus: {len(specs)} sources, {n_files} training files, {tokens.numel():,} tokens", flush=True)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True

    if args.init_from:
        model = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
    else:
        model = LlamaForCausalLM(target_config(tokenizer, args.hidden, args.layers, args.heads, args.intermediate,
                                               args.max_positions, args.tie))
    model.to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"target: {n_params:,} parameters", flush=True)

    sampler = WindowSampler(tokens, args.seq_len, args.batch_size, seed=args.seed)
    loss_fn = causal_lm_loss
    if args.unlikelihood:
        loss_fn = make_loss(args.unlikelihood, args.ul_batch, args.ul_prefix, args.ul_new, args.ul_ngram, tokenizer.pad_token_id)
    summary = loop.run(model, sampler.batch, loss_fn, loop.LoopConfig(
        run_dir=Path(args.run_dir), max_steps=args.steps, max_minutes=args.max_minutes, lr=args.lr,
        warmup_steps=args.warmup, bf16=not args.no_bf16, checkpoint_minutes=args.checkpoint_minutes,
        desc="pretrain", compile=args.compile))
    export.save_hf_dir(model, tokenizer, args.out)
    summary.update(parameters=n_params, corpus_tokens=int(tokens.numel()), corpus_files=n_files, sources=rows,
                   device=str(args.device), hardware=torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
                   seq_len=args.seq_len, batch_size=args.batch_size, include_tests=include_tests,
                   corpus=args.corpus, init_from=args.init_from, max_steps=args.steps, lr=args.lr, warmup=args.warmup,
                   unlikelihood=args.unlikelihood and {"weight": args.unlikelihood, "batch": args.ul_batch, "prefix": args.ul_prefix,
                                                       "new": args.ul_new, "ngram": args.ul_ngram})
    (Path(args.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
