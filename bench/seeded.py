"""Does a seeded sampled request's output depend on its tau sequence? The measurement behind
DESIGN.md §7's choice that seeded sampled requests ignore the verifier's price (their tau must
not follow the load).

    python -m bench.seeded [--prompts 8 --max-new-tokens 48 --temperature 1.0 --out bench/results]

On the shipped pair (one torch thread per service), each code prompt is sampled with its own
fixed seed at a fixed tau of 1, 2, 4 and 8 (adaptive tau off) through the draft service, at tau 4
a second time (the control: same seed, same tau), and target-only through the verify service
(tau 0). Each run's tokens are compared with the first tau-4 run's: how many prompts give the
same tokens, and where the first difference falls. Writes SEEDED.md and seeded.json.
"""
from __future__ import annotations

import asyncio
import os
import statistics

from bench.cli import pair_run, pair_run_parser, run_header, write_report
from bench.prompts import CODE_PROMPTS
from bench.launch import service_pair
from client import AsyncClient

TAUS = (4, 1, 2, 8, 4)  # the first tau-4 run is the reference, the last its control


async def sample(address: str, target_only: bool, prompts: list[str], tau: int, a) -> list[list[int]]:
    async with AsyncClient(address, target_only=target_only, timeout=1800) as c:
        return [(await c.generate(prompt=p, max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=1000 + i,
                                  num_draft_tokens=tau, adaptive=None if target_only else False)).token_ids
                for i, p in enumerate(prompts)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (a shorter one differs where it ends); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    a = pair_run_parser("seeded", 48, 1, prompts=dict(type=int, default=8),
                        temperature=dict(type=float, default=1.0)).parse_args(argv)
    prompts = (CODE_PROMPTS * (1 + a.prompts // len(CODE_PROMPTS)))[: a.prompts]
    rows = []
    with service_pair(os.path.abspath(a.target), os.path.abspath(a.draft), "--threads", "1") as (v, d):
        ref = None
        for k, tau in enumerate(TAUS + (0,)):
            target_only = tau == 0
            outs = asyncio.run(sample(v.address if target_only else d.address, target_only, prompts, tau, a))
            ref = ref or outs
            diffs = [first_difference(o, r) for o, r in zip(outs, ref)]
            at = [x for x in diffs if x is not None]
            role = {0: " (the reference)", len(TAUS) - 1: " again (control)"}.get(k, "")
            label = "target-only (verify service)" if target_only else f"tau {tau}{role}"
            rows.append(dict(run=label, tau=tau, same=len(prompts) - len(at), prompts=len(prompts), first_difference=diffs,
                             median_first_difference=statistics.median(at) if at else None))
            print(rows[-1], flush=True)
    res = dict(**run_header(a), temperature=a.temperature, max_new_tokens=a.max_new_tokens, rows=rows)
    return write_report(a.out, "seeded", "SEEDED.md", res, render)


def render(res: dict) -> str:
    out = ["# A seeded sampled request's tokens against its tau", "",
           f"{pair_run(res)}. {len(res['rows'][0]['first_difference'])} code prompts, each with its own seed, "
           f"temperature {res['temperature']}, "
           f"{res['max_new_tokens']} new tokens, fixed tau (adaptive off); every run compared with the first tau-4 run.",
           "", "| run | same tokens as tau 4 | median first difference (token) | first difference per prompt |", "|---|---|---|---|"]
    for r in res["rows"]:
        m = "-" if r["median_first_difference"] is None else f"{r['median_first_difference']:g}"
        out.append(f"| {r['run']} | {r['same']} / {r['prompts']} | {m} | "
                   f"{', '.join('=' if x is None else str(x) for x in r['first_difference'])} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
