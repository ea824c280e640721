"""What a verify pass of the shipped target costs on the CPU as sessions and rows grow, under the
CPU tier's two layout choices that trade a step against a batch: float32 matmuls through MKL's
GEMM (the default) or oneDNN with prepacked weights (`--engine-choices fp32-prepack=on`), and keys read
through one gather per group or, for a session whose pages are consecutive, as a view of the pool
in a group of its own (layout.VIEW_BYTES).

    python -m bench.kernels [--target models/stdlib-code-target --dtype float32 --context 300 --repeats 3 --out bench/results]

Each pass is `Engine.forward` on N sessions of --context cached tokens, each with the same number
of new tokens (1: target-only steps; 5: rounds of tau = 4), the lengths put back after each pass.
Every configuration is timed in turn, --repeats times over (a, b, c, a, b, c, ...), 10 passes a
time; the best median counts. Writes KERNELS.md and kernels.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.cli import RESULTS, TARGET, run_header, write_report
from specdec.engine import layout
from specdec.lm import LM

CASES = ((1, 1), (1, 5), (1, 9), (1, 17), (4, 1), (4, 5), (8, 5), (16, 1), (16, 5))  # (sessions, new tokens each)
CONFIGS = (("GEMM, gathered", False, False), ("GEMM, views", False, True), ("prepacked, views", True, True))


def passes_ms(lm: LM, caches: list, sessions: int, rows: int, calls: int = 10) -> float:
    eng = lm.engine

    def one():
        eng.forward([[5] * rows] * sessions, caches[:sessions], True)
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
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    view_bytes = layout.VIEW_BYTES
    lms = {packed: LM.load(a.target, "cpu", a.dtype, choices=dict(fp32_prepack=packed)) for packed in (False, True)}
    prompt = [3 + i % 200 for i in range(a.context)]
    caches = {}
    for packed, lm in lms.items():
        caches[packed] = [lm.engine.cache(a.context + 32) for _ in range(max(s for s, _ in CASES))]
        for c in caches[packed]:
            lm.engine.forward([prompt], [c], False)
    rows = []
    try:
        for sessions, n in CASES:
            best = {}
            for _ in range(a.repeats):
                for name, packed, views in CONFIGS:
                    layout.VIEW_BYTES = view_bytes if views else float("inf")
                    ms = passes_ms(lms[packed], caches[packed], sessions, n)
                    best[name] = min(best.get(name, ms), ms)
            rows.append(dict(sessions=sessions, rows=n, ms=best))
            print(sessions, n, {k: round(v, 1) for k, v in best.items()}, flush=True)
    finally:
        layout.VIEW_BYTES = view_bytes
    res = dict(**run_header(a), dtype=a.dtype, context=a.context,
               repeats=a.repeats, view_bytes=view_bytes, plans={str(k): repr(lm.engine.plan) for k, lm in lms.items()}, cases=rows)
    return write_report(a.out, "kernels", "KERNELS.md", res, render)


def render(res: dict) -> str:
    names = [c[0] for c in CONFIGS]
    out = [f"# A verify pass of the shipped target on the CPU: matmul kernels and key reads\n",
           f"Run {res['date']}; `{res['target']}` in {res['dtype']}, one torch thread, {res['context']} cached tokens a "
           f"session; best of {res['repeats']} medians of 10 passes, configurations in turn. Command: `python -m bench.kernels`. "
           f"GEMM: MKL's float32 matmul (the default plan); prepacked: oneDNN with prepacked weights "
           f"(`--engine-choices fp32-prepack=on`); views: a session whose consecutive pages hold at least "
           f"{res['view_bytes'] // 1024} KiB of a layer's keys reads them as a view of the pool (the default), gathered: "
           f"every group's keys through one gather. Speed-ups: views against gathered (both GEMM), prepacked against "
           f"GEMM (both views).\n",
           "| sessions | new tokens each | rows | " + " | ".join(f"{n} ms" for n in names) + " | views: speed-up | prepacked: speed-up |",
           "|---" * (5 + len(names)) + "|"]
    for r in res["cases"]:
        ms = [r["ms"][n] for n in names]
        out.append(f"| {r['sessions']} | {r['rows']} | {r['sessions'] * r['rows']} | " + " | ".join(f"{x:.1f}" for x in ms)
                   + f" | {ms[0] / ms[1]:.2f}× | {ms[1] / ms[2]:.2f}× |")
    out.append("\nPlans: " + "; ".join(f"fp32-prepack={'on' if k == 'True' else 'off'}: `{v}`" for k, v in res["plans"].items()) + "\n")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
