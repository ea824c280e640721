"""Measuring a (target, draft) pair for speculative decoding on held-out text.

    python -m train.evaluate --target models/stdlib-code-target --draft models/stdlib-code-draft \
        --out models/eval.json

Everything is measured in float32 with batch-1 KV-cache decoding, the way the services run, on
held-out text of ``--corpus`` (where it holds out too little: the end of its training text, as
``text`` says). The draft must pair with the target as the services pair them (the same vocabulary
fingerprint, or the same tokenizer over other output rows: then q is taken over the target's rows):

* held-out loss (nats/token) of each model on held-out windows;
* greedy acceptance α: teacher-forced agreement of the draft's argmax with the target's argmax
  along the TARGET's own greedy continuations of held-out prompts, and from it the measured
  expected tokens per verify round for greedy drafting of γ tokens;
* T=1 acceptance: along the draft's own sampled 8-token proposals, β_k = Σ_x min(p(x), q(x))
  at proposal position k = 1..8; the mean β, the product-form estimate of tokens per round,
  and the unbiased path estimate E[Π_j min(1, p(x_j)/q(x_j))];
* on code from outside the standard library (train/code_prompts.py CODE_PROMPTS): the distinct-3-gram
  ratio of the target's greedy 128-token continuations (a loop scores near 0, real code about
  0.8) and α along them;
* α on out-of-domain code (``--ood-corpus``: packages the pair never trained on);
* per-token decoding latency of each model and c = draft / target (alternating runs; the
  minimum over runs is reported as the latency, the median is kept too);
* the expected speed-up of DESIGN.md §7, S = E / (γ·c + 1) with E = (1 − α^(γ+1)) / (1 − α),
  for γ = 1..8, and the best γ.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import architectures, startup
from specdec.costmodel import best_gamma, round_cost, speedup
from specdec.engine import cache_kwargs, returned_cache
from specdec.lm import eos_ids
from train import corpus
from train.code_prompts import CODE_PROMPTS
from train.data import tokenize_documents
from train.latency import compare_latency
from train.pairing import check_pair, feedable, fit_rows, rows

GAMMAS = range(1, 9)


def speedup_table(alpha: float, c: float) -> dict:
    """The bound S = E / (γ·c + 1) of specdec/costmodel.py for every γ, and the best γ."""
    table = {g: round(speedup(alpha, g, c), 3) for g in GAMMAS}
    best = best_gamma(alpha, c, GAMMAS)
    return {"alpha": round(alpha, 4), "by_gamma": table, "best_gamma": best, "best_speedup": table[best]}


@torch.no_grad()
def heldout_loss(model, tokens: torch.Tensor, seq_len: int, max_windows: int) -> float:
    total, count = 0.0, 0
    n = min(max_windows, (tokens.numel() - 1) // seq_len)
    for i in range(n):
        w = tokens[i * seq_len: i * seq_len + seq_len + 1][None]
        logits = model(input_ids=w[:, :-1]).logits.float()
        total += F.cross_entropy(logits[0], w[0, 1:], reduction="sum").item()
        count += seq_len
    return total / count


def prompts_from(tokens: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """``n`` prompts of ``length`` tokens at evenly spaced offsets of the held-out stream."""
    span = tokens.numel() - length - 1
    starts = [int(i * span / n) for i in range(n)]
    return torch.stack([tokens[s:s + length] for s in starts])


@torch.no_grad()
def greedy_continue(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    out = model(input_ids=ids, use_cache=True)
    past, new = returned_cache(out), []
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    for i in range(steps):
        new.append(tok)
        if i + 1 == steps:
            break
        out = model(input_ids=tok, use_cache=True, **cache_kwargs(model, past))
        past = returned_cache(out)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(new, dim=1)


@torch.no_grad()
def greedy_acceptance(target, draft, prompts: torch.Tensor, steps: int, batch: int) -> dict:
    """α along the target's greedy continuations, and measured greedy tokens per round."""
    agree_rows = []
    for i in range(0, len(prompts), batch):
        p = prompts[i:i + batch]
        cont = greedy_continue(target, p, steps)
        full = torch.cat([p, cont], dim=1)
        L = p.size(1)
        t_logits = target(input_ids=full[:, :-1]).logits[:, L - 1:]
        t_arg = t_logits.argmax(-1)
        d_arg = fit_rows(draft(input_ids=feedable(draft, full[:, :-1])).logits[:, L - 1:], t_logits.size(-1)).argmax(-1)
        # t_arg re-derives the continuation in one parallel pass; use it as the reference so
        # tiny numeric differences between cached and parallel passes cannot bias α.
        agree_rows.append((d_arg == t_arg).float())
    agree = torch.cat(agree_rows).cpu()  # [prompts, steps]
    alpha = agree.mean().item()
    # Greedy drafting of γ tokens from position t is accepted up to k iff the draft agrees at
    # t..t+k-1 (identical contexts while it agrees): P(first k accepted) = mean Π agree.
    per_round = {}
    for g in GAMMAS:
        usable = agree.size(1) - g + 1
        if usable <= 0:
            break
        e = torch.ones(agree.size(0), usable)
        run = torch.ones(agree.size(0), usable)
        for k in range(g):
            run = run * agree[:, k:k + usable]
            e = e + run
        per_round[g] = round(e.mean().item(), 4)
    return {"alpha": alpha, "positions": agree.numel(), "tokens_per_round_measured": per_round}


def distinct_ngrams(ids: list[int], n: int = 3) -> float:
    """Distinct n-grams / n-grams of a token sequence (1.0: no n-gram repeats)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


@torch.no_grad()
def code_prompts_quality(target, draft, tokenizer, prompts: list[str], steps: int) -> dict:
    """The target's greedy continuations of `prompts` (cut at EOS, as generate() stops): their
    distinct-3-gram ratio and text, and the draft's greedy α along them."""
    eos = eos_ids(target.config, architectures.text_config(target.config), getattr(target, "generation_config", None)) or eos_ids(tokenizer)
    rows, agree, positions = [], 0.0, 0  # (cut at the EOS ids the services stop at: config's, generation_config's)
    for text in prompts:
        ids = torch.tensor([tokenizer(text).input_ids])
        cont = greedy_continue(target, ids, steps)[0].tolist()
        end = next((i for i, t in enumerate(cont) if t in eos), None)
        if end is not None:
            cont = cont[:end + 1]
        g = greedy_acceptance(target, draft, ids, len(cont), 1)
        agree += g["alpha"] * g["positions"]
        positions += g["positions"]
        rows.append({"prompt": text, "completion": tokenizer.decode(cont), "tokens": len(cont),
                     "distinct_3": round(distinct_ngrams(cont), 4)})
    return {"mean_distinct_3": round(sum(r["distinct_3"] for r in rows) / len(rows), 4),
            "alpha": round(agree / positions, 4), "positions": positions, "max_new_tokens": steps, "prompts": rows}


@torch.no_grad()
def sampled_acceptance(target, draft, prompts: torch.Tensor, gamma: int, batch: int, seed: int) -> dict:
    """T=1 acceptance per proposal position along the draft's own samples."""
    gen = torch.Generator().manual_seed(seed)
    betas, ratios = [], []
    n = rows(target)  # q over the target's rows, as the draft service sends it
    for i in range(0, len(prompts), batch):
        p = prompts[i:i + batch]
        out = draft(input_ids=feedable(draft, p), use_cache=True)
        past, qs, xs = returned_cache(out), [], []
        logits = fit_rows(out.logits[:, -1].float(), n)
        for k in range(gamma):
            q = F.softmax(logits, dim=-1)
            x = torch.multinomial(q, 1, generator=gen)
            qs.append(q)
            xs.append(x)
            if k + 1 < gamma:
                out = draft(input_ids=x, use_cache=True, **cache_kwargs(draft, past))
                past = returned_cache(out)
                logits = fit_rows(out.logits[:, -1].float(), n)
        xs_t = torch.cat(xs, dim=1)
        L = p.size(1)
        t_logits = target(input_ids=torch.cat([p, xs_t[:, :-1]], dim=1)).logits[:, L - 1:].float()
        ps = F.softmax(t_logits, dim=-1)  # [B, gamma, V]
        qs_t = torch.stack(qs, dim=1)
        betas.append(torch.minimum(ps, qs_t).sum(-1))
        px = ps.gather(-1, xs_t[..., None])[..., 0]
        qx = qs_t.gather(-1, xs_t[..., None])[..., 0]
        ratios.append(torch.clamp(px / qx, max=1.0))
    beta = torch.cat(betas)  # [prompts, gamma]
    ratio = torch.cat(ratios)
    beta_k = beta.mean(0).tolist()
    product, path = {}, {}
    for g in range(1, gamma + 1):
        product[g] = round(1 + sum(float(torch.tensor(beta_k[:k]).prod()) for k in range(1, g + 1)), 4)
        path[g] = round(1 + sum(ratio[:, :k].prod(1).mean().item() for k in range(1, g + 1)), 4)
    return {"beta_mean": beta.mean().item(), "beta_by_position": [round(b, 4) for b in beta_k],
            "tokens_per_round_product_form": product, "tokens_per_round_path_estimate": path,
            "rounds": beta.size(0)}


def load(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--corpus", nargs="+", default=["stdlib"],
                    help="held-out split of these: 'stdlib' (default), 'package:NAME', files or directories")
    ap.add_argument("--ood-corpus", nargs="*", default=[],
                    help="out-of-domain code the pair never trained on (all of it), e.g. package:rich")
    ap.add_argument("--code-tokens", type=startup.number(int, low=1), default=128, help="greedy tokens per code prompt")
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--loss-seq-len", type=startup.number(int, low=1), default=512)
    ap.add_argument("--loss-windows", type=startup.number(int, low=1), default=48)
    ap.add_argument("--prompts", type=startup.number(int, low=1), default=48)
    ap.add_argument("--prompt-len", type=startup.number(int, low=1), default=128)
    ap.add_argument("--continuation", type=startup.number(int, low=1), default=64)
    ap.add_argument("--batch", type=startup.number(int, low=1), default=8)
    ap.add_argument("--latency-steps", type=startup.number(int, low=1), default=64)
    ap.add_argument("--latency-rounds", type=startup.number(int, low=1), default=7)
    ap.add_argument("--threads", type=startup.number(int, low=1), default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)


    corpus.check(corpus.expand(args.corpus), "evaluate: --corpus")  # before any model loads: one line, not a traceback later
    corpus.check(args.ood_corpus, "evaluate: --ood-corpus")
    for flag, path in (("--target", args.target), ("--draft", args.draft)):  # one line, as the services say it
        try:
            startup.check_model_dir(path, flag)
        except startup.StartupError as e:
            raise SystemExit(f"evaluate: {e}") from None
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target, draft = load(args.target), load(args.draft)
    n_t, n_d = rows(target), rows(draft)
    pair = check_pair(tokenizer, n_t, args.draft, n_d)  # other rows or special roles over one tokenizer pair too, as in the services
    if not pair["match"]:
        raise SystemExit(f"evaluate: the draft {args.draft} does not pair with the target {args.target}: {pair['problem']} "
                         f"(vocabulary fingerprints: draft {pair['draft_fingerprint'][:12]}, target {pair['target_fingerprint'][:12]})")
    ood_names = [x.split(":", 1)[1] for x in args.ood_corpus if x.startswith("package:")]
    trained = corpus.documents(args.corpus, "train", exclude=ood_names)  # as train.gpu.sh trains: --exclude the OOD packages
    held = corpus.documents(args.corpus, "heldout", exclude=ood_names)
    docs = corpus.unseen(held, trained)  # a held-out file with a trained copy elsewhere is not held out
    print(f"held-out: {len(held) - len(docs)} files left out, copies of trained ones", flush=True)
    tokens = tokenize_documents(tokenizer, docs)
    print(f"held-out: {len(docs)} files, {tokens.numel():,} tokens", flush=True)
    seq = min(args.loss_seq_len, architectures.context_limit(target.config))
    text, held_tokens = "held-out files", tokens.numel()
    if tokens.numel() < max(seq, args.prompt_len) + args.prompts + 1:  # as train.verdict.measure does
        text = (f"the end of the training text (too little held out: {len(docs)} files, {tokens.numel():,} tokens; "
                f"--loss-seq-len {seq} and --prompt-len {args.prompt_len} need {max(seq, args.prompt_len) + args.prompts + 1})")
        tokens = tokenize_documents(tokenizer, trained)
        tokens = tokens[-max(args.loss_windows * seq + 1, args.prompt_len + args.prompts + 1):]
        seq = max(1, min(seq, tokens.numel() - 1))
        print(f"measured on {text}: {tokens.numel():,} tokens", flush=True)
    if tokens.numel() < 2:
        raise SystemExit(f"evaluate: nothing to measure on: --corpus {' '.join(args.corpus)} gives {tokens.numel()} tokens")
    prompt_len = min(args.prompt_len, tokens.numel() - 1)
    res: dict = {
        "target": args.target, "draft": args.draft,
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "vocab_size": target.config.vocab_size, "prompts": args.prompts,
        "text": text, "heldout_files": len(docs), "heldout_tokens": int(held_tokens),
        "heldout_files_left_out_as_trained": len(held) - len(docs),
        "machine": {"processor": platform.processor() or platform.machine(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
    }
    t0 = time.time()
    res["heldout_loss_nats_per_token"] = {
        "target": heldout_loss(target, tokens, seq, args.loss_windows),
        "draft": heldout_loss(draft, tokens, seq, args.loss_windows),
        "tokens": min(args.loss_windows, (tokens.numel() - 1) // seq) * seq,
    }
    print("loss", res["heldout_loss_nats_per_token"], flush=True)
    prompts = prompts_from(tokens, args.prompts, prompt_len)
    res["greedy"] = greedy_acceptance(target, draft, prompts, args.continuation, args.batch)
    print("greedy", res["greedy"], flush=True)
    res["code_prompts"] = code_prompts_quality(target, draft, tokenizer, CODE_PROMPTS, args.code_tokens)
    print("code prompts", {k: v for k, v in res["code_prompts"].items() if k != "prompts"}, flush=True)
    if args.ood_corpus:
        ood_docs = corpus.documents(args.ood_corpus, "all")
        kept = corpus.unseen(ood_docs, trained)  # pip vendors rich: its trained copy is not out of domain
        ood = tokenize_documents(tokenizer, kept)
        if ood.numel() < prompt_len + 1:
            raise SystemExit(f"evaluate: --ood-corpus {' '.join(args.ood_corpus)} gives {len(kept)} files and {ood.numel()} tokens "
                             f"not trained on: too few for prompts of {prompt_len} tokens")
        res["out_of_domain"] = {"corpus": args.ood_corpus, "tokens": int(ood.numel()), "files": len(kept),
                                "files_left_out_as_trained": len(ood_docs) - len(kept),
                                **greedy_acceptance(target, draft, prompts_from(ood, args.prompts, prompt_len),
                                                    args.continuation, args.batch)}
        print("out of domain", res["out_of_domain"]["alpha"], flush=True)
    res["sampled_T1"] = sampled_acceptance(target, draft, prompts, 8, args.batch, args.seed)
    print("T=1", res["sampled_T1"], flush=True)
    res["latency_ms_per_token"] = compare_latency(target, draft, args.latency_rounds, args.latency_steps)
    c = res["latency_ms_per_token"]["c"]
    print("latency", res["latency_ms_per_token"], flush=True)
    res["expected_speedup"] = {
        "greedy": speedup_table(res["greedy"]["alpha"], c),
        "sampled_T1": speedup_table(res["sampled_T1"]["beta_mean"], c),
        "greedy_from_measured_tokens_per_round": {
            g: round(e / round_cost(int(g), c), 3) for g, e in res["greedy"]["tokens_per_round_measured"].items()},
        "sampled_T1_from_path_estimate": {
            g: round(e / round_cost(int(g), c), 3) for g, e in res["sampled_T1"]["tokens_per_round_path_estimate"].items()},
    }
    res["eval_seconds"] = round(time.time() - t0, 1)
    print(json.dumps(res["expected_speedup"], indent=1), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
