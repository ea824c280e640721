"""Token authentication on both hops (issue 15), on real processes over loopback.

One pair: the verify service requires the session token (--auth-token-file, here through the
env SPECDEC_AUTH_TOKEN_FILE) and also accepts the client token for Generate and Info only
(SPECDEC_CLIENT_TOKEN_FILE); the draft service sends the session token to it
(--verify-auth-token-file) and requires the client token from its own callers
(--auth-token-file). Every RPC of both services is tried with no credentials, a wrong token,
the token of the other role and the right one."""
import asyncio
import contextlib
import json
import os
import subprocess
import sys

import grpc
import pytest

from bench.launch import ENV, ROOT, start_pair
from client import AsyncClient, Client
from helpers import assert_health_and_reflection, free_port, json_log_lines, metric, wait_for
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

SESSION_TOKEN = "session-token-7f3a9c"  # verify: every RPC; held by the draft service
CLIENT_TOKEN = "client-token-51be04"  # draft: every RPC; verify: Generate and Info only
WRONG_TOKEN = "not-a-token-at-all"
OK, UNAUTH, DENIED = grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
CREDS = {"none": None, "wrong": WRONG_TOKEN, "client": CLIENT_TOKEN, "session": SESSION_TOKEN}

# the RPC x credential matrix: the status each call must end with
VERIFY_MATRIX = {
    "Info": {"none": UNAUTH, "wrong": UNAUTH, "client": OK, "session": OK},
    "Generate": {"none": UNAUTH, "wrong": UNAUTH, "client": OK, "session": OK},
    "Session": {"none": UNAUTH, "wrong": UNAUTH, "client": DENIED, "session": OK},
}
DRAFT_MATRIX = {  # the session token is the verify's, not a credential of the draft
    "Info": {"none": UNAUTH, "wrong": UNAUTH, "client": OK, "session": UNAUTH},
    "Generate": {"none": UNAUTH, "wrong": UNAUTH, "client": OK, "session": UNAUTH},
}


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return str(path)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    return {"session": write(d / "session", SESSION_TOKEN + "\n"), "client": write(d / "client", CLIENT_TOKEN + "\n"), "dir": d}


@pytest.fixture(scope="module")
def pair(model_dir, tokens):
    venv = dict(ENV, SPECDEC_AUTH_TOKEN_FILE=tokens["session"], SPECDEC_CLIENT_TOKEN_FILE=tokens["client"])
    v, d = start_pair(("--model", model_dir("target"), "--metrics-port", "0", "--log-level", "INFO"),
                      ("--model", model_dir("draft"), "--metrics-port", "0", "--log-level", "INFO",
                       "--verify-auth-token-file", tokens["session"], "--auth-token-file", tokens["client"]), env=venv, draft_env=ENV)
    yield v, d
    d.stop()
    v.stop()


def md(token, rid=None):
    out = [("authorization", f"Bearer {token}")] if token is not None else []
    return out + ([("x-request-id", rid)] if rid else [])


def call(stub_cls, address, method, token, rid=None, fingerprint=""):
    """Calls one RPC; returns (status, responses)."""
    with grpc.insecure_channel(address) as ch:
        stub = stub_cls(ch)
        try:
            if method == "Info":
                return OK, [stub.Info(pb.InfoRequest(), timeout=30, metadata=md(token, rid))]
            if method == "Generate":
                return OK, list(stub.Generate(pb.GenerateRequest(prompt="w3 w4", max_new_tokens=3), timeout=30, metadata=md(token, rid)))
            msgs = [pb.VerifyRequest(start=pb.SessionStart(prompt_ids=[3, 4], max_new_tokens=2, vocab_fingerprint=fingerprint,
                                                           proposal_mode=pb.PROPOSAL_MODE_GREEDY, request_id=rid or "")),
                    pb.VerifyRequest(round=pb.Round(round=1)), pb.VerifyRequest(round=pb.Round(round=2))]
            return OK, list(stub.Session(iter(msgs), timeout=30, metadata=md(token, rid)))
        except grpc.RpcError as e:
            return e.code(), []


@pytest.mark.parametrize("cred", list(CREDS))
@pytest.mark.parametrize("method", list(VERIFY_MATRIX))
def test_verify_rpc_by_credential(pair, method, cred):
    v, _ = pair
    fp = call(pb_grpc.VerifyStub, v.address, "Info", SESSION_TOKEN)[1][0].vocab_fingerprint
    want = VERIFY_MATRIX[method][cred]
    errors = lambda: metric(v.metrics(), "specdec_request_errors_total", service="verify", method=method, code=want.name)  # noqa: E731
    before = errors()
    rid = f"auth-verify-{method}-{cred}"
    code, out = call(pb_grpc.VerifyStub, v.address, method, CREDS[cred], rid=rid, fingerprint=fp)
    assert code == want
    if want == OK:  # served in full
        if method == "Session":
            assert [r.round for r in out] == [1, 2] and out[-1].finish_reason == pb.FINISH_REASON_LENGTH
        elif method == "Generate":
            assert sum(len(c.token_ids) for c in out) >= 1 and out[-1].finish_reason
        else:
            assert out[0].vocab_size == 16
        return
    # a refusal: counted, and logged once (at WARNING, with the reason), naming no token
    assert wait_for(lambda: errors() == before + 1, 5)
    assert wait_for(lambda: json_log_lines(v, request_id=rid), 5), v.stderr[-3:]
    (line,) = json_log_lines(v, request_id=rid)
    assert line["level"] == "warning" and line["code"] == want.name and line["method"] == method and line["peer"]
    assert line["error"] == {"none": "missing bearer token", "wrong": "invalid bearer token"}.get(cred, f"this token may not call {method}")
    text = "".join(v.stderr)
    assert SESSION_TOKEN not in text and CLIENT_TOKEN not in text and WRONG_TOKEN not in text


@pytest.mark.parametrize("cred", list(CREDS))
@pytest.mark.parametrize("method", list(DRAFT_MATRIX))
def test_draft_rpc_by_credential(pair, method, cred):
    _, d = pair
    rid = f"auth-draft-{method}-{cred}"
    code, out = call(pb_grpc.DraftStub, d.address, method, CREDS[cred], rid=rid)
    want = DRAFT_MATRIX[method][cred]
    assert code == want
    if want == OK and method == "Generate":  # speculative: the draft's session with the verify was authenticated
        assert out[-1].finish_reason and out[-1].stats.rounds >= 1
    if want != OK:
        assert wait_for(lambda: json_log_lines(d, request_id=rid), 5), d.stderr[-3:]
        (line,) = json_log_lines(d, request_id=rid)
        assert line["level"] == "warning" and line["code"] == "UNAUTHENTICATED"
        assert not [x for x in "".join(d.stderr).split("\n") if SESSION_TOKEN in x or CLIENT_TOKEN in x or WRONG_TOKEN in x]


def test_speculative_generation_through_authenticated_hops(pair):
    v, d = pair
    with Client(d.address, token=CLIENT_TOKEN, timeout=60) as c:
        spec = c.generate(prompt="w3 w4 w5", max_new_tokens=12, num_draft_tokens=3, request_id="auth-e2e")
        sampled = c.generate(prompt_ids=[3, 4], max_new_tokens=8, temperature=1.0, seed=5)
    with Client(v.address, target_only=True, token=CLIENT_TOKEN, timeout=60) as c:
        target = c.generate(prompt="w3 w4 w5", max_new_tokens=12)
    assert spec.served_by == "draft" and spec.stats["drafted"] >= 1 and spec.stats["rounds"] >= 1
    assert spec.token_ids == target.token_ids  # greedy: the target's own output, through both hops
    assert sampled.seed == 5 and sampled.token_ids
    assert wait_for(lambda: json_log_lines(v, request_id="auth-e2e", msg="session done"), 5)
    (session,) = json_log_lines(v, request_id="auth-e2e", msg="session done")
    assert session["code"] == "OK" and session["rounds"] == spec.stats["rounds"]


def test_fallback_to_the_verify_service_with_a_token(pair):
    v, _ = pair
    down = f"127.0.0.1:{free_port()}"  # no draft service there
    with Client(down, fallback=v.address, token=CLIENT_TOKEN, timeout=60) as c:
        r = c.generate(prompt="w3 w4", max_new_tokens=5)
    assert r.served_by == "verify" and r.token_ids
    with Client(down, fallback=v.address, token=WRONG_TOKEN, fallback_token=CLIENT_TOKEN, timeout=60) as c:
        assert c.generate(prompt="w3 w4", max_new_tokens=5).token_ids == r.token_ids  # its own token for the fallback
    for kw in (dict(token=None), dict(token=CLIENT_TOKEN, fallback_token=WRONG_TOKEN)):
        with Client(down, fallback=v.address, timeout=60, **kw) as c, pytest.raises(grpc.RpcError) as e:
            c.generate(prompt="w3 w4", max_new_tokens=5)
        assert e.value.code() == UNAUTH


    async def with_asyncio(**kw):
        async with AsyncClient(down, fallback=v.address, timeout=60, retries=1, **kw) as c:
            return await c.generate(prompt="w3 w4", max_new_tokens=5)

    r2 = asyncio.run(with_asyncio(token=CLIENT_TOKEN))  # one retry on the draft, then the fallback
    assert r2.served_by == "verify" and r2.token_ids == r.token_ids
    with pytest.raises(grpc.RpcError) as e:
        asyncio.run(with_asyncio(token=WRONG_TOKEN))
    assert e.value.code() == UNAUTH


def test_health_and_reflection_are_open(pair):
    v, d = pair
    for svc, name in ((d, "specdec.v1.Draft"), (v, "specdec.v1.Verify")):
        with grpc.insecure_channel(svc.address) as ch:
            assert_health_and_reflection(ch, name)


def test_cli_and_load_tester_take_a_token_file(pair, tokens, tmp_path):
    v, d = pair
    base = [sys.executable, "-m", "client", "generate", "--prompt", "w3 w4", "--max-new-tokens", "4", "--json"]
    ok = subprocess.run(base + ["--server", d.address, "--token-file", tokens["client"]], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["served_by"] == "draft"
    fb = subprocess.run(base + ["--server", f"127.0.0.1:{free_port()}", "--fallback", v.address, "--token-file", tokens["client"]],
                        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert fb.returncode == 0, fb.stderr
    assert json.loads(fb.stdout)["served_by"] == "verify"
    bad = subprocess.run(base + ["--server", d.address, "--token-file", tokens["session"]], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "error: UNAUTHENTICATED: invalid bearer token" in bad.stderr

    prompts = write(tmp_path / "prompts.txt", "w3 w4 w5\nw6 w7\n")
    load = [sys.executable, "-m", "bench.loadtest", "--server", d.address, "--concurrency", "1", "--requests", "2", "--max-new-tokens", "4",
            "--prompts", prompts, "--warmup", "0", "--no-progress", "--fail-on-error", "--out", str(tmp_path / "out")]
    r = subprocess.run(load + ["--token-file", tokens["client"]], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = (tmp_path / "out" / "loadtest.json").read_text()
    assert json.loads(report)["cells"][0]["summary"]["completed"] == 2
    assert CLIENT_TOKEN not in report
    r = subprocess.run(load, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "UNAUTHENTICATED" in r.stderr
    # the target-only baseline against the verify service: --server's token, or --fallback-token-file's where given
    r = subprocess.run(load + ["--token-file", tokens["client"], "--baseline", v.address], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cells = json.loads((tmp_path / "out" / "loadtest.json").read_text())["cells"]
    assert sorted(c["tags"]["path"] for c in cells) == ["speculative", "target-only"]
    assert all(c["summary"]["completed"] == 2 for c in cells)
    wrong = write(tmp_path / "wrong", WRONG_TOKEN + "\n")
    r = subprocess.run(load + ["--token-file", tokens["client"], "--baseline", v.address, "--fallback-token-file", wrong], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(f"bench.loadtest: --baseline {v.address}: UNAUTHENTICATED")


@pytest.mark.parametrize("setup, error", [
    (["--client-token-file", "{client}"], "--client-token-file needs --auth-token-file"),
    (["--auth-token-file", "{client}", "--client-token-file", "{client}"], "hold the same token"),
    (["--auth-token-file", "{empty}"], "is empty"),
    # what an authorization header cannot carry: gRPC refused it at the draft's first call, in a traceback, after the load
    (["--auth-token-file", "{two_lines}"], "one line of printable ASCII"),
    (["--auth-token-file", "{accented}"], "one line of printable ASCII"),
])
def test_verify_refuses_to_start_with_unusable_tokens(model_dir, tokens, setup, error):
    empty = write(tokens["dir"] / "empty", "\n")
    two_lines, accented = write(tokens["dir"] / "two-lines", "abc\ndef\n"), write(tokens["dir"] / "accented", "t\u00f6ken\n")
    args = [a.format(client=tokens["client"], empty=empty, two_lines=two_lines, accented=accented) for a in setup]
    r = subprocess.run([sys.executable, "-m", "verify_service", "--model", model_dir("target"), "--port", "0", *args],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and error in r.stderr


def test_a_draft_refuses_a_verify_token_no_header_can_carry_in_one_line(model_dir, tokens):
    bad = write(tokens["dir"] / "accented", "t\u00f6ken\n")  # gRPC refused it at the draft's first call, in a traceback
    r = subprocess.run([sys.executable, "-m", "draft_service", "--model", model_dir("draft"), "--port", "0", "--verify", "127.0.0.1:1",
                        "--verify-auth-token-file", bad], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"python -m draft_service: error: --verify-auth-token-file {bad}: the token must be")


def test_split_bench_passes_credentials_as_files():
    """bench.split runs the pair secured: each process gets the flag for its side, files only."""
    import argparse

    from bench.split import credential_args

    a = argparse.Namespace(tls_cert="s.pem", tls_key="s.key", tls_ca="ca.pem", tls_client_cert="c.pem", tls_client_key="c.key",
                           verify_token_file="session", token_file="client")
    verify, draft, load = credential_args(a)
    flags = lambda xs: dict(zip(xs[::2], [os.path.basename(x) for x in xs[1::2]]))  # noqa: E731
    assert flags(verify) == {"--tls-cert": "s.pem", "--tls-key": "s.key", "--tls-client-ca": "ca.pem", "--auth-token-file": "session"}
    assert flags(draft) == {"--tls-cert": "s.pem", "--tls-key": "s.key", "--tls-client-ca": "ca.pem", "--verify-tls-ca": "ca.pem",
                            "--verify-tls-cert": "c.pem", "--verify-tls-key": "c.key", "--verify-auth-token-file": "session",
                            "--auth-token-file": "client"}
    assert flags(load) == {"--tls-ca": "ca.pem", "--tls-cert": "c.pem", "--tls-key": "c.key", "--token-file": "client"}
    assert all(os.path.isabs(x) for x in (verify + draft + load)[1::2])


def test_a_caller_without_a_token_is_refused_before_its_bytes_are_judged(pair, tokens):
    """An undecodable request from a caller without a valid token was answered INVALID_ARGUMENT
    (logged at INFO, not as a refused caller at WARNING): the request observer judged the bytes
    before the token check. Now it is UNAUTHENTICATED; with the token, still INVALID_ARGUMENT."""
    v, _ = pair
    bad = b"\x0a\x02\xff\xfe" + b"\x10\x04"  # prompt = b"\xff\xfe" (not UTF-8), max_new_tokens = 4
    with grpc.insecure_channel(v.address) as ch:
        send = ch.unary_stream("/specdec.v1.Verify/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for token, code in ((None, UNAUTH), (WRONG_TOKEN, UNAUTH), (SESSION_TOKEN, grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as e:
                list(send(bad, timeout=30, metadata=md(token)))
            assert e.value.code() == code, (token, e.value.code(), e.value.details())


def test_a_cancel_during_the_first_write_on_a_token_channel_is_a_cancel(pair):
    """From two reviews: on a channel with interceptors (the session token) grpc.aio turns a cancel
    of the task awaiting an upstream write into InvalidStateError ("RPC already finished"); the
    draft logged that with a traceback and ended its caller's call INTERNAL (counted as a server
    error) where the caller had left or its deadline had passed. The draft's handler now checks
    its own task first (server._cancelled): 20 cancels at the first write, 20 CancelledErrors."""
    import asyncio
    import collections
    import types

    from draft_service.server import _cancelled
    from draft_service.upstream import verify_channel
    from specdec import serving

    v, _ = pair

    async def main():
        args = types.SimpleNamespace(max_message_bytes=16 << 20, verify_tls_ca=None, verify_tls_cert=None, verify_tls_key=None,
                                     verify_token=SESSION_TOKEN)
        ch = verify_channel(args, v.address)
        stub = pb_grpc.VerifyStub(ch)
        info = await stub.Info(pb.InfoRequest())
        start = pb.VerifyRequest(start=pb.SessionStart(prompt_ids=[3, 4], max_new_tokens=10, vocab_fingerprint=info.vocab_fingerprint))
        seen = collections.Counter()

        async def handler():  # as DraftServicer.stream's except clauses do
            call = stub.Session()
            try:
                await call.write(start)
                await call.read()
                seen["finished"] += 1
            except asyncio.CancelledError:
                seen["cancelled"] += 1
                raise
            except Exception as e:  # noqa: BLE001
                seen[type(e).__name__] += 1
                _cancelled()
                seen["not cancelled"] += 1
            finally:
                await serving.release(call)

        for _ in range(20):
            t = asyncio.ensure_future(handler())
            await asyncio.sleep(0)  # the handler now awaits its first write
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await ch.close()
        return seen

    seen = asyncio.run(main())
    assert seen["cancelled"] + seen["InvalidStateError"] == 20 and seen["not cancelled"] == 0 and not seen["finished"], seen
