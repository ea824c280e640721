"""Per-request observability in one place: a grpc.aio server interceptor that gives every
specdec RPC (health and reflection aside) on either service

  - a request id: `x-request-id` metadata when it is a valid id (at most 128 printable ASCII
    characters; a bad one is replaced, with a warning), else the request's own `request_id` (a Generate
    request, or a session's `start`), else a new one (written into a Generate request, so the
    handler, the reply and the next hop all use it);
  - one server span (OpenTelemetry, when tracing is on), a child of the caller's span;
  - one JSON log line when it ends: `request done` (`session done` for Verify.Session) with
    the service, method, request id, status code, tokens, rounds, finish reason, duration and,
    on failure, the error; refusals by authentication are logged at WARNING with the peer;
  - the request metrics: latency, errors by status code, tokens returned to callers;
  - requests whose bytes do not parse (invalid UTF-8 in a string field) end with
    INVALID_ARGUMENT, logged and counted, instead of gRPC's own UNKNOWN before any handler.

It reads what it needs from the messages going through (requests read, responses written or
yielded), so the servicers hold no observability code. The rest of the metrics (verify rounds,
caches, batches, acceptance) belong to the engines and stay there."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid

import grpc

from specdec import metrics, tracing
from specdec.errors import invalid
from specdec.v1 import specdec_pb2 as pb

REQUEST_ID_KEY = "x-request-id"
OBSERVED = "/specdec.v1."  # the services' own RPCs; health checks and reflection are not logged
REFUSALS = ("UNAUTHENTICATED", "PERMISSION_DENIED")


MAX_REQUEST_ID_CHARS = 128


def valid_request_id(rid) -> bool:
    """Printable ASCII of bounded length: it travels as gRPC metadata and into the logs."""
    return isinstance(rid, str) and len(rid) <= MAX_REQUEST_ID_CHARS and all(" " <= c <= "~" for c in rid)


def _header(metadata) -> str | None:
    for k, v in metadata or ():
        if k == REQUEST_ID_KEY:
            return v
    return None


def request_id(metadata, fallback: str = "") -> str:
    """The `x-request-id` header if it is a valid request id, else `fallback` (a bad header is
    replaced, never used: the observer logs one warning about it)."""
    v = _header(metadata)
    return v if v and valid_request_id(v) else fallback


class Undecodable:
    """What the observer's request deserializer returns for bytes that do not parse as the
    request message (e.g. a string field that is not valid UTF-8): the handler is not run and
    the call ends with INVALID_ARGUMENT, counted like any other error."""

    def __init__(self, error: Exception):
        self.error = error

    def message(self, method: str) -> str:
        return (f"request: not a valid {method} request message ({type(self.error).__name__}; for example a string "
                "field that is not UTF-8)")


def _tolerant(deserializer):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and kin: the caller sent bad bytes
            return Undecodable(e)
    return parse


def _finish_name(finish: int) -> str:
    return pb.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower()


def drain_cut(cut_at: float | None) -> bool:
    """Whether a call cancelled now was cut by a drain whose grace ends at `cut_at` (monotonic;
    None: no drain), with 50 ms of slack for the cut's own scheduling."""
    return cut_at is not None and time.monotonic() >= cut_at - 0.05


# grpc.aio's time_remaining() reads a few ms (6-7 measured) left when gRPC has already ended a call at
# its deadline: a call that ends this close to its deadline ended by it
DEADLINE_SLACK_S = 0.05


def code_name(context, exc: BaseException | None, cut_at: float | None = None) -> str:
    """The status a handler ended with (CANCELLED where its caller left, also when the handler
    then returned quietly: serving.fail has no one to tell of a failed write to a caller gone).
    A call cancelled past its deadline is DEADLINE_EXCEEDED, one the drain cut at the end of its
    grace (`cut_at`, monotonic) UNAVAILABLE, as their callers see them: neither is a caller that
    left, and both count as errors."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) or context.cancelled():
        remaining = context.time_remaining()
        if remaining is not None and remaining <= DEADLINE_SLACK_S:
            return "DEADLINE_EXCEEDED"
        if drain_cut(cut_at):
            return "UNAVAILABLE"
        return "CANCELLED"
    if exc is None:
        return "OK"
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"


class _Call:
    """What one RPC did, gathered from the messages it read and wrote."""

    def __init__(self, method: str, metadata):
        self.method = method
        self.request_id = request_id(metadata)
        header = _header(metadata)
        self.bad_header = None if header is None or self.request_id else header  # replaced: warned about at the end
        self.tokens = 0  # tokens this RPC returned (Generate) or committed (Session)
        self.rounds = 0
        self.fields: dict = {}

    def received(self, msg) -> None:
        if isinstance(msg, pb.GenerateRequest):
            if not self.request_id:
                self.request_id = self._adopt(msg.request_id) or uuid.uuid4().hex
                if not msg.request_id:
                    msg.request_id = self.request_id  # the handler and the next hop use the same id
        elif isinstance(msg, pb.VerifyRequest) and msg.WhichOneof("kind") == "start":
            self.request_id = self.request_id or self._adopt(msg.start.request_id)
            self.fields["prompt_tokens"] = len(msg.start.prompt_ids)

    def _adopt(self, rid: str) -> str:
        """A request id from a message, if valid. A bad one (validation refuses the request) is
        never logged, as a bad header is not: it may be huge or unprintable, and come before the
        caller's token is checked; its length is."""
        if rid and not valid_request_id(rid):
            self.fields["bad_request_id_chars"] = len(rid)
            return ""
        return rid

    def sent(self, msg) -> None:
        if isinstance(msg, pb.GenerateResponse):
            self.tokens += len(msg.token_ids)
            if msg.finish_reason:
                st = msg.stats
                self.rounds = st.rounds
                self.fields.update(finish_reason=_finish_name(msg.finish_reason), prompt_tokens=st.prompt_tokens)
                if st.drafted:
                    self.fields.update(accepted=st.accepted, drafted=st.drafted)
        elif isinstance(msg, pb.VerifyResponse):  # one per verification round, or per several steps of a run
            self.rounds += 1 + len(msg.run_tokens)
            self.tokens += msg.num_accepted + len(msg.run_tokens) + msg.HasField("next_token")
            if msg.finish_reason:
                self.fields["finish_reason"] = _finish_name(msg.finish_reason)


class _ObservedContext:
    """The servicer context, with the messages a reader/writer handler reads and writes seen
    on the way."""

    def __init__(self, context: grpc.aio.ServicerContext, call: _Call):
        self._context, self._call = context, call

    def __getattr__(self, name):
        return getattr(self._context, name)

    async def read(self):
        msg = await self._context.read()
        if isinstance(msg, Undecodable):
            raise invalid(msg.message(self._call.method))
        if msg is not grpc.aio.EOF:
            self._call.received(msg)
        return msg

    async def write(self, msg) -> None:
        self._call.sent(msg)  # counted when handed to gRPC: the caller may cancel (and so cancel this
        await self._context.write(msg)  # await) as soon as the message arrives


# (request streaming, response streaming) -> the handler's attribute, and how to make one of that kind
_KINDS = {(False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
          (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
          (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
          (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler)}


async def _received(request, context, call: _Call, method: str, streaming: bool, refused: bool = False) -> None:
    """A call's request is in: an undecodable one ends it with INVALID_ARGUMENT (unless a later
    interceptor refuses the caller: `refused`, so a caller without a token learns nothing of its
    bytes); a unary one is counted."""
    if isinstance(request, Undecodable) and not refused:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
    if not streaming:
        call.received(request)


class RequestObserver(grpc.aio.ServerInterceptor):
    """Put it first in the server's interceptors, so it also sees calls that later
    interceptors (authentication) refuse."""

    def __init__(self, service: str, logger: logging.Logger | None = None):
        self.service = service
        self.log = logger or logging.getLogger(f"specdec.{service}")
        self.cut_at: float | None = None  # when a drain's grace ends (serving.serve): calls cut then are UNAVAILABLE

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(OBSERVED):
            return handler
        method = details.method.rsplit("/", 1)[-1]
        attr, make = _KINDS[handler.request_streaming, handler.response_streaming]
        behavior = getattr(handler, attr)
        observe = self._observe
        metadata = details.invocation_metadata
        refused = getattr(behavior, "refuses", False)  # specdec/auth.py's handler for a caller it refuses

        if inspect.isasyncgenfunction(behavior):  # the handler yields its responses
            async def wrapped(request, context):
                call = _Call(method, metadata)
                with observe(call, context):
                    await _received(request, context, call, method, handler.request_streaming, refused)
                    # aclosing: a caller that goes away ends the handler's generator now (its finally runs)
                    async with contextlib.aclosing(behavior(request, _ObservedContext(context, call))) as responses:
                        async for msg in responses:
                            call.sent(msg)
                            yield msg
        else:  # a coroutine: returns its (unary) response, or writes with context.write()
            async def wrapped(request, context):
                call = _Call(method, metadata)
                with observe(call, context):
                    await _received(request, context, call, method, handler.request_streaming, refused)
                    response = await behavior(request, _ObservedContext(context, call))
                    if response is not None:
                        call.sent(response)
                    return response

        return make(wrapped, request_deserializer=_tolerant(handler.request_deserializer), response_serializer=handler.response_serializer)

    @contextlib.contextmanager
    def _observe(self, call: _Call, context: grpc.aio.ServicerContext):
        t0 = time.perf_counter()
        exc = None
        with tracing.server_span(f"specdec.{self.service}/{call.method}", context, only_in_trace=call.method == "Info",
                                 request_id=call.request_id or None) as set_attrs:
            try:
                yield
            except BaseException as e:
                exc = e
                raise
            finally:
                duration = time.perf_counter() - t0
                code = code_name(context, exc, self.cut_at)
                fields = {"service": self.service, "method": call.method, "request_id": call.request_id or uuid.uuid4().hex,
                          "code": code, "tokens": call.tokens, "duration_s": round(duration, 6)}
                if call.rounds or call.method == "Session":
                    fields["rounds"] = call.rounds
                fields.update(call.fields)
                if code not in ("OK", "CANCELLED") and context.details():
                    fields["error"] = context.details()
                if code in REFUSALS:  # never the token itself
                    fields["peer"] = context.peer()
                if call.bad_header is not None:  # never the bad value itself: it may be huge or unprintable
                    self.log.warning(f"{REQUEST_ID_KEY} header is not a valid request id (at most {MAX_REQUEST_ID_CHARS} printable "
                                     "ASCII characters); replaced", extra={"fields": {"request_id": fields["request_id"],
                                                                                      "header_chars": len(call.bad_header)}})
                msg = "session done" if call.method == "Session" else "request done"
                # Info answers are polled (drafts rank verify replicas by the capacity it reports): not logged at INFO
                level = logging.WARNING if code in REFUSALS else logging.DEBUG if (call.method, code) == ("Info", "OK") else logging.INFO
                self.log.log(level, msg, extra={"fields": fields})
                set_attrs(**{f"specdec.{k}": v for k, v in fields.items() if k not in ("service", "method")})
                metrics.REQUEST_LATENCY.labels(self.service, call.method).observe(duration)
                if code not in ("OK", "CANCELLED"):
                    metrics.REQUEST_ERRORS.labels(self.service, call.method, code).inc()
                if call.method == "Generate" and call.tokens:  # tokens returned to callers (not a session's)
                    metrics.GENERATED_TOKENS.labels(self.service).inc(call.tokens)
