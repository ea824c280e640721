"""Byte-level BPE tokenizer trained on the training split of the corpus.

Saved as a ``PreTrainedTokenizerFast`` directory, so ``AutoTokenizer.from_pretrained(DIR)``
loads it offline.  Special tokens: ``<|bos|>``, ``<|eos|>`` (end of a document) and
``<|pad|>``.  Byte-level means every string round-trips exactly and no input is unknown.

    python -m train.tokenizer --out runs/tokenizer --vocab-size 8192
"""

from __future__ import annotations

import argparse
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from train.corpus import Document, stdlib_documents

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192,
                    model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it as a transformers fast tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=model_max_length, clean_up_tokenization_spaces=False)


def train_on_documents(docs: Sequence[Document], vocab_size: int = 8192,
                       model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    return train_tokenizer((d.text for d in docs), vocab_size, model_max_length)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory to save the tokenizer to")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--no-tests", action="store_true", help="leave the stdlib test packages out")
    args = ap.parse_args(argv)
    docs = stdlib_documents("train", include_tests=not args.no_tests)
    tok = train_on_documents(docs, args.vocab_size)
    tok.save_pretrained(args.out)
    print(f"trained on {len(docs)} files, vocab {len(tok)} -> {args.out}")


if __name__ == "__main__":
    main()
