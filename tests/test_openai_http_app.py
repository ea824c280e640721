"""The HTTP front door's app in-process (starlette's TestClient) over a stub servicer: what the
real pair (tests/test_openai_http.py) cannot show cheaply, i.e. chat templates missing or given
with --chat-template, and the statuses of a full or unreachable verify service (429/503 with
Retry-After, through serving.fail, the path the real servicer takes; none where no wait helps), and an error after the
stream has started."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from bench.tinymodels import word_tokenizer
from draft_service.http import FrontDoor
from specdec import serving
from specdec.errors import Refusal, RequestError
from specdec.validation import parse_generate
from specdec.v1 import specdec_pb2 as pb


class Stub:
    """A DraftServicer stand-in: records the GenerateRequests and answers two chunks, or fails
    (before any output, or after the first chunk) the way the servicer does."""

    def __init__(self, tokenizer, fail: Refusal | None = None, fail_after_first: bool = False, retry: bool = True):
        self.lm = SimpleNamespace(name="stub", tokenizer=tokenizer)
        self.max_context = 64
        self.fail, self.fail_after_first, self.retry = fail, fail_after_first, retry
        self.requests: list[pb.GenerateRequest] = []

    async def stream(self, request, context):  # what the front door streams (DraftServicer.stream)
        self.requests.append(request)
        try:
            if self.fail_after_first:
                yield pb.GenerateResponse(token_ids=[3], text="w3")
            if self.fail:
                raise RequestError(self.fail, "upstream: the verify service is full", retry=self.retry)
            yield pb.GenerateResponse(token_ids=[3], text="w3")
            yield pb.GenerateResponse(token_ids=[4], text=" w4", finish_reason=pb.FINISH_REASON_LENGTH,
                                      stats=pb.Stats(prompt_tokens=2, generated_tokens=2, rounds=1))
        except Exception as e:  # noqa: BLE001 - as DraftServicer.stream does
            await serving.fail(context, "draft", "Generate", e)


def args(template_file=None, served=None) -> SimpleNamespace:
    return SimpleNamespace(chat_template=template_file, host="127.0.0.1", http_port=0, drain_s=1, tls_cert=None, tls_key=None,
                           tls_client_ca=None, served_model_name=served, max_message_bytes=4096)


def client(stub, template_file=None, served=None) -> TestClient:
    return TestClient(FrontDoor(stub, args(template_file, served), model="the-target").app)


def test_served_model_name_is_listed_and_the_models_own_names_accepted():
    c = client(Stub(word_tokenizer(16)), served="specdec")
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["specdec"]
    for name in ("specdec", "the-target", "stub"):
        assert c.post("/v1/completions", json={"model": name, "prompt": "w3"}).json()["model"] == "specdec"
    assert c.post("/v1/completions", json={"model": "other", "prompt": "w3"}).status_code == 404


def test_a_draft_started_before_its_verify_service_serves_the_targets_name_once_known():
    """The draft knew no target at start-up: the id is the draft's until the verify service
    answers, then the target's (README's examples name the target), the draft's still accepted;
    meanwhile another id is a 503 to retry (it may be the target's)."""
    stub = Stub(word_tokenizer(16))
    stub.target = None
    c = TestClient(FrontDoor(stub, args(), model="").app)
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["stub"]
    # from a review: a 404 (which the SDK does not retry) for the id README names, until the verify service answers
    for r in (c.post("/v1/completions", json={"model": "late-target", "prompt": "w3"}), c.get("/v1/models/late-target")):
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "until the verify service first answers" in r.text, r.text
    stub.target = pb.ModelInfo(model_name="late-target")  # what DraftServicer.set_target keeps when it first answers
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["late-target"]
    assert c.post("/v1/completions", json={"model": "other", "prompt": "w3"}).status_code == 404  # known now: not served
    for name in ("late-target", "stub"):
        r = c.post("/v1/completions", json={"model": name, "prompt": "w3"})
        assert r.status_code == 200 and r.json()["model"] == "late-target"


CHAT = {"model": "stub", "messages": [{"role": "user", "content": "w7"}], "max_tokens": 2}


def test_a_chat_template_that_does_not_compile_fails_the_start_up(tmp_path):
    """From a review: a --chat-template with a Jinja syntax error started; every chat then got a
    400 blaming its messages. The start-up refuses it, naming the flag and the line."""
    from specdec.startup import StartupError

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }{% endfor %}")
    with pytest.raises(StartupError, match=r"--chat-template .*bad.jinja: not a chat template transformers can compile \(.*line 2\)"):
        FrontDoor(Stub(word_tokenizer(16)), args(str(bad)))
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")  # transformers' own tags
    FrontDoor(Stub(word_tokenizer(16)), args(str(good)))


def test_a_model_without_a_chat_template_gets_a_clear_400():
    stub = Stub(word_tokenizer(16))
    r = client(stub).post("/v1/chat/completions", json=CHAT)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "chat_template_missing" and "--chat-template" in err["message"]
    assert not stub.requests
    assert client(stub).post("/v1/completions", json={"model": "stub", "prompt": "w3", "max_tokens": 2}).status_code == 200


def test_chat_template_flag_renders_the_messages(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}w5 {{ m['content'] }} {% endfor %}w6")
    stub = Stub(word_tokenizer(16))
    r = client(stub, str(path)).post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "w3 w4"
    assert stub.requests[0].prompt == "w5 w7 w6" and stub.requests[0].max_new_tokens == 2


def test_a_chat_prompt_carries_the_templates_special_tokens_only(tmp_path):
    """A template that writes the BOS itself (Llama-3's, Gemma's): the prompt the servicer
    validates is the template's tokens, as transformers' apply_chat_template(tokenize=True) gives
    them, not the tokenizer's BOS in front of the template's."""
    tok = word_tokenizer(16, bos=True)
    tok.chat_template = "{{ bos_token }}{% for m in messages %}w5 {{ m['content'] }} {% endfor %}w6"
    stub = Stub(tok)
    assert client(stub).post("/v1/chat/completions", json=CHAT).status_code == 200
    messages = [{"role": "user", "content": "w7"}]
    want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)  # a BatchEncoding in transformers 5
    got = parse_generate(stub.requests[0], tok, 16, 64).prompt_ids
    assert got == want and got.count(3) == 1, got  # id 3: <bos>
    assert client(stub).post("/v1/completions", json={"model": "stub", "prompt": "w7"}).status_code == 200
    assert parse_generate(stub.requests[1], tok, 16, 64).prompt_ids == [3, 7]  # a completion's prompt takes the tokenizer's BOS


def test_bodies_that_are_not_json_text_are_400s_that_say_why():
    stub = Stub(word_tokenizer(16))
    c = client(stub)
    for body, why in ((b'{"model": "stub", "prompt": "w3 \xff"}', "not valid JSON"),  # not UTF-8
                      (b'{"model": "stub", "prompt": "w3 \\ud800"}', "lone surrogate"),  # UTF-8, but no Unicode string
                      (b'{"model": "stub", "prompt": "w3 \xed\xa0\x80"}', "lone surrogate")):  # a surrogate's bytes: json takes them
        r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert not stub.requests


def test_405_keeps_allow_and_is_a_client_error():
    r = client(Stub(word_tokenizer(16))).get("/v1/completions")
    assert r.status_code == 405 and "POST" in r.headers["Allow"]
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("code,status", [(Refusal.RESOURCE_EXHAUSTED, 429), (Refusal.UNAVAILABLE, 503)])
@pytest.mark.parametrize("stream", [False, True])
def test_a_full_or_unreachable_service_answers_with_retry_after(code, status, stream):
    r = client(Stub(word_tokenizer(16), fail=code)).post("/v1/completions", json={"model": "stub", "prompt": "w3", "stream": stream})
    assert r.status_code == status and r.headers["Retry-After"] == str(serving.RETRY_AFTER_MS // 1000 if status == 429 else 1)
    assert r.json()["error"]["message"] == "upstream: the verify service is full"


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_no_wait_can_fit_answers_429_without_retry_after(stream):
    """Larger than every verify replica's whole cache (gRPC's pushback -1): 429, but no
    Retry-After, since no wait makes room for it."""
    stub = Stub(word_tokenizer(16), fail=Refusal.RESOURCE_EXHAUSTED, retry=False)
    r = client(stub).post("/v1/completions", json={"model": "stub", "prompt": "w3", "stream": stream})
    assert r.status_code == 429 and "Retry-After" not in r.headers


def test_an_error_after_the_first_chunk_is_an_error_event_then_done():
    r = client(Stub(word_tokenizer(16), fail=Refusal.UNAVAILABLE, fail_after_first=True)).post(
        "/v1/completions", json={"model": "stub", "prompt": "w3", "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "w3"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "unavailable"


def test_http_errors_and_partly_streamed_tokens_are_counted_as_over_grpc():
    """specdec_request_errors_total counts the HTTP door's server-side errors (as the gRPC status
    they stand for, so the error alert sees them), and a stream that fails after a chunk counts
    that chunk's tokens in specdec_generated_tokens_total (it counted none); a reply that fails
    returns, and counts, none."""
    from prometheus_client import REGISTRY

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    errors = dict(service="draft", method="/v1/completions", code="UNAVAILABLE")
    before, tokens = value("specdec_request_errors_total", **errors), value("specdec_generated_tokens_total", service="draft")
    r = client(Stub(word_tokenizer(16), fail=Refusal.UNAVAILABLE)).post("/v1/completions", json={"model": "stub", "prompt": "w3"})
    assert r.status_code == 503 and value("specdec_request_errors_total", **errors) == before + 1
    r = client(Stub(word_tokenizer(16), fail=Refusal.UNAVAILABLE, fail_after_first=True)).post(
        "/v1/completions", json={"model": "stub", "prompt": "w3", "stream": True})
    assert r.status_code == 200 and '"error"' in r.text
    assert value("specdec_generated_tokens_total", service="draft") == tokens + 1
    # from a review: a non-streamed reply that fails after a chunk returns no tokens, and counted that chunk's
    r = client(Stub(word_tokenizer(16), fail=Refusal.UNAVAILABLE, fail_after_first=True)).post(
        "/v1/completions", json={"model": "stub", "prompt": "w3"})
    assert r.status_code == 503 and value("specdec_generated_tokens_total", service="draft") == tokens + 1
    # a client's mistake is counted as the code the error alert leaves out (deploy/k8s/components/monitoring/alerts.yaml)
    missing = dict(service="draft", method="/v1/completions", code="NOT_FOUND")
    before = value("specdec_request_errors_total", **missing)
    r = client(Stub(word_tokenizer(16))).post("/v1/completions", json={"model": "no-such-model", "prompt": "w3"})
    assert r.status_code == 404 and value("specdec_request_errors_total", **missing) == before + 1


def test_a_body_over_max_message_bytes_is_a_413():
    from prometheus_client import REGISTRY

    def errors(code):
        return REGISTRY.get_sample_value("specdec_request_errors_total", dict(service="draft", method="/v1/completions", code=code)) or 0.0

    before = errors("RESOURCE_EXHAUSTED"), errors("UNIMPLEMENTED")
    stub = Stub(word_tokenizer(16))
    r = client(stub).post("/v1/completions", json={"model": "stub", "prompt": "w3 " * 2000})
    assert r.status_code == 413 and "--max-message-bytes" in r.json()["error"]["message"] and not stub.requests
    assert client(stub).get("/v1/completions").status_code == 405
    # from a review: logged as RESOURCE_EXHAUSTED and UNIMPLEMENTED, but not counted as errors
    assert (errors("RESOURCE_EXHAUSTED"), errors("UNIMPLEMENTED")) == (before[0] + 1, before[1] + 1)


def test_prompts_and_chats_past_the_context_are_refused_before_they_are_validated():
    """From a review: a body of millions of ids or of 520,000 messages went through pydantic,
    protobuf and the chat template (seconds each, holding the GIL: every stream and /health
    stalled) before the servicer refused it by its length. The front door now refuses it by its
    length first: the stub, which checks nothing, never sees it."""
    tok = word_tokenizer(16)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    stub = Stub(tok)  # a context of 64 tokens
    c = TestClient(FrontDoor(stub, SimpleNamespace(**{**vars(args()), "max_message_bytes": 16 << 20}), model="the-target").app)
    longest = max(len(t) for t in tok.get_vocab())
    for path, body, says in (
            ("/v1/completions", {"model": "stub", "prompt": [3] * 65}, "prompt: 65 token ids are more than the context limit of 64"),
            ("/v1/completions", {"model": "stub", "prompt": "w3" * (2 * longest * 64 + 1)}, "characters are far more than"),
            # a batch of one prompt, which the schema unwraps (from a review: it went through pydantic); a batch of more, its own error
            ("/v1/completions", {"model": "stub", "prompt": [[3] * 65]}, "prompt: 65 token ids are more than the context limit of 64"),
            ("/v1/completions", {"model": "stub", "prompt": ["w3" * (2 * longest * 64 + 1)]}, "characters are far more than"),
            ("/v1/completions", {"model": "stub", "prompt": ["w3"] * 65}, "one prompt per request"),
            ("/v1/chat/completions", {"model": "stub", "messages": [{"role": "user", "content": "w3"}] * 65},
             "messages: 65 messages are more than"),
            # from a review: a stray "prompt" batch in a chat body skipped the messages' check
            ("/v1/chat/completions", {"model": "stub", "prompt": ["a", "b"], "messages": [{"role": "user", "content": "w3"}] * 65},
             "messages: 65 messages are more than"),
            ("/v1/chat/completions", {"model": "stub", "messages": [{"role": "user", "content": [{"type": "text", "text": "w3" * 700}]}] * 20},
             "characters of content are far more than")):
        r = c.post(path, json=body)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert not stub.requests
    assert c.post("/v1/completions", json={"model": "stub", "prompt": [3] * 60, "max_tokens": 2}).status_code == 200  # fits
    r = c.post("/v1/completions", json={"model": "stub", "prompt": "w3 " * 100_000})  # past what any request within the context takes
    assert r.status_code == 413 and "within the context of 64 tokens" in r.json()["error"]["message"], r.text


def test_served_connections_have_tcp_nodelay():
    """Without TCP_NODELAY a response's body waits for the client's delayed ACK of its headers
    (Nagle): a fixed 40 ms per request on Linux, measured before the fix (bench/results/HTTP.md)."""
    async def go():
        front = FrontDoor(Stub(word_tokenizer(16)), args())
        port = await front.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        socks = [c.transport.get_extra_info("socket") for c in front.server.server_state.connections]
        flags = [sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for sock in socks]
        writer.close()
        await front.stop()
        return flags

    flags = asyncio.run(go())
    assert len(flags) == 1 and flags[0]


def test_a_connection_past_max_connection_age_is_closed_after_its_response():
    """From a review: --max-connection-age-s closed gRPC connections (clients re-resolve and reach
    the draft pods an autoscaler added) but an HTTP keep-alive connection stayed on its pod for as
    long as its client kept it busy. Its first response past the age now says Connection: close."""
    async def go():
        a = args()
        a.max_connection_age_s = 0.5
        front = FrontDoor(Stub(word_tokenizer(16)), a)
        port = await front.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        heads = []
        for wait in (0.0, 0.7):  # the second request past the connection's age
            await asyncio.sleep(wait)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head = (await reader.readuntil(b"\r\n\r\n")).lower()
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.startswith(b"content-length")))
            await reader.readexactly(length)
            heads.append(head)
        closed = await asyncio.wait_for(reader.read(), 5) == b""  # the server closed it
        writer.close()
        # from a review: the age was kept by the client's address as uvicorn's proxy headers rewrote it, so two
        # connections naming one X-Forwarded-For shared an age: a new one was closed after its first response
        forwarded = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 10.1.2.3\r\n\r\n")
            forwarded.append((await reader.readuntil(b"\r\n\r\n")).lower())
            writer.close()
            await asyncio.sleep(0.7)
        await front.stop()
        return heads, closed, forwarded

    heads, closed, forwarded = asyncio.run(go())
    assert b"connection: close" not in heads[0] and b"connection: close" in heads[1] and closed, heads
    assert not [h for h in forwarded if b"connection: close" in h], forwarded


class Slow(Stub):
    """Streams a chunk every 20 ms, for at most 30 s: a generation the drain outlasts."""

    async def stream(self, request, context):
        self.requests.append(request)
        for _ in range(1500):
            yield pb.GenerateResponse(token_ids=[3], text="w3")
            await asyncio.sleep(0.02)
        yield pb.GenerateResponse(token_ids=[4], text=" w4", finish_reason=pb.FINISH_REASON_LENGTH)


def test_the_drain_ends_a_running_stream_with_an_error_event_then_done():
    """From a review: at the end of the drain's grace uvicorn cancelled a running SSE stream and
    closed its connection mid-event (the SDK's APIConnectionError; two ERROR lines with a
    traceback). Just before the grace ends, the stream now ends with an error event saying the
    service is shutting down, then [DONE], as a gRPC stream ends UNAVAILABLE."""
    async def go():
        front = FrontDoor(Slow(word_tokenizer(16)), args())  # drain_s 1
        port = await front.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"model": "stub", "prompt": "w3", "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await reader.readuntil(b"data: ")  # the stream has started
        t0 = time.monotonic()
        stop = asyncio.create_task(front.stop())
        rest = await asyncio.wait_for(reader.read(), 10)  # to the connection's end
        await stop
        writer.close()
        return rest.decode(), time.monotonic() - t0

    rest, took = asyncio.run(go())
    events = [e for e in rest.replace("\r\n", "\n").split("\n\n") if "data: " in e]
    assert events[-1].strip().endswith("data: [DONE]"), rest[-500:]
    err = json.loads(events[-2].split("data: ", 1)[1].strip().splitlines()[0])
    assert err["error"]["code"] == "unavailable" and "shutting down" in err["error"]["message"], err
    assert took < 5, took


class Silent(Stub):
    """Yields nothing for 30 s (a queued request, or a long prefill), then finishes."""

    async def stream(self, request, context):
        self.requests.append(request)
        await asyncio.sleep(30)
        yield pb.GenerateResponse(token_ids=[4], text=" w4", finish_reason=pb.FINISH_REASON_LENGTH)


@pytest.mark.parametrize("servicer,stream", [(Slow, False), (Silent, True)])
def test_the_drain_answers_a_reply_not_yet_begun_with_a_503(servicer, stream, caplog):
    """From a review: the drain's cut reached only SSE streams that had begun. A non-streamed
    reply, or a stream still waiting for its first chunk, was cancelled by uvicorn at the grace's
    end: a plain-text 500 and an ASGI traceback in the log. No status line has gone out there, so
    the cut now answers them a 503 in OpenAI's shape, and ends their generation."""
    async def go():
        stub = servicer(word_tokenizer(16))
        front = FrontDoor(stub, args())  # drain_s 1
        port = await front.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"model": "stub", "prompt": "w3", "stream": stream, "max_tokens": 5000}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        while not stub.requests:  # the generation has begun
            await asyncio.sleep(0.01)
        stop = asyncio.create_task(front.stop())
        reply = await asyncio.wait_for(reader.read(), 10)
        await stop
        writer.close()
        return reply.decode()

    with caplog.at_level(logging.INFO):
        reply = asyncio.run(go())
    head, _, body = reply.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 503") and "retry-after: 1" in head.lower(), head
    err = json.loads(body)["error"]
    assert err["code"] == "unavailable" and "shutting down" in err["message"], err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_http_port_is_off_by_default_and_read_from_the_environment(monkeypatch):
    import argparse

    from draft_service.__main__ import add_http_args

    def parsed():
        p = argparse.ArgumentParser()
        add_http_args(p)
        return p.parse_args([])

    monkeypatch.delenv("SPECDEC_HTTP_PORT", raising=False)
    assert parsed().http_port is None  # off: __main__ starts no front door
    monkeypatch.setenv("SPECDEC_HTTP_PORT", "8000")
    assert parsed().http_port == 8000


def test_a_large_body_is_read_as_a_small_one():
    """Bodies past validation.LARGE_REQUEST are parsed (and a chat's template rendered) in a worker
    thread, not on the event loop that serves every other call: the same request, the same
    answers, the same errors."""
    from specdec.validation import LARGE_REQUEST

    stub = Stub(word_tokenizer(16))
    stub.max_context = 1 << 20  # a prompt of this size fits
    big = SimpleNamespace(**{**vars(args()), "max_message_bytes": 16 << 20})
    c = TestClient(FrontDoor(stub, big, model="the-target").app)
    prompt = "w3 " * (LARGE_REQUEST // 3 + 10)
    r = c.post("/v1/completions", json={"model": "stub", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200 and stub.requests[-1].prompt == prompt and stub.requests[-1].max_new_tokens == 2
    assert c.post("/v1/completions", json={"model": "other", "prompt": prompt}).status_code == 404
    bad = c.post("/v1/completions", content=b'{"model": "stub", "prompt": "' + b"w3 " * LARGE_REQUEST, headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]


def test_top_p_zero_is_greedy_a_negative_seed_is_its_64_bits_and_types_are_strict():
    """OpenAI's API takes top_p in [0, 1] and a signed seed: top_p 0 (only the most probable token)
    becomes a greedy request (gRPC's top_p 0 would mean unset), and seed -1 the uint64 of its bits;
    out-of-range values and values of the wrong JSON type are 400s that name the field."""
    stub = Stub(word_tokenizer(16))
    c = client(stub)
    assert c.post("/v1/completions", json={"model": "stub", "prompt": "w3", "top_p": 0, "temperature": 0.7, "seed": -1}).status_code == 200
    s = stub.requests[-1].sampling
    assert (s.temperature, s.top_p, s.seed) == (0.0, 1.0, (1 << 64) - 1)
    assert c.post("/v1/completions", json={"model": "stub", "prompt": "w3", "top_p": 1e-50}).status_code == 200  # 0 in float32
    assert stub.requests[-1].sampling.temperature == 0.0
    assert c.post("/v1/completions", json={"model": "stub", "prompt": "w3", "top_p": 0.5, "seed": 5}).status_code == 200
    s = stub.requests[-1].sampling
    assert (s.temperature, s.top_p, s.seed) == (1.0, 0.5, 5)
    # out of range, or of another JSON type (strings and bools were coerced to numbers before)
    for field, value in (("top_p", -0.1), ("top_p", 1.5), ("seed", -(1 << 63) - 1), ("seed", 1 << 64), ("temperature", "0.5"),
                         ("max_tokens", "8"), ("max_tokens", 2.0), ("stream", 1), ("seed", True)):
        r = c.post("/v1/completions", json={"model": "stub", "prompt": "w3", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.json()


class Ending(Stub):
    """A Stub whose stream notes that it ran past its last chunk, as the servicer's does to close
    its verify session in order (draft_service/server.py `_ended`)."""
    ended = False

    async def stream(self, request, context):
        async for c in super().stream(request, context):
            yield c
        self.ended = True


@pytest.mark.parametrize("stream", [False, True])
def test_a_finished_reply_reads_the_generation_to_its_end(stream):
    """The reply reads the chunks past the finish chunk to their end: the servicer half-closes its
    verify session then, so the verifier counts it OK; closing the generator at its last chunk
    cancelled the session instead (CANCELLED in the verifier's log, a stop-string end every time)."""
    stub = Ending(word_tokenizer(16))
    r = client(stub).post("/v1/completions", json={"model": "stub", "prompt": "w3", "stream": stream,
                                                   "stream_options": {"include_usage": True} if stream else None})
    assert r.status_code == 200 and stub.ended
    if stream:
        events = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
        assert [e["choices"][0]["finish_reason"] if e["choices"] else "usage" for e in events] == [None, None, "length", "usage"]
        assert r.text.endswith("data: [DONE]\n\n")
    else:
        assert r.json()["choices"][0]["text"] == "w3 w4" and r.json()["choices"][0]["finish_reason"] == "length"


class Endless(Stub):
    """A Stub whose stream is long and its chunks large (a client that does not read fills the
    socket's buffers in a few of them), and which notes when it is closed."""
    client_write_timeout_s = 1.0
    closed = False

    async def stream(self, request, context):
        try:
            for _ in range(2000):
                yield pb.GenerateResponse(token_ids=[3], text="w3 " * 20000)
            yield pb.GenerateResponse(token_ids=[4], text=" w4", finish_reason=pb.FINISH_REASON_LENGTH, stats=pb.Stats())
        finally:
            self.closed = True


def _value(name, **labels) -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_streaming_client_that_stops_reading_is_ended_and_its_generation_closed():
    """An HTTP client that stops reading its stream, its connection open, held its generation (and
    its sessions on both services) for as long as it liked; past --client-write-timeout-s without
    an event taken, the request ends (504 in the log and the error counts, as gRPC's DEADLINE_EXCEEDED)."""
    deadline = dict(service="draft", method="/v1/completions", code="DEADLINE_EXCEEDED")
    before = _value("specdec_request_errors_total", **deadline)

    async def go():
        stub = Endless(word_tokenizer(16))
        front = FrontDoor(stub, args())
        port = await front.start()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        body = json.dumps({"model": "stub", "prompt": "w3", "stream": True}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        await asyncio.get_running_loop().sock_sendall(sock, head.encode() + body)
        for _ in range(300):  # 30 s at most; reading nothing meanwhile
            if stub.closed:
                break
            await asyncio.sleep(0.1)
        closed = stub.closed  # before the stop, which closes every generation anyway
        sock.close()
        await front.stop()
        return closed

    assert asyncio.run(go())
    assert _value("specdec_request_errors_total", **deadline) == before + 1


def test_a_client_gone_before_its_body_is_in_is_a_499_not_a_server_error():
    """A client that closes its connection halfway through sending its body is a client that left
    (499 in the log), not an internal error with a traceback counted by the error alert."""
    gone = dict(path="/v1/completions", status="499")
    internal = dict(service="draft", method="/v1/completions", code="INTERNAL")
    before = _value("specdec_http_requests_total", **gone), _value("specdec_request_errors_total", **internal)

    async def go():
        front = FrontDoor(Stub(word_tokenizer(16)), args())
        port = await front.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        for _ in range(100):
            if _value("specdec_http_requests_total", **gone) > before[0]:
                break
            await asyncio.sleep(0.05)
        await front.stop()

    asyncio.run(go())
    assert _value("specdec_http_requests_total", **gone) == before[0] + 1
    assert _value("specdec_request_errors_total", **internal) == before[1]


@pytest.mark.parametrize("field,value,ok", [
    ("response_format", {"type": "text"}, True), ("tool_choice", "none", True), ("tools", [], True), ("logit_bias", {}, True),
    ("parallel_tool_calls", True, True), ("presence_penalty", 0.0, True), ("n", 1, True),
    ("tool_choice", "auto", False), ("logit_bias", {"3": 5}, False), ("n", "1", False), ("n", True, False),
    ("response_format", {"type": "json_object"}, False), ("presence_penalty", False, False),
])
def test_the_off_values_of_fields_not_implemented_are_taken_as_absent(field, value, ok):
    """Generic clients send OpenAI's defaults for fields this server does not implement: those
    values (of the same JSON type) are taken as absent; any other is a 400 naming the field."""
    stub = Stub(word_tokenizer(16))
    r = client(stub).post("/v1/completions", json={"model": "stub", "prompt": "w3", field: value})
    assert (r.status_code == 200) == ok, r.text
    if not ok:
        assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_a_clients_huge_strings_are_quoted_cut_in_errors_and_logs(caplog):
    """From a review: a model name or an unknown field name of megabytes (a body may be 16 MiB)
    came back whole in the error message and in the `request done` log line: one line of 2 MB in
    the logs for anyone who can reach the port. They are quoted cut, with their length."""
    import logging

    a = args()
    a.max_message_bytes = 16 << 20
    stub = Stub(word_tokenizer(16))
    stub.max_context = 1 << 20  # a context whose requests may be megabytes: the body limit is --max-message-bytes
    c = TestClient(FrontDoor(stub, a, model="the-target").app)
    huge = "m" * 200_000
    with caplog.at_level(logging.INFO, logger="specdec.draft"):
        r1 = c.post("/v1/completions", json={"model": huge, "prompt": "w3"})
        r2 = c.post("/v1/completions", json={"model": "stub", "prompt": "w3", huge: 1})
        r3 = c.post("/v1/chat/completions", json={"model": "stub", "messages": [{"role": "user", "content": "w3", huge: 1}]})
    assert r1.status_code == 404 and r2.status_code == 400 and r3.status_code == 400
    for r in (r1, r2):
        msg = r.json()["error"]["message"]
        assert "200000 characters" in msg and len(msg) < 400, msg[:400]
    assert r2.json()["error"]["param"] == "m" * 64
    nested = r3.json()["error"]  # a nested key: pydantic's location names it
    assert len(nested["message"]) < 400 and nested["param"] == "messages.0." + "m" * 64, nested["param"][:100]
    done = [rec for rec in caplog.records if rec.getMessage() == "request done"]
    assert len(done) == 3 and all(len(json.dumps(rec.fields)) < 3000 for rec in done)


def test_the_openai_sdk_does_not_retry_a_request_no_wait_can_fit_and_gets_error_request_ids():
    """The official SDK retries every 429 and 5xx unless told `x-should-retry: false`: a request
    larger than every verify replica's cache reached the servicer three times and failed after
    1.4 s. Error responses carried no X-Request-Id, so the SDK's error had no request_id to match
    the server's logs with."""
    import openai

    async def go():
        stubs = {"never": Stub(word_tokenizer(16), fail=Refusal.RESOURCE_EXHAUSTED, retry=False),
                 "full": Stub(word_tokenizer(16), fail=Refusal.RESOURCE_EXHAUSTED)}
        out = {}
        for name, stub in stubs.items():
            front = FrontDoor(stub, args(), model="the-target")
            port = await front.start()
            try:
                async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=30) as c:
                    with pytest.raises(openai.RateLimitError) as e:
                        await c.completions.create(model="stub", prompt="w3", max_tokens=2, extra_headers={"X-Request-Id": f"r-{name}"})
                    out[name] = (len(stub.requests), e.value.request_id)
                    with pytest.raises(openai.BadRequestError) as e:
                        await c.completions.create(model="stub", prompt="w3", max_tokens=0, extra_headers={"X-Request-Id": "r-bad"})
                    assert e.value.request_id == "r-bad"
            finally:
                await front.stop()
        return out

    out = asyncio.run(go())
    assert out["never"] == (1, "r-never")
    assert out["full"] == (3, "r-full")  # a refusal a wait can cure is retried, by the SDK's default max_retries=2


def test_a_developer_message_is_a_system_one_unless_the_template_knows_the_role(tmp_path):
    """OpenAI's SDK asks for `developer` where it asked for `system`; chat templates that know only
    system/user/assistant dropped it (Qwen's) or printed a header the model never saw (Llama 3's),
    and the reply was a 200 all the same."""
    knows_system = tmp_path / "system.jinja"  # prints system messages, drops any role it does not know
    knows_system.write_text("{% for m in messages %}{% if m['role'] == 'system' %}w5 {{ m['content'] }} {% elif m['role'] == 'user' %}"
                            "w6 {{ m['content'] }} {% endif %}{% endfor %}w8")
    knows_developer = tmp_path / "developer.jinja"
    knows_developer.write_text("{% for m in messages %}{% if m['role'] == 'developer' %}w9 {% endif %}{{ m['content'] }} {% endfor %}w8")
    chat = dict(CHAT, messages=[{"role": "developer", "content": "w2"}, {"role": "user", "content": "w7"}])
    prose = tmp_path / "prose.jinja"  # names developers in its text, not the role: still a system message
    prose.write_text(knows_system.read_text().replace("w8", "{# for developers #}w8"))
    for template, want in ((knows_system, "w5 w2 w6 w7 w8"), (knows_developer, "w9 w2 w7 w8"), (prose, "w5 w2 w6 w7 w8")):
        stub = Stub(word_tokenizer(16))
        assert client(stub, str(template)).post("/v1/chat/completions", json=chat).status_code == 200
        assert stub.requests[0].prompt == want


def test_a_refused_field_is_named_for_what_was_sent():
    """A field that takes two JSON shapes was refused for the first shape pydantic tried: content
    parts were told to be a string, a replayed tool-calling message that its content was missing,
    and a prompt of ids with a string in it that it should be a string."""
    c = client(Stub(word_tokenizer(16)))
    image = dict(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "w3"}, {"type": "image_url", "image_url": {"url": "x"}}]}])
    tool = dict(CHAT, messages=[{"role": "user", "content": "w3"},
                                {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}])
    for path, body, param in (("/v1/chat/completions", image, "messages.0.content.1"),
                              ("/v1/chat/completions", tool, "messages.1.tool_calls"),
                              ("/v1/completions", {"model": "stub", "prompt": [1, "a"]}, "prompt.1")):
        r = c.post(path, json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"].startswith(param) and "valid string" not in err["message"], err


def test_temperatures_below_the_least_are_greedy_and_above_openais_range_refused():
    """0 < temperature < 1e-4 was a 400 naming a float32 value nobody sent (OpenAI takes it); 1e300
    was refused as 'inf'. Below the services' least it is greedy, above OpenAI's 2 a 400 that
    quotes the range."""
    stub = Stub(word_tokenizer(16))
    c = client(stub)
    assert c.post("/v1/completions", json={"model": "stub", "prompt": "w3", "temperature": 1e-5}).status_code == 200
    assert stub.requests[-1].sampling.temperature == 0.0
    for t in (2.5, 1e300):
        r = c.post("/v1/completions", json={"model": "stub", "prompt": "w3", "temperature": t})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature" and "2" in r.json()["error"]["message"], r.json()


def test_a_401_and_a_403_carry_the_callers_request_id():
    from specdec.auth import TokenAuth

    auth = TokenAuth([("good", frozenset({"Info"}))])  # a token that may not call Generate: 403
    c = TestClient(FrontDoor(Stub(word_tokenizer(16)), args(), token_auth=auth, model="the-target").app)
    for headers, status in (({}, 401), ({"Authorization": "Bearer bad"}, 401), ({"Authorization": "Bearer good"}, 403)):
        r = c.post("/v1/completions", json={"model": "stub", "prompt": "w3"}, headers={"X-Request-Id": "rid-7", **headers})
        assert r.status_code == status and r.headers.get("x-request-id") == "rid-7", (status, r.headers)
    r = c.post("/v1/completions", json={"model": "stub", "prompt": "w3"}, headers={"X-Request-Id": "bad id\x7f"})
    assert r.status_code == 401  # an id that is not valid waits for the token's check: the caller is not known yet


def test_every_response_says_its_request_id_as_its_log_line_does(caplog):
    """From a review: /v1/models, an unknown path's 404 and a 405 carried no X-Request-Id, and
    their log lines a request id made up after the reply, which no caller could match. Every
    response now names the caller's id (where valid) or a new one, the one its log line holds."""
    c = client(Stub(word_tokenizer(16)))
    with caplog.at_level(logging.INFO, logger="specdec.draft"):
        for method, path, status, sent in (("GET", "/v1/models", 200, "m-1"), ("GET", "/v1/nothing", 404, "n-1"),
                                           ("GET", "/v1/completions", 405, None), ("GET", "/health", 200, "bad id\x7f")):
            caplog.clear()
            r = c.request(method, path, headers={"X-Request-Id": sent} if sent else {})
            rid = r.headers.get("x-request-id")
            logged = [x.fields["request_id"] for x in caplog.records if x.getMessage() == "request done"]
            assert r.status_code == status and rid and logged == [rid], (path, r.status_code, rid, logged)
            assert rid == sent if sent in ("m-1", "n-1") else len(rid) == 32, rid


def test_the_http_request_line_is_the_grpc_lines_shape(caplog):
    """The HTTP request's log line had an integer in `code` (the gRPC one's field holds a name) and
    left out the rounds, finish reason and counts the gRPC line carries."""
    import logging

    with caplog.at_level(logging.INFO, logger="specdec.draft"):
        assert client(Stub(word_tokenizer(16))).post("/v1/completions", json={"model": "stub", "prompt": "w3"}).status_code == 200
        assert client(Stub(word_tokenizer(16))).post("/v1/completions", json={"model": "stub"}).status_code == 400
    done = [r.fields for r in caplog.records if r.getMessage() == "request done"]
    assert done[0]["code"] == "OK" and done[0]["http_status"] == 200 and done[0]["rounds"] == 1, done
    assert done[0]["finish_reason"] == "length" and done[0]["prompt_tokens"] == 2, done
    assert (done[1]["code"], done[1]["http_status"]) == ("INVALID_ARGUMENT", 400), done


def test_a_nested_key_is_named_as_sent_and_off_values_are_said():
    """From a review: a nested key that began with a capital letter (or was `str`) was taken for
    the name of a pydantic union member, so the 400 named the field above it, or the wrong error
    (a valid list of parts "should be a valid string"); `stream_options: {"include_usage": null}`
    was refused though null counts as absent; `n: 2` was "unsupported", though 1 is taken."""
    c = client(Stub(word_tokenizer(16)))
    for body, param, says in (
            ({"messages": [{"role": "user", "content": "w3", "Name": "x"}]}, "messages.0.Name", "unsupported field"),
            ({"messages": [{"role": "user", "content": [{"type": "text", "text": "w3", "Extra": 1}]}]}, "messages.0.content.0.Extra",
             "unsupported field"),
            ({"messages": [{"role": "user", "content": "w3", "str": 1}]}, "messages.0.str", "unsupported field"),
            ({"messages": [{"role": "user", "content": "w3"}], "n": 2}, "n", "n: only 1 is supported here, got '2'")):
        r = c.post("/v1/chat/completions", json={"model": "stub", "max_tokens": 2, **body})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and says in err["message"], (body, err)
    r = c.post("/v1/completions", json={"model": "stub", "prompt": "w3", "stream": True, "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text


def test_bodies_the_length_checks_cannot_count_are_still_400s():
    """From the review of this session's diff: a content part whose text is no string made the
    new length check raise (a 500 with a traceback), and a UTF-16 body's lone surrogate passed the
    byte scan for one (a 500 from protobuf); both were 400s before, from pydantic and the whole-body
    check, and are again."""
    stub = Stub(word_tokenizer(16))
    c = client(stub)
    r = c.post("/v1/chat/completions", json={"model": "stub", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert r.status_code == 400 and "messages" in r.json()["error"]["param"], r.text
    body = '{"model": "stub", "prompt": "w3 \\ud800"}'.encode("utf-16-le")
    r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    assert not stub.requests
