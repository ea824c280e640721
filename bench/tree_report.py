"""The report of bench/tree.py: TREE.md from the run's results (tree.json), so `python -m bench.tree
--render` rebuilds it without running anything; the bars and the notes are derived from the numbers."""
from __future__ import annotations

REFERENCE = "target-only"


def best_chain(by: dict, key: str = "tok_s_ref_median") -> tuple[str, float]:
    chains = {k: v[key] for k, v in by.items() if k.startswith("chain τ=") and not v["errors"]}
    k = max(chains, key=chains.get) if chains else ""
    return k, chains.get(k, 0.0)


def bars(res: dict) -> dict:
    out = {}
    t = res["tpr"]
    chain = next((k for k in t if k.startswith("chain")), None)
    tree = next((k for k in t if k.startswith("tree B=16 ")), None)
    if chain and tree:
        ratio = t[tree]["tokens_per_round_ref"] / t[chain]["tokens_per_round_ref"]
        out["tokens_per_round"] = dict(tree=tree, chain=chain, ratio=ratio, bar=1.15, met=ratio >= 1.15,
                                       ratio_generated=t[tree]["tokens_per_round"] / t[chain]["tokens_per_round"],
                                       others={k: v["tokens_per_round_ref"] / t[chain]["tokens_per_round_ref"] for k, v in t.items()})
    by = res["sweep"].get("20")
    if by:
        name, chain_tok_s = best_chain(by)
        trees = {k: v["tok_s_ref_median"] for k, v in by.items()
                 if k.startswith(f"tree B={res['budget']} d=") and "hybrid" not in k and not v["errors"]}  # as chains: no errors
        if trees and chain_tok_s:
            tk = max(trees, key=trees.get)
            ratio = trees[tk] / chain_tok_s
            gname, gchain = best_chain(by, "tok_s_median")
            out["rtt20"] = dict(tree=tk, tree_tok_s=trees[tk], best_chain=name, chain_tok_s=chain_tok_s, ratio=ratio, bar=1.2, met=ratio >= 1.2,
                                per_tree={k: v / chain_tok_s for k, v in trees.items()},
                                ratio_generated=by[tk]["tok_s_median"] / gchain if gchain else None)
    return out


def _names(res: dict) -> list[str]:
    names = []
    for by in res["sweep"].values():
        names += [n for n in by if n not in names]
    return names


def _bars(res: dict) -> list[str]:
    L: list[str] = []
    b = res["bars"]
    L += ["## Bars", ""]
    if "tokens_per_round" in b:
        x = b["tokens_per_round"]
        L.append(f"- Tokens per round, tree budget 16 / 16-token chain (draft model alone, adaptive=False, predraft=False, depth cap "
                 f"{res['tpr_depth']}): **{x['ratio']:.3f}×** (bar ≥ {x['bar']}×): **{'met' if x['met'] else 'NOT met'}** "
                 f"(on generated tokens: {x['ratio_generated']:.3f}×).")
    if "rtt20" in b:
        x = b["rtt20"]
        per = ", ".join(f"{k}: {v:.2f}×" for k, v in x["per_tree"].items())
        L.append(f"- tok/s at 20 ms RTT, best tree ({x['tree']}, {x['tree_tok_s']:.1f} tok/s) / best fixed-τ chain "
                 f"({x['best_chain']}, {x['chain_tok_s']:.1f} tok/s): **{x['ratio']:.2f}×** (bar ≥ {x['bar']}×): "
                 f"**{'met' if x['met'] else 'NOT met'}** ({per}; on generated tokens {x['ratio_generated']:.2f}×).")
    mm = res["mismatches"]
    if mm:
        kinds: dict[str, int] = {}
        for m in mm:
            kinds[m["kind"]] = kinds.get(m["kind"], 0) + 1
        L += ["", f"**TOKEN MISMATCH: {len(mm)} (run, prompt) pairs differ from the verify service's own target-only output** "
              f"({', '.join(f'{v} {k}' for k, v in kinds.items())}); the same difference in several runs is one line:", "",
              "| config | prompt | kind | at token | length / reference's | got / want (from 2 before) | runs (part, RTT ms, repeat) |",
              "|---|---|---|---|---|---|---|"]
        groups: dict[tuple, list[str]] = {}
        for m in mm:
            k = (m["config"], m["prompt"], m["kind"], m["first_difference_at"], m["len"], m["ref_len"], str(m["got"]), str(m["want"]))
            groups.setdefault(k, []).append(f"{'part 1' if m['part'] == 'tokens per round' else 'sweep'} {m['rtt_ms']:g}/{m['repeat']}")
        for (cfg, prompt, kind, at, n, rn, got, want), where in groups.items():
            L.append(f"| {cfg} | {prompt} | {kind} | {at} | {n} / {rn} | {got} / {want} | {len(where)}: {', '.join(where)} |")
        bad = sorted({m["config"] for m in mm})
        good = [n for n in _names(res) if n not in bad and n != "hf generate()"] + [n for n in res["tpr"] if n not in bad]
        L += ["", f"Rows with a mismatch: {', '.join(bad)}. Rows without: {', '.join(dict.fromkeys(good))}."]
    else:
        L.append("- Greedy outputs: every run of every configuration, at every RTT, produced exactly the verify service's own "
                 "target-only token ids on every prompt.")
    errs = [(key, name, e) for key, by in res["sweep"].items() for name, v in by.items() for r in v.get("all_runs", []) for e in r["errors"]]
    errs += [("0", name, e) for name, v in res["tpr"].items() for e in v["errors"]]
    if errs:
        L += ["", f"**SERVICE ERRORS: {len(errs)} requests failed:**", ""]
        L += [f"- RTT {k} ms, {n}: prompt {e['prompt']}: {e['code']}: {e['details']}" for k, n, e in errs[:20]]
    L.append("")

    return L


def _part1(res: dict) -> list[str]:
    L: list[str] = []
    t = res["tpr"]
    if t:
        chain = next((k for k in t if k.startswith("chain")), None)
        L += [f"## 1. Tokens per round (RTT 0, {res['tpr_prompts']} prompts, draft model alone, adaptive=False, predraft=False, "
              f"depth cap {res['tpr_depth']}; one run each: the counts do not depend on timing; the trees' on the calibration learned so far)", "",
              "| config | tokens | rounds | **tokens/round** | × chain | tokens/round, generated | drafted nodes/round | accepted/round | "
              "tree rounds | draft ms/round | draft ms/node | verify ms/round (wall) | target pass ms/round | tok/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for k, v in t.items():
            r = max(v["rounds"], 1)
            L.append(f"| {k} | {v['ref_tokens']} | {v['rounds']:.0f} | **{v['tokens_per_round_ref']:.3f}** | "
                     f"{v['tokens_per_round_ref'] / t[chain]['tokens_per_round_ref']:.3f}× | {v['tokens_per_round']:.3f} | "
                     f"{v['drafted'] / r:.2f} | {v['accepted'] / r:.2f} | {100 * v['tree_rounds'] / r:.0f}% | {1e3 * v['draft_s'] / r:.1f} | "
                     f"{1e3 * v['draft_s'] / max(v['drafted'], 1):.2f} | {1e3 * v['verify_s'] / r:.1f} | "
                     f"{1e3 * v['verify_forward_s'] / r:.1f} | {v['ref_tokens'] / v['wall_s']:.1f} |")
        L.append("")

    return L


def _sweep_main(res: dict) -> list[str]:
    L: list[str] = []
    keys = list(res["sweep"])
    names = _names(res)
    L += ["## 2. tok/s against RTT", "",
          f"Median of {res['repeats']} runs per cell (the order of RTTs and of rows rotated between repeats). Chains at fixed τ "
          f"(num_draft_tokens=τ) and trees (tree_budget=B, depth cap d = num_draft_tokens) with adaptive=False; pre-drafting left to "
          "the service default (on); `default` rows send neither num_draft_tokens nor adaptive (adaptive τ up to 8, the services' "
          "defaults, including the draft fallback); hybrid = the default proposer (prompt lookup on a recurring 2-gram, else the "
          "draft model). `target-only` is Verify.Generate on the verify service directly, `hf generate()` transformers' generate() "
          "in the client process (RTT 0 only).", "",
          "| config | " + " | ".join(f"{k} ms tok/s" for k in keys) + " | " + " | ".join(f"{k} ms tok/round" for k in keys) + " |",
          "|---|" + "---|" * (2 * len(keys))]
    for n in names:
        cells = []
        for key in keys:
            v = res["sweep"][key].get(n)
            cells.append("-" if v is None else f"{v['tok_s_ref_median']:.1f}")
        for key in keys:
            v = res["sweep"][key].get(n)
            cells.append("-" if v is None or n == "hf generate()" else f"{v['tokens_per_round_ref']:.2f}")
        L.append(f"| {n} | " + " | ".join(cells) + " |")
    return L


def followup(f: dict, main: dict | None = None) -> list[str]:
    """A later, shorter run of this script (--render --followup DIR) on newer code: its bars, part 1 and tok/s table."""
    code = f.get("code", {})
    L = ["## Check on later code", "",
         f"Run {f['date']}: `{f['command']}`, from commit {code.get('head', '?')}"
         + (f" with uncommitted changes to {', '.join(code['changed'])}" if code.get("changed") else "")
         + f"; {f['repeats']} repeat(s), load {f['load_range'][0]:.1f}–{f['load_range'][1]:.1f}, {f['wall_s'] / 60:.1f} min. "
         "Same machine and counting as above; single runs are noisy, the token counts are not.", ""]
    L += _bars(f)[2:]
    L += _part1(f)
    L += _sweep_main(f)
    if main:
        z, z0 = f["sweep"].get("0", {}), main["sweep"].get("0", {})
        rows = [n for n in z if n in z0 and n.startswith(("tree", "chain τ=4", "chain τ=8"))]
        if rows:
            L += ["", "Per round at RTT 0, this check against the main run above (draft ms / target pass ms): "
                  + "; ".join(f"{n}: {z[n]['draft_ms_per_round']:.1f} / {z[n]['forward_ms_per_round']:.1f} against "
                              f"{z0[n]['draft_ms_per_round']:.1f} / {z0[n]['forward_ms_per_round']:.1f}" for n in rows) + "."]
    return ["#" + line if line.startswith("## ") and i else line for i, line in enumerate(L)]


def render(res: dict) -> str:
    L = ["# Tree speculation against chains", "",
         f"Run {res['date']}; shipped pair (`{res['target']}`, `{res['draft']}`); both services on {res.get('verify_device', '?')} in "
         f"{res.get('verify_dtype', '?')} (the services' `--dtype auto` on this CPU), one torch thread per process, "
         f"{res['cpu_count']} CPU cores shared by everything (verify service, {2 * len(res['rtt_ms'])} draft services, the proxies, the "
         f"client); greedy; up to {res['new_tokens']} new tokens per request (some stop at EOS earlier), one request at a time. "
         f"Prompts: part 1 uses {res['tpr_prompts']} ({res['tpr_code_prompts']} code prompts from outside the standard library, "
         f"bench/prompts.py CODE_PROMPTS, then {res['tpr_prompts'] - res['tpr_code_prompts']} held-out standard-library prompts, "
         f"heldout_prompts), part 2 the first {res['prompts']} of them. Whole run: {res['wall_s'] / 60:.1f} min; the machine's "
         f"1-minute load average during the runs: {res['load_range'][0]:.1f}–{res['load_range'][1]:.1f} (other work shared the 2 cores).", "",
         f"Command: `{res['command']}`" + (f", from commit {res['code']['head']}"
                                          + (f" with uncommitted changes to {', '.join(res['code']['changed'])}" if res['code'].get('changed') else "")
                                          if res.get("code", {}).get("head") else "")
         + (f". {res['code']['note']}" if res.get("code", {}).get("note") else "") + ".", "",
         *([res["context_note"], ""] if res.get("context_note") else []),
         "Per RTT there are two draft services on the same verify service: the fixed-τ and tree rows go to one started with "
         f"`{res.get('fixed_draft_args', '--no-draft-fallback')}` (else the draft-fallback judge and its process-wide model record "
         "turn sessions into target-only rounds, and one configuration's sessions decide the next one's: a trial run of this script with the "
         "defaults (2 prompts, 32 tokens) had the RTT-0 service skip the model in 100% of the rounds of every fixed configuration), the `default` rows "
         "to one with the service defaults. The draft model is the only proposer (`proposer=draft`) except in rows marked hybrid.", "",
         "Counting: **tokens/round** = tokens / rounds (the verifier's bonus token included), summed over the prompts; **tok/s** = "
         "tokens over the wall time of all prompts (client side). Both count the verify service's own target-only output length per "
         "prompt (same work for every row: a run that returns tokens past the reference's end gains nothing from them); the "
         "generated-token versions are in tree.json (`tok_s_median`, `tokens_per_round`). Only ratios within this run count: this shared 2-core machine's "
         "speed drifts.", ""]
    L += _bars(res)
    L += _part1(res)
    L += _sweep_main(res)
    names, keys = _names(res), list(res["sweep"])
    others = [n for n in names if not n.startswith("chain")]
    L += ["", "Against the best fixed-τ chain at the same RTT (median tok/s):", "",
          "| RTT ms | best chain (tok/s) | " + " | ".join(others) + " |", "|---|---|" + "---|" * len(others)]
    for key in keys:
        by = res["sweep"][key]
        bn, bv = best_chain(by)
        cells = [f"{by[n]['tok_s_ref_median'] / bv:.2f}×" if n in by and bv else "-" for n in others]
        L.append(f"| {key} | {bn} ({bv:.1f}) | " + " | ".join(cells) + " |")
    L += per_repeat(res, "20")
    L += ["", "Per round, pooled over all runs. draft ms = the draft service's time proposing in the request's path (a pre-draft "
          "that hits was drafted while the previous round was verified and costs ~0 here); verify ms = from sending a round to its "
          "verdict (wall: RTT, queueing and the target's pass); target pass = the verifier's forward:", "",
          "| RTT ms | config | drafted/round | accepted/round | draft ms/round | verify ms/round | target pass ms/round | pre-draft hits | "
          "tree rounds | lookup rounds | target-only rounds | tok/s min–max |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in keys:
        for n, v in res["sweep"][key].items():
            if n in ("hf generate()", REFERENCE):
                continue
            L.append(f"| {key} | {n} | {v['drafted_per_round']:.2f} | {v['accepted_per_round']:.2f} | {v['draft_ms_per_round']:.1f} | "
                     f"{v['verify_ms_per_round']:.1f} | {v['forward_ms_per_round']:.1f} | {100 * v['predraft_hit_rate']:.0f}% | "
                     f"{100 * v['tree_share']:.0f}% | {100 * v['lookup_share']:.0f}% | {100 * v['target_only_share']:.0f}% | "
                     f"{v['tok_s_min']:.1f}–{v['tok_s_max']:.1f} |")
    hm = res.get("hf_mismatches") or []
    if "hf generate()" in names:
        diff = sorted({(m["prompt"], m["first_difference_at"]) for m in hm})
        L += ["", f"transformers' generate() (in the client process, {res.get('verify_dtype')}, one thread) differs from the verify "
              f"service's target-only output on {len(diff)} of {res['prompts']} prompts"
              + (" (" + ", ".join(f"prompt {p} from token {t}" for p, t in diff) + "): in bfloat16 transformers rounds differently "
                 "from the engine, so near-ties flip (bench/results/ENGINE.md)" if diff else "") + "."]
    L += [""] + notes(res)
    if res.get("followup"):
        L += followup(res["followup"], res)
    if res.get("earlier"):
        L += ["## Earlier runs", ""] + res["earlier"] + [""]
    return "\n".join(L)


def per_repeat(res: dict, key: str) -> list[str]:
    """The bar's RTT, run by run (repeat order; the machine's 1-minute load when the run started):
    the chains and the bar's trees, and each repeat's tree / best chain."""
    by = res["sweep"].get(key)
    if not by:
        return []
    names = [n for n in by if n.startswith("chain τ=") or (n.startswith(f"tree B={res['budget']} d=") and "hybrid" not in n)]
    reps = max(len(by[n].get("all_runs", [])) for n in names)
    if reps < 2:
        return []
    L = ["", f"At {key} ms, run by run (tok/s; the 1-minute load average when the run started):", "",
         "| config | " + " | ".join(f"repeat {i + 1}" for i in range(reps)) + " |", "|---|" + "---|" * reps]
    tok = {n: [r["ref_tokens"] / r["wall_s"] for r in by[n]["all_runs"]] for n in names}
    for n in names:
        L.append(f"| {n} | " + " | ".join(f"{x:.1f} (load {r.get('load1', 0):.1f})" for x, r in zip(tok[n], by[n]["all_runs"])) + " |")
    chains = [n for n in names if n.startswith("chain")]
    for n in names:
        if n.startswith("tree"):
            cells = []
            for i in range(reps):
                best = max((tok[c][i] for c in chains if len(tok[c]) > i), default=0)
                cells.append(f"{tok[n][i] / best:.2f}×" if best and len(tok[n]) > i else "-")
            L.append(f"| {n} / best chain of the repeat | " + " | ".join(cells) + " |")
    return L


def tree_vs_defaults(res: dict) -> dict[str, float]:
    """Per RTT: the best tree row's median tok/s over the best `default` row's."""
    out = {}
    for key, by in res["sweep"].items():
        trees = [v["tok_s_ref_median"] for n, v in by.items() if n.startswith("tree")]
        defaults = [v["tok_s_ref_median"] for n, v in by.items() if n.startswith("default")]
        if trees and defaults:
            out[key] = max(trees) / max(defaults)
    return out


def tree_tpr_spread(sw: dict) -> float | None:
    """The largest relative spread (%) of tokens/round between the runs of one tree row at one RTT."""
    out = None
    for by in sw.values():
        for n, v in by.items():
            rs = [r["ref_tokens"] / max(r["rounds"], 1) for r in v.get("all_runs", [])]
            if n.startswith("tree") and len(rs) > 1:
                out = max(out or 0.0, 100 * (max(rs) / min(rs) - 1))
    return out


def notes(res: dict) -> list[str]:
    """What the tables mean, and what looked odd, from the numbers of this run."""
    N = ["## Notes", ""]
    mm, sw, t = res["mismatches"], res["sweep"], res["tpr"]
    eos = [m for m in mm if m["kind"] == "tokens after the reference's EOS"]
    if eos:
        rows = sorted({m["config"] for m in eos})
        N.append(f"- **Tree rounds return tokens past EOS** ({len(eos)} (run, prompt) pairs, rows: {', '.join(rows)}; no chain row): "
                 "where the reference ends with EOS (id 2) the tree run returns 1-2 more tokens after it (e.g. "
                 f"`{eos[0]['got']}` against `{eos[0]['want']}`). The tables count the reference's length per prompt, so these "
                 "tokens add nothing to tok/s or tokens/round.")
    ties = res.get("tie_check") or []
    if ties:
        dt = res.get("verify_dtype", "bfloat16")
        where = {}
        for m in mm:
            if m["kind"] == "different token":
                where.setdefault((m["prompt"], m["first_difference_at"]), set()).add(f"{m['config']} ({m['part']}, RTT {m['rtt_ms']:g})")
        n_diff = sum(1 for m in mm if m["kind"] == "different token")
        cfgs = sorted({m["config"] for m in mm if m["kind"] == "different token"})
        N.append(f"- **Different tokens** in {n_diff} (run, prompt) pairs (rows: {', '.join(cfgs)}). The target's logits "
                 "there, recomputed with transformers after the reference's prefix:")
        for o in ties:
            a = o.get(dt, {})
            f = o.get("float32", {})
            N.append(f"  - prompt {o['prompt']}, token {o['at']} ({', '.join(sorted(where.get((o['prompt'], o['at']), [])))}): the tree run "
                     f"took {o['got']}, the reference {o['want']}; {dt}: {a.get('got_logit', float('nan')):.5f} vs "
                     f"{a.get('want_logit', float('nan')):.5f}; float32: {f.get('got_logit', float('nan')):.5f} vs "
                     f"{f.get('want_logit', float('nan')):.5f} (top 3 in float32: {f.get('top3')}).")
        N.append("  Gaps this small (about one bfloat16 step at these magnitudes, or an exact tie) are near-ties, which any change in "
                 "the order of the arithmetic can flip; the engine's contract for chains is bitwise equality with target-only "
                 "(DESIGN.md §9), and the runs above did not keep it for such near-ties.")
    defaults = {(key, n): by[n]["target_only_share"] for key, by in sw.items() for n in by if n.startswith("default") and key != "0"}
    if defaults:
        lo, hi = min(defaults.values()), max(defaults.values())
        N.append(f"- The `default` rows (adaptive τ, draft fallback, the pace; the services' defaults) spend {100 * lo:.0f}-{100 * hi:.0f}% of "
                 "their rounds at RTT > 0 as target-only steps: runs the verifier streams without a round trip per token "
                 "(draft_service/adaptive.py `Pace`), close to the target alone's speed whatever the RTT. That is how they beat "
                 "fixed chains once the link has a delay. The 20 ms bar compares "
                 "the tree with fixed-τ chains only, as asked. The best tree against the best default row, per RTT: "
                 + ", ".join(f"{key} ms {vs:.2f}×" for key, vs in tree_vs_defaults(res).items()) + ".")
    z = sw.get("0", {})
    trees = [n for n in z if n.startswith("tree") and "hybrid" not in n]
    chains = [n for n in z if n.startswith("chain")]
    if trees and chains:
        def per(n):
            v = z[n]
            return (f"{n}: {v['draft_ms_per_round']:.1f} ms for {v['drafted_per_round']:.1f} nodes "
                    f"({v['draft_ms_per_round'] / max(v['drafted_per_round'], 1e-9):.2f} ms/node), target pass {v['forward_ms_per_round']:.1f} ms")
        N.append("- Draft time per round (sweep, RTT 0, pooled; the time the decode loop waits for a proposal, so pre-drafts that hit "
                 "count as ~0): " + "; ".join(per(n) for n in trees + chains) + ". A tree drafts a level per draft forward, so a node "
                 "costs less than a chain token, but it sends more rows to the verifier per round.")
    if t:
        ch = next((k for k in t if k.startswith("chain")), None)
        if ch:
            tr = next((k for k in t if k.startswith("tree B=16 ")), None)
            line = (f"- Part 1 and part 2 use different prompt sets ({res['tpr_prompts']} against {res['prompts']} prompts) and part 2 "
                    "pre-drafts, so their tokens/round differ; compare within a table. In part 1 the 16-token chain drafts "
                    f"{t[ch]['drafted'] / max(t[ch]['rounds'], 1):.1f} tokens per round and gets {t[ch]['accepted'] / max(t[ch]['rounds'], 1):.2f} "
                    "accepted")
            if tr:
                a_ch, a_tr = t[ch]["accepted"] / max(t[ch]["rounds"], 1), t[tr]["accepted"] / max(t[tr]["rounds"], 1)
                line += (f"; the 16-node tree drafts {t[tr]['drafted'] / max(t[tr]['rounds'], 1):.1f} nodes and gets "
                         f"{a_tr:.2f} ({a_tr / a_ch:.2f}× the chain's accepted tokens per round)")
            N.append(line + ".")
    N.append(f"- Timing noise: the runs of one cell spread widely (the min–max column) with the other jobs sharing the 2 cores "
             f"(load {res['load_range'][0]:.1f}–{res['load_range'][1]:.1f}); the medians of {res['repeats']} interleaved "
             "repeats are what the tables show (of 2 runs: their mean). The tokens do not depend on timing (greedy); a chain's "
             "rounds do not either (fixed τ), a greedy tree's shape follows the acceptance calibration learned from the draft "
             "service's earlier tree rounds, so its tokens/round moves a little from run to run"
             + (f" (here {tree_tpr_spread(sw):.1f}% at most between a tree row's runs)" if tree_tpr_spread(sw) is not None else "") + ".")
    N += res.get("extra_notes", [])
    N.append("")
    return N
