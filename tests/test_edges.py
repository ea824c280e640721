"""Reliability at the edges (issue 27), with real processes on loopback:

* start-up either serves or says why in one line: bad flag values, unreadable token files, a
  model directory that cannot be loaded, a port in use, a session token the verify service
  refuses, all exit 2 with one stderr line naming the flag or file (cases 2, 3, 5, 6, 9);
* calibration measures round costs whatever the target writes, and falls back with one warning
  when it cannot (case 1);
* `x-request-id` is input (case 4); cheap checks come first (case 8); undecodable requests get
  INVALID_ARGUMENT and are counted (case 10); greedy sessions check q (case 11);
* a verify service that hangs (SIGSTOP) fails requests within --verify-round-timeout-s and the
  draft's health follows it; a draft started before its verify service is NOT_SERVING until it
  answers (case 7).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import Client
from conftest import ENV, ROOT, Service, metric, wait_for
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

SESSION_TOKEN, CLIENT_TOKEN = "session-token-27", "client-token-27"
TIMEOUT = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_socket(reuseport: bool) -> socket.socket:
    """A socket listening on a free loopback port (with SO_REUSEPORT, as gRPC's default sets it)."""
    s = socket.socket()
    if reuseport:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def run_all(cases: dict[str, list[str]], timeout: float = 240) -> dict[str, subprocess.CompletedProcess]:
    """Runs each command line at once (they are independent); waits for all, each bounded."""
    procs = {name: subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, args in cases.items()}
    out = {}
    deadline = time.monotonic() + timeout
    for name, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def assert_one_line_exit_2(name: str, r: subprocess.CompletedProcess, *words: str) -> None:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, (name, r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr, (name, r.stderr[-2000:])
    assert "listening on" not in r.stdout, (name, r.stdout)
    assert all(w in lines[0] for w in words), (name, lines[0], words)


def model_variant(model_dir, tmp, name: str, edit) -> str:
    path = str(tmp / name)
    shutil.copytree(model_dir("target"), path)
    edit(path)
    return path


def test_start_up_failures_exit_2_with_one_line(model_dir, tmp_path):
    """Cases 3, 5, 6, 9: every start-up failure is one line naming the flag or file, exit 2,
    before `listening on`."""
    tok_dir = tmp_path / "a-directory"
    tok_dir.mkdir()

    def rm(*names):
        return lambda p: [os.remove(os.path.join(p, n)) for n in names]

    def write(name, data):
        return lambda p: open(os.path.join(p, name), "wb").write(data)

    models = {
        "no weights": (model_variant(model_dir, tmp_path, "noweights", rm("model.safetensors")), "model.safetensors"),
        "corrupt weights": (model_variant(model_dir, tmp_path, "corrupt", write("model.safetensors", b"\x07" * 64)), "cannot load the model"),
        "bad config JSON": (model_variant(model_dir, tmp_path, "badcfg", write("config.json", b"{not json")), "config"),
        "no tokenizer": (model_variant(model_dir, tmp_path, "notok", rm("tokenizer.json", "tokenizer_config.json")), "tokenizer"),
    }
    busy = listening_socket(reuseport=True)  # as a second gRPC server would hold it
    busy_metrics = listening_socket(reuseport=False)
    target = model_dir("target")
    quiet = ["--log-level", "WARNING"]  # the model load logs its engine choices at INFO first
    v = ["verify_service", "--port", "0", *quiet]
    d = ["draft_service", "--port", "0", "--verify", "127.0.0.1:1", "--verify-wait-s", "0", *quiet]
    cases = {
        "idle timeout 0": ([*v, "--model", target, "--idle-timeout-s", "0"], "--idle-timeout-s"),
        "max sessions 0": ([*v, "--model", target, "--max-sessions", "0"], "--max-sessions"),
        "threads -1": ([*v, "--model", target, "--threads", "-1"], "--threads"),
        "draft threads -1": ([*d, "--model", target, "--threads", "-1"], "--threads"),
        "round timeout 0": ([*d, "--model", target, "--verify-round-timeout-s", "0"], "--verify-round-timeout-s"),
        "missing token file": ([*v, "--model", target, "--auth-token-file", str(tmp_path / "nope")], "--auth-token-file", "No such file"),
        "token file is a directory": ([*v, "--model", target, "--auth-token-file", str(tok_dir)], "--auth-token-file", "directory"),
        "missing verify token file": ([*d, "--model", target, "--verify-auth-token-file", str(tmp_path / "nope")],
                                      "--verify-auth-token-file", "No such file"),
        "missing model dir": ([*v, "--model", str(tmp_path / "nope")], "--model", "no such directory"),
        "draft missing model dir": ([*d, "--model", str(tmp_path / "nope")], "--model", "no such directory"),
        "port in use": ([*v, "--model", target, "--port", str(busy.getsockname()[1])], "--port", "in use"),
        "metrics port in use": ([*v, "--model", target, "--metrics-port", str(busy_metrics.getsockname()[1])], "--metrics-port"),
        **{name: ([*v, "--model", path], "--model", path, word) for name, (path, word) in models.items()},
    }
    cases["draft no tokenizer"] = ([*d, "--model", models["no tokenizer"][0]], "--model", "tokenizer")
    try:
        results = run_all({name: args for name, (args, *_) in cases.items()})
    finally:
        busy.close()
        busy_metrics.close()
    for name, (_, *words) in cases.items():
        assert_one_line_exit_2(name, results[name], *words)


# ---- a verify service with tokens, whose target writes EOS at once ------------------------------

@pytest.fixture(scope="module")
def eos_verify(model_dir, tmp_path_factory):
    """A verify service (session + client tokens, one session at most) on a target whose every
    token is an end-of-sequence id: each session ends at its first round."""
    tmp = tmp_path_factory.mktemp("eos")
    path = str(tmp / "all-eos")
    shutil.copytree(model_dir("target"), path)
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(path, name)) as f:
            cfg = json.load(f)
        cfg["eos_token_id"] = list(range(16))
        with open(os.path.join(path, name), "w") as f:
            json.dump(cfg, f)
    files = {}
    for name, text in (("session", SESSION_TOKEN), ("client", CLIENT_TOKEN), ("wrong", "not-the-token")):
        files[name] = str(tmp / name)
        with open(files[name], "w") as f:
            f.write(text + "\n")
    v = Service("verify_service", "--model", path, "--auth-token-file", files["session"], "--client-token-file", files["client"],
                "--max-sessions", "1", "--threads", "1", "--metrics-port", "0")
    yield v, files
    v.stop()


def test_draft_checks_its_session_token_at_start_up(eos_verify, model_dir):
    """Case 2: a wrong session token, a client token (Info only) or none is refused at start-up."""
    v, files = eos_verify
    base = ["draft_service", "--model", model_dir("draft"), "--port", "0", "--verify", v.address, "--log-level", "WARNING"]
    results = run_all({
        "wrong token": [*base, "--verify-auth-token-file", files["wrong"]],
        "client token": [*base, "--verify-auth-token-file", files["client"]],
        "no token": base,
    })
    assert_one_line_exit_2("wrong token", results["wrong token"], "--verify-auth-token-file", "UNAUTHENTICATED", "invalid bearer token")
    assert_one_line_exit_2("client token", results["client token"], "--verify-auth-token-file", "PERMISSION_DENIED")
    assert_one_line_exit_2("no token", results["no token"], "--verify-auth-token-file (not given)", "UNAUTHENTICATED")


def test_calibration_does_not_depend_on_what_the_target_writes(eos_verify, model_dir):
    """Case 1: adaptive tau calibrates against a target that ends every session at once; when
    the verify service cannot give it a session at all, it falls back with one warning."""
    v, files = eos_verify
    args = ["--model", model_dir("draft"), "--verify", v.address, "--verify-auth-token-file", files["session"], "--threads", "1",
            "--adaptive", "--log-level", "INFO"]
    d = Service("draft_service", *args)
    try:
        log = "".join(d.stderr)
        assert '"msg": "calibrated"' in log and "calibration failed" not in log, log[-3000:]
        with Client(d.address, timeout=TIMEOUT) as c:
            r = c.generate(prompt_ids=[3, 4], max_new_tokens=8)
        assert r.finish_reason == "eos" and len(r.token_ids) == 1, r
    finally:
        d.stop()
    # the verify service's one session is taken: calibration cannot run, the draft starts anyway
    release = threading.Event()
    auth = [("authorization", f"Bearer {SESSION_TOKEN}")]

    def hold():
        yield pb.VerifyRequest(start=pb.SessionStart(prompt_ids=[3], max_new_tokens=4, vocab_fingerprint=fingerprint))
        release.wait(TIMEOUT)  # then the stream half-closes and the session ends

    with grpc.insecure_channel(v.address) as ch:
        fingerprint = pb_grpc.VerifyStub(ch).Info(pb.InfoRequest(), metadata=auth, timeout=TIMEOUT).vocab_fingerprint
        held = pb_grpc.VerifyStub(ch).Session(hold(), metadata=auth, timeout=TIMEOUT)
        try:
            assert wait_for(lambda: metric(v.metrics(), "specdec_live_sessions", service="verify") == 1, 20), v.metrics()
            d = Service("draft_service", *args)
            try:
                warnings = [line for line in "".join(d.stderr).splitlines() if "calibration failed" in line]
                assert len(warnings) == 1 and "RESOURCE_EXHAUSTED" in warnings[0], "".join(d.stderr)[-3000:]
            finally:
                d.stop()
        finally:
            release.set()
            held.cancel()
