"""What the engine's tests share: a cache filled by a pass of its own, steps against rounds,
a model loaded with its matmuls forced one way, the logits of a short session, a pass counter,
and a scheduler thread held back."""
from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from specdec.engine import KVCache
from specdec.engine.cpu import kernel as row_kernel
from specdec.engine.cpu.prepack import prepacked
from specdec.engine.cpu.rows import PER_ROW_LEAD
from specdec.lm import LM

BF16_ONEDNN = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cached(engine, s, c):
    """A cache of len(s) holding s[:c], put there by a pass of its own."""
    kv = KVCache(len(s))
    if c:
        engine.forward([s[:c]], [kv], logits=False)
    return kv


def same_cache(a: KVCache, b: KVCache, n: int) -> bool:
    """Whether two caches hold bitwise the same keys and values for their first n positions."""
    return a.layers == b.layers and all(torch.equal(x[:, :n], y[:, :n]) for i in range(a.layers) for x, y in zip(a.layer(i), b.layer(i)))


def steps_and_rounds(engine, ids: list[int]):
    """The logits of ids' second half after its first half in the cache: one token a pass, and
    five tokens a pass (rounds of tau = 4); and the stepped cache."""
    half = len(ids) // 2
    a, b = KVCache(len(ids)), KVCache(len(ids))
    engine.forward([ids[:half]], [a], logits=False)
    engine.forward([ids[:half]], [b], logits=False)
    steps = torch.cat([engine.forward([[t]], [a])[0] for t in ids[half:]])
    rounds = torch.cat([engine.forward([ids[i:i + 5]], [b])[0] for i in range(half, len(ids), 5)])
    return steps, rounds, a


def load_packed(path: str, dtype: str, matmuls: str) -> LM:
    """The model as the services load it ("calibrated": GEMMs, or per-row products where the
    calibration says they pay), with per-row matmul products forced (as batched matmuls, "per-row",
    or through the float32 row kernel, "row-kernel", which alone attends through the CPU tier's query
    attention, the others through SDPA where pinned and else wherever the kernels build), with prepacked
    oneDNN products forced ("prepacked": in half precision where oneDNN has bf16; in float32 another
    kernel than the module's own) or with the module's own GEMMs ("unpacked")."""
    if matmuls == "calibrated":
        return LM.load(path, "cpu", dtype)
    if matmuls in ("prepacked", "unpacked"):
        lm = LM.load(path, "cpu", dtype, check=False, choices={"fp32_prepack" if dtype == "float32" else "prepack": matmuls == "prepacked"})
        want = matmuls == "prepacked" and (dtype == "float32" or BF16_ONEDNN)
        if want and dtype != "float32" and not lm.engine.plan.prepacked and not prepacked_products_agree(path, dtype):
            pytest.skip("this CPU's oneDNN products with prepacked weights round differently from the modules' own: "
                        "the engine keeps the weights unpacked")
        assert lm.engine.plan.prepacked == want
        return lm
    kernel = matmuls == "row-kernel"  # per-row products through the float32 row kernel, else batched matmuls
    if kernel and row_kernel.library() is None:
        pytest.skip("the row kernel does not build on this machine (see the log): per-row products are batched matmuls")
    # batched per-row products attend through SDPA, the row kernel's with the query attention: both layouts stay tested
    pins = {"row_kernel": kernel, "attention_kernel": kernel} if dtype == "float32" else {}
    lm = LM.load(path, "cpu", dtype, check=False, choices=dict(per_row=True, **pins))
    assert lm.engine.plan.pad_to == 1 and lm.engine.plan.top == PER_ROW_LEAD  # kept: no padding rows
    assert lm.engine.plan.row_kernel == kernel
    return lm


def prepacked_products_agree(path: str, dtype: str) -> bool:
    """Whether every linear module of the model at path, in dtype, gives the same numbers through
    oneDNN with its weight prepacked as through its own forward, for five rows together and for
    each of them alone, over four random draws: where they differ (seen on a CPU without native
    bf16 instructions, one row at a time), the engine must not prepack."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                packed = prepacked(m)  # the engine's prepacked product; compared here on more inputs than its own check
                for _ in range(4):
                    x = torch.randn(1, 5, m.in_features, generator=g).to(model.dtype)
                    if not all(torch.equal(packed(r), m(r)) for r in (x, *x.split(1, dim=1))):
                        return False
    return True


def logits_of_a_session(engine) -> torch.Tensor:
    c = KVCache(48)
    outs = [engine.forward([[3 + i % 13 for i in range(30)]], [c])[0], engine.forward([[7, 8, 9, 10, 11]], [c])[0],
            engine.forward([[12]], [c])[0]]
    return torch.cat(outs)


def count_passes(monkeypatch, engine) -> list:
    """A list that gets one entry per `engine.forward` call (a verify pass) from now on."""
    passes = []
    real = engine.forward

    def counted(*a, **kw):
        passes.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(engine, "forward", counted)
    return passes


def held_thread():
    """(go, context): a Scheduler made with thread_context=context starts its thread's work only
    once `go` is set (the test arranges its queue, or its state, first)."""
    go = threading.Event()

    @contextlib.contextmanager
    def context():
        go.wait(60)
        yield

    return go, context
