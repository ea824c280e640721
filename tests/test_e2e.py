"""End to end through the real commands: both services as processes, the client CLI on top."""
import json
import subprocess
import sys
import time

import grpc
import pytest

from bench.launch import ENV, ROOT, start_pair
from client import AsyncClient, Client
from helpers import assert_health_and_reflection, metric, wait_for
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc


def cli(*args):
    r = subprocess.run([sys.executable, "-m", "client", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def test_cli_generate_json_speculative_equals_target_only(services):
    v, d = services("target", "draft")
    rc, out, err = cli("generate", "--server", d.address, "--prompt", "w3 w4 w5", "--max-new-tokens", "12", "--json")
    assert rc == 0, err
    spec = json.loads(out)
    assert 1 <= len(spec["token_ids"]) <= 12 and spec["finish_reason"] in ("eos", "length")
    for key in ("rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "accepted_per_position",
                "draft_s", "verify_s", "wall_s"):
        assert key in spec["stats"], key
    assert spec["stats"]["wall_s"] > 0 and spec["stats"]["rounds"] >= 1
    rc, out, err = cli("generate", "--server", v.address, "--target-only", "--prompt", "w3 w4 w5", "--max-new-tokens", "12", "--json")
    assert rc == 0, err
    assert json.loads(out)["token_ids"] == spec["token_ids"]
    rc, out, err = cli("generate", "--server", d.address, "--prompt", "w3 w4 w5", "--max-new-tokens", "12", "--tree-budget", "8",
                       "--tau", "3", "--proposer", "draft", "--json")
    assert rc == 0, err
    tree = json.loads(out)
    assert tree["token_ids"] == spec["token_ids"] and tree["stats"]["tree_rounds"] > 0


def test_cli_prompt_ids_and_sampling_flags(services):
    """The CLI's sampling flags reach the server: its seeded tokens are the client library's with
    the same top-k and top-p, for a seed whose draws those filters change (two equal CLI runs
    did not notice a dropped --top-k)."""
    from client import Client

    _, d = services("target", "draft")
    with Client(d.address, timeout=60) as c:
        for seed in range(10):
            want = c.generate(prompt_ids=[3, 4, 5], max_new_tokens=10, temperature=0.9, top_k=2, top_p=0.9, seed=seed)
            if want.token_ids != c.generate(prompt_ids=[3, 4, 5], max_new_tokens=10, temperature=0.9, top_p=0.9, seed=seed).token_ids:
                break
        else:
            pytest.fail("top-k changed no seed's tokens")
    rc, out, err = cli("generate", "--server", d.address, "--prompt-ids", "3,4,5", "--max-new-tokens", "10", "--temperature", "0.9",
                       "--top-k", "2", "--top-p", "0.9", "--seed", str(seed), "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got["token_ids"] == want.token_ids and got["seed"] == seed


@pytest.mark.parametrize("args,field", [
    (["--prompt", ""], "prompt"),
    (["--prompt", "w3", "--top-p", "1.5"], "top_p"),
    (["--prompt", "w3", "--temperature", "-1"], "temperature"),
    (["--prompt-ids", "3,99"], "prompt_ids"),
    (["--prompt", "w3", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt", "w3", "--tau", "1000"], "num_draft_tokens"),
    (["--prompt", "w3", "--tree-budget", "65"], "tree_budget"),
    (["--prompt", "w3", "--tree-budget", "-1"], "--tree-budget"),
    (["--prompt", "w3", "--seed", "-1"], "--seed"),  # checked before the call: the proto's fields would raise
    (["--prompt", "w3", "--max-new-tokens", "99999999999"], "--max-new-tokens"),
    (["--prompt-ids", "3,99999999999"], "--prompt-ids"),
])
def test_cli_reports_status_code_and_message(services, args, field):
    _, d = services("target", "draft")
    rc, out, err = cli("generate", "--server", d.address, *args)
    assert rc != 0 and "INVALID_ARGUMENT" in err and field in err and "Traceback" not in err, err


def test_cli_tls_files_it_cannot_use_are_one_line_errors():
    for args, words in ((["--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem"),
                        (["--tls-cert", "/nonexistent/cert.pem"], "--tls-key")):  # a certificate without its key
        rc, _, err = cli("generate", "--server", "127.0.0.1:1", "--prompt", "w3", *args)
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_cli_unreachable_server_is_unavailable():
    rc, _, err = cli("generate", "--server", "127.0.0.1:1", "--prompt", "w3", "--timeout", "5")
    assert rc != 0 and "UNAVAILABLE" in err


def test_seeded_determinism_and_seed_sensitivity(services):
    _, d = services("target", "draft")
    with Client(d.address, timeout=60) as c:
        outs = [c.generate(prompt_ids=[3, 4], max_new_tokens=20, temperature=1.0, seed=s).token_ids for s in (1, 1, 2, 3)]
    assert outs[0] == outs[1]
    assert len({tuple(o) for o in outs[1:]}) > 1


def test_async_client_streams_chunks(services):
    import asyncio

    _, d = services("target", "draft")

    async def run():
        async with AsyncClient(d.address, timeout=60) as c:
            chunks = [ch async for ch in c.stream(prompt="w3 w4", max_new_tokens=15, num_draft_tokens=3)]
            one = await c.generate(prompt="w3 w4", max_new_tokens=15, num_draft_tokens=3)
        return chunks, one

    chunks, one = asyncio.run(run())
    assert len(chunks) > 1 and chunks[-1].finish_reason != 0
    assert [t for ch in chunks for t in ch.token_ids] == one.token_ids
    assert "".join(ch.text for ch in chunks) == one.text


def test_health_and_reflection_on_both_services(services):
    v, d = services("target", "draft")
    for svc, name in ((v, "specdec.v1.Verify"), (d, "specdec.v1.Draft")):
        with grpc.insecure_channel(svc.address) as ch:
            assert_health_and_reflection(ch, name)


def test_fingerprint_mismatch_is_refused(services, model_dir):
    v, _ = services("target", "draft")
    with grpc.insecure_channel(v.address) as ch:
        start = pb.SessionStart(prompt_ids=[3], max_new_tokens=2, vocab_fingerprint="0" * 64)
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.VerifyStub(ch).Session(iter([pb.VerifyRequest(start=start)]), timeout=10))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # a draft whose vocabulary differs from the verify service's refuses to start
    r = subprocess.run([sys.executable, "-m", "draft_service", "--model", model_dir("other-vocab"), "--port", "0", "--verify", v.address],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "fingerprint" in r.stderr


def test_cancelled_stream_frees_the_verify_session_at_once(services):
    v, d = services("long-target", "long-draft")
    gen0 = metric(v.metrics(), "specdec_generated_tokens_total", service="verify")
    with Client(d.address, timeout=120) as c:
        # greedy: long-target's greedy run never reaches EOS; a sampled run's path depends on the draft's
        # numbers, which its load-time kernel choices can change, and one such path ended after two rounds
        it = c.stream(prompt_ids=[3], max_new_tokens=3000, temperature=0.0, num_draft_tokens=2)
        next(it)
        assert metric(v.metrics(), "specdec_live_sessions", service="verify") == 1
        it.close()  # stop reading: the client cancels the RPC
    assert wait_for(lambda: metric(v.metrics(), "specdec_live_sessions", service="verify") == 0, 5)
    assert metric(v.metrics(), "specdec_reserved_tokens") == 0
    assert metric(v.metrics(), "specdec_cached_tokens") == 0
    assert metric(d.metrics(), "specdec_live_sessions", service="draft") == 0
    assert metric(v.metrics(), "specdec_generated_tokens_total", service="verify") == gen0  # it never finished


def test_sigterm_drains_running_streams(model_dir):
    v, d = start_pair(("--model", model_dir("long-target"), "--drain-s", "60", "--log-level", "INFO"),
                      ("--model", model_dir("long-draft"), "--drain-s", "60", "--log-level", "INFO"))
    try:
        with Client(d.address, timeout=120) as c:
            it = c.stream(prompt_ids=[3, 4], max_new_tokens=400, num_draft_tokens=1)
            first = next(it)
            d.proc.send_signal(15)
            v.proc.send_signal(15)
            draining = lambda svc: any('"msg": "draining"' in line for line in svc.stderr)  # noqa: E731
            assert wait_for(lambda: draining(d) and draining(v), 30), (d.stderr[-3:], v.stderr[-3:])
            assert d.proc.poll() is None and v.proc.poll() is None  # still draining
            with pytest.raises(grpc.RpcError):  # new requests are refused while draining
                Client(d.address, timeout=5).generate(prompt_ids=[3], max_new_tokens=2)
            rest = list(it)  # the running stream completes
            assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert len(first.token_ids) + sum(len(ch.token_ids) for ch in rest) == 400
        assert d.proc.wait(30) == 0 and v.proc.wait(30) == 0
    finally:
        d.stop()
        v.stop()


def test_sigterm_before_serving_ends_the_service_with_one_line(model_dir, tmp_path):
    """A pod deleted while its service loads: SIGTERM before `listening on` ends the process with
    one line and exit 143. Without a handler, a container's PID 1 ignores SIGTERM and went on to
    load and serve until the kubelet's kill. The service is held at start-up reading its token
    file, a FIFO: the signal is sent while it waits there, and the token written after it."""
    import os
    import signal

    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    for module in ("verify_service", "draft_service"):
        extra = ["--verify", "127.0.0.1:1"] if module == "draft_service" else []
        p = subprocess.Popen([sys.executable, "-m", module, "--model", model_dir("target"), "--port", "0",
                              "--auth-token-file", str(fifo), *extra], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            for _ in range(600):  # until the service opens the FIFO to read (a non-blocking writer needs a reader)
                try:
                    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                    break
                except OSError:
                    assert p.poll() is None, p.stderr.read()
                    time.sleep(0.05)
            else:
                pytest.fail("the service never opened its token file")
            try:
                p.send_signal(signal.SIGTERM)  # it reads its token file: past the handler's installation, before serving
            finally:
                # then the token: the read returns (whether or not the signal interrupted it; a signal taken by another
                # thread does not), and the handler runs at the main thread's next step, long before it could serve
                try:
                    os.write(writer, b"a-token\n")
                except BrokenPipeError:  # it has already stopped: no reader left
                    pass
                os.close(writer)
            try:
                out, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:  # say where it waits, for whoever meets this
                proc = f"/proc/{p.pid}"
                where = {name: open(f"{proc}/{name}").read().strip() for name in ("wchan",)}
                signals = [line for line in open(f"{proc}/status") if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))]
                pytest.fail(f"{module} did not end within 60 s of SIGTERM: {where}, {len(os.listdir(proc + '/task'))} threads, "
                            f"{''.join(signals)}")
        finally:
            p.kill()
        assert p.returncode == 143 and err.strip().splitlines()[-1] == f"python -m {module}: stopped by SIGTERM before serving", (module, err)
        assert "listening on" not in out


@pytest.mark.parametrize("name,code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_sigterm_before_serving_passes_out_of_an_event_loop_callback(capsys, name, code):
    """The draft does part of its start-up inside its event loop (waiting for its verify service,
    calibrating): a SIGTERM that lands in a loop callback must still end it. asyncio logs and drops
    an exception from a callback unless it is a SystemExit (or KeyboardInterrupt), so the first
    version's exception was swallowed there and the service went on to serve. Ctrl-C (SIGINT) in
    the model's load was a KeyboardInterrupt traceback: it ends the same way, in one line."""
    import asyncio
    import signal

    from specdec import startup

    sig = getattr(signal, name)

    async def starting():
        asyncio.get_running_loop().call_soon(startup._stop, sig, None)  # the handler, run as a callback
        for _ in range(100):
            await asyncio.sleep(0.01)

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(SystemExit) as e:
            startup.main("svc", lambda: asyncio.run(starting()))
        assert signal.getsignal(sig) is startup._stop  # installed for both
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert e.value.code == code and capsys.readouterr().err.strip() == f"svc: stopped by {name} before serving"
