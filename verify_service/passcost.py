"""What the verifier's passes cost, measured on whatever hardware it runs on, and the price of
one more proposal row that each verdict carries to its draft (DESIGN.md §7).

A pass over `rows` new tokens of `sessions` sessions takes about
    seconds = base + per_row * rows + per_session * sessions,
fitted by least squares over the passes actually run (older ones decayed), anchored by a few
passes timed at start-up (`probe`), which keep the fit defined while every pass looks alike.

The price: the verifier's goodput is the tokens its passes commit per second. A proposal at
depth k adds alpha^k expected tokens to its pass and per_row seconds to it; it raises the
goodput of a busy verifier only while alpha^k > per_row * (tokens per pass-second) (the
derivative of tokens / seconds). Scaled by the share of time the verifier is busy in passes (an
idle verifier loses nothing to a longer pass), that is `price`: a draft keeps proposals of
depth k while alpha^k exceeds it (draft_service/adaptive.py), down to none.
"""
from __future__ import annotations

import torch

DECAY = 0.97  # weight of a pass after each later one (about the last 30 passes count)
PROBE_WEIGHT = 0.1  # each start-up probe counts as this share of a fresh pass, never decayed: enough to fix what
# passes all alike cannot tell apart, little beside the ~30 passes' weight the fit keeps
PROBE_LAYOUTS = ((1, 1), (1, 9), (8, 1), (8, 5))  # (sessions, rows each) timed at start-up
PROBE_CONTEXT = 32  # tokens already in each probe session's cache


class PassCost:
    def __init__(self, probes: list[tuple[int, int, float]] = ()):
        """probes: (rows, sessions, seconds) measured at start-up."""
        self._probe_a, self._probe_b = _normal([(r, s, t) for r, s, t in probes], PROBE_WEIGHT)
        self._a, self._b = torch.zeros(3, 3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
        self._busy = self._span = self._pass_s = self._tokens = 0.0
        self._last: tuple[float, float] | None = None  # (start, seconds) of the last pass
        self.base_s = self.per_row_s = self.per_session_s = 0.0
        self._fit()

    def observe(self, rows: int, sessions: int, tokens: int, seconds: float, start: float) -> None:
        """A pass that began at `start` (perf_counter) and committed `tokens` tokens."""
        a, b = _normal([(rows, sessions, seconds)], 1.0)
        self._a, self._b = self._a * DECAY + a, self._b * DECAY + b
        if self._last is not None:  # the last pass's share of the time from its start to this one's
            last_start, last_s = self._last
            self._span = self._span * DECAY + max(start - last_start, last_s)
            self._busy = self._busy * DECAY + last_s
        self._last = (start, seconds)
        self._pass_s = self._pass_s * DECAY + seconds
        self._tokens = self._tokens * DECAY + tokens
        self._fit()

    def _fit(self) -> None:
        """Weighted least squares from the decayed normal equations (minimum norm if singular)."""
        coef = torch.linalg.lstsq(self._probe_a + self._a, (self._probe_b + self._b)[:, None]).solution[:, 0].tolist()
        self.base_s, self.per_row_s, self.per_session_s = coef[0], max(coef[1], 0.0), coef[2]

    @property
    def utilisation(self) -> float:
        """The share of recent wall time the verifier spent in passes."""
        return min(1.0, self._busy / self._span) if self._span else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens committed per second of pass time, recently."""
        return self._tokens / self._pass_s if self._pass_s else 0.0

    @property
    def price(self) -> float:
        """Expected tokens one more proposal row costs the verifier's goodput now (see above)."""
        return self.per_row_s * self.tokens_per_s * self.utilisation


    def target_only_s(self, sessions: int) -> float:
        """Seconds per token of a target-only session now: a pass with `sessions` sessions of one
        row each (every open session in every pass, as Verify.Generate's streams run)."""
        return max(self.base_s + max(sessions, 1) * (self.per_row_s + self.per_session_s), 0.0)


def _normal(points: list[tuple[int, int, float]], weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """X'WX and X'Wy of (rows, sessions, seconds) points for seconds ~ [1, rows, sessions]."""
    x = torch.tensor([[1.0, r, s] for r, s, _ in points], dtype=torch.float64).reshape(-1, 3)
    y = torch.tensor([t for *_, t in points], dtype=torch.float64)
    return weight * x.T @ x, weight * x.T @ y


def probe(timed_pass, vocab_size: int, tries: int = 3) -> list[tuple[int, int, float]]:
    """(rows, sessions, seconds) for each layout of PROBE_LAYOUTS, best of `tries`:
    `timed_pass(contexts, inputs)` puts each context into a fresh session's cache, then returns
    the seconds of one packed pass over the inputs (verify_service/scheduler.py)."""
    out = []
    for sessions, rows in PROBE_LAYOUTS:
        ids = [[(7 * i + 3 * j + 1) % vocab_size for j in range(PROBE_CONTEXT + rows)] for i in range(sessions)]
        best = min(timed_pass([x[:PROBE_CONTEXT] for x in ids], [x[PROBE_CONTEXT:] for x in ids]) for _ in range(tries))
        out.append((sessions * rows, sessions, best))
    return out
