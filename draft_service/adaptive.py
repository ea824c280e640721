"""Adaptive draft length: per session, pick tau each round to maximize predicted tokens per second
under the cost model (specdec/costmodel.py: E(gamma) over the expected round time, pre-drafting
included), from the session's own acceptance history and costs calibrated once at start-up.

Nothing here reads a clock: the same request with the same calibration chooses the same taus
whatever else runs, so its random draws, keyed by position, repeat (DESIGN.md §3, §7). alpha is the
maximum-likelihood estimate for a geometric run, accepted / (accepted + rejections), over the
rounds seen so far with older rounds decayed, starting from a prior worth a few rounds."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.costmodel import Costs, choose_gamma


@dataclass
class TauController:
    max_tau: int
    costs: Costs
    predraft: bool = False
    alpha: float = 0.7  # prior
    prior_weight: float = 8.0  # in proposal positions
    decay: float = 0.95  # older rounds count less: acceptance drifts along a sequence
    accepted: float = 0.0
    trials: float = 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < drafted else 0)

    def estimate(self) -> float:
        a = (self.accepted + self.alpha * self.prior_weight) / (self.trials + self.prior_weight)
        return min(a, 0.999)

    def choose(self) -> int:
        return choose_gamma(self.costs, self.estimate(), self.max_tau, self.predraft)
