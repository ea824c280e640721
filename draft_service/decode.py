"""The speculative decode loop of one request, on the draft side.

Given the request's parameters and an open Verify.Session stream, `DecodeLoop.rounds(call)`:
sends `start` (the prompt; the verifier prefills while the draft prefills its own cache, unless the
session starts in a run of target-only steps: then the draft's cache catches up when it first drafts), then
per round proposes tau tokens (draft model or prompt lookup) with the q each was sampled from,
sends them as one `Round`, reads the verdict, commits the accepted prefix plus the verifier's
next token and yields them with the verifier's finish reason, until that reason is set.

* A verdict's tokens are yielded once the next round is on its way (written, where it was
  pre-drafted or needs no drafting; else with its drafting started in its thread), so the
  caller's write to its client overlaps the verifier's pass or the drafting; a failure before
  then yields them, then raises. Before a run, and for a request with stop strings (the caller
  may end it at any verdict's tokens, and a round written ahead would cost the verifier a pass),
  they are yielded at once.
* Adaptive tau (draft_service/adaptive.py) picks tau per round from the acceptance so far and costs calibrated once.
* Pre-drafting: while round k is verified, a thread drafts round k+1 assuming all of round k is
  accepted and guessing the bonus token, and for a greedy chain the draft serves alone also
  after each rejection whose correction is the draft's second choice (draft_service/drafter.py);
  the verdict decides which one is used, if any.
* Fallback: when the session's measured acceptance makes the draft model slower than target-only
  rounds (adaptive.DraftJudge, from the same costs), the loop stops running the model for the
  session and sends rounds without proposals: the verifier answers each with the target's next
  token, exactly as it does after a full rejection. In hybrid mode prompt lookup is judged the
  same way (its rounds cost no draft steps) and stops for the session when it does not pay.
  Until the model's first proposal is accepted, its rounds propose one token (cheap evidence).
  Counted in Stats.fallback_rounds and specdec_draft_fallback_sessions_total; one warning per model.
* A verify stream that does not take a message or give a verdict within `round_timeout_s` ends
  the request with UNAVAILABLE ("the verify service stopped answering"): a hung verify service
  holds a request for that long, not until keepalive gives up.
* Stats (`self.stats`, the wire's Stats message) and the draft-side Prometheus counters are
  updated every round; `summary()` fills in the derived rates at the end.

The caller owns the stream (opens it and cancels it) and the text: it turns the ids into
GenerateResponse chunks and may stop early (a stop string) by closing the generator; closing it
stops a pre-draft, or the draft's prefill of the prompt (or its catch-up after a run), after its
current step or chunk (the session is counted as served until then). Anything with async `write(VerifyRequest)` and `read()` returning
VerifyResponse or grpc.aio.EOF works as the stream, so the loop runs in-process in tests.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import time
from typing import AsyncIterator, Protocol

import grpc

from draft_service.adaptive import RUN_MIN, RUN_TOKENS_PER_VERDICT, DraftJudge, ModelRecord, Pace, TauController, load_label, pace_of
from draft_service.drafter import Drafter, PredraftControl, Proposal
from draft_service.lookup import lookup
from draft_service.tree import CALIBRATIONS, Calibration
from specdec.costmodel import Costs
from specdec import metrics
from specdec.errors import Refusal, RequestError
from specdec.engine import PREFILL_CHUNK
from specdec.proposal import ids_only
from specdec.validation import GenParams
from specdec.v1 import specdec_pb2 as pb

HYBRID_MIN_NGRAM = 2  # hybrid mode trusts prompt lookup from a 2-gram match up
log = logging.getLogger("specdec.draft")
_warned: set[str] = set()  # models whose fallback was logged
RECORDS: dict[str, ModelRecord] = {}  # per draft model: whether it paid in this process's recent sessions


DRAFT_THREADS = 72  # the draft service's worker threads at most (`drafting_executor`): a step batch of 64 sessions and a margin


def drafting_executor(max_sessions: int) -> concurrent.futures.ThreadPoolExecutor:
    """The draft service's default executor, where `started` and `asyncio.to_thread` run: a worker
    for every session that may draft at once, and for one step each may leave running after its
    session ended, with a margin for the rest (a large request's parsing, address lookups).
    asyncio's own is min(32, CPUs + 4) workers: on a small host it held the step batcher's passes
    to a few sessions (6 on 2 cores), whatever --max-sessions allows. At most DRAFT_THREADS: each
    thread that leads a pass may get an OpenMP team of its own where --threads > 1."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=min(2 * max_sessions + 8, DRAFT_THREADS), thread_name_prefix="draft")


def started(fn, *args) -> asyncio.Future:
    """fn(*args) in a worker thread, started now (asyncio.to_thread starts it only when the event
    loop next runs its task): the draft drafts while the loop's caller still holds the loop."""
    ctx = contextvars.copy_context()
    return asyncio.get_running_loop().run_in_executor(None, functools.partial(ctx.run, fn, *args))


class VerifyStream(Protocol):
    """The draft's end of a Verify.Session stream (a grpc.aio stream-stream call)."""

    async def write(self, request: pb.VerifyRequest) -> None: ...

    async def read(self): ...  # pb.VerifyResponse, or grpc.aio.EOF once the verifier ended the stream


class DecodeLoop:
    """One request's rounds. `fingerprint` is the draft vocabulary's (sent in `start`);
    `max_context` the smaller of the two models' context limits. `costs` turns on adaptive tau;
    `fallback` (costs) the fallback to target-only rounds when the draft model does not pay;
    `skip` whether the session starts without the model (None: its record decides, `skipped` says
    what it decided; a request placed again on another replica passes the first loop's)."""

    def __init__(self, drafter: Drafter, params: GenParams, fingerprint: str, max_context: int,
                 costs: Costs | None = None, predraft: bool = False, fallback: Costs | None = None, goodput: bool = True,
                 round_timeout_s: float | None = None, pace: Pace | None = None, skip: bool | None = None,
                 run_tokens: int = RUN_TOKENS_PER_VERDICT):
        self.drafter = drafter
        self.round_timeout_s = round_timeout_s  # a write or a verdict that takes longer: the verify service stopped answering
        self.run_tokens = run_tokens  # a run's steps one verdict may answer while the verifier serves others (--run-tokens-per-verdict)
        self.params = params
        self.fingerprint = fingerprint
        self.max_context = max_context
        # the verifier knows its own context limit only: where the pair's (the draft's) is smaller, the session asks for
        # no more tokens than fit under it, and the end there is CONTEXT, not LENGTH (`_reason`)
        self._max_new = min(params.max_new_tokens, max(1, max_context - len(params.prompt_ids)))
        # prompt lookup alone drafts nothing ahead: there is no model to run
        self.predraft = predraft and params.proposer != pb.PROPOSER_LOOKUP
        self.state = drafter.new_state(params, max_context)
        # adaptive tau when costs are given (calibrated by the service); else a fixed tau. It follows
        # the verifier's load (`goodput`) unless a seeded sampled request needs load-free taus
        steer = goodput and (params.sampling.greedy or not params.seeded)
        self.tau = TauController(max_tau=params.tau, costs=costs, predraft=self.predraft, steer=steer) if costs else None
        # the draft process's verdict on whether speculation pays at the verifier's load (adaptive.Pace)
        self.pace = (pace_of("") if pace is None else pace) if steer and costs else None  # "": no replica named (tests, tools)
        self.runs_ok = True  # the verifier runs target-only steps on its own (Round.target_only_steps); an old one does not
        self.stats = pb.Stats(prompt_tokens=len(params.prompt_ids), accepted_per_position=[0] * params.tau)
        use_model = params.proposer != pb.PROPOSER_LOOKUP
        self.judge = DraftJudge(fallback, params.tau, self.predraft) if fallback and use_model else None
        self.fallen_back = False  # the draft model stopped for this session
        # the model's record across this process's sessions (adaptive.ModelRecord): it may skip the model from the start
        self.record = RECORDS.setdefault(drafter.lm.name, ModelRecord()) if self.judge and steer else None
        self.skipped = bool(self.record) and (self.record.skip() if skip is None else skip)
        self._placed = False  # a verify replica took the session (`placed`)
        if self.skipped:  # counted once the session runs (`placed`): not a placement every replica refused
            self._fall_back(count=False)
        hybrid = fallback and params.proposer == pb.PROPOSER_HYBRID
        self.lookup_judge = DraftJudge(Costs(0.0, fallback.verify_base, fallback.verify_per_token), params.tau,
                                       min_tau=params.tau) if hybrid else None
        self.lookup_off = False  # hybrid: prompt lookup stopped for this session
        # greedy trees' acceptance by rank and draft probability, across this process's sessions (draft_service/tree.py)
        self.calibration = CALIBRATIONS.setdefault(drafter.lm.name, Calibration()) \
            if params.tree_budget and (params.sampling.greedy or (ids_only(params.mode) and not params.seeded)) else None

    def start(self) -> pb.VerifyRequest:
        g = self.params
        sampling = pb.SamplingParams(temperature=g.sampling.temperature, top_k=g.sampling.top_k, top_p=g.sampling.top_p, seed=g.seed)
        return pb.VerifyRequest(start=pb.SessionStart(
            prompt_ids=g.prompt_ids, max_new_tokens=self._max_new, sampling=sampling,
            proposal_mode=g.mode, vocab_fingerprint=self.fingerprint, request_id=g.request_id, tree_budget=g.tree_budget))

    def _reason(self, finish: int) -> int:
        """A verdict's finish reason as the request's: LENGTH at the pair's context limit is CONTEXT."""
        cut = self._max_new < self.params.max_new_tokens
        return pb.FINISH_REASON_CONTEXT if finish == pb.FINISH_REASON_LENGTH and cut else finish

    def cap(self, extra: int = 0) -> int:
        """Most proposals a round may carry once `extra` more tokens are committed: never more
        than the tokens still allowed minus the verifier's next token, nor past the context."""
        st = self.state
        left = self._max_new - (len(st.ids) + extra - st.prompt_len)
        return max(0, min(left - 1, self.max_context - len(st.ids) - extra))

    def tree_budget(self, tau: int) -> int:
        """Nodes of this round's tree (0: a chain): the request's tree_budget while the model drafts
        with evidence (judged sessions start with one-token chains) and a token may follow the next."""
        b = self.params.tree_budget
        if not b or tau == 0 or self.fallen_back or (self.judge and not self.judge.accepted) or not self.cap():
            return 0
        return self.tree_room(b)

    def tree_room(self, budget: int, extra: int = 0) -> int:
        """Nodes a tree may have once `extra` more tokens are committed: the verifier reserved room
        for the request's tree_budget past its last token (SessionStart.tree_budget), so only the
        context limit cuts it; its depth is cut to the tokens left (`cap`)."""
        return max(0, min(budget, self.max_context - len(self.state.ids) - extra))

    def floor(self) -> float:
        """The lowest branch probability a tree node may have: what one more row costs the verifier's
        goodput now (its row price; 0 when idle or not steering), so under load the tree shrinks to
        the nodes likely enough to pay, down to a chain or none."""
        return self.tau.price if self.tau and self.tau.steer else 0.0

    def tree_cost(self) -> tuple[float, float] | None:
        """(seconds of a round besides its proposal rows, seconds per row) from the calibrated costs
        (adaptive sessions only): what sizes a tree (costmodel.tree_size). The round's drafting is
        counted as its depth in draft steps; the network is in the calibrated verify_base."""
        if not self.tau:
            return None
        c = self.tau.costs
        return c.verify_base + min(self.params.tau, self.cap()) * c.draft_step, c.verify_per_token

    def propose(self, tau: int, budget: int = 0) -> Proposal:
        st, mode = self.state, self.params.proposer
        if mode == pb.PROPOSER_LOOKUP or (mode == pb.PROPOSER_HYBRID and not self.lookup_off):
            # a lookup proposal costs no draft steps, so it takes the request's cap (num_draft_tokens;
            # 8 with adaptive tau), not the tau chosen for the draft model (bench/results/ENGINE.md),
            # as far as the verifier's load allows (tau above the load's cap: the priced-out session's probe, TauController.choose)
            cap = min(self.params.tau, max(self.tau.goodput_cap(), tau) if self.tau else self.params.tau, self.cap())
            prop = self.drafter.lookup(st, cap, min_ngram=1 if mode == pb.PROPOSER_LOOKUP else HYBRID_MIN_NGRAM)
            if prop.tokens or mode == pb.PROPOSER_LOOKUP:
                return prop
        if self.fallen_back:
            self.stats.fallback_rounds += 1
            return Proposal()  # a target-only round
        if tau == 0:
            return Proposal()  # the verifier's load (or the end of the request) leaves no room for proposals
        if budget:
            return self.drafter.propose_tree(st, budget, min(self.params.tau, self.cap()), floor=self.floor(), cost=self.tree_cost(),
                                             calibration=self.calibration)
        return self.drafter.propose(st, tau)

    async def rounds(self, call: VerifyStream) -> AsyncIterator[tuple[list[int], int]]:
        """Yields (committed ids, verifier finish reason) per round; the last has a reason set."""
        st, stats, ctl = self.state, self.stats, self.tau
        # the draft's thread in flight, which holds its cache until it returns: (its task, the PredraftControl of a
        # pre-draft; None for a prefill or a proposal)
        thread = None
        # the session counts among those the model serves (Drafter.shared: their pre-drafts give way) only while it
        # may use the model: not with prompt lookup alone, nor once it fell back
        uses_model = self.params.proposer != pb.PROPOSER_LOOKUP and not self.fallen_back
        serving = self.drafter.serving() if uses_model else contextlib.nullcontext()
        serving.__enter__()

        def in_thread(fn, *args) -> None:
            nonlocal thread
            thread = (started(fn, *args), None)

        async def result():
            nonlocal thread
            out = await asyncio.shield(thread[0])  # a cancel here leaves the task to its thread: `finally` counts the session until it ends
            thread = None
            return out

        # the last verdict's tokens, yielded once the next round is on its way (written, or its drafting started): the
        # caller's write to its client then overlaps the verifier's pass, or the drafting, not the round trip
        pending = None
        try:
            await self._timed(call.write(self.start()))
            # a session that starts in a run, or without the model (its record), drafts nothing yet: its cache
            # catches up when it first drafts (_feed)
            if uses_model and not self._run_wanted():
                t1 = time.perf_counter()
                in_thread(self.drafter.prefill, st)  # the verifier prefills meanwhile
                await result()
                stats.prefill_s = time.perf_counter() - t1
            prop = None
            t_mark = time.perf_counter()  # the last verdict: a round's wall time for Pace runs from there
            caught_up = True  # False after a run: the model's next round feeds the run's tokens first
            while True:
                run = self._run_wanted() if prop is None else 0
                if run or (self.fallen_back and not self._lookup_left()):
                    if pending is not None:
                        yield pending
                        pending = None
                if run:
                    async for item in self._run(call, run):
                        yield item
                        if item[1]:
                            return
                    t_mark, caught_up = time.perf_counter(), False
                    continue
                if self.fallen_back and not self._lookup_left():
                    async for item in self._target_only(call):  # a verifier without runs: rounds written ahead
                        yield item
                    return
                # a session that follows the load pre-drafts only while the model serves it alone: beside others,
                # the model's spare steps are theirs (and, where the draft shares a machine with the verifier, its CPU)
                ahead_ok = self.predraft and not (self.pace and self.drafter.shared())
                if ctl:
                    ctl.predraft = ahead_ok  # the costs tau is chosen by: draft steps hidden or not
                if self.judge:  # and those the model is judged by; at fixed tau a seeded sampled request's judge
                    # weighs no overlap, so its decisions, and its tokens, are the same with pre-drafting on and off (§3)
                    self.judge.predraft = ahead_ok and not (ctl is None and self.params.seeded and not self.params.sampling.greedy)
                tau = ctl.choose() if ctl else self.params.tau
                if self.judge and not self.judge.accepted:
                    tau = min(tau, 1)  # no proposal of the model accepted yet: gather the judge's evidence cheaply
                budget = self.tree_budget(tau)
                t1 = time.perf_counter()
                if prop is None and (self.fallen_back or tau == 0):
                    prop = self.propose(min(tau, self.cap()))  # no model step: not worth a thread
                elif prop is None:
                    in_thread(self.propose, min(tau, self.cap()), budget)
                    if pending is not None:  # the caller writes to its client while the draft drafts
                        t0 = time.perf_counter()
                        yield pending
                        pending = None
                        t1 += time.perf_counter() - t0  # draft_s: the drafting the round waited for, not the caller's write
                    prop = await result()
                t2 = time.perf_counter()
                stats.rounds += 1
                stats.tree_rounds += prop.parents is not None
                stats.target_only_rounds += not prop.tokens
                await self._timed(call.write(pb.VerifyRequest(round=prop.to_round(stats.rounds))))
                tree = prop.parents is not None
                assumed = len(prop.assumed()) + 1
                next_cap = min(self.params.tau if tree else tau, self.cap(assumed))
                # a seeded sampled request replays with pre-drafting on or off (DESIGN §3): no pre-draft while the judge
                # caps its rounds at 1 (above), and none used where prompt lookup proposes (below); greedy output is the
                # same either way, and unseeded requests promise no replay, so those keep their pre-drafts
                replay = self.params.seeded and not self.params.sampling.greedy
                judging = replay and self.judge is not None and not self.judge.accepted
                # the next message is a run (a verifier with runs, in the pace's hold), or the verifier's price leaves the
                # next round no proposals (a priced-out session's probe, adaptive.PRICED_OUT_PROBE): nothing to pre-draft
                held = self.pace is not None and self.runs_ok and self.pace.held()
                priced_out = ctl is not None and ctl.steer and ctl.goodput_cap() == 0
                if ahead_ok and not prop.lookup and next_cap > 0 and not self.fallen_back and not judging and not held and not priced_out:
                    ahead_ctl = PredraftControl()
                    # a tree's pre-draft: a tree after its likeliest path (a greedy tree's: after each end of that path)
                    more = (self.tree_room(budget, assumed), self.floor(), self.tree_cost(), self.calibration) if tree else ()
                    thread = (started(self.drafter.predraft, st, prop, next_cap, ahead_ctl, *more), ahead_ctl)
                away = 0.0
                if pending is not None:  # the caller writes to its client during the round trip
                    t0 = time.perf_counter()
                    yield pending
                    pending = None
                    away = time.perf_counter() - t0  # verify_s: the wait for the verdict, not the caller's write
                v = await self._timed(call.read(), self._first_read_scale() if stats.rounds == 1 else 1)
                if v is grpc.aio.EOF:
                    raise RequestError(Refusal.UNAVAILABLE, "verify service ended the session without a verdict")
                t3 = time.perf_counter()
                metrics.PROPOSALS_PER_ROUND.observe(len(prop.tokens))  # once verified: a round a full replica refused is not one
                stats.draft_s += t2 - t1
                stats.verify_s += t3 - t2 - away
                stats.verify_forward_s += v.forward_s
                stats.lookup_rounds += prop.lookup and bool(prop.tokens)  # a lookup that found nothing is a target-only round
                n = v.num_accepted
                path = list(v.accepted_path) if tree else list(range(n))
                new = [prop.tokens[i] for i in path] + ([v.next_token] if v.HasField("next_token") else [])
                sent, prop = prop, None
                if thread is not None:  # a pre-draft: kept only if the context it assumed came true
                    prop = await self._predrafted(*thread, sent, v, path)  # a cancel meanwhile leaves the thread to `finally`
                    thread = None
                st.ids.extend(new)
                if replay and prop is not None and self._lookup_left() and lookup(st.ids, 1, min_ngram=HYBRID_MIN_NGRAM):
                    # prompt lookup proposes here, as a round drafted now would: the pre-draft gives way, so the
                    # round is the same with pre-drafting on or off, and the seeded request's tokens with it
                    prop = self._unused()
                prop = self._learn(sent, v, new, path, prop, t3 - t_mark, caught_up)
                if uses_model and self.fallen_back:  # it stopped the model (no thread of it in flight here): it no longer
                    uses_model = False  # counts among the sessions the model serves
                    serving.__exit__(None, None, None)
                    serving = contextlib.nullcontext()
                caught_up = caught_up or (bool(sent.tokens) and not sent.lookup)
                t_mark = t3
                if v.finish_reason:
                    yield new, self._reason(v.finish_reason)
                    return
                if self.params.stop:  # the caller may end the request at these tokens (a stop string): they go to it now,
                    yield new, 0  # so a stop costs the verifier no round written ahead
                else:
                    pending = (new, 0)
        except Exception:
            if pending is not None:  # a failure before the next round was on its way: the caller gets the tokens, then the error
                yield pending
            raise
        finally:
            st.gone.set()  # a long feed still in its thread (a prefill, a catch-up) stops before its next chunk
            task, ahead_ctl = thread if thread is not None else (None, None)
            if ahead_ctl is not None:  # a failure or a close with a pre-draft in flight: its thread stops after its current step
                ahead_ctl.verdict(None)

            def ended(task: asyncio.Task | None) -> None:  # the session is served until its thread returns; its error is nobody's
                if task is not None and not task.cancelled():
                    task.exception()
                serving.__exit__(None, None, None)

            if task is None or task.done():
                ended(task)
            else:
                task.add_done_callback(ended)

    async def _predrafted(self, task: asyncio.Task, ahead_ctl: PredraftControl, sent: Proposal, v, path: list[int]) -> Proposal | None:
        """The next round's proposal from the pre-draft in flight, if the context it assumed came
        true (a hit), else None (a miss). The thread owns the draft cache until it returns."""
        n, stats, ctl = v.num_accepted, self.stats, self.tau
        on_guess = sent.parents is None or path == sent.guess[: len(path)]  # a tree's outcomes end on its likeliest path
        ahead_ctl.verdict((n, v.next_token) if v.HasField("next_token") and on_guess else None)
        try:
            ahead = await asyncio.shield(task)
        except Exception as e:  # noqa: BLE001 - a pre-draft is work ahead, not the round's: its failure is a miss, and the
            # round is drafted afresh (where the model itself is broken, that fails the request with its own error)
            log.warning("pre-draft failed (%s: %s); drafting the round afresh, and pre-drafting no more in this session",
                        type(e).__name__, e, extra={"fields": {"request_id": self.params.request_id}})
            self.predraft, ahead = False, {}
        got = ahead.get(ahead_ctl.outcome())
        hit = got is not None and bool(got.tokens)
        stats.predraft_hits += hit
        stats.predraft_misses += not hit
        if ctl:  # whether this session's pre-drafts follow rejections (not while the draft model is shared)
            ctl.follows = len(ahead_ctl.wanted or ()) > 1
            if ctl.follows and on_guess and n < len(sent.alts) and v.HasField("next_token"):
                ctl.observe_second(v.next_token in sent.alts[n])
        return got if hit else None

    def _learn(self, sent: Proposal, v, new: list[int], path: list[int], prop: Proposal | None, wall_s: float,
               caught_up: bool) -> Proposal | None:
        """What a verified round teaches: the tree calibration, adaptive tau (acceptance and the
        verifier's price), the pace (the round's wall time since the last verdict, `wall_s`), the
        judges of the model and of prompt lookup, and the counts. Returns the next round's
        pre-draft (`prop`) as the load and the judge still allow it."""
        n, ctl, tree = v.num_accepted, self.tau, sent.parents is not None
        if tree and self.calibration and sent.ranks:
            self.calibration.observe(sent, path)
        if ctl:  # its estimate is a chain's per-token acceptance: a tree's is its likeliest path's
            if tree:
                ctl.observe(len(sent.guess), next((j for j, (a, b) in enumerate(zip(path, sent.guess)) if a != b),
                                                  min(len(path), len(sent.guess))))
            else:
                ctl.observe(len(sent.tokens), n)
            ctl.load(v.row_price)
            if prop is not None and ctl.steer:  # a pre-draft: made before this verdict's price was known
                prop = self._within_load(prop)
        if self.pace:
            # not the first round (it holds the verifier's prefill of the prompt), nor the first after a run
            # (it holds the draft's catch-up on the run's tokens, the whole prompt after a start in a run)
            if sent.tokens and self.stats.rounds > 1 and (caught_up or sent.lookup):
                judged = self.pace.observe(len(new), wall_s, v.target_only_s, v.open_sessions)
                if judged:
                    metrics.PACE_COMPARISONS.labels(load_label(judged[0]), judged[1]).inc()
                    log.debug("pace: a comparison at %s open sessions: speculation %s (%.2f of target-only's "
                              "seconds, relay %.2f)", load_label(judged[0]), judged[1], self.pace.ratio, self.pace.relay)
            else:
                self.pace.quote(v.target_only_s, v.open_sessions)
            if prop is not None and self.runs_ok and self.pace.held():  # a hold began (or goes on): the session runs target-only
                prop = self._unused()  # now, as one without a pre-draft would; a guess that came true does not skip it
        if self.judge and not sent.lookup:
            drafting = not self.fallen_back
            self._judge(max(len(sent.guess), n) if tree else len(sent.tokens), n)  # a tree: judged as the chain of its levels
            if drafting and self.fallen_back and prop is not None:  # the model stopped: its pre-draft is not sent,
                prop = self._unused()  # and the next message may be a run
        if self.lookup_judge and sent.lookup and not self.lookup_off:
            self.lookup_judge.observe(len(sent.tokens), n)
            self.lookup_off = not self.lookup_judge.pays()
        self._count(len(sent.tokens), n)
        return prop

    def _within_load(self, prop: Proposal) -> Proposal | None:
        """A pre-draft as the verifier's load now allows it: a chain cut to the goodput cap; none at
        a cap of 0 (then counted a miss, not a hit), so the round is decided afresh (a target-only
        round, or a run). A tree is kept whole above 0: its nodes were grown against the price
        before (its floor)."""
        keep = self.tau.goodput_cap()
        if keep < len(prop.tokens) and (keep == 0 or prop.parents is None):
            log.debug("pre-draft of %d proposals cut to %d by the verifier's price %.3f", len(prop.tokens), keep, self.tau.price)
        if keep == 0:
            return self._unused()
        return prop.prefix(keep) if prop.parents is None else prop

    def _unused(self) -> None:
        """Drops a pre-draft counted as a hit: it is counted a miss (Stats.predraft_hits counts the rounds sent from one)."""
        self.stats.predraft_hits -= 1
        self.stats.predraft_misses += 1

    def _lookup_left(self) -> bool:
        """Whether hybrid prompt lookup still proposes for the session."""
        return self.params.proposer == pb.PROPOSER_HYBRID and not self.lookup_off

    def _left(self) -> int:
        """Tokens the session may still commit."""
        st = self.state
        return max(0, min(self._max_new - (len(st.ids) - st.prompt_len), self.max_context - len(st.ids)))

    def _run_wanted(self) -> int:
        """Target-only steps to ask the verifier for now (0: a round): the rest of the request once
        the draft model does not pay and nothing else proposes; else what the load asks (Pace).
        A request with stop strings asks for RUN_MIN at a time: its stop is found here, after the
        verifier has stepped on, which reads nothing in a run, so the rest of a long run would be
        passes spent on a finished request and an end that waits for them."""
        if not self.runs_ok:
            return 0
        if self.fallen_back and not self._lookup_left():
            n = self._left()
        else:
            n = min(self.pace.run(), self._left()) if self.pace else 0
        return min(n, RUN_MIN) if self.params.stop else n

    async def _run(self, call: VerifyStream, n: int) -> AsyncIterator[tuple[list[int], int]]:
        """A run of n target-only steps on the verifier (Round.target_only_steps): one message out,
        the verifier steps on its own and sends a verdict per token, or per up to run_tokens while it
        serves other sessions (Round.run_tokens_per_verdict); the draft relays them. Its
        own cache catches up (one forward over the run's tokens) when it next drafts (drafter._feed)."""
        stats = self.stats
        per = self.run_tokens  # the verifier answers this many steps a verdict while it serves other sessions
        await self._timed(call.write(pb.VerifyRequest(round=pb.Round(round=stats.rounds + 1, target_only_steps=n, run_tokens_per_verdict=per))))
        got, t0 = 0, time.perf_counter()
        while True:
            # the run's first verdict answers one step (and the request's prefill, in its first round); a later one up
            # to `per` steps, each a pass beside other sessions
            v = await self._timed(call.read(), (self._first_read_scale() if stats.rounds == 0 else 1) if not got else per)
            if v is grpc.aio.EOF:
                raise RequestError(Refusal.UNAVAILABLE, "verify service ended the session without a verdict")
            k = len(v.run_tokens) + 1  # the steps this verdict answers
            first = not got
            got += k
            stats.rounds += k
            stats.target_only_rounds += k
            stats.fallback_rounds += k * self.fallen_back
            stats.run_steps += k
            for _ in range(k):
                metrics.PROPOSALS_PER_ROUND.observe(0)
            t1 = time.perf_counter()
            stats.verify_s += t1 - t0
            if self.tau:
                self.tau.load(v.row_price)
            if self.pace:
                self.pace.quote(v.target_only_s, v.open_sessions)
                if not first:  # the first verdict's wait holds the request's trip (and a prefill)
                    self.pace.ran((t1 - t0) / k, v.target_only_s)
            t0 = t1
            yield self._committed(v), self._reason(v.finish_reason)
            if v.finish_reason:
                return
            if not v.steps_left:
                if got == 1 and n > 1:
                    self.runs_ok = False  # a verifier that answers a run with one verdict has no runs
                return

    async def _target_only(self, call: VerifyStream) -> AsyncIterator[tuple[list[int], int]]:
        """The rest of a session that proposes nothing: rounds without proposals, one written ahead
        of the verdict the loop waits for (an empty round does not depend on it), so the verifier's
        next pass need not wait for the round trip. A round written past the end is never read:
        the verifier stops reading at the finish reason."""
        st, stats, g = self.state, self.stats, self.params
        ahead, open_ = 0, True  # open_: the verifier still takes rounds
        while True:
            while open_ and ahead < 2 and len(st.ids) - st.prompt_len + ahead < self._max_new and len(st.ids) + ahead < self.max_context:
                try:
                    await self._timed(call.write(pb.VerifyRequest(round=pb.Round(round=stats.rounds + ahead + 1))))
                except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
                    # the verifier ended the stream (a finish verdict still on its way): read what is there
                    open_ = False
                    break
                ahead += 1
            if not ahead:
                raise RequestError(Refusal.UNAVAILABLE, "verify service ended the session without a verdict")
            t0 = time.perf_counter()
            v = await self._timed(call.read())
            ahead -= 1
            if v is grpc.aio.EOF:
                raise RequestError(Refusal.UNAVAILABLE, "verify service ended the session without a verdict")
            stats.rounds += 1  # counted when verified: a round written ahead past the end is not
            stats.fallback_rounds += 1
            stats.target_only_rounds += 1
            metrics.PROPOSALS_PER_ROUND.observe(0)
            stats.verify_s += time.perf_counter() - t0
            yield self._committed(v), self._reason(v.finish_reason)
            if v.finish_reason:
                return

    def _committed(self, v: pb.Verdict) -> list[int]:
        """A target-only verdict's tokens (a run's several; none at a finish without one), added to the sequence and counted."""
        self.stats.verify_forward_s += v.forward_s
        new = list(v.run_tokens) + ([v.next_token] if v.HasField("next_token") else [])
        self.state.ids.extend(new)
        for _ in range(len(v.run_tokens) + 1):
            self._count(0, 0)
        return new

    def _judge(self, drafted: int, accepted: int) -> None:
        j = self.judge
        j.observe(drafted, accepted)
        if self.fallen_back:
            return
        if j.pays():
            if self.record and j.rounds == j.min_rounds:
                self.record.judged(True)
            return
        if self.record:
            self.record.judged(False)
        self._fall_back()

    def placed(self) -> None:
        """The session runs on a verify replica (its first tokens came): a session the model's
        record skipped from its start is counted a fallback now, once."""
        if self.skipped and not self._placed:
            metrics.DRAFT_FALLBACK.labels(self.drafter.lm.name).inc()
        self._placed = True

    def _fall_back(self, count: bool = True) -> None:
        """Stops the draft model for this session: counted, and logged once per model."""
        self.fallen_back = True
        name = self.drafter.lm.name
        if count:
            metrics.DRAFT_FALLBACK.labels(name).inc()
        if name not in _warned:
            _warned.add(name)
            j = self.judge
            log.warning("the draft model does not pay: sessions whose acceptance makes speculation slower than the target alone "
                        "fall back to target-only rounds (counted in specdec_draft_fallback_sessions_total; a better draft, "
                        "or --proposer lookup, would help)",
                        extra={"fields": {"model": name, "accepted": j.accepted, "rounds": j.rounds, "request_id": self.params.request_id}})

    def _first_read_scale(self) -> int:
        """The first verdict also waits for the verifier's prefill of the prompt, chunk by chunk:
        it gets the round timeout once per chunk."""
        return 1 + len(self.params.prompt_ids) // PREFILL_CHUNK

    async def _timed(self, op, scale: int = 1):
        """Awaits one write or read on the verify stream, at most scale x round_timeout_s."""
        limit = None if self.round_timeout_s is None else scale * self.round_timeout_s
        try:  # not asyncio.wait_for: on Python 3.11 it loses a cancel that lands as op completes (the session then runs on)
            async with asyncio.timeout(limit):
                return await op
        except TimeoutError:
            raise RequestError(Refusal.UNAVAILABLE, f"the verify service stopped answering: nothing for "
                               f"{limit:g}s in a round (--verify-round-timeout-s)") from None

    def summary(self) -> pb.Stats:
        """The stats with the acceptance rate and mean accepted length filled in."""
        s = self.stats
        s.acceptance_rate = s.accepted / s.drafted if s.drafted else 0.0
        s.mean_accepted_length = s.accepted / s.rounds if s.rounds else 0.0
        return s

    def _count(self, drafted: int, accepted: int) -> None:
        stats = self.stats
        stats.drafted += drafted
        stats.accepted += accepted
        for i in range(accepted):
            stats.accepted_per_position[i] += 1
        metrics.NUM_DRAFTS.inc()
        metrics.NUM_DRAFT_TOKENS.inc(drafted)
        metrics.NUM_ACCEPTED.inc(accepted)
        for i in range(accepted):
            metrics.ACCEPTED_PER_POS.labels(str(i)).inc()
