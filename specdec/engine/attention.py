"""The attention that transformers' attention layers call during a pass, and the pass's cache.

A pass runs the new tokens of many sessions as one packed sequence [1, T] (forward.py). In every
layer, `PassCache.update` writes all the new keys and values into the pool with one
`index_copy_` each, and `packed_attention` attends all the sessions' queries in one call per
group of inputs (layout.py). Soft-capped attention (Gemma 2) runs the same layouts through
transformers' eager order of ops. With compiled layers (compiled.py) the write and the
attention run as one opaque op, `attend`.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect

import torch
from transformers import AttentionInterface, Cache

from specdec.engine.layout import Pass

ATTN = "specdec_packed"
PASS_KWARG = "specdec_pass"  # the model-call keyword that hands a pass down to its attention (where the model passes keywords on)


_current: contextvars.ContextVar[Pass] = contextvars.ContextVar("specdec_pass")


def current() -> Pass | None:
    """The pass running on this thread, if any."""
    return _current.get(None)


@contextlib.contextmanager
def running(p: Pass):
    """Makes p the pass that this thread's attention calls and matmuls see."""
    token = _current.set(p)
    try:
        yield
    finally:
        _current.reset(token)


class PassCache(Cache):
    """What the model sees as its KV cache during a pass (forward.cache_kwargs): `update` writes
    the pass's new keys and values into the pool; attention reads them there (packed_attention)."""

    def __init__(self, p: Pass):
        super().__init__(layers=[])
        self.p = p

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # [1, H_kv, T, D]
        if not _opaque:  # else `attend` writes them
            _write(self.p, layer_idx, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    @property
    def is_compileable(self) -> bool:
        return False


@functools.cache
def _cache_kwarg(cls) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """{name: cache}, under the name `model`'s forward takes a KV cache by: `cache` from
    transformers 5.24 on (which deprecates `past_key_values`, to be removed in 5.40, and pays a
    warning per call for it), `past_key_values` before."""
    return {_cache_kwarg(type(model)): cache}


def returned_cache(out):
    """The KV cache a forward returned: `cache` from transformers 5.24 on, `past_key_values` before."""
    return out["cache"] if "cache" in out else out.past_key_values


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """query [1, H, T, D] -> ([1, T, H, D], None); keys and values come from the pool."""
    if s_aux is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported")
    if _opaque:  # compiled layers: the write and the attention as one op that a trace does not enter
        scale = scaling if scaling is not None else query.shape[3] ** -0.5
        return attend(query, key, value, module.layer_idx, scale, sliding_window or 0, softcap or 0.0), None
    p = kwargs.get(PASS_KWARG) or _current.get()
    K = p.pool.k[module.layer_idx]  # what PassCache.update wrote: [slots, H_kv, D]
    if key.shape[1] != K.shape[1] or key.shape[-1] != K.shape[-1]:  # (the `attend` op writes the keys it is given)
        raise NotImplementedError(f"the layer changes its keys after the cache's update ({K.shape[1]} heads of {K.shape[-1]} "
                                  f"written, {key.shape[1]} of {key.shape[-1]} attended: JetMoE tiles them), and attention "
                                  "reads the keys written")
    return _attend(p, module.layer_idx, query, scaling, sliding_window, softcap), None


_opaque = False  # compiled layers are on (compiled.py): attention is the `attend` op


def opaque() -> bool:
    return _opaque


def set_opaque(on: bool) -> None:
    """Routes every layer's cache write and attention through the `attend` op (on) or through
    PassCache.update and packed_attention's own code (off). Process-wide: the compiled layers'
    setting (compiled.py), read when a layer is traced and every time it runs."""
    global _opaque
    _opaque = on


@torch.library.custom_op("specdec::attend", mutates_args=())
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float, window: int,
           softcap: float) -> torch.Tensor:
    """One layer's attention in the thread's pass (`running`), as one op: writes the new keys and
    values into the pool, then attends ([1, H, T, D] -> [1, T, H, D]). A compiled layer calls it
    (`set_opaque`): the pass and the layer's index stay out of the trace, so one compilation
    serves every layer and every pass."""
    p = _current.get()
    _write(p, layer, key, value)
    # contiguous, as the fake below says: a long chunk attended alone comes back as a strided view
    # (soft-capped attention's matmuls, for one), and compiled code holds the op to its fake's strides
    return _attend(p, layer, query, scaling, window or None, softcap or None).contiguous()


@attend.register_fake
def _(query, key, value, layer, scaling, window, softcap):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def _write(p: Pass, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """The pass's new keys and values [1, H_kv, T, D] into the pool's layer."""
    k, v = p.pool.layer(layer, key_states)  # [slots, H_kv, D]
    k.index_copy_(0, p.slots, key_states[0].transpose(0, 1).to(k.dtype))
    v.index_copy_(0, p.slots, value_states[0].transpose(0, 1).to(v.dtype))


def _attend(p: Pass, layer: int, query: torch.Tensor, scaling: float | None, sliding_window: int | None,
            softcap: float | None) -> torch.Tensor:
    K, V = p.pool.k[layer], p.pool.v[layer]  # [slots, H_kv, D]
    H, D = query.shape[1], query.shape[3]
    H_kv = K.shape[1]
    rep = H // H_kv
    scale = scaling if scaling is not None else D**-0.5
    q_all = query[0].transpose(0, 1)  # [T, H, D]
    outs = []
    for g, alone in [(g, False) for g in p.short] + [(g, True) for g in p.long]:
        B = g.qpos.shape[0]
        q = (q_all if p.back is None else q_all.index_select(0, g.rows)).to(K.dtype)  # [B * n, H, D]
        # the CPU tier's query attention, where it takes the layer's heads, reading the pool in place: -> [B * n, H, D]
        o = p.kernel(q.reshape(B, g.n, H, D), K, V, g.visible(sliding_window), scale, g.slots(), softcap or 0.0) \
            if p.kernel is not None and not alone else None
        if o is not None:
            outs.append(o)
            continue
        k, v = g.keys(K), g.keys(V)  # [B, H_kv, Lb, D]
        if alone:  # [1, H, n, D]: the chunk's queries together
            q = q.view(B, g.n, H, D).transpose(1, 2)
            heads, reps, gqa = 0, 1, rep > 1
        elif p.per_query:  # [B, H_kv * n * rep, 1, D]: one query per head row
            q = q.view(B, g.n, H_kv, rep, D).transpose(1, 2).reshape(B, H_kv * g.n * rep, 1, D)
            heads, reps, gqa = H_kv, rep, g.n * rep > 1
        else:  # [B, H_kv, n * rep, D]: a KV head's queries (rounds' rows x GQA's query heads) as the rows of one problem
            q = q.view(B, g.n, H_kv, rep, D).transpose(1, 2).reshape(B, H_kv, g.n * rep, D)
            heads, reps, gqa = 0, rep, False
        mask = g.mask(sliding_window, heads, reps, None if softcap else K.dtype)
        if softcap:
            o = _eager(q, k, v, mask, scale, softcap)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        if alone:  # -> [B * n, H, D]
            o = o.transpose(1, 2).reshape(B * g.n, H, D)
        else:
            o = o.view(B, H_kv, g.n, rep, D).transpose(1, 2).reshape(B * g.n, H, D)
        outs.append(o)
    if p.back is None:  # one group, already in packed order
        o = outs[0]
    else:
        outs.append(outs[0].new_zeros(1, H, D))  # the zero row: padding rows' output, never read
        o = torch.cat(outs).index_select(0, p.back)  # [T, H, D], back in packed order
    return o[None].to(query.dtype)


def _eager(q, k, v, mask, scaling: float, softcap: float) -> torch.Tensor:
    """Attention with tanh logit soft-capping (Gemma 2), in transformers' eager order of ops."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling  # [B, Hq, n, Lb]
    w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)


AttentionInterface.register(ATTN, packed_attention)  # no mask function: masks are built per pass
