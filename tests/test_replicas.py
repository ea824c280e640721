"""A draft service in front of several verify replicas (draft_service/replicas.py), with real
processes on loopback: sessions go where there is room, a refusal before the first verdict is
placed again on another replica, and the draft's readiness follows its replicas."""
import asyncio
import http.client
import json
import queue
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.launch import Service, free_port
from client import Client
from draft_service.upstream import PROBE_INTERVAL_S
from helpers import metric, wait_for
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

LONG = dict(prompt_ids=[3, 4], max_new_tokens=3000)  # greedy: no EOS on long-target, runs for many seconds


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="specdec.v1.Draft"), timeout=10).status


def sessions_done(v: Service) -> float:
    return metric(v.metrics(), "specdec_request_latency_seconds_count", service="verify", method="Session")


def test_info_reports_free_capacity(model_dir):
    v = Service("verify_service", "--model", model_dir("long-target"), "--max-sessions", "2", "--max-cached-tokens", "5000")
    try:
        with grpc.insecure_channel(v.address) as ch, Client(v.address, target_only=True, timeout=60) as holder:
            info = pb_grpc.VerifyStub(ch).Info(pb.InfoRequest(), timeout=10)
            assert (info.capacity.free_sessions, info.capacity.max_sessions) == (2, 2)
            assert info.capacity.free_cached_tokens == info.capacity.max_cached_tokens == 5000
            it = holder.stream(**dict(LONG, max_new_tokens=1000))
            next(it)
            info = pb_grpc.VerifyStub(ch).Info(pb.InfoRequest(), timeout=10)
            assert info.capacity.free_sessions == 1 and info.capacity.free_cached_tokens == 5000 - 1008  # prompt + max_new_tokens, in pages of 16
            it.close()
    finally:
        v.stop()


class Held:
    """n open sessions on a verify service, each with a one-token prompt and no round sent: each
    holds a session slot (and 16 cache tokens: a page) until released."""

    def __init__(self, address: str, n: int):
        self.channel = grpc.insecure_channel(address)
        stub = pb_grpc.VerifyStub(self.channel)
        fp = stub.Info(pb.InfoRequest(), timeout=10).vocab_fingerprint
        self.queues = [queue.Queue() for _ in range(n)]
        self.calls = []
        for q in self.queues:
            q.put(pb.VerifyRequest(start=pb.SessionStart(prompt_ids=[3], max_new_tokens=10, vocab_fingerprint=fp)))
            self.calls.append(stub.Session(iter(q.get, None), timeout=120))

    def release(self) -> None:
        for q, call in zip(self.queues, self.calls):
            q.put(None)
            call.cancel()
        self.channel.close()


def free(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.VerifyStub(ch).Info(pb.InfoRequest(), timeout=10).capacity.free_sessions


def refused(v: Service) -> float:
    return sum(metric(v.metrics(), "specdec_capacity_rejections_total", reason=r) for r in ("sessions", "cached_tokens"))


@pytest.fixture(scope="module")
def two(model_dir):
    """Verify A admits four sessions and 100 cache tokens; verify B three sessions, with room."""
    a = Service("verify_service", "--model", model_dir("long-target"), "--metrics-port", "0", "--max-sessions", "4",
                "--max-cached-tokens", "100", "--threads", "1")
    b = Service("verify_service", "--model", model_dir("long-target"), "--metrics-port", "0", "--max-sessions", "3", "--threads", "1")
    d = Service("draft_service", "--model", model_dir("long-draft"), "--verify", f"{a.address},{b.address}", "--metrics-port", "0",
                "--threads", "1")
    try:
        yield a, b, d
    finally:
        for s in (d, a, b):
            s.stop()


def test_a_refused_session_is_placed_on_the_other_replica(two):
    """A has more free sessions, so it is tried first, and refuses (the request's 123 cache tokens
    do not fit its 100): the draft opens the session on B before any token, and the client sees
    one clean stream, the target's own tokens."""
    a, b, d = two
    a0, b0 = refused(a), sessions_done(b)
    request = dict(prompt_ids=[3, 4, 5], max_new_tokens=120, num_draft_tokens=2)
    with Client(d.address, timeout=60) as c:
        r = c.generate(**request)
    assert len(r.token_ids) == 120 and r.finish_reason == "length"
    assert refused(a) == a0 + 1  # tried first, refused
    assert wait_for(lambda: sessions_done(b) == b0 + 1, 10)  # served there
    with Client(b.address, target_only=True, timeout=60) as vc:  # the same tokens as the target alone
        assert vc.generate(**request).token_ids == r.token_ids


def test_sessions_go_to_the_replica_with_the_most_room(two):
    """With three of A's four slots held, B (three free) has the most room: once the draft's poll
    has seen it, every session goes to B, and none is refused anywhere."""
    a, b, d = two
    held = Held(a.address, 3)
    try:
        assert wait_for(lambda: free(a.address) == 1, 10) and free(b.address) == 3
        refused0 = refused(a) + refused(b)
        placed = []
        with Client(d.address, timeout=60) as c:
            for _ in range(30):  # bounded: the draft polls its replicas every 2 s
                b0 = sessions_done(b)
                assert len(c.generate(prompt_ids=[3], max_new_tokens=4, num_draft_tokens=1).token_ids) == 4
                placed.append(wait_for(lambda: sessions_done(b) == b0 + 1, 2))
                if placed[-4:] == [True] * 4:
                    break
        assert placed[-4:] == [True] * 4, placed
        assert refused(a) + refused(b) == refused0
    finally:
        held.release()


def test_a_burst_between_two_polls_is_spread(two):
    """Sessions that arrive together (faster than the draft's 2 s poll) are spread over the
    replicas: the draft counts the sessions it has just opened against each one's free room."""
    import asyncio

    from client import AsyncClient

    a, b, d = two
    for v in (a, b):  # the last test's held sessions are counted once they have ended
        assert wait_for(lambda v=v: metric(v.metrics(), "specdec_live_sessions", service="verify") == 0, 20)

    async def burst():
        async with AsyncClient(d.address, timeout=60) as c:
            return await asyncio.gather(*(c.generate(prompt_ids=[3], max_new_tokens=6, num_draft_tokens=1) for _ in range(4)))

    for _ in range(3):  # bounded: a burst right after other traffic may meet a stale ranking (then a refusal)
        time.sleep(2.5)  # the draft's next poll of both replicas (every 2 s), all sessions closed
        a0, b0, ra, rb = sessions_done(a), sessions_done(b), refused(a), refused(b)
        assert all(len(r.token_ids) == 6 for r in asyncio.run(burst()))
        assert wait_for(lambda: sessions_done(a) + sessions_done(b) >= a0 + b0 + 4, 10)
        if refused(a) == ra and refused(b) == rb:
            break
    # with a fresh ranking (A 4 free, B 3) and no refusal: were the opened sessions not counted, A
    # (room for all four) would have taken them all
    assert (refused(a), refused(b)) == (ra, rb)
    assert sessions_done(a) - a0 >= 1 and sessions_done(b) - b0 >= 1, (sessions_done(a) - a0, sessions_done(b) - b0)


def test_readiness_follows_the_replicas_and_recovers(model_dir):
    """The draft is SERVING while a replica answers, NOT_SERVING once none does, and SERVING again
    (with a log line saying so) when one comes back on the same address; its HTTP /health says the
    same (200, then 503 "unavailable", then 200)."""
    v = Service("verify_service", "--model", model_dir("target"), "--threads", "1")
    d = Service("draft_service", "--model", model_dir("draft"), "--verify", v.address, "--threads", "1", "--log-level", "INFO",
                "--http-port", "0")
    host, port = v.address.rsplit(":", 1)

    def http_health() -> tuple[int, str]:
        conn = http.client.HTTPConnection(*d.http_address.split(":"), timeout=30)
        conn.request("GET", "/health")
        r = conn.getresponse()
        return r.status, json.loads(r.read())["status"]
    try:
        assert health(d.address) == health_pb2.HealthCheckResponse.SERVING
        assert http_health() == (200, "ok")
        v.stop()
        assert wait_for(lambda: health(d.address) == health_pb2.HealthCheckResponse.NOT_SERVING, 20)
        assert http_health() == (503, "unavailable")
        with Client(d.address, timeout=30) as c, pytest.raises(grpc.RpcError) as e:
            c.generate(prompt_ids=[3], max_new_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        v = Service("verify_service", "--model", model_dir("target"), "--threads", "1", "--port", port)
        assert wait_for(lambda: health(d.address) == health_pb2.HealthCheckResponse.SERVING, 20)
        assert wait_for(lambda: any("verify service answers" in line for line in d.stderr), 5), d.stderr[-5:]
        assert http_health() == (200, "ok")
        assert any("verify service lost" in line for line in d.stderr)
        with Client(d.address, timeout=30) as c:
            assert len(c.generate(prompt_ids=[3], max_new_tokens=3).token_ids) == 3
        # the replica comes back with another vocabulary: it answers, but would refuse every session (it stayed SERVING)
        v.stop()
        v = Service("verify_service", "--model", model_dir("stat-target"), "--threads", "1", "--port", port)
        time.sleep(3 * PROBE_INTERVAL_S)  # probes that reach it
        assert health(d.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert http_health() == (503, "unavailable")
    finally:
        d.stop()
        v.stop()


def test_scaleout_bench_spreads_one_burst_over_two_replicas(model_dir, tmp_path):
    """bench.scaleout, the capacity comparison of one verify replica and two behind one draft
    tier, runs end to end on tiny models: each configuration is measured, and with two replicas
    the burst is spread over both (the numbers themselves are the report's, not the test's)."""
    import json
    import subprocess
    import sys

    from bench.launch import ENV, ROOT

    cmd = [sys.executable, "-m", "bench.scaleout", "--target", model_dir("long-target"), "--draft", model_dir("long-draft"),
           "--sessions", "4", "--max-new-tokens", "8", "--repeats", "1", "--out", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "scaleout.json").read_text())
    one, two = res["runs"]["1"][0], res["runs"]["2"][0]
    assert one["tokens"] == two["tokens"] == 4 * 8 and one["tok_s"] > 0 and two["tok_s"] > 0
    assert one["sessions_per_replica"] == [4, 0] and min(two["sessions_per_replica"]) >= 1, two
    assert "Two replicas / one" in (tmp_path / "SCALEOUT.md").read_text()


def test_a_replica_that_leaves_twice_has_both_channels_closed_once_drained(monkeypatch):
    """An address that leaves the name while this draft has sessions there, comes back and leaves
    again: each time its channel waits for its own sessions, and both are closed once they end (a
    closed channel's calls raise UsageError, which the draft's Generate takes as the replica gone)."""
    from draft_service import replicas as placement

    answers: list[list[str]] = []

    async def resolve(name):  # what the DNS name resolves to at each poll
        return answers[-1]

    monkeypatch.setattr(placement, "resolve", resolve)
    made: list[grpc.aio.Channel] = []

    def make_channel(address, authority):
        made.append(grpc.aio.insecure_channel(address))
        return made[-1]

    async def run():
        r = placement.Replicas("dns:verify.example:50052", make_channel, timeout_s=0.2)
        address = f"127.0.0.1:{free_port()}"  # nothing listens there: its polls fail, which changes nothing here
        answers.append([address])
        await r.refresh()
        first = r.replicas[address]
        first.open = 1  # a session still running there
        answers.append([])
        await r.refresh()
        answers.append([address])
        await r.refresh()
        second = r.replicas[address]
        assert second is not first
        second.open = 1
        answers.append([])
        await r.refresh()
        assert made == [first.channel, second.channel]
        first.open = second.open = 0
        await r.refresh()
        for channel in made:
            with pytest.raises(grpc.aio.UsageError):
                await pb_grpc.VerifyStub(channel).Info(pb.InfoRequest(), timeout=1)
        await r.close()

    asyncio.run(run())


def test_a_replica_that_left_and_drained_takes_its_pace_with_it(monkeypatch):
    """The draft keeps one pace per verify address (draft_service/adaptive.py); a replica that
    left the name and whose sessions ended drops its pace, so a tier whose pods come and go does
    not keep one for every address it ever saw. One that stays keeps its pace."""
    from draft_service import adaptive
    from draft_service import replicas as placement

    answers: list[list[str]] = []

    async def resolve(name):
        return answers[-1]

    monkeypatch.setattr(placement, "resolve", resolve)
    monkeypatch.setattr(adaptive, "PACES", {})

    async def run():
        r = placement.Replicas("dns:verify.example:50052", lambda a, authority: grpc.aio.insecure_channel(a), timeout_s=0.2)
        stays, leaves = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        answers.append([stays, leaves])
        await r.refresh()
        kept, dropped = adaptive.pace_of(stays), adaptive.pace_of(leaves)
        r.replicas[leaves].open = 1
        answers.append([stays])
        await r.refresh()
        assert adaptive.PACES[leaves] is dropped  # a session still runs there
        gone = r._leaving[0]
        assert r.pace(gone) is not dropped and r.pace(r.replicas[stays]) is kept  # placed there after it left: a pace of its own
        gone.open = 0
        await r.refresh()
        assert adaptive.PACES == {stays: kept}
        assert r.pace(gone) is not r.pace(gone) and adaptive.PACES == {stays: kept}  # never kept for the address that left
        await r.close()

    asyncio.run(run())


def test_a_session_goes_only_to_replicas_whose_info_says_they_serve_it():
    """During a rolling change of replicas, a session is placed only where the replica's last
    Info says it serves it: the draft's vocabulary, and a tree of the request's tree_budget (a
    verifier older than trees would read a tree's nodes as one chain). A replica that has not
    answered yet stays a candidate."""
    from draft_service.replicas import Replica, Replicas

    async def run():
        r = Replicas("a:1,b:1,c:1,d:1", lambda address, authority: grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}"))
        infos = {"a:1": pb.ModelInfo(vocab_fingerprint="fp", max_tree_budget=64), "b:1": pb.ModelInfo(vocab_fingerprint="fp"),
                 "c:1": pb.ModelInfo(vocab_fingerprint="other", max_tree_budget=64), "d:1": None}
        for address, info in infos.items():
            r.replicas[address] = Replica(address, r.make_channel(address, None), info=info, reachable=info is not None)
        try:
            names = lambda *needs: sorted(x.address for x in r.ranked(*needs))  # noqa: E731
            assert names() == ["a:1", "b:1", "c:1", "d:1"]
            assert names("fp") == names("fp", 0) == ["a:1", "b:1", "d:1"]
            assert names("fp", 8) == ["a:1", "d:1"]
            assert names("fp", 65) == ["d:1"]
            # another tokenizer's text rules (where both report them), or a smaller context than the requests were checked against
            for address, info in (("a:1", pb.ModelInfo(vocab_fingerprint="fp", max_tree_budget=64, max_context=64,
                                                       tokenizer=pb.TokenizerInfo(text_rules="rules"))),
                                  ("b:1", pb.ModelInfo(vocab_fingerprint="fp", max_context=64, tokenizer=pb.TokenizerInfo(text_rules="other"))),
                                  ("c:1", pb.ModelInfo(vocab_fingerprint="fp", max_context=32))):
                r.replicas[address].info = info
            assert names("fp", 0, "rules", 64) == ["a:1", "d:1"]
            assert names("fp", 0, "rules", 32) == ["a:1", "c:1", "d:1"]  # c reports no rules (an older verifier)
            assert names("fp", 0, "", 32) == ["a:1", "b:1", "c:1", "d:1"]
        finally:
            await r.close()

    asyncio.run(run())
