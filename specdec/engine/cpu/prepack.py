"""The CPU tier's prepacked half-precision weights: PyTorch's bf16 matmul on the CPU reorders a
plain weight into oneDNN's blocked layout on every call; here each weight is reordered once at load
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU weight prepacking uses) and the
module runs through `torch.ops.mkldnn._linear_pointwise`: the same kernel, so the same numbers."""
from __future__ import annotations

import collections
import logging

import torch

from specdec.engine.cache import available_memory_bytes
from specdec.engine.cpu.rows import ROUND_ROWS, kinds, matmul_seconds, own_forward, row_modules, width

log = logging.getLogger("specdec.engine")

PREPACK_GAIN = 1.2  # a half-precision model's weights are prepacked for oneDNN where that makes its matmuls this much faster
PREPACK_MEMORY_SHARE = 0.25  # ... and where the packed copies take at most this share of the host's free memory
PREPACK_TRIES = 3  # timings before prepacking is found not to pay (its numbers are the same either way; only speed is at stake)


def packed_weight(m) -> torch.Tensor:
    """m's weight reordered once into oneDNN's own layout (torch.ops.mkldnn, what inductor's CPU
    weight prepacking uses)."""
    w = m.weight.detach()
    return torch.ops.mkldnn._reorder_linear_weight((w if isinstance(m, torch.nn.Linear) else w.t()).contiguous(), 1)


def prepacked(m, packed: torch.Tensor | None = None):
    """m's product (an nn.Linear's or a Conv1D's) through oneDNN with the weight reordered once
    (`packed_weight`, or packed: the same weight's, packed for another module). The same kernel
    as the module's own half-precision product, so the same numbers (`prepack` checks), but the
    plain matmul reorders the weight on every call: for one to a few rows that doubles its time."""
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
def prepack(model, force: bool = False, timer=None) -> dict | None:
    """For a half-precision model on the CPU: switches every matmul module's forward to
    `prepacked` where that gives the module's own numbers (one module of each kind probed, at 1
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
    weights = {(isinstance(m, torch.nn.Linear), id(m.weight)): m.weight for m in row_modules(model)}  # a shared weight: packed once
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
                by_weight[key] = packed_weight(m)
            packed[m] = prepacked(m, by_weight[key])
        return packed[m]

    try:
        g = torch.Generator().manual_seed(0)
        for ms in kinds(model).values():
            x = torch.randn(1, ROUND_ROWS, width(ms[0]), generator=g).to(model.dtype)
            if not all(torch.equal(pack(ms[0])(r), ms[0].forward(r)) for r in (x, x[:, :1])):
                log.info("%s: prepacked matmuls give other numbers on this CPU; not used", name)
                return None
        if not force:
            for _ in range(PREPACK_TRIES):  # a miss is timed again: once, a loaded machine timed a 1.85x step at 1.02x
                gains = [plain / fast for plain, fast in
                         (matmul_seconds(model, [(own_forward, n), (pack, n)], timer, "prepack") for n in (1, ROUND_ROWS))]
                log.info("%s: prepacked matmuls are %.2fx as fast for a step, %.2fx for a %d-row round", name, *gains, ROUND_ROWS)
                if min(gains) >= PREPACK_GAIN:
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
    return former

