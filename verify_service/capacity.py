"""Admission: how many sessions and cached tokens the verify service takes, and the refusal
(RESOURCE_EXHAUSTED, with a retry hint from the server) when it is full.

Every session reserves room for its whole run at admission, and for one tree round past it:
min(prompt + max_new_tokens + tree_budget, context), rounded up to whole pages: the slots its
cache takes from the engine's pool (specdec/engine/cache.py). So the token budget is the memory
budget: tokens x kv_bytes_per_token in the pool's dtype (the engine plan's kv_dtype).
"""
from __future__ import annotations

import logging
import threading

import torch

from specdec import metrics
from specdec.architectures import text_config
from specdec.errors import Refusal, RequestError
from specdec.engine import PAGE, available_memory_bytes

log = logging.getLogger("specdec.verify")


def kv_bytes_per_token(config, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one cached token costs: K and V, every layer, in the cache's dtype."""
    config = text_config(config)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def full_cache_tokens(lm, max_sessions: int) -> int:
    """Room for every session at full context, in whole pages as `Capacity.admit` counts them."""
    return max_sessions * -(-lm.max_context // PAGE) * PAGE


def default_cache_budget(lm, max_sessions: int, memory_fraction: float | None = None) -> int:
    """Tokens all sessions may reserve: `full_cache_tokens`, capped by a share of the memory free
    at start-up (after the model is loaded): 90% on a GPU, 50% of the host's (no more than the process's memory
    cgroup leaves: engine.available_memory_bytes)."""
    full = full_cache_tokens(lm, max_sessions)
    mem = available_memory_bytes(lm.device)
    if mem is None:
        return full
    share = memory_fraction if memory_fraction is not None else (0.9 if lm.device.type == "cuda" else 0.5)
    fits = int(mem * share / kv_bytes_per_token(lm.model.config, lm.engine.plan.kv_dtype))
    if fits < lm.max_context:  # one session of the whole context is admitted all the same: say so
        log.warning("the free memory's share holds %d cache tokens, less than one session at the model's context (%d): a "
                    "session that long may fail out of memory; give the service more memory, or a smaller --max-cached-tokens "
                    "to admit less", fits, lm.max_context)
    return max(lm.max_context, min(full, fits))


class Capacity:
    def __init__(self, max_sessions: int, max_cached_tokens: int, page: int = 1):
        """page: the cache's slots per page; sessions are admitted in whole pages, within the
        budget's own pages (so a budget of the context admits a session of the whole context)."""
        self.max_sessions = max_sessions
        self.max_cached_tokens = max_cached_tokens
        self.page = page
        self._limit = -(-max_cached_tokens // page) * page
        metrics.CACHE_BUDGET.set(max_cached_tokens)
        self.sessions = 0
        self.reserved = 0
        self._lock = threading.Lock()

    def admit(self, need: int) -> int:
        """Reserves room for `need` cache tokens, in whole pages, for a new session, or raises
        RESOURCE_EXHAUSTED. Returns the tokens reserved (for `release`)."""
        need = -(-need // self.page) * self.page
        with self._lock:
            if need > self._limit:  # no wait makes room for it here (another replica may be larger)
                metrics.CAPACITY_REJECTIONS.labels("cached_tokens").inc()
                raise RequestError(Refusal.RESOURCE_EXHAUSTED, f"the request needs {need} cache tokens (its prompt, max_new_tokens "
                                   f"and tree room, within the context, in whole pages of {self.page}), more than this verify service's whole cache "
                                   f"({self.max_cached_tokens} tokens, --max-cached-tokens); ask for fewer", retry=False)
            if self.sessions >= self.max_sessions:
                metrics.CAPACITY_REJECTIONS.labels("sessions").inc()
                raise RequestError(Refusal.RESOURCE_EXHAUSTED, f"verify service is at its limit of {self.max_sessions} sessions; retry later")
            if self.reserved + need > self._limit:
                metrics.CAPACITY_REJECTIONS.labels("cached_tokens").inc()
                raise RequestError(Refusal.RESOURCE_EXHAUSTED, f"verify service cache is full ({self.reserved}/{self.max_cached_tokens} tokens reserved, {need} asked); retry later")
            self.sessions += 1
            self.reserved += need
            self._report()
        return need

    def free(self) -> dict[str, int]:
        """What is left to admit (the fields of the Info response's Capacity)."""
        with self._lock:
            return dict(free_sessions=max(0, self.max_sessions - self.sessions),
                        free_cached_tokens=max(0, self.max_cached_tokens - self.reserved),
                        max_sessions=self.max_sessions, max_cached_tokens=self.max_cached_tokens)

    def tight(self, need: int) -> bool:
        """Whether another `need` tokens (a session like one whose tokens are still reserved) do not
        fit beside what is reserved now."""
        with self._lock:
            return self.reserved + need > self._limit

    def release(self, need: int) -> None:
        """A session's slot and its `need` reserved tokens back."""
        self.leave()
        self.give_back(need)

    def leave(self) -> None:
        """A session's slot back (the session is gone: its call may end), its tokens not yet."""
        with self._lock:
            self.sessions -= 1
            self._report()

    def give_back(self, need: int) -> None:
        """A closed session's reserved tokens back, once its pages are in the pool again."""
        with self._lock:
            self.reserved -= need
            self._report()

    def _report(self) -> None:
        metrics.LIVE_SESSIONS.labels("verify").set(self.sessions)
        metrics.RESERVED_TOKENS.set(self.reserved)
