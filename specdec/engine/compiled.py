"""Compiled layers on a GPU (`--compile-layers`, Plan.compiled): regional torch.compile.

Each decoder layer is compiled whole with torch.compile(fullgraph=True, dynamic=True): inductor
fuses its element-wise work (norms, rotary embedding, activation, residual adds) around the
matmuls, so a pass launches far fewer small kernels, and a CUDA graph (graphs.py) captures the
fused ones. The cache write and the attention, which read the pass's layout and the pool by the
layer's index, run as one opaque op (attention.attend, `set_opaque`), so the trace holds neither
and one compilation serves every layer (parameters are inputs of the compiled code, not
constants) and every pass. Sizes are symbolic: a row count of 1 and one of more are the only two
compilations (per distinct layer, e.g. sliding and global ones), made at load by probe passes.

Where a layer cannot be compiled whole, its children that read no pool (norms, MLP; torch.nn's
own modules, such as nn.LayerNorm, are single kernels already and stay as they are) are compiled
instead; where those cannot either (data-dependent control flow, say), the model runs
uncompiled. Each failure is a warning naming its reason, at load, before any session.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from specdec.engine.attention import opaque, set_opaque

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
    """Compiles the decoder layers whole (their attention as the `attend` op), or where a probe of
    that fails, their pool-free children; returns the modules compiled (none, with a warning, where
    neither works). Probes: passes of 1 row and of 3, then padded rounds of 1 row and of 2, twice
    each (on CUDA the second is captured as a graph), so every compilation is made now.

    Every compiled module's code is Module._call_impl, so they share one compile cache, whose
    entries dynamo bounds (recompile_limit, 8 by default) and, with fullgraph, fails past: the
    bound is raised to leave room for each class's compilations many times over. A layer's int
    attributes (its index, its window) stay symbolic (allow_unspec_int_on_nn_module), so layers
    that differ only in them share a compilation."""
    name = type(engine.model).__name__
    layers = decoder_layers(engine.model)
    if layers is None:
        log.warning("%s: no decoder layers found to compile; layers run uncompiled", name)
        return []
    config = torch._dynamo.config
    config.allow_unspec_int_on_nn_module = True
    for whole in (True, False):
        done = list(layers) if whole else [c for layer in layers for c in layer.children() if _compilable(c)]
        if not done:
            continue
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its older name
        setattr(config, limit, max(getattr(config, limit), 8 * len({type(c) for c in done}) + 8))
        for c in done:
            c.compile(fullgraph=True, dynamic=True)
        set_opaque(whole)
        cache = engine.cache(16)
        try:
            engine.forward([[0]], [cache])
            engine.forward([[0, 0, 0]], [cache])
            for rows in ([0], [0, 0]):  # padded: a uniform pass where the engine has them
                engine.forward([rows], [cache], padded=True)
                engine.forward([rows], [cache], padded=True)
            return done
        except Exception as e:  # noqa: BLE001 - a model whose layers cannot be compiled still runs, uncompiled
            log.warning("%s: torch.compile of its %s failed (%s: %s)", name, "layers" if whole else "layers' norms and MLPs",
                        type(e).__name__, " ".join(str(e).split())[:300])
            for c in done:
                c._compiled_call_impl = None  # what Module.compile set: back to the module's own call
            set_opaque(False)
        finally:
            cache.release()
    log.warning("%s: layers run uncompiled", name)
    return []


@contextlib.contextmanager
def uncompiled(modules: list[torch.nn.Module]):
    """Runs the compiled modules uncompiled for a while (benchmarks compare the two in one process)."""
    saved, was = [m._compiled_call_impl for m in modules], opaque()
    for m in modules:
        m._compiled_call_impl = None
    set_opaque(False)
    try:
        yield
    finally:
        for m, c in zip(modules, saved):
            m._compiled_call_impl = c
        set_opaque(was)

