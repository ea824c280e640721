"""Prompt-lookup proposals (model-free): find the most recent earlier occurrence of the longest
suffix n-gram of the sequence and propose the tokens that followed it.

After Saxena 2023, "Prompt Lookup Decoding", and transformers' `prompt_lookup_num_tokens`. The
proposal is deterministic given the sequence, so it is verified as a one-hot q: exact in every
mode."""
from __future__ import annotations


def lookup(ids: list[int], tau: int, max_ngram: int = 3, min_ngram: int = 1, window: int = 4096) -> list[int]:
    """tau tokens continuing the latest earlier match of ids' last n tokens (n from max_ngram down
    to min_ngram), the match's continuation run on where it reaches the end; [] when nothing
    matches. Looks back at most `window` tokens."""
    if tau <= 0:
        return []
    base = max(0, len(ids) - window)
    seq = ids[base:]
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):  # latest first; the suffix itself excluded
            if seq[start : start + n] == suffix:
                # what followed the match, copied on past the sequence's end as LZ77 copies an overlapping match:
                # a text repeating with period p (a run of one token, `0, 0, 0`) proposes tau tokens, not p
                out: list[int] = []
                for i in range(start + n, start + n + tau):
                    out.append(seq[i] if i < len(seq) else out[i - len(seq)])
                return out
    return []
