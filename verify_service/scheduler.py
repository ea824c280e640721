"""The verify scheduler: one thread owns the target model; each iteration it runs ONE packed pass
(specdec/engine) over every round waiting across sessions plus the next chunk of as many waiting
prompts as the pass's row budget leaves room for (at least one), applies the acceptance rule to
all its sessions at once on the model's device (`accept_batch`, specdec/acceptance.py, through
verify_service/jobs.py), and moves
the verdicts of the whole batch to the host at once (two integers per session).

Sessions talk to it from the asyncio event loop: `prefill` and `step` put a job on the queue
and await a future that the thread resolves; `steps` (target-only) puts one job that the thread
runs step after step, posting each verdict to the caller's queue. A pass's verdicts reach each
event loop in one `call_soon_threadsafe`, after the pass (jobs.holding). Prompts are prefilled
in chunks whose boundaries depend only on the prompt (multiples of PREFILL_CHUNK), so a long
prompt does not stall the sessions already decoding, and a session's numbers never depend on
what else is running. A failed batched pass is retried session by session (nothing is
committed by a failed pass), so one session's failure fails that session only; a fault past the
model call (the device, a bug) fails the pass's unanswered jobs with INTERNAL, and the thread goes
on. Before a pass the
thread waits a little (by default at most GATHER_SHARE of the last pass) for the rounds of the sessions the
last pass answered, so that sessions in step stay in one pass (`_gather`).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable

import torch

from specdec import metrics
from specdec.errors import Refusal, RequestError
from specdec.engine import PAGE, PREFILL_CHUNK, KVCache, Tree
from specdec.lm import LM
from specdec.proposal import RoundQ
from specdec.sampling import Sampling, to_host, wait
from verify_service.capacity import Capacity, default_cache_budget, full_cache_tokens
from verify_service.health import SELF_TEST_S, PassHealth
from verify_service.jobs import Job, Prefill, Round, Stream, check, decide, holding, unfilled
from verify_service.passcost import PassCost, probe
from verify_service.session import Session, Verdict, commit, kept

log = logging.getLogger("specdec.verify")

CLOSE_WAIT_S = 0.9  # the longest a closing handler waits for its session's room (`Scheduler.closed`): within the second the
# draft waits for the session's end (draft_service/server.py ENDED_WAIT_S) before it cancels it
MAX_BATCH_TOKENS = 1024  # new rows of rounds per pass, by default (fairness: DESIGN.md §7)
GPU_PREFILL_ROWS = 8192  # prompt rows per pass on a GPU, by default: arrivals are admitted in a few compute-bound passes
SWITCH_INTERVAL_S = 0.0005  # the GIL's switch interval in a process that runs a scheduler (Scheduler.__init__)
GATHER_SHARE = 0.25  # a pass waits at most this share of the last pass's time for the last pass's sessions' next rounds


class Scheduler:
    def __init__(self, lm: LM, max_sessions: int = 64, max_cached_tokens: int | None = None, max_pass_rows: int = MAX_BATCH_TOKENS,
                 thread_context: Callable[[], contextlib.AbstractContextManager] | None = None,
                 forced_acceptance: Callable[[Session, int], int] | None = None, gather: float = GATHER_SHARE,
                 max_prefill_rows: int | None = None):
        """max_pass_rows bounds the rows of rounds in one pass (a round is never split: one that
        does not fit waits for the next pass, first in line); max_prefill_rows, the rows of rounds
        and prompt chunks together (at least one chunk a pass; default: max_pass_rows on the CPU,
        GPU_PREFILL_ROWS elsewhere, where a prompt chunk is compute-bound and many in one pass cost
        little more per row than one). thread_context: a context the
        scheduler thread (the one that runs the model) runs its whole life in, e.g. a profiler.
        gather: the share of the last pass's time a pass waits for the last pass's sessions (`_gather`; 0: none).
        forced_acceptance (benchmarks only, never the services): how many of a round's tau
        proposals to accept, given its session and tau, in place of the rule; the round commits
        those proposals and the target's own token after them, so a benchmark measures throughput at
        a chosen acceptance on random-weight models, whose proposals no draft can predict."""
        self.lm = lm
        self._forced = forced_acceptance
        self.gather = gather
        self._back: set[int] = set()  # sessions whose next round the next pass waits for a little (`_gather`)
        self._pass_s = 0.0  # the last pass's seconds
        self._awaited: set[int] = set()  # while gathering: the sessions not queued yet (emptied by `_submit`)
        self._arrived = threading.Event()  # set by `_submit` when the last awaited session is queued
        # The event loop (gRPC handlers, the sessions' coroutines) and this thread share one GIL. At
        # CPython's default 5 ms switch interval a pass's host work waits up to 5 ms each time the
        # event loop holds it, many times a pass; 0.5 ms bounds that wait.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.max_pass_rows = max_pass_rows
        self.max_prefill_rows = max_prefill_rows or (max_pass_rows if lm.device.type == "cpu" else max(max_pass_rows, GPU_PREFILL_ROWS))
        budget = default_cache_budget(lm, max_sessions)  # every session at full context, within the free memory's share
        if max_cached_tokens and max_cached_tokens > budget and budget < full_cache_tokens(lm, max_sessions):
            # the given budget wins (replicas alike, an estimate overruled), but not silently where memory is what binds
            log.warning("--max-cached-tokens %d is more than the free memory's share holds (%d tokens): admission may promise "
                        "cache room the device does not have", max_cached_tokens, budget)
        self.capacity = Capacity(max_sessions, max_cached_tokens or budget, PAGE)
        # the pool never doubles past what admission can hand out (the budget's pages and the trash page)
        lm.engine.pool.limit = -(-self.capacity.max_cached_tokens // PAGE) * PAGE + PAGE
        self.sessions: dict[int, Session] = {}
        self._next_sid = 1
        self._lock = threading.Lock()
        self._passing = False  # a pass is in flight (the scheduler thread sets it under _lock; `close` reads it)
        self._pass_began = 0.0  # when the pass in flight began (time.monotonic), for `pass_age`
        self._pass_t0 = 0.0  # ... and by time.perf_counter, the pass cost's clock (`in_flight_since`)
        self._queue: queue.Queue = queue.Queue()
        self.cost = PassCost(probe(self._timed_pass, lm.vocab_size, lm.max_context))  # before the scheduler thread owns the model
        cost, me = self.cost, weakref.ref(self)  # the gauges read them when scraped: an idle verifier's utilisation and
        # price fall, not freeze; by a weak reference, so that the process-wide gauges keep no scheduler (and model) alive

        def since() -> float | None:
            s = me()
            return None if s is None else s.in_flight_since()
        metrics.PASS_UTILISATION.set_function(lambda: cost.utilisation_at(time.perf_counter(), since()))
        metrics.ROW_PRICE.set_function(lambda: cost.price_at(time.perf_counter(), since()))
        self.health = PassHealth()  # whether the passes work (verify_service/health.py)
        self._thread_context = thread_context or contextlib.nullcontext
        self._worker = threading.Thread(target=self._thread, name="verify-scheduler", daemon=True)
        self._worker.start()

    @property
    def max_sessions(self) -> int:
        return self.capacity.max_sessions

    @property
    def max_cached_tokens(self) -> int:
        return self.capacity.max_cached_tokens

    # ---- sessions ---------------------------------------------------------------------------

    def open(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling, seed: int, mode: int,
             request_id: str = "", tree_budget: int = 0) -> Session:
        """Admits a session (its arguments already validated); reserves its cache room: its whole
        run, and room for a tree of `tree_budget` nodes past its last token (so its last rounds'
        trees keep their width), up to the context limit."""
        need = min(len(prompt_ids) + max_new_tokens + tree_budget, self.lm.max_context)
        held = self.capacity.admit(need)  # in whole pages: the slots its cache holds
        with self._lock:
            sid, self._next_sid = self._next_sid, self._next_sid + 1
            s = Session(sid=sid, request_id=request_id, ids=list(prompt_ids), prompt_len=len(prompt_ids),
                        max_new_tokens=max_new_tokens, sampling=sampling, mode=mode, seed=seed,
                        cache=self.lm.engine.cache(need), reserved=held)
            self.sessions[sid] = s
        return s

    def close(self, s: Session) -> asyncio.Future | None:
        """Closes a session (again: a no-op). Its session slot comes back now; its pages and reserved
        tokens now too, or, while a pass is in flight, once that pass is done: then, called in an
        event loop, it returns a future that is done when they are (`closed` awaits it where the
        cache is full), so a caller whose call has ended OK finds room for its next session."""
        with self._lock:
            if s.closed:
                return s.released[1] if s.released else None
            s.closed = True
            del self.sessions[s.sid]
            now = not self._passing  # no pass reads its pages, and the next one drops its jobs (`_dropped`)
        self._arrive(s.sid)  # a pass that waits for its next round waits no longer
        if now:
            s.cache.release()
            self.capacity.release(s.reserved)
        else:  # its slot comes back now (the sessions table no longer holds it); the scheduler thread frees its pages
            self.capacity.leave()  # after the pass in flight, and only then its reserved tokens: admission never counts on
            with contextlib.suppress(RuntimeError):  # pages not in the pool yet (`_take`)
                loop = asyncio.get_running_loop()
                s.released = (loop, loop.create_future())  # before the queue: the thread reads it after its get
            self._queue.put(s)
        metrics.CACHED_TOKENS.set(self.cached_tokens())
        return s.released[1] if s.released else None

    def in_flight_since(self) -> float | None:
        """When the pass in flight began (perf_counter), or None: the gauges count it busy as it runs."""
        with self._lock:
            return self._pass_t0 if self._passing else None

    def pass_age(self) -> float:
        """Seconds the pass in flight has run (0 without one): a pass that never returns (a wedged
        device, a hung kernel) faults nothing, so only its age tells (VerifyServicer's watchdog)."""
        with self._lock:
            return time.monotonic() - self._pass_began if self._passing else 0.0

    async def closed(self, s: Session, timeout: float = CLOSE_WAIT_S) -> None:
        """Closes `s` (its session slot back at once); where its reserved tokens are what the next
        session like it needs (the cache's budget is full: `Capacity.tight`), waits, at most
        `timeout`, until its pages and tokens are back (at most the pass in flight; a scheduler that
        stopped never gives them back). Elsewhere the call ends at once: a request's end does not
        wait for a pass."""
        done = self.close(s)
        if done is not None and not done.done() and self.capacity.tight(s.reserved):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.shield(done)

    def cached_tokens(self) -> int:
        return sum(s.cache.length for s in list(self.sessions.values()))

    def room(self, s: Session) -> int:
        """Proposals the session's next round may carry without passing the context limit."""
        return self.lm.max_context - len(s.ids)

    async def prefill(self, s: Session) -> float:
        """Puts prompt[:-1] into the session's cache; returns the seconds it took."""
        t0 = time.perf_counter()
        if unfilled(s):
            await self._submit(s)
        return time.perf_counter() - t0

    async def step(self, s: Session, tokens: list[int], q: RoundQ | None, parents: list[int] | None = None) -> Verdict:
        """One round: a pass over [pending, tokens] (batched with other sessions), acceptance, commit.
        With parents, the tokens are a tree's nodes (DESIGN.md §12)."""
        s.next_round += 1
        # a chain's proposals past max_new_tokens could never be emitted; a tree's nodes past the
        # session's reserved room could not be stored (`open`; commit cuts what passes max_new_tokens)
        left = s.max_new_tokens - s.generated if parents is None else s.cache.capacity - len(s.ids)
        if len(tokens) > left:
            tokens, q = tokens[:left], None if q is None else q.cut(left)
            parents = None if parents is None else parents[:left]  # parents come first: still a tree
        return await self._submit(s, list(tokens), q, list(parents) if parents else None)

    async def steps(self, s: Session, limit: int | None = None) -> AsyncIterator[Verdict]:
        """Target-only: the prompt's prefill, then one-token steps until the session finishes
        (or after `limit` steps: a run of a Verify.Session stream, verify_service/server.py).
        The first step shares the pass of the prompt's last chunk (`_run`). The scheduler thread
        runs each step as soon as the last one is committed, without waiting for the caller to
        take its verdict (DESIGN.md §6). Stops when the caller closes the session."""
        verdicts: asyncio.Queue = asyncio.Queue()
        self._queue.put(Stream(s, asyncio.get_running_loop(), verdicts, limit))
        self._arrive(s.sid)  # a run is the session's next work too: a pass waiting for its round goes now
        while True:
            ok, v = await verdicts.get()
            if not ok:
                raise v
            yield v
            limit = None if limit is None else limit - 1
            if v.finish or limit == 0:
                return

    async def _submit(self, s: Session, tokens=None, q=None, parents=None):
        loop = asyncio.get_running_loop()
        job = Round(s, loop, loop.create_future(), tokens, q, parents) if tokens is not None else Prefill(s, loop, loop.create_future())
        self._queue.put(job)
        self._arrive(s.sid)
        return await job.future

    def _arrive(self, sid: int) -> None:
        """Session `sid`'s next work is queued, or it closed: the scheduler thread, if it is
        gathering (`_gather`) and this was the last session it waited for, is woken."""
        awaited = self._awaited
        if awaited:
            awaited.discard(sid)
            if not awaited:
                self._arrived.set()

    def _timed_pass(self, contexts: list[list[int]], inputs: list[list[int]]) -> float:
        """Seconds of one pass over `inputs`, each after its context in a fresh cache (PassCost's
        start-up probe), through the same engine and host sync as a round's."""
        caches = [KVCache(len(c) + len(x)) for c, x in zip(contexts, inputs)]
        try:
            self.lm.engine.forward(contexts, caches, False)
            t0 = time.perf_counter()
            logits = self.lm.engine.forward(inputs, caches)
            to_host(torch.stack([lg[-1].argmax() for lg in logits]))  # waits for the device as a round's verdicts do
            return time.perf_counter() - t0
        finally:
            for c in caches:
                c.release()

    def shutdown(self, timeout: float | None = 5) -> None:
        """Stops the scheduler thread; waits for it at most `timeout` seconds (None: until it ends)."""
        self._queue.put(_STOP)
        self._worker.join(timeout=timeout)

    # ---- the scheduler thread ---------------------------------------------------------------

    def _thread(self) -> None:
        with self._thread_context():
            self._work()

    def _take(self, job, rounds: list[Job], prefills: collections.deque[Job]) -> bool:
        """Files `job` (if any) and every job queued after it; False once told to stop."""
        while True:
            if job is None:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    return True
            if job is _STOP:
                return False
            if isinstance(job, Session):  # a closed session (`close`): its pages back to the pool, then its tokens
                job.cache.release()
                self.capacity.give_back(job.reserved)
                if job.released:  # its handler waits for that room (`closed`)
                    loop, done = job.released
                    with contextlib.suppress(RuntimeError):  # a loop that closed meanwhile
                        loop.call_soon_threadsafe(lambda d=done: d.done() or d.set_result(None))
            elif job.session.closed:
                job.resolve(False, RequestError(Refusal.CANCELLED, "session closed"))
            elif unfilled(job.session) and isinstance(job, (Prefill, Stream)):  # its prompt is not in yet: it fills it
                waiting = next((i for i, p in enumerate(prefills) if p.session is job.session), None)
                there = None if waiting is None else prefills[waiting]
                if isinstance(job, Stream) and isinstance(there, Prefill):  # the session's prefill still waits:
                    job.prefill, prefills[waiting] = there, job  # the stream takes its place (`_run` resolves it)
                elif isinstance(job, Prefill) and isinstance(there, Stream) and there.prefill is None:
                    there.prefill = job  # a prefill after its session's stream (not sent so today): the stream fills for it
                else:
                    prefills.append(job)
            else:
                (prefills if isinstance(job, Prefill) or unfilled(job.session) else rounds).append(job)
            job = None

    def _gather(self, rounds: list[Job], prefills: collections.deque[Job]) -> bool:
        """Waits, at most `gather` of the last pass's time, for the next rounds of the sessions
        whose verdicts the last pass gave (their drafts were already running): a pass that starts
        without them would leave them a whole pass behind. It waits only when those are at least as
        many as the rounds already queued (sessions in runs, say): a few late sessions do not hold
        back a pass of many ready ones. The thread sleeps until the last of
        them is queued (`_submit` wakes it once) or the time is up, so it takes no GIL meanwhile
        from the event loop that is queueing them. False once told to stop."""
        missing = {sid for sid in self._back - {j.session.sid for j in rounds} if sid in self.sessions} if self.gather else None
        if missing:
            self._arrived.clear()
            self._awaited = missing  # published: from now on `_submit` takes sessions out of it
            if not self._take(None, rounds, prefills):  # what was queued before it was published
                return False
            missing.difference_update(j.session.sid for j in rounds)
            missing.intersection_update(self.sessions)  # closed before it was published: `_arrive` could not take them out
            if missing and len(missing) >= len(rounds):
                self._arrived.wait(self.gather * self._pass_s)
            self._awaited = set()
        return self._take(None, rounds, prefills)

    def _work(self) -> None:
        rounds: list[Job] = []
        prefills: collections.deque[Job] = collections.deque()
        while True:
            job = None
            if not rounds and not prefills:  # idle: block (while broken, test the engine now and then meanwhile)
                try:
                    job = self._queue.get(timeout=SELF_TEST_S if self.health.wants_self_test else None)
                except queue.Empty:  # a pass over one token in a fresh cache
                    try:
                        self._timed_pass([[0]], [[0]])
                    except Exception as e:  # noqa: BLE001 - still broken
                        self.health.self_tested(e)
                    else:
                        self.health.self_tested(None)
                    continue
            if not self._take(job, rounds, prefills):
                return
            if not self._gather(rounds, prefills):
                return
            batch, used = [], 0
            while rounds and (not batch or used + len(rounds[0].tokens) + 1 <= self.max_pass_rows):
                used += len(rounds[0].tokens) + 1
                batch.append(rounds.pop(0))
            filling, budget = [], max(PREFILL_CHUNK, self.max_prefill_rows - used)  # at least one chunk a pass; more where rows are left
            for j in prefills:
                left = len(j.session.ids) - 1 - j.session.cache.length
                n = min(PREFILL_CHUNK, left)
                n += isinstance(j, Stream) and n == left  # a stream's first step joins its prompt's last chunk (_run)
                if filling and n > budget:
                    break
                filling.append(j)
                budget -= n
            t0, fault = time.perf_counter(), None
            with holding() as outcomes:  # the pass's verdicts go to each event loop in one hand-off, at its end
                with self._lock:
                    self._passing, self._pass_began, self._pass_t0 = True, time.monotonic(), t0
                try:
                    self._run(batch, filling)
                except Exception as e:  # noqa: BLE001 - a fault past the model call's own guard (the device, a bug): the pass's
                    fault = e
                    # unanswered jobs fail with it, and the thread goes on; a dead thread would leave every session waiting
                    log.exception("verify pass failed outside the model call; its %d unanswered jobs fail",
                                  sum(not j.finished for j in batch + filling))
                    for j in batch + filling:
                        if not j.finished:
                            j.resolve(False, RequestError(Refusal.INTERNAL, f"the verify pass failed: {type(e).__name__}: {e}"))
                finally:  # before the hand-off: a session its verdict ends is closed after the pass
                    with self._lock:
                        self._passing = False
                self.health.judge(outcomes, fault)  # before the hand-off too: a caller that has its result sees the health it made
            self._pass_s = time.perf_counter() - t0
            for j in batch + filling:  # a stream's session that finished (Generate's, or a Session's run, which runs ahead of
                if isinstance(j, Stream) and j.session.finish:  # its reader) gives its pages and room back now: its handler
                    self.close(j.session)  # may wait long on a slow reader, and a finished session takes no more rounds
            self._back = {j.session.sid for j in batch if isinstance(j, Round) and not j.session.finish and not j.session.closed}
            rounds += [j for j in batch if not j.finished]  # streams whose sessions go on
            for j in filling:
                if j.finished or not unfilled(j.session):
                    prefills.remove(j)
                    if not j.finished:  # a stream with its prompt in: its steps go on as rounds
                        rounds.append(j)
            metrics.CACHED_TOKENS.set(self.cached_tokens())

    def _run(self, batch: list[Job], prefills: list[Job]) -> None:
        """One pass over the rounds in `batch` and the next chunk of each prompt in `prefills`;
        resolves every job it finishes (a prefill once its last chunk is in). A stream among the
        prefills (target-only) takes its first step in the pass of its prompt's last chunk, as a
        second input of the same session, so its first token costs no pass of its own."""
        t0 = time.perf_counter()
        jobs = [j for j in batch if not self._dropped(j)]
        prefills = [j for j in prefills if not self._dropped(j)]
        chunks, merged = [], []  # each prefill's next chunk; the streams whose first step joins this pass
        for p in prefills:
            s = p.session
            have, goal = s.cache.length, len(s.ids) - 1
            chunks.append(s.ids[have : min(goal, have - have % PREFILL_CHUNK + PREFILL_CHUNK)])  # boundaries fixed by position
            if isinstance(p, Stream) and have + len(chunks[-1]) == goal:
                merged.append(p)
        jobs += merged
        everyone = jobs + [p for p in prefills if p not in merged]
        if not everyone:
            return
        filling = [(p, c) for p, c in zip(prefills, chunks) if c]
        inputs = [c for _, c in filling] + [[j.session.ids[-1], *j.tokens] for j in jobs]  # chunks first: each precedes its session's step
        caches = [p.session.cache for p, _ in filling] + [j.session.cache for j in jobs]
        T = max((len(j.tokens) for j in jobs), default=0)
        proposals = torch.tensor([j.tokens + [0] * (T - len(j.tokens)) for j in jobs], dtype=torch.long).view(len(jobs), T)
        proposals = proposals.to(self.lm.device, non_blocking=True)  # [B, T] all sessions', padded with 0: one copy
        trees = [None] * len(filling) + [Tree(j.session.cache.length, (-1, *(p + 1 for p in j.parents))) if j.parents else None
                                         for j in jobs]  # a tree round's row 0 is its pending token, the root
        try:
            logits = self.lm.engine.forward(inputs, caches, [False] * len(filling) + [True] * len(jobs), padded=True,
                                            trees=trees)  # [B, T+1, V]
        except Exception as e:  # noqa: BLE001 - nothing was committed: retry alone to find whose it is
            if len(everyone) == 1:
                everyone[0].resolve(False, e)
                return
            log.warning("batched pass failed (%s: %s); retrying its %d sessions one by one", type(e).__name__, e, len(everyone))
            for j in jobs:
                if j not in merged:  # a merged stream is retried with its chunk, below
                    self._run([j], [])
            for p in prefills:
                self._run([], [p])
            return
        for p, _ in filling:
            if not unfilled(p.session):  # before the verdicts: a stream's handler reads it with its first
                p.session.prefill_s = time.perf_counter() - p.enqueued
                p.enqueued = t0  # a merged first step waited for its prompt only, which prefill_s counts
        if jobs:
            metrics.BATCH_SIZE.observe(len(jobs))
            metrics.BATCH_TOKENS.observe(sum(len(x) for x in inputs))
            self._verdicts(jobs, logits, proposals, t0, (sum(len(x) for x in inputs), len(inputs)))
        elif filling:  # prompt chunks alone: busy time too (pass utilisation, the cost fit, the forward histogram)
            metrics.BATCH_TOKENS.observe(sum(len(x) for x in inputs))  # every pass's tokens, as FORWARD_TIME times every pass
            wait(self.lm.device)  # its time once the device is done (no verdicts to wait for)
            self._observed((sum(len(x) for x in inputs), len(inputs)), 0, t0)
        for p in prefills:
            if unfilled(p.session):
                continue
            if not isinstance(p, Stream):
                p.resolve(True, None)
            elif p.prefill is not None:  # the prefill this stream took over
                p.prefill.resolve(True, None)
                p.prefill = None

    def _verdicts(self, jobs: list[Job], logits: torch.Tensor, proposals: torch.Tensor, t0: float,
                  layout: tuple[int, int]) -> None:
        """Acceptance for every session in one batched call on the device, then one transfer of
        all (n, next); the pass's time (forward + acceptance) is taken after that transfer, when a
        GPU is done, and feeds the pass cost model with the pass's layout (rows, inputs).
        logits [B, T+1, V]: each job's rows padded by repeating its last; proposals [B, T]: each
        job's tokens padded with 0."""
        keep = []
        for i, j in enumerate(jobs):
            try:
                check(j, logits.shape[-1])
                keep.append(i)
            except Exception as e:  # noqa: BLE001 - fails this session only
                j.resolve(False, e)
        if len(keep) < len(jobs):
            jobs, logits, proposals = [jobs[i] for i in keep], logits[keep], proposals[keep]
        done = self._decide(jobs, logits, proposals) if jobs else []
        if not done:
            return
        done = [(j, n, ([j.tokens[i] for i in path] if path is not None else j.tokens[:n]) + [nxt], path) for j, n, nxt, path in done]
        eos, limit = self.lm.eos, self.lm.max_context  # the tokens the pass commits: its rounds' cut at EOS and the limits
        cuts = {id(j): kept(j.session, new, eos, limit) for j, _, new, _ in done}  # each session's, before any commits
        forward_s = self._observed(layout, sum(k for k, _ in cuts.values()), t0)
        row_cost_s, price = self.cost.per_row_s, self.cost.price  # the same for every verdict of the pass
        moves: tuple[list[int], list[int]] = ([], [])
        for j, n, _, path in done:
            if path:  # a tree's accepted nodes go where the path's tokens belong, after the pending token
                src, dst = j.session.cache.path_slots(len(j.session.ids) - 1, [i + 1 for i in path])
                moves[0].extend(src)
                moves[1].extend(dst)
        try:
            self.lm.engine.pool.move(*moves)
        except Exception as e:  # noqa: BLE001 - the tree rounds' paths are not in place: they fail, the chains go on
            for j, _, _, path in done:
                if path is not None:
                    j.resolve(False, e)
            done = [d for d in done if d[3] is None]
        for j, n, new, path in done:
            s = j.session
            try:
                if not 0 <= new[-1] < self.lm.vocab_size:  # a NaN row's draw: never into the sequence (the next pass would index with it)
                    raise RequestError(Refusal.INTERNAL, "the target's logits at this position are not finite: no token can be drawn")
                v = commit(s, new, n, cuts[id(j)])
                v.path = None if path is None else path[: v.num_accepted]  # cut where the sequence ended (EOS, a limit)
                v.forward_s, v.queue_s, v.pass_rounds = forward_s, t0 - j.enqueued, len(jobs)
                v.row_cost_s, v.row_price = row_cost_s, price
                metrics.QUEUE_WAIT.observe(t0 - j.enqueued)
                j.resolve(True, v)
            except Exception as e:  # noqa: BLE001
                j.resolve(False, e)

    def _observed(self, layout: tuple[int, int], tokens: int, t0: float) -> float:
        """A finished pass that began at t0, with its layout (rows, inputs) and the tokens it
        committed, into the forward histogram and the cost model; returns its seconds."""
        forward_s = time.perf_counter() - t0
        metrics.FORWARD_TIME.observe(forward_s)
        self.cost.observe(*layout, tokens, forward_s, t0)
        return forward_s

    def _decide(self, jobs: list[Job], logits: torch.Tensor, proposals: torch.Tensor) -> list[tuple[Job, int, int, list[int] | None]]:
        """[(job, n, next, a tree's accepted path or None)] from one batched acceptance (chains and
        trees apart) and ONE host transfer; if the batch raises, each session is retried alone, so
        a failure fails its own session only."""
        try:
            order, verdicts = decide(jobs, logits, proposals, self._forced)
            rows = to_host(verdicts)  # [B, 2 + W]: the only host sync
            out = {}
            for i, r in zip(order, rows):
                out[i] = (jobs[i], r[0], r[1], [m for m in range(len(jobs[i].tokens)) if r[2 + m]] if jobs[i].parents else None)
            return [out[i] for i in range(len(jobs))]
        except Exception as e:  # noqa: BLE001
            if len(jobs) == 1:
                jobs[0].resolve(False, e)
                return []
            log.warning("batched acceptance failed (%s: %s); retrying its %d sessions one by one", type(e).__name__, e, len(jobs))
            return [d for i in range(len(jobs)) for d in self._decide(jobs[i : i + 1], logits[i : i + 1], proposals[i : i + 1])]

    @staticmethod
    def _dropped(j: Job) -> bool:
        if j.session.closed:
            j.resolve(False, RequestError(Refusal.CANCELLED, "session closed"))
            return True
        return False


_STOP = object()
