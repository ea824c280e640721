"""The client library's retries (client/core.py) against a real verify service that is full:
gRPC's own retry policy retries RESOURCE_EXHAUSTED before the first token, waiting as long as
the server's pushback says, and never once a token has been streamed."""
import asyncio
import time
from concurrent import futures

import grpc
import pytest

from bench.launch import Service
from client import AsyncClient, Client
from helpers import metric, wait_for
from specdec import serving
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

LONG = dict(prompt_ids=[3, 4], max_new_tokens=3000)  # greedy: no EOS on long-target, runs for many seconds


@pytest.fixture(scope="module")
def full(model_dir):
    """A verify service that admits one session, and a client holding it."""
    v = Service("verify_service", "--model", model_dir("long-target"), "--max-sessions", "1", "--threads", "1", "--metrics-port", "0")
    try:
        yield v
    finally:
        v.stop()


def refusals(v: Service) -> float:
    return metric(v.metrics(), "specdec_capacity_rejections_total", reason="sessions")


def test_retries_wait_for_the_servers_pushback_then_give_up(full):
    with Client(full.address, target_only=True, timeout=60) as holder, \
            Client(full.address, target_only=True, timeout=60, retries=2) as c:
        it = holder.stream(**LONG)
        next(it)  # the one session the service admits
        before, t0 = refusals(full), time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            c.generate(prompt_ids=[3], max_new_tokens=2)
        took = time.monotonic() - t0
        it.close()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refusals(full) - before == 3  # the call and its 2 retries, each refused by the server
    # the retries waited for the server's pushback (1 s each), not gRPC's own 0.1-0.2 s backoff
    assert took >= 2 * serving.RETRY_AFTER_MS / 1000 * 0.95, took


def test_a_retry_gets_the_slot_once_it_is_free(full):
    """The first attempt is refused; the holder lets go meanwhile; a retry is served in full."""
    assert wait_for(lambda: metric(full.metrics(), "specdec_live_sessions", service="verify") == 0, 10)
    with Client(full.address, target_only=True, timeout=60) as holder:
        it = holder.stream(**LONG)
        next(it)
        before = refusals(full)

        async def run():
            async with AsyncClient(full.address, target_only=True, timeout=60, retries=4) as c:
                task = asyncio.ensure_future(c.generate(prompt_ids=[3], max_new_tokens=5))
                for _ in range(200):  # bounded: until the first refusal (then 1 s before the retry)
                    if refusals(full) > before or task.done():
                        break
                    await asyncio.sleep(0.02)
                it.close()  # frees the slot before the retry
                return await task

        r = asyncio.run(run())
    assert len(r.token_ids) == 5 and r.finish_reason == "length"
    assert refusals(full) - before >= 1


def test_a_server_killed_mid_stream_is_unavailable_to_its_caller(model_dir):
    """The verify service is killed mid-stream with retries on: UNAVAILABLE reaches the caller
    after the tokens it had (that the call is not sent again is tested where the server stays up:
    tests/test_client_edges.py)."""
    v = Service("verify_service", "--model", model_dir("long-target"), "--threads", "1")
    try:
        with Client(v.address, target_only=True, timeout=60, retries=4) as c:
            it = c.stream(**LONG)
            ids = list(next(it).token_ids)
            v.proc.kill()
            with pytest.raises(grpc.RpcError) as e:
                for chunk in it:  # bounded: the stream ends with the killed server
                    ids += chunk.token_ids
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert 0 < len(ids) < LONG["max_new_tokens"]
    finally:
        v.stop()


def test_the_timeout_bounds_the_whole_request_fallback_included():
    """A draft service that answers UNAVAILABLE after 1 s, and a fallback verify service that
    answers after 2.5 s: with timeout=3 the request ends DEADLINE_EXCEEDED (the fallback gets what
    is left, 2 s), where each attempt's own 3 s made it a success after 3.5 s."""
    class Slow(pb_grpc.DraftServicer, pb_grpc.VerifyServicer):
        def __init__(self, wait_s, fail):
            self.wait_s, self.fail = wait_s, fail

        def Generate(self, request, context):
            time.sleep(self.wait_s)
            if self.fail:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the draft's verify service is gone")
            yield pb.GenerateResponse(token_ids=[3], text="w3", finish_reason=pb.FINISH_REASON_LENGTH)

    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_DraftServicer_to_server(Slow(1.0, True), server)
    pb_grpc.add_VerifyServicer_to_server(Slow(2.5, False), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        with Client(address, fallback=address, timeout=60) as c:  # the fallback serves it, given the time
            assert c.generate(prompt="w3").served_by == "verify"
        with Client(address, fallback=address, timeout=3) as c, pytest.raises(grpc.RpcError) as e:
            c.generate(prompt="w3")
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        async def run():
            async with AsyncClient(address, fallback=address, timeout=3) as c:
                await c.generate(prompt="w3")
        with pytest.raises(grpc.RpcError) as e:
            asyncio.run(run())
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        server.stop(0)
