"""The draft service's OpenAI-compatible HTTP front door (issue 29), driven by the official
`openai` package and by raw HTTP against one real verify + draft pair (started once for the
module, with a client token and --http-port 0), and compared with the same requests over gRPC.

The pair is the 4096-context tiny pair (long greedy runs, so a disconnect lands mid-generation);
the draft's tokenizer carries a chat template. The draft's request defaults are the tests'
(conftest: fixed tau 4, no pre-drafting), so greedy and seeded runs replay exactly."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket

import openai
import pytest

from bench import tinymodels
from bench.launch import Service
from client import Client
from helpers import metric, wait_for

TOKEN = "http-front-door-token"
MODEL = "long-target"  # the model id: the verify service's model
TEMPLATE = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
PROMPTS = ["w3 w4 w5", "w7 w7 w8 w9 w7 w7", [3, 9, 12]]


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("http")
    draft = tinymodels.build(str(d / "chat-draft"), seed=1, hidden=16, layers=1, sharpen=4.0, max_context=4096, chat_template=TEMPLATE)
    (d / "token").write_text(TOKEN + "\n")
    v = Service("verify_service", "--model", model_dir("long-target"), "--metrics-port", "0", "--log-level", "INFO")
    try:
        dr = Service("draft_service", "--model", draft, "--verify", v.address, "--metrics-port", "0", "--http-port", "0",
                     "--auth-token-file", str(d / "token"), "--log-level", "INFO")
    except BaseException:
        v.stop()
        raise
    yield v, dr
    dr.stop()
    v.stop()


@pytest.fixture(scope="module")
def oai(pair):
    return openai.OpenAI(base_url=f"http://{pair[1].http_address}/v1", api_key=TOKEN, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def rpc(pair):
    with Client(pair[1].address, token=TOKEN, timeout=60) as c:
        yield c


def grpc_prompt(prompt) -> dict:
    return {"prompt_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}


def extra(choice_or_response, key):
    return choice_or_response.model_extra[key]


def raw(pair, method: str, path: str, body=None, headers=None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(*pair[1].http_address.split(":"), timeout=60)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    return conn.getresponse()


# ---- output: the same as gRPC ----

@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_grpc_token_for_token(oai, rpc, prompt):
    for tau in (1, 4):
        r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                   extra_body={"num_draft_tokens": tau, "return_token_ids": True, "return_metrics": True})
        g = rpc.generate(**grpc_prompt(prompt), max_new_tokens=40, num_draft_tokens=tau)
        c = r.choices[0]
        assert extra(c, "token_ids") == g.token_ids and c.text == g.text and c.finish_reason == "length" == g.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
            (g.stats["prompt_tokens"], len(g.token_ids), g.stats["prompt_tokens"] + len(g.token_ids)) == (3 if isinstance(prompt, list) else len(prompt.split()), 40, r.usage.total_tokens)
        m = extra(r, "metrics")["speculative_decoding"]  # the same rounds as the gRPC run's stats
        assert (m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"], m["num_accepted_tokens_per_pos"]) == \
            (g.stats["rounds"], g.stats["drafted"], g.stats["accepted"], g.stats["accepted_per_position"])
        assert sum(m["num_accepted_tokens_per_pos"]) == m["num_accepted_tokens"] <= m["num_draft_tokens"]
        assert m["acceptance_rate"] == pytest.approx(m["num_accepted_tokens"] / m["num_draft_tokens"])
        assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    tree = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"num_draft_tokens": 4, "tree_budget": 12, "return_token_ids": True, "return_metrics": True})
    g = rpc.generate(**grpc_prompt(prompt), max_new_tokens=40, num_draft_tokens=4, tree_budget=12)
    assert extra(tree.choices[0], "token_ids") == g.token_ids == rpc.generate(**grpc_prompt(prompt), max_new_tokens=40).token_ids
    assert g.stats["tree_rounds"] > 0  # passed through: the same request as the gRPC one, trees and all
    assert extra(tree, "metrics")["speculative_decoding"]["num_drafts"] == g.stats["rounds"]


def test_streamed_completion_equals_the_whole_one_with_usage_last(oai):
    whole = oai.completions.create(model=MODEL, prompt="w3 w4 w5", max_tokens=30, temperature=0)
    chunks = list(oai.completions.create(model=MODEL, prompt="w3 w4 w5", max_tokens=30, temperature=0, stream=True,
                                         stream_options={"include_usage": True, "include_obfuscation": False},  # newer SDKs' field
                                         extra_body={"return_metrics": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    *body, finish, last = chunks
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in body) and len(body) >= 2
    assert finish.choices[0].finish_reason == "length" and finish.choices[0].text == ""
    assert extra(finish, "metrics")["speculative_decoding"]["num_drafts"] >= 1
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


def test_chat_sync_and_streamed_equal_grpc_on_the_rendered_template(oai, rpc):
    messages = [{"role": "system", "content": "w6"}, {"role": "user", "content": "w7 w8"}]
    rendered = "w3 w6 w4 w3 w7 w8 w4 w5"  # TEMPLATE, with the generation prompt
    g = rpc.generate(prompt=rendered, max_new_tokens=25)
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=25, temperature=0)
    assert r.choices[0].message.content == g.text and r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(rendered.split()), 25)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=25, temperature=0, stream=True))
    first, *body, finish = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content for c in body) == g.text
    assert finish.choices[0].finish_reason == "length" and finish.choices[0].delta.content is None and finish.usage is None


def test_a_reply_sent_back_as_a_dict_is_a_message(oai):
    """The SDK's model_dump() of a reply message has null fields (refusal, tool_calls, ...):
    null counts as absent inside a message too."""
    first = [{"role": "user", "content": "w7 w8"}]
    r = oai.chat.completions.create(model=MODEL, messages=first, max_tokens=3, temperature=0)
    again = oai.chat.completions.create(model=MODEL, messages=[*first, r.choices[0].message.model_dump(), {"role": "user", "content": "w9"}],
                                        max_tokens=3, temperature=0)
    assert again.choices[0].finish_reason == "length" and again.usage.completion_tokens == 3


def test_async_client_concurrent_chat_and_stream(pair, oai):
    messages = [{"role": "user", "content": "w9 w10"}]
    want = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0).choices[0].message.content

    async def go():
        async with openai.AsyncOpenAI(base_url=f"http://{pair[1].http_address}/v1", api_key=TOKEN, max_retries=0, timeout=60) as c:
            async def streamed():
                s = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
                return "".join([ch.choices[0].delta.content or "" async for ch in s])

            whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
            comp = c.completions.create(model=MODEL, prompt="w3 w4 w5", max_tokens=5, temperature=0)
            return await asyncio.gather(whole, streamed(), comp)

    whole, streamed, comp = asyncio.run(go())
    assert whole.choices[0].message.content == streamed == want
    assert comp.usage.completion_tokens == 5


def test_stop_strings_cut_the_text_and_finish_with_stop(oai):
    base = oai.completions.create(model=MODEL, prompt="w3 w4 w5", max_tokens=30, temperature=0).choices[0].text
    stop = next(w for w in base.split() if base.find(w) > 0)  # a word first seen after the start
    r = oai.completions.create(model=MODEL, prompt="w3 w4 w5", max_tokens=30, temperature=0, stop=stop)
    assert r.choices[0].text == base[: base.find(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(oai.completions.create(model=MODEL, prompt="w3 w4 w5", max_tokens=30, temperature=0, stop=["w999", stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text and chunks[-1].choices[0].finish_reason == "stop"


def test_same_seed_same_text_as_grpc(oai, rpc):
    kw = dict(model=MODEL, prompt="w3 w4 w5", max_tokens=30, temperature=0.9, top_p=0.95, seed=1234)
    a = oai.completions.create(**kw, extra_body={"return_token_ids": True, "top_k": 12})
    b = oai.completions.create(**kw, extra_body={"return_token_ids": True, "top_k": 12})
    s = "".join(c.choices[0].text for c in oai.completions.create(**kw, stream=True, extra_body={"top_k": 12}))
    g = rpc.generate(prompt="w3 w4 w5", max_new_tokens=30, temperature=0.9, top_p=0.95, top_k=12, seed=1234)
    assert a.choices[0].text == b.choices[0].text == s == g.text and extra(a.choices[0], "token_ids") == g.token_ids


def test_specdec_knobs_ride_in_the_body(oai, rpc):
    for knobs in ({"proposer": "lookup", "num_draft_tokens": 6}, {"proposer": "hybrid", "adaptive": False, "predraft": True}):
        r = oai.completions.create(model=MODEL, prompt="w7 w7 w8 w9 w7 w7", max_tokens=20, temperature=0,
                                   extra_body={**knobs, "return_token_ids": True, "return_metrics": True})
        g = rpc.generate(prompt="w7 w7 w8 w9 w7 w7", max_new_tokens=20, **knobs)
        assert extra(r.choices[0], "token_ids") == g.token_ids
        assert extra(r, "metrics")["speculative_decoding"]["num_drafts"] == g.stats["rounds"]


# ---- the wire: SSE framing, models, health, request ids, metrics ----

def test_sse_framing_byte_for_byte(pair, rpc):
    rid = "sse-framing-1"
    chunks = list(rpc.stream(prompt="w3 w4 w5", max_new_tokens=12))
    resp = raw(pair, "POST", "/v1/completions", {"model": MODEL, "prompt": "w3 w4 w5", "max_tokens": 12, "temperature": 0, "stream": True,
                                                 "stream_options": {"include_usage": True}},
               {"Authorization": f"Bearer {TOKEN}", "X-Request-Id": rid})
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream; charset=utf-8"
    assert resp.getheader("X-Request-Id") == rid and resp.getheader("Transfer-Encoding") == "chunked"
    body = resp.read()
    created = json.loads(body.split(b"\n\n")[0].removeprefix(b"data: "))["created"]
    head = f'data: {{"id":"cmpl-{rid}","object":"text_completion","created":{created},"model":"{MODEL}","choices":'
    want = "".join(f'{head}[{{"index":0,"text":{json.dumps(c.text)},"logprobs":null,"finish_reason":null}}],"usage":null}}\n\n'
                   for c in chunks if c.text)
    want += f'{head}[{{"index":0,"text":"","logprobs":null,"finish_reason":"length"}}],"usage":null}}\n\n'
    want += f'{head}[],"usage":{{"prompt_tokens":3,"completion_tokens":12,"total_tokens":15}}}}\n\n'
    want += "data: [DONE]\n\n"
    assert len(chunks) >= 3 and body == want.encode()


def test_models_health_and_request_ids(pair, oai):
    v, d = pair
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL  # GET /v1/models/ID
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("gpt-4")
    assert e.value.code == "model_not_found"
    h = raw(pair, "GET", "/health")
    assert h.status == 200 and json.loads(h.read()) == {"status": "ok"}
    r = oai.completions.create(model=MODEL, prompt="w3", max_tokens=3, temperature=0, extra_headers={"X-Request-Id": "rid-http-42"})
    assert r.id == "cmpl-rid-http-42"
    assert wait_for(lambda: any("rid-http-42" in line and "request done" in line for line in d.stderr))
    assert wait_for(lambda: any("rid-http-42" in line and "session done" in line for line in v.stderr))


def test_prometheus_counts_http_requests(pair, oai):
    d = pair[1]
    ok = lambda: metric(d.metrics(), "specdec_http_requests_total", path="/v1/completions", status="200")  # noqa: E731
    bad = lambda: metric(d.metrics(), "specdec_http_requests_total", path="/v1/completions", status="400")  # noqa: E731
    tokens = lambda: metric(d.metrics(), "specdec_generated_tokens_total", service="draft")  # noqa: E731
    n_ok, n_bad, n_tokens = ok(), bad(), tokens()
    oai.completions.create(model=MODEL, prompt="w3", max_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="w3", max_tokens=0)
    assert (ok(), bad(), tokens()) == (n_ok + 1, n_bad + 1, n_tokens + 4)
    assert metric(d.metrics(), "specdec_request_latency_seconds_count", service="draft", method="/v1/completions") >= 2


# ---- refusals ----

def test_auth_401_without_the_token_200_with_it(pair, oai):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        resp = raw(pair, "POST", "/v1/completions", {"model": MODEL, "prompt": "w3", "max_tokens": 2}, headers)
        err = json.loads(resp.read())["error"]
        assert resp.status == 401 and set(err) == {"message", "type", "param", "code"} and TOKEN not in err["message"]
    assert raw(pair, "GET", "/v1/models").status == 401
    wrong = openai.OpenAI(base_url=f"http://{pair[1].http_address}/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w3"}], max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    # greedy: at OpenAI's default temperature (1) an EOS drawn first would end it after one token
    ok = raw(pair, "POST", "/v1/completions", {"model": MODEL, "prompt": "w3", "max_tokens": 2, "temperature": 0},
             {"Authorization": f"Bearer {TOKEN}"})
    assert ok.status == 200 and json.loads(ok.read())["usage"]["completion_tokens"] == 2


BAD = [  # (endpoint, arguments, the field the 400 names)
    ("completions", dict(n=2), "n"),
    ("completions", dict(logprobs=2), "logprobs"),
    ("completions", dict(logprobs=0), "logprobs"),  # the chosen tokens' logprobs: not implemented, so refused, not ignored
    ("completions", dict(max_tokens=0), "max_tokens"),
    ("completions", dict(max_tokens=5000), "max_tokens"),  # past the context limit (gRPC validation's message, renamed)
    ("completions", dict(temperature=-1), "temperature"),
    ("completions", dict(top_p=1.5), "top_p"),
    ("completions", dict(prompt=["w3", "w4"]), "prompt"),
    ("completions", dict(prompt=[3, 999]), "prompt"),  # outside the vocabulary (gRPC validation's message)
    ("completions", dict(prompt=[3, 1 << 31]), "prompt"),  # past int32, the wire's type: was a 500 with two tracebacks
    ("completions", dict(extra_body={"num_draft_tokens": 99}), "num_draft_tokens"),
    ("completions", dict(extra_body={"proposer": "oracle"}), "proposer"),
    ("completions", dict(extra_body={"tree_budget": 65}), "tree_budget"),  # past the verifier's 64 nodes
    ("completions", dict(stream_options={"include_usage": True}), "stream_options"),
    ("completions", dict(extra_headers={"X-Request-Id": "x" * 200}), "X-Request-Id"),
    ("chat", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
    ("chat", dict(response_format={"type": "json_object"}), "response_format"),
    ("chat", dict(messages=[{"role": "tool", "content": "w3", "tool_call_id": "1"}]), "messages.0.role"),
    ("chat", dict(messages=[]), "messages"),
    ("chat", dict(max_completion_tokens=5000), "max_completion_tokens"),  # the name the request used, in gRPC validation's message
    ("chat", dict(max_tokens=5000), "max_tokens"),
    ("chat", dict(messages=[{"role": "user", "content": "w3 " * 4100}]), "messages"),  # no room left in the context
]


@pytest.mark.parametrize("endpoint,kw,param", BAD, ids=[f"{e}-{p}" for e, _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(oai, endpoint, kw, param):
    if endpoint == "chat":
        kw = dict(dict(model=MODEL, messages=[{"role": "user", "content": "w3"}], max_tokens=2), **kw)
        call = oai.chat.completions.create
    else:
        kw = dict(dict(model=MODEL, prompt="w3", max_tokens=2), **kw)
        call = oai.completions.create
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    assert e.value.status_code == 400 and e.value.param == param and param in e.value.message


def test_unknown_model_404_and_bad_json_400(pair, oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4", prompt="w3", max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    for body in (b"{not json", b"[" * 100_000 + b"]" * 100_000):  # the second: nesting past the parser's recursion
        resp = raw(pair, "POST", "/v1/completions", body, {"Authorization": f"Bearer {TOKEN}"})
        assert resp.status == 400 and "JSON" in json.loads(resp.read())["error"]["message"]
    for field, value in (("prompt", "w3 \\ud800"), ("stop", "\\ud800"), ("user\\ud800", "x")):  # valid JSON, but no UTF-8 string
        body = ('{"model": "%s", "max_tokens": 2, "prompt": "w3", "%s": "%s"}' % (MODEL, field, value)).encode()
        resp = raw(pair, "POST", "/v1/completions", body, {"Authorization": f"Bearer {TOKEN}"})
        assert resp.status == 400 and "surrogate" in json.loads(resp.read())["error"]["message"], field
    assert raw(pair, "GET", "/v1/nothing-here", headers={"Authorization": f"Bearer {TOKEN}"}).status == 404


# ---- a client that goes away ----

@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_frees_both_sessions(pair, stream):
    v, d = pair
    live = lambda s, name: metric(s.metrics(), "specdec_live_sessions", service=name)  # noqa: E731
    gone = lambda: metric(d.metrics(), "specdec_http_requests_total", path="/v1/completions", status="499")  # noqa: E731
    n_gone = gone()
    body = json.dumps({"model": MODEL, "prompt": "w3 w4", "max_tokens": 4000, "temperature": 0, "stream": stream}).encode()
    host, port = d.http_address.split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        if stream:  # the first text event is out: the generation is running
            got = b""
            for _ in range(100):
                got += sock.recv(4096)
                if got.count(b"data: ") >= 2:
                    break
            assert b'"text":" w' in got  # after the prompt's last word: its space first
        assert wait_for(lambda: live(d, "draft") == 1 and live(v, "verify") == 1, timeout=20)
    finally:
        sock.close()
    assert wait_for(lambda: live(d, "draft") == 0 and live(v, "verify") == 0, timeout=20)
    assert wait_for(lambda: gone() == n_gone + 1, timeout=10)  # cut short (499), not run to its 4000 tokens


def test_sigterm_drains_a_running_http_stream(pair, model_dir):
    """uvicorn runs in the gRPC server's loop without signal handlers of its own: SIGTERM drains
    both, a running HTTP stream completes, new connections are refused, the process exits 0."""
    d = Service("draft_service", "--model", model_dir("long-draft"), "--verify", pair[0].address, "--http-port", "0", "--drain-s", "60")
    try:
        host, port = d.http_address.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": [3, 4], "max_tokens": 400, "temperature": 0,
                                                            "stream": True, "num_draft_tokens": 1}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: {")
        d.proc.send_signal(15)
        assert wait_for(lambda: not _accepts(host, int(port)), timeout=10)  # the listener closed: new requests refused
        assert d.proc.poll() is None  # still draining
        rest = [e.strip() for e in resp.read().split(b"\n\n") if e.strip()]  # (the first event's blank line first)
        assert rest[-1] == b"data: [DONE]" and json.loads(rest[-2].removeprefix(b"data: "))["choices"][0]["finish_reason"] == "length"
        assert d.proc.wait(30) == 0
    finally:
        d.stop()


def test_a_stream_the_drain_cuts_is_logged_503_not_a_client_that_left(pair, model_dir):
    """From a review: a stream still running when the drain's grace ended was logged and counted
    499, a client that went away; the server cut it. It is 503 (UNAVAILABLE), an error. (A plain
    process: its log is read to its end.)"""
    import subprocess
    import sys

    from bench.launch import ENV, ROOT

    proc = subprocess.Popen([sys.executable, "-m", "draft_service", "--model", model_dir("long-draft"), "--verify", pair[0].address,
                             "--port", "0", "--http-port", "0", "--drain-s", "1"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        address = None
        for line in proc.stdout:  # bounded by the process: it ends if it cannot start
            address = line.split()[-1] if line.startswith("http on ") else address
            if line.startswith("listening on "):
                break
        host, port = address.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": [3, 4], "max_tokens": 4000, "temperature": 0,
                                                            "stream": True, "num_draft_tokens": 1}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: {")
        proc.send_signal(15)
        try:
            while resp.read(65536):  # until the server cuts it, a second on
                pass
        except (http.client.IncompleteRead, ConnectionError):
            pass
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    done = [json.loads(line) for line in err.splitlines() if '"request done"' in line and "POST /v1/completions" in line]
    assert proc.returncode == 0 and [(d["code"], d["http_status"]) for d in done] == [("UNAVAILABLE", 503)], (proc.returncode, done)


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False
