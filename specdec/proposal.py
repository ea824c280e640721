"""The proposal codec: a round's proposed tokens and the distributions q they were drawn from,
as the draft builds them (`Proposal`) and as the wire carries them (`pb.Round`), in the three
proposal modes (DESIGN.md §4):

  greedy (ids-only)  tokens only; q is the one-hot at each token
  sparse (default)   per token, the top-K ids of q and their renormalized probabilities:
                     q_counts[i] entries of q_ids / q_probs belong to token i
  dense              per token, all V probabilities of q in q_probs

A tree round (DESIGN.md §12) adds each token's parent (`Proposal.parents`, `decode_parents`); q is
then per node, in the same modes.

`Proposal.to_round` encodes; `decode_round` checks every wire rule and decodes to the token ids
and a `RoundQ`: q's entries as the wire carried them, which the verifier's pass scatters into one
[B, T, V] table on its device (verify_service/jobs.py `_q`). Both sides use this module, and
tests/test_proposal.py round-trips it.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch

from specdec.errors import invalid
from specdec.sampling import sparsify
from specdec.v1 import specdec_pb2 as pb

MAX_ROUND_TOKENS = 64  # proposals per round the verifier accepts, a tree's nodes included (ModelInfo.max_tree_budget)
PROB_TOL = 1e-3  # how far a row of q may sum from 1


@dataclass(frozen=True)
class RoundQ:
    """A round's q, a [tau, V] table, as its nonzero entries: probs[e] at (rows[e], ids[e]), each
    row divided by its sum. On the host, a few entries a row (sparse mode: K; ids-only: 1), not the
    vocabulary's V: a dense host table per round cost 5.8 ms a round to build and check at V = 128k,
    and 191 ms a pass to gather 64 sessions' before their one copy to the device."""
    tau: int
    rows: torch.Tensor  # [E] int64
    ids: torch.Tensor  # [E] int64
    probs: torch.Tensor  # [E] float32

    def cut(self, k: int) -> RoundQ:
        """The first k rows' q (a round cut to what the session may still emit)."""
        keep = self.rows < k
        return RoundQ(max(0, min(k, self.tau)), self.rows[keep], self.ids[keep], self.probs[keep])

    def dense(self, V: int) -> torch.Tensor:
        """[tau, V] float32 (tests, and a look at one round)."""
        return torch.zeros(self.tau, V).index_put_((self.rows, self.ids), self.probs)


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)  # x_1..x_tau
    q_counts: list[int] = field(default_factory=list)  # sparse
    q_ids: list[int] = field(default_factory=list)  # sparse
    q_probs: list[float] = field(default_factory=list)  # sparse (K per token) or dense (V per token)
    lookup: bool = False  # proposed by prompt lookup (one-hot q)
    parents: list[int] | None = None  # a tree: each token's parent token, or -1 (the pending token)
    guess: list[int] = field(default_factory=list)  # a tree: its most likely path (indices), what a pre-draft assumes
    ranks: list[tuple[int, float]] = field(default_factory=list)  # a tree: each node's rank among its siblings, draft probability
    alts: list[tuple[int, ...]] = field(default_factory=list)  # a draft model's chain: its next choices at each token (not sent; pre-drafts guess them)

    def to_round(self, number: int) -> pb.Round:
        return pb.Round(round=number, tokens=self.tokens, q_counts=self.q_counts, q_ids=self.q_ids, q_probs=self.q_probs,
                        parents=self.parents or [])

    def prefix(self, k: int) -> Proposal:
        """A chain's first k proposals with their q (a pre-draft cut to what the verifier's load allows)."""
        assert self.parents is None, "a tree is not cut by length"
        n = len(self.tokens)
        if k >= n:
            return self
        if self.q_counts:  # sparse: q_counts[i] entries per token
            m = sum(self.q_counts[:k])
            q_ids, q_probs = self.q_ids[:m], self.q_probs[:m]
        else:  # dense (V per token) or none
            q_ids, q_probs = [], self.q_probs[: len(self.q_probs) // n * k]
        return Proposal(self.tokens[:k], self.q_counts[:k], q_ids, q_probs, self.lookup, alts=self.alts[:k])

    def assumed(self) -> list[int]:
        """The tokens a pre-draft after this round assumes accepted: a chain's all, a tree's most likely path."""
        return self.tokens if self.parents is None else [self.tokens[i] for i in self.guess]

    def add(self, token: int, mode: int, q: torch.Tensor | None = None, q_ids: torch.Tensor | None = None) -> None:
        """Appends one proposal with q as `wire_q` gives it: dense mode takes q [V]; sparse mode
        q~ [k] (renormalized) with q_ids [k]; ids-only mode nothing."""
        self.tokens.append(token)
        if mode == pb.PROPOSAL_MODE_DENSE:
            self.q_probs.extend(q.tolist())
        elif mode == pb.PROPOSAL_MODE_SPARSE:
            self.q_counts.append(len(q_ids))
            self.q_ids.extend(q_ids.tolist())
            self.q_probs.extend(q.tolist())

    def add_one_hot(self, token: int, mode: int, vocab_size: int) -> None:
        """Appends one proposal whose q is the one-hot at `token` (greedy drafting, prompt lookup),
        in the session's mode."""
        if mode == pb.PROPOSAL_MODE_SPARSE:
            self.add(token, mode, torch.ones(1), torch.tensor([token]))
        elif mode == pb.PROPOSAL_MODE_DENSE:
            self.add(token, mode, torch.nn.functional.one_hot(torch.tensor(token), vocab_size).float())
        else:
            self.add(token, mode)

    @classmethod
    def one_hot(cls, tokens: list[int], mode: int, vocab_size: int) -> "Proposal":
        """Proposals with q = one-hot (prompt lookup), encoded in the session's mode."""
        out = cls(lookup=True)
        for t in tokens:
            out.add_one_hot(t, mode, vocab_size)
        return out


def ids_only(mode: int) -> bool:
    """Whether `mode` sends no q: the verifier takes q as the one-hot at each proposal, so the draft
    proposes its argmax."""
    return mode == pb.PROPOSAL_MODE_GREEDY


def wire_q(q: torch.Tensor, mode: int, sparse_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The draft distribution q [V] as `mode` carries it, which is also the distribution the draft
    samples its proposal from: dense, (q, None); sparse, its top-k renormalized (q~ [k'], ids [k']).
    Raises ValueError where q has no mass to draw from (the draft's logits are not finite): the
    sparse form dropped NaN entries and failed later in an unrelated error, or, in a tree, sent an
    empty round and hid the broken draft."""
    total = float(q.sum())  # one host sync: a NaN or an infinity anywhere makes the sum not finite (q >= 0)
    if not (math.isfinite(total) and total > 0):
        raise ValueError("the model's probabilities have no mass to draw from (its logits are not finite)")
    if mode == pb.PROPOSAL_MODE_DENSE:
        return q, None
    ids, vals = sparsify(q, sparse_k)
    return vals, ids


def decode_parents(r: pb.Round) -> list[int] | None:
    """A tree round's parents (each an earlier token's index, or -1 for the pending token), or None
    for a chain. Raises RequestError(INVALID_ARGUMENT) naming the field."""
    if not r.parents:
        return None
    if len(r.parents) != len(r.tokens):
        raise invalid(f"round.parents: {len(r.parents)} parents for {len(r.tokens)} tokens (one per token, or none for a chain)")
    for i, p in enumerate(r.parents):
        if not -1 <= p < i:
            raise invalid(f"round.parents[{i}]: {p}; a parent is -1 (the pending token) or the index of an earlier token")
    return list(r.parents)


def decode_round(r: pb.Round, *, expected: int, room: int, vocab_size: int, mode: int, greedy: bool) -> tuple[torch.Tensor, RoundQ | None]:
    """Checks a Round against its session (the round number expected next, the room left in the
    context, the vocabulary, the session's mode) and returns (tokens [tau] int64, its q as a
    RoundQ on the host, or None when the session is greedy: q plays no part in the greedy rule,
    but it is checked all the same). Only a dense round builds a [tau, V] table (its wire holds as
    many values).
    Raises RequestError(INVALID_ARGUMENT) naming the field on any violation."""
    V = vocab_size
    if r.round != expected:
        raise invalid(f"round: expected {expected}, got {r.round} (out of order or repeated)")
    tau = len(r.tokens)
    if tau > min(MAX_ROUND_TOKENS, room):
        raise invalid(f"round.tokens: {tau} proposals; at most {min(MAX_ROUND_TOKENS, room)} fit")
    bad = [t for t in r.tokens if not 0 <= t < V]
    if bad:
        raise invalid(f"round.tokens: token id {bad[0]} is outside the vocabulary [0, {V})")
    tokens = torch.tensor(list(r.tokens), dtype=torch.long)
    if mode == pb.PROPOSAL_MODE_GREEDY:
        if r.q_ids or r.q_probs or r.q_counts:
            raise invalid("round.q_*: greedy (ids-only) mode sends no probabilities")
        return tokens, None if greedy else RoundQ(tau, torch.arange(tau), tokens, torch.ones(tau))  # the one-hot at each token
    # a greedy session (temperature 0) checks q as well (DESIGN.md §11: every round is checked), then drops it
    if mode == pb.PROPOSAL_MODE_DENSE:  # counts before any per-element work
        if r.q_ids or r.q_counts or len(r.q_probs) != tau * V:
            raise invalid(f"round.q_probs: dense mode needs tau*V = {tau * V} values and no q_ids/q_counts, got {len(r.q_probs)}")
        probs = torch.tensor(list(r.q_probs), dtype=torch.float32)
        rows, ids = probs.view(tau, V).nonzero(as_tuple=True)  # (a NaN is nonzero: refused below)
        probs = probs.view(tau, V)[rows, ids]
    else:
        if len(r.q_counts) != tau or len(r.q_ids) != len(r.q_probs) or sum(r.q_counts) != len(r.q_ids):
            raise invalid("round.q_counts/q_ids/q_probs: lengths disagree (one count per token, one prob per id)")
        if tau and max(r.q_counts) > V:
            raise invalid(f"round.q_counts: {max(r.q_counts)} ids for one position; a position has at most V = {V} distinct ids")
        probs = torch.tensor(list(r.q_probs), dtype=torch.float32)
        ids = torch.tensor(list(r.q_ids), dtype=torch.long)
        if ids.numel() and (ids.min() < 0 or ids.max() >= V):
            raise invalid(f"round.q_ids: an id is outside the vocabulary [0, {V})")
        rows = torch.repeat_interleave(torch.arange(tau), torch.tensor(list(r.q_counts), dtype=torch.long))
        if torch.unique(rows * V + ids).numel() != ids.numel():
            raise invalid("round.q_ids: an id repeats within one position")
    if not torch.isfinite(probs).all() or (probs < 0).any() or (probs > 1 + PROB_TOL).any():
        raise invalid("round.q_probs: probabilities must be finite and in [0, 1]")
    sums = torch.zeros(tau, dtype=torch.float64).index_add_(0, rows, probs.double()).float()  # the dense table's row sums, in its order
    if tau and ((sums - 1).abs() > PROB_TOL).any():
        raise invalid(f"round.q_probs: each position must sum to 1 (got {sums.tolist()})")
    drawn = torch.zeros(tau, dtype=torch.long).index_add_(0, rows, ((ids == tokens[rows]) & (probs > 0)).long())  # per row: its token's entry
    if tau and not (drawn > 0).all():
        raise invalid("round.q_probs: a proposed token has no probability in its q (it cannot have been sampled from it)")
    if greedy:
        return tokens, None
    # the rule is exact for the q a token was drawn from: a draw from a row divides by its sum
    return tokens, RoundQ(tau, rows, ids, probs / sums[rows])
