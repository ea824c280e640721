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

`accept_tree` is the multi-candidate rule for rounds that are token trees (DESIGN.md §12).

`accept_batch` applies the rule to a whole pass at once: sessions padded to the longest round,
each with its own tau, sampling settings and keyed uniforms (specdec/sampling.py). `accept` and
`accept_greedy` are one session's rule, the same code with a batch of one. All return tensors
on the inputs' device and never sync with the host: the scheduler moves the verdicts of a whole
batch to the host at once.
"""
from __future__ import annotations

import torch

from specdec.sampling import VERIFY, keyed_uniforms, probs_from_logits_rows, sample_with, to_device


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> the argmax ids [...] (first index on ties), V where the row has no largest
    number (a NaN, which argmax takes for the largest, or every logit -inf): the id a sampled row's
    draw gives there too, never accepted, which the verify service refuses (INTERNAL) instead of
    committing. One gather of the maxima, no host sync."""
    ids = logits.argmax(-1)
    top = logits.gather(-1, ids[..., None]).squeeze(-1)
    return torch.where(torch.isnan(top) | (top == float("-inf")), logits.shape[-1], ids)


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
    ok = live & (qx > 0) & (u[:, :T] * qx < px)  # [B, T]: u < p/q without dividing (a token the target gives no mass: never)
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
    n, nxt = _greedy_rows(argmax_rows(logits), tokens, tau_d)  # [B], [B]
    if greedy.all():
        return n, nxt
    rows = lambda x: x.repeat_interleave(R)  # noqa: E731 - [B] -> [B*R]: a session's setting on each of its rows
    p = probs_from_logits_rows(logits.reshape(B * R, V), rows(temperature), rows(top_k), rows(top_p)).view(B, R, V)
    index = torch.arange(R, device=dev)  # [R]
    u = keyed_uniforms(seeds[:, None], positions[:, None], VERIFY, index, device=dev)  # [B, R]
    n_s, nxt_s = _sampled_rows(p, tokens, tau_d, q, u)
    g = to_device(greedy, dev)  # [B]
    return torch.where(g, n, n_s), torch.where(g, nxt, nxt_s)


def accept_greedy_batch(logits: torch.Tensor, tokens: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_batch for a pass whose sessions are all greedy: the argmax rule alone, so no
    settings, q or uniforms need building. logits [B, T+1, V] and tokens [B, T] on the device,
    tau [B] on the host. Returns (n accepted [B], next token [B]) on the device."""
    return _greedy_rows(argmax_rows(logits), tokens, to_device(tau, logits.device))


def tree_tables(parents: list[list[int]], R: int) -> dict[str, torch.Tensor]:
    """Host tables of B trees for `accept_tree` (row 0 of a tree is the pending token, row i + 1
    its node i; parents[b][i] is node i's parent node or -1), each padded to R rows:
    parent [B, R] (row 0: 0), kids [B, R, C] (each row's child rows in node order, -1 padding),
    anc [B, R, R] (row r's ancestor rows and itself, the root row 0 included), depth [B, R]."""
    B = len(parents)
    kid_lists = [[[] for _ in range(R)] for _ in range(B)]
    parent = torch.zeros(B, R, dtype=torch.long)
    depth = torch.zeros(B, R, dtype=torch.long)
    anc = torch.eye(R, dtype=torch.bool).repeat(B, 1, 1)
    for b, ps in enumerate(parents):
        anc[b, 0] = False
        anc[b, 0, 0] = True
        for i, p in enumerate(ps):
            r, pr = i + 1, p + 1
            parent[b, r] = pr
            depth[b, r] = depth[b, pr] + 1
            kid_lists[b][pr].append(r)
            anc[b, r] = anc[b, pr]
            anc[b, r, r] = True
    C = max(1, max(len(k) for ks in kid_lists for k in ks))
    kids = torch.tensor([[k + [-1] * (C - len(k)) for k in ks] for ks in kid_lists], dtype=torch.long).view(B, R, C)
    return dict(parent=parent, kids=kids, anc=anc, depth=depth)


def accept_tree(logits: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, tables: dict[str, torch.Tensor],
                q: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The multi-candidate rule over one pass of B tree rounds (DESIGN.md §12): logits [B, R, V]
    (row 0 the pending token, row i + 1 node i; R = the largest tree's nodes + 1), tokens [B, N]
    (N = R - 1; padding 0) and q [B, N, V] (node i's: the distribution its token was drawn from,
    given its parent and its earlier siblings) on the device; on the host counts [B] (nodes per
    tree), tree_tables(...) and each session's settings as accept_batch takes them.

    At every node u at once: its children c_1, c_2, ... are tried in order, each as one step of
    the chain rule against the target's current distribution p at u (x_c accepted with probability
    min(1, p(x_c) / q_c(x_c)); on a rejection p becomes normalize(max(0, p - q_c))); the first
    accepted child is u's choice, and p at the end is what u's next token is drawn from. The
    accepted path follows the choices from the root; greedy sessions take the argmax rule (a
    child is chosen if its token is the argmax at u). Uniforms: node i's coin is keyed
    (seed, position, VERIFY, i), the next token's draw (seed, position, VERIFY, count), so a tree
    that is a chain draws what the chain rule draws.

    Returns [B, 2 + N] on the device: n accepted, the next token, then per node 1 if it is on the
    accepted path (one host transfer for the lot)."""
    B, R, V = logits.shape
    dev = logits.device
    parent, kids, anc, depth = (to_device(tables[k], dev) for k in ("parent", "kids", "anc", "depth"))
    live = torch.arange(R, device=dev)[None, :] <= to_device(counts, dev)[:, None]  # [B, R] real rows
    tok_row = torch.cat([tokens.new_zeros(B, 1), tokens], 1)  # [B, R] the token of each row
    am = argmax_rows(logits)  # [B, R]
    ok_greedy = tok_row == am.gather(1, parent)  # [B, R]
    ok, nxt_rows = ok_greedy, am
    if not greedy.all():
        rows = lambda x: x.repeat_interleave(R)  # noqa: E731
        p = probs_from_logits_rows(logits.reshape(B * R, V), rows(temperature), rows(top_k), rows(top_p)).view(B, R, V).double()
        u = keyed_uniforms(seeds[:, None], positions[:, None], VERIFY, torch.arange(R), device=dev)  # [B, R]: node i's coin at i
        u_next = keyed_uniforms(seeds, positions, VERIFY, counts, device=dev)  # [B]
        chosen = torch.full((B, R), -1, dtype=torch.long, device=dev)
        qrow = torch.cat([q.new_zeros(B, 1, V), q], 1)  # [B, R, V] q by row
        # rank s of the siblings works on the rows that have an s-th child only (found in the host table, so
        # no sync): a wide node costs its own children's steps, not every row's in the pass
        has = [(tables["kids"][:, :, s] >= 0).nonzero() for s in range(kids.shape[2])]  # [M_s, 2] (tree, row) each
        for s, (b, r) in enumerate(t.unbind(1) for t in to_device(torch.cat(has), dev).split([len(h) for h in has])):
            if not len(b):
                continue
            c = kids[b, r, s]  # [M] the s-th child's row
            try_ = chosen[b, r] < 0
            x = tok_row[b, c]  # [M]
            pr, qc = p[b, r], qrow[b, c].double()  # [M, V]
            px, qx = pr.gather(1, x[:, None]).squeeze(1), qc.gather(1, x[:, None]).squeeze(1)
            take = try_ & (qx > 0) & (u[b, c - 1] * qx < px)  # as the chain rule
            chosen[b, r] = torch.where(take, c, chosen[b, r])
            rest = (pr - qc).clamp_(min=0)
            total = rest.sum(-1, keepdim=True)
            rest = torch.where(total > 0, rest / total.clamp(min=1e-300), pr)  # all mass cancelled (only if p = q_c): p
            p[b, r] = torch.where((try_ & ~take)[:, None], rest, pr)
        ok_s = chosen.gather(1, parent) == torch.arange(R, device=dev)[None, :]
        nxt_s = sample_with(p, u_next[:, None].expand(B, R))  # [B, R]: each row's next token if the path ends there
        g = to_device(greedy, dev)[:, None]
        ok, nxt_rows = torch.where(g, ok_greedy, ok_s), torch.where(g, am, nxt_s)
    ok = (ok & live) | (torch.arange(R, device=dev)[None, :] == 0)  # the root is always on the path
    good = ~(anc & ~ok[:, None, :]).any(2)  # [B, R]: every row from the root to it was chosen
    end = torch.where(good, depth + 1, 0).argmax(1)  # [B] the deepest such row (one per depth)
    n = depth.gather(1, end[:, None]).squeeze(1)
    nxt = nxt_rows.gather(1, end[:, None]).squeeze(1)
    on_path = anc[torch.arange(B, device=dev), end][:, 1:]  # [B, N]
    return torch.cat([n[:, None], nxt[:, None], on_path.long()], 1)
