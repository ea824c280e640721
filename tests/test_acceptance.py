"""The acceptance rule as a pure function: table-driven cases and its exactness in distribution."""
import collections

import numpy as np
import pytest
import torch

from helpers.reference import chi_square_p
from specdec import acceptance

T = torch.tensor


def accept(p, tokens, q, g):
    """The rule as the scheduler calls it, with ints out: greedy when q is None, else tau+1
    float64 uniforms drawn from g."""
    if q is None:
        n, nxt = acceptance.accept_greedy(p.argmax(-1), tokens)
    else:
        u = torch.rand(tokens.shape[0] + 1, generator=g, dtype=torch.float64)
        n, nxt = acceptance.accept(p, tokens, q, u)
    return int(n), int(nxt)


def onehot_rows(*idx, V=4):
    return torch.nn.functional.one_hot(T(idx), V).float()


GREEDY_CASES = [
    # (target argmax per position incl. bonus, proposed tokens, expected (n, next))
    ([1, 2, 3], [1, 2], (2, 3)),  # all accepted -> bonus
    ([1, 2, 3], [0, 2], (0, 1)),  # first rejected -> correction
    ([1, 2, 3], [1, 0], (1, 2)),  # second rejected
    ([1], [], (0, 1)),  # no proposals: target-only step
]


@pytest.mark.parametrize("argmax,tokens,expected", GREEDY_CASES)
def test_greedy_table(argmax, tokens, expected):
    p = onehot_rows(*argmax)
    assert accept(p, T(tokens, dtype=torch.long), None, None) == expected


def test_greedy_ties_take_first_index():
    p = T([[0.4, 0.4, 0.2, 0.0], [0.1, 0.3, 0.3, 0.3]])
    assert accept(p, T([1]), None, None) == (0, 0)  # argmax of row 0 is 0, not 1
    assert accept(p, T([0]), None, None) == (1, 1)  # bonus: first of the tied 0.3s


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_p_equal_q_always_accepts():
    p = T([[0.25, 0.25, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]])
    q = p[:1].clone()
    for s in range(50):
        assert accept(p, T([2]), q, gen(s)) == (1, 3)  # bonus from the one-hot last row


def test_zero_q_entry_is_always_rejected():
    # x=1 has target mass 1 but q~(x)=0: the rule never accepts it; residual = max(0, p - q) -> token 1
    p = T([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    q = T([[1.0, 0.0, 0.0, 0.0]])
    for s in range(50):
        assert accept(p, T([1]), q, gen(s)) == (0, 1)


def test_zero_p_is_always_rejected_and_residual_excludes_q_mass():
    p = T([[0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    q = T([[1.0, 0.0, 0.0, 0.0]])
    nexts = collections.Counter(accept(p, T([0]), q, gen(s))[1] for s in range(400))
    assert set(nexts) == {1, 2} and abs(nexts[1] - 200) < 60


def test_residual_summing_to_zero_falls_back_to_p():
    # the proposed token has q~ = 0 and p == q~ elsewhere: max(0, p - q~) is all zero
    p = T([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    q = T([[0.5, 0.5, 0.0, 0.0]])
    nexts = collections.Counter()
    for s in range(400):
        n, nxt = accept(p, T([3]), q, gen(s))
        assert n == 0
        nexts[nxt] += 1
    assert set(nexts) == {0, 1} and abs(nexts[0] - 200) < 60


def test_first_rejection_stops_the_prefix():
    # position 1 always accepted (p >= q), position 2 never (p(x)=0); next comes from p_2's residual
    p = T([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    q = T([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    assert accept(p, T([1, 2]), q, gen()) == (1, 3)


def test_same_generator_state_same_result():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(5, 7), -1)
    q = torch.softmax(torch.randn(4, 7), -1)
    x = T([1, 2, 3, 4])
    assert accept(p, x, q, gen(7)) == accept(p, x, q, gen(7))


@pytest.mark.parametrize("seed", [0, 1])
def test_rule_output_has_target_distribution(seed):
    """x ~ q, then accept-or-resample gives exactly p; acceptance rate is sum(min(p, q))."""
    torch.manual_seed(seed)
    V = 5
    p = torch.softmax(torch.randn(2, V) * 1.5, -1)  # [2, V]: position 1 and the bonus row
    q = torch.softmax(torch.randn(1, V) * 1.5, -1)  # [1, V]
    g = gen(100 + seed)
    N = 20000
    xs = torch.multinomial(q[0], N, replacement=True, generator=g)
    counts, accepted = collections.Counter(), 0
    for x in xs.tolist():
        n, nxt = accept(p, T([x]), q, g)
        accepted += n
        counts[x if n else nxt] += 1
    assert chi_square_p(counts, {i: float(p[0, i]) for i in range(V)}) > 1e-3
    beta = float(torch.minimum(p[0], q[0]).sum())
    assert abs(accepted / N - beta) < 4 * np.sqrt(beta * (1 - beta) / N)


def test_the_next_token_is_drawn_with_the_last_uniform():
    """u_{tau+1} alone decides the next token: the inverse CDF of the residual (or bonus) row."""
    p = T([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = T([[1.0, 0.0, 0.0, 0.0]])
    x = T([0])  # p(x) = 0: always rejected; residual = p_1
    assert [int(v) for v in acceptance.accept(p, x, q, T([0.5, 0.1], dtype=torch.float64))] == [0, 1]
    assert [int(v) for v in acceptance.accept(p, x, q, T([0.5, 0.9], dtype=torch.float64))] == [0, 2]
    q2 = T([[0.0, 1.0, 0.0, 0.0]])  # x = 1, p/q = 0.5: accepted iff u_1 <= 0.5; the bonus from p_2
    assert [int(v) for v in acceptance.accept(p, T([1]), q2, T([0.4, 0.99], dtype=torch.float64))] == [1, 3]
    assert [int(v) for v in acceptance.accept(p, T([1]), q2, T([0.6, 0.99], dtype=torch.float64))] == [0, 2]
