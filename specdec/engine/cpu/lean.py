"""The lean forward: a Llama model's pass through its own modules, without its wrappers.

On a CPU a small model's pass is mostly Python: the shipped draft (2 layers of width 256) spent
about a fifth of a decode step in transformers' per-call machinery (keyword plumbing and
deprecation wrappers, output capture and dataclasses, the mask builder the engine does not use,
gradient-checkpointing layers; bench/results/LEAN.md). On a GPU CUDA graphs take that cost away;
this is the CPU tier's answer. For a model built of transformers' own Llama classes (`supported`),
`lean_forward` walks the same modules in the order `LlamaForCausalLM.forward` does: the embedding,
the rotary embedding, each layer's norms, projections, `apply_rotary_pos_emb`, the engine's cache
write and attention (attention.py, what the model's attention calls), its MLP and residuals, then
the final norm and the head on the kept rows (each called as a module, so hooks on them run).
Every tensor op is the model's own, so the numbers are the model's bitwise; the engine takes it
only after a probe at load gives the very logits of the model's forward (`lean_for`), else it
keeps the model's forward and logs why.
"""
from __future__ import annotations

import logging

import torch
from torch.nn.modules import module as module_hooks

from specdec.engine.attention import PassCache, packed_attention

log = logging.getLogger("specdec.engine")


def supported(model) -> str | None:
    """None where `lean_forward` can run `model`, else why not (the model keeps its forward)."""
    try:
        from transformers.models.llama import modeling_llama as ml  # noqa: PLC0415
    except ImportError:  # pragma: no cover - transformers always has Llama
        return "no Llama modeling in transformers"
    if type(model) is not ml.LlamaForCausalLM:
        return f"{type(model).__name__} is not transformers' LlamaForCausalLM"
    base = model.model
    if type(base.rotary_emb) is not ml.LlamaRotaryEmbedding or type(base.norm) is not ml.LlamaRMSNorm:
        return "its rotary embedding or final norm is not Llama's"
    for layer in base.layers:
        if (type(layer) is not ml.LlamaDecoderLayer or type(layer.self_attn) is not ml.LlamaAttention
                or type(layer.mlp) is not ml.LlamaMLP or {type(layer.input_layernorm), type(layer.post_attention_layernorm)} != {ml.LlamaRMSNorm}):
            return f"layer {layer.self_attn.layer_idx if hasattr(layer, 'self_attn') else '?'} is not built of Llama's modules"
    skipped = [model, base, *base.layers, *(layer.self_attn for layer in base.layers)]  # the modules it does not call
    if any(m._forward_hooks or m._forward_pre_hooks for m in skipped):
        return "the model, a decoder layer or an attention module has forward hooks"
    if any("forward" in vars(m) or getattr(m, "_compiled_call_impl", None) is not None for m in skipped):
        return "the model, a decoder layer or an attention module has its forward replaced or compiled"
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        return "global module forward hooks are registered"
    return None


def lean_forward(model):
    """model (`supported`)'s pass as a function (input_ids [1, T], position_ids [1, T], cache: the
    pass's PassCache, rows: the logits_to_keep of the model's forward, or None for the hidden
    states only) -> logits [1, k, V] or None. Each module is called as the model's forward calls it."""
    from transformers.modeling_utils import slice_logits_to_keep  # noqa: PLC0415
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: PLC0415

    base, head = model.model, model.lm_head
    layers = [(layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp)
              for layer in base.layers[: model.config.num_hidden_layers]]

    def run(input_ids: torch.Tensor, position_ids: torch.Tensor, cache: PassCache, rows) -> torch.Tensor | None:
        x = base.embed_tokens(input_ids)
        cos, sin = base.rotary_emb(x, position_ids=position_ids)
        for norm_in, attn, norm_post, mlp in layers:
            h = norm_in(x)
            shape = (*h.shape[:-1], -1, attn.head_dim)
            q = attn.q_proj(h).view(shape).transpose(1, 2)
            k = attn.k_proj(h).view(shape).transpose(1, 2)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = cache.update(k, v, attn.layer_idx)
            o, _ = packed_attention(attn, q, k, v, None, dropout=0.0, scaling=attn.scaling)
            x = x + attn.o_proj(o.reshape(*shape[:-2], -1).contiguous())
            x = x + mlp(norm_post(x))
        if rows is None:
            return None
        return head(slice_logits_to_keep(base.norm(x), rows))

    return run


def lean_for(engine):
    """The CPU tier's lean forward for `engine`'s model, where the model is built of
    Llama's modules and a probe gives the very logits of the model's own forward: two sessions'
    prompts in one pass, then a step of one and a round of the other against their caches, each
    pass both ways from the same cache state, compared bitwise. Else None, logged."""
    name = f"{type(engine.model).__name__} in {engine.model.dtype}"
    why = supported(engine.model)
    if why is None:
        try:
            run = lean_forward(engine.model)
        except Exception as e:  # noqa: BLE001 - a transformers without what it calls: the model keeps its own forward
            why = f"it could not be built: {type(e).__name__}: {e}"
    if why is None:
        why = _probe(engine, run)
    if why is not None:
        log.info("%s: the model's own forward (no lean forward: %s)", name, why)
        return None
    log.info("%s: the lean forward (the model's modules without its wrappers; its probe's logits are the model's bitwise)", name)
    return run


def _probe(engine, run) -> str | None:
    """Why `run` is not the engine's model's forward (lean_for's probe), or None where it gave the
    same logits bitwise in every pass. The engine is left on the model's own forward."""
    g = torch.Generator().manual_seed(0)
    V = engine.model.config.get_text_config().vocab_size
    caches = [engine.cache(16), engine.cache(16)]

    def both(inputs: list[list[int]]):  # the pass through each forward, from the same cache state
        before, ways = [c.length for c in caches], []
        for lean in (None, run):
            for c, n in zip(caches, before):
                c.crop(n)
            engine.lean = lean
            try:
                ways.append(engine.forward(inputs, caches))
            except Exception as e:  # noqa: BLE001 - logged; a model whose own forward fails is refused later, at its check
                where = "the model's own forward" if lean is None else "the lean forward"
                return f"its probe failed in {where}: {type(e).__name__}: {e}"
        return None if all(torch.equal(a, b) for a, b in zip(*ways)) else "its probe's logits differ from the model's forward"

    try:
        for counts in ([7, 3], [1, 2]):  # each session's new tokens in the pass
            why = both([torch.randint(V, (n,), generator=g).tolist() for n in counts])
            if why is not None:
                return why
        return None
    finally:
        engine.lean = None
        for c in caches:
            c.release()
