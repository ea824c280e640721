"""Prompt sets for the benchmarks and the load tester, all cut from code the shipped models never
trained on: the held-out split of the CPython standard library (train/corpus.py), less the
prompts whose text is also in a trained copy of a stdlib module inside an installed package
(`VENDORS`: setuptools' copy of distutils, for one).

* `heldout_prompts`: code-completion prompts, the text up to and including a `def` line and its
  first body line, one per held-out file, in a fixed order (bench.run, bench.concurrency);
* `stdlib_snippets`: snippets that START at a `def`/`class` line and stop at a line boundary,
  shuffled (bench.loadtest `--prompts stdlib`);
* `load_prompts`: the load tester's `--prompts` choice: `stdlib`, `builtin` or a file;
* `CODE_PROMPTS` (from train/code_prompts.py, which the model card's quality figures use too):
  code that uses libraries from outside the standard library (bench.engine, bench.policy).
"""
from __future__ import annotations

import functools
import itertools
import json
import random
import re

from train.code_prompts import CODE_PROMPTS  # noqa: F401 - one prompt set for the benchmarks and the model card
from train.corpus import package_documents, stdlib_documents

BUILTIN_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef walk_python_files(root):\n    \"\"\"Yield the path of every .py file under root.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def parse_header(line):\n    key, _, value = line.partition(':')\n",
    "def read_config(path):\n    import json\n    with open(path) as f:\n",
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n",
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n",
    "def flatten(items):\n    for item in items:\n        if isinstance(item, (list, tuple)):\n",
    "def quote(s):\n    \"\"\"Return s with special characters escaped.\"\"\"\n",
    "def chunks(seq, n):\n    \"\"\"Yield successive n-sized chunks from seq.\"\"\"\n",
    "async def fetch_all(urls):\n    results = []\n    for url in urls:\n",
]

_DEF = re.compile(r"^(\s*)def \w+\(.*\):\s*$", re.M)


# Installed packages of the shipped models' training corpus (models/training.json) that carry
# copies of standard-library modules (setuptools' distutils and importlib_metadata, pip's
# vendored ones): the stdlib split is by path, so a held-out module can have a trained copy there.
VENDORS = ("setuptools", "pip", "pkg_resources", "wheel")
SEEN_CHARS = 300  # a prompt whose last this many characters are in such a trained copy is left out


@functools.cache
def _trained_copies() -> str:
    """The training-split text of the installed VENDORS, one string (read once per process)."""
    docs = []
    for name in VENDORS:
        try:
            docs += package_documents(name, "train")
        except FileNotFoundError:  # not installed here
            continue
    return "\n".join(d.text for d in docs)


def _unseen(prompt: str) -> bool:
    return prompt[-SEEN_CHARS:] not in _trained_copies()


def heldout_documents() -> list[tuple[str, str]]:
    """(name, text) of the held-out stdlib files (train/corpus.py), sorted by name."""
    return sorted(((d.name, d.text) for d in stdlib_documents("heldout", include_tests=False)), key=lambda d: d[0])


def heldout_prompts(n: int, max_chars: int = 800, min_chars: int = 200) -> list[str]:
    """n completion prompts, one per held-out file at most, in a fixed order; each ends at the end
    of a line, without the newline (see CODE_PROMPTS)."""
    out = []
    for _, text in heldout_documents():
        m = next((m for m in _DEF.finditer(text) if m.start() >= min_chars), None)
        if m is None:
            continue
        end = text.find("\n", m.end() + 1)  # keep the first body line (often a docstring), not its newline
        prompt = text[: end if end > 0 else m.end()][-max_chars:]
        if _unseen(prompt):  # two of the first 20 were in setuptools' trained copies (distutils, importlib_metadata)
            out.append(prompt)
        if len(out) == n:
            break
    return out


def _snippets(text: str, max_chars: int) -> list[str]:
    """Snippets of `text` that start at a def/class line and stop at a line boundary, so the
    model continues inside a definition."""
    lines = text.splitlines(keepends=True)
    out = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("def ", "class ", "async def ")) and line.rstrip().endswith(":"):
            snippet = ""
            for nxt in lines[i:]:
                if len(snippet) + len(nxt) > max_chars:
                    break
                snippet += nxt
            if snippet.count("\n") >= 2:
                out.append(snippet)
    return out


def stdlib_snippets(n: int, max_chars: int, seed: int) -> list[str]:
    """n snippets from the held-out files, shuffled by `seed` ([] if there are none)."""
    pool = [s for _, text in heldout_documents() for s in _snippets(text, max_chars)]
    random.Random(seed).shuffle(pool)
    return list(itertools.islice(filter(_unseen, pool), n))


def load_prompts(source: str, n: int = 256, max_chars: int = 400, seed: int = 0) -> list[str]:
    """The load tester's prompt set: `builtin`, `stdlib`, or a file of one JSON string or
    {"prompt": ...} object per line (plain text lines work too); each cut to max_chars."""
    if source == "builtin":
        return [p[:max_chars] for p in BUILTIN_PROMPTS]
    if source == "stdlib":
        return stdlib_snippets(n, max_chars, seed) or [p[:max_chars] for p in BUILTIN_PROMPTS]
    prompts = []
    with open(source, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompts.append(obj["prompt"] if isinstance(obj, dict) else str(obj))
            except (json.JSONDecodeError, KeyError):
                prompts.append(line.rstrip("\n"))
    if not prompts:
        raise SystemExit(f"no prompts in {source}")
    return [p[:max_chars] for p in prompts]
