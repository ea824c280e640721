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

import math

import torch

DECAY = 0.97  # weight of a pass in the fit after each later one (about the last 30 passes count)
BUSY_WINDOW_S = 1.0  # the busy share's time constant: time this long ago weighs 1/e of now's, whatever the passes' pace
PROBE_WEIGHT = 0.1  # each start-up probe counts as this share of a fresh pass, never decayed: enough to fix what
# passes all alike cannot tell apart, little beside the ~30 passes' weight the fit keeps
PROBE_LAYOUTS = ((1, 1), (1, 9), (8, 1), (8, 5))  # (sessions, rows each) timed at start-up
PROBE_CONTEXT = 32  # tokens already in each probe session's cache


class PassCost:
    def __init__(self, probes: list[tuple[int, int, float]] = ()):
        """probes: (rows, sessions, seconds) measured at start-up."""
        self._probe_a, self._probe_b = _normal([(r, s, t) for r, s, t in probes], PROBE_WEIGHT)
        self._a, self._b = [[0.0] * 3 for _ in range(3)], [0.0] * 3
        self._busy = self._span = self._pass_s = self._tokens = 0.0
        self._last: tuple[float, float] | None = None  # (start, seconds) of the last pass
        self.base_s = self.per_row_s = self.per_session_s = 0.0
        self._fit()

    def observe(self, rows: int, sessions: int, tokens: int, seconds: float, start: float) -> None:
        """A pass that began at `start` (perf_counter) and committed `tokens` tokens."""
        _add(self._a, self._b, rows, sessions, seconds, 1.0, DECAY)
        if self._last is not None:
            self._busy, self._span = self._folded(start)
        self._last = (start, seconds)
        self._pass_s = self._pass_s * DECAY + seconds
        self._tokens = self._tokens * DECAY + tokens
        self._fit()

    def _fit(self) -> None:
        """Weighted least squares from the decayed normal equations (minimum norm if singular)."""
        coef = _solve([[p + q for p, q in zip(pr, r)] for pr, r in zip(self._probe_a, self._a)],
                      [p + q for p, q in zip(self._probe_b, self._b)])
        self.base_s, self.per_row_s, self.per_session_s = coef[0], max(coef[1], 0.0), coef[2]

    @property
    def utilisation(self) -> float:
        """The share of recent wall time the verifier spent in passes (weighted by age, BUSY_WINDOW_S),
        as of the last pass's start."""
        return min(1.0, self._busy / self._span) if self._span else 0.0

    def utilisation_at(self, now: float, running: float | None = None) -> float:
        """The busy share as of `now` (perf_counter): the time since the last pass began counts as
        it will once the next one does, so a verifier gone idle reads ever less busy (the gauge's
        value; `utilisation` only moves when a pass begins). running: when a pass in flight began
        (not yet observed): its time so far is busy, so a long pass (a long prompt's chunk on a GPU)
        does not read as idle while it runs."""
        if running is not None and (self._last is None or running >= sum(self._last)):
            busy, span = self._folded(running) if self._last is not None else (0.0, 0.0)
            w = math.exp(-max(now - running, 0.0) / BUSY_WINDOW_S)
            busy, span = busy * w + BUSY_WINDOW_S * (1.0 - w), span * w + BUSY_WINDOW_S * (1.0 - w)
            return min(1.0, busy / max(span, 1e-9))
        if self._last is None:
            return 0.0
        busy, span = self._folded(now)
        return min(1.0, busy / max(span, 1e-9))

    def _folded(self, now: float) -> tuple[float, float]:
        """(busy, span) with the time from the last pass's start to `now` added: integrals of
        being in a pass, and of time, each instant weighted exp(-age / BUSY_WINDOW_S). Time, not
        passes, ages them: an hour idle weighed an hour against the few ms of each later pass, and a
        saturated verifier read idle (and priced rows at about 0) for hundreds of passes after it."""
        last_start, last_s = self._last
        d = max(now - last_start, last_s)
        w = math.exp(-d / BUSY_WINDOW_S)
        busy = self._busy * w + BUSY_WINDOW_S * (math.exp(-(d - last_s) / BUSY_WINDOW_S) - w)
        return busy, self._span * w + BUSY_WINDOW_S * (1.0 - w)

    def price_at(self, now: float, running: float | None = None) -> float:
        """`price` with the busy share as of `now` (utilisation_at)."""
        return self.per_row_s * self.tokens_per_s * self.utilisation_at(now, running)

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


def _normal(points: list[tuple[int, int, float]], weight: float) -> tuple[list[list[float]], list[float]]:
    """X'WX and X'Wy of (rows, sessions, seconds) points for seconds ~ [1, rows, sessions]."""
    a, b = [[0.0] * 3 for _ in range(3)], [0.0] * 3
    for r, s, t in points:
        _add(a, b, r, s, t, weight)
    return a, b


def _add(a: list[list[float]], b: list[float], rows: int, sessions: int, seconds: float, weight: float, decay: float = 1.0) -> None:
    """Decays the normal equations (a, b) in place, then adds one weighted point to them, in plain
    floats: every pass pays for this in its host time."""
    x = (1.0, float(rows), float(sessions))
    for i in range(3):
        b[i] = b[i] * decay + weight * x[i] * seconds
        for j in range(3):
            a[i][j] = a[i][j] * decay + weight * x[i] * x[j]


SINGULAR = 1e-10  # a pivot this small against the matrix's largest entry: singular, solved by torch's minimum-norm lstsq


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """c with a c = b for the 3 x 3 normal equations: Gaussian elimination with partial pivoting in
    plain floats (every pass runs it: about 10 us against 250 for torch's lstsq on tiny tensors,
    on this CPU), or torch's minimum-norm least squares where a pivot says the system is singular
    (no probes, and every pass alike)."""
    m = [row[:] + [v] for row, v in zip(a, b)]
    scale = max(abs(v) for row in a for v in row)
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) <= SINGULAR * scale:
            at, bt = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
            return torch.linalg.lstsq(at, bt[:, None]).solution[:, 0].tolist()
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, 3):
            f = m[r][c] / m[c][c]
            for k in range(c, 4):
                m[r][k] -= f * m[c][k]
    out = [0.0] * 3
    for c in (2, 1, 0):
        out[c] = (m[c][3] - sum(m[c][k] * out[k] for k in range(c + 1, 3))) / m[c][c]
    return out


def probe(timed_pass, vocab_size: int, max_context: int, tries: int = 3) -> list[tuple[int, int, float]]:
    """(rows, sessions, seconds) for each layout of PROBE_LAYOUTS, best of `tries`:
    `timed_pass(contexts, inputs)` puts each context into a fresh session's cache, then returns
    the seconds of one packed pass over the inputs (verify_service/scheduler.py). Within the
    model's context: shorter contexts where it is small, no layout whose rows do not fit."""
    out = []
    for sessions, rows in PROBE_LAYOUTS:
        context = min(PROBE_CONTEXT, max_context - rows)
        if context < 1:
            continue
        ids = [[(7 * i + 3 * j + 1) % vocab_size for j in range(context + rows)] for i in range(sessions)]
        best = min(timed_pass([x[:context] for x in ids], [x[context:] for x in ids]) for _ in range(tries))
        out.append((sessions * rows, sessions, best))
    return out
