"""Draft gRPC servicer: Info, and the client-facing Generate.

Per request: validate it, open one Verify.Session stream (the target's KV cache lives exactly as
long as it) on the verify replica with the most free capacity (draft_service/replicas.py), run
the decode loop (draft_service/decode.py) over it and stream the ids it commits to the client as
text chunks (specdec/textstream.py). A replica that refuses the session (RESOURCE_EXHAUSTED) or
cannot be reached (UNAVAILABLE) before its first verdict is passed over for the next one, within
the request's deadline; once a token has been streamed, an error ends the request.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from draft_service import calibrate
from draft_service.adaptive import RUN_TOKENS_PER_VERDICT
from draft_service.decode import DecodeLoop
from draft_service.drafter import Drafter
from draft_service.replicas import Replicas
from draft_service.upstream import pair
from specdec import edge, metrics, serving, validation, vocabdiff
from specdec.architectures import TESTED
from specdec.errors import Refusal, RequestError, invalid
from specdec.costmodel import Costs
from specdec.lm import LM
from specdec.textstream import Chunks
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

log = logging.getLogger("specdec.draft")
SERVICE = "draft"
# a session refused with these before its first verdict is opened on the next replica (nothing
# was streamed to the client yet, so nothing is repeated)
PLACE_AGAIN = (Refusal.RESOURCE_EXHAUSTED, Refusal.UNAVAILABLE)
CALIBRATION_RETRY_S = 60.0  # a failed calibration is tried again after this long
ADAPTIVE_MAX_TAU = 8  # the cap adaptive tau was measured with (bench/results/POLICY.md)
ENDED_WAIT_S = 1.0  # after a session's last verdict, how long the verify stream's own end is awaited before it is cancelled


CLIENT_WRITE_TIMEOUT_S = 60.0  # --client-write-timeout-s
MAX_SESSIONS = 256  # --max-sessions


class DraftServicer(pb_grpc.DraftServicer):
    def __init__(self, lm: LM, replicas: Replicas, target: pb.ModelInfo | None = None,
                 adaptive: bool = False, predraft: bool = False, costs: Costs | None = None,
                 proposer: int = pb.PROPOSER_DRAFT, draft_fallback: bool = False, goodput: bool = True,
                 round_timeout_s: float | None = None, run_tokens: int = RUN_TOKENS_PER_VERDICT,
                 calibration_retry_s: float = CALIBRATION_RETRY_S, client_write_timeout_s: float = CLIENT_WRITE_TIMEOUT_S,
                 max_sessions: int = MAX_SESSIONS, max_message_bytes: int = 16 << 20):
        self.lm = lm
        self.max_message_bytes = max_message_bytes  # --max-message-bytes: the largest round it can send
        self.max_sessions, self.sessions = max_sessions, 0  # requests streaming at once (gRPC and HTTP), and the limit
        self.client_write_timeout_s = client_write_timeout_s
        self.drafter = Drafter(lm)
        self.replicas = replicas
        self.target = None
        self.max_context, self.context_whose = lm.max_context, ""
        self.set_target(target)
        # what a request that leaves a field unset gets: the flags (validation applies them)
        self.defaults = validation.Defaults(proposer=proposer, adaptive=adaptive, predraft=predraft, adaptive_tau=ADAPTIVE_MAX_TAU)
        self.draft_fallback = draft_fallback  # stop drafting in sessions where the model does not pay (decode.py)
        self.goodput = goodput  # adaptive tau follows the verifier's load (decode.py, adaptive.py)
        self.round_timeout_s = round_timeout_s
        self.run_tokens = run_tokens  # a run's tokens a verdict (Round.run_tokens_per_verdict)
        self._costs, self._calibrating = costs, asyncio.Lock()
        self._pinned = self._measured = costs is not None  # --costs-ms; or calibrated (not the fallback)
        self._retry_at = 0.0  # after a failed calibration: when to try again
        self._first: asyncio.Task | None = None  # the first calibration, which the requests that need costs wait for
        self.calibration_retry_s = calibration_retry_s
        self._retry: asyncio.Task | None = None  # a calibration tried again in the background
        self._paired = target is not None  # checked at start-up; else at the first request

    def set_target(self, target: pb.ModelInfo | None) -> None:
        """The verify service's model, once known (at start-up, or when it first answers)."""
        if target is not None and self.target is None:
            self.target = target
            self.max_context = min(self.lm.max_context, target.max_context)
            if self.lm.max_context < target.max_context:  # refusals name the draft's limit, not "the context limit"
                self.context_whose = f" (the draft model's; the target's is {target.max_context})"

    async def costs(self) -> Costs:
        """The costs adaptive tau plans with: pinned (--costs-ms), else calibrated once, at the
        first call (the draft's step, and probe rounds with the verify service). If the rounds
        cannot be timed: conservative default costs and one warning (calibrate.fallback_costs),
        and another try a minute later, in the background: requests meanwhile plan with the
        default costs rather than wait for a verify service that may be slow to answer."""
        if self._costs is None:
            if self._first is None or self._first.done():  # none yet, or one that raised
                self._first = asyncio.ensure_future(self._calibrate())
                self._first.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: a waiter reports it
            # shielded: a request cancelled meanwhile (its client's deadline) leaves the calibration to the next ones
            await asyncio.shield(self._first)
        elif not self._measured and time.monotonic() >= self._retry_at and not self._calibrating.locked():
            self._retry_at = time.monotonic() + self.calibration_retry_s
            self._retry = asyncio.create_task(self._calibrate(again=True))
        return self._costs

    async def _calibrate(self, again: bool = False) -> None:
        async with self._calibrating:
            if self._costs is not None and not again:
                return  # another request's call calibrated meanwhile
            step = await asyncio.to_thread(calibrate.draft_step_seconds, self.drafter)
            try:
                base, per_token = await calibrate.verify_round_seconds(self._stub(), self.lm.fingerprint, self.lm.vocab_size,
                                                                       self.max_context, self.lm.eos)
                costs, msg = Costs(step, base, per_token), "calibrated"
            except (grpc.aio.AioRpcError, RuntimeError, RequestError) as e:  # RequestError: no replica known yet
                # a retry that fails keeps the fallback costs it had (DESIGN §3: they change once at most, when measured)
                costs = self._costs if again and self._costs is not None and not self._measured else calibrate.fallback_costs(step)
                msg = "calibration failed; using conservative default costs (pin them with --costs-ms)"
                err = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
            self._costs, self._measured = costs, msg == "calibrated"
            self._retry_at = time.monotonic() + self.calibration_retry_s
            fields = {"draft_step_ms": round(costs.draft_step * 1e3, 3), "verify_base_ms": round(costs.verify_base * 1e3, 3),
                      "verify_per_token_ms": round(costs.verify_per_token * 1e3, 3)}
            if msg == "calibrated":
                log.info(msg, extra={"fields": fields})
            else:
                log.warning(msg, extra={"fields": {**fields, "error": err}})

    async def check_pairing(self) -> None:
        """When the verify service was not reachable at start-up: compare fingerprints at the first
        request, so a refusal says what differs (the verify service refuses every session anyway)."""
        stub = self._stub()
        info = await stub.Info(pb.InfoRequest(), timeout=30)
        problem = await pair(stub, self.lm, info)
        if problem:
            log.error("the verify service's model does not pair with this draft", extra={"fields": {"reason": problem}})
            raise RequestError(Refusal.FAILED_PRECONDITION, problem)
        self.set_target(info)
        self._paired = True

    def _judge(self, g) -> bool:
        """Whether a session may fall back to target-only rounds (DraftJudge): not on the fallback
        costs of a failed calibration (they make a round look cheap), and not for a seeded sampled
        request unless the costs are pinned (its taus, and so its tokens, must repeat after a restart)."""
        return self.draft_fallback and self._measured and (g.sampling.greedy or not g.seeded or self._pinned)

    def serving_replicas(self, tree_budget: int = 0) -> list:
        """The verify replicas that serve this draft's sessions (its vocabulary, tokenizer and
        context; trees of tree_budget nodes), best first (Replicas.ranked)."""
        return self.replicas.ranked(self.lm.fingerprint, tree_budget, vocabdiff.text_rules(self.lm.tokenizer), self.max_context)

    def _stub(self) -> pb_grpc.VerifyStub:
        """A verify replica for a call that is not a session: the best one known."""
        best = self.replicas.best()
        if best is None:
            raise RequestError(Refusal.UNAVAILABLE, f"no verify replica is known at {self.replicas.target}")
        return best.stub

    async def Info(self, request, context):
        """The draft model's Info, but with what a request through the pair meets: the pair's
        context limit (the smaller one), the ids that end generation and the tree budget allowed
        (the target's, once known)."""
        info = serving.model_info(self.lm, request.include_vocab, TESTED)
        info.max_context = self.max_context
        if self.target is not None:
            info.eos_token_id = self.target.eos_token_id
            info.eos_token_ids[:] = self.target.eos_token_ids
            info.max_tree_budget = self.target.max_tree_budget  # what a request's tree_budget is checked against
        return info

    async def Generate(self, request, context):
        """Draft.Generate: `stream`'s chunks, each written to the client within
        client_write_timeout_s: a client that takes none for that long (it stopped reading, its
        connection open) is ended with DEADLINE_EXCEEDED, and its session's state with it."""
        async with contextlib.aclosing(self.stream(request, context)) as chunks:
            async for chunk in chunks:
                try:
                    async with asyncio.timeout(self.client_write_timeout_s):
                        await context.write(chunk)
                except TimeoutError:
                    await serving.fail(context, SERVICE, "Generate", RequestError(Refusal.DEADLINE_EXCEEDED, (
                        f"the client read nothing for {self.client_write_timeout_s:g} s (--client-write-timeout-s); request ended")))

    async def stream(self, request, context):
        """The chunks of one request (Generate writes them; the HTTP front door streams them too)."""
        t0 = time.perf_counter()
        call = None
        admitted = False
        metrics.LIVE_SESSIONS.labels(SERVICE).inc()
        try:
            if self.sessions >= self.max_sessions:  # before any work: the draft's cache and CPU are what the limit guards
                metrics.CAPACITY_REJECTIONS.labels("draft_sessions").inc()
                raise RequestError(Refusal.RESOURCE_EXHAUSTED, f"draft service is at its limit of {self.max_sessions} sessions "
                                   "(--max-sessions); retry later")
            self.sessions += 1
            admitted = True
            parse = lambda: validation.parse_generate_async(request, self.lm.tokenizer, self.lm.vocab_size,  # noqa: E731
                                                            self.max_context, self.defaults, self.context_whose)
            g = await parse()
            if not self._paired:
                await self.check_pairing()
                g = await parse()  # again: the pairing may have lowered the context to the target's
            g.request_id = serving.request_id(context, g.request_id)
            validation.check_dense_rounds(g, self.drafter.rows, self.max_message_bytes)  # in the target's rows, once paired
            if g.tree_budget > self.target.max_tree_budget:
                raise invalid(f"tree_budget: {g.tree_budget} nodes; the verify service allows at most {self.target.max_tree_budget}"
                              + (" (it has no tree speculation: send tree_budget 0)" if not self.target.max_tree_budget else ""))
            adaptive = g.adaptive
            costs = await self.costs() if adaptive or (self.draft_fallback and g.proposer != pb.PROPOSER_LOOKUP) else None
            replicas = self.serving_replicas(g.tree_budget)
            if not replicas:
                raise RequestError(Refusal.UNAVAILABLE, f"no verify replica is known at {self.replicas.target}" + (
                    f" that serves this draft's vocabulary, tokenizer and context{' and tree_budget ' + str(g.tree_budget) if g.tree_budget else ''}"
                    if self.replicas.replicas else ""))
            skip = None  # whether the model's record skips it: decided once per request, not per placement
            retryable = False  # whether a replica refused for now only (full, gone), not for good (too small for it)
            for i, replica in enumerate(replicas):
                loop = DecodeLoop(self.drafter, g, self.lm.fingerprint, self.max_context,
                                  costs=costs if adaptive else None, fallback=costs if self._judge(g) else None,
                                  predraft=g.predraft, goodput=self.goodput,
                                  round_timeout_s=self.round_timeout_s, skip=skip, run_tokens=self.run_tokens,
                                  pace=self.replicas.pace(replica))
                skip = loop.skipped
                out = Chunks(self.lm.tokenizer, g.stop, g.request_id, g.prompt_ids)
                started = False
                replica.open += 1
                try:
                    call = None
                    call = replica.stub.Session(metadata=[(serving.REQUEST_ID_KEY, g.request_id)], timeout=context.time_remaining())
                    async with contextlib.aclosing(loop.rounds(call)) as rounds:  # closing it stops a pre-draft
                        async for new, finish in rounds:
                            if not started:
                                loop.placed()
                            started = True
                            chunk, finish = out.push(new, finish)
                            if not finish:
                                if chunk:
                                    yield chunk
                                continue
                            yield out.last(chunk, loop.summary(), g.seed, t0)
                            await _ended(call)
                            return
                except Exception as e:  # noqa: BLE001 - a write on a call the replica ended fails otherwise than its status
                    _cancelled()
                    if isinstance(e, grpc.aio.UsageError):  # a closed channel (at the call, or at its first write where the
                        # channel has interceptors): the replica left the name (Replicas.refresh) after the ranking
                        e, call = RequestError(Refusal.UNAVAILABLE, f"verify replica {replica.address} is gone"), None
                    e = await serving.upstream_error(e, call)
                    code = edge.refusal(e.code()) if isinstance(e, grpc.aio.AioRpcError) else getattr(e, "kind", None)
                    retryable = retryable or getattr(e, "retry", True)
                    if started or i == len(replicas) - 1 or code not in PLACE_AGAIN:
                        if isinstance(e, RequestError) and not started:
                            e.retry = retryable  # "no retry" only where no replica may take it later
                        raise e from None
                    if getattr(e, "retry", True):
                        replica.refused()  # full or gone: rank it last until its next poll says otherwise
                    log.info("verify replica refused a session; trying another", extra={"fields": {
                        "request_id": g.request_id, "replica": replica.address, "code": code.name}})
                    if call is not None:
                        await serving.release(call)
                finally:
                    replica.open -= 1
        except Exception as e:  # noqa: BLE001 - mapped to a status; CancelledError passes through
            _cancelled()
            await serving.fail(context, SERVICE, "Generate", e, upstream=call)  # the verify call's status explains a failed write
        finally:
            self.sessions -= admitted
            metrics.LIVE_SESSIONS.labels(SERVICE).dec()
            if call is not None:
                await serving.release(call)  # frees the verifier's session at once
            # an ended RPC's exception stays referenced (gRPC keeps the last one) and its traceback holds
            # this frame: without this, the session's draft cache lived on until the service's next RPC
            loop = out = call = None  # noqa: F841


def _cancelled() -> None:
    """Raises CancelledError where this task is being cancelled (its caller left, or its deadline
    passed) whatever the exception that surfaced: on a channel with interceptors (the session
    token, tracing) grpc.aio turns a cancel during a write into InvalidStateError("RPC already
    finished"), which was logged with a traceback and counted as INTERNAL."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from None


async def _ended(call) -> None:
    """After a session's last verdict: half-closes the verify stream and waits (ENDED_WAIT_S at most)
    for the verifier's handler to end it, so the verifier logs and counts the session OK; the cancel
    that follows is then a no-op (one racing the handler's return ends the session CANCELLED)."""
    with contextlib.suppress(Exception):
        await call.done_writing()
        async with asyncio.timeout(ENDED_WAIT_S):  # not wait_for, which can lose a cancel on Python 3.11
            await call.code()
