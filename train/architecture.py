"""The one Llama architecture the trainers build: a target from scratch (train.pretrain) and a
draft that shares a target's vocabulary and special tokens (train.distill)."""
from __future__ import annotations

from transformers import LlamaConfig

from specdec import architectures


def _first_id(x):
    """A config's special token id: the first of a list, or the value itself (None stays None)."""
    if isinstance(x, (list, tuple)):
        return x[0] if x else None
    return x


def llama_config(*, vocab_size: int, hidden: int, layers: int, heads: int, intermediate: int, max_positions: int,
                 tie: bool, bos_token_id=None, eos_token_id=None, pad_token_id=None) -> LlamaConfig:
    """A Llama config (no grouped-query attention, RMSNorm eps 1e-5, rope theta 10000)."""
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_positions,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=_first_id(bos_token_id),
                       eos_token_id=eos_token_id, pad_token_id=_first_id(pad_token_id))


def target_config(tokenizer, hidden: int, layers: int, heads: int, intermediate: int, max_positions: int,
                  tie: bool) -> LlamaConfig:
    """A target trained from scratch with `tokenizer`."""
    return llama_config(vocab_size=len(tokenizer), hidden=hidden, layers=layers, heads=heads, intermediate=intermediate,
                        max_positions=max_positions, tie=tie, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def draft_config(target, hidden: int, layers: int, heads: int, intermediate: int, tie: bool,
                 max_positions: int | None = None, rows: int | None = None) -> LlamaConfig:
    """A draft for the target whose config is `target` (a multimodal one's language model: its
    text_config): its output rows (`rows`, else its vocabulary size) and special ids, and its
    context limit as the services read it (a rotary scaling's stretch included) unless
    max_positions says otherwise."""
    text = architectures.text_config(target)

    def field(name):  # the checkpoint's own top-level value where it set one (a text_config holds its class's default)
        v = getattr(target, name, None)
        return v if v is not None else getattr(text, name, None)

    max_pos = max_positions or architectures.context_limit(target)
    return llama_config(vocab_size=rows or field("vocab_size"), hidden=hidden, layers=layers, heads=heads, intermediate=intermediate,
                        max_positions=max_pos, tie=tie, bos_token_id=field("bos_token_id"), eos_token_id=field("eos_token_id"),
                        pad_token_id=field("pad_token_id"))
