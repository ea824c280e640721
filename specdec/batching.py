"""One target forward pass over the new tokens of many sessions, each with its own KV cache.

Each session keeps its cache as plain tensors, per layer (K, V) of shape [1, H, L_i, D]. For a
batch the caches are left-padded to the longest L and stacked; the new tokens are right-padded
to the longest n; explicit position ids give every session its own positions (L_i + j). After
the pass each session's cache is sliced back out, now including its n_i new entries.

Isolation by construction: a session's numbers must not depend on who shares its batch.
  * Attention is the only op that mixes positions. `isolated_attention` runs it per session on
    exactly that session's keys ([L_i + n_i]), with the same shapes and the same code as when
    the session runs alone, so it is bitwise identical alone and batched.
  * Every other op works row by row (linear layers, norms, MLP, rotary embeddings). CPU GEMM
    kernels give row-invariant results once a matmul has enough rows, but use other kernels
    for tiny ones (seen here: M=1 and M=2 differ from M>=4 in the last bits), so every pass
    is padded to at least MIN_ROWS token rows.
  * The output layer runs only on the real rows (gathered, padded to MIN_ROWS), not on the
    padding: it is the largest matmul of a small model. This assumes logits = lm_head(hidden),
    as in Llama, Mistral and Qwen (not models that scale or soft-cap logits afterwards).
The padding has a price where a pass would otherwise have one row: a single-token step of an
8-layer d=512 model took 20.8 ms instead of 16.2 ms here (a verify round of tau+1 >= 4 tokens
pays nothing). Target-only sessions pay it; the benchmarks report transformers' own generate()
beside them for that reason.
The remaining assumption, that the GEMM library's row results do not change with M >= MIN_ROWS,
holds for the CPU build tested here (tests/test_batching.py checks it bitwise); on other
hardware a near-tie (top-2 logits within ~1e-6, or u within ~1e-7 of p/q) could still flip.

Stacking costs one copy of the batch's caches per pass. Transformers' own DynamicCache copies
the whole cache on every append as well (torch.cat), so a batch of one costs what a plain
`model(past_key_values=...)` step costs; on a GPU server a paged cache would avoid both copies.
"""
from __future__ import annotations

import contextvars

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

KV = list  # per layer: (keys [1, H, L, D], values [1, H, L, D]); [] when nothing is cached
MIN_ROWS = 4  # token rows per matmul, so GEMMs stay on their row-invariant kernels
ATTN = "specdec_isolated"

# (Lm, [(L_i, n_i)]) of the pass in progress, read by isolated_attention
_layout: contextvars.ContextVar = contextvars.ContextVar("specdec_batch_layout")


def isolated_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, H, Nm, D]; key, value [B, Hkv, Lm + Nm, D] -> ([B, Nm, H, D], None)."""
    B, H, Nm, D = query.shape
    Lm, rows = _layout.get((key.shape[2] - Nm, [(key.shape[2] - Nm, Nm)] * B))  # default: unpadded, no cache gaps
    rep = H // key.shape[1]  # grouped-query attention: query heads per key/value head
    out = query.new_zeros(B, Nm, H, D)
    for i, (L, n) in enumerate(rows):
        q = query[i : i + 1, :, :n].contiguous()  # [1, H, n, D]
        k = key[i : i + 1, :, Lm - L : Lm + n].contiguous()  # [1, Hkv, L+n, D]
        v = value[i : i + 1, :, Lm - L : Lm + n].contiguous()
        causal = torch.arange(L + n)[None, :] <= (L + torch.arange(n))[:, None]  # [n, L+n]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scaling, enable_gqa=rep > 1)  # [1, H, n, D]
        out[i, :n] = o[0].transpose(0, 1)
    return out, None


AttentionInterface.register(ATTN, isolated_attention)
AttentionMaskInterface.register(ATTN, lambda *args, **kwargs: None)  # masks are built per session above


def use_isolated_attention(model) -> None:
    model.set_attn_implementation(ATTN)


def kv_len(kv: KV) -> int:
    return kv[0][0].shape[2] if kv else 0


def kv_crop(kv: KV, length: int) -> KV:
    if kv_len(kv) <= length:
        return kv
    return [(k[:, :, :length], v[:, :, :length]) for k, v in kv]


def _pad_left(x: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - x.shape[2]
    if missing == 0:
        return x
    return torch.cat([x.new_zeros(x.shape[0], x.shape[1], missing, x.shape[3]), x], dim=2)


@torch.inference_mode()
def forward_batch(model, inputs: list[list[int]], kvs: list[KV], logits: bool = True) -> tuple[list[torch.Tensor] | None, list[KV]]:
    """Runs inputs[i] after kvs[i] for every i in one pass. Returns (logits_i [n_i, V] float32,
    or None when logits=False (prefill), and the new caches: kv_i plus the n_i new entries)."""
    B = len(inputs)
    n = [len(x) for x in inputs]  # [B]
    L = [kv_len(kv) for kv in kvs]  # [B]
    Lm = max(L)
    Nm = max(max(n), -(-MIN_ROWS // B))  # B * Nm >= MIN_ROWS
    cache = DynamicCache(config=model.config)
    if Lm:
        for layer, lay in enumerate(cache.layers):
            if B == 1:  # nothing to pad or stack
                ks, vs = kvs[0][layer]
            else:
                ks = torch.cat([_pad_left(kv[layer][0], Lm) if kv else _empty(kvs, layer, Lm) for kv in kvs])  # [B, H, Lm, D]
                vs = torch.cat([_pad_left(kv[layer][1], Lm) if kv else _empty(kvs, layer, Lm) for kv in kvs])
            lay.lazy_initialization(ks, vs)
            lay.keys, lay.values = ks, vs  # the pass appends with torch.cat: these tensors are never written
    ids = torch.zeros(B, Nm, dtype=torch.long)  # [B, Nm], right-padded (pad rows are never attended)
    pos = torch.zeros(B, Nm, dtype=torch.long)  # [B, Nm]
    for i, x in enumerate(inputs):
        ids[i, : n[i]] = torch.tensor(x)
        pos[i] = L[i] + torch.arange(Nm)
    token = _layout.set((Lm, list(zip(L, n))))
    try:
        hidden = model.base_model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).last_hidden_state  # [B, Nm, d]
    finally:
        _layout.reset(token)
    if B == 1:  # the cache tensors are fresh from the pass's torch.cat and hold exactly this session
        new_kvs = [[(lay.keys[:, :, : L[0] + n[0]], lay.values[:, :, : L[0] + n[0]]) for lay in cache.layers]]
    else:  # copy each session's rows out, so no session keeps the whole batch tensor alive
        new_kvs = []
        for i in range(B):
            keep = slice(Lm - L[i], Lm + n[i])
            new_kvs.append([(lay.keys[i : i + 1, :, keep].clone(), lay.values[i : i + 1, :, keep].clone()) for lay in cache.layers])
    if not logits:
        return None, new_kvs
    rows = torch.cat([hidden[i, : n[i]] for i in range(B)])  # [sum n, d]: the real rows only
    pad = max(0, MIN_ROWS - rows.shape[0])
    out = model.get_output_embeddings()(torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows).float()  # [sum n (+pad), V]
    return list(out[: rows.shape[0]].split(n)), new_kvs


def _empty(kvs: list[KV], layer: int, length: int) -> torch.Tensor:
    """Zeros shaped like another session's layer cache, for a session with nothing cached."""
    k = next(kv for kv in kvs if kv)[layer][0]
    return k.new_zeros(1, k.shape[1], length, k.shape[3])
