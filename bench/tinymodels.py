"""Tiny seeded Llama models and word-level tokenizers built on disk for the demo, the benchmarks
and the tests (nothing is downloaded)."""
from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<eos>", "<pad>", "<unk>"]  # ids 0, 1, 2


def word_tokenizer(vocab_size: int, bos: bool = False) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `vocab_size` ids: 3 specials then words w3, w4, ...; with
    `bos`, id 3 is <bos>, which it puts in front of every text (as Llama-3's and Gemma's do)."""
    specials = SPECIALS + ["<bos>"] * bos
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<bos>" if bos else None)


def build(path: str, *, vocab_size: int = 16, hidden: int = 32, layers: int = 2, heads: int = 4, max_context: int = 64,
          seed: int = 0, sharpen: float = 1.0, eos_like: int | None = None, chat_template: str | None = None,
          bos: bool = False) -> str:
    """A random LlamaForCausalLM with its tokenizer saved in `path`. `sharpen` scales the output
    layer: > 1 gives peakier (lower-entropy) next-token distributions. `eos_like` makes EOS win
    wherever that token would have been the (positive-logit) argmax, so greedy runs end.
    `chat_template`: a Jinja chat template saved with the tokenizer (tokenizer_config.json)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_context,
                      eos_token_id=0, pad_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
        if eos_like is not None:
            model.lm_head.weight[0] = 1.1 * model.lm_head.weight[eos_like]
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok = word_tokenizer(vocab_size, bos)
    tok.chat_template = chat_template
    tok.save_pretrained(path)
    return path
