"""Per-session KV caches and the packed forward pass that reads and writes them in place.

A session's cache (`KVCache`) is, per layer, one K and one V buffer [H_kv, capacity, D] on the
model's device, allocated at the session's first pass with room for its whole reservation
(prompt + max_new_tokens, capped at the context). Tokens are written in place at their
positions; a rejection only moves `length` back. Nothing is copied when sessions join, leave or
share a pass, and nothing allocated per round grows with the context.

A pass (`forward_packed`) runs the new tokens of many sessions as ONE packed sequence
[1, T]: the sessions' tokens one after another, each with its own absolute positions (padded
to the model's calibrated minimum row count on the CPU, see below). Through transformers' attention interface the model's attention
layers call `packed_attention`, which attends each session's queries to that session's own
cache slice (a view, no copy): causal, with the layer's sliding window and logit soft-cap, in
exactly the shapes the session would have alone. The model's own CausalLM head runs on the
real rows only, so whatever an architecture does after lm_head (soft-capping, scaling) is kept.

Invariance, on the CPU: a token's numbers are the same alone or batched with other sessions,
and the same in a one-token step or inside a round of tau + 1 tokens (so greedy speculative
output is the same service's target-only output, bitwise, in float32 and in bfloat16):
  * attention is the only op that mixes tokens: it runs per session on its own keys, and a
    round's queries attend one at a time (up to ROW_BY_ROW tokens), in exactly the call a
    one-token step at that position makes;
  * every other op works row by row, but a CPU GEMM gives a row the same numbers only among
    row counts that take the same kernel: which counts those are depends on the CPU, the dtype
    and the weight's shape (the shipped target in float32: 1 row, 2-15 rows and 16 or more rows
    are three classes on one x86 machine; on an AMD EPYC, 4-64 rows agree and fewer do not). So at load (`use_packed_attention`) the
    model's matmul modules are probed: `calibrate_rows` finds row counts lo..hi that all give
    every row the same numbers, wherever it sits. A pass is padded to lo rows, and each matmul
    module cuts a longer input into blocks of lo..hi rows (`_blocked`). lo is 1 only if a
    thousand one-row products also match two-row ones (a one-row bf16 kernel that sums in another
    order differs only where the bf16 rounding flips: it once flipped a greedy token);
  * where lo > 1, per-row products (`_per_row`: a batched matmul, one row per batch entry) may
    replace the GEMMs: a row then gets the same numbers at any row count, so nothing is padded.
    They are kept where a one-token step's matmuls get much faster and a round's at most twice as slow
    (`_per_row_pays`; the shipped target in float32 on the AMD machine: a step 21 -> 13 ms);
  * a half-precision model's matmul weights are reordered once into oneDNN's own layout where
    that pays (`_prepack`): the same kernel and numbers as the module's own product, which reorders
    the weight on every call (the shipped target in bf16 on the AMD machine: a step 14 -> 10 ms);
  * a prefill chunk of more than hi tokens (PER_ROW_LEAD with per-row products; keys and values
    only, no logits) is the exception:
    it goes first in its pass, through every matmul in one product of its own and through
    attention in one masked call. Its numbers then depend only on the chunk, whose bounds depend
    only on the prompt, and its weights are read once rather than once per block (blocks made a
    200-token float32 prefill 2.3x transformers' own; now they are level).
tests/test_batching.py checks this bitwise in both dtypes, on tiny models and on the shipped
target, with one torch thread (GEMMs split across threads by rows, so more threads can break it). GPU kernels may choose another algorithm for
another batch shape, so there only near-ties can differ (DESIGN.md §9).

Why not transformers' own caches: DynamicCache appends with torch.cat (a copy of the layer's
cache per step) and is one batch for all its rows; StaticCache and the paged cache of
continuous batching hold a batch whose rows are positions of one padded tensor or pages read
through a paged kernel, and neither crops one session on a rejection or keeps a session's
attention independent of its batch-mates. See DESIGN.md §6.
"""
from __future__ import annotations

import collections
import contextvars
import functools
import inspect
import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, Cache

log = logging.getLogger("specdec.kvcache")

ROW_BY_ROW = 64  # a session's inputs of up to this many tokens attend one query at a time, long prefill chunks excepted (see packed_attention)
PREFILL_CHUNK = 256  # prompt tokens per prefill pass, on both services (boundaries depend only on the prompt)
ROW_PROBE = 64  # row counts the calibration tries; longer inputs are always cut into blocks
# One-row products compared with two-row ones before a pass may have a single row: a one-row bf16
# kernel that sums in another order differs from the others only where the bf16 rounding of the
# sum flips (measured once on a real model: a greedy token), so it takes many outputs to see.
ONE_ROW_PROBE = 1024
ATTN_FLOAT32_GAIN = 1.5  # a half-precision model attends in float32 on the CPU where that is this much faster
PER_ROW_GAIN = 1.5  # per-row products replace padded GEMMs where they make a one-token step's matmuls this much faster
PER_ROW_ROUND_COST = 2.0  # ... as long as a round's matmuls cost at most this much more: a judgement call, with room for a
# loaded machine; the hot-cache probe overstates it (the shipped target: 1.06-1.33x probed, 1.0-1.1x in real five-row passes)
ROUND_ROWS = 5  # a round of tau = 4, for that comparison
PER_ROW_LEAD = 8  # with per-row products, a prefill chunk of more tokens has a GEMM of its own (see use_packed_attention)
PREPACK_GAIN = 1.2  # a half-precision model's weights are prepacked for oneDNN where that makes its matmuls this much faster
PREPACK_MEMORY_SHARE = 0.25  # ... and where the packed copies take at most this share of the host's free memory
PREPACK_TRIES = 3  # timings before prepacking is found not to pay (its numbers are the same either way; only speed is at stake)


def row_counts(model, device: torch.device) -> tuple[int, int | None]:
    """(pad_to, top) for a pass of `model` on `device` (looked up once per pass): on the CPU the
    calibrated lo, and the length above which a prefill chunk has a product of its own (the
    calibrated hi; PER_ROW_LEAD with per-row products); else (1, None): on a GPU padding would not
    buy invariance (DESIGN.md §9)."""
    if device.type != "cpu":
        return 1, None
    rows = getattr(model, "_specdec_rows", None)
    if not rows:
        return 4, None  # uncalibrated: the old fixed rule
    return rows[0], getattr(model, "_specdec_lead", rows[1])


def _row_modules(model) -> list[torch.nn.Module]:
    """The model's matmul modules that work row by row: nn.Linear and transformers' Conv1D (GPT-2)."""
    from transformers.pytorch_utils import Conv1D  # noqa: PLC0415

    return [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D))]


def _class_top(fwd, x: torch.Tensor, lo: int) -> int:
    """The largest h <= ROW_PROBE such that fwd gives every row the same numbers in any row count
    from lo to h, also one position further on."""
    outs: dict = {}

    def out(k: int, at: int = 0) -> torch.Tensor:
        if (k, at) not in outs:
            outs[k, at] = fwd(x[None, at : at + k])[0]
        return outs[k, at]

    h = lo
    while h < ROW_PROBE and torch.equal(out(h), out(h + 1)[:h]) and torch.equal(out(h, 1), out(h + 1)[1:]):
        h += 1
    return h


def _one_row_agrees(fwd, x: torch.Tensor) -> bool:
    """Whether fwd gives each of ONE_ROW_PROBE rows the same numbers alone as beside another row."""
    return all(torch.equal(fwd(x[None, i : i + 1]), fwd(x[None, i : i + 2])[:, :1]) for i in range(ONE_ROW_PROBE))


def _kinds(model) -> dict:
    """The model's matmul modules by kind (type, weight shape, bias): kind -> [modules]."""
    kinds: dict = {}
    for m in _row_modules(model):
        kinds.setdefault((type(m), tuple(m.weight.shape), m.bias is not None), []).append(m)
    return kinds


def _width(m) -> int:
    """The width of the rows m multiplies."""
    return m.weight.shape[1] if isinstance(m, torch.nn.Linear) else m.weight.shape[0]


@torch.inference_mode()
def calibrate_rows(model, seeds: int = 2, forward_of=lambda m: m.forward) -> tuple[int, int] | None:
    """(lo, hi): row counts for which every matmul module of the model, run as forward_of(module),
    gives each row the same numbers, whatever the count in lo..hi and wherever the row sits; the
    smallest lo up to 8 with hi >= 2 lo (so any longer input splits into blocks of lo..hi rows);
    lo = 1 only if one-row products also pass `_one_row_agrees`. None if there is none."""
    fwds = [(forward_of(ms[0]), _width(ms[0])) for ms in _kinds(model).values()]  # one module of each kind
    g = torch.Generator().manual_seed(0)
    probes = [(fwd, [torch.randn(ROW_PROBE + 1, w, generator=g).to(model.dtype) for _ in range(seeds)]) for fwd, w in fwds]
    for lo in range(1, 9):
        hi = min(_class_top(fwd, x, lo) for fwd, xs in probes for x in xs)
        if hi >= 2 * lo and (lo > 1 or all(_one_row_agrees(fwd, torch.randn(ONE_ROW_PROBE + 1, w, generator=g).to(model.dtype))
                                           for fwd, w in fwds)):
            return lo, hi
    return None


def _blocked(forward, hi: int, lead_forward=None):
    """forward (a row-wise module's) on a pass's input: each of its lead rows (long prefill chunks)
    in one product of lead_forward (default: forward), then the other rows in near-equal blocks of
    at most hi rows each (at least hi / 2 >= lo)."""
    lead_forward = lead_forward or forward

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        p = _current.get(None)
        lead = p.lead if p is not None and rows == p.rows else []
        if rows <= hi and not lead:
            return forward(x)
        rest = rows - sum(lead)
        n = -(-rest // hi)
        sizes = lead + [rest // n + (i < rest % n) for i in range(n)]
        flat = x.reshape(1, rows, x.shape[-1])
        out = torch.cat([(lead_forward if i < len(lead) else forward)(b) for i, b in enumerate(flat.split(sizes, dim=1))], dim=1)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return run


def _per_row(m, own_weight: bool = False):
    """m's product (an nn.Linear's or a Conv1D's) with each row in a product of its own: a batched
    matmul with one row per batch entry and the weight, laid out [in, out], broadcast to every
    entry. A row then gets the same numbers at any row count, so nothing needs padding; the rows
    after the first read the weight from cache. An nn.Linear's weight is transposed once: with
    own_weight (not for a weight shared with another module, such as tied embeddings) the module
    keeps only the transposed copy, as a view in its usual shape, so memory does not grow."""
    w = m.weight.detach()
    if isinstance(m, torch.nn.Linear):
        w = w.t().contiguous()  # [in, out]
        if own_weight:
            m.weight = torch.nn.Parameter(w.t(), requires_grad=False)  # the same storage; F.linear reads it as x @ w
    b = m.bias

    def run(x: torch.Tensor) -> torch.Tensor:
        r = x.reshape(-1, 1, x.shape[-1])
        y = torch.bmm(r, w.expand(r.shape[0], *w.shape))
        if b is not None:
            y = y + b
        return y.reshape(*x.shape[:-1], w.shape[1])

    return run


def _packed_weight(m) -> torch.Tensor:
    """m's weight reordered once into oneDNN's own layout (torch.ops.mkldnn, what inductor's CPU
    weight prepacking uses)."""
    w = m.weight.detach()
    return torch.ops.mkldnn._reorder_linear_weight((w if isinstance(m, torch.nn.Linear) else w.t()).contiguous(), 1)


def _prepacked(m, packed: torch.Tensor | None = None):
    """m's product (an nn.Linear's or a Conv1D's) through oneDNN with the weight reordered once
    (`_packed_weight`, or packed: the same weight's, packed for another module). The same kernel
    as the module's own half-precision product, so the same numbers (`_prepack` checks), but the
    plain matmul reorders the weight on every call: for one to a few rows that doubles its time."""
    packed = _packed_weight(m) if packed is None else packed
    b = None if m.bias is None else m.bias.detach()

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")

    return run


def _holders(model) -> collections.Counter:
    """How many modules hold each parameter (by id): one held twice (input and output embeddings
    tied) is read by the other module as it is."""
    return collections.Counter(id(p) for mod in model.modules() for p in mod.parameters(recurse=False))


@torch.inference_mode()
def _prepack(model, force: bool = False) -> dict | None:
    """For a half-precision model on the CPU: switches every matmul module's forward to
    `_prepacked` where that gives the module's own numbers (one module of each kind probed, at 1
    and ROUND_ROWS rows) and, unless forced, makes the matmuls of a one-token step and of a round
    of ROUND_ROWS tokens at least PREPACK_GAIN times faster (one module of each kind timed, in
    up to PREPACK_TRIES tries), and
    the packed copies fit in PREPACK_MEMORY_SHARE of the host's free memory. The plain weights stay
    (the modules' own attributes: anything that reads them directly still computes with the right
    numbers), so the matmul weights are held twice. One module of each kind is packed for the
    checks; the rest only once they pass, and all before any is switched, so a failure changes
    nothing. Returns {module: its plain forward} if it switched, else None."""
    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not all(hasattr(ops, op) for op in ("_reorder_linear_weight", "_linear_pointwise")):
        return None
    name = f"{type(model).__name__} in {model.dtype}"
    weights = {(isinstance(m, torch.nn.Linear), id(m.weight)): m.weight for m in _row_modules(model)}  # a shared weight: packed once
    extra, free = sum(w.numel() * w.element_size() for w in weights.values()), available_memory_bytes()
    if free is not None and extra > PREPACK_MEMORY_SHARE * free:
        log.info("%s: prepacked matmuls not used: their %.2f GiB would pass %.0f%% of the %.2f GiB free", name, extra / 2**30,
                 100 * PREPACK_MEMORY_SHARE, free / 2**30)
        return None
    packed: dict = {}  # module -> its prepacked forward: one module of each kind until the checks pass
    by_weight: dict = {}  # (layout, weight id) -> the packed weight: modules that share a weight share one packed copy

    def pack(m):
        if m not in packed:
            key = (isinstance(m, torch.nn.Linear), id(m.weight))
            if key not in by_weight:
                by_weight[key] = _packed_weight(m)
            packed[m] = _prepacked(m, by_weight[key])
        return packed[m]

    try:
        g = torch.Generator().manual_seed(0)
        for ms in _kinds(model).values():
            x = torch.randn(1, ROUND_ROWS, _width(ms[0]), generator=g).to(model.dtype)
            if not all(torch.equal(pack(ms[0])(r), ms[0].forward(r)) for r in (x, x[:, :1])):
                log.info("%s: prepacked matmuls give other numbers on this CPU; not used", name)
                return None
        if not force:
            for _ in range(PREPACK_TRIES):  # a miss is timed again: once, a loaded machine timed a 1.85x step at 1.02x
                gains = [plain / fast for plain, fast in
                         (_matmul_seconds(model, [(_own_forward, n), (pack, n)]) for n in (1, ROUND_ROWS))]
                log.info("%s: prepacked matmuls are %.2fx as fast for a step, %.2fx for a %d-row round", name, *gains, ROUND_ROWS)
                if min(gains) >= PREPACK_GAIN:
                    break
            else:
                return None
        for m in _row_modules(model):
            pack(m)
    except (RuntimeError, AttributeError) as e:  # this build's oneDNN cannot pack this dtype or shape
        log.info("%s: prepacked matmuls unavailable (%s)", name, e)
        return None
    former = {}
    for m, fwd in packed.items():
        former[m], m.forward = m.forward, fwd
    return former


def available_memory_bytes(device: torch.device | None = None) -> int | None:
    """Free memory on `device`: the CUDA device's free memory, or the host's MemAvailable."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def _own_forward(m):
    return m.forward


TIMING_REPEATS = 5  # every contender timed this many times, alternately; the best of each counts


def _best_seconds(fns: list, calls: int = 20, repeats: int = TIMING_REPEATS) -> list[float]:
    """Seconds one call of each fn takes: `repeats` timings of `calls` calls each, taken in turn
    (a, b, a, b, ...: a burst of load from a neighbour on a shared machine then falls on every
    contender, not on one), after one untimed call each; the best timing of each."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return [b / calls for b in best]


@torch.inference_mode()
def _matmul_seconds(model, runs: list[tuple]) -> list[float]:
    """Seconds the model's matmuls take for each (forward_of, rows) in runs: each module run as
    forward_of(module) on inputs of `rows` rows. One module of each kind is timed, with every run
    in turn (`_best_seconds`), and counted as often as the kind occurs."""
    totals = [0.0] * len(runs)
    for ms in _kinds(model).values():
        xs = {rows: torch.randn(1, rows, _width(ms[0])).to(model.dtype) for _, rows in runs}
        fns = [functools.partial(forward_of(ms[0]), xs[rows]) for forward_of, rows in runs]
        for i, t in enumerate(_best_seconds(fns)):
            totals[i] += t * len(ms)
    return totals


def _per_row_pays(model, lo: int, per_row) -> bool:
    """Whether per-row products (per_row(module): its per-row forward) make a one-token step's
    matmuls at least PER_ROW_GAIN times faster than lo-row GEMMs, while a round of ROUND_ROWS
    tokens costs at most PER_ROW_ROUND_COST times its GEMM (timed on this CPU with one module of
    each kind)."""
    gemm_step, per_row_step, per_row_round, gemm_round = _matmul_seconds(
        model, [(_own_forward, lo), (per_row, 1), (per_row, ROUND_ROWS), (_own_forward, ROUND_ROWS)])
    step, rnd = gemm_step / per_row_step, per_row_round / gemm_round
    log.info("%s in %s: per-row products make a step's matmuls %.2fx faster and cost a %d-row round's %.2fx",
             type(model).__name__, model.dtype, step, ROUND_ROWS, rnd)
    return step >= PER_ROW_GAIN and rnd <= PER_ROW_ROUND_COST


ATTN = "specdec_packed"


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


class KVCache:
    """One session's cache: per layer K and V [H_kv, capacity, D], written in place."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0  # tokens held
        self.k: list[torch.Tensor] = []  # per layer [H_kv, capacity, D]
        self.v: list[torch.Tensor] = []

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def release(self) -> None:
        self.k, self.v, self.length = [], [], 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


@dataclass
class _Pass:
    """The layout of one packed pass: session i's n_i new tokens are rows off_i..off_i+n_i."""

    caches: list[KVCache]
    offsets: list[int]
    counts: list[int]
    starts: list[int]  # tokens each cache held before the pass
    rows: int  # T, with padding
    lead: list[int]  # row counts of the prefill chunks that come first, each in a product of its own (_blocked)
    kv_dtype: torch.dtype  # the dtype the caches are kept and attended in (attention_dtype)
    _masks: dict = field(default_factory=dict)

    def mask(self, i: int, lo: int, window: int | None, device) -> torch.Tensor | None:
        """[n_i, L_i + n_i - lo] bool: query j (position L_i + j) sees key position p iff
        lo <= p <= L_i + j and (no window or p > L_i + j - window). None for a single query,
        which sees every key from lo on (lo already starts the window)."""
        L, n = self.starts[i], self.counts[i]
        if n == 1:
            return None
        key = (i, lo, window)
        if key not in self._masks:
            qpos = L + torch.arange(n, device=device)[:, None]  # [n, 1]
            kpos = lo + torch.arange(L + n - lo, device=device)[None, :]  # [1, L+n-lo]
            m = kpos <= qpos
            if window:
                m &= kpos > qpos - window
            self._masks[key] = m
        return self._masks[key]


_current: contextvars.ContextVar[_Pass] = contextvars.ContextVar("specdec_pass")


class _PassCache(Cache):
    """What the model sees as its KV cache (`cache_kwargs`) during a pass: `update` writes each session's
    new keys and values into its own buffers; attention reads them there (packed_attention)."""

    def __init__(self, p: _Pass):
        super().__init__(layers=[])
        self.p = p

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # [1, H_kv, T, D]
        p = self.p
        for c, off, n, L in zip(p.caches, p.offsets, p.counts, p.starts):
            if len(c.k) == layer_idx:  # first write: allocate the whole reservation
                c.k.append(key_states.new_empty((key_states.shape[1], c.capacity, key_states.shape[3]), dtype=p.kv_dtype))
                c.v.append(value_states.new_empty((value_states.shape[1], c.capacity, value_states.shape[3]), dtype=p.kv_dtype))
            c.k[layer_idx][:, L : L + n] = key_states[0, :, off : off + n]
            c.v[layer_idx][:, L : L + n] = value_states[0, :, off : off + n]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    @property
    def is_compileable(self) -> bool:
        return False


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """query [1, H, T, D] -> ([1, T, H, D], None); keys and values come from each session's cache."""
    if s_aux is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported")
    p = _current.get()
    layer = module.layer_idx
    H, D = query.shape[1], query.shape[3]
    cpu = query.device.type == "cpu"

    def attend(c, off, n, L, mask_fn):  # -> [1, H, n, D]
        lo = max(0, L - sliding_window + 1) if sliding_window else 0
        k = c.k[layer][None, :, lo : L + n]  # [1, H_kv, L+n-lo, D], a view
        q = query[:, :, off : off + n]
        v = c.v[layer][None, :, lo : L + n]
        mask = mask_fn(lo)
        if cpu or mask is not None:
            # the CPU: one memory layout whatever the pass; a GPU: an H100 run with strided masked
            # queries gave half the batch throughput (not isolated)
            q = q.to(k.dtype).contiguous()  # [1, H, n, D], in the cache's dtype (attention_dtype)
        if softcap:
            return _eager(q, k, v, mask, scaling if scaling is not None else D**-0.5, softcap)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != H)

    outs = []
    for i, (c, off, n, L) in enumerate(zip(p.caches, p.offsets, p.counts, p.starts)):
        if cpu and 1 < n <= ROW_BY_ROW and i >= len(p.lead):  # a round on the CPU: each query alone, exactly as a single step at its position computes it
            outs += [attend(c, off + j, 1, L + j, lambda lo: None) for j in range(n)]
        else:  # one query, a long or lead prefill chunk, or a GPU: one masked call per session
            outs.append(attend(c, off, n, L, lambda lo, i=i: p.mask(i, lo, sliding_window, query.device)))
    real = sum(p.counts)
    if p.rows > real:  # padding rows (the CPU's calibrated minimum): zeros, never read
        outs.append(outs[0].new_zeros(1, H, p.rows - real, value.shape[3]))
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, H, T, D]
    return o.transpose(1, 2).to(query.dtype), None


def _eager(q, k, v, mask, scaling: float, softcap: float) -> torch.Tensor:
    """Attention with tanh logit soft-capping (Gemma 2), in transformers' eager order of ops."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling  # [1, H, n, L+n-lo]
    w = torch.tanh(w / softcap) * softcap
    if mask is not None:
        w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)


AttentionInterface.register(ATTN, packed_attention)  # no mask function: masks are built per session


def attention_dtype(model) -> torch.dtype:
    """The dtype the model's KV caches are kept and attended in: its own, except a half-precision
    model on a CPU whose one-query attention kernel is much faster in float32 (`_faster_attention`)."""
    return getattr(model, "_specdec_kv_dtype", None) or model.dtype


def _faster_attention(model, keys: int = 256, calls: int = 20) -> torch.dtype:
    """For a half-precision model on the CPU: float32 if one query over `keys` keys, at the model's
    head shape, attends at least ATTN_FLOAT32_GAIN times faster in float32 (the query cast there and
    the output cast back included) than in the model's dtype; else the model's dtype. CPU bf16
    attention kernels differ widely: 14 us against 20 us in float32 on one x86 machine, 135 against
    22 us on another (200 keys, 8 heads of 64, one thread)."""
    cfg, dt = model.config.get_text_config(), model.dtype
    try:
        H = cfg.num_attention_heads
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
        H_kv = getattr(cfg, "num_key_value_heads", None) or H
    except AttributeError:
        return dt
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, D, generator=g) for h, n in ((H, 1), (H_kv, keys), (H_kv, keys)))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    qh, kh, vh = q.to(dt), k.to(dt), v.to(dt)  # a cache in the model's dtype, or (k, v) one in float32
    own, wide = _best_seconds([lambda: sdpa(qh, kh, vh, enable_gqa=H_kv != H),
                               lambda: sdpa(qh.float(), k, v, enable_gqa=H_kv != H).to(dt)], calls)
    return torch.float32 if own > ATTN_FLOAT32_GAIN * wide else dt


PINS = {"attention": ("float32", "model"), "prepack": ("on", "off"), "per-row": ("on", "off")}


def parse_choices(text: str | None) -> dict[str, bool | str]:
    """--engine-choices ('attention=float32,prepack=on,per-row=off', any of them; '' for none) ->
    use_packed_attention's keyword arguments. ValueError names what is wrong."""
    out: dict[str, bool | str] = {}
    for part in filter(None, (x.strip() for x in (text or "").split(","))):
        name, _, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if name not in PINS or value not in PINS[name]:
            raise ValueError(f"--engine-choices: {part!r} is not one of " +
                             ", ".join(f"{n}={'|'.join(v)}" for n, v in PINS.items()))
        key = name.replace("-", "_")
        if key in out:
            raise ValueError(f"--engine-choices: {name} given twice")
        out[key] = value if name == "attention" else value == "on"
    if out.get("prepack") and out.get("per_row"):
        raise ValueError("--engine-choices: prepack=on and per-row=on exclude each other (per-row products read the plain weights)")
    return out


def _made(model) -> dict[str, str]:
    """{choice: value} for each choice that applies to the model's dtype, as the engine stands
    (after use_packed_attention on the CPU; {} on a GPU)."""
    if model.device.type != "cpu" or not hasattr(model, "_specdec_rows"):
        return {}
    out = {}
    if model.dtype in (torch.bfloat16, torch.float16):
        out["attention"] = "float32" if attention_dtype(model) == torch.float32 else "model"
        out["prepack"] = "on" if getattr(model, "_specdec_prepacked", False) else "off"
    out["per-row"] = "on" if getattr(model, "_specdec_per_row", False) else "off"
    return out


def engine_choices(model) -> str:
    """The engine's state after use_packed_attention on the CPU, in --engine-choices' format ('' on
    a GPU): each choice that applies to the model's dtype, timed or pinned. Given back at the next
    start they are made again without timing (the checks still run), so with the same thread count
    the engine computes the same numbers."""
    return ",".join(f"{k}={v}" for k, v in _made(model).items())


def use_packed_attention(model, per_row: bool | None = None, prepack: bool | None = None, attention: str | None = None) -> None:
    """Switches the model to the packed attention; on the CPU, calibrates its row counts once and
    makes its matmul modules cut long inputs into blocks of them (see the module docstring), and
    picks the dtype a half-precision model attends in (`_faster_attention`).

    Where the calibration pads a one-token step to lo > 1 rows, per-row products (`_per_row`) are
    tried instead: they need no padding, and are kept if they calibrate to lo = 1 and pay on this
    CPU (`_per_row_pays`; per_row forces the choice either way, for tests). Prefill chunks of more
    than PER_ROW_LEAD tokens then keep the GEMM, in a product of their own (their numbers depend on
    the chunk alone either way).

    A half-precision model first has its matmul weights prepacked for oneDNN where that gives the
    same numbers and pays (`_prepack`; prepack forces it either way where it gives the same
    numbers; per_row=True wins over it). Its GEMMs are then calibrated as they are, and
    per-row products are not tried unless no row counts agree (then the prepacking is undone).
    attention ('float32' or 'model') fixes the dtype a half-precision model attends in.

    per_row, prepack and attention replace the timed choices (`engine_choices` gives them back for
    the next start: --engine-choices); the checks of the numbers run either way."""
    model.set_attn_implementation(ATTN)
    name = f"{type(model).__name__} in {model.dtype}"
    pins = {k: v for k, v in (("attention", attention), ("prepack", prepack), ("per-row", per_row)) if v is not None}
    if model.device.type != "cpu":
        if pins:
            log.warning("%s: engine choices are made on the CPU only; the pinned %s ignored on %s", name, ", ".join(pins), model.device)
        return
    if hasattr(model, "_specdec_rows"):
        return
    _choose(model, per_row, prepack, attention)
    made = _made(model)
    for k, v in pins.items():
        want = v if k == "attention" else ("on" if v else "off")
        if k not in made:
            log.warning("%s: the pinned %s=%s does not apply to this dtype; ignored", name, k, want)
        elif made[k] != want:
            log.warning("%s: the pinned %s=%s could not be kept (its check failed: see above); %s=%s instead",
                        name, k, want, k, made[k])
    log.info("%s: engine choices %s (%s; --engine-choices pins them)", name, engine_choices(model),
             f"pinned: {', '.join(pins)}" if pins else "timed")


def _choose(model, per_row: bool | None, prepack: bool | None, attention: str | None) -> None:
    """use_packed_attention's work on the CPU."""
    if model.dtype in (torch.bfloat16, torch.float16):
        if attention is None:
            with torch.inference_mode():
                model._specdec_kv_dtype = _faster_attention(model)
        else:
            model._specdec_kv_dtype = torch.float32 if attention == "float32" else model.dtype
        log.info("%s in %s: KV cache and attention in %s on this CPU", type(model).__name__, model.dtype, model._specdec_kv_dtype)
    unpacked = None
    if model.dtype in (torch.bfloat16, torch.float16) and per_row is not True and prepack is not False:
        unpacked = _prepack(model, force=bool(prepack))  # {module: plain forward}, or None
    mods = _row_modules(model)
    rows = calibrate_rows(model) if per_row is not True else None
    if unpacked is not None:
        if rows is None:  # no row counts agree: back to the plain forwards, so per-row products can be tried
            for m, fwd in unpacked.items():
                m.forward = fwd
        else:  # kept, without per-row products (slower than GEMMs in bf16)
            model._specdec_prepacked = True
            per_row = False
    if per_row is not False and (per_row or rows is None or rows[0] > 1):
        probes: dict = {}  # one module of each kind's per-row forward, for calibration and timing alike

        def probe(m):
            return probes.setdefault(m, _per_row(m))

        # timed first: calibrating per-row products costs far more where they are slow (bf16 here: a minute)
        pays = per_row or rows is None or _per_row_pays(model, rows[0], probe)
        per = calibrate_rows(model, forward_of=probe) if pays else None
        if per is not None and per[0] == 1:
            holders = _holders(model)
            gemm = {m: m.forward for m in mods}
            for m in mods:
                m.forward = _blocked(_per_row(m, own_weight=holders[id(m.weight)] == 1), per[1], gemm[m])
            model._specdec_rows, model._specdec_lead, model._specdec_per_row = per, PER_ROW_LEAD, True
            log.info("%s in %s: per-row matmul products (no padding rows), blocks of up to %d rows",
                     type(model).__name__, model.dtype, per[1])
            return
        if per_row:
            rows = calibrate_rows(model)
    model._specdec_rows = rows
    if rows is None:
        log.warning("%s in %s: no row counts give this CPU's matmuls the same numbers per row; a session's numbers may "
                    "change with its batch-mates (only near-ties can flip)", type(model).__name__, model.dtype)
        return
    for m in mods:
        m.forward = _blocked(m.forward, rows[1])
    log.info("%s in %s: matmuls padded to %d rows, cut into blocks of %d-%d rows", type(model).__name__, model.dtype, rows[0], *rows)


@torch.inference_mode()
def forward_packed(model, inputs: list[list[int]], caches: list[KVCache], logits: bool | list[bool] = True) -> list[torch.Tensor | None]:
    """Runs inputs[i] after caches[i] for every i in one pass, writing the new keys and values in
    place. Returns, per input, its logits [n_i, V] (float32, on the model's device) where
    logits (or logits[i]) is true, else None. A failed pass leaves every cache's length as it was."""
    device = model.device
    want = [logits] * len(inputs) if isinstance(logits, bool) else list(logits)
    # A prefill chunk longer than the CPU's calibrated top (its keys and values only) goes first,
    # in one product of its own: its numbers then depend on the chunk alone, which depends on the
    # prompt alone, and its weights are read once, not once per block (see _blocked).
    pad_to, top = row_counts(model, device)
    own = {i for i, x in enumerate(inputs) if top is not None and not want[i] and len(x) > top}
    order = sorted(range(len(inputs)), key=lambda i: i not in own)
    inputs, caches, want = [inputs[i] for i in order], [caches[i] for i in order], [want[i] for i in order]
    counts = [len(x) for x in inputs]
    starts, ends = [], {}  # a cache may take two inputs (a prompt's last chunk, then a step): the second starts after the first
    for c, n in zip(caches, counts):
        starts.append(ends.get(id(c), c.length))
        ends[id(c)] = starts[-1] + n
    lead = [counts[i] for i in range(len(own))]  # rows of the own products, first in the pass
    real = sum(counts)
    rest = real - sum(lead)  # the other sessions' rows, padded to pad_to
    T = sum(lead) + (max(rest, pad_to) if rest or not lead else 0)
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    for c, L, n in zip(caches, starts, counts):
        if L + n > c.capacity:
            raise ValueError(f"cache overflow: {L} + {n} tokens > capacity {c.capacity}")
    flat = [t for x in inputs for t in x] + [0] * (T - real)  # padding rows: token 0 at position 0, never attended
    pos = [L + j for L, n in zip(starts, counts) for j in range(n)] + [0] * (T - real)
    ids, position_ids = torch.tensor([flat, pos], dtype=torch.long, device=device).split(1)  # [1, T] each, one copy to the device
    keep = [r for i, n in enumerate(counts) if want[i] for r in range(offsets[i], offsets[i] + n)]  # rows that need logits
    p = _Pass(caches, offsets, counts, starts, T, lead, attention_dtype(model))
    token = _current.set(p)
    try:
        cache = _PassCache(p)
        if keep:
            # >= pad_to rows for the head too; every row (0): no index to copy to the device
            rows = 0 if len(keep) == T else torch.tensor(keep + [keep[-1]] * (pad_to - len(keep)), device=device)
            out = model(input_ids=ids, position_ids=position_ids, use_cache=True, logits_to_keep=rows, **cache_kwargs(model, cache)).logits[0]
        else:
            model.base_model(input_ids=ids, position_ids=position_ids, use_cache=True, **cache_kwargs(model.base_model, cache))
    finally:
        _current.reset(token)
    for c, n in zip(caches, counts):
        c.length += n
    res: list[torch.Tensor | None] = [None] * len(inputs)
    at = 0
    for k, (i, n) in enumerate(zip(order, counts)):  # back to the callers' order
        if want[k]:
            res[i] = out[at : at + n].float()
            at += n
    return res
