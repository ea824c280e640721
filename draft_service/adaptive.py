"""Adaptive draft length: per session, pick tau each round to maximize predicted tokens per second
under the cost model (specdec/costmodel.py: E(gamma) over the expected round time, pre-drafting
included), from the session's own acceptance history and costs calibrated once at start-up.

Nothing here but the pace (`Pace`, which seeded sampled requests never use) reads a clock: the
same request with the same calibration chooses the same taus
whatever else runs, so its random draws, keyed by position, repeat (DESIGN.md §3, §7) — except
the cap from the verifier's load (`goodput_cap`, the price each verdict carries), which seeded
sampled requests do without, and for greedy sessions (whose tokens do not depend on tau) the
pre-drafts that follow rejections, which run only while the draft model serves the session
alone (`follows`, `second`). alpha is the
maximum-likelihood estimate for a geometric run, accepted / (accepted + rejections), over the
rounds seen so far with older rounds decayed, starting from a prior worth a few rounds.

`DraftJudge` decides, from the same costs, when a session stops drafting with the model because
its measured acceptance makes speculation slower than target-only rounds."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specdec.costmodel import Costs, choose_gamma, tokens_per_second


PRICED_OUT_PROBE = 16  # a session the price holds at no proposals proposes one every this many rounds (below)


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
    second_hits: float = 0.0  # rejections whose verifier token was the draft's second choice (a greedy chain's pre-drafts follow those)
    second_trials: float = 0.0
    follows: bool = False  # the last pre-draft followed rejections too (drafter.outcomes): the cost model counts those hits
    priced_out: int = 0  # rounds in a row the price held at no proposals

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified round's acceptance. A round without proposals (target-only, as the price
        held it) tells nothing: the evidence so far is kept, not decayed back to the prior, so a
        session that the load held at 0 resumes at its own acceptance."""
        if drafted <= 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < drafted else 0)

    def observe_second(self, hit: bool) -> None:
        """A rejection in a round whose pre-draft followed it: whether the verifier's token was the draft's second choice."""
        self.second_hits = self.decay * self.second_hits + hit
        self.second_trials = self.decay * self.second_trials + 1

    def second(self) -> float:
        """How often a rejection's token is the draft's second choice: starts at 0 (a prior of prior_weight / 2 rejections, none of them hits)."""
        return self.second_hits / (self.second_trials + self.prior_weight / 2)

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
        """The tau of the best predicted tokens/s for the session, capped by the verifier's load.
        A round without proposals tells nothing of the draft (`observe`), so a session whose
        estimate is at or below the price would stay there for as long as the price does (one
        that started inside a hold, at the prior, or whose first proposal was rejected): every
        PRICED_OUT_PROBE-th round the price holds at 0, it proposes one token, its acceptance
        learned again at a row's cost per that many tokens."""
        second = self.second() if self.follows else 0.0
        cap = self.goodput_cap()
        self.priced_out = self.priced_out + 1 if cap == 0 else 0
        if self.priced_out >= PRICED_OUT_PROBE:
            self.priced_out, cap = 0, 1
        return min(choose_gamma(self.costs, self.estimate(), self.max_tau, self.predraft, second), cap)


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


RECORD_STREAK = 2  # a model's sessions in a row that fell back before new ones start without it ...
EXPLORE_EVERY = 8  # ... except every this-many-th, which is judged anew


@dataclass
class ModelRecord:
    """Whether one draft model pays across a draft process's sessions: once RECORD_STREAK sessions
    in a row fell back (DraftJudge), new sessions start without the model (no judging rounds, no
    draft prefill: target-only runs from their first message, or prompt lookup in hybrid mode), except every EXPLORE_EVERY-th,
    which is judged as usual; a judged session whose model pays clears the record. Sessions share it
    only when their taus may follow the load (decode.py): it depends on other requests."""
    streak: int = 0  # judged sessions in a row that fell back
    skipped: int = 0  # sessions started without the model since the streak began (explorers counted)

    def skip(self) -> bool:
        """Whether a new session should start without the model."""
        if self.streak < RECORD_STREAK:
            return False
        self.skipped += 1
        return self.skipped % EXPLORE_EVERY != 0

    def judged(self, pays: bool) -> None:
        """A session's judge decided: the model fell back (pays False) or paid over its judging rounds."""
        if pays:
            self.streak = self.skipped = 0
        else:
            self.streak += 1


RUN_MIN, RUN_MAX = 8, 256  # tokens in one run of target-only steps (Round.target_only_steps)
RUN_TOKENS_PER_VERDICT = 4  # a run's steps one verdict may answer, by default (Round.run_tokens_per_verdict)
PROBE_ROUNDS = 8  # speculative rounds, over the draft's sessions, that a comparison needs ...
PROBE_S = 0.5  # ... and their seconds, summed: one session's few rounds are too short to judge on a shared machine
RELAY = 1.0  # a run's seconds per token over the verifier's quote, until measured (`Pace.ran`): 1.00-1.02 measured
# with runs relayed several tokens a verdict (bench/results/GOODPUT.md)
RELAY_DECAY = 0.98  # weight of the measured relay factor after each later run verdict (of one or more steps)
HOLD_S = (2.0, 30.0)  # how long target-only holds at a load after speculation lost there: first, and at most (doubling)
IDLE_S = 0.25  # the most one gap between verdicts counts toward a hold: a hold runs on busy time, not idle time
LOAD_S = 1.0  # the load the pace acts on: the highest class among the verdicts of the last this-many busy seconds


def load_class(sessions: int) -> int:
    """A verifier load as the pace tells loads apart: its open sessions by powers of two (1, 2-3,
    4-7, 8-15, ...); 0 for a verifier that does not say (VerifyResponse.open_sessions)."""
    return max(0, sessions).bit_length()


def load_label(c: int) -> str:
    """A load class as the sessions it spans: "1", "2-3", "4-7", ...; "unknown" for class 0."""
    if c <= 0:
        return "unknown"
    lo, hi = 1 << (c - 1), (1 << c) - 1
    return str(lo) if lo == hi else f"{lo}-{hi}"


@dataclass
class Hold:
    """The pace's verdict at one load class: target-only for `left` more busy seconds; the next
    lost comparison there holds for `next`."""
    left: float = 0.0
    next: float = HOLD_S[0]
    lost: bool | None = None  # the last decided comparison here (None: none yet; a lighter load's loss counts)
    doubt: bool = False  # the last window here disagreed with `lost` and decided nothing: the next one decides


@dataclass
class Pace:
    """Whether speculation pays at the verifier's current load, for all of one draft process's
    sessions that follow the load (DESIGN.md §7): the draft's measured speed per session in its
    speculative rounds (tokens over wall time, verdict to verdict) against the speed the verifier
    quotes for a target-only session now (VerifyResponse.target_only_s), times `relay`: what a
    run's steps measured over the quote (verdict to verdict, relayed through this process).

    The verdict is kept per load class (the verifier's open sessions, `load_class`): when
    speculation is slower at a load, sessions run target-only there and at every heavier load
    for a hold (runs of target-only steps on the verifier), then speculate again for
    PROBE_ROUNDS rounds (and PROBE_S) to measure anew; each lost probe doubles that load's next
    hold (up to HOLD_S[1]), a won one halves it (down to HOLD_S[0]); a load's first comparison
    starts from the next hold of a lighter load whose last comparison lost. A won window after a
    loss at its load (or, at a load's first comparison, at a lighter load) decides nothing
    ("unconfirmed"): the next window there decides. A probe's first window holds the rounds that
    ended first once the sessions left their runs, the short ones. A lost window after a win is
    unconfirmed alike, but only with one session open: a shared verifier's ties go to
    target-only (its goodput first), a lone session's to speculation (only its own latency is at
    stake), whose 8 rounds swing with its text's acceptance. Time is busy time: the gaps
    between this process's verdicts, each counted up to IDLE_S toward the holds at the load of
    the time and lighter ones, so an idle spell neither ends a hold nor is taken for evidence.
    The load acted on is the highest class the verdicts of the last LOAD_S busy seconds saw: a
    batch's sessions ending one by one, or a new batch's first sessions, are not taken for a
    lighter load, and a load that stays lower is judged on its own within LOAD_S. Reads a
    clock: seeded sampled requests never use it."""
    clock: object = None  # time.monotonic unless a test gives one
    seconds: float = 0.0  # the window's speculative rounds, summed over sessions ...
    quoted: float = 0.0  # ... and their tokens' seconds at the target-only quote of their time
    rounds: int = 0
    loads: dict = field(default_factory=dict)  # the window's rounds by load class
    target_only_s: float = 0.0
    load: int = 0  # the load class acted on: the highest of the last LOAD_S busy seconds
    busy: float = 0.0  # busy seconds so far
    peaks: deque = field(default_factory=deque)  # (busy, class): the classes that may still be the window's highest
    holds: dict = field(default_factory=dict)  # load class -> Hold
    last: float | None = None  # when the last verdict came (the busy clock)
    lost: int = 0  # probes speculation lost (for stats and tests)
    ratio: float = 0.0  # the last comparison's seconds over relay x quoted (above 1: lost; for the log)
    probe_rounds: int = PROBE_ROUNDS
    relay: float = RELAY

    def now(self) -> float:
        import time
        return (self.clock or time.monotonic)()

    def quote(self, target_only_s: float, sessions: int = 0) -> None:
        """Any verdict: the quote and load it came with; the busy time since the last one counts
        toward the hold of the load it passed at."""
        now = self.now()
        if self.last is not None:
            gap = min(max(now - self.last, 0.0), IDLE_S)
            self.busy += gap
            for c, hold in self.holds.items():
                if c <= self.load:
                    hold.left -= gap
        self.last = now
        if target_only_s > 0:
            self.target_only_s = target_only_s
        c, peaks = load_class(sessions), self.peaks
        while peaks and peaks[-1][1] <= c:
            peaks.pop()
        peaks.append((self.busy, c))
        while peaks[0][0] < self.busy - LOAD_S:
            peaks.popleft()
        self.load = peaks[0][1]

    def left(self) -> float:
        """Busy seconds target-only still holds at the load acted on: a hold at a load holds at
        every heavier one too (what loses at a load loses where each row costs more)."""
        return max((h.left for c, h in self.holds.items() if c <= self.load), default=0.0)

    def held(self) -> bool:
        return self.left() > 0

    def observe(self, tokens: int, seconds: float, target_only_s: float, sessions: int = 0) -> tuple[int, str] | None:
        """One speculative round of some session: its committed tokens and wall seconds. Returns
        (load class, outcome) when the round completed a comparison: "lost" (target-only holds
        there now), "won", or "unconfirmed" (a win after a loss at its load, or a loss after a
        win with one session open: the next window decides)."""
        self.quote(target_only_s, sessions)
        if self.held() or not self.target_only_s:
            return None  # a round of a session that came out of a run early (the window is for the probe), or no quote
        self.quoted += tokens * self.target_only_s
        self.seconds += seconds
        self.rounds += 1
        self.loads[self.load] = self.loads.get(self.load, 0) + 1
        if self.rounds < self.probe_rounds or self.seconds < PROBE_S:
            return None
        load = max(self.loads, key=self.loads.get)  # the load most of the window saw
        if load not in self.holds:  # a first comparison here: a loss at a lighter load stands for this one (each row costs more
            # here), its next hold too: what keeps losing there is not probed here every HOLD_S[0]
            lost = [h for c, h in self.holds.items() if c < load and h.lost]
            self.holds[load] = Hold(lost=True if lost else None, next=max((h.next for h in lost), default=HOLD_S[0]))
        hold = self.holds[load]
        self.ratio = self.seconds / (self.relay * self.quoted)
        self.seconds = self.quoted = 0.0
        self.rounds = 0
        self.loads = {}
        lost = self.ratio > 1.0
        if hold.lost is not None and lost != hold.lost and not hold.doubt and (not lost or load == load_class(1)):
            hold.doubt = True  # a probe's first window, whose rounds (the first to end) are the short ones; a lone session's swing
            return load, "unconfirmed"
        hold.lost, hold.doubt = lost, False
        if lost:
            hold.left = hold.next
            hold.next = min(2 * hold.next, HOLD_S[1])
            self.lost += 1
            return load, "lost"
        hold.next = max(HOLD_S[0], hold.next / 2)  # halved, not reset: one lucky window under a steady load does not bring the short holds back
        return load, "won"

    def ran(self, seconds: float, target_only_s: float) -> None:
        """One step of a run, seconds from the verdict before it, against the quote it came with."""
        if seconds > 0 and target_only_s > 0:
            self.relay = RELAY_DECAY * self.relay + (1 - RELAY_DECAY) * seconds / target_only_s

    def run(self) -> int:
        """Target-only steps a session should run now (0: speculate): enough to last the hold at
        the load acted on (`left`)."""
        left = self.left()
        if left <= 0 or not self.target_only_s:
            return 0
        return max(RUN_MIN, min(RUN_MAX, int(left / self.target_only_s)))


PACES: dict[str, Pace] = {}  # the draft process's, one per verify replica: its sessions there share one verdict on its load


def pace_of(replica: str) -> Pace:
    """The pace of the sessions this process places on `replica` (its address): sessions on
    another verifier neither share its passes nor its load, so they do not share its verdict."""
    return PACES.setdefault(replica, Pace())
