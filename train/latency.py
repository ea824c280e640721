"""Per-token decoding latency of a causal LM: batch 1, KV cache, float32, in transformers.

This is the cost model of DESIGN.md §5: c = latency(draft) / latency(target).  A step is one
forward pass over one new token with the cache of the previous ones, timed after a warm-up,
and the median over several runs is reported.
"""

from __future__ import annotations

import statistics
import time

import torch


@torch.no_grad()
def decode_step_seconds(model, steps: int = 64, prompt_len: int = 32, repeats: int = 3,
                        warmup: int = 8) -> float:
    """Median seconds per decoding step of ``model`` (greedy, batch 1, KV cache)."""
    model.eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, prompt_len), generator=gen)
    results = []
    for r in range(repeats + 1):
        out = model(input_ids=prompt, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        n = warmup if r == 0 else steps
        t0 = time.perf_counter()
        for _ in range(n):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
        dt = (time.perf_counter() - t0) / n
        if r > 0:
            results.append(dt)
    return statistics.median(results)
