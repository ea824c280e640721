"""The draft model's side of a session: its KV cache, and proposing tau tokens with the
distribution each was sampled from (or one-hot proposals from prompt lookup).

The cache (a KVCache in the engine's pool, specdec/engine) holds the tokens in `DraftState.cached`; forward
steps go through the StepBatcher, which runs the steps of all sessions together. Before each
proposal it is cropped to the longest prefix it shares with the context to draft from, and the
missing tokens are fed first;
so it stays in step with the committed sequence after rejections, and with an assumed sequence
when pre-drafting.

Pre-drafting: while round k is verified, the draft assumes all its tau proposals are accepted,
guesses the bonus token (the draft's own argmax) and drafts round k+1 after it. Exact: the
proposals of round k+1 are still samples from q given their context, and are used only when
the verdict shows that context was right.

Each sample the draft draws at absolute position i uses the keyed uniform at (seed, i, DRAFT)
(specdec/sampling.py), so a pre-draft that is thrown away, or a step timed differently, changes
no later draw.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draft_service import tree
from draft_service.lookup import lookup
from draft_service.stepbatch import StepBatcher
from specdec.engine import KVCache
from specdec.lm import LM
from specdec.proposal import Proposal, ids_only, wire_q
from specdec.sampling import DRAFT, probs_from_logits, sample
from specdec.validation import GenParams

__all__ = ["Drafter", "DraftState", "PredraftControl", "Proposal"]


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
    cache: KVCache
    cached: list[int] = field(default_factory=list)  # tokens the cache holds
    prompt_len: int = field(init=False)

    def __post_init__(self):
        self.prompt_len = len(self.ids)


class Drafter:
    def __init__(self, lm: LM):
        self.lm = lm
        self.batcher = StepBatcher(lm.engine)

    def new_state(self, params: GenParams, max_context: int | None = None) -> DraftState:
        limit = max_context or self.lm.max_context
        ahead = 2 * params.tau + 2 + (tree.BEAM * params.tau if params.tree_budget else 0)  # pre-drafts look ahead; a tree's nodes
        room = min(len(params.prompt_ids) + params.max_new_tokens + ahead, limit)
        return DraftState(ids=list(params.prompt_ids), params=params, cache=KVCache(room))

    def prefill(self, st: DraftState) -> None:
        if len(st.ids) > 1:
            self.batcher.forward(st.cache, st.ids[:-1], logits=False)
            st.cached = st.ids[:-1]

    def _feed(self, st: DraftState, context: list[int]) -> torch.Tensor:
        """Brings the cache to hold all of `context`; returns the logits after it [V]."""
        keep = 0
        limit = min(len(st.cached), len(context) - 1)  # always feed at least the last token
        while keep < limit and st.cached[keep] == context[keep]:
            keep += 1
        st.cache.crop(keep)
        st.cached = st.cached[:keep]
        logits = self.batcher.forward(st.cache, context[keep:])
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
            if ids_only(prm.mode) or prm.sampling.greedy:  # q is the one-hot at the argmax
                if i and prm.early_stop_p > 0 and float(torch.softmax(logits, -1).max()) < prm.early_stop_p:
                    break  # the draft is unsure: end the round here
                x = int(logits.argmax())
                out.add_one_hot(x, prm.mode, logits.shape[-1])
                context.append(x)
                continue
            q = probs_from_logits(logits, prm.sampling)  # [V]
            if i and float(q.max()) < prm.early_stop_p:
                break
            vals, ids = wire_q(q, prm.mode, prm.sparse_k)  # what the wire carries is what the draft samples from
            j = sample(vals, prm.seed, len(context), DRAFT)
            x = j if ids is None else int(ids[j])
            out.add(x, prm.mode, vals.cpu(), None if ids is None else ids.cpu())
            context.append(x)
        return out

    def propose_tree(self, st: DraftState, budget: int, depth: int, context: list[int] | None = None,
                     stop: PredraftControl | None = None, floor: float = 0.0, cost: tuple[float, float] | None = None,
                     calibration: tree.Calibration | None = None) -> Proposal:
        """A tree of at most `budget` nodes and `depth` levels after `context`, expanding none less
        likely than `floor`, sized by `cost` and scored by `calibration` where given (draft_service/tree.py)."""
        return tree.grow(self, st, budget, depth, context, stop, floor, cost, calibration)

    def predraft(self, st: DraftState, sent: Proposal, tau: int, ctl: PredraftControl, budget: int = 0,
                 floor: float = 0.0, cost: tuple[float, float] | None = None, calibration: tree.Calibration | None = None) -> Proposal:
        """Assumes `sent` is all accepted (a tree: its most likely path) and guesses the bonus token
        (ctl.guess, the draft's argmax); returns the round after it (a tree where budget is given;
        cut short if ctl says the assumption failed)."""
        context = st.ids + sent.assumed()
        ctl.guess = int(self._feed(st, context).argmax())
        if budget:
            return self.propose_tree(st, budget, tau, context + [ctl.guess], ctl, floor, cost, calibration)
        return self.propose(st, tau, context + [ctl.guess], ctl)

    def lookup(self, st: DraftState, tau: int, min_ngram: int = 1) -> Proposal:
        """Prompt-lookup proposal with one-hot q in the session's mode ([] tokens if no match)."""
        return Proposal.one_hot(lookup(st.ids, tau, min_ngram=min_ngram), st.params.mode, self.lm.vocab_size)
