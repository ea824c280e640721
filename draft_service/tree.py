"""Drafting a token tree for one round (DESIGN.md §12), EAGLE-2 style.

Every node has a score, the draft's probability of its whole branch (the product of its tokens'
draft probabilities). The tree grows one level a pass: the BEAM best-scored nodes of the newest
level (none below `floor`, the verifier's row price) run through the draft in ONE pass
(StepBatcher.forward_tree: each node attends its own branch), and each gets up to BRANCH children.
Each node carries its q: the distribution its token was drawn from, given its parent and its
earlier siblings (one-hot where the session sends ids only). Its most likely path (the best child
at every step) is what a pre-draft assumes.

* Greedy and ids-only sessions: a node's children are the draft's most likely tokens, a function of
  the context alone, so any choice among them keeps the rule exact: a node is expanded while it is
  among the `budget` best found so far, and the round sends the `budget` best-scored nodes, parents
  before children (a child's score never exceeds its parent's, so the best nodes form a tree).
* Sampled sessions: a node's children are draws without replacement from its q (its top-k in
  sparse mode), each from what the earlier draws left, renormalized; the draws are keyed
  (seed, the round's base position, DRAFT_TREE, (parent + 1) * 64 + rank), so a round's tree depends on
  its context and seed only. The rule is exact only if whether a child is sent does not depend on
  the child's own token (else the sent child is no longer a draw from its q): so how many children
  a node gets is fixed before they are drawn (BRANCH, while the budget lasts, in the order the
  expanded nodes rank, but no more than q has entries of at least SAMPLED_MIN_Q, and one at least:
  else every node took BRANCH children of any probability, and a budget of 16 stopped every tree at
  depth 2; a q flat over many tokens gets one child, a chain), every
  child drawn is sent, and only which nodes to expand looks at scores.

A greedy tree's pre-draft grows several trees at once (`grow_outcomes`): one after each way the
round's likeliest path may end, each level of all of them in one pass.

The draft's cache holds the context after a round; the nodes it wrote for the tree are cropped off.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.costmodel import tree_size
from specdec.engine import Tree
from specdec.proposal import Proposal, ids_only, wire_q
from specdec.sampling import DRAFT_TREE, keyed_uniforms, probs_from_logits, sample_with

BEAM = 4  # nodes expanded per level
BRANCH = 4  # children taken per expanded node
SAMPLED_MIN_Q = 0.05  # a sampled node gets no more children than its q has entries this likely: a sure draft's tree grows deep, not wide
_KEY = 64  # a node's children's draws are keyed parent * _KEY + rank


RANKS = 2  # Calibration's classes of sibling rank: the draft's first choice, the others


class Calibration:
    """How often a greedy tree's node is accepted once its parent is, by its rank among its siblings
    (the draft's first choice, or another) and its draft probability (in tenths): learned from the verdicts, for a
    draft whose probabilities say too little (a distilled draft's first choice is often right
    far more often than its probability says). Starts at the draft's own probability, with the
    weight of PRIOR observations. Per draft model in a process (`CALIBRATIONS`); used by greedy and
    unseeded sessions only, whose tokens do not depend on it (greedy trees are exact whatever
    their shape; a seeded sampled tree must not depend on other requests)."""

    PRIOR = 4.0

    def __init__(self):
        self.hits = [[(b + 0.5) / 10 * self.PRIOR for b in range(10)] for _ in range(RANKS)]
        self.trials = [[self.PRIOR] * 10 for _ in range(RANKS)]

    def __call__(self, rank: int, p: float) -> float:
        r, b = _bin(rank, p)
        return self.hits[r][b] / self.trials[r][b]

    def observe(self, prop: Proposal, path: list[int]) -> None:
        """A tree round's verdict: every node whose parent was reached (the root, or on the path) was tested."""
        reached = {-1, *path}
        for i, (rank, p) in enumerate(prop.ranks):
            if prop.parents[i] in reached:
                r, b = _bin(rank, p)
                self.trials[r][b] += 1
                self.hits[r][b] += i in reached


def _bin(rank: int, p: float) -> tuple[int, int]:
    """A node's Calibration cell: its rank class and its probability's tenth."""
    return min(rank, RANKS - 1), min(int(p * 10), 9)


CALIBRATIONS: dict[str, Calibration] = {}  # per draft model name


@dataclass
class _Node:
    token: int
    parent: int  # index into the candidates, -1 for a child of the context
    score: float  # the draft's probability of the branch
    depth: int  # 1 for a child of the context
    q: tuple  # the wire q it was drawn from: (probs, ids or None), or None for one-hot
    written: int = -1  # its tree position in the draft's cache this round (specdec/engine/tree.py; -1: not run)
    rank: tuple[int, float] = (0, 1.0)  # its rank among its siblings and its draft probability (Calibration)
    kids: list[int] | None = None  # greedy, once expanded: the draft's candidate tokens after it, best first


@dataclass
class _Tree:
    """One tree being grown: after the node at tree position `at` (-1: the context's last token)."""
    at: int
    logits: torch.Tensor  # the draft's logits after its root [V]
    nodes: list[_Node]
    kids: list[int]  # greedy: the draft's candidate tokens after its root, best first (one more than it may take)


def grow(drafter, st, budget: int, depth: int, context: list[int] | None = None, stop=None, floor: float = 0.0,
         cost: tuple[float, float] | None = None, calibration: Calibration | None = None) -> Proposal:
    """A tree of at most `budget` nodes and `depth` levels after `context` (default: the committed
    sequence), expanding no node below `floor`, as a Proposal with parents and its most likely
    path (`guess`). cost: (seconds of a round besides its rows, seconds per row), where known:
    a greedy or ids-only tree then sends as many of its best nodes as pay (costmodel.tree_size).
    calibration: a greedy or ids-only tree's scores take it in place of the draft's probabilities."""
    context = list(st.ids if context is None else context)
    logits = drafter._feed(st, context)  # [V]; the cache now holds the context
    base = len(context)
    try:
        (t,) = _grow(drafter, st, Tree(base, ()), [_Tree(-1, logits, [], [])], budget, depth, stop, floor, calibration)
    finally:
        st.cache.crop(base)  # the tree's nodes go; the cache holds the context
    return _finish(t, budget, st.params, drafter.rows, floor, cost)


def grow_outcomes(drafter, st, path: list[int], roots: list[tuple[int, int]], budget: int, depth: int, stop=None,
                  floor: float = 0.0, cost: tuple[float, float] | None = None,
                  calibration: Calibration | None = None) -> list[Proposal]:
    """A greedy tree's pre-draft for several outcomes at once: for each root (j, x), the tree that
    `grow` makes after the committed sequence, path[:j] and x. The cache holds the committed sequence
    and `path` (a round's likeliest path); the roots are nodes of a tree over them, and every level
    of every outcome's tree runs in one pass (the roots must fit in the cache). Once `stop` (a
    PredraftControl) knows its verdict, only that outcome grows on; once it knows the verdict is
    none of them, none does. The cache holds the committed sequence and `path` after."""
    base = len(st.ids)
    chain = tuple(range(-1, len(path) - 1))  # path's tokens: tree positions 0..len-1, in the cache already
    if not roots or (stop is not None and stop.is_set()):
        return [Proposal(parents=[]) for _ in roots]
    tree = Tree(base, chain + tuple(j - 1 for j, _ in roots))
    try:
        logits = drafter.step_tree(st.cache, [x for _, x in roots], tree)  # [roots, V]
        ts = [_Tree(len(path) + k, logits[k], [], []) for k in range(len(roots))]
        ts = _grow(drafter, st, tree, ts, budget, depth, stop, floor, calibration, keys=roots)
    finally:
        st.cache.crop(base + len(path))
    return [_finish(t, budget, st.params, drafter.rows, floor, cost) for t in ts]


def _grow(drafter, st, tree: Tree, ts: list[_Tree], budget: int, depth: int, stop, floor: float,
          calibration: Calibration | None, keys: list | None = None) -> list[_Tree]:
    """Grows the trees `ts` level by level, all of them in one draft pass a level, on top of the
    nodes `tree` has in the cache already; returns them. keys: each tree's outcome, for `stop`."""
    prm = st.params
    sampled = not (ids_only(prm.mode) or prm.sampling.greedy)
    k0 = min(BRANCH, budget)
    for t in ts:
        _children(t, -1, t.logits, prm, tree.base, k0, floor, calibration)
    parents, level = list(tree.parents), 1
    while level < depth and not (stop is not None and stop.is_set()):
        known = stop.outcome() if keys is not None and stop is not None else None
        rows = []  # (tree, node, how many children)
        for k, t in enumerate(ts):
            if known is not None and keys[k] != known:
                continue  # the verdict is in: only its outcome grows on
            nodes = t.nodes
            cut = max(floor, 0.0 if sampled else _cutoff(nodes, budget))
            pick = sorted((i for i, n in enumerate(nodes) if n.depth == level and n.score >= cut), key=lambda i: -nodes[i].score)[:BEAM]
            if sampled:  # every child drawn stays: each expanded node's count is fixed before its draws (see above)
                room = budget - len(nodes)
                for i in pick:
                    if room > 0:
                        rows.append((t, i, min(BRANCH, room)))
                        room -= rows[-1][2]
            else:
                rows += [(t, i, k0) for i in pick]
        rows = rows[: max(0, st.cache.capacity - tree.base - len(parents))]  # near the context limit the cache has less room
        if not rows:
            break
        for t, i, _ in rows:
            n = t.nodes[i]
            n.written = len(parents)
            parents.append(t.nodes[n.parent].written if n.parent >= 0 else t.at)
        out = drafter.step_tree(st.cache, [t.nodes[i].token for t, i, _ in rows], Tree(tree.base, tuple(parents)))
        for r, (t, i, c) in enumerate(rows):
            _children(t, i, out[r], prm, tree.base, c, floor, calibration)
        level += 1
    return ts


def _finish(t: _Tree, budget: int, prm, vocab_size: int, floor: float, cost: tuple[float, float] | None) -> Proposal:
    sampled = not (ids_only(prm.mode) or prm.sampling.greedy)
    return _proposal(t, len(t.nodes) if sampled else budget, prm, vocab_size, 0.0 if sampled else floor, None if sampled else cost)


def _cutoff(nodes: list[_Node], budget: int) -> float:
    """The budget-th best score so far: a node below it cannot make the round, nor can its children."""
    scores = sorted((n.score for n in nodes), reverse=True)
    return scores[budget - 1] if len(scores) >= budget else 0.0


def _children(t: _Tree, parent: int, logits: torch.Tensor, prm, base: int, k: int, floor: float,
              calibration: Calibration | None = None) -> None:
    """Adds to t up to k children of `parent` (-1: t's root) from the draft's logits after it (fewer
    where q has fewer tokens; sampled: no more than q has tokens whose branch would reach `floor`,
    a count that q decides before any draw)."""
    nodes = t.nodes
    score, depth = (nodes[parent].score, nodes[parent].depth + 1) if parent >= 0 else (1.0, 1)
    if ids_only(prm.mode) or prm.sampling.greedy:  # the draft's top tokens, q one-hot
        probs = torch.softmax(logits.float(), -1) if prm.sampling.greedy else probs_from_logits(logits, prm.sampling)
        if not bool(torch.isfinite(probs).all()):  # else no child has mass, and the round goes out empty: a broken draft unseen
            raise ValueError("the model's probabilities have no mass to draw from (its logits are not finite)")
        vals, ids = torch.topk(probs, min(k + 1, probs.shape[-1]))
        kids = [x for v, x in zip(vals.tolist(), ids.tolist()) if v > 0]
        if parent >= 0:
            nodes[parent].kids = kids
        else:
            t.kids = kids
        for r, (v, x) in enumerate(zip(vals.tolist()[:k], ids.tolist()[:k])):
            if v > 0:
                nodes.append(_Node(x, parent, score * (calibration(r, v) if calibration else v), depth, None, rank=(r, v)))
        return
    q = probs_from_logits(logits, prm.sampling)  # [V]
    vals, ids = wire_q(q, prm.mode, prm.sparse_k)  # what the wire carries is what the draft samples from
    k = min(k, max(1, int(((vals * score >= floor) & (vals >= SAMPLED_MIN_Q)).sum())))  # q's alone, before any draw
    left = vals.double()
    u = keyed_uniforms(prm.seed, base, DRAFT_TREE, torch.arange(k) + (parent + 1) * _KEY).tolist()
    for r in range(k):
        total = float(left.sum())
        if total <= 0:
            break
        cur = (left / total).float()
        j = int(sample_with(cur, torch.tensor(u[r], dtype=torch.float64, device=cur.device)))  # not a CPU tensor beside CUDA's
        keep = cur > 0
        wire = (cur[keep], None if ids is None else ids[keep]) if ids is not None else (cur, None)
        x = j if ids is None else int(ids[j])
        t.nodes.append(_Node(x, parent, score * float(vals[j]), depth, wire))
        left[j] = 0.0


def _proposal(t: _Tree, budget: int, prm, vocab_size: int, floor: float, cost: tuple[float, float] | None) -> Proposal:
    """The budget best nodes of t (ties: shallower first) from `floor` up (the best one in any case), as
    many as pay where `cost` is given, parents before children and siblings in the order they were
    drawn, as a Proposal. A greedy tree's `alts`: at each step of its likeliest path, the draft's
    best token there that the round does not send (what a pre-draft guesses if the path ends there)."""
    nodes = t.nodes
    ranked = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))
    best = ranked[:1] + [i for i in ranked[1:budget] if nodes[i].score >= floor]
    if cost is not None:
        best = best[: tree_size([nodes[i].score for i in best], *cost)]
    order = sorted(best, key=lambda i: (nodes[i].depth, i))
    at = {i: k for k, i in enumerate(order)}
    out = Proposal(parents=[])
    for i in order:
        n = nodes[i]
        out.ranks.append(n.rank)
        if n.q is None:
            out.add_one_hot(n.token, prm.mode, vocab_size)
        else:
            out.add(n.token, prm.mode, n.q[0].cpu(), None if n.q[1] is None else n.q[1].cpu())
        out.parents.append(at[n.parent] if n.parent >= 0 else -1)
    k = -1  # the most likely path: the best-scored child at every step
    while True:
        kids = [c for c in range(len(order)) if out.parents[c] == k]
        if not kids:
            break
        if prm.sampling.greedy:
            known, sent = t.kids if k < 0 else nodes[order[k]].kids or [], {out.tokens[c] for c in kids}
            out.alts.append(tuple(x for x in known if x not in sent)[:1])
        k = max(kids, key=lambda c: (nodes[order[c]].score, -c))
        out.guess.append(k)
    return out
