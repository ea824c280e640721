"""A useless draft's fallback against the target alone: the shipped target with a randomly
initialised draft of the shipped draft's shape (acceptance about 0), requests one at a time,
each configuration interleaved with Verify.Generate on the same verify service, in one run.

    python -m bench.fallback [--lengths 48,128 --repeats 3 --out bench/results]

Draft.Generate with the service's defaults (hybrid proposals) and with --proposer draft: after
its judging rounds the session asks the verifier for a run of target-only steps (DESIGN.md §7).
Reports tok/s (generated tokens over wall time, all prompts; median) and the median of the ratios
of each run to the Verify.Generate run next to it (this shared machine's speed drifts).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench.cli import write_report
from bench.prompts import CODE_PROMPTS
from client import Client
from bench.launch import ENV, ROOT, Service


def random_draft(like: str, out: str) -> str:
    """A draft with `like`'s config and tokenizer and freshly initialised weights (seed 0)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(like))
    model.save_pretrained(out)
    for f in os.listdir(like):
        if f.startswith("tokenizer") or f == "generation_config.json":
            shutil.copy(os.path.join(like, f), out)
    return out


def timed(address: str, target_only: bool, n: int) -> dict:
    with Client(address, target_only=target_only, timeout=600) as c:
        t0, tokens, runs, rounds = time.perf_counter(), 0, 0, 0
        for p in CODE_PROMPTS:
            r = c.generate(prompt=p, max_new_tokens=n)
            tokens += len(r.token_ids)
            runs += r.stats.get("run_steps", 0)
            rounds += r.stats.get("rounds", 0)
        wall = time.perf_counter() - t0
    return dict(tokens=tokens, wall_s=wall, tok_s=tokens / wall, run_share=runs / max(rounds, 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fallback")
    p.add_argument("--target", default=os.path.join(ROOT, "models", "stdlib-code-target"))
    p.add_argument("--like", default=os.path.join(ROOT, "models", "stdlib-code-draft"))
    p.add_argument("--lengths", default="48,128")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = p.parse_args(argv)
    env = dict(ENV, OMP_NUM_THREADS="1")
    tmp = tempfile.mkdtemp(prefix="random-draft-")
    draft = random_draft(a.like, tmp)
    verify = Service("verify_service", "--model", os.path.abspath(a.target), "--threads", "1", "--metrics-port", "0", env=env)
    drafts = {"hybrid": Service("draft_service", "--model", draft, "--verify", verify.address, "--threads", "1", env=env),
              "draft": Service("draft_service", "--model", draft, "--verify", verify.address, "--threads", "1",
                               "--proposer", "draft", env=env)}
    rows = []
    try:
        for kind, d in drafts.items():  # warm-up
            timed(d.address, False, 8)
        timed(verify.address, True, 8)
        for n in [int(x) for x in a.lengths.split(",")]:
            runs = {k: [] for k in ("target-only", *drafts)}
            for rep in range(a.repeats):
                for kind in drafts:
                    order = [("target-only", verify.address, True), (kind, drafts[kind].address, False)]
                    for name, addr, plain in (order if rep % 2 == 0 else order[::-1]):
                        runs[name].append(timed(addr, plain, n))
            med = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
            plain = runs["target-only"]  # paired: each kind's run against the Verify.Generate run next to it
            pairs = {k: [r["tok_s"] / plain[i * len(drafts) + j]["tok_s"] for i, r in enumerate(runs[k])] for j, k in enumerate(drafts)}
            rows.append(dict(max_new_tokens=n, runs=runs, tok_s=med, ratio={k: statistics.median(pairs[k]) for k in drafts},
                             run_share={k: statistics.median(r["run_share"] for r in runs[k]) for k in drafts}))
            print(n, {k: round(v, 3) for k, v in rows[-1]["ratio"].items()}, flush=True)
    finally:
        for d in drafts.values():
            d.stop()
        verify.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), target=os.path.relpath(a.target, ROOT), repeats=a.repeats,
               prompts=len(CODE_PROMPTS), rows=rows)
    return write_report(a.out, "fallback", "FALLBACK.md", res, render)


def render(res: dict) -> str:
    lines = ["# A useless draft's fallback against the target alone", "",
             f"Run {res['date']}; `{res['target']}` with a randomly initialised draft of the shipped draft's shape, one torch "
             f"thread each, greedy, {res['prompts']} code prompts one at a time; {res['repeats']} runs of each kind, each "
             "next to a Verify.Generate run on the same verify service (alternating order); × is the median of the paired ratios. Command: `python -m bench.fallback`.", "",
             "| new tokens | Verify.Generate tok/s | hybrid (default) tok/s | × | draft model tok/s | × | steps in runs |",
             "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        t, x = r["tok_s"], r["ratio"]
        lines.append(f"| {r['max_new_tokens']} | {t['target-only']:.1f} | {t['hybrid']:.1f} | **{x['hybrid']:.2f}×** | "
                     f"{t['draft']:.1f} | **{x['draft']:.2f}×** | {100 * r['run_share']['draft']:.0f}% |")
    lines += ["", "Only ratios within one run count: this shared 2-core machine's speed drifts.", ""]
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
