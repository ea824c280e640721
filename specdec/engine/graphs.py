"""Uniform passes of rounds, and on CUDA their CUDA graphs.

A pass of rounds only (every input wants its logits, none longer than MAX_ROWS tokens, at most
BUCKETS[-1] inputs) runs in a uniform shape (B, n, P): B the first bucket (1, 2, 4, ..., 64) that
holds its inputs, each input padded to n rows (the longest input's), and every input's keys read
through P page-table entries (P a power of two, at least the longest input's pages). Its layout
is computed on the device from two integer tensors, [B, 2 + n] (per input: its row count, its
first position, its token ids) and [B, P] (its page table), views of one buffer that one copy
fills (padding inputs: one token 0 at position 0 on the trash page), so the whole pass (layout,
model, head, the padded logits) is a fixed sequence of kernels over fixed buffers:

* on CUDA, with graphs on, a shape's first pass runs eagerly (it warms up every kernel), its
  second is captured once as a CUDA graph, and every pass of that shape after it is one copy of
  the integer buffer to the device and one graph replay. All graphs share one memory pool; a
  graph's output is read before the next pass starts, on the same stream. A grown KV pool drops
  the graphs (their kernels hold the old pool's addresses); they are captured again.
* elsewhere (or with graphs off) the same uniform pass runs eagerly. On the CPU the packed pass
  (layout.layout) stays the default: its padding is the CPU's calibrated row count.
* with compiled layers (compiled.py) a graph captures their fused kernels like any other.

Padding rows write their keys to the trash page and query at their input's last position, and a
padding row's logits are replaced by its input's last real row's, as `Engine.forward(padded=True)`
promises.
"""
from __future__ import annotations

import logging
import time

import torch

from specdec.engine.attention import PASS_KWARG, PassCache, cache_kwargs, running
from specdec.engine.cache import PAGE, KVCache, Pool
from specdec.engine.layout import Group, Pass

log = logging.getLogger("specdec.engine")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # inputs per uniform pass
MAX_ROWS = 16  # rows per input: a round of up to MAX_ROWS - 1 proposals


def pages_bucket(pages: int) -> int:
    """The power of two (at least 4) of page-table entries for inputs whose longest needs `pages`."""
    return max(4, 1 << (pages - 1).bit_length())


def uniform_layout(head: torch.Tensor, table: torch.Tensor, pool: Pool) -> tuple[torch.Tensor, torch.Tensor, Pass]:
    """From head [B, 2 + n] (per input: rows, first position, n token ids) and table [B, P] (its
    pages) on the device: (input ids [1, B*n], positions [1, B*n], the pass), by device ops alone."""
    B, n, dev = head.shape[0], head.shape[1] - 2, head.device
    cnt, start, ids = head[:, :1], head[:, 1:2], head[:, 2:]  # [B, 1], [B, 1], [B, n]
    j = torch.arange(n, device=dev)[None, :]  # [1, n]
    qpos = start + torch.minimum(j, cnt - 1)  # [B, n] padding rows: the input's last position
    page = torch.gather(table, 1, qpos // PAGE)
    slots = torch.where(j < cnt, page * PAGE + qpos % PAGE, j % PAGE)  # padding rows: the trash page
    gather = (table[:, :, None] * PAGE + torch.arange(PAGE, device=dev)).view(-1)  # [B * P * PAGE] key slots
    rows = torch.arange(B * n, device=dev)
    group = Group([], n, table.shape[1] * PAGE, gather, rows, qpos)
    return ids.reshape(1, B * n), qpos.reshape(1, B * n), Pass(pool, B * n, [], slots.reshape(-1), [group], [], None)


def uniform_pass(engine, head: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """One uniform pass from head and table (uniform_layout): logits [B, n, V] float32, a padding
    row's those of its input's last real row. Device ops alone, no host sync, and no graph break:
    `torch.compile(uniform_pass, fullgraph=True)` traces it whole (tests/test_graphs.py). The
    pass reaches the attention layers as a keyword of the model's call, which transformers hands
    down to its attention functions; `running` also makes it the thread's pass, for a model that
    does not (outside a compiled trace, which cannot follow a context variable)."""
    model = engine.model
    ids, pos, p = uniform_layout(head, table, engine.pool)
    kw = {**cache_kwargs(model, PassCache(p)), PASS_KWARG: p}
    if torch.compiler.is_compiling():
        logits = model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=0, **kw).logits[0]
    else:
        with running(p):
            logits = model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=0, **kw).logits[0]
    B, n, dev = head.shape[0], head.shape[1] - 2, head.device
    last = torch.arange(B, device=dev)[:, None] * n + torch.minimum(torch.arange(n, device=dev), head[:, :1] - 1)
    return logits.index_select(0, last.view(-1)).view(B, n, -1).float()  # padding rows: their input's last row


class _Shape:
    def __init__(self, B: int, n: int, P: int, device):
        self.buf = torch.empty(B * (2 + n + P), dtype=torch.long, device=device)  # the static input, filled by one copy
        self.head = self.buf[: B * (2 + n)].view(B, 2 + n)
        self.table = self.buf[B * (2 + n) :].view(B, P)
        self.seen = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None  # the graph's output [B, n, V] float32


class Uniform:
    """Runs an engine's uniform passes; with `graphs` (CUDA only) captures each shape's."""

    def __init__(self, engine, graphs: bool):
        self.engine, self.graphs = engine, graphs
        self._shapes: dict[tuple[int, int, int], _Shape] = {}
        self._pool_slots = 0  # the pool's size when the graphs were captured
        self._mempool = None
        self.captures = 0
        self.capture_s = 0.0  # seconds spent capturing, all graphs
        self.graph_bytes = 0  # device memory reserved while capturing, all graphs

    @property
    def shapes(self) -> dict[tuple[int, int, int], int]:
        """{(B, n, P): passes run in that shape so far (since the graphs were last dropped)}."""
        return {key: sh.seen for key, sh in self._shapes.items()}

    def graph(self, B: int, n: int) -> torch.cuda.CUDAGraph | None:
        """The captured graph of B inputs x n rows that has run most, if any (benchmarks replay it to time a pass)."""
        got = [sh for (b, rows, _), sh in self._shapes.items() if (b, rows) == (B, n) and sh.graph is not None]
        return max(got, key=lambda sh: sh.seen).graph if got else None

    def shape(self, counts: list[int]) -> tuple[int, int] | None:
        """(B, n) for these inputs' counts, or None where they do not fit a uniform pass."""
        n = max(counts)
        B = next((b for b in BUCKETS if b >= len(counts)), None)
        return None if B is None or n > MAX_ROWS else (B, n)

    def run(self, inputs: list[list[int]], caches: list[KVCache], starts: list[int], B: int, n: int) -> torch.Tensor:
        """Logits [len(inputs), n, V] float32 (rows past an input's own repeat its last) of one
        uniform pass; the caches are bound and their lengths not yet moved. From a graph they are
        a view of its output: valid until the next pass."""
        engine = self.engine
        pool = engine.pool
        P = pages_bucket(-(-max(s + len(x) for s, x in zip(starts, inputs)) // PAGE))
        head: list[int] = []
        table: list[int] = []
        for x, c, s in zip(inputs, caches, starts):
            pages = c.pages[:P]
            head += [len(x), s, *x, *[0] * (n - len(x))]
            table += [*pages, *[0] * (P - len(pages))]
        head += [1, 0, *[0] * n] * (B - len(inputs))  # padding inputs: token 0 at position 0, on the trash page
        table += [0] * (P * (B - len(inputs)))
        host = torch.tensor(head + table, dtype=torch.long)
        key = (B, n, P)
        sh = self._shapes.get(key)
        if sh is None:
            sh = self._shapes[key] = _Shape(B, n, P, pool.device)
        sh.buf.copy_(host, non_blocking=True)
        sh.seen += 1
        slots = pool.size if pool.k else 0  # every layer holds this pass's pages: Engine.forward fitted them (Pool.fit)
        graphed = self.graphs and slots
        if graphed and self._pool_slots != slots:  # the pool grew: its old addresses are baked in
            self._drop()
            self._pool_slots = slots
        if graphed and sh.graph is None and sh.seen >= 2:
            try:
                self._capture(sh)
            except Exception as e:  # noqa: BLE001 - a model whose pass cannot be captured still runs, eagerly
                log.warning("CUDA graph capture failed (%s: %s); passes run eagerly from now on", type(e).__name__, str(e)[:300])
                self.graphs = False
                self._drop()
        if graphed and sh.graph is not None:
            sh.graph.replay()
            out = sh.out
        else:
            out = uniform_pass(self.engine, sh.head, sh.table)
        return out[: len(inputs)]

    def _capture(self, sh: _Shape) -> None:
        dev = sh.head.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # as the capture itself does first: what it reserves after is the graph's
        before = torch.cuda.memory_reserved(dev)
        t0 = time.perf_counter()
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        # on the model's device: the capture's stream is the current device's, which no thread sets (a --device cuda:1
        # model's kernels ran on cuda:1 outside a capture made on cuda:0, which recorded nothing, and replays did nothing)
        with torch.cuda.device(dev), torch.cuda.graph(g, pool=self._mempool, capture_error_mode="thread_local"):
            sh.out = uniform_pass(self.engine, sh.head, sh.table)
        sh.graph = g
        torch.cuda.synchronize(dev)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        self.graph_bytes += torch.cuda.memory_reserved(dev) - before
        log.info("captured a CUDA graph for %d inputs x %d rows, %d key pages (%.2f s)", sh.head.shape[0], sh.head.shape[1] - 2,
                 sh.table.shape[1], time.perf_counter() - t0)

    def _drop(self) -> None:
        for sh in self._shapes.values():
            sh.graph, sh.out, sh.seen = None, None, 0
        self._mempool = None  # its graphs are gone: the next capture starts a new pool
