"""The repository stands on its own: every relative link in its markdown resolves, every
"DESIGN.md §N" names a section that exists, and no tracked file names a path on a build machine."""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from bench.launch import ROOT

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
SECTION_REF = re.compile(r"DESIGN\.md\)?\s*§\s*(\d+)")
# What must not appear: paths of the machines the project was built on. (This file names them,
# so it is the one file not scanned.)
FORBIDDEN = ("/wo" "rk/", "../sha" "red")  # split so this file does not contain them


def tracked(suffix: str = "") -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p and p.endswith(suffix) and os.path.isfile(os.path.join(ROOT, p))]


def text_of(path: str) -> str | None:
    try:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        return None  # binary (images, weights)


def links(markdown: str) -> list[str]:
    prose = CODE_SPAN.sub("", FENCE.sub("", markdown))
    return INLINE_LINK.findall(prose) + REFERENCE_DEF.findall(prose)


def test_link_extraction():
    md = ('See [a](x/y.md#part), ![img](pics/p.png "title") and [site](https://example.com).\n'
          "`[not](a-link)`\n```\n[nor](this)\n```\n[ref]: ../up.md\n")
    assert links(md) == ["x/y.md#part", "pics/p.png", "https://example.com", "../up.md"]


def test_relative_links_in_markdown_resolve():
    broken = []
    for md in tracked(".md"):
        for target in links(text_of(md) or ""):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # a URL, or an anchor in the same file
            path = target.split("#", 1)[0].split("?", 1)[0]
            resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(md), path))
            if not resolved.startswith(ROOT) or not os.path.exists(resolved):
                broken.append(f"{md}: {target}")
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_design_section_references_exist():
    sections = set(re.findall(r"^## (\d+)\. ", text_of("DESIGN.md"), re.M))
    assert sections, "DESIGN.md has numbered sections"
    wrong = []
    for path in tracked():
        text = text_of(path)
        for n in SECTION_REF.findall(text or ""):
            if n not in sections:
                wrong.append(f"{path}: DESIGN.md §{n}")
    assert not wrong, "references to sections DESIGN.md does not have:\n" + "\n".join(wrong)


def test_no_tracked_file_names_a_build_machine_path():
    me = os.path.relpath(__file__, ROOT)
    hits = []
    for path in tracked():
        if path == me:
            continue
        text = text_of(path)
        for bad in FORBIDDEN:
            if text is not None and bad in text:
                line = text[: text.index(bad)].count("\n") + 1
                hits.append(f"{path}:{line}: {bad}")
    assert not hits, "tracked files naming paths outside the repository:\n" + "\n".join(hits)


def test_results_name_no_scratch_folder():
    """A result file (bench/results, deploy/loadtest) records where it was written as a folder of
    the repository or as OUT (bench/cli.py repo_path), never a scratch folder of the machine that
    ran it."""
    hits = [p for p in tracked() if p.startswith(("bench/results/", "deploy/loadtest/")) and "/tmp/" in (text_of(p) or "")]
    assert not hits, "result files naming a scratch folder:\n" + "\n".join(hits)
    # nor the install folder of the machine's Python (a warning's file name in a committed log): site-packages/... only
    installed = re.compile(r"/\S*/(site|dist)-packages/")
    hits = [p for p in tracked() if p.startswith(("bench/results/", "deploy/loadtest/")) and installed.search(text_of(p) or "")]
    assert not hits, "result files naming the machine's Python install folder:\n" + "\n".join(hits)


def test_a_recorded_command_names_its_output_folder_in_repository_terms():
    from bench.cli import command, repo_path

    assert repo_path(os.path.join(ROOT, "bench", "results")) == os.path.join("bench", "results")
    assert repo_path("/somewhere/else") == "OUT" and repo_path(None) is None
    assert command("bench.tree", ["--tpr-budgets", "", "--out", "/somewhere/else"]) == "python -m bench.tree --tpr-budgets '' --out OUT"
    assert command("bench.tree", [f"--out={ROOT}/bench/results"]) == "python -m bench.tree --out=bench/results"
