"""Pre-drafting, adaptive tau and prompt lookup keep the output exact (greedy), and their
pure parts behave as specified."""
import pytest

from client import Client
from draft_service.adaptive import TauController
from draft_service.lookup import lookup
from test_greedy import hf_greedy, prompts, target  # noqa: F401 - fixture reused


@pytest.mark.parametrize("ids,tau,expected", [
    ([1, 2, 3, 9, 1, 2], 3, [3, 9, 1]),  # 2-gram [1, 2] seen before: continue after it
    ([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, [8, 1]),  # the most recent earlier match wins
    ([1, 2, 3, 4], 3, []),  # no repeat
    ([4, 4], 3, [4]),  # a 1-gram match, continuation cut at the end of the sequence
    ([3, 1, 2, 3, 1, 2], 0, []),  # tau = 0
    ([7, 8, 9, 5, 8, 9], 5, [5, 8, 9]),  # longest suffix first: [8, 9] -> [5, 8, 9]
])
def test_lookup_table(ids, tau, expected):
    assert lookup(ids, tau) == expected


def test_lookup_min_ngram():
    assert lookup([4, 1, 5, 1], 2, min_ngram=2) == []
    assert lookup([4, 1, 5, 1], 2, min_ngram=1) == [5, 1]


def test_tau_controller_follows_acceptance_and_costs():
    c = TauController(max_tau=8)
    assert c.choose() == 8  # no measurements yet: the maximum
    for _ in range(30):
        c.observe(drafted=8, accepted=8, draft_s=8 * 0.001, round_s=0.02)  # cheap draft, all accepted
    assert c.choose() == 8
    low = TauController(max_tau=8)
    for _ in range(30):
        low.observe(drafted=4, accepted=0, draft_s=4 * 0.01, round_s=0.02)  # costly draft, all rejected
    assert low.estimate() < 0.3 and low.choose() == 1
    # pipelined: drafting is hidden behind the round trip up to gamma * t_draft = t_round
    mid = TauController(max_tau=8)
    for _ in range(30):
        mid.observe(drafted=4, accepted=3, draft_s=4 * 0.005, round_s=0.02)
    assert mid.choose(pipelined=True) >= mid.choose(pipelined=False)


FEATURES = [
    dict(predraft=True),
    dict(predraft=True, adaptive=True),
    dict(adaptive=True, early_stop_p=0.5),
    dict(proposer="lookup"),
    dict(proposer="hybrid", predraft=True),
]


@pytest.mark.parametrize("draft", ["draft", "target"])
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_greedy_exact_with_every_feature(services, target, draft, features):  # noqa: F811
    _, d = services("target", draft)
    with Client(d.address, timeout=60) as c:
        hits = 0
        for i, prompt in enumerate(prompts(6, seed=11)):
            n = [3, 9, 20, 33, 14, 40][i]
            r = c.generate(prompt_ids=prompt, max_new_tokens=n, num_draft_tokens=4, **features)
            assert r.token_ids == hf_greedy(target, prompt, n), (prompt, n, r.stats)
            hits += r.stats["predraft_hits"]
            if features.get("proposer") == "lookup":
                assert r.stats["lookup_rounds"] == r.stats["rounds"]
        if features.get("predraft") and draft == "target" and "proposer" not in features:
            assert hits > 0, "a perfect draft must hit its pre-drafts"
