"""Per-token decoding latency of a causal LM: batch 1, KV cache, float32, in transformers.

This is the cost model of DESIGN.md §7: c = latency(draft) / latency(target).  A step is one
forward pass over one new token with the cache of the previous ones, timed after a warm-up,
and the median over several runs is reported.
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec.engine import cache_kwargs, returned_cache


@torch.no_grad()
def decode_step_seconds(model, steps: int = 64, prompt_len: int = 32, repeats: int = 3,
                        warmup: int = 8) -> float:
    """Median seconds per decoding step of ``model`` (greedy, batch 1, KV cache)."""
    model.eval()
    vocab = model.get_output_embeddings().weight.shape[0]  # a multimodal config keeps its vocab_size in text_config
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, prompt_len), generator=gen).to(next(model.parameters()).device)
    results = []
    for r in range(repeats + 1):
        out = model(input_ids=prompt, use_cache=True)
        past = returned_cache(out)
        tok = out.logits[:, -1:].argmax(-1)
        n = warmup if r == 0 else steps
        t0 = time.perf_counter()
        for _ in range(n):
            out = model(input_ids=tok, use_cache=True, **cache_kwargs(model, past))
            past = returned_cache(out)
            tok = out.logits[:, -1:].argmax(-1)
        dt = (time.perf_counter() - t0) / n
        if r > 0:
            results.append(dt)
    return statistics.median(results)


def compare_latency(target, draft, rounds: int = 7, steps: int = 64) -> dict:
    """Per-token latency of two models, measured alternately so that load from other
    processes hits both alike.  Reports the median and the minimum over ``rounds`` runs (the
    minimum is the better estimate of the cost on an otherwise idle machine) and c for both.
    """
    t_runs, d_runs = [], []
    for _ in range(rounds):
        t_runs.append(decode_step_seconds(target, steps=steps, repeats=1))
        d_runs.append(decode_step_seconds(draft, steps=steps, repeats=1))
    t_med, d_med = statistics.median(t_runs), statistics.median(d_runs)
    t_min, d_min = min(t_runs), min(d_runs)
    return {
        "target": t_min * 1e3, "draft": d_min * 1e3, "c": d_min / t_min,
        "target_median": t_med * 1e3, "draft_median": d_med * 1e3, "c_median": d_med / t_med,
        "rounds": rounds, "steps_per_round": steps,
        "target_runs": [round(x * 1e3, 3) for x in t_runs], "draft_runs": [round(x * 1e3, 3) for x in d_runs],
    }
