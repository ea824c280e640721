"""The engine: one pooled KV cache per model and one packed forward pass for all sessions.

  cache.py      the pool, its pages, and a session's handle into it (KVCache)
  layout.py     the pass layout: which inputs attend together, and their index tensors
  attention.py  the attention transformers' layers call during a pass, and the pass's cache
  forward.py    Engine (model + plan + pool), its forward pass, `prepare`
  graphs.py     uniform passes of rounds, captured as CUDA graphs on CUDA
  compiled.py   compiled decoder layers on a GPU (--compile-layers)
  plan.py       the load-time plan
  tree.py       a token tree as one input of a pass (tree speculation)
  cpu/          the CPU tier: calibrated matmul row counts, per-row products, prepacked weights
                and the attention dtype (never imported on a GPU)
"""
from specdec.engine.attention import cache_kwargs, returned_cache
from specdec.engine.cache import PAGE, KVCache, Pool, available_memory_bytes
from specdec.engine.forward import PREFILL_CHUNK, Engine, cpu_row_kernel, prepare
from specdec.engine.layout import ROW_BY_ROW
from specdec.engine.plan import Plan
from specdec.engine.tree import Tree

__all__ = ["PAGE", "PREFILL_CHUNK", "ROW_BY_ROW", "Engine", "KVCache", "Plan", "Pool", "Tree", "available_memory_bytes", "cache_kwargs",
           "cpu_row_kernel", "prepare", "returned_cache"]
