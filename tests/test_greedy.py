"""Greedy speculative output equals the target's own greedy output, token for token."""
import grpc
import pytest

from client import Client
from helpers.greedy import hf_greedy, prompts
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc


@pytest.mark.parametrize("draft", ["draft", "target"])  # a different draft, and a perfect one (all accepted)
@pytest.mark.parametrize("tau", [1, 2, 3, 5, 8])
def test_greedy_equals_target_generate(services, target, draft, tau):
    _, d = services("target", draft)
    with Client(d.address, timeout=60) as c:
        for i, prompt in enumerate(prompts(6, seed=tau)):
            n = [1, 7, 20, 33, 12, 5][i]
            r = c.generate(prompt_ids=prompt, max_new_tokens=n, num_draft_tokens=tau)
            assert r.token_ids == hf_greedy(target, prompt, n), (prompt, n, r.stats)
            if draft == "target" and r.finish_reason != "eos":  # proposals after EOS are dropped
                assert r.stats["accepted"] == r.stats["drafted"]


def test_eos_inside_a_proposal_ends_the_sequence(services, target):
    """With the target as its own draft, EOS is proposed; nothing after it is emitted."""
    _, d = services("target", "target")
    hits = 0
    with Client(d.address, timeout=60) as c:
        for prompt in prompts(40, seed=99):
            ref = hf_greedy(target, prompt, 40)
            if 0 not in ref:
                continue
            hits += 1
            r = c.generate(prompt_ids=prompt, max_new_tokens=40, num_draft_tokens=8)
            assert r.token_ids == ref[: ref.index(0) + 1] and r.finish_reason == "eos"
    assert hits >= 2, "need prompts whose greedy continuation contains EOS"


def test_target_only_generation_equals_target_generate(services, target):
    v, _ = services("target", "draft")
    with Client(v.address, target_only=True, timeout=60) as c:
        for prompt in prompts(5, seed=5):
            assert c.generate(prompt_ids=prompt, max_new_tokens=15).token_ids == hf_greedy(target, prompt, 15)


def test_prompt_at_the_context_limit(services, target):
    _, d = services("target", "draft")
    ctx = target.config.max_position_embeddings
    prompt = prompts(1, seed=3, max_len=1)[0] * (ctx - 1)
    with Client(d.address, timeout=60) as c:
        r = c.generate(prompt_ids=prompt, max_new_tokens=10, num_draft_tokens=4)
        assert r.token_ids == hf_greedy(target, prompt, 1)
        assert r.finish_reason in ("context", "eos")
        with pytest.raises(grpc.RpcError) as e:
            c.generate(prompt_ids=prompt + [3], max_new_tokens=1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context limit" in e.value.details()


def session(address, start, rounds):
    """Drives Verify.Session by hand: returns the verdicts."""
    with grpc.insecure_channel(address) as ch:
        msgs = [pb.VerifyRequest(start=start)] + [pb.VerifyRequest(round=pb.Round(round=i + 1, tokens=t)) for i, t in enumerate(rounds)]
        return list(pb_grpc.VerifyStub(ch).Session(iter(msgs), timeout=30))


def test_verify_truncates_a_round_at_max_new_tokens(services, target):
    """Proposals beyond max_new_tokens are never emitted: verify stops mid-round with LENGTH."""
    v, _ = services("target", "draft")
    with grpc.insecure_channel(v.address) as ch:
        fp = pb_grpc.VerifyStub(ch).Info(pb.InfoRequest()).vocab_fingerprint
    prompt = [3, 4, 5]
    ref = hf_greedy(target, prompt, 10)
    start = pb.SessionStart(prompt_ids=prompt, max_new_tokens=3, vocab_fingerprint=fp, proposal_mode=pb.PROPOSAL_MODE_GREEDY)
    (verdict,) = session(v.address, start, [ref[:6]])  # 6 correct proposals, only 3 allowed
    assert verdict.num_accepted == 3 and not verdict.HasField("next_token")
    assert verdict.finish_reason == pb.FINISH_REASON_LENGTH
