"""The sampling transform T(logits; temperature, top_k, top_p) -> probabilities.

Both services call exactly this code: the draft samples from T(draft logits) and reports it,
the verifier compares against T(target logits). Any difference between the two sides would
silently change the output distribution (DESIGN.md §3).

Random numbers are keyed, not streamed: every draw comes from a generator seeded with
(request seed, absolute position, purpose) (`keyed_generator`), so the same request gives the
same tokens however its rounds were timed, batched or pre-drafted (DESIGN.md §3).
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


# purposes of a keyed draw
VERIFY = 0  # the verifier's uniforms of one round
DRAFT = 1  # the draft's sample at one position

_MASK64 = (1 << 64) - 1


def mix(seed: int, position: int, purpose: int) -> int:
    """A 63-bit generator seed from (seed, position, purpose): SplitMix64's finalizer over their sum
    with odd multipliers, so nearby positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + purpose * 0xABC98388FB8FAC03 + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def keyed_generator(generator: torch.Generator, seed: int, position: int, purpose: int) -> torch.Generator:
    """Re-seeds `generator` (on the tensors' device) for the draws at (seed, position, purpose)."""
    return generator.manual_seed(mix(seed, position, purpose))


def sample_with(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: probs [..., V], u [...] uniforms in [0, 1) -> ids [...] (int64, on the
    device, no host sync). float64 sums, and a token with no mass is never returned."""
    c = probs.double().cumsum(-1)  # [..., V]
    total = c[..., -1:]  # [..., 1]
    x = torch.minimum(u.double().unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))  # [..., 1], < total
    # the first index whose cdf exceeds x: its own mass is > 0, so a token with no mass never comes out
    return torch.searchsorted(c, x, right=True).squeeze(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from probs [V] with a uniform from `generator` (a host sync: draft side)."""
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device)
    return int(sample_with(probs, u))
