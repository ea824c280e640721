"""Which architectures the packed engine serves exactly, and the start-up check that refuses the rest.

The engine (specdec/kvcache.py) runs the model's own modules and its own CausalLM head; it
replaces only the cache and the attention function, through transformers' attention
interface. So an architecture is served exactly when
  * its attention layers call that interface (`_supports_attention_backend`), with no feature
    the packed attention lacks (it handles causal masks, sliding windows, GQA and logit
    soft-capping; attention sinks are refused),
  * every layer is attention (no recurrent or linear-attention state to crop on a rejection),
  * and its logits through the engine match its own forward pass: `check_supported` runs a
    short sequence both ways at start-up, the engine's way split across a prefill, a batched
    round beside another session and single steps, and refuses the model if they differ.
The architectures in TESTED are covered by tests/test_architectures.py (greedy equality with
generate() through both services, prompts past the sliding window, runs to the context limit,
isolation, and sampled distributions where logits are transformed after the head).
"""
from __future__ import annotations

import torch

from specdec.kvcache import KVCache, forward_packed, use_packed_attention

TESTED = ("llama", "qwen2", "qwen3", "mistral", "starcoder2", "gemma2", "gemma3_text", "phi3", "granite", "gpt2", "gpt_neox", "cohere")
NON_ATTENTION_LAYERS = ("linear_attention", "mamba", "conv", "recurrent", "mlp_only")


def context_limit(config) -> int:
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return 2048


def check_supported(lm, choices: dict | None = None) -> None:
    """Switches lm.model to the packed attention (with the engine's pinned load-time choices,
    kvcache.parse_choices), or raises Unsupported naming the architecture and the reason."""
    from specdec.lm import Unsupported  # noqa: PLC0415

    model, cfg = lm.model, lm.model.config
    arch = f"{type(model).__name__} ({cfg.model_type})"
    if not getattr(model, "_supports_attention_backend", False):
        raise Unsupported(f"{arch}: its attention does not go through transformers' attention interface, so the engine "
                          "cannot give each session its own keys (batch-mates would see each other's padding)")
    layer_types = getattr(cfg, "layer_types", None) or []
    odd = sorted({t for t in layer_types if any(k in str(t) for k in NON_ATTENTION_LAYERS)})
    if odd:
        raise Unsupported(f"{arch}: layers of type {', '.join(odd)} keep a recurrent state that cannot be cropped on a rejection")
    if getattr(cfg, "is_encoder_decoder", False):
        raise Unsupported(f"{arch}: encoder-decoder models are not served")
    reference_impl = cfg._attn_implementation
    try:
        _probe(lm, reference_impl, choices or {})
    except Unsupported:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the engine's pass means: not servable
        raise Unsupported(f"{arch}: the packed engine cannot run it ({type(e).__name__}: {e})") from None


@torch.inference_mode()
def _probe(lm, reference_impl: str, choices: dict) -> None:
    from specdec.lm import Unsupported  # noqa: PLC0415

    model = lm.model
    n = max(8, min(40, lm.max_context - 2))
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, lm.vocab_size, (n,), generator=g).tolist()
    other = torch.randint(0, lm.vocab_size, (7,), generator=g).tolist()
    ref = model(input_ids=torch.tensor([ids], device=lm.device)).logits[0].float()  # [n, V], the model's own attention
    use_packed_attention(model, **choices)
    a, b = KVCache(n), KVCache(n)
    split = n - 6
    forward_packed(model, [ids[: split - 3]], [a], logits=False)  # prefill
    got = forward_packed(model, [ids[split - 3 : split], other], [a, b])[0]  # a round beside another session
    steps = [forward_packed(model, [[t]], [a])[0] for t in ids[split:]]  # single steps
    got = torch.cat([got, *steps])  # [n - split + 3, V]
    want = ref[split - 3 :]
    tol = 1e-3 if lm.dtype == torch.float32 else 0.08
    scale = max(1.0, float(want.abs().max()))
    err = float((got - want).abs().max()) / scale
    if not err <= tol:
        model.set_attn_implementation(reference_impl)
        raise Unsupported(f"{type(model).__name__} ({model.config.model_type}): logits through the packed engine differ from the "
                          f"model's own forward (max relative error {err:.2e} > {tol:g}); refusing rather than serving it wrong")
