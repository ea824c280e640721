"""Adaptive draft length: per session, pick tau each round to maximize predicted tokens per second
under the cost model (specdec/costmodel.py: E(gamma) over the expected round time, pre-drafting
included), from the session's own acceptance history and costs calibrated once at start-up.

Nothing here reads a clock: the same request with the same calibration chooses the same taus
whatever else runs, so its random draws, keyed by position, repeat (DESIGN.md §3, §7) — except
the cap from the verifier's load (`goodput_cap`, the price each verdict carries), which seeded
sampled requests do without. alpha is the
maximum-likelihood estimate for a geometric run, accepted / (accepted + rejections), over the
rounds seen so far with older rounds decayed, starting from a prior worth a few rounds.

`DraftJudge` decides, from the same costs, when a session stops drafting with the model because
its measured acceptance makes speculation slower than target-only rounds."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.costmodel import Costs, choose_gamma, tokens_per_second


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
    steer: bool = True  # follow the verifier's load (row_price); off for seeded sampled requests (DESIGN.md §7)
    price: float = 0.0  # the verifier's last row_price: tokens of its goodput one more proposal row costs

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < drafted else 0)

    def estimate(self) -> float:
        a = (self.accepted + self.alpha * self.prior_weight) / (self.trials + self.prior_weight)
        return min(a, 0.999)

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


@dataclass
class DraftJudge:
    """Whether the draft model pays in one session: after `min_rounds` rounds it proposed, the
    session's measured acceptance (no prior) at the best tau up to max_tau must predict more
    tokens per second than a round without proposals (target-only, 1 / verify(0)). Once it does
    not, the decode loop stops running the draft model for the session (decode.py)."""
    costs: Costs
    max_tau: int
    predraft: bool = False
    min_rounds: int = 4
    min_tau: int = 1  # prompt lookup proposes up to the cap, not the best tau: judge it at max_tau
    rounds: int = 0
    accepted: int = 0
    trials: int = 0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.rounds += 1
            self.accepted += accepted
            self.trials += accepted + (1 if accepted < drafted else 0)

    def pays(self) -> bool:
        if self.rounds < self.min_rounds:
            return True
        alpha = min(self.accepted / self.trials, 0.999) if self.trials else 0.999
        best = max(tokens_per_second(self.costs, alpha, g, self.predraft) for g in range(min(self.min_tau, self.max_tau), self.max_tau + 1))
        return best >= 1.0 / self.costs.verify(0)
