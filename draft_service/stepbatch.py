"""Batched draft steps: the forward steps that sessions ask for at the same time run as ONE packed
pass of the draft model (specdec/engine: one pooled cache, the same numbers alone or batched).

No thread of its own: each session drafts in its own worker thread and calls `forward()`. The
first caller to find the model idle becomes the leader: it runs passes over the queued steps and
hands out the results until its own step is done; then it hands the lead to a thread whose step
still waits, so no session drafts for the others while its own loop waits. The others wait for
their result. A session drafting alone therefore runs its step in its own thread with no
hand-off at all. Prompts go in chunks of PREFILL_CHUNK tokens, alone in their pass (beside
decode steps they would hold them up), in their turn: a pass takes the decode steps queued
before the oldest waiting chunk (at most MAX_BATCH), else that chunk. So a step waits only for
what was queued before it (besides the pass in flight), whatever the others ask for after it.
"""
from __future__ import annotations

import logging
import threading

import torch

from specdec import metrics
from specdec.engine import PREFILL_CHUNK, Engine, KVCache, Tree

log = logging.getLogger("specdec.draft")

STEP_TOKENS = 8  # a forward over at most this many tokens counts as a decode step
MAX_BATCH = 128  # decode steps per pass


class _Step:
    __slots__ = ("cache", "tokens", "logits", "tree", "result", "error", "done")

    def __init__(self, cache: KVCache, tokens: list[int], logits: bool, tree: Tree | None = None):
        self.cache, self.tokens, self.logits, self.tree = cache, tokens, logits, tree
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.done = False


class StepBatcher:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._cv = threading.Condition()
        self._waiting: list[_Step] = []
        self._busy = False

    def forward(self, cache: KVCache, tokens: list[int], logits: bool = True) -> torch.Tensor | None:
        """Runs `tokens` after `cache` (written in place); returns the logits after the last token [V]
        (float32, on the model's device) or None."""
        out = None
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            out = self._one(_Step(cache, chunk, logits and start + len(chunk) == len(tokens)))
        return out

    def forward_tree(self, cache: KVCache, tokens: list[int], tree: Tree) -> torch.Tensor:
        """Runs `tokens` as the last nodes of `tree` (specdec/engine/tree.py) after `cache`; returns
        every node's logits [n, V] (tree drafting: one level of the tree a pass)."""
        return self._one(_Step(cache, tokens, True, tree))

    def _one(self, step: _Step) -> torch.Tensor | None:
        with self._cv:
            self._waiting.append(step)
            while not step.done and self._busy:
                self._cv.wait()
            lead = not step.done
            self._busy = self._busy or lead
        while lead:  # run passes until this step is done, then hand the lead on (to a waiting step's thread)
            try:
                self._pass()
            finally:  # (a pass that raised past its steps, too: the lead goes on, so no one waits for ever)
                with self._cv:
                    if step.done:
                        self._busy = lead = False
                        self._cv.notify_all()
        if step.error is not None:
            raise step.error
        return step.result

    def _forward(self, steps: list[_Step]) -> None:
        """One forward over `steps`, each one's result set (a cache's length moves only once the
        pass's output is made, so a failed pass commits nothing)."""
        # a tree's nodes through the tree mask: the draft's numbers need no chain equality (any q it sends is exact)
        outs = self.engine.forward([s.tokens for s in steps], [s.cache for s in steps], [s.logits for s in steps],
                                   trees=[s.tree for s in steps], tree_paths=False,
                                   last=[s.tree is None for s in steps])  # a chain's step needs its last row's logits only
        for s, o in zip(steps, outs):
            s.result = None if o is None else o if s.tree is not None else o[-1]

    def _pass(self) -> None:
        with self._cv:
            chunk = next((i for i, s in enumerate(self._waiting) if len(s.tokens) > STEP_TOKENS), None)
            steps = self._waiting[:chunk][:MAX_BATCH] or self._waiting[:1]  # the steps before the oldest chunk, else it
            self._waiting = [s for s in self._waiting if all(s is not b for b in steps)]
        metrics.DRAFT_BATCH_SIZE.observe(len(steps))
        try:
            try:
                self._forward(steps)
            except Exception as e:  # noqa: BLE001 - one session's fault (nothing was committed): each step alone finds whose
                if len(steps) == 1:
                    raise
                log.warning("draft pass of %d steps failed (%s: %s); retrying them one by one", len(steps), type(e).__name__, e)
                for s in steps:
                    try:
                        self._forward([s])
                    except Exception as e1:  # noqa: BLE001 - this step's own failure, for its session alone
                        s.error = e1
        except BaseException as e:  # noqa: BLE001 - handed to the waiting sessions, so none waits for ever
            for s in steps:
                s.error = e
            if not isinstance(e, Exception):
                raise
        finally:
            with self._cv:
                for s in steps:
                    s.done = True
                self._cv.notify_all()
