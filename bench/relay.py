"""What relaying a held session through the draft service costs: N concurrent greedy requests
generated target-only three ways, in one run, alternating:

* `generate`: through Verify.Generate (the goodput benchmark's target-only baseline);
* `session-runs`: a raw Verify.Session per request, one run of target-only steps
  (Round.target_only_steps) for all its tokens: what a held session costs the verifier, without a
  draft process;
* `draft-runs`: through a draft service whose draft model is useless (random weights, so its
  sessions fall back and, once the model's record says so, start with that one run): the same
  session relayed by a real draft process, verdict in, chunk out (up to four steps a verdict
  while the verifier serves other sessions: Round.run_tokens_per_verdict).

    python -m bench.relay [--sessions 16 --max-new-tokens 64 --repeats 3 --pin --out bench/results]

Reports aggregate tok/s and the verify and draft processes' CPU per token (user + system).
With --pin the verify service runs on CPU 0, the draft service and the clients on CPU 1.
"""
from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time

import grpc

from bench.cli import pair_run, pair_run_parser, run_header, write_report
from bench.fallback import random_draft
from bench.launch import ENV, Service
from bench.prompts import CODE_PROMPTS
from client import AsyncClient
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

KINDS = ("generate", "session-runs", "draft-runs")


async def _session_run(stub, ids: list[int], max_new: int, fingerprint: str) -> int:
    call = stub.Session(timeout=600)
    start = pb.SessionStart(prompt_ids=ids, max_new_tokens=max_new, sampling=pb.SamplingParams(),
                            proposal_mode=pb.PROPOSAL_MODE_GREEDY, vocab_fingerprint=fingerprint)
    await call.write(pb.VerifyRequest(start=start))
    await call.write(pb.VerifyRequest(round=pb.Round(round=1, target_only_steps=max_new)))
    n = 0
    while True:
        v = await call.read()
        if v is grpc.aio.EOF:
            raise RuntimeError("the verify service ended a session without a finish reason")
        n += 1
        if v.finish_reason:
            call.cancel()
            return n


async def batch(kind: str, address: dict, prompts: list[str], ids: list[list[int]], max_new: int) -> tuple[int, int]:
    """Runs the N requests together; returns the tokens generated and those from runs."""
    if kind == "session-runs":
        async with grpc.aio.insecure_channel(address["verify"]) as ch:
            stub = pb_grpc.VerifyStub(ch)
            fingerprint = (await stub.Info(pb.InfoRequest())).vocab_fingerprint
            n = sum(await asyncio.gather(*(_session_run(stub, i, max_new, fingerprint) for i in ids)))
            return n, n
    target_only = kind == "generate"
    async with AsyncClient(address["verify" if target_only else "draft"], target_only=target_only, timeout=600) as c:
        res = await asyncio.gather(*(c.generate(prompt=p, max_new_tokens=max_new) for p in prompts))
    return sum(len(r.token_ids) for r in res), sum(r.stats.get("run_steps", 0) for r in res)


def main(argv=None) -> int:
    a = pair_run_parser("relay", 64, 3, sessions=dict(type=int, default=16),
                        pin=dict(action="store_true", help="the verify service on CPU 0, the draft service and the clients on CPU 1")
                        ).parse_args(argv)
    from transformers import AutoTokenizer

    env = dict(ENV, OMP_NUM_THREADS="1")
    on = {"verify": ("taskset", "-c", "0"), "draft": ("taskset", "-c", "1")} if a.pin else {"verify": (), "draft": ()}
    if a.pin:
        os.sched_setaffinity(0, {1})
    prompts = (CODE_PROMPTS * (1 + a.sessions // len(CODE_PROMPTS)))[: a.sessions]
    tok = AutoTokenizer.from_pretrained(a.target)
    ids = [tok(p)["input_ids"] for p in prompts]  # as the services tokenize a text prompt (the target's special tokens)
    with tempfile.TemporaryDirectory() as tmp:
        draft_dir = random_draft(a.draft, os.path.join(tmp, "useless-draft"))
        verify = Service("verify_service", "--model", os.path.abspath(a.target), "--threads", "1",
                         "--max-sessions", str(max(64, a.sessions)), env=env, prefix=on["verify"])
        draft = Service("draft_service", "--model", draft_dir, "--verify", verify.address, "--threads", "1",
                        "--proposer", "draft", env=env, prefix=on["draft"])
        address = {"verify": verify.address, "draft": draft.address}
        runs: dict[str, list[dict]] = {k: [] for k in KINDS}
        try:
            for _ in range(3):  # warm-up; two sessions in a row fall back: later ones start without the model
                asyncio.run(batch("draft-runs", address, prompts[:1], ids[:1], 16))
            asyncio.run(batch("generate", address, prompts[:1], ids[:1], 16))
            for rep in range(a.repeats):
                for kind in (KINDS if rep % 2 == 0 else KINDS[::-1]):
                    c0, d0, t0 = verify.cpu_s(), draft.cpu_s(), time.perf_counter()
                    tokens, run_steps = asyncio.run(batch(kind, address, prompts, ids, a.max_new_tokens))
                    wall = time.perf_counter() - t0
                    runs[kind].append(dict(tokens=tokens, wall_s=wall, tok_s=tokens / wall, run_share=run_steps / tokens,
                                           verify_cpu_ms_per_token=1e3 * (verify.cpu_s() - c0) / tokens,
                                           draft_cpu_ms_per_token=1e3 * (draft.cpu_s() - d0) / tokens))
                    print(kind, round(tokens / wall), flush=True)
        finally:
            draft.stop()
            verify.stop()
    res = dict(**run_header(a), draft_model="the draft's architecture with random weights (useless)", sessions=a.sessions,
               max_new_tokens=a.max_new_tokens, repeats=a.repeats, pin=a.pin, runs=runs)
    return write_report(a.out, "relay", "RELAY.md", res, render)


def render(res: dict) -> str:
    runs = res["runs"]
    base = statistics.median(r["tok_s"] for r in runs["generate"])

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    lines = ["# Relaying a held session through the draft service", "",
             pair_run(res) + f" (the draft: {res['draft_model']}), {res['sessions']} concurrent greedy requests of "
             f"{res['max_new_tokens']} new tokens, code prompts from outside the standard library, one torch thread per "
             f"process, median of {res['repeats']} alternating runs"
             f"{'; the verify service pinned to CPU 0, the draft service and the clients to CPU 1' if res.get('pin') else ''}. "
             f"Command: `python -m bench.relay{' --pin' if res.get('pin') else ''}`.", "",
             "| how | tok/s | × Verify.Generate | verifier CPU ms/token | draft CPU ms/token | tokens from runs | runs (tok/s) |",
             "|---|---|---|---|---|---|---|"]
    for k in KINDS:
        draft_cpu = f"{med(k, 'draft_cpu_ms_per_token'):.3f}" if k == "draft-runs" else "-"
        each = " / ".join(f"{r['tok_s']:.0f}" for r in runs[k])
        lines.append(f"| {k} | {med(k, 'tok_s'):.1f} | {med(k, 'tok_s') / base:.2f}× | {med(k, 'verify_cpu_ms_per_token'):.3f} | "
                     f"{draft_cpu} | {100 * med(k, 'run_share'):.0f}% | {each} |")
    lines += ["", "`generate`: Verify.Generate. `session-runs`: a raw Verify.Session per request asking for one run of "
              "target-only steps (what a held session costs the verifier; a verdict a step). `draft-runs`: the same sessions relayed by a "
              "draft service (a verdict in, a chunk out, up to four steps a verdict); its draft CPU includes the sessions that still "
              "judge the useless model (adaptive.ModelRecord explores every 8th), tokens from runs says how many did not. "
              "Only ratios within one run count.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
