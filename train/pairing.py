"""A target and a draft as the services pair them: the draft's tokenizer must give the target's
vocabulary fingerprint (specdec/lm.py; `check_pair` says what differs, specdec/vocabdiff.py), and
a draft with other output rows over the same tokenizer is compared over the target's rows (as
the draft service sends q, draft_service/drafter.py Drafter._fit)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from specdec import vocabdiff
from specdec.lm import vocab_fingerprint
from specdec.v1 import specdec_pb2 as pb


def rows(model) -> int:
    """The model's output rows (its vocabulary size, padding rows included)."""
    return model.get_output_embeddings().weight.shape[0]


def fit_rows(logits: torch.Tensor, n: int) -> torch.Tensor:
    """A draft's logits over the target's `n` output rows (as the draft service sends q, Drafter._fit):
    rows past `n` cut (padding past the shared tokenizer), missing rows -inf (never proposed)."""
    if logits.shape[-1] >= n:
        return logits[..., :n]
    return F.pad(logits, (0, n - logits.shape[-1]), value=float("-inf"))


def feedable(model, ids: torch.Tensor) -> torch.Tensor:
    """`ids` with any past the model's embedding rows (the target's padding rows, never a token) as 0."""
    n = model.get_input_embeddings().num_embeddings
    return ids.masked_fill(ids >= n, 0)


def check_pair(target_tokenizer, target_rows: int, draft_dir, draft_rows: int) -> dict:
    """Whether the draft in `draft_dir` pairs with the target as the draft service pairs them
    (specdec.vocabdiff.paired_fingerprint: the same fingerprint, or other output rows or special-token
    roles over one tokenizer; and the same text rules): both fingerprints, `match`, and `problem`
    saying what differs where they do not pair."""
    dtok = AutoTokenizer.from_pretrained(draft_dir)
    t_fp, d_fp = vocab_fingerprint(target_tokenizer, target_rows), vocab_fingerprint(dtok, draft_rows)
    target = pb.ModelInfo(vocab_fingerprint=t_fp, vocab_size=target_rows, tokenizer=vocabdiff.tokenizer_info(target_tokenizer))
    speaks, how = vocabdiff.paired_fingerprint(target, dtok, draft_rows)
    own = vocabdiff.tokenizer_info(dtok)
    rules = vocabdiff.same_text_rules(target, own.text_rules)
    out = {"target_fingerprint": t_fp, "draft_fingerprint": d_fp, "match": speaks is not None and rules, "paired_by": how,
           "tokenizer_class": type(target_tokenizer).__name__, "draft_tokenizer_class": type(dtok).__name__}
    if speaks is None:
        out["problem"] = vocabdiff.explain(
            pb.ModelInfo(vocab_size=target_rows, tokenizer=vocabdiff.tokenizer_info(target_tokenizer, True)),
            pb.ModelInfo(vocab_size=draft_rows, tokenizer=vocabdiff.tokenizer_info(dtok, True)))
    elif not rules:
        out["problem"] = vocabdiff.text_rules_differ(target, own)
    return out
