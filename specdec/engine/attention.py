"""The pass layout and the attention that transformers' attention layers call during a pass.

A pass runs the new tokens of many sessions as one packed sequence [1, T] (forward.py). In every
layer, `PassCache.update` writes all the new keys and values into the pool with one
`index_copy_` each, and `packed_attention` attends all the sessions' queries in one call per
group of inputs:

* **Short inputs** (steps, rounds, short prefill chunks: up to ROW_BY_ROW tokens) go into groups
  by size (up to 8, 16, 32, 64 tokens: one group in a steady decode). A group's keys are read
  from the pool with one gather, [B, H_kv, Lb, D], Lb the group's longest session padded to a
  multiple of PAGE, and each QUERY is its own attention problem: the queries of a session are laid
  out along the head axis ([B, H_kv * n * rep, 1, D], GQA's kv head h // (n * rep) is still the
  query's own), each with its own causal (and sliding-window) mask row. So a query is computed
  exactly as a one-token step at its position computes it, whatever the group's size, its other
  sessions or its Lb: on the CPU, with one thread, bitwise (tests/test_pool.py), because masked
  key positions add exact zeros and every key length is a multiple of PAGE.
* **Long inputs** (prefill chunks of more tokens) attend in one masked call each, queries
  together: their numbers then depend on the chunk alone, whose bounds depend on the prompt alone.

Soft-capped attention (Gemma 2) runs the same layouts through transformers' eager order of ops.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, Cache

from specdec.engine.cache import PAGE, KVCache, Pool
from specdec.engine.tree import Tree

ATTN = "specdec_packed"
PASS_KWARG = "specdec_pass"  # the model-call keyword that hands a pass down to its attention (where the model passes keywords on)
ROW_BY_ROW = 64  # inputs of up to this many tokens attend a query at a time (in one call per group); longer ones together
GROUPS = (8, 16, 32, ROW_BY_ROW)  # short inputs are grouped by the first of these their length fits


@dataclass
class Group:
    """Inputs attended in one call: B sessions' inputs padded to n rows each, keys padded to Lb."""

    inputs: list[int]  # indices into the pass's inputs (empty in a uniform pass; the group's size is qpos's first)
    n: int  # query rows per input (the longest input's)
    Lb: int  # key positions per input, a multiple of PAGE
    gather: torch.Tensor | None  # [B * Lb] pool slots of each input's key positions (trash beyond its pages); None: a view
    rows: torch.Tensor  # [B * n] packed row of each (input, query j) (padding: the input's last row)
    qpos: torch.Tensor  # [B, n] absolute position of each query (padding: the input's last)
    first_slot: int | None = None  # one input whose key pages are consecutive: its keys are a view of the pool from here
    tree: tuple | None = None  # where a member is a tree (tree.py): (base [B, 1, 1], visible [B, n, M], query depth [B, n],
    # key depth [B, M]) over each input's M nodes from its base; a chain member as the chain tree. None: all chains
    _masks: dict = field(default_factory=dict)

    def keys(self, t: torch.Tensor) -> torch.Tensor:
        """The group's keys (or values) from a pool tensor [slots, H_kv, D]: [B, H_kv, Lb, D]."""
        B, Lb = self.qpos.shape[0], self.Lb
        x = t.narrow(0, self.first_slot, Lb) if self.first_slot is not None else t.index_select(0, self.gather)
        return x.view(B, Lb, t.shape[1], t.shape[2]).transpose(1, 2)

    def mask(self, window: int | None, heads: int, rep: int, additive: torch.dtype | None = None) -> torch.Tensor:
        """[B, heads * n * rep, 1, Lb] for the head layout (one query per head row), or [B, 1, n * rep, Lb]
        with heads = 0 (queries together, each one `rep` times): query at p sees key position k iff
        k <= p and, with a window, k > p - window. Bool, or additive in that dtype (0 / -inf: what
        SDPA would make of a bool mask in every call)."""
        key = (window, heads, rep, additive)
        if key not in self._masks:
            k = torch.arange(self.Lb, device=self.qpos.device)[None, None, :]  # [1, 1, Lb]
            if self.tree is None:
                p = self.qpos[:, :, None]  # [B, n, 1]
                m = k <= p
                if window:
                    m &= k > p - window
            else:
                m = self._tree_mask(k, window)
            B = m.shape[0]
            if heads:
                m = m[:, None, :, None, :].expand(B, heads, self.n, rep, self.Lb).reshape(B, heads * self.n * rep, 1, self.Lb)
            else:
                m = m[:, None, :, None, :].expand(B, 1, self.n, rep, self.Lb).reshape(B, 1, self.n * rep, self.Lb)
            if additive:
                m = torch.zeros(m.shape, dtype=additive, device=m.device).masked_fill_(~m, float("-inf"))
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


def layout(pool: Pool, caches: list[KVCache], counts: list[int], starts: list[int], offsets: list[int], rows: int,
           lead: list[int], per_query: bool = False, trees: list[Tree | None] | None = None, paths: bool = True) -> Pass:
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
    for top in GROUPS:
        members = [i for i, n in enumerate(counts) if lo < n <= top and i not in branched]
        lo = top
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
    within = torch.arange(PAGE, device=dev)
    groups, k = [], 0
    for members, n in plan:
        B = len(members)
        m = mem[k : k + B]  # [B]
        k += B
        jc = torch.minimum(torch.arange(n, device=dev)[None, :], cnt[m, None] - 1)  # [B, n] padding queries: the input's last
        pages = -(-max(starts[i] + counts[i] for i in members) // PAGE)
        own = caches[members[0]].pages[:pages]
        first = own[0] * PAGE if B == 1 and own == list(range(own[0], own[0] + pages)) else None  # a view, no gather
        gather = None if first is not None else (tab[m, :pages, None] * PAGE + within).view(-1)  # [B * Lb] slots of its key positions
        tree = _tree_tensors([trees[i] for i in members], [counts[i] for i in members], [starts[i] for i in members], n, dev) \
            if trees and any(trees[i] is not None for i in members) else None
        groups.append(Group(members, n, pages * PAGE, gather, (off[m, None] + jc).view(-1), st[m, None] + jc, first, tree))
    if branch is not None:
        groups += branch[0]
    ordered = len(plan) == 1 and rows == real and all(c == plan[0][1] for c in counts) and not branched  # one group, in packed order, no padding
    short_groups = groups[:short] + groups[len(plan):]  # the branch groups attend a query at a time, after the short ones
    return Pass(pool, rows, lead, slots, short_groups, groups[short:len(plan)], None if ordered else back, per_query)


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


_current: contextvars.ContextVar[Pass] = contextvars.ContextVar("specdec_pass")


def current() -> Pass | None:
    """The pass running on this thread, if any."""
    return _current.get(None)


@contextlib.contextmanager
def running(p: Pass):
    """Makes p the pass that this thread's attention calls and matmuls see."""
    token = _current.set(p)
    try:
        yield
    finally:
        _current.reset(token)


class PassCache(Cache):
    """What the model sees as its KV cache during a pass (forward.cache_kwargs): `update` writes
    the pass's new keys and values into the pool; attention reads them there (packed_attention)."""

    def __init__(self, p: Pass):
        super().__init__(layers=[])
        self.p = p

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # [1, H_kv, T, D]
        if not _opaque:  # else `attend` writes them
            _write(self.p, layer_idx, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    @property
    def is_compileable(self) -> bool:
        return False


@functools.cache
def _cache_kwarg(cls) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """{name: cache}, under the name `model`'s forward takes a KV cache by: `cache` from
    transformers 5.24 on (which deprecates `past_key_values`, to be removed in 5.40, and pays a
    warning per call for it), `past_key_values` before."""
    return {_cache_kwarg(type(model)): cache}


def returned_cache(out):
    """The KV cache a forward returned: `cache` from transformers 5.24 on, `past_key_values` before."""
    return out["cache"] if "cache" in out else out.past_key_values


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """query [1, H, T, D] -> ([1, T, H, D], None); keys and values come from the pool."""
    if s_aux is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported")
    if _opaque:  # compiled layers: the write and the attention as one op that a trace does not enter
        scale = scaling if scaling is not None else query.shape[3] ** -0.5
        return attend(query, key, value, module.layer_idx, scale, sliding_window or 0, softcap or 0.0), None
    p = kwargs.get(PASS_KWARG) or _current.get()
    return _attend(p, module.layer_idx, query, scaling, sliding_window, softcap), None


_opaque = False  # compiled layers are on (compiled.py): attention is the `attend` op


def opaque() -> bool:
    return _opaque


def set_opaque(on: bool) -> None:
    """Routes every layer's cache write and attention through the `attend` op (on) or through
    PassCache.update and packed_attention's own code (off). Process-wide: the compiled layers'
    setting (compiled.py), read when a layer is traced and every time it runs."""
    global _opaque
    _opaque = on


@torch.library.custom_op("specdec::attend", mutates_args=())
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float, window: int,
           softcap: float) -> torch.Tensor:
    """One layer's attention in the thread's pass (`running`), as one op: writes the new keys and
    values into the pool, then attends ([1, H, T, D] -> [1, T, H, D]). A compiled layer calls it
    (`set_opaque`): the pass and the layer's index stay out of the trace, so one compilation
    serves every layer and every pass."""
    p = _current.get()
    _write(p, layer, key, value)
    return _attend(p, layer, query, scaling, window or None, softcap or None)


@attend.register_fake
def _(query, key, value, layer, scaling, window, softcap):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def _write(p: Pass, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """The pass's new keys and values [1, H_kv, T, D] into the pool's layer."""
    k, v = p.pool.layer(layer, key_states)  # [slots, H_kv, D]
    k.index_copy_(0, p.slots, key_states[0].transpose(0, 1).to(k.dtype))
    v.index_copy_(0, p.slots, value_states[0].transpose(0, 1).to(v.dtype))


def _attend(p: Pass, layer: int, query: torch.Tensor, scaling: float | None, sliding_window: int | None,
            softcap: float | None) -> torch.Tensor:
    K, V = p.pool.k[layer], p.pool.v[layer]  # [slots, H_kv, D]
    H, D = query.shape[1], query.shape[3]
    H_kv = K.shape[1]
    rep = H // H_kv
    scale = scaling if scaling is not None else D**-0.5
    q_all = query[0].transpose(0, 1)  # [T, H, D]
    outs = []
    for g, alone in [(g, False) for g in p.short] + [(g, True) for g in p.long]:
        B = g.qpos.shape[0]
        k, v = g.keys(K), g.keys(V)  # [B, H_kv, Lb, D]
        q = (q_all if p.back is None else q_all.index_select(0, g.rows)).to(K.dtype)  # [B * n, H, D]
        if alone:  # [1, H, n, D]: the chunk's queries together
            q = q.view(B, g.n, H, D).transpose(1, 2)
            heads, reps, gqa = 0, 1, rep > 1
        elif p.per_query:  # [B, H_kv * n * rep, 1, D]: one query per head row
            q = q.view(B, g.n, H_kv, rep, D).transpose(1, 2).reshape(B, H_kv * g.n * rep, 1, D)
            heads, reps, gqa = H_kv, rep, g.n * rep > 1
        else:  # [B, H_kv, n * rep, D]: a KV head's queries (rounds' rows x GQA's query heads) as the rows of one problem
            q = q.view(B, g.n, H_kv, rep, D).transpose(1, 2).reshape(B, H_kv, g.n * rep, D)
            heads, reps, gqa = 0, rep, False
        mask = g.mask(sliding_window, heads, reps, None if softcap else K.dtype)
        if softcap:
            o = _eager(q, k, v, mask, scale, softcap)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        if alone:  # -> [B * n, H, D]
            o = o.transpose(1, 2).reshape(B * g.n, H, D)
        else:
            o = o.view(B, H_kv, g.n, rep, D).transpose(1, 2).reshape(B * g.n, H, D)
        outs.append(o)
    if p.back is None:  # one group, already in packed order
        o = outs[0]
    else:
        outs.append(outs[0].new_zeros(1, H, D))  # the zero row: padding rows' output, never read
        o = torch.cat(outs).index_select(0, p.back)  # [T, H, D], back in packed order
    return o[None].to(query.dtype)


def _eager(q, k, v, mask, scaling: float, softcap: float) -> torch.Tensor:
    """Attention with tanh logit soft-capping (Gemma 2), in transformers' eager order of ops."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling  # [B, Hq, n, Lb]
    w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)


AttentionInterface.register(ATTN, packed_attention)  # no mask function: masks are built per pass
