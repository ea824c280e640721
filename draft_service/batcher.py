"""Batched drafting: one thread owns the draft model and runs the pending forward steps of all
sessions as one pass (specdec/batching.py, the verifier's batched pass: per-session caches,
bitwise the same numbers alone or batched).

Each session drafts in its own worker thread; a step calls `forward()`, which queues the step and
blocks until the batcher thread has run it together with whatever other sessions queued
meanwhile. Prompts are fed in chunks of PREFILL_CHUNK tokens so a long prompt does not hold up
the others' steps.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import torch

from specdec import batching, metrics

PREFILL_CHUNK = 256
STEP_TOKENS = 8  # a forward over at most this many tokens counts as a decode step
MAX_BATCH_TOKENS = 1024


class DraftBatcher:
    def __init__(self, model):
        self.model = model
        batching.use_isolated_attention(model)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="draft-batcher", daemon=True)
        self._thread.start()

    def forward(self, kv: batching.KV, tokens: list[int], logits: bool = True) -> tuple[torch.Tensor | None, batching.KV]:
        """Runs `tokens` after `kv`; returns (logits of the last token [V] or None, the new cache)."""
        last = None
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            fut: Future = Future()
            self._queue.put((chunk, kv, logits and start + len(chunk) == len(tokens), fut))
            last, kv = fut.result()
        return last, kv

    def _work(self) -> None:
        pending: list = []
        while True:
            if not pending:
                pending.append(self._queue.get())
            while True:
                try:
                    pending.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            # decode steps go together; a prompt chunk runs on its own (batched with steps it would
            # pad every step to its length)
            steps = [j for j in pending if len(j[0]) <= STEP_TOKENS][: MAX_BATCH_TOKENS // STEP_TOKENS]
            batch = steps or pending[:1]
            pending = [j for j in pending if all(j is not b for b in batch)]
            self._run(batch)

    def _run(self, jobs: list) -> None:
        metrics.DRAFT_BATCH_SIZE.observe(len(jobs))
        want = any(j[2] for j in jobs)
        try:
            out, kvs = batching.forward_batch(self.model, [j[0] for j in jobs], [j[1] for j in jobs], logits=want)
        except Exception as e:  # noqa: BLE001 - handed to the waiting sessions
            for j in jobs:
                j[3].set_exception(e)
            return
        for i, j in enumerate(jobs):
            j[3].set_result((out[i][-1] if j[2] else None, kvs[i]))
