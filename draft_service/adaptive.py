"""Adaptive draft length: per session, pick tau each round to maximize expected tokens per second
under the cost model of DESIGN.md §5 (specdec/costmodel.py), from measured acceptance and costs.

With per-position acceptance alpha, a round of gamma proposals yields on average E(gamma) tokens
and costs gamma * t_draft + t_round without pre-drafting (t_round = verify wait incl. network), or
about max(gamma * t_draft, t_round) with it. Measured in units of t_round, that is the model's
round cost with c = t_draft / t_round and rho = 0 (the network is inside t_round). alpha is estimated from the rounds seen so far (accepted / (accepted + rejections): the
maximum-likelihood estimate for a geometric run), starting from a prior worth a few rounds."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.costmodel import best_gamma


@dataclass
class TauController:
    max_tau: int
    alpha: float = 0.7  # prior
    prior_weight: float = 8.0  # in proposal positions
    decay: float = 0.95  # older rounds count less: acceptance drifts along a sequence
    accepted: float = 0.0
    trials: float = 0.0
    t_draft: float | None = None  # seconds per draft token (EMA)
    t_round: float | None = None  # seconds per verify round (EMA)

    def observe(self, drafted: int, accepted: int, draft_s: float, round_s: float) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < drafted else 0)
        if drafted:
            self.t_draft = _ema(self.t_draft, draft_s / drafted)
        self.t_round = _ema(self.t_round, round_s)

    def estimate(self) -> float:
        a = (self.accepted + self.alpha * self.prior_weight) / (self.trials + self.prior_weight)
        return min(a, 0.999)

    def choose(self, pipelined: bool = False) -> int:
        if self.t_draft is None or self.t_round is None:
            return self.max_tau
        c = self.t_draft / max(self.t_round, 1e-12)
        return best_gamma(self.estimate(), c, range(1, self.max_tau + 1), predraft=pipelined)


def _ema(old: float | None, new: float, w: float = 0.2) -> float:
    return new if old is None else (1 - w) * old + w * new
