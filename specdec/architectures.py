"""Which architectures the engine serves exactly, and the start-up check that refuses the rest.

The engine (specdec/engine) runs the model's own modules and its own CausalLM head; it
replaces only the cache and the attention function, through transformers' attention
interface. So an architecture is served exactly when
  * its attention layers call that interface (`_supports_attention_backend`, or their code looks
    the function up there), with no feature the packed attention lacks (it handles causal masks,
    sliding windows, GQA and logit soft-capping; attention sinks and cross-attention are refused),
  * every layer is attention (no recurrent or linear-attention state to crop on a rejection),
  * nothing the short probe below cannot see changes its numbers: `refusal` reads the config for
    what acts past the probe's length or through the attention mask only (LongRoPE, chunked
    attention, temperature tuning, a window its layers do not pass on) or is not a per-layer
    key/value cache (latent attention, shared or cross-attention layers),
  * and its logits through the engine match its own forward pass: `reference` (before the engine
    is prepared) and `probe` (after) run a short sequence both ways at start-up, the engine's way split across a prefill, a batched
    round beside another session and single steps, and refuses the model if they differ.
The architectures in TESTED are covered by tests/test_architectures.py (greedy equality with
generate() through both services, prompts past the sliding window, runs to the context limit,
isolation, and sampled distributions where logits are transformed after the head).
"""
from __future__ import annotations

import inspect
import logging

import torch

from specdec.engine import KVCache
from specdec.startup import StartupError

log = logging.getLogger("specdec.startup")


class Unsupported(StartupError):
    """The model cannot be served as asked (no such device, an architecture the engine refuses)."""

TESTED = ("llama", "qwen2", "qwen3", "mistral", "starcoder2", "gemma2", "gemma3_text", "phi3", "granite", "gpt2", "gpt_neox", "cohere",
          "stablelm", "biogpt")
NON_ATTENTION_LAYERS = ("linear_attention", "mamba", "conv", "recurrent", "mlp_only")


def text_config(config):
    """The config of the language model: a multimodal checkpoint's causal-LM class (Gemma 3's
    *ForConditionalGeneration, say) keeps its context, windows, rope and layer types in its
    `text_config`; a text-only config is its own."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def context_limit(config) -> int:
    """The positions the model takes: its config's limit, stretched by a linear or YaRN rotary
    scaling where the scaling names the length it was trained at (factor x
    original_max_position_embeddings: Qwen2.5's YaRN recipe), as transformers' rotary code computes
    positions past the limit. Without that length the config's limit stands: checkpoints differ on
    whether it is the stretched length already (Gemma 3's 131072 with a linear factor of 8) or
    not. Never by dynamic scaling, whose factors change per call."""
    config = text_config(config)
    base = next((v for v in (getattr(config, name, None) for name in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"))
                 if isinstance(v, int) and not isinstance(v, bool) and v > 0), 2048)
    for name in ("rope_scaling", "rope_parameters"):
        d = getattr(config, name, None)
        if not isinstance(d, dict):
            continue
        kind, factor = d.get("rope_type") or d.get("type"), d.get("factor")
        if kind in ("linear", "yarn") and isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1:
            trained = d.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
            if isinstance(trained, int) and not isinstance(trained, bool) and trained > 0:
                return max(base, int(factor * trained))
    return base


def refusal(model, cfg) -> str | None:
    """Why the engine cannot serve this model exactly, read from its config and its modules before
    any pass (features the short start-up probe could not see: they act past its length, or in the
    attention mask, which the engine does not read), or None."""
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder models are not served"
    cfg = text_config(cfg)  # what follows is the language model's (a multimodal config's text_config)
    try:  # transformers raises (a RuntimeError, not an AttributeError) where layers differ in these: Gemma 4's global layers
        shapes = [getattr(cfg, n, None) for n in ("head_dim", "num_key_value_heads")]
    except Exception as e:  # noqa: BLE001 - any config that cannot name one shape
        return f"its layers have attention heads of different shapes ({type(e).__name__}); the engine's pool and its cache budget take one"
    wider = [n for n, v in (("global_head_dim", shapes[0]), ("num_global_key_value_heads", shapes[1]))
             if isinstance(getattr(cfg, n, None), int) and getattr(cfg, n) != v]
    if wider:
        return f"its global layers have attention heads of another shape ({wider[0]}); the engine's pool and its cache budget take one"
    if getattr(cfg, "is_decoder", True) is False and hasattr(cfg, "add_cross_attention"):
        # the BERT family: an encoder (bidirectional attention) unless is_decoder is set; GPT-NeoX's
        # config carries is_decoder false too, but it has no encoder form (no add_cross_attention)
        return "not a decoder (is_decoder is false): its attention sees later tokens"
    layer_types = [str(t) for t in getattr(cfg, "layer_types", None) or []]
    odd = sorted({t for t in layer_types if any(k in t for k in NON_ATTENTION_LAYERS)})
    if odd:
        return f"layers of type {', '.join(odd)} keep a recurrent state that cannot be cropped on a rejection"
    states = [k for k in STATE_FIELDS if getattr(cfg, k, None)]
    if states:
        return f"state-space layers ({states[0]}) keep a recurrent state that cannot be cropped on a rejection"
    if getattr(cfg, "model_type", None) in RECURRENT_TYPES:
        return f"a recurrent model ({cfg.model_type}): its state cannot be cropped on a rejection"
    if getattr(cfg, "model_type", None) in MASK_BIAS_TYPES:  # small learned biases passed the probe's tolerance, then served wrong
        return "its attention adds a learned bias to the keys through the attention mask, which the packed pass does not use"
    compressed = sorted({t for t in layer_types if "compress" in t})
    if compressed or getattr(cfg, "compress_rates", None):
        return (f"layers of type {', '.join(compressed) or 'compressed attention'} cache compressed keys, not one key and value per "
                "token as the engine pools them")
    if not _calls_interface(model):
        return ("its attention does not go through transformers' attention interface, so the engine "
                "cannot give each session its own keys (batch-mates would see each other's padding)")
    crossed = sorted(_cross_attention(model))
    if crossed:  # (BART's family: its causal-LM class is the seq2seq decoder, which transformers marks not encoder-decoder)
        return f"cross-attention layers ({crossed[0]}) attend to an encoder's output, which is not served"
    if getattr(cfg, "kv_lora_rank", None):
        return "multi-head latent attention (kv_lora_rank) caches compressed latents, not the keys and values the engine pools"
    v_dim, k_dim = getattr(cfg, "v_head_dim", None), head_dim(cfg)
    if isinstance(v_dim, int) and k_dim and v_dim != k_dim:
        return f"its values have another head size than its keys (v_head_dim {v_dim}, head_dim {k_dim}); the engine's pool holds one size"
    sinks = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] in SINK_NAMES})
    if sinks:
        return f"attention sinks ({sinks[0]}: a learned logit each head's softmax adds) are not in the engine's attention"
    if getattr(cfg, "num_kv_shared_layers", 0):
        return "layers that reuse another layer's keys and values (num_kv_shared_layers) are not served"
    if getattr(cfg, "cross_attention_layers", None):
        return "cross-attention layers are not served"
    if "chunked_attention" in layer_types:
        return "chunked attention (attention_chunk_size) is applied by the attention mask, which the packed pass does not use"
    if getattr(cfg, "attn_temperature_tuning", False):
        return "attention temperature tuning scales queries by positions read from the cache's length, which the packed pass does not keep"
    if "longrope" in rope_types(cfg):
        return ("LongRoPE (rope_type longrope) picks its rotary factors from the longest position in a call, so sessions packed "
                "into one pass, and a prompt's chunks, would change each other's encodings")
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, int) and 0 < window < context_limit(cfg) and not _passes_window(model) and _names_window(model):
        return (f"its sliding window ({window}) is applied by the attention mask only (its attention layers do not pass it "
                "on), which the packed pass does not use")
    return None


SINK_NAMES = ("sinks", "s_aux")  # the parameter of a learned attention sink (gpt-oss, granite's SWA variant)


def head_dim(cfg) -> int | None:
    """The size of one attention head's keys: the config's head_dim, else hidden / heads."""
    d = getattr(cfg, "head_dim", None)
    if isinstance(d, int) and d > 0:
        return d
    hidden, heads = getattr(cfg, "hidden_size", None), getattr(cfg, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None


def stray_window(model, cfg) -> int | None:
    """A `sliding_window` that no module's code reads (a Llama config copied from Mistral's): the
    model's own layers attend the whole context, as the engine does, but transformers' generate()
    builds its cache from the config and windows it once decoding. The window, or None."""
    cfg = text_config(cfg)
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, int) and 0 < window < context_limit(cfg) and not _names_window(model):
        return window
    return None


CROSS_NAMES = ("encoder_attn", "crossattention", "cross_attn", "cross_attention")  # attention modules over an encoder's output


def _cross_attention(model) -> set[str]:
    """The model's cross-attention modules, each by its attribute name where that says so
    (CROSS_NAMES), else by its class name (*CrossAttention*)."""
    found = set()
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in CROSS_NAMES:
            found.add(leaf)
        elif "CrossAttention" in type(m).__name__:
            found.add(type(m).__name__)
    return found
STATE_FIELDS = ("state_size", "ssm_state_size", "mamba_d_state")  # config fields of state-space (Mamba-like) layers
MASK_BIAS_TYPES = {"doge"}  # attention that builds its own additive mask (Doge's dynamic mask: a learned per-key bias)
RECURRENT_TYPES = {"rwkv", "xlstm"}  # recurrent models whose configs name no state field above (they have no attention either)


def rope_types(cfg) -> set[str]:
    """Every rotary embedding type a config names (rope_scaling, rope_parameters, per layer type too)."""
    out: set[str] = set()

    def walk(d) -> None:
        if isinstance(d, dict):
            t = d.get("rope_type") or d.get("type")
            if isinstance(t, str):
                out.add(t)
            for v in d.values():
                walk(v)
    for name in ("rope_scaling", "rope_parameters"):
        walk(getattr(cfg, name, None))
    return out


def _attention_kinds(model) -> set[type]:
    """The classes of the model's attention layers (modules named *Attention that know their layer)."""
    return {type(m) for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")}


def _calls_interface(model) -> bool:
    """Whether the model's attention goes through transformers' attention interface: its class says
    so (`_supports_attention_backend`), or every attention layer's forward looks its function up
    there (StableLM and BioGPT do, without the flag). The start-up probe then checks the numbers."""
    if getattr(model, "_supports_attention_backend", False):
        return True
    kinds = _attention_kinds(model)
    try:
        return bool(kinds) and all("ALL_ATTENTION_FUNCTIONS" in inspect.getsource(k.forward) for k in kinds)
    except (OSError, TypeError):  # no source to read: refuse, as the flag says
        return False


def _names(kinds, word: str) -> bool:
    """Whether any of these classes' forward code names `word`; True where the code cannot be read."""
    for kind in kinds:
        try:
            if word in inspect.getsource(kind.forward):
                return True
        except (OSError, TypeError):
            return True
    return False


def _passes_window(model) -> bool:
    """Whether the model's attention layers hand a sliding window to the attention function (their
    forward's code names it), where the engine applies it; True where the code cannot be read."""
    kinds = _attention_kinds(model)
    return _names(kinds, "sliding_window") or not kinds


def _names_window(model) -> bool:
    """Whether any of the model's modules' code names a sliding window (a mask built with one):
    a config field that no code reads (Llama's classes ignore `sliding_window`) changes nothing."""
    return _names({type(m) for m in model.modules()}, "sliding_window")


def reference(lm) -> tuple[list[int], list[int], torch.Tensor]:
    """Refuses (Unsupported) a model whose kind the engine cannot serve; else the probe's inputs and
    the model's own logits for them: (ids, another session's ids, logits [len(ids), V])."""
    model, cfg = lm.model, lm.model.config
    arch = f"{type(model).__name__} ({cfg.model_type})"
    why = refusal(model, cfg)
    if why:
        raise Unsupported(f"{arch}: {why}")
    window = stray_window(model, cfg)
    if window:
        log.warning("%s: config.json sets sliding_window %d, which none of this model's layers reads: the services attend the "
                    "whole context, as the model's own forward does, but transformers' generate() windows its cache by it once "
                    "decoding, so past %d tokens the two differ; remove the field to make them agree", arch, window, window)
    experts = mixture(cfg)
    if experts and lm.device.type == "cpu":
        log.warning("%s: a mixture of %d experts, each a product over the rows its router sends it, so row counts the CPU "
                    "tier cannot pad: a session's numbers may differ in the last bits with its batch-mates (DESIGN §9), greedy "
                    "output with them where the target's top two logits nearly tie", arch, experts)
    n = max(8, min(40, lm.max_context - 2))
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, lm.vocab_size, (n,), generator=g).tolist()
    other = torch.randint(0, lm.vocab_size, (7,), generator=g).tolist()
    try:
        with torch.inference_mode():
            ref = model(input_ids=torch.tensor([ids], device=lm.device)).logits[0].float()  # [n, V], the model's own attention
    except Exception as e:  # noqa: BLE001 - its own forward fails (a config its code cannot run, out of memory): one line
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        raise Unsupported(f"{arch}: its own forward pass fails on a {n}-token probe ({type(e).__name__}: {first[:300]})") from None
    return ids, other, ref


def mixture(cfg) -> int | None:
    """The number of experts of a mixture-of-experts model (Mixtral, Qwen2-MoE, PhiMoE, ...), else None."""
    cfg = text_config(cfg)
    return next((v for v in (getattr(cfg, n, None) for n in ("num_local_experts", "num_experts", "n_routed_experts"))
                 if isinstance(v, int) and not isinstance(v, bool) and v > 1), None)


def probe(lm, reference: tuple[list[int], list[int], torch.Tensor]) -> None:
    """Runs the reference's sequence through lm.engine, split across a prefill, a batched round beside
    another session and single steps, and refuses (Unsupported) the model if its logits differ from
    the model's own."""
    arch = f"{type(lm.model).__name__} ({lm.model.config.model_type})"
    ids, other, ref = reference
    eng, n = lm.engine, len(ids)
    split = n - 6
    try:
        a, b = KVCache(n), KVCache(n)
        eng.forward([ids[: split - 3]], [a], logits=False)  # prefill
        # a round beside another session, then single steps, as the verify scheduler runs them (padded:
        # on CUDA the uniform pass, replayed from a CUDA graph from its second time, whose output the next overwrites)
        got = eng.forward([ids[split - 3 : split], other], [a, b], padded=True)[0, :3].clone()
        steps = [eng.forward([[t]], [a], padded=True)[0].clone() for t in ids[split:]]
        a.release(), b.release()
    except Exception as e:  # noqa: BLE001 - any failure of the engine's pass means: not servable
        raise Unsupported(f"{arch}: the engine cannot run it ({type(e).__name__}: {e})") from None
    got = torch.cat([got, *steps])  # [n - split + 3, V]
    want = ref[split - 3 :]
    tol = 1e-3 if lm.dtype == torch.float32 else 0.08
    scale = max(1.0, float(want.abs().max()))
    err = float((got - want).abs().max()) / scale
    if not err <= tol:
        raise Unsupported(f"{arch}: logits through the engine differ from the model's own forward (max relative error "
                          f"{err:.2e} > {tol:g}); refusing rather than serving it wrong")
