"""What the benchmark commands share on the command line and on disk: the model pair and the
results folder (flags and their defaults), and writing a run's JSON and its Markdown report."""
from __future__ import annotations

import argparse
import json
import os
import time

from bench.launch import ROOT

TARGET = os.path.join(ROOT, "models", "stdlib-code-target")
DRAFT = os.path.join(ROOT, "models", "stdlib-code-draft")
RESULTS = os.path.join(ROOT, "bench", "results")


def add_pair_args(p: argparse.ArgumentParser, out: bool = True) -> None:
    """--target and --draft (the shipped pair by default) and, with `out`, --out (bench/results)."""
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    if out:
        p.add_argument("--out", default=RESULTS)


def add_run_args(p: argparse.ArgumentParser, max_new_tokens: int, repeats: int | None = None) -> None:
    """--max-new-tokens per request and (when the command repeats its measurements) --repeats."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats)


def run_header(a) -> dict:
    """What every result file starts with: when it ran and which pair (paths from the checkout)."""
    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), target=os.path.relpath(a.target, ROOT),
                draft=os.path.relpath(a.draft, ROOT))


def write_report(out: str, stem: str, report_name: str, res: dict, render) -> str:
    """Writes res to OUT/STEM.json and render(res) to OUT/REPORT_NAME; prints and returns the report."""
    with open(os.path.join(out, f"{stem}.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    report = render(res)
    with open(os.path.join(out, report_name), "w") as fh:
        fh.write(report)
    print(report)
    return report
