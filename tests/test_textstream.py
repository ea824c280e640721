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


def test_a_stream_that_ends_inside_a_character_loses_nothing(tok):
    """Byte-level tokens may end inside a character, even over several tokens in a row. Each
    complete character counts as soon as its last byte is in, and a stream that ends at any id
    gives the ids' whole decode (a character cut off at the end as U+FFFD, as decode gives it):
    the complete characters after the last token that ended on a character boundary were lost."""
    ids = tok(TEXT)["input_ids"]
    cut = 0
    for k in range(1, len(ids) + 1):
        s = TextStream(tok)
        text = "".join(s.push([t])[1] for t in ids[:k]) + s.finish()
        assert text == tok.decode(ids[:k]), k
        cut += tok.decode(ids[:k]).endswith("\ufffd")
    assert cut  # the text has tokens that end inside a character


def test_a_prompt_cut_inside_a_character_gets_the_character_completed(tok):
    """From a review: a prompt (ids, say a cut reply sent back to continue) that ends inside a
    multi-byte character was dropped as context, so the generated ids that complete the character
    decoded alone, as U+FFFD. The stream now gives the whole character: the prompt's decode
    without its cut character, then the stream, is the whole text."""
    ids = tok(TEXT)["input_ids"]
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert cuts
    for k in cuts:
        s = TextStream(tok, context=ids[:k])
        streamed = "".join(s.push([t])[1] for t in ids[k:]) + s.finish()
        assert tok.decode(ids[:k]).rstrip("\ufffd") + streamed == TEXT, k


def test_a_stop_string_is_found_as_soon_as_its_last_character_is_in(tok):
    """The ids kept end at the one that completes the stop string: none lies wholly after it, and
    a stream that ends right there has stopped (where a token ended inside the next character,
    the stop was found late, or at the end not at all)."""
    ids = tok(TEXT)["input_ids"]
    for i in range(len(TEXT) - 1):
        stop = TEXT[i : i + 2]
        if stop.strip() != stop or TEXT.find(stop) != i:
            continue
        s = TextStream(tok, stop=[stop])
        kept = []
        for t in ids:
            kept += s.push([t])[0]
            if s.stopped:
                break
        assert s.stopped, stop
        assert stop in tok.decode(kept) and stop not in tok.decode(kept[:-1]).rstrip("\ufffd"), (stop, kept)


def test_the_first_token_keeps_its_leading_space_after_the_prompt():
    """A SentencePiece-style (Metaspace) decode drops a first token's leading space: the stream
    decodes its first ids after the prompt's last ones, so the completion joins the prompt as the
    whole decode does ("is Paris.", not "isParis.")."""
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    t.train_from_iterator(["The capital of France is Paris. The capital of Japan is Tokyo."] * 5,
                          trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<eos>"]))
    sp = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", unk_token="<unk>")
    prompt = sp("The capital of France is")["input_ids"]
    full = sp("The capital of France is Paris.")["input_ids"]
    assert full[: len(prompt)] == prompt
    s = TextStream(sp, context=prompt)
    text = s.push(full[len(prompt):])[1] + s.finish()
    assert text == " Paris." and sp.decode(prompt) + text == sp.decode(full)


def test_special_tokens_do_not_grow_the_decode_window(tok):
    """A special token decodes to nothing: the window of ids decoded at each push did not move
    past it, so a long run of them was decoded whole at every push (quadratic, on the event
    loop). They are kept out of it, and the text is the same."""
    s = TextStream(tok)
    word = tok("ok done")["input_ids"]
    kept, text = s.push(word[:1] + [tok.eos_token_id] * 2000 + word[1:])
    assert len(kept) == len(word) + 2000 and len(s.ids) == len(word)
    assert text + s.finish() == "ok done"


def _stream(tok, prompt: list[int], gen: list[int]) -> str:
    s = TextStream(tok, context=prompt)
    return "".join(s.push([t])[1] for t in gen) + s.finish()


def test_a_prompt_cut_anywhere_streams_the_rest_without_stray_replacement_characters(tok):
    """From a review: the prompt's window was decoded and every trailing U+FFFD stripped, so a
    window that started inside a character and decoded to nothing else was taken for new text:
    the first chunk began with U+FFFD. At every cut of a text's ids: a prompt of whole characters
    is followed by exactly the rest of the text's decode; one cut inside a character by the rest
    of the text from its next whole character on, with no U+FFFD."""
    import os

    from transformers import AutoTokenizer

    shipped = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(__file__), "..", "models", "stdlib-code-target"))
    for t, text in ((tok, TEXT), (shipped, "x = '日本語'  # 🎉\ns = '→🎉'\n")):
        ids = t(text, add_special_tokens=False)["input_ids"]
        whole = t.decode(ids)
        for k in range(1, len(ids)):
            prompt, gen = ids[:k], ids[k:]
            out, before = _stream(t, prompt, gen), t.decode(prompt)
            if "\ufffd" not in before:
                assert before + out == whole, k
            else:
                assert "\ufffd" not in out and whole.endswith(out), (k, before, out)


def _byte_fallback_tokenizer():
    """Llama-2 / Mistral style: a SentencePiece-like BPE with byte fallback, which writes 日本語 as
    byte tokens and decodes a run of them that is not whole UTF-8 as one U+FFFD per byte."""
    from tokenizers import Tokenizer, normalizers, processors

    trained = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trained.train_from_iterator(["hello world this is a test of the tokenizer", "the quick brown fox"] * 50,
                                trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    vocab, merges = trained.get_vocab(), []
    import json
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in json.loads(trained.to_str())["model"]["merges"]]
    vocab.update({f"<0x{i:02X}>": len(vocab) + i for i in range(256)})  # the byte tokens
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    t.normalizer = trained.normalizer
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    t.add_special_tokens(["<unk>", "<s>", "</s>"])
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_a_byte_fallback_prompt_ending_in_byte_tokens_streams_clean_text():
    """A byte-fallback decoder turns a window of byte tokens that starts mid-character into one
    U+FFFD per byte; the stream after the text prompt "hello world 日本語" began with four of them."""
    bf = _byte_fallback_tokenizer()
    prompt = bf("hello world 日本語")["input_ids"]
    gen = bf(" 🎉 the fox", add_special_tokens=False)["input_ids"]
    dec = lambda ids: bf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # noqa: E731
    assert set(dec(prompt[-4:])) == {"\ufffd"}  # the window the stream used to decode: bytes of 本 and 語
    assert _stream(bf, prompt, gen) == dec(prompt + gen)[len(dec(prompt)):]


def test_a_byte_fallback_prompt_cut_inside_a_character_streams_the_characters_after_it():
    """From a review: a prompt (ids) that ends inside 日, written as byte tokens (a continuation
    of a reply cut at its length limit), got 日 completed, then every later byte-token character as
    U+FFFD (the next delta's window began at a continuation byte), and a stop string among them was
    never found."""
    from specdec.textstream import TextStream

    bf = _byte_fallback_tokenizer()
    ids = bf("hello 日本語 ok")["input_ids"]
    cut = ids.index(bf.convert_tokens_to_ids("<0x97>")) + 1  # after 日's second byte
    prompt, gen = ids[:cut], ids[cut:]
    assert _stream(bf, prompt, gen) == "日本語 ok"
    ts = TextStream(bf, ["本"], prompt)
    out = "".join(ts.push([t])[1] for t in gen)
    assert ts.stopped and out + ts.finish() == "日"
