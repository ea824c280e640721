"""Prompt-lookup proposals (model-free): find the most recent earlier occurrence of the longest
suffix n-gram of the sequence and propose the tokens that followed it.

After Saxena 2023, "Prompt Lookup Decoding", and transformers' `prompt_lookup_num_tokens`. The
proposal is deterministic given the sequence, so it is verified as a one-hot q: exact in every
mode."""
from __future__ import annotations


def lookup(ids: list[int], tau: int, max_ngram: int = 3, min_ngram: int = 1, window: int = 4096) -> list[int]:
    """tau tokens continuing the latest earlier match of ids' last n tokens (n from max_ngram down
    to min_ngram), the match's continuation run on where it reaches the end; [] when nothing
    matches. Looks back at most `window` tokens. The search is str.rfind over the tokens as one
    character each (a Python scan of the window cost 1.5 ms a round at 4,096 tokens where nothing
    matched; this, 0.1 ms)."""
    if tau <= 0:
        return []
    seq = ids[max(0, len(ids) - window):]
    try:
        text = "".join(map(chr, seq))
    except (ValueError, OverflowError):  # an id past the last code point (U+10FFFF): no vocabulary is that large
        return []
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        start = text.rfind(text[-n:], 0, len(text) - 1)  # latest first; ends before the last token: not the suffix itself
        if start < 0:
            continue
        # what followed the match, copied on past the sequence's end as LZ77 copies an overlapping match:
        # a text repeating with period p (a run of one token, `0, 0, 0`) proposes tau tokens, not p
        out: list[int] = []
        for i in range(start + n, start + n + tau):
            out.append(seq[i] if i < len(seq) else out[i - len(seq)])
        return out
    return []
