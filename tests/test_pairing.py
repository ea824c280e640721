"""Bring your own model pair (issue 28): distill a draft for a target of another model type, check
the pair, serve it; a fingerprint mismatch says what differs; a draft that does not pay is
dropped for target-only rounds; prompts get the tokenizer's BOS unless a request opts out."""
import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from bench import tinymodels
from bench.launch import ENV, ROOT, Service, service_pair
from client import Client
from helpers import metric

SHIPPED = Path(ROOT) / "models" / "stdlib-code-target"  # its tokenizer files (8192 tokens, TokenizersBackend)
FALLBACK_ENV = dict(ENV, SPECDEC_DRAFT_FALLBACK="1")
COSTS = ("--costs-ms", "1.0,3.0,0.2")  # pinned: the fallback decision depends on acceptance alone


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory):
    """A tiny random Qwen2 target with the shipped tokenizer files, and a draft distilled from it."""
    root = tmp_path_factory.mktemp("byo")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False)
    target = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # peaked next-token distributions: greedy ties are unlikely
    tdir, cdir, out, run = root / "target", root / "corpus", root / "draft", root / "run"
    target.save_pretrained(tdir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED / name, tdir / name)
    cdir.mkdir()
    for i in range(24):
        (cdir / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i % 5}\n" * 20)
    from train import distill

    argv = ["--target", str(tdir), "--corpus", str(cdir), "--out", str(out), "--run-dir", str(run), "--layers", "1",
            "--hidden", "16", "--heads", "2", "--intermediate", "32", "--seq-len", "32", "--batch-size", "2",
            "--warmup", "1", "--no-bf16"]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        summary = distill.main(argv + ["--steps", "3", "--verdict-prompts", "4"])
    return dict(target=tdir, draft=out, run=run, argv=argv, summary=summary, model=target.eval(), printed=printed.getvalue())


def test_distilled_draft_for_a_qwen2_target_pairs_and_serves_greedy_exactly(qwen_pair):
    s = qwen_pair["summary"]
    # transformers loads the Qwen2 target's tokenizer as a Qwen2Tokenizer with 8193 tokens; the
    # Llama draft's must load the same way, not as its model type's default
    assert s["match"] and s["target_fingerprint"] == s["draft_fingerprint"]
    assert s["tokenizer_class"] == s["draft_tokenizer_class"] == "Qwen2Tokenizer"
    assert len(AutoTokenizer.from_pretrained(qwen_pair["draft"])) == len(AutoTokenizer.from_pretrained(qwen_pair["target"])) == 8193
    v = s["verdict"]
    assert 0 <= v["alpha"] <= 1 and v["c"] > 0 and v["speedup"] > 0 and v["prompts"] == 4
    out = qwen_pair["printed"]
    assert "verdict: greedy acceptance" in out and f"--model {qwen_pair['draft']}" in out and "python -m verify_service" in out
    tok = AutoTokenizer.from_pretrained(qwen_pair["target"])
    prompt = "def f3(x):\n    return"
    ids = tok(prompt)["input_ids"]
    expected = hf_greedy(qwen_pair["model"], ids, 12)
    with service_pair(str(qwen_pair["target"]), str(qwen_pair["draft"])) as (vs, ds):  # starts: the draft is accepted
        with Client(ds.address, timeout=60) as c:
            r = c.generate(prompt=prompt, max_new_tokens=12)
            assert r.token_ids == expected and r.stats["drafted"] > 0 and len(set(expected)) > 2
            assert c.generate(prompt_ids=ids, max_new_tokens=12).token_ids == expected
        with Client(vs.address, target_only=True, timeout=60) as c:
            assert c.generate(prompt=prompt, max_new_tokens=12).token_ids == expected


def test_a_rerun_that_trains_nothing_keeps_the_export(qwen_pair, capsys):
    from train import distill

    weights = qwen_pair["draft"] / "model.safetensors"
    before = weights.read_bytes()
    s = distill.main(qwen_pair["argv"] + ["--steps", "3", "--verdict-prompts", "0"])  # the same command again
    assert s["steps"] == 3 and s["steps_this_run"] == 0 and s["resumed_from_step"] == 3
    assert not s["exported"] and weights.read_bytes() == before
    assert s["final_loss"] is not None and s["tokens"] > 0 and s["match"]
    assert "nothing to train" in capsys.readouterr().out
    # a larger --steps continues from step 3 and exports what it trained
    s = distill.main(qwen_pair["argv"] + ["--steps", "5", "--verdict-prompts", "0"])
    assert (s["resumed_from_step"], s["steps"], s["steps_this_run"], s["exported"]) == (3, 5, 2, True)
    assert weights.read_bytes() != before


def test_fingerprint_mismatch_says_what_differs(qwen_pair, tmp_path):
    """The bug the issue found: the target's tokenizer files copied verbatim, so the Llama draft's
    tokenizer loads as another class, without the Qwen2 tokenizer's added unknown token."""
    bad = tmp_path / "bad-draft"
    shutil.copytree(qwen_pair["draft"], bad)
    shutil.copy(SHIPPED / "tokenizer_config.json", bad / "tokenizer_config.json")
    v = Service("verify_service", "--model", str(qwen_pair["target"]))
    try:
        r = subprocess.run([sys.executable, "-m", "draft_service", "--model", str(bad), "--verify", v.address, "--port", "0"],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    finally:
        v.stop()
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "do not share a tokenizer" in line
    assert "vocabulary sizes: target 8193 tokens (8192 output rows), draft 8192 tokens (8192 output rows)" in line
    assert "first differing ids: 8192 (target '<|endoftext|>', draft none)" in line
    assert "unk target <|endoftext|>=8192, draft none" in line
    assert "tokenizer classes: target Qwen2Tokenizer, draft TokenizersBackend" in line


@pytest.mark.parametrize("change,says", [
    (dict(normalizer={"type": "Lowercase"}), "normalizers, pre-tokenizers, merges"),
    (dict(post_processor=None), "adds special tokens (such as BOS) to a prompt and the draft's does not"),
])
def test_a_draft_whose_tokenizer_reads_text_otherwise_is_refused(tmp_path, change, says):
    """Same vocabulary and special ids (so the same fingerprint), but a tokenizer that lowercases,
    or adds no BOS: the draft tokenizes text prompts and decodes the output, so the pair served
    another tokenization than the target's (a prompt with "W5" gave other tokens), and was taken."""
    target = tinymodels.build(str(tmp_path / "t"), vocab_size=16, seed=1, bos=True)
    draft = tinymodels.build(str(tmp_path / "d"), vocab_size=16, seed=2, bos=True)
    spec = json.loads((tmp_path / "d" / "tokenizer.json").read_text())
    (tmp_path / "d" / "tokenizer.json").write_text(json.dumps(dict(spec, **change)))
    v = Service("verify_service", "--model", target)
    try:
        r = subprocess.run([sys.executable, "-m", "draft_service", "--model", draft, "--verify", v.address, "--port", "0", "--log-level", "WARNING"],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    finally:
        v.stop()
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "turns text into ids differently" in lines[0] and says in lines[0], lines[0]


def _fallback_run(v, draft_dir, prompt, n):
    d = Service("draft_service", "--model", draft_dir, "--verify", v.address, "--metrics-port", "0", *COSTS, env=FALLBACK_ENV)
    try:
        with Client(d.address, timeout=60) as c:
            runs = [c.generate(prompt_ids=prompt, max_new_tokens=n, num_draft_tokens=4) for _ in range(3)]
        return runs, d.metrics(), "".join(d.stderr)
    finally:
        d.stop()


def test_a_useless_draft_falls_back_to_target_only_rounds(model_dir):
    target, useless = model_dir("long-target"), model_dir("long-draft")
    prompt, n = [3, 4, 5, 6], 60
    v = Service("verify_service", "--model", target)
    try:
        with Client(v.address, target_only=True, timeout=60) as c:
            expected = c.generate(prompt_ids=prompt, max_new_tokens=n).token_ids
        runs, text, log = _fallback_run(v, useless, prompt, n)
        for r in runs:
            assert r.token_ids == expected  # proposal-free rounds stay exact
            assert r.stats["acceptance_rate"] < 0.3
            assert r.stats["fallback_rounds"] > 20 and r.stats["drafted"] <= 4 * 4  # four model rounds, then none
            # the rest is one run of target-only steps on the verifier (Round.target_only_steps), not a round per token
            assert r.stats["run_steps"] == r.stats["fallback_rounds"] == r.stats["target_only_rounds"] > 20
        # two sessions in a row fell back: the third starts without the model (adaptive.ModelRecord), one run from the start
        assert [r.stats.get("drafted", 0) > 0 for r in runs] == [True, True, False]
        assert runs[2].stats["run_steps"] == runs[2].stats["rounds"] and not runs[2].stats.get("prefill_s")
        assert metric(text, "specdec_draft_fallback_sessions_total", model="long-draft") == 3
        assert log.count("the draft model does not pay") == 1  # one warning per model
        # a draft that always agrees (the target itself) keeps drafting
        runs, text, _ = _fallback_run(v, target, prompt, n)
        assert all(r.token_ids == expected and not r.stats.get("fallback_rounds") for r in runs)
        assert metric(text, "specdec_draft_fallback_sessions_total", model="long-target") == 0
    finally:
        v.stop()


def test_prompts_get_the_tokenizers_bos_unless_the_request_opts_out(tmp_path):
    path = tinymodels.build(str(tmp_path / "bos-model"), seed=5, sharpen=4.0, bos=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = "w4 w5 w6"
    with_bos, without = [3, 4, 5, 6], [4, 5, 6]
    assert AutoTokenizer.from_pretrained(path)(text)["input_ids"] == with_bos
    with service_pair(path, path) as (v, d):
        for address, target_only in ((d.address, False), (v.address, True)):
            with Client(address, target_only=target_only, timeout=60) as c:
                r = c.generate(prompt=text, max_new_tokens=8)
                assert r.stats["prompt_tokens"] == 4 and r.token_ids == hf_greedy(model, with_bos, 8)
                r = c.generate(prompt=text, max_new_tokens=8, add_special_tokens=False)
                assert r.stats["prompt_tokens"] == 3 and r.token_ids == hf_greedy(model, without, 8)
        cli = [sys.executable, "-m", "client", "generate", "--server", d.address, "--prompt", text, "--max-new-tokens", "4", "--json"]
        for flag, n in (([], 4), (["--no-add-special-tokens"], 3)):
            r = subprocess.run(cli + flag, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["stats"]["prompt_tokens"] == n


def _rows(src: str, dst, rows: int, wins: int | None = None) -> str:
    """A copy of the model at `src` with `rows` output rows (and embeddings) over the same tokenizer;
    with `wins`, its last row is twice that token's, so it comes out where that token would."""
    model = AutoModelForCausalLM.from_pretrained(src)
    model.resize_token_embeddings(rows)
    if wins is not None:
        with torch.no_grad():
            head = model.get_output_embeddings().weight
            head[rows - 1] = 2 * head[wins]
    model.save_pretrained(dst)
    for f in Path(src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, Path(dst) / f.name)
    return str(dst)


@pytest.mark.parametrize("more", ["draft", "target"])
def test_a_pair_whose_models_have_other_output_rows_over_one_tokenizer_serves_exactly(model_dir, tmp_path, more):
    """From a review: the vocabulary fingerprint counts a model's output rows, so a draft and a
    target over one tokenizer with other row counts (Qwen2.5's 0.5B has 151,936, its 7B 152,064)
    were refused as "do not share a tokenizer". They pair now: the draft sends q over the target's
    rows (its own extra rows cut, the target's padded with none of its mass) and feeds an id past
    its own rows to its model as 0. Greedy output is the target's own, and sampled DENSE rounds
    (q over the target's rows, checked by it) run."""
    target = draft = model_dir("target")  # the target as its own draft: where the rows agree, every proposal is accepted
    rows = AutoModelForCausalLM.from_pretrained(target).get_output_embeddings().weight.shape[0]
    if more == "draft":
        draft = _rows(draft, tmp_path / "draft-more-rows", rows + 8)
    prompts = [[3, 4, 5], [5, 6, 7, 3], [9, 3, 4]]
    if more == "target":  # one of its padding rows wins where the target's first greedy token would: an id past the draft's rows
        first = hf_greedy(AutoModelForCausalLM.from_pretrained(target), prompts[0], 1)[0]
        target = _rows(target, tmp_path / "target-more-rows", rows + 8, wins=first)
    with service_pair(target, draft) as (vs, ds):  # starts: the pair is accepted
        with Client(vs.address, target_only=True, timeout=60) as vc:
            want = [vc.generate(prompt_ids=p, max_new_tokens=24).token_ids for p in prompts]
        if more == "target":
            assert rows + 7 in want[0], want[0]  # the draft is fed an id it has no row for
        with Client(ds.address, timeout=60) as c:
            got = [c.generate(prompt_ids=p, max_new_tokens=24, num_draft_tokens=3, adaptive=False) for p in prompts]
            dense = c.generate(prompt_ids=prompts[0], max_new_tokens=16, temperature=1.0, seed=3, proposal_mode="dense",
                               num_draft_tokens=3, adaptive=False)
    assert [r.token_ids for r in got] == want
    assert sum(r.stats["drafted"] for r in got) > 0 and sum(r.stats["accepted"] for r in got) > 0
    assert dense.token_ids and dense.stats["drafted"] > 0


def test_a_draft_whose_tokenizer_differs_in_special_roles_only_pairs(tmp_path):
    """From a review: the fingerprint counts which id each special role names, so a base draft
    beside its instruct target (Qwen2.5's and Llama-3's EOS differ between the two; a fine-tune's
    added pad token too) was refused as "not sharing a tokenizer", though they share every token
    and id and turn text into ids alike, and nothing on the draft's side reads those roles. The
    draft pairs (taking the target's fingerprint) and serves the target's greedy tokens."""
    target = tinymodels.build(str(tmp_path / "t"), vocab_size=16, seed=1, bos=True)
    draft = tinymodels.build(str(tmp_path / "d"), vocab_size=16, seed=2, bos=True)
    config = tmp_path / "d" / "tokenizer_config.json"
    spec = json.loads(config.read_text())
    config.write_text(json.dumps(dict(spec, eos_token="<pad>")))  # the draft's EOS: another special token
    v = Service("verify_service", "--model", target)
    d = None
    try:
        d = Service("draft_service", "--model", draft, "--verify", v.address, "--log-level", "INFO")
        with Client(v.address, target_only=True, timeout=60) as vc, Client(d.address, timeout=60) as dc:
            want = vc.generate(prompt="w5 w6 w7", max_new_tokens=12).token_ids
            got = dc.generate(prompt="w5 w6 w7", max_new_tokens=12, num_draft_tokens=3, adaptive=False)
        assert got.token_ids == want and got.stats["drafted"] > 0
        assert any("special tokens' roles only" in line and "eos target <eos>=0, draft <pad>=1" in line for line in d.stderr), d.stderr
    finally:
        if d is not None:
            d.stop()
        v.stop()


def test_a_draft_whose_chat_template_differs_from_the_targets_warns_where_it_renders_chats(tmp_path):
    """From a review: the HTTP front door renders chats with the draft's tokenizer's template, and
    a draft with another template than the target's paired in silence (the target then read
    prompts in a format it was not tuned on). The verify service now reports a digest of its
    template; the draft warns at start-up where it serves HTTP without --chat-template."""
    target = tinymodels.build(str(tmp_path / "t"), vocab_size=16, seed=1, chat_template="{% for m in messages %}w5 {{ m['content'] }}{% endfor %}")
    draft = tinymodels.build(str(tmp_path / "d"), vocab_size=16, seed=2, chat_template="{% for m in messages %}w6 {{ m['content'] }}{% endfor %}")
    template = tmp_path / "target.jinja"
    template.write_text("{% for m in messages %}w5 {{ m['content'] }}{% endfor %}")
    v = Service("verify_service", "--model", target)
    try:
        for extra, warns in (([], True), (["--chat-template", str(template)], False)):
            d = Service("draft_service", "--model", draft, "--verify", v.address, "--http-port", "0", *extra)
            d.stop()
            said = any("chat template differs from the draft's" in line for line in d.stderr)
            assert said == warns, (extra, d.stderr)
    finally:
        v.stop()
