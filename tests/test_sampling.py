"""The sampling transform against an independent reference, and the sparse proposal."""
import numpy as np
import pytest
import torch

from helpers.reference import transform
from specdec.sampling import Sampling, probs_from_logits, sparsify

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
    logits = torch.randn(3, 10)
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
