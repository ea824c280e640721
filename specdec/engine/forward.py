"""The engine: a model, its load-time plan and its pooled KV cache, and the packed forward pass.

A pass (`Engine.forward`) runs the new tokens of many sessions as ONE packed sequence [1, T]:
the sessions' tokens one after another, each with its own absolute positions (on the CPU padded
to the plan's minimum row count). Through transformers' attention interface the model's own
attention layers call the engine's attention (attention.py), which writes every new key and value
into the pool in one op per layer and attends all sessions in one call per group. The model's own
CausalLM head runs on the real rows only, so whatever an architecture does after lm_head is kept.

`prepare` switches a model to the engine. On the CPU it first makes the CPU tier's load-time
choices (cpu/choose.py: calibrated matmul row counts, per-row products, prepacked weights, the
attention dtype), which keep a token's numbers bitwise the same alone or batched and in a step or
a round; a GPU never imports that tier.
"""
from __future__ import annotations

import itertools
import logging

import torch

from specdec.choices import PIN_KEYWORDS
from specdec.engine.attention import ATTN, PassCache, cache_kwargs, running
from specdec.engine.cache import KVCache, Pool
from specdec.engine.compiled import compile_layers
from specdec.engine.graphs import Uniform
from specdec.engine.layout import layout
from specdec.engine.plan import Plan
from specdec.engine.tree import Tree

log = logging.getLogger("specdec.engine")

PREFILL_CHUNK = 256  # prompt tokens per prefill pass, on both services (boundaries depend only on the prompt)


class Engine:
    def __init__(self, model, plan: Plan, uniform: bool | None = None):
        """uniform: run passes of rounds in uniform shapes (graphs.py; default: where the plan captures
        CUDA graphs)."""
        self.model, self.plan = model, plan
        self.pool = Pool(plan.kv_dtype, model.device)
        self.uniform = Uniform(self, plan.graphs) if (plan.graphs if uniform is None else uniform) else None
        self.compiled: list[torch.nn.Module] = []  # the model's compiled modules (compiled.py)
        self.lean = None  # the CPU tier's lean forward (cpu/lean.py), where `lean_for` took it

    @property
    def device(self) -> torch.device:
        return self.model.device

    def cache(self, capacity: int) -> KVCache:
        """A session's cache, its pages taken from the pool now."""
        return self.pool.cache(capacity)

    @torch.inference_mode()
    def forward(self, inputs: list[list[int]], caches: list[KVCache], logits: bool | list[bool] = True,
                padded: bool = False, trees: list[Tree | None] | None = None,
                tree_paths: bool = True, last: list[bool] | None = None) -> list[torch.Tensor | None] | torch.Tensor:
        """Runs inputs[i] after caches[i] for every i in one pass, writing the new keys and values in
        place. Returns, per input, its logits [n_i, V] (float32, on the model's device) where
        logits (or logits[i]) is true, else None; with `padded`, one tensor [K, R, V] for the K inputs
        with logits (in order), R their longest, rows past an input's own repeating its last (a pass
        of rounds only may return a CUDA graph's output buffer: read it before the next pass). A
        failed pass leaves every cache's length as it was. trees[i] (tree.py), where given, makes
        input i the last len(inputs[i]) nodes of that tree: each attends its ancestors only, at its
        branch's positions (such a pass never runs in the uniform shapes); on the CPU each node's logits
        are bitwise its branch's chain pass's unless tree_paths is False (the tree mask instead: the
        same numbers alone or batched, cheaper, to float rounding of the chain's; the draft's choice).
        last[i] (not with `padded`): input i's logits are its last row's only, [1, V] (the output
        layer over one row, not n_i: the draft's feeds)."""
        model, device, plan = self.model, self.device, self.plan
        want = [logits] * len(inputs) if isinstance(logits, bool) else list(logits)
        last = list(last) if last is not None and not padded else [False] * len(inputs)
        # A prefill chunk longer than the plan's top (its keys and values only) goes first, in one
        # matmul product of its own: its numbers then depend on the chunk alone (cpu/rows.py).
        own = {i for i, x in enumerate(inputs) if plan.top is not None and not want[i] and len(x) > plan.top}
        order = sorted(range(len(inputs)), key=lambda i: i not in own)
        inputs, caches, want, last = [inputs[i] for i in order], [caches[i] for i in order], [want[i] for i in order], [last[i] for i in order]
        trees = [trees[i] for i in order] if trees and any(t is not None for t in trees) else None
        counts = [len(x) for x in inputs]
        starts, ends = [], {}  # a cache may take two inputs (a prompt's last chunk, then a step): the second starts after the first
        for c, n in zip(caches, counts):
            starts.append(ends.get(id(c), c.length))
            ends[id(c)] = starts[-1] + n
        for i, t in enumerate(trees or []):
            if t is not None and (len(t) < counts[i] or t.base + len(t) - counts[i] != starts[i]):
                raise ValueError(f"a tree of {len(t)} nodes from {t.base} cannot take {counts[i]} rows at {starts[i]}")
        for c, L, n in zip(caches, starts, counts):
            if L + n > c.capacity:
                raise ValueError(f"cache overflow: {L} + {n} tokens > capacity {c.capacity}")
            c.bind(self.pool)
        self.pool.fit()  # every layer holds the pass's pages before anything runs (not in a capture)
        shape = self.uniform.shape(counts) if self.uniform is not None and padded and all(want) and inputs and not trees else None
        if shape is not None:  # rounds only (so in the callers' order): one uniform pass, a CUDA graph where captured
            out = self.uniform.run(inputs, caches, starts, *shape)
            for c, n in zip(caches, counts):
                c.length += n
            return out[:, : max(counts)]
        lead = counts[: len(own)]  # rows of the own products, first in the pass
        real = sum(counts)
        rest = real - sum(lead)  # the other sessions' rows, padded to pad_to
        T = sum(lead) + (max(rest, plan.pad_to) if rest or not lead else 0)
        flat = [t for x in inputs for t in x] + [0] * (T - real)  # padding rows: token 0 at position 0, never attended
        pos = [L + j for L, n in zip(starts, counts) for j in range(n)] if not trees else \
            [L + j if t is None else t.base + t.depth[len(t) - n + j] for L, n, t in zip(starts, counts, trees) for j in range(n)]
        pos += [0] * (T - real)
        ids, position_ids = torch.tensor([flat, pos], dtype=torch.long).to(device, non_blocking=True).split(1)  # [1, T] each, one copy
        # to the device (torch.tensor(..., device=cuda) copies blocking: a host sync)
        offsets = [0, *itertools.accumulate(counts)][: len(counts)]  # each input's first row
        at = {i: k for k, i in enumerate(order)}  # caller's index -> the pass's
        callers = [i for i in range(len(order)) if want[at[i]]]  # the inputs with logits, in the callers' order
        R = max((counts[at[i]] for i in callers), default=0) if padded else 0
        rows_of = [R or (1 if last[at[i]] else counts[at[i]]) for i in callers]  # each caller's rows of logits
        keep = [offsets[at[i]] + (counts[at[i]] - 1 if last[at[i]] and not R else min(j, counts[at[i]] - 1))
                for i, k in zip(callers, rows_of) for j in range(k)]  # the head's rows
        heads = list(dict.fromkeys(keep))  # the output layer runs on each row once: a padding row is a copy (below)
        p = layout(self.pool, caches, counts, starts, offsets, T, lead, plan.per_query, trees, tree_paths, plan.query_attention)
        with running(p):
            cache = PassCache(p)
            if heads:
                # >= pad_to rows for the head too; every row (0): no index to copy to the device. cpu/rows.py tells the
                # pass's own rows (a lead chunk's product first) by their count: picked rows as many as those take one more
                picked = heads + [heads[-1]] * (plan.pad_to - len(heads))
                picked += [heads[-1]] * (bool(lead) and len(picked) == T)
                rows = 0 if heads == list(range(T)) else torch.tensor(picked).to(device, non_blocking=True)
                out = self._model(ids, position_ids, cache, rows)[0]
            else:
                self._model(ids, position_ids, cache, None)
        if padded:
            res = torch.empty(0, 0, 0, device=device)
            if keep:
                out = out[: len(heads)]
                if len(heads) < len(keep):  # each input's rows past its own repeat its last: copies of its logits, not
                    # the output layer again (one long round beside many one-row steps multiplied the head's work)
                    index = {r: k for k, r in enumerate(heads)}
                    out = out.index_select(0, torch.tensor([index[r] for r in keep]).to(device, non_blocking=True))
                res = out.view(len(callers), R, -1).float()
        else:
            res = [None] * len(inputs)
            row = 0
            for i, n in zip(callers, rows_of):  # back to the callers' order
                res[i] = out[row : row + n].float()
                row += n
        for c, n in zip(caches, counts):  # only once the output is made: a pass that fails leaves every length as it was
            c.length += n
        return res

    def _model(self, ids: torch.Tensor, position_ids: torch.Tensor, cache: PassCache, rows) -> torch.Tensor | None:
        """The model's pass: logits [1, k, V] of the rows that `rows` keeps (logits_to_keep), or
        with rows None the keys and values only; through the lean forward where the engine took it."""
        if self.lean is not None:
            return self.lean(ids, position_ids, cache, rows)
        model = self.model
        if rows is None:
            model.base_model(input_ids=ids, position_ids=position_ids, use_cache=True, **cache_kwargs(model.base_model, cache))
            return None
        return model(input_ids=ids, position_ids=position_ids, use_cache=True, logits_to_keep=rows, **cache_kwargs(model, cache)).logits


def cpu_row_kernel() -> bool:
    """Whether the CPU tier's row kernel builds and loads on this host (cpu/kernel.py: float32
    products that read a bfloat16 checkpoint's weights from bfloat16 panels)."""
    from specdec.engine.cpu import kernel  # noqa: PLC0415 - the CPU tier, asked on the CPU only

    return kernel.library() is not None


def prepare(model, timer=None, graphs: bool | None = None, compiled: bool | None = None, **pins) -> Engine:
    """Switches `model` to the engine's attention and returns its Engine. On the CPU the CPU tier makes
    its load-time choices first (pinned by `pins`, where given and not None: specdec.choices.parse_choices'
    keywords, per_row=True, attention='float32', ...; timed with timer, for tests, else the clock);
    on a GPU there are none to make, and passes of rounds
    are captured as CUDA graphs unless graphs is False, and the decoder layers are compiled
    (compiled.py) unless compiled is False: on CUDA by default, elsewhere only when asked for."""
    unknown = sorted(set(pins) - set(PIN_KEYWORDS))
    if unknown:
        raise TypeError(f"prepare(): no engine choice {', '.join(unknown)} (the choices: {', '.join(PIN_KEYWORDS)})")
    pins = {k: v for k, v in pins.items() if v is not None}
    model.set_attn_implementation(ATTN)
    name = f"{type(model).__name__} in {model.dtype}"
    if model.device.type != "cpu":
        if pins:
            log.warning("%s: engine choices are made on the CPU only; the pinned %s ignored on %s", name,
                        ", ".join(PIN_KEYWORDS[k] for k in PIN_KEYWORDS if k in pins), model.device)
        graphs = model.device.type == "cuda" and graphs is not False
        engine = Engine(model, Plan(kv_dtype=model.dtype, graphs=graphs))
        if compiled or (compiled is None and model.device.type == "cuda"):
            engine.compiled = compile_layers(engine)
            engine.plan.compiled = bool(engine.compiled)
        log.info("%s on %s: CUDA graphs %s, compiled layers %s", name, model.device, "on" if graphs else "off",
                 "on" if engine.plan.compiled else "off")
        return engine
    if graphs:
        log.warning("%s: CUDA graphs need a CUDA device; off on the CPU", name)
    if compiled:
        log.warning("%s: compiled layers are for a GPU (the CPU tier makes its own choices); off on the CPU", name)
    from specdec.engine.cpu.choose import choose  # noqa: PLC0415 - the CPU tier: never imported on a GPU

    from specdec.engine.cpu.lean import lean_for  # noqa: PLC0415 - the CPU tier

    engine = Engine(model, choose(model, pins, timer))
    engine.lean = lean_for(engine)
    return engine
