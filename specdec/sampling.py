"""The sampling transform T(logits; temperature, top_k, top_p) -> probabilities.

Both services call exactly this code: the draft samples from T(draft logits) and reports it,
the verifier compares against T(target logits). Any difference between the two sides would
silently change the output distribution (DESIGN.md §2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] in float32. Greedy gives the argmax one-hot."""
    logits = logits.float()
    if s.greedy:
        # first index on ties, as torch.argmax
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep a token if the mass strictly before it is < top_p: the smallest nucleus >= top_p
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sparsify(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [V] -> (ids [k'], renormalized probs [k']) of its top-k nonzero entries (k' <= k)."""
    vals, ids = torch.topk(probs, min(k, probs.shape[-1]))
    keep = vals > 0
    vals, ids = vals[keep], ids[keep]
    return ids, vals / vals.sum()


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs [V] (float64 uniforms, so a token with mass is never skipped)."""
    return int(torch.multinomial(probs.double(), 1, generator=generator))
