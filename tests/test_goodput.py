"""Speculation that never costs the verifier goodput: the price each verdict carries, the draft
following it down to target-only rounds and back, and the scheduler's bound on rows per pass.
(The pass cost model itself: tests/test_passcost.py.)"""
import asyncio

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from client import Client
from draft_service.decode import DecodeLoop
from draft_service.drafter import Drafter
from draft_service.tree import CALIBRATIONS
from helpers import metric
from specdec.costmodel import Costs
from specdec.lm import LM
from specdec.sampling import Sampling
from specdec.validation import GenParams
from specdec.v1 import specdec_pb2 as pb

COSTS = Costs(draft_step=0.001, verify_base=0.010, verify_per_token=0.0002)


class Verifier:
    """A verify stream in-process that quotes the price it is told to. It accepts every chain
    proposal and a tree's first-child path, and its next token is 5, or, given a model, that
    model's argmax after the accepted tokens (the draft model's own: then pre-drafts hit)."""

    def __init__(self, prices, model=None):
        self.prices, self.rounds, self.model, self.context, self.shapes = list(prices), [], model, [], []

    async def write(self, req: pb.VerifyRequest) -> None:
        if req.HasField("start"):
            self.context = list(req.start.prompt_ids)
        if req.HasField("round"):
            self.rounds.append(list(req.round.tokens))
            self.parents = list(req.round.parents)
            self.shapes.append(self.parents)

    def _path(self) -> list[int]:
        if not self.parents:
            return list(range(len(self.rounds[-1])))
        path, at = [], -1
        while (kids := [i for i, p in enumerate(self.parents) if p == at]):
            at = kids[0]
            path.append(at)
        return path

    async def read(self):
        if len(self.rounds) > len(self.prices):
            return grpc.aio.EOF
        path = self._path()
        self.context += [self.rounds[-1][i] for i in path]
        with torch.inference_mode():
            nxt = int(self.model(torch.tensor([self.context])).logits[0, -1].argmax()) if self.model is not None else 5
        self.context.append(nxt)
        finish = pb.FINISH_REASON_LENGTH if len(self.rounds) == len(self.prices) else pb.FINISH_REASON_UNSPECIFIED
        return pb.VerifyResponse(round=len(self.rounds), num_accepted=len(path), next_token=nxt, finish_reason=finish,
                                 row_price=self.prices[len(self.rounds) - 1], accepted_path=path if self.parents else [])


def rounds_under(prices, model_dir, temperature=0.0, seeded=False, goodput=True, proposer=pb.PROPOSER_DRAFT, predraft=False,
                 tree_budget=0, prompt=(3, 4, 5), draft="draft"):
    """(proposals per round, the loop's stats) of one request under the verifier's prices, round by
    round; with pre-drafting, the verifier continues as the draft model does (pre-drafts hit)."""
    lm = LM.load(model_dir(draft), "cpu", "float32")
    params = GenParams(prompt_ids=list(prompt), max_new_tokens=200, sampling=Sampling(temperature=temperature), seed=7, seeded=seeded,
                       tau=8, proposer=proposer, mode=pb.PROPOSAL_MODE_GREEDY if temperature == 0 else pb.PROPOSAL_MODE_SPARSE,
                       predraft=predraft, tree_budget=tree_budget)
    CALIBRATIONS.pop(lm.name, None)  # a tree's sizes start from no evidence (other tests' sessions taught this process's)
    loop = DecodeLoop(Drafter(lm), params, lm.fingerprint, lm.max_context, costs=COSTS, goodput=goodput, predraft=predraft)
    v = Verifier(prices, AutoModelForCausalLM.from_pretrained(model_dir(draft)).eval() if predraft else None)

    async def run():
        async for _ in loop.rounds(v):
            pass
    asyncio.run(run())
    return [len(r) for r in v.rounds], loop.summary(), v.shapes


def test_tau_follows_the_price_down_to_target_only_rounds_and_back(model_dir):
    """Every proposal accepted (alpha near 1): an idle verifier (price 0) gets the cost model's tau;
    a price above alpha gets rounds without proposals (no draft step), and tau comes back when
    the price falls; in between, only the depths that still pay (alpha^k > price)."""
    prices = [0.0] * 4 + [0.999] * 4 + [0.0] * 4
    taus, stats, _ = rounds_under(prices, model_dir)
    assert all(t > 0 for t in taus[:5]), taus  # the first round is sent before any price is known
    assert taus[5:9] == [0, 0, 0, 0], taus  # each verdict's price sets the next round
    assert all(t > 0 for t in taus[9:]), taus
    assert stats.target_only_rounds == 4 and stats.rounds == len(prices)
    partial, _, _ = rounds_under([0.0] * 3 + [0.9] * 6, model_dir)  # alpha estimate < 1: a shorter cap, not none
    assert 0 < min(partial[4:]) < max(partial[:4]), partial


def test_a_priced_out_sessions_probe_drafts_nothing_ahead(model_dir):
    """A session the price holds at no proposals proposes one token every PRICED_OUT_PROBE-th
    round; the round after a probe is priced out again, so a pre-draft made during the probe was
    thrown away, a miss each time (from a review of the change). Pre-drafting on, a steady price
    above every proposal's worth: the probes come, and no pre-draft is made for the round after."""
    from draft_service.adaptive import PRICED_OUT_PROBE

    prices = [0.0] + [0.9999] * (3 * PRICED_OUT_PROBE + 2)
    taus, stats, _ = rounds_under(prices, model_dir, predraft=True)
    probes = [i for i, t in enumerate(taus[3:], 3) if t]
    assert len(probes) >= 2 and all(taus[i] == 1 for i in probes), taus
    assert stats.predraft_hits + stats.predraft_misses <= 2, (taus, stats)  # the first rounds' only, before the price rose


@pytest.mark.parametrize("proposer,predraft,tree_budget", [
    (pb.PROPOSER_DRAFT, True, 0), (pb.PROPOSER_LOOKUP, False, 0), (pb.PROPOSER_HYBRID, False, 0), (pb.PROPOSER_HYBRID, True, 0),
    (pb.PROPOSER_DRAFT, False, 8), (pb.PROPOSER_DRAFT, True, 8)])
def test_every_proposer_follows_the_price_down_to_target_only_rounds_and_back(model_dir, proposer, predraft, tree_budget):
    """Prompt lookup, hybrid, pre-drafted chains and trees: the round after a verdict that prices
    every proposal out carries none. A pre-draft made while that verdict was pending is not sent
    (the verifier continues as the draft model does, so pre-drafts hit), and proposals come back
    when the price falls."""
    prices = [0.0] * 4 + [0.999] * 4 + [0.0] * 4
    # a context of 4,096 tokens: prompt lookup proposes 8 tokens a round on this periodic prompt, which the
    # verifier here accepts, and the tiny draft's 64 ran out after the price fell (no room: rounds of 0)
    taus, stats, _ = rounds_under(prices, model_dir, proposer=proposer, predraft=predraft, tree_budget=tree_budget, prompt=(3, 4, 5, 3, 4, 5),
                                  draft="long-draft")
    assert all(t > 0 for t in taus[:5]) and taus[5:9] == [0, 0, 0, 0] and all(t > 0 for t in taus[9:]), taus
    assert stats.target_only_rounds == 4
    assert stats.predraft_hits > 0 if predraft else stats.predraft_hits == 0
    assert (stats.lookup_rounds > 0) == (proposer != pb.PROPOSER_DRAFT) and (stats.tree_rounds > 0) == bool(tree_budget)


def test_under_load_a_tree_shrinks_to_a_chain(model_dir):
    """A price above 1/2 is a floor no two siblings can both clear (their branch probabilities sum
    to at most their parent's), so a busy verifier gets chains: no node with two children."""
    prices = [0.0] * 5 + [0.6] * 6
    taus, stats, shapes = rounds_under(prices, model_dir, tree_budget=8, prompt=(3, 4, 5, 3, 4, 5))
    idle_taus, _, idle = rounds_under([0.0] * len(prices), model_dir, tree_budget=8, prompt=(3, 4, 5, 3, 4, 5))

    def branched(parents):
        return len(set(parents)) < len(parents)
    # the same request with the verifier idle throughout still branches in those rounds (the
    # calibration, learning that this verifier takes first children, does not make chains alone)
    assert any(branched(p) for p in shapes[1:6]) and any(branched(p) for p in idle[6:]), (shapes, idle)
    assert not any(branched(p) for p in shapes[6:]) and stats.tree_rounds == len(prices), shapes
    assert max(taus[6:]) < max(idle_taus[6:]), (taus, idle_taus)


def test_seeded_sampled_requests_ignore_the_price(model_dir):
    """Their taus must not depend on load (DESIGN.md §7); unseeded sampled ones follow it."""
    prices = [0.0] * 2 + [0.999] * 4
    seeded, _, _ = rounds_under(prices, model_dir, temperature=1.0, seeded=True)
    free, _, _ = rounds_under([0.0] * len(prices), model_dir, temperature=1.0, seeded=True)
    unseeded, _, _ = rounds_under(prices, model_dir, temperature=1.0, seeded=False)
    off, _, _ = rounds_under(prices, model_dir, goodput=False)
    assert seeded == free and 0 not in seeded
    assert unseeded[3:] == [0, 0, 0]
    assert 0 not in off  # --no-goodput


def test_verdicts_carry_the_price_and_the_verifier_exports_its_load(services):
    """Through real services: the verifier measures its passes and says so in its metrics (the
    gauges as of the scrape: they fall while the verifier is idle, tests/test_passcost.py); that
    every verdict carries row_cost_s and row_price is the next test's, on a fixed cost model."""
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    v, d = services()
    with Client(d.address, timeout=60) as c:
        for _ in range(3):
            assert c.generate(prompt_ids=[3, 4], max_new_tokens=12, num_draft_tokens=3).token_ids  # may end at EOS
    assert metric(d.metrics(), "specdec_draft_proposals_per_round_count") >= 3
    with grpc.insecure_channel(v.address) as ch:
        stub = pb_grpc.VerifyStub(ch)
        fp = stub.Info(pb.InfoRequest(), timeout=10).vocab_fingerprint
        reqs = [pb.VerifyRequest(start=pb.SessionStart(prompt_ids=[3, 4], max_new_tokens=4, vocab_fingerprint=fp,
                                                       proposal_mode=pb.PROPOSAL_MODE_GREEDY)),
                pb.VerifyRequest(round=pb.Round(round=1, tokens=[5]))]
        verdict = next(iter(stub.Session(iter(reqs), timeout=30)))
    assert verdict.round == 1 and verdict.forward_s > 0 and verdict.target_only_s > 0
    text = v.metrics()
    assert 0 < metric(text, "specdec_verify_pass_utilisation") <= 1
    assert "specdec_verify_row_price " in text  # its value (0 where the fit finds rows free) is pinned below


def test_the_verifiers_costs_reach_every_verdict_and_its_price_gauge(model_dir, monkeypatch):
    """What the verifier's cost model says goes out with each verdict (row_cost_s, row_price,
    target_only_s), through a real gRPC server, and the price and utilisation gauges read the
    model as of the scrape: just after the last pass, its price; ten idle seconds later, almost
    nothing (a gauge frozen at the last pass's value passed the check this test had). The model
    in the verdicts is fixed (the measured one may fit rows as free on a busy machine)."""
    import types

    from prometheus_client import REGISTRY

    import verify_service.scheduler as scheduler

    from specdec.v1 import specdec_pb2_grpc as pb_grpc
    from verify_service.passcost import PassCost
    from verify_service.scheduler import Scheduler
    from verify_service.server import VerifyServicer

    class Fixed:  # a cost model with known answers
        per_row_s, price = 0.25, 0.5

        def observe(self, *args) -> None:
            pass

        def target_only_s(self, sessions: int) -> float:
            return 0.125 * sessions

    lm = LM.load(model_dir("target"), "cpu", "float32")
    eng = Scheduler(lm, max_sessions=4)
    measured = eng.cost
    for k in range(40):  # back-to-back passes whose seconds grow with their rows: a busy verifier, rows that cost
        rows = 1 + k % 9
        measured.observe(rows, 1, 2, 0.001 + 0.0005 * rows, k * 0.01)
    eng.cost = Fixed()

    async def go():
        server = grpc.aio.server()
        pb_grpc.add_VerifyServicer_to_server(VerifyServicer(eng), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.VerifyStub(ch)
                fp = (await stub.Info(pb.InfoRequest())).vocab_fingerprint
                call = stub.Session(timeout=30)
                await call.write(pb.VerifyRequest(start=pb.SessionStart(prompt_ids=[3, 4], max_new_tokens=8, vocab_fingerprint=fp,
                                                                        proposal_mode=pb.PROPOSAL_MODE_GREEDY)))
                await call.write(pb.VerifyRequest(round=pb.Round(round=1, tokens=[5, 6])))
                verdict = await call.read()
                call.cancel()
                return verdict
        finally:
            await server.stop(None)

    try:
        verdict = asyncio.run(go())
    finally:
        eng.shutdown()
    assert (verdict.row_cost_s, verdict.row_price, verdict.target_only_s) == (0.25, 0.5, 0.125)
    clock = [0.0]  # the scrape's clock, once the scheduler thread (the other reader of scheduler.time) has stopped
    monkeypatch.setattr(scheduler, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    last_end = 39 * 0.01 + 0.001 + 0.0005 * (1 + 39 % 9)

    def scrape(at: float) -> tuple[float, float]:
        clock[0] = at
        return (REGISTRY.get_sample_value("specdec_verify_row_price"),
                REGISTRY.get_sample_value("specdec_verify_pass_utilisation"))

    (fresh, busy), (stale, idle) = scrape(last_end), scrape(last_end + 10.0)
    assert measured.per_row_s > 0 and fresh == pytest.approx(measured.price, rel=0.1) and 0.2 < busy <= 1
    assert stale < 0.05 * fresh and idle < 0.05


def test_a_pass_takes_rounds_in_arrival_order_within_its_row_bound(model_dir, monkeypatch):
    """Fairness: with room for 12 rows per pass, four rounds of 5 rows go two by two, in the
    order they arrived: no pass exceeds the bound and none is overtaken."""
    import verify_service.scheduler as scheduler

    torch.set_num_threads(1)
    lm = LM.load(model_dir("target"), "cpu", "float32")
    passes = []

    def recorded(inputs, caches, logits=True, **kw):
        passes.append((len(inputs), sum(len(x) for x in inputs), list(caches)))
        return real(inputs, caches, logits, **kw)

    real = lm.engine.forward
    eng = scheduler.Scheduler(lm, max_sessions=8, max_pass_rows=12)
    monkeypatch.setattr(lm.engine, "forward", recorded)

    async def run():
        ss = [eng.open([3, 4, 5 + i], 20, Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY) for i in range(4)]
        for s in ss:
            await eng.prefill(s)
        passes.clear()
        await asyncio.gather(*(eng.step(s, [6, 7, 8, 9], None) for s in ss))
        return ss

    try:
        ss = asyncio.run(run())
    finally:
        eng.shutdown()
    order = [ss.index(next(s for s in ss if s.cache is c)) for _, _, caches in passes for c in caches]
    assert order == [0, 1, 2, 3], order  # arrival order, across passes
    assert all(rows <= 12 for _, rows, _ in passes) and len(passes) >= 2, passes


@pytest.mark.parametrize("prefill_rows, split", [(None, [5, 1]), (360, [6])])
def test_prompt_chunks_per_pass_follow_the_prefill_row_bound(model_dir, monkeypatch, prefill_rows, split):
    """Admission: queued prompts of 59 rows each go into a pass while their rows fit the prefill
    bound (on the CPU by default the rounds' bound, here 300 rows: five, then one; with
    max_prefill_rows=360: all six). The first pass is held until all six have queued."""
    import threading

    import verify_service.scheduler as scheduler

    torch.set_num_threads(1)
    lm = LM.load(model_dir("target"), "cpu", "float32")
    passes, started, go = [], threading.Event(), threading.Event()

    def recorded(inputs, caches, logits=True, **kw):
        started.set()
        go.wait(30)
        passes.append([len(x) for x in inputs])
        return real(inputs, caches, logits, **kw)

    real = lm.engine.forward
    eng = scheduler.Scheduler(lm, max_sessions=8, max_pass_rows=300, max_prefill_rows=prefill_rows)
    assert eng.max_prefill_rows == (prefill_rows or 300)
    monkeypatch.setattr(lm.engine, "forward", recorded)

    async def run():
        first = eng.open([3] * 20, 4, Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)
        held = asyncio.ensure_future(eng.prefill(first))
        for _ in range(300):  # until its pass is running, held
            if started.is_set():
                break
            await asyncio.sleep(0.01)
        ss = [eng.open([3 + i % 10] * 60, 4, Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY) for i in range(6)]
        rest = asyncio.gather(*(eng.prefill(s) for s in ss))
        await asyncio.sleep(0.2)  # every prefill queued behind the held pass
        go.set()
        await held
        await rest
        return ss

    try:
        ss = asyncio.run(run())
    finally:
        eng.shutdown()
    assert all(s.cache.length == 59 for s in ss)
    assert passes == [[19]] + [[59] * n for n in split], passes


def test_the_draft_counts_its_paces_comparisons_by_load(services):
    """Through real services (the target as its own draft: every proposal accepted), one adaptive
    request at a time (the pace steers adaptive taus): once the pace's window holds its rounds (8, and 0.5 s of them) it compares
    speculation with the verifier's target-only quote, and the draft's metrics count the
    comparison by the verifier's load (its one open session: "1") and outcome (which one depends
    on this machine's timing: the draft is as large as the target)."""
    v, d = services("long-target", "long-target")

    def counted(outcome: str, load: str = "1") -> float:
        return metric(d.metrics(), "specdec_draft_pace_comparisons_total", load=load, outcome=outcome)

    made = 0
    with Client(d.address, timeout=60) as c:
        while counted("won") + counted("lost") == 0 and made < 20:  # bounded: a few requests' rounds make up a window
            assert len(c.generate(prompt_ids=[3, 4, 5, 6], max_new_tokens=200, adaptive=True).token_ids) == 200
            made += 1
    assert counted("won") + counted("lost") >= 1, f"after {made} requests"
    assert counted("won", load="2-3") == counted("lost", load="2-3") == 0  # no other load was seen


def test_a_pass_of_prompt_chunks_alone_counts_as_busy(model_dir):
    """A verifier that only prefills (a burst of long prompts, no rounds yet) is busy: its passes
    go into the forward histogram (the KEDA trigger's pass utilisation) and the cost model, whose
    utilisation gauge then reads above 0 (before the fix, such passes were not observed at all)."""
    from prometheus_client import REGISTRY

    import verify_service.scheduler as scheduler

    torch.set_num_threads(1)
    lm = LM.load(model_dir("long-target"), "cpu", "float32")
    eng = scheduler.Scheduler(lm, max_sessions=2)
    count = lambda: REGISTRY.get_sample_value("specdec_verify_forward_seconds_count") or 0.0  # noqa: E731
    before = count()
    assert eng.cost.utilisation_at(1e9) == 0.0

    async def run():
        s = eng.open([3 + i % 10 for i in range(3 * 256 + 1)], 4, Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)
        await eng.prefill(s)  # three chunks, three passes, no round
        eng.close(s)

    try:
        asyncio.run(run())
        assert count() - before == 3
        assert REGISTRY.get_sample_value("specdec_verify_pass_utilisation") > 0
    finally:
        eng.shutdown()


def test_the_cost_model_counts_the_tokens_a_pass_commits(model_dir):
    """A round cut by max_new_tokens commits fewer tokens than its accepted proposals plus one:
    the cost model's tokens (its tokens_per_s) count what was committed (it counted n + 1)."""
    import verify_service.scheduler as scheduler
    from specdec.errors import Finish

    class Recorder:  # the cost model's inputs, as the scheduler reports them
        per_row_s = price = 0.0

        def __init__(self):
            self.tokens = []

        def observe(self, rows, sessions, tokens, seconds, start) -> None:
            self.tokens.append(tokens)

    torch.set_num_threads(1)
    lm = LM.load(model_dir("target"), "cpu", "float32")
    eng = scheduler.Scheduler(lm, max_sessions=2, forced_acceptance=lambda s, tau: tau)  # every proposal accepted
    eng.cost = Recorder()

    async def run():
        s = eng.open([3, 4, 5], 7, Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)
        await eng.prefill(s)
        try:
            first = await eng.step(s, [6, 7, 8, 9], None)  # 4 accepted + the target's token: 5 of 7
            last = await eng.step(s, [6, 7, 8, 9], None)  # 2 left: cut at max_new_tokens
            return first, last
        finally:
            eng.close(s)

    try:
        first, last = asyncio.run(run())
    finally:
        eng.shutdown()
    assert first.num_accepted == 4 and last.finish == Finish.LENGTH and last.num_accepted + (last.next_token is not None) == 2
    assert eng.cost.tokens[-2:] == [5, 2], eng.cost.tokens
