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

`accept_batch` applies the rule to a whole pass at once: sessions padded to the longest round,
each with its own tau, sampling settings and keyed uniforms (specdec/sampling.py). `accept` and
`accept_greedy` are one session's rule, the same code with a batch of one. All return tensors
on the inputs' device and never sync with the host: the scheduler moves the verdicts of a whole
batch to the host at once.
"""
from __future__ import annotations

import torch

from specdec.sampling import VERIFY, keyed_uniforms, probs_from_logits_rows, sample_with, to_device


def _greedy_rows(target: torch.Tensor, tokens: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target [B, T+1] argmax ids; tokens [B, T]; tau [B] (rows past tau are padding, never
    accepted). Returns (n [B], next [B])."""
    live = torch.arange(tokens.shape[1], device=tokens.device) < tau[:, None]  # [B, T]
    n = ((tokens == target[:, :-1]) & live).long().cumprod(1).sum(1)  # [B] length of the matching prefix
    return n, target.gather(1, n[:, None]).squeeze(1)


def _sampled_rows(p: torch.Tensor, tokens: torch.Tensor, tau: torch.Tensor, q: torch.Tensor,
                  u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p [B, T+1, V]; tokens [B, T]; tau [B]; q [B, T, V]; u [B, T+1] float64: u_i decides x_i,
    u at index tau draws the next token. Returns (n [B], next [B])."""
    T = tokens.shape[1]
    live = torch.arange(T, device=tokens.device) < tau[:, None]  # [B, T]
    px = p[:, :T].gather(2, tokens[:, :, None]).squeeze(2).double()  # [B, T]
    qx = q.gather(2, tokens[:, :, None]).squeeze(2).double()  # [B, T]
    ok = live & (qx > 0) & (u[:, :T] * qx <= px)  # [B, T]: u <= p/q without dividing
    n = ok.long().cumprod(1).sum(1)  # [B] accepted prefix
    rows = torch.arange(p.shape[0], device=p.device)  # [B]
    pn = p[rows, n].double()  # [B, V]
    qn = q[rows, n.clamp(max=max(T - 1, 0))].double() if T else pn.new_zeros(pn.shape)  # [B, V]
    qn = torch.where((n < tau)[:, None], qn, 0.0)  # q_n = 0 at n = tau
    residual = (pn - qn).clamp_(min=0)  # [B, V]
    residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, pn)  # all mass cancelled (only via q~(x)=0): p_n
    return n, sample_with(residual, u.gather(1, tau[:, None]).squeeze(1))


def accept_greedy(target: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target [tau+1] = argmax of the target's logits (first index on ties); tokens [tau].
    Accept while x_i is the target's argmax; the next token is the argmax at the first miss
    (or the bonus position). Returns (n accepted, next token)."""
    tau = tokens.new_full((1,), tokens.shape[0])  # [1]
    n, nxt = _greedy_rows(target[None], tokens[None], tau)
    return n[0], nxt[0]


def accept(p: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p [tau+1, V] target probabilities T(target logits); tokens [tau] proposed ids; q [tau, V]
    the proposal distributions (one-hot for ids-only); u [tau+1] float64 uniforms in [0, 1):
    u_i decides x_i, u_{tau+1} draws the next token. Returns (n accepted, next token)."""
    tau = tokens.new_full((1,), tokens.shape[0])  # [1]
    n, nxt = _sampled_rows(p[None], tokens[None], tau, q[None], u[None])
    return n[0], nxt[0]


def accept_batch(logits: torch.Tensor, tokens: torch.Tensor, tau: torch.Tensor, q: torch.Tensor, greedy: torch.Tensor,
                 seeds: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over one pass of B sessions, each padded to the longest round (T = its tau):
    logits [B, T+1, V] and tokens [B, T] (padding ids 0) and q [B, T, V] (zeros where absent or
    greedy) on the device; per session on the CPU: tau [B], greedy [B] bool, seeds [B] (int64(seed)),
    positions [B] (the session's committed length: the key of its uniforms), temperature, top_k,
    top_p [B]. Greedy sessions take the argmax rule; the others p = T(logits) and the uniforms
    keyed (seed, position, VERIFY, 0..T). Returns (n accepted [B], next token [B]) on the device."""
    B, R, V = logits.shape
    dev = logits.device
    tau_d = to_device(tau, dev)  # [B]
    n, nxt = _greedy_rows(logits.argmax(-1), tokens, tau_d)  # [B], [B]
    if greedy.all():
        return n, nxt
    rows = lambda x: x.repeat_interleave(R)  # noqa: E731 - [B] -> [B*R]: a session's setting on each of its rows
    p = probs_from_logits_rows(logits.reshape(B * R, V), rows(temperature), rows(top_k), rows(top_p)).view(B, R, V)
    index = torch.arange(R, device=dev)  # [R]
    u = keyed_uniforms(seeds[:, None], positions[:, None], VERIFY, index, device=dev)  # [B, R]
    n_s, nxt_s = _sampled_rows(p, tokens, tau_d, q, u)
    g = to_device(greedy, dev)  # [B]
    return torch.where(g, n, n_s), torch.where(g, nxt, nxt_s)
