"""Tiny random-weight models of mainstream architectures, built from configs (nothing is
downloaded), each saved with a word-level tokenizer shared across the architecture's target and
draft so their vocabulary fingerprints match. Used by tests/test_architectures.py."""
from __future__ import annotations

import os

import torch
import transformers as tf
from transformers import GenerationConfig

from bench.tinymodels import word_tokenizer

V, CTX, WINDOW = 48, 96, 8  # vocabulary, context limit, sliding window (prompts are longer than it)
EOS = 0


def _llama_like(**extra):
    return dict(dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=CTX, eos_token_id=EOS, pad_token_id=1, bos_token_id=None,
                     tie_word_embeddings=False), **extra)


# name -> (config class, model class, config kwargs, what the test is about)
SPECS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, _llama_like(), "GQA; several EOS ids in generation_config (Llama-3 style)"),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
              _llama_like(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
              "sliding window on the layers from max_window_layers on"),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, _llama_like(head_dim=8), "q/k norms"),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, _llama_like(sliding_window=WINDOW), "sliding window on every layer"),
    "starcoder2": (tf.Starcoder2Config, tf.Starcoder2ForCausalLM, _llama_like(sliding_window=WINDOW, use_bias=True),
                   "sliding window on every layer, biases, LayerNorm"),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM,
               _llama_like(head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=20.0, final_logit_softcapping=3.0,
                           query_pre_attn_scalar=8, tie_word_embeddings=True),
               "alternating sliding/global layers, attention soft-cap, final soft-cap after the head"),
    "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                    _llama_like(num_hidden_layers=3, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                tie_word_embeddings=True),
                    "local (sliding) and global layers with their own rotary bases, q/k norms"),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, _llama_like(), "fused qkv and gate_up projections"),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM,
                _llama_like(logits_scaling=4.0, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3),
                "logits_scaling after the head; embedding, residual and attention multipliers"),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel,
             dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=CTX, eos_token_id=EOS, bos_token_id=EOS,
                  pad_token_id=1), "absolute learned positions (n_positions is the context limit)"),
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM,
                 dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=CTX, eos_token_id=EOS, bos_token_id=EOS, pad_token_id=1, rotary_pct=0.5),
                 "partial rotary, parallel residual"),
    "cohere": (tf.CohereConfig, tf.CohereForCausalLM, _llama_like(logit_scale=0.5, tie_word_embeddings=True),
               "logit_scale after the head, parallel attention/MLP"),
    "stablelm": (tf.StableLmConfig, tf.StableLmForCausalLM,
                 _llama_like(partial_rotary_factor=0.5, qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=True),
                 "attention through the interface without the class flag; partial rotary, per-head q/k norms"),
    "biogpt": (tf.BioGptConfig, tf.BioGptForCausalLM,
               dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=CTX, eos_token_id=EOS, bos_token_id=EOS, pad_token_id=1),
               "attention through the interface without the class flag; learned positions offset by 2, scaled embeddings"),
}
TRANSFORMED = ("gemma2", "granite", "cohere")  # logits transformed after lm_head: tested by sampling too


SHARPEN = {"gemma2": 20.0}  # Gemma 2's logits are small at this size: make the final soft-cap (3.0) bite


def build(root: str, name: str, seed: int = 0, eos_from: list[int] | None = None) -> str:
    """Saves a tiny random `name` model with the shared tokenizer under root/name-seed. With
    eos_from (a prompt), generation_config lists several EOS ids, Llama-3 style: config's EOS
    plus the token the model greedily produces 4th after that prompt, plus one more."""
    cfg_cls, model_cls, kw, _ = SPECS[name]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).eval()
    with torch.no_grad():  # random init is near-uniform: sharpen the head so greedy is robust to rounding
        model.get_output_embeddings().weight.mul_(SHARPEN.get(name, 3.0))
    gen = GenerationConfig(eos_token_id=EOS, pad_token_id=1, do_sample=False)
    if eos_from is not None:
        model.generation_config = gen
        out = model.generate(torch.tensor([eos_from]), max_new_tokens=6, do_sample=False)[0, len(eos_from):].tolist()
        stop = next(t for t in out[3:] if t != EOS)
        gen = GenerationConfig(eos_token_id=[EOS, stop, V - 1], pad_token_id=1, do_sample=False)
    model.generation_config = gen
    path = os.path.join(root, f"{name}-{seed}")
    model.save_pretrained(path)
    word_tokenizer(V).save_pretrained(path)
    return path
