"""Scale-out: aggregate tok/s of one draft tier in front of one verify replica, then two, in one
run (the draft places each session on the replica with the most free capacity:
draft_service/replicas.py).

    python -m bench.scaleout [--sessions 8 --max-new-tokens 64 --repeats 3 --proposer hybrid --out bench/results]

Two verify services (one torch thread each) and two draft services on the same model pair: one
draft with `--verify A`, one with `--verify A,B`. For each repeat, the same N concurrent greedy
requests (code prompts from outside the standard library) run through each draft in
alternating order, each after a pause for the drafts' next poll of the replicas (every 2 s: the
last run's sessions on a replica would otherwise still count against its free room); the
median aggregate tok/s counts. Each process's CPU seconds over the run
are recorded too: on a machine with fewer cores than processes, that is what bounds the gain.
"""
from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

from bench.cli import pair_run, pair_run_parser, run_header, write_report
from bench.goodput import run_batch
from bench.prompts import CODE_PROMPTS
from bench.launch import ENV, Service


def sessions(v: Service) -> float:
    """Verify.Session calls the service has seen."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(v.metrics()) for s in f.samples
               if s.name == "specdec_request_latency_seconds_count" and s.labels.get("method") == "Session")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def main(argv=None) -> int:
    a = pair_run_parser("scaleout", 64, 3, sessions=dict(type=int, default=8),
                        proposer=dict(default="hybrid", choices=("draft", "hybrid", "lookup"))).parse_args(argv)
    env = dict(ENV, OMP_NUM_THREADS="1")
    vs = [Service("verify_service", "--model", os.path.abspath(a.target), "--threads", "1", "--metrics-port", "0", env=env)
          for _ in range(2)]
    drafts = {n: Service("draft_service", "--model", os.path.abspath(a.draft), "--verify", ",".join(v.address for v in vs[:n]),
                         "--threads", "1", "--proposer", a.proposer, env=env) for n in (1, 2)}
    prompts = (CODE_PROMPTS * (1 + a.sessions // len(CODE_PROMPTS)))[: a.sessions]
    runs: dict[int, list[dict]] = {1: [], 2: []}
    try:
        for n in (1, 2):
            asyncio.run(run_batch(drafts[n].address, False, prompts[:1], 8, False))  # warm-up
        cpu0 = {name: cpu_seconds(s.proc.pid) for name, s in {"verify A": vs[0], "verify B": vs[1], "draft (A)": drafts[1],
                                                              "draft (A,B)": drafts[2]}.items()}
        t0, paused = time.monotonic(), 0.0
        for rep in range(a.repeats):
            for n in ((1, 2) if rep % 2 == 0 else (2, 1)):
                time.sleep(2.5)
                paused += 2.5  # a poll of the replicas' Info after the last run's sessions closed (they poll every 2 s)
                before = [sessions(v) for v in vs]
                r = asyncio.run(run_batch(drafts[n].address, False, prompts, a.max_new_tokens, together=True))
                r["sessions_per_replica"] = [sessions(v) - b for v, b in zip(vs, before)]
                runs[n].append(r)
                print(n, round(r["tok_s"], 1), r["sessions_per_replica"], flush=True)
        wall = time.monotonic() - t0 - paused
        cpu = {name: cpu_seconds(s.proc.pid) - cpu0[name] for name, s in {"verify A": vs[0], "verify B": vs[1], "draft (A)": drafts[1],
                                                                            "draft (A,B)": drafts[2]}.items()}
    finally:
        for s in [*drafts.values(), *vs]:
            s.stop()
    med = {n: statistics.median(r["tok_s"] for r in runs[n]) for n in runs}
    res = dict(**run_header(a), sessions=a.sessions, max_new_tokens=a.max_new_tokens, proposer=a.proposer,
               repeats=a.repeats, cores=os.cpu_count(), runs=runs, median_tok_s=med, ratio=med[2] / med[1], wall_s=wall, cpu_s=cpu)
    return write_report(a.out, "scaleout", "SCALEOUT.md", res, render)


def render(res: dict) -> str:
    lines = ["# Scale-out: one verify replica, then two, behind one draft tier", "",
             pair_run(res, f" on {res['cores']} cores") + ", one torch thread per "
             f"process, {res['sessions']} concurrent greedy requests of {res['max_new_tokens']} tokens (code prompts from outside the "
             f"standard library), proposer `{res['proposer']}`, median of {res['repeats']} alternating runs. "
             "Command: `python -m bench.scaleout`.", "",
             "| verify replicas | aggregate tok/s (median) | runs | sessions per replica (last run) |", "|---|---|---|---|"]
    for n in (1, 2):
        runs = res["runs"][n]
        each = ", ".join(f"{r['tok_s']:.1f}" for r in runs)
        lines.append(f"| {n} | {res['median_tok_s'][n]:.1f} | {each} | {runs[-1]['sessions_per_replica']} |")
    lines += ["", f"**Two replicas / one: {res['ratio']:.2f}×.**", "",
              f"CPU seconds per process over the {res['wall_s']:.0f} s of measurement (both configurations):", "",
              "| process | CPU s | share of one core |", "|---|---|---|"]
    for name, s in res["cpu_s"].items():
        lines.append(f"| {name} | {s:.1f} | {s / res['wall_s']:.2f} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
