"""The client library and CLI at their edges (client/core.py, client/__main__.py): a server that
ends a stream too early, bad timeouts and TLS files, an asyncio client made outside its loop, and
the CLI's exits on Ctrl-C and on a closed stdout. The server is a real gRPC server on loopback
whose Draft.Generate misbehaves on purpose, chosen by the prompt."""
import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest

from client import AsyncClient, Client
from client import StreamError
from client.core import AFTER_FINISH, CLOSED, NO_FINISH, NO_RESPONSE, check_timeout, make_request
from specdec.files import StartupError
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)


class Odd(pb_grpc.DraftServicer):
    calls: dict[str, int] = {}  # Generate calls by request_id (a retried call arrives again)
    active: dict[str, int] = {}  # ... running now

    def Generate(self, request, context):
        rid = request.request_id
        self.calls[rid] = self.calls.get(rid, 0) + 1
        self.active[rid] = self.active.get(rid, 0) + 1
        try:
            yield from self._generate(request, context)
        finally:
            self.active[rid] -= 1

    def _generate(self, request, context):
        if request.prompt.startswith("full"):  # refused, to be tried again 10 ms later
            context.set_trailing_metadata((("grpc-retry-pushback-ms", "10"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        if request.prompt == "hang":  # no token for up to 30 s
            for _ in range(600):
                if not context.is_active():
                    return
                time.sleep(0.05)
        if request.prompt == "empty":  # OK with no message
            return
        if request.prompt == "lateend":  # the final chunk at once, the call's end 4 s later (a verifier slow to end its session)
            yield pb.GenerateResponse(token_ids=[5], text="w5", finish_reason=pb.FINISH_REASON_LENGTH)
            for _ in range(80):
                if not context.is_active():
                    return
                time.sleep(0.05)
            return
        if request.prompt == "unknownfin":  # a finish reason a newer server might add
            yield pb.GenerateResponse(token_ids=[5], text="w5", finish_reason=99)
            return
        yield pb.GenerateResponse(token_ids=[3], text="w3")
        if request.prompt == "nofinish":  # OK before the final chunk
            return
        if request.prompt == "afterfinish":  # a chunk after the final one
            yield pb.GenerateResponse(token_ids=[5], text=" w5", finish_reason=pb.FINISH_REASON_LENGTH)
            yield pb.GenerateResponse(token_ids=[6], text=" w6")
            return
        if request.prompt == "dies":  # a token, then a failure a retry policy would take before any token
            context.set_trailing_metadata((("grpc-retry-pushback-ms", "10"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "gone mid-stream")
        if request.prompt == "slow":  # a chunk every 50 ms, for at most 30 s
            for _ in range(600):
                if not context.is_active():
                    return
                time.sleep(0.05)
                yield pb.GenerateResponse(token_ids=[4], text=" w4")
        yield pb.GenerateResponse(token_ids=[5], text=" w5", finish_reason=pb.FINISH_REASON_LENGTH)


@pytest.fixture(scope="module")
def odd():
    server = grpc.server(futures.ThreadPoolExecutor(8))
    pb_grpc.add_DraftServicer_to_server(Odd(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "client", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=60, **kw)


@pytest.mark.parametrize("prompt,why", [("empty", NO_RESPONSE), ("nofinish", NO_FINISH)])
def test_a_stream_that_ends_early_is_an_internal_error(odd, prompt, why):
    """Before: no message was a bare StopIteration (sync) or an AttributeError (asyncio); a stream
    without its final chunk was a success with finish_reason 'unspecified' and exit 0."""
    with Client(odd, timeout=10) as c:
        for call in (lambda: c.generate(prompt=prompt), lambda: list(c.stream(prompt=prompt))):
            with pytest.raises(StreamError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INTERNAL and e.value.details() == why

    async def run():
        async with AsyncClient(odd, timeout=10) as c:
            with pytest.raises(StreamError, match=re.escape(why)):
                await c.generate(prompt=prompt)
            with pytest.raises(StreamError, match=re.escape(why)):
                [x async for x in c.stream(prompt=prompt)]
    asyncio.run(run())
    for extra in ([], ["--json"]):
        p = cli("generate", "--server", odd, "--prompt", prompt, "--timeout", "10", *extra)
        assert p.returncode == 1 and p.stderr.strip().splitlines() == [f"error: INTERNAL: {why}"], p.stderr


def test_a_whole_stream_still_succeeds(odd):
    with Client(odd, timeout=10) as c:
        r = c.generate(prompt="ok")
    assert (r.token_ids, r.text, r.finish_reason) == ([3, 5], "w3 w5", "length")


def test_timeouts():
    """0, negative and NaN are refused (each failed at once as DEADLINE_EXCEEDED); inf and values
    past gRPC's deadline arithmetic (1e10 s failed at once too) mean no deadline."""
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout must be > 0"):
            check_timeout(bad)
    assert check_timeout(float("inf")) is None and check_timeout(1e10) is None and check_timeout(2.5) == 2.5
    for bad in ("0", "-1", "nan", "x"):
        p = cli("generate", "--server", "127.0.0.1:1", "--prompt", "x", "--timeout", bad)
        assert p.returncode == 2 and "--timeout" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_inf_and_huge_timeouts_reach_the_server(odd):
    for t in (float("inf"), 1e10):
        with Client(odd, timeout=t) as c:
            assert c.generate(prompt="ok").finish_reason == "length"
    p = cli("generate", "--server", odd, "--prompt", "ok", "--timeout", "inf", "--json")
    assert p.returncode == 0, p.stderr


def test_a_tls_file_that_is_not_pem_names_its_flag(tmp_path, odd):
    """Before: accepted, then UNAVAILABLE at connect time with gRPC's own log lines."""
    bad = tmp_path / "garbage.pem"
    bad.write_text("garbage\n")
    with pytest.raises(StartupError, match=f"--tls-ca {bad}: not a PEM file"):
        Client(odd, tls_ca=str(bad))
    p = cli("generate", "--server", odd, "--prompt", "ok", "--tls-ca", str(bad))
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [f"error: --tls-ca {bad}: not a PEM file (no -----BEGIN line)"], p.stderr


def test_an_async_client_made_outside_its_loop_works(odd):
    """grpc.aio channels belong to the loop they are made in: a client made at import time failed
    in asyncio.run with 'attached to a different loop'."""
    c = AsyncClient(odd, timeout=10)

    async def run():
        try:
            return await c.generate(prompt="ok")
        finally:
            await c.close()
    assert asyncio.run(run()).token_ids == [3, 5]


def test_the_cli_exits_quietly_on_ctrl_c_and_on_a_closed_stdout(odd):
    """Each gave a traceback on stderr: KeyboardInterrupt (exit 130 with 25 lines), BrokenPipeError (`| head -c 5`)."""
    args = [sys.executable, "-m", "client", "generate", "--server", odd, "--prompt", "slow", "--timeout", "60"]
    p = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.read(5) == b"w3 w4"  # it is streaming
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 130 and err == b"", err
    p = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.read(5) == b"w3 w4"
        p.stdout.close()  # the reader goes away: the next write fails
        err = p.stderr.read()
        p.wait(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 141 and err == b"", err
    # --json (and info) print once, at the end: with stdout buffered (no PYTHONUNBUFFERED) the write failed only at the
    # interpreter's exit, after the handler: exit 120 with "Exception ignored ... BrokenPipeError"
    buffered = {k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"}
    for extra in (["--json"], []):
        r, w = os.pipe()
        os.close(r)  # the reader has gone before anything is written
        try:
            p = subprocess.run([*args[:-4], "--prompt", "ok", "--timeout", "60", *extra], cwd=ROOT, env=buffered, stdout=w,
                               stderr=subprocess.PIPE, timeout=60)
        finally:
            os.close(w)
        assert p.returncode == 141 and p.stderr == b"", (extra, p.stderr)


def test_one_stop_string_is_one_stop_string():
    """make_request(stop="END") sent three stop strings, "E", "N" and "D" (protobuf iterates a str
    given for a repeated field), so generation stopped at the first of those letters."""
    from client import make_request

    assert list(make_request(prompt="ok", stop="END").stop) == ["END"]
    assert list(make_request(prompt="ok", stop=["a", "b"]).stop) == ["a", "b"] and not make_request(prompt="ok").stop


def test_a_request_and_its_parameters_are_not_both_taken(odd):
    """generate(request, max_new_tokens=8) sent the request and dropped the parameters silently;
    make_request(proposal_mode="Greedy") was a bare KeyError."""
    from client import make_request

    with Client(odd, timeout=10) as c, pytest.raises(TypeError, match="max_new_tokens"):
        c.generate(make_request(prompt="ok"), max_new_tokens=8)
    with pytest.raises(ValueError, match="proposal_mode must be one of dense, greedy, sparse"):
        make_request(prompt="ok", proposal_mode="Greedy")
    with pytest.raises(ValueError, match="proposer must be one of"):
        make_request(prompt="ok", proposer="oracle")


def test_retries_reach_requests_past_grpcs_default_retry_buffer(odd):
    """gRPC keeps a copy of a request to send again only up to its retry buffer (256 KiB by
    default): a request of 300 KB (a long prompt) was sent once and never retried."""
    for rid, prompt in (("small", "full"), ("large", "full" + "x" * 300_000)):
        with Client(odd, timeout=30, retries=4) as c, pytest.raises(grpc.RpcError) as e:
            c.generate(prompt=prompt, request_id=rid)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and Odd.calls[rid] == 5, (rid, Odd.calls)


def test_a_stream_that_failed_after_a_token_is_not_sent_again(odd):
    """The server streams a token, then fails with a retryable status and a pushback: the call
    reaches it once (gRPC does not retry a call that has had a response), so no token comes twice."""
    for sync in (True, False):
        rid, ids = f"dies-{sync}", []
        if sync:
            with Client(odd, timeout=30, retries=4) as c, pytest.raises(grpc.RpcError) as e:
                for chunk in c.stream(prompt="dies", request_id=rid):
                    ids += chunk.token_ids
        else:
            async def run():
                async with AsyncClient(odd, timeout=30, retries=4) as c:
                    async for chunk in c.stream(prompt="dies", request_id=rid):
                        ids.extend(chunk.token_ids)
            with pytest.raises(grpc.RpcError) as e:
                asyncio.run(run())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and Odd.calls[rid] == 1 and ids == [3], (sync, ids)


def test_an_interrupt_before_the_first_token_cancels_the_call(odd):
    """Ctrl-C while the sync client waits for its first token: the call is cancelled at once, not
    when the traceback (which a REPL keeps, and with it the call) is dropped."""
    import _thread
    import threading

    with Client(odd, timeout=30) as c:
        timer = threading.Timer(0.5, _thread.interrupt_main)  # Ctrl-C's KeyboardInterrupt, in the main thread
        timer.start()
        kept = None
        try:
            c.generate(prompt="hang", request_id="interrupted")
        except (KeyboardInterrupt, RuntimeError) as e:  # inside gRPC's locks it can surface as RuntimeError (client/__main__.py)
            kept = e  # its traceback holds the frames, as a REPL's last traceback does
        finally:
            timer.cancel()
        deadline = time.monotonic() + 10
        while Odd.active.get("interrupted") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kept is not None and Odd.calls["interrupted"] == 1 and Odd.active["interrupted"] == 0


def test_an_async_client_serves_one_loop_after_another_and_after_close(odd):
    """Its channels were made once: a second asyncio.run failed with 'Event loop is closed' (not a
    gRPC error), and a client used again after close() with 'Channel is closed'."""
    c = AsyncClient(odd, timeout=10)

    async def once():
        return (await c.generate(prompt="ok")).token_ids

    assert asyncio.run(once()) == [3, 5] and asyncio.run(once()) == [3, 5]

    async def twice():
        out = []
        for _ in range(2):
            async with c:
                out.append(await once())
        return out

    assert asyncio.run(twice()) == [[3, 5], [3, 5]]


def test_values_that_cannot_go_in_a_request_name_their_field(odd):
    """make_request raised protobuf's bare 'Value out of range: -1' (no field named) or a TypeError
    for a stop that is not a string; the CLI printed a traceback for a prompt that is not UTF-8
    (bytes a shell passed through); retries=1.5 made every call fail with a service-config error."""
    from client import make_request

    for kw, field in ((dict(max_new_tokens=-1), "max_new_tokens"), (dict(seed=-1), "seed"), (dict(top_k=2**32), "top_k"),
                      (dict(prompt_ids=[2**31]), "prompt_ids"), (dict(stop=["x", None]), "stop"),
                      (dict(prompt="\udcff"), "prompt"), (dict(num_draft_tokens=1.5), "num_draft_tokens"),
                      # float32 fields: 1e-50 arrived as 0 (greedy; for top_p, unset, i.e. no nucleus)
                      (dict(temperature=1e-50), "temperature"), (dict(top_p=1e-50), "top_p"), (dict(early_stop_p=1e-50), "early_stop_p"),
                      (dict(temperature="0.7"), "temperature")):
        with pytest.raises(ValueError, match=f"^{field}"):
            make_request(**kw)
    import numpy as np
    import torch

    # what stands for an int (a tokenizer's numpy or torch ids) is taken, as protobuf takes it
    r = make_request(prompt_ids=list(np.array([3, 4])) + [torch.tensor(5)], max_new_tokens=np.int64(8))
    assert list(r.prompt_ids) == [3, 4, 5] and r.max_new_tokens == 8
    # an array itself: its truth test raised (several ids) or dropped it (one id 0: the server saw an empty prompt)
    assert list(make_request(prompt_ids=np.array([3, 4])).prompt_ids) == [3, 4]
    assert list(make_request(prompt_ids=np.array([0])).prompt_ids) == [0]
    for bad in (-1, 5, 1.5, True):
        with pytest.raises(ValueError, match="retries must be an integer in \\[0, 4\\]"):
            Client(odd, retries=bad)
    p = cli("generate", "--server", odd, "--prompt", os.fsdecode(b"\xff"))
    assert p.returncode == 1 and p.stderr.strip().splitlines() == ["error: INVALID_ARGUMENT: --prompt is not UTF-8 text"], p.stderr
    p = cli("generate", "--server", odd, "--prompt", "ok", "--tau", "-1")
    assert p.returncode == 1 and "--tau must be an integer in [0, 4294967295]" in p.stderr, p.stderr
    p = cli("generate", "--server", odd, "--prompt", "ok", "--retries", "7")
    assert p.returncode == 2 and "--retries" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_failure_after_the_final_chunk_leaves_the_result_whole(odd):
    """The server may end the call a while after its final chunk (the draft service waits up to a
    second for the verifier to end its session). A deadline that passed in between made a
    finished generation DEADLINE_EXCEEDED: generate() lost its result, stream() raised after its
    last token, the CLI printed the text and then an error, exit 1."""
    with Client(odd, timeout=2) as c:
        assert c.generate(prompt="lateend").token_ids == [5]
        assert [x.finish_reason for x in c.stream(prompt="lateend")] == [pb.FINISH_REASON_LENGTH]

    async def run():
        async with AsyncClient(odd, timeout=2) as c:
            r = await c.generate(prompt="lateend")
            return r.text, [x.text async for x in c.stream(prompt="lateend")]
    assert asyncio.run(run()) == ("w5", ["w5"])
    p = cli("generate", "--server", odd, "--prompt", "lateend", "--timeout", "2")
    assert p.returncode == 0 and p.stdout == "w5\n", (p.stdout, p.stderr)
    with Client(odd, timeout=2) as c:  # a deadline before the final chunk is still an error
        with pytest.raises(grpc.RpcError) as e:
            c.generate(prompt="slow")
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def _self_signed(d, name):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}", "-days", "1"],
                   cwd=d, check=True, capture_output=True)
    return os.path.join(d, f"{name}.pem"), os.path.join(d, f"{name}.key")


def test_tls_files_that_are_pem_but_not_what_their_flag_says_name_the_flags(tmp_path, odd):
    """A certificate and key that are not one pair (swapped, or another certificate's key), or a
    key given as the CA: gRPC took them, then failed every call UNAVAILABLE after its own log
    lines, which --retries and --fallback tried again, and the error named the fallback."""
    a_pem, a_key = _self_signed(tmp_path, "a")
    b_pem, b_key = _self_signed(tmp_path, "b")
    for cert, key in ((a_key, a_pem), (a_pem, b_key)):
        with pytest.raises(StartupError, match=f"--tls-cert {re.escape(cert)} and --tls-key {re.escape(key)}: not a certificate and its private key"):
            Client(odd, tls_cert=cert, tls_key=key)
        p = cli("generate", "--server", odd, "--fallback", odd, "--retries", "2", "--prompt", "ok", "--tls-cert", cert, "--tls-key", key)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "--tls-cert" in p.stderr, p.stderr
    with pytest.raises(StartupError, match=f"--tls-ca {re.escape(a_key)}: no CA certificate in it"):
        Client(odd, tls_ca=a_key)
    Client(odd, tls_ca=a_pem, tls_cert=b_pem, tls_key=b_key).close()  # files that are what they say are taken
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:1024", "-nodes", "-keyout", "small.key", "-out", "small.pem",
                    "-subj", "/CN=small", "-days", "1"], cwd=tmp_path, check=True, capture_output=True)
    # a pair whose key OpenSSL's default security level calls too small was refused as "not a pair"
    Client(odd, tls_ca=a_pem, tls_cert=str(tmp_path / "small.pem"), tls_key=str(tmp_path / "small.key")).close()


def test_tokens_and_flags_the_cli_would_drop_or_send_broken_are_refused(tmp_path, odd):
    """--token "" sent no header, a token with a line break or a non-ASCII character failed in
    gRPC with its log lines (an undecodable byte: a traceback), --token beside --token-file was
    dropped without a word; so were --fallback with --target-only and --fallback-token-file
    without --fallback. Each is one line, exit 2, and never shows the token."""
    f = tmp_path / "tok"
    f.write_text("filetoken\n")
    for args, says in ((["--token", ""], "--token (token): the token is empty"),
                       (["--token", "hunter2\nx"], "--token (token): the token must be one line of printable ASCII"),
                       (["--token", "hunter\u00e92"], "--token (token): the token must be one line of printable ASCII"),
                       (["--token", os.fsdecode(b"hunter\xff2")], "--token (token): the token must be one line of printable ASCII"),
                       (["--token", "x", "--token-file", str(f)], "not allowed with argument"),
                       (["--target-only", "--fallback", odd], "--fallback with --target-only"),
                       (["--fallback-token-file", str(f)], "--fallback-token-file without --fallback")):
        p = cli("generate", "--server", odd, "--prompt", "ok", *args)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 2 and says in last and "hunter" not in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    with pytest.raises(StartupError, match="token is empty"):
        Client(odd, token="")
    with pytest.raises(ValueError, match="target_only already asks a verify service"):
        Client(odd, target_only=True, fallback=odd)


def test_a_stream_that_goes_on_after_its_final_chunk_says_so(odd):
    """From a review: a chunk after the final one was reported as "the stream ended before its
    final chunk", which was false."""
    with Client(odd, timeout=10) as c:
        with pytest.raises(StreamError, match=re.escape(AFTER_FINISH)):
            c.generate(prompt="afterfinish")

    async def run():
        async with AsyncClient(odd, timeout=10) as c:
            with pytest.raises(StreamError, match=re.escape(AFTER_FINISH)):
                await c.generate(prompt="afterfinish")
    asyncio.run(run())


def test_a_finish_reason_the_client_does_not_know_is_named_not_an_error(odd):
    """From a review: a newer server's finish reason (99 here) made generate() raise ValueError
    and the CLI's --json print a traceback."""
    with Client(odd, timeout=10) as c:
        assert c.generate(prompt="unknownfin").finish_reason == "unknown_99"
    p = cli("generate", "--server", odd, "--prompt", "unknownfin", "--json", "--timeout", "10")
    assert p.returncode == 0 and '"finish_reason": "unknown_99"' in p.stdout, p.stderr


def test_prompt_ids_from_an_iterator_are_sent_whole():
    """From a review: the ids were checked by iterating them, then the spent iterator was sent: an
    empty prompt, which the server refused as "empty (set prompt or prompt_ids)"."""
    assert list(make_request(prompt_ids=iter([3, 4])).prompt_ids) == [3, 4]
    assert list(make_request(prompt_ids=(i for i in (5, 6))).prompt_ids) == [5, 6]


def test_closing_an_async_client_mid_stream_is_cancelled_not_a_cancelled_task(odd):
    """From a review: close() during a stream raised CancelledError in the reading task, which
    nobody had cancelled (a TaskGroup or asyncio.timeout takes that for its own); the blocking
    client raised an RpcError CANCELLED. Now both do."""
    async def run():
        c = AsyncClient(odd, timeout=30)
        got = []

        async def read():
            async for chunk in c.stream(prompt="slow"):
                got.append(chunk)

        task = asyncio.create_task(read())
        for _ in range(200):  # at most 10 s for the first chunk
            if got:
                break
            await asyncio.sleep(0.05)
        await c.close()
        with pytest.raises(StreamError) as e:
            await asyncio.wait_for(task, 10)
        return e.value, task.cancelled()
    err, cancelled = asyncio.run(run())
    assert err.code() == grpc.StatusCode.CANCELLED and err.details() == CLOSED and not cancelled
    assert err.trailing_metadata() == () and err.initial_metadata() == ()  # gRPC's error methods, for generic handlers


def test_closing_a_blocking_client_mid_stream_is_a_stream_error_too(odd):
    """From a review: README said a stream the client's own close() cuts raises StreamError
    CANCELLED; the blocking client raised gRPC's own error ("Channel closed!")."""
    c = Client(odd, timeout=30)
    chunks = c.stream(prompt="slow")
    next(chunks)
    threading.Timer(0.2, c.close).start()  # from another thread, while the caller waits for the next chunk
    with pytest.raises(StreamError) as e:
        for _ in chunks:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED and e.value.details() == CLOSED


def test_closing_a_blocking_client_before_the_first_chunk_is_a_stream_error(odd):
    """From a review: a close() while the call waited for its first chunk (a long prefill, a full
    queue) still raised gRPC's own error, with or without a fallback."""
    for fallback in (None, odd):
        c = Client(odd, timeout=30, fallback=fallback)
        threading.Timer(0.3, c.close).start()
        with pytest.raises(StreamError) as e:
            c.generate(prompt="hang")
        assert e.value.code() == grpc.StatusCode.CANCELLED and e.value.details() == CLOSED


def test_addresses_that_are_no_grpc_target_are_bad_flags(odd):
    """From a review: --server "" printed gRPC's own log lines and failed UNKNOWN (exit 1);
    http://host:port failed UNAVAILABLE, which --retries and --fallback then tried again."""
    for args in (["--server", ""], ["--server", "http://127.0.0.1:1"], ["--server", odd, "--fallback", ""],
                 ["--server", odd, "--fallback", "https://127.0.0.1:1"]):
        p = cli("generate", *args, "--prompt", "ok")
        last = p.stderr.strip().splitlines()[-1]  # argparse's usage, then its error
        assert p.returncode == 2 and ("--server" in last or "--fallback" in last) and "Traceback" not in p.stderr, (args, p.stderr)
    p = cli("generate", "--server", f"dns:///{odd}", "--prompt", "ok", "--timeout", "10")  # gRPC's own URI forms are addresses
    assert p.returncode == 0 and p.stdout == "w3 w5\n", p.stderr


def test_an_error_mid_stream_is_a_line_of_its_own(odd):
    """From a review: after partial text the CLI wrote its error line straight after it, so a
    terminal showed `w3error: ...`."""
    p = cli("generate", "--server", odd, "--prompt", "dies", "--timeout", "10")
    assert p.returncode == 1 and p.stdout == "w3\n", p.stdout
    assert p.stderr.strip().splitlines() == ["error: UNAVAILABLE: gone mid-stream"], p.stderr


class Fallback(pb_grpc.VerifyServicer):
    def Generate(self, request, context):
        yield pb.GenerateResponse(token_ids=[7], text="v7", finish_reason=pb.FINISH_REASON_LENGTH)


def test_the_fallback_takes_tls_of_its_own_and_a_fallback_is_said(tmp_path, odd, caplog):
    """From a review: one TLS set-up served both the draft and the fallback, so the documented
    split (a plaintext draft beside an mTLS verify service, deploy/k8s/overlays/gpu-mtls) had no
    working flags, and a draft that refused the client's TLS sent every request target-only
    without a word. The fallback now takes --fallback-tls-*, and a request that falls back says so."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", "v.key", "-out", "v.pem", "-subj", "/CN=verify", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-days", "1"], cwd=tmp_path, check=True, capture_output=True)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_VerifyServicer_to_server(Fallback(), server)
    creds = grpc.ssl_server_credentials([((tmp_path / "v.key").read_bytes(), (tmp_path / "v.pem").read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        tls = dict(fallback_tls_ca=str(tmp_path / "v.pem"))
        with Client(odd, fallback=f"127.0.0.1:{port}", timeout=10, **tls) as c:  # the draft answers, in plaintext
            assert c.generate(prompt="ok").served_by == "draft"
        caplog.set_level("WARNING", logger="specdec.client")
        with Client("127.0.0.1:1", fallback=f"127.0.0.1:{port}", timeout=10, **tls) as c:  # the draft is down
            r = c.generate(prompt="ok")
        assert (r.served_by, r.text) == ("verify", "v7")
        assert any("goes target-only to the fallback verify service" in m for m in caplog.messages), caplog.messages
        p = cli("generate", "--server", "127.0.0.1:1", "--fallback", f"127.0.0.1:{port}", "--fallback-tls-ca", str(tmp_path / "v.pem"),
                "--prompt", "ok", "--timeout", "10")
        assert p.returncode == 0 and p.stdout == "v7\n" and "goes target-only to the fallback" in p.stderr, p.stderr
    finally:
        server.stop(0)
    with pytest.raises(ValueError, match="without --fallback"):
        Client(odd, **tls)
    p = cli("generate", "--server", odd, "--prompt", "ok", "--fallback-tls-ca", str(tmp_path / "v.pem"))
    assert p.returncode == 2 and "--fallback-tls-ca without --fallback" in p.stderr, p.stderr
