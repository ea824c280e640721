"""What sessions hand the verify scheduler's thread (verify_service/scheduler.py), one type per
kind of work, and the batched acceptance over a pass's rounds.

* `Prefill`: put the session's prompt (but its last token) into its cache; its future resolves
  once the last chunk is in.
* `Round`: one round of proposals (tau >= 0, with their q where sampled; a chain, or a tree
  with each proposal's parent); its future resolves with the Verdict.
* `Stream`: target-only steps, one a pass, each verdict posted to the caller's queue; the thread
  runs the next step as soon as the last one is committed (at most `left` steps, else until the
  session finishes). A stream that arrives while its session's `Prefill` still waits takes the
  prefill's place (and resolves it), so its first step shares the pass of the prompt's last chunk.

A job is resolved on the scheduler's thread and handed to its caller's event loop with
`call_soon_threadsafe`. During a pass (`holding`) the hand-offs are held and posted at its end,
one call per event loop: a loop wakes once a pass, not once a session.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch

from specdec.acceptance import accept_batch, accept_greedy_batch, accept_tree, argmax_rows, tree_tables
from specdec.proposal import RoundQ
from specdec.sampling import int64
from verify_service.session import Session


@dataclass
class Job:
    session: Session
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.perf_counter, kw_only=True)  # when its work was queued
    finished: bool = field(default=False, kw_only=True)  # nothing more to do for it

    def resolve(self, ok: bool, result) -> None:
        self.finished = True
        self._post(ok, result)

    def _post(self, ok: bool, result) -> None:
        held = getattr(_held, "calls", None)
        if held is not None:  # in a pass: posted at its end (`holding`)
            held.setdefault(self.loop, []).append((self, self._call(ok, result)))
            _held.outcomes.append((ok, result))
            return
        try:
            self.loop.call_soon_threadsafe(_call_all, [self._call(ok, result)])
        except RuntimeError:  # the caller's event loop is closed: nobody is waiting any more
            self.finished = True

    def _call(self, ok: bool, result) -> tuple:
        """What the caller's event loop runs to take the result: (function, *arguments)."""
        return _resolve, self.future, ok, result


class _NoProposals:
    """A prefill's and a stream step's (empty) proposals, as a round's are read."""

    @property
    def tokens(self) -> list[int]:
        return []

    @property
    def q(self) -> None:
        return None

    @property
    def parents(self) -> None:
        return None


@dataclass
class Prefill(_NoProposals, Job):
    future: asyncio.Future


@dataclass
class Round(Job):
    future: asyncio.Future
    tokens: list[int]  # the proposals
    q: RoundQ | None = None  # its entries on the host (all sessions' go to the device in one copy per pass, `_q`), or None
    parents: list[int] | None = None  # a tree round: each proposal's parent proposal, or -1 (the pending token)


@dataclass
class Stream(_NoProposals, Job):
    verdicts: asyncio.Queue  # gets every (ok, Verdict or error)
    left: int | None = None  # steps still allowed (None: until the session finishes)
    prefill: Prefill | None = None  # the session's queued prefill it took over (resolved once the prompt is in)

    def resolve(self, ok: bool, result) -> None:
        if not ok and self.prefill is not None:  # the prefill it took over fails with it
            self.prefill.resolve(False, result)
            self.prefill = None
        if self.left is not None and ok:
            self.left -= 1
        self.finished = not ok or bool(result.finish) or self.left == 0
        self.enqueued = time.perf_counter()  # its next step is queued from now
        self._post(ok, result)

    def _call(self, ok: bool, result) -> tuple:
        return self.verdicts.put_nowait, (ok, result)


def unfilled(s: Session) -> bool:
    """Whether some of the session's prompt is not in its cache yet (it holds ids[:-1] once filled)."""
    return s.cache.length < len(s.ids) - 1


def check(j: Job, V: int) -> None:
    """A session's q fits the batch: tau rows over V ids, or None."""
    tau = len(j.tokens)
    q = j.q
    if q is not None and not j.session.sampling.greedy and (q.tau != tau or (q.ids.numel() and int(q.ids.max()) >= V)):
        raise ValueError(f"q of {q.tau} rows (ids up to {int(q.ids.max()) if q.ids.numel() else None}) for a round of {tau} "
                         f"proposals over {V} ids")


def accept(jobs: list[Job], lg: torch.Tensor, proposals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sessions' (n accepted [B], next token [B]) on the device: accept_batch over their
    rounds padded to the longest. lg [B, T+1, V] (rows past a session's tau+1 are padding);
    proposals [B, >= T]."""
    T = lg.shape[1] - 1
    tau, sessions = torch.tensor([len(j.tokens) for j in jobs]), [j.session for j in jobs]
    if all(s.sampling.greedy for s in sessions):  # greedy rounds and target-only steps: nothing to sample
        return accept_greedy_batch(lg, proposals[:, :T], tau)
    return accept_batch(lg, proposals[:, :T], tau, _q(jobs, lg, T), *_settings(sessions))


def decide(jobs: list[Job], lg: torch.Tensor, proposals: torch.Tensor, forced=None) -> tuple[list[int], torch.Tensor]:
    """A pass's verdicts on the device, target-only steps first, then chains, then trees: (the jobs' indices in that order,
    [B, 2 + W]: n accepted, the next token, then for a tree 1 per node on its accepted path; W its
    largest tree's nodes). lg [B, T+1, V]; proposals [B, T]. forced (benchmarks only,
    Scheduler(forced_acceptance=)): a chain round accepts that many and takes the target's token after them."""
    tree = [i for i, j in enumerate(jobs) if j.parents]
    # target-only steps apart from the rounds with proposals: a step's acceptance reads its one row, not
    # the longest round's padding (runs beside speculating sessions are the mixed load of a hold)
    steps = [i for i, j in enumerate(jobs) if not j.parents and not j.tokens]
    chain = [i for i, j in enumerate(jobs) if not j.parents and j.tokens]
    parts, W = [], max((len(jobs[i].tokens) for i in tree), default=0)
    for group in (steps, chain):
        if not group:
            continue
        T = max(len(jobs[i].tokens) for i in group)
        whole = len(group) == len(jobs) and T + 1 == lg.shape[1]
        if whole:
            cj, c_lg, c_pr = jobs, lg, proposals
        else:  # the group's rows picked on the device through an index copied there without a sync (a list index syncs)
            at = torch.tensor(group).to(lg.device, non_blocking=True)
            cj, c_lg, c_pr = [jobs[i] for i in group], lg.index_select(0, at)[:, : T + 1], proposals.index_select(0, at)[:, :T]
        n, nxt = accept(cj, c_lg, c_pr)
        if forced is not None:
            n = torch.tensor([max(0, min(forced(j.session, len(j.tokens)), len(j.tokens))) for j in cj]).to(lg.device, non_blocking=True)
            nxt = argmax_rows(c_lg[torch.arange(len(cj), device=lg.device), n])
        verdicts = torch.stack((n, nxt), 1)
        parts.append(torch.nn.functional.pad(verdicts, (0, W)) if W else verdicts)
    if tree:
        at = torch.tensor(tree).to(lg.device, non_blocking=True)
        parts.append(accept_trees([jobs[i] for i in tree], lg.index_select(0, at)[:, : 1 + W], proposals.index_select(0, at)))
    return steps + chain + tree, torch.cat(parts) if len(parts) > 1 else parts[0]


def accept_trees(jobs: list[Job], lg: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """The tree rounds' verdicts on the device, [B, 2 + N]: n, next, then 1 per node on the accepted
    path (accept_tree over their rounds padded to the largest)."""
    R = lg.shape[1]
    return accept_tree(lg, proposals[:, : R - 1], torch.tensor([len(j.tokens) for j in jobs]), tree_tables([j.parents for j in jobs], R),
                       _q(jobs, lg, R - 1), *_settings([j.session for j in jobs]))


def _q(jobs: list[Job], lg: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T, V] on the device: the sampled sessions' q, zeros where absent or greedy. Their
    entries (RoundQ) go to the device in one copy of indices and one of values (not per session;
    packed into one float64 copy they cost 0.6 ms more host time a pass of 64 sessions, bench.roundq),
    and are scattered into a table made there: the table never exists on the host."""
    B, V = lg.shape[0], lg.shape[2]
    qs = [(i, j.q) for i, j in enumerate(jobs) if j.q is not None and not j.session.sampling.greedy]
    if not qs:  # all greedy or target-only: a zero q that takes no memory
        return lg.new_zeros((), dtype=torch.float32).expand(B, T, V)
    where = torch.cat([torch.stack((torch.full_like(qi.rows, i), qi.rows, qi.ids)) for i, qi in qs], 1)  # [3, E]: session, row, id
    where = where.to(lg.device, non_blocking=True)
    probs = torch.cat([qi.probs for _, qi in qs]).to(lg.device, non_blocking=True)
    return torch.zeros(B, T, V, dtype=torch.float32, device=lg.device).index_put_(tuple(where), probs)


def _settings(ss: list[Session]) -> tuple[torch.Tensor, ...]:
    """Per session on the host: greedy, int64(seed), position (committed length), temperature, top_k, top_p."""
    return (torch.tensor([s.sampling.greedy for s in ss]), torch.tensor([int64(s.seed) for s in ss]),
            torch.tensor([len(s.ids) for s in ss]),
            torch.tensor([s.sampling.temperature for s in ss], dtype=torch.float64),
            torch.tensor([s.sampling.top_k for s in ss]),
            torch.tensor([s.sampling.top_p for s in ss], dtype=torch.float64))


_held = threading.local()  # the hand-offs of the pass running on this thread (`holding`)


@contextlib.contextmanager
def holding():
    """Holds the hand-offs of the jobs resolved on this thread until the block ends, then posts
    them with ONE call_soon_threadsafe per event loop (in the order they were resolved). A job whose
    loop is closed is marked finished, as when posted alone. Yields the list of the block's
    outcomes, (ok, verdict or error) in the order resolved, filled as the block runs."""
    _held.calls, _held.outcomes = held, outcomes = {}, []
    try:
        yield outcomes
    finally:
        _held.calls = None
        for loop, calls in held.items():
            try:
                loop.call_soon_threadsafe(_call_all, [c for _, c in calls])
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                for job, _ in calls:
                    job.finished = True


def _call_all(calls: list[tuple]) -> None:
    """Runs on the caller's event loop: each (function, *arguments); one failing does not stop the others."""
    for fn, *args in calls:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported as the loop reports a failing callback
            asyncio.get_running_loop().call_exception_handler({"message": f"handing over a verdict: {e!r}", "exception": e})


def _resolve(fut: asyncio.Future, ok: bool, result) -> None:
    if fut.done():  # the awaiting caller was cancelled meanwhile
        return
    if ok:
        fut.set_result(result)
    else:
        fut.set_exception(result)
