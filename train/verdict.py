"""The end of a distillation run: does the pair work, and does it pay?

* ``check_pair`` (train/pairing.py): the draft directory's tokenizer must load as the target's does (same class,
  same vocabulary, same special tokens) and the two vocabulary fingerprints the services compare
  at start-up (specdec/lm.py) must match; otherwise it says what differs (specdec/vocabdiff.py).
* ``measure``: greedy acceptance α of the draft along the target's own greedy continuations of
  held-out prompts (train/evaluate.py), the per-token cost ratio c = draft / target (batch-1
  KV-cache decoding, train/latency.py), and the speed-up the cost model predicts from them,
  S = E / (γ·c + 1) at the best γ (specdec/costmodel.py; network and RPC overhead not included,
  so serving gets somewhat less).
* ``report``: the verdict in words, what to change when S < 1, and the two commands that serve
  the pair.
"""

from __future__ import annotations

import torch

from specdec.architectures import context_limit
from train import corpus
from train.data import tokenize_documents
from train.evaluate import greedy_acceptance, prompts_from, speedup_table
from train.latency import compare_latency


@torch.no_grad()
def measure(target, draft, tokenizer, specs, train_tokens: torch.Tensor, prompts: int = 16, prompt_len: int = 64,
            continuation: int = 32, latency_rounds: int = 3, latency_steps: int = 32) -> dict:
    """α, c and the predicted speed-up on held-out text of the corpus (the training text's tail
    when the corpus holds out too little to cut prompts from)."""
    device = next(target.parameters()).device
    draft = draft.to(device, next(target.parameters()).dtype).eval()
    limit = min(context_limit(target.config), context_limit(draft.config))
    continuation = max(1, min(continuation, limit // 4))
    prompt_len = max(1, min(prompt_len, limit - continuation - 1))
    held = corpus.unseen(corpus.documents(specs, "heldout"), corpus.documents(specs, "train"))  # not copies of trained files
    tokens = tokenize_documents(tokenizer, held)
    source = "held-out files"
    if tokens.numel() < prompt_len + prompts + 1:
        tokens, source = train_tokens[-max(prompt_len + prompts + 1, 4 * prompt_len):], "the end of the training text (too little held out)"
        prompt_len = min(prompt_len, tokens.numel() // 2)
    ids = prompts_from(tokens, prompts, prompt_len).to(device)
    g = greedy_acceptance(target, draft, ids, continuation, batch=8)
    lat = compare_latency(target, draft, latency_rounds, latency_steps)
    table = speedup_table(g["alpha"], lat["c"])
    return {"alpha": round(g["alpha"], 4), "positions": g["positions"], "prompts": prompts, "text": source,
            "c": round(lat["c"], 4), "target_ms": round(lat["target"], 3), "draft_ms": round(lat["draft"], 3),
            "best_tau": table["best_gamma"], "speedup": table["best_speedup"], "device": str(device)}


def report(v: dict, target_dir, draft_dir, pair: dict) -> str:
    """The verdict, and the commands that serve the pair."""
    lines = [f"verdict: greedy acceptance {v['alpha']:.2f} on {v['prompts']} prompts from {v['text']} "
             f"({v['positions']} positions); a draft step costs {v['c']:.3f} of a target step "
             f"({v['draft_ms']:.2f} ms / {v['target_ms']:.2f} ms on {v['device']})",
             f"  expected speed-up {v['speedup']:.2f}x at tau={v['best_tau']} (cost model E / (tau*c + 1), "
             f"before network overhead); " + (f"vocabulary fingerprints match ({pair['target_fingerprint'][:12]})"
             if pair.get("paired_by", "same") == "same" else
             f"the tokenizers pair ({pair['paired_by']}: the target's vocabulary fingerprint {pair['target_fingerprint'][:12]})")]
    if v["speedup"] < 1.0:
        lines += [f"  BELOW 1x: with this draft, speculative decoding would be SLOWER than the target alone "
                  f"({v['speedup']:.2f}x). To change that:",
                  "  * train longer: run the same command again with more --max-minutes (or a larger --steps): it resumes where it stopped",
                  f"  * a smaller draft (--layers 1 --hidden 128): c is {v['c']:.2f} now"
                  + (", and the draft must be far cheaper than the target to pay" if v["c"] > 0.2 else
                     ", small already: acceptance is what is missing"),
                  "  * no draft model: prompt lookup (draft_service --proposer lookup) proposes continuations of earlier text",
                  "  (served as it is, the draft service falls back to target-only rounds in sessions where the draft does not pay)"]
    lines += ["serve the pair:",
              f"  python -m verify_service --model {target_dir} --port 50051",
              f"  python -m draft_service --model {draft_dir} --port 50052 --verify 127.0.0.1:50051"]
    return "\n".join(lines)
