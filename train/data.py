"""Token streams for training: documents are tokenized, joined into one long stream with the
tokenizer's EOS between documents, and training windows are cut from it at random offsets.

Batches are drawn from a generator seeded by ``(seed, step)``, so a resumed run sees exactly
the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np
import torch

from train import corpus
from train.corpus import Document


def tokenize_documents(tokenizer, docs: Sequence[Document], chunk: int = 256) -> torch.Tensor:
    """One 1-D int64 tensor: each document's tokens, each followed by EOS (BOS in front)."""
    head = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    tail = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    parts = []
    for i in range(0, len(docs), chunk):
        texts = [d.text for d in docs[i:i + chunk]]
        # whole documents, cut into windows later: longer than the model's context is expected, not worth a warning
        for toks in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
            parts.append(np.asarray(head + toks + tail, dtype=np.int64))
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.long)


_WORKER_TOKENIZER = None


def _tokenize_spec(args):
    spec, split, include_tests = args
    docs = corpus.documents([spec], split, include_tests=include_tests)
    toks = tokenize_documents(_WORKER_TOKENIZER, docs).numpy().astype(np.int32) if docs else np.zeros(0, np.int32)
    lic = corpus.package_license(spec.split(":", 1)[1]) if spec.startswith("package:") else \
        "PSF-2.0 (CPython)" if spec == "stdlib" else "the user's"
    return toks, {"spec": spec, "license": lic, "files": len(docs), "tokens": int(toks.size)}


def corpus_tokens(tokenizer, specs: Sequence[str], split: str = "train", include_tests: bool = True,
                  cache: str | None = None, workers: int | None = None) -> Tuple[torch.Tensor, List[dict]]:
    """The token stream of a corpus (specs as ``corpus.documents`` takes them, already expanded)
    and one row per spec: its license, files and tokens.  Specs are tokenized in ``workers``
    processes (default: one per CPU), then joined in order.  With ``cache``, a stream saved there
    by an earlier call with the same specs, split, tokenizer and files (paths, sizes and
    modification times) is loaded instead of tokenizing again."""
    global _WORKER_TOKENIZER
    key = {"specs": list(specs), "split": split, "include_tests": include_tests, "tokenizer": _fingerprint(tokenizer)}
    if cache:
        key["files"] = _files_digest(specs, include_tests)
    if cache and Path(cache).exists():
        saved = torch.load(cache, weights_only=False)
        if all(saved.get(k) == v for k, v in key.items()):  # another tokenizer (or --no-tests) tokenizes anew
            return saved["tokens"], saved["rows"]
    _WORKER_TOKENIZER = tokenizer
    jobs = [(spec, split, include_tests) for spec in specs]
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    if workers > 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.map(_tokenize_spec, jobs, chunksize=1)
    else:
        results = [_tokenize_spec(job) for job in jobs]
    rows = [row for _, row in results]
    tokens = torch.from_numpy(np.concatenate([t for t, _ in results]).astype(np.int64)) if results \
        else torch.zeros(0, dtype=torch.long)
    if cache:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        torch.save({**key, "tokens": tokens, "rows": rows}, cache)
    return tokens, rows


def _files_digest(specs: Sequence[str], include_tests: bool) -> str:
    """A digest of every file the specs read: path, size and modification time."""
    h = hashlib.sha256()
    for spec in specs:
        for path in corpus.source_files(spec, include_tests):
            try:
                st = path.stat()
                h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            except OSError:
                h.update(f"{path}\0missing\n".encode())
    return h.hexdigest()


def _fingerprint(tokenizer) -> str:
    """A digest of the tokenizer's vocabulary and special tokens: what the cached ids depend on."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()


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


def describe(specs: Sequence[str], tokenizer, split: str = "train") -> List[dict]:
    """Per corpus spec: its license (for installed packages), files and tokens in `split`."""
    return corpus_tokens(tokenizer, list(specs), split)[1]
