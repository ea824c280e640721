"""The verify engine: target-model sessions (one KV cache each) and the worker thread that owns
the target model.

A session's committed sequence is `ids` (prompt + generated). Its cache always holds ids[:-1]:
the last committed token is "pending" and is the first input of the next forward pass. A round
with proposals x_1..x_tau therefore runs ONE forward over [pending, x_1..x_tau] (tau+1 logits:
one per proposal plus the bonus position), applies the acceptance rule, appends the accepted
prefix and the next token, and crops the cache back to len(ids) - 1.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from specdec import metrics
from specdec.acceptance import accept
from specdec.errors import RequestError, invalid
from specdec.lm import LM, crop
from specdec.sampling import Sampling, probs_from_logits
from specdec.v1 import specdec_pb2 as pb

log = logging.getLogger("specdec.verify")

MAX_ROUND_TOKENS = 64  # proposals per round the verifier accepts
PROB_TOL = 1e-3  # how far a row of q may sum from 1


@dataclass
class Session:
    sid: int
    request_id: str
    ids: list[int]
    prompt_len: int
    max_new_tokens: int
    sampling: Sampling
    mode: int
    seed: int
    generator: torch.Generator
    reserved: int
    cache: object = None
    next_round: int = 1
    finish: int = pb.FINISH_REASON_UNSPECIFIED
    closed: bool = False
    last_active: float = field(default_factory=time.monotonic)

    @property
    def generated(self) -> int:
        return len(self.ids) - self.prompt_len


@dataclass
class Verdict:
    num_accepted: int
    next_token: int | None
    finish: int
    forward_s: float = 0.0
    queue_s: float = 0.0


@dataclass
class _Job:
    fn: object
    args: tuple
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.perf_counter)


class Engine:
    def __init__(self, lm: LM, max_sessions: int = 64, max_cached_tokens: int | None = None):
        self.lm = lm
        self.max_sessions = max_sessions
        self.max_cached_tokens = max_cached_tokens or max_sessions * lm.max_context
        self.sessions: dict[int, Session] = {}
        self.reserved = 0
        self._next_sid = 1
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="verify-worker", daemon=True)
        self._worker.start()

    # ---- admission --------------------------------------------------------------------------

    def open(self, start: pb.SessionStart, sampling: Sampling, seed: int, mode: int) -> Session:
        """Admits a session (validation of `start` is the caller's); reserves its cache room."""
        need = min(len(start.prompt_ids) + start.max_new_tokens, self.lm.max_context)
        with self._lock:
            if len(self.sessions) >= self.max_sessions:
                metrics.CAPACITY_REJECTIONS.labels("sessions").inc()
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"verify service is at its limit of {self.max_sessions} sessions; retry later")
            if self.reserved + need > self.max_cached_tokens:
                metrics.CAPACITY_REJECTIONS.labels("cached_tokens").inc()
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"verify service cache is full ({self.reserved}/{self.max_cached_tokens} tokens reserved, {need} asked); retry later")
            sid, self._next_sid = self._next_sid, self._next_sid + 1
            s = Session(
                sid=sid,
                request_id=start.request_id,
                ids=list(start.prompt_ids),
                prompt_len=len(start.prompt_ids),
                max_new_tokens=start.max_new_tokens,
                sampling=sampling,
                mode=mode,
                seed=seed,
                generator=torch.Generator().manual_seed(seed),
                reserved=need,
                cache=self.lm.new_cache(),
            )
            self.sessions[sid] = s
            self.reserved += need
        metrics.LIVE_SESSIONS.labels("verify").set(len(self.sessions))
        metrics.RESERVED_TOKENS.set(self.reserved)
        return s

    def close(self, s: Session) -> None:
        with self._lock:
            if s.closed:
                return
            s.closed = True
            del self.sessions[s.sid]
            self.reserved -= s.reserved
            s.cache = None  # a job still running holds its own reference until it returns
        metrics.LIVE_SESSIONS.labels("verify").set(len(self.sessions))
        metrics.RESERVED_TOKENS.set(self.reserved)
        metrics.CACHED_TOKENS.set(self.cached_tokens())

    def cached_tokens(self) -> int:
        return sum(max(len(s.ids) - 1, 0) for s in list(self.sessions.values()))

    # ---- rounds -----------------------------------------------------------------------------

    def parse_round(self, s: Session, r: pb.Round) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Validates one Round against the session; returns (tokens [tau], q [tau, V] or None)."""
        V = self.lm.vocab_size
        if r.round != s.next_round:
            raise invalid(f"round: expected {s.next_round}, got {r.round} (out of order or repeated)")
        tau = len(r.tokens)
        room = self.lm.max_context - len(s.ids)
        if tau > min(MAX_ROUND_TOKENS, room):
            raise invalid(f"round.tokens: {tau} proposals; at most {min(MAX_ROUND_TOKENS, room)} fit")
        bad = [t for t in r.tokens if not 0 <= t < V]
        if bad:
            raise invalid(f"round.tokens: token id {bad[0]} is outside the vocabulary [0, {V})")
        tokens = torch.tensor(list(r.tokens), dtype=torch.long)
        if s.sampling.greedy:
            return tokens, None  # q plays no part in the greedy rule
        if s.mode == pb.PROPOSAL_MODE_GREEDY:
            if r.q_ids or r.q_probs or r.q_counts:
                raise invalid("round.q_*: greedy (ids-only) mode sends no probabilities")
            return tokens, torch.nn.functional.one_hot(tokens, V).float()
        probs = torch.tensor(list(r.q_probs), dtype=torch.float32)
        if s.mode == pb.PROPOSAL_MODE_DENSE:
            if r.q_ids or r.q_counts or probs.numel() != tau * V:
                raise invalid(f"round.q_probs: dense mode needs tau*V = {tau * V} values and no q_ids/q_counts, got {probs.numel()}")
            q = probs.view(tau, V)
        else:
            if len(r.q_counts) != tau or sum(r.q_counts) != len(r.q_ids) or len(r.q_ids) != probs.numel():
                raise invalid("round.q_counts/q_ids/q_probs: lengths disagree (one count per token, one prob per id)")
            ids = torch.tensor(list(r.q_ids), dtype=torch.long)
            if ids.numel() and (ids.min() < 0 or ids.max() >= V):
                raise invalid(f"round.q_ids: an id is outside the vocabulary [0, {V})")
            rows = torch.repeat_interleave(torch.arange(tau), torch.tensor(list(r.q_counts), dtype=torch.long))
            q = torch.zeros(tau, V)
            q.index_put_((rows, ids), probs)
            if torch.unique(rows * V + ids).numel() != ids.numel():
                raise invalid("round.q_ids: an id repeats within one position")
        if not torch.isfinite(probs).all() or (probs < 0).any() or (probs > 1 + PROB_TOL).any():
            raise invalid("round.q_probs: probabilities must be finite and in [0, 1]")
        sums = q.sum(-1)
        if tau and ((sums - 1).abs() > PROB_TOL).any():
            raise invalid(f"round.q_probs: each position must sum to 1 (got {sums.tolist()})")
        return tokens, q

    async def prefill(self, s: Session) -> float:
        """Puts prompt[:-1] into the session's cache; returns the seconds it took."""
        return await self._submit(self._prefill, s)

    async def step(self, s: Session, tokens: torch.Tensor, q: torch.Tensor | None) -> Verdict:
        """One round: forward over [pending, tokens], acceptance, commit."""
        s.next_round += 1
        s.last_active = time.monotonic()
        return await self._submit(self._step, s, tokens, q)

    def _prefill(self, s: Session) -> float:
        t0 = time.perf_counter()
        if len(s.ids) > 1:
            self.lm.forward(s.ids[:-1], s.cache, last_only=True)
        return time.perf_counter() - t0

    def _step(self, s: Session, tokens: torch.Tensor, q: torch.Tensor | None) -> Verdict:
        t0 = time.perf_counter()
        logits = self.lm.forward([s.ids[-1]] + tokens.tolist(), s.cache)  # [tau+1, V]
        p = probs_from_logits(logits, s.sampling)  # [tau+1, V]
        n, nxt = accept(p, tokens, q, s.generator)
        v = self._commit(s, tokens[:n].tolist() + [nxt], n)
        v.forward_s = time.perf_counter() - t0
        metrics.BATCH_SIZE.observe(1)
        metrics.BATCH_TOKENS.observe(len(tokens) + 1)
        metrics.FORWARD_TIME.observe(v.forward_s)
        return v

    def _commit(self, s: Session, new: list[int], n: int) -> Verdict:
        """Appends new tokens up to the first end condition; crops the cache to len(ids) - 1."""
        out: list[int] = []
        finish = pb.FINISH_REASON_UNSPECIFIED
        for t in new:
            out.append(t)
            if t == self.lm.eos_token_id:
                finish = pb.FINISH_REASON_EOS
            elif s.generated + len(out) >= s.max_new_tokens:
                finish = pb.FINISH_REASON_LENGTH
            elif len(s.ids) + len(out) >= self.lm.max_context:
                finish = pb.FINISH_REASON_CONTEXT
            if finish:
                break
        s.ids.extend(out)
        s.finish = finish
        if s.cache is not None:
            crop(s.cache, len(s.ids) - 1)
        return Verdict(num_accepted=min(n, len(out)), next_token=out[n] if len(out) > n else None, finish=finish)

    # ---- worker -----------------------------------------------------------------------------

    async def _submit(self, fn, *args):
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop.create_future(), loop)
        self._queue.put(job)
        return await job.future

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            wait = time.perf_counter() - job.enqueued
            metrics.QUEUE_WAIT.observe(wait)
            session = job.args[0]
            try:
                if session.closed:
                    raise RequestError(grpc.StatusCode.CANCELLED, "session closed")
                result = job.fn(*job.args)
                if isinstance(result, Verdict):
                    result.queue_s = wait
                ok = True
            except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
                result, ok = e, False
            metrics.CACHED_TOKENS.set(self.cached_tokens())
            job.loop.call_soon_threadsafe(_resolve, job.future, ok, result)

    def shutdown(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=5)


def _resolve(fut: asyncio.Future, ok: bool, result) -> None:
    if fut.done():  # the awaiting stream was cancelled meanwhile
        return
    if ok:
        fut.set_result(result)
    else:
        fut.set_exception(result)
