"""bench.gpu's pass log and report: each pass's kind and device span, a graph's replay time, and
GPU.md / gpu.json / gpu.png."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch


class PassLog:
    """The bench's own wrapper on the engine's forward: per pass, whether it held prefill chunks
    (the packed eager pass) or rounds only (uniform: a graph where captured), and its span on the
    device (CUDA events around the call; on the CPU the call's wall time)."""

    def __init__(self, engine):
        self.passes: list[tuple[bool, object, object]] = []
        forward = engine.forward
        cuda = engine.device.type == "cuda"

        def logged(inputs, caches, logits=True, padded=False, **kw):
            prefill = not logits if isinstance(logits, bool) else not all(logits)
            a = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if cuda:
                a.record()
            out = forward(inputs, caches, logits, padded, **kw)
            b = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if cuda:
                b.record()
            self.passes.append((prefill, a, b))
            return out

        engine.forward = logged

    def summary(self) -> dict:
        """{kind: [passes, mean ms]} for the passes logged since the last summary."""
        out: dict = {}
        for prefill, a, b in self.passes:
            ms = a.elapsed_time(b) if hasattr(a, "elapsed_time") else 1e3 * (b - a)
            n, total = out.get("with_prefill" if prefill else "rounds_only", (0, 0.0))
            out["with_prefill" if prefill else "rounds_only"] = (n + 1, total + ms)
        self.passes.clear()
        return {k: [n, total / n] for k, (n, total) in out.items()}


def replay_ms(engine, sessions: int, rows: int) -> float | None:
    """Device milliseconds of one replay of the CUDA graph most used for `sessions` sessions' rounds
    of `rows` rows (median of 20, timed with CUDA events), or None where none was captured."""
    u = engine.uniform
    shape = u.shape([rows] * sessions) if u is not None and u.graphs else None
    graph = u.graph(*shape) if shape is not None else None
    if graph is None:
        return None
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def checkpoint(res: dict, out: str) -> None:
    """gpu.json after each stage, so a run cut short still leaves what it measured."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res), file=sys.stderr, flush=True)


def write(res: dict, out: str) -> None:
    checkpoint(res, out)
    g = res["generate_tok_s"]
    c = res.get("generate_compiled")
    cg = c["tok_s"] if c and c["error"] is None else None

    def vs(x: float) -> str:
        return f"{x / g:.2f}x | " + (f"{x / cg:.2f}x" if cg else "-")

    lines = [f"# Engine on {res['device']}: random {res['shape']} {res['dims']}, {res['dtype']}, prompt {res['prompt_len']}, "
             f"{res['tokens']} tokens, greedy, CUDA graphs {'on' if res['cuda_graphs'] else 'off'}, compiled modules "
             f"{res.get('compiled_layers', 0)}, {res.get('max_prefill_rows', 1024)} prefill rows a pass; generate() and target-only: "
             f"median of {len(res['generate_runs_tok_s'])} alternating runs", "",
             "| what | tok/s | vs generate() | vs compiled generate() | identical to generate() |", "|---|---|---|---|---|",
             f"| transformers generate() | {g:.1f} | 1.00x | - | - |"]
    if c:  # the compile's own mode: reduce-overhead (CUDA graphs) on cuda, default on the CPU
        what = f"generate(), static cache + torch.compile {c['mode']}{' (CUDA graphs)' if c['mode'] == 'reduce-overhead' else ''}"
        error = " ".join((c["error"] or "").split())[:120].replace("|", "/")
        lines.append(f"| {what}; warm-up {c['warmup_s']:.1f} s | {c['tok_s']:.1f} | {c['tok_s'] / g:.2f}x | 1.00x | {c['equals_generate']} |"
                     if c["error"] is None else f"| {what}: failed ({error}) | - | - | - | - |")
    lines.append(f"| scheduler target-only | {res['target_only_tok_s']:.1f} | {vs(res['target_only_tok_s'])} | {res['target_only_equals_generate']} |")
    if "target_only_uncompiled_tok_s" in res:
        lines.append(f"| scheduler target-only, layers uncompiled | {res['target_only_uncompiled_tok_s']:.1f} "
                     f"| {vs(res['target_only_uncompiled_tok_s'])} | - |")
    if "target_only_packed_tok_s" in res:
        lines.append(f"| scheduler target-only, packed eager pass (no uniform shapes, no graphs) | {res['target_only_packed_tok_s']:.1f} "
                     f"| {vs(res['target_only_packed_tok_s'])} | - |")
    for alpha, r in res["speculative"].items():
        lines.append(f"| speculative tau={res['tau']}, forced acceptance alpha={alpha} ({r['tokens_per_round']:.2f} tokens/round, draft cost 0) "
                     f"| {r['tok_s']:.1f} | {vs(r['tok_s'])} | {r['equals_generate']} |")
    one = res["batch"].get("1", {}).get("tok_s")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    def kinds(k: dict) -> str:
        return ", ".join(f"{n} x {t:.1f} ms" + (" (prefill)" if kind == "with_prefill" else "") for kind, (n, t) in k.items()) or "-"

    lines += ["", "Passes (a round's pass: from the engine's start to the verdicts on the host; device: a replay of its CUDA graph; "
              "1 - device / pass: the replay timed apart against the in-run mean, whose passes also hold prompt chunks, so it "
              "is not the host's share of a pass (the profiler's kernel tables are); GB/s: weights plus the keys and values read, over the pass; passes: rounds-only "
              "and with prompt chunks, count x mean device span):", "",
              "| sessions | tau | total tok/s | x one session | tokens/round | sessions/pass | round ms | pass ms | device ms | 1 - device / pass | GB/s "
              "| passes |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [("1 (target-only)", 0, res["target_only"])] + [(k, res["tau"], r) for k, r in res["batch"].items()]
    for k, tau, r in rows:
        x = f"{r['tok_s'] / one:.1f}x" if one and tau else "-"
        share = "-" if r["host_share"] is None else f"{100 * r['host_share']:.0f}%"
        lines.append(f"| {k} | {tau} | {r['tok_s']:.1f} | {x} | {r['tokens_per_round']:.2f} | {r['sessions_per_pass']:.1f} | {r['round_ms']:.2f} "
                     f"| {r['pass_ms']:.2f} "
                     f"| {ms(r['graph_replay_ms'])} | {share} | {r['bandwidth_gb_s']:.0f} | {kinds(r.get('pass_kinds', {}))} |")
    if "graphs" in res:
        gr = res["graphs"]
        lines += ["", f"CUDA graphs: {gr['captured']} captured in {gr['capture_s']:.2f} s in all, {gr['memory_bytes'] / 2**20:.0f} MiB "
                  "of device memory reserved while capturing. The first target-only stage (two sessions, their captures "
                  f"included; compiled layers compile at load) took {res.get('first_target_only_s', float('nan')):.1f} s."]
    lines += ["", "Forced acceptance (benchmark only, `Scheduler(forced_acceptance=...)`): each proposal of a round is accepted with "
              "probability alpha until the first rejection, and the round commits those proposals (the engine's own target-only "
              "output) and the target's token after them. Random weights have near-tied logits that no draft predicts, so this "
              "is how a round's cost at a given acceptance is measured; the verify pass itself is the real one."]
    if "host_ops_per_token" in res:
        h = res["host_ops_per_token"]
        lines += ["", f"Host-side profiler events per token ({h['tokens']} tokens, prefill included): target-only {h['target_only']:.0f}, "
                  f"generate() {h['generate']:.0f} (tables: profile_target_only.txt, profile_generate.txt)"]
    with open(os.path.join(out, "GPU.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        ks = list(res["batch"])
        plt.figure(figsize=(5, 3.5))
        plt.plot([int(k) for k in ks], [res["batch"][k]["tok_s"] for k in ks], marker="o")
        plt.xscale("log", base=2)
        plt.xlabel("concurrent sessions")
        plt.ylabel("total tokens/s")
        plt.title(f"verify batch throughput ({res['shape']}, {res['device']})")
        plt.tight_layout()
        plt.savefig(os.path.join(out, "gpu.png"), dpi=100)
    except ImportError:
        pass
    print("\n".join(lines))
