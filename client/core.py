"""specdec client library: sync and asyncio, streaming chunks or one-shot results.

Needs grpcio and protobuf only. Point it at a draft service for speculative generation, or at
a verify service with target_only=True for target-only generation. `retries` > 0 turns on
gRPC's own retry policy for Generate: a call refused with UNAVAILABLE or RESOURCE_EXHAUSTED
before its first token is tried again (at most 4 retries, gRPC's cap), after an exponential
backoff or, when the server says when (`grpc-retry-pushback-ms`, sent beside `retry-after-ms`),
after that (a pushback of -1, for a request larger than the verifier's whole cache, means no
retry); gRPC never retries a call once a response has arrived, so no token is streamed
twice. With `fallback` set to a verify address, a request the draft service still cannot take
(UNAVAILABLE before any token) is then served target-only there: same output distribution, no
speed-up; `timeout` bounds the whole request, the fallback's attempt included. `token` is sent as
`authorization: Bearer <token>` to the server, and to the fallback too unless `fallback_token`
is given. TLS is on where `tls_ca` (the server's CA) or the client's `tls_cert` and `tls_key`
(mTLS, with gRPC's default roots where no `tls_ca`: not the system's trust store; give a private
CA as `tls_ca`) are given. Credentials are checked when the client is made: a file that is not
what its flag says, a certificate and key that are not one pair, or a token a header cannot carry
is a StartupError naming the flag."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import numbers
import operator
import struct
import time
from dataclasses import dataclass, field

import grpc
from google.protobuf.json_format import MessageToDict

from specdec.files import check_ca, check_pair, check_token, read_pem, read_token
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

MODES = {"greedy": pb.PROPOSAL_MODE_GREEDY, "sparse": pb.PROPOSAL_MODE_SPARSE, "dense": pb.PROPOSAL_MODE_DENSE}
PROPOSERS = {"draft": pb.PROPOSER_DRAFT, "lookup": pb.PROPOSER_LOOKUP, "hybrid": pb.PROPOSER_HYBRID}
FALLBACK_ON = (grpc.StatusCode.UNAVAILABLE,)
MAX_ATTEMPTS = 5  # gRPC's own cap on a retry policy's attempts
MAX_RETRIES = MAX_ATTEMPTS - 1
MAX_TIMEOUT_S = 1e9  # gRPC's deadline arithmetic overflows past about 1e10 s (an instant DEADLINE_EXCEEDED); beyond this, no deadline


class StreamError(grpc.RpcError):
    """An error the client finds itself, with gRPC's error methods: a Generate stream that ended
    without its final chunk (the one with a finish_reason) or went on after it (INTERNAL, like the
    errors the services send), or a call cut by the client's own close() (CANCELLED)."""

    def __init__(self, details: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL):
        super().__init__(details)
        self._details, self._code = details, code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> tuple:
        return ()

    def trailing_metadata(self) -> tuple:  # no retry-after-ms: the server sent no status
        return ()

    def debug_error_string(self) -> str:
        return self._details


NO_RESPONSE = "the stream ended with no response"
NO_FINISH = "the stream ended before its final chunk (no finish_reason)"
AFTER_FINISH = "the stream went on after its final chunk (the one with a finish_reason)"
CLOSED = "the client was closed during the call"
log = logging.getLogger("specdec.client")


def check_timeout(timeout: float | None) -> float | None:
    """The request timeout in seconds: > 0; inf, or more than MAX_TIMEOUT_S, is none (None).
    ValueError otherwise (0, negative or NaN failed at once as DEADLINE_EXCEEDED)."""
    if timeout is None:
        return None
    if not timeout > 0:  # NaN too
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    return None if timeout > MAX_TIMEOUT_S or math.isinf(timeout) else float(timeout)


def check_retries(retries: int) -> int:
    """Retries before a request's first token: an int in 0..MAX_RETRIES (gRPC's own cap); ValueError
    otherwise (a fraction made a service config gRPC refuses on every call)."""
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        raise ValueError(f"retries must be an integer in [0, {MAX_RETRIES}] (gRPC's cap), got {retries!r}")
    return retries


def _request(request: pb.GenerateRequest | None, params: dict) -> pb.GenerateRequest:
    """The request to send: `request`, or one made from `params` (make_request); not both."""
    if request is not None and params:
        raise TypeError(f"give a request or its parameters, not both (got {', '.join(sorted(params))} beside a request)")
    return request if request is not None else make_request(**params)


def _finished(chunk) -> bool:
    return chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED


def retry_service_config(retries: int) -> str:
    """gRPC service config: Generate on both services retried `retries` times (1..4) on
    UNAVAILABLE and RESOURCE_EXHAUSTED, before any response (gRPC's rule)."""
    return json.dumps({"methodConfig": [{
        "name": [{"service": "specdec.v1.Draft", "method": "Generate"}, {"service": "specdec.v1.Verify", "method": "Generate"}],
        "retryPolicy": {"maxAttempts": retries + 1, "initialBackoff": "0.1s", "maxBackoff": "2s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]}}]})


UINT32_FIELDS = ("max_new_tokens", "top_k", "num_draft_tokens", "sparse_k", "tree_budget")


def _float32(x: float) -> float:
    """x as a float32 field carries it (inf past its range)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def field_error(values: dict, name=lambda field: field) -> str | None:
    """Why one of `values` (GenerateRequest fields by name) cannot go in its field: the proto's
    unsigned and 32-bit integers, stop strings that are strings, and text that is UTF-8 (a command
    line's undecodable bytes arrive as surrogates). None if all can. `name` names a field in the
    message (the CLI: its flag)."""
    def integer(value, end) -> bool:  # ints, and what stands for one (numpy's, a 0-d tensor): protobuf takes those
        try:
            return not isinstance(value, bool) and 0 <= operator.index(value) < end
        except TypeError:
            return False

    for f in UINT32_FIELDS:  # what the field can carry; the server's own limits (max_new_tokens >= 1, its context) are its to say
        if f in values and not integer(values[f], 1 << 32):
            return f"{name(f)} must be an integer in [0, {(1 << 32) - 1}], got {values[f]!r}"
    if values.get("seed") is not None and not integer(values["seed"], 1 << 64):
        return f"{name('seed')} must be an integer in [0, {(1 << 64) - 1}], got {values['seed']!r}"
    if any(not integer(i, 1 << 31) for i in (() if values.get("prompt_ids") is None else values["prompt_ids"])):
        return f"{name('prompt_ids')}: token ids are integers in [0, {(1 << 31) - 1}]"
    # float32 fields: a value so small it arrives as 0 would be read as greedy (temperature) or unset (top_p: 1) by the
    # server, which cannot tell; what arrives as itself the server checks (specdec/validation.py)
    for f, meaning in (("temperature", "greedy"), ("top_p", "unset, i.e. 1: no nucleus"), ("early_stop_p", "off")):
        v = values.get(f)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            return f"{name(f)} must be a number, got {v!r}"
        if v and _float32(v) == 0:
            return f"{name(f)} {v!r} arrives as 0 in its float32 field ({meaning}): give 0 or a larger value"
    stop = values.get("stop") or []
    if any(not isinstance(x, str) for x in stop):
        return f"{name('stop')}: stop strings are strings"
    for f, text in (("prompt", values.get("prompt")), ("request_id", values.get("request_id")), *(("stop", x) for x in stop)):
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError:
            return f"{name(f)} is not UTF-8 text"
    return None


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict
    seed: int
    request_id: str
    served_by: str = "draft"

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("text", "token_ids", "finish_reason", "stats", "seed", "request_id", "served_by")}


def make_request(prompt: str | None = None, prompt_ids: list[int] | None = None, max_new_tokens: int = 64,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: list[str] | str | None = None, num_draft_tokens: int = 0, proposal_mode: str | None = None,
                 sparse_k: int = 0, request_id: str = "", proposer: str | None = None, adaptive: bool | None = None,
                 predraft: bool | None = None, early_stop_p: float = 0.0,
                 add_special_tokens: bool | None = None, tree_budget: int = 0) -> pb.GenerateRequest:
    """add_special_tokens: None = the server's default (the tokenizer's own: BOS where it adds one).
    tree_budget: tree speculation's nodes per round (0: chains; num_draft_tokens is then the depth cap).
    stop: a list of strings, or one string (one stop string, not one per character).
    A value that cannot go in its field (a negative count, an id past 32 bits, text that is not
    UTF-8) is a ValueError naming the field."""
    for name, value, names in (("proposal_mode", proposal_mode, MODES), ("proposer", proposer, PROPOSERS)):
        if value is not None and value not in names:
            raise ValueError(f"{name} must be one of {', '.join(sorted(names))}, got {value!r}")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    prompt_ids = None if prompt_ids is None else list(prompt_ids)  # an iterator: checked below, then sent, both in full
    why = field_error(dict(prompt=prompt, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, early_stop_p=early_stop_p, seed=seed, stop=stop,
                           num_draft_tokens=num_draft_tokens, sparse_k=sparse_k, request_id=request_id, tree_budget=tree_budget))
    if why:
        raise ValueError(why)
    sampling = pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if seed is not None:
        sampling.seed = seed
    return pb.GenerateRequest(
        prompt=prompt or "", prompt_ids=[] if prompt_ids is None else prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
        stop=stop, num_draft_tokens=num_draft_tokens, sparse_k=sparse_k, request_id=request_id,
        proposal_mode=MODES[proposal_mode] if proposal_mode is not None else pb.PROPOSAL_MODE_UNSPECIFIED,
        proposer=PROPOSERS[proposer] if proposer is not None else pb.PROPOSER_UNSPECIFIED,
        adaptive=adaptive, predraft=predraft, early_stop_p=early_stop_p, add_special_tokens=add_special_tokens,
        tree_budget=tree_budget)


@dataclass
class _Collector:
    t0: float = field(default_factory=time.perf_counter)
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    last: pb.GenerateResponse | None = None
    t_last: float | None = None  # when the chunk with the finish reason came (the stream's end may follow later)

    def add(self, chunk: pb.GenerateResponse) -> None:
        self.ids.extend(chunk.token_ids)
        self.text.append(chunk.text)
        self.last = chunk
        if chunk.finish_reason:
            self.t_last = time.perf_counter()

    def result(self, served_by: str) -> Result:
        last = self.last
        stats = MessageToDict(last.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        stats["wall_s"] = (self.t_last or time.perf_counter()) - self.t0  # request to last token
        return Result(text="".join(self.text), token_ids=self.ids, finish_reason=finish_name(last.finish_reason),
                      stats=stats, seed=last.seed, request_id=last.request_id, served_by=served_by)


def finish_name(reason: int) -> str:
    """A FinishReason's short name ("length", "stop", ...); one this client does not know (a newer
    server's) as unknown_N, not an error."""
    if reason in pb.FinishReason.values():
        return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
    return f"unknown_{reason}"


def _credentials(tls_ca, tls_cert, tls_key, flag: str = "--tls"):
    """TLS where any of the three is given: the server's certificate checked against tls_ca, else
    gRPC's default roots; with tls_cert and tls_key (together only), mTLS. A file that cannot be
    read, a CA file with no certificate, or a certificate and key that are not one pair is a
    StartupError naming its flag (gRPC took them, then failed each call UNAVAILABLE, which the
    retries and the fallback then tried again)."""
    if not (tls_ca or tls_cert or tls_key):
        return None
    if bool(tls_cert) != bool(tls_key):
        raise ValueError(f"{flag}-cert and {flag}-key go together: the client's certificate and its key")
    read = lambda p, name: read_pem(p, name) if p else None  # noqa: E731
    ca, key, cert = read(tls_ca, f"{flag}-ca"), read(tls_key, f"{flag}-key"), read(tls_cert, f"{flag}-cert")
    if tls_ca:
        check_ca(tls_ca, f"{flag}-ca")
    if tls_cert:
        check_pair(tls_cert, tls_key, f"{flag}-cert", f"{flag}-key")
    return grpc.ssl_channel_credentials(ca, key, cert)


@dataclass
class _Target:
    label: str  # "draft" or "verify" (Result.served_by)
    stub: object
    metadata: list
    address: str


class _Attempts:
    """The primary, then the fallback (retries on one target are gRPC's own: retry_service_config).
    Iterating yields each target; `failed(e)` re-raises the error unless the fallback is left and
    the error is one it is for."""

    def __init__(self, targets: list[_Target], timeout: float | None):
        self.plan, self.attempt = targets, -1
        self.deadline = None if timeout is None else time.monotonic() + timeout  # the whole request's, fallback included

    def __iter__(self):
        for self.attempt, target in enumerate(self.plan):
            yield target

    def timeout(self) -> float | None:
        """What is left of the request's timeout, for the next attempt."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def failed(self, e: grpc.RpcError) -> None:
        if e.code() not in FALLBACK_ON or self.attempt + 1 >= len(self.plan):
            raise e
        # said, not silent: a TLS set-up that does not match the draft's also reads UNAVAILABLE, and would
        # send every request target-only, at no speed-up, without a word
        log.warning("%s at %s is unavailable (%s: %s); this request goes target-only to the fallback verify service at %s",
                    self.plan[self.attempt].label, self.plan[self.attempt].address, e.code().name,
                    " ".join(str(e.details()).split()), self.plan[self.attempt + 1].address)


class _Base:
    def __init__(self, server: str, *, target_only: bool = False, fallback: str | None = None, timeout: float | None = None,
                 retries: int = 0, tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 token: str | None = None, fallback_token: str | None = None, max_message_bytes: int = 16 << 20,
                 fallback_tls_ca: str | None = None, fallback_tls_cert: str | None = None, fallback_tls_key: str | None = None):
        """token: bearer token for `server`. fallback_token: for the `fallback` verify service
        (default: the same token, for a verify service that accepts the clients' token).
        fallback_tls_*: the fallback's TLS, where it differs from the server's (a plaintext draft
        beside an mTLS verify service); given none, the fallback gets the server's."""
        if target_only and fallback:
            raise ValueError("fallback is a verify service for a draft service's requests; target_only already asks a verify service")
        self.server, self.target_only, self.fallback = server, target_only, fallback
        self.timeout, self.retries = check_timeout(timeout), check_retries(retries)
        self._creds = _credentials(tls_ca, tls_cert, tls_key)
        own = fallback_tls_ca or fallback_tls_cert or fallback_tls_key
        if own and not fallback:
            raise ValueError("--fallback-tls-* (fallback_tls_*) without --fallback (fallback)")
        self._fallback_creds = _credentials(fallback_tls_ca, fallback_tls_cert, fallback_tls_key, "--fallback-tls") if own else self._creds
        self._opts = [("grpc.max_receive_message_length", max_message_bytes)]
        if retries > 0:
            # gRPC keeps a copy of a request to send it again only up to this size (256 KiB by default): a larger
            # request (a long prompt) would not be retried at all
            self._opts += [("grpc.enable_retries", 1), ("grpc.service_config", retry_service_config(retries)),
                           ("grpc.per_rpc_retry_buffer_size", max(max_message_bytes, 256 << 10))]
        self._metadata = _auth(token, "--token (token)")
        self._fallback_metadata = _auth(fallback_token or token, "--fallback-token-file (fallback_token)" if fallback_token else "--token (token)")

    def _channel(self, mod, address: str, creds):
        if creds:
            return mod.secure_channel(address, creds, options=self._opts)
        return mod.insecure_channel(address, options=self._opts)

    def _stubs(self, mod) -> list[_Target]:
        """The primary, then the verify fallback."""
        self._channels = [self._channel(mod, self.server, self._creds)]
        out = [_Target("verify" if self.target_only else "draft",
                       (pb_grpc.VerifyStub if self.target_only else pb_grpc.DraftStub)(self._channels[0]), self._metadata, self.server)]
        if self.fallback:
            self._channels.append(self._channel(mod, self.fallback, self._fallback_creds))
            out.append(_Target("verify", pb_grpc.VerifyStub(self._channels[1]), self._fallback_metadata, self.fallback))
        return out


def _auth(token: str | None, where: str) -> list[tuple[str, str]]:
    """The metadata that carries `token` (none for None); a token a header cannot carry, or an
    empty one (it sent no header at all), is a StartupError naming `where`."""
    return [] if token is None else [("authorization", f"Bearer {check_token(token, where)}")]


def add_credential_args(p, fallback: bool = True) -> None:
    """The credential flags of the CLI and the load testers (an argparse parser); the fallback's
    own with `fallback`."""
    p.add_argument("--tls-ca", help="CA bundle to check the server's certificate (enables TLS; with only --tls-cert/--tls-key, "
                                    "TLS against gRPC's default roots, not the system's trust store)")
    p.add_argument("--tls-cert", help="client certificate (mTLS)")
    p.add_argument("--tls-key", help="client key (mTLS)")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token-file", help="file holding the bearer token for --server (and the fallback)")
    token.add_argument("--token", help="the bearer token itself (prefer --token-file: a flag value is visible to other local users)")
    if not fallback:
        return
    p.add_argument("--fallback-token-file", help="file holding the bearer token for the fallback verify service, if it differs")
    for part, what in (("ca", "CA bundle"), ("cert", "client certificate"), ("key", "client key")):
        p.add_argument(f"--fallback-tls-{part}", help=f"the fallback verify service's TLS {what}, where its TLS differs from --server's "
                                                     "(default: --server's --tls-* for both)")


def credential_kwargs(args) -> dict:
    """Client(...) keyword arguments from the flags of add_credential_args."""
    """A token file that cannot be read or is empty is a StartupError naming the flag."""
    token = read_token(args.token_file, "--token-file") if args.token_file else args.token
    fallback_token = read_token(args.fallback_token_file, "--fallback-token-file") if getattr(args, "fallback_token_file", None) else None
    return dict(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key, token=token, fallback_token=fallback_token,
                **{f"fallback_tls_{part}": getattr(args, f"fallback_tls_{part}", None) for part in ("ca", "cert", "key")})


class Client(_Base):
    """Blocking client. `stream()` yields GenerateResponse chunks; `generate()` returns a Result."""

    def __init__(self, server: str, **kw):
        super().__init__(server, **kw)
        self._targets = self._stubs(grpc)
        self._closed = False

    def _closed_under(self, e: grpc.RpcError) -> bool:
        """Whether `close()` cut the call (gRPC's own error says "Channel closed!")."""
        return self._closed and e.code() == grpc.StatusCode.CANCELLED

    def close(self) -> None:
        self._closed = True  # a stream it cuts raises StreamError(CANCELLED), as AsyncClient's does (_read)
        for c in self._channels:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def info(self) -> pb.ModelInfo:
        return self._targets[0].stub.Info(pb.InfoRequest(), timeout=self.timeout, metadata=self._metadata)

    def stream(self, request: pb.GenerateRequest | None = None, **params):
        yield from self._stream(_request(request, params))[1]

    def _stream(self, request):
        attempts = _Attempts(self._targets, self.timeout)
        for target in attempts:
            it = target.stub.Generate(request, timeout=attempts.timeout(), metadata=target.metadata)
            try:
                first = next(it)
            except grpc.RpcError as e:
                if self._closed_under(e):  # closed while waiting for the first chunk (a long prefill, a full queue)
                    raise StreamError(CLOSED, grpc.StatusCode.CANCELLED) from None
                attempts.failed(e)
                continue
            except StopIteration:
                raise StreamError(NO_RESPONSE) from None
            except BaseException:  # Ctrl-C before the first token: the traceback (kept by a REPL) would keep the call open
                it.cancel()
                raise

            def chunks(first=first, it=it):
                try:
                    chunk = first
                    yield chunk
                    try:
                        for nxt in it:
                            if _finished(chunk):
                                raise StreamError(AFTER_FINISH)
                            chunk = nxt
                            yield chunk
                    except grpc.RpcError as e:
                        if isinstance(e, StreamError):
                            raise
                        if _finished(chunk):
                            return  # the call failed after its final chunk (a deadline during the server's end): the result is whole
                        if self._closed_under(e):
                            raise StreamError(CLOSED, grpc.StatusCode.CANCELLED) from None
                        raise
                    if not _finished(chunk):
                        raise StreamError(NO_FINISH)
                finally:
                    it.cancel()  # a caller that stops early cancels the RPC (no-op once done)
            return target.label, chunks()
        raise AssertionError("unreachable")

    def generate(self, request: pb.GenerateRequest | None = None, **params) -> Result:
        col = _Collector()
        label, chunks = self._stream(_request(request, params))
        for chunk in chunks:
            col.add(chunk)
        return col.result(label)


async def _read(call):
    """call.read(); a call cut by the client's own close() (its channel closed) raises
    StreamError(CANCELLED), as the blocking client's does, where grpc.aio raised CancelledError in
    a task that nobody cancelled (a TaskGroup or asyncio.timeout takes that for its own)."""
    try:
        return await call.read()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # the task itself was cancelled: that goes on
            raise
        raise StreamError(CLOSED, grpc.StatusCode.CANCELLED) from None


class AsyncClient(_Base):
    """asyncio client. `stream()` is an async iterator of chunks; `generate()` returns a Result.
    Its channels open on first use, in the event loop that uses them (a grpc.aio channel belongs to
    the loop it was made in), so a client may be made outside that loop."""

    def __init__(self, server: str, **kw):
        super().__init__(server, **kw)
        self._channels: list = []
        self._made: list[_Target] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop _made's channels belong to

    @property
    def _targets(self) -> list[_Target]:
        loop = asyncio.get_running_loop()
        if self._made is None or self._loop is not loop:  # first use, after close(), or in another loop (a second asyncio.run)
            self._made, self._loop = self._stubs(grpc.aio), loop
        return self._made

    async def close(self) -> None:
        """Closes its channels (those of the running loop; another loop's are gone with it); a later
        call opens new ones."""
        channels, same = self._channels, self._loop is asyncio.get_running_loop()
        self._channels, self._made, self._loop = [], None, None
        if same:
            for c in channels:
                await c.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def info(self) -> pb.ModelInfo:
        return await self._targets[0].stub.Info(pb.InfoRequest(), timeout=self.timeout, metadata=self._metadata)

    async def stream(self, request: pb.GenerateRequest | None = None, **params):
        _, chunks = await self._stream(_request(request, params))
        async with contextlib.aclosing(chunks):  # closing this stream cancels the call now, not when the GC gets to it
            async for c in chunks:
                yield c

    async def _stream(self, request):
        attempts = _Attempts(self._targets, self.timeout)
        for target in attempts:
            call = target.stub.Generate(request, timeout=attempts.timeout(), metadata=target.metadata)
            try:
                first = await _read(call)
            except grpc.aio.AioRpcError as e:
                attempts.failed(e)
                continue
            if first is grpc.aio.EOF:
                raise StreamError(NO_RESPONSE)

            async def chunks(chunk=first, call=call):
                try:
                    while True:
                        yield chunk
                        last = chunk
                        try:
                            chunk = await _read(call)
                        except grpc.aio.AioRpcError:
                            if not _finished(last):
                                raise
                            return  # the call failed after its final chunk (a deadline during the server's end): the result is whole
                        if chunk is grpc.aio.EOF:
                            if not _finished(last):
                                raise StreamError(NO_FINISH)
                            return
                        if _finished(last):
                            raise StreamError(AFTER_FINISH)
                finally:
                    call.cancel()
            return target.label, chunks()
        raise AssertionError("unreachable")

    async def generate(self, request: pb.GenerateRequest | None = None, **params) -> Result:
        col = _Collector()
        label, chunks = await self._stream(_request(request, params))
        async for chunk in chunks:
            col.add(chunk)
        return col.result(label)
