"""Sequence-level unlikelihood training against greedy repetition (Welleck et al., 2019, "Neural
Text Generation with Unlikelihood Training", §5.2), for fine-tuning the target.

A small model decoding greedily tends to copy itself: it re-emits the function it just wrote, or a
phrase, again and again. Likelihood training alone does not stop that. Each step of this loss
does two things:
  * the usual next-token cross-entropy on a batch of corpus windows;
  * a greedy continuation of `new` tokens, from a `prefix`-token start of some of those windows.
    Every continuation token that is part of an `ngram`-gram seen earlier in that same continuation
    is pushed down with -log(1 - p(token)).
The penalty is averaged over all continuation tokens, so it fades as the repeats go away. Only
repeats inside the continuation count: copying a name from the prompt is normal in code.
"""
from __future__ import annotations

import torch

from train.loop import causal_lm_loss


def repeated_ngrams(seq: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T] ids -> [B, T] bool: token t lies in an n-gram (a window of n tokens) that already
    started at an earlier position of the same row."""
    out = torch.zeros(seq.shape, dtype=torch.bool)
    for b, row in enumerate(seq.tolist()):
        seen: set[tuple[int, ...]] = set()
        for t in range(len(row) - n + 1):
            gram = tuple(row[t : t + n])
            if gram in seen:
                out[b, t : t + n] = True
            seen.add(gram)
    return out.to(seq.device)


def make_loss(weight: float, batch: int, prefix: int, new: int, ngram: int = 4, pad_token_id: int = 0):
    """The training loss: cross-entropy + weight * the unlikelihood of repeated n-grams in greedy
    continuations of the first `batch` windows (eager only: it decodes inside the step)."""

    def loss_fn(model, windows):
        mle, _ = causal_lm_loss(model, windows)
        starts = windows[:batch, :prefix]
        was_training = model.training
        model.eval()
        with torch.no_grad():
            seq = model.generate(starts, attention_mask=torch.ones_like(starts), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad_token_id)
        model.train(was_training)
        cont = seq[:, prefix:]
        rep = repeated_ngrams(cont, ngram)
        logits = model(input_ids=seq[:, :-1]).logits[:, prefix - 1 :].float()  # predicts cont
        p = torch.softmax(logits, dim=-1).gather(-1, cont[..., None])[..., 0]
        ul = -(torch.log1p(-p.clamp(max=1 - 1e-6)) * rep).sum() / rep.numel()
        return mle + weight * ul, {"mle": mle.detach(), "unlikelihood": ul.detach(), "repeated": rep.float().mean()}

    return loss_fn
