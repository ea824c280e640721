"""A verify session and its commit rule.

A session's committed sequence is `ids` (prompt + generated). Its cache always holds ids[:-1]:
the last committed token is "pending" and is the first input of the next pass. A round with
proposals x_1..x_tau therefore runs ONE forward over [pending, x_1..x_tau] (tau+1 logits: one
per proposal plus the bonus position), the acceptance rule keeps n of them, and `commit`
appends the accepted prefix and the next token, stops at the first end condition, and crops
the cache back to len(ids) - 1 (a rejection only moves the cache's length back).
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import Finish
from specdec.engine import KVCache
from specdec.sampling import Sampling


@dataclass
class Session:
    sid: int
    request_id: str
    ids: list[int]
    prompt_len: int
    max_new_tokens: int
    sampling: Sampling
    mode: int  # the proposal mode (specdec/proposal.py)
    seed: int  # keys the round's uniforms with the position (specdec/sampling.py keyed_uniforms)
    cache: KVCache
    reserved: int  # cache tokens reserved at admission
    next_round: int = 1
    prefill_s: float = 0.0  # from the prefill's queueing to the pass that put the prompt's last chunk in
    finish: Finish = Finish.NONE
    closed: bool = False
    released: object = None  # closed during a pass: (event loop, future) the scheduler thread settles once its room is back

    @property
    def generated(self) -> int:
        return len(self.ids) - self.prompt_len


@dataclass
class Verdict:
    num_accepted: int
    next_token: int | None
    finish: Finish
    forward_s: float = 0.0
    queue_s: float = 0.0
    row_cost_s: float = 0.0  # the verifier's load after the pass (passcost.PassCost)
    row_price: float = 0.0
    pass_rounds: int = 0  # the rounds verified in the same pass (this one included)
    path: list[int] | None = None  # a tree round's accepted nodes, root first


def kept(s: Session, new: list[int], eos: frozenset[int], max_context: int) -> tuple[int, Finish]:
    """How many of `new` commit keeps (up to the first end condition: EOS, max_new_tokens, the
    context limit), and that condition."""
    for i, t in enumerate(new, 1):
        if t in eos:
            return i, Finish.EOS
        if s.generated + i >= s.max_new_tokens:
            return i, Finish.LENGTH
        if len(s.ids) + i >= max_context:
            return i, Finish.CONTEXT
    return len(new), Finish.NONE


def commit(s: Session, new: list[int], n: int, cut: tuple[int, Finish]) -> Verdict:
    """Appends new = accepted + [next] up to the first end condition, cut = kept(s, new, ...)
    (EOS, max_new_tokens, the context limit: tokens past it are never emitted); crops the cache to
    len(ids) - 1."""
    k, finish = cut
    out = new[:k]
    s.ids.extend(out)
    s.finish = finish
    s.cache.crop(len(s.ids) - 1)
    return Verdict(num_accepted=min(n, len(out)), next_token=out[n] if len(out) > n else None, finish=finish)
