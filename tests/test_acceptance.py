"""The acceptance rule as a pure function: table-driven cases, its exactness in distribution, and
the batched rule over a pass equal to the per-session rule."""
import collections

import numpy as np
import pytest
import torch

from helpers.reference import chi_square_p
from specdec import acceptance
from specdec.sampling import VERIFY, Sampling, int64, keyed_uniforms, probs_from_logits

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


def test_a_rejection_resamples_from_the_residual_where_p_and_q_overlap():
    """p and q share their support: x = 0 is accepted with p/q = 1/3, and a rejection draws from
    max(0, p - q) = token 1 alone. A rule that resampled from p would give token 0 a quarter of
    its rejections (the table cases above cannot tell the two apart: their residual is p)."""
    p = T([[0.25, 0.75, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    q = T([[0.75, 0.25, 0.0, 0.0]])
    out = collections.Counter(accept(p, T([0]), q, gen(s)) for s in range(600))
    assert set(out) == {(1, 3), (0, 1)}, out  # accepted (bonus 3), or rejected to token 1: never token 0
    assert abs(out[1, 3] - 200) < 60, out


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


# ---- the batched rule over a pass --------------------------------------------------------------

def _session_verdict(lg, tokens, q, s, seed, position):
    """One session as the scheduler used to decide it: the per-session transform, the session's
    keyed uniforms, then accept / accept_greedy."""
    if s.greedy:
        return [int(v) for v in acceptance.accept_greedy(lg.argmax(-1), tokens)]
    u = keyed_uniforms(seed, position, VERIFY, torch.arange(tokens.shape[0] + 1))  # [tau+1]
    q = q if q is not None else torch.zeros(0, lg.shape[1])  # target-only: no proposals
    return [int(v) for v in acceptance.accept(probs_from_logits(lg, s), tokens, q, u)]


def _batch_verdicts(sessions):
    """sessions: (logits [tau+1, V], tokens [tau], q [tau, V] or None, Sampling, seed, position)
    padded into one batch as the scheduler pads them -> [[n, next]] from accept_batch."""
    B, V = len(sessions), sessions[0][0].shape[1]
    T = max(x[1].shape[0] for x in sessions)
    logits = torch.zeros(B, T + 1, V)
    tokens = torch.zeros(B, T, dtype=torch.long)
    q = torch.zeros(B, T, V)
    for i, (lg, x, qi, *_) in enumerate(sessions):
        logits[i, : lg.shape[0]], tokens[i, : x.shape[0]] = lg, x
        if qi is not None:
            q[i, : qi.shape[0]] = qi
    col = lambda f, dtype=None: torch.tensor([f(x) for x in sessions], dtype=dtype)  # noqa: E731
    n, nxt = acceptance.accept_batch(logits, tokens, col(lambda x: x[1].shape[0]), q, col(lambda x: x[3].greedy),
                                     col(lambda x: int64(x[4])), col(lambda x: x[5]), col(lambda x: x[3].temperature, torch.float64),
                                     col(lambda x: x[3].top_k), col(lambda x: x[3].top_p, torch.float64))
    return torch.stack([n, nxt], 1).tolist()


def _random_session(g, V, tau, s, seed):
    """A round whose proposals are drawn from q = T(draft logits) near the target's, so that
    some are accepted and some rejected."""
    target = torch.randn(tau + 1, V, generator=g) * 2  # [tau+1, V]
    draft = target[:tau] + torch.randn(tau, V, generator=g) * 0.7  # [tau, V]
    if s.greedy:
        tokens = torch.where(torch.rand(tau, generator=g) < 0.8, target[:tau].argmax(-1), draft.argmax(-1))
        return target, tokens, None, s, seed, int(torch.randint(1, 500, (), generator=g))
    q = probs_from_logits(draft, s)  # [tau, V]
    tokens = torch.multinomial(q, 1, generator=g).squeeze(1) if tau else torch.zeros(0, dtype=torch.long)
    return target, tokens, q, s, seed, int(torch.randint(1, 500, (), generator=g))


SETTINGS = [Sampling(), Sampling(1.0), Sampling(0.8, 5, 1.0), Sampling(1.0, 0, 0.9), Sampling(0.6, 8, 0.8), Sampling(1.3)]


@pytest.mark.parametrize("seed", range(4))
def test_batched_rule_equals_the_per_session_rule(seed):
    """Mixed greedy and sampled sessions, taus from 0 to 6, different settings and seeds (one a
    uint64 past 2^63): every session's (n, next) from one batched call is its per-session verdict."""
    g = torch.Generator().manual_seed(seed)
    V = 12
    for trial in range(25):
        B = int(torch.randint(1, 7, (), generator=g))
        sessions = [_random_session(g, V, int(torch.randint(0, 7, (), generator=g)), SETTINGS[int(torch.randint(0, 6, (), generator=g))],
                                    2**64 - 1 - i if i == 0 else 1000 * trial + i) for i in range(B)]
        want = [_session_verdict(*x) for x in sessions]
        assert _batch_verdicts(sessions) == want, (trial, want)
        assert all(n <= x[1].shape[0] for (n, _), x in zip(want, sessions))


def test_the_greedy_batch_rule_equals_the_per_session_rule():
    """A pass of greedy sessions only (the scheduler's path for greedy rounds and target-only steps,
    verify_service/jobs.py `accept`): accept_greedy_batch gives every session its own verdict, with
    taus from 0 to 6 padded to the longest, so padding is never accepted."""
    g = torch.Generator().manual_seed(5)
    for trial in range(25):
        sessions = [_random_session(g, 12, int(torch.randint(0, 7, (), generator=g)), Sampling(), i)
                    for i in range(int(torch.randint(1, 7, (), generator=g)))]
        B, T = len(sessions), max(x[1].shape[0] for x in sessions)
        logits, tokens = torch.zeros(B, T + 1, 12), torch.zeros(B, T, dtype=torch.long)
        for i, (lg, x, *_) in enumerate(sessions):
            logits[i, : lg.shape[0]], tokens[i, : x.shape[0]] = lg, x
        n, nxt = acceptance.accept_greedy_batch(logits, tokens, torch.tensor([x[1].shape[0] for x in sessions]))
        assert torch.stack([n, nxt], 1).tolist() == [_session_verdict(*x) for x in sessions], trial


def test_padding_is_never_accepted():
    """A short round beside a long one: the padding ids (0) match the argmax of the zero padding
    rows, and would be accepted if padding counted; a sampled session's q is zero there."""
    V = 4
    short_greedy = (onehot_rows(1, 0, V=V), T([1]), None, Sampling(), 1, 10)  # all accepted: n = 1, bonus 0
    short_sampled = (onehot_rows(2, 0, V=V) * 10, T([2]), onehot_rows(2, V=V), Sampling(1.0), 2, 10)
    target_only = (onehot_rows(3, V=V) * 10, T([], dtype=torch.long), None, Sampling(1.0), 3, 10)
    long = (onehot_rows(0, 0, 0, 0, V=V), T([0, 0, 0]), None, Sampling(), 4, 10)
    got = _batch_verdicts([short_greedy, short_sampled, target_only, long])
    assert got[0] == [1, 0] and got[1][0] == 1 and got[2][0] == 0 and got[3] == [3, 0]
    assert got == [_session_verdict(*x) for x in (short_greedy, short_sampled, target_only, long)]


def test_the_same_session_gets_the_same_verdict_in_any_batch():
    g = torch.Generator().manual_seed(9)
    sessions = [_random_session(g, 10, tau, SETTINGS[1 + i % 5], 50 + i) for i, tau in enumerate([3, 0, 5, 1, 2])]
    alone = [_batch_verdicts([x])[0] for x in sessions]
    assert _batch_verdicts(sessions) == alone
    assert _batch_verdicts(sessions[::-1]) == alone[::-1]


def test_a_token_the_target_gives_no_mass_is_never_accepted():
    """The rule accepts x when u < p(x)/q(x); at u = 0 (a keyed uniform's 53 bits all zero, once
    in 2^53 draws) `u q <= p` accepted a token the target's top-k or top-p had filtered out."""
    from specdec.acceptance import accept

    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25] * 4])
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    n, nxt = accept(p, torch.tensor([0]), q, torch.tensor([0.0, 0.5], dtype=torch.float64))
    assert int(n) == 0 and int(nxt) in (1, 2)  # (the tree rule's sibling steps compare the same way)
