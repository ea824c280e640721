"""The pass layout (forward.py's packed pass): which inputs attend together, and the index
tensors that place every row's keys and queries.

* **Short inputs** (steps, rounds, short prefill chunks: up to ROW_BY_ROW tokens) go into groups
  by size (up to 8, 16, 32, 64 tokens: one group in a steady decode). A group's keys are read
  from the pool with one gather of their pages, [B, H_kv, Lb, D], Lb the group's longest session padded to a
  multiple of PAGE, and on the CPU each QUERY is its own attention problem: the queries of a
  session are laid out along the head axis ([B, H_kv * n * rep, 1, D], GQA's kv head h // (n * rep)
  is still the query's own), each with its own causal (and sliding-window) mask row. So a query is
  computed exactly as a one-token step at its position computes it, whatever the group's size, its
  other sessions or its Lb: on the CPU, with one thread, bitwise (tests/test_pool.py), because
  masked key positions add exact zeros and every key length is a multiple of PAGE. The CPU tier's
  query attention reads the keys in place instead, through the group's slots (`Group.slots`). There an input
  whose pages are consecutive and hold VIEW_BYTES of a layer's keys attends in a group of its
  own, reading them as a view of the pool (`_viewed`): copying them would cost more.
* **Long inputs** (prefill chunks of more tokens) attend in one masked call each, queries
  together: their numbers then depend on the chunk alone, whose bounds depend on the prompt alone.
* **Trees** (tree.py) are cut into paths on the CPU (`_branch_groups`), else masked (Group.tree).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.engine.cache import PAGE, KVCache, Pool
from specdec.engine.tree import Tree

ROW_BY_ROW = 65  # inputs of up to this many tokens attend a query at a time (in one call per group); longer ones together:
# a round of the most proposals a round may carry (specdec/proposal.py MAX_ROUND_TOKENS, 64) and its pending token is one
GROUPS = (8, 16, 32, ROW_BY_ROW)  # short inputs are grouped by the first of these their length fits
VIEW_BYTES = 64 * 1024  # per-query layout: an input whose consecutive pages hold at least this many bytes of a layer's keys attends alone (`_viewed`)


@dataclass
class Group:
    """Inputs attended in one call: B sessions' inputs padded to n rows each, keys padded to Lb."""

    inputs: list[int]  # indices into the pass's inputs (empty in a uniform pass; the group's size is qpos's first)
    n: int  # query rows per input (the longest input's)
    Lb: int  # key positions per input, a multiple of PAGE
    gather: torch.Tensor | None  # [B * Lb] pool slots of each input's key positions (trash beyond its pages); None: a view
    # (or, with `paged`, [B * Lb / PAGE] the pool pages that hold them: whole pages are fewer, longer copies)
    rows: torch.Tensor  # [B * n] packed row of each (input, query j) (padding: the input's last row)
    qpos: torch.Tensor  # [B, n] absolute position of each query (padding: the input's last)
    first_slot: int | None = None  # one input whose key pages are consecutive: its keys are a view of the pool from here
    tree: tuple | None = None  # where a member is a tree (tree.py): (base [B, 1, 1], visible [B, n, M], query depth [B, n],
    # key depth [B, M]) over each input's M nodes from its base; a chain member as the chain tree. None: all chains
    paged: bool = False  # gather holds pages, not slots
    _masks: dict = field(default_factory=dict)  # masks and slots, made once a pass

    def keys(self, t: torch.Tensor) -> torch.Tensor:
        """The group's keys (or values) from a pool tensor [slots, H_kv, D]: [B, H_kv, Lb, D]."""
        B, Lb = self.qpos.shape[0], self.Lb
        if self.first_slot is not None:
            x = t.narrow(0, self.first_slot, Lb)
        elif self.paged:  # the pool's slots are whole pages (cache.Pool)
            x = t.view(-1, PAGE, *t.shape[1:]).index_select(0, self.gather)
        else:
            x = t.index_select(0, self.gather)
        return x.view(B, Lb, t.shape[1], t.shape[2]).transpose(1, 2)

    def slots(self) -> torch.Tensor:
        """[B, Lb] int32: the pool slot of each input's key positions (trash beyond its pages), for
        an attention that reads the pool in place (the CPU tier's query attention)."""
        if "slots" not in self._masks:
            B, Lb, dev = self.qpos.shape[0], self.Lb, self.qpos.device
            if self.first_slot is not None:
                s = torch.arange(self.first_slot, self.first_slot + Lb, device=dev).expand(B, Lb)
            elif self.paged:
                s = (self.gather.view(B, Lb // PAGE, 1) * PAGE + torch.arange(PAGE, device=dev)).view(B, Lb)
            else:
                s = self.gather.view(B, Lb)
            self._masks["slots"] = s.to(torch.int32)
        return self._masks["slots"]

    def mask(self, window: int | None, heads: int, rep: int, additive: torch.dtype | None = None) -> torch.Tensor:
        """[B, heads * n * rep, 1, Lb] for the head layout (one query per head row), or [B, 1, n * rep, Lb]
        with heads = 0 (queries together, each one `rep` times): query at p sees key position k iff
        k <= p and, with a window, k > p - window. Bool, or additive in that dtype (0 / -inf: what
        SDPA would make of a bool mask in every call)."""
        key = (window, heads, rep, additive)
        if key not in self._masks:
            m = self.visible(window)
            B = m.shape[0]
            if additive:  # made additive before it is spread over heads and GQA's query heads: fewer elements
                m = torch.zeros(m.shape, dtype=additive, device=m.device).masked_fill_(~m, float("-inf"))
            if heads:
                m = m[:, None, :, None, :].expand(B, heads, self.n, rep, self.Lb).reshape(B, heads * self.n * rep, 1, self.Lb)
            else:
                m = m[:, None, :, None, :].expand(B, 1, self.n, rep, self.Lb).reshape(B, 1, self.n * rep, self.Lb)
            self._masks[key] = m
        return self._masks[key]

    def visible(self, window: int | None) -> torch.Tensor:
        """[B, n, Lb] bool: query at p sees key position k iff k <= p and, with a window, k > p - window
        (a tree's: `_tree_mask`)."""
        key = ("visible", window)
        if key not in self._masks:
            k = torch.arange(self.Lb, device=self.qpos.device)[None, None, :]  # [1, 1, Lb]
            if self.tree is None:
                p = self.qpos[:, :, None]  # [B, n, 1]
                m = k <= p
                if window:
                    m &= k > p - window
            else:
                m = self._tree_mask(k, window)
            self._masks[key] = m
        return self._masks[key]

    def _tree_mask(self, k: torch.Tensor, window: int | None) -> torch.Tensor:
        """[B, n, Lb]: a node sees the committed keys (positions < base; within the window of its own
        position base + depth) and its ancestors' and its own keys (stored at base + node)."""
        base, vis, qdepth, kdepth = self.tree
        M = vis.shape[2]
        p = base + qdepth[:, :, None]  # [B, n, 1] the query's position
        m = (k < base) & (k <= p)
        if window:
            m &= k > p - window
        node = (k - base).clamp(0, M - 1).expand(vis.shape[0], vis.shape[1], -1)  # [B, n, Lb]
        t = vis.gather(2, node) & (k >= base) & (k < base + M)
        if window:
            t &= qdepth[:, :, None] - kdepth.gather(1, node[:, 0]).unsqueeze(1) < window
        return m | t


@dataclass
class Pass:
    """The layout of one packed pass: input i's n_i new tokens are rows off_i..off_i+n_i."""

    pool: Pool
    rows: int  # T, with padding
    lead: list[int]  # row counts of the prefill chunks that come first, each in a matmul product of its own (cpu/rows.py)
    slots: torch.Tensor  # [T] where each row's keys and values go (padding rows: the trash page)
    short: list[Group]  # inputs attended a query at a time
    long: list[Group]  # inputs attended together, one group each
    back: torch.Tensor | None  # [T] for each packed row, its row in the concatenated group outputs (padding: the zero row);
    # None where the one group's rows are the packed rows in order
    per_query: bool = False  # short groups: each query its own problem (the CPU's, for bitwise invariance), else a
    # session's queries are the rows of one problem per KV head (what the GPU's fused kernels take)
    kernel: Callable | None = None  # per_query: the CPU tier's query attention (Plan.query_attention), else SDPA


def layout(pool: Pool, caches: list[KVCache], counts: list[int], starts: list[int], offsets: list[int], rows: int,
           lead: list[int], per_query: bool = False, trees: list[Tree | None] | None = None, paths: bool = True,
           kernel: Callable | None = None) -> Pass:
    """The pass's index tensors. A few integers per input (its length, start, first row, where its
    attention output goes) and its page table go to the device in one copy; every per-row index is
    computed there. Tree inputs (trees[i], tree.py) are cut into paths in the per-query layout (with
    `paths`; `_branch_groups`), else a group with a tree among its inputs takes a tree mask; either
    takes a second small copy."""
    N, dev = len(counts), pool.device
    real = sum(counts)
    # on the CPU a tree's rows are cut into paths, each an input of its own with its branch's keys (`_branch_groups`)
    branched = [i for i in range(N) if trees[i] is not None] if per_query and paths and trees else []
    branch = _branch_groups(branched, caches, counts, offsets, [trees[i] for i in branched], dev) if branched else None
    plan, lo = [], 0  # (inputs, n) per group: the short ones by size, then each long one alone
    view_pages = _view_pages(pool)
    for top in GROUPS:
        members = [i for i, n in enumerate(counts) if lo < n <= top and i not in branched]
        lo = top
        if per_query:  # the CPU: an input whose keys are a view attends in a group of its own, ungathered
            alone = [i for i in members if _viewed(caches[i], starts[i] + counts[i], view_pages)]
            plan += [([i], counts[i]) for i in alone]
            members = [i for i in members if i not in alone]
        if members:
            plan.append((members, max(counts[i] for i in members)))
    short = len(plan)
    plan += [([i], n) for i, n in enumerate(counts) if n > ROW_BY_ROW and i not in branched]
    out_at, at = [0] * N, 0  # where each input's first attention output row goes in the concatenated group outputs
    branch_at = 0  # where the branch group's outputs start: after the short groups', before the long ones'
    for g, (members, n) in enumerate(plan + [([], 0)]):  # in the order attention concatenates them: short, branched, long
        if g == short and branch is not None:
            branch_at, at = at, at + len(branch[1])
        for b, i in enumerate(members):
            out_at[i] = at + b * n
        at += len(members) * n
    P = -(-max(L + n for L, n in zip(starts, counts)) // PAGE)  # key pages of the longest input
    table = [x for c in caches for x in (c.pages + [0] * P)[:P]]  # past a cache's own pages: the trash page
    members = [i for m, _ in plan for i in m]
    host = torch.tensor(counts + starts + offsets + out_at + members + table, dtype=torch.long)
    cnt, st, off, oat, mem, tab = host.to(dev, non_blocking=True).split([N, N, N, N, len(members), N * P])
    tab = tab.view(N, P)
    inp = torch.repeat_interleave(torch.arange(N, device=dev), cnt, output_size=real)  # [real] each row's input
    j = torch.arange(real, device=dev) - off[inp]  # [real] each row's place in its input
    pos = st[inp] + j  # [real] absolute positions
    pad = torch.arange(rows - real, device=dev)
    slots = torch.cat([tab[inp, pos // PAGE] * PAGE + pos % PAGE, pad % PAGE])  # [T] padding rows: the trash page
    back = torch.cat([oat[inp] + j, pad * 0 + at])  # [T] padding rows: the zero row after every group's output
    if branch is not None:  # a tree's rows: where their paths put them
        back = back.index_put((branch[1],), branch[2] + branch_at)
    groups, k = [], 0
    for members, n in plan:
        B = len(members)
        m = mem[k : k + B]  # [B]
        k += B
        jc = torch.minimum(torch.arange(n, device=dev)[None, :], cnt[m, None] - 1)  # [B, n] padding queries: the input's last
        pages = -(-max(starts[i] + counts[i] for i in members) // PAGE)
        own = caches[members[0]].pages[:pages]
        first = own[0] * PAGE if B == 1 and own == list(range(own[0], own[0] + pages)) else None  # a view, no gather
        gather = None if first is not None else tab[m, :pages].reshape(-1)  # [B * pages] the pages of its key positions
        tree = _tree_tensors([trees[i] for i in members], [counts[i] for i in members], [starts[i] for i in members], n, dev) \
            if trees and any(trees[i] is not None for i in members) else None
        groups.append(Group(members, n, pages * PAGE, gather, (off[m, None] + jc).view(-1), st[m, None] + jc, first, tree, paged=True))
    if branch is not None:
        groups += branch[0]
    ordered = len(plan) == 1 and rows == real and all(c == plan[0][1] for c in counts) and not branched  # one group, in packed order, no padding
    short_groups = groups[:short] + groups[len(plan):]  # the branch groups attend a query at a time, after the short ones
    return Pass(pool, rows, lead, slots, short_groups, groups[short:len(plan)], None if ordered else back, per_query,
                kernel if per_query else None)


def _viewed(cache: KVCache, keys: int, view_pages: int) -> bool:
    """Whether an input's keys (up to `keys` positions) are read as a view of the pool, in a group
    of their own, rather than gathered with other inputs' (per-query layout, the CPU): where its
    pages are consecutive and a layer's keys take at least VIEW_BYTES, so that copying them costs
    more than one more attention call (view_pages: `_view_pages`, once a pass)."""
    pages = -(-keys // PAGE)
    if pages < view_pages:  # the cheap test first
        return False
    own = cache.pages[:pages]
    return len(own) == pages and own == list(range(own[0], own[0] + pages))


def _view_pages(pool: Pool) -> int:
    """The fewest pages whose keys take VIEW_BYTES of a layer (huge before the pool has layers)."""
    if not pool.k:
        return 1 << 40
    k = pool.k[0]
    return -(-VIEW_BYTES // (PAGE * k.shape[1] * k.shape[2] * k.element_size()))


def _branch_groups(inputs: list[int], caches: list[KVCache], counts: list[int], offsets: list[int], trees: list[Tree],
                   dev) -> tuple[list[Group], torch.Tensor, torch.Tensor]:
    """The rows of tree inputs cut into paths (a node joins its parent's path where the parent ends
    it, else starts one: a tree of L leaves is L paths), each path a per-query group of its own (no
    padding rows) whose key positions are its cache's committed ones, then its branch's entries
    from the root at positions base, base + 1, ... (gathered from where the nodes are stored). So a
    node is attended exactly as a one-token step of its branch is, bitwise on the CPU (the chain
    layout's invariant, tests/test_tree.py). Returns the groups, and each tree row's packed row and
    place in their concatenated outputs (for Pass.back)."""
    paths = []  # (input, tree, [nodes])
    for i, t in zip(inputs, trees):
        first, tail = len(t) - counts[i], {}  # tail: the path a node ends
        for m in range(first, len(t)):
            path = tail.pop(t.parents[m], None)
            if path is None:
                path = (i, t, [])
                paths.append(path)
            path[2].append(m)
            tail[m] = path
    gathers, ints, packed = [], [], []
    for i, t, nodes in paths:
        first = len(t) - counts[i]
        Lb = -(-(t.base + t.depth[nodes[-1]] + 1) // PAGE) * PAGE
        P = max(Lb, t.base + len(t) + PAGE) // PAGE  # every key position, and every node's storage position
        pages = torch.tensor((caches[i].pages + [0] * P)[:P], dtype=torch.long)
        slot = (pages[:, None] * PAGE + torch.arange(PAGE)).view(-1)  # the cache's slot of each position (trash past its pages)
        g = slot[:Lb].clone()
        branch = t.ancestors(nodes[-1])  # the root's path to the path's last node: its nodes' ancestors, and them
        g[t.base : t.base + len(branch)] = slot[[t.base + a for a in branch]]
        gathers.append(g)
        rows = [offsets[i] + m - first for m in nodes]
        ints += rows + [t.base + t.depth[m] for m in nodes]
        packed += rows
    host = torch.cat([*gathers, torch.tensor(ints + list(range(len(packed))), dtype=torch.long)])
    parts = host.to(dev, non_blocking=True).split([len(g) for g in gathers] + [len(nodes) for _, _, nodes in paths for _ in (0, 1)]
                                                  + [len(packed)])
    groups = []
    for k, (i, _, nodes) in enumerate(paths):
        groups.append(Group([i], len(nodes), len(gathers[k]), parts[k], parts[len(paths) + 2 * k],
                            parts[len(paths) + 2 * k + 1].view(1, len(nodes))))
    return groups, torch.tensor(packed, dtype=torch.long).to(dev, non_blocking=True), parts[-1]


def _tree_tensors(trees: list[Tree | None], counts: list[int], starts: list[int], n: int, dev) -> tuple:
    """Group.tree for a group's inputs (a chain input as the chain tree from its start); an input's
    padding rows repeat its last."""
    trees = [t if t is not None else Tree.chain(st, c) for t, c, st in zip(trees, counts, starts)]
    M = max(len(t) for t in trees)
    vis, qd, kd, base = [], [], [], []
    for t, c in zip(trees, counts):
        rows = t.visible()
        own = [len(t) - c + min(j, c - 1) for j in range(n)]  # this input's nodes, padding: the last
        vis.append([rows[x] + [False] * (M - len(t)) for x in own])
        qd.append([t.depth[x] for x in own])
        kd.append(list(t.depth) + [0] * (M - len(t)))
        base.append(t.base)
    B = len(trees)
    v = torch.tensor(vis, dtype=torch.bool).view(B, n, M)
    ints = torch.tensor([b + q + k for b, q, k in zip([[x] for x in base], qd, kd)], dtype=torch.long)  # [B, 1 + n + M]
    v, ints = v.to(dev, non_blocking=True), ints.to(dev, non_blocking=True)
    return ints[:, :1, None], v, ints[:, 1 : 1 + n], ints[:, 1 + n :]
