"""The cost model of speculative decoding and the speed-up bound it implies (DESIGN.md §7).

Terms (per session, in units of one target forward step):
  alpha - the chance that a proposal is accepted, assumed the same at every position;
  gamma - proposals per verify round (tau on the wire);
  c     - the cost of one draft step relative to one target step;
  rho   - the extra cost of a round outside the target's forward pass (network, gRPC,
          scheduling), also relative to one target step.

A round of gamma proposals yields E(gamma) = (1 - alpha^(gamma+1)) / (1 - alpha) tokens on
average (the accepted prefix plus the recovered or bonus token) and costs gamma*c + 1 target
steps; the ratio is the walltime speed-up S over target-only decoding (Leviathan et al. 2023,
Thm 3.8). Across a network a round costs gamma*c + 1 + rho, and with pre-drafting the drafting of
round k+1 overlaps the verification of round k, so a round costs max(gamma*c, 1 + rho).

Adaptive tau (draft_service/adaptive.py), the benchmarks (bench/) and the model card (train/)
all use these functions, so every number the project reports comes from one formula.
"""
from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(gamma) = (1 - alpha^(gamma+1)) / (1 - alpha): expected tokens per verify round."""
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def round_cost(gamma: int, c: float, rho: float = 0.0, predraft: bool = False) -> float:
    """Cost of one round in target steps: gamma*c + 1 + rho, or max(gamma*c, 1 + rho) when the
    next round is drafted while this one is verified."""
    return max(gamma * c, 1.0 + rho) if predraft else gamma * c + 1.0 + rho


def speedup(alpha: float, gamma: int, c: float, rho: float = 0.0, predraft: bool = False) -> float:
    """Expected speed-up over target-only decoding: S = E / (gamma*c + 1) with the defaults;
    S_net = E / (gamma*c + 1 + rho) with rho; E / max(gamma*c, 1 + rho) with pre-drafting."""
    return expected_tokens(alpha, gamma) / round_cost(gamma, c, rho, predraft)


def best_gamma(alpha: float, c: float, gammas=range(1, 9), rho: float = 0.0, predraft: bool = False) -> int:
    """The gamma in `gammas` with the highest expected speed-up (the smallest on ties)."""
    return max(gammas, key=lambda g: (speedup(alpha, g, c, rho, predraft), -g))


@dataclass(frozen=True)
class Costs:
    """Measured costs in seconds, as the draft service sees them (calibrated once at start-up,
    draft_service/calibrate.py, or pinned by flags): one draft step, and a verify round of gamma
    proposals as seen from the draft, network and RPC included: verify_base + gamma * verify_per_token."""

    draft_step: float
    verify_base: float
    verify_per_token: float

    def verify(self, gamma: int) -> float:
        return self.verify_base + gamma * self.verify_per_token


def round_seconds(costs: Costs, alpha: float, gamma: int, predraft: bool, second: float = 0.0) -> float:
    """Expected wall time of one round of gamma proposals.

    Without pre-drafting the draft proposes gamma tokens, then waits for the verdict:
    gamma * t_d + V(gamma). With it, round k+1 (a bonus guess plus gamma steps) is drafted while
    round k is verified; it is used when all gamma proposals were accepted and the guessed bonus
    was right (probability about alpha^(gamma+1)), or, where pre-drafts also follow each rejection
    with the draft's second choice as the verifier's token (a greedy chain), when that choice was
    right (probability `second` given a rejection); then the round costs
    max(V(gamma), (gamma+1) * t_d); otherwise it is drafted again after the verdict."""
    v, d = costs.verify(gamma), gamma * costs.draft_step
    if not predraft:
        return d + v
    hit = alpha ** (gamma + 1) + (1 - alpha**gamma) * second
    return hit * max(v, d + costs.draft_step) + (1 - hit) * (v + d)


def tokens_per_second(costs: Costs, alpha: float, gamma: int, predraft: bool, second: float = 0.0) -> float:
    """The model's prediction for one session: E(gamma) / expected round time."""
    return expected_tokens(alpha, gamma) / round_seconds(costs, alpha, gamma, predraft, second)


def choose_gamma(costs: Costs, alpha: float, max_gamma: int, predraft: bool, second: float = 0.0) -> int:
    """The gamma in 1..max_gamma with the highest predicted tokens/s (the smallest on ties)."""
    return max(range(1, max_gamma + 1), key=lambda g: (tokens_per_second(costs, alpha, g, predraft, second), -g))


def tree_size(scores: list[float], fixed_s: float, row_s: float) -> int:
    """How many of a tree's best nodes to send (DESIGN.md §12): scores, best first, estimate each
    node's chance to be accepted (the draft's probability of its branch), so a round of the k best
    yields 1 + sum(scores[:k]) tokens on average and costs fixed_s + k * row_s seconds; the k >= 1
    of the most tokens per second."""
    best, best_k, total = -1.0, 1, 1.0
    for k, s in enumerate(scores, 1):
        total += s
        rate = total / (fixed_s + k * row_s)
        if rate > best:
            best, best_k = rate, k
    return best_k
