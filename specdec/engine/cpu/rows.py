"""The CPU tier's matmul rules: row counts that give a row the same numbers wherever it sits.

A CPU GEMM gives a row the same numbers only among row counts that take the same kernel: which
counts those are depends on the CPU, the dtype and the weight's shape (the shipped target in
float32: 1 row, 2-15 rows and 16 or more rows are three classes on one x86 machine). So at load
the model's matmul modules are probed: `calibrate_rows` finds row counts lo..hi that all give
every row the same numbers, wherever it sits (every count up to 64, then 128 and 256). A pass is
padded to lo rows, and each matmul module cuts a longer input into blocks of lo..hi rows
(`blocked`); lo is 1 only if a thousand one-row products also match two-row ones. Where lo > 1, per-row products (`per_row`: a batched matmul,
one row per batch entry) may replace the GEMMs, so nothing is padded; they are kept where a
one-token step's matmuls get much faster and a round's at most twice as slow, or where both get
faster (`per_row_pays`).
A prefill chunk of more than hi tokens (PER_ROW_LEAD with per-row products) goes first in its pass
and through every matmul in one product of its own. Nothing here is imported on a GPU.
"""
from __future__ import annotations

import functools
import logging
import time

import torch

from specdec.engine.attention import current

log = logging.getLogger("specdec.engine")

ROW_PROBE = 64  # row counts the calibration tries one by one
# ... then these, each against the last that passed (a pass of 32 sessions' rounds of 5 is 160 rows: blocks of
# at most 64 cost it three small products a module, which MKL runs slower per row than one of 160); longer inputs
# are always cut into blocks
ROW_LADDER = (128, 256)
# One-row products compared with two-row ones before a pass may have a single row: a one-row bf16
# kernel that sums in another order differs from the others only where the bf16 rounding of the
# sum flips (measured once on a real model: a greedy token), so it takes many outputs to see.
ONE_ROW_PROBE = 1024
PER_ROW_GAIN = 1.5  # per-row products replace padded GEMMs where they make a one-token step's matmuls this much faster
PER_ROW_ROUND_COST = 2.0  # ... as long as a round's matmuls cost at most this much more (a judgement call, with room for a loaded machine)
ROUND_ROWS = 5  # a round of tau = 4, for that comparison
PER_ROW_LEAD = 8  # with per-row products, a prefill chunk of more tokens has a GEMM of its own
TIMING_REPEATS = 5  # every contender timed this many times, alternately; the best of each counts
TIMED_CALLS = 20  # module calls in one timing of a contender
STREAMED = 8  # a kind's modules run one after another in its timings (matmul_seconds)


def row_modules(model) -> list[torch.nn.Module]:
    """The model's matmul modules that work row by row: nn.Linear and transformers' Conv1D (GPT-2)."""
    from transformers.pytorch_utils import Conv1D  # noqa: PLC0415

    return [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D))]


def class_top(fwd, x: torch.Tensor, lo: int) -> int:
    """The largest h such that fwd gives every row the same numbers in any row count from lo to h,
    also one position further on: every count up to ROW_PROBE, then the rungs of ROW_LADDER
    (each against the last count that passed; a kernel that changed and changed back between two
    rungs would go unseen). x has a row more than the last rung."""
    outs: dict = {}  # only the outputs still to be compared: a 128k-token head's would take gigabytes

    def out(k: int, at: int = 0) -> torch.Tensor:
        if (k, at) not in outs:
            outs[k, at] = fwd(x[None, at : at + k])[0]
        return outs[k, at]

    def passed(k: int) -> int:
        for key in [key for key in outs if key[0] < k]:
            del outs[key]
        return k

    h = lo
    while h < ROW_PROBE and torch.equal(out(h), out(h + 1)[:h]) and torch.equal(out(h, 1), out(h + 1)[1:]):
        h = passed(h + 1)
    for rung in ROW_LADDER if h == ROW_PROBE else ():
        if not (torch.equal(out(h), out(rung)[:h]) and torch.equal(out(rung - 1, 1), out(rung)[1:])):
            break
        h = passed(rung)
    return h


def one_row_agrees(fwd, x: torch.Tensor) -> bool:
    """Whether fwd gives each of ONE_ROW_PROBE rows the same numbers alone as beside another row."""
    return all(torch.equal(fwd(x[None, i : i + 1]), fwd(x[None, i : i + 2])[:, :1]) for i in range(ONE_ROW_PROBE))


def kinds(model) -> dict:
    """The model's matmul modules by kind (type, weight shape, bias): kind -> [modules]."""
    kinds: dict = {}
    for m in row_modules(model):
        kinds.setdefault((type(m), tuple(m.weight.shape), m.bias is not None), []).append(m)
    return kinds


def width(m) -> int:
    """The width of the rows m multiplies."""
    return m.weight.shape[1] if isinstance(m, torch.nn.Linear) else m.weight.shape[0]


@torch.inference_mode()
def calibrate_rows(model, seeds: int = 2, forward_of=lambda m: m.forward) -> tuple[int, int] | None:
    """(lo, hi): row counts for which every matmul module of the model, run as forward_of(module),
    gives each row the same numbers, whatever the count in lo..hi and wherever the row sits; the
    smallest lo up to 8 with hi >= 2 lo (so any longer input splits into blocks of lo..hi rows);
    lo = 1 only if one-row products also pass `one_row_agrees`. None if there is none."""
    fwds = [(forward_of(ms[0]), width(ms[0])) for ms in kinds(model).values()]  # one module of each kind
    g = torch.Generator().manual_seed(0)
    probes = [(fwd, [torch.randn(max((ROW_PROBE, *ROW_LADDER)) + 1, w, generator=g).to(model.dtype) for _ in range(seeds)]) for fwd, w in fwds]
    for lo in range(1, 9):
        hi = min(class_top(fwd, x, lo) for fwd, xs in probes for x in xs)
        if hi >= 2 * lo and (lo > 1 or all(one_row_agrees(fwd, torch.randn(ONE_ROW_PROBE + 1, w, generator=g).to(model.dtype))
                                           for fwd, w in fwds)):
            return lo, hi
    return None


def blocked(forward, hi: int, lead_forward=None):
    """forward (a row-wise module's) on a pass's input: each of its lead rows (long prefill chunks)
    in one product of lead_forward (default: forward), then the other rows in near-equal blocks of
    at most hi rows each (at least hi / 2 >= lo)."""
    lead_forward = lead_forward or forward

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        p = current()
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


def per_row(m, own_weight: bool = False):
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



def own_forward(m):
    return m.forward




def best_seconds(fns: list, calls: int = TIMED_CALLS, repeats: int = TIMING_REPEATS) -> list[float]:
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


def clock(what: str, fns: list) -> list[float]:
    """The load-time timer: seconds per call of each fn (`best_seconds`). `what` names the choice
    being timed ("attention", "prepack", "per-row"); a test passes a timer of its own instead."""
    return best_seconds(fns)


@torch.inference_mode()
def matmul_seconds(model, runs: list[tuple], timer=None, what: str = "") -> list[float]:
    """Seconds the model's matmuls take for each (forward_of, rows) in runs: each module run as
    forward_of(module) on inputs of `rows` rows. Each kind is timed on up to STREAMED of its modules
    (from layers spread over the model) run one after another, with every run in turn
    (`best_seconds`), and counted as often as the kind occurs. One module run over and over would
    keep its weight in cache where a pass streams every weight once: on a CPU whose cache holds a
    small weight (a Xeon's 2 MB of L2 a core), that times MKL's GEMMs on cached weights, faster
    than they run in a pass (bench/results/ENGINE.md, the Xeon's runs)."""
    totals = [0.0] * len(runs)
    for ms in kinds(model).values():
        some = ms[:: -(-len(ms) // STREAMED)]  # [<= STREAMED] distinct weights
        xs = {rows: torch.randn(1, rows, width(ms[0])).to(model.dtype) for _, rows in runs}
        fns = [functools.partial(_each, [forward_of(m) for m in some], xs[rows]) for forward_of, rows in runs]
        seconds = timer(what, fns) if timer else best_seconds(fns, calls=max(2, TIMED_CALLS // len(some)))
        for i, t in enumerate(seconds):
            totals[i] += t / len(some) * len(ms)
    return totals


def _each(fwds: list, x: torch.Tensor) -> None:
    for f in fwds:
        f(x)


def per_row_pays(model, lo: int, per_row, timer=None) -> bool:
    """Whether per-row products (per_row(module): its per-row forward) make a one-token step's
    matmuls at least PER_ROW_GAIN times faster than lo-row GEMMs, while a round of ROUND_ROWS
    tokens costs at most PER_ROW_ROUND_COST times its GEMM, or make both faster (timed on this
    CPU with a few modules of each kind, `matmul_seconds`)."""
    gemm_step, per_row_step, per_row_round, gemm_round = matmul_seconds(
        model, [(own_forward, lo), (per_row, 1), (per_row, ROUND_ROWS), (own_forward, ROUND_ROWS)], timer, "per-row")
    step, rnd = gemm_step / per_row_step, per_row_round / gemm_round
    log.info("%s in %s: per-row products make a step's matmuls %.2fx faster and cost a %d-row round's %.2fx",
             type(model).__name__, model.dtype, step, ROUND_ROWS, rnd)
    return (step >= PER_ROW_GAIN and rnd <= PER_ROW_ROUND_COST) or (step > 1 and rnd < 1)

