"""The engine against what a user would otherwise run: transformers' own generate(), in-process,
same dtype, one torch thread, same prompts (code from outside the standard library), greedy.

    python -m bench.engine [--dtypes float32,bfloat16 --sets code,heldout --max-new-tokens 128 --repeats 2 --out bench/results]

Per prompt set and dtype, in one run, with the models loaded and the services started once; for
each prompt every kind runs back to back, in an order reversed from one prompt to the next (so
drift in the machine's speed hits all kinds alike); tok/s is all tokens over all seconds:
  generate()            transformers, in-process (the baseline every ratio divides by)
  assisted              transformers' assisted generation with the draft (assistant_model=)
  prompt lookup         transformers' prompt_lookup_num_tokens=8
  service target-only   the verify service's Generate through gRPC
  service speculative   both services at their default settings (draft -> verify over loopback)
  ..., draft model only the same with proposer=draft (no prompt lookup)
and the per-round overhead of the services (wall time per round not spent in the target's pass
or the draft's steps), on the shipped pair and on tiny models where the models cost ~nothing.
Reports which greedy outputs equal generate()'s and each other. Writes ENGINE.md and engine.json.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.cli import pair_run_parser
from bench.prompts import CODE_PROMPTS, heldout_prompts
from bench.launch import ENV, Service
from client import Client



class InProcess:
    """transformers, in this process: the target (and the draft, for assisted generation) loaded once."""

    def __init__(self, target: str, draft: str, dtype: str):
        dt = getattr(torch, dtype)
        self.tok = AutoTokenizer.from_pretrained(target)
        self.t = AutoModelForCausalLM.from_pretrained(target, dtype=dt).eval()
        self.d = AutoModelForCausalLM.from_pretrained(draft, dtype=dt).eval()

    def run(self, kind: str, text: str, n: int) -> tuple[int, float, list[int]]:
        """(tokens, seconds, token ids) of one greedy generate() of `kind`."""
        extra = {"generate": {}, "assisted": dict(assistant_model=self.d), "prompt lookup": dict(prompt_lookup_num_tokens=8)}[kind]
        ids = self.tok(text, return_tensors="pt").input_ids
        with torch.inference_mode():
            t0 = time.perf_counter()
            o = self.t.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                                pad_token_id=self.tok.pad_token_id, **extra)[0, ids.shape[1]:].tolist()
        return len(o), time.perf_counter() - t0, o


class Services:
    """Both services on the pair (one thread each), started once: target-only, speculative at the
    service's defaults, and speculative with the draft model as the only proposer."""

    def __init__(self, target: str, draft: str, dtype: str, env_extra: dict | None = None):
        env = dict(ENV, SPECDEC_DTYPE=dtype, **(env_extra or {}))
        # INFO: the engine's load-time choices (specdec.engine) go into the report
        self.v = Service("verify_service", "--model", target, "--threads", "1", "--log-level", "INFO", env=env)
        self.d = Service("draft_service", "--model", draft, "--verify", self.v.address, "--threads", "1", "--log-level", "INFO", env=env)
        self.cv = Client(self.v.address, timeout=300, target_only=True)
        self.cd = Client(self.d.address, timeout=300)

    def run(self, kind: str, ids: list[int], n: int):
        """(tokens, seconds, token ids, stats) of one request of `kind`."""
        c, extra = {"target-only": (self.cv, {}), "speculative": (self.cd, {}), "draft model only": (self.cd, dict(proposer="draft"))}[kind]
        r = c.generate(prompt_ids=ids, max_new_tokens=n, **extra)
        return len(r.token_ids), r.stats["wall_s"], r.token_ids, r.stats

    def close(self) -> None:
        self.cv.close()
        self.cd.close()
        self.d.stop()
        self.v.stop()

    def choices(self) -> dict:
        """What each service's engine chose at load on this CPU (its specdec.engine log lines)."""
        out = {}
        for name, svc in (("verify", self.v), ("draft", self.d)):
            out[name] = []
            for line in svc.stderr:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("logger") == "specdec.engine":
                    out[name].append(rec.get("msg", ""))
        return out


def round_split(stats: dict) -> dict:
    """A speculative request's per-round split: draft steps, target pass, and the rest (overhead)."""
    rounds = max(1, stats["rounds"])
    spent = stats.get("draft_s", 0) + stats.get("verify_forward_s", 0) + stats.get("prefill_s", 0)
    return {"overhead_ms": 1e3 * (stats["wall_s"] - spent) / rounds, "draft_ms": 1e3 * stats.get("draft_s", 0) / rounds,
            "forward_ms": 1e3 * stats.get("verify_forward_s", 0) / rounds, "acceptance": stats.get("acceptance_rate", 0.0),
            "rounds": stats["rounds"], "lookup_rounds": stats.get("lookup_rounds", 0), "target_only_rounds": stats.get("target_only_rounds", 0)}


IN_PROCESS = ("generate", "assisted", "prompt lookup")
THROUGH_SERVICES = ("target-only", "speculative", "draft model only")


def measure(target: str, draft: str, dtype: str, n: int, texts: list[str], ids: list[list[int]], repeats: int,
            kinds=IN_PROCESS + THROUGH_SERVICES, env_extra: dict | None = None) -> dict:
    """Every kind on every prompt, `repeats` times, with the models loaded and the services started
    once: per prompt the kinds run back to back, in an order reversed from prompt to prompt and from repeat to repeat, so
    drift in the machine's speed hits all kinds alike. After one untimed short run of each kind.
    Returns per kind the (tokens, seconds) and the token ids of each run, and the per-round
    splits of the default speculative runs."""
    hf = InProcess(target, draft, dtype) if set(kinds) & set(IN_PROCESS) else None
    svc = Services(target, draft, dtype, env_extra)
    out: dict = {"runs": {k: [] for k in kinds}, "ids": {k: [] for k in kinds}, "split": []}
    try:
        def one(kind: str, i: int, tokens: int):
            if kind in IN_PROCESS:
                return hf.run(kind, texts[i], tokens) + (None,)
            return svc.run(kind, ids[i], tokens)

        for k in kinds:  # warm-up
            one(k, 0, 4)
        for rep in range(repeats):
            for i in range(len(ids)):
                for k in (kinds if (rep + i) % 2 == 0 else kinds[::-1]):
                    print(f"[{dtype}] repeat {rep + 1}/{repeats}, prompt {i + 1}/{len(ids)}: {k}", file=sys.stderr, flush=True)
                    got, secs, toks, stats = one(k, i, n)
                    out["runs"][k].append((got, secs))
                    out["ids"][k].append(toks)
                    if k == "speculative":
                        out["split"].append(round_split(stats))
    finally:
        svc.close()
        out["choices"] = svc.choices()
    return out


def tiny_round(n: int) -> dict:
    """The services' own cost per round, with models that cost almost nothing: a 2-layer, 64-wide
    target and a 1-layer, 32-wide draft (random weights), at a fixed tau=4 from the draft model
    without pre-drafting (the request policy the per-round figures were first measured with), and
    without the draft fallback: the random draft's acceptance is about 0, so the fallback judge
    would turn its sessions into target-only runs, which have no round trip per token to measure."""
    from bench import tinymodels  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="specdec-engine-") as tmp:
        t = tinymodels.build(os.path.join(tmp, "target"), vocab_size=256, hidden=64, layers=2, max_context=1024, seed=0)
        d = tinymodels.build(os.path.join(tmp, "draft"), vocab_size=256, hidden=32, layers=1, max_context=1024, seed=1)
        r = random.Random(0)
        prompts = [[r.randrange(2, 256) for _ in range(24)] for _ in range(8)]
        res = measure(t, d, "float32", n, [], prompts, 1, kinds=("target-only", "speculative"),
                      env_extra={"SPECDEC_ADAPTIVE": "0", "SPECDEC_PREDRAFT": "0", "SPECDEC_PROPOSER": "draft", "SPECDEC_DRAFT_FALLBACK": "0"})
    if any(x["target_only_rounds"] > x["rounds"] // 10 for x in res["split"]):  # a round or so at a request's end has no room
        raise RuntimeError(f"tiny_round: target-only rounds in a speculative run ({res['split']}): not the per-round cost it reports")
    return {"target": "2-layer 64-wide", "draft": "1-layer 32-wide", "requests": len(res["split"]),
            **{k: statistics.median(x[k] for x in res["split"]) for k in ("overhead_ms", "draft_ms", "forward_ms")},
            "target_only_tok_s": rate(res["runs"]["target-only"]), "speculative_tok_s": rate(res["runs"]["speculative"])}


def rate(pairs) -> float:
    return sum(k for k, _ in pairs) / sum(t for _, t in pairs)


def main(argv=None) -> None:
    p = pair_run_parser("engine", 128, 2, dtypes=dict(default="float32,bfloat16"))
    p.add_argument("--sets", default="code,heldout", help="prompt sets: code (CODE_PROMPTS), heldout (held-out stdlib prompts)")
    p.add_argument("--heldout-dtypes", default="float32", help="dtypes the held-out set runs in (float32: `auto` where the row kernel runs)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    results: dict = {"max_new_tokens": a.max_new_tokens, "sets": {}}
    tok = AutoTokenizer.from_pretrained(a.target)
    prompt_sets = {"code": CODE_PROMPTS, "heldout": heldout_prompts(len(CODE_PROMPTS))}
    kinds = ("generate", "assisted", "prompt lookup", "target-only", "speculative", "draft model only")
    for set_name in a.sets.split(","):
        texts = prompt_sets[set_name]
        ids = [tok(t).input_ids for t in texts]
        results["sets"][set_name] = {"prompts": len(texts), "dtypes": {}}
        for dtype in (a.dtypes if set_name == "code" else a.heldout_dtypes).split(","):
            res = measure(a.target, a.draft, dtype, a.max_new_tokens, texts, ids, a.repeats)
            runs, same = res["runs"], res["ids"]
            row: dict = {k: rate(runs[k]) for k in kinds}  # all tokens over all seconds, every repeat and prompt
            row["ratios"] = {k: row[k] / row["generate"] for k in kinds}
            row["per_prompt_ratios"] = {k: [round(x[0] / x[1] / (g[0] / g[1]), 4) for x, g in zip(runs[k], runs["generate"])] for k in kinds}
            row["identical"] = {
                "target-only == generate()": same["target-only"] == same["generate"],
                "speculative == generate()": same["speculative"] == same["generate"],
                "speculative == target-only": same["speculative"] == same["target-only"] == same["draft model only"],
            }
            split = res["split"]
            row["overhead_ms_per_round"] = statistics.median(x["overhead_ms"] for x in split)
            row["acceptance"] = statistics.mean(x["acceptance"] for x in split)
            row["lookup_rounds_share"] = sum(x["lookup_rounds"] for x in split) / max(1, sum(x["rounds"] for x in split))
            row["choices"] = res["choices"]
            results["sets"][set_name]["dtypes"][dtype] = row
    results["tiny"] = tiny_round(a.max_new_tokens)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "engine.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    lines = [f"# Engine vs transformers generate() (greedy, {a.max_new_tokens} tokens, 1 torch thread per process, "
             f"{a.repeats} repeats; per prompt every kind back to back, in alternating order; tok/s = all tokens over all seconds)", "",
             "Prompt sets: `code`, the non-stdlib code prompts of bench/prompts.py (CODE_PROMPTS); `heldout`, as many "
             "prompts cut from held-out standard-library files (heldout_prompts). The service's defaults are adaptive "
             "tau with pre-drafting and hybrid proposals (prompt lookup on a recurring 2-gram, else the draft model); "
             "'draft model only' is the same with `proposer=draft`.", "",
             "| prompts | dtype | what | tok/s | vs generate() |", "|---|---|---|---|---|"]
    labels = {"target-only": "service target-only", "speculative": "service speculative (defaults)",
              "draft model only": "service speculative, draft model only"}
    for set_name, sres in results["sets"].items():
        for dtype, row in sres["dtypes"].items():
            for k in kinds:
                lines.append(f"| {set_name} | {dtype} | {labels.get(k, k)} | {row[k]:.1f} | {row['ratios'][k]:.2f}x |")
    lines += ["", "| prompts | dtype | identical outputs | target-only / generate() per request: median (range) | overhead per round (ms) | acceptance | lookup rounds |",
              "|---|---|---|---|---|---|---|"]
    for set_name, sres in results["sets"].items():
        for dtype, row in sres["dtypes"].items():
            same = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in row["identical"].items())
            per = row["per_prompt_ratios"]["target-only"]
            lines.append(f"| {set_name} | {dtype} | {same} | {statistics.median(per):.2f}x ({min(per):.2f}-{max(per):.2f}) | "
                         f"{row['overhead_ms_per_round']:.2f} | {row['acceptance']:.3f} | "
                         f"{row['lookup_rounds_share']:.0%} |")
    lines += ["", "What each service's engine chose when it loaded its model on this CPU (its log):", ""]
    for set_name, sres in results["sets"].items():
        for dtype, row in sres["dtypes"].items():
            for svc_name, msgs in row["choices"].items():
                lines.append(f"- {set_name}, {dtype}, {svc_name}: " + ("; ".join(msgs) or "nothing logged"))
    lines += ["", "In bfloat16, transformers' generate() rounds differently from the engine (one-row matmuls; the engine makes "
              "its own attention calls, a query at a time in a round), so near-ties can flip between the two; the engine's contract there is speculative == "
              "target-only of the same service, bitwise (DESIGN.md §9)."]
    t = results["tiny"]
    lines += ["", f"Per round with tiny models (a {t['target']} target, a {t['draft']} draft, float32, median over "
              f"{t['requests']} requests): draft steps {t['draft_ms']:.2f} ms, target pass {t['forward_ms']:.2f} ms, "
              f"everything else (gRPC, scheduling, Python) **{t['overhead_ms']:.2f} ms**; target-only "
              f"{t['target_only_tok_s']:.0f} tok/s, speculative {t['speculative_tok_s']:.0f} tok/s."]
    with open(os.path.join(a.out, "ENGINE.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
