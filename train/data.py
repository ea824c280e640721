"""Token streams for training: documents are tokenized, joined into one long stream with the
tokenizer's EOS between documents, and training windows are cut from it at random offsets.

Batches are drawn from a generator seeded by ``(seed, step)``, so a resumed run sees exactly
the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from typing import Sequence

import torch

from train.corpus import Document


def tokenize_documents(tokenizer, docs: Sequence[Document], chunk: int = 256) -> torch.Tensor:
    """One 1-D int64 tensor: each document's tokens, each followed by EOS (BOS in front)."""
    bos = tokenizer.bos_token_id
    eos = tokenizer.eos_token_id
    ids = []
    for i in range(0, len(docs), chunk):
        texts = [d.text for d in docs[i:i + chunk]]
        for toks in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            if bos is not None:
                ids.append(bos)
            ids.extend(toks)
            if eos is not None:
                ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


class WindowSampler:
    """Random windows of ``seq_len`` tokens from a token stream, deterministic per step."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int = 0):
        if tokens.numel() < 2:
            raise ValueError("corpus is empty after tokenization")
        self.tokens = tokens
        self.seq_len = min(seq_len, tokens.numel() - 1)
        self.batch_size = batch_size
        self.seed = seed

    def batch(self, step: int) -> torch.Tensor:
        """``[batch_size, seq_len + 1]`` token ids for training step ``step``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = self.tokens.numel() - self.seq_len - 1
        starts = torch.randint(0, high + 1, (self.batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        return self.tokens[idx]

    def sequential(self, max_windows: int | None = None):
        """Non-overlapping windows in order (for evaluation), each ``[1, seq_len + 1]``."""
        n = (self.tokens.numel() - 1) // self.seq_len
        if max_windows is not None:
            n = min(n, max_windows)
        for i in range(n):
            s = i * self.seq_len
            yield self.tokens[s:s + self.seq_len + 1][None, :]
