"""The speculative-sampling acceptance rule (Leviathan et al. 2023, arXiv 2211.17192, §2.3;
Chen et al. 2023, arXiv 2302.01318, Alg. 2), as pure functions over tensors on any device.

Vocabulary used here (after vLLM's rejection sampler):
  accepted tokens  - the prefix x_1..x_n of the proposals the target keeps;
  recovered token  - at the first rejected position j, a draw from normalize(max(0, p_j - q_j));
  bonus token      - when all tau proposals are accepted, a draw from p_{tau+1}.
Either the recovered or the bonus token is the round's "next token", so a round always yields
n + 1 tokens. The rule is exact for ANY proposal distribution q as long as q is the very
distribution the draft sampled x_i from. Writing q_{tau+1} = 0, the next token is always a draw
from normalize(max(0, p_n - q_n)) at n = the number accepted, which is how it is computed.

Both functions return 0-dim tensors on the inputs' device and never sync with the host: the
scheduler moves the verdicts of a whole batch to the host at once.
"""
from __future__ import annotations

import torch

from specdec.sampling import sample_with


def accept_greedy(target: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target [tau+1] = argmax of the target's logits (first index on ties); tokens [tau].
    Accept while x_i is the target's argmax; the next token is the argmax at the first miss
    (or the bonus position). Returns (n accepted, next token)."""
    tau = tokens.shape[0]
    n = (tokens == target[:tau]).long().cumprod(0).sum()  # [] length of the matching prefix
    return n, target[n]


def accept(p: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p [tau+1, V] target probabilities T(target logits); tokens [tau] proposed ids; q [tau, V]
    the proposal distributions (one-hot for ids-only); u [tau+1] float64 uniforms in [0, 1):
    u_i decides x_i, u_{tau+1} draws the next token. Returns (n accepted, next token)."""
    tau = tokens.shape[0]
    px = p[:tau].gather(1, tokens[:, None]).squeeze(1).double()  # [tau]
    qx = q.gather(1, tokens[:, None]).squeeze(1).double()  # [tau]
    ok = (qx > 0) & (u[:tau] * qx <= px)  # [tau]: u <= p/q without dividing
    n = ok.long().cumprod(0).sum()  # [] accepted prefix
    qn = torch.cat([q, q.new_zeros(1, q.shape[1])]).index_select(0, n.view(1))[0].double()  # [V] q_n, 0 past tau
    pn = p.index_select(0, n.view(1))[0].double()  # [V]
    residual = (pn - qn).clamp_(min=0)  # [V]
    residual = torch.where(residual.sum() > 0, residual, pn)  # all mass cancelled (only via q~(x)=0): fall back to p_n
    return n, sample_with(residual, u[tau])
