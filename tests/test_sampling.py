"""The sampling transform against an independent reference, its batched form, the sparse
proposal, and the keyed uniforms."""
import numpy as np
import pytest
import torch

from helpers.reference import transform
from specdec.sampling import DRAFT, VERIFY, Sampling, _shr, int64, keyed_uniforms, probs_from_logits, probs_from_logits_rows, sparsify

CASES = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6), (0.5, 4, 0.9), (2.0, 1, 1.0), (1.0, 0, 1e-6), (0.0, 0, 1.0)]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_transform_matches_reference(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(10, generator=g) * 3
        ours = probs_from_logits(logits, Sampling(temperature, top_k, top_p)).double().numpy()
        ref = transform(logits.numpy(), temperature, top_k, top_p)
        np.testing.assert_allclose(ours, ref, atol=1e-6)
        assert abs(ours.sum() - 1) < 1e-5


def test_batched_rows_transform_independently():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    s = Sampling(0.8, 5, 0.7)
    rows = torch.stack([probs_from_logits(r, s) for r in logits])
    torch.testing.assert_close(probs_from_logits(logits, s), rows)


def test_sparsify_keeps_top_k_nonzero_and_renormalizes():
    q = torch.tensor([0.1, 0.0, 0.5, 0.3, 0.1, 0.0])
    ids, vals = sparsify(q, 3)
    assert ids.tolist()[:2] == [2, 3] and len(ids) == 3
    assert abs(float(vals.sum()) - 1) < 1e-6 and float(vals[0]) == pytest.approx(0.5 / 0.9)
    ids, vals = sparsify(q, 6)  # zeros are never sent
    assert sorted(ids.tolist()) == [0, 2, 3, 4]


# ---- the batched transform: each row with its own settings ------------------------------------

ROW_SETTINGS = [Sampling(*c) for c in CASES] + [Sampling(0.3, 2, 0.5), Sampling(1.5, 9, 0.95), Sampling(1.0, 10, 1.0)]


def test_batched_transform_is_bitwise_the_per_row_transform():
    """Rows with different (temperature, top_k, top_p), greedy ones among them, mixed in one
    batch: each row equals probs_from_logits with its own settings, bit for bit."""
    g = torch.Generator().manual_seed(1)
    for rows in (ROW_SETTINGS, ROW_SETTINGS[::-1], ROW_SETTINGS[3:6], [Sampling(1.0)] * 3, [Sampling()] * 2):
        logits = torch.randn(len(rows), 10, generator=g) * 3
        logits[0, 4] = logits[0, 7]  # a tie
        got = probs_from_logits_rows(logits, torch.tensor([s.temperature for s in rows], dtype=torch.float64),
                                     torch.tensor([s.top_k for s in rows]), torch.tensor([s.top_p for s in rows], dtype=torch.float64))
        for i, s in enumerate(rows):
            assert torch.equal(got[i], probs_from_logits(logits[i], s)), (i, s)


def test_batched_transform_matches_a_sessions_block_of_rows():
    """As the verifier calls it: a session's [tau+1, V] block inside a batch of sessions equals the
    per-session transform of that block (a bigger vocabulary, bfloat16 logits)."""
    g = torch.Generator().manual_seed(2)
    settings = [Sampling(0.7, 50, 0.9), Sampling(), Sampling(1.0, 0, 0.8), Sampling(1.2, 7, 1.0)]
    blocks = [(torch.randn(r, 500, generator=g) * 4).bfloat16() for r in (3, 1, 5, 2)]
    reps = torch.tensor([b.shape[0] for b in blocks])
    got = probs_from_logits_rows(torch.cat(blocks), torch.tensor([s.temperature for s in settings], dtype=torch.float64).repeat_interleave(reps),
                                 torch.tensor([s.top_k for s in settings]).repeat_interleave(reps),
                                 torch.tensor([s.top_p for s in settings], dtype=torch.float64).repeat_interleave(reps))
    for b, s, out in zip(blocks, settings, got.split(reps.tolist())):
        assert torch.equal(out, probs_from_logits(b, s))


# ---- keyed uniforms --------------------------------------------------------------------------

_M64 = (1 << 64) - 1


def _splitmix_reference(*key: int) -> float:
    """The same hash in Python's unbounded ints (unsigned 64-bit arithmetic, logical shifts)."""
    h = 0
    for x in key:
        z = (h * 0x9E3779B97F4A7C15 + (x & _M64) + 1) & _M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        h = z ^ (z >> 31)
    return (h >> 11) / 2.0**53


@pytest.mark.parametrize("key", [(0, 0, 0, 0), (1, 2, 0, 3), (2**64 - 1, 5, 1, 0), (2**63, 0, 0, 8), (123456789, 4096, 1, 0)])
def test_keyed_uniform_is_the_unsigned_hash(key):
    """int64 tensor ops give the unsigned hash: products wrap and shifts are logical."""
    assert float(keyed_uniforms(*key)) == _splitmix_reference(*key)


def test_keyed_uniforms_are_deterministic_and_in_range():
    a = keyed_uniforms(7, torch.arange(100_000), VERIFY, 0)
    assert torch.equal(a, keyed_uniforms(7, torch.arange(100_000), VERIFY, 0))
    assert a.dtype == torch.float64 and float(a.min()) >= 0 and float(a.max()) < 1
    assert float(_shr(torch.tensor(-1), 11).double() * 2.0**-53) < 1  # the largest value the hash can give


@pytest.mark.parametrize("axis", ["seed", "position", "purpose", "index"])
def test_keyed_uniforms_are_uniform_along_each_part_of_the_key(axis):
    """200,000 draws along one part of the key (the others fixed) against U[0, 1): chi-square over
    100 bins and Kolmogorov-Smirnov. Fixed keys, so the p-values are fixed numbers, not flaky."""
    from scipy.stats import chisquare, kstest

    n = 200_000
    key = {"seed": 12345, "position": 17, "purpose": DRAFT, "index": 3}
    key[axis] = torch.arange(n)
    u = keyed_uniforms(**key).numpy()
    assert chisquare(np.bincount((u * 100).astype(int), minlength=100)).pvalue > 1e-3
    assert kstest(u, "uniform").pvalue > 1e-3


def test_keyed_uniform_does_not_depend_on_its_batch():
    """A key's value is the same computed alone, in a batch, in another order or broadcast."""
    g = torch.Generator().manual_seed(3)
    seeds = torch.randint(-(2**62), 2**62, (64,), generator=g)
    positions, index = torch.randint(0, 10_000, (64,), generator=g), torch.randint(0, 9, (64,), generator=g)
    batch = keyed_uniforms(seeds, positions, VERIFY, index)
    perm = torch.randperm(64, generator=g)
    assert torch.equal(keyed_uniforms(seeds[perm], positions[perm], VERIFY, index[perm]), batch[perm])
    for i in range(0, 64, 7):
        assert float(keyed_uniforms(int(seeds[i]), int(positions[i]), VERIFY, int(index[i]))) == float(batch[i])
    grid = keyed_uniforms(seeds[:, None], positions[:, None], VERIFY, torch.arange(9))  # [64, 9]: a round's uniforms
    assert torch.equal(grid.gather(1, index[:, None]).squeeze(1), batch)
    assert float(keyed_uniforms(2**64 - 5, 1, DRAFT, 0)) == float(keyed_uniforms(torch.tensor([int64(2**64 - 5)]), 1, DRAFT, 0)[0])


def test_an_overflowed_logit_takes_the_mass_and_no_draw_falls_outside_the_vocabulary():
    """A +inf logit (an overflow in half precision) made the whole row NaN, and a draw from it
    token V, one past the vocabulary. It now takes all the mass (shared with any other +inf),
    in both transforms alike; a row with no mass at all (NaN logits) is an error on the draft's
    side, where a draw used to come out as V."""
    from specdec.sampling import sample

    logits = torch.tensor([[1.0, float("inf"), 0.5, -1.0, float("-inf"), 0.0], [float("inf"), 2.0, float("inf"), 0, 0, 0]])
    for s in (Sampling(1.0), Sampling(0.7, 3, 0.9)):
        rows = probs_from_logits_rows(logits, torch.full((2,), s.temperature), torch.full((2,), s.top_k), torch.full((2,), s.top_p))
        assert torch.equal(rows, probs_from_logits(logits, s))
        assert torch.equal(rows[0], torch.tensor([0, 1.0, 0, 0, 0, 0])) and torch.equal(rows[1], torch.tensor([0.5, 0, 0.5, 0, 0, 0]))
        assert sample(rows[0], 7, 3, DRAFT) == 1
    nan = probs_from_logits(torch.tensor([1.0, float("nan"), 0.0]), Sampling(1.0))
    with pytest.raises(ValueError, match="not finite"):
        sample(nan, 7, 3, DRAFT)


def test_the_greedy_rules_never_accept_or_commit_at_a_row_without_a_largest_logit():
    """argmax takes a NaN for the largest value: a greedy round accepted a proposal of the NaN's
    token, and a NaN row committed token 0. Such a row's argmax is V now, as a sampled row's draw
    is, which the verify service refuses."""
    from specdec.acceptance import accept_greedy_batch, argmax_rows

    V = 8
    logits = torch.arange(3 * V, dtype=torch.float32).view(1, 3, V) % V  # argmax V-1 at every row
    logits[0, 1, 3] = float("nan")  # one NaN at row 1
    assert argmax_rows(logits).tolist() == [[V - 1, V, V - 1]]
    assert argmax_rows(torch.full((2, V), float("-inf"))).tolist() == [V, V]
    assert argmax_rows(torch.tensor([0.0, float("inf"), 1.0])).item() == 1  # +inf is a largest logit
    n, nxt = accept_greedy_batch(logits, torch.tensor([[V - 1, 3]]), torch.tensor([2]))
    assert (n.item(), nxt.item()) == (1, V)  # the NaN row's token is not accepted, and no token is drawn there
