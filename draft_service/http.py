"""The draft service's OpenAI-compatible HTTP front door (--http-port): POST /v1/completions,
POST /v1/chat/completions, GET /v1/models (and /v1/models/ID) and GET /health, on Starlette, served by uvicorn in
the gRPC server's own event loop (specdec/serving.py starts and drains both).

An HTTP request becomes the GenerateRequest a gRPC client would send, and runs through the
servicer's own stream, as Draft.Generate's (draft_service/server.py) with a stand-in for the gRPC context: the same
validation, decode loop, stop strings and stats, so HTTP output is the gRPC output by
construction. gRPC statuses map to HTTP ones (INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED 429 and
UNAVAILABLE 503 with Retry-After, ...) in OpenAI's error shape. The client token (--auth-token-file)
is checked as gRPC checks it (specdec/auth.py). A client that goes away cancels its generation:
the servicer's generator is closed, which cancels the verify session. Schemas:
draft_service/openai_schemas.py; errors, the context stand-in and the chunks' translation:
draft_service/openai_reply.py."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import math
import re
import socket
import ssl
import time
import uuid

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from draft_service import openai_schemas as s
from draft_service.openai_reply import CLIENT_GONE, STATUS, ClientGone, Context, HttpError, Reply, http_names
from specdec import metrics, observe, serving, tracing, validation
from specdec.errors import Refusal, RequestError
from specdec.files import StartupError
from specdec.v1 import specdec_pb2 as pb

log = logging.getLogger("specdec.draft")
GENERATE = "/specdec.v1.Draft/Generate"  # what an HTTP generation is authorised as
PROPOSERS = {"draft": pb.PROPOSER_DRAFT, "lookup": pb.PROPOSER_LOOKUP, "hybrid": pb.PROPOSER_HYBRID}
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context limit


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":  # the body has been read: only a disconnect comes
        pass


async def unless_disconnected(request: Request, aw, cut: asyncio.Event | None = None):
    """Awaits aw, unless the client disconnects first: then aw is cancelled (closing the
    generation, which frees both services' sessions) and ClientGone raised; or unless `cut` (the
    drain's, FrontDoor.cut) is set first: then aw is cancelled alike and a 503 raised, before any
    status line went out (uvicorn's own cancel at the grace's end would answer a plain-text 500)."""
    work, gone = asyncio.ensure_future(aw), asyncio.ensure_future(_disconnect(request.receive))
    ended = asyncio.ensure_future(cut.wait()) if cut is not None else None
    try:
        done, _ = await asyncio.wait([f for f in (work, gone, ended) if f is not None], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        gone.cancel()
        if ended is not None:
            ended.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.wait((work,))  # its finally blocks run now
    if gone in done:
        raise ClientGone
    raise HttpError(503, "the service is shutting down (its drain's grace ended); retry", code="unavailable", retry_after=1)


class _Observe:
    """ASGI middleware: one `request done` log line per HTTP request (like the gRPC observer's,
    specdec/observe.py) and the request metrics: specdec_http_requests_total by path and status,
    latency, tokens returned."""

    def __init__(self, app, door=None):
        self.app, self.door = app, door
        self.opened: collections.OrderedDict[tuple, float] = collections.OrderedDict()  # a client address -> its first request's time

    def _too_old(self, scope) -> bool:
        """Whether the request's connection is older than --max-connection-age-s, as gRPC's are
        closed after it: its response then closes it, and the client's next request connects
        again (to a draft pod the autoscaler added since: a keep-alive client stayed on its pod)."""
        max_age = getattr(getattr(self.door, "args", None), "max_connection_age_s", None)
        client = scope.get("client")
        if not max_age or not client:
            return False
        now = time.monotonic()
        while self.opened and now - next(iter(self.opened.values())) > 2 * max_age:  # oldest first: gone by now (a
            self.opened.popitem(last=False)  # connection past its age is closed at its next request, and forgotten then)
        first = self.opened.setdefault(tuple(client), now)
        if now - first < max_age:
            return False
        del self.opened[tuple(client)]
        return True

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, call = time.perf_counter(), {"status": 500, "tokens": 0}
        scope["specdec"] = call
        close = self._too_old(scope)

        async def send_status(msg):
            if msg["type"] == "http.response.start":
                call["status"] = msg["status"]
                call["returns"] = msg["status"] == 200  # a reply that carries its tokens (an error's body, or none, does not)
                headers = list(msg.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):  # every response says its id, as the log line
                    # does (/v1/models, a 404, a 405: the caller's own where valid, else a new one)
                    call["request_id"] = call.get("request_id") or _sent_id(scope) or uuid.uuid4().hex
                    headers.append((b"x-request-id", call["request_id"].encode()))
                if close:
                    headers.append((b"connection", b"close"))
                msg = dict(msg, headers=headers)
            await send(msg)

        path = scope["path"] if scope["path"] in PATHS else "other"
        # polls (/health, /v1/models) are no trace's root, as the gRPC door's Info polls are not
        polled = path not in ("/v1/completions", "/v1/chat/completions")
        with tracing.server_span(f"specdec.draft/{scope['method']} {path}", _Headers(scope), only_in_trace=polled) as set_attrs:
            try:
                await self.app(scope, receive, send_status)
            except asyncio.CancelledError:
                call["status"] = _gone(self.door)
                raise
            finally:
                self._done(scope, call, path, t0, set_attrs)

    @staticmethod
    def _done(scope, call: dict, path: str, t0: float, set_attrs) -> None:
        """The request's log line, metrics and span attributes."""
        status, duration = call["status"], time.perf_counter() - t0
        tokens = call["tokens"] if call.get("returns") else 0  # returned to the caller, as the gRPC observer counts them
        # `code` as the gRPC observer names it (one type in one field for log indexers); the HTTP status beside it
        fields = {"service": "draft", "method": f"{scope['method']} {path}", "request_id": call.get("request_id") or uuid.uuid4().hex,
                  "code": code_of(status), "http_status": status, "tokens": tokens, "duration_s": round(duration, 6),
                  **call.get("fields", {})}
        if "error" in call:  # bounded: what a message quotes of a client's input is cut already (quoted)
            fields["error"] = call["error"][:2000]
        if status in (401, 403) and scope.get("client"):  # as the gRPC observer logs a refused caller
            fields["peer"] = "%s:%s" % tuple(scope["client"])
        log.log(logging.WARNING if status in (401, 403) else logging.INFO, "request done", extra={"fields": fields})
        metrics.HTTP_REQUESTS.labels(path, str(status)).inc()
        metrics.REQUEST_LATENCY.labels("draft", path).observe(duration)
        if fields["code"] not in ("OK", "CANCELLED"):  # as the gRPC observer counts its calls' errors, and as logged above
            metrics.REQUEST_ERRORS.labels("draft", path, fields["code"]).inc()  # (405 and 413 were logged, not counted)
        if tokens:
            metrics.GENERATED_TOKENS.labels("draft").inc(tokens)
        set_attrs(**{f"specdec.{k}": v for k, v in fields.items() if k not in ("service", "method")})


def _sent_id(scope) -> str | None:
    """The request's X-Request-Id header, where it is a valid request id."""
    rid = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"x-request-id"), None)
    return rid if observe.valid_request_id(rid) else None


class _Headers:
    """An HTTP request's headers as tracing.server_span reads a gRPC call's metadata (its
    `traceparent`): the HTTP front door's span is the parent of the verify session's, as the gRPC
    door's is."""

    def __init__(self, scope):
        self.scope = scope

    def invocation_metadata(self):
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.scope.get("headers", [])]


class _Stream(StreamingResponse):
    """A stream of events each of which the client must take within `timeout_s`
    (--client-write-timeout-s, as Draft.Generate's chunks): a client that stops reading, its
    connection open, ends the request, and its sessions on both services with it (504 in the
    request's log line and the error counts; the status line has gone as 200; uvicorn adds an
    error line of its own, "ASGI callable returned without completing response", and closes the
    connection). The events' generator is closed however the response ends."""

    def __init__(self, content, timeout_s: float, call: dict, **kw):
        super().__init__(content, **kw)
        self.timeout_s, self.call = timeout_s, call

    async def __call__(self, scope, receive, send):
        async def timed(message):
            async with asyncio.timeout(self.timeout_s):
                await send(message)

        try:
            await super().__call__(scope, receive, timed)
        except TimeoutError:
            self.call.update(status=STATUS[grpc.StatusCode.DEADLINE_EXCEEDED],
                             error=f"the client read nothing for {self.timeout_s:g} s (--client-write-timeout-s); request ended")
        finally:
            await self.body_iterator.aclose()


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # SIGTERM and SIGINT belong to the service's drain (specdec/serving.py), which stops this server


# HTTP status -> the gRPC status name it stands for (the first code STATUS maps to it), for the request's log line
CODE_NAMES = {s: c.name for c, s in reversed(list(STATUS.items()))} | {CLIENT_GONE: "CANCELLED", 405: "UNIMPLEMENTED",
                                                                      413: "RESOURCE_EXHAUSTED"}


def code_of(status: int) -> str:
    """The gRPC status name an HTTP status stands for in the request's log line."""
    return "OK" if status < 400 else CODE_NAMES.get(status, "INVALID_ARGUMENT" if status < 500 else "INTERNAL")


def _gone(door) -> int:
    """The status of a request cancelled without its client's leave: 503 where the drain cut it at
    the end of its grace (UNAVAILABLE, as a gRPC call cut then: an error), else 499 (the client
    left: none)."""
    return STATUS[grpc.StatusCode.UNAVAILABLE] if observe.drain_cut(getattr(door, "cut_at", None)) else CLIENT_GONE


async def _error_response(request: Request, e: Exception) -> Response:
    call = request.scope.get("specdec", {})
    if isinstance(e, ClientGone):
        call["status"] = CLIENT_GONE
        return Response(status_code=CLIENT_GONE)
    if isinstance(e, HTTPException):  # Starlette's own (404, 405 with its Allow header)
        e = HttpError(e.status_code, str(e.detail), headers=e.headers)
    elif not isinstance(e, HttpError):
        log.exception("internal error in %s", request.url.path)
        e = HttpError(500, f"internal error: {type(e).__name__}: {e}")
    call["error"] = e.message
    if call.get("request_id"):  # known once the request's headers were read: a failure is traced as a success is
        e.headers.setdefault("X-Request-Id", call["request_id"])
    return e.response()


SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")  # a surrogate's JSON escape, or its UTF-8 bytes (json.loads takes them)


CUT_MARGIN_S = 0.5  # the drain ends running streams this long before its grace ends: time to write their last events


class FrontDoor:
    """The HTTP app over a DraftServicer; `start()` serves it, `stop()` drains it."""

    def __init__(self, servicer, args, token_auth=None, model: str = ""):
        """model: the target's name if known at start-up (else the servicer's target once it is, else
        the draft's); --served-model-name wins."""
        self.servicer, self.args, self.auth = servicer, args, token_auth
        self._served, self._given = getattr(args, "served_model_name", None), model
        self.created = int(time.time())
        self.template = open(args.chat_template, encoding="utf-8").read() if args.chat_template else None  # noqa: SIM115 - read at start-up (checked there)
        if self.template is not None:
            check_template(self.template, args.chat_template)
        self.draining, self.server, self.task, self.sock = False, None, None, None
        self.upstream = True  # whether a verify replica answers and takes this draft (the gRPC health's; set by the service)
        errors = {HttpError: _error_response, HTTPException: _error_response, ClientGone: _error_response, Exception: _error_response}
        self.app = Starlette(routes=[Route("/v1/completions", self.completions, methods=["POST"]),
                                     Route("/v1/chat/completions", self.chat, methods=["POST"]),
                                     Route("/v1/models", self.models), Route("/v1/models/{model:path}", self.model_info),
                                     Route("/health", self.health)],
                             exception_handlers=errors, middleware=[Middleware(_Observe, door=self)])
        self.cut_at: float | None = None  # when the drain's grace ends (`stop`): streams cancelled then are 503, not 499
        self.cut: asyncio.Event | None = None  # set just before the drain's grace ends: running SSE streams end (Reply.sse);
        # made in `start`, in the loop that serves (an app used without it, as in tests, has no drain)

    def _target(self) -> str:
        """The target's name: the servicer's once its verify service has answered (a draft started
        before it learns it then), else the one given at start-up."""
        target = getattr(self.servicer, "target", None)
        return target.model_name if target is not None else self._given

    @property
    def model(self) -> str:
        """The model id served: --served-model-name, else the target's name, else the draft's."""
        return self._served or self._target() or self.servicer.lm.name

    @property
    def accepted(self) -> set[str]:
        """The model ids a request may name: the served one, the target's and the draft's own."""
        return {self.model, self._target(), self._given, self.servicer.lm.name} - {"", None}

    def bind(self) -> None:
        """Binds --host:--http-port (before the gRPC server starts: a port taken while the model
        loaded is a one-line start-up failure, not a traceback behind a serving gRPC server)."""
        a = self.args
        # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on connections of such a socket, and without
        # it a response's body waits for the client's delayed ACK of its headers (40 ms on Linux)
        sock = socket.socket(socket.AF_INET6 if ":" in a.host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((a.host.strip("[]"), a.http_port))
            sock.listen(1024)
        except OSError as e:
            sock.close()
            raise StartupError(f"--http-port {a.http_port}: cannot listen on {a.host}:{a.http_port}: {e.strerror or e}") from None
        self.sock = sock

    async def start(self) -> int:
        """Serves on the socket `bind` made (binding it now if it has not), prints `http on
        HOST:PORT`; returns the port."""
        a = self.args
        if self.sock is None:
            self.bind()
        sock = self.sock
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off", server_header=False, proxy_headers=False,
                                timeout_graceful_shutdown=max(1, math.ceil(a.drain_s)), ssl_certfile=a.tls_cert, ssl_keyfile=a.tls_key,
                                ssl_ca_certs=a.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED if a.tls_client_ca else ssl.CERT_NONE)
        self.cut = asyncio.Event()
        self.server = _Uvicorn(config)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        for _ in range(3000):  # 30 s at most
            if self.server.started or self.task.done():
                break
            await asyncio.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"the HTTP server did not start: {self.task.exception() if self.task.done() else 'timed out'}")
        port = sock.getsockname()[1]
        host = serving.bracketed(a.host)
        print(f"http on {host}:{port}", flush=True)
        log.info("serving http", extra={"fields": {"address": f"{host}:{port}", "tls": bool(a.tls_cert)}})
        return port

    async def stop(self) -> None:
        """The listener closes (new connections are refused; a request on a connection still open gets
        503); running ones get the drain period (--drain-s)."""
        self.draining = True
        grace = max(1, math.ceil(self.args.drain_s))
        self.cut_at = time.monotonic() + grace  # uvicorn's timeout_graceful_shutdown
        cut = asyncio.get_running_loop().call_later(max(0.0, grace - CUT_MARGIN_S), self.cut.set) if self.cut else None
        try:
            if self.server is not None:
                self.server.should_exit = True
                await self.task
        finally:
            if cut is not None:
                cut.cancel()


    # ---- endpoints ----

    async def health(self, request: Request) -> Response:
        """Readiness, as the gRPC health of specdec.v1.Draft: 503 while draining or while no verify
        replica answers and serves this draft (its vocabulary, tokenizer and context; requests would
        fail with 503 then), else 200."""
        if self.draining:
            return JSONResponse({"status": "draining"}, 503)
        if not self.upstream:
            return JSONResponse({"status": "unavailable", "reason": "no verify service answers and takes this draft"}, 503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._card(self.model)]})

    async def model_info(self, request: Request) -> Response:
        """GET /v1/models/{id} (the SDK's models.retrieve): the served model, under any id a request may name."""
        self._authorize(request)
        name = request.path_params["model"]
        self._check_model(name)
        return JSONResponse(self._card(name))

    def _check_model(self, name: str) -> None:
        """A model id a request may name; another is a 404, or a 503 while the target's name is
        unknown (a draft started before its verify service: the id may be the target's)."""
        if name in self.accepted:
            return
        if not self._served and not self._target():
            raise HttpError(503, f"the model {s.quoted(name)} is not known until the verify service first answers; retry",
                            "model", "unavailable", retry_after=1)
        raise HttpError(404, f"the model {s.quoted(name)} does not exist; this server serves {self.model!r}", "model", "model_not_found")

    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "specdec"}

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        call = request.scope["specdec"]
        try:  # before the token's check, so a 401 or 403 carries the caller's X-Request-Id too
            rid, bad_id = self._request_id(request), None
        except HttpError as e:
            rid, bad_id = None, e
        call["request_id"] = rid
        self._authorize(request)
        if bad_id is not None:
            raise bad_id
        if self.draining:
            raise HttpError(503, "the service is shutting down", retry_after=1)
        data = await self._body(request)
        read = functools.partial(self._read, data, chat, rid)
        # a large body's parsing and chat template run in a thread: seconds of it would stall every call on the event loop
        r, req = await asyncio.to_thread(read) if len(data) > validation.LARGE_REQUEST else read()
        reply = Reply(chat, r, rid, self.model, call, self)
        chunks = self.servicer.stream(req, Context(rid, http_names(chat, r)))
        headers = {"X-Request-Id": rid}
        if not r.stream:
            return Response(await unless_disconnected(request, reply.collect(chunks), self.cut), media_type="application/json",
                            headers=headers)
        try:  # the first chunk before the status line: errors before any output get their own status
            first = await unless_disconnected(request, anext(chunks), self.cut)
        except StopAsyncIteration:
            raise HttpError(500, "internal error: the generation ended without output") from None
        return _Stream(reply.sse(first, chunks), getattr(self.servicer, "client_write_timeout_s", None), call,
                       media_type="text/event-stream", headers=dict(headers, **{"Cache-Control": "no-cache"}))

    def _read(self, data: bytes, chat: bool, rid: str) -> tuple[s._Request, pb.GenerateRequest]:
        """The request a body holds, and the GenerateRequest it makes (a chat's messages rendered)."""
        try:
            body = json.loads(data)
            if SURROGATE.search(data) or json.detect_encoding(data) != "utf-8":  # a lone surrogate ("\\ud800") is valid JSON, not a string gRPC or a reply can carry
                json.dumps(body, ensure_ascii=False).encode()  # (this whole-body check, only where one may be: 1.5 s at 16 MiB)
            self._too_long(body, chat)
            r = s.parse(s.ChatRequest if chat else s.CompletionRequest, body)
        except s.Refused as e:
            raise HttpError(400, e.message, e.param) from None
        except UnicodeEncodeError:  # the body's bytes were UTF-8 (else UnicodeDecodeError, below): a string is not
            raise HttpError(400, "the body has a string that is not valid Unicode (a lone surrogate escape)") from None
        except (ValueError, RecursionError):  # JSON's (and UTF-8's) errors; nesting deeper than the parser goes
            raise HttpError(400, "the body is not valid JSON") from None
        self._check_model(r.model)
        return r, self._grpc_request(r, rid, chat)

    def _too_long(self, body, chat: bool) -> None:
        """A prompt or chat that cannot fit the context, refused by its length before pydantic,
        protobuf and the chat template see it: each holds the GIL, and so the event loop of every
        stream, for seconds on a body of megabytes (5 s to validate 520,000 messages, 9 s to render
        them), though the body's parsing runs in a thread."""
        if not isinstance(body, dict):
            return
        context, longest = self.servicer.max_context, validation.max_token_chars(self.servicer.lm.tokenizer)
        most_chars = validation.PROMPT_CHARS_MARGIN * longest * context  # the servicer's own bound on a text prompt
        prompt, messages = body.get("prompt"), body.get("messages")
        if not chat:
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                if len(prompt) > 1:
                    return  # a batch: its own 400
                prompt = prompt[0]  # a batch of one prompt, as the schema takes it
            if isinstance(prompt, list) and len(prompt) > context:
                raise HttpError(400, f"prompt: {len(prompt)} token ids are more than the context limit of {context} tokens", "prompt")
            if isinstance(prompt, str) and len(prompt) > most_chars:
                raise HttpError(400, f"prompt: {len(prompt)} characters are far more than the context limit of {context} tokens "
                                     f"holds (no token here is longer than {longest} characters)", "prompt")
        elif isinstance(messages, list):
            if len(messages) > context:
                raise HttpError(400, f"messages: {len(messages)} messages are more than the context limit of {context} tokens holds",
                                "messages")
            chars = sum(len(c) if isinstance(c, str) else sum(len(p["text"]) for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
                        if isinstance(c, list) else 0 for c in (m.get("content") for m in messages if isinstance(m, dict)))  # other types: pydantic's 400
            if chars > most_chars:
                raise HttpError(400, f"messages: {chars} characters of content are far more than the context limit of {context} "
                                     f"tokens holds (no token here is longer than {longest} characters)", "messages")

    def _body_limit(self) -> int:
        """The most bytes a body may have: --max-message-bytes (gRPC's limit on a request), and no
        more than a request within the context can take (its text at 12 bytes a character, an
        astral character's JSON escape, and room for the messages' keys): a larger body is
        refused before its JSON is parsed, which holds the GIL (1 s at 16 MiB)."""
        longest = validation.max_token_chars(self.servicer.lm.tokenizer)
        context = self.servicer.max_context
        fits = 12 * validation.PROMPT_CHARS_MARGIN * longest * context + 256 * context + (64 << 10)
        return min(getattr(self.args, "max_message_bytes", 16 << 20), fits)

    async def _body(self, request: Request) -> bytes:
        """The body, up to _body_limit(), else 413."""
        limit, data = self._body_limit(), bytearray()
        try:
            async for part in request.stream():
                data += part
                if len(data) > limit:
                    why = ("--max-message-bytes" if limit == getattr(self.args, "max_message_bytes", 16 << 20)
                           else f"more than any request within the context of {self.servicer.max_context} tokens takes")
                    raise HttpError(413, f"the request body is larger than {limit} bytes ({why})")
        except ClientDisconnect:  # gone before its body was in: a client that left (499), not a server error
            raise ClientGone from None
        return bytes(data)

    def _authorize(self, request: Request) -> None:
        if self.auth is None:
            return
        refusal = self.auth.check(GENERATE, [("authorization", request.headers.get("authorization", ""))])
        if refusal:
            kind, reason = refusal
            raise HttpError(401 if kind == Refusal.UNAUTHENTICATED else 403, reason, code="invalid_api_key")

    @staticmethod
    def _request_id(request: Request) -> str:
        rid = request.headers.get(serving.REQUEST_ID_KEY) or uuid.uuid4().hex
        try:
            return validation.check_request_id(rid, "X-Request-Id")
        except RequestError as e:
            raise HttpError(400, e.message, "X-Request-Id") from None

    def _grpc_request(self, r: s._Request, rid: str, chat: bool) -> pb.GenerateRequest:
        if chat:
            max_tokens = r.max_completion_tokens or r.max_tokens or self.servicer.max_context
        else:
            max_tokens = r.max_tokens or COMPLETION_MAX_TOKENS
        # the nucleus of p -> 0 is the one most probable token (gRPC's 0 means unset: so is any p that rounds to 0 in float32);
        # so is a temperature below the services' least (validation.MIN_TEMPERATURE: greedy in all but name)
        greedy = r.top_p <= 2.0 ** -150 or r.temperature < validation.MIN_TEMPERATURE
        sampling = pb.SamplingParams(temperature=0.0 if greedy else r.temperature, top_k=r.top_k, top_p=1.0 if greedy else r.top_p,
                                     seed=None if r.seed is None else r.seed % (1 << 64))
        req = pb.GenerateRequest(max_new_tokens=max_tokens, sampling=sampling, stop=r.stops, num_draft_tokens=r.num_draft_tokens,
                                 request_id=rid, proposer=PROPOSERS.get(r.proposer, pb.PROPOSER_UNSPECIFIED), adaptive=r.adaptive,
                                 predraft=r.predraft, tree_budget=r.tree_budget)
        prompt = self._render(r) if chat else r.prompt
        if chat:  # the template wrote the special tokens it wants (a BOS, for one): the tokenizer adds none of its own
            req.add_special_tokens = False
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_ids.extend(prompt)
        return req

    def _render(self, r: s.ChatRequest) -> str:
        """The chat as text, through --chat-template or the draft model's tokenizer's template (the
        draft service tokenizes; distilled drafts carry their target's template). A `developer`
        message (OpenAI's newer name for `system`) is a `system` one unless the template knows the
        role: most templates drop a role they do not know, or print a header the model never saw."""
        tok = self.servicer.lm.tokenizer
        template = self.template or getattr(tok, "chat_template", None)
        if not template:
            raise HttpError(400, "the draft model's tokenizer has no chat template (chats are rendered with it): use /v1/completions, "
                                 "or start the draft service with --chat-template FILE", "messages", "chat_template_missing")
        developer = "developer" if re.search(r"""['"]developer['"]""", str(template)) else "system"  # a comparison with the role
        messages = [{"role": developer if m.role == "developer" else m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in r.messages]
        try:
            return tok.apply_chat_template(messages, chat_template=self.template, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template that raises on these messages (jinja's raise_exception)
            raise HttpError(400, f"messages: the chat template refused them: {e}", "messages") from None


def check_template(text: str, path: str) -> None:
    """StartupError naming --chat-template where transformers cannot compile the file (a Jinja
    syntax error): it was found at the first chat, as a 400 that blamed the client's messages."""
    from jinja2 import TemplateError  # noqa: PLC0415

    try:  # transformers' own compiler, as apply_chat_template's (a private name: where it is gone, the first chat tells)
        from transformers.utils.chat_template_utils import _compile_jinja_template  # noqa: PLC0415
    except ImportError:
        return
    try:
        _compile_jinja_template(text)
    except TemplateError as e:
        line = getattr(e, "lineno", None)
        raise StartupError(f"--chat-template {path}: not a chat template transformers can compile ({e}"
                           + (f", line {line})" if line else ")")) from None
