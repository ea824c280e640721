"""The HTTP front door's bridge to the servicer (draft_service/http.py): gRPC statuses as HTTP
errors in OpenAI's shape, the stand-in for the gRPC context that DraftServicer.Generate runs with,
and `Reply`, which turns the servicer's GenerateResponse chunks into one OpenAI object or its SSE
events."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time

import grpc
from starlette.responses import JSONResponse

from draft_service import openai_schemas as s
from specdec import serving
from specdec.v1 import specdec_pb2 as pb

FINISH = {pb.FINISH_REASON_EOS: "stop", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
          pb.FINISH_REASON_CONTEXT: "length"}
C = grpc.StatusCode
STATUS = {C.INVALID_ARGUMENT: 400, C.OUT_OF_RANGE: 400, C.NOT_FOUND: 404, C.UNAUTHENTICATED: 401, C.PERMISSION_DENIED: 403,
          C.RESOURCE_EXHAUSTED: 429, C.UNAVAILABLE: 503, C.DEADLINE_EXCEEDED: 504}
ERROR_TYPES = {400: "invalid_request_error", 413: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable"}
# the GenerateRequest fields validation messages name, as the HTTP request names them
HTTP_NAMES = {"max_new_tokens": "max_tokens", "sampling.temperature": "temperature", "sampling.top_p": "top_p",
              "prompt_ids": "prompt", "request_id": "X-Request-Id"}
FIELDS = set(s.CompletionRequest.model_fields) | set(s.ChatRequest.model_fields)
CLIENT_GONE = 499  # logged for a client that disconnected (nginx's code; never sent)


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, retry_after: int | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after
        self.headers = dict(headers or {})

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if 400 <= self.status < 500 else "server_error")
        return s.error_body(self.message, kind, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = dict(self.headers, **({"Retry-After": str(self.retry_after)} if self.retry_after else {}))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), self.status, headers)


class ClientGone(Exception):
    pass


def http_names(chat: bool, r: s._Request) -> dict[str, str]:
    """HTTP_NAMES for one request: a chat request's prompt is its messages, and its token limit the
    field it sent (max_completion_tokens, else max_tokens)."""
    if not chat:
        return HTTP_NAMES
    limit = "max_completion_tokens" if getattr(r, "max_completion_tokens", None) else "max_tokens"
    return dict(HTTP_NAMES, prompt="messages", prompt_ids="messages", max_new_tokens=limit)


def from_grpc(code: grpc.StatusCode, details: str, trailing=(), names: dict[str, str] = HTTP_NAMES) -> HttpError:
    status = STATUS.get(code, 500)
    param = None
    if status == 400 and (m := re.match(r"[\w.]+", details)):  # validation's messages start with the field's name
        param = names.get(m.group(), m.group() if m.group() in FIELDS else None)
        details = (param or m.group()) + details[m.end():]
    retry, headers, trailers = None, {}, dict(trailing)
    if status in (429, 503):
        if trailers.get(serving.PUSHBACK_KEY) == "-1":  # no wait cures it (too large): no Retry-After, and the OpenAI
            headers["x-should-retry"] = "false"  # SDKs, which retry every 429 and 5xx, are told not to
        else:
            ms = trailers.get(serving.RETRY_AFTER_KEY)
            retry = max(1, math.ceil(int(ms) / 1000)) if ms else 1
    return HttpError(status, details, param, code.name.lower(), retry, headers)


class Context:
    """What DraftServicer.Generate uses of a grpc.aio ServicerContext, for a call from HTTP."""

    def __init__(self, request_id: str, names: dict[str, str] = HTTP_NAMES):
        """names: the request's fields as HTTP names them (http_names), for the errors it gets."""
        self.metadata = ((serving.REQUEST_ID_KEY, request_id),)
        self.trailing = ()
        self.names = names

    def invocation_metadata(self):
        return self.metadata

    def time_remaining(self):
        return None

    def cancelled(self) -> bool:
        return False  # a client that went away cancels the handler's task instead

    def set_trailing_metadata(self, md) -> None:
        self.trailing = tuple(md)

    async def abort(self, code, details):
        raise from_grpc(code, details, self.trailing, self.names)


def spec_metrics(st: pb.Stats) -> s.Metrics:
    return s.Metrics(speculative_decoding=s.SpeculativeDecoding(
        num_drafts=st.rounds, num_draft_tokens=st.drafted, num_accepted_tokens=st.accepted,
        num_accepted_tokens_per_pos=list(st.accepted_per_position),
        mean_acceptance_length=1 + st.accepted / st.rounds if st.rounds else 0.0, acceptance_rate=st.acceptance_rate))


def usage(st: pb.Stats) -> s.Usage:
    return s.Usage(prompt_tokens=st.prompt_tokens, completion_tokens=st.generated_tokens,
                   total_tokens=st.prompt_tokens + st.generated_tokens)


class Reply:
    """Turns the servicer's GenerateResponse chunks into one OpenAI object, or its SSE events."""

    def __init__(self, chat: bool, r: s._Request, request_id: str, model: str, call: dict, door=None):
        """door: the FrontDoor, whose drain ends a running stream with an error event (its `cut`
        Event, set just before the grace ends); None: no drain."""
        self.chat, self.r, self.model, self.call, self.door = chat, r, model, call, door
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())

    def _extras(self, st: pb.Stats) -> s.Metrics | None:
        return spec_metrics(st) if self.r.return_metrics else None

    def _got(self, c: pb.GenerateResponse) -> None:
        """Counts a chunk's tokens for the request's log line and specdec_generated_tokens_total as it
        comes, so a stream that fails or whose client leaves counts what it generated."""
        self.call["tokens"] = self.call.get("tokens", 0) + len(c.token_ids)
        if c.finish_reason:  # the request's log line carries what the gRPC one does (specdec/observe.py)
            st = c.stats
            self.call["fields"] = dict(rounds=st.rounds, finish_reason=pb.FinishReason.Name(c.finish_reason).removeprefix("FINISH_REASON_").lower(),
                                       prompt_tokens=st.prompt_tokens, **(dict(accepted=st.accepted, drafted=st.drafted) if st.drafted else {}))

    async def collect(self, chunks) -> str:
        """The whole reply. The chunks are read to their end, past the finish: the servicer then
        closes its verify session in order (server.py `_ended`), as for a gRPC client, not by a cancel."""
        text, ids, c = [], [], None
        async with contextlib.aclosing(chunks):
            async for got in chunks:
                if c is None or not c.finish_reason:
                    c = got
                    self._got(c)
                    text.append(c.text)
                    ids += c.token_ids
            if c is None or not c.finish_reason:
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
        (and metrics), the usage chunk when asked for, then [DONE] once the chunks have ended (as
        `collect` reads them). An error after the first chunk comes as an error event, as the
        status line has gone."""
        with_ids, done = self.r.return_token_ids, False
        try:
            async with contextlib.aclosing(chunks):
                if self.chat:
                    yield self.event(text="", role=True, ids=[] if with_ids else None)
                async for c in _until_cut(_chain(first, chunks), None if self.door is None else self.door.cut):
                    if done:
                        continue
                    self._got(c)
                    if c.text or (with_ids and c.token_ids):
                        yield self.event(text=c.text, ids=list(c.token_ids) if with_ids else None)
                    if c.finish_reason:
                        done = True
                        yield self.event(finish=FINISH[c.finish_reason], ids=[] if with_ids else None, metrics=self._extras(c.stats))
                        if self.r.include_usage:
                            yield self.event(usage=usage(c.stats), choices=False)
                if not done:
                    raise HttpError(500, "internal error: the generation ended without a finish reason")
        except HttpError as e:
            self.call.update(status=e.status, error=e.message)
            yield f"data: {json.dumps(e.body())}\n\n"
        except _Cut:  # the drain's grace is ending (FrontDoor.stop): an error event and [DONE], as a gRPC stream ends
            # UNAVAILABLE then, where uvicorn's own cancel at the grace's end cut the connection mid-event
            if done:  # after the finish (the servicer was ending its verify session): the reply is whole
                yield "data: [DONE]\n\n"
                return
            e = HttpError(503, "the service is shutting down (its drain's grace ended); retry", code="unavailable")
            self.call.update(status=e.status, error=e.message)
            yield f"data: {json.dumps(e.body())}\n\n"
        except asyncio.CancelledError:
            self.call["status"] = CLIENT_GONE
            raise
        yield "data: [DONE]\n\n"


class _Cut(Exception):
    """A stream the drain ends (`_until_cut`)."""


async def _until_cut(items, cut: asyncio.Event | None):
    """items' items until `cut` is set, then _Cut (the item being made is cancelled: the
    generation ends, its verify session freed). Each item is awaited in a task of its own, raced
    with the cut; with no cut (None), items as they are."""
    if cut is None:
        async for item in items:
            yield item
        return
    waiter = asyncio.ensure_future(cut.wait())
    try:
        while True:
            nxt = asyncio.ensure_future(anext(items))
            cancelled = None  # this task's own cancel, while the item's task ends
            try:
                await asyncio.wait((nxt, waiter), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError as e:
                cancelled = e
            if not nxt.done():  # the cut, or this task's own cancel: the item's task ends first (its cleanup
                nxt.cancel()  # runs whole), so that `items` may be closed after, not while it runs
                while not nxt.done():
                    try:
                        await asyncio.wait((nxt,))
                    except asyncio.CancelledError as e:
                        cancelled = e
            if cancelled is not None:
                raise cancelled
            if nxt.cancelled():
                if cut.is_set():
                    raise _Cut
                raise asyncio.CancelledError  # the item's own cancel (a call cancelled under it): not the drain's
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        waiter.cancel()
        if waiter.done() and not waiter.cancelled():
            waiter.exception()  # retrieved (an Event of another loop's raised RuntimeError)


async def _chain(first, rest):
    yield first
    async for c in rest:
        yield c
