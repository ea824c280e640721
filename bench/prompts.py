"""Code-completion prompts cut from held-out CPython standard-library files (files the shipped
models never trained on): the text up to and including a `def` line and its first body line."""
from __future__ import annotations

import re

from train.corpus import stdlib_documents

_DEF = re.compile(r"^(\s*)def \w+\(.*\):\s*$", re.M)


def heldout_prompts(n: int, max_chars: int = 800, min_chars: int = 200) -> list[str]:
    """n prompts, one per held-out file at most, in a fixed order."""
    out = []
    for doc in sorted(stdlib_documents("heldout", include_tests=False), key=lambda d: d.name):
        m = next((m for m in _DEF.finditer(doc.text) if m.start() >= min_chars), None)
        if m is None:
            continue
        end = doc.text.find("\n", m.end() + 1)  # keep the first body line (often a docstring)
        text = doc.text[: end + 1 if end > 0 else m.end()]
        out.append(text[-max_chars:])
        if len(out) == n:
            break
    return out
