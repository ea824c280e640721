"""The CPU tier's lean forward (specdec/engine/cpu/lean.py): a Llama model's modules without its
wrappers, taken only where a probe at load gives the model's own logits bitwise."""
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdec.engine import KVCache, Tree, prepare
from specdec.engine.cpu import lean


def _llama(seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **kw})).eval()


def _passes(engine) -> list[torch.Tensor]:
    """Every kind of pass the services run, on fresh caches: a long prefill chunk without logits
    beside a session's prompt, steps and rounds of several sessions, padded rounds, the draft's
    last-row feeds, and tree passes through the tree mask and along the branches."""
    g = torch.Generator().manual_seed(1)
    V = engine.model.config.vocab_size
    ids = lambda n: torch.randint(V, (n,), generator=g).tolist()  # noqa: E731
    a, b, c = KVCache(400), KVCache(64), KVCache(64)
    out = []
    got = lambda r: out.extend(x for x in (r if isinstance(r, list) else [r]) if x is not None)  # noqa: E731
    got(engine.forward([ids(300), ids(9)], [a, b], [False, True]))
    got(engine.forward([ids(1), ids(4), ids(11)], [a, b, c]))
    got(engine.forward([ids(5), ids(5)], [a, c], padded=True))
    got(engine.forward([ids(1), ids(3)], [b, c], last=[True, True]))
    for paths in (True, False):
        tree = Tree(b.length, (-1, 0, 0, 1, 2))
        got(engine.forward([ids(5), ids(2)], [b, a], trees=[tree, None], tree_paths=paths))
        b.crop(tree.base)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_forward_gives_the_models_own_numbers_in_every_kind_of_pass(dtype, caplog):
    torch.set_num_threads(1)
    with caplog.at_level(logging.INFO, logger="specdec.engine"):
        engine = prepare(_llama().to(dtype))
    assert engine.lean is not None
    assert "the lean forward" in caplog.text

    def bypassed(module, args, kwargs):
        raise AssertionError("the model's own forward ran")

    hook = engine.model.register_forward_pre_hook(bypassed, with_kwargs=True)  # the lean forward does not call the model
    fast = _passes(engine)
    hook.remove()
    engine.lean = None  # the model's own forward
    own = _passes(engine)
    assert len(fast) == len(own) == 11
    for x, y in zip(fast, own):
        assert torch.equal(x, y)


def _refused(model, caplog, words: str) -> None:
    with caplog.at_level(logging.INFO, logger="specdec.engine"):
        engine = prepare(model)
    assert engine.lean is None
    assert f"no lean forward: {words}" in caplog.text


def test_a_model_not_built_of_llamas_modules_keeps_its_own_forward(caplog):
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    _refused(qwen, caplog, "Qwen2ForCausalLM is not transformers' LlamaForCausalLM")

    class Subclassed(LlamaForCausalLM):
        pass

    _refused(Subclassed(_llama().config).eval(), caplog, "Subclassed is not transformers' LlamaForCausalLM")
    hooked = _llama()
    hooked.model.layers[1].register_forward_hook(lambda m, args, out: None)
    _refused(hooked, caplog, "the model, a decoder layer or an attention module has forward hooks")
    replaced = _llama()
    replaced.model.layers[0].self_attn.forward = lambda *a, **kw: None
    _refused(replaced, caplog, "the model, a decoder layer or an attention module has its forward replaced or compiled")


def test_a_model_whose_own_forward_fails_the_probe_is_left_to_its_check(monkeypatch, caplog):
    model = _llama()
    monkeypatch.setattr(model.model.layers[0].mlp, "forward", lambda x: (_ for _ in ()).throw(RuntimeError("broken mlp")))
    _refused(model, caplog, "its probe failed in the model's own forward: RuntimeError: broken mlp")


@pytest.mark.parametrize("fault,words", [("differs", "its probe's logits differ from the model's forward"),
                                         ("raises", "its probe failed in the lean forward: RuntimeError: lean fault")])
def test_a_lean_forward_whose_probe_does_not_match_is_not_taken(monkeypatch, caplog, fault, words):
    real = lean.lean_forward

    def faulty(model):
        run = real(model)

        def wrong(ids, position_ids, cache, rows):
            if fault == "raises":
                raise RuntimeError("lean fault")
            out = run(ids, position_ids, cache, rows)
            return None if out is None else out + 1e-3

        return wrong

    monkeypatch.setattr(lean, "lean_forward", faulty)
    _refused(_llama(), caplog, words)


def test_the_lean_benchmark_reports_both_forwards(model_dir, tmp_path):
    import json
    import subprocess
    import sys

    from bench.launch import ENV, ROOT

    out = tmp_path / "lean"
    subprocess.run([sys.executable, "-m", "bench.lean", "--target", model_dir("target"), "--draft", model_dir("draft"),
                    "--context", "20", "--repeats", "1", "--out", str(out)], cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=300)
    res = json.loads((out / "lean.json").read_text())
    assert [(r["model"], r["sessions"], r["rows"]) for r in res["cases"]] == \
        [("draft", 1, 1), ("draft", 4, 1), ("draft", 1, 5), ("target", 1, 1), ("target", 1, 5), ("target", 4, 5), ("target", 16, 1)]
    assert all(r["ms"]["model"] > 0 and r["ms"]["lean"] > 0 for r in res["cases"])
    assert (out / "LEAN.md").read_text().count("| draft |") == 3
