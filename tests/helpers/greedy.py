"""The reference greedy output the exactness tests compare with, and their random prompts."""
from __future__ import annotations

import random

import torch


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy generate() of n tokens after prompt."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, pad_token_id=1)
    return out[0, len(prompt):].tolist()


def prompts(n: int, seed: int = 0, vocab: int = 16, max_len: int = 20) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(1, vocab) for _ in range(r.randint(1, max_len))] for _ in range(n)]
