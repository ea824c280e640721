"""What one verify pass costs as sessions are added to it: the engine's own work per session.

    python -m bench.passes [--sessions 1,2,4,8,16,32,64 --tau 4 --context 64 --hidden 32 --repeats 30 --out bench/results]

A tiny Llama target (built here, so the model's own compute is small and the engine's work shows)
is loaded as the verify service loads it, in float32 with one torch thread. N sessions are opened
on a real Scheduler and prefilled with a context of --context tokens; then every session proposes
tau tokens at once, so each pass verifies N rounds of tau + 1 rows, through the scheduler's own
path (pass, acceptance, one host transfer). A pass's time is the verdicts' `forward_s`, the
median over --repeats passes that held all N rounds (rounds sent together may be split over two
passes; those are left out); the table gives it against one session's, and the round trip: the
wall time from sending the N rounds to having all N verdicts back in the event loop. Then the same
N sessions pipelined, each sending its next round as soon as its verdict is back (as sessions
do): rounds a second, and how many rounds shared a pass with all N. Writes PASSES.md and
passes.json.

    python -m bench.passes --mixed "63x0+1x60,63x0+1x8" [--model DIR] [--out DIR]

Mixed passes instead: per layout (COUNTxTAU terms joined by +, e.g. 63 target-only steps beside
one round of 60 proposals), the median pass time of the sessions' rounds sent together, greedy,
on --model (a model directory, loaded as the verify service loads it) or the tiny target.
Writes PASSES_MIXED.md and passes_mixed.json (bench/results/ holds a run on the shipped target).
With --idle-ms 0,4,10 each layout is measured again after each idle time: the event loop sleeps
that long before sending every pass's rounds, as a verifier waits for its sessions' next rounds
(the draft's drafting and the network), so what a pass costs after the verifier idled shows.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import tempfile
import time

import torch

from bench import tinymodels
from bench.cli import RESULTS, write_report
from specdec.lm import LM
from specdec.sampling import Sampling
from specdec.v1 import specdec_pb2 as pb
from verify_service.scheduler import Scheduler


@contextlib.asynccontextmanager
async def prefilled(eng: Scheduler, n: int, context: int, max_new: int):
    """n greedy sessions on eng, each with a context of `context` tokens prefilled; closed after."""
    ss = [eng.open([3 + (i + j) % 200 for j in range(context)], max_new, Sampling(), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)
          for i in range(n)]
    try:
        for s in ss:
            await eng.prefill(s)
        yield ss
    finally:
        for s in ss:
            eng.close(s)


async def pass_seconds(eng: Scheduler, n: int, tau: int, context: int, repeats: int) -> tuple[list[float], list[float]]:
    """forward_s of `repeats` passes of n sessions' rounds of tau proposals each, and the wall
    time from sending those rounds to having every verdict back in the event loop (the pass, its
    commits and hand-offs, and the sessions' coroutines)."""
    async with prefilled(eng, n, context, (tau + 1) * (4 * repeats + 2)) as ss:
        times: list[float] = []
        cycles: list[float] = []
        for _ in range(4 * repeats):  # bounded: rounds submitted together may be split over passes; count the whole ones
            t0 = time.perf_counter()
            vs = await asyncio.gather(*(eng.step(s, [s.ids[-1]] * tau, None) for s in ss))
            if all(v.pass_rounds == n for v in vs):
                times.append(vs[0].forward_s)
                cycles.append(time.perf_counter() - t0)
            if len(times) > repeats:
                break
        return times[1:], cycles[1:]  # the first pass warms up


def layout(spec: str) -> list[int]:
    """'63x0+1x60' -> 63 zeros then one 60: each session's proposals."""
    taus = []
    for term in spec.split("+"):
        count, _, tau = term.partition("x")
        taus += [int(tau)] * int(count)
    return taus


async def mixed_seconds(eng: Scheduler, taus: list[int], context: int, repeats: int, idle_s: float = 0.0) -> list[float]:
    """forward_s of `repeats` passes that held every session's round (session i proposing taus[i]
    tokens, none for 0: a target-only step), all sent together `idle_s` after the last verdicts."""
    room = eng.lm.max_context - context  # proposals past a session's room are cut: rounds of ids[-1] are rarely accepted
    async with prefilled(eng, len(taus), context, min((max(taus) + 1) * (4 * repeats + 2), room)) as ss:
        times: list[float] = []
        for _ in range(4 * repeats):
            if idle_s:
                await asyncio.sleep(idle_s)
            vs = await asyncio.gather(*(eng.step(s, [s.ids[-1]] * tau, None) for s, tau in zip(ss, taus)))
            if all(v.pass_rounds == len(taus) for v in vs):
                times.append(vs[0].forward_s)
            if len(times) > repeats:
                break
        return times[1:]


def run_mixed(a) -> None:
    layouts = a.mixed.split(",")
    need = max(max(layout(x)) for x in layouts)
    with tempfile.TemporaryDirectory() as d:
        if a.model is None:
            tinymodels.build(d, vocab_size=256, hidden=a.hidden, layers=2, heads=4, max_context=a.context + (need + 1) * (4 * a.repeats + 4))
        lm = LM.load(a.model or d, "cpu", "float32")
        most = max(len(layout(x)) for x in layouts)
        eng = Scheduler(lm, max_sessions=most, max_cached_tokens=most * lm.max_context)
        try:
            rows = []
            for spec in layouts:
                taus = layout(spec)
                for idle in a.idle_ms:
                    ts = asyncio.run(mixed_seconds(eng, taus, a.context, a.repeats, idle / 1e3))
                    rows.append(dict(layout=spec, idle_ms=idle, sessions=len(taus), rows=sum(t + 1 for t in taus), passes=len(ts),
                                     median_ms=1e3 * statistics.median(ts) if ts else None))
        finally:
            eng.shutdown()
    res = dict(model=a.model or f"tiny Llama (hidden {a.hidden})", context=a.context, repeats=a.repeats, plan=repr(lm.engine.plan), rows=rows)
    write_report(a.out, "passes_mixed", "PASSES_MIXED.md", res, render_mixed)


def render_mixed(res: dict) -> str:
    out = ["# Verify passes of mixed rounds", "",
           f"{res['model']}, float32, one thread; context {res['context']}, greedy; median of up to {res['repeats']} passes "
           "that held every session's round (scheduler's forward_s: pass, acceptance, host transfer). A layout's COUNTxTAU terms: "
           f"that many sessions proposing tau tokens each (0: a target-only step). Engine plan: `{res['plan']}`.", "",
           "| layout | idle ms before a pass | sessions | real rows | passes | pass ms (median) |", "|---|---|---|---|---|---|"]
    out += [f"| {r['layout']} | {r.get('idle_ms', 0):g} | {r['sessions']} | {r['rows']} | {r['passes']} | "
            + (f"{r['median_ms']:.1f} |" if r["median_ms"] is not None else "- |") for r in res["rows"]]
    return "\n".join(out) + "\n"


async def pipelined(eng: Scheduler, n: int, tau: int, context: int, rounds: int) -> tuple[float, float]:
    """n sessions that each send their next round of tau proposals as soon as their verdict is back
    (as sessions do), `rounds` rounds each: (rounds a second, the share of rounds verified in a pass
    that held all n)."""
    full = 0

    async def session(s):
        nonlocal full
        for _ in range(rounds):
            v = await eng.step(s, [s.ids[-1]] * tau, None)
            full += v.pass_rounds == n

    async with prefilled(eng, n, context, (tau + 1) * (rounds + 2)) as ss:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(s) for s in ss))
        return n * rounds / (time.perf_counter() - t0), full / (n * rounds)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.passes")
    p.add_argument("--sessions", default="1,2,4,8,16,32,64")
    p.add_argument("--tau", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--hidden", type=int, default=32, help="the tiny target's width (32: its own compute is small)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--mixed", default=None, help="mixed passes instead, e.g. 63x0+1x60,63x0+1x8 (COUNTxTAU terms)")
    p.add_argument("--model", default=None, help="with --mixed: a model directory (default: the tiny target)")
    p.add_argument("--idle-ms", default="0", help="with --mixed: idle times before each pass, e.g. 0,4,10 (each layout at each)")
    a = p.parse_args()
    try:
        a.idle_ms = [float(x) for x in a.idle_ms.split(",") if x.strip()] or [0.0]
    except ValueError:
        p.error(f"--idle-ms: {a.idle_ms!r} is not a list of numbers")
    if not all(math.isfinite(x) and x >= 0 for x in a.idle_ms):
        p.error("--idle-ms: times are finite and >= 0")
    torch.set_num_threads(1)
    if a.mixed:
        return run_mixed(a)
    counts = [int(x) for x in a.sessions.split(",")]
    with tempfile.TemporaryDirectory() as d:
        tinymodels.build(d, vocab_size=256, hidden=a.hidden, layers=2, heads=4, max_context=a.context + (a.tau + 1) * (4 * a.repeats + 4))
        lm = LM.load(d, "cpu", "float32")
        eng = Scheduler(lm, max_sessions=max(counts))
        try:
            rows = []
            for n in counts:
                ts, cs = asyncio.run(pass_seconds(eng, n, a.tau, a.context, a.repeats))
                rate, full = asyncio.run(pipelined(eng, n, a.tau, a.context, a.repeats))
                rows.append(dict(sessions=n, median_ms=1e3 * statistics.median(ts), p10_ms=1e3 * sorted(ts)[len(ts) // 10],
                                 cycle_ms=1e3 * statistics.median(cs), rounds_per_s=rate, full_passes=full))
        finally:
            eng.shutdown()
    one, one_cycle = rows[0]["median_ms"], rows[0]["cycle_ms"]
    for r in rows:
        r["vs_one"] = r["median_ms"] / one
        r["cycle_vs_one"] = r["cycle_ms"] / one_cycle
    res = dict(tau=a.tau, context=a.context, hidden=a.hidden, repeats=a.repeats, plan=repr(lm.engine.plan), rows=rows)
    write_report(a.out, "passes", "PASSES.md", res, render)


def render(res: dict) -> str:
    out = ["# Verify pass time against sessions in the pass", "",
           f"Tiny Llama target (hidden {res['hidden']}, 2 layers, 4 heads, vocab 256), float32, one thread; context {res['context']}, "
           f"rounds of tau = {res['tau']}; median of {res['repeats']} passes (scheduler's forward_s: pass, acceptance, "
           f"host transfer); a round trip is the median wall time from sending the N rounds to having all N verdicts in the "
           f"event loop (the pass, its commits and hand-offs, the sessions' coroutines). Pipelined: every session sends its "
           f"next round as soon as its verdict is back, {res['repeats']} rounds each (as sessions do): rounds a second, and the "
           f"share of rounds verified in a pass that held all N. Engine plan: `{res['plan']}`.", "",
           "| sessions | pass ms (median) | p10 ms | vs one session | round trip ms | vs one session | pipelined rounds/s "
           "| in full passes |", "|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['sessions']} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} | {r['vs_one']:.2f}x | "
            + (f"{r['cycle_ms']:.2f} | {r['cycle_vs_one']:.2f}x |" if "cycle_ms" in r else "- | - |")
            + (f" {r['rounds_per_s']:.0f} | {100 * r['full_passes']:.0f}% |" if "rounds_per_s" in r else " - | - |") for r in res["rows"]]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
