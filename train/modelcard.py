"""Rendering ``models/README.md`` (the model card) from the measured figures.

    python -m train.modelcard --eval models/eval.json [--target-summary runs/target2/summary.json \
        --draft-summary runs/draft2/summary.json] --out models/README.md

The training summaries (both stages) and the corpus table live in ``models/training.json``, so
the card's figures stay traceable after ``runs/`` (not versioned) is gone; the summaries given
on the command line are recorded there first.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from transformers import AutoConfig

COMMANDS = """\
```sh
# Stage 1: target from scratch on the standard library (trains the tokenizer first, if
# runs/tokenizer is missing), and a draft distilled from it.
nohup nice -n 19 .venv/bin/python -m train.pretrain --out runs/stage1-target \\
    --run-dir runs/target --tokenizer runs/tokenizer --hidden 512 --layers 8 --heads 8 \\
    --intermediate 1408 --max-positions 1024 --seq-len 512 --batch-size 8 --steps 1800 \\
    --lr 8e-4 --warmup 100 --max-minutes 78 --threads 1 --seed 0 > runs/pretrain.log 2>&1 &
nohup nice -n 19 .venv/bin/python -m train.distill --target runs/stage1-target \\
    --corpus stdlib --out runs/stage1-draft --run-dir runs/draft \\
    --layers 1 --hidden 256 --heads 4 --intermediate 1024 --seq-len 256 --batch-size 16 \\
    --steps 3000 --lr 2e-3 --warmup 50 --ce-weight 0.1 --max-minutes 35 \\
    --threads 1 --seed 0 > runs/distill.log 2>&1 &
# Stage 2: the target trained further on the wider corpus, and the draft distilled again from it.
nohup nice -n 19 .venv/bin/python -m train.pretrain --init-from runs/stage1-target \\
    --out models/stdlib-code-target --run-dir runs/target2 --corpus {corpus} \\
    --seq-len {t_seq} --batch-size {t_batch} --steps {t_steps} --lr {t_lr} --warmup {t_warmup} \\
    --threads 2 > runs/target2.log 2>&1 &
nohup nice -n 19 .venv/bin/python -m train.distill --target models/stdlib-code-target \\
    --init-from runs/stage1-draft --corpus {corpus} \\
    --out models/stdlib-code-draft --run-dir runs/draft2 --seq-len {d_seq} --batch-size {d_batch} \\
    --steps {d_steps} --max-minutes {d_minutes} --lr {d_lr} --warmup {d_warmup} --ce-weight 0.1 \\
    --target-dtype bfloat16 --threads 2 > runs/draft2.log 2>&1 &
# Measurements (this file's numbers)
.venv/bin/python -m train.evaluate --target models/stdlib-code-target \\
    --draft models/stdlib-code-draft --out models/eval.json --threads 1 \\
    --corpus {corpus} --ood-corpus {ood} --loss-windows 16 --prompts 32 --latency-rounds 5
.venv/bin/python -m train.modelcard --eval models/eval.json
```
Both training commands resume from their `runs/*/checkpoint.pt` when run again; the learning
rate follows whichever of the step limit and the time budget comes first, so a run always ends
annealed. Batches depend only on the seed and the step."""

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
  starts from an existing draft (how the shipped draft followed the stage-2 target).
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


def _cmd_args(ts: dict, ds: dict, ood: list[str]) -> dict:
    corpus = " ".join(ts.get("corpus") or ["stdlib"])
    return dict(corpus=corpus, ood=" ".join(ood) or "package:rich", t_seq=ts["seq_len"], t_batch=ts["batch_size"],
                t_steps=ts.get("max_steps", ts["steps"]), t_lr=ts.get("lr", "6e-4"), t_warmup=ts.get("warmup", 30),
                d_seq=ds["seq_len"], d_batch=ds["batch_size"], d_steps=ds.get("max_steps", ds["steps"]),
                d_lr=ds.get("lr", "1e-3"), d_warmup=ds.get("warmup", 20), d_minutes=ds.get("max_minutes") or 30)


def render(ev: dict, stages: dict, corpus_rows: list[dict], target_dir: Path, draft_dir: Path) -> str:
    t1, d1, ts, ds = stages["stage1_target"], stages["stage1_draft"], stages["target"], stages["draft"]
    lo = ev["heldout_loss_nats_per_token"]
    g, s, lat, sp = ev["greedy"], ev["sampled_T1"], ev["latency_ms_per_token"], ev["expected_speedup"]
    code, ood = ev["code_prompts"], ev.get("out_of_domain", {})
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
    corpus_table = "\n".join(f"| `{r['spec']}` | {r['license']} | {r['files']:,} | {r['tokens']:,} |" for r in corpus_rows)
    total = sum(r["tokens"] for r in corpus_rows)
    per_prompt = "\n".join(f"| {i + 1} | `{p['prompt'].splitlines()[0][:60]}` | {p['tokens']} | {p['distinct_3']:.2f} |"
                           for i, p in enumerate(code["prompts"]))
    best = max(code["prompts"], key=lambda p: p["distinct_3"])
    worst = min(code["prompts"], key=lambda p: p["distinct_3"])
    t_tokens = t1["tokens"] + ts["tokens"]
    return f"""# Shipped model pair: `stdlib-code-target` + `stdlib-code-draft`

A matched target/draft pair for speculative decoding of Python code, trained from scratch on this
machine's two CPU cores by the project's own code (`train/`), so that the demo, tests and
benchmarks run on real models with real acceptance rates, offline. Both directories load with
`AutoModelForCausalLM.from_pretrained(DIR)` / `AutoTokenizer.from_pretrained(DIR)`; weights are
stored as bfloat16 safetensors (target) and float32 (draft).

**What to expect.** The target has seen {t_tokens / 1e6:.1f} M training tokens in
{(t1['elapsed_s'] + ts['elapsed_s']) / 60:.0f} minutes of CPU training; models of this size are
usually trained on a thousand times more. Its held-out loss is {lo['target']:.2f} nats/token. On
code from outside the standard library its greedy continuations score a mean distinct-3-gram ratio of
**{code['mean_distinct_3']:.2f}** (a loop scores near 0, real code about 0.8): see the quality
section below for what it writes. The pair is meant for measuring speculative decoding; the
engine's exactness does not depend on it.

| | target `models/stdlib-code-target/` | draft `models/stdlib-code-draft/` |
|---|---|---|
| architecture | {_arch(target_dir)} | {_arch(draft_dir)} |
| parameters | {ev['target_parameters']:,} | {ev['draft_parameters']:,} ({ev['draft_parameters'] / ev['target_parameters']:.3f} of the target) |
| size on disk | {_mb(target_dir):.1f} MB | {_mb(draft_dir):.1f} MB |
| training | next-token cross-entropy | distillation: 0.9·KL(p_target ‖ q_draft) + 0.1·CE |
| stage 1: standard library | {t1['tokens']:,} tokens, {t1['elapsed_s'] / 60:.0f} min | {d1['tokens']:,} tokens, {d1['elapsed_s'] / 60:.0f} min |
| stage 2: wider corpus, from stage 1 | {ts['tokens']:,} tokens ({ts['steps']} steps × {ts['batch_size']} × {ts['seq_len']}), {ts['elapsed_s'] / 60:.0f} min | {ds['tokens']:,} tokens ({ds['steps']} steps × {ds['batch_size']} × {ds['seq_len']}), {ds['elapsed_s'] / 60:.0f} min |
| final training loss | {ts['final_loss']:.3f} | {ds['final_loss']:.3f} (mixed KL/CE) |
| **held-out loss** (nats/token) | **{lo['target']:.3f}** | **{lo['draft']:.3f}** |
| **decoding latency** (batch 1, KV cache, float32, {ev['machine']['torch_threads']} thread(s); best of {lat['rounds']} alternating runs of {lat['steps_per_round']} steps) | **{lat['target']:.2f} ms/token** | **{lat['draft']:.2f} ms/token** (c = {c:.3f}) |

Training ran at nice 19 with bf16 autocast (weights and optimizer state in float32) on an AMD EPYC
with two cores shared with the project's other work (benchmarks and tests were running), so the
minutes above are wall-clock minutes of a busy machine.

Tokenizer (shared, identical files in both directories): byte-level BPE, {ev.get('vocab_size', 8192)} tokens, trained
with `tokenizers` on the stage-1 training split; special tokens `<|pad|>` (0), `<|bos|>` (1), `<|eos|>` (2);
`eos_token_id` = 2 in both configs and generation configs. Documents are fed as
`<|bos|> text <|eos|>`.

## Corpus

Stage 1: the CPython {t1.get('python', platform.python_version())} standard library ({t1['corpus_files']} training files,
{t1['corpus_tokens']:,} tokens). Stage 2 adds the Python source (`.py` files only) of permissively
licensed packages installed beside the project ({total:,} tokens in all, training split):

| corpus | license | training files | tokens |
|---|---|---|---|
{corpus_table}

About 5% of the files of every part are held out by a hash of their path (`train/corpus.py`):
held-out loss and α below use only held-out files ({ev['heldout_files']} files,
{ev['heldout_tokens']:,} tokens). Out-of-domain figures use packages the pair never trained on
({', '.join(f'`{x}`' for x in ood.get('corpus', []))}: {ood.get('tokens', 0):,} tokens).

## Quality on code from outside the standard library

Greedy continuations ({code['max_new_tokens']} tokens, or up to EOS) of the five prompts of
`bench/prompts.py` `CODE_PROMPTS` (numpy, Flask, PyTorch, requests, pandas code, written for the
benchmarks): mean distinct-3-gram ratio **{code['mean_distinct_3']:.2f}**, and the draft's greedy α
along them **{code['alpha']:.3f}** ({code['positions']} positions).

| prompt | first line | tokens | distinct-3 |
|---|---|---|---|
{per_prompt}

The best of them (distinct-3 {best['distinct_3']:.2f}):

```python
{best['prompt']}{best['completion']}
```

The worst (distinct-3 {worst['distinct_3']:.2f}):

```python
{worst['prompt']}{worst['completion']}
```

## Acceptance (`train/evaluate.py`, `models/eval.json`)

* **Greedy acceptance α = {g['alpha']:.3f}** on held-out files of the training corpora —
  teacher-forced agreement of the draft's argmax with the target's argmax along the target's own
  greedy continuations ({g['positions']} positions: {ev.get('prompts', 48)} held-out prompts of 128 tokens,
  64 generated tokens each); **α = {ood.get('alpha', float('nan')):.3f}** out of domain ({ood.get('positions', 0)} positions);
  **α = {code['alpha']:.3f}** on the code prompts above.
  Measured tokens per verify round with greedy drafting of γ tokens (held-out, exact for greedy: the draft
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
{lat['draft_median']:.2f} / {lat['target_median']:.2f} = {lat['c_median']:.3f}). S = E / (γ·c + 1) with E = (1 − α^(γ+1)) / (1 − α)
(columns 2 and 4), and with E replaced by the measured tokens per round (columns 3 and 5):

| γ | greedy, bound (α={g['alpha']:.3f}) | greedy, measured E | T=1, bound (β={s['beta_mean']:.3f}) | T=1, path E |
|---|---|---|---|---|
{chr(10).join(rows)}

Best γ: greedy **γ = {sp['greedy']['best_gamma']}, S = {sp['greedy']['best_speedup']:.2f}×**; T=1 γ = {sp['sampled_T1']['best_gamma']},
S = {sp['sampled_T1']['best_speedup']:.2f}×. These are in-process bounds over target-only decoding; the
services add RPC and scheduling costs (ρ in DESIGN.md §7), and what they reach against
transformers' own `generate()` is measured in `bench/results/ENGINE.md`. Latencies were measured
on an AMD EPYC (AVX512-BF16), 2 cores, torch {ev['machine']['torch']}, {ev['machine']['torch_threads']} thread(s);
evaluation took {ev['eval_seconds']:.0f} s.

## How the sizes were chosen

Measured before stage 1, with randomly initialised models on this machine (batch-1 KV-cache
decoding in float32, 2 threads, median of 5 runs of 64 steps; vocab 8192):

| model | parameters | ms/token |
|---|---|---|
| 8 layers × 512, MLP 1408, untied (the target) | 34.1 M | 14.6 |
| 1 layer × 256, MLP 768, tied | 2.9 M | 1.0–1.3 |
| 1 layer × 192, MLP 512, tied | 2.0 M | 0.9 |
| 2 layers × 256, MLP 640, tied | 3.6 M | 2.0–2.2 |

A second layer costs the draft about as much as the whole first one (Python overhead per layer
dominates tiny models), so the draft has one layer of width 256 (MLP 1024: 3.1 M parameters,
0.092 of the target), keeping a draft step under 1/6 of a target step. Stage 2 kept both sizes:
a smaller target trains on more tokens per minute, but its step would be too cheap against the
services' fixed cost per round and against any draft this machine runs in Python.

## Reproducing

{COMMANDS.format(**_cmd_args(ts, ds, ood.get('corpus', [])))}

Figures of the runs that produced these files: `models/training.json`; raw measurements:
`models/eval.json`.

{TOOL}
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval", default="models/eval.json")
    ap.add_argument("--training", default="models/training.json",
                    help="the runs' summaries: stage1_target, stage1_draft, target, draft (and the corpus table, added once)")
    ap.add_argument("--target-summary", default=None, help="stage 2 target run summary to record in --training")
    ap.add_argument("--draft-summary", default=None, help="stage 2 draft run summary to record in --training")
    ap.add_argument("--target-dir", default="models/stdlib-code-target")
    ap.add_argument("--draft-dir", default="models/stdlib-code-draft")
    ap.add_argument("--out", default="models/README.md")
    args = ap.parse_args(argv)
    ev = json.loads(Path(args.eval).read_text())
    runs = json.loads(Path(args.training).read_text())
    for key, path in (("target", args.target_summary), ("draft", args.draft_summary)):
        if path:
            runs[key] = json.loads(Path(path).read_text())
    if "corpus" not in runs:
        from transformers import AutoTokenizer  # noqa: PLC0415

        from train import corpus  # noqa: PLC0415

        runs["corpus"] = corpus.describe(runs["target"].get("corpus") or ["stdlib"], AutoTokenizer.from_pretrained(args.target_dir))
    Path(args.training).write_text(json.dumps(runs, indent=2) + "\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(ev, runs, runs["corpus"], Path(args.target_dir), Path(args.draft_dir)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
