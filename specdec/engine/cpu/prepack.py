"""The CPU tier's prepacked weights: each matmul weight is reordered once at load into oneDNN's
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU weight prepacking
uses) and the module runs through `torch.ops.mkldnn._linear_pointwise`.

* Half precision: PyTorch's bf16 matmul on the CPU runs the same oneDNN kernel but reorders the
  plain weight on every call, so prepacking gives the same numbers, faster.
* Float32: PyTorch's matmul is MKL's GEMM, whose kernel for a few rows costs nearly as much per
  row as one row (the shipped target: 15 ms for 2 rows, 30 ms for 9, 48 ms for 16 in two blocks).
  oneDNN's prepacked product is another kernel, with other numbers, whose cost grows far more
  slowly with rows (20 ms, 24 ms, 27 ms; a step is padded to 2 rows). Its own row calibration (rows.calibrate_rows) then
  decides its padding and blocks, as for any product."""
from __future__ import annotations

import collections
import logging

import torch

from specdec.engine.cache import available_memory_bytes
from specdec.engine.cpu.rows import ROUND_ROWS, blocked, calibrate_rows, kinds, matmul_seconds, own_forward, row_modules, width

log = logging.getLogger("specdec.engine")

PREPACK_GAIN = 1.2  # weights are prepacked for oneDNN where that makes the matmuls this much faster (float32: see `prepack`)
PREPACK_MEMORY_SHARE = 0.25  # ... and where the packed copies take at most this share of the host's free memory
PREPACK_TRIES = 3  # timings before prepacking is found not to pay (its numbers are the same either way; only speed is at stake)
PASS_ROWS = 2 * ROUND_ROWS  # float32: a verify pass of two sessions' rounds (or one of tau = 9), for the prepacking's bar


def packed_weight(m) -> torch.Tensor:
    """m's weight reordered once into oneDNN's own layout (torch.ops.mkldnn, what inductor's CPU
    weight prepacking uses)."""
    w = m.weight.detach()
    return torch.ops.mkldnn._reorder_linear_weight((w if isinstance(m, torch.nn.Linear) else w.t()).contiguous(), 1)


def prepacked(m, packed: torch.Tensor | None = None):
    """m's product (an nn.Linear's or a Conv1D's) through oneDNN with the weight reordered once
    (`packed_weight`, or packed: the same weight's, packed for another module). In half precision
    the same kernel as the module's own product, so the same numbers (`prepack` checks), but the
    plain matmul reorders the weight on every call: for one to a few rows that doubles its time.
    In float32 another kernel than the module's own (MKL's), with other numbers."""
    packed = packed_weight(m) if packed is None else packed
    b = None if m.bias is None else m.bias.detach()

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")

    return run


def holders(model) -> collections.Counter:
    """How many modules hold each parameter (by id): one held twice (input and output embeddings
    tied) is read by the other module as it is."""
    return collections.Counter(id(p) for mod in model.modules() for p in mod.parameters(recurse=False))


@torch.inference_mode()
def prepack(model, force: bool = False, timer=None, plain_rows: tuple[int, int] | None = None) \
        -> tuple[dict, tuple[int, int] | None] | None:
    """Switches every matmul module's forward to `prepacked` where that keeps the engine exact and,
    unless forced, pays; returns ({module: its plain forward}, the prepacked products' calibrated
    rows (float32; None in half precision, which calibrates after)) if it switched, else None.

    * Half precision: the prepacked product must give the module's own numbers (one module of each
      kind probed, at 1 and ROUND_ROWS rows) and make the matmuls of a one-token step and of a
      round of ROUND_ROWS tokens at least PREPACK_GAIN times faster.
    * Float32 (plain_rows: the plain GEMMs' calibrated (lo, hi), or None): the prepacked products
      must calibrate (`calibrate_rows`: row counts that give every row the same numbers), and
      against the plain GEMMs, padded to lo rows and cut into blocks of up to hi, make a verify
      pass of PASS_ROWS rows at least PREPACK_GAIN times faster while a one-token step costs at
      most PREPACK_GAIN times as much: a verifier's passes hold rounds, a step pays a little.

    Timed with a few modules of each kind (`matmul_seconds`; half precision: in up to PREPACK_TRIES tries); the packed copies must fit
    in PREPACK_MEMORY_SHARE of the host's free memory. The plain weights stay (the modules' own
    attributes: anything that reads them directly still computes with the right numbers), so the
    matmul weights are held twice. A few modules of each kind are packed for the checks; the rest only
    once they pass, and all before any is switched, so a failure changes nothing."""
    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not all(hasattr(ops, op) for op in ("_reorder_linear_weight", "_linear_pointwise")):
        return None
    name = f"{type(model).__name__} in {model.dtype}"
    half = model.dtype in (torch.bfloat16, torch.float16)
    weights = {(isinstance(m, torch.nn.Linear), id(m.weight)): m.weight for m in row_modules(model)}  # a shared weight: packed once
    extra, free = sum(w.numel() * w.element_size() for w in weights.values()), available_memory_bytes()
    if free is not None and extra > PREPACK_MEMORY_SHARE * free:
        log.info("%s: prepacked matmuls not used: their %.2f GiB would pass %.0f%% of the %.2f GiB free", name, extra / 2**30,
                 100 * PREPACK_MEMORY_SHARE, free / 2**30)
        return None
    rows = None  # float32: the prepacked products' calibrated rows
    packed: dict = {}  # module -> its prepacked forward: a few of each kind until the checks pass
    by_weight: dict = {}  # (layout, weight id) -> the packed weight: modules that share a weight share one packed copy

    def pack(m):
        if m not in packed:
            key = (isinstance(m, torch.nn.Linear), id(m.weight))
            if key not in by_weight:
                by_weight[key] = packed_weight(m)
            packed[m] = prepacked(m, by_weight[key])
        return packed[m]

    try:
        if half:
            g = torch.Generator().manual_seed(0)
            for ms in kinds(model).values():
                x = torch.randn(1, ROUND_ROWS, width(ms[0]), generator=g).to(model.dtype)
                if not all(torch.equal(pack(ms[0])(r), ms[0].forward(r)) for r in (x, x[:, :1])):
                    log.info("%s: prepacked matmuls give other numbers on this CPU; not used", name)
                    return None
            runs = [[(own_forward, n), (pack, n)] for n in (1, ROUND_ROWS)]
            what = "%s: prepacked matmuls are %.2fx as fast for a step, %.2fx for a " + f"{ROUND_ROWS}-row round"
            bars = (PREPACK_GAIN, PREPACK_GAIN)
        else:
            rows = calibrate_rows(model, forward_of=pack)  # returned: the engine pads and blocks by them
            if rows is None:
                log.info("%s: prepacked matmuls calibrate to no row counts on this CPU; not used", name)
                return None
            lo, hi = plain_rows or (4, PASS_ROWS)  # no calibrated GEMM rows: the engine's fixed padding (choose.py)
            runs = [[(own_forward, lo), (pack, rows[0])],
                    [(lambda m: blocked(m.forward, hi), PASS_ROWS), (lambda m: blocked(pack(m), rows[1]), PASS_ROWS)]]
            what = "%s: prepacked matmuls are %.2fx as fast for a step, %.2fx for a " + f"{PASS_ROWS}-row pass"
            bars = (1 / PREPACK_GAIN, PREPACK_GAIN)
        if not force:  # a half-precision miss is timed again (once, a loaded machine timed a 1.85x step at 1.02x); a
            # float32 one is not: it keeps the default GEMMs, and it would cost every float32 start-up the retries
            for _ in range(PREPACK_TRIES if half else 1):
                gains = [plain / fast for plain, fast in (matmul_seconds(model, run, timer, "prepack") for run in runs)]
                log.info(what, name, *gains)
                if all(g >= bar for g, bar in zip(gains, bars)):
                    break
            else:
                return None
        for m in row_modules(model):
            pack(m)
    except (RuntimeError, AttributeError) as e:  # this build's oneDNN cannot pack this dtype or shape
        log.info("%s: prepacked matmuls unavailable (%s)", name, e)
        return None
    former = {}
    for m, fwd in packed.items():
        former[m], m.forward = m.forward, fwd
    return former, rows
