"""Writing a trained model as a complete Hugging Face directory (config, generation config,
safetensors weights, tokenizer) that ``AutoModelForCausalLM`` / ``AutoTokenizer`` load offline.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import GenerationConfig


def set_special_ids(model, tokenizer) -> None:
    """Make config and generation config agree with the tokenizer's BOS/EOS/pad ids."""
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id = tokenizer.bos_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id


def save_hf_dir(model, tokenizer, out_dir, dtype: torch.dtype = torch.bfloat16,
                max_shard_size: str = "40MB") -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to(dtype)
    if model.generation_config is None:
        m.generation_config = GenerationConfig()
    set_special_ids(m, tokenizer)
    m.config.use_cache = True
    m.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
