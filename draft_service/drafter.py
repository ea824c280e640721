"""The draft model's side of a session: its KV cache, and proposing tau tokens with the
distribution each was sampled from (or one-hot proposals from prompt lookup).

The cache (per-layer K/V tensors, see specdec/batching.py) holds the tokens in
`DraftState.cached`; forward steps go through the DraftBatcher, which runs the steps of all
sessions together. Before each proposal it is cropped to the
longest prefix it shares with the context to draft from, and the missing tokens are fed first;
so it stays in step with the committed sequence after rejections, and with an assumed sequence
when pre-drafting.

Pre-drafting: while round k is verified, the draft assumes all its tau proposals are accepted,
guesses the bonus token (the draft's own argmax) and drafts round k+1 after it. Exact: the
proposals of round k+1 are still samples from q given their context, and are used only when
the verdict shows that context was right.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draft_service.batcher import DraftBatcher
from draft_service.lookup import lookup
from specdec.batching import kv_crop
from specdec.lm import LM
from specdec.validation import GenParams
from specdec.sampling import probs_from_logits, sample, sparsify
from specdec.v1 import specdec_pb2 as pb


class PredraftControl:
    """Tells a pre-draft in flight when to stop: reject() once the verdict rejected part of the
    round, or bonus(token) once the verifier's bonus token is known and differs from the guess."""

    def __init__(self):
        self._rejected = False
        self._bonus: int | None = None
        self.guess: int | None = None

    def reject(self) -> None:
        self._rejected = True

    def bonus(self, token: int) -> None:
        self._bonus = token

    def is_set(self) -> bool:
        return self._rejected or (self._bonus is not None and self.guess is not None and self._bonus != self.guess)


@dataclass
class DraftState:
    ids: list[int]  # committed: prompt + generated
    params: GenParams
    generator: torch.Generator
    kv: list = field(default_factory=list)  # per layer (K, V) [1, H, len(cached), D]
    cached: list[int] = field(default_factory=list)  # tokens the cache holds
    prompt_len: int = field(init=False)

    def __post_init__(self):
        self.prompt_len = len(self.ids)


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)  # x_1..x_tau
    q_counts: list[int] = field(default_factory=list)  # sparse
    q_ids: list[int] = field(default_factory=list)  # sparse
    q_probs: list[float] = field(default_factory=list)  # sparse (K per token) or dense (V per token)
    lookup: bool = False  # proposed by prompt lookup (one-hot q)

    def truncated(self, n: int, vocab_size: int) -> "Proposal":
        """The first n proposals with their q rows."""
        if n >= len(self.tokens):
            return self
        if self.q_counts:  # sparse
            k = sum(self.q_counts[:n])
            return Proposal(self.tokens[:n], self.q_counts[:n], self.q_ids[:k], self.q_probs[:k], self.lookup)
        return Proposal(self.tokens[:n], [], [], self.q_probs[: n * vocab_size] if self.q_probs else [], self.lookup)

    def to_round(self, number: int) -> pb.Round:
        return pb.Round(round=number, tokens=self.tokens, q_counts=self.q_counts, q_ids=self.q_ids, q_probs=self.q_probs)


class Drafter:
    def __init__(self, lm: LM):
        self.lm = lm
        self.batcher = DraftBatcher(lm.model)

    def new_state(self, params: GenParams) -> DraftState:
        # the draft's stream must differ from the verifier's (seeded with `seed`) yet follow from it
        g = torch.Generator().manual_seed((params.seed + 1) % (1 << 64))
        return DraftState(ids=list(params.prompt_ids), params=params, generator=g)

    def prefill(self, st: DraftState) -> None:
        if len(st.ids) > 1:
            _, st.kv = self.batcher.forward([], st.ids[:-1], logits=False)
            st.cached = st.ids[:-1]

    def _feed(self, st: DraftState, context: list[int]) -> torch.Tensor:
        """Brings the cache to hold all of `context`; returns the logits after it [V]."""
        keep = 0
        limit = min(len(st.cached), len(context) - 1)  # always feed at least the last token
        while keep < limit and st.cached[keep] == context[keep]:
            keep += 1
        logits, st.kv = self.batcher.forward(kv_crop(st.kv, keep), context[keep:])
        st.cached = list(context)
        return logits

    def propose(self, st: DraftState, tau: int, context: list[int] | None = None, stop: PredraftControl | None = None) -> Proposal:
        """Drafts up to tau tokens after `context` (default: the committed sequence)."""
        context = list(st.ids if context is None else context)
        prm, out = st.params, Proposal()
        for i in range(tau):
            if stop is not None and stop.is_set():
                break
            logits = self._feed(st, context)  # [V]
            greedy = prm.mode == pb.PROPOSAL_MODE_GREEDY  # ids-only: q is the one-hot at the argmax
            q = torch.softmax(logits, -1) if greedy else probs_from_logits(logits, prm.sampling)  # [V]
            if i and float(q.max()) < prm.early_stop_p:  # the draft is unsure: end the round here
                break
            if greedy:
                x = int(logits.argmax())
            elif prm.mode == pb.PROPOSAL_MODE_DENSE:
                x = sample(q, st.generator)
                out.q_probs.extend(q.tolist())
            else:
                ids, vals = sparsify(q, prm.sparse_k)  # [k'], [k'] renormalized q~
                x = int(ids[sample(vals, st.generator)])
                out.q_counts.append(len(ids))
                out.q_ids.extend(ids.tolist())
                out.q_probs.extend(vals.tolist())
            out.tokens.append(x)
            context.append(x)
        return out

    def predraft(self, st: DraftState, sent: Proposal, tau: int, ctl: PredraftControl) -> Proposal:
        """Assumes `sent` is all accepted and guesses the bonus token (ctl.guess, the draft's
        argmax); returns the round after it (cut short if ctl says the assumption failed)."""
        context = st.ids + sent.tokens
        ctl.guess = int(self._feed(st, context).argmax())
        return self.propose(st, tau, context + [ctl.guess], ctl)

    def lookup(self, st: DraftState, tau: int, min_ngram: int = 1) -> Proposal:
        """Prompt-lookup proposal with one-hot q in the session's mode ([] tokens if no match)."""
        tokens = lookup(st.ids, tau, min_ngram=min_ngram)
        out = Proposal(tokens=tokens, lookup=True)
        if st.params.mode == pb.PROPOSAL_MODE_SPARSE:
            out.q_counts, out.q_ids, out.q_probs = [1] * len(tokens), list(tokens), [1.0] * len(tokens)
        elif st.params.mode == pb.PROPOSAL_MODE_DENSE:
            for t in tokens:
                row = [0.0] * self.lm.vocab_size
                row[t] = 1.0
                out.q_probs.extend(row)
        return out
