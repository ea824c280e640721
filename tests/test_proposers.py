"""Pre-drafting, adaptive tau and prompt lookup keep the output exact (greedy), and their
pure parts behave as specified."""
import random

import pytest

from client import Client
from draft_service.adaptive import TauController
from draft_service.drafter import shared_prefix
from specdec.costmodel import Costs
from draft_service.lookup import lookup
from helpers.greedy import hf_greedy, prompts


@pytest.mark.parametrize("ids,tau,expected", [
    ([1, 2, 3, 9, 1, 2], 3, [3, 9, 1]),  # 2-gram [1, 2] seen before: continue after it
    ([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, [8, 1]),  # the most recent earlier match wins
    ([1, 2, 3, 4], 3, []),  # no repeat
    ([4, 4], 3, [4, 4, 4]),  # a 1-gram match whose continuation reaches the end: run on (it was [4]: one token a round)
    ([3, 1, 2, 3, 1, 2], 0, []),  # tau = 0
    ([7, 8, 9, 5, 8, 9], 5, [5, 8, 9, 5, 8]),  # longest suffix first: [8, 9] -> [5, 8, 9], then on with period 3
    ([5] * 20, 8, [5] * 8),  # from a review: a run proposed one token a round whatever tau
    ([1, 2] * 10, 8, [1, 2] * 4),  # ... a period of 2, two
])
def test_lookup_table(ids, tau, expected):
    assert lookup(ids, tau) == expected


def test_lookup_min_ngram():
    assert lookup([4, 1, 5, 1], 2, min_ngram=2) == []
    assert lookup([4, 1, 5, 1], 2, min_ngram=1) == [5, 1]


def _scan_lookup(ids, tau, max_ngram, min_ngram, window):
    """The specification of lookup, as a plain scan (what it was before its search moved to str.rfind)."""
    seq = ids[max(0, len(ids) - window):]
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        for start in range(len(seq) - n - 1, -1, -1):
            if tau > 0 and seq[start:start + n] == seq[-n:]:
                out = []
                for i in range(start + n, start + n + tau):
                    out.append(seq[i] if i < len(seq) else out[i - len(seq)])
                return out
    return []


def test_lookup_matches_a_plain_scan():
    """Random sequences over small alphabets (many matches, periodic runs) and ids at the ends of
    the code-point range (0xD800 starts the surrogates, 0x10FFFF is the last): the rfind search
    proposes what the scan does; an id past the range proposes nothing rather than raising."""
    rng = random.Random(7)
    for _ in range(3000):
        alphabet = rng.choice([[0, 1], [0, 1, 2], list(range(7)), [0xD7FF, 0xD800, 0xDFFF, 0x10FFFF]])
        ids = [rng.choice(alphabet) for _ in range(rng.randrange(60))]
        max_ngram = rng.randrange(1, 5)
        args = (rng.randrange(10), max_ngram, rng.randrange(1, max_ngram + 1), rng.choice([4096, 12, 3]))
        assert lookup(ids, *args) == _scan_lookup(ids, *args), (ids, args)
    assert lookup([0x110000, 1, 0x110000, 1], 2) == []


def test_shared_prefix_matches_a_plain_scan():
    """drafter.shared_prefix (how much of its cache a draft keeps) against a scan from the start:
    equal prefixes, a divergence anywhere, a limit below either length."""
    rng = random.Random(11)
    for _ in range(3000):
        a = [rng.randrange(3) for _ in range(rng.randrange(80))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(12))]
        limit = rng.randrange(min(len(a), len(b)) + 1)
        keep = 0
        while keep < limit and a[keep] == b[keep]:
            keep += 1
        assert shared_prefix(a, b, limit) == keep, (a, b, limit)


def test_tau_controller_follows_acceptance_and_costs():
    cheap = Costs(draft_step=0.001, verify_base=0.02, verify_per_token=0.0005)
    c = TauController(max_tau=8, costs=cheap)
    for _ in range(30):
        c.observe(drafted=8, accepted=8)  # cheap draft, all accepted
    assert c.choose() == 8
    low = TauController(max_tau=8, costs=Costs(0.01, 0.02, 0.001))
    for _ in range(30):
        low.observe(drafted=4, accepted=0)  # costly draft, all rejected
    assert low.estimate() < 0.3 and low.choose() == 1
    # pre-drafting hides drafting behind the round trip: it never wants a shorter round
    for alpha_obs in (1, 2, 3):
        a, b = (TauController(max_tau=8, costs=Costs(0.005, 0.02, 0.001), predraft=p) for p in (False, True))
        for ctl in (a, b):
            for _ in range(30):
                ctl.observe(drafted=4, accepted=alpha_obs)
        assert b.choose() >= a.choose()
    # a slower network (larger verify_base) favours longer rounds
    near, far = (TauController(max_tau=8, costs=Costs(0.005, base, 0.001)) for base in (0.01, 0.1))
    for ctl in (near, far):
        for _ in range(30):
            ctl.observe(drafted=4, accepted=3)
    assert far.choose() > near.choose()


def test_rounds_the_load_held_at_zero_keep_the_sessions_acceptance():
    """From a review: each round without proposals (the verifier's price held it at 0) decayed
    the session's acceptance back to the 0.7 prior, so under a steady price in [0.7, its real
    acceptance) a session that had measured 0.95 never proposed again, though a proposal paid."""
    c = TauController(max_tau=8, costs=Costs(0.001, 0.02, 0.0005))
    for _ in range(30):
        c.observe(drafted=4, accepted=4)
    learned = c.estimate()
    c.load(0.99)  # the verifier is busy: no proposal pays
    assert learned > 0.9 and c.choose() == 0
    for _ in range(100):
        c.observe(drafted=0, accepted=0)  # the target-only rounds the price held it to
    c.load(0.8)  # busy, but one proposal at 0.9+ acceptance pays
    assert c.estimate() == learned and c.choose() >= 1


def test_a_session_the_price_holds_at_no_proposals_probes_now_and_then():
    """From a review: a round without proposals teaches nothing, so a session whose estimate sat
    at or below a steady price (one that started inside a hold, at the 0.7 prior; one whose first
    proposal was rejected) never proposed again, whatever its draft could do. It proposes one
    token every PRICED_OUT_PROBE rounds, and a draft that is better than the price comes back."""
    from draft_service.adaptive import PRICED_OUT_PROBE

    c = TauController(max_tau=8, costs=Costs(0.001, 0.02, 0.0005))
    c.observe(drafted=1, accepted=0)  # its first proposal rejected: 0.62, below the price
    c.load(0.65)
    taus = []
    for _ in range(3 * PRICED_OUT_PROBE):
        taus.append(c.choose())
        c.observe(drafted=taus[-1], accepted=0)  # a draft worse than the price: it stays out but for the probes
    assert taus == ([0] * (PRICED_OUT_PROBE - 1) + [1]) * 3, taus
    for _ in range(20 * PRICED_OUT_PROBE):  # a draft that is in fact good: the probes find it out
        tau = c.choose()
        c.observe(drafted=tau, accepted=tau)
        if tau > 1:
            break
    assert tau > 1 and c.estimate() > 0.65
    c.load(0.0)
    assert c.choose() >= 1 and c.priced_out == 0


def test_tau_choice_reads_no_clock(monkeypatch):
    """Same history, same costs: same taus, however the rounds were timed (seeds reproduce). The
    second run has no clock to read: any read of one fails it (two runs back to back could not
    tell a controller that reads the time from one that does not)."""
    import time

    def run() -> list[int]:
        ctl = TauController(max_tau=8, costs=Costs(0.004, 0.03, 0.0008), predraft=True)
        taus = []
        for accepted in [4, 0, 2, 8, 8, 1, 3, 5, 0, 7]:
            taus.append(ctl.choose())
            ctl.observe(drafted=taus[-1], accepted=min(accepted, taus[-1]))
        return taus

    timed = run()

    def no_clock(*args):
        raise AssertionError("the tau choice read a clock")

    with monkeypatch.context() as m:
        for name in ("time", "monotonic", "perf_counter", "process_time", "time_ns", "monotonic_ns", "perf_counter_ns"):
            m.setattr(time, name, no_clock)
        clockless = run()
    assert clockless == timed and len(set(timed)) > 1


FEATURES = [
    dict(predraft=True),
    dict(predraft=True, adaptive=True),
    dict(adaptive=True, early_stop_p=0.5),
    dict(proposer="lookup"),
    dict(proposer="hybrid", predraft=True),
]


@pytest.mark.parametrize("draft", ["draft", "target"])
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_greedy_exact_with_every_feature(services, target, draft, features):
    _, d = services("target", draft)
    with Client(d.address, timeout=60) as c:
        hits = 0
        for i, prompt in enumerate(prompts(6, seed=11)):
            n = [3, 9, 20, 33, 14, 40][i]
            r = c.generate(prompt_ids=prompt, max_new_tokens=n, num_draft_tokens=4, **features)
            assert r.token_ids == hf_greedy(target, prompt, n), (prompt, n, r.stats)
            hits += r.stats["predraft_hits"]
            if features.get("proposer") == "lookup":
                assert r.stats.get("lookup_rounds", 0) + r.stats.get("target_only_rounds", 0) == r.stats["rounds"]  # found nothing: target-only
        if features.get("predraft") and draft == "target" and "proposer" not in features:
            assert hits > 0, "a perfect draft must hit its pre-drafts"


def test_early_stop_reads_the_distribution_the_session_samples_from():
    """From a review: an ids-only sampled round compared early_stop_p with the model's raw
    softmax, a sparse or dense one with the sampled distribution (temperature, top-k, top-p):
    one threshold, two meanings. Both now read the sampled one; greedy reads the softmax."""
    import torch

    from draft_service.drafter import top_probability
    from specdec.sampling import Sampling

    logits = torch.tensor([2.0, 1.0, 0.0])
    raw = float(torch.softmax(logits, -1).max())
    assert abs(float(top_probability(logits, Sampling())) - raw) < 1e-6  # greedy
    sharp = float(top_probability(logits, Sampling(temperature=0.5)))
    assert abs(sharp - float(torch.softmax(logits / 0.5, -1).max())) < 1e-6 and sharp > raw
    assert float(top_probability(logits, Sampling(temperature=1.0, top_k=1))) == 1.0
