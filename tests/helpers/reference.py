"""Independent reference implementations for the tests (numpy, written from the definitions)."""
from __future__ import annotations

import numpy as np


def transform(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """T(logits): temperature, top-k, smallest nucleus with mass >= top_p, renormalize."""
    z = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        out = np.zeros_like(z)
        out[int(np.argmax(z))] = 1.0
        return out
    z = z / temperature
    if 0 < top_k < len(z):
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep = np.zeros(len(p), bool)
        mass = 0.0
        for i in order:
            keep[i] = True
            mass += p[i]
            if mass >= top_p:
                break
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def chi_square_p(counts: dict, probs: dict, min_expected: float = 5.0) -> float:
    """p-value of a chi-square goodness-of-fit test; outcomes with small expectation are pooled."""
    from scipy.stats import chisquare

    n = sum(counts.values())
    assert set(counts) <= {k for k, v in probs.items() if v > 0}, f"impossible outcomes seen: {set(counts) - set(probs)}"
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k, pk in probs.items():
        if pk * n >= min_expected:
            obs.append(counts.get(k, 0))
            exp.append(pk * n)
        else:
            pool_o += counts.get(k, 0)
            pool_e += pk * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = np.array(exp) * (n / sum(exp))
    return float(chisquare(obs, exp).pvalue)


def total_variation(counts: dict, probs: dict) -> float:
    n = sum(counts.values())
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - probs.get(k, 0.0)) for k in keys)
