"""Tree speculation (GenerateRequest.tree_budget) against chains, in one run on the shipped pair,
greedy, one torch thread per process, requests one at a time:

    python -m bench.tree [--prompts 5 --tpr-prompts 10 --new-tokens 128 --rtt-ms 0,10,20,50 --repeats 3 --out bench/results]
    python -m bench.tree --render      # only rewrite OUT/TREE.md from OUT/tree.json

1. Tokens per round (RTT 0, measured once: the counts do not depend on timing): a tree of at
   most B nodes per round (B = 8, 16, 32; depth cap num_draft_tokens=16) against a 16-token chain
   (num_draft_tokens=16, tree_budget=0), all with proposer=draft (the draft model alone, no prompt
   lookup), adaptive=False, predraft=False, over --tpr-prompts prompts. Tokens per round = tokens
   / rounds, summed over the prompts. Bar: tree(16) / chain(16) >= 1.15.
2. RTT sweep: per RTT, draft services that reach the one verify service through bench/proxy.py (a
   userspace TCP proxy adding RTT/2 each way; RTT 0 = direct). At each RTT, tok/s (tokens over the
   wall time of all prompts, one request at a time, client side) and tokens per round of: chains at
   fixed tau (adaptive=False), trees at budget 16 with depth caps 8 and 16 and (not in the bar) at
   --extra-budgets, the service's default request (adaptive tau, no num_draft_tokens) as a
   reference, all with proposer=draft and the service's default pre-drafting (predraft unset);
   plus, with the default proposer (hybrid: prompt lookup on a recurring 2-gram, else the draft
   model), the default request and the budget-16 tree. At RTT 0 also the verify service alone
   (Verify.Generate, target-only) and, with --hf, transformers' generate() greedy in this process
   (same dtype as the services, one thread). Each RTT has two draft services: the fixed-tau and
   tree rows use one with --fixed-draft-args (--no-draft-fallback: the fallback judge's
   process-wide model record would otherwise let one configuration's sessions decide another's),
   the `default` rows one with the service defaults. Every row runs --repeats times; the order of
   the RTTs and of the rows rotates from repeat to repeat (drift on this shared machine does not
   land on one configuration); the median run counts. Bar: at 20 ms the budget-16 tree's tok/s
   >= 1.2x the best fixed-tau chain's.

Before any measured run every draft service that serves trees runs --warm-prompts held-out prompts
(after the measured ones, never measured) as budget-B trees: a greedy tree's nodes are scored by
acceptance learned from the verdicts (draft_service/tree.py Calibration, per draft model per draft
process), which would otherwise start cold on each fresh service.

Greedy output must not depend on the configuration: every run's token ids are compared, prompt by
prompt, with the verify service's own target-only output (Verify.Generate, the engine's
contract), and every difference is reported; where a run chose another token, the target's
logits there are recomputed (transformers, services' dtype and float32) to tell a near-tie from a
wrong verdict. Token counts use the reference's length per prompt (same work for every row).
transformers' generate() is compared separately (in bfloat16 its rounding differs from the
engine's, bench/results/ENGINE.md).

Writes OUT/tree.json (every run's numbers) and OUT/TREE.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

from bench.cli import add_pair_args, command, run_header, write_report
from bench.launch import ENV, Service
from bench.prompts import CODE_PROMPTS, heldout_prompts
from bench.tree_report import REFERENCE, bars, render
from client import Client

SUMMED = ("rounds", "drafted", "accepted", "tree_rounds", "lookup_rounds", "target_only_rounds", "fallback_rounds", "run_steps",
          "predraft_hits", "predraft_misses", "draft_s", "verify_s", "verify_forward_s", "prefill_s", "generated_tokens")


def code_state() -> dict:
    """The checkout the services ran from: HEAD and the files changed against it (services import the working tree)."""
    import subprocess  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True,
                               timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(head=head, changed=[line[3:] for line in dirty if line.strip()])


def tpr_configs(budgets: list[int], depth: int) -> dict[str, dict]:
    """Part 1: the chain and the trees, no pre-drafting, no adaptive tau, the draft model alone."""
    base = dict(adaptive=False, predraft=False, proposer="draft", num_draft_tokens=depth)
    return {f"chain τ={depth}": dict(base), **{f"tree B={b} d={depth}": dict(base, tree_budget=b) for b in budgets}}


def sweep_configs(taus: list[int], budget: int, depths: list[int], hybrid_depth: int, extra: list[int] = ()) -> dict[str, dict]:
    """Part 2, per RTT (pre-drafting left to the service's default). `extra`: more tree budgets, at the largest depth cap."""
    out = {f"chain τ={t}": dict(num_draft_tokens=t, adaptive=False, proposer="draft") for t in taus}
    out.update({f"tree B={budget} d={d}": dict(num_draft_tokens=d, tree_budget=budget, adaptive=False, proposer="draft") for d in depths})
    out.update({f"tree B={b} d={max(depths)}": dict(num_draft_tokens=max(depths), tree_budget=b, adaptive=False, proposer="draft")
                for b in extra})
    out["default (draft)"] = dict(proposer="draft")
    out["default (hybrid)"] = dict()
    out[f"tree B={budget} d={hybrid_depth} (hybrid)"] = dict(num_draft_tokens=hybrid_depth, tree_budget=budget, adaptive=False)
    return out


def service_of(name: str) -> str:
    """Which draft service of an RTT a sweep row goes to: `default` rows to the one with the service
    defaults, the fixed-tau and tree rows to the one with --fixed-draft-args."""
    return "defaults" if name.startswith("default") else "fixed"


def run_service(client: Client, kw: dict, prompts: list[str], n: int) -> dict:
    """All prompts, one request at a time: totals, per-prompt (tokens, rounds, seconds) and ids."""
    tot = {k: 0.0 for k in SUMMED}
    ids, per, errors, finish = [], [], [], []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        t1 = time.perf_counter()
        try:
            r = client.generate(prompt=p, max_new_tokens=n, **kw)
        except Exception as e:  # a service error: recorded and reported, the run goes on
            details = e.details() if hasattr(e, "details") else ""
            code = e.code().name if hasattr(e, "code") else type(e).__name__
            errors.append(dict(prompt=i, code=str(code), details=str(details) or repr(e)))
            ids.append(None)
            per.append(None)
            finish.append(None)
            continue
        ids.append(list(r.token_ids))
        finish.append(r.finish_reason)
        for k in SUMMED:
            tot[k] += float(r.stats.get(k, 0) or 0)
        per.append([len(r.token_ids), int(r.stats.get("rounds", 0)), round(time.perf_counter() - t1, 4)])
    wall = time.perf_counter() - t0
    tokens = sum(len(x) for x in ids if x is not None)
    return dict(tokens=tokens, wall_s=wall, tok_s=tokens / wall if wall else 0.0, **tot, per_prompt=per, errors=errors, ids=ids,
                finish=finish)


class HF:
    """transformers' generate(), greedy, in this process: the target loaded once, one torch thread."""

    def __init__(self, target: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(target)
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()

    def run(self, prompts: list[str], n: int) -> dict:
        ids, per = [], []
        t0 = time.perf_counter()
        for p in prompts:
            t1 = time.perf_counter()
            x = self.tok(p, return_tensors="pt").input_ids
            with self.torch.inference_mode():
                o = self.model.generate(x, max_new_tokens=n, do_sample=False, attention_mask=self.torch.ones_like(x),
                                        pad_token_id=self.tok.pad_token_id)[0, x.shape[1]:].tolist()
            ids.append(o)
            per.append([len(o), len(o), round(time.perf_counter() - t1, 4)])
        wall = time.perf_counter() - t0
        tokens = sum(len(x) for x in ids)
        return dict(tokens=tokens, wall_s=wall, tok_s=tokens / wall, rounds=float(tokens), per_prompt=per, errors=[], ids=ids, finish=[])


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else -1


def check(run: dict, ref: list, where: dict, mismatches: list) -> None:
    """Adds a record to `mismatches` for each prompt whose ids differ from the reference's, and
    sets run["ref_tokens"]: the reference's token count over the prompts that ran (the same work
    for every configuration: tokens a run returns past the reference's end are not counted)."""
    run["ref_tokens"] = sum(len(want) for got, want in zip(run["ids"], ref) if got is not None and want is not None)
    for i, (got, want) in enumerate(zip(run["ids"], ref)):
        if got is None or want is None:
            continue
        pos = first_difference(got, want)
        if pos >= 0:
            kind = ("tokens after the reference's EOS" if pos == len(want) and len(got) > len(want)
                    else "stops early" if pos == len(got) else "different token")
            mismatches.append(dict(where, prompt=i, kind=kind, first_difference_at=pos, len=len(got), ref_len=len(want),
                                   got=got[max(pos - 2, 0):pos + 4], want=want[max(pos - 2, 0):pos + 4]))


def strip(run: dict) -> dict:
    """A run without its token ids (kept once, in the reference)."""
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in run.items() if k != "ids"}


def summary(runs: list[dict]) -> dict:
    """The median run by tok/s, plus the pooled numbers of all runs."""
    ok = [r for r in runs if not r["errors"]] or runs
    med = sorted(ok, key=lambda r: r["tok_s"])[len(ok) // 2]
    pooled = {k: sum(r.get(k, 0) for r in ok) for k in ("tokens", "ref_tokens", "wall_s", "rounds", "drafted", "accepted", "tree_rounds", "lookup_rounds",
                                                       "target_only_rounds", "fallback_rounds", "predraft_hits", "predraft_misses",
                                                       "draft_s", "verify_s", "verify_forward_s")}
    rounds = max(pooled["rounds"], 1)
    return dict(tok_s_median=statistics.median(r["tok_s"] for r in ok), tok_s_min=min(r["tok_s"] for r in ok),
                tok_s_max=max(r["tok_s"] for r in ok), tok_s_pooled=pooled["tokens"] / pooled["wall_s"] if pooled["wall_s"] else 0.0,
                tok_s_ref_median=statistics.median(r["ref_tokens"] / r["wall_s"] for r in ok),
                tokens_per_round=pooled["tokens"] / rounds, tokens_per_round_ref=pooled["ref_tokens"] / rounds,
                extra_tokens=pooled["tokens"] - pooled["ref_tokens"], drafted_per_round=pooled["drafted"] / rounds,
                accepted_per_round=pooled["accepted"] / rounds, draft_ms_per_round=1e3 * pooled["draft_s"] / rounds,
                verify_ms_per_round=1e3 * pooled["verify_s"] / rounds, forward_ms_per_round=1e3 * pooled["verify_forward_s"] / rounds,
                tree_share=pooled["tree_rounds"] / rounds, lookup_share=pooled["lookup_rounds"] / rounds,
                target_only_share=pooled["target_only_rounds"] / rounds, fallback_rounds=pooled["fallback_rounds"],
                predraft_hit_rate=pooled["predraft_hits"] / max(pooled["predraft_hits"] + pooled["predraft_misses"], 1),
                median_run=dict(tokens=med["tokens"], wall_s=med["wall_s"], rounds=med["rounds"]), runs=len(runs),
                errors=sum(len(r["errors"]) for r in runs))


def rotate(items: list, k: int) -> list:
    k %= max(len(items), 1)
    out = items[k:] + items[:k]
    return out if k % 2 == 0 else out[::-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tree", description=__doc__.split("\n\n")[0])
    add_pair_args(p)
    p.add_argument("--prompts", type=int, default=5, help="the code prompts from outside the standard library (bench/prompts.py "
                   "CODE_PROMPTS, 5) first, then held-out standard-library prompts (heldout_prompts) up to this many")
    p.add_argument("--tpr-prompts", type=int, default=10, help="prompts of part 1 (tokens per round), from the same list")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rtt-ms", default="0,10,20,50")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--taus", default="2,4,6,8,12", help="the fixed-tau chains of the sweep")
    p.add_argument("--budget", type=int, default=16, help="the sweep's tree budget (nodes per round)")
    p.add_argument("--depths", default="8,16", help="the sweep's tree depth caps (num_draft_tokens)")
    p.add_argument("--extra-budgets", default="32", help="more tree budgets in the sweep, at the largest depth cap (not in the bar)")
    p.add_argument("--render", action="store_true", help="only rewrite TREE.md from OUT/tree.json")
    p.add_argument("--followup", help="with --render: attach DIR/tree.json, a later run (e.g. on newer code), as a short section")
    p.add_argument("--warm-prompts", type=int, default=4, help="held-out prompts (after the measured ones) of the tree-calibration "
                   "warm-up on every draft service before any measured run (0: none)")
    p.add_argument("--warm-tokens", type=int, default=64, help="new tokens per warm-up request")
    p.add_argument("--hybrid-depth", type=int, default=8, help="depth cap of the hybrid tree row (also prompt lookup's cap)")
    p.add_argument("--tpr-budgets", default="8,16,32", help="part 1's tree budgets (empty: skip part 1)")
    p.add_argument("--tpr-depth", type=int, default=16, help="part 1's depth cap and chain length")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="transformers' generate() at RTT 0")
    p.add_argument("--draft-args", default="", help="extra arguments of every draft_service (one string)")
    p.add_argument("--fixed-draft-args", default="--no-draft-fallback",
                   help="extra arguments of the draft services that serve the fixed-tau and tree rows (the `default` rows have their "
                        "own draft services, with the service defaults): without --no-draft-fallback the fallback judge and the "
                        "process-wide model record (draft_service/adaptive.py) turn sessions into target-only rounds, and one "
                        "configuration's sessions would decide another's")
    p.add_argument("--verify-args", default="", help="extra verify_service arguments (one string)")
    a = p.parse_args(argv)
    rtts = [float(x) for x in a.rtt_ms.split(",")]
    n_all = max(a.prompts, a.tpr_prompts)
    code = list(CODE_PROMPTS[:n_all])
    all_prompts = code + (heldout_prompts(n_all - len(code)) if n_all > len(code) else [])
    prompts, tpr_prompts = all_prompts[: a.prompts], all_prompts[: a.tpr_prompts]
    tpr = tpr_configs([int(x) for x in a.tpr_budgets.split(",") if x], a.tpr_depth) if a.tpr_budgets else {}
    if a.render:
        import json  # noqa: PLC0415

        with open(os.path.join(a.out, "tree.json")) as fh:
            res = json.load(fh)
        if a.followup:
            with open(os.path.join(a.followup, "tree.json")) as fh:
                f = json.load(fh)
            res["followup"] = {k: v for k, v in f.items() if k not in ("prompt_texts", "reference_ids", "service_stderr_tails")}
            for by in res["followup"]["sweep"].values():
                for v in by.values():
                    v.pop("all_runs", None)
        if "tie_check" not in res:
            res["tie_check"] = tie_check(res["target"], res.get("verify_dtype", "bfloat16"), res["prompt_texts"], res["reference_ids"],
                                         res["mismatches"])
        res["bars"] = bars(res)
        return write_report(a.out, "tree", "TREE.md", res, render)
    sweep = sweep_configs([int(x) for x in a.taus.split(",")], a.budget, [int(x) for x in a.depths.split(",")], a.hybrid_depth,
                          [int(x) for x in a.extra_budgets.split(",") if x])
    env = dict(ENV, OMP_NUM_THREADS="1")
    checkout = code_state()
    t_start = time.perf_counter()
    started: list[Service] = []
    mismatches: list[dict] = []
    runs: dict[str, dict[str, list]] = {f"{r:g}": {} for r in rtts}  # rtt -> config -> runs
    tpr_runs: dict[str, dict] = {}
    hf_mismatches: list[dict] = []
    ref: list | None = None
    ref_finish: list | None = None
    info = {}
    try:
        verify = Service("verify_service", "--model", os.path.abspath(a.target), "--threads", "1", *a.verify_args.split(), env=env,
                         timeout=300)
        started.append(verify)
        clients: dict[str, dict[str, Client]] = {}  # rtt -> "fixed" / "defaults" -> client
        fixed_args = a.fixed_draft_args.split()
        for rtt in rtts:
            upstream = verify.address
            if rtt > 0:
                proxy = Service("bench.proxy", "--target", verify.address, "--rtt-ms", f"{rtt:g}", env=env, timeout=30)
                started.append(proxy)
                upstream = proxy.address
            clients[f"{rtt:g}"] = {}
            for kind, extra in (("fixed", fixed_args), ("defaults", [])):
                d = Service("draft_service", "--model", os.path.abspath(a.draft), "--verify", upstream, "--threads", "1",
                            *extra, *a.draft_args.split(), env=env, timeout=300)
                started.append(d)
                clients[f"{rtt:g}"][kind] = Client(d.address, timeout=900)
                print(f"[tree] RTT {rtt:g} ms: {kind} draft {d.address} -> {upstream}" + (f" -> {verify.address}" if rtt > 0 else ""),
                      file=sys.stderr, flush=True)
        vclient = Client(verify.address, target_only=True, timeout=900)
        vi = vclient.info()
        info = dict(verify_device=vi.device, verify_dtype=vi.dtype, max_tree_budget=vi.max_tree_budget,
                    draft_dtype=clients[f"{rtts[0]:g}"]["fixed"].info().dtype)
        hf = HF(os.path.abspath(a.target), vi.dtype.removeprefix("torch.")) if a.hf else None
        print(f"[tree] started in {time.perf_counter() - t_start:.0f}s; {info}", file=sys.stderr, flush=True)

        # warm-up: one short request of each kind on every draft service, and the verify service alone
        for key, pair in clients.items():
            for kw in (dict(num_draft_tokens=4, adaptive=False, proposer="draft"),
                       dict(num_draft_tokens=8, tree_budget=a.budget, adaptive=False, proposer="draft")):
                run_service(pair["fixed"], kw, prompts[:1], 8)
            run_service(pair["defaults"], {}, prompts[:1], 8)
        # greedy trees score nodes by acceptance learned from the verdicts (draft_service/tree.py
        # Calibration, per draft model per draft process): warm it on every tree-serving draft service
        # with tree requests on prompts outside the measured ones, so no measured row runs it cold
        warm = heldout_prompts(n_all - len(code) + a.warm_prompts)[n_all - len(code):] if a.warm_prompts else []
        for key, pair in clients.items():  # the `default` rows send no trees: only the fixed services
            run_service(pair["fixed"], dict(num_draft_tokens=a.tpr_depth, tree_budget=a.budget, adaptive=False, proposer="draft"),
                        warm, a.warm_tokens)
        print(f"[tree] calibration warm-up: {len(warm)} prompts x {a.warm_tokens} tokens on each fixed draft service", file=sys.stderr,
              flush=True)
        run_service(vclient, {}, prompts[:1], 8)
        if hf:
            hf.run(prompts[:1], 8)

        # the reference: the verify service alone (its own target-only decoding)
        r = run_service(vclient, {}, all_prompts, a.new_tokens)
        ref, ref_finish = r["ids"], r["finish"]
        runs[f"{rtts[0]:g}"].setdefault(REFERENCE, [])  # this first run is the reference, not timed among the rest
        print(f"[tree] reference (Verify.Generate): {r['tokens']} tokens in {r['wall_s']:.1f}s", file=sys.stderr, flush=True)

        # part 1: tokens per round (RTT 0 service; no pre-drafting, fixed depth)
        first = f"{rtts[0]:g}"
        for name in rotate(list(tpr), 0):
            load = os.getloadavg()[0]
            r = run_service(clients[first]["fixed"], tpr[name], tpr_prompts, a.new_tokens)
            r["load1"] = load
            check(r, ref, dict(part="tokens per round", rtt_ms=rtts[0], config=name, repeat=0), mismatches)
            tpr_runs[name] = strip(r)
            print(f"[tree] tokens/round {name}: {r['tokens'] / max(r['rounds'], 1):.3f} ({r['tok_s']:.1f} tok/s)"
                  + (f" ERRORS {r['errors']}" if r["errors"] else ""), file=sys.stderr, flush=True)

        # part 2: the RTT sweep, order rotating from repeat to repeat
        for rep in range(a.repeats):
            for rtt in rotate(rtts, rep):
                key = f"{rtt:g}"
                names = list(sweep) + ([REFERENCE] + (["hf generate()"] if hf else []) if rtt == 0 else [])
                for name in rotate(names, rep + int(rtt)):
                    load = os.getloadavg()[0]
                    if name == REFERENCE:
                        r = run_service(vclient, {}, prompts, a.new_tokens)
                    elif name == "hf generate()":
                        r = hf.run(prompts, a.new_tokens)
                    else:
                        r = run_service(clients[key][service_of(name)], sweep[name], prompts, a.new_tokens)
                    r["load1"] = load
                    check(r, ref, dict(part="sweep", rtt_ms=rtt, config=name, repeat=rep), hf_mismatches if name == "hf generate()" else mismatches)
                    runs[key].setdefault(name, []).append(strip(r))
                    print(f"[tree] repeat {rep + 1}/{a.repeats} RTT {key} ms {name}: {r['tok_s']:.1f} tok/s, "
                          f"{r['tokens'] / max(r['rounds'], 1):.2f} tokens/round" + (f" ERRORS {r['errors']}" if r["errors"] else ""),
                          file=sys.stderr, flush=True)
    except Exception:
        traceback.print_exc()
        for s in started:
            if s.stderr:
                print(f"--- {' '.join(s.cmd[2:4])} stderr tail:\n{''.join(s.stderr)[-2000:]}", file=sys.stderr)
        raise
    finally:
        service_logs = {" ".join(s.cmd[2:3] + s.cmd[-2:]): "".join(s.stderr)[-4000:] for s in started if s.stderr}
        for s in reversed(started):
            s.stop()

    res = dict(**run_header(a), command=command("bench.tree", argv if argv is not None else sys.argv[1:]),
               prompts=len(prompts), code_prompts=len([p for p in prompts if p in CODE_PROMPTS]), tpr_prompts=len(tpr_prompts),
               tpr_code_prompts=len([p for p in tpr_prompts if p in CODE_PROMPTS]), new_tokens=a.new_tokens,
               repeats=a.repeats, warm_prompts=a.warm_prompts, warm_tokens=a.warm_tokens,
               rtt_ms=rtts, budget=a.budget, taus=a.taus, depths=a.depths, hybrid_depth=a.hybrid_depth,
               tpr_depth=a.tpr_depth, draft_args=a.draft_args, fixed_draft_args=a.fixed_draft_args, verify_args=a.verify_args, cpu_count=os.cpu_count(), **info,
               code=checkout, wall_s=time.perf_counter() - t_start, tpr_configs=tpr, sweep_configs=sweep,
               tpr={k: dict(v, tokens_per_round=v["tokens"] / max(v["rounds"], 1), tokens_per_round_ref=v["ref_tokens"] / max(v["rounds"], 1))
                    for k, v in tpr_runs.items()},
               sweep={key: {name: dict(summary(rs), all_runs=rs) for name, rs in by.items() if rs} for key, by in runs.items()},
               mismatches=mismatches, hf_mismatches=hf_mismatches, prompt_texts=all_prompts, reference_finish=ref_finish, reference_ids=ref, service_stderr_tails=service_logs)
    loads = [r.get("load1", 0) for by in runs.values() for rs in by.values() for r in rs] + [v.get("load1", 0) for v in tpr_runs.values()]
    res["load_range"] = [min(loads, default=0), max(loads, default=0)]
    res["tie_check"] = tie_check(a.target, res.get("verify_dtype", "bfloat16"), all_prompts, ref, mismatches)
    res["bars"] = bars(res)
    return write_report(a.out, "tree", "TREE.md", res, render)


def tie_check(target: str, dtype: str, prompts: list[str], ref: list, mismatches: list[dict]) -> list[dict]:
    """Where a run chose another token than the reference (not a length difference): the target's
    logits there (transformers, in this process, in the services' dtype and in float32, after the
    reference's prefix): the two tokens' logits and the top 3, to tell a near-tie from a wrong verdict."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    spots = sorted({(m["prompt"], m["first_difference_at"], m["got"][min(2, m["first_difference_at"])],
                     m["want"][min(2, m["first_difference_at"])]) for m in mismatches if m["kind"] == "different token"})
    if not spots:
        return []
    path = target if os.path.isabs(target) else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), target)
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(path)
    out = [dict(prompt=p, at=pos, got=g, want=w) for p, pos, g, w in spots]
    for dt in dict.fromkeys([dtype, "float32"]):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dt)).eval()
        for o in out:
            ids = tok(prompts[o["prompt"]]).input_ids + ref[o["prompt"]][: o["at"]]
            with torch.inference_mode():
                lg = model(torch.tensor([ids])).logits[0, -1].float()
            top = torch.topk(lg, 3)
            o[dt] = dict(got_logit=lg[o["got"]].item(), want_logit=lg[o["want"]].item(), top3=top.indices.tolist(),
                         top3_logits=[round(v, 5) for v in top.values.tolist()])
    return out


if __name__ == "__main__":
    sys.exit(main())
