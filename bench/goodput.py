"""Goodput of a shared verifier: N concurrent greedy requests through the draft service
(speculative, the service's defaults) against the same N through the verify service alone
(target-only), in one run, with the load-steered tau on and off.

    python -m bench.goodput [--levels 1,4,8,16 --max-new-tokens 64 --repeats 2 --pin --out bench/results]

Level 1 runs four prompts one after another; level n runs n requests on different code prompts
from outside the standard library (bench/prompts.py CODE_PROMPTS, repeated as needed) together.
Each configuration is measured `--repeats` times in alternating order (target-only, steered,
unsteered, then the reverse), and the median aggregate tok/s (all tokens / wall time) counts.
Two draft services share the verify service: one with the load-steered tau
(`--goodput`, the default) and one with it off (`--no-goodput`), so before and after come from
the same run, on the same verify process. Everything runs with one torch thread per process.
With --pin the verify service runs on CPU 0 and the draft services and the clients on CPU 1 (the
split topology, with one core for every client's drafting, on a 2-core machine).
"""
from __future__ import annotations

import asyncio
import os
import shlex
import statistics
import sys
import time

from bench.cli import pair_run, pair_run_parser, run_header, write_report
from bench.concurrency import scrape
from bench.prompts import CODE_PROMPTS
from client import AsyncClient
from bench.launch import ENV, Service

KINDS = ("target-only", "steered", "unsteered")


async def run_batch(address: str, target_only: bool, prompts: list[str], max_new: int, together: bool) -> dict:
    async with AsyncClient(address, target_only=target_only, timeout=1800) as c:
        async def one(p: str):
            r = await c.generate(prompt=p, max_new_tokens=max_new)
            return len(r.token_ids), r.stats

        t0 = time.perf_counter()
        if together:
            res = await asyncio.gather(*(one(p) for p in prompts))
        else:
            res = [await one(p) for p in prompts]
        wall = time.perf_counter() - t0
    tokens = sum(n for n, _ in res)
    rounds = sum(s.get("rounds", 0) for _, s in res)
    drafted = sum(s.get("drafted", 0) for _, s in res)
    plain = sum(s.get("target_only_rounds", 0) for _, s in res)
    run = sum(s.get("run_steps", 0) for _, s in res)
    return dict(tokens=tokens, wall_s=wall, tok_s=tokens / wall, rounds=rounds, mean_tau=drafted / max(rounds, 1),
                target_only_share=plain / max(rounds, 1), run_share=run / max(tokens, 1))


def main(argv=None) -> int:
    a = pair_run_parser("goodput", 64, 2, levels=dict(default="1,4,8,16"),
                        verify_args=dict(default="", help="extra verify_service arguments (one string)"),
                        pin=dict(action="store_true", help="the split topology on one machine: the verify service on CPU 0, "
                                 "the draft services and the clients on CPU 1")).parse_args(argv)
    levels = [int(x) for x in a.levels.split(",")]
    os.makedirs(a.out, exist_ok=True)
    env = dict(ENV, OMP_NUM_THREADS="1")
    on = {"verify": ("taskset", "-c", "0"), "draft": ("taskset", "-c", "1")} if a.pin else {"verify": (), "draft": ()}
    if a.pin:
        os.sched_setaffinity(0, {1})  # this process's threads, the clients', made from here on
    verify = Service("verify_service", "--model", os.path.abspath(a.target), "--threads", "1", "--metrics-port", "0",
                     "--max-sessions", str(max(64, max(levels))), *shlex.split(a.verify_args), env=env, prefix=on["verify"])
    drafts = {kind: Service("draft_service", "--model", os.path.abspath(a.draft), "--verify", verify.address, "--threads", "1",
                            "--goodput" if kind == "steered" else "--no-goodput", env=env, prefix=on["draft"]) for kind in KINDS[1:]}
    address = {"target-only": verify.address, **{k: d.address for k, d in drafts.items()}}
    rows = []
    try:
        for kind in KINDS:  # warm-up
            asyncio.run(run_batch(address[kind], kind == "target-only", CODE_PROMPTS[:1], 8, False))
        for n in levels:
            count = 4 if n == 1 else n  # level 1: four requests one after another; level n > 1: n at once
            prompts = (CODE_PROMPTS * (1 + count // len(CODE_PROMPTS)))[:count]
            runs: dict[str, list[dict]] = {k: [] for k in KINDS}
            for rep in range(a.repeats):
                for kind in (KINDS if rep % 2 == 0 else KINDS[::-1]):
                    b0 = scrape(verify, "specdec_verify_batch_size_sum"), scrape(verify, "specdec_verify_batch_size_count")
                    c0 = verify.cpu_s()
                    r = asyncio.run(run_batch(address[kind], kind == "target-only", prompts, a.max_new_tokens, together=n > 1))
                    r["verify_cpu_ms_per_token"] = 1e3 * (verify.cpu_s() - c0) / max(r["tokens"], 1)
                    b1 = scrape(verify, "specdec_verify_batch_size_sum"), scrape(verify, "specdec_verify_batch_size_count")
                    r["mean_batch"] = (b1[0] - b0[0]) / max(b1[1] - b0[1], 1)
                    runs[kind].append(r)
            med = {k: sorted(v, key=lambda r: r["tok_s"])[len(v) // 2] for k, v in runs.items()}
            tok_s = {k: statistics.median(r["tok_s"] for r in runs[k]) for k in KINDS}
            rows.append(dict(sessions=n, prompts=len(prompts), runs=runs, median=med, tok_s=tok_s,
                             ratio={k: paired_ratio(runs[k], runs["target-only"]) for k in KINDS}))
            print(n, {k: round(v, 2) for k, v in rows[-1]["ratio"].items()}, flush=True)
    finally:
        for d in drafts.values():
            d.stop()
        verify.stop()
    res = dict(**run_header(a), max_new_tokens=a.max_new_tokens, repeats=a.repeats, verify_args=a.verify_args, pin=a.pin, rows=rows,
               levels=a.levels)
    return write_report(a.out, "goodput", "GOODPUT.md", res, render)


def paired_ratio(runs: list[dict], baseline: list[dict]) -> float:
    """The median over repeats of one repeat's tok/s over its baseline run's (the two ran back to
    back): a ratio of the two paths' medians could divide runs of different repeats, and let the
    machine's drift between them into it."""
    return statistics.median(r["tok_s"] / b["tok_s"] for r, b in zip(runs, baseline, strict=True))


def render(res: dict) -> str:
    lines = ["# Goodput of a shared verifier: speculative against target-only", "",
             pair_run(res) + ", one verify service and two draft services "
             f"(load-steered tau on / off), one torch thread each, greedy, {res['max_new_tokens']} new tokens per request, code "
             f"prompts from outside the standard library, the services' defaults otherwise; median of {res['repeats']} alternating "
             f"runs{'; the verify service pinned to CPU 0, the draft services and the clients to CPU 1' if res.get('pin') else ''}. "
             f"Command: `python -m bench.goodput --levels {res.get('levels', '1,4,8,16')} --repeats {res['repeats']} --max-new-tokens "
             f"{res['max_new_tokens']}{' --verify-args ' + repr(res['verify_args']) if res.get('verify_args') else ''}"
             f"{' --pin' if res.get('pin') else ''}`. "
             "Level 1 is four requests one after another.", "",
             "| sessions | target-only tok/s | steered tok/s | × target-only | mean τ | target-only rounds | tokens from runs "
             "| unsteered tok/s | × target-only | mean τ | verifier CPU ms/token: target-only / steered / unsteered |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        m, x = r["median"], r["ratio"]
        # tok_s: the medians of the runs (files from before it was kept: the median runs')
        tok_s = r.get("tok_s") or {k: m[k]["tok_s"] for k in KINDS}
        cpu = " / ".join(f"{statistics.median(run['verify_cpu_ms_per_token'] for run in r['runs'][k]):.2f}"
                         if all("verify_cpu_ms_per_token" in run for run in r["runs"][k]) else "-" for k in KINDS)
        lines.append(f"| {r['sessions']} | {tok_s['target-only']:.1f} | {tok_s['steered']:.1f} | **{x['steered']:.2f}×** | "
                     f"{m['steered']['mean_tau']:.2f} | {100 * m['steered']['target_only_share']:.0f}% | "
                     f"{100 * m['steered'].get('run_share', 0):.0f}% | {tok_s['unsteered']:.1f} | "
                     f"{x['unsteered']:.2f}× | {m['unsteered']['mean_tau']:.2f} | {cpu} |")
    lines += ["", "tok/s is the median of the runs (of an even number, the mean of the middle two); each ratio is "
              "the median over the repeats of a repeat's run over its target-only run, which ran back to back with it "
              "(files from before 2026-11-30 22:30 UTC divided the two medians instead); mean τ and the shares of rounds and tokens are the median run's (of an even "
              "number, the faster of the middle two). Only ratios within one run count: this shared 2-core machine's "
              "speed drifts. The verifier's CPU "
              "per token (its process's user + system seconds over the tokens, median of the runs) is what the requests "
              "cost the verifier itself, the draft's relay and drafting apart: here all processes share 2 cores, in the "
              "split topology the draft runs on the client's hardware.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
