"""The demo: both services on the shipped model pair, a streamed greedy code completion, its stats,
a seeded sampled completion beside it, and the speed-up measured in the same run against
transformers' own generate() (in-process, the services' dtype, one thread), with the verify
service's target-only path beside it.

    python -m bench.demo [--target DIR --draft DIR --prompt TEXT --max-new-tokens N --tau T]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from bench.cli import add_pair_args
from client import Client
from bench.launch import ENV, StartFailed, start_pair

# Ends at the end of a line, without its newline: the shipped tokenizer merges a newline with the
# next line's indentation (bench/prompts.py, CODE_PROMPTS).
PROMPT = '''import os


def walk_python_files(root):
    """Yield the path of every .py file under root."""'''


def tiny_pair(path: str) -> tuple[str, str]:
    """Random tiny models, for when the shipped pair is missing (output is gibberish)."""
    from bench import tinymodels  # needs only what the services need

    return tinymodels.build(os.path.join(path, "target"), seed=0, hidden=256, layers=6, sharpen=4.0, max_context=2048), \
        tinymodels.build(os.path.join(path, "draft"), seed=1, hidden=32, layers=1, sharpen=4.0, max_context=2048)


def hf_generate(path: str, dtype: str, ids: list[int], n: int) -> tuple[list[int], float]:
    """transformers' generate(), in this process, greedy: (new ids, seconds)."""
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    x = torch.tensor([ids])
    kw = dict(do_sample=False, attention_mask=torch.ones_like(x), pad_token_id=model.config.pad_token_id or 0)
    with torch.inference_mode():
        model.generate(x, max_new_tokens=8, **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=n, **kw)[0, len(ids):].tolist()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.demo")
    add_pair_args(p, out=False)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tau", type=int, default=0,
                   help="fixed draft tokens per round (default: the service's default, adaptive tau with pre-drafting)")
    a = p.parse_args(argv)
    tmp = None
    if not (os.path.isdir(a.target) and os.path.isdir(a.draft)):
        tmp = tempfile.mkdtemp(prefix="specdec-demo-")
        print(f"[demo] shipped models not found; using random tiny models built in {tmp}", file=sys.stderr)
        a.target, a.draft = tiny_pair(tmp)
    env = dict(ENV, OMP_NUM_THREADS="1")  # the two services share this machine's cores: one thread each
    print("[demo] starting verify_service (target) and draft_service (draft) ...", file=sys.stderr)
    try:  # both started together, and both stopped where either fails to start (start_pair)
        verify, draft = start_pair(("--model", a.target, "--threads", "1"),
                                   ("--model", a.draft, "--threads", "1", "--http-port", "0"), env=env)
    except StartFailed as e:  # a service that did not start: its own one line, not a traceback
        print(f"[demo] a service did not start: {e.last_line()}", file=sys.stderr)
        return 2
    print(f"[demo] draft: gRPC on {draft.address}, OpenAI-compatible HTTP on http://{draft.http_address}/v1", file=sys.stderr)
    try:
        policy = dict(num_draft_tokens=a.tau, adaptive=False) if a.tau else {}  # else the service's defaults
        params = dict(prompt=a.prompt, max_new_tokens=a.max_new_tokens, **policy)
        with Client(draft.address, timeout=600) as spec, Client(verify.address, target_only=True, timeout=600) as base:
            info = base.info()
            spec.generate(**dict(params, max_new_tokens=8))  # warm-up: first calls pay one-off costs
            base.generate(prompt=a.prompt, max_new_tokens=8)
            print(f"\n--- prompt ---\n{a.prompt}\n--- speculative completion, greedy (streamed) ---", flush=True)
            ids, last, texts = [], None, []
            t0 = time.perf_counter()
            for chunk in spec.stream(**params):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                ids += chunk.token_ids
                texts.append(chunk.text)
                last = chunk
            spec_s = time.perf_counter() - t0
            base_r = base.generate(prompt=a.prompt, max_new_tokens=a.max_new_tokens)
            http_text = _http_completion(draft.http_address, os.path.basename(os.path.normpath(a.target)), dict(
                prompt=a.prompt, max_tokens=a.max_new_tokens, temperature=0, **policy))
            # fixed tau: with adaptive tau the rounds follow costs measured at start-up, and another cut into rounds
            # is another (equally exact) sample; a fixed tau replays the same text on every run (DESIGN.md §3)
            sampled = spec.generate(**dict(params, temperature=0.8, top_p=0.95, seed=7, num_draft_tokens=a.tau or 4, adaptive=False))
            print(f"\n--- speculative completion, sampled (temperature 0.8, top-p 0.95, seed 7, tau {a.tau or 4}) ---\n{sampled.text}",
                  flush=True)
        hf_ids, hf_s = hf_generate(a.target, info.dtype, _prompt_ids(a.target, a.prompt), a.max_new_tokens)
        s = last.stats
        print("\n--- stats ---")
        print(f"tokens {len(ids)}  rounds {s.rounds}  drafted {s.drafted}  accepted {s.accepted}  "
              f"acceptance {s.acceptance_rate:.2f}  tokens/round {len(ids) / max(s.rounds, 1):.2f}")
        print(f"accepted per position {list(s.accepted_per_position)}")
        print(f"time: draft {s.draft_s:.2f}s  verify {s.verify_s:.2f}s (target forward {s.verify_forward_s:.2f}s)  wall {spec_s:.2f}s")
        spec_tps = len(ids) / spec_s
        base_tps = len(base_r.token_ids) / base_r.stats["wall_s"]
        hf_tps = len(hf_ids) / hf_s
        # the contract: speculative == the same service's target-only, bitwise; and == generate() in
        # float32 (in bfloat16 generate() rounds differently, so near-ties may flip: DESIGN.md §9)
        ok = base_r.token_ids == ids and (hf_ids == ids or info.dtype != "float32")
        print(f"models in {info.dtype} on {info.device}, one torch thread per process")
        print(f"speculative {spec_tps:.1f} tok/s  vs  transformers generate() {hf_tps:.1f} tok/s  ->  {spec_tps / hf_tps:.2f}x")
        print(f"(verify service target-only {base_tps:.1f} tok/s = {base_tps / hf_tps:.2f}x generate(); greedy speculative "
              f"{'==' if base_r.token_ids == ids else '!='} target-only {'==' if hf_ids == ids else '!='} generate()"
              f"{'' if ok else ': DIFFERENT (bug!)'})")
        same = http_text == "".join(texts)
        print(f"HTTP: the same request to http://{draft.http_address}/v1/completions gave "
              f"{'the same text' if same else 'DIFFERENT text (bug!)'} (the OpenAI-compatible API: README, \"HTTP API\")")
        return 0 if ok and same else 1
    finally:
        draft.stop()
        verify.stop()


def _http_completion(address: str, model: str, body: dict) -> str:
    """The text of one POST /v1/completions to the draft's HTTP front door."""
    import json  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    req = urllib.request.Request(f"http://{address}/v1/completions", data=json.dumps(dict(body, model=model)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["text"]


def _prompt_ids(path: str, prompt: str) -> list[int]:
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(path)(prompt).input_ids


if __name__ == "__main__":
    sys.exit(main())
