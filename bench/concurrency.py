"""Batched verification benchmark: aggregate throughput of the verify service with 1, 2, 4, 8, 16
concurrent sessions driven through real draft services, against the same sessions run one at a
time, in one run.

    python -m bench.concurrency [--target DIR --draft DIR --levels 1,2,4,8,16 --drafts 2 --out bench/results]

Sessions are spread round-robin over --drafts draft-service processes that share one verify
service. For each level n: n greedy requests on different held-out prompts run together
(aggregate tokens/s = tokens / wall time), and the same n requests one after another, the two in
alternating order from level to level and repeat to repeat (--repeats: each level's row is the
median repeat, its ratio the median of the repeats' own ratios). The
verify service's Prometheus endpoint gives the mean batch size per forward pass. After every
level the verify service must be back to zero live sessions and zero cached tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from tqdm import tqdm

from bench.cli import add_pair_args, run_header
from client import AsyncClient
from bench.launch import ENV, Service


def scrape(svc: Service, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(svc.metrics()):
        for s in fam.samples:
            if s.name == name:
                return s.value
    return 0.0


async def run_level(drafts: list[str], prompts: list[str], max_new: int, together: bool) -> dict:
    clients = [AsyncClient(a, timeout=1800) for a in drafts]
    try:
        async def one(i: int, p: str):
            r = await clients[i % len(clients)].generate(prompt=p, max_new_tokens=max_new, num_draft_tokens=4, adaptive=False, predraft=False)
            return len(r.token_ids), r.stats["accepted"]

        t0 = time.perf_counter()
        if together:
            res = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        else:
            res = [await one(i, p) for i, p in enumerate(prompts)]
        wall = time.perf_counter() - t0
    finally:
        for c in clients:
            await c.close()
    tokens, accepted = sum(r[0] for r in res), sum(r[1] for r in res)
    return dict(tokens=tokens, accepted=accepted, wall_s=wall, tok_s=tokens / wall, accepted_tok_s=accepted / wall)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.concurrency")
    add_pair_args(p)
    p.add_argument("--levels", default="1,2,4,8,16")
    p.add_argument("--drafts", type=int, default=2, help="draft-service processes")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="concurrent/sequential pairs per level, in alternating order")
    a = p.parse_args(argv)
    levels = [int(x) for x in a.levels.split(",")]
    os.makedirs(a.out, exist_ok=True)
    from bench.prompts import heldout_prompts

    prompts = heldout_prompts(max(levels), max_chars=400)
    env = dict(ENV, OMP_NUM_THREADS="1", SPECDEC_PROPOSER="draft")  # the draft model unless a config says (the service default is hybrid)
    verify = Service("verify_service", "--model", os.path.abspath(a.target), "--threads", "1", "--metrics-port", "0", env=env)
    drafts = [Service("draft_service", "--model", os.path.abspath(a.draft), "--verify", verify.address, "--threads", "1", env=env)
              for _ in range(a.drafts)]
    rows = []
    try:
        asyncio.run(run_level([d.address for d in drafts], prompts[:1], 4, False))  # warm-up
        threads0 = _threads(verify.proc.pid)
        for k, n in enumerate(tqdm(levels, desc="levels")):
            pairs, batch = [], [0.0, 0.0]
            for rep in range(a.repeats):
                got = {}
                for together in ((True, False) if (k + rep) % 2 == 0 else (False, True)):  # order bias cancels over repeats
                    b0, c0 = scrape(verify, "specdec_verify_batch_size_sum"), scrape(verify, "specdec_verify_batch_size_count")
                    got[together] = asyncio.run(run_level([d.address for d in drafts], prompts[:n], a.max_new_tokens, together))
                    if together:
                        batch[0] += scrape(verify, "specdec_verify_batch_size_sum") - b0
                        batch[1] += scrape(verify, "specdec_verify_batch_size_count") - c0
                pairs.append((got[True], got[False]))
            conc, seq = sorted(pairs, key=lambda x: x[0]["tok_s"] / x[1]["tok_s"])[(len(pairs) - 1) // 2]  # the median repeat
            rows.append(dict(sessions=n, concurrent=conc, sequential=seq, mean_batch=batch[0] / max(batch[1], 1),
                             speedup_vs_sequential=statistics.median(c["tok_s"] / q["tok_s"] for c, q in pairs),
                             repeats=[dict(concurrent_tok_s=c["tok_s"], sequential_tok_s=q["tok_s"]) for c, q in pairs],
                             live_sessions_after=scrape(verify, "specdec_live_sessions"),
                             cached_tokens_after=scrape(verify, "specdec_cached_tokens"),
                             verify_threads_after=_threads(verify.proc.pid)))
    finally:
        for d in drafts:
            d.stop()
        verify.stop()
    base = rows[0]["concurrent"]["tok_s"]
    for r in rows:
        r["vs_one_session"] = r["concurrent"]["tok_s"] / base
    res = dict(**run_header(a), drafts=a.drafts, repeats=a.repeats,
               max_new_tokens=a.max_new_tokens, verify_threads_before=threads0, rows=rows)
    with open(os.path.join(a.out, "concurrency.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    report = render(res, plot(res, a.out))
    with open(os.path.join(a.out, "CONCURRENCY.md"), "w") as fh:
        fh.write(report)
    print(report)
    return 0


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(line for line in fh if line.startswith("Threads:")).split()[1])


def plot(res: dict, out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["sessions"] for r in res["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(n, [r["concurrent"]["tok_s"] for r in res["rows"]], "o-", label="concurrent (batched verification)")
    ax.plot(n, [r["sequential"]["tok_s"] for r in res["rows"]], "s--", label="same sessions one at a time")
    ax.set_xscale("log", base=2)
    ax.set_xticks(n, [str(x) for x in n])
    ax.set_xlabel("sessions")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "concurrency.png"), dpi=110)
    plt.close(fig)
    return "concurrency.png"


def render(res: dict, png: str) -> str:
    lines = ["# Batched verification: aggregate throughput", "",
             f"Run {res['date']}; {res['drafts']} draft-service processes, one verify service, 1 torch thread each, "
             f"{res['max_new_tokens']} new tokens per greedy request, tau=4, "
             + (f"{res['repeats']} repeats per level in alternating order, the median repeat's tok/s and the median ratio"
                if res.get("repeats") else "one pair per level, the concurrent run always first (files before 2026-12-01)")
             + ". Command: `python -m bench.concurrency`.", "",
             "| sessions | concurrent tok/s | accepted tok/s | one-at-a-time tok/s | concurrent / one-at-a-time | vs 1 session | mean batch | live sessions after | cached tokens after | verify threads after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['sessions']} | {r['concurrent']['tok_s']:.1f} | {r['concurrent']['accepted_tok_s']:.1f} | {r['sequential']['tok_s']:.1f} | "
                     f"{r['speedup_vs_sequential']:.2f}× | {r['vs_one_session']:.2f}× | {r['mean_batch']:.2f} | {r['live_sessions_after']:.0f} | "
                     f"{r['cached_tokens_after']:.0f} | {r['verify_threads_after']} |")
    lines += ["", f"Verify threads before the first level: {res['verify_threads_before']}.", "", f"![{png}]({png})", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
