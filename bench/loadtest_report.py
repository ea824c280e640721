"""The load tester's report (bench/loadtest.py): REPORT.md from a results dict, with its tables
(every cell; speculative over target-only run by run, where both paths ran; where the time went;
sizing inputs at a p95 ITL target; capacity per path at a per-session rate) and the PNG plots
(matplotlib, Agg). Where a cell ran more than once (`run`), the plots, the sizing and the
capacity tables take the run of median throughput at each level."""
from __future__ import annotations

import math
import os
import statistics

def _ms(x) -> str:
    return "–" if x is None else f"{1000 * x:.0f}" if x >= 0.1 else f"{1000 * x:.1f}"


def _level(cell, runs: bool = False) -> str:
    """The cell's load level, and its run where `runs`."""
    level = f"c={cell['concurrency']}" if cell["mode"] == "closed" else f"{cell['rate']:g} req/s"
    return f"{level}, run {cell.get('run', 1)}" if runs else level


def _at(cell) -> tuple:
    return cell["mode"], cell.get("concurrency"), cell.get("rate")


def typical(cells: list[dict]) -> list[dict]:
    """One cell per tag set and load level: where the level ran more than once, the run of median
    output tok/s in a closed loop, of median e2e p50 latency in an open one (whose tok/s is about
    its offered rate on any path); for an even count the slower of the middle two (lower tok/s,
    higher e2e)."""
    by: dict[tuple, list[dict]] = {}
    for c in cells:
        by.setdefault((_tag_set(c), *_at(c)), []).append(c)
    out = []
    for cs in by.values():
        if cs[0]["mode"] == "closed":
            cs = sorted(cs, key=lambda c: c["summary"]["output_tokens_per_s"])
        else:
            cs = sorted(cs, key=lambda c: -(c["summary"]["e2e_s"]["p50"] or math.inf))
        out.append(cs[(len(cs) - 1) // 2])
    return out


def paired(cells: list[dict]) -> list[str]:
    """Markdown: each speculative closed-loop cell over the target-only cell of the same level,
    run and other tags (bench.loadtest --baseline: the two ran back to back, alternating which
    went first), run by run, and the median ratio. Open-loop cells are left out: at an offered
    rate both paths put out about the same tokens/s."""
    def rest(c):
        return tuple(x for x in _tag_set(c) if x[0] != "path")

    closed = [c for c in cells if c["mode"] == "closed"]
    base = {(rest(c), *_at(c), c.get("run", 1)): c for c in closed if c.get("tags", {}).get("path") == "target-only"}
    rows: dict[tuple, list[tuple[dict, dict]]] = {}
    for c in closed:
        b = base.get((rest(c), *_at(c), c.get("run", 1)))
        if b is not None and c.get("tags", {}).get("path") != "target-only" and c["summary"]["completed"] and b["summary"]["completed"]:
            rows.setdefault((_tag_set(c), *_at(c)), []).append((c, b))
    if not rows:
        return []
    out = ["## Speculative over target-only, run by run", "",
           "Output tok/s of each cell over the target-only cell of the same load and run (with `--baseline` the two ran "
           "back to back, which went first alternating from run to run: each cell's `order` in the JSON), and the median of "
           "those ratios (of an even count, the mean of the middle two, as for the tok/s). Request i takes prompt i mod "
           "the prompts: a ratio marked * compares cells that completed different numbers of requests (one path cut off "
           "by --duration-s), so over partly different prompts.", "",
           "| path / tags | load | runs | tok/s, median | target-only tok/s, median | ratio by run | median ratio |",
           "|---|---|---|---|---|---|---|"]
    for _, pairs in sorted(rows.items(), key=lambda kv: (_group_order(kv[1][0][0]), kv[0][0], kv[0][2] or 0)):
        pairs.sort(key=lambda p: p[0].get("run", 1))
        g = _group_key(pairs[0][0])
        spec = [p[0]["summary"]["output_tokens_per_s"] for p in pairs]
        tonly = [p[1]["summary"]["output_tokens_per_s"] for p in pairs]
        ratios = [a / b if b else math.inf for a, b in zip(spec, tonly)]
        unlike = ["*" if p[0]["summary"]["completed"] != p[1]["summary"]["completed"] else "" for p in pairs]
        out.append(f"| {g} | {_level(pairs[0][0])} | {len(pairs)} | {statistics.median(spec):.1f} | {statistics.median(tonly):.1f} "
                   f"| {' / '.join(f'{r:.2f}{u}' for r, u in zip(ratios, unlike))} | **{statistics.median(ratios):.2f}×** |")
    return out + [""]


def _tags(cell) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(cell.get("tags", {}).items())) or "–"


def _group_order(cell):
    t = cell.get("tags", {})
    rtt = t.get("rtt_ms")
    return (0, float(rtt), "") if isinstance(rtt, (int, float)) else (1, 0.0, _group_key(cell))


def _group_key(cell) -> str:
    t = cell.get("tags", {})
    if "rtt_ms" in t:  # the split topology's groups; a target-only baseline beside them stays apart
        return f"RTT {t['rtt_ms']} ms" + (", path=target-only" if t.get("path") == "target-only" else "")
    return _tags(cell) if t else "all"


def _tag_set(cell) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in cell.get("tags", {}).items()))


def log_x_axis(ax, levels) -> None:
    """A log x axis ticked at exactly `levels`, written as plain numbers."""
    ax.set_xscale("log")
    ax.set_xticks(levels)
    ax.set_xticklabels([f"{v:g}" for v in levels])
    ax.minorticks_off()


def log_y_axis(ax) -> None:
    """A log y axis with readable ticks: 1-2-5 in every decade, so a panel whose data span less
    than a decade still shows several, written as plain numbers."""
    import matplotlib.ticker

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def plot(cells: list[dict], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for mode, xkey, xlabel, name in (("closed", "concurrency", "concurrent sessions (closed loop)", "closed"),
                                     ("open", "rate", "offered load, requests/s (open loop, Poisson)", "open")):
        sel = [c for c in cells if c["mode"] == mode]
        if not sel:
            continue
        groups: dict[str, list[dict]] = {}
        for c in sel:
            groups.setdefault(_group_key(c), []).append(c)
        fig, ax = plt.subplots(figsize=(6, 4))
        for g, cs in sorted(groups.items(), key=lambda kv: _group_order(kv[1][0])):
            cs = sorted(cs, key=lambda c: c[xkey])
            ax.plot([c[xkey] for c in cs], [c["summary"]["output_tokens_per_s"] for c in cs], marker="o", label=g)
        log_x_axis(ax, sorted({c[xkey] for c in sel}))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title("Throughput")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = f"throughput_{name}.png"
        fig.savefig(os.path.join(out_dir, path), dpi=110)
        plt.close(fig)
        made.append(path)

        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for ax, (metric, title) in zip(axes, (("ttft_s", "time to first token"), ("itl_s", "inter-token latency (per request)"),
                                              ("e2e_s", "end-to-end latency"))):
            for j, (g, cs) in enumerate(sorted(groups.items(), key=lambda kv: _group_order(kv[1][0]))):
                cs = sorted(cs, key=lambda c: c[xkey])
                xs = [c[xkey] for c in cs]
                color = f"C{j}"
                for q, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
                    ys = [1000 * c["summary"][metric][q] if c["summary"][metric][q] is not None else math.nan for c in cs]
                    ax.plot(xs, ys, style, color=color, marker="o", markersize=3, label=f"{g} {q}")
            log_x_axis(ax, sorted({c[xkey] for c in sel}))
            log_y_axis(ax)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("ms")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        path = f"latency_{name}.png"
        fig.savefig(os.path.join(out_dir, path), dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def sizing(cells: list[dict], itl_target_ms: float) -> list[str]:
    """Markdown: per RTT, the most concurrent sessions whose p95 ITL meets the target, and what the
    uncontended per-token costs say about draft capacity (the inputs of the replica ratio)."""
    groups: dict[str, list[dict]] = {}
    for c in cells:
        if c["mode"] == "closed" and "draft_ms_per_token" in c["summary"]:
            groups.setdefault(_group_key(c), []).append(c)
    if not groups:
        return []
    t = itl_target_ms / 1000
    out = [f"## Sizing inputs (p95 ITL target {itl_target_ms:g} ms)", "",
           "`c*` = most concurrent sessions measured whose p95 inter-token latency meets the target (what one verify "
           "replica sustains here); `draft ms/token at c=1` = drafting time per output token without contention, so one "
           "draft core feeds about target / that many sessions at the target rate.", "",
           "| RTT / tags | c* | out tok/s at c* | p95 ITL at c* | draft ms/token at c=1 | target forward ms/token at c=1 "
           "| sessions per draft core at the target | draft cores per c* sessions |", "|---|---|---|---|---|---|---|---|"]
    for g, cs in sorted(groups.items(), key=lambda kv: _group_order(kv[1][0])):
        cs = sorted(cs, key=lambda c: c["concurrency"])
        ok = [c for c in cs if c["summary"]["itl_s"]["p95"] is not None and c["summary"]["itl_s"]["p95"] <= t
              and c["summary"]["errors"] == 0 and not c["summary"].get("cancelled_at_deadline")]  # its slowest not dropped
        best = ok[-1] if ok else None
        low = cs[0]["summary"]
        d = low["draft_ms_per_token"] / 1000
        per_core = f"{t / d:.1f}" if d > 0 else "–"  # no drafting (target-only): no draft cores to size
        if best:
            s = best["summary"]
            cores = f"{best['concurrency'] * d / t:.2f}" if d > 0 else "–"
            out.append(f"| {g} | {best['concurrency']} | {s['output_tokens_per_s']:.1f} | {_ms(s['itl_s']['p95'])} ms "
                       f"| {1000 * d:.1f} (c={cs[0]['concurrency']}) | {low['verify_forward_ms_per_token']:.1f} | {per_core} "
                       f"| {cores} |")
        else:
            out.append(f"| {g} | none | – | – | {1000 * d:.1f} (c={cs[0]['concurrency']}) | {low['verify_forward_ms_per_token']:.1f} "
                       f"| {per_core} | – |")
    return out + [""]


def capacity(cells: list[dict], session_tok_s: float) -> list[str]:
    """Markdown: per group (speculative paths beside the target-only baseline, cells tagged
    path=target-only), the most concurrent sessions measured that each still get session_tok_s
    (closed loop: aggregate output tok/s / sessions), and the aggregate there."""
    groups: dict[str, list[dict]] = {}
    for c in cells:
        if c["mode"] == "closed" and c["summary"]["completed"]:
            groups.setdefault(_group_key(c), []).append(c)
    if len(groups) < 2 and not any(c.get("tags", {}).get("path") == "target-only" for c in cells):
        return []
    side = ("speculative beside target-only" if any(c.get("tags", {}).get("path") == "target-only" for c in cells)
            else "per tag set")
    out = [f"## Capacity at {session_tok_s:g} tokens/s per session", "",
           "The most concurrent sessions measured whose per-session rate (aggregate output tok/s / sessions, closed loop) "
           f"still meets the target, with no error and no request cut at the run's end: what one verifier sustains, {side} "
           "(a level that ran more than once: its run of median throughput, the lower of the middle two for an even count).", "",
           "| path / tags | sessions sustained | aggregate tok/s there | per-session tok/s there | highest aggregate tok/s (at sessions) |",
           "|---|---|---|---|---|"]
    for g, cs in sorted(groups.items(), key=lambda kv: _group_order(kv[1][0])):
        cs = sorted(cs, key=lambda c: c["concurrency"])
        ok = [c for c in cs if c["summary"]["output_tokens_per_s"] / c["concurrency"] >= session_tok_s and c["summary"]["errors"] == 0
              and not c["summary"].get("cancelled_at_deadline")]  # a level whose requests outlived the run does not sustain it
        top = max(cs, key=lambda c: c["summary"]["output_tokens_per_s"])
        peak = f"{top['summary']['output_tokens_per_s']:.1f} ({top['concurrency']})"
        if ok:
            s = ok[-1]["summary"]
            out.append(f"| {g} | {ok[-1]['concurrency']} | {s['output_tokens_per_s']:.1f} | {s['output_tokens_per_s'] / ok[-1]['concurrency']:.1f} | {peak} |")
        else:
            out.append(f"| {g} | none | – | – | {peak} |")
    return out + [""]


def render(results: dict, out_dir: str, json_name: str = "loadtest.json") -> str:
    """Write OUT/REPORT.md (and the PNGs) from a results dict; returns the markdown."""
    cells = sorted(results["cells"], key=lambda c: (_group_order(c), c["mode"], c.get("concurrency") or 0, c.get("rate") or 0,
                                                    c.get("run", 1)))
    runs = any(c.get("run", 1) > 1 for c in cells)
    one = typical(cells)
    pngs = plot(one, out_dir)
    m = results.get("meta", {})
    lines = ["# Load test report", ""]
    if m.get("title"):
        lines += [m["title"], ""]
    lines += [f"Generated by `python -m bench.loadtest` ({m.get('created', '')}); raw numbers and every request in "
              f"[`{json_name}`]({json_name}).", ""]
    setup = m.get("setup", {})
    if setup:
        lines += ["| setting | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in setup.items()] + [""]
    lines += ["Latencies in ms. ITL = mean inter-token latency of a request, (last token's arrival − first token's)/(tokens − 1); "
              "tok/s = all output tokens received / cell wall time; acc = drafted tokens accepted.", ""]
    head = ("| RTT / tags | load | done | err | cancelled | req/s | out tok/s | TTFT p50 | p95 | p99 | ITL p50 | p95 | p99 "
            "| e2e p50 | p95 | p99 | acc | tok/round |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cells:
        s = c["summary"]
        err = f"{s['errors']}" + (f" ({', '.join(f'{k}: {v}' for k, v in s['errors_by_code'].items())})" if s["errors"] else "")
        acc = "–" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.2f}"
        tpr = "–" if s.get("tokens_per_round") is None else f"{s['tokens_per_round']:.2f}"
        lines.append(f"| {_group_key(c)} | {_level(c, runs)} | {s['completed']} | {err} | {s['cancelled_at_deadline']} "
                     f"| {s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.1f} | "
                     + " | ".join(_ms(s[k][q]) for k in ("ttft_s", "itl_s", "e2e_s") for q in ("p50", "p95", "p99"))
                     + f" | {acc} | {tpr} |")
    lines.append("")
    lines += paired(cells)
    if any("draft_ms_per_token" in c["summary"] for c in cells):
        lines += ["Where a completed request's time went, per output token (from the draft service's per-request stats): "
                  "drafting on the draft host; waiting for verdicts (network + verify queue + target forward); the "
                  "target forward itself (a batched forward counts in full for every session in the batch).", "",
                  "| RTT / tags | load | draft ms/token | verify wait ms/token | target forward ms/token | chunk gap p50 | p95 | p99 |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in cells:
            s = c["summary"]
            if "draft_ms_per_token" not in s:
                continue
            lines.append(f"| {_group_key(c)} | {_level(c, runs)} | {s['draft_ms_per_token']:.1f} | {s['verify_wait_ms_per_token']:.1f} "
                         f"| {s['verify_forward_ms_per_token']:.1f} | "
                         + " | ".join(_ms(s["chunk_gap_s"][q]) for q in ("p50", "p95", "p99")) + " |")
        lines.append("")
    for p in pngs:
        lines += [f"![{p}]({p})", ""]
    lines += sizing(one, m.get("itl_target_ms", 100.0))
    lines += capacity(one, m.get("session_tok_s", 20.0))
    if m.get("notes"):
        lines += ["## Notes", ""] + [f"* {n}" for n in m["notes"]] + [""]
    md = "\n".join(lines)
    with open(os.path.join(out_dir, "REPORT.md"), "w") as f:
        f.write(md)
    return md
