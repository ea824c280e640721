"""The draft service's link to its verify replicas: a channel to each (draft_service/replicas.py
finds them and ranks them by free capacity), and `VerifyCheck`, which checks at start-up that the
verify service takes this draft (vocabulary, session token) and then keeps the draft's health in
step with its replicas: SERVING while one answers and takes it."""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2

from draft_service.replicas import Replicas
from specdec import auth, serving, tracing, vocabdiff
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

PROBE_INTERVAL_S = 2.0  # how often the draft checks that its verify service answers (its health)

log = logging.getLogger("specdec.draft")


def verify_channel(args, address: str, authority: str | None = None) -> grpc.aio.Channel:
    """A channel to one verify replica. `authority`: the name it was found under (a DNS name that
    resolved to `address`), which TLS checks the replica's certificate against."""
    opts = serving.link_options(args.max_message_bytes) + [
        # reconnect soon after a verify restart (gRPC's default backoff grows to 120 s)
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
    creds = serving.channel_credentials(args.verify_tls_ca, args.verify_tls_cert, args.verify_tls_key, flag="--verify-tls")
    interceptors = tracing.client_interceptors()  # traceparent on Verify.Session when --trace is on
    interceptors += auth.metadata_interceptors(getattr(args, "verify_token", None))  # the session token on every call to the verify service
    if creds:
        if authority:
            opts += [("grpc.ssl_target_name_override", authority), ("grpc.default_authority", authority)]
        return grpc.aio.secure_channel(address, creds, options=opts, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)


def replicas(args) -> Replicas:
    return Replicas(args.verify, lambda address, authority: verify_channel(args, address, authority), timeout_s=PROBE_INTERVAL_S)


async def pair(verify: pb_grpc.VerifyStub, lm, target: pb.ModelInfo) -> str | None:
    """Pairs the draft with the target: None if the target's vocabulary fingerprint is the draft's
    and its tokenizer's text rules too (where the verify service reports them); else one line
    saying what differs (asking the verify service for its whole vocabulary to compare). A
    target whose model has other output rows over the same tokenizer (its fingerprint is the
    draft tokenizer's with the target's rows: Qwen2.5's 0.5B and 7B) pairs too: the draft takes
    its fingerprint and sends q over its rows from then on (LM.peer_rows; Drafter.step); so does one
    whose tokenizer differs in its special tokens' roles only (specdec.vocabdiff.paired_fingerprint)."""

    fingerprint, how = vocabdiff.paired_fingerprint(target, lm.tokenizer, lm.vocab_size) if target.vocab_fingerprint != lm.fingerprint \
        else (lm.fingerprint, "same")
    if fingerprint is not None:
        own = vocabdiff.tokenizer_info(lm.tokenizer)
        if not vocabdiff.same_text_rules(target, own.text_rules):
            return vocabdiff.text_rules_differ(target, own)
        if how == "roles":
            differ = vocabdiff.explain(target, pb.ModelInfo(vocab_size=target.vocab_size, tokenizer=own))
            log.info("the target's tokenizer differs from the draft's in its special tokens' roles only (%s): paired", differ)
        rows = target.vocab_size if target.vocab_size and target.vocab_size != lm.vocab_size else 0
        if rows and lm.peer_rows != rows:
            log.info("the target's model has %d output rows over the draft's tokenizer, the draft %d: the draft's q goes "
                     "over the target's rows", target.vocab_size, lm.vocab_size)
        lm.peer_rows = rows  # a later target of the draft's own rows: none (a replica of other rows no longer holds it)
        lm.fingerprint = fingerprint  # from now on the draft speaks the target's vocabulary, its rows included
        return None
    try:
        target = await verify.Info(pb.InfoRequest(include_vocab=True), timeout=30)
    except grpc.aio.AioRpcError:
        pass  # explain from what the first answer said
    return (f"vocabulary fingerprint {target.vocab_fingerprint[:12]}, this draft has {lm.fingerprint[:12]}: the models do not "
            f"share a tokenizer ({vocabdiff.explain(target, serving.model_info(lm, include_vocab=True))})")


class VerifyCheck:
    """Whether the verify replicas answer and take this draft: their Info (reachable, same
    vocabulary) and an empty Verify.Session (the session token: UNAUTHENTICATED for a wrong one,
    PERMISSION_DENIED for a client token). At start-up a refusal stops the service; later the
    draft's health follows its replicas (SERVING while one answers and takes it), polled every
    PROBE_INTERVAL_S with the replicas' Info, which also carries their free capacity."""

    def __init__(self, args, replicas: Replicas, lm):
        self.args, self.replicas, self.lm = args, replicas, lm
        self.token_ok = False

    async def refusal(self, info, stub) -> str | None:
        """Why the verify service that answered Info with `info` cannot serve this draft, or None."""
        problem = await pair(stub, self.lm, info)
        if problem:
            return f"--verify {self.args.verify}: the verify service has {problem}"
        self._chat_templates(info)
        if not self.token_ok:
            call = stub.Session(metadata=[("x-request-id", "specdec-token-check")], timeout=max(1.0, self.args.verify_wait_s))
            try:
                await call.done_writing()  # no `start`: the verify service opens nothing
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # it already ended the call (a refusal): its status says why
            code = await call.code()
            await serving.release(call)
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return self.token_refused(code, await call.details())
            self.token_ok = code == grpc.StatusCode.OK
        return None

    def _chat_templates(self, info: pb.ModelInfo) -> None:
        """Warns (once per target template) where the draft's HTTP front door would render chats
        with a template other than the target's: its own tokenizer's, without --chat-template."""
        theirs = info.tokenizer.chat_template if info.HasField("tokenizer") else ""
        ours = vocabdiff.chat_template_digest(self.lm.tokenizer)
        if (getattr(self.args, "http_port", None) is None or getattr(self.args, "chat_template", None) or not theirs
                or theirs == ours or theirs == getattr(self, "_warned_template", None)):
            return
        self._warned_template = theirs
        log.warning("the target's chat template differs from the draft's%s: /v1/chat/completions renders chats with the "
                    "draft's, which the target may not have been tuned on; give --chat-template FILE with the target's",
                    "" if ours else " (the draft's tokenizer has none)", extra={"fields": {"verify": self.args.verify}})

    def token_refused(self, code, details: str) -> str:
        flag = "--verify-auth-token-file" + ("" if self.args.verify_auth_token_file else " (not given)")
        return f"{flag}: the verify service at {self.args.verify} refuses this draft's sessions: {code.name}: {details}"

    async def probe(self, servicer) -> str | None:
        """None if a verify replica answers and takes this draft, else why not. Polls every
        replica's Info; the pairing and token checks while the target is not yet known or the
        token not yet accepted."""
        await self.replicas.refresh()
        up = [r for r in self.replicas.ranked() if r.reachable]
        if not up:
            if (e := self.replicas.refusal()) is not None:  # it answers, and refuses this draft's token
                return self.token_refused(e.code(), e.details())
            known = list(self.replicas.replicas.values())
            why = "; ".join(f"{r.address}: {r.error.code().name}" for r in known if r.error is not None) or "none resolved"
            return f"no verify replica at {self.args.verify} answers ({why})"
        if servicer.target is None or not self.token_ok:
            why = await self.refusal(up[0].info, up[0].stub)
            if why:
                return why
            servicer.set_target(up[0].info)
        elif not any(r.reachable for r in servicer.serving_replicas()):
            # the replicas changed since (another tokenizer, a shorter context): every request would be refused
            return f"no verify replica at {self.args.verify} serves this draft's vocabulary, tokenizer and context"
        return None

    async def watch(self, servicer, set_health, serving_now: bool) -> None:
        """Runs while the service does: polls the replicas, sets the health they imply, and logs
        each new reason it is not serving (a draft that started before its verify service logged
        none after "not reachable yet": a token the verify service then refused went unsaid)."""
        said = None  # the reason last logged
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                why = await self.probe(servicer)
            except Exception as e:  # noqa: BLE001 - the watch must outlive any one probe
                log.exception("verify probe failed")
                why = f"the probe of the verify replicas failed: {type(e).__name__}: {e}"
            if (why is None) != serving_now:
                serving_now = why is None
                await set_health(health_pb2.HealthCheckResponse.SERVING if serving_now else health_pb2.HealthCheckResponse.NOT_SERVING)
                log.log(logging.INFO if serving_now else logging.WARNING, "verify service " + ("answers" if serving_now else "lost"),
                        extra={"fields": {"verify": self.args.verify, **({} if serving_now else {"reason": why})}})
                said = why
            elif why is not None and why != said:
                log.warning("verify service still not serving this draft", extra={"fields": {"verify": self.args.verify, "reason": why}})
                said = why
