"""Runs of target-only steps (Round.target_only_steps, DESIGN.md §7): the verifier steps on its
own and sends a verdict per token (or per several while it serves other sessions); the draft
asks for them when its process's Pace says speculation loses at the verifier's load, and comes
back to speculation after the hold.
(A useless draft's session using them: tests/test_pairing.py.)"""
import asyncio
import dataclasses
import json
import time

import grpc
import pytest
import torch

from client import Client
from draft_service.adaptive import (EXPLORE_EVERY, HOLD_S, IDLE_S, LOAD_S, PROBE_ROUNDS, PROBE_S, RECORD_STREAK, RUN_TOKENS_PER_VERDICT, Hold,
                                    ModelRecord, Pace, load_class, load_label)
from draft_service.decode import DecodeLoop
from draft_service.drafter import Drafter
from specdec.costmodel import Costs
from specdec.lm import LM
from specdec.sampling import Sampling
from bench.launch import Service
from transformers import AutoModelForCausalLM
from helpers.engine import count_passes, held_thread
from helpers.greedy import hf_greedy
from specdec.validation import GenParams
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from verify_service.server import MAX_RUN_TOKENS_PER_VERDICT as CAP

COSTS = Costs(draft_step=0.001, verify_base=0.010, verify_per_token=0.0002)
PROMPT = [3, 4, 5, 6]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class EndingPace(Pace):
    """A pace holding target-only at the verifier's load of one session until its 10th verdict
    quote: the end of a first run of 10 target-only steps."""

    quotes = 0

    def quote(self, target_only_s: float, sessions: int = 0) -> None:
        super().quote(target_only_s, sessions)
        self.quotes += 1
        if self.quotes == 10:
            self.holds[load_class(1)].left = 0.0


def params(n, temperature=0.0, seeded=False):
    return GenParams(prompt_ids=PROMPT, max_new_tokens=n, sampling=Sampling(temperature=temperature), seed=7, seeded=seeded,
                     tau=4, proposer=pb.PROPOSER_DRAFT, mode=pb.PROPOSAL_MODE_GREEDY if temperature == 0 else pb.PROPOSAL_MODE_SPARSE)


async def _session(address, loop):
    async with grpc.aio.insecure_channel(address) as ch:
        call = pb_grpc.VerifyStub(ch).Session(timeout=60)
        out = []
        async for new, _ in loop.rounds(call):
            out += new
        call.cancel()
        return out


def test_runs_on_the_verifier_are_exact_and_speculation_resumes(model_dir):
    """A session held target-only runs its tokens as runs on a real verify service, then drafts
    again after the hold (its cache caught up): greedy output equals Verify.Generate's; a
    seeded sampled session run target-only throughout repeats Verify.Generate's seeded tokens
    (the same draws, keyed by position)."""
    target = model_dir("long-target")
    v = Service("verify_service", "--model", target)
    try:
        with Client(v.address, target_only=True, timeout=60) as c:
            greedy = c.generate(prompt_ids=PROMPT, max_new_tokens=80).token_ids
            sampled = c.generate(prompt_ids=PROMPT, max_new_tokens=40, temperature=1.0, seed=7).token_ids
        lm = LM.load(target, "cpu", "float32")  # the target as its own draft: every proposal accepted
        clock = Clock()
        # speculation lost at this load: target-only for a second (10 steps); no new verdict after (timing is not tested)
        pace = EndingPace(clock=clock, target_only_s=0.1, load=load_class(1), holds={load_class(1): Hold(left=1.0)},
                          probe_rounds=10**6)
        loop = DecodeLoop(Drafter(lm), params(80), lm.fingerprint, lm.max_context, costs=COSTS, pace=pace)
        assert asyncio.run(_session(v.address, loop)) == greedy
        s = loop.summary()
        assert s.run_steps == 10 and s.target_only_rounds == s.run_steps  # one run, then drafting
        assert pace.load == load_class(1) and pace.peaks  # its verdicts said one session was open (open_sessions)
        assert s.prefill_s == 0  # it started in the run: the draft's cache caught up when it first drafted
        assert s.drafted > 0 and s.accepted == s.drafted  # its cache caught up: the target agrees with itself
        assert s.rounds - s.run_steps < 80 - s.run_steps  # the rest in rounds of several tokens

        pace = Pace(clock=Clock(), target_only_s=0.01, load=load_class(1), holds={load_class(1): Hold(left=1e9)})
        loop = DecodeLoop(Drafter(lm), params(40, 1.0, seeded=True), lm.fingerprint, lm.max_context, costs=COSTS)
        loop.pace = pace  # as if it followed the load (seeded sampled requests do not): all target-only
        assert asyncio.run(_session(v.address, loop)) == sampled
        assert loop.summary().run_steps == len(sampled) and loop.summary().drafted == 0

        # a hybrid session that the model's record skips: prompt lookup still proposes, the model never runs
        from draft_service import decode
        decode.RECORDS[lm.name] = ModelRecord(streak=RECORD_STREAK)
        drafter = Drafter(lm)
        drafter.propose = drafter.predraft = drafter.prefill = None  # any call of the model's would fail the session
        try:
            loop = DecodeLoop(drafter, dataclasses.replace(params(80), proposer=pb.PROPOSER_HYBRID), lm.fingerprint,
                              lm.max_context, costs=COSTS, fallback=COSTS, pace=Pace(clock=Clock()))
            assert loop.fallen_back
            assert asyncio.run(_session(v.address, loop)) == greedy
            assert loop.summary().prefill_s == 0 and loop.summary().fallback_rounds > 0
        finally:
            decode.RECORDS.pop(lm.name, None)
    finally:
        v.stop()


def test_a_request_with_stop_strings_runs_a_few_steps_at_a_time(model_dir):
    """From a review: a session whose draft model fell back asked for the rest of the request as
    one run, and the verifier reads nothing during a run: where the client's stop string matched
    early, it stepped on to the end of the request, and the request's end waited a second for it
    and then cancelled the session. A request with stop strings asks for RUN_MIN steps at a time."""
    from draft_service import decode
    from draft_service.adaptive import RUN_MIN

    target = model_dir("long-target")
    v = Service("verify_service", "--model", target)
    lm = LM.load(target, "cpu", "float32")
    decode.RECORDS[lm.name] = ModelRecord(streak=RECORD_STREAK)  # the model's record skips it: target-only throughout
    try:
        with Client(v.address, target_only=True, timeout=60) as c:
            greedy = c.generate(prompt_ids=PROMPT, max_new_tokens=40).token_ids
        runs = {}
        for stop in ([], ["never in this text"]):
            loop = DecodeLoop(Drafter(lm), dataclasses.replace(params(40), stop=stop), lm.fingerprint, lm.max_context,
                              costs=COSTS, fallback=COSTS)
            asked, run = [], loop._run

            async def recording(call, n, run=run, asked=asked):
                asked.append(n)
                async for x in run(call, n):
                    yield x

            loop._run = recording
            assert loop.fallen_back and asyncio.run(_session(v.address, loop)) == greedy
            runs[bool(stop)] = asked
    finally:
        decode.RECORDS.pop(lm.name, None)
        v.stop()
    assert runs[False] == [40]  # the rest of the request as one run
    assert len(runs[True]) == 40 // RUN_MIN and set(runs[True]) == {RUN_MIN}


def test_a_draft_context_below_the_verifiers_ends_the_session_there(model_dir):
    """From a review: where the draft's context limit is the pair's (the smaller), the verifier,
    which knows only its own, was asked for max_new_tokens past it: a session went on past the
    limit Draft.Info reports, and one whose draft fell back ran to the limit, then failed with a
    false UNAVAILABLE in the middle of its reply. Both end at the limit with CONTEXT now."""
    from draft_service import decode

    target = model_dir("long-target")
    v = Service("verify_service", "--model", target)
    lm = LM.load(target, "cpu", "float32")
    limit = len(PROMPT) + 9  # the pair's limit, the draft's, far below the verifier's own

    async def session(loop):
        async with grpc.aio.insecure_channel(v.address) as ch:
            call = pb_grpc.VerifyStub(ch).Session(timeout=60)
            out, finish = [], None
            async for new, finish in loop.rounds(call):
                out += new
            call.cancel()
            return out, finish

    try:
        with Client(v.address, target_only=True, timeout=60) as c:
            greedy = c.generate(prompt_ids=PROMPT, max_new_tokens=40).token_ids
        got = {"drafting": asyncio.run(session(DecodeLoop(Drafter(lm), params(40), lm.fingerprint, limit, costs=COSTS)))}
        decode.RECORDS[lm.name] = ModelRecord(streak=RECORD_STREAK)  # fallen back from the start: runs of target-only steps
        try:
            loop = DecodeLoop(Drafter(lm), params(40), lm.fingerprint, limit, costs=COSTS, fallback=COSTS)
            assert loop.fallen_back
            got["fallen back"] = asyncio.run(session(loop))
        finally:
            decode.RECORDS.pop(lm.name, None)
    finally:
        v.stop()
    for how, (ids, finish) in got.items():
        assert ids == greedy[:9] and finish == pb.FINISH_REASON_CONTEXT, (how, ids, finish)


def busy(p: Pace, clock: Clock, seconds: float, sessions: int = 16) -> None:
    """Verdicts every 62.5 ms (a binary fraction: exact sums) for `seconds`, at a verifier with `sessions` open."""
    for _ in range(round(seconds / 0.0625)):
        clock.t += 0.0625
        p.quote(0.01, sessions)


def lose(p: Pace, sessions: int = 16) -> tuple[int, str] | None:
    """A window of rounds at 30 tok/s against a target-only 100 tok/s (3 tokens in 100 ms): what the last round's observe said."""
    return [p.observe(3, 0.1, 0.01, sessions) for _ in range(PROBE_ROUNDS)][-1]


def test_pace_holds_target_only_while_speculation_loses_and_probes_again():
    clock = Clock()
    p = Pace(clock=clock)
    for _ in range(PROBE_ROUNDS):  # rounds too short to judge on: no verdict yet
        p.observe(1, PROBE_S / PROBE_ROUNDS / 2, 1.0, 16)
    assert p.lost == 0 and p.rounds == PROBE_ROUNDS
    p = Pace(clock=clock)
    lose(p)
    assert p.lost == 1 and p.run() == int(HOLD_S[0] / 0.01)
    busy(p, clock, HOLD_S[0] / 2)
    assert p.run() == int(HOLD_S[0] / 2 / 0.01)  # runs last what is left of the hold
    busy(p, clock, HOLD_S[0] / 2)
    assert p.run() == 0  # the hold is over: speculate, and measure again
    lose(p)
    assert p.lost == 2 and p.holds[load_class(16)].next == min(4 * HOLD_S[0], HOLD_S[1])  # a longer hold next time
    busy(p, clock, 2 * HOLD_S[0])
    win = lambda: [p.observe(30, 0.1, 0.01, 16) for _ in range(PROBE_ROUNDS)][-1]  # 300 tok/s, above target-only's 100
    assert win() == (load_class(16), "unconfirmed") and p.run() == 0  # the first window after a hold wins: it decides nothing alone ...
    assert p.holds[load_class(16)].next == min(4 * HOLD_S[0], HOLD_S[1])
    assert win() == (load_class(16), "won")  # ... until the next one agrees: speculation stays
    assert p.lost == 2 and p.run() == 0 and p.holds[load_class(16)].next == min(4 * HOLD_S[0], HOLD_S[1]) / 2
    # (the next hold is halved, not reset: one lucky window does not bring the short holds back)
    assert win() == (load_class(16), "won") and p.holds[load_class(16)].next == min(4 * HOLD_S[0], HOLD_S[1]) / 4
    # (a window that agrees with the last decided one decides alone)
    assert lose(p) == (load_class(16), "lost") and p.lost == 3 and p.run() > 0  # a shared verifier's loss decides at once
    busy(p, clock, HOLD_S[1])
    assert win() == (load_class(16), "unconfirmed")  # a won first window followed by a lost one: lost, and the next hold doubled
    assert lose(p) == (load_class(16), "lost")
    assert p.lost == 4 and p.run() > 0 and p.holds[load_class(16)].next == min(2 * HOLD_S[0], HOLD_S[1]) * 2
    # a session alone at the verifier: a loss after a win needs the next window too (its ties go to speculation)
    p = Pace(clock=clock)
    for won in (True, False):
        assert [p.observe(30 if won else 3, 0.1, 0.01, 1) for _ in range(PROBE_ROUNDS)][-1] == (load_class(1), "won" if won else "unconfirmed")
    assert p.run() == 0 and p.lost == 0
    assert lose(p, 1) == (load_class(1), "lost") and p.run() > 0
    # a first comparison at a heavier load than one that lost there last: the loss stands for it, so a win waits for the next window
    busy(p, clock, HOLD_S[1], sessions=1)
    assert win() == (load_class(16), "unconfirmed") and win() == (load_class(16), "won")
    p = Pace(clock=clock)
    assert win() == (load_class(16), "won")  # no loss anywhere yet: a win decides
    p.observe(3, 0.03, 0.0)  # no quote (an old verifier): never target-only on no evidence
    assert Pace().run() == 0


def test_each_verify_replica_has_its_own_pace():
    """From a review: one pace per draft process pooled the verdicts of sessions on different
    verify replicas, so a loss under one replica's load held target-only the sessions on an idle
    replica too (the highest load of the last second of verdicts, from any replica, was the one
    acted on). Sessions on another verifier share neither its passes nor its load."""
    from draft_service.adaptive import pace_of

    busy_one, idle_one = pace_of("10.0.0.1:50051"), pace_of("10.0.0.2:50051")
    assert busy_one is pace_of("10.0.0.1:50051") and idle_one is not busy_one
    busy_one.clock = idle_one.clock = Clock()
    lose(busy_one, 16)
    for _ in range(4):
        idle_one.quote(0.01, 1)  # its verdicts: one open session
    assert busy_one.run() > 0 and idle_one.run() == 0 and idle_one.load == load_class(1)


def test_the_pace_keeps_its_verdict_per_load_and_holds_on_busy_time():
    """A loss at 16 open sessions holds target-only at that load (and heavier ones) only. A load that falls to 4
    sessions is acted on once it has lasted LOAD_S of busy time (a batch's sessions ending one by
    one are not a lighter load), and nothing holds there; back at 16 the hold holds again. Idle
    time (no verdicts) neither ends a hold nor counts as evidence; busy time ends it."""
    clock = Clock()
    p = Pace(clock=clock)
    lose(p, 16)
    assert p.run() > 0 and p.holds[load_class(16)].left == HOLD_S[0]
    p.holds[load_class(16)].left = 4.0  # a long hold, as after losses in a row
    busy(p, clock, LOAD_S / 2, sessions=4)
    assert p.load == load_class(16) and p.run() > 0
    busy(p, clock, LOAD_S, sessions=4)
    assert p.load == load_class(4) and p.run() == 0  # speculate: no verdict at this load yet
    left = p.holds[load_class(16)].left
    assert HOLD_S[0] < left < 4.0
    clock.t += 100.0  # idle: counts as IDLE_S at most, and at the load of 4
    p.quote(0.01, 16)  # a new batch of 16 sessions: held at once, the hold as it was
    assert p.load == load_class(16) and p.run() > 0 and p.holds[load_class(16)].left == left
    busy(p, clock, left + 0.0625)
    assert p.run() == 0 and p.lost == 1  # the hold is over after its busy time: speculate and measure anew
    # a loss at 4 sessions holds at 16 too (each row costs more there), and busy time at 16 counts toward it
    p = Pace(clock=clock)
    lose(p, 4)
    p.quote(0.01, 16)
    assert p.load == load_class(16) and p.run() == int(HOLD_S[0] / 0.01)
    busy(p, clock, HOLD_S[0] / 2)
    assert p.holds[load_class(4)].left == HOLD_S[0] / 2 and set(p.holds) == {load_class(4)}
    busy(p, clock, HOLD_S[0] / 2)
    assert p.run() == 0
    # a loss at 4 again (its next hold doubles), then a first comparison at 16 that loses: 16's hold starts
    # from 4's next one, not from HOLD_S[0]; a load where nothing lost starts from HOLD_S[0]
    busy(p, clock, LOAD_S + 0.0625, sessions=4)
    lose(p, 4)
    busy(p, clock, HOLD_S[0] * 2, sessions=4)
    assert p.run() == 0 and set(p.holds) == {load_class(4)} and p.holds[load_class(4)].next == 4 * HOLD_S[0]
    busy(p, clock, LOAD_S + 0.0625)
    assert lose(p, 16) == (load_class(16), "lost")
    assert p.holds[load_class(16)].left == 4 * HOLD_S[0] and p.holds[load_class(16)].next == min(8 * HOLD_S[0], HOLD_S[1])
    q = Pace(clock=clock)
    lose(q, 16)
    assert q.holds[load_class(16)].left == HOLD_S[0]
    assert [load_label(load_class(n)) for n in (0, 1, 2, 3, 4, 16, 31)] == ["unknown", "1", "2-3", "2-3", "4-7", "16-31", "16-31"]
    # a window is judged on the load most of its rounds were acted on at (observe says so, and whether speculation lost)
    p = Pace(clock=clock)
    for i in range(PROBE_ROUNDS):
        p.observe(3, 0.1, 0.01, 16 if i < 3 else 4)
    assert set(p.holds) == {load_class(16)}
    p = Pace(clock=clock)
    judged = [p.observe(3, 0.1, 0.01, 4 if i < 3 else 16) for i in range(PROBE_ROUNDS)]
    assert set(p.holds) == {load_class(16)} and judged == [None] * (PROBE_ROUNDS - 1) + [(load_class(16), "lost")]


def test_a_model_record_skips_a_model_that_keeps_falling_back_and_explores():
    r = ModelRecord()
    for _ in range(RECORD_STREAK - 1):
        r.judged(False)
    assert not r.skip()  # one session's bad luck is not enough
    r.judged(True)  # a session where the model paid clears the streak
    for _ in range(RECORD_STREAK):
        assert not r.skip()
        r.judged(False)
    starts = [r.skip() for _ in range(2 * EXPLORE_EVERY)]
    assert starts.count(False) == 2 and not starts[EXPLORE_EVERY - 1] and not starts[-1]  # every EXPLORE_EVERY-th is judged
    r.judged(True)  # an explorer found the model pays (the prompts changed): sessions use it again
    assert not r.skip()


class Counted:
    """A verify stream that counts the verdicts read from it."""

    def __init__(self, call):
        self.call, self.reads = call, 0

    async def write(self, req):
        await self.call.write(req)

    async def read(self):
        self.reads += 1
        return await self.call.read()


def test_a_runs_verdicts_answer_several_steps_beside_other_sessions(model_dir):
    """Round.run_tokens_per_verdict: one verdict answers up to that many steps of a run (the
    verifier caps it at MAX_RUN_TOKENS_PER_VERDICT), the earlier steps' tokens in run_tokens, numbered
    as its last step; the tokens are the same as a verdict a step. The verifier does so only
    while it serves other sessions: a session alone gets a verdict a step. A run's first step is
    answered alone (a session that starts in a run gets its first token after its prefill). A
    held session's runs ask for it (--run-tokens-per-verdict; 1: a verdict a step)."""
    target = model_dir("long-target")
    v = Service("verify_service", "--model", target, "--log-level", "INFO")
    try:
        with Client(v.address, target_only=True, timeout=60) as c:
            greedy = c.generate(prompt_ids=PROMPT, max_new_tokens=80).token_ids
        lm = LM.load(target, "cpu", "float32")
        start = DecodeLoop(Drafter(lm), params(80), lm.fingerprint, lm.max_context).start()

        async def opened(ch, max_new=80):
            call = pb_grpc.VerifyStub(ch).Session(timeout=60)
            start.start.max_new_tokens = max_new
            await call.write(start)
            return call

        async def run(per, steps, max_new, other_open=True):
            async with grpc.aio.insecure_channel(v.address) as ch:
                other = await opened(ch) if other_open else None  # a second session open at the verifier
                call = await opened(ch, max_new)
                await call.write(pb.VerifyRequest(round=pb.Round(round=1, target_only_steps=steps, run_tokens_per_verdict=per)))
                got = []
                while not got or got[-1].steps_left and not got[-1].finish_reason:
                    got.append(await call.read())
                for c in (call, other):
                    if c is not None:
                        c.cancel()
                return got

        got = asyncio.run(run(4, 23, 80, other_open=False))  # alone: a verdict a step
        assert [len(r.run_tokens) for r in got] == [0] * 23 and [r.next_token for r in got] == greedy[:23]
        got = asyncio.run(run(4, 23, 80))
        assert [len(r.run_tokens) + 1 for r in got] == [1, 4, 4, 4, 4, 4, 2]
        assert [r.round for r in got] == [1, 5, 9, 13, 17, 21, 23] and [r.steps_left for r in got] == [22, 18, 14, 10, 6, 2, 0]
        assert [t for r in got for t in [*r.run_tokens, r.next_token]] == greedy[:23]
        assert all(r.forward_s > 0 for r in got)
        got = asyncio.run(run(1000, 40, 80))
        assert [len(r.run_tokens) + 1 for r in got] == [1, CAP, CAP, 40 - 1 - 2 * CAP]
        got = asyncio.run(run(4, 23, 10))  # the session ends within a verdict's steps
        assert [len(r.run_tokens) + 1 for r in got] == [1, 4, 4, 1] and got[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert [t for r in got for t in [*r.run_tokens, r.next_token]] == greedy[:10]

        def logged():  # the verifier's `session done` lines of sessions that committed tokens: (tokens, rounds)
            lines = [json.loads(x) for x in v.stderr if '"session done"' in x]
            return [(f["tokens"], f["rounds"]) for f in lines if f["tokens"]]

        deadline = time.monotonic() + 10
        while logged()[-1:] != [(10, 10)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert logged()[-1] == (10, 10)  # its log counts every step's token and round, not one per verdict

        async def held(other_open: bool, run_tokens: int = RUN_TOKENS_PER_VERDICT):
            async with grpc.aio.insecure_channel(v.address) as ch:
                other = await opened(ch) if other_open else None
                pace = Pace(clock=Clock(), target_only_s=0.01, load=load_class(1), holds={load_class(1): Hold(left=1e9)})  # held throughout
                loop = DecodeLoop(Drafter(lm), params(80), lm.fingerprint, lm.max_context, costs=COSTS, pace=pace, run_tokens=run_tokens)
                call = Counted(pb_grpc.VerifyStub(ch).Session(timeout=60))
                out = [t async for new, _ in loop.rounds(call) for t in new]
                for c in (call.call, other):
                    if c is not None:
                        c.cancel()
                return out, loop.summary(), call.reads

        out, s, reads = asyncio.run(held(True))
        assert out == greedy and s.run_steps == s.target_only_rounds == s.rounds == 80 and s.drafted == 0
        assert reads == 1 + -(-79 // RUN_TOKENS_PER_VERDICT)  # the first step alone, then up to RUN_TOKENS_PER_VERDICT a verdict
        out, s, reads = asyncio.run(held(False))
        assert out == greedy and s.run_steps == 80 and reads == 80
        out, s, reads = asyncio.run(held(True, run_tokens=1))  # --run-tokens-per-verdict 1
        assert out == greedy and s.run_steps == 80 and reads == 80
    finally:
        v.stop()


def test_a_run_right_after_the_start_takes_the_queued_prefill_over(model_dir, monkeypatch):
    """A session that starts in a run (the draft sends its start and the run together): the
    stream takes the place of the session's prefill while that still waits, so its first step
    shares the pass of the prompt's last chunk; the prefill's own future resolves with it, and the
    tokens are the stream's alone."""

    import torch

    import verify_service.scheduler as scheduler

    torch.set_num_threads(1)
    lm = LM.load(model_dir("long-target"), "cpu", "float32")
    passes = count_passes(monkeypatch, lm.engine)
    go, held = held_thread()  # the scheduler thread starts work only once both jobs are queued

    eng = scheduler.Scheduler(lm, max_sessions=4, thread_context=held)
    passes.clear()  # the pass-cost probe's, at start-up

    async def session():
        s = eng.open(PROMPT, 10, Sampling(temperature=0.0), seed=7, mode=pb.PROPOSAL_MODE_GREEDY)
        try:
            prefill = asyncio.ensure_future(eng.prefill(s))
            await asyncio.sleep(0)  # the prefill is queued
            steps = eng.steps(s, 10)
            first = asyncio.ensure_future(steps.__anext__())  # queues the stream behind it
            await asyncio.sleep(0)
            go.set()
            got = [(await first).next_token] + [v.next_token async for v in steps]
            await asyncio.wait_for(prefill, 60)  # resolved by the stream that took it over
            return got
        finally:
            eng.close(s)

    try:
        got = asyncio.run(session())
    finally:
        eng.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_dir("long-target"), dtype=torch.float32).eval()
    assert got == hf_greedy(model, PROMPT, 10)
    assert len(passes) == 10  # the prompt's pass carried the first step: a pass per token, none for the prefill alone


class ScriptedVerifier:
    """A Verify.Session stand-in whose verdicts follow a script per round: `accept(k, tokens)` gives
    the number of proposals accepted in round k; the next token is then the draft's own argmax after
    them (so a greedy pre-draft's guess comes true) where `bonus_is_draft(k)`, else a token that is
    neither of the draft's two likeliest. Runs (Round.target_only_steps) are served as one verdict."""

    def __init__(self, draft_dir: str, max_new: int, accept, bonus_is_draft=lambda k: False, target_only_s: float = 0.0):
        self.model = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
        self.max_new, self.accept, self.bonus_is_draft = max_new, accept, bonus_is_draft
        self.target_only_s = target_only_s  # the quote each verdict carries (0: none, so a pace never runs)
        self.sent: list[tuple[str, int]] = []  # ("round", proposals) or ("run", steps), in order
        self.queue: list = []

    def top2(self, ids):
        with torch.no_grad():
            return torch.topk(self.model(torch.tensor([ids])).logits[0, -1].float(), 2).indices.tolist()

    async def write(self, req):
        if req.HasField("start"):
            self.ids, self.prompt = list(req.start.prompt_ids), len(req.start.prompt_ids)
            return
        r, k = req.round, len(self.sent) + 1
        left = self.max_new - (len(self.ids) - self.prompt)
        if r.target_only_steps:
            self.sent.append(("run", r.target_only_steps))
            n = min(r.target_only_steps, left)
            self.ids += [5] * n
            self.queue.append(pb.VerifyResponse(round=r.round, run_tokens=[5] * (n - 1), next_token=5, steps_left=0,
                                                finish_reason=pb.FINISH_REASON_LENGTH if n == left else 0,
                                                target_only_s=self.target_only_s, open_sessions=1))
            return
        tokens = list(r.tokens)
        self.sent.append(("round", len(tokens)))
        n = min(self.accept(k, tokens), len(tokens))
        if self.bonus_is_draft(k):
            nxt = self.top2(self.ids + tokens[:n])[0]
        else:
            nxt = next(t for t in range(16) if t not in self.top2(self.ids + tokens[:n]) and t not in tokens[n:n + 1])
        self.ids += tokens[:n] + [nxt]
        finish = pb.FINISH_REASON_LENGTH if len(self.ids) - self.prompt >= self.max_new else 0
        self.queue.append(pb.VerifyResponse(round=r.round, num_accepted=n, next_token=nxt, finish_reason=finish,
                                            target_only_s=self.target_only_s, open_sessions=1))

    async def read(self):
        return self.queue.pop(0) if self.queue else grpc.aio.EOF


def _loop_run(loop, verifier):
    async def go():
        async for _ in loop.rounds(verifier):
            pass
    asyncio.run(go())


class HoldingPace(Pace):
    """A pace whose comparison is lost at its third verdict: target-only holds from there on (its
    clock stands still, so the hold never ends)."""

    quotes = 0

    def quote(self, target_only_s: float, sessions: int = 0) -> None:
        super().quote(target_only_s, sessions)
        self.quotes += 1
        if self.quotes == 3:
            self.holds[load_class(1)] = Hold(left=5.0, lost=True)


def test_a_predraft_that_came_true_gives_way_to_the_paces_hold(model_dir):
    """A session whose pre-draft came true sent it, and pre-drafted again, while the pace held
    target-only: with a draft whose guesses keep coming true it speculated through the whole hold
    (DESIGN §7: every session there runs target-only). With pre-drafting on or off, the message
    after the hold began is a run."""
    lm = LM.load(model_dir("draft"), "cpu", "float32")
    for predraft in (False, True):
        g = dataclasses.replace(params(60), predraft=predraft)
        loop = DecodeLoop(Drafter(lm), g, lm.fingerprint, lm.max_context, costs=COSTS, predraft=predraft,
                          pace=HoldingPace(clock=Clock(), probe_rounds=10**6))
        v = ScriptedVerifier(model_dir("draft"), 60, accept=lambda k, tokens: len(tokens), bonus_is_draft=lambda k: True,
                             target_only_s=0.01)
        _loop_run(loop, v)
        assert [kind for kind, _ in v.sent[:3]] == ["round"] * 3 and v.sent[3:4] == [("run", 60 - sum(n + 1 for _, n in v.sent[:3]))], \
            (predraft, v.sent)
        assert len(v.sent) == 4, (predraft, v.sent)
        if predraft:  # its pre-drafts came true until the hold: the one it had then is counted a miss, not sent
            assert loop.stats.predraft_hits >= 1 and loop.stats.predraft_misses >= 1, loop.stats


def test_a_session_closed_during_a_pass_ends_its_call_once_its_room_is_back(model_dir):
    """A session closed while a pass was in flight gave its room back only at the scheduler
    thread's next turn, after its handler had returned: a caller at the limit whose call had ended
    OK was refused its next session (RESOURCE_EXHAUSTED). Its slot comes back at once; its tokens
    after the pass (its pages are read until then), and where the cache is full the call waits for
    them (`closed`). The scheduler thread is held while the pass is said to be in flight."""

    import verify_service.scheduler as scheduler
    from specdec.errors import RequestError

    lm = LM.load(model_dir("target"), "cpu", "float32")
    go, held = held_thread()

    def new(eng):
        return eng.open(PROMPT, 4, Sampling(temperature=0.0), seed=7, mode=pb.PROPOSAL_MODE_GREEDY)

    need = -(-(len(PROMPT) + 4) // scheduler.PAGE) * scheduler.PAGE  # one session's reserved tokens, in whole pages

    async def slots():  # one session at most, room for many: the slot is back as the call ends, no wait
        eng = scheduler.Scheduler(lm, max_sessions=1, max_cached_tokens=8 * need, thread_context=held)
        try:
            a = new(eng)
            eng._passing = True
            ending = asyncio.ensure_future(eng.closed(a))
            for _ in range(3):
                await asyncio.sleep(0)
            eng._passing = False
            assert ending.done() and not a.released[1].done()  # it ended with the tokens still to come back
            eng.close(new(eng))  # the next session fits
        finally:
            go.set()
            eng.shutdown()

    async def tokens():  # a cache of one session's tokens: the call waits for them
        go.clear()
        eng = scheduler.Scheduler(lm, max_sessions=4, max_cached_tokens=need, thread_context=held)
        try:
            a = new(eng)
            eng._passing = True
            done = eng.close(a)
            eng._passing = False
            assert done is not None and not done.done() and eng.close(a) is done  # closing again waits for the same
            with pytest.raises(RequestError, match="cache is full"):
                new(eng)  # its tokens are not back yet
            waiting = asyncio.ensure_future(eng.closed(a))
            await asyncio.sleep(0.05)
            assert not waiting.done()  # it waits for the scheduler thread
            go.set()
            await asyncio.wait_for(waiting, 30)
            eng.close(new(eng))  # once the call would end, the next session fits
        finally:
            go.set()
            eng.shutdown()

    asyncio.run(asyncio.wait_for(slots(), 60))
    asyncio.run(asyncio.wait_for(tokens(), 60))


def test_callers_at_the_session_limit_are_never_refused_a_session_after_their_last_one_ended(model_dir):
    """Three callers, a verify service of three sessions: each opens its next session once the
    last one's call has ended. 23 of 75 were refused (its room was still counted) before."""
    v = Service("verify_service", "--model", model_dir("target"), "--max-sessions", "3")

    async def caller(stub, fp, n):
        refused = 0
        for _ in range(n):
            call = stub.Session(timeout=60)
            await call.write(pb.VerifyRequest(start=pb.SessionStart(prompt_ids=PROMPT, max_new_tokens=2, sampling=pb.SamplingParams(),
                                                                     proposal_mode=pb.PROPOSAL_MODE_GREEDY, vocab_fingerprint=fp)))
            try:
                for r in range(1, 3):
                    await call.write(pb.VerifyRequest(round=pb.Round(round=r)))
                    if (await call.read()).finish_reason:
                        break
                await call.done_writing()
                assert await call.read() is grpc.aio.EOF
                await call.code()
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                refused += 1
        return refused

    async def run():
        async with grpc.aio.insecure_channel(v.address) as ch:
            stub = pb_grpc.VerifyStub(ch)
            fp = (await stub.Info(pb.InfoRequest())).vocab_fingerprint
            return await asyncio.wait_for(asyncio.gather(*(caller(stub, fp, 15) for _ in range(3))), 240)

    try:
        assert asyncio.run(run()) == [0, 0, 0]
    finally:
        v.stop()


def test_a_predraft_that_came_true_is_sent_through_a_hold_where_the_verifier_has_no_runs(model_dir):
    """The pace's hold turns a session to runs; a verifier without runs (an older one: it answers
    a run with one verdict) keeps it in rounds, so a pre-draft that came true is still sent there:
    dropping it would draft the same round again and count a miss."""
    lm = LM.load(model_dir("draft"), "cpu", "float32")
    loop = DecodeLoop(Drafter(lm), params(60), lm.fingerprint, lm.max_context, costs=COSTS, predraft=True,
                      pace=HoldingPace(clock=Clock(), probe_rounds=10**6))
    loop.runs_ok = False  # as the loop sets it after such a verifier's first answer to a run
    v = ScriptedVerifier(model_dir("draft"), 60, accept=lambda k, tokens: len(tokens), bonus_is_draft=lambda k: True,
                         target_only_s=0.01)
    _loop_run(loop, v)
    assert loop.pace.held() and all(kind == "round" for kind, _ in v.sent), v.sent
    # every pre-draft but the one for the request's last token was sent (dropped in the hold: 2 hits, 10 misses)
    assert loop.stats.predraft_hits >= 10 and loop.stats.predraft_misses <= 1, loop.stats


def test_sessions_that_do_not_use_the_model_do_not_count_among_those_it_serves(model_dir):
    """Drafter.shared() (other sessions' pre-drafts give way) counted every open request: one with
    prompt lookup alone, or one that fell back, turned the others' pre-drafts off (a review: 5 hits
    / 2 misses alone, 1 / 6 beside a lookup request). A lookup request also prefilled the model
    over its whole prompt for nothing."""
    from draft_service import decode

    lm = LM.load(model_dir("draft"), "cpu", "float32")
    drafter = Drafter(lm)

    def recording(seen, n=0):
        return lambda k, tokens: (seen.append(drafter.serving_now), n)[1]

    seen: list[int] = []
    g = dataclasses.replace(params(12), proposer=pb.PROPOSER_LOOKUP)
    loop = DecodeLoop(drafter, g, lm.fingerprint, lm.max_context)
    _loop_run(loop, ScriptedVerifier(model_dir("draft"), 12, accept=recording(seen)))
    assert seen and set(seen) == {0} and loop.stats.prefill_s == 0, (seen, loop.stats)

    decode.RECORDS.clear()  # a session of the model that falls back after its rounds 1-3 are rejected
    costs = Costs(draft_step=0.004, verify_base=0.010, verify_per_token=0.0)
    seen = []
    loop = DecodeLoop(drafter, dataclasses.replace(params(30), tau=8), lm.fingerprint, lm.max_context, costs=costs, fallback=costs)
    loop.runs_ok = False  # target-only rounds after the fallback, each seen by the verifier's script
    _loop_run(loop, ScriptedVerifier(model_dir("draft"), 30, accept=recording(seen)))
    decode.RECORDS.clear()
    assert loop.fallen_back and seen[0] == 1 and seen[-1] == 0, seen
    assert drafter.serving_now == 0


def test_a_predraft_that_fails_is_a_miss_not_the_requests_failure(model_dir):
    """A pre-draft is work ahead of its round: when its thread raised, the request failed INTERNAL
    though the round's verdict was in (a review injected a failure into every 4th pre-draft: 8 of 8
    requests failed). It is a miss, the round is drafted afresh, and the session pre-drafts no more
    (a fault that repeats would cost a doomed pre-draft and a warning every round)."""
    class Failing(Drafter):
        def predraft(self, *args, **kwargs):
            raise RuntimeError("injected")

    lm = LM.load(model_dir("draft"), "cpu", "float32")
    loop = DecodeLoop(Failing(lm), params(24), lm.fingerprint, lm.max_context, predraft=True)
    v = ScriptedVerifier(model_dir("draft"), 24, accept=lambda k, tokens: len(tokens), bonus_is_draft=lambda k: True)
    _loop_run(loop, v)
    assert len(v.ids) - v.prompt == 24
    assert loop.stats.predraft_hits == 0 and loop.stats.predraft_misses == 1 and not loop.predraft, loop.stats


def test_a_fallback_decided_in_a_round_whose_predraft_came_true_drops_the_predraft(model_dir):
    """The judge stops the draft model in a round whose pre-draft came true: that pre-draft is
    not sent and counts as a miss, and the rest of the session is one run (DESIGN §7). It was
    sent, and the rest went as one empty round per token."""
    from draft_service import decode

    lm = LM.load(model_dir("draft"), "cpu", "float32")
    costs = Costs(draft_step=0.004, verify_base=0.010, verify_per_token=0.0)
    for predraft in (False, True):
        decode.RECORDS.clear()
        g = dataclasses.replace(params(60), tau=8, predraft=predraft)
        loop = DecodeLoop(Drafter(lm), g, lm.fingerprint, lm.max_context, costs=costs, fallback=costs, predraft=predraft,
                          pace=Pace(clock=Clock()))
        # rounds 1-3 rejected; round 4 accepted whole with the draft's own next token (its pre-draft's guess); then runs
        v = ScriptedVerifier(model_dir("draft"), 60, accept=lambda k, tokens: len(tokens) if k == 4 else 0, bonus_is_draft=lambda k: k == 4)
        _loop_run(loop, v)
        s = loop.summary()
        assert loop.fallen_back and v.sent[:4] == [("round", 1)] * 4, (predraft, v.sent)
        assert v.sent[4:] == [("run", 60 - 5)], (predraft, v.sent)  # a token from each of rounds 1-3, two from round 4; one run
        assert s.predraft_hits == 0 and s.predraft_misses == (3 if predraft else 0) + predraft, s
    decode.RECORDS.clear()


def test_the_fallback_judge_counts_no_predraft_overlap_for_a_session_that_cannot_predraft(model_dir):
    """A session that follows the load does not pre-draft while the draft model serves other
    sessions too; the judge then weighs the model's costs without pre-drafting's overlap (it counted
    the overlap the session did not get, and kept a model slower than target-only rounds)."""
    from draft_service import decode

    decode.RECORDS.clear()
    lm = LM.load(model_dir("draft"), "cpu", "float32")
    costs = Costs(draft_step=0.006, verify_base=0.010, verify_per_token=0.0)
    drafter = Drafter(lm)
    g = dataclasses.replace(params(200), tau=8, predraft=True)
    other = drafter.serving()  # another session is being drafted for
    other.__enter__()
    try:
        loop = DecodeLoop(drafter, g, lm.fingerprint, lm.max_context, costs=costs, fallback=costs, predraft=True, pace=Pace(clock=Clock()))
        loop.record = None
        # one proposal accepted in 11 rounds of 20: with pre-drafting's overlap the model would pay, without it it does not
        accepted = {1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19}
        v = ScriptedVerifier(model_dir("draft"), 60, accept=lambda k, tokens: int(k % 20 in accepted))
        _loop_run(loop, v)
    finally:
        other.__exit__(None, None, None)
        decode.RECORDS.clear()
    assert loop.judge.predraft is False and loop.fallen_back
    assert loop.summary().predraft_hits == loop.summary().predraft_misses == 0  # no pre-draft was made


def test_a_seeded_sampled_request_at_fixed_tau_is_judged_alike_with_pre_drafting_on_and_off(model_dir):
    """DESIGN §3: at fixed tau a seeded sampled request gives the same tokens with pre-drafting on
    and off. The fallback judge (costs pinned: it judges seeded requests then) weighed the overlap
    a pre-draft gives, so with the same verdicts it kept the model two rounds longer with
    pre-drafting on, and a round with proposals and a target-only step are different draws."""
    from draft_service import decode

    lm = LM.load(model_dir("draft"), "cpu", "float32")
    script = [1, 0, 2, 0, 0, 1] + [0] * 60  # proposals accepted in round k (at most what it sent)
    sent = {}
    for predraft in (False, True):
        decode.RECORDS.clear()
        g = dataclasses.replace(params(40, temperature=1.0, seeded=True), mode=pb.PROPOSAL_MODE_SPARSE, predraft=predraft)
        loop = DecodeLoop(Drafter(lm), g, lm.fingerprint, lm.max_context, fallback=Costs(0.002, 0.005, 0.0005), predraft=predraft)
        v = ScriptedVerifier(model_dir("draft"), 40, accept=lambda k, tokens: script[k - 1])
        _loop_run(loop, v)
        sent[predraft] = v.sent
    decode.RECORDS.clear()
    assert sent[False] == sent[True], sent
    assert sent[False] == [("round", 1)] + [("round", 4)] * 4 + [("run", 40 - 8)]  # it drafted 8 tokens, then fell back


def test_a_pass_waiting_for_the_last_passs_sessions_goes_once_each_sent_a_run_or_closed(model_dir):
    """The pass that waits a little for the sessions of the last one (`--gather`) was woken by
    their rounds only: a session whose next work was a run, or that closed (a cancel, a stop
    string), kept it waiting out its whole time. The scheduler thread is held while the waiting
    set is as `_gather` publishes it."""

    import verify_service.scheduler as scheduler

    lm = LM.load(model_dir("target"), "cpu", "float32")
    go, held = held_thread()

    eng = scheduler.Scheduler(lm, max_sessions=4, gather=1.0, thread_context=held)

    async def session():
        a, b, c = (eng.open(PROMPT, 4, Sampling(temperature=0.0), seed=7, mode=pb.PROPOSAL_MODE_GREEDY) for _ in range(3))
        eng._arrived.clear()
        eng._awaited = {a.sid, b.sid, c.sid}  # the last pass's sessions, none of whose next work is queued yet
        eng.close(a)
        assert eng._awaited == {b.sid, c.sid} and not eng._arrived.is_set()
        run = eng.steps(b, 2)
        first = asyncio.ensure_future(run.__anext__())  # queues b's run
        await asyncio.sleep(0)
        assert eng._awaited == {c.sid} and not eng._arrived.is_set()
        eng.close(c)
        assert not eng._awaited and eng._arrived.is_set()  # the last one it waited for: the pass goes now
        eng._awaited = set()
        go.set()
        try:
            return [(await first).next_token] + [v.next_token async for v in run]
        finally:
            eng.close(b)

    try:
        got = asyncio.run(asyncio.wait_for(session(), 60))
    finally:
        eng.shutdown()
    assert len(got) == 2


def test_a_pass_does_not_wait_for_sessions_closed_just_before_it_published_its_wait(model_dir):
    """A session that closes after `_gather` picked the last pass's sessions but before it
    published them finds nothing to take itself out of (`_arrive`), so the pass would wait its
    whole time for a round that never comes. The close is made to land in that window (the
    clearing of the wake-up event, between the two); the wait is recorded, not slept."""
    import collections
    import threading

    import verify_service.scheduler as scheduler

    lm = LM.load(model_dir("target"), "cpu", "float32")
    go, held = held_thread()  # the scheduler's own thread stays out of the way

    eng = scheduler.Scheduler(lm, max_sessions=4, gather=1.0, thread_context=held)
    try:
        a, b = (eng.open(PROMPT, 4, Sampling(temperature=0.0), seed=7, mode=pb.PROPOSAL_MODE_GREEDY) for _ in range(2))
        waits = []

        class ClosingEvent(threading.Event):
            def clear(self):
                super().clear()
                eng.close(a)
                eng.close(b)

            def wait(self, timeout=None):
                waits.append(timeout)
                return False

        eng._arrived = ClosingEvent()
        eng._back, eng._pass_s = {a.sid, b.sid}, 30.0  # the last pass answered both; a wait would be 30 s
        assert eng._gather([], collections.deque()) is True
        assert waits == [] and not eng._awaited
    finally:
        go.set()
        eng.shutdown()


def test_a_run_that_finishes_the_session_gives_its_room_back_before_its_verdicts_are_read(model_dir):
    """From a review: a Session's run runs ahead of its reader, and a finished session was closed
    after the pass only for Verify.Generate's streams: a run's session that reached
    max_new_tokens kept its slot, pages and reserved tokens until a slow reader had taken every
    verdict (up to --idle-timeout-s a verdict), and other sessions were refused meanwhile."""
    from verify_service.scheduler import Scheduler

    lm = LM.load(model_dir("long-target"), "cpu", "float32")
    eng = Scheduler(lm, max_sessions=1)

    async def go():
        s = eng.open(PROMPT, 12, Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)
        steps = eng.steps(s, 12)
        first = await steps.__anext__()  # then nothing read while the run goes on
        for _ in range(3000):
            if s.closed:
                break
            await asyncio.sleep(0.01)
        room = (s.closed, eng.capacity.sessions, eng.capacity.reserved)
        other = eng.open(PROMPT, 4, Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)  # the one slot is free again
        eng.close(other)
        rest = [v async for v in steps]
        await eng.closed(s)
        return room, [first.next_token] + [v.next_token for v in rest], rest[-1].finish

    try:
        room, tokens, finish = asyncio.run(go())
    finally:
        eng.shutdown()
    assert room == (True, 0, 0)
    assert tokens == hf_greedy(AutoModelForCausalLM.from_pretrained(model_dir("long-target")).eval(), PROMPT, 12)
    from specdec.errors import Finish

    assert finish == Finish.LENGTH



def test_a_finished_runs_slow_reader_gets_its_verdicts_grouped_and_counted_as_before(model_dir):
    """A finished run's session leaves the sessions table at once now (above), while its handler
    still writes the verdicts its slow reader has not taken: those went out a step each (the
    grouping asks whether other sessions are open) and told the draft one session fewer than the
    verifier served. The handler counts its own session while it writes."""
    from verify_service.scheduler import Scheduler
    from verify_service.server import VerifyServicer

    lm = LM.load(model_dir("long-target"), "cpu", "float32")
    eng = Scheduler(lm, max_sessions=4)
    srv = VerifyServicer(eng)

    class Slow:  # takes its first verdict after `wait` seconds: the scheduler runs the whole run ahead meanwhile
        def __init__(self, wait):
            self.wait, self.got = wait, []

        async def write(self, v):
            if self.wait and not self.got:
                await asyncio.sleep(self.wait)
            self.got.append((len(v.run_tokens) + 1, v.open_sessions))

    async def go(wait):
        other = eng.open(PROMPT, 50, Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)
        s = eng.open(PROMPT, 13, Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)
        await eng.prefill(s)
        reader = Slow(wait)
        await srv._run(s, pb.Round(round=1, target_only_steps=13, run_tokens_per_verdict=4), reader)
        closed = s.closed
        await eng.closed(s)
        eng.close(other)
        return closed, reader.got

    try:
        fast, slow = asyncio.run(go(0.0)), asyncio.run(go(1.0))
    finally:
        eng.shutdown()
    assert slow[0] and slow[1] == fast[1] == [(1, 2), (4, 2), (4, 2), (4, 2)], (fast, slow)
