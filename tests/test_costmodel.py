"""The cost model (specdec/costmodel.py): E(γ), the bound S, S_net and the pre-drafting cost,
checked against closed forms and against a direct simulation of the acceptance process."""
import random

import pytest

from specdec.costmodel import Costs, best_gamma, choose_gamma, expected_tokens, round_cost, round_seconds, speedup


def test_expected_tokens_closed_forms():
    assert expected_tokens(0.0, 4) == 1.0  # nothing accepted: only the recovered token
    assert expected_tokens(1.0, 4) == 5.0  # everything accepted: gamma + the bonus token
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.7, 0) == 1.0  # target-only: one token per round
    for a in (0.1, 0.5, 0.9, 0.999):  # the geometric sum 1 + a + ... + a^gamma
        assert expected_tokens(a, 6) == pytest.approx(sum(a ** i for i in range(7)))


def test_expected_tokens_is_the_mean_of_the_acceptance_process():
    rng = random.Random(0)
    alpha, gamma, rounds = 0.8, 5, 100_000
    total = 0
    for _ in range(rounds):
        n = 0
        while n < gamma and rng.random() < alpha:
            n += 1
        total += n + 1  # the accepted prefix plus the recovered or bonus token
    assert total / rounds == pytest.approx(expected_tokens(alpha, gamma), rel=0.01)


def test_expected_tokens_rejects_nonsense():
    with pytest.raises(ValueError):
        expected_tokens(1.5, 2)
    with pytest.raises(ValueError):
        expected_tokens(0.5, -1)


def test_round_cost_and_speedup():
    assert round_cost(4, 0.1) == pytest.approx(1.4)  # gamma*c + 1
    assert round_cost(4, 0.1, rho=0.5) == pytest.approx(1.9)  # + rho
    assert round_cost(4, 0.1, rho=0.5, predraft=True) == pytest.approx(1.5)  # max(gamma*c, 1 + rho)
    assert round_cost(20, 0.1, rho=0.5, predraft=True) == pytest.approx(2.0)  # drafting dominates
    e = expected_tokens(0.8, 3)
    assert speedup(0.8, 3, 0.1) == pytest.approx(e / 1.3)  # S
    assert speedup(0.8, 3, 0.1, rho=0.2) == pytest.approx(e / 1.5)  # S_net
    assert speedup(0.8, 3, 0.1, rho=0.2) < speedup(0.8, 3, 0.1)
    assert speedup(0.8, 3, 0.1, rho=0.2, predraft=True) == pytest.approx(e / 1.2)
    assert speedup(0.0, 1, 0.0) == 1.0  # a free draft that is never accepted costs nothing


def test_best_gamma():
    assert best_gamma(0.99, 0.01) == 8  # cheap, accurate draft: as long as allowed
    assert best_gamma(0.1, 0.5) == 1  # poor, costly draft: as short as allowed
    g = best_gamma(0.8, 0.1, range(1, 17))
    assert all(speedup(0.8, g, 0.1) >= speedup(0.8, k, 0.1) for k in range(1, 17))
    # a slow network makes longer rounds pay: the round cost is dominated by 1 + rho
    assert best_gamma(0.8, 0.1, range(1, 17), rho=10.0) > g
    assert best_gamma(0.5, 0.0, range(1, 5)) == 4  # ties impossible here; free drafting: the maximum


def test_round_seconds_counts_the_predrafts_that_follow_a_rejection():
    """With pre-drafting a round costs max(V, (gamma + 1) t_d) when its pre-draft is used, else
    V + gamma t_d: used after all gamma accepted with the right bonus guess (alpha^(gamma+1)) and,
    for a greedy chain's pre-drafts (`second`), after a rejection whose token was the draft's
    second choice. Checked against a simulation of the outcomes."""
    costs = Costs(draft_step=0.002, verify_base=0.012, verify_per_token=0.0004)
    alpha, gamma, second = 0.6, 4, 0.45
    v, d = costs.verify(gamma), gamma * costs.draft_step
    rng, total, rounds = random.Random(1), 0.0, 100_000
    for _ in range(rounds):
        n = 0
        while n < gamma and rng.random() < alpha:
            n += 1
        hit = rng.random() < (alpha if n == gamma else second)  # the guessed next token was the verifier's
        total += max(v, d + costs.draft_step) if hit else v + d
    assert round_seconds(costs, alpha, gamma, True, second) == pytest.approx(total / rounds, rel=0.005)
    assert round_seconds(costs, alpha, gamma, True) > round_seconds(costs, alpha, gamma, True, second)
    assert round_seconds(costs, alpha, gamma, False, second) == pytest.approx(v + d)  # no pre-draft: nothing to use
    # rejections that are cheap to follow make longer rounds pay
    assert choose_gamma(costs, 0.5, 8, True, 0.9) > choose_gamma(costs, 0.5, 8, True)
