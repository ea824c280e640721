"""Load tester for a draft endpoint: concurrent streaming sessions, latency percentiles, a report.

    python -m bench.loadtest --server 127.0.0.1:50052 --concurrency 1,4,16,64 --out deploy/loadtest
    python -m bench.loadtest --server 127.0.0.1:50052 --rate 0.5,2 --requests 40 --duration-s 60 --out /tmp/lt

Each *cell* is one load level: closed-loop at a fixed concurrency (N sessions, each sends its
next request when the previous one ends) or open-loop at a target request rate (Poisson
arrivals, whatever is in flight). A cell is bounded in requests (`--requests`) and in time
(`--duration-s`: no request starts after it; requests still running `--grace-s` later are
cancelled and counted as `cancelled`, not as errors).

Per request it records, from the client's side of the stream:
  TTFT   time to first token (request sent -> first chunk with tokens)
  ITL    mean inter-token latency of the request, (last token's chunk - first token's) / (tokens - 1) (a.k.a. TPOT);
         tokens arrive in chunks of one verify round each, so `chunk gap` (time between
         successive chunks) is reported too: it is what a reader of the stream sees stall
  e2e    request sent -> last chunk
plus output tokens, the draft acceptance rate (from the server's stats) and the gRPC status of
failures. Per cell: p50/p95/p99 of each latency, output tokens/s (all tokens received in the
cell / cell wall time), requests/s, errors by status code.

The target-only baseline: `--target-only` sends the cells to a verify service instead (tagged
path=target-only), or `--baseline VERIFY` runs every cell against both, back to back in one
process, alternating which path goes first from run to run (`--repeats` runs); the report then
divides each run's speculative cell by its target-only twin, so a drifting machine's speed does
not pass for an effect of speculation.

Results go to OUT/loadtest.json (with `--append`, cells are added to / replace cells of the
same load level and tags in an existing file) and OUT/REPORT.md with PNG plots (bench/loadtest_report.py).

The prompt set (`--prompts`): `stdlib` (default) cuts code snippets that start at a `def` or
`class` line from the held-out split of the CPython standard library (train/corpus.py, never
seen in training), `builtin` is a small fixed list, or a path to a file with one JSON string or
{"prompt": ...} object per line (plain text lines work too).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from bench.cli import repo_path
from bench.loadtest_report import _ms, render
from bench.prompts import load_prompts

# --------------------------------------------------------------------------------------------
# One request


@dataclass
class Record:
    i: int
    start_s: float  # send time, relative to the cell start
    code: str = "OK"  # gRPC status name, CANCELLED_AT_DEADLINE, or an exception type
    tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    acceptance_rate: float | None = None
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    draft_s: float = 0.0  # server-side split of the request's time (from the last chunk's stats)
    verify_s: float = 0.0
    verify_forward_s: float = 0.0


async def one_request(client, i: int, prompt: str, args, cell_t0: float, live: dict) -> Record:
    import grpc

    t0 = time.perf_counter()
    rec = Record(i=i, start_s=t0 - cell_t0)
    last_t, last = None, None
    try:
        async for chunk in client.stream(prompt=prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                         seed=None if args.request_seeds is None else args.request_seeds + i,
                                         num_draft_tokens=args.tau, proposal_mode=args.mode):
            now = time.perf_counter()
            if chunk.token_ids:
                if rec.ttft_s is None:
                    rec.ttft_s = now - t0
                elif last_t is not None:
                    rec.chunk_gaps_s.append(now - last_t)
                last_t = now
                rec.tokens += len(chunk.token_ids)
                live["tokens"] += len(chunk.token_ids)
            last = chunk
        rec.e2e_s = time.perf_counter() - t0
        if rec.tokens > 1 and rec.ttft_s is not None:
            rec.itl_s = (last_t - t0 - rec.ttft_s) / (rec.tokens - 1)
        if last is not None and last.HasField("stats"):
            s = last.stats
            rec.acceptance_rate, rec.drafted, rec.accepted, rec.rounds = s.acceptance_rate, s.drafted, s.accepted, s.rounds
            rec.draft_s, rec.verify_s, rec.verify_forward_s = s.draft_s, s.verify_s, s.verify_forward_s
    except grpc.aio.AioRpcError as e:
        rec.code = e.code().name
    except asyncio.CancelledError:
        rec.code = "CANCELLED_AT_DEADLINE"
    except Exception as e:  # noqa: BLE001 - a load tester reports failures, it does not stop on them
        rec.code = type(e).__name__
    return rec


# --------------------------------------------------------------------------------------------
# Cells: closed loop and open loop


async def _finish(tasks: set, grace_s: float) -> None:
    """Wait up to grace_s for running requests, then cancel the rest (they record themselves)."""
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def run_cell(client, prompts: list[str], args, mode: str, level: float, bar=None) -> tuple[list[Record], float, int]:
    """One load level. Returns (records, wall seconds, output tokens received)."""
    records: list[Record] = []
    live = {"tokens": 0}
    t0 = time.perf_counter()
    end = t0 + args.duration_s
    counter = iter(range(args.requests))
    tasks: set[asyncio.Task] = set()

    def done(rec: Record):
        records.append(rec)
        if bar is not None:
            errs = sum(r.code not in ("OK", "CANCELLED_AT_DEADLINE") for r in records)
            bar.set_postfix(err=errs, tok_s=f"{live['tokens'] / max(time.perf_counter() - t0, 1e-9):.1f}", refresh=False)
            bar.update(1)

    async def request(i: int):
        done(await one_request(client, i, prompts[i % len(prompts)], args, t0, live))

    if mode == "closed":
        async def session():
            for i in counter:  # shared iterator: the request budget is global to the cell
                if time.perf_counter() >= end:
                    return
                await request(i)

        for _ in range(int(level)):
            tasks.add(asyncio.ensure_future(session()))
        remaining = max(0.0, end - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=remaining)
        await _finish(pending, args.grace_s)
    else:
        rng = random.Random(args.seed)
        next_t = t0
        for i in counter:
            next_t += rng.expovariate(level)  # Poisson arrivals at `level` requests/s
            if next_t >= end:
                break
            await asyncio.sleep(max(0.0, next_t - time.perf_counter()))
            t = asyncio.ensure_future(request(i))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(set(tasks), timeout=max(0.0, end - time.perf_counter()))
        await _finish(set(tasks), args.grace_s)
    wall = time.perf_counter() - t0
    records.sort(key=lambda r: r.i)
    return records, wall, live["tokens"]


# --------------------------------------------------------------------------------------------
# Statistics


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "n": 0}
    import numpy as np

    a = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)), "p99": float(np.percentile(a, 99)),
            "mean": float(a.mean()), "n": int(a.size)}


def summarize(records: list[Record], wall_s: float, tokens_received: int) -> dict:
    ok = [r for r in records if r.code == "OK"]
    errors: dict[str, int] = {}
    for r in records:
        if r.code not in ("OK", "CANCELLED_AT_DEADLINE"):
            errors[r.code] = errors.get(r.code, 0) + 1
    drafted = sum(r.drafted for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "cancelled_at_deadline": sum(r.code == "CANCELLED_AT_DEADLINE" for r in records),
        "errors": sum(errors.values()),
        "errors_by_code": errors,
        "wall_s": wall_s,
        "output_tokens": tokens_received,
        "output_tokens_per_s": tokens_received / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "mean_output_tokens": (sum(r.tokens for r in ok) / len(ok)) if ok else 0.0,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([r.itl_s for r in ok if r.itl_s is not None]),
        "chunk_gap_s": percentiles([g for r in ok for g in r.chunk_gaps_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
        "acceptance_rate": (sum(r.accepted for r in ok) / drafted) if drafted else None,
        "tokens_per_round": (sum(r.tokens for r in ok) / sum(r.rounds for r in ok)) if sum(r.rounds for r in ok) else None,
        # Where a completed request's time went, per output token (server stats): drafting on the
        # draft host, waiting for verdicts (network + verify queue + target forward), the target forward.
        "draft_ms_per_token": 1000 * sum(r.draft_s for r in ok) / max(1, sum(r.tokens for r in ok)),
        "verify_wait_ms_per_token": 1000 * sum(r.verify_s for r in ok) / max(1, sum(r.tokens for r in ok)),
        "verify_forward_ms_per_token": 1000 * sum(r.verify_forward_s for r in ok) / max(1, sum(r.tokens for r in ok)),
    }


# --------------------------------------------------------------------------------------------
# Command line


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()] if s else []


def _tag(s: str) -> tuple[str, object]:
    k, _, v = s.partition("=")
    try:
        return k, json.loads(v)
    except json.JSONDecodeError:
        return k, v


def _same_cell(a: dict, b: dict) -> bool:
    """The same load and tags: with --append, a new cell replaces every earlier run of it."""
    return (a["mode"], a.get("concurrency"), a.get("rate"), a.get("tags", {})) == (b["mode"], b.get("concurrency"), b.get("rate"), b.get("tags", {}))


def _credentials(kw: dict) -> tuple[dict, dict]:
    """The client's credentials (credential_kwargs) for --server, and for the --baseline verify
    service: the fallback's token and TLS files where given (--fallback-token-file,
    --fallback-tls-*), else --server's."""
    fallback = {k.removeprefix("fallback_"): kw.pop(k) for k in list(kw) if k.startswith("fallback_")}
    base = dict(kw, token=fallback.pop("token") or kw["token"])
    if any(fallback.values()):
        base.update(fallback)
    return kw, base


async def run(args) -> dict:
    import contextlib

    import grpc

    from tqdm import tqdm

    from client import AsyncClient
    from client.core import credential_kwargs

    prompts = load_prompts(args.prompts, n=256, max_chars=args.prompt_chars, seed=args.seed)
    cells_spec = [("closed", c) for c in _floats(args.concurrency)] + [("open", r) for r in _floats(args.rate)]
    if not cells_spec:
        raise SystemExit("give --concurrency and/or --rate")
    tags = {"path": "target-only" if args.target_only else "speculative"} | dict(_tag(t) for t in args.tag)
    cells = []
    async with contextlib.AsyncExitStack() as stack:
        own, baseline_creds = _credentials(credential_kwargs(args))
        client = await stack.enter_async_context(AsyncClient(args.server, target_only=args.target_only, timeout=args.timeout_s, **own))
        paths = [(client, tags, "--server", args.server, "a draft service, or a verify service with --target-only")]
        if args.baseline:  # the same cells against a verify service, target-only, alternating with --server's
            base = await stack.enter_async_context(AsyncClient(args.baseline, target_only=True, timeout=args.timeout_s, **baseline_creds))
            paths.append((base, tags | {"path": "target-only"}, "--baseline", args.baseline, "a verify service"))
        infos = []
        for c, _, flag, address, wanted in paths:  # one line, not a traceback, for an address that does not serve
            try:
                infos.append(await c.info())
                for _ in range(args.warmup):  # first requests pay one-off costs (allocations, lazy init)
                    await c.generate(prompt=prompts[0], max_new_tokens=min(8, args.max_new_tokens))
            except grpc.aio.AioRpcError as e:
                hint = f" (it takes {wanted})" if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE) else ""
                raise SystemExit(f"bench.loadtest: {flag} {address}: {e.code().name}: {e.details()}{hint}") from None
        info = infos[0]
        pairs = args.pair_offset  # runs so far, over every level (and earlier invocations: --pair-offset): which path goes
        # first alternates across levels too, so an odd --repeats does not put --server first at every level
        for mode, level in cells_spec:
            for k in range(args.repeats):
                pairs += 1
                for order, (c, cell_tags, *_) in enumerate(paths if pairs % 2 else paths[::-1], 1):
                    run_tag = f" run {k + 1}" if args.repeats > 1 else ""
                    label = (f"{'c=' + str(int(level)) if mode == 'closed' else f'{level:g} req/s'}{run_tag} "
                             f"[{','.join(f'{t}={v}' for t, v in cell_tags.items())}]")
                    with tqdm(total=args.requests, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True,
                              disable=args.no_progress) as bar:
                        records, wall, toks = await run_cell(c, prompts, args, mode, level, bar)
                    s = summarize(records, wall, toks)
                    cell = {"mode": mode, "concurrency": int(level) if mode == "closed" else None,
                            "rate": level if mode == "open" else None, "tags": cell_tags, "summary": s,
                            "requests": [asdict(r) for r in records]}
                    if args.repeats > 1 or args.baseline:
                        cell |= {"run": k + 1, "order": order}  # order: 1 if this path went first in its run
                    cells.append(cell)
                    print(f"{label}: {s['completed']} done, {s['errors']} errors {s['errors_by_code'] or ''}, "
                          f"{s['output_tokens_per_s']:.1f} tok/s, TTFT p50 {_ms(s['ttft_s']['p50'])} ms, "
                          f"ITL p50 {_ms(s['itl_s']['p50'])} ms, e2e p95 {_ms(s['e2e_s']['p95'])} ms", file=sys.stderr)
    meta = {"created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "server": args.server,
            "draft_model": info.model_name, "prompts": args.prompts, "num_prompts": len(prompts),
            "args": {k: repo_path(v) if k == "out" else v for k, v in vars(args).items() if k not in ("tag", "token")}}  # never a secret in the report
    return {"meta": meta, "cells": cells}


def main(argv=None) -> int:
    from client.core import add_credential_args

    p = argparse.ArgumentParser(prog="python -m bench.loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True, help="draft service HOST:PORT (a verify service with --target-only)")
    p.add_argument("--target-only", action="store_true",
                   help="the baseline: --server is a verify service, generating target-only; cells are tagged path=target-only (else path=speculative)")
    p.add_argument("--baseline", default="", metavar="HOST:PORT",
                   help="a verify service (with --server's credentials, or the --fallback-token-file and --fallback-tls-* ones where given): every "
                        "cell runs against it too, target-only (tagged "
                        "path=target-only), right before or after --server's, alternating which goes first by run; the report "
                        "adds their ratio")
    p.add_argument("--repeats", type=int, default=1, help="runs of every cell (with --baseline: pairs, alternating order)")
    p.add_argument("--pair-offset", type=int, default=0, help="with --baseline: runs made by earlier invocations of one "
                   "comparison (bench.split runs a level at a time), so which path goes first keeps alternating")
    add_credential_args(p)
    p.add_argument("--concurrency", default="", help="closed-loop cells: comma-separated session counts, e.g. 1,4,16,64")
    p.add_argument("--rate", default="", help="open-loop cells: comma-separated request rates (req/s, Poisson arrivals)")
    p.add_argument("--requests", type=int, default=200, help="at most this many requests per cell")
    p.add_argument("--duration-s", type=float, default=60.0, help="no request starts after this many seconds of a cell")
    p.add_argument("--grace-s", type=float, default=30.0, help="then wait this long for running requests before cancelling them")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tau", type=int, default=0, help="draft tokens per round (0 = server default)")
    p.add_argument("--mode", choices=("greedy", "sparse", "dense"), default=None, help="proposal mode (default: server's)")
    p.add_argument("--seed", type=int, default=0, help="seeds prompt choice and arrivals")
    p.add_argument("--request-seeds", type=int, default=None,
                   help="request i sends sampling seed N+i (a seeded sampled request keeps its tau off the load, DESIGN §3); "
                        "default: unseeded, as most traffic is")
    p.add_argument("--prompts", default="stdlib", help="stdlib | builtin | path to a JSON-lines / text file")
    p.add_argument("--prompt-chars", type=int, default=400, help="cut prompts to at most this many characters")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-request gRPC deadline")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded requests before the first cell")
    p.add_argument("--tag", action="append", default=[], help="KEY=VALUE label for these cells (e.g. rtt_ms=10); repeatable")
    p.add_argument("--out", default=None, help="directory for loadtest.json, REPORT.md and PNGs")
    p.add_argument("--append", action="store_true", help="merge into an existing OUT/loadtest.json")
    p.add_argument("--title", default="", help="a line of text under the report's heading")
    p.add_argument("--setup", action="append", default=[], help="KEY=VALUE row for the report's set-up table; repeatable")
    p.add_argument("--note", action="append", default=[], help="a note for the report; repeatable")
    p.add_argument("--itl-target-ms", type=float, default=100.0, help="p95 inter-token latency target for the report's sizing table")
    p.add_argument("--session-tok-s", type=float, default=20.0,
                   help="per-session tokens/s target for the report's capacity table (sessions one verifier sustains)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--fail-on-error", action="store_true", help="exit 1 if any request failed")
    args = p.parse_args(argv)
    if args.baseline and args.target_only:
        p.error("--baseline runs the target-only path beside --server's speculative one: not with --target-only")
    if args.baseline and any(t.partition("=")[0] == "path" for t in args.tag):
        p.error("--baseline tags the two paths path=speculative and path=target-only: no --tag path=... with it")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    from client import AsyncClient
    from client.core import credential_kwargs
    from specdec.files import StartupError

    own = [f"--fallback-{part}" for part in ("token-file", "tls-ca", "tls-cert", "tls-key") if getattr(args, f"fallback_{part.replace('-', '_')}")]
    if own and not args.baseline:  # a flag that would be dropped without a word
        p.error(f"{own[0]} without --baseline (the fallback's credentials are the baseline verify service's)")
    try:  # the credentials' files and tokens, checked before any cell, as the client CLI does: one line, exit 2;
        # the baseline's as a fallback's, so an error names its --fallback-* flag
        AsyncClient(args.server, fallback=args.baseline or None, **credential_kwargs(args))  # opens no channel: that waits for a call
    except (OSError, ValueError, StartupError) as e:
        p.error(str(e))
    results = asyncio.run(run(args))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "loadtest.json")
        if args.append and os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
            kept = [c for c in old["cells"] if not any(_same_cell(c, n) for n in results["cells"])]
            results["cells"] = kept + results["cells"]
            results["meta"] = {**old.get("meta", {}), **{k: v for k, v in results["meta"].items() if k != "args"},
                               "runs": old.get("meta", {}).get("runs", [old.get("meta", {}).get("args")]) + [results["meta"]["args"]]}
            results["meta"].pop("args", None)
        results["meta"]["setup"] = {**results["meta"].get("setup", {}), **dict(s.split("=", 1) for s in args.setup)}
        if args.title:
            results["meta"]["title"] = args.title
        results["meta"]["itl_target_ms"] = args.itl_target_ms
        results["meta"]["session_tok_s"] = args.session_tok_s
        results["meta"]["notes"] = list(dict.fromkeys(results["meta"].get("notes", []) + args.note))
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        render(results, args.out)
        print(f"wrote {path} and {os.path.join(args.out, 'REPORT.md')}", file=sys.stderr)
    else:
        json.dump({"meta": results["meta"], "cells": [{k: v for k, v in c.items() if k != "requests"} for c in results["cells"]]},
                  sys.stdout, indent=1)
        print()
    bad = sum(c["summary"]["errors"] for c in results["cells"])
    return 1 if bad and args.fail_on_error else 0


if __name__ == "__main__":
    sys.exit(main())
