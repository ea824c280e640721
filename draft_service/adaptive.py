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

    steer: bool = True  # follow the verifier's load (row_price); off for seeded sampled requests (DESIGN.md §7)
    price: float = 0.0  # the verifier's last row_price: tokens of its goodput one more proposal row costs

    def load(self, price: float) -> None:
        self.price = price

    def goodput_cap(self) -> int:
        """The most proposals that still raise a busy verifier's goodput: the k-th pays while
        alpha^k > price (verify_service/passcost.py); 0 (a target-only round) when the first
        does not. max_tau when not steering or the verifier is idle."""
        if not self.steer or self.price <= 0.0:
            return self.max_tau
        a, k = self.estimate(), 0
        while k < self.max_tau and a ** (k + 1) > self.price:
            k += 1
        return k

    def choose(self) -> int:
        """The tau of the best predicted tokens/s for the session, capped by the verifier's load."""
        return min(choose_gamma(self.costs, self.estimate(), self.max_tau, self.predraft), self.goodput_cap())
