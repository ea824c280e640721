"""The HTTP front door's overhead against gRPC, on the shipped pair: the same greedy requests,
alternating gRPC (the client library, streamed), HTTP /v1/completions whole (one JSON answer) and
HTTP streamed (SSE), on one draft service with --http-port; the order rotates each repeat, and
every answer must be the same text. Writes bench/results/HTTP.md (and prints it).

    python -m bench.http [--repeats 3 --prompts 6 --max-new-tokens 128 --out bench/results/HTTP.md]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import sys
import time

from bench.cli import add_pair_args
from bench.prompts import BUILTIN_PROMPTS
from client import Client
from bench.launch import ENV, ROOT, Service

WAYS = ("grpc", "http", "http-sse")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http_completion(conn: http.client.HTTPConnection, body: dict, stream: bool) -> str:
    conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=stream)), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
    if not stream:
        return json.loads(data)["choices"][0]["text"]
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != b"[DONE]")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http")
    add_pair_args(p, out=False)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "HTTP.md"))
    a = p.parse_args(argv)
    env = dict(ENV, OMP_NUM_THREADS="1")
    verify = Service("verify_service", "--model", a.target, "--threads", "1", env=env)
    draft = Service("draft_service", "--model", a.draft, "--verify", verify.address, "--threads", "1", "--http-port", "0", env=env)
    model = os.path.basename(os.path.normpath(a.target))
    prompts = BUILTIN_PROMPTS[: a.prompts]
    walls: dict[str, list[list[float]]] = {w: [[] for _ in prompts] for w in WAYS}
    cpu = dict.fromkeys(WAYS, 0.0)  # the draft process's CPU seconds, summed per way
    try:
        host, port = draft.http_address.split(":")
        with Client(draft.address, timeout=600) as rpc:
            conn = http.client.HTTPConnection(host, int(port), timeout=600)  # one kept-alive connection, as a client would keep
            run = {"grpc": lambda pr: rpc.generate(prompt=pr, max_new_tokens=a.max_new_tokens).text,
                   "http": lambda pr: http_completion(conn, dict(model=model, prompt=pr, max_tokens=a.max_new_tokens, temperature=0), False),
                   "http-sse": lambda pr: http_completion(conn, dict(model=model, prompt=pr, max_tokens=a.max_new_tokens, temperature=0), True)}
            for w in WAYS:  # warm-up: first calls pay one-off costs
                run[w](prompts[0])
            for r in range(a.repeats):
                for i, pr in enumerate(prompts):
                    order = WAYS[(r + i) % 3:] + WAYS[: (r + i) % 3]
                    texts = {}
                    for w in order:
                        c0, t0 = cpu_s(draft.proc.pid), time.perf_counter()
                        texts[w] = run[w](pr)
                        walls[w][i].append(time.perf_counter() - t0)
                        cpu[w] += cpu_s(draft.proc.pid) - c0
                    if len(set(texts.values())) != 1:
                        print(f"prompt {i}: the texts differ: {texts}", file=sys.stderr)
                        return 1
                print(f"[bench.http] repeat {r + 1}/{a.repeats} done", file=sys.stderr)
    finally:
        draft.stop()
        verify.stop()
    report = render(a, prompts, walls, cpu)
    with open(a.out, "w") as f:
        f.write(report)
    print(report)
    return 0


def render(a, prompts, walls, cpu) -> str:
    med = {w: [statistics.median(x) for x in walls[w]] for w in WAYS}
    tot = {w: sum(med[w]) for w in WAYS}
    rows = "\n".join(f"| {i} | {med['grpc'][i] * 1e3:.0f} | {med['http'][i] * 1e3:.0f} ({(med['http'][i] / med['grpc'][i] - 1) * 100:+.1f}%) "
                     f"| {med['http-sse'][i] * 1e3:.0f} ({(med['http-sse'][i] / med['grpc'][i] - 1) * 100:+.1f}%) |" for i in range(len(prompts)))
    over = {w: (tot[w] / tot["grpc"] - 1) * 100 for w in ("http", "http-sse")}
    # each repeat runs a prompt's three ways back to back: their ratios drift less than the sums
    paired = {w: (statistics.median(h / g for hs, gs in zip(walls[w], walls["grpc"]) for h, g in zip(hs, gs)) - 1) * 100
              for w in ("http", "http-sse")}
    return f"""# HTTP front door overhead against gRPC

Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.machine()} ({os.cpu_count()} cores; this machine's speed drifts
with its neighbours, so single differences of a few percent are within its noise). Models
{os.path.basename(os.path.normpath(a.target))} / {os.path.basename(os.path.normpath(a.draft))} (models/), one verify and one draft service, 1 torch
thread each, the draft's request defaults (adaptive tau, pre-drafting, hybrid proposer). Each request:
one of the first {len(prompts)} builtin prompts (bench/prompts.py), greedy, {a.max_new_tokens} new tokens;
the three ways alternate (the order rotates per prompt and repeat), {a.repeats} repeats, median wall
time per prompt and way. Every request's text was the same over the three ways. Command:
`python -m bench.http --repeats {a.repeats} --prompts {len(prompts)} --max-new-tokens {a.max_new_tokens}`.

* gRPC: `client.Client.generate` (Draft.Generate, streamed chunks collected).
* HTTP: `POST /v1/completions`, one JSON answer, over one kept-alive connection (`http.client`).
* HTTP SSE: the same with `"stream": true`, read to `data: [DONE]`.

| prompt | gRPC ms | HTTP ms (vs gRPC) | HTTP SSE ms (vs gRPC) |
|---|---|---|---|
{rows}
| all | {tot['grpc'] * 1e3:.0f} | {tot['http'] * 1e3:.0f} ({over['http']:+.1f}%) | {tot['http-sse'] * 1e3:.0f} ({over['http-sse']:+.1f}%) |

Overhead of the HTTP path over the sum of the medians: {over['http']:+.1f}% (whole), {over['http-sse']:+.1f}% (SSE).
Median of the {len(prompts) * a.repeats} paired ratios (each HTTP request over the gRPC request of the same prompt
and repeat, run back to back): {paired['http']:+.1f}% (whole), {paired['http-sse']:+.1f}% (SSE). The target was at most +5%.

CPU time of the draft process over all the timed requests of each way (less sensitive to the other jobs than
wall time; /proc, 10 ms ticks): gRPC {cpu['grpc']:.2f} s, HTTP {cpu['http']:.2f} s ({(cpu['http'] / cpu['grpc'] - 1) * 100:+.1f}%),
HTTP SSE {cpu['http-sse']:.2f} s ({(cpu['http-sse'] / cpu['grpc'] - 1) * 100:+.1f}%).
"""


if __name__ == "__main__":
    sys.exit(main())
