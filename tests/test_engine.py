"""The engine's contract at the command line and across dtypes: device errors, bfloat16
exactness against the same service's target-only output, and seeds that reproduce with
pre-drafting on, alone or under load."""
import asyncio
import subprocess
import sys
import time

import pytest
import torch

from bench.launch import ENV, ROOT, Service, start_pair
from client import AsyncClient, Client


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("module", ["verify_service", "draft_service"])
def test_device_cuda_without_cuda_exits_with_one_line(model_dir, module):
    args = [sys.executable, "-m", module, "--model", model_dir("target"), "--port", "0", "--device", "cuda"]
    if module == "draft_service":
        args += ["--verify", "127.0.0.1:1"]
    p = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and "CUDA is not available" in lines[0] and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("pin", ["prepack=maybe", "per-row", "colour=blue", "per-row=on,per-row=off", "prepack=on,per-row=on",
                                 "fp32-prepack=on,per-row=on"])
@pytest.mark.parametrize("via", ["flag", "env"])
def test_a_bad_engine_choice_exits_with_a_usage_line(model_dir, pin, via):
    args = [sys.executable, "-m", "verify_service", "--model", model_dir("target"), "--port", "0"]
    env = dict(ENV, SPECDEC_ENGINE_CHOICES=pin) if via == "env" else ENV
    p = subprocess.run(args + (["--engine-choices", pin] if via == "flag" else []), cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    last = p.stderr.splitlines()[-1]
    assert "--engine-choices" in last and "Traceback" not in p.stderr, p.stderr
    assert ("SPECDEC_ENGINE_CHOICES" in last) == (via == "env"), last


@pytest.fixture(scope="module")
def bf16(model_dir):
    env = dict(ENV, SPECDEC_DTYPE="bfloat16")
    v, d = start_pair(("--model", model_dir("long-target"), "--threads", "1"), ("--model", model_dir("long-draft"), "--threads", "1"), env=env)
    yield v, d
    d.stop()
    v.stop()


def test_bfloat16_speculative_equals_the_same_services_target_only(bf16):
    """In bf16 logits tie often; the engine computes a session's logits bitwise the same in a
    target-only step and inside a speculative round, so the outputs are equal token for token."""
    v, d = bf16
    with Client(v.address, timeout=120, target_only=True) as cv, Client(d.address, timeout=120) as cd:
        assert cv.info().dtype == "bfloat16"
        accepted = 0
        for i, tau in enumerate([1, 3, 4, 7]):
            prompt = [3 + i, 4, 5, 6 + i, 7]
            ref = cv.generate(prompt_ids=prompt, max_new_tokens=60).token_ids
            got = cd.generate(prompt_ids=prompt, max_new_tokens=60, num_draft_tokens=tau)
            assert got.token_ids == ref, (tau, got.stats)
            accepted += got.stats.get("accepted", 0)
        assert accepted > 0  # proposals really were verified in rounds of several tokens


SAMPLED = [dict(prompt_ids=[3 + i, 4, 5], max_new_tokens=40, temperature=1.0, seed=500 + i, num_draft_tokens=4,
                predraft=True, proposal_mode=["sparse", "dense", "greedy"][i % 3]) for i in range(6)]


def test_same_seed_same_tokens_with_predrafting_alone_and_under_load(services):
    """Every draw is keyed by (seed, position): a pre-draft thrown away, or a batch-mate, changes nothing."""
    _, d = services("target", "draft")
    with Client(d.address, timeout=120) as c:
        alone = [c.generate(**r).token_ids for r in SAMPLED]

    async def together():
        async with AsyncClient(d.address, timeout=120) as c:
            return await asyncio.gather(*(c.generate(**r) for r in SAMPLED))

    loaded = asyncio.run(together())
    assert [r.token_ids for r in loaded] == alone
    assert sum(r.stats.get("predraft_hits", 0) + r.stats.get("predraft_misses", 0) for r in loaded) > 0  # pre-drafting ran
    with Client(d.address, timeout=120) as c:
        assert [c.generate(**r).token_ids for r in SAMPLED] == alone


ADAPTIVE = [dict(prompt_ids=[3 + i, 5, 4 + i], max_new_tokens=36, temperature=1.0, seed=900 + i, num_draft_tokens=6,
                 adaptive=True, predraft=bool(i % 2)) for i in range(6)]


def test_same_seed_same_tokens_with_adaptive_tau_under_load_and_across_restarts(model_dir):
    """Adaptive tau (pre-drafting on and off) chooses from acceptance history and the costs, never
    from a clock: a seeded request gives the same tokens alone, beside five others, and after both
    services restart with the same flags (costs pinned with --costs-ms, the engine's timed load-time
    choices with --engine-choices or SPECDEC_ENGINE_CHOICES: on tiny models their timings sit near
    the thresholds, and a choice that flips changes the numbers a sample is drawn from)."""
    PIN = "fp32-prepack=off,per-row=off,attention-kernel=off"  # every float32 choice the CPU tier times, and the kernel's

    def start():
        v, d = start_pair(("--model", model_dir("target"), "--log-level", "INFO"),
                          ("--model", model_dir("draft"), "--costs-ms", "1.0,3.0,0.2", "--engine-choices", PIN, "--log-level", "INFO"),
                          env=dict(ENV, SPECDEC_ENGINE_CHOICES=PIN), draft_env=ENV)
        for svc in (v, d):  # padded GEMMs: on every CPU (per-row may not calibrate)
            deadline = time.monotonic() + 10  # the log line was written at load; its reader thread may lag
            while not any(f"engine choices {PIN} (pinned: fp32-prepack, per-row" in line for line in list(svc.stderr)):
                assert time.monotonic() < deadline, svc.stderr
                time.sleep(0.05)
        return v, d

    def alone(d):
        with Client(d.address, timeout=120) as c:
            return [c.generate(**r) for r in ADAPTIVE]

    async def together(d):
        async with AsyncClient(d.address, timeout=120) as c:
            return await asyncio.gather(*(c.generate(**r) for r in ADAPTIVE))

    v, d = start()
    try:
        first = alone(d)
        loaded = asyncio.run(together(d))
    finally:
        d.stop()
        v.stop()
    v, d = start()
    try:
        restarted = alone(d)
    finally:
        d.stop()
        v.stop()
    ids = [r.token_ids for r in first]
    assert [r.token_ids for r in loaded] == ids
    assert [r.token_ids for r in restarted] == ids
    # adaptive tau really adapted: rounds before the last (which the token budget may cut) drafted fewer than 6
    assert any(r.stats["drafted"] < 6 * (r.stats["rounds"] - 1) for r in first), [r.stats for r in first]
    assert any(r.stats.get("predraft_hits", 0) + r.stats.get("predraft_misses", 0) for r in first)  # pre-drafting ran


def test_the_service_defaults_to_adaptive_tau_with_predrafting_and_hybrid_proposals(model_dir):
    """Without flags or SPECDEC_ADAPTIVE / SPECDEC_PREDRAFT / SPECDEC_PROPOSER (which the other
    tests set), a request that does not choose gets adaptive tau up to 8 with pre-drafting and
    hybrid proposals (prompt lookup on a recurring 2-gram, else the draft); --no-adaptive
    --no-predraft --proposer draft gives fixed tau = 4 from the draft model alone."""
    env = {k: v for k, v in ENV.items() if k not in ("SPECDEC_ADAPTIVE", "SPECDEC_PREDRAFT", "SPECDEC_PROPOSER")}
    repeating = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]  # its last 2-gram recurs: lookup proposes "5 6 3 4 ..."
    v = Service("verify_service", "--model", model_dir("target"), env=env)
    try:
        for flags, tau, predraft, lookup in (((), 8, True, True),
                                             (("--no-adaptive", "--no-predraft", "--proposer", "draft"), 4, False, False)):
            d = Service("draft_service", "--model", model_dir("draft"), "--verify", v.address, *flags, env=env)
            try:
                with Client(d.address, timeout=120) as c:
                    r = c.generate(prompt_ids=[3, 4, 5], max_new_tokens=40, proposer="draft")  # the draft model: pre-drafts run
                    rep = c.generate(prompt_ids=repeating, max_new_tokens=8)  # the service's default proposer
            finally:
                d.stop()
            assert len(r.stats["accepted_per_position"]) == tau, (flags, r.stats)
            ran = r.stats.get("predraft_hits", 0) + r.stats.get("predraft_misses", 0)
            assert (ran > 0) == predraft, (flags, r.stats)
            assert (rep.stats.get("lookup_rounds", 0) > 0) == lookup, (flags, rep.stats)
    finally:
        v.stop()


def test_a_target_only_stream_ends_with_its_request(services):
    """Generate on the verify service is a stream that the scheduler thread runs ahead of the
    handler. A stop string or a client that goes away ends it early: the session and its cache
    are freed, and no pass runs for it afterwards."""
    from helpers import metric, wait_for

    v, _ = services("long-target", "long-draft")

    def passes():
        return metric(v.metrics(), "specdec_verify_batch_size_count")

    def idle():
        text = v.metrics()
        return metric(text, "specdec_live_sessions", service="verify") == 0 and metric(text, "specdec_cached_tokens") == 0

    def settled():  # no pass counted for 0.3 s
        before = passes()
        time.sleep(0.3)
        return passes() == before

    prompt = [3, 4, 5]
    with Client(v.address, target_only=True, timeout=60) as c:
        p0 = passes()
        full = c.generate(prompt_ids=prompt, max_new_tokens=300)
        assert full.finish_reason == "length" and len(full.token_ids) == 300
        whole = passes() - p0
        assert whole == 300  # one pass per token

        stop = full.text[len(full.text) // 8 :][:6]  # text from early on
        p0 = passes()
        long = 3000  # a missed stop or cancel runs this many passes; a stop that lands late, a few hundred at most
        cut = c.generate(prompt_ids=prompt, max_new_tokens=long, stop=[stop])
        assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)] and len(cut.token_ids) < 100
        assert wait_for(idle, 10) and wait_for(settled, 10)  # a pass in flight at the close may still be counted
        after = passes()
        time.sleep(0.5)
        assert passes() == after and after - p0 < long // 3  # the stream stopped with the request

        p0 = passes()
        it = c.stream(prompt_ids=prompt, max_new_tokens=long)
        got = [next(it) for _ in range(3)]
        it.close()  # the client goes away mid-stream: the RPC is cancelled
        assert sum(len(x.token_ids) for x in got) >= 3
        assert wait_for(idle, 10) and wait_for(settled, 10)
        after = passes()
        time.sleep(0.5)
        assert passes() == after and after - p0 < long // 3
