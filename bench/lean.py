"""What the CPU tier's lean forward (specdec/engine/cpu/lean.py) saves: passes of the shipped
draft and target through the lean forward and through the model's own forward, in one process,
on the same engine (the default plan), the two in turn.

    python -m bench.lean [--target ... --draft ... --dtype float32 --context 300 --repeats 5 --out bench/results]

Each case is `Engine.forward` on N sessions of --context cached tokens with the same number of new
tokens each (1 and last-row logits: the draft's step; 1: a target-only step; 5: a round of tau =
4), the lengths put back after each pass. Both forwards are timed --repeats times in turn, 10
passes a time (the draft's step 50); the best median counts. One torch thread. Writes LEAN.md and
lean.json.
"""
from __future__ import annotations

import argparse

import torch

from bench.cli import DRAFT, RESULTS, TARGET, run_header, write_report
from bench.kernels import passes_ms
from specdec.lm import LM

CASES = {"draft": ((1, 1, True), (4, 1, True), (1, 5, False)), "target": ((1, 1, False), (1, 5, False), (4, 5, False), (16, 1, False))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lean")
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for role, path in (("draft", a.draft), ("target", a.target)):
        lm = LM.load(path, "cpu", a.dtype)
        lean = lm.engine.lean
        prompt = [3 + i % min(200, lm.vocab_size - 3) for i in range(a.context)]
        if lean is None:
            raise SystemExit(f"{path}: the engine did not take the lean forward (see its log)")
        caches = [lm.engine.cache(a.context + 32) for _ in range(max(s for s, _, _ in CASES[role]))]
        for c in caches:
            lm.engine.forward([prompt], [c], False)
        for sessions, n, last in CASES[role]:
            best: dict[str, float] = {}
            for _ in range(a.repeats):
                for name, fwd in (("model", None), ("lean", lean)):
                    lm.engine.lean = fwd
                    ms = passes_ms(lm, caches, sessions, n, 50 if role == "draft" else 10, last)
                    best[name] = min(best.get(name, ms), ms)
            lm.engine.lean = lean
            rows.append(dict(model=role, sessions=sessions, rows=n, last=last, ms=best))
            print(role, sessions, n, {k: round(v, 2) for k, v in best.items()}, flush=True)
    res = dict(**run_header(a), dtype=a.dtype, context=a.context, repeats=a.repeats, cases=rows)
    return write_report(a.out, "lean", "LEAN.md", res, render)


def render(res: dict) -> str:
    out = ["# The lean forward against the model's own forward, on the CPU\n",
           f"Run {res['date']}; `{res['draft']}` and `{res['target']}` in {res['dtype']}, one torch thread, {res['context']} "
           f"cached tokens a session, the engine's default plan; best of {res['repeats']} medians (10 passes, the draft's 50), "
           "the two forwards in turn in one process. Command: `python -m bench.lean`.\n",
           "| model | sessions | new tokens each | logits | model's forward ms | lean forward ms | speed-up |", "|---|---|---|---|---|---|---|"]
    for r in res["cases"]:
        m, lean = r["ms"]["model"], r["ms"]["lean"]
        out.append(f"| {r['model']} | {r['sessions']} | {r['rows']} | {'last row' if r['last'] else 'every row'} | {m:.2f} | "
                   f"{lean:.2f} | {m / lean:.2f}× |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
