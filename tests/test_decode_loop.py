"""The draft's decode loop (draft_service/decode.py) run in-process, on real tiny models.

Against an in-process greedy verifier (the target's argmax over the whole sequence, no cache, the
greedy acceptance rule and the verifier's end rules), greedy output must equal the target's own
generate() with every proposer and feature. Against a real verify service over gRPC, the loop
must give what the draft service gives for the same request and seed."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import threading

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from client import Client
from specdec.costmodel import Costs
from specdec.engine import PREFILL_CHUNK
from draft_service import decode
from draft_service.decode import DecodeLoop
from draft_service.drafter import CHOICES, Drafter, Gone, PredraftControl
from specdec.errors import Refusal, RequestError
from specdec.lm import LM
from specdec.validation import parse_generate
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from helpers.greedy import hf_greedy, prompts

EOS = 0


@pytest.fixture(scope="module")
def drafters(model_dir):
    """name -> Drafter over that model, loaded in this process."""
    made = {}

    def get(name: str) -> Drafter:
        if name not in made:
            made[name] = Drafter(LM.load(model_dir(name)))
        return made[name]

    return get


class GreedyVerifier:
    """An in-process stand-in for the verifier's end of a Verify.Session at temperature 0.

    Each round: the target's argmax after every prefix of [committed ids + proposals] (one plain
    forward over the whole sequence), the greedy acceptance rule (accept while a proposal is the
    argmax; the next token is the argmax at the first miss, or the bonus), then the verifier's end
    rules (EOS, max_new_tokens, context) applied token by token. It also checks what the loop
    sends: rounds numbered 1, 2, ..., ids-only proposals, never more than fit (a tree: no deeper
    than the tokens left allow, no more nodes than SessionStart.tree_budget reserved)."""

    def __init__(self, model, max_context: int):
        self.model, self.max_context = model, max_context
        self.verdicts: list = []
        self.rounds = 0
        self.finished = False

    async def write(self, req: pb.VerifyRequest) -> None:
        if req.WhichOneof("kind") == "start":
            st = req.start
            assert st.proposal_mode == pb.PROPOSAL_MODE_GREEDY and st.sampling.temperature == 0
            self.ids, self.prompt_len, self.max_new = list(st.prompt_ids), len(st.prompt_ids), st.max_new_tokens
            self.tree_budget = st.tree_budget
            return
        r = req.round
        assert not self.finished, "a round after the session finished"
        self.rounds += 1
        assert r.round == self.rounds
        assert not (r.q_counts or r.q_ids or r.q_probs), "greedy mode sends ids only"
        tokens = list(r.tokens)
        generated = len(self.ids) - self.prompt_len
        parents = list(r.parents)
        depth = []
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        assert max(depth, default=len(tokens)) <= self.max_new - generated - 1 and len(self.ids) + len(tokens) <= self.max_context
        assert len(tokens) <= (self.tree_budget if parents else self.max_new - generated - 1)
        if parents:  # a tree: walk the argmax branch (the greedy tree rule)
            path, nxt = self._walk(tokens, parents)
            tokens, n = [tokens[m] for m in path], len(path)
            best = tokens + [nxt]
        else:
            path = None
            with torch.no_grad():
                logits = self.model(torch.tensor([self.ids + tokens])).logits[0]
            best = logits[len(self.ids) - 1:].argmax(-1).tolist()  # [tau + 1]
            n = next((i for i, t in enumerate(tokens) if t != best[i]), len(tokens))
        out, finish = [], pb.FINISH_REASON_UNSPECIFIED
        for t in tokens[:n] + [best[n]]:
            out.append(t)
            if t == EOS:
                finish = pb.FINISH_REASON_EOS
            elif generated + len(out) >= self.max_new:
                finish = pb.FINISH_REASON_LENGTH
            elif len(self.ids) + len(out) >= self.max_context:
                finish = pb.FINISH_REASON_CONTEXT
            if finish:
                break
        self.ids += out
        self.finished = bool(finish)
        self.verdicts.append(pb.VerifyResponse(round=r.round, num_accepted=min(n, len(out)),
                                               next_token=out[n] if len(out) > n else None, finish_reason=finish,
                                               accepted_path=path[: min(n, len(out))] if path is not None else []))

    def _walk(self, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
        """From the root, the child that is the target's argmax after its branch, while there is one:
        (the accepted nodes, the target's next token after them)."""
        path, at = [], -1
        while True:
            with torch.no_grad():
                nxt = int(self.model(torch.tensor([self.ids + [tokens[m] for m in path]])).logits[0, -1].argmax())
            at = next((m for m in range(len(tokens)) if parents[m] == at and tokens[m] == nxt), None)
            if at is None:
                return path, nxt
            path.append(at)

    async def read(self):
        return self.verdicts.pop(0) if self.verdicts else grpc.aio.EOF


def request(drafter: Drafter, max_context: int | None = None, **fields):
    """The request's GenParams, validated as the draft service validates them."""
    lm = drafter.lm
    return parse_generate(pb.GenerateRequest(**fields), lm.tokenizer, lm.vocab_size, max_context or lm.max_context)


async def until(condition, what: str, timeout_s: float = 30.0) -> None:
    """Polls `condition` on the event loop until it holds; fails the test after timeout_s."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"no {what} within {timeout_s:g} s")


async def run(loop: DecodeLoop, call) -> tuple[list[int], int]:
    ids, finish = [], pb.FINISH_REASON_UNSPECIFIED
    async with contextlib.aclosing(loop.rounds(call)) as rounds:
        async for new, finish in rounds:
            ids += new
    return ids, finish


FEATURES = [
    dict(),
    dict(predraft=True),
    dict(adaptive=True),
    dict(predraft=True, adaptive=True),
    dict(early_stop_p=0.5),
    dict(proposer=pb.PROPOSER_LOOKUP),
    dict(proposer=pb.PROPOSER_HYBRID, predraft=True),
    dict(tree_budget=8),
    dict(tree_budget=8, predraft=True, adaptive=True),
]


@pytest.mark.parametrize("draft", ["draft", "target"])  # a different draft, and a perfect one
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "plain")
def test_greedy_loop_equals_target_generate(drafters, target, draft, features):
    d = drafters(draft)
    predraft, adaptive = features.pop("predraft", False), features.pop("adaptive", False)
    hits = trees = 0
    for i, prompt in enumerate(prompts(6, seed=5)):
        n = [1, 4, 9, 20, 33, 40][i]
        g = request(d, prompt_ids=prompt, max_new_tokens=n, num_draft_tokens=4, **features)
        loop = DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context, costs=Costs(0.002, 0.01, 0.0005) if adaptive else None, predraft=predraft)
        verifier = GreedyVerifier(target, d.lm.max_context)
        ids, finish = asyncio.run(run(loop, verifier))
        ref = hf_greedy(target, prompt, n)
        assert ids == ref, (prompt, n, loop.stats)
        assert finish == (pb.FINISH_REASON_EOS if ref[-1] == EOS else pb.FINISH_REASON_LENGTH)
        s = loop.summary()
        assert s.rounds == verifier.rounds and s.accepted <= s.drafted
        assert sum(s.accepted_per_position) == s.accepted
        assert s.acceptance_rate == (s.accepted / s.drafted if s.drafted else 0.0)
        assert s.rounds <= len(ids) <= s.accepted + s.rounds  # each round commits >= 1 token, at most its accepted + 1
        hits += s.predraft_hits
        trees += s.tree_rounds
        if features.get("proposer") == pb.PROPOSER_LOOKUP:
            # every round is lookup's; one that found nothing is a target-only round, not a lookup round
            assert s.lookup_rounds + s.target_only_rounds == s.rounds and s.predraft_hits == s.predraft_misses == 0
        if draft == "target" and finish != pb.FINISH_REASON_EOS and not features:
            assert s.accepted == s.drafted  # a perfect draft is always accepted
        if adaptive and s.tree_rounds:  # tree rounds feed the tau controller: their likeliest path, as a chain
            assert loop.tau.trials > 0
    assert (trees > 0) == ("tree_budget" in features)
    if predraft and draft == "target" and "proposer" not in features and "tree_budget" not in features:
        assert hits > 0, "a perfect draft must hit its pre-drafts"


@pytest.mark.parametrize("predraft,stop", [(True, False), (False, False), (True, True)], ids=["predraft", "no-predraft", "stop-strings"])
def test_the_next_round_is_on_its_way_when_the_caller_gets_a_verdicts_tokens(drafters, target, monkeypatch, predraft, stop):
    """The caller's work on a verdict's tokens (its write to its client) overlaps the next round:
    when it gets them, the next round is written where its proposal was ready (a pre-draft that
    came true), else its drafting has started in its thread. The last verdict has no next round.
    A request with stop strings gets them before anything is written: the caller may end it there."""
    d = drafters("target")  # a perfect draft: its pre-drafts come true
    prompt, ref = next((p, r) for p in prompts(8, seed=5) if EOS not in (r := hf_greedy(target, p, 30)))  # 30 tokens: several rounds
    g = request(d, prompt_ids=prompt, max_new_tokens=30, num_draft_tokens=3, stop=["never in the text"] if stop else [])
    loop = DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context, predraft=predraft)
    verifier = GreedyVerifier(target, d.lm.max_context)
    threads = []  # (what a thread was started for, the rounds sent by then)
    real = decode.started

    def spy(fn, *args):
        threads.append((fn.__name__, loop.stats.rounds))
        return real(fn, *args)

    monkeypatch.setattr(decode, "started", spy)

    async def go():
        seen, ids = [], []
        async with contextlib.aclosing(loop.rounds(verifier)) as rounds:
            async for new, finish in rounds:
                ids += new
                seen.append((verifier.rounds, threads[-1], finish))
        return seen, ids

    seen, ids = asyncio.run(go())
    assert ids == ref
    written = 0
    for k, (sent, (fn, rounds), finish) in enumerate(seen, 1):
        if finish:
            assert k == len(seen) and sent == k
        elif sent == k + 1:  # written: a pre-draft's round
            written += 1
        elif not stop:
            assert sent == k and (fn, rounds) == ("propose", k), "the next round's drafting is not under way"
        else:
            assert sent == k
    assert (written > 0) == (predraft and not stop)  # a perfect draft's pre-drafts come true
    assert loop.stats.predraft_hits > 0 or not predraft


def test_a_greedy_predraft_prepares_each_rejection_with_the_drafts_next_choices(model_dir):
    """A greedy chain's pre-draft prepares, besides "all accepted, then the draft's argmax", each
    outcome "the first j accepted, then one of the draft's next CHOICES choices at j", in one tree pass a step:
    each prepared round is the round the draft proposes afresh after that outcome; afterwards the
    cache holds the context and the sent tokens. The verdict picks its outcome, or stops the rest."""
    d = Drafter(LM.load(model_dir("draft")))  # its own: no other test's sessions share its model
    prompt = prompts(1, seed=9)[0]
    g = request(d, prompt_ids=prompt, max_new_tokens=40, num_draft_tokens=4)
    st = d.new_state(g)
    d.prefill(st)
    sent = d.propose(st, 4)
    assert len(sent.tokens) == len(sent.alts) == 4 and all(len(a) == CHOICES and x not in a for a, x in zip(sent.alts, sent.tokens))
    ctl = PredraftControl()
    ahead = d.predraft(st, sent, 4, ctl)
    guess = next(c for n, c in ahead if n == 4)
    assert set(ahead) == ctl.wanted == {(4, guess)} | {(j, a) for j, alts in enumerate(sent.alts) for a in alts}
    assert st.cache.length == len(prompt) + 4 and st.cached == prompt + sent.tokens
    for (n, c), prop in ahead.items():
        fresh = d.new_state(request(d, prompt_ids=prompt + sent.tokens[:n] + [c], max_new_tokens=40, num_draft_tokens=4))
        d.prefill(fresh)
        want = d.propose(fresh, 4)
        assert (prop.tokens, prop.alts) == (want.tokens, want.alts), (n, c)
    told = PredraftControl()
    told.verdict((1, sent.alts[1][-1]))  # the verdict is in before the pre-draft starts: only its outcome runs on
    only = d.predraft(st, sent, 4, told)
    assert told.outcome() == (1, sent.alts[1][-1]) and not told.is_set()
    assert only[1, sent.alts[1][-1]].tokens == ahead[1, sent.alts[1][-1]].tokens
    assert all(not p.tokens for o, p in only.items() if o != (1, sent.alts[1][-1]))  # the others took no step
    missed = PredraftControl()
    missed.verdict((2, -1))  # an outcome no pre-draft prepared
    assert all(not p.tokens for p in d.predraft(st, sent, 4, missed).values()) and missed.is_set() and missed.outcome() is None


def test_a_greedy_tree_predraft_prepares_each_end_of_its_likeliest_path(model_dir):
    """A greedy tree's pre-draft prepares, besides "its likeliest path accepted, then the draft's
    argmax", each outcome "the path's first j nodes accepted, then the draft's best token there that
    the round did not send" (`alts`), every outcome's tree grown level by level in one pass a level:
    each prepared tree is the tree the draft grows afresh after that outcome; afterwards the cache
    holds the context and the path. The verdict picks its outcome, or stops the rest."""
    d = Drafter(LM.load(model_dir("draft")))  # its own: no other test's sessions share its model
    prompt = prompts(1, seed=9)[0]
    g = request(d, prompt_ids=prompt, max_new_tokens=60, num_draft_tokens=4, tree_budget=8)
    st = d.new_state(g)
    d.prefill(st)
    sent = d.propose_tree(st, 8, 4)
    path = sent.assumed()
    assert len(sent.alts) == len(sent.guess) >= 2
    for j, alts in enumerate(sent.alts):  # never a token the round sends after path[:j]
        parent = sent.guess[j - 1] if j else -1
        assert not set(alts) & {x for x, p in zip(sent.tokens, sent.parents) if p == parent}
    ctl = PredraftControl()
    ahead = d.predraft(st, sent, 4, ctl, 8)
    guess = next(c for n, c in ahead if n == len(path))
    assert set(ahead) == ctl.wanted == {(len(path), guess)} | {(j, a) for j, alts in enumerate(sent.alts) for a in alts}
    assert st.cache.length == len(prompt) + len(path) and st.cached == prompt + path
    for (n, c), prop in ahead.items():
        fresh = d.new_state(request(d, prompt_ids=prompt + path[:n] + [c], max_new_tokens=60, num_draft_tokens=4, tree_budget=8))
        d.prefill(fresh)
        want = d.propose_tree(fresh, 8, 4)
        assert (prop.tokens, prop.parents, prop.guess, prop.alts) == (want.tokens, want.parents, want.guess, want.alts), (n, c)
    o = (1, sent.alts[1][0])
    told = PredraftControl()
    told.verdict(o)  # the verdict is in before the pre-draft starts: only its outcome grows past its first level
    only = d.predraft(st, sent, 4, told, 8)
    assert told.outcome() == o and not told.is_set() and only[o].tokens == ahead[o].tokens
    assert all(p == -1 for k in only if k != o for p in only[k].parents)  # the others: their roots' children only
    missed = PredraftControl()
    missed.verdict((1, -1))  # an outcome no pre-draft prepared
    assert all(not p.tokens for p in d.predraft(st, sent, 4, missed, 8).values()) and missed.is_set() and missed.outcome() is None
    assert st.cache.length == len(prompt) + len(path)


def test_a_shared_draft_model_prepares_one_outcome(model_dir):
    """While the draft model serves other sessions too (their decode loops run in the process), a
    pre-draft prepares only "all accepted, then the argmax": the model's steps are the sessions'."""
    d = Drafter(LM.load(model_dir("draft")))
    prompt = prompts(1, seed=9)[0]
    st = d.new_state(request(d, prompt_ids=prompt, max_new_tokens=40, num_draft_tokens=4))
    d.prefill(st)
    sent = d.propose(st, 4)
    with d.serving():
        assert not d.shared()
        with d.serving():  # a second session's loop
            assert d.shared()
            ctl = PredraftControl()
            one = d.predraft(st, sent, 4, ctl)
            assert len(one) == len(ctl.wanted) == 1 and next(iter(one))[0] == 4
        assert not d.shared()
        assert len(d.predraft(st, sent, 4, PredraftControl())) == 1 + len(sent.tokens)


def test_a_session_that_follows_the_load_predrafts_only_while_the_model_serves_it_alone(model_dir, target):
    """With pre-drafting on, a session whose taus follow the load (greedy, adaptive, goodput on)
    pre-drafts while its draft model serves it alone, and not while another session's loop runs
    on the same model: the model's spare steps are the other session's. With the load ignored
    (--no-goodput) it pre-drafts either way. Greedy output is the target's throughout."""
    from draft_service.adaptive import Pace

    d = Drafter(LM.load(model_dir("target")))  # a perfect draft, its own model: its pre-drafts hit
    prompt = prompts(1, seed=4)[0]
    ref = hf_greedy(target, prompt, 30)

    def session(goodput: bool) -> pb.Stats:
        g = request(d, prompt_ids=prompt, max_new_tokens=30, num_draft_tokens=4)
        loop = DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context, costs=Costs(0.002, 0.01, 0.0005), predraft=True,
                          goodput=goodput, pace=Pace())
        assert asyncio.run(run(loop, GreedyVerifier(target, d.lm.max_context)))[0] == ref
        return loop.summary()

    assert session(True).predraft_hits > 0
    with d.serving():  # another session's loop runs on the model
        s = session(True)
        assert s.predraft_hits == s.predraft_misses == 0 and s.rounds < 30
        assert session(False).predraft_hits > 0


def test_the_context_limit_ends_the_loop(drafters, model_dir):
    """A context limit below the models' (as when the target's is the smaller): the loop never
    proposes past it (the verifier checks) and ends with CONTEXT exactly at the limit."""
    long_target = AutoModelForCausalLM.from_pretrained(model_dir("long-target"), dtype=torch.float32).eval()  # no EOS bias
    d = drafters("long-draft")
    for prompt in prompts(3, seed=3):
        limit = len(prompt) + 7
        g = request(d, limit, prompt_ids=prompt, max_new_tokens=limit, num_draft_tokens=5)
        ids, finish = asyncio.run(run(DecodeLoop(d, g, d.lm.fingerprint, limit), GreedyVerifier(long_target, limit)))
        assert ids == hf_greedy(long_target, prompt, 7)
        assert finish == pb.FINISH_REASON_CONTEXT and len(prompt) + len(ids) == limit


def test_a_verifier_that_ends_the_stream_is_unavailable(drafters):
    class Silent:
        async def write(self, req):
            pass

        async def read(self):
            return grpc.aio.EOF

    d = drafters("draft")
    g = request(d, prompt_ids=[3, 4, 5], max_new_tokens=8, num_draft_tokens=3)
    with pytest.raises(RequestError) as e:
        asyncio.run(run(DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context, predraft=True), Silent()))
    assert e.value.kind == Refusal.UNAVAILABLE


def test_a_failure_after_a_verdict_gives_the_caller_its_tokens_first(drafters, target):
    """The verdict's tokens wait for the next round to be on its way; where that round's write
    fails, the caller still gets them before the error (a pre-drafted round is written before
    they are yielded; one drafted after the verdict, after)."""
    class Broken(GreedyVerifier):
        async def write(self, req):
            if req.WhichOneof("kind") == "round" and req.round.round == 2:
                raise RuntimeError("the stream broke")
            await super().write(req)

    d = drafters("target")
    prompt, ref = next((p, r) for p in prompts(8, seed=5) if EOS not in (r := hf_greedy(target, p, 30)))

    async def go(predraft):
        got = []
        loop = DecodeLoop(d, request(d, prompt_ids=prompt, max_new_tokens=30, num_draft_tokens=3), d.lm.fingerprint,
                          d.lm.max_context, predraft=predraft)
        with pytest.raises(RuntimeError, match="the stream broke"):
            async with contextlib.aclosing(loop.rounds(Broken(target, d.lm.max_context))) as rounds:
                async for new, _ in rounds:
                    got += new
        return got

    for predraft in (True, False):  # round 2 pre-drafted (written at once), or drafted after the verdict
        assert asyncio.run(go(predraft)) == ref[:4]  # round 1: three proposals accepted and the bonus token


def test_the_caller_may_stop_after_any_round(drafters, model_dir):
    """A stop string ends the request between rounds: closing the loop there ends it cleanly."""
    long_target = AutoModelForCausalLM.from_pretrained(model_dir("long-target"), dtype=torch.float32).eval()
    d = drafters("long-draft")

    async def two_rounds_only():
        g = request(d, prompt_ids=[3, 4, 5], max_new_tokens=40, num_draft_tokens=4)
        loop = DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context, predraft=True)
        verifier = GreedyVerifier(long_target, d.lm.max_context)
        got = []
        async with contextlib.aclosing(loop.rounds(verifier)) as rounds:
            async for new, finish in rounds:
                assert new and not finish
                got += new
                if loop.stats.rounds == 2:
                    break
        return loop, verifier, got

    loop, verifier, got = asyncio.run(two_rounds_only())
    assert loop.stats.rounds == verifier.rounds == 2
    assert got == hf_greedy(long_target, [3, 4, 5], len(got))


@pytest.mark.parametrize("fails", [False, True], ids=["predraft", "failing-predraft"])
def test_a_cancelled_round_stops_its_predraft(drafters, model_dir, monkeypatch, fails):
    """Cancelled while waiting for a verdict (the client went away): the pre-draft running in
    its thread is told to stop; the session counts as served until it has, and an error it ends
    with is taken (asyncio reports none as never retrieved)."""
    long_target = AutoModelForCausalLM.from_pretrained(model_dir("long-target"), dtype=torch.float32).eval()
    d = drafters("long-draft")
    controls = []
    predraft = d.predraft

    release, ended = threading.Event(), []

    def spy(st, sent, tau, ctl):
        controls.append(ctl)
        try:
            out = predraft(st, sent, tau, ctl)
            release.wait(30)  # a long last step: it ends after the loop has
            if fails:
                raise RuntimeError("a pre-draft that fails")
            return out
        finally:
            ended.append(True)

    monkeypatch.setattr(d, "predraft", spy)

    class Hanging(GreedyVerifier):
        async def read(self):
            await asyncio.Event().wait()  # no verdict, ever

    async def cancel_mid_round():
        g = request(d, prompt_ids=[3, 4, 5], max_new_tokens=40, num_draft_tokens=4)
        loop = DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context, predraft=True)
        task = asyncio.create_task(run(loop, Hanging(long_target, d.lm.max_context)))
        await until(lambda: controls, "the pre-draft")
        assert not controls[0].is_set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert d.serving_now == 1 and not ended  # the loop is gone, its pre-draft still steps the model
        release.set()
        await until(lambda: ended and not d.serving_now, "the pre-draft's end")  # its task's done callback (which
        # takes its error) ends the serving: the task is done here

    reported = []
    with asyncio.Runner() as runner:
        runner.get_loop().set_exception_handler(lambda loop, context: reported.append(context))
        runner.run(cancel_mid_round())
        gc.collect()  # a task's unretrieved exception is reported when the task is collected
    assert len(controls) == 1 and controls[0].is_set()
    assert not reported


def test_a_cancel_during_the_drafts_prefill_stops_it_after_its_chunk(drafters, monkeypatch):
    """Cancelled while the draft prefills a long prompt in its thread (the client went away): the
    session counts as served until the thread returns (other sessions would otherwise pre-draft as
    if the model were theirs alone), and the thread stops after the chunk in flight instead of
    prefilling the rest of a prompt nobody waits for."""
    d = drafters("long-draft")
    forward, chunks, release = d.batcher.forward, [], threading.Event()

    def held(cache, tokens, logits=True):
        chunks.append(len(tokens))
        if len(chunks) == 1:
            release.wait(30)  # the first chunk is in flight when the cancel lands
        return forward(cache, tokens, logits)

    monkeypatch.setattr(d.batcher, "forward", held)

    async def cancel_mid_prefill():
        g = request(d, prompt_ids=[3 + i % 12 for i in range(4 * PREFILL_CHUNK + 1)], max_new_tokens=8)
        loop = DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context)
        task = asyncio.create_task(run(loop, GreedyVerifier(None, d.lm.max_context)))
        await until(lambda: chunks, "the prefill's first chunk")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert d.serving_now == 1  # the loop is gone, its prefill still holds the model
        release.set()
        await until(lambda: not d.serving_now, "the prefill's end")

    reported = []
    with asyncio.Runner() as runner:
        runner.get_loop().set_exception_handler(lambda loop, context: reported.append(context))
        runner.run(cancel_mid_prefill())
        gc.collect()
    assert chunks == [PREFILL_CHUNK]  # four chunks of prompt; the three after the cancel never ran
    assert not reported


def test_a_catch_up_after_a_run_stops_after_its_chunk_once_the_session_is_gone(drafters, monkeypatch):
    """A session that started in a run has nothing in the draft's cache: its first proposal feeds
    the whole prompt (Drafter._feed). If the session ends meanwhile (its loop sets st.gone), the
    feed stops after the chunk in flight, raises Gone (awaited by no one but the thread's end) and
    leaves the cache as it began; a session still there feeds the whole prompt and proposes."""
    d = drafters("long-draft")
    forward, chunks = d.batcher.forward, []
    prompt = [3 + i % 12 for i in range(4 * PREFILL_CHUNK + 1)]
    st = d.new_state(request(d, prompt_ids=prompt, max_new_tokens=8))

    def held(cache, tokens, logits=True):
        chunks.append(len(tokens))
        st.gone.set()  # the client leaves while the first chunk runs
        return forward(cache, tokens, logits)

    monkeypatch.setattr(d.batcher, "forward", held)
    with pytest.raises(Gone):
        d.propose(st, 4)
    assert chunks == [PREFILL_CHUNK] and st.cache.length == 0

    monkeypatch.setattr(d.batcher, "forward", forward)
    st = d.new_state(request(d, prompt_ids=prompt, max_new_tokens=8))
    assert len(d.propose(st, 4).tokens) == 4 and st.cache.length == len(prompt) + 3


def test_a_round_the_verifier_refuses_is_not_counted(drafters):
    """A full replica refuses the session after reading its first round (the draft then places it
    on another): that round was never verified, so specdec_draft_proposals_per_round has no
    observation of it."""
    from prometheus_client import REGISTRY

    d = drafters("long-draft")

    class Refusing(GreedyVerifier):
        async def write(self, req):
            pass  # takes the start and the first round

        async def read(self):
            raise RequestError(Refusal.RESOURCE_EXHAUSTED, "verify service is at its limit")

    def rounds_seen():
        return REGISTRY.get_sample_value("specdec_draft_proposals_per_round_count") or 0.0

    before = rounds_seen()
    g = request(d, prompt_ids=[3, 4, 5], max_new_tokens=8, num_draft_tokens=4)
    with pytest.raises(RequestError):
        asyncio.run(run(DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context), Refusing(None, d.lm.max_context)))
    assert rounds_seen() == before


def test_a_cancel_that_lands_as_a_verdict_arrives_ends_the_loop(drafters, model_dir):
    """The client goes away just as a verdict comes in (the task is cancelled in the same loop
    iteration as its read completes). The cancel ends the loop: Python 3.11's asyncio.wait_for
    returned the verdict and dropped the cancel, and the session ran on to max_new_tokens."""
    long_target = AutoModelForCausalLM.from_pretrained(model_dir("long-target"), dtype=torch.float32).eval()
    d = drafters("long-draft")

    class Racing(GreedyVerifier):
        held = None  # (the future the read waits on, the verdict it will get)

        async def read(self):
            v = await super().read()
            self.held = (asyncio.get_running_loop().create_future(), v)
            return await self.held[0]

    async def cancel_as_the_verdict_arrives():
        g = request(d, prompt_ids=[3, 4, 5], max_new_tokens=40, num_draft_tokens=4)
        loop = DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context, round_timeout_s=30.0)
        verifier = Racing(long_target, d.lm.max_context)
        task = asyncio.create_task(run(loop, verifier))
        await until(lambda: verifier.held is not None, "the first read")
        verifier.held[0].set_result(verifier.held[1])
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return loop, verifier

    loop, verifier = asyncio.run(cancel_as_the_verdict_arrives())
    assert loop.stats.rounds == verifier.rounds == 1


def test_loop_over_a_real_verify_service_equals_the_draft_service(services, drafters, target):
    """The same requests through the draft service and through the loop in this process, both
    against the same verify service: identical ids, in greedy and in seeded sampled modes."""
    v, dsvc = services("target", "draft")
    d = drafters("draft")
    cases = [
        dict(max_new_tokens=24, num_draft_tokens=4),
        dict(max_new_tokens=24, num_draft_tokens=3, sampling=pb.SamplingParams(temperature=1.0, seed=7)),
        dict(max_new_tokens=24, num_draft_tokens=3, proposal_mode=pb.PROPOSAL_MODE_DENSE,
             sampling=pb.SamplingParams(temperature=0.8, top_k=8, seed=11)),
        dict(max_new_tokens=24, num_draft_tokens=2, proposal_mode=pb.PROPOSAL_MODE_SPARSE, sparse_k=4,
             sampling=pb.SamplingParams(temperature=1.0, top_p=0.9, seed=3)),
    ]

    async def through_loop(prompt, case):
        g = request(d, prompt_ids=prompt, **case)
        loop = DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context)
        async with grpc.aio.insecure_channel(v.address) as ch:
            call = pb_grpc.VerifyStub(ch).Session(timeout=60)
            try:
                return await run(loop, call)
            finally:
                call.cancel()

    with Client(dsvc.address, timeout=60) as c:
        for prompt in prompts(3, seed=21):
            for case in cases:
                ids, finish = asyncio.run(through_loop(prompt, case))
                r = c.generate(pb.GenerateRequest(prompt_ids=prompt, **case))
                assert ids == r.token_ids, (prompt, case)
                assert pb.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower() == r.finish_reason
                if "sampling" not in case:
                    assert ids == hf_greedy(target, prompt, case["max_new_tokens"])


def test_pre_drafting_leaves_a_seeded_requests_tokens_alone_at_fixed_tau(services, drafters):
    """DESIGN.md §3: with fixed tau, pre-drafting on and off give the same tokens. Two rounds used
    to differ (review of 2026-11-28): a pre-draft used where hybrid prompt lookup would have
    proposed (the lookup now wins, as without pre-drafting), and the judge's one-token first
    rounds, whose pre-draft of one token outlived that cap (no pre-draft while judging)."""
    d = drafters("draft")
    judged = Costs(0.0001, 0.05, 0.0001)  # the draft always pays: judged, never fallen back

    async def tokens(case, predraft, fallback=None, target="target"):
        v, _ = services(target, "draft")
        g = request(d, **case)
        loop = DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context, predraft=predraft, fallback=fallback)
        async with grpc.aio.insecure_channel(v.address) as ch:
            call = pb_grpc.VerifyStub(ch).Session(timeout=60)
            try:
                return (await run(loop, call))[0], loop.stats.predraft_hits + loop.stats.predraft_misses
            finally:
                call.cancel()

    hits = 0
    for seed in [111, *range(7)]:
        case = dict(prompt_ids=[3, 4, 5, 6, 3, 4, 8], max_new_tokens=40, num_draft_tokens=4, proposer=pb.PROPOSER_HYBRID,
                    sampling=pb.SamplingParams(temperature=1.0, seed=seed))
        (off, _), (on, used) = asyncio.run(tokens(case, False)), asyncio.run(tokens(case, True))
        assert on == off, ("hybrid", seed)
        hits += used
    for i in range(16):  # against the draft model itself: its first proposals are accepted, and pre-drafts used
        case = dict(prompt_ids=[3 + i % 10, 4, 5], max_new_tokens=30, num_draft_tokens=4, proposer=pb.PROPOSER_DRAFT,
                    sampling=pb.SamplingParams(temperature=0.5, seed=700 + i))
        (off, _), (on, used) = asyncio.run(tokens(case, False, judged, "draft")), asyncio.run(tokens(case, True, judged, "draft"))
        assert on == off, ("judged", i)
        hits += used
    assert hits > 0  # pre-drafts were made and judged against the verdicts


def test_a_lookup_proposal_takes_the_request_cap_not_the_draft_models_tau(drafters):
    """Prompt lookup costs no draft steps, so a hybrid round that finds a match proposes up to
    num_draft_tokens, whatever tau adaptive tau chose for the draft model; without a match the
    draft model proposes exactly that tau."""
    d = drafters("draft")
    repeating = list(range(3, 12)) * 2 + [3, 4]  # the last 2-gram recurs: lookup continues 5, 6, ...
    g = request(d, prompt_ids=repeating, max_new_tokens=30, num_draft_tokens=8, proposer=pb.PROPOSER_HYBRID)
    prop = DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context).propose(2)
    assert prop.lookup and prop.tokens == [5, 6, 7, 8, 9, 10, 11, 3], prop.tokens
    g = request(d, prompt_ids=list(range(1, 16)), max_new_tokens=30, num_draft_tokens=8, proposer=pb.PROPOSER_HYBRID)
    prop = DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context).propose(2)
    assert not prop.lookup and len(prop.tokens) == 2


def test_a_runs_first_verdict_waits_one_round_timeout_not_one_per_step_of_a_verdict(drafters):
    """A run's verdicts after the first answer up to run_tokens steps each (a pass apiece), so
    each waits that many round timeouts; the first answers one step, and waited as long too: a hung
    verifier held a session that starts a run 16 round timeouts (--run-tokens-per-verdict 16) where
    the contract is one per write or verdict (one per prefill chunk for a request's first)."""
    d = drafters("long-draft")

    class Hung:  # answers the first `answers` verdicts of a run, then nothing (a stopped verifier)
        def __init__(self, answers: int):
            self.answers = answers

        async def write(self, req):
            pass

        async def read(self):
            if self.answers:
                self.answers -= 1
                return pb.VerifyResponse(next_token=5, steps_left=8)
            await asyncio.sleep(3600)

    async def ended(answers: int, rounds: int, prompt: int = 3) -> str:
        loop = DecodeLoop(d, request(d, prompt_ids=[3] * prompt, max_new_tokens=20), d.lm.fingerprint, d.lm.max_context,
                          round_timeout_s=0.05, run_tokens=16)
        loop.stats.rounds = rounds
        with pytest.raises(RequestError) as e:
            async for _ in loop._run(Hung(answers), 8):
                pass
        assert e.value.kind == Refusal.UNAVAILABLE
        return e.value.message

    assert "nothing for 0.05s in a round" in asyncio.run(ended(0, rounds=3))  # the run's first verdict: one step
    assert "nothing for 0.8s in a round" in asyncio.run(ended(1, rounds=3))  # a later one: up to 16 steps
    first = 1 + (PREFILL_CHUNK + 1) // PREFILL_CHUNK  # a request's first verdict also waits for its prefill's chunks
    assert f"nothing for {first * 0.05:g}s in a round" in asyncio.run(ended(0, rounds=0, prompt=PREFILL_CHUNK + 1))


@pytest.mark.parametrize("proposer", [pb.PROPOSER_LOOKUP, pb.PROPOSER_HYBRID])
def test_a_priced_out_lookup_session_probes_like_a_drafting_one(drafters, proposer):
    """A session the verifier's price holds at no proposals proposes one token every
    PRICED_OUT_PROBE-th round, else its estimate would never move again (DESIGN §7). Prompt
    lookup took its cap from the price alone, so a --proposer lookup session's probes were empty
    rounds; a hybrid one probed with the model only."""
    from draft_service.adaptive import PRICED_OUT_PROBE

    d = drafters("draft")
    g = request(d, prompt_ids=[3, 4, 5, 6, 7] * 6, max_new_tokens=40, num_draft_tokens=8, proposer=proposer)  # lookup always matches
    loop = DecodeLoop(d, g, d.lm.fingerprint, d.lm.max_context, costs=Costs(0.001, 0.02, 0.0005))
    loop.tau.observe(drafted=1, accepted=0)  # its first proposal rejected: an estimate below...
    loop.tau.load(0.65)  # ...a steady price
    assert loop.tau.goodput_cap() == 0
    sent = []
    for _ in range(2 * PRICED_OUT_PROBE):
        tau = loop.tau.choose()
        prop = loop.propose(min(tau, loop.cap()))
        sent.append((tau, len(prop.tokens), prop.lookup))
    assert [(n, lookup) for tau, n, lookup in sent if tau] == [(1, True)] * 2  # each probe: one token, from lookup
    assert all(n == 0 for tau, n, _ in sent if not tau)
