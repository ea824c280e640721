"""The engine against what a user would otherwise run: transformers' own generate(), in-process,
same dtype, one torch thread, same prompts (code from outside the standard library), greedy.

    python -m bench.engine [--dtypes float32,bfloat16 --max-new-tokens 128 --repeats 2 --out bench/results]

Per dtype, in one run and in alternating order (so machine noise hits all alike):
  generate()            transformers, in-process (the baseline every ratio divides by)
  assisted              transformers' assisted generation with the draft (assistant_model=)
  prompt lookup         transformers' prompt_lookup_num_tokens=8
  service target-only   the verify service's Generate through gRPC
  service speculative   both services at their default settings (draft -> verify over loopback)
and the per-round overhead of the services (wall time per round not spent in the target's pass
or the draft's steps), on the shipped pair and on tiny models where the models cost ~nothing.
Checks that every greedy output equals generate()'s. Writes ENGINE.md and engine.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.testing.launch import ENV, ROOT, Service
from client import Client

# code from outside the standard library, written for this benchmark
PROMPTS = [
    "import numpy as np\n\n\ndef moving_average(x, window):\n    \"\"\"Mean of each window of x.\"\"\"\n",
    "from flask import Flask, jsonify, request\n\napp = Flask(__name__)\n\n\n@app.route('/users/<int:user_id>')\ndef get_user(user_id):\n",
    "import torch\nimport torch.nn as nn\n\n\nclass MLP(nn.Module):\n    def __init__(self, dim, hidden):\n        super().__init__()\n",
    "import requests\n\n\ndef fetch_json(url, retries=3, timeout=5.0):\n    for attempt in range(retries):\n",
]


def hf_runs(target: str, draft: str, dtype: str, n: int) -> dict:
    """tokens/s and outputs of the in-process transformers baselines."""
    dt = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(target)
    t = AutoModelForCausalLM.from_pretrained(target, dtype=dt).eval()
    d = AutoModelForCausalLM.from_pretrained(draft, dtype=dt).eval()
    out: dict = {"generate": [], "assisted": [], "prompt lookup": [], "ids": []}
    with torch.inference_mode():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            kw = dict(max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=tok.pad_token_id)
            for name, extra in [("generate", {}), ("assisted", dict(assistant_model=d)), ("prompt lookup", dict(prompt_lookup_num_tokens=8))]:
                t0 = time.perf_counter()
                o = t.generate(ids, **kw, **extra)[0, ids.shape[1]:].tolist()
                out[name].append((len(o), time.perf_counter() - t0))
                if name == "generate":
                    out["ids"].append(o)
    return out


def service_runs(target: str, draft: str, dtype: str, n: int) -> dict:
    env = dict(ENV, SPECDEC_DTYPE=dtype)
    v = Service("verify_service", "--model", target, "--threads", "1", env=env)
    d = Service("draft_service", "--model", draft, "--verify", v.address, "--threads", "1", env=env)
    out: dict = {"target-only": [], "speculative": [], "ids_target": [], "ids_spec": [], "overhead_ms": []}
    try:
        tok = AutoTokenizer.from_pretrained(target)
        with Client(v.address, timeout=300, target_only=True) as cv, Client(d.address, timeout=300) as cd:
            for p in PROMPTS:
                ids = tok(p).input_ids
                cv.generate(prompt_ids=ids, max_new_tokens=4)  # warm-up
                r = cv.generate(prompt_ids=ids, max_new_tokens=n)
                out["target-only"].append((len(r.token_ids), r.stats["wall_s"]))
                out["ids_target"].append(r.token_ids)
                r = cd.generate(prompt_ids=ids, max_new_tokens=n)
                out["speculative"].append((len(r.token_ids), r.stats["wall_s"]))
                out["ids_spec"].append(r.token_ids)
                s = r.stats
                spent = s.get("draft_s", 0) + s.get("verify_forward_s", 0) + s.get("prefill_s", 0)
                out["overhead_ms"].append(1e3 * (s["wall_s"] - spent) / max(1, s["rounds"]))
                out.setdefault("acceptance", []).append(s.get("acceptance_rate", 0.0))
                out.setdefault("rounds", []).append(s["rounds"])
    finally:
        d.stop()
        v.stop()
    return out


def rate(pairs) -> float:
    return sum(k for k, _ in pairs) / sum(t for _, t in pairs)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine")
    p.add_argument("--target", default=os.path.join(ROOT, "models", "stdlib-code-target"))
    p.add_argument("--draft", default=os.path.join(ROOT, "models", "stdlib-code-draft"))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    results: dict = {"max_new_tokens": a.max_new_tokens, "prompts": len(PROMPTS), "dtypes": {}}
    for dtype in a.dtypes.split(","):
        runs: dict = {}
        for rep in range(a.repeats):  # alternate in-process and service runs
            for name, fn in [("hf", hf_runs), ("svc", service_runs)] if rep % 2 == 0 else [("svc", service_runs), ("hf", hf_runs)]:
                print(f"[{dtype}] repeat {rep + 1}/{a.repeats}: {name}", file=sys.stderr, flush=True)
                res = fn(a.target, a.draft, dtype, a.max_new_tokens)
                for k, v in res.items():
                    runs.setdefault(k, []).append(v)
        row: dict = {}
        for k in ("generate", "assisted", "prompt lookup", "target-only", "speculative"):
            row[k] = statistics.median(rate(r) for r in runs[k])  # median over repeats
        base = row["generate"]
        row["ratios"] = {k: row[k] / base for k in ("generate", "assisted", "prompt lookup", "target-only", "speculative")}
        ref = runs["ids"][0]
        row["identical"] = {
            "target-only == generate()": all(x == ref for x in runs["ids_target"]),
            "speculative == generate()": all(x == ref for x in runs["ids_spec"]),
            "speculative == target-only": all(x == y for x, y in zip(runs["ids_spec"], runs["ids_target"])),
        }
        row["overhead_ms_per_round"] = statistics.median(x for r in runs["overhead_ms"] for x in r)
        row["acceptance"] = statistics.mean(x for r in runs["acceptance"] for x in r)
        results["dtypes"][dtype] = row
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "engine.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    lines = [f"# Engine vs transformers generate() ({len(PROMPTS)} non-stdlib code prompts, greedy, "
             f"{a.max_new_tokens} tokens, 1 torch thread per process, median of {a.repeats} alternating repeats)", "",
             "| dtype | what | tok/s | vs generate() |", "|---|---|---|---|"]
    for dtype, row in results["dtypes"].items():
        for k in ("generate", "assisted", "prompt lookup", "target-only", "speculative"):
            label = {"target-only": "service target-only", "speculative": "service speculative (defaults)"}.get(k, k)
            lines.append(f"| {dtype} | {label} | {row[k]:.1f} | {row['ratios'][k]:.2f}x |")
    lines += ["", "| dtype | identical outputs | overhead per round (ms) | acceptance |", "|---|---|---|---|"]
    for dtype, row in results["dtypes"].items():
        same = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in row["identical"].items())
        lines.append(f"| {dtype} | {same} | {row['overhead_ms_per_round']:.2f} | {row['acceptance']:.3f} |")
    with open(os.path.join(a.out, "ENGINE.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
