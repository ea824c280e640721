"""Compiled layers (specdec/engine/compiled.py): each decoder layer compiled whole with its
attention as one opaque op, which a GPU's CUDA graphs capture; else its norms and MLP; else
nothing. Run here on the CPU (inductor's C++ kernels): the same code path, the model's own
logits, every compilation made at load whatever the layer count, and each fallback."""
from __future__ import annotations

import logging
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import archmodels
from specdec.engine import Engine, KVCache, Plan
from specdec.engine.attention import ATTN, opaque, set_opaque
from specdec.engine.compiled import compile_layers, decoder_layers, uncompiled


def engine_for(path: str) -> tuple[Engine, torch.nn.Module]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.set_attn_implementation(ATTN)
    return Engine(model, Plan(kv_dtype=torch.float32), uniform=True), reference


def passes(eng: Engine, seqs: list[list[int]], rounds: list[int]) -> list[torch.Tensor]:
    """Prefills each sequence but its last sum(rounds) tokens, then runs every session's rounds together."""
    caches = [KVCache(len(s)) for s in seqs]
    at = [len(s) - sum(rounds) for s in seqs]
    eng.forward([s[:a] for s, a in zip(seqs, at)], caches, logits=False)
    outs = []
    for n in rounds:
        outs.append(eng.forward([s[a : a + n] for s, a in zip(seqs, at)], caches, padded=True).clone())
        at = [a + n for a in at]
    for c in caches:
        c.release()
    return outs


def own_logits(reference, seqs: list[list[int]], rounds: list[int]) -> list[torch.Tensor]:
    """The model's own logits at the rounds' positions, [sessions, n, V] per round."""
    with torch.no_grad():
        full = [reference(torch.tensor([s])).logits[0] for s in seqs]
    outs, at = [], [len(s) - sum(rounds) for s in seqs]
    for n in rounds:
        outs.append(torch.stack([f[a : a + n] for f, a in zip(full, at)]))
        at = [a + n for a in at]
    return outs


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2"])
def test_compiled_layers_serve_the_models_own_logits(tmp_path, name):
    """Every decoder layer compiled whole; its compilations (rows 1 and more, packed and uniform
    passes; per kind of layer: gemma2's sliding and global ones) all made at load by the probes,
    none after, whatever the sessions, rows and pages; the model's own logits, compiled and not."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eng, reference = engine_for(archmodels.build(str(tmp_path), name, seed=0))
    try:
        done = compile_layers(eng)
        assert done == list(decoder_layers(eng.model)) and opaque()
        made = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert 1 <= made <= 8
        r = random.Random(1)
        # (the last: one session's prefill of more than ROW_BY_ROW tokens, a long chunk attended alone, whose
        # attention comes back strided; compiled code held the op to its fake's contiguous strides and failed on gemma2)
        for k, rounds, length in ((1, [1, 1], (20, 40)), (3, [5, 2], (20, 40)), (6, [4, 1, 3], (20, 40)), (1, [3, 1], (90, 90))):
            seqs = [[r.randrange(2, archmodels.V) for _ in range(r.randint(*length))] for _ in range(k)]
            for got, want in zip(passes(eng, seqs, rounds), own_logits(reference, seqs, rounds)):
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == made
        seqs = [[r.randrange(2, archmodels.V) for _ in range(30)] for _ in range(2)]
        with uncompiled(done):  # the layers' own calls, what a benchmark compares against: the same logits
            assert not opaque() and all(m._compiled_call_impl is None for m in done)
            for got, want in zip(passes(eng, seqs, [3]), own_logits(reference, seqs, [3])):
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        assert opaque() and all(m._compiled_call_impl is not None for m in done)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == made
    finally:
        set_opaque(False)


class Branchy(torch.nn.Module):
    """An MLP stand-in with data-dependent control flow: torch.compile(fullgraph=True) refuses it."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x) if x.sum() > -1e9 else x


def test_a_layer_that_cannot_be_compiled_whole_gets_its_norms_and_mlp_compiled(tmp_path, caplog):
    """Data-dependent control flow in the attention module: the whole layer fails its probe, so
    its children that read no pool (two norms and the MLP) are compiled instead."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    eng, reference = engine_for(archmodels.build(str(tmp_path), "llama", seed=0))
    for m in (eng.model, reference):
        for layer in decoder_layers(m):
            layer.self_attn.o_proj = Branchy(layer.self_attn.o_proj)
    try:
        with caplog.at_level(logging.WARNING, logger="specdec.engine"):
            done = compile_layers(eng)
        assert "torch.compile of its layers failed" in caplog.text and not opaque()
        assert len(done) == 3 * len(decoder_layers(eng.model)) and not any(isinstance(m, type(eng.model.model.layers[0])) for m in done)
        seqs = [[3, 4, 5, 6, 7, 8, 9, 10] * 3]
        for got, want in zip(passes(eng, seqs, [2, 1]), own_logits(reference, seqs, [2, 1])):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    finally:
        set_opaque(False)


def test_a_model_whose_layers_cannot_be_compiled_runs_uncompiled(tmp_path, caplog):
    torch.set_num_threads(1)
    torch._dynamo.reset()
    eng, reference = engine_for(archmodels.build(str(tmp_path), "llama", seed=0))
    for m in (eng.model, reference):
        for layer in decoder_layers(m):
            layer.mlp = Branchy(layer.mlp)
    with caplog.at_level(logging.WARNING, logger="specdec.engine"):
        assert compile_layers(eng) == []
    assert "torch.compile of its layers failed" in caplog.text and "norms and MLPs failed" in caplog.text
    assert "layers run uncompiled" in caplog.text and not opaque()
    assert all(getattr(c, "_compiled_call_impl", None) is None for layer in decoder_layers(eng.model) for c in [layer, *layer.children()])
    seqs = [[3, 4, 5, 6, 7, 8, 9, 10] * 3]
    for got, want in zip(passes(eng, seqs, [2, 1]), own_logits(reference, seqs, [2, 1])):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
