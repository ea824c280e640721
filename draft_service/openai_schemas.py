"""Pydantic schemas of the OpenAI-compatible HTTP front door (draft_service/http.py).

Requests: the OpenAI fields this server implements, plus specdec's own knobs as extra body
fields (`top_k`, `num_draft_tokens`, `tree_budget`, `proposer`, `adaptive`, `predraft`, and `return_metrics`,
`return_token_ids`). Every other field is refused by name (`Refused`, a 400), except that a field
sent as null, or as the value that means "off" (`logprobs: false`, `n: 1`, a zero penalty, ...),
is taken as absent. Responses: the OpenAI objects, serialised by `dump`."""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from specdec.proposal import MAX_ROUND_TOKENS
from specdec.validation import MAX_TAU

# OpenAI fields sent with their "off" value are accepted as if absent
# (a boolean matches a boolean only: `logprobs: 0` asks /v1/completions for the chosen tokens' logprobs, and is refused)
NEUTRAL = {"n": (1,), "best_of": (1,), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,),
           "presence_penalty": (0,), "frequency_penalty": (0,), "parallel_tool_calls": (False, True), "tools": ([],),
           "tool_choice": ("none",), "logit_bias": ({},), "response_format": ({"type": "text"},)}
MAX_TOKENS = 1 << 31


class Refused(Exception):
    """A request the server will not run: 400 with the field (`param`) named."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool = False  # accepted (newer SDKs send it), unused: no obfuscation padding is sent


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1, lt=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)  # OpenAI's range; below 1e-4 it is greedy (http.py)
    top_p: float = Field(1.0, ge=0, le=1)  # 0 keeps only the most probable token: greedy
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # int64 or uint64; a negative one is its uint64 bits
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    # specdec's own knobs (extra body fields; the openai SDK sends them with extra_body)
    top_k: int = Field(0, ge=0, lt=MAX_TOKENS)
    num_draft_tokens: int = Field(0, ge=0, le=MAX_TAU)
    tree_budget: int = Field(0, ge=0, le=MAX_ROUND_TOKENS)  # tree speculation's nodes per round (0: chains)
    proposer: Literal["draft", "lookup", "hybrid"] | None = None
    adaptive: bool | None = None
    predraft: bool | None = None
    return_metrics: bool = False  # the per-request speculative metrics, top-level `metrics`
    return_token_ids: bool = False  # the generated ids in each choice, `token_ids` (vLLM's name)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("one prompt per request (batches of prompts are not supported)")
            v = v[0]
        if not v:
            raise ValueError("empty")
        if isinstance(v, list) and not all(0 <= t < 1 << 31 for t in v):  # int32 on the wire (a larger id was a 500)
            raise ValueError(f"token ids are in [0, {(1 << 31) - 1}]")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=MAX_TOKENS)  # the newer name of max_tokens; wins


def quoted(text, limit: int = 64) -> str:
    """A client's string as an error message quotes it: its repr, cut to `limit` characters with its
    length said (a 16 MiB body can name a model or a field of megabytes; messages are logged)."""
    text = str(text)
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def parse(model: type[_Request], body) -> _Request:
    """The validated request, or Refused naming the first bad field."""
    if not isinstance(body, dict):
        raise Refused("the body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None and not _neutral(k, v)}
    if isinstance(body.get("messages"), list):  # a message's null fields too (the SDK's model_dump() of a reply has several)
        body["messages"] = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in body["messages"]]
    if isinstance(body.get("stream_options"), dict):  # and stream_options' ({"include_usage": null}: absent)
        body["stream_options"] = {k: v for k, v in body["stream_options"].items() if v is not None}
    unknown = [k for k in body if k not in model.model_fields]
    off = [k for k in unknown if k in NEUTRAL]  # a field this server implements at its "off" value only (n: 1)
    if off:
        k = off[0]
        raise Refused(f"{k}: only {' or '.join(json.dumps(v) for v in NEUTRAL[k])} is supported here, got {quoted(json.dumps(body[k]))}", k)
    if unknown:
        names = ", ".join(quoted(k) for k in unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise Refused(f"unsupported field(s): {names} (this server does not implement them)", unknown[0][:64])
    try:
        return model.model_validate(body, strict=True)  # JSON types as sent: no "0.5" for a number, no 1 for a bool
    except ValidationError as e:
        err = _pick(e.errors(), body)
        msg = err["msg"].removeprefix("Value error, ")
        param = ".".join(str(p)[:64] for p, field, _ in _walk(err["loc"], body) if field)[:256] or msg.split(":")[0]  # a nested key is the client's
        if err["type"] == "extra_forbidden":
            raise Refused(f"{param}: unsupported field", param) from None
        raise Refused(msg if msg.startswith(f"{param}:") else f"{param}: {msg[:512]}", param) from None


def _neutral(field: str, v) -> bool:
    """Whether v is the "off" value of an OpenAI field this server does not implement: the same
    JSON type (a number for a number, never a bool or a string for one) and equal."""
    def same_type(off) -> bool:
        if isinstance(off, bool) or isinstance(v, bool):
            return type(v) is type(off)
        return isinstance(v, (int, float)) if isinstance(off, (int, float)) else type(v) is type(off)
    return any(same_type(off) and v == off for off in NEUTRAL.get(field, ()))


def _pick(errors: list[dict], body: dict) -> dict:
    """The error to report: one about a value sent (a role it does not take) first, then a field
    the server does not take (a replayed assistant message's `tool_calls`), then a field left out
    (that message's `content`); and among each, one from the member of a union that is the JSON
    type the client sent (a list of content parts is not told it should be a string)."""
    def rank(err) -> int:
        kind = {"extra_forbidden": 1, "missing": 2}.get(err["type"], 0)
        for p, field, value in _walk(err["loc"], body):
            if not field and not str(p).startswith(type(value).__name__):
                return 3 + kind  # a member of a union that is not what was sent
        return kind

    return min(errors, key=rank)  # the first of the best


def _walk(loc, body):
    """A pydantic error location's parts, each with whether it is the client's (a key or an index
    into what was sent: a nested key named `Name` or `str` too) or names a member of a union
    (`str`, `list[TextPart]`), and the value the part applies to."""
    v = body
    for p in loc:
        if isinstance(v, dict) and isinstance(p, str) and p in v:
            yield p, True, v
            v = v[p]
        elif isinstance(v, list) and isinstance(p, int) and not isinstance(p, bool) and 0 <= p < len(v):
            yield p, True, v
            v = v[p]
        elif isinstance(p, str) and (p[:1].isupper() or "[" in p or p in ("str", "int", "float", "bool")):
            yield p, False, v  # a union's member: the value stays what was sent
        else:
            yield p, True, v  # a field left out (`missing`)
            v = None


# ---- responses ----------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeDecoding(BaseModel):
    """vLLM's spec-decode counters, for one request."""
    num_drafts: int  # verify rounds
    num_draft_tokens: int  # tokens proposed
    num_accepted_tokens: int  # of those, accepted
    num_accepted_tokens_per_pos: list[int]  # [i]: rounds whose proposal i+1 was accepted
    mean_acceptance_length: float  # tokens per round, the verifier's own included (1 + accepted / drafts), as vLLM logs it
    acceptance_rate: float  # accepted / proposed


class Metrics(BaseModel):
    speculative_decoding: SpeculativeDecoding


class _Response(BaseModel):
    """What a completion, a chat completion and a chat chunk carry, in OpenAI's field order; each
    names its own `object` and choices."""
    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: Usage | None = None
    metrics: Metrics | None = None


def _choice(name: str, body: str, kind: type, finish_required: bool = False) -> type[BaseModel]:
    """A choice with its fields in OpenAI's order: index, its body (text, message or delta),
    logprobs, finish_reason (null while streaming, unless required), token_ids."""
    finish = Literal["stop", "length"]
    return create_model(name, index=(int, 0), **{body: (kind, ...)}, logprobs=(None, None),
                        finish_reason=(finish, ...) if finish_required else (finish | None, None), token_ids=(list[int] | None, None))


CompletionChoice = _choice("CompletionChoice", "text", str)


class Completion(_Response):
    """A completion, and (object text_completion too) each streamed chunk of one."""
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


ChatChoice = _choice("ChatChoice", "message", ChatMessage, finish_required=True)


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


ChatChunkChoice = _choice("ChatChunkChoice", "delta", Delta)


class ChatChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


def dump(m: BaseModel, null_usage: bool = False) -> str:
    """Compact JSON as OpenAI sends it: `metrics` and `token_ids` only when asked for, a delta's
    unset fields left out, `usage` null on stream chunks when include_usage is on (else absent)."""
    d = m.model_dump()
    for key in ("usage", "metrics"):
        if d.get(key, 0) is None and not (key == "usage" and null_usage):
            del d[key]
    for c in d["choices"]:
        if c.get("token_ids", 0) is None:
            del c["token_ids"]
        if "delta" in c:
            c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
    return json.dumps(d, ensure_ascii=False, separators=(",", ":"))


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
