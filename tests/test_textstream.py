"""Incremental detokenization and stop strings on a real byte-level BPE tokenizer."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdec.textstream import TextStream

TEXT = "héllo wörld — 日本語のテキスト 🙂 done. def f(x):\n    return x\n"


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator([TEXT] * 3, trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")


def test_multibyte_characters_are_never_split(tok):
    ids = tok(TEXT)["input_ids"]
    assert len(ids) > 20
    s, out = TextStream(tok), []
    for t in ids:  # one token at a time: many tokens are partial UTF-8 sequences
        out.append(s.push([t])[1])
    out.append(s.finish())
    assert "".join(out) == TEXT
    assert all("\ufffd" not in piece for piece in out)


def test_stop_string_ends_the_stream_and_is_not_emitted(tok):
    ids = tok(TEXT)["input_ids"] + [tok.eos_token_id]
    s = TextStream(tok, stop=["テキスト"])
    kept, text = [], ""
    for t in ids:
        k, piece = s.push([t])
        kept += k
        text += piece
        if s.stopped:
            break
    text += s.finish()
    assert s.stopped and text == "héllo wörld — 日本語の"
    assert len(kept) < len(ids) and "テキスト" in tok.decode(kept)  # ids up to the one completing the stop


def test_text_that_may_start_a_stop_string_is_held_back(tok):
    s = TextStream(tok, stop=["wörld!"])
    ids = tok("héllo wörld")["input_ids"]
    streamed = "".join(s.push([t])[1] for t in ids)
    assert not s.stopped and len(streamed) <= len("héllo wörld") - 5
    assert streamed + s.finish() == "héllo wörld"


def test_special_tokens_are_not_in_the_text(tok):
    s = TextStream(tok)
    _, text = s.push(tok("ok")["input_ids"] + [tok.eos_token_id])
    assert text + s.finish() == "ok"
