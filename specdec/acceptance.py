"""The speculative-sampling acceptance rule (Leviathan et al. 2023, arXiv 2211.17192, §2.3;
Chen et al. 2023, arXiv 2302.01318, Alg. 2), as one pure function over tensors.

Vocabulary used here (after vLLM's rejection sampler):
  accepted tokens  - the prefix x_1..x_n of the proposals the target keeps;
  recovered token  - at the first rejected position j, a draw from normalize(max(0, p_j - q_j));
  bonus token      - when all tau proposals are accepted, a draw from p_{tau+1}.
Either the recovered or the bonus token is the round's "next token", so a round always yields
n + 1 tokens. The rule is exact for ANY proposal distribution q as long as q is the very
distribution the draft sampled x_i from.
"""
from __future__ import annotations

import torch

from specdec.sampling import sample


def accept(
    p: torch.Tensor,  # [tau+1, V] target probabilities T(target logits), float32
    tokens: torch.Tensor,  # [tau] proposed ids x_1..x_tau, int64
    q: torch.Tensor | None,  # [tau, V] proposal q~ (one-hot for ids-only); None when greedy
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Returns (n accepted, next token). q=None selects the greedy rule."""
    tau = tokens.shape[0]
    if q is None:
        # greedy: accept while x_i is the target argmax; next = argmax at the first miss / bonus
        target = p.argmax(-1)  # [tau+1]
        miss = (tokens != target[:tau]).nonzero()
        n = int(miss[0]) if miss.numel() else tau
        return n, int(target[n])

    px = p[:tau].gather(1, tokens[:, None]).squeeze(1).double()  # [tau]
    qx = q.gather(1, tokens[:, None]).squeeze(1).double()  # [tau]
    u = torch.rand(tau, generator=generator, dtype=torch.float64)  # [tau], float64: never exactly 0 issues
    ok = (qx > 0) & (u * qx <= px)  # u <= p/q without dividing
    miss = (~ok).nonzero()
    if not miss.numel():
        return tau, sample(p[tau], generator)
    j = int(miss[0])
    residual = (p[j].double() - q[j].double()).clamp_(min=0)  # [V]
    if residual.sum() <= 0:  # p_j <= q_j everywhere: only possible via q~(x)=0; fall back to p
        residual = p[j].double()
    return j, sample(residual, generator)
