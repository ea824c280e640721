"""Distilling a small draft model for any local Hugging Face causal LM target.

    python -m train.distill --target path/to/target --corpus my_code/ more.py --out my-draft \
        [--layers 1 --hidden 256 --intermediate 1024 --steps 2000 --max-minutes 30]

The draft is a small ``LlamaForCausalLM`` with the target's vocabulary (its output row ``i``
is the target's token ``i``) and the target's tokenizer: its files are copied into the output
directory with ``tokenizer_class`` set to the class the target's tokenizer loaded as, so that
AutoTokenizer resolves the same class for the draft whatever its model type (a Qwen2 target's
tokenizer is a Qwen2Tokenizer, not the Llama draft's default).  It is trained to match the target's
next-token distribution: at every position of windows cut from the corpus, the target runs
without gradients and the loss is the KL divergence ``KL(p_target || q_draft)`` (optionally
mixed with the ordinary cross-entropy on the corpus, ``--ce-weight``).  Matching the whole
distribution, not only the corpus token, is what raises the acceptance rate.

The corpus is any mix of files and directories (every text file under a directory), the
word ``stdlib`` for the training split of the Python standard library, and ``package:NAME`` for
an installed package's Python source.  About 5% of the files
(chosen by a hash of their path) are held out and never trained on.

Running the same command again resumes from ``RUN_DIR/checkpoint.pt`` (default
``runs/distill-<name of --out>``): ``--steps`` counts all the steps so far, ``--max-minutes`` is
this run's budget. The loss log is ``RUN_DIR/log.jsonl``. A run that trains nothing (``--steps``
already reached) leaves an existing export as it is, unless that export is of another step than
the checkpoint (an interrupted run checkpoints without exporting: ``RUN_DIR/exported.json``
records the step exported). The checkpoint records the target (its path, config.json and
vocabulary) and the draft's shape; a run with another target or shape refuses to resume it.

At the end the run checks that the exported draft's tokenizer gives the target's vocabulary
fingerprint (and fails if not, saying what differs), measures greedy acceptance and the cost
ratio on held-out text, and prints a verdict with the predicted speed-up and the two commands
that serve the pair (train/verdict.py). ``RUN_DIR/summary.json`` records all of it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

from specdec.engine.cache import available_memory_bytes
from specdec.lm import vocab_fingerprint
from specdec.startup import number
from train import checkpoint, corpus, loop, pairing, verdict
from train.architecture import draft_config
from train.data import WindowSampler, corpus_tokens
from train.pretrain import seed_everything

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def copy_tokenizer(target_dir: Path, out_dir: Path, tokenizer) -> None:
    """Copy the target's tokenizer files (fall back to re-saving the tokenizer), naming in
    tokenizer_config.json the class the target's tokenizer loaded as: without it AutoTokenizer
    picks a class from the draft's model type, which may differ from the target's."""
    out_dir.mkdir(parents=True, exist_ok=True)
    copied = False
    for name in TOKENIZER_FILES:
        src = target_dir / name
        if src.is_file():
            shutil.copyfile(src, out_dir / name)
            copied = True
    named = target_dir / "additional_chat_templates"  # transformers' named chat templates (tool_use, ...): the template is all of them
    if named.is_dir():
        shutil.rmtree(out_dir / named.name, ignore_errors=True)
        shutil.copytree(named, out_dir / named.name)
    if not copied or not (out_dir / "tokenizer_config.json").is_file():
        tokenizer.save_pretrained(out_dir)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = type(tokenizer).__name__
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def distillation_loss(target, temperature: float = 1.0, ce_weight: float = 0.0):
    """``loss_fn(draft, batch)`` for ``train.loop``: KL(target || draft), mixed with CE."""

    def loss_fn(draft, batch):
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with torch.no_grad():
            t_logits = target(input_ids=inputs).logits.float()
        d_logits = draft(input_ids=inputs).logits.float()
        vocab = d_logits.size(-1)
        t_logits = t_logits[..., :vocab]  # targets may pad their output layer beyond the vocab
        t_logp = F.log_softmax(t_logits / temperature, dim=-1).reshape(-1, vocab)
        d_logp = F.log_softmax(d_logits / temperature, dim=-1).reshape(-1, vocab)
        kl = F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean") * temperature ** 2
        ce = F.cross_entropy(d_logits.reshape(-1, vocab), labels.reshape(-1))
        loss = (1.0 - ce_weight) * kl + ce_weight * ce
        with torch.no_grad():
            agree = (d_logits.argmax(-1) == t_logits.argmax(-1)).float().mean()
        return loss, {"kl": kl.detach(), "ce": ce.detach(), "argmax_agree": agree}  # tensors: no host sync inside a compiled step

    return loss_fn


POSITIVE_INT, COUNT, POSITIVE = number(int, low=1), number(int, low=0), number(float, above=0)  # specdec/startup.py's flag types


LOSS_TENSORS = 7  # float32 tensors of the logits' size the loss holds at once (both models' logits, log-softmaxes, grads)


def warn_loss_memory(batch_size: int, seq_len: int, vocab: int, device) -> None:
    """A warning, with a batch size that fits, when the loss alone would take more than half the
    free memory: it grows with the vocabulary (about 16 GiB at the default batch for 152k tokens)."""
    need = LOSS_TENSORS * batch_size * seq_len * vocab * 4
    free = available_memory_bytes(torch.device(device))
    if free and need > free / 2:
        fits = int(batch_size * free / 2 / need)
        advice = f"--batch-size {fits} would fit" if fits else "even --batch-size 1 would not: a shorter --seq-len too"
        print(f"WARNING: the loss needs about {need / 2**30:.1f} GiB ({LOSS_TENSORS} x batch {batch_size} x seq-len {seq_len} "
              f"x vocabulary {vocab} x 4 bytes), {free / 2**30:.1f} GiB is free: {advice}", flush=True)


def identity(target_dir: Path, tokenizer, target, draft) -> dict:
    """What a checkpoint was trained for: the target (path, config.json, vocabulary) and the draft's shape."""
    c = draft.config
    return {"target": str(target_dir.resolve()),
            "target config.json sha256": hashlib.sha256((target_dir / "config.json").read_bytes()).hexdigest()[:16],
            "target vocabulary fingerprint": vocab_fingerprint(tokenizer, pairing.rows(target))[:16],
            "--layers": c.num_hidden_layers, "--hidden": c.hidden_size, "--heads": c.num_attention_heads,
            "--intermediate": c.intermediate_size, "--untie": not c.tie_word_embeddings,
            "--max-positions": c.max_position_embeddings}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m train.distill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="local Hugging Face causal LM directory")
    ap.add_argument("--corpus", required=True, nargs="+", help="files and/or directories, 'stdlib', or 'package:NAME'")
    ap.add_argument("--exclude", nargs="*", default=[], help="packages 'site:permissive' leaves out")
    ap.add_argument("--tokens-cache", default=None, help="save the token stream here, reuse it if present")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--init-from", default=None, help="start from this draft directory instead of random weights")
    ap.add_argument("--out", required=True, help="output directory of the draft model")
    ap.add_argument("--run-dir", default=None, help="checkpoints and loss log (default runs/distill-<out name>)")
    ap.add_argument("--layers", type=POSITIVE_INT, default=None, help="default 1")
    ap.add_argument("--hidden", type=POSITIVE_INT, default=None, help="default 256")
    ap.add_argument("--heads", type=POSITIVE_INT, default=None, help="default 4")
    ap.add_argument("--intermediate", type=POSITIVE_INT, default=None, help="MLP width (default 4 x hidden)")
    ap.add_argument("--untie", action="store_true", help="separate output layer (default: tied to the embedding)")
    ap.add_argument("--max-positions", type=POSITIVE_INT, default=None, help="default: the target's")
    ap.add_argument("--seq-len", type=POSITIVE_INT, default=256)
    ap.add_argument("--batch-size", type=POSITIVE_INT, default=16)
    ap.add_argument("--steps", type=POSITIVE_INT, default=2000)
    ap.add_argument("--max-minutes", type=POSITIVE, default=None, help="this run's training time budget (a re-run trains this long again)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--temperature", type=POSITIVE, default=1.0, help="distillation temperature")
    ap.add_argument("--ce-weight", type=float, default=0.1, help="weight of the corpus cross-entropy")
    ap.add_argument("--target-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--no-bf16", action="store_true", help="no bf16 autocast (slower on most CPUs)")
    ap.add_argument("--checkpoint-minutes", type=float, default=5.0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the training step (pays on a GPU)")
    ap.add_argument("--max-ratio", type=float, default=0.15,
                    help="warn if draft/target parameters exceed this (the shipped pair's draft is 0.14 of its target)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verdict-prompts", type=COUNT, default=16, help="held-out prompts the closing acceptance estimate uses (0: skip it)")
    args = ap.parse_args(argv)
    shape = [f for f in ("layers", "hidden", "heads", "intermediate", "max_positions") if getattr(args, f) is not None] + \
        (["untie"] if args.untie else [])
    if args.init_from and shape:  # the draft is the one in --init-from: its shape is its own
        ap.error(f"--init-from takes the draft's shape from its directory: not with --{shape[0].replace('_', '-')}")
    args.layers, args.hidden, args.heads = args.layers or 1, args.hidden or 256, args.heads or 4
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r}: cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here")
    if args.init_from and not (Path(args.init_from) / "config.json").is_file():
        ap.error(f"--init-from {args.init_from}: not a local model directory (no config.json in it)")
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")

    target_dir, out_dir = Path(args.target), Path(args.out)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / f"distill-{out_dir.name}"
    if not (target_dir / "config.json").is_file():
        raise SystemExit(f"distill: --target {args.target} is not a local model directory (no config.json in it)")
    if out_dir.resolve() == target_dir.resolve():
        raise SystemExit(f"distill: --out {args.out} is the --target directory: the export would overwrite the target; give another --out")
    if (out_dir / "config.json").is_file() and not (run_dir / checkpoint.CKPT_NAME).is_file():
        raise SystemExit(f"distill: --out {args.out} already holds a model (config.json) that this run did not make "
                         f"({run_dir} has no checkpoint): give another --out, or remove it")
    specs = corpus.expand(args.corpus, args.exclude)
    corpus.check(specs, "distill: --corpus")  # one line for a spec that names nothing

    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise SystemExit(f"distill: no tokenizer loads from --target {args.target} ({_first_line(e)})") from None
    try:
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, args.target_dtype), local_files_only=True)
    except (OSError, ValueError) as e:
        raise SystemExit(f"distill: the model in --target {args.target} does not load ({_first_line(e)})") from None
    target.to(args.device).eval().requires_grad_(False)

    tokens, rows = corpus_tokens(tokenizer, specs, "train", cache=args.tokens_cache)
    n_files = sum(r["files"] for r in rows)
    print(f"corpus: {len(specs)} sources, {n_files} files, {tokens.numel():,} tokens", flush=True)
    if tokens.numel() < 2:
        raise SystemExit(f"distill: the corpus has no text to train on ({n_files} readable text files, "
                         f"{tokens.numel()} tokens in --corpus {' '.join(args.corpus)})")

    torch.manual_seed(args.seed)
    cfg = draft_config(target.config, args.hidden, args.layers, args.heads,
                       args.intermediate or 4 * args.hidden, not args.untie, args.max_positions, rows=pairing.rows(target))
    if args.init_from:
        init = json.loads((Path(args.init_from) / "config.json").read_text())
        if init.get("model_type") != "llama":
            raise SystemExit(f"distill: --init-from {args.init_from} is a {init.get('model_type')!r} model; the drafts distill "
                             "makes are Llama ones (another kind would load with weights dropped)")
        if init.get("vocab_size") != pairing.rows(target):
            raise SystemExit(f"distill: --init-from {args.init_from} has {init.get('vocab_size')} output rows, the target "
                             f"{pairing.rows(target)}: a draft of another vocabulary")
    draft = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32) if args.init_from else LlamaForCausalLM(cfg)
    draft.to(args.device)
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in draft.parameters())
    print(f"target {n_t:,} parameters, draft {n_d:,} ({n_d / n_t:.3f} of the target)", flush=True)
    if n_d > args.max_ratio * n_t:
        print(f"WARNING: the draft is larger than {args.max_ratio} of the target", flush=True)

    warn_loss_memory(args.batch_size, args.seq_len, pairing.rows(target), args.device)
    sampler = WindowSampler(tokens, args.seq_len, args.batch_size, seed=args.seed)
    summary = loop.run(draft, sampler.batch, distillation_loss(target, args.temperature, args.ce_weight),
                       loop.LoopConfig(run_dir=run_dir, max_steps=args.steps, max_minutes=args.max_minutes,
                                       lr=args.lr, warmup_steps=args.warmup, bf16=not args.no_bf16,
                                       checkpoint_minutes=args.checkpoint_minutes, desc="distill", compile=args.compile,
                                       identity=identity(target_dir, tokenizer, target, draft)))

    # export the checkpoint unless --out holds it already (an interrupted run checkpointed, exported nothing)
    record = {"step": summary["steps"], "out": str(out_dir.resolve())}
    exported = summary["steps"] > 0 and (not (out_dir / "config.json").is_file() or _exported(run_dir) != record)
    if exported:
        draft.generation_config = GenerationConfig.from_dict(target.generation_config.to_dict()) \
            if target.generation_config is not None else GenerationConfig()
        m = draft.to("cpu", getattr(torch, args.save_dtype))
        m.config.use_cache = True
        for old in [*out_dir.glob("model*.safetensors"), *out_dir.glob("pytorch_model*.bin"), out_dir / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)  # a re-export that shards otherwise left the last one's file, which loads first
        m.save_pretrained(out_dir, safe_serialization=True, max_shard_size="40MB")
        copy_tokenizer(target_dir, out_dir, tokenizer)
        (run_dir / EXPORTED).write_text(json.dumps(record) + "\n")
    summary.update(exported=exported, exported_step=(_exported(run_dir) or {}).get("step"), out=str(out_dir), target=str(target_dir))
    summary.update(target_parameters=n_t, draft_parameters=n_d, ratio=n_d / n_t,
                   corpus_tokens=int(tokens.numel()), corpus_files=n_files, device=str(args.device),
                   seq_len=sampler.seq_len, batch_size=args.batch_size, max_steps=args.steps, lr=args.lr,
                   warmup=args.warmup, max_minutes=args.max_minutes, corpus=args.corpus, init_from=args.init_from,
                   ce_weight=args.ce_weight, temperature=args.temperature)
    if not (out_dir / "config.json").is_file():
        _write(run_dir, summary)
        raise SystemExit(f"distill: nothing trained (--steps {args.steps}, --max-minutes {args.max_minutes}) and no draft "
                         f"in {out_dir}: nothing exported")
    saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    pair = pairing.check_pair(tokenizer, pairing.rows(target), out_dir, pairing.rows(saved))
    summary.update(pair)
    if not pair["match"]:
        _write(run_dir, summary)
        raise SystemExit(f"distill: the draft in {out_dir} does not pair with the target: {pair['problem']} "
                         f"(vocabulary fingerprints: draft {pair['draft_fingerprint'][:12]}, target {pair['target_fingerprint'][:12]})")
    print(_what_happened(summary, args), flush=True)
    if args.verdict_prompts:
        summary["verdict"] = verdict.measure(target, saved, tokenizer, specs, tokens, prompts=args.verdict_prompts)
        print(verdict.report(summary["verdict"], target_dir, out_dir, pair), flush=True)
    _write(run_dir, summary)
    print(f"summary: {run_dir / 'summary.json'}", flush=True)
    return summary


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


EXPORTED = "exported.json"  # in the run directory: the step exported last, and where to


def _exported(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / EXPORTED).read_text())
    except (OSError, ValueError):
        return None


def _write(run_dir: Path, summary: dict) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _what_happened(s: dict, args) -> str:
    run = (f"trained {s['steps_this_run']} steps in {s['minutes_this_run']:.1f} min"
           + (f", resumed at step {s['resumed_from_step']}" if s["resumed_from_step"] else "")
           + f"; {s['steps']} steps and {s['tokens']:,} tokens in all")
    if not s["steps_this_run"]:
        run = f"nothing to train: the run is at step {s['steps']} and --steps is {args.steps} (raise --steps to go on)"
    stop = {"steps": f"--steps {args.steps} reached", "max-minutes": f"--max-minutes {args.max_minutes} used up"}[s["stopped_by"]]
    loss = f"final loss {s['final_loss']:.4f}" if s["final_loss"] is not None else "no loss yet"
    out = f"exported to {s['out']}" if s["exported"] else f"the draft in {s['out']} was left as it was"
    if 0 < s["steps"] < args.warmup:
        out += f" (the run is still in its --warmup of {args.warmup} steps: the learning rate has not reached --lr yet)"
    return f"distill: {run}" + (f" ({stop})" if s["steps_this_run"] else "") + f"; {loss}; {out}"


if __name__ == "__main__":
    main()
