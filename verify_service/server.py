"""Verify gRPC servicer: Info, Session (the draft's bidirectional stream), Generate (target-only)."""
from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc
from grpc_health.v1 import health_pb2

from specdec import edge, metrics, observe, serving, validation
from specdec.architectures import TESTED
from specdec.errors import Refusal, RequestError, invalid
from specdec.proposal import MAX_ROUND_TOKENS, decode_parents, decode_round
from specdec.textstream import Chunks
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from verify_service.scheduler import Scheduler

log = logging.getLogger("specdec.verify")
SERVICE = "verify"
STALLED_PASS_S = 300.0  # --stalled-pass-s: a verify pass running longer is stalled (a wedged device); 0: not watched
MAX_RUN_TOKENS_PER_VERDICT = 16  # the most steps of a run one verdict answers (Round.run_tokens_per_verdict)


class VerifyServicer(pb_grpc.VerifyServicer):
    def __init__(self, engine: Scheduler, idle_timeout_s: float = 60.0, stalled_pass_s: float = STALLED_PASS_S):
        self.engine = engine
        self.lm = engine.lm
        self.idle_timeout_s = idle_timeout_s
        self.stalled_pass_s = stalled_pass_s  # a pass running longer is stalled (0: not watched)
        self.stalled: float | None = None  # the stalled pass's age when the watchdog last looked, while it is stalled
        self._set_health = None

    def on_start(self, set_health) -> None:
        """Once serving (specdec/serving.py `serve`): the health follows the scheduler's passes
        (verify_service/health.py): while they keep faulting, readiness and liveness are NOT_SERVING (and
        Info is UNAVAILABLE, so drafts place sessions elsewhere); after a self-test pass, ready but
        not live until a pass gives verdicts."""
        loop = asyncio.get_running_loop()
        status = {True: health_pb2.HealthCheckResponse.SERVING, False: health_pb2.HealthCheckResponse.NOT_SERVING}

        def tell(ready: bool, live: bool) -> None:  # on the scheduler thread
            asyncio.run_coroutine_threadsafe(set_health(status[ready], liveness=status[live]), loop)

        health = self.engine.health
        health.on_health = tell
        if health.broken:  # broken before serving began
            tell(health.retrying, False)
        self._set_health = set_health
        if self.stalled_pass_s:
            self._watchdog = loop.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.stalled_pass_s / 4))
            await self.watch_once()

    async def watch_once(self) -> None:
        """The watchdog's look at the pass in flight: one past `stalled_pass_s` makes the service
        NOT_SERVING (readiness and liveness: a device that never returns needs a new process) and
        Info UNAVAILABLE, until it returns; the passes' own health (verify_service/health.py) says
        the rest. Its sessions fail meanwhile at the draft's round timeout."""
        age = self.engine.pass_age()
        stalled = age if age > self.stalled_pass_s else None
        if (stalled is None) == (self.stalled is None):
            self.stalled = stalled
            return
        self.stalled = stalled
        metrics.VERIFY_BROKEN.set(1 if stalled is not None or self.engine.health.broken else 0)
        if stalled is not None:
            log.error("a verify pass has run for %.0f s (--stalled-pass-s %g): reporting NOT_SERVING until it returns", age,
                      self.stalled_pass_s)
            ready = live = False
        else:
            log.warning("the stalled verify pass returned")
            health = self.engine.health
            ready, live = health.broken is None or health.retrying, health.broken is None
        if self._set_health is not None:
            status = {True: health_pb2.HealthCheckResponse.SERVING, False: health_pb2.HealthCheckResponse.NOT_SERVING}
            await self._set_health(status[ready], liveness=status[live])

    async def Info(self, request, context):
        health = self.engine.health
        if self.stalled is not None:  # a pass that does not return: drafts place sessions elsewhere
            await serving.fail(context, SERVICE, "Info", RequestError(
                Refusal.UNAVAILABLE, f"this verify service is not serving: a pass has run for {self.stalled:.0f} s"))
            return None
        if health.wants_self_test:  # broken, not retrying: drafts rank a replica by its Info, so not this one now
            await serving.fail(context, SERVICE, "Info", RequestError(Refusal.UNAVAILABLE,
                                                                      f"this verify service is not serving: {health.broken}"))
            return None
        info = serving.model_info(self.lm, request.include_vocab, TESTED)
        info.capacity.CopyFrom(pb.Capacity(**self.engine.capacity.free()))
        if health.broken:  # retrying after a self-test: drafts rank it last (they rank by free sessions), so it gets
            info.capacity.free_sessions = 0  # sessions where no other replica has room, until a verdict makes it live
        info.max_tree_budget = MAX_ROUND_TOKENS
        return info

    async def _read(self, context):
        try:  # asyncio.timeout, not wait_for (which can lose a cancel on Python 3.11)
            async with asyncio.timeout(self.idle_timeout_s):
                return await context.read()
        except TimeoutError:
            raise RequestError(Refusal.DEADLINE_EXCEEDED, f"session idle for more than {self.idle_timeout_s:g}s; closed") from None

    async def _write(self, context, s, verdict: pb.VerifyResponse) -> None:
        """Writes a verdict, which the client must take within the idle timeout: one that stopped
        reading, its stream open, would otherwise hold its session (its cache and its room) for as
        long as it liked, while the scheduler steps its run ahead of it. The session is closed at
        once: the status that ends the call waits behind the verdicts the client has not taken."""
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                await context.write(verdict)
        except TimeoutError:
            self.engine.close(s)
            raise RequestError(Refusal.DEADLINE_EXCEEDED, f"the client took no verdict for {self.idle_timeout_s:g}s "
                               "(--idle-timeout-s); session closed") from None

    def _open(self, st: pb.SessionStart, header_id: str = ""):
        if st.vocab_fingerprint != self.lm.fingerprint:
            tok = self.lm.tokenizer
            raise RequestError(Refusal.FAILED_PRECONDITION, f"vocabulary fingerprint mismatch: draft {st.vocab_fingerprint[:12]!r}, "
                               f"target {self.lm.fingerprint[:12]!r} ({type(tok).__name__}, {len(tok)} tokens, {self.lm.vocab_size} output "
                               "rows; the draft service's start-up check, or Info with include_vocab, says what differs)")
        validation.check_request_id(st.request_id, "start.request_id")
        if not st.prompt_ids:
            raise invalid("start.prompt_ids: empty")
        if len(st.prompt_ids) >= self.lm.max_context:  # the cheap check first
            raise invalid(f"start.prompt_ids: {len(st.prompt_ids)} tokens leave no room in the context limit of {self.lm.max_context}")
        validation.check_ids(st.prompt_ids, self.lm.vocab_size, "start.prompt_ids")
        if not 1 <= st.max_new_tokens <= self.lm.max_context:
            raise invalid(f"start.max_new_tokens must be in [1, {self.lm.max_context}], got {st.max_new_tokens}")
        if st.proposal_mode not in pb.ProposalMode.values():
            raise invalid(f"start.proposal_mode: unknown value {st.proposal_mode}")
        if st.tree_budget > MAX_ROUND_TOKENS:
            raise invalid(f"start.tree_budget: {st.tree_budget} nodes; this verify service allows at most {MAX_ROUND_TOKENS} (Info.max_tree_budget)")
        sampling = validation.parse_sampling(st.sampling)
        seed = validation.parse_seed(st.sampling)
        return self.engine.open(list(st.prompt_ids), st.max_new_tokens, sampling, seed, st.proposal_mode or pb.PROPOSAL_MODE_SPARSE,
                                header_id or st.request_id,  # the header's, as the request observer logs it
                                tree_budget=st.tree_budget)

    async def _check_round(self, s, r: pb.Round):
        """The round's proposals as (token ids, q's entries on the host (RoundQ) or None), every wire
        rule checked; the scheduler moves all sessions' q to the device in one copy per pass. A round of many q values
        (dense q of a large vocabulary) is checked in a worker thread: its per-element checks would
        stall every other call on the event loop."""
        check = functools.partial(decode_round, r, expected=s.next_round, room=self.engine.room(s), vocab_size=self.lm.vocab_size,
                                  mode=s.mode, greedy=s.sampling.greedy)
        _, q = await asyncio.to_thread(check) if len(r.q_probs) > validation.LARGE_REQUEST else check()
        return r.tokens, q, decode_parents(r)

    async def Session(self, request_iterator, context):
        s = prefill = None
        try:
            first = await self._read(context)
            if first is grpc.aio.EOF:
                return
            if first.WhichOneof("kind") != "start":
                raise invalid("start: the first message of a session must be `start`")
            s = self._open(first.start, serving.request_id(context))
            # the prompt goes in while the draft prefills its own cache; a run sent right after the start
            # takes the queued prefill over, so its first step shares the prompt's last pass
            prefill = asyncio.ensure_future(self.engine.prefill(s))
            while not s.finish:
                req = await self._read(context)
                if req is grpc.aio.EOF:  # the draft ended it (a stop string the verifier does not see), or its deadline passed:
                    # grpc.aio ends the reads as if the draft had, a few ms before the deadline (it was counted OK)
                    remaining = context.time_remaining()
                    if remaining is not None and remaining <= observe.DEADLINE_SLACK_S:
                        raise asyncio.CancelledError  # observe.code_name: DEADLINE_EXCEEDED
                    return
                kind = req.WhichOneof("kind")
                if kind == "start":
                    raise invalid("start: a session is already open on this stream (one session per stream); send `round` messages")
                if kind != "round":
                    raise invalid("round: a message with neither `start` nor `round` set")
                tokens, q, parents = await self._check_round(s, req.round)
                if prefill.done():
                    prefill.result()  # raises if the prefill failed
                if not tokens and req.round.target_only_steps > 1:
                    await self._run(s, req.round, context)
                    continue
                await prefill
                v = await self.engine.step(s, tokens, q, parents)
                await self._write(context, s, self._verdict(s, req.round.round, v))
        except Exception as e:  # noqa: BLE001 - mapped to a status; CancelledError passes through
            await serving.fail(context, SERVICE, "Session", e)
        finally:
            if prefill is not None and not prefill.done():
                prefill.cancel()
            elif prefill is not None and not prefill.cancelled():
                prefill.exception()  # retrieved: a failed prefill was already reported, or the session ended first
            if s is not None:
                await self.engine.closed(s)  # its slot back now; where the cache is full, the call ends once its tokens are too

    def _open_sessions(self, s) -> int:
        """Sessions open at the verifier as `s`'s handler sees them: its own counted while it still
        writes verdicts after the scheduler closed it (a finished run's, whose reader is slow)."""
        return len(self.engine.sessions) + bool(s.closed)

    def _verdict(self, s, number: int, v, steps_left: int = 0) -> pb.VerifyResponse:
        return pb.VerifyResponse(
            round=number, num_accepted=v.num_accepted, next_token=v.next_token, finish_reason=edge.finish_reason(v.finish),
            forward_s=v.forward_s, queue_s=v.queue_s, seed=s.seed, row_cost_s=v.row_cost_s, row_price=v.row_price,
            steps_left=steps_left, target_only_s=self.engine.cost.target_only_s(self._open_sessions(s)), accepted_path=v.path or [],
            open_sessions=self._open_sessions(s))

    async def _run(self, s, r: pb.Round, context) -> None:
        """A run of target-only steps (Round.target_only_steps): the scheduler runs them back to
        back as it does Generate's (Scheduler.steps), numbered on from the round's; never past
        max_new_tokens (the session finishes there). While other sessions are open, a verdict
        answers up to Round.run_tokens_per_verdict steps (at most MAX_RUN_TOKENS_PER_VERDICT): the
        earlier steps' tokens in run_tokens, their forward seconds summed; fewer messages for the
        draft to relay where the verifier is shared, a verdict a step (no burst) where it is not.
        Every run's first step is answered on its own (one more verdict a run): a session that starts
        in a run gets its first token after its prefill, and one that comes back to a run its next
        token after a step, not after the steps that follow it."""
        limit = min(r.target_only_steps, s.max_new_tokens - s.generated)
        per = max(1, min(r.run_tokens_per_verdict, MAX_RUN_TOKENS_PER_VERDICT))
        done, held, forward_s = 0, [], 0.0
        async for v in self.engine.steps(s, limit):
            done += 1
            forward_s += v.forward_s
            left = 0 if v.finish else limit - done
            if left and done > 1 and len(held) + 1 < per and self._open_sessions(s) > 1:  # alone, a verdict a step (latency)
                held.append(v.next_token)
                continue
            out = self._verdict(s, r.round + done - 1, v, left)
            out.run_tokens.extend(held)
            out.forward_s = forward_s
            await self._write(context, s, out)
            held, forward_s = [], 0.0
        s.next_round += done

    async def Generate(self, request, context):
        """Target-only generation: rounds with no proposals (each yields the next token)."""
        t0 = time.perf_counter()
        s = None
        try:
            g = await validation.parse_generate_async(request, self.lm.tokenizer, self.lm.vocab_size, self.lm.max_context)
            g.request_id = serving.request_id(context, g.request_id)  # the header's, as the draft and the logs take it
            s = self.engine.open(g.prompt_ids, g.max_new_tokens, g.sampling, g.seed, pb.PROPOSAL_MODE_GREEDY, g.request_id)
            stats = pb.Stats(prompt_tokens=len(g.prompt_ids))
            out = Chunks(self.lm.tokenizer, g.stop, g.request_id, g.prompt_ids)
            t1 = time.perf_counter()
            async for v in self.engine.steps(s):  # the prefill, then no proposals: the next token only
                stats.verify_s += time.perf_counter() - t1
                stats.verify_forward_s += v.forward_s
                stats.rounds += 1
                chunk, finish = out.push([v.next_token] if v.next_token is not None else [], edge.finish_reason(v.finish))
                if finish:
                    stats.prefill_s = s.prefill_s
                    yield out.last(chunk, stats, g.seed, t0)
                    return
                if chunk:
                    yield chunk
                t1 = time.perf_counter()
        except Exception as e:  # noqa: BLE001
            await serving.fail(context, SERVICE, "Generate", e)
        finally:
            if s is not None:
                await self.engine.closed(s)
