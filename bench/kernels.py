"""What a verify pass of the shipped target costs on the CPU as sessions and rows grow, under each
of the CPU tier's float32 plans, pinned with --engine-choices: MKL's GEMMs padded to the
calibrated rows, oneDNN with prepacked weights (`fp32-prepack=on`), per-row products as batched
matmuls (`per-row=on,row-kernel=off`) and per-row products through the row kernel
(`per-row=on,row-kernel=on`, cpu/kernel.py), all four attending through SDPA
(`attention-kernel=off`); then the row kernel with the query attention (`attention-kernel=on`,
cpu/attend.c), the default where the kernels build.

    python -m bench.kernels [--target models/stdlib-code-target --dtype float32 --context 300 --repeats 3 --threads 1 --out bench/results]

Each pass is `Engine.forward` on N sessions of --context cached tokens, each with the same number
of new tokens (1: target-only steps; 5: rounds of tau = 4), the lengths put back after each pass.
Every plan is timed in turn, --repeats times over (a, b, c, a, b, c, ...), 10 passes a time; the
best median counts. Writes KERNELS.md and kernels.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.cli import RESULTS, TARGET, run_header, write_report
from specdec.choices import parse_choices
from specdec.lm import LM

CASES = ((1, 1), (1, 5), (1, 9), (1, 17), (4, 1), (4, 5), (8, 5), (16, 1), (16, 5))  # (sessions, new tokens each)
PLANS = (("GEMM", "fp32-prepack=off,per-row=off,attention-kernel=off"), ("prepacked", "fp32-prepack=on,per-row=off,attention-kernel=off"),
         ("per-row, batched", "fp32-prepack=off,per-row=on,row-kernel=off,attention-kernel=off"),
         ("row kernel", "fp32-prepack=off,per-row=on,row-kernel=on,attention-kernel=off"),
         ("row kernel, query attention", "fp32-prepack=off,per-row=on,row-kernel=on,attention-kernel=on"))


def passes_ms(lm: LM, caches: list, sessions: int, rows: int, calls: int = 10, last: bool = False) -> float:
    """The median ms of `calls` passes of `rows` new tokens for each of the first `sessions` caches
    (their lengths put back after each; `last`: logits of each input's last row only, as the draft's feeds)."""
    eng = lm.engine

    def one():
        eng.forward([[5] * rows] * sessions, caches[:sessions], True, last=[last] * sessions)
        for c in caches[:sessions]:
            c.length -= rows

    one()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        one()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernels")
    p.add_argument("--target", default=TARGET)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the GEMMs', SDPA's and the CPU tier's kernels')")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    lms = {name: LM.load(a.target, "cpu", a.dtype, choices=parse_choices(pin)) for name, pin in PLANS}
    prompt = [3 + i % 200 for i in range(a.context)]
    caches = {}
    for name, lm in lms.items():
        caches[name] = [lm.engine.cache(a.context + 32) for _ in range(max(s for s, _ in CASES))]
        for c in caches[name]:
            lm.engine.forward([prompt], [c], False)
    rows = []
    for sessions, n in CASES:
        best = {}
        for _ in range(a.repeats):
            for name, _ in PLANS:
                ms = passes_ms(lms[name], caches[name], sessions, n)
                best[name] = min(best.get(name, ms), ms)
        rows.append(dict(sessions=sessions, rows=n, ms=best))
        print(sessions, n, {k: round(v, 1) for k, v in best.items()}, flush=True)
    res = dict(**run_header(a), dtype=a.dtype, context=a.context, repeats=a.repeats, threads=a.threads,
               plans={name: lm.engine.plan.choices() for name, lm in lms.items()}, cases=rows)
    return write_report(a.out, "kernels", "KERNELS.md", res, render)


def _threads(n: int) -> str:
    return "one torch thread" if n == 1 else f"{n} torch threads"


def render(res: dict) -> str:
    names = [name for name, _ in PLANS]
    out = ["# A verify pass of the shipped target on the CPU: the float32 plans\n",
           f"Run {res['date']}; `{res['target']}` in {res['dtype']}, {_threads(res.get('threads', 1))}, {res['context']} cached tokens a "
           f"session; best of {res['repeats']} medians of 10 passes, plans in turn. Command: `python -m bench.kernels --threads {res.get('threads', 1)}`. "
           "Each plan pinned with `--engine-choices` as the last line gives. GEMM: MKL's matmul, padded to the calibrated "
           "rows; prepacked: oneDNN with prepacked weights; per-row, batched: one batched matmul entry per row; row kernel: "
           "per-row products through the CPU tier's row kernel; these four attend through SDPA; query attention: the CPU tier's "
           "own (attend.c). Speed-ups: the last plan against each other.\n",
           "| sessions | new tokens each | rows | " + " | ".join(f"{n} ms" for n in names) + " | "
           + " | ".join(f"last vs {n}" for n in names[:-1]) + " |",
           "|---" * (3 + 2 * len(names) - 1) + "|"]
    for r in res["cases"]:
        ms = [r["ms"][n] for n in names]
        out.append(f"| {r['sessions']} | {r['rows']} | {r['sessions'] * r['rows']} | " + " | ".join(f"{x:.1f}" for x in ms)
                   + " | " + " | ".join(f"{x / ms[-1]:.2f}×" for x in ms[:-1]) + " |")
    out.append("\nPlans as made: " + "; ".join(f"{k}: `{v}`" for k, v in res["plans"].items()) + "\n")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
