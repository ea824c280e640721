"""Rendering ``models/README.md`` (the model card) from the measured figures.

    python -m train.modelcard --eval models/eval.json --target-summary runs/target/summary.json \
        --draft-summary runs/draft/summary.json --out models/README.md

The training summaries are also copied to ``models/training.json`` so the card's figures stay
traceable after ``runs/`` (not versioned) is gone.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from transformers import AutoConfig

COMMANDS = """\
```sh
# 1. target (trains the tokenizer on the training split first, if runs/tokenizer is missing)
nohup nice -n 19 .venv/bin/python -m train.pretrain --out models/stdlib-code-target \\
    --run-dir runs/target --tokenizer runs/tokenizer --hidden 512 --layers 8 --heads 8 \\
    --intermediate 1408 --max-positions 1024 --seq-len 512 --batch-size 8 --steps 1800 \\
    --lr 8e-4 --warmup 100 --max-minutes 78 --threads 1 --seed 0 > runs/pretrain.log 2>&1 &
# 2. draft, distilled from the target (the --max-minutes used was {draft_minutes})
nohup nice -n 19 .venv/bin/python -m train.distill --target models/stdlib-code-target \\
    --corpus stdlib --out models/stdlib-code-draft --run-dir runs/draft \\
    --layers 1 --hidden 256 --heads 4 --intermediate 1024 --seq-len 256 --batch-size 16 \\
    --steps 3000 --lr 2e-3 --warmup 50 --ce-weight 0.1 --max-minutes {draft_minutes} \\
    --threads 1 --seed 0 > runs/distill.log 2>&1 &
# 3. measurements (this file's numbers)
.venv/bin/python -m train.evaluate --target models/stdlib-code-target \\
    --draft models/stdlib-code-draft --out models/eval.json --threads 1 \\
    --loss-windows 16 --prompts 32 --latency-rounds 5
.venv/bin/python -m train.modelcard --eval models/eval.json \\
    --target-summary runs/target/summary.json --draft-summary runs/draft/summary.json
```
(The shipped target ran its first 31 minutes with `--threads 2`, was interrupted with Ctrl-C
and resumed with `--threads 1`: with another developer's services busy on the same two cores,
two OpenMP threads at nice 19 spent their time waiting for each other. Batches depend only on
the seed and the step, so the resume changes no data.)
Both training commands resume from their `runs/*/checkpoint.pt` when run again; the time budgets
count training time across resumed runs, and the learning rate follows whichever of the step
limit and the time budget comes first, so a run always ends annealed."""

TOOL = """\
## Training a draft for your own target: `train.distill`

```sh
.venv/bin/python -m train.distill --target path/to/your-target --corpus src/ notes.md \\
    --out my-draft [--layers 1 --hidden 256 --heads 4 --intermediate 1024] \\
    [--steps 2000 --max-minutes 30 --seq-len 256 --batch-size 16 --lr 2e-3] \\
    [--ce-weight 0.1 --temperature 1.0 --target-dtype bfloat16 --save-dtype float32]
```

* `--target`: any local Hugging Face causal LM directory (`AutoModelForCausalLM` +
  `AutoTokenizer`); nothing is downloaded.
* `--corpus`: files and/or directories (every text file below a directory, binaries skipped),
  the word `stdlib` for the Python standard library, or `package:NAME` for the `.py` files of
  an installed package. Files are read in sorted order; about
  5% of them, picked by a hash of their path, are held out and never trained on
  (`train.evaluate --corpus ...` measures on exactly those).
* The draft is a `LlamaForCausalLM` with the target's vocabulary size and special token ids,
  tied input/output embeddings by default; the target's tokenizer files are copied into `--out`,
  so the two directories form a pair for `specdec`. The size of the draft relative to the
  target is printed, with a warning above 1/10 (`--max-ratio`).
* Loss: `KL(p_target || q_draft)` at every position (the target runs without gradients, under
  bf16 autocast unless `--no-bf16`), mixed with `--ce-weight` of the ordinary cross-entropy on
  the corpus. The log also tracks how often the two argmaxes agree.
* Resumable: checkpoints every `--checkpoint-minutes` (default 5) and at the end in `--run-dir`
  (default `runs/distill-<name of --out>`); running the same command again continues. Progress
  bar on stderr, loss log in `RUN_DIR/log.jsonl`, summary in `RUN_DIR/summary.json`. Seeded.
* Stops at `--steps` or `--max-minutes` of training, whichever comes first. `--init-from DIR`
  starts from an existing draft instead of random weights.
* Then measure the pair: `python -m train.evaluate --target T --draft D --corpus src/ --out eval.json`.

Keep the draft shallow: on a CPU a batch-1 decoding step of a small model is dominated by
per-layer overhead, so one layer is far cheaper than two of half the width, and c (draft cost
/ target cost) matters as much as the acceptance rate in the speed-up E / (γ·c + 1)."""


def _mb(d: Path) -> float:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file()) / 1e6


def _arch(d: Path) -> str:
    c = AutoConfig.from_pretrained(d)
    tie = "tied" if c.tie_word_embeddings else "untied"
    return (f"Llama, {c.num_hidden_layers} layer(s), hidden {c.hidden_size}, {c.num_attention_heads} heads, "
            f"MLP {c.intermediate_size}, vocab {c.vocab_size}, {tie} embeddings, "
            f"max_position_embeddings {c.max_position_embeddings}")


def render(ev: dict, ts: dict, ds: dict, target_dir: Path, draft_dir: Path) -> str:
    lo = ev["heldout_loss_nats_per_token"]
    g, s, lat, sp = ev["greedy"], ev["sampled_T1"], ev["latency_ms_per_token"], ev["expected_speedup"]
    c = lat["c"]
    rows = []
    for gam in range(1, 9):
        k = str(gam)
        rows.append(f"| {gam} | {sp['greedy']['by_gamma'][k]:.2f} | "
                    f"{sp['greedy_from_measured_tokens_per_round'].get(k, float('nan')):.2f} | "
                    f"{sp['sampled_T1']['by_gamma'][k]:.2f} | {sp['sampled_T1_from_path_estimate'][k]:.2f} |")
    beta_rows = " | ".join(f"{b:.3f}" for b in s["beta_by_position"])
    prod = s["tokens_per_round_product_form"]
    path = s["tokens_per_round_path_estimate"]
    greedy_e = g["tokens_per_round_measured"]
    draft_minutes = round(ds.get("max_minutes", ds["elapsed_s"] / 60))
    return f"""# Shipped model pair: `stdlib-code-target` + `stdlib-code-draft`

A matched target/draft pair for speculative decoding of Python code, trained from scratch on this
machine by the project's own code (`train/`), so that the demo, tests and benchmarks run on real
models with real acceptance rates, offline. Both directories load with
`AutoModelForCausalLM.from_pretrained(DIR)` / `AutoTokenizer.from_pretrained(DIR)`; weights are
stored as bfloat16 safetensors (target) and float32 (draft) and are meant to be run in float32.
These are small models trained for about {ts['elapsed_s'] / 60:.0f} + {ds['elapsed_s'] / 60:.0f} minutes
on two shared CPU cores (about 2 M training tokens for the target): the target is weak (held-out
loss {lo['target']:.2f} nats/token) and its greedy continuations soon fall into loops; the pair is
meant for measuring speculative decoding, not for writing code. Held-out loss is measured on
{lo['tokens']:,} held-out tokens (an interrupted run over 24,576 tokens gave 4.680 / 4.700).

| | target `models/stdlib-code-target/` | draft `models/stdlib-code-draft/` |
|---|---|---|
| architecture | {_arch(target_dir)} | {_arch(draft_dir)} |
| parameters | {ev['target_parameters']:,} | {ev['draft_parameters']:,} ({ev['draft_parameters'] / ev['target_parameters']:.3f} of the target) |
| size on disk | {_mb(target_dir):.1f} MB | {_mb(draft_dir):.1f} MB |
| training | next-token cross-entropy | distillation: 0.9·KL(p_target ‖ q_draft) + 0.1·CE |
| training tokens | {ts['tokens']:,} ({ts['steps']} steps × {ts['batch_size']} × {ts['seq_len']}) | {ds['tokens']:,} ({ds['steps']} steps × {ds['batch_size']} × {ds['seq_len']}) |
| training time (2 cores, nice 19, bf16 autocast) | {ts['elapsed_s'] / 60:.1f} min | {ds['elapsed_s'] / 60:.1f} min |
| final training loss | {ts['final_loss']:.3f} | {ds['final_loss']:.3f} (mixed KL/CE) |
| **held-out loss** (nats/token) | **{lo['target']:.3f}** | **{lo['draft']:.3f}** |
| **decoding latency** (batch 1, KV cache, float32, {ev['machine']['torch_threads']} thread(s); best of {lat['rounds']} alternating runs of {lat['steps_per_round']} steps) | **{lat['target']:.2f} ms/token** | **{lat['draft']:.2f} ms/token** |

Tokenizer (shared, identical files in both directories): byte-level BPE, {ev.get('vocab_size', 8192)} tokens, trained
with `tokenizers` on the training split; special tokens `<|pad|>` (0), `<|bos|>` (1), `<|eos|>` (2);
`eos_token_id` = 2 in both configs and generation configs. Documents are fed as
`<|bos|> text <|eos|>`.

**Corpus.** The CPython {ts.get('python', platform.python_version())} standard library of the interpreter found through `sysconfig`
(`*.py` files, `site-packages` excluded, test packages included): {ts['corpus_files']} training files,
{ts['corpus_tokens']:,} tokens. About 5% of the files are held out by a hash of their relative path
(`train/corpus.py`); none of the figures below uses a file that training saw.
Held-out set: {ev['heldout_files']} files, {ev['heldout_tokens']:,} tokens.

## Acceptance (held-out code, `train/evaluate.py`, `models/eval.json`)

* **Greedy acceptance α = {g['alpha']:.3f}** — teacher-forced agreement of the draft's argmax with the
  target's argmax along the target's own greedy continuations ({g['positions']} positions:
  {ev.get('prompts', 48)} held-out prompts of 128 tokens, 64 generated tokens each).
  Measured tokens per verify round with greedy drafting of γ tokens (exact for greedy: the draft
  is accepted up to its first disagreement): {', '.join(f'γ={k}: {v:.2f}' for k, v in greedy_e.items())}.
* **T=1 acceptance** β_k = Σ_x min(p(x), q(x)) at position k of a speculative round, along the
  draft's own sampled proposals ({s['rounds']} rounds), mean **β = {s['beta_mean']:.3f}**:

| position k | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 |
|---|---|---|---|---|---|---|---|---|
| β_k | {beta_rows} |

  Tokens per round at T=1: product form 1 + Σ_k Π_{{j≤k}} β_j = {prod['4']:.2f} (γ=4), {prod['8']:.2f} (γ=8);
  unbiased path estimate 1 + Σ_k E[Π_{{j≤k}} min(1, p(x_j)/q(x_j))] = {path['4']:.2f} (γ=4), {path['8']:.2f} (γ=8).

## Expected speed-up (DESIGN.md §7)

c = {lat['draft']:.2f} / {lat['target']:.2f} = **{c:.3f}** (from the medians of the runs instead of the best:
{lat['draft_median']:.2f} / {lat['target_median']:.2f} = {lat['c_median']:.3f}; the machine is shared, so runs vary). S = E / (γ·c + 1) with E = (1 − α^(γ+1)) / (1 − α)
(columns 2 and 4), and with E replaced by the measured tokens per round (columns 3 and 5):

| γ | greedy, bound (α={g['alpha']:.3f}) | greedy, measured E | T=1, bound (β={s['beta_mean']:.3f}) | T=1, path E |
|---|---|---|---|---|
{chr(10).join(rows)}

Best γ: greedy **γ = {sp['greedy']['best_gamma']}, S = {sp['greedy']['best_speedup']:.2f}×**; T=1 γ = {sp['sampled_T1']['best_gamma']},
S = {sp['sampled_T1']['best_speedup']:.2f}×. These are the in-process bounds; the services add RPC and scheduling
costs (ρ in DESIGN.md §7). The latencies (and so c) were measured while another developer's services
were running on the same two cores; on an idle machine the sizing runs above gave
14.6 ms vs about 1.1 ms (c ≈ 0.08, 2 threads), so the speed-ups here are conservative. Latencies were measured on an AMD EPYC (AVX512-BF16), 2 cores, torch
{ev['machine']['torch']}, {ev['machine']['torch_threads']} threads; evaluation took {ev['eval_seconds']:.0f} s.

## How the sizes were chosen

Measured before training, with randomly initialised models on this machine (batch-1 KV-cache
decoding in float32, 2 threads, median of 5 runs of 64 steps; vocab 8192):

| model | parameters | ms/token |
|---|---|---|
| 8 layers × 512, MLP 1408, untied (the target) | 34.1 M | 14.6 |
| 1 layer × 256, MLP 768, tied | 2.9 M | 1.0–1.3 |
| 1 layer × 192, MLP 512, tied | 2.0 M | 0.9 |
| 2 layers × 256, MLP 640, tied | 3.6 M | 2.0–2.2 |

A second layer costs the draft about as much as the whole first one (Python overhead per layer
dominates tiny models), so the draft has one layer of width 256 (MLP 1024: 3.1 M parameters,
0.092 of the target), giving a target/draft step ratio above 10 (the requirement is ≥ 6).
Training throughput of the target (8 × 512 sequences, forward + backward + AdamW): 700 tokens/s
in float32, 1,400 tokens/s under bf16 autocast, so both trainings use bf16 autocast (weights and
optimizer state stay float32). The CPU was shared with another developer's workload during
training (our runs at nice 19), which roughly halved the throughput actually obtained.

## Reproducing

{COMMANDS.format(draft_minutes=draft_minutes)}

Figures of the runs that produced these files: `models/training.json`; raw measurements:
`models/eval.json`.

{TOOL}
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval", default="models/eval.json")
    ap.add_argument("--target-summary", default="runs/target/summary.json")
    ap.add_argument("--draft-summary", default="runs/draft/summary.json")
    ap.add_argument("--target-dir", default="models/stdlib-code-target")
    ap.add_argument("--draft-dir", default="models/stdlib-code-draft")
    ap.add_argument("--draft-minutes", type=float, default=None, help="the --max-minutes of the distill run")
    ap.add_argument("--out", default="models/README.md")
    args = ap.parse_args(argv)
    ev = json.loads(Path(args.eval).read_text())
    ts = json.loads(Path(args.target_summary).read_text())
    ds = json.loads(Path(args.draft_summary).read_text())
    if args.draft_minutes:
        ds["max_minutes"] = args.draft_minutes
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / "training.json").write_text(json.dumps({"target": ts, "draft": ds}, indent=2) + "\n")
    out.write_text(render(ev, ts, ds, Path(args.target_dir), Path(args.draft_dir)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
