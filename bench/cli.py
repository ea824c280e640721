"""What the benchmark commands share on the command line and on disk: the model pair and the
results folder (flags and their defaults), and writing a run's JSON and its Markdown report."""
from __future__ import annotations

import argparse
import json
import os
import shlex
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


def pair_run_parser(command: str, max_new_tokens: int, repeats: int, **flags: dict) -> argparse.ArgumentParser:
    """`python -m bench.COMMAND`'s parser: the pair and --out (add_pair_args), each of `flags`
    (--name: add_argument's keywords, e.g. levels=dict(default="1,4")), --max-new-tokens per request
    and --repeats of its measurements."""
    p = argparse.ArgumentParser(prog=f"python -m bench.{command}")
    add_pair_args(p)
    for name, kw in flags.items():
        p.add_argument("--" + name.replace("_", "-"), **kw)
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--repeats", type=int, default=repeats)
    return p


def repo_path(path: str | None) -> str | None:
    """A path as a result records it: relative to the repository's root where it is inside it,
    else "OUT" (a folder of the machine that ran it, which names nothing anywhere else)."""
    if not path:
        return path
    full = os.path.abspath(path)
    return os.path.relpath(full, ROOT) if full == ROOT or full.startswith(ROOT + os.sep) else "OUT"


def command(module: str, argv: list[str]) -> str:
    """The command line a result records, shell-quoted, its --out folder as repo_path gives it."""
    args = list(argv)
    for i, x in enumerate(args):
        if x == "--out" and i + 1 < len(args):
            args[i + 1] = repo_path(args[i + 1])
        elif x.startswith("--out="):
            args[i] = "--out=" + repo_path(x[len("--out="):])
    return shlex.join(["python", "-m", module, *args])


def run_header(a) -> dict:
    """What every result file starts with: when it ran and which models (paths from the checkout):
    the pair, or a target alone where `a` has no draft."""
    out = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), target=os.path.relpath(a.target, ROOT))
    if getattr(a, "draft", None):
        out["draft"] = os.path.relpath(a.draft, ROOT)
    return out


def pair_run(res: dict, where: str = "") -> str:
    """The opening of a pair benchmark's report: "Run DATE[ where]; shipped pair (`target`, `draft`)"."""
    return f"Run {res['date']}{where}; shipped pair (`{res['target']}`, `{res['draft']}`)"


def write_report(out: str, stem: str, report_name: str, res: dict, render) -> int:
    """Writes res to OUT/STEM.json and render(res) to OUT/REPORT_NAME (making OUT) and prints the
    report; returns the command's exit status (0)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    report = render(res)
    with open(os.path.join(out, report_name), "w") as fh:
        fh.write(report)
    print(report)
    return 0
