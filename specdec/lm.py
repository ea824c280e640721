"""A causal LM loaded from a local Hugging Face directory, with what the services report about it
(vocabulary fingerprint, context limit, EOS id). Forward passes go through specdec/batching.py."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def vocab_fingerprint(tokenizer, vocab_size: int) -> str:
    """SHA-256 over the sorted token->id map, the special ids and the model's vocab size."""
    special = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "unk": tokenizer.unk_token_id,
        "vocab_size": vocab_size,
    }
    blob = json.dumps([sorted(tokenizer.get_vocab().items()), special], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class LM:
    model: torch.nn.Module
    tokenizer: object
    name: str
    vocab_size: int
    max_context: int
    eos_token_id: int | None
    fingerprint: str
    num_parameters: int

    @classmethod
    def load(cls, path: str) -> "LM":
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path!r} does not exist")
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        cfg = model.config
        vocab = model.get_output_embeddings().weight.shape[0]
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else tok.eos_token_id
        if isinstance(eos, list):
            eos = eos[0]
        return cls(
            model=model,
            tokenizer=tok,
            name=os.path.basename(os.path.normpath(path)),
            vocab_size=vocab,
            max_context=int(getattr(cfg, "max_position_embeddings", 0) or 2048),
            eos_token_id=eos,
            fingerprint=vocab_fingerprint(tok, vocab),
            num_parameters=sum(p.numel() for p in model.parameters()),
        )
