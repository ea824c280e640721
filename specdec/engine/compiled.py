"""Compiled layers on a GPU (`--compile-layers`, Plan.compiled): regional torch.compile.

In every decoder layer, each child module that does not read the KV pool (the norms, the MLP;
torch.nn's own modules, such as nn.LayerNorm, are single kernels already and stay as they are) is
compiled with torch.compile(fullgraph=True, dynamic=True). Inductor fuses each norm's half-dozen
element-wise kernels into one, and the MLP's activation into one, so a pass launches far fewer
small kernels, and a CUDA graph (graphs.py) captures the fused ones. The layers are copies of one
class, so one compilation per child class serves every layer (parameters are inputs of the
compiled code, not constants), and sizes are symbolic: a row count of 1 and one of more are the
only two compilations, a few seconds each, made at load by a probe pass. The attention modules
stay eager: they read the pool by their layer's index, which a compilation would specialize on,
one compilation per layer.

A model whose children cannot be compiled whole (a mixture-of-experts block's data-dependent
routing, say) is left uncompiled, with a warning naming the reason: the probe pass runs before
any session.
"""
from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger("specdec.engine")


def decoder_layers(model) -> torch.nn.ModuleList | None:
    """The model's decoder layers: its base model's `layers` (or GPT-2's `h`), else its longest
    ModuleList of modules of one class."""
    for name in ("layers", "h"):
        found = getattr(model.base_model, name, None)
        if isinstance(found, torch.nn.ModuleList) and len(found):
            return found
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(x) for x in m}) == 1]
    return max(lists, key=len, default=None)


def _compilable(module: torch.nn.Module) -> bool:
    """Not torch's own (nn.LayerNorm is one kernel already, and dynamo skips torch.nn's frames), and
    reads no pool (an attention module knows its layer_idx)."""
    return not type(module).__module__.startswith("torch.") and not any(hasattr(m, "layer_idx") for m in module.modules())


def compile_layers(engine) -> list[torch.nn.Module]:
    """Compiles every decoder layer's pool-free children and runs probe passes (1 row, 3 rows,
    then a padded round twice: on CUDA its second pass is captured as a graph) to make every
    compilation now. Returns the modules compiled; none, with a warning, where the model has none
    or a probe failed (everything is uncompiled again then).

    Every compiled module's code is Module._call_impl, so they share one compile cache, whose
    entries dynamo bounds (recompile_limit, 8 by default) and, with fullgraph, fails past: the
    bound is raised to leave room for every class's two compilations many times over."""
    layers = decoder_layers(engine.model)
    done = [c for layer in (layers or []) for _, c in layer.named_children() if _compilable(c)]
    if not done:
        log.warning("%s: no decoder layer children to compile; layers run uncompiled", type(engine.model).__name__)
        return []
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 8 * len({type(c) for c in done}) + 8)
    for c in done:
        c.compile(fullgraph=True, dynamic=True)
    cache = engine.cache(16)
    try:
        engine.forward([[0]], [cache])
        engine.forward([[0, 0, 0]], [cache])
        engine.forward([[0, 0]], [cache], padded=True)
        engine.forward([[0, 0]], [cache], padded=True)
    except Exception as e:  # noqa: BLE001 - a model whose layers cannot be compiled still runs, uncompiled
        log.warning("%s: torch.compile of its layers failed (%s: %s); layers run uncompiled", type(engine.model).__name__,
                    type(e).__name__, " ".join(str(e).split())[:300])
        for c in done:
            c._compiled_call_impl = None  # what Module.compile set: back to the module's own call
        return []
    finally:
        cache.release()
    return done


@contextlib.contextmanager
def uncompiled(modules: list[torch.nn.Module]):
    """Runs the compiled modules uncompiled for a while (benchmarks compare the two in one process)."""
    saved = [m._compiled_call_impl for m in modules]
    for m in modules:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, c in zip(modules, saved):
            m._compiled_call_impl = c

