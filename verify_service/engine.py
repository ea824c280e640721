"""The verify engine: target-model sessions (one KV cache each) and the scheduler thread that
owns the target model.

A session's committed sequence is `ids` (prompt + generated). Its cache always holds ids[:-1]:
the last committed token is "pending" and is the first input of the next forward pass. A round
with proposals x_1..x_tau therefore runs ONE forward over [pending, x_1..x_tau] (tau+1 logits:
one per proposal plus the bonus position), applies the acceptance rule, appends the accepted
prefix and the next token, and crops the cache back to len(ids) - 1.

Scheduling: the worker thread takes every round waiting across sessions and verifies them in ONE
batched forward pass (specdec/batching.py; each session keeps its own cache and its own
sampling settings and generator). Prompts are prefilled in chunks of PREFILL_CHUNK tokens, one
chunk per scheduler iteration beside the round batch, so a long prompt does not stall the
sessions already decoding. Chunk boundaries depend only on the prompt, so a session's numbers do
not depend on what else is running.
"""
from __future__ import annotations

import asyncio
import collections
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
from specdec.lm import LM
from specdec.sampling import Sampling, probs_from_logits
from specdec.v1 import specdec_pb2 as pb
from specdec.batching import forward_batch, kv_crop, kv_len, use_isolated_attention

log = logging.getLogger("specdec.verify")

MAX_ROUND_TOKENS = 64  # proposals per round the verifier accepts
PREFILL_CHUNK = 256  # prompt tokens per prefill pass
MAX_BATCH_TOKENS = 1024  # new tokens per batched verification pass
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
    kv: list = field(default_factory=list)  # per layer (K, V) [1, H, len(ids) - 1, D]
    next_round: int = 1
    finish: int = pb.FINISH_REASON_UNSPECIFIED
    closed: bool = False

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


def kv_bytes_per_token(config) -> int:
    """Bytes one cached token costs: K and V, every layer, float32."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * 4


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def default_cache_budget(lm: LM, max_sessions: int, memory_fraction: float = 0.5) -> int:
    """Tokens all sessions may reserve: room for every session at full context, capped by half of
    the memory available at start-up (a batched pass briefly holds a second copy of the caches)."""
    full = max_sessions * lm.max_context
    mem = available_memory_bytes()
    if mem is None:
        return full
    return max(lm.max_context, min(full, int(mem * memory_fraction / 2 / kv_bytes_per_token(lm.model.config))))


@dataclass
class _Job:
    session: Session
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    tokens: torch.Tensor | None = None  # a round: [tau] proposals; None: a prefill
    q: torch.Tensor | None = None  # [tau, V] or None (greedy)
    enqueued: float = field(default_factory=time.perf_counter)

    def resolve(self, ok: bool, result) -> None:
        self.loop.call_soon_threadsafe(_resolve, self.future, ok, result)


class Engine:
    def __init__(self, lm: LM, max_sessions: int = 64, max_cached_tokens: int | None = None):
        self.lm = lm
        use_isolated_attention(lm.model)
        self.max_sessions = max_sessions
        self.max_cached_tokens = max_cached_tokens or default_cache_budget(lm, max_sessions)
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
            s.kv = []  # a pass in flight holds its own references until it returns
        metrics.LIVE_SESSIONS.labels("verify").set(len(self.sessions))
        metrics.RESERVED_TOKENS.set(self.reserved)
        metrics.CACHED_TOKENS.set(self.cached_tokens())

    def cached_tokens(self) -> int:
        return sum(kv_len(s.kv) for s in list(self.sessions.values()))

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
        t0 = time.perf_counter()
        if len(s.ids) > 1:
            await self._submit(s)
        return time.perf_counter() - t0

    async def step(self, s: Session, tokens: torch.Tensor, q: torch.Tensor | None) -> Verdict:
        """One round: forward over [pending, tokens] (batched with other sessions), acceptance, commit."""
        s.next_round += 1
        return await self._submit(s, tokens, q)

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
        s.kv = kv_crop(s.kv, len(s.ids) - 1)
        return Verdict(num_accepted=min(n, len(out)), next_token=out[n] if len(out) > n else None, finish=finish)

    # ---- scheduler -------------------------------------------------------------------------

    async def _submit(self, s: Session, tokens=None, q=None):
        loop = asyncio.get_running_loop()
        job = _Job(s, loop.create_future(), loop, tokens, q)
        self._queue.put(job)
        return await job.future

    def _work(self) -> None:
        rounds: list[_Job] = []
        prefills: collections.deque[_Job] = collections.deque()
        while True:
            job = self._queue.get() if not rounds and not prefills else None  # idle: block
            while True:
                if job is None:
                    try:
                        job = self._queue.get_nowait()
                    except queue.Empty:
                        break
                if job is _STOP:
                    return
                if job.session.closed:
                    job.resolve(False, RequestError(grpc.StatusCode.CANCELLED, "session closed"))
                else:
                    (prefills if job.tokens is None else rounds).append(job)
                job = None
            if rounds:
                batch, used = [], 0
                while rounds and (not batch or used + len(rounds[0].tokens) + 1 <= MAX_BATCH_TOKENS):
                    used += len(rounds[0].tokens) + 1
                    batch.append(rounds.pop(0))
                self._verify(batch)
            if prefills and self._prefill_chunk(prefills[0]):
                prefills.popleft()
            metrics.CACHED_TOKENS.set(self.cached_tokens())

    def _prefill_chunk(self, job: _Job) -> bool:
        """Advances a prefill by one chunk; True once the job is resolved."""
        s = job.session
        done, goal = kv_len(s.kv), len(s.ids) - 1
        try:
            if s.closed:
                raise RequestError(grpc.StatusCode.CANCELLED, "session closed")
            chunk = s.ids[done : min(goal, done - done % PREFILL_CHUNK + PREFILL_CHUNK)]  # boundaries fixed by position
            _, (kv,) = forward_batch(self.lm.model, [chunk], [s.kv], logits=False)
            s.kv = kv
            if kv_len(kv) < goal:
                return False
            job.resolve(True, None)
        except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
            job.resolve(False, e)
        return True

    def _verify(self, batch: list[_Job]) -> None:
        t0 = time.perf_counter()
        live = [j for j in batch if not j.session.closed]
        for j in batch:
            if j.session.closed:
                j.resolve(False, RequestError(grpc.StatusCode.CANCELLED, "session closed"))
        if not live:
            return
        try:
            logits, kvs = forward_batch(self.lm.model, [[j.session.ids[-1]] + j.tokens.tolist() for j in live], [j.session.kv for j in live])
        except Exception as e:  # noqa: BLE001
            for j in live:
                j.resolve(False, e)
            return
        forward_s = time.perf_counter() - t0
        metrics.BATCH_SIZE.observe(len(live))
        metrics.BATCH_TOKENS.observe(sum(len(j.tokens) + 1 for j in live))
        metrics.FORWARD_TIME.observe(forward_s)
        for j in batch:
            metrics.QUEUE_WAIT.observe(t0 - j.enqueued)
        for j, lg, kv in zip(live, logits, kvs):
            s = j.session
            try:
                s.kv = kv
                p = probs_from_logits(lg, s.sampling)  # [tau+1, V]
                n, nxt = accept(p, j.tokens, j.q, s.generator)
                v = self._commit(s, j.tokens[:n].tolist() + [nxt], n)
                v.forward_s, v.queue_s = forward_s, t0 - j.enqueued
                j.resolve(True, v)
            except Exception as e:  # noqa: BLE001
                j.resolve(False, e)

    def shutdown(self) -> None:
        self._queue.put(_STOP)
        self._worker.join(timeout=5)


_STOP = object()


def _resolve(fut: asyncio.Future, ok: bool, result) -> None:
    if fut.done():  # the awaiting stream was cancelled meanwhile
        return
    if ok:
        fut.set_result(result)
    else:
        fut.set_exception(result)
