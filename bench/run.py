"""The benchmark suite: speculative decoding through the services against its baselines, its
in-process anchors and the bound of DESIGN.md §7, in one run.

    python -m bench.run [--target DIR --draft DIR --prompts 6 --max-new-tokens 128 --out bench/results]

On held-out code prompts it measures tokens/s (generated tokens / client wall time, one request
at a time) for
  (a) target-only generation through the verify service,
  (b) speculative generation through both services over loopback: tau = 1..8, adaptive tau,
      pre-drafting, each proposal mode (sampled, T=1), prompt lookup and hybrid,
  (c) in-process anchors on the same models: transformers `generate()`, assisted generation
      (`assistant_model=`) and prompt lookup (`prompt_lookup_num_tokens=`),
  (d) emulated round-trip times between draft and verify: the two services in two network
      namespaces joined by a veth pair, a delaying TCP proxy (bench/proxy.py) in between
      (none at RTT 0),
      pre-drafting off and on.
It also measures per-token latency of each model in-process (c = draft / target), estimates the
acceptance alpha from the greedy runs, the gRPC + scheduling overhead per round (rho, in target
steps), and reports for every speculative run the bound S = E / (gamma c + 1), S_net = E /
(gamma c + 1 + rho) and the efficiency measured / S. Writes results.json, REPORT.md and PNG plots.
Every service runs with one torch thread (the two share this machine's cores); so do the
in-process anchors, and they run in the services' dtype (--dtype; `auto` resolves as the
services resolve it, specdec.lm.resolve_dtype: float32 where the CPU tier's row kernel runs and fits,
else bfloat16 on a CPU with bf16 instructions, else float32).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from tqdm import tqdm

from bench.cli import add_pair_args
from client import Client
from specdec.costmodel import expected_tokens, round_cost
from bench.launch import ENV, ROOT, Service

GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=1.0, seed=1234)
# a row named by its tau drafts that tau every round, without pre-drafting, unless its name says otherwise
# (a request that leaves these unset gets the service's defaults: adaptive tau up to it, pre-drafting on)
FIXED = dict(adaptive=False, predraft=False)


def spec_configs(quick: bool) -> list[tuple[str, dict]]:
    taus = [1, 2, 4] if quick else list(range(1, 9))
    out = [("target-only", dict(target_only=True, **GREEDY))]
    out += [(f"spec tau={t}", dict(num_draft_tokens=t, **FIXED, **GREEDY)) for t in taus]
    out += [
        ("spec adaptive (tau<=8)", dict(num_draft_tokens=8, adaptive=True, predraft=False, **GREEDY)),
        ("spec tau=4 predraft", dict(num_draft_tokens=4, adaptive=False, predraft=True, **GREEDY)),
        ("spec adaptive predraft", dict(num_draft_tokens=8, adaptive=True, predraft=True, **GREEDY)),
        ("prompt lookup tau=8", dict(num_draft_tokens=8, proposer="lookup", **FIXED, **GREEDY)),
        ("hybrid lookup+draft tau=4", dict(num_draft_tokens=4, proposer="hybrid", **FIXED, **GREEDY)),
        ("T=1 target-only", dict(target_only=True, **SAMPLED)),
        ("T=1 sparse tau=4", dict(num_draft_tokens=4, proposal_mode="sparse", **FIXED, **SAMPLED)),
        ("T=1 dense tau=4", dict(num_draft_tokens=4, proposal_mode="dense", **FIXED, **SAMPLED)),
        ("T=1 ids-only tau=4", dict(num_draft_tokens=4, proposal_mode="greedy", **FIXED, **SAMPLED)),
    ]
    return out


def measure(draft_addr: str, verify_addr: str, prompts: list[str], max_new: int, params: dict) -> dict:
    """Runs every prompt once (sequentially); sums tokens, time and the per-request stats."""
    params = dict(params)
    target_only = params.pop("target_only", False)
    tot = dict(tokens=0, wall_s=0.0, rounds=0, drafted=0, accepted=0, draft_s=0.0, verify_s=0.0, verify_forward_s=0.0,
               predraft_hits=0, lookup_rounds=0, target_only_rounds=0, rounds_fully_accepted=0, ids=[])
    with Client(verify_addr if target_only else draft_addr, target_only=target_only, timeout=900) as c:
        c.generate(prompt=prompts[0], max_new_tokens=4, **params)  # warm-up
        for p in prompts:
            r = c.generate(prompt=p, max_new_tokens=max_new, **params)
            s = r.stats
            tot["tokens"] += len(r.token_ids)
            tot["wall_s"] += s["wall_s"]
            tot["ids"].append(r.token_ids)
            for k in ("rounds", "drafted", "accepted", "draft_s", "verify_s", "verify_forward_s", "predraft_hits", "lookup_rounds",
                      "target_only_rounds"):
                tot[k] += s.get(k, 0)
            app = s.get("accepted_per_position") or [0]
            tot["rounds_fully_accepted"] += app[min(len(app), params.get("num_draft_tokens", 1)) - 1] if s.get("drafted") else 0
    tot["tok_s"] = tot["tokens"] / tot["wall_s"]
    return tot


def hf_anchor(target, draft, tok, prompts: list[str], max_new: int, kind: str) -> dict:
    extra = {"assisted": dict(assistant_model=draft), "lookup": dict(prompt_lookup_num_tokens=10)}.get(kind, {})
    tokens, wall, ids = 0, 0.0, []
    for i, p in enumerate([prompts[0]] + prompts):  # the first is a warm-up
        x = tok(p, return_tensors="pt")  # as the services tokenize by default
        t0 = time.perf_counter()
        with torch.no_grad():
            out = target.generate(**x, max_new_tokens=4 if i == 0 else max_new, do_sample=False, pad_token_id=tok.pad_token_id, **extra)
        if i:
            wall += time.perf_counter() - t0
            new = out[0, x["input_ids"].shape[1]:].tolist()
            tokens += len(new)
            ids.append(new)
    return dict(tokens=tokens, wall_s=wall, tok_s=tokens / wall, ids=ids)


def alpha_from(rows: list[dict]) -> float:
    """Per-position acceptance: accepted / (accepted + rounds with a rejection), pooled; rounds
    without proposals (a fallback, the last token) are neither."""
    acc = sum(r["accepted"] for r in rows)
    rej = sum(r["rounds"] - r.get("target_only_rounds", 0) - r["rounds_fully_accepted"] for r in rows)
    return acc / (acc + rej) if acc + rej else 0.0


def rtt_section(a, prompts, max_new: int, t_target: float, bar) -> list[dict]:
    """(d): verify and draft in two network namespaces, a delaying proxy between them."""
    from bench import split

    ok, why = split.netns_supported()
    if not ok:
        print(f"[bench] skipping RTT emulation: {why}", file=sys.stderr)
        return []
    n = split.names(f"b{os.getpid()}")
    env = dict(ENV, OMP_NUM_THREADS="1", SPECDEC_PROPOSER="draft", SPECDEC_DTYPE=a.dtype)  # the draft model unless a config says
    in_d, in_v = ("ip", "netns", "exec", n["ns_draft"]), ("ip", "netns", "exec", n["ns_verify"])
    rows, procs, proxies = [], [], []
    try:
        split.setup(n)
        verify = Service("verify_service", "--model", a.target, "--threads", "1", host=split.VERIFY_IP, env=env, prefix=in_v)
        procs.append(verify)
        for rtt in a.rtts:
            proxy, upstream = None, verify.address  # RTT 0: straight over the veth pair, as bench.tree and bench.split do
            if rtt > 0:
                proxy = subprocess.Popen([*in_d, sys.executable, "-m", "bench.proxy", "--listen", "127.0.0.1:0", "--target", verify.address,
                                          "--rtt-ms", str(rtt)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
                proxies.append(proxy)  # stopped in `finally` too, where a draft fails to start
                upstream = proxy.stdout.readline().split()[-1]
            draft = Service("draft_service", "--model", a.draft, "--verify", upstream, "--threads", "1", env=env, prefix=in_d)
            for predraft in (False, True):
                cfg = dict(num_draft_tokens=4, adaptive=False, predraft=predraft, **GREEDY)
                # the client runs on the draft host: `python -m bench.run measure` inside its namespace
                out = subprocess.run([*in_d, sys.executable, "-m", "bench.run", "measure", "--server", draft.address,
                                      "--max-new-tokens", str(max_new), "--params", json.dumps(cfg), "--prompts-json", json.dumps(prompts)],
                                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
                if out.returncode:
                    raise RuntimeError(f"measure in namespace failed: {out.stderr[-2000:]}")
                row = json.loads(out.stdout)
                row.update(name=f"rtt={rtt:g}ms tau=4 predraft={'on' if predraft else 'off'}", rtt_ms=rtt, params=cfg)
                rows.append(row)
                bar.update(1)
            draft.stop()
            if proxy is not None:
                proxy.terminate()
                proxy.wait(10)
        return rows
    finally:
        for p in procs:
            p.stop()
        for p in proxies:
            if p.poll() is None:
                p.terminate()
                p.wait(10)
        split.cleanup(n)


def derive(rows: list[dict], base_tok_s: float, alpha: float, c: float, t_target: float, hf_tok_s: float) -> None:
    for r in rows:
        r["speedup"] = r["tok_s"] / base_tok_s
        r["vs_hf_generate"] = r["tok_s"] / hf_tok_s
        if not r.get("rounds") or not r.get("drafted"):
            continue
        gamma = r["drafted"] / r["rounds"]
        rho = max(r["verify_s"] - r["verify_forward_s"], 0.0) / r["rounds"] / t_target
        r.update(gamma=gamma, rho=rho, tokens_per_round=r["tokens"] / r["rounds"])
        if r.get("lookup_rounds"):  # the bound is the draft model's: a lookup round costs no draft steps, and has its own
            continue  # acceptance; no bound, rather than one its own measurement beats
        # E(alpha, gamma) at a whole gamma; else (adaptive tau, rounds cut near the end) the measured tokens per round
        e = expected_tokens(alpha, round(gamma)) if abs(gamma - round(gamma)) < 0.05 else r["tokens"] / r["rounds"]
        r.update(bound_S=e / round_cost(gamma, c), bound_S_net=e / round_cost(gamma, c, rho))
        r["efficiency"] = r["speedup"] / r["bound_S"]


def plot(res: dict, out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(10, 6))
    names = [r["name"] for r in rows]
    ax.barh(names, [r["tok_s"] for r in rows], color=["tab:gray" if "target-only" in n or n.startswith("hf") else "tab:blue" for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (one request at a time)")
    ax.set_title("specdec: throughput per configuration")
    fig.tight_layout()
    files.append("throughput.png")
    fig.savefig(os.path.join(out, files[-1]), dpi=110)
    plt.close(fig)

    taus = [r for r in rows if r["name"].startswith("spec tau=") and "predraft" not in r["name"]]
    if taus:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        g = [r["gamma"] for r in taus]
        ax.plot(g, [r["speedup"] for r in taus], "o-", label="measured speed-up")
        ax.plot(g, [r["bound_S"] for r in taus], "s--", label="bound S = E/(γc+1)")
        ax.plot(g, [r["bound_S_net"] for r in taus], "^:", label="bound with measured ρ")
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xlabel("γ (draft tokens per round)")
        ax.set_ylabel("speed-up over target-only")
        ax.legend()
        ax.set_title(f"α={res['alpha']:.2f}, c={res['c']:.3f}")
        fig.tight_layout()
        files.append("speedup_vs_tau.png")
        fig.savefig(os.path.join(out, files[-1]), dpi=110)
        plt.close(fig)
    rtt = res.get("rtt_rows") or []
    if rtt:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for pd in ("off", "on"):
            pts = [r for r in rtt if r["name"].endswith(pd)]
            ax.plot([r["rtt_ms"] for r in pts], [r["speedup"] for r in pts], "o-", label=f"pre-drafting {pd}")
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xlabel("emulated round-trip time draft↔verify (ms)")
        ax.set_ylabel("speed-up over target-only (0 ms)")
        ax.legend()
        fig.tight_layout()
        files.append("speedup_vs_rtt.png")
        fig.savefig(os.path.join(out, files[-1]), dpi=110)
        plt.close(fig)
    return files


def render(res: dict, files: list[str]) -> str:
    f = lambda x, d=2: "" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = [
        "# specdec benchmark report", "",
        f"Run {res['date']} on {res['machine']}; models `{res['target']}` / `{res['draft']}`; "
        f"{res['n_prompts']} held-out code prompts, {res['max_new_tokens']} new tokens each, one request at a time, "
        f"1 torch thread per process, every model in {res['dtype']} (services and in-process anchors). "
        "Command: `" + res["command"] + "`.", "",
        f"* per-token latency in-process (transformers' own forward with its cache): target {res['t_target_ms']:.2f} ms, draft {res['t_draft_ms']:.2f} ms → **c = {res['c']:.3f}**",
        f"* acceptance per position (greedy, from the fixed-τ runs): **α = {res['alpha']:.3f}**",
        "* ρ = (verify wait − target forward time) per round / target step: gRPC, scheduling and Python per round",
        "* S = E/(γc+1) with E = (1−α^(γ+1))/(1−α) (DESIGN.md §7); S_net adds ρ; efficiency = measured speed-up / S",
        "* speed-up is against target-only through the verify service (greedy rows) or its T=1 run (sampled rows); "
        "`vs hf generate` is against transformers' own `generate()` in-process, which pays no RPC and, for single-token "
        "steps, no batch-invariance padding (passes on the CPU are padded to a calibrated minimum row count; see specdec/engine/cpu/rows.py)", "",
        "| configuration | tok/s | ms/token | speed-up | vs hf generate | γ | tokens/round | ρ | S | S_net | efficiency | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"] + (res.get("rtt_rows") or []):
        lines.append(f"| {r['name']} | {r['tok_s']:.1f} | {1000 / r['tok_s']:.1f} | {r['speedup']:.2f}× | {r['vs_hf_generate']:.2f}× | {f(r.get('gamma'))} | "
                     f"{f(r.get('tokens_per_round'))} | {f(r.get('rho'))} | {f(r.get('bound_S'))} | {f(r.get('bound_S_net'))} | "
                     f"{f(r.get('efficiency'))} | {r.get('exact', '')} |")
    lines += ["", "`exact`: greedy output identical to target-only for every prompt (sampled rows: n/a). In bfloat16, "
              "transformers' generate() rounds differently from the engine, so near-ties can flip between the two (the "
              "engine's contract is speculative == its own target-only, bitwise: DESIGN.md §9).", ""]
    lines += [f"![{x}]({x})" for x in files]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["measure"]:  # worker mode, used inside the draft namespace
        p = argparse.ArgumentParser()
        p.add_argument("cmd")
        p.add_argument("--server", required=True)
        p.add_argument("--max-new-tokens", type=int, required=True)
        p.add_argument("--params", required=True)
        p.add_argument("--prompts-json", required=True)
        m = p.parse_args(argv)
        print(json.dumps(measure(m.server, m.server, json.loads(m.prompts_json), m.max_new_tokens, json.loads(m.params))))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    add_pair_args(p)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rtt-ms", default="0,2,10,50")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the services' dtype, and so the in-process anchors' (default: auto, as the services resolve it)")
    p.add_argument("--quick", action="store_true", help="fewer configurations (a smoke run)")
    a = p.parse_args(argv)
    a.rtts = [float(x) for x in a.rtt_ms.split(",") if x.strip()]
    a.target, a.draft = os.path.abspath(a.target), os.path.abspath(a.draft)
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.prompts import heldout_prompts
    from train.latency import compare_latency

    from specdec.lm import checkpoint_dtype, resolve_dtype, weight_bytes

    a.dtype = str(resolve_dtype(a.dtype, torch.device("cpu"), checkpoint_dtype(a.target), weight_bytes(a.target))).removeprefix("torch.")
    prompts = heldout_prompts(a.prompts)
    tok = AutoTokenizer.from_pretrained(a.target)
    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=getattr(torch, a.dtype)).eval()
    draft = AutoModelForCausalLM.from_pretrained(a.draft, dtype=getattr(torch, a.dtype)).eval()
    lat = compare_latency(target, draft, rounds=3, steps=32)
    t_target, t_draft = lat["target"] / 1e3, lat["draft"] / 1e3
    c = t_draft / t_target
    configs = spec_configs(a.quick)
    anchors = ["hf generate", "hf assisted (assistant_model)", "hf prompt lookup"]
    bar = tqdm(total=len(configs) + len(anchors) + 2 * len(a.rtts), desc="bench", unit="config")
    env = dict(ENV, OMP_NUM_THREADS="1", SPECDEC_PROPOSER="draft", SPECDEC_DTYPE=a.dtype)  # the draft model unless a config says
    verify = Service("verify_service", "--model", a.target, "--threads", "1", env=env)
    draft_svc = Service("draft_service", "--model", a.draft, "--verify", verify.address, "--threads", "1", env=env)
    rows = []
    try:
        for name, params in configs:
            bar.set_postfix_str(name)
            r = measure(draft_svc.address, verify.address, prompts, a.max_new_tokens, params)
            r.update(name=name, params=params)
            rows.append(r)
            bar.update(1)
    finally:
        draft_svc.stop()
        verify.stop()
    for name, kind in zip(anchors, ["plain", "assisted", "lookup"]):
        bar.set_postfix_str(name)
        r = hf_anchor(target, draft, tok, prompts, a.max_new_tokens, kind)
        r.update(name=name)
        rows.append(r)
        bar.update(1)
    base = rows[0]
    for r in rows:  # greedy rows (the HF anchors are greedy too) must reproduce target-only exactly
        if r.get("params", GREEDY).get("temperature") == 0.0:
            r["exact"] = "yes" if r["ids"] == base["ids"] else "NO"
    alpha = alpha_from([r for r in rows if r["name"].startswith("spec tau=")])
    hf_tok_s = next(r for r in rows if r["name"] == "hf generate")["tok_s"]
    derive(rows, base["tok_s"], alpha, c, t_target, hf_tok_s)
    sampled_base = next(r for r in rows if r["name"] == "T=1 target-only")
    for r in rows:  # sampled rows compare with sampled target-only
        if r.get("params", {}).get("temperature") == 1.0:
            r["speedup"] = r["tok_s"] / sampled_base["tok_s"]
            if r.get("bound_S"):
                r["efficiency"] = r["speedup"] / r["bound_S"]
    rtt_rows = rtt_section(a, prompts, a.max_new_tokens, t_target, bar) if a.rtts else []
    for r in rtt_rows:
        r["exact"] = "yes" if r["ids"] == base["ids"] else "NO"
    derive(rtt_rows, base["tok_s"], alpha, c, t_target, hf_tok_s)
    bar.close()
    res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=f"{os.cpu_count()} CPU cores, torch {torch.__version__}",
               target=os.path.relpath(a.target, ROOT), draft=os.path.relpath(a.draft, ROOT), n_prompts=len(prompts),
               max_new_tokens=a.max_new_tokens, command="python -m bench.run " + " ".join(argv), dtype=a.dtype, latency=lat,
               t_target_ms=t_target * 1e3, t_draft_ms=t_draft * 1e3, c=c, alpha=alpha, rows=rows, rtt_rows=rtt_rows)
    for r in rows + rtt_rows:
        r.pop("ids", None)
    with open(os.path.join(a.out, "results.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    files = plot(res, a.out)
    with open(os.path.join(a.out, "REPORT.md"), "w") as fh:
        fh.write(render(res, files))
    print(render(res, files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
