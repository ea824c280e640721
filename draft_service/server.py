"""Draft gRPC servicer: the client-facing Generate and the speculative decode loop.

Per request: open one Verify.Session stream (the target's KV cache lives exactly as long as
it), send the prompt, then per round propose tau tokens (draft model or prompt lookup), send
them with their q, read the verdict, commit accepted + next token, stream ids and text to the
client. With pre-drafting, round k+1 is drafted while round k is being verified.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from draft_service.adaptive import TauController
from draft_service.drafter import Drafter, DraftState, PredraftControl, Proposal
from specdec import metrics, requests, serving
from specdec.errors import RequestError
from specdec.lm import LM
from specdec.textstream import Chunks
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

log = logging.getLogger("specdec.draft")
SERVICE = "draft"
HYBRID_MIN_NGRAM = 2  # hybrid mode trusts prompt lookup from a 2-gram match up


class DraftServicer(pb_grpc.DraftServicer):
    def __init__(self, lm: LM, verify: pb_grpc.VerifyStub, target: pb.ModelInfo | None = None,
                 adaptive: bool = False, predraft: bool = False):
        self.lm = lm
        self.drafter = Drafter(lm)
        self.verify = verify
        self.max_context = min(lm.max_context, target.max_context) if target else lm.max_context
        self.adaptive, self.predraft = adaptive, predraft

    async def Info(self, request, context):
        return serving.model_info(self.lm)

    def _cap(self, st: DraftState, extra: int = 0) -> int:
        """Most proposals a round may carry once `extra` more tokens are committed: never more
        than the tokens still allowed minus the verifier's next token, nor past the context."""
        left = st.params.max_new_tokens - (len(st.ids) + extra - st.prompt_len)
        return max(0, min(left - 1, self.max_context - len(st.ids) - extra))

    def _propose(self, st: DraftState, tau: int) -> Proposal:
        mode = st.params.proposer
        if mode in (pb.PROPOSER_LOOKUP, pb.PROPOSER_HYBRID):
            prop = self.drafter.lookup(st, tau, min_ngram=1 if mode == pb.PROPOSER_LOOKUP else HYBRID_MIN_NGRAM)
            if prop.tokens or mode == pb.PROPOSER_LOOKUP:
                return prop
        return self.drafter.propose(st, tau)

    async def Generate(self, request, context):
        t0 = time.perf_counter()
        call = None
        pending = None  # a pre-draft in flight: (task, stop event)
        metrics.LIVE_SESSIONS.labels(SERVICE).inc()
        try:
            g = requests.parse_generate(request, self.lm.tokenizer, self.lm.vocab_size, self.max_context)
            g.request_id = serving.request_id(context, g.request_id)
            adaptive = self.adaptive if g.adaptive is None else g.adaptive
            predraft = (self.predraft if g.predraft is None else g.predraft) and g.proposer != pb.PROPOSER_LOOKUP
            st = self.drafter.new_state(g)
            ctl = TauController(max_tau=g.tau)
            call = self.verify.Session(metadata=[(serving.REQUEST_ID_KEY, g.request_id)], timeout=context.time_remaining())
            sampling = pb.SamplingParams(temperature=g.sampling.temperature, top_k=g.sampling.top_k, top_p=g.sampling.top_p, seed=g.seed)
            await call.write(pb.VerifyRequest(start=pb.SessionStart(
                prompt_ids=g.prompt_ids, max_new_tokens=g.max_new_tokens, sampling=sampling,
                proposal_mode=g.mode, vocab_fingerprint=self.lm.fingerprint, request_id=g.request_id)))
            stats = pb.Stats(prompt_tokens=len(g.prompt_ids), accepted_per_position=[0] * g.tau)
            t1 = time.perf_counter()
            await asyncio.to_thread(self.drafter.prefill, st)  # the verifier prefills meanwhile
            stats.prefill_s = time.perf_counter() - t1
            out = Chunks(self.lm.tokenizer, g.stop, g.request_id)
            prop = None
            while True:
                tau = ctl.choose(pipelined=predraft) if adaptive else g.tau
                t1 = time.perf_counter()
                if prop is None:
                    prop = await asyncio.to_thread(self._propose, st, min(tau, self._cap(st)))
                t2 = time.perf_counter()
                stats.rounds += 1
                await call.write(pb.VerifyRequest(round=prop.to_round(stats.rounds)))
                next_cap = min(tau, self._cap(st, len(prop.tokens) + 1))
                if predraft and not prop.lookup and next_cap > 0:
                    ctl_ahead = PredraftControl()
                    pending = (asyncio.create_task(asyncio.to_thread(self.drafter.predraft, st, prop, next_cap, ctl_ahead)), ctl_ahead)
                v = await call.read()
                if v is grpc.aio.EOF:
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, "verify service ended the session without a verdict")
                t3 = time.perf_counter()
                stats.draft_s += t2 - t1
                stats.verify_s += t3 - t2
                stats.verify_forward_s += v.forward_s
                stats.lookup_rounds += prop.lookup
                n = v.num_accepted
                new = prop.tokens[:n] + ([v.next_token] if v.HasField("next_token") else [])
                sent, prop = prop, None
                if pending is not None:  # keep the pre-draft only if its assumed context came true
                    task, ahead_ctl = pending
                    if n < len(sent.tokens) or not v.HasField("next_token"):
                        ahead_ctl.reject()
                    else:
                        ahead_ctl.bonus(v.next_token)
                    ahead = await task  # the thread owns the draft cache until it returns
                    pending = None
                    if not ahead_ctl.is_set() and ahead.tokens:
                        prop = ahead
                        stats.predraft_hits += 1
                    else:
                        stats.predraft_misses += 1
                st.ids.extend(new)
                ctl.observe(len(sent.tokens), n, t2 - t1, t3 - t2)
                self._count(stats, len(sent.tokens), n)
                chunk, finish = out.push(new, v.finish_reason)
                if not finish:
                    if chunk:
                        yield chunk
                    continue
                stats.acceptance_rate = stats.accepted / stats.drafted if stats.drafted else 0.0
                stats.mean_accepted_length = stats.accepted / stats.rounds
                yield out.last(chunk, stats, g.seed, t0)
                return
        except Exception as e:  # noqa: BLE001 - mapped to a status; CancelledError passes through
            await serving.fail(context, SERVICE, "Generate", e, upstream=call)  # the verify call's status explains a failed write
        finally:
            metrics.LIVE_SESSIONS.labels(SERVICE).dec()
            if pending is not None:
                pending[1].reject()  # the thread stops after its current step
            if call is not None:
                call.cancel()  # frees the verifier's session at once (no-op if already done)

    @staticmethod
    def _count(stats: pb.Stats, drafted: int, accepted: int) -> None:
        stats.drafted += drafted
        stats.accepted += accepted
        for i in range(accepted):
            stats.accepted_per_position[i] += 1
        metrics.NUM_DRAFTS.inc()
        metrics.NUM_DRAFT_TOKENS.inc(drafted)
        metrics.NUM_ACCEPTED.inc(accepted)
        for i in range(accepted):
            metrics.ACCEPTED_PER_POS.labels(str(i)).inc()
