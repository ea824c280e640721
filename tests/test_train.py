"""Tests of the training tools: corpus split, tokenizer, and the draft-distillation tool."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

from train import corpus
from train.tokenizer import BOS, EOS, PAD, train_tokenizer

SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\n\nfor name in os.listdir('.'):\n    print(name)\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "with open('f.txt') as f:\n    data = f.read()\n",
]


def test_heldout_split_is_deterministic_and_disjoint():
    names = corpus.stdlib_files(include_tests=False)
    assert names == sorted(names) and len(names) > 100
    assert not any("site-packages" in n for n in names)
    assert names == corpus.stdlib_files(include_tests=False)
    held = [n for n in names if corpus.is_heldout(n)]
    assert 0.01 < len(held) / len(names) < 0.12
    assert [corpus.is_heldout(n) for n in names] == [corpus.is_heldout(n) for n in names]
    # The split depends only on the relative path, and the two splits do not overlap.
    train = {d.name for d in corpus.select_documents(corpus.stdlib_root(), names[:200], "train")}
    heldout = {d.name for d in corpus.select_documents(corpus.stdlib_root(), names[:200], "heldout")}
    assert train and heldout and not (train & heldout)
    assert train | heldout <= set(names[:200])


def test_user_corpus_reads_files_and_directories(tmp_path):
    d = tmp_path / "src"
    (d / "pkg").mkdir(parents=True)
    for i, s in enumerate(SNIPPETS):
        (d / "pkg" / f"m{i}.py").write_text(s)
    (d / "blob.bin").write_bytes(b"\x00\x01\x02")
    extra = tmp_path / "extra.txt"
    extra.write_text("hello\n")
    docs = corpus.user_documents([str(d), str(extra)], "all")
    names = [x.name for x in docs]
    assert names == sorted(names)
    assert "1:extra.txt" in names and not any("blob" in n for n in names)
    assert len(docs) == len(SNIPPETS) + 1
    assert corpus.user_documents([str(d), str(extra)], "all") == docs


def _tiny_tokenizer():
    return train_tokenizer(SNIPPETS * 20, vocab_size=300, model_max_length=128)


def test_tokenizer_round_trips_and_has_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    _tiny_tokenizer().save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    for text in SNIPPETS + ["unseen: λ → 🙂 \t\r\n  x = {'ü': 1}\n"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text


@pytest.fixture()
def tiny_pair_inputs(tmp_path):
    """A random tiny Llama target with its tokenizer, and a tiny corpus directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    target = LlamaForCausalLM(cfg)
    with torch.no_grad():  # a peaked next-token distribution, so there is something to imitate
        target.lm_head.weight.mul_(40.0)
    tdir = tmp_path / "target"
    target.save_pretrained(tdir)
    tok.save_pretrained(tdir)
    cdir = tmp_path / "corpus"
    cdir.mkdir()
    for i, s in enumerate(SNIPPETS * 4):
        (cdir / f"f{i:02d}.py").write_text(s * 3)
    return tdir, cdir, target


def _log(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def test_distill_trains_a_loadable_draft_and_resumes(tmp_path, tiny_pair_inputs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train import distill

    tdir, cdir, target = tiny_pair_inputs
    out, run = tmp_path / "draft", tmp_path / "run"
    common = ["--target", str(tdir), "--corpus", str(cdir), "--out", str(out), "--run-dir", str(run),
              "--layers", "1", "--hidden", "16", "--heads", "2", "--intermediate", "32",
              "--seq-len", "32", "--batch-size", "4", "--lr", "1e-2", "--warmup", "2", "--seed", "1", "--verdict-prompts", "0"]
    s1 = distill.main(common + ["--steps", "6"])
    assert s1["steps"] == 6
    assert s1["draft_parameters"] < s1["target_parameters"]

    draft = AutoModelForCausalLM.from_pretrained(out)
    dtok = AutoTokenizer.from_pretrained(out)
    ttok = AutoTokenizer.from_pretrained(tdir)
    assert dtok.get_vocab() == ttok.get_vocab()
    assert draft.config.vocab_size == target.config.vocab_size
    assert draft.config.eos_token_id == ttok.eos_token_id == dtok.eos_token_id
    assert draft.config.num_hidden_layers == 1 and draft.config.hidden_size == 16
    ids = torch.tensor([ttok("def add(a, b):")["input_ids"]])
    with torch.no_grad():
        assert draft(input_ids=ids).logits.shape[-1] == target(input_ids=ids).logits.shape[-1]

    log1 = _log(run)
    assert log1[0]["step"] == 1 and log1[-1]["step"] == 6
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log1)
    assert all(r["kl"] >= -1e-4 for r in log1)

    # Running again with a larger step limit resumes at step 6 instead of starting over.
    s2 = distill.main(common + ["--steps", "40"])
    assert s2["steps"] == 40
    log2 = _log(run)
    steps = [r["step"] for r in log2]
    assert steps.index(6) < len(steps) - 1 and 7 <= steps[len(log1)] <= 10
    assert 1 not in steps[len(log1):]
    # The draft learns to imitate the target: KL at the end is well below KL at the start.
    assert log2[-1]["kl"] < 0.8 * log1[0]["kl"]
    assert log2[-1]["loss"] < log1[0]["loss"]

    # The saved draft is the resumed one, not a fresh one.
    draft2 = AutoModelForCausalLM.from_pretrained(out)
    assert not torch.equal(draft.model.embed_tokens.weight, draft2.model.embed_tokens.weight)


def test_evaluation_measures_a_pair(tiny_pair_inputs):
    from transformers import LlamaConfig, LlamaForCausalLM

    from train import evaluate

    _, _, target = tiny_pair_inputs
    target.eval()
    table = evaluate.speedup_table(0.8, 0.1)
    assert table["by_gamma"][3] == pytest.approx((1 - 0.8 ** 4) / 0.2 / 1.3, abs=1e-3)
    assert table["best_speedup"] == max(table["by_gamma"].values())
    torch.manual_seed(0)
    prompts = torch.randint(3, target.config.vocab_size, (4, 12))
    # A draft identical to the target is always accepted: α = 1, β = 1, γ + 1 tokens per round.
    same = evaluate.greedy_acceptance(target, target, prompts, steps=10, batch=2)
    assert same["alpha"] == 1.0 and same["tokens_per_round_measured"][4] == pytest.approx(5.0)
    t1 = evaluate.sampled_acceptance(target, target, prompts, gamma=4, batch=2, seed=0)
    assert t1["beta_mean"] == pytest.approx(1.0, abs=1e-4)
    assert t1["tokens_per_round_path_estimate"][4] == pytest.approx(5.0, abs=1e-3)
    # An unrelated random draft agrees less and its acceptance is a probability.
    other = LlamaForCausalLM(LlamaConfig(vocab_size=target.config.vocab_size, hidden_size=16,
                                         intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, max_position_embeddings=128)).eval()
    diff = evaluate.greedy_acceptance(target, other, prompts, steps=10, batch=2)
    assert diff["alpha"] < 1.0
    t1o = evaluate.sampled_acceptance(target, other, prompts, gamma=4, batch=2, seed=0)
    assert 0.0 <= t1o["beta_mean"] < 0.999
    assert all(1.0 <= e <= g + 1 for g, e in t1o["tokens_per_round_path_estimate"].items())


def test_package_corpus_is_split_by_its_own_names_and_declares_its_license():
    """`package:NAME` reads an installed package's .py files (named NAME/relative path), split by
    the same hash as every corpus; its declared license is found for the model card."""
    train_docs = corpus.documents(["package:packaging"], "train")
    held = corpus.documents(["package:packaging"], "heldout")
    everything = corpus.documents(["package:packaging"], "all")
    assert train_docs and all(d.name.startswith("packaging/") and d.name.endswith(".py") for d in everything)
    assert sorted(d.name for d in train_docs + held) == sorted(d.name for d in everything)
    assert all(corpus.is_heldout(d.name) for d in held) and not any(corpus.is_heldout(d.name) for d in train_docs)
    assert "Apache" in corpus.package_license("packaging") or "BSD" in corpus.package_license("packaging")
    with pytest.raises(FileNotFoundError):
        corpus.documents(["package:no_such_package_here"])


def test_a_top_level_name_two_distributions_install_takes_its_own_license(monkeypatch):
    """packages_distributions() can map one import name to several distributions (a wheel that
    ships a stray top-level directory): the distribution named like the package decides, and
    where none is, every license is listed, so one copyleft license among them refuses the package."""
    from train import corpus

    own = corpus.package_license("packaging")
    dists = {"packaging": ["torch", "packaging"], "stray": ["torch", "packaging"]}
    assert corpus.package_license("packaging", dists) == own and "(torch)" not in own
    both = corpus.package_license("stray", dists)
    assert "(torch)" in both and "(packaging)" in both
    monkeypatch.setattr(corpus.importlib.metadata, "metadata", lambda d: {"License-Expression": "GPL-3.0" if d == "torch" else "MIT"})
    assert not corpus.is_permissive(corpus.package_license("stray", dists))
    assert corpus.is_permissive(corpus.package_license("packaging", dists))


def test_code_prompt_quality_scores_loops_low():
    from train.evaluate import distinct_ngrams

    assert distinct_ngrams([1, 2, 3, 4, 5, 6]) == 1.0
    assert distinct_ngrams([7, 8] * 20) == pytest.approx(2 / 38)  # a loop: two distinct 3-grams
    assert distinct_ngrams([1, 2]) == 1.0


def test_only_permissive_licenses_count_as_permissive():
    for lic in ("MIT", "BSD-3-Clause", "Apache-2.0 AND BSD-2-Clause", "PSF-2.0", "ISC License", "Apache Software License"):
        assert corpus.is_permissive(lic), lic
    for lic in ("GPL-3.0", "LGPL-2.1-or-later", "MIT OR GPL-2.0", "MPL-2.0", "Other/Proprietary License", "unknown", "",
                "Copyright 2020 Example Limited, all rights reserved"):
        assert not corpus.is_permissive(lic), lic


def test_site_permissive_expands_to_permissive_installed_packages_minus_the_excluded():
    specs = corpus.expand(["stdlib", "site:permissive"], exclude=["packaging"])
    packages = [s.split(":", 1)[1] for s in specs if s.startswith("package:")]
    assert specs[0] == "stdlib" and packages, specs
    assert "packaging" not in packages and "packaging" in corpus.permissive_packages()  # installed: the exclusion worked
    assert all(corpus.is_permissive(corpus.package_license(p)) for p in packages)
    assert packages == sorted(packages)


def test_corpus_tokens_are_the_same_in_parallel_and_come_back_from_the_cache(tmp_path):
    """Sources tokenized in worker processes give the serial stream, in spec order, with one
    row per source; a cached stream is reused for the same specs, split and files only (a file
    changed or added under a directory spec was read from the stale cache)."""
    from train.data import corpus_tokens

    tok = _tiny_tokenizer()
    dirs = []
    for i in range(3):
        d = tmp_path / f"src{i}"
        d.mkdir()
        for j, text in enumerate(SNIPPETS[i:] * 3):
            (d / f"m{j}.py").write_text(text)
        dirs.append(str(d))
    serial, rows = corpus_tokens(tok, dirs, "all", workers=1)
    parallel, rows2 = corpus_tokens(tok, dirs, "all", workers=3)
    assert torch.equal(serial, parallel) and rows == rows2
    assert [r["spec"] for r in rows] == dirs and sum(r["tokens"] for r in rows) == serial.numel()
    cache = tmp_path / "tokens.pt"
    first, _ = corpus_tokens(tok, dirs, "all", cache=str(cache))
    again, _ = corpus_tokens(tok, dirs, "all", cache=str(cache))
    assert cache.exists() and torch.equal(first, again) and torch.equal(first, serial)
    other, _ = corpus_tokens(tok, dirs[:2], "all", cache=str(cache))  # other specs: tokenized afresh
    assert other.numel() < serial.numel()
    first, _ = corpus_tokens(tok, dirs, "all", cache=str(cache))
    (Path(dirs[0]) / "m0.py").write_text("x = 1\n" * 50)  # a changed source: tokenized afresh
    changed, _ = corpus_tokens(tok, dirs, "all", cache=str(cache))
    assert torch.equal(changed, corpus_tokens(tok, dirs, "all", workers=1)[0]) and not torch.equal(changed, first)
    (Path(dirs[1]) / "new.py").write_text("y = 2\n" * 30)  # an added one too
    added, _ = corpus_tokens(tok, dirs, "all", cache=str(cache))
    assert added.numel() > changed.numel() and torch.equal(added, corpus_tokens(tok, dirs, "all", workers=1)[0])


def _distill_args(tdir, cdir, out, run) -> list[str]:
    return ["--target", str(tdir), "--corpus", str(cdir), "--out", str(out), "--run-dir", str(run),
            "--layers", "1", "--hidden", "16", "--heads", "2", "--intermediate", "32", "--seq-len", "32",
            "--batch-size", "4", "--lr", "1e-2", "--warmup", "2", "--seed", "1", "--steps", "12", "--compile", "--verdict-prompts", "0"]


def test_compiled_training_step_trains(tmp_path, tiny_pair_inputs):
    """--compile runs the step through torch.compile (inductor on the CPU). In a process of its own:
    inductor's C++ build breaks in a process where another test already imported distutils."""
    import subprocess
    import sys

    from bench.launch import ENV, ROOT

    tdir, cdir, _ = tiny_pair_inputs
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "train.distill", *_distill_args(tdir, cdir, tmp_path / "draft", run)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "torch.compile failed" not in p.stdout, p.stdout[-2000:]
    log = _log(run)
    assert log[-1]["step"] == 12 and all(isinstance(r["kl"], float) for r in log)
    assert log[-1]["kl"] < log[0]["kl"]


def test_a_failing_compiler_falls_back_to_eager_training(tmp_path, tiny_pair_inputs, monkeypatch, capsys):
    """A compiler that fails at the first step leaves training to eager mode instead of ending the run."""
    from train import distill

    def broken(fn, *a, **k):
        def call(*args, **kwargs):
            raise RuntimeError("no compiler here")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    tdir, cdir, _ = tiny_pair_inputs
    run = tmp_path / "run"
    s = distill.main(_distill_args(tdir, cdir, tmp_path / "draft", run))
    assert s["steps"] == 12
    log = _log(run)
    assert log[-1]["step"] == 12 and log[-1]["kl"] < log[0]["kl"]
    assert "torch.compile failed (RuntimeError: no compiler here); training eagerly" in capsys.readouterr().out


def test_model_card_adds_up_a_target_trained_in_several_runs():
    from train.modelcard import combine_runs

    first = {"steps": 100, "tokens": 3200, "elapsed_s": 60.0, "final_loss": 2.0, "corpus_tokens": 500, "lr": 2e-3}
    second = {"steps": 50, "tokens": 1600, "elapsed_s": 30.0, "final_loss": 1.5, "corpus_tokens": 500, "lr": 1e-3}
    ts = combine_runs([first, second])
    assert (ts["steps"], ts["tokens"], ts["elapsed_s"]) == (150, 4800, 90.0)
    assert ts["final_loss"] == 1.5 and ts["lr"] == 1e-3 and ts["runs"] == 2 and ts["run_minutes"] == [1.0, 0.5]
    assert first["steps"] == 100  # the runs themselves are left as they were


def test_shipped_model_card_is_the_one_rendered_from_the_shipped_records(tmp_path):
    """models/README.md is generated: a hand edit would be lost the next time it is rendered."""
    from train.modelcard import main

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "models" / "README.md"
    main(["--training", str(root / "models/training.json"), "--eval", str(root / "models/eval.json"),
          "--engine", str(root / "bench/results/engine.json"), "--target-dir", str(root / "models/stdlib-code-target"),
          "--draft-dir", str(root / "models/stdlib-code-draft"), "--out", str(out)])
    assert out.read_text() == (root / "models/README.md").read_text(), \
        "models/README.md is not what its records render: run python -m train.modelcard --training models/training.json"
    assert (tmp_path / "models" / "training.json").read_text() == (root / "models/training.json").read_text()


def test_repeated_ngrams_marks_every_token_of_a_repeat():
    from train.unlikelihood import repeated_ngrams

    seq = torch.tensor([[1, 2, 3, 1, 2, 3, 4, 5], [7, 7, 7, 7, 8, 9, 10, 11]])
    got = repeated_ngrams(seq, 3)
    assert got.tolist() == [[False, False, False, True, True, True, False, False],
                            [False, True, True, True, False, False, False, False]]
    assert not repeated_ngrams(torch.arange(12)[None], 2).any()


def test_unlikelihood_step_lowers_the_probability_of_repeated_tokens(tiny_pair_inputs):
    """One SGD step with the unlikelihood term weighted up makes the model less likely to repeat what its
    own greedy continuation repeated (teacher-forced on that continuation)."""
    from train.unlikelihood import make_loss, repeated_ngrams

    _, _, model = tiny_pair_inputs
    torch.manual_seed(3)
    windows = torch.randint(3, model.config.vocab_size, (4, 24))
    prefix, new = 8, 32
    with torch.no_grad():
        seq = model.generate(windows[:, :prefix], attention_mask=torch.ones(4, prefix, dtype=torch.long), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
    rep = repeated_ngrams(seq[:, prefix:], 4)
    assert rep.sum() >= 8, "the peaked random model should loop"

    def p_repeated():
        with torch.no_grad():
            logits = model(input_ids=seq[:, :-1]).logits[:, prefix - 1 :].float()
            return torch.softmax(logits, -1).gather(-1, seq[:, prefix:, None])[..., 0][rep].mean().item()

    before = p_repeated()
    loss_fn = make_loss(weight=20.0, batch=4, prefix=prefix, new=new)
    model.train()
    loss, m = loss_fn(model, windows)
    assert m["repeated"] == rep.float().mean() and m["unlikelihood"] > 0
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for prm in model.parameters():
            prm -= 0.5 * prm.grad
    model.eval()
    after = p_repeated()
    assert after < 0.8 * before, (before, after)


def test_progress_total_follows_the_time_budget_and_a_rerun_gets_its_own(tmp_path, capsys):
    from train import loop

    # the bar's total: --steps, or sooner at this run's rate when the budget ends first
    assert loop.planned_steps(10, 1000, 10, 5.0, None) == 1000
    assert loop.planned_steps(10, 1000, 10, 5.0, 60.0) == 10 + 110  # 55 s left at 2 steps/s
    assert loop.planned_steps(510, 1000, 10, 5.0, 60.0) == 620  # resumed at step 500
    assert loop.planned_steps(10, 50, 10, 5.0, 60.0) == 50 and loop.planned_steps(10, 1000, 10, 70.0, 60.0) == 10
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(batch[:, :-1]).reshape(-1, 32), batch[:, 1:].reshape(-1)), {}

    cfg = loop.LoopConfig(run_dir=tmp_path, max_steps=10**9, max_minutes=0.01, bf16=False, warmup_steps=1)
    first = loop.run(model, lambda step: torch.randint(0, 32, (2, 9)), loss_fn, cfg)
    bar = capsys.readouterr().err.rsplit("\r", 1)[-1]
    n = first["steps"]
    assert first["stopped_by"] == "max-minutes" and 0 < n < 10**9
    assert f" {n}/{n} " in bar  # the bar ended full at the step the budget ended, not at 1e9
    # the same command again trains another budget from where it stopped
    second = loop.run(model, lambda step: torch.randint(0, 32, (2, 9)), loss_fn, cfg)
    assert second["resumed_from_step"] == n and second["steps_this_run"] > 0 and second["steps"] == n + second["steps_this_run"]
    assert second["final_loss"] is not None and second["tokens"] == second["steps"] * 16


def test_a_non_finite_loss_keeps_the_last_good_weights(tmp_path):
    """The check came after the optimizer's step, and the run's last save then wrote the NaN
    weights over the last good checkpoint, which a resume loaded."""
    from train import checkpoint, loop

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))

    def loss_fn(m, batch):
        loss = torch.nn.functional.cross_entropy(m(batch[:, :-1]).reshape(-1, 32), batch[:, 1:].reshape(-1))
        return (loss * float("nan") if loss_fn.calls == 3 else loss), {}

    def batch(step):
        loss_fn.calls = step
        return torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(step))

    cfg = loop.LoopConfig(run_dir=tmp_path, max_steps=10, bf16=False, warmup_steps=1)
    with pytest.raises(FloatingPointError, match="step 4"):
        loop.run(model, batch, loss_fn, cfg)
    saved = checkpoint.load(tmp_path)
    assert saved["step"] == 3 and all(torch.isfinite(v).all() for v in saved["model"].values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_final_metrics_of_a_run_are_in_its_summary(tmp_path):
    """The model card reads a run's final cross-entropy (final_mle) beside its mixed loss: it was
    written by hand into the records, as no run returned it."""
    from train import loop

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))

    def loss_fn(m, batch):
        ce = torch.nn.functional.cross_entropy(m(batch[:, :-1]).reshape(-1, 32), batch[:, 1:].reshape(-1))
        return 2 * ce, {"mle": ce.detach()}

    out = loop.run(model, lambda step: torch.randint(0, 32, (2, 9)), loss_fn, loop.LoopConfig(run_dir=tmp_path, max_steps=3, bf16=False))
    assert out["final_mle"] == pytest.approx(out["final_loss"] / 2)


def test_a_token_cache_is_reused_only_for_the_same_tokenizer_and_tests(tmp_path):
    """The cache was keyed by specs and split only: another tokenizer (or --no-tests) got the old ids."""
    from train.data import corpus_tokens

    d = tmp_path / "src"
    d.mkdir()
    for j, text in enumerate(SNIPPETS * 3):
        (d / f"m{j}.py").write_text(text)
    cache = str(tmp_path / "tokens.pt")
    a = _tiny_tokenizer()
    b = train_tokenizer(SNIPPETS[:2] * 20, vocab_size=270, model_max_length=128)
    first, _ = corpus_tokens(a, [str(d)], "all", cache=cache)
    other, _ = corpus_tokens(b, [str(d)], "all", cache=cache)
    own, _ = corpus_tokens(b, [str(d)], "all", workers=1)
    assert torch.equal(other, own) and not torch.equal(first, own)
    assert torch.equal(corpus_tokens(b, [str(d)], "all", cache=cache)[0], own)  # now cached for b


def test_copies_of_a_trained_file_are_not_held_out_or_out_of_domain(tmp_path):
    """The split is by path: a file copied into two packages could be held out in one and trained
    on in the other, and pip's vendored rich put the out-of-domain set in training."""
    vendored = "from pip._vendor.rich.text import Text\nfrom pip._vendor.rich import box\n\n" + SNIPPETS[3]
    own = "from rich.text import Text\nfrom rich import box\n\n" + SNIPPETS[3]
    trained = [corpus.Document("pip/_vendor/rich/x.py", vendored), corpus.Document("a/y.py", SNIPPETS[0])]
    docs = [corpus.Document("rich/x.py", own), corpus.Document("b/y.py", SNIPPETS[0] + "\n"), corpus.Document("c/z.py", SNIPPETS[1])]
    assert [d.name for d in corpus.unseen(docs, trained)] == ["c/z.py"]


def test_a_tiny_user_corpus_is_all_trained_and_nothing_held_out(tmp_path):
    """A corpus whose every file hashes to the held-out split is trained on whole; the held-out
    split is then empty, not the training text under the name of held-out files."""
    f = tmp_path / "m34.py"  # a name that hashes into the held-out split
    f.write_text(SNIPPETS[0])
    assert corpus.is_heldout("m34.py")
    assert [d.name for d in corpus.user_documents([str(f)], "train")] == ["0:m34.py"]
    assert corpus.user_documents([str(f)], "heldout") == []


def test_benchmark_prompts_are_not_in_a_trained_copy_of_their_module():
    """The stdlib split is by path, and setuptools (trained on) carries copies of stdlib modules:
    two of the first twenty held-out prompts (distutils.fancy_getopt, importlib.metadata._adapters)
    ended in text the target had trained on."""
    from bench import prompts

    trained = prompts._trained_copies()
    if not trained:
        pytest.skip("none of the vendoring packages is installed")
    kept = prompts.heldout_prompts(24)
    assert kept and not any(p[-prompts.SEEN_CHARS:] in trained for p in kept)
    fancy = next((t for n, t in prompts.heldout_documents() if n == "distutils/fancy_getopt.py"), None)
    if fancy is not None and "fancy_getopt" in trained:  # the case found: its prompt is left out
        assert not any(p in fancy for p in kept)
    assert all(s[-prompts.SEEN_CHARS:] not in trained for s in prompts.stdlib_snippets(40, 400, 0))


def _save_llama(path: Path, tok, rows: int | None = None, hidden: int = 16, seed: int = 0):
    """A tiny random Llama with `tok` (and `rows` output rows, default the tokenizer's) saved in `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=rows or len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=128, bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def _quick(tdir, cdir, out, run, steps: int = 1) -> list[str]:
    return ["--target", str(tdir), "--corpus", str(cdir), "--out", str(out), "--run-dir", str(run), "--layers", "1",
            "--hidden", "16", "--heads", "2", "--intermediate", "32", "--seq-len", "16", "--batch-size", "2",
            "--steps", str(steps), "--threads", "1", "--verdict-prompts", "0"]


def _refusal(argv) -> str:
    """The one line distill.main exits with."""
    from train import distill

    with pytest.raises(SystemExit) as e:
        distill.main(argv)
    msg = e.value.code
    assert isinstance(msg, str) and msg.startswith("distill: ") and "\n" not in msg, msg
    return msg


def test_distill_refuses_to_resume_a_run_of_another_target_or_draft_shape(tmp_path, tiny_pair_inputs):
    """A re-run with another --target (or draft shape) resumed the checkpoint in the run dir, and
    exported a draft trained against the other target; another shape died in load_state_dict."""
    from transformers import AutoTokenizer

    from train import checkpoint, distill

    tdir, cdir, _ = tiny_pair_inputs
    out, run = tmp_path / "draft", tmp_path / "run"
    assert distill.main(_quick(tdir, cdir, out, run))["steps"] == 1
    weights = (out / "model.safetensors").read_bytes()
    msg = _refusal(_quick(tdir, cdir, out, run, 2)[:-8] + ["--hidden", "32", "--heads", "2", "--steps", "2", "--verdict-prompts", "0"])
    assert "--hidden 16 (now 32)" in msg and "--intermediate" not in msg and str(run) in msg and "--run-dir" in msg
    other = tmp_path / "other-target"
    _save_llama(other, AutoTokenizer.from_pretrained(tdir), hidden=32)
    msg = _refusal(_quick(other, cdir, out, run, 2))
    assert f"target {tdir.resolve()} (now {other.resolve()})" in msg and "config.json" in msg and "--hidden" not in msg
    assert (out / "model.safetensors").read_bytes() == weights and checkpoint.load(run)["step"] == 1
    # a checkpoint from before identities resumes as it did
    state = checkpoint.load(run)
    del state["extra"]["identity"]
    torch.save(state, run / checkpoint.CKPT_NAME)
    s = distill.main(_quick(tdir, cdir, out, run, 2))
    assert (s["resumed_from_step"], s["steps"]) == (1, 2) and checkpoint.load(run)["extra"]["identity"]["--hidden"] == 16


def test_distill_refuses_an_out_that_is_the_target_or_a_model_it_did_not_make(tmp_path, tiny_pair_inputs):
    """--out equal to --target overwrote the target's weights, then died in shutil.SameFileError."""
    tdir, cdir, _ = tiny_pair_inputs
    before = {f.name: f.read_bytes() for f in tdir.iterdir()}
    msg = _refusal(_quick(tdir, cdir, tdir, tmp_path / "run"))
    assert "is the --target directory" in msg
    assert {f.name: f.read_bytes() for f in tdir.iterdir()} == before and not (tmp_path / "run").exists()
    other = tmp_path / "someone-elses"
    (other).mkdir()
    (other / "config.json").write_text("{}")
    msg = _refusal(_quick(tdir, cdir, other, tmp_path / "run"))
    assert "already holds a model" in msg and str(tmp_path / "run") in msg
    assert (other / "config.json").read_text() == "{}"


def test_distill_bad_input_exits_with_one_line(tmp_path, tiny_pair_inputs):
    """A --target that is no local directory (it even tried the Hub), one without a tokenizer,
    a missing corpus path, a package that is not installed and an empty corpus were tracebacks."""
    tdir, cdir, _ = tiny_pair_inputs
    out, run = tmp_path / "draft", tmp_path / "run"
    assert "not a local model directory" in _refusal(_quick(tmp_path / "nowhere", cdir, out, run))
    assert "not a local model directory" in _refusal(_quick("someone/some-model", cdir, out, run))
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((tdir / name).read_bytes())
    assert "no tokenizer loads from --target" in _refusal(_quick(bare, cdir, out, run))
    assert "no such file or directory" in _refusal(_quick(tdir, tmp_path / "missing.py", out, run))
    assert "no installed package" in _refusal(_quick(tdir, "package:no_such_package_here", out, run))
    assert "no installed package" in _refusal(_quick(tdir, "package:no_such_parent.child", out, run))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blob.bin").write_bytes(b"\x00\x01")
    assert "no text to train on" in _refusal(_quick(tdir, empty, out, run))
    assert not out.exists()


def test_a_single_module_package_is_a_corpus():
    """package:typing_extensions (one module, no package directory) was refused as not installed."""
    docs = corpus.documents(["package:typing_extensions"], "all")
    assert [d.name for d in docs] == ["typing_extensions/typing_extensions.py"] and "def " in docs[0].text
    assert corpus.source_files("package:typing_extensions")[0].name == "typing_extensions.py"


@pytest.mark.parametrize("flag,value", [("--steps", "0"), ("--max-minutes", "0"), ("--max-minutes", "-1"),
                                        ("--seq-len", "0"), ("--batch-size", "0"), ("--temperature", "0"),
                                        ("--verdict-prompts", "-1"), ("--layers", "0"), ("--hidden", "0"),
                                        ("--heads", "0"), ("--heads", "3")])
def test_distill_argument_ranges_are_argparse_errors(tmp_path, tiny_pair_inputs, capsys, flag, value):
    from train import distill

    tdir, cdir, _ = tiny_pair_inputs
    with pytest.raises(SystemExit) as e:
        distill.main(_quick(tdir, cdir, tmp_path / "draft", tmp_path / "run") + [flag, value])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err.splitlines()[-1]


def test_a_rerun_exports_the_checkpoint_an_interrupted_run_left(tmp_path, tiny_pair_inputs, monkeypatch):
    """An interrupted run checkpoints and exports nothing; a re-run with nothing left to train
    reported the checkpoint's step and loss but kept the older export."""
    from transformers import AutoModelForCausalLM

    from train import checkpoint, distill
    from train.data import WindowSampler

    tdir, cdir, _ = tiny_pair_inputs
    out, run = tmp_path / "draft", tmp_path / "run"
    assert distill.main(_quick(tdir, cdir, out, run, 1))["exported"]
    batch = WindowSampler.batch

    def interrupted(self, step):
        if step == 2:
            raise FloatingPointError("interrupted")
        return batch(self, step)

    monkeypatch.setattr(WindowSampler, "batch", interrupted)
    with pytest.raises(FloatingPointError):
        distill.main(_quick(tdir, cdir, out, run, 3))
    monkeypatch.setattr(WindowSampler, "batch", batch)
    assert checkpoint.load(run)["step"] == 2
    s = distill.main(_quick(tdir, cdir, out, run, 2))
    saved = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert torch.equal(saved["model.embed_tokens.weight"], checkpoint.load(run)["model"]["model.embed_tokens.weight"])
    assert s["steps_this_run"] == 0 and s["exported"] and s["exported_step"] == 2
    again = distill.main(_quick(tdir, cdir, out, run, 2))  # now nothing to do: the export is left as it is
    assert not again["exported"] and again["exported_step"] == 2


def test_ctrl_c_in_distill_checkpoints_and_says_so_in_one_line(tmp_path, tiny_pair_inputs, monkeypatch, capsys):
    """Ctrl-C during training ended in a KeyboardInterrupt traceback; the run keeps its checkpoint,
    says where in one line and exits 130, and the same command resumes from it."""
    from train import checkpoint, distill
    from train.data import WindowSampler

    tdir, cdir, _ = tiny_pair_inputs
    out, run = tmp_path / "draft", tmp_path / "run"
    batch = WindowSampler.batch

    def ctrl_c(self, step):
        if step == 2:
            raise KeyboardInterrupt
        return batch(self, step)

    monkeypatch.setattr(WindowSampler, "batch", ctrl_c)
    with pytest.raises(SystemExit) as e:
        distill.main(_quick(tdir, cdir, out, run, 4))
    assert e.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"distill: interrupted at step 2; the checkpoint in {run} keeps step 2: the same command resumes there"
    assert "Traceback" not in "\n".join(err) and checkpoint.load(run)["step"] == 2 and not (out / "config.json").exists()
    monkeypatch.setattr(WindowSampler, "batch", batch)
    s = distill.main(_quick(tdir, cdir, out, run, 4))
    assert s["resumed_from_step"] == 2 and s["steps"] == 4 and s["exported"]


def _evaluate_args(tdir, ddir, cdir) -> list[str]:
    return ["--target", str(tdir), "--draft", str(ddir), "--corpus", str(cdir), "--loss-seq-len", "64",
            "--loss-windows", "2", "--prompts", "2", "--prompt-len", "16", "--continuation", "4", "--batch", "2",
            "--code-tokens", "2", "--latency-steps", "2", "--latency-rounds", "1", "--threads", "1"]


def test_evaluate_falls_back_to_the_training_text_on_a_small_corpus(tmp_path, tiny_pair_inputs):
    """A corpus that holds nothing out (here: every held-out file is a copy of a trained one)
    crashed in ZeroDivisionError; it is measured on the end of the training text, and says so."""
    from transformers import AutoTokenizer

    from train import evaluate

    tdir, cdir, _ = tiny_pair_inputs
    _save_llama(tmp_path / "d", AutoTokenizer.from_pretrained(tdir))
    res = evaluate.main(_evaluate_args(tdir, tmp_path / "d", cdir))
    assert res["heldout_tokens"] == 0 and res["text"].startswith("the end of the training text (too little held out")
    assert res["heldout_loss_nats_per_token"]["tokens"] == 128 and res["greedy"]["positions"] == 8
    (tmp_path / "tiny.py").write_text("x = 1\n")
    with pytest.raises(SystemExit) as e:
        evaluate.main(_evaluate_args(tdir, tmp_path / "d", cdir) + ["--ood-corpus", str(tmp_path / "tiny.py")])
    assert str(e.value.code).startswith("evaluate: --ood-corpus") and "too few" in str(e.value.code)


def test_evaluate_pairs_a_draft_with_other_output_rows_and_refuses_another_vocabulary(tmp_path, tiny_pair_inputs):
    """The services pair a draft whose model has other output rows over the target's tokenizer;
    evaluate died in torch.minimum(ps, qs). A draft of another vocabulary is refused in one line."""
    from transformers import AutoTokenizer

    from train import evaluate

    tdir, cdir, target = tiny_pair_inputs
    tok = AutoTokenizer.from_pretrained(tdir)
    wide = _save_llama(tmp_path / "wide", tok, rows=len(tok) + 16)
    torch.manual_seed(0)
    prompts = torch.randint(3, len(tok), (2, 8))
    # q over the target's rows: the draft's extra rows cut, or (a draft with fewer rows) q = 0 on the target's extra rows
    for t, d in ((target.eval(), wide), (wide, target.eval())):
        t1 = evaluate.sampled_acceptance(t, d, prompts, gamma=2, batch=2, seed=0)
        assert 0.0 <= t1["beta_mean"] <= 1.0 + 1e-6
        assert 0.0 <= evaluate.greedy_acceptance(t, d, prompts, steps=3, batch=2)["alpha"] <= 1.0
    res = evaluate.main(_evaluate_args(tdir, tmp_path / "wide", cdir))
    assert 0.0 <= res["sampled_T1"]["beta_mean"] <= 1.0 + 1e-6 and 0.0 <= res["greedy"]["alpha"] <= 1.0
    _save_llama(tmp_path / "alien", train_tokenizer(SNIPPETS[:2] * 20, vocab_size=270, model_max_length=128))
    with pytest.raises(SystemExit) as e:
        evaluate.main(_evaluate_args(tdir, tmp_path / "alien", cdir))
    assert str(e.value.code).startswith("evaluate: the draft") and "does not pair" in str(e.value.code)
    assert "\n" not in str(e.value.code)


def test_evaluate_refuses_a_draft_without_tokenizer_files_in_one_line(tmp_path, tiny_pair_inputs):
    """A draft directory without tokenizer files (a bare export) ended evaluate in a transformers
    traceback; it is refused, naming the flag, as the services refuse it."""
    from transformers import AutoTokenizer

    from train import evaluate

    tdir, cdir, _ = tiny_pair_inputs
    _save_llama(tmp_path / "bare", AutoTokenizer.from_pretrained(tdir))
    for name in os.listdir(tmp_path / "bare"):
        if "token" in name:
            os.remove(tmp_path / "bare" / name)
    assert sorted(os.listdir(tmp_path / "bare")) == ["config.json", "generation_config.json", "model.safetensors"]
    for args, start, reason in ((_evaluate_args(tdir, tmp_path / "bare", cdir), "evaluate: --draft ", "no tokenizer files"),
                                (_evaluate_args(tmp_path / "nowhere", tdir, cdir), "evaluate: --target ", "no such directory")):
        with pytest.raises(SystemExit) as e:
            evaluate.main(args)
        msg = str(e.value.code)
        assert msg.startswith(start) and reason in msg and "\n" not in msg, msg


def test_verdict_leaves_out_held_out_copies_of_trained_files(tmp_path, tiny_pair_inputs):
    """measure called held-out documents identical to trained ones "held-out files"."""
    from transformers import AutoTokenizer

    from train import verdict
    from train.data import corpus_tokens

    tdir, _, target = tiny_pair_inputs
    tok = AutoTokenizer.from_pretrained(tdir)
    src = tmp_path / "src"
    src.mkdir()
    text = "".join(SNIPPETS) * 3
    (src / "m34.py").write_text(text)  # held out by its name ...
    (src / "a.py").write_text(text)  # ... and a copy trained on
    (src / "b.py").write_text(SNIPPETS[0] * 5)
    assert corpus.is_heldout("m34.py") and not corpus.is_heldout("a.py") and not corpus.is_heldout("b.py")
    train_tokens, _ = corpus_tokens(tok, [str(src)], "train", workers=1)
    draft = _save_llama(tmp_path / "d", tok)
    v = verdict.measure(target.eval(), draft, tok, [str(src)], train_tokens, prompts=2, prompt_len=8, continuation=4,
                        latency_rounds=1, latency_steps=2)
    assert v["text"].startswith("the end of the training text")


def test_distill_warns_when_its_loss_would_not_fit_in_memory(monkeypatch, capsys):
    """The loss holds several float32 tensors of the logits' size: a large vocabulary at the
    default batch (16 x 256 x 151,936: about 16 GiB) ran out of memory with no word; now a warning
    names the size and a batch that fits, and says nothing where the memory is there."""
    from train import distill

    monkeypatch.setattr(distill, "available_memory_bytes", lambda device: 8 << 30)
    distill.warn_loss_memory(16, 256, 151_936, "cpu")
    out = capsys.readouterr().out
    assert "WARNING: the loss needs about 16.2 GiB" in out and "8.0 GiB is free: --batch-size 3 would fit" in out, out
    distill.warn_loss_memory(1, 8192, 151_936, "cpu")  # 32.5 GiB at batch 1
    assert "even --batch-size 1 would not: a shorter --seq-len too" in capsys.readouterr().out
    distill.warn_loss_memory(16, 256, 8192, "cpu")
    assert capsys.readouterr().out == ""


def test_a_draft_for_a_multimodal_or_rope_scaled_target_takes_its_language_models_fields():
    """From a review: draft_config read the top level of the target's config, so a Gemma 3
    *ForConditionalGeneration target (its vocabulary and ids in text_config) crashed distill, and
    a YaRN-scaled target's draft cut the pair's context to the unscaled limit."""
    from transformers import Gemma3Config, Gemma3TextConfig, LlamaConfig, SiglipVisionConfig

    from train.architecture import draft_config

    text = Gemma3TextConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, max_position_embeddings=96, eos_token_id=[1, 5], pad_token_id=0)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                                patch_size=8)
    mm = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299, boi_token_index=297,
                      eoi_token_index=298)
    cfg = draft_config(mm, hidden=16, layers=1, heads=2, intermediate=32, tie=True)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.eos_token_id, cfg.pad_token_id) == (300, 96, [1, 5], 0)
    assert draft_config(mm, hidden=16, layers=1, heads=2, intermediate=32, tie=True, rows=320).vocab_size == 320
    yarn = LlamaConfig(vocab_size=64, max_position_embeddings=64,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    assert draft_config(yarn, hidden=16, layers=1, heads=2, intermediate=32, tie=True).max_position_embeddings == 256


def test_train_pairs_drafts_as_the_services_do(tmp_path):
    """From a review: train's pair check was the fingerprint alone, so evaluate refused a draft
    the services pair (special-token roles only) and measured one they refuse (a tokenizer that
    lowercases: other ids for the same text). It is the services' rule now."""
    from train.pairing import check_pair

    tok = _tiny_tokenizer()
    target = tmp_path / "t"
    tok.save_pretrained(target)
    roles = tmp_path / "roles"
    tok.save_pretrained(roles)
    config = roles / "tokenizer_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), eos_token=tok.pad_token)))
    got = check_pair(tok, len(tok), roles, len(tok))
    assert got["match"] and got["paired_by"] == "roles", got
    lower = tmp_path / "lower"
    tok.save_pretrained(lower)
    spec = json.loads((lower / "tokenizer.json").read_text())
    (lower / "tokenizer.json").write_text(json.dumps(dict(spec, normalizer={"type": "Lowercase"})))
    got = check_pair(tok, len(tok), lower, len(tok))
    assert not got["match"] and "turns text into ids differently" in got["problem"], got


def test_distill_init_from_is_checked_and_a_reexport_leaves_no_stale_weights(tmp_path, tiny_pair_inputs):
    """From a review: --init-from dropped the shape flags in silence, loaded any directory (a
    Qwen2 one as Llama, its biases dropped; a missing one in a traceback after tokenizing the
    corpus); and a re-export left the last export's weights file beside the new ones, which
    transformers loads first."""
    from train import distill

    tdir, cdir, _ = tiny_pair_inputs
    out, run = tmp_path / "draft", tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        distill.main(["--target", str(tdir), "--corpus", str(cdir), "--out", str(out), "--init-from", str(tdir), "--layers", "2"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        distill.main(["--target", str(tdir), "--corpus", str(cdir), "--out", str(out), "--init-from", str(tmp_path / "nowhere")])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        distill.main(["--target", str(tdir), "--corpus", str(cdir), "--out", str(out), "--device", "gpu"])
    assert e.value.code == 2
    other = tmp_path / "other-rows"
    _save_llama(other, _tiny_tokenizer(), rows=len(_tiny_tokenizer()) + 8)
    quick = ["--target", str(tdir), "--corpus", str(cdir), "--out", str(out), "--run-dir", str(run), "--seq-len", "16",
             "--batch-size", "2", "--steps", "1", "--threads", "1", "--verdict-prompts", "0"]  # _quick without the shape flags
    assert "output rows" in _refusal([*quick, "--init-from", str(other)])
    distill.main(_quick(tdir, cdir, out, run))
    stale = out / "model-00001-of-00009.safetensors"  # what a sharded export before this one would have left
    stale.write_bytes((out / "model.safetensors").read_bytes())
    (out / "pytorch_model.bin").write_bytes(b"stale")
    distill.main(_quick(tdir, cdir, out, run, steps=2))
    assert not stale.exists() and not (out / "pytorch_model.bin").exists()


def test_a_resumed_run_counts_the_tokens_each_run_trained(tmp_path):
    """From a review: `tokens` was steps x this run's batch, so a resume with another --batch-size
    rewrote the whole history (2 steps of 1 x 16 then 1 of 4 x 16 read 192 tokens, not 96)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from train import loop

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))

    def batches(n):
        return lambda step: torch.randint(0, 32, (n, 17))

    def loss(m, batch):
        out = m(input_ids=batch[:, :-1], labels=batch[:, :-1])
        return out.loss, {}

    cfg = dict(run_dir=tmp_path / "run", lr=1e-3, warmup_steps=0, bf16=False, checkpoint_minutes=60.0)
    first = loop.run(model, batches(1), loss, loop.LoopConfig(max_steps=2, **cfg))
    second = loop.run(model, batches(4), loss, loop.LoopConfig(max_steps=3, **cfg))
    assert (first["tokens"], second["tokens"], second["tokens_this_run"]) == (32, 96, 64)


def test_evaluate_says_in_one_line_that_a_corpus_names_nothing(tmp_path, tiny_pair_inputs):
    """From a review: a missing --corpus path, or an --ood-corpus package that is not installed,
    was a traceback, the second after the whole measurement had run."""
    from train import evaluate

    tdir, cdir, _ = tiny_pair_inputs
    for extra, says in ((["--corpus", str(tmp_path / "nowhere")], "evaluate: --corpus"),
                        (["--corpus", str(cdir), "--ood-corpus", "package:no_such_package_here"], "evaluate: --ood-corpus")):
        with pytest.raises(SystemExit) as e:
            evaluate.main(["--target", str(tdir), "--draft", str(tdir), *extra])
        assert isinstance(e.value.code, str) and e.value.code.startswith(says) and "\n" not in e.value.code, e.value.code


def test_a_file_distill_trains_on_is_never_held_out_beside_other_corpus_arguments(tmp_path, tiny_pair_inputs):
    """From a review: a one-file --corpus argument whose file hashes into the held-out split is
    trained on whole (distill tokenizes an argument at a time), but the verdict and evaluate,
    splitting all arguments together, held it out: a trained file measured as unseen."""
    from train import corpus

    _, cdir, _ = tiny_pair_inputs
    for i in range(200):  # a file name the split holds out
        single = tmp_path / f"more{i}.py"
        single.write_text("def more():\n    return 1\n")
        if not corpus.select_documents(tmp_path, [single.name], "train"):
            break
        single.unlink()
    else:
        pytest.fail("no name hashed into the held-out split")
    assert [d.text for d in corpus.documents([str(single)], "train")] == [single.read_text()]  # trained whole, alone
    held = corpus.documents([str(cdir), str(single)], "heldout")
    assert not [d for d in held if d.name.startswith("1:")], [d.name for d in held]
