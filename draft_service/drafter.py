"""The draft model's side of a session: its KV cache kept in step with the committed sequence,
and proposing tau tokens with the distribution each was sampled from.

Like the verifier, the draft cache holds at most ids[:-1]; before proposing it is cropped to
what is still committed, and whatever committed tokens it lacks (the pending token, plus the
last proposal when a whole round was accepted) are fed first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.lm import LM, cache_len, crop
from specdec.requests import GenParams
from specdec.sampling import probs_from_logits, sample, sparsify
from specdec.v1 import specdec_pb2 as pb


@dataclass
class DraftState:
    ids: list[int]  # committed: prompt + generated
    params: GenParams
    generator: torch.Generator
    cache: object
    prompt_len: int = field(init=False)

    def __post_init__(self):
        self.prompt_len = len(self.ids)


@dataclass
class Proposal:
    tokens: list[int]  # x_1..x_tau
    q_counts: list[int] = field(default_factory=list)  # sparse
    q_ids: list[int] = field(default_factory=list)  # sparse
    q_probs: list[float] = field(default_factory=list)  # sparse (K per token) or dense (V per token)
    top_probs: list[float] = field(default_factory=list)  # draft's max q at each position

    def to_round(self, number: int) -> pb.Round:
        return pb.Round(round=number, tokens=self.tokens, q_counts=self.q_counts, q_ids=self.q_ids, q_probs=self.q_probs)


class Drafter:
    def __init__(self, lm: LM):
        self.lm = lm

    def new_state(self, params: GenParams) -> DraftState:
        # the draft's stream must differ from the verifier's (seeded with `seed`) yet follow from it
        g = torch.Generator().manual_seed((params.seed + 1) % (1 << 64))
        return DraftState(ids=list(params.prompt_ids), params=params, generator=g, cache=self.lm.new_cache())

    def prefill(self, st: DraftState) -> None:
        if len(st.ids) > 1:
            self.lm.forward(st.ids[:-1], st.cache, last_only=True)

    def propose(self, st: DraftState, tau: int) -> Proposal:
        crop(st.cache, len(st.ids) - 1)
        feed = st.ids[cache_len(st.cache):]  # pending token(s) the cache lacks
        prm, out = st.params, Proposal(tokens=[])
        for _ in range(tau):
            logits = self.lm.forward(feed, st.cache)[-1]  # [V]
            if prm.mode == pb.PROPOSAL_MODE_GREEDY:
                # ids-only: q is the one-hot at the argmax, whatever the temperature
                x = int(logits.argmax())
                out.top_probs.append(float(torch.softmax(logits.float(), -1)[x]))
            else:
                q = probs_from_logits(logits, prm.sampling)  # [V]
                if prm.mode == pb.PROPOSAL_MODE_DENSE:
                    x = sample(q, st.generator)
                    out.q_probs.extend(q.tolist())
                    out.top_probs.append(float(q.max()))
                else:
                    ids, vals = sparsify(q, prm.sparse_k)  # [k'], [k'] renormalized q~
                    x = int(ids[sample(vals, st.generator)])
                    out.q_counts.append(len(ids))
                    out.q_ids.extend(ids.tolist())
                    out.q_probs.extend(vals.tolist())
                    out.top_probs.append(float(vals[0]))
            out.tokens.append(x)
            feed = [x]
        return out
