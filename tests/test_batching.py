"""Batched verification: correctness, isolation between sessions, capacity and idle limits."""
import asyncio
import random
import threading

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.launch import Service
from client import AsyncClient, Client
from helpers import metric, wait_for
from helpers.engine import count_passes, held_thread
from specdec.lm import LM
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.engine import PREFILL_CHUNK, KVCache


REQS = [dict(prompt_ids=[3 + i % 5, 4, 5 + i % 3], max_new_tokens=20 + 3 * i, temperature=[0.0, 1.0, 0.7][i % 3], top_k=[0, 0, 6][i % 3],
             seed=100 + i, num_draft_tokens=1 + i % 5, proposal_mode=["sparse", "dense", "greedy"][i % 3]) for i in range(12)]


def test_same_seed_same_tokens_alone_or_under_load(services):
    v, d = services("target", "draft")
    with Client(d.address, timeout=120) as c:
        alone = [c.generate(**r).token_ids for r in REQS]
    def shared(svc, name):  # passes so far, and passes that had one session only
        text = svc.metrics()
        return metric(text, f"{name}_count"), metric(text, f"{name}_bucket", le="1.0")

    before = shared(v, "specdec_verify_batch_size"), shared(d, "specdec_draft_batch_size")

    async def together():
        async with AsyncClient(d.address, timeout=120) as c:
            return await asyncio.gather(*(c.generate(**r) for r in REQS))

    loaded = [r.token_ids for r in asyncio.run(together())]
    assert loaded == alone
    after = shared(v, "specdec_verify_batch_size"), shared(d, "specdec_draft_batch_size")
    for (n0, single0), (n1, single1), what in zip(before, after, ["verify", "draft"]):
        assert (n1 - n0) - (single1 - single0) >= 3, f"sessions must actually have shared {what} passes"


def test_long_prompt_is_prefilled_in_chunks_and_stays_exact(services, model_dir):
    _, d = services("long-target", "long-draft")
    target = AutoModelForCausalLM.from_pretrained(model_dir("long-target"), dtype=torch.float32).eval()
    r = random.Random(1)
    prompt = [r.randrange(1, 16) for _ in range(700)]  # > 2 prefill chunks
    with torch.no_grad():
        ref = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=1)[0, 700:].tolist()
    with Client(d.address, timeout=120) as c:
        assert c.generate(prompt_ids=prompt, max_new_tokens=12, num_draft_tokens=3).token_ids == ref


def _start(fp, prompt=(3, 4), max_new=8):
    return pb.VerifyRequest(start=pb.SessionStart(prompt_ids=list(prompt), max_new_tokens=max_new, vocab_fingerprint=fp))


async def _open_session(stub, fp, **kw):
    call = stub.Session()
    await call.write(_start(fp, **kw))
    await call.write(pb.VerifyRequest(round=pb.Round(round=1, tokens=[])))
    return call, await call.read()


async def _refused_session(stub, fp, **kw) -> grpc.aio.AioRpcError:
    """Opens a session the verifier must refuse at `start`: writes only the start and reads the
    status (a second write could race the refusal and lose its status, grpc/grpc#36066)."""
    call = stub.Session()
    await call.write(_start(fp, **kw))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(call.read(), 60)
    return e.value


def test_capacity_limits_answer_resource_exhausted_and_recover(model_dir):
    v = Service("verify_service", "--model", model_dir("target"), "--max-sessions", "2", "--max-cached-tokens", "40", "--metrics-port", "0")
    try:
        async def run():
            async with grpc.aio.insecure_channel(v.address) as ch:
                stub = pb_grpc.VerifyStub(ch)
                fp = (await stub.Info(pb.InfoRequest())).vocab_fingerprint
                a, ra = await _open_session(stub, fp)
                b, rb = await _open_session(stub, fp)
                assert ra.round == 1 and rb.round == 1
                e = await _refused_session(stub, fp)  # third session: over --max-sessions
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in e.details()
                assert dict(e.trailing_metadata()).get("retry-after-ms")
                a.cancel()
                b.cancel()
                for _ in range(100):  # the server frees cancelled sessions promptly; wait for it under load
                    if metric(v.metrics(), "specdec_live_sessions", service="verify") == 0:
                        break
                    await asyncio.sleep(0.05)
                e = await _refused_session(stub, fp, max_new=60)  # 2 + 60 tokens > --max-cached-tokens 40: never fits here
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-cached-tokens" in e.details()
                trailers = dict(e.trailing_metadata())  # no wait cures it: no retry hint, and a pushback gRPC does not retry on
                assert "retry-after-ms" not in trailers and trailers.get("grpc-retry-pushback-ms") == "-1"
                c, rc = await _open_session(stub, fp)  # room again
                assert rc.round == 1
                c.cancel()
        asyncio.run(run())
        with Client(v.address, target_only=True, retries=4, timeout=60) as c, pytest.raises(grpc.RpcError) as e:
            c.generate(prompt_ids=[3, 4], max_new_tokens=60)  # gRPC's retry policy takes the pushback: one attempt
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        wait_for(lambda: metric(v.metrics(), "specdec_live_sessions", service="verify") == 0, 5)
        text = v.metrics()
        assert metric(text, "specdec_capacity_rejections_total", reason="sessions") == 1
        assert metric(text, "specdec_capacity_rejections_total", reason="cached_tokens") == 2  # not 1 + 5
        assert metric(text, "specdec_cache_budget_tokens") == 40  # what the KEDA trigger divides by
        d = Service("draft_service", "--model", model_dir("draft"), "--verify", v.address, "--metrics-port", "0")
        try:  # through the draft service: it passes the verifier's "no retry" on
            with Client(d.address, retries=4, timeout=60) as c, pytest.raises(grpc.RpcError) as e:
                c.generate(prompt_ids=[3, 4], max_new_tokens=60)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-cached-tokens" in e.value.details()
            assert dict(e.value.trailing_metadata()).get("grpc-retry-pushback-ms") == "-1"
            # (not a count of attempts: a refusal that races the draft's next write is a retryable UNAVAILABLE, DESIGN.md §2)
        finally:
            d.stop()
        assert metric(text, "specdec_live_sessions", service="verify") == 0
    finally:
        v.stop()


def test_sessions_are_admitted_by_the_pages_their_caches_hold(model_dir):
    """The cache budget is memory: a session that needs 17 tokens holds two pages (32 slots), and
    the budget counts those, so the sessions admitted never hold more slots than it (it counted
    tokens, and admitted 94 such sessions holding 3008 slots into a budget of 1600). A budget of the
    whole context still admits a session of the whole context."""
    from specdec.engine import PAGE
    from specdec.errors import Refusal, RequestError
    from specdec.sampling import Sampling
    from verify_service.scheduler import Scheduler

    lm = LM.load(model_dir("target"), "cpu", "float32")
    greedy = dict(sampling=Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)
    eng = Scheduler(lm, max_sessions=1000, max_cached_tokens=100 * PAGE)
    opened = []
    try:
        with pytest.raises(RequestError) as e:
            for _ in range(1000):
                opened.append(eng.open([3, 4], PAGE - 1, **greedy))  # 17 tokens: two pages
        assert e.value.kind == Refusal.RESOURCE_EXHAUSTED and "cache is full" in str(e.value)
        held = sum(len(s.cache.pages) for s in opened) * PAGE
        assert len(opened) == 50 and held == eng.capacity.reserved == 100 * PAGE
    finally:
        for s in opened:
            eng.close(s)
        eng.shutdown()
    assert eng.capacity.reserved == 0
    odd = lm.max_context - 1  # a budget that is not whole pages
    eng = Scheduler(lm, max_sessions=2, max_cached_tokens=odd)
    try:
        eng.close(eng.open([3, 4], odd - 2, **greedy))
    finally:
        eng.shutdown()


def test_a_streams_first_step_counts_against_the_passs_prefill_rows(model_dir, monkeypatch):
    """A target-only stream takes its first step in the pass of its prompt's last chunk: that row
    counts against --max-prefill-rows with the chunk (it did not, so a burst of short target-only
    prompts ran passes of twice the bound)."""
    from specdec.sampling import Sampling
    from verify_service.scheduler import Scheduler

    lm = LM.load(model_dir("target"), "cpu", "float32")
    go, held = held_thread()  # the scheduler thread starts once every stream is queued

    eng = Scheduler(lm, max_sessions=200, max_prefill_rows=PREFILL_CHUNK, thread_context=held)  # the least it takes
    rows, forward = [], lm.engine.forward

    def counted(inputs, *args, **kwargs):
        rows.append(sum(len(x) for x in inputs))
        return forward(inputs, *args, **kwargs)

    monkeypatch.setattr(lm.engine, "forward", counted)

    async def burst():
        sessions = [eng.open([3, 4], 1, Sampling(), 1, pb.PROPOSAL_MODE_GREEDY) for _ in range(200)]

        async def one(s):
            return [v.next_token async for v in eng.steps(s)]

        tasks = [asyncio.ensure_future(one(s)) for s in sessions]
        await asyncio.sleep(0.2)
        go.set()
        try:
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            for s in sessions:
                eng.close(s)

    try:
        got = asyncio.run(burst())
    finally:
        eng.shutdown()
    assert all(len(tokens) == 1 for tokens in got) and len(got) == 200
    assert rows and max(rows) <= PREFILL_CHUNK, rows  # each stream: its one-token chunk and its first step


def test_a_closed_sessions_room_comes_back_with_its_pages(model_dir):
    """A session closed while a pass is in flight (held here) gives its pages, and only then its
    room, back after that pass: admission never hands out pages the pool has not got back, so
    sessions opened and closed under a pass never grow the pool past the cache budget. One closed
    between passes gives both back at once, so a session that ends and another that starts at the
    limit never meet a refusal."""
    from specdec.engine import PAGE
    from specdec.errors import Refusal, RequestError
    from specdec.sampling import Sampling
    from verify_service.scheduler import Scheduler

    torch.set_num_threads(1)
    lm = LM.load(model_dir("target"), "cpu", "float32")
    eng = Scheduler(lm, max_sessions=3, max_cached_tokens=5 * PAGE)
    before = lm.engine.pool.size  # the layers' slots: the load's and start-up probes' pages, all free again, more than the budget's
    greedy = dict(sampling=Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)

    def cycle():
        a, b = (eng.open([3, 4, 5], 2 * PAGE - 3, **greedy) for _ in range(2))
        eng.close(a)
        eng.close(b)

    entered, go = threading.Event(), threading.Event()
    try:
        for _ in range(10):  # between passes: the room is back at once
            cycle()
        assert eng.capacity.reserved == 0 and eng.capacity.sessions == 0
        forward = lm.engine.forward

        def held(*args, **kwargs):  # a pass that waits, as a long one does
            entered.set()
            go.wait(60)
            return forward(*args, **kwargs)

        lm.engine.forward = held
        long = eng.open([3, 4, 5, 6], 4, **greedy)  # a small session whose prefill pass is held
        filling = threading.Thread(target=lambda: asyncio.run(eng.prefill(long)))
        filling.start()
        assert entered.wait(30)
        cycle()
        with pytest.raises(RequestError) as e:  # closed under the pass: their pages are not back, nor their room
            cycle()
        assert e.value.kind == Refusal.RESOURCE_EXHAUSTED
        lm.engine.forward = forward
        go.set()
        filling.join(30)
        eng.close(long)
        assert wait_for(lambda: eng.capacity.reserved == 0 and eng.capacity.sessions == 0, 5)
        for _ in range(10):
            cycle()
        assert before >= 6 * PAGE and lm.engine.pool.size == before and lm.engine.pool.held_slots() <= before  # the churn grew no layer
    finally:
        go.set()
        eng.shutdown()


def test_idle_session_times_out_and_frees_its_cache(model_dir):
    v = Service("verify_service", "--model", model_dir("target"), "--idle-timeout-s", "1", "--metrics-port", "0")
    try:
        async def run():
            async with grpc.aio.insecure_channel(v.address) as ch:
                stub = pb_grpc.VerifyStub(ch)
                fp = (await stub.Info(pb.InfoRequest())).vocab_fingerprint
                call, _ = await _open_session(stub, fp)
                assert metric(v.metrics(), "specdec_cached_tokens") > 0
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call.read()  # we send nothing more
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "idle" in e.value.details()
        asyncio.run(run())
        # the status reaches the client before the handler's cleanup has run: give it a moment
        assert wait_for(lambda: metric(v.metrics(), "specdec_live_sessions", service="verify") == 0, 5)
        assert metric(v.metrics(), "specdec_cached_tokens") == 0
    finally:
        v.stop()


def _run_batch(eng, spec):
    """Runs the rounds [(session, proposals, q)] as ONE scheduler pass (no queue, so the batch is
    exactly this), returning each session's Verdict or exception."""
    from verify_service.jobs import Round

    loop = asyncio.new_event_loop()
    try:
        jobs = [Round(s, loop, loop.create_future(), toks, q) for s, toks, q in spec]
        eng._run(jobs, [])
        return loop.run_until_complete(asyncio.gather(*(j.future for j in jobs), return_exceptions=True))
    finally:
        loop.close()


def _prefilled(eng, prompts, sampling=None):
    from specdec.sampling import Sampling
    from verify_service.jobs import Prefill

    out = []
    for p in prompts:
        s = eng.open(p, 8, sampling or Sampling(), seed=3, mode=pb.PROPOSAL_MODE_GREEDY)
        loop = asyncio.new_event_loop()
        try:
            job = Prefill(s, loop, loop.create_future())
            eng._run([], [job])
            loop.run_until_complete(job.future)
        finally:
            loop.close()
        out.append(s)
    return out


@pytest.mark.parametrize("where", ["pass", "acceptance"])
def test_a_failing_session_fails_alone_and_its_batch_mates_get_their_solo_verdicts(packed, where):
    """One session of a batched pass raises, in the forward pass (its cache cannot take the round)
    or in the acceptance rule (a q of the wrong shape): that session gets the error, the others
    get exactly the verdicts they get alone."""
    from specdec.sampling import Sampling
    from verify_service.scheduler import Scheduler

    prompts = [[3, 4, 5, 6], [7, 8, 9], [4, 4, 5, 9, 10]]
    rounds = [[5, 6, 7], [8, 9], [6, 6, 6, 6]]
    eng = Scheduler(packed, max_sessions=8)
    try:
        solo = [_run_batch(eng, [(s, r, None)])[0] for s, r in zip(_prefilled(eng, prompts), rounds)]
        assert all(not isinstance(v, Exception) for v in solo), solo
        if where == "pass":
            ss = _prefilled(eng, prompts)
            ss[1].cache = KVCache(1)  # room for one token: its round's writes fail inside the pass
            spec = [(s, r, None) for s, r in zip(ss, rounds)]
        else:
            ss = _prefilled(eng, prompts[:1]) + _prefilled(eng, prompts[1:2], Sampling(temperature=1.0)) + _prefilled(eng, prompts[2:])
            from specdec.proposal import RoundQ
            bad_q = RoundQ(len(rounds[1]), torch.tensor([0, 1]), torch.tensor([20, 20]), torch.ones(2))  # id 20 in a vocabulary of 16
            spec = [(s, r, bad_q if i == 1 else None) for i, (s, r) in enumerate(zip(ss, rounds))]
        got = _run_batch(eng, spec)
        assert isinstance(got[1], ValueError if where == "acceptance" else Exception), got
        assert where == "pass" or "ids up to 20" in str(got[1]), got[1]
        for v, w in ((got[0], solo[0]), (got[2], solo[2])):
            assert not isinstance(v, Exception), got
            assert (v.num_accepted, v.next_token, v.finish) == (w.num_accepted, w.next_token, w.finish)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("n_prompt", [5, 40])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_target_only_stream_takes_its_first_step_in_its_prompts_last_pass(packed, n_prompt, temperature, monkeypatch):
    """Target-only, the first step runs in the pass of the prompt's last chunk, as a second input
    of the same session: one pass fewer than a prefill and then steps, and bitwise the same tokens."""
    import verify_service.scheduler as scheduler
    from specdec.sampling import Sampling

    passes = count_passes(monkeypatch, packed.engine)
    r = random.Random(n_prompt)
    prompt = [r.randrange(3, 16) for _ in range(n_prompt)]
    eng = scheduler.Scheduler(packed, max_sessions=4)
    passes.clear()  # the pass-cost probe's, at start-up

    async def stepped():  # the Session path: the prefill awaited, then one round per token
        s = eng.open(prompt, 12, Sampling(temperature=temperature), seed=9, mode=pb.PROPOSAL_MODE_GREEDY)
        await eng.prefill(s)
        for _ in range(12):  # a token a round: at most 12 rounds
            if s.finish:
                break
            await eng.step(s, [], None)
        assert s.finish
        eng.close(s)
        return s.ids

    async def streamed():
        s = eng.open(prompt, 12, Sampling(temperature=temperature), seed=9, mode=pb.PROPOSAL_MODE_GREEDY)
        got = [v.next_token async for v in eng.steps(s)]
        eng.close(s)
        assert s.prefill_s > 0 and got == s.ids[n_prompt:]
        return s.ids

    try:
        a = asyncio.run(stepped())
        n_stepped, passes[:] = len(passes), []
        b = asyncio.run(streamed())
    finally:
        eng.shutdown()
    assert a == b and n_prompt < len(a) <= n_prompt + 12  # EOS may end it early
    assert len(passes) == n_stepped - 1 == len(a) - n_prompt  # a pass per token, the prompt's included


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_long_target_only_stream_beside_rounds_gives_its_solo_tokens(model_dir, dtype, monkeypatch):
    """A stream whose prompt takes three prefill chunks, the last longer than the calibrated block
    (so in a product of its own, merged with its first step), shares passes with another session's
    rounds: both get bitwise the tokens they get alone."""
    import verify_service.scheduler as scheduler
    from specdec.engine.cpu import rows
    from specdec.sampling import Sampling

    passes = []  # per pass: the number of inputs and of distinct caches

    torch.set_num_threads(1)
    monkeypatch.setattr(rows, "ROW_LADDER", ())  # calibrated blocks end at ROW_PROBE: shorter than a prefill chunk
    lm = LM.load(model_dir("long-target"), "cpu", dtype)
    real = lm.engine.forward

    def recorded(inputs, caches, logits=True, **kw):
        passes.append((len(inputs), len({id(c) for c in caches})))
        return real(inputs, caches, logits, **kw)

    monkeypatch.setattr(lm.engine, "forward", recorded)
    r = random.Random(3)
    long_prompt = [r.randrange(3, 16) for _ in range(2 * PREFILL_CHUNK + 104)]
    assert len(long_prompt) - 1 - 2 * PREFILL_CHUNK > lm.engine.plan.top  # the last chunk has a product of its own
    short_prompt = [r.randrange(3, 16) for _ in range(20)]
    eng = scheduler.Scheduler(lm, max_sessions=4)

    async def stream(after: asyncio.Event | None = None):
        if after is not None:
            await after.wait()
        s = eng.open(long_prompt, 16, Sampling(temperature=0.0), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)
        try:
            return [v.next_token async for v in eng.steps(s)]
        finally:
            eng.close(s)

    async def rounds(started: asyncio.Event | None = None):  # proposals of three tokens each (the verdicts decide)
        s = eng.open(short_prompt, 40, Sampling(temperature=0.0), seed=2, mode=pb.PROPOSAL_MODE_GREEDY)
        try:
            await eng.prefill(s)
            for _ in range(40):  # at least a token a round: at most 40 rounds
                if s.finish:
                    break
                if started is not None:
                    started.set()  # the stream's prompt goes in while this session runs rounds
                await eng.step(s, [s.ids[-1]] * 3, None)
            assert s.finish
            return s.ids[len(short_prompt):]
        finally:
            eng.close(s)

    async def both():
        started = asyncio.Event()
        return await asyncio.gather(stream(started), rounds(started))

    try:
        solo = (asyncio.run(stream()), asyncio.run(rounds()))
        assert len(solo[0]) == 16 and len(solo[1]) == 40
        passes.clear()
        for _ in range(3):  # bounded: until a round has shared the merged pass (timing: the round must be back in the queue)
            assert tuple(asyncio.run(both())) == solo
            if (3, 2) in passes:  # a round, the stream's last chunk and its first step in one pass
                break
    finally:
        eng.shutdown()
    assert (3, 2) in passes, passes




def test_a_pass_hands_its_verdicts_to_the_event_loop_in_one_call(packed, monkeypatch):
    """Six sessions' rounds and a target-only stream on one event loop: every pass wakes the loop
    once (one call_soon_threadsafe, however many verdicts it gives), the verdicts are the ones the
    sessions get, and nothing is left undelivered."""
    import verify_service.scheduler as scheduler
    from specdec.sampling import Sampling

    eng = scheduler.Scheduler(packed, max_sessions=8)
    passes = count_passes(monkeypatch, packed.engine)
    wakes = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(*a, **kw):
            wakes.append(threading.current_thread() is not threading.main_thread())
            return real(*a, **kw)

        ss = [eng.open([3 + i, 4, 5 + i % 3], 40, Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY) for i in range(6)]
        for s in ss:
            await eng.prefill(s)
        streamed = eng.open([6, 7, 8], 12, Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)
        passes.clear()
        loop.call_soon_threadsafe = counted  # from here every hand-off from the scheduler thread is counted

        async def rounds(s):
            return [await eng.step(s, [s.ids[-1], 5, 6], None) for _ in range(3)]

        async def stream():
            return [v.next_token async for v in eng.steps(streamed)]

        *verdicts, tokens = await asyncio.gather(*(rounds(s) for s in ss), stream())
        loop.call_soon_threadsafe = real
        for s in ss + [streamed]:
            eng.close(s)
        return verdicts, tokens, streamed.ids

    try:
        verdicts, tokens, ids = asyncio.run(main())
    finally:
        eng.shutdown()
    assert all(len(v) == 3 for v in verdicts) and tokens == ids[3:] and tokens
    assert all(wakes) and len(wakes) == len(passes)  # one hand-off a pass, from the scheduler thread
    assert len(passes) < 6 * 3 + len(tokens)  # sessions shared passes: fewer hand-offs than verdicts


@pytest.mark.parametrize("temperature,mode", [(1.0, pb.PROPOSAL_MODE_SPARSE), (0.0, pb.PROPOSAL_MODE_GREEDY)])
def test_a_target_whose_logits_are_not_finite_fails_the_session_not_the_service(model_dir, monkeypatch, temperature, mode):
    """NaN logits leave a sampled session's draw nothing to draw from: it came out as token V, one
    past the vocabulary, was committed, and the next pass indexed the embeddings with it (on CUDA a
    device-side assert, for every session). The session fails with INTERNAL, its sequence as it was.
    A greedy session's argmax took the NaN for the largest logit and committed token 0 (a review)."""
    from specdec.errors import Refusal, RequestError
    from specdec.sampling import Sampling
    from verify_service.scheduler import Scheduler

    lm = LM.load(model_dir("target"), "cpu", "float32")
    eng = Scheduler(lm, max_sessions=2)
    forward = lm.engine.forward
    def broken(*args, **kwargs):  # the model's pass, its logits NaN (as an overflow in half precision leaves them)
        out = forward(*args, **kwargs)
        return torch.full_like(out, float("nan")) if torch.is_tensor(out) else [None if x is None else torch.full_like(x, float("nan"))
                                                                               for x in out]

    monkeypatch.setattr(lm.engine, "forward", broken)

    async def run():
        s = eng.open([3, 4, 5], 8, Sampling(temperature=temperature), seed=3, mode=mode)
        try:
            await eng.prefill(s)
            ids = list(s.ids)
            with pytest.raises(RequestError) as e:
                await eng.step(s, [], None)
            return e.value, ids, list(s.ids)
        finally:
            eng.close(s)

    try:
        err, before, after = asyncio.run(run())
    finally:
        eng.shutdown()
    assert err.kind == Refusal.INTERNAL and "not finite" in str(err) and after == before


def test_a_fault_outside_the_model_call_fails_its_pass_not_the_scheduler(model_dir):
    """A fault past the model call's own guard (an asynchronous device error surfacing at the
    verdicts' transfer, a bug) killed the scheduler thread, and every session then waited for
    ever. Now the pass's jobs fail with INTERNAL and the next pass runs."""
    from specdec.errors import Refusal, RequestError
    from specdec.sampling import Sampling
    from verify_service.scheduler import Scheduler

    lm = LM.load(model_dir("target"), "cpu", "float32")
    eng = Scheduler(lm, max_sessions=2)
    verdicts, calls = eng._verdicts, []

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("an asynchronous device error")
        return verdicts(*args, **kwargs)

    eng._verdicts = faulty

    async def session():
        s = eng.open([3, 4, 5], 8, Sampling(temperature=1.0), seed=3, mode=pb.PROPOSAL_MODE_SPARSE)
        try:
            await asyncio.wait_for(eng.prefill(s), 30)
            return await asyncio.wait_for(eng.step(s, [], None), 30)
        finally:
            eng.close(s)

    async def run():
        with pytest.raises(RequestError) as e:
            await session()
        return e.value, await session()

    try:
        err, v = asyncio.run(run())
    finally:
        eng.shutdown()
    assert err.kind == Refusal.INTERNAL and "an asynchronous device error" in str(err)
    assert v.next_token is not None and len(calls) == 2


def test_passes_that_keep_faulting_report_not_serving_until_one_gives_verdicts(model_dir, monkeypatch):
    """A lost device faults every pass. The fault guard failed each pass's jobs, but health stayed
    SERVING, so orchestrators kept routing requests to it and never restarted it. Now FAULT_PASSES
    faulted passes in a row make readiness and liveness NOT_SERVING (a real gRPC health service
    here) and Info UNAVAILABLE (drafts rank replicas by it); one-off faults between verdicts do
    not. While idle a self-test pass makes it ready again, but only a pass that gives verdicts
    makes it live: a fault the self-test does not meet (here in the acceptance) breaks it again
    at the next pass and keeps it not live (from a review: the self-test had cleared everything,
    so such a fault flapped between SERVING and NOT_SERVING and liveness never failed long enough
    for a restart)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio
    from prometheus_client import REGISTRY

    from specdec.sampling import Sampling
    from verify_service import scheduler
    from verify_service.health import FAULT_PASSES
    from verify_service.scheduler import Scheduler
    from verify_service.server import VerifyServicer

    monkeypatch.setattr(scheduler, "SELF_TEST_S", 0.2)
    lm = LM.load(model_dir("target"), "cpu", "float32")
    eng = Scheduler(lm, max_sessions=2)
    forward, decide, lost = lm.engine.forward, scheduler.decide, {"device": False, "acceptance": False}

    def device(*args, **kwargs):
        if lost["device"]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return forward(*args, **kwargs)

    def acceptance(*args, **kwargs):
        if lost["acceptance"]:
            raise RuntimeError("a bug in the acceptance")
        return decide(*args, **kwargs)

    monkeypatch.setattr(lm.engine, "forward", device)
    monkeypatch.setattr(scheduler, "decide", acceptance)
    faults = lambda: REGISTRY.get_sample_value("specdec_verify_pass_faults_total") or 0.0  # noqa: E731
    before = faults()
    S, N = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def session():  # its prefill is one pass, its round another
        s = eng.open([3, 4, 5], 8, Sampling(), seed=0, mode=pb.PROPOSAL_MODE_GREEDY)
        try:
            await asyncio.wait_for(eng.prefill(s), 30)
            return await asyncio.wait_for(eng.step(s, [6], None), 30)
        finally:
            eng.close(s)

    async def failing(n, what="device"):
        lost[what] = True
        for _ in range(n):
            with pytest.raises(RuntimeError, match="illegal memory access|a bug in the acceptance"):
                await session()
        lost[what] = False

    async def go():
        server, health = grpc.aio.server(), health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        servicer = VerifyServicer(eng)
        pb_grpc.add_VerifyServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        seen = {}

        async def set_health(status, liveness=None):  # as specdec/serving.py `serve` hands it over
            await health.set("specdec.v1.Verify", status)
            if liveness is not None:
                await health.set("", liveness)

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            async def statuses():
                return [(await stub.Check(health_pb2.HealthCheckRequest(service=name))).status for name in ("specdec.v1.Verify", "")]

            async def until(ready, live):
                for _ in range(100):
                    if await statuses() == [ready, live]:
                        return True
                    await asyncio.sleep(0.1)
                return False

            try:
                await set_health(S, liveness=S)
                servicer.on_start(set_health)
                await failing(FAULT_PASSES - 1)  # one-off faults: a verdict in between clears them
                assert (await session()).next_token is not None and eng.health.faults == 0 and eng.health.broken is None
                await failing(FAULT_PASSES - 1)
                seen["still"] = await statuses()
                await failing(1)
                seen["gone"] = await until(N, N)
                seen["broken"] = eng.health.broken
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await pb_grpc.VerifyStub(ch).Info(pb.InfoRequest(), timeout=10)
                seen["info"] = (e.value.code(), e.value.details())
                seen["ready"] = await until(S, N)  # the device is back: a self-test pass lets traffic in, not yet live
                seen["retry_free"] = (await pb_grpc.VerifyStub(ch).Info(pb.InfoRequest(), timeout=10)).capacity.free_sessions
                seen["verdict"] = (await session()).next_token is not None
                seen["back"] = await until(S, S) and eng.health.broken is None  # a verdict: live again
                # a fault the self-test does not meet: ready after the self-test, broken again at the next faulted pass
                await failing(FAULT_PASSES, "acceptance")
                seen["bug"] = await until(N, N)
                seen["bug_ready"] = await until(S, N)
                await failing(1, "acceptance")
                seen["bug_again"] = await statuses()
            finally:
                await server.stop(None)
        return seen

    try:
        seen = asyncio.run(go())
    finally:
        eng.shutdown()
    assert seen["still"] == [S, S]
    assert seen["gone"] and f"{FAULT_PASSES} verify passes in a row failed" in seen["broken"] and "illegal memory access" in seen["broken"]
    assert seen["info"][0] == grpc.StatusCode.UNAVAILABLE and "not serving" in seen["info"][1]
    assert seen["ready"] and seen["verdict"] and seen["back"]
    assert seen["retry_free"] == 0  # drafts rank it last while it is not live
    assert seen["bug"] and seen["bug_ready"]
    assert seen["bug_again"] == [N, N]  # one more faulted pass: the count was not reset by the self-test
    assert faults() - before == 2 * FAULT_PASSES - 1 + FAULT_PASSES + 1  # a faulted pass per failed session


def test_a_cache_budget_past_what_memory_holds_is_kept_and_logged(model_dir, monkeypatch, caplog):
    """--max-cached-tokens replaces the budget made from the free memory (so replicas are alike and
    an estimate can be overruled); one above what that memory holds is a warning at start-up, not
    silent (deploy/README.md §3)."""
    import logging

    from verify_service import scheduler
    from verify_service.scheduler import Scheduler

    lm = LM.load(model_dir("target"), "cpu", "float32")
    monkeypatch.setattr(scheduler, "default_cache_budget", lambda lm, n: 64)  # a host with room for 64 tokens of cache
    with caplog.at_level(logging.WARNING, logger="specdec.verify"):
        eng = Scheduler(lm, max_sessions=2, max_cached_tokens=1000)
    try:
        assert eng.capacity.max_cached_tokens == 1000
        assert any("--max-cached-tokens 1000 is more than the free memory's share holds (64 tokens)" in r.getMessage()
                   for r in caplog.records)
    finally:
        eng.shutdown()
