"""The draft service's OpenAI-compatible HTTP front door (--http-port): POST /v1/completions,
POST /v1/chat/completions, GET /v1/models and GET /health, on Starlette, served by uvicorn in
the gRPC server's own event loop (specdec/serving.py starts and drains both).

An HTTP request becomes the GenerateRequest a gRPC client would send, and runs through the
servicer's own Generate (draft_service/server.py) with a stand-in for the gRPC context: the same
validation, decode loop, stop strings and stats, so HTTP output is the gRPC output by
construction. gRPC statuses map to HTTP ones (INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED 429 and
UNAVAILABLE 503 with Retry-After, ...) in OpenAI's error shape. The client token (--auth-token-file)
is checked as gRPC checks it (specdec/auth.py). A client that goes away cancels its generation:
the servicer's generator is closed, which cancels the verify session. Schemas:
draft_service/openai_schemas.py."""
from __future__ import annotations

import asyncio
import contextlib
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
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from draft_service import openai_schemas as s
from specdec import metrics, serving, validation
from specdec.errors import RequestError
from specdec.v1 import specdec_pb2 as pb

log = logging.getLogger("specdec.draft")
GENERATE = "/specdec.v1.Draft/Generate"  # what an HTTP generation is authorised as
PROPOSERS = {"draft": pb.PROPOSER_DRAFT, "lookup": pb.PROPOSER_LOOKUP, "hybrid": pb.PROPOSER_HYBRID}
FINISH = {pb.FINISH_REASON_EOS: "stop", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
          pb.FINISH_REASON_CONTEXT: "length"}
C = grpc.StatusCode
STATUS = {C.INVALID_ARGUMENT: 400, C.OUT_OF_RANGE: 400, C.NOT_FOUND: 404, C.UNAUTHENTICATED: 401, C.PERMISSION_DENIED: 403,
          C.RESOURCE_EXHAUSTED: 429, C.UNAVAILABLE: 503, C.DEADLINE_EXCEEDED: 504}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable"}
# the GenerateRequest fields validation messages name, as the HTTP request names them
HTTP_NAMES = {"max_new_tokens": "max_tokens", "sampling.temperature": "temperature", "sampling.top_p": "top_p",
              "prompt_ids": "prompt", "request_id": "X-Request-Id"}
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context limit
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")
CLIENT_GONE = 499  # logged for a client that disconnected (nginx's code; never sent)


def add_args(p) -> None:
    p.add_argument("--http-port", type=int, default=int(serving.env("SPECDEC_HTTP_PORT") or -1),
                   help="also serve the OpenAI-compatible HTTP API on this port (0 picks a free one; default: off) "
                        "[env SPECDEC_HTTP_PORT]")
    p.add_argument("--served-model-name", default=serving.env("SPECDEC_SERVED_MODEL_NAME"),
                   help="the model id the HTTP API lists and accepts (default: the verify service's model directory name) "
                        "[env SPECDEC_SERVED_MODEL_NAME]")
    p.add_argument("--chat-template", default=serving.env("SPECDEC_CHAT_TEMPLATE"),
                   help="Jinja chat template file for /v1/chat/completions (default: the tokenizer's own) [env SPECDEC_CHAT_TEMPLATE]")


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    def body(self) -> dict:
        return s.error_body(self.message, ERROR_TYPES.get(self.status, "server_error"), self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), self.status, headers)


class ClientGone(Exception):
    pass


def from_grpc(code: grpc.StatusCode, details: str, trailing=()) -> HttpError:
    status = STATUS.get(code, 500)
    param = None
    if status == 400 and (m := re.match(r"[\w.]+", details)):
        param = HTTP_NAMES.get(m.group(), m.group())
        details = param + details[m.end():]
    retry = None
    if status in (429, 503):
        ms = dict(trailing).get(serving.RETRY_AFTER_KEY)
        retry = max(1, math.ceil(int(ms) / 1000)) if ms else 1
    return HttpError(status, details, param, code.name.lower(), retry)


class _Context:
    """What DraftServicer.Generate uses of a grpc.aio ServicerContext, for a call from HTTP."""

    def __init__(self, request_id: str):
        self.metadata = ((serving.REQUEST_ID_KEY, request_id),)
        self.trailing = ()

    def invocation_metadata(self):
        return self.metadata

    def time_remaining(self):
        return None

    def cancelled(self) -> bool:
        return False  # a client that went away cancels the handler's task instead

    def set_trailing_metadata(self, md) -> None:
        self.trailing = tuple(md)

    async def abort(self, code, details):
        raise from_grpc(code, details, self.trailing)


def spec_metrics(st: pb.Stats) -> s.Metrics:
    return s.Metrics(speculative_decoding=s.SpeculativeDecoding(
        num_drafts=st.rounds, num_draft_tokens=st.drafted, num_accepted_tokens=st.accepted,
        num_accepted_tokens_per_pos=list(st.accepted_per_position),
        mean_acceptance_length=1 + st.accepted / st.rounds if st.rounds else 0.0, acceptance_rate=st.acceptance_rate))


def usage(st: pb.Stats) -> s.Usage:
    return s.Usage(prompt_tokens=st.prompt_tokens, completion_tokens=st.generated_tokens,
                   total_tokens=st.prompt_tokens + st.generated_tokens)


class _Reply:
    """Turns the servicer's GenerateResponse chunks into one OpenAI object, or its SSE events."""

    def __init__(self, chat: bool, r: s._Request, request_id: str, model: str, call: dict):
        self.chat, self.r, self.model, self.call = chat, r, model, call
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())

    def _extras(self, st: pb.Stats) -> s.Metrics | None:
        self.call["tokens"] = st.generated_tokens
        return spec_metrics(st) if self.r.return_metrics else None

    async def collect(self, chunks) -> str:
        text, ids = [], []
        async with contextlib.aclosing(chunks):
            async for c in chunks:
                text.append(c.text)
                ids += c.token_ids
                if c.finish_reason:
                    break
            else:
                raise HttpError(500, "internal error: the generation ended without a finish reason")
        head = dict(id=self.id, created=self.created, model=self.model, usage=usage(c.stats), metrics=self._extras(c.stats))
        tail = dict(finish_reason=FINISH[c.finish_reason], token_ids=ids if self.r.return_token_ids else None)
        if self.chat:
            return s.dump(s.ChatCompletion(choices=[s.ChatChoice(message=s.ChatMessage(content="".join(text)), **tail)], **head))
        return s.dump(s.Completion(choices=[s.CompletionChoice(text="".join(text), **tail)], **head))

    def event(self, text: str | None = None, ids: list[int] | None = None, finish: str | None = None, role: bool = False,
              usage: s.Usage | None = None, metrics: s.Metrics | None = None, choices: bool = True) -> str:
        if not choices:
            choice = []
        elif self.chat:
            choice = [s.ChatChunkChoice(delta=s.Delta(role="assistant" if role else None, content=text), finish_reason=finish, token_ids=ids)]
        else:
            choice = [s.CompletionChoice(text=text or "", finish_reason=finish, token_ids=ids)]
        chunk = (s.ChatChunk if self.chat else s.Completion)(id=self.id, created=self.created, model=self.model, choices=choice,
                                                              usage=usage, metrics=metrics)
        return f"data: {s.dump(chunk, null_usage=self.r.include_usage)}\n\n"

    async def sse(self, first: pb.GenerateResponse, chunks):
        """The events: (chat: the role first) the text as it comes, a chunk with the finish reason
        (and metrics), the usage chunk when asked for, then [DONE]. An error after the first
        chunk comes as an error event, as the status line has gone."""
        with_ids = self.r.return_token_ids
        try:
            async with contextlib.aclosing(chunks):
                if self.chat:
                    yield self.event(text="", role=True, ids=[] if with_ids else None)
                c = first
                for _ in range(1 << 31):  # a chunk per round, at most max_tokens of them
                    if c.text or (with_ids and c.token_ids):
                        yield self.event(text=c.text, ids=list(c.token_ids) if with_ids else None)
                    if c.finish_reason:
                        break
                    c = await anext(chunks)
                m = self._extras(c.stats)
                yield self.event(finish=FINISH[c.finish_reason], ids=[] if with_ids else None, metrics=m)
                if self.r.include_usage:
                    yield self.event(usage=usage(c.stats), choices=False)
        except HttpError as e:
            self.call.update(status=e.status, error=e.message)
            yield f"data: {json.dumps(e.body())}\n\n"
        except StopAsyncIteration:
            yield f"data: {json.dumps(HttpError(500, 'internal error: the generation ended without a finish reason').body())}\n\n"
        except asyncio.CancelledError:
            self.call["status"] = CLIENT_GONE
            raise
        yield "data: [DONE]\n\n"


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":  # the body has been read: only a disconnect comes
        pass


async def unless_disconnected(request: Request, aw):
    """Awaits aw, unless the client disconnects first: then aw is cancelled (closing the
    generation, which frees both services' sessions) and ClientGone raised."""
    work, gone = asyncio.ensure_future(aw), asyncio.ensure_future(_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        gone.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.wait((work,))  # its finally blocks run now
    raise ClientGone


class _Observe:
    """ASGI middleware: one `request done` log line per HTTP request (like the gRPC observer's,
    specdec/observe.py) and the request metrics: specdec_http_requests_total by path and status,
    latency, tokens returned."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, call = time.perf_counter(), {"status": 500, "tokens": 0}
        scope["specdec"] = call

        async def send_status(msg):
            if msg["type"] == "http.response.start":
                call["status"] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        except asyncio.CancelledError:
            call["status"] = CLIENT_GONE
            raise
        finally:
            path = scope["path"] if scope["path"] in PATHS else "other"
            status, duration = call["status"], time.perf_counter() - t0
            fields = {"service": "draft", "method": f"{scope['method']} {path}", "request_id": call.get("request_id") or uuid.uuid4().hex,
                      "code": status, "tokens": call["tokens"], "duration_s": round(duration, 6)}
            if "error" in call:
                fields["error"] = call["error"]
            log.log(logging.WARNING if status in (401, 403) else logging.INFO, "request done", extra={"fields": fields})
            metrics.HTTP_REQUESTS.labels(path, str(status)).inc()
            metrics.REQUEST_LATENCY.labels("draft", path).observe(duration)
            if call["tokens"]:
                metrics.GENERATED_TOKENS.labels("draft").inc(call["tokens"])


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # SIGTERM and SIGINT belong to the service's drain (specdec/serving.py), which stops this server


async def _error_response(request: Request, e: Exception) -> Response:
    call = request.scope.get("specdec", {})
    if isinstance(e, ClientGone):
        call["status"] = CLIENT_GONE
        return Response(status_code=CLIENT_GONE)
    if isinstance(e, HTTPException):
        e = HttpError(e.status_code, str(e.detail))
    elif not isinstance(e, HttpError):
        log.exception("internal error in %s", request.url.path)
        e = HttpError(500, f"internal error: {type(e).__name__}: {e}")
    call["error"] = e.message
    return e.response()


class FrontDoor:
    """The HTTP app over a DraftServicer; `start()` serves it, `stop()` drains it."""

    def __init__(self, servicer, args, token_auth=None, model: str = ""):
        """model: the target's name (else the draft's); --served-model-name wins."""
        self.servicer, self.args, self.auth = servicer, args, token_auth
        self.model = getattr(args, "served_model_name", None) or model or servicer.lm.name
        self.accepted = {self.model, model, servicer.lm.name} - {""}  # also the target's and the draft's own names
        self.created = int(time.time())
        self.template = open(args.chat_template).read() if args.chat_template else None  # noqa: SIM115 - read at start-up
        self.draining, self.server, self.task = False, None, None
        errors = {HttpError: _error_response, HTTPException: _error_response, ClientGone: _error_response, Exception: _error_response}
        self.app = Starlette(routes=[Route("/v1/completions", self.completions, methods=["POST"]),
                                     Route("/v1/chat/completions", self.chat, methods=["POST"]),
                                     Route("/v1/models", self.models), Route("/health", self.health)],
                             exception_handlers=errors, middleware=[Middleware(_Observe)])

    async def start(self) -> int:
        """Binds --host:--http-port, serves, prints `http on HOST:PORT`; returns the port."""
        a = self.args
        sock = socket.create_server((a.host, a.http_port), family=socket.AF_INET6 if ":" in a.host else socket.AF_INET)
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off", server_header=False,
                                timeout_graceful_shutdown=max(1, math.ceil(a.drain_s)), ssl_certfile=a.tls_cert, ssl_keyfile=a.tls_key,
                                ssl_ca_certs=a.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED if a.tls_client_ca else ssl.CERT_NONE)
        self.server = _Uvicorn(config)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        for _ in range(3000):  # 30 s at most
            if self.server.started or self.task.done():
                break
            await asyncio.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"the HTTP server did not start: {self.task.exception() if self.task.done() else 'timed out'}")
        port = sock.getsockname()[1]
        print(f"http on {a.host}:{port}", flush=True)
        log.info("serving http", extra={"fields": {"address": f"{a.host}:{port}", "tls": bool(a.tls_cert)}})
        return port

    async def stop(self) -> None:
        """New requests get 503; running ones get the drain period (--drain-s)."""
        self.draining = True
        if self.server is not None:
            self.server.should_exit = True
            await self.task

    # ---- endpoints ----

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "draining" if self.draining else "ok"}, 503 if self.draining else 200)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created, "owned_by": "specdec"}]})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        call = request.scope["specdec"]
        self._authorize(request)
        rid = call["request_id"] = self._request_id(request)
        if self.draining:
            raise HttpError(503, "the service is shutting down", retry_after=1)
        try:
            body = await request.json()
        except ValueError:
            raise HttpError(400, "the body is not valid JSON") from None
        try:
            r = s.parse(s.ChatRequest if chat else s.CompletionRequest, body)
        except s.Refused as e:
            raise HttpError(400, e.message, e.param) from None
        if r.model not in self.accepted:
            raise HttpError(404, f"the model {r.model!r} does not exist; this server serves {self.model!r}", "model", "model_not_found")
        reply = _Reply(chat, r, rid, self.model, call)
        chunks = self.servicer.Generate(self._grpc_request(r, rid, chat), _Context(rid))
        headers = {"X-Request-Id": rid}
        if not r.stream:
            return Response(await unless_disconnected(request, reply.collect(chunks)), media_type="application/json", headers=headers)
        try:  # the first chunk before the status line: errors before any output get their own status
            first = await unless_disconnected(request, anext(chunks))
        except StopAsyncIteration:
            raise HttpError(500, "internal error: the generation ended without output") from None
        return StreamingResponse(reply.sse(first, chunks), media_type="text/event-stream", headers=dict(headers, **{"Cache-Control": "no-cache"}))

    def _authorize(self, request: Request) -> None:
        if self.auth is None:
            return
        refusal = self.auth.check(GENERATE, [("authorization", request.headers.get("authorization", ""))])
        if refusal:
            code, reason = refusal
            raise HttpError(401 if code == C.UNAUTHENTICATED else 403, reason, code="invalid_api_key")

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
        sampling = pb.SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=r.seed)
        req = pb.GenerateRequest(max_new_tokens=max_tokens, sampling=sampling, stop=r.stops, num_draft_tokens=r.num_draft_tokens,
                                 request_id=rid, proposer=PROPOSERS.get(r.proposer, pb.PROPOSER_UNSPECIFIED), adaptive=r.adaptive,
                                 predraft=r.predraft)
        prompt = self._render(r) if chat else r.prompt
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_ids.extend(prompt)
        return req

    def _render(self, r: s.ChatRequest) -> str:
        tok = self.servicer.lm.tokenizer
        if self.template is None and not getattr(tok, "chat_template", None):
            raise HttpError(400, f"the model {self.model!r} has no chat template: use /v1/completions, or start the draft service "
                                 "with --chat-template FILE", "messages", "chat_template_missing")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in r.messages]
        try:
            return tok.apply_chat_template(messages, chat_template=self.template, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template that raises on these messages (jinja's raise_exception)
            raise HttpError(400, f"messages: the chat template refused them: {e}", "messages") from None
