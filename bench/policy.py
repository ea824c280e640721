"""The decode-loop policy against every fixed tau, at emulated round-trip times, with the cost
model's prediction beside each measurement.

    python -m bench.policy [--rtt-ms 0,10,50 --max-new-tokens 96 --repeats 2 --out bench/results]

The verify and draft services run in two network namespaces joined by a veth pair, with a
delaying TCP proxy (bench/proxy.py) between them (bench/split.py); the client runs on the draft
host. For each RTT and each prompt set (code from outside the standard library; the loop-prone
demo prompt) it measures greedy tokens/s, one request at a time, for fixed tau = 1..8 without
pre-drafting, fixed tau = 4 with pre-drafting, and adaptive tau with and without pre-drafting
(costs calibrated by the draft service at start-up, over the proxy), all from the draft model; and
the service's default, adaptive tau with pre-drafting and hybrid proposals (prompt lookup when a
2-gram recurs, else the draft model), which the cost model does not predict. Configurations alternate
between repeats; the median counts.

The prediction for a configuration is specdec/costmodel.tokens_per_second with alpha and the
costs measured in the same run: the draft step from the fixed-tau runs' draft time per drafted
token, and a verify round V(gamma) = a + b*gamma fitted to their verify wait per round.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from bench.cli import pair_run_parser, write_report
from bench import split
from bench.demo import PROMPT as DEMO_PROMPT
from bench.prompts import CODE_PROMPTS
from bench.run import alpha_from
from specdec.costmodel import Costs, expected_tokens, tokens_per_second
from bench.launch import ENV, ROOT, Service

FIXED = [1, 2, 3, 4, 5, 6, 8]


def configs() -> list[tuple[str, dict]]:
    out = [(f"tau={t}", dict(num_draft_tokens=t, predraft=False, adaptive=False)) for t in FIXED]
    out += [("tau=4 predraft", dict(num_draft_tokens=4, predraft=True, adaptive=False)),
            ("adaptive", dict(num_draft_tokens=8, predraft=False, adaptive=True)),
            ("adaptive predraft", dict(num_draft_tokens=8, predraft=True, adaptive=True)),
            ("adaptive predraft hybrid (default)", dict(num_draft_tokens=8, predraft=True, adaptive=True, proposer="hybrid"))]
    return out


def run_rtt(a, rtt: float, prompt_sets: dict, n: dict) -> dict:
    env = dict(ENV, OMP_NUM_THREADS="1", SPECDEC_PROPOSER="draft")  # the draft model unless a config says (the service default is hybrid)
    in_d, in_v = ("ip", "netns", "exec", n["ns_draft"]), ("ip", "netns", "exec", n["ns_verify"])
    verify = Service("verify_service", "--model", a.target, "--threads", "1", host=split.VERIFY_IP, env=env, prefix=in_v)
    proxy = subprocess.Popen([*in_d, sys.executable, "-m", "bench.proxy", "--listen", "127.0.0.1:0", "--target", verify.address,
                              "--rtt-ms", str(rtt)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    upstream = proxy.stdout.readline().split()[-1]
    draft = Service("draft_service", "--model", a.draft, "--verify", upstream, "--threads", "1", env=env, prefix=in_d)
    rows: dict = {}
    try:
        for rep in range(a.repeats):
            order = configs() if rep % 2 == 0 else configs()[::-1]
            for set_name, prompts in prompt_sets.items():
                for name, cfg in order:
                    out = subprocess.run([*in_d, sys.executable, "-m", "bench.run", "measure", "--server", draft.address,
                                          "--max-new-tokens", str(a.max_new_tokens), "--params", json.dumps(dict(cfg, temperature=0.0)),
                                          "--prompts-json", json.dumps(prompts)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
                    if out.returncode:
                        raise RuntimeError(f"measure failed: {out.stderr[-2000:]}")
                    rows.setdefault(set_name, {}).setdefault(name, []).append(json.loads(out.stdout))
                    print(f"[policy] rtt={rtt:g}ms {set_name} {name}: {rows[set_name][name][-1]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        draft.stop()
        proxy.terminate()
        proxy.wait(10)
        verify.stop()
    return rows


def summarize(rows: dict) -> dict:
    """Median tok/s per config, the measured costs and alpha, and the model's prediction."""
    fixed = [_median_row(rows[f"tau={t}"]) for t in FIXED]
    alpha = alpha_from(fixed)
    draft_step = sum(r["draft_s"] for r in fixed) / sum(r["drafted"] for r in fixed)
    xs = [r["drafted"] / r["rounds"] for r in fixed]
    ys = [r["verify_s"] / r["rounds"] for r in fixed]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    costs = Costs(draft_step, max(my - b * mx, 1e-6), b)
    out = {"alpha": alpha, "costs_ms": [1e3 * costs.draft_step, 1e3 * costs.verify_base, 1e3 * costs.verify_per_token], "configs": {}}
    for name, reps in rows.items():
        r = _median_row(reps)
        gamma = r["drafted"] / r["rounds"] if r["rounds"] else 0
        predraft = "predraft" in name
        g = max(1, round(gamma))
        # the model knows the draft model's rounds only: no prediction for prompt-lookup rounds
        pred = None if "hybrid" in name else tokens_per_second(costs, alpha, g, predraft)
        out["configs"][name] = {"tok_s": r["tok_s"], "mean_tau": gamma, "tokens_per_round": r["tokens"] / r["rounds"],
                                "predicted_tok_s": pred, "expected_tokens_per_round": expected_tokens(alpha, g),
                                "lookup_rounds": r.get("lookup_rounds", 0),
                                "predraft_hits": r.get("predraft_hits", 0), "ids": r["ids"]}
    best = max((c for c in out["configs"] if c.startswith("tau=") and "predraft" not in c), key=lambda c: out["configs"][c]["tok_s"])
    out["best_fixed"] = best
    return out


def _median_row(reps: list[dict]) -> dict:
    """The repeats' median tok/s, with the counts (rounds, drafts, ids) of the lower-median repeat
    (with two repeats this took the faster one's tok/s, which the runs before 2026-12-01 report)."""
    row = dict(sorted(reps, key=lambda r: r["tok_s"])[(len(reps) - 1) // 2])
    row["tok_s"] = statistics.median(r["tok_s"] for r in reps)
    return row


def main(argv=None) -> int:
    a = pair_run_parser("policy", 96, 2, rtt_ms=dict(default="0,10,50")).parse_args(argv)
    ok, why = split.netns_supported()
    if not ok:
        print(f"bench.policy needs network namespaces: {why}", file=sys.stderr)
        return 2
    prompt_sets = {"code": CODE_PROMPTS, "demo": [DEMO_PROMPT]}
    res: dict = {"max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "rtt": {}}
    n = split.names(f"p{os.getpid()}")
    try:
        split.setup(n)
        for rtt in [float(x) for x in a.rtt_ms.split(",")]:
            rows = run_rtt(a, rtt, prompt_sets, n)
            res["rtt"][f"{rtt:g}"] = {s: summarize(r) for s, r in rows.items()}
    finally:
        split.cleanup(n)
    os.makedirs(a.out, exist_ok=True)
    for per in res["rtt"].values():  # every greedy output of a prompt set must be the same
        for s in per.values():
            ids = [c.pop("ids") for c in s["configs"].values()]
            s["identical_outputs"] = all(x == ids[0] for x in ids)
    return write_report(a.out, "policy", "POLICY.md", res, render)


def render(res: dict) -> str:
    lines = [f"# Decode-loop policy vs fixed tau (greedy, {res['max_new_tokens']} tokens, median of {res['repeats']} alternating repeats, "
             "one torch thread per service, services in two network namespaces with a delaying proxy)", ""]
    for rtt, per in res["rtt"].items():
        for s, summ in per.items():
            best = summ["configs"][summ["best_fixed"]]["tok_s"]
            lines += [f"## RTT {rtt} ms, {s} prompts (alpha = {summ['alpha']:.3f}; measured costs ms: draft step "
                      f"{summ['costs_ms'][0]:.2f}, verify round {summ['costs_ms'][1]:.2f} + {summ['costs_ms'][2]:.2f}/token; "
                      f"outputs identical: {summ['identical_outputs']})", "",
                      "| config | mean tau | tokens/round | tok/s | vs best fixed | predicted tok/s | measured/predicted |", "|---|---|---|---|---|---|---|"]
            for name, c in summ["configs"].items():
                pred = c["predicted_tok_s"]
                lines.append(f"| {name} | {c['mean_tau']:.2f} | {c['tokens_per_round']:.2f} | {c['tok_s']:.1f} | {c['tok_s'] / best:.2f}x | "
                             + (f"{pred:.1f} | {c['tok_s'] / pred:.2f} |" if pred else "— | — |"))
            lines.append("")
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
