"""The draft model's side of a session: its KV cache, and proposing tau tokens with the
distribution each was sampled from (or one-hot proposals from prompt lookup).

The cache (a KVCache in the engine's pool, specdec/engine) holds the tokens in `DraftState.cached`; forward
steps go through the StepBatcher, which runs the steps of all sessions together. Before each
proposal it is cropped to the longest prefix it shares with the context to draft from, and the
missing tokens are fed first;
so it stays in step with the committed sequence after rejections, and with an assumed sequence
when pre-drafting.

Pre-drafting: while round k is verified, the draft assumes all its tau proposals are accepted
(a tree: its likeliest path), guesses the bonus token (the draft's own argmax) and drafts round
k+1 after it. A greedy round prepares more outcomes at once, while the model serves no other
session: besides that one, each "the first j proposals accepted, then the verifier's token is the
draft's next choice at j" (a chain: its second choice and CHOICES, `outcomes`; a tree: its best
token the round does not send there, tree.grow_outcomes), all in one batched pass a step. Exact: the proposals of round k+1 are
still the draft's own given their context, and are used only when the verdict shows that context
was right.

Each sample the draft draws at absolute position i uses the keyed uniform at (seed, i, DRAFT)
(specdec/sampling.py), so a pre-draft that is thrown away, or a step timed differently, changes
no later draw.
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field

import torch

from draft_service import tree
from draft_service.lookup import lookup
from draft_service.stepbatch import StepBatcher
from specdec.engine import PREFILL_CHUNK, KVCache, Tree
from specdec.lm import LM
from specdec.proposal import Proposal, ids_only, wire_q
from specdec.sampling import DRAFT, probs_from_logits, sample
from specdec.validation import GenParams

__all__ = ["Drafter", "DraftState", "PredraftControl", "Proposal"]


# a greedy chain's pre-draft follows each rejection with each of the draft's next this many choices (1: its second);
# 2 prepared more outcomes but was no faster on the shipped pair (bench/results/ENGINE.md)
CHOICES = 1
Outcome = tuple[int, int]  # a round's verdict as a pre-draft sees it: (tokens accepted, the verifier's next token)


class PredraftControl:
    """Between a pre-draft in flight and the decode loop: the pre-draft publishes the outcomes it
    prepares (`wanted`, once it knows them); the loop tells it the verdict's (`verdict`, None for
    one no pre-draft can follow: a tree off its likeliest path, a round without a next token).
    is_set() once the verdict is known and not prepared: the pre-draft stops after its step."""

    def __init__(self):
        self._verdict: Outcome | None = None
        self._known = False
        self.wanted: set[Outcome] | None = None

    def verdict(self, outcome: Outcome | None) -> None:
        self._verdict, self._known = outcome, True

    def outcome(self) -> Outcome | None:
        """The verdict, once known and prepared; else None."""
        return self._verdict if self._known and self.wanted is not None and self._verdict in self.wanted else None

    def is_set(self) -> bool:
        return self._known and (self._verdict is None or (self.wanted is not None and self._verdict not in self.wanted))


class Gone(Exception):
    """The session ended while its draft fed the model a long span in a thread (Drafter._fill); the
    loop that started the thread has ended, so no one awaits this but the thread's own end."""



def top_probability(logits: torch.Tensor, sampling) -> torch.Tensor:
    """The draft's top probability, as early_stop_p compares it: of the distribution the session
    samples from (temperature, top-k, top-p), or of the model's own softmax where it is greedy.
    (An ids-only sampled round read the raw softmax, a sparse or dense one the sampled
    distribution: the same threshold stopped them at different points.)"""
    return (torch.softmax(logits, -1) if sampling.greedy else probs_from_logits(logits, sampling)).max()

def shared_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of a's and b's common prefix, at most `limit`. They differ, if at all, in their
    last few tokens (a round's drafted ones), so whole prefixes are compared from the end in
    C-speed list comparisons, backing off by doubling steps, and only the last gap is scanned in
    Python: a scan from the start cost 1.4 ms a draft step at 32k tokens."""
    keep, step = limit, 1
    while keep > 0 and a[:keep] != b[:keep]:
        keep, step = max(0, keep - step), 2 * step
    while keep < limit and a[keep] == b[keep]:
        keep += 1
    return keep


@dataclass
class DraftState:
    ids: list[int]  # committed: prompt + generated
    params: GenParams
    cache: KVCache
    cached: list[int] = field(default_factory=list)  # tokens the cache holds
    prompt_len: int = field(init=False)
    # set when the session ends (its client left): a long feed in a thread (the prompt's prefill, a catch-up after a
    # run) stops before its next chunk (Drafter._fill)
    gone: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.prompt_len = len(self.ids)


class Drafter:
    def __init__(self, lm: LM):
        self.lm = lm
        self.batcher = StepBatcher(lm.engine)
        self._embeds = lm.model.get_input_embeddings().weight.shape[0]  # ids the model can be fed
        self._live = 0  # sessions whose decode loops run now, or their last pre-drafts (`serving`)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def serving(self):
        """Held by a session's decode loop while it runs (and until a pre-draft it leaves running ends):
        how many sessions the model serves at once."""
        with self._lock:
            self._live += 1
        try:
            yield
        finally:
            with self._lock:
                self._live -= 1

    @property
    def serving_now(self) -> int:
        """Sessions the model serves now (decode loops running, or their pre-drafts finishing)."""
        return self._live

    def shared(self) -> bool:
        """Whether the model serves other sessions beside one: then its spare steps are theirs."""
        return self._live > 1

    @property
    def rows(self) -> int:
        """The ids q is over on the wire: the target's output rows (LM.peer_rows, where its model
        has other rows over the same tokenizer), else the draft's own."""
        return self.lm.peer_rows or self.lm.vocab_size

    def step(self, cache: KVCache, tokens: list[int], logits: bool = True) -> torch.Tensor | None:
        """StepBatcher.forward in the target's rows: logits cut to them (the draft's extra rows are
        padding past the shared tokenizer) or padded with -inf (ids it never proposes); an id past
        the draft's own rows (a target's padding row, never a token) is fed to the model as 0,
        which changes its guesses only."""
        return self._fit(self.batcher.forward(cache, self._ids(tokens), logits))

    def step_tree(self, cache: KVCache, tokens: list[int], tree: Tree) -> torch.Tensor:
        """StepBatcher.forward_tree in the target's rows (as `step`)."""
        return self._fit(self.batcher.forward_tree(cache, self._ids(tokens), tree))

    def _ids(self, tokens: list[int]) -> list[int]:
        return tokens if self.rows <= self._embeds else [t if t < self._embeds else 0 for t in tokens]

    def _fit(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        R = self.rows
        if logits is None or logits.shape[-1] == R:
            return logits
        if R < logits.shape[-1]:
            return logits[..., :R]
        return torch.nn.functional.pad(logits, (0, R - logits.shape[-1]), value=float("-inf"))

    def new_state(self, params: GenParams, max_context: int | None = None) -> DraftState:
        limit = max_context or self.lm.max_context
        # pre-drafts look ahead: a greedy round's outcomes, up to CHOICES * tau + 1 (a tree: tau + 1), each a chain of
        # tau (`outcomes`) or a tree's expanded nodes, up to BEAM a level (tree.grow_outcomes); else one tree's, or none
        grown = tree.BEAM * params.tau if params.tree_budget else params.tau  # one outcome's
        outcomes = CHOICES * params.tau + 1 if params.sampling.greedy else int(bool(params.tree_budget))
        ahead = 2 * params.tau + 2 + outcomes * grown
        room = min(len(params.prompt_ids) + params.max_new_tokens + ahead, limit)
        return DraftState(ids=list(params.prompt_ids), params=params, cache=KVCache(room))

    def prefill(self, st: DraftState) -> None:
        """The prompt (all but its last token) into the cache (_fill: a session gone meanwhile
        raises Gone and leaves the cache empty)."""
        ids = st.ids[:-1]
        self._fill(st, ids, logits=False)
        st.cached = ids

    def _fill(self, st: DraftState, tokens: list[int], logits: bool = True) -> torch.Tensor | None:
        """`tokens` after what the cache holds, PREFILL_CHUNK at a time (StepBatcher.forward's own
        chunks); the logits after the last [V], or None. Once `st.gone` is set it stops before the
        next chunk, crops the cache back to where it began and raises Gone: a client that left does
        not hold the draft's model for the rest of a long prompt."""
        begin, out = st.cache.length, None
        for start in range(0, len(tokens), PREFILL_CHUNK):
            if st.gone.is_set():
                st.cache.crop(begin)
                raise Gone
            chunk = tokens[start : start + PREFILL_CHUNK]
            out = self.step(st.cache, chunk, logits and start + len(chunk) == len(tokens))
        return out

    def _feed(self, st: DraftState, context: list[int]) -> torch.Tensor:
        """Brings the cache to hold all of `context`; returns the logits after it [V]. The first
        feed after a session started in a run is its whole prompt (_fill: stops if the session ends)."""
        keep = shared_prefix(st.cached, context, min(len(st.cached), len(context) - 1))  # always feed at least the last token
        st.cache.crop(keep)
        st.cached = st.cached[:keep]
        logits = self._fill(st, context[keep:])
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
                if i and prm.early_stop_p > 0 and float(top_probability(logits, prm.sampling)) < prm.early_stop_p:
                    break  # the draft is unsure: end the round here
                top = torch.topk(logits, 1 + CHOICES)
                best, x, *alts = torch.cat((top.values[:1].double(), top.indices.double())).tolist()  # one host sync
                if math.isnan(best) or best == -math.inf:  # topk takes a NaN for the largest: the round would carry garbage, a broken draft unseen
                    raise ValueError("the model's probabilities have no mass to draw from (its logits are not finite)")
                x, alts = int(x), [int(a) for a in alts]
                out.add_one_hot(x, prm.mode, logits.shape[-1])
                out.alts.append(tuple(alts))  # the next choices: a greedy pre-draft's guesses where x is rejected
                context.append(x)
                continue
            q = probs_from_logits(logits, prm.sampling)  # [V]
            if i and prm.early_stop_p > 0 and float(q.max()) < prm.early_stop_p:  # no host sync where it is off
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
                 floor: float = 0.0, cost: tuple[float, float] | None = None,
                 calibration: tree.Calibration | None = None) -> dict[Outcome, Proposal]:
        """The next round for each outcome of `sent` it prepares: `sent` all accepted (a tree: its
        most likely path) with the draft's argmax as the bonus token (a tree where budget is
        given), and for a greedy round with its next choices (`sent.alts`) also each outcome that
        keeps its first j proposals (a tree: of its likeliest path) and gets one of the draft's
        next choices at j (a chain: `outcomes`; a tree: tree.grow_outcomes), unless the model
        serves other sessions meanwhile (`shared`): their steps come first. Cut short once ctl
        says the verdict is none of them."""
        assumed = sent.assumed()
        context = st.ids + assumed
        guess = int(self._feed(st, context).argmax())
        several = bool(sent.alts) and st.params.sampling.greedy and not self.shared()
        if several and not budget and sent.parents is None:
            return self.outcomes(st, sent, tau, guess, ctl)
        if several and budget and sent.parents is not None:  # a greedy tree: each end of its likeliest path, at once
            roots = [(len(assumed), guess)] + [(j, a) for j, alts in enumerate(sent.alts) for a in alts]
            roots = roots[: max(0, st.cache.capacity - len(context))]  # near the context limit the cache has less room
            ctl.wanted = set(roots)
            return dict(zip(roots, tree.grow_outcomes(self, st, assumed, roots, budget, tau, ctl, floor, cost, calibration)))
        ctl.wanted = {(len(assumed), guess)}
        after = context + [guess]
        prop = self.propose_tree(st, budget, tau, after, ctl, floor, cost, calibration) if budget else self.propose(st, tau, after, ctl)
        return {(len(assumed), guess): prop}

    def outcomes(self, st: DraftState, sent: Proposal, tau: int, guess: int, ctl: PredraftControl) -> dict[Outcome, Proposal]:
        """A greedy chain's pre-draft for several outcomes at once: all of `sent` accepted with
        `guess` next, and each "sent.tokens[:j] accepted, then one of sent.alts[j]". The cache
        holds the context and sent's tokens (`predraft` fed them); each outcome's next token is a node of a
        tree over them, and every step runs the outcomes still open as one tree pass, each row
        attending its own branch. Once the verdict is known only its outcome runs on. The cache
        holds the context and sent's tokens after (the next feed brings it to the outcome's)."""
        prm, V, base = st.params, self.rows, len(st.ids)
        heads = [(len(sent.tokens), guess, len(sent.tokens) - 1)] + [(j, a, j - 1) for j, alts in enumerate(sent.alts) for a in alts]
        parents = list(range(-1, len(sent.tokens) - 1))  # the chain of sent's tokens: nodes 0..len-1, in the cache
        props, leaf, run = {}, {}, []  # per outcome its proposal and newest node; the outcomes to run and their tokens
        for n, c, parent in heads:
            props[n, c] = Proposal()
            parents.append(parent)
            leaf[n, c] = len(parents) - 1
            run.append(((n, c), c))
        ctl.wanted = set(props)
        try:
            for i in range(tau):
                if ctl.is_set() or base + len(parents) > st.cache.capacity:  # near the context limit the cache has less room
                    break
                logits = self.step_tree(st.cache, [x for _, x in run], Tree(base, tuple(parents)))  # [len(run), V]
                top = torch.topk(logits, 1 + CHOICES, dim=-1).indices.tolist()
                known, nxt = ctl.outcome(), []
                for k, (o, _) in enumerate(run):
                    if i and prm.early_stop_p > 0 and float(torch.softmax(logits[k], -1).max()) < prm.early_stop_p:
                        continue  # the draft is unsure: that outcome's round ends here
                    if known is not None and o != known:
                        continue  # the verdict is in: only its outcome runs on
                    props[o].add_one_hot(top[k][0], prm.mode, V)
                    props[o].alts.append(tuple(top[k][1:]))
                    nxt.append((o, top[k][0]))
                for o, x in nxt:
                    parents.append(leaf[o])
                    leaf[o] = len(parents) - 1
                run = nxt
                if not run:
                    break
        finally:
            st.cache.crop(base + len(sent.tokens))  # the outcomes' nodes go; the cache holds the context and sent's tokens
        return props

    def lookup(self, st: DraftState, tau: int, min_ngram: int = 1) -> Proposal:
        """Prompt-lookup proposal with one-hot q in the session's mode ([] tokens if no match)."""
        return Proposal.one_hot(lookup(st.ids, tau, min_ngram=min_ngram), st.params.mode, self.rows)
