"""What differs between two tokenizers whose vocabulary fingerprints (specdec/lm.py) do not match.

Each service describes its tokenizer in ModelInfo.tokenizer (TokenizerInfo): the class
AutoTokenizer resolved, how many tokens it knows, its special tokens, and on request
(InfoRequest.include_vocab) every token by id. `explain` turns two descriptions into one line
naming what differs: the vocabulary sizes, the first differing ids, the special tokens, the
classes. It explains a refusal; the fingerprints decide one, and so does `text_rules`, a
digest of how a tokenizer turns text into ids and back: one vocabulary can be split or marked
differently (a lowercasing normalizer, no BOS), and the draft tokenizes text prompts and decodes
the output."""
from __future__ import annotations

import hashlib
import json
import weakref

from specdec.v1 import specdec_pb2 as pb

ROLES = ("bos", "eos", "pad", "unk")
SHOW_IDS = 3  # differing ids named in the message


def adds_special_tokens(tokenizer) -> bool:
    """Whether the tokenizer adds tokens of its own (BOS, ...) to a text by default."""
    probe = "a"
    return tokenizer(probe, add_special_tokens=True)["input_ids"] != tokenizer(probe, add_special_tokens=False)["input_ids"]


def id_ordered(tokenizer) -> list[str]:
    """Token strings by id ("" where no token has an id below the largest)."""
    vocab = tokenizer.get_vocab()
    out = [""] * (max(vocab.values(), default=-1) + 1)
    for tok, i in vocab.items():
        out[i] = tok
    return out


_RULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> text_rules (Info is polled every 2 s)


def chat_template_digest(tokenizer) -> str:
    """TokenizerInfo.chat_template: a digest of the tokenizer's chat template(s), "" without one."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return ""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()


def text_rules(tokenizer) -> str:
    """TokenizerInfo.text_rules: a digest of the `tokenizers` backend's whole definition but its
    truncation and padding settings, and of whether it adds special tokens; "" without a backend."""
    if tokenizer not in _RULES:
        _RULES[tokenizer] = _text_rules(tokenizer)
    return _RULES[tokenizer]


def _text_rules(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    spec = json.loads(backend.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    spec["adds_special_tokens"] = adds_special_tokens(tokenizer)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def same_text_rules(target: pb.ModelInfo, own: str) -> bool:
    """Whether the target's tokenizer turns text into ids as the draft's does (`own`: its
    TokenizerInfo.text_rules); true where either side cannot tell (an older verify service)."""
    theirs = target.tokenizer.text_rules if target.HasField("tokenizer") else ""
    return not theirs or not own or theirs == own


def paired_fingerprint(target, tokenizer, rows: int) -> tuple[str | None, str]:
    """How a draft with `tokenizer` and `rows` output rows pairs with the target that ModelInfo
    `target` describes, as the draft service pairs them (draft_service/upstream.py) and train/
    checks its drafts: (the fingerprint the draft speaks, or None where the vocabularies differ;
    how: "same", "rows" (the target's model has other output rows over the same tokenizer: q goes
    over the target's rows) or "roles" (the same tokens and ids, other special-token roles: a base
    model's EOS beside its instruct model's; only where both tokenizers' text rules are known,
    since one without them adds its BOS by role)). Text rules are compared apart
    (same_text_rules)."""
    from specdec.lm import vocab_fingerprint  # noqa: PLC0415 - the model libraries load where a pairing is judged

    want = target.vocab_fingerprint
    if want == vocab_fingerprint(tokenizer, rows):
        return want, "same"
    if target.vocab_size and target.vocab_size != rows and want == vocab_fingerprint(tokenizer, target.vocab_size):
        return want, "rows"
    info = target.tokenizer if target.HasField("tokenizer") else None
    if info is not None and info.text_rules and text_rules(tokenizer):
        roles = {}
        for role, text in info.special_tokens.items():
            try:
                roles[role] = int(text.rsplit("=", 1)[1])
            except (IndexError, ValueError):
                roles[role] = None
        if want == vocab_fingerprint(tokenizer, target.vocab_size or rows, roles):
            return want, "roles"
    return None, ""


def text_rules_differ(target: pb.ModelInfo, own: pb.TokenizerInfo) -> str:
    """One line on a pair with one vocabulary whose tokenizers turn text into ids differently."""
    what = (f"the target's adds special tokens (such as BOS) to a prompt {'and' if target.tokenizer.adds_special_tokens else 'but'} "
            f"the draft's {'does' if own.adds_special_tokens else 'does not'}"
            if target.tokenizer.adds_special_tokens != own.adds_special_tokens else
            "their normalizers, pre-tokenizers, merges, post-processors, decoders or added tokens differ")
    return (f"the same vocabulary, but a tokenizer that turns text into ids differently ({what}): the draft tokenizes text "
            "prompts and decodes the output, so they would not be the target's; give the draft the target's tokenizer files")


def tokenizer_info(tokenizer, include_vocab: bool = False) -> pb.TokenizerInfo:
    special = {}
    for role in ROLES:
        tid = getattr(tokenizer, f"{role}_token_id", None)
        if tid is not None:
            special[role] = f"{getattr(tokenizer, f'{role}_token')}={tid}"
    info = pb.TokenizerInfo(tokenizer_class=type(tokenizer).__name__, num_tokens=len(tokenizer), special_tokens=special,
                            adds_special_tokens=adds_special_tokens(tokenizer), text_rules=text_rules(tokenizer),
                            chat_template=chat_template_digest(tokenizer))
    if include_vocab:
        info.tokens.extend(id_ordered(tokenizer))
    return info


def explain(target: pb.ModelInfo, draft: pb.ModelInfo) -> str:
    """One line on what differs between the target's tokenizer and the draft's."""
    if not target.HasField("tokenizer"):
        return "the verify service does not describe its tokenizer (an older version): compare the two tokenizers by hand"
    t, d = target.tokenizer, draft.tokenizer
    parts = []
    if (t.num_tokens, target.vocab_size) != (d.num_tokens, draft.vocab_size):
        parts.append(f"vocabulary sizes: target {t.num_tokens} tokens ({target.vocab_size} output rows), "
                     f"draft {d.num_tokens} tokens ({draft.vocab_size} output rows)")
    if t.tokens and d.tokens:
        n = max(len(t.tokens), len(d.tokens))
        diff = [i for i in range(n) if _at(t.tokens, i) != _at(d.tokens, i)]
        if diff:
            shown = ", ".join(f"{i} (target {_show(t.tokens, i)}, draft {_show(d.tokens, i)})" for i in diff[:SHOW_IDS])
            more = f" and {len(diff) - SHOW_IDS} more" if len(diff) > SHOW_IDS else ""
            parts.append(f"first differing ids: {shown}{more}")
    roles = sorted(set(t.special_tokens) | set(d.special_tokens))
    special = [f"{r} target {t.special_tokens.get(r, 'none')}, draft {d.special_tokens.get(r, 'none')}"
               for r in roles if t.special_tokens.get(r) != d.special_tokens.get(r)]
    if special:
        parts.append("special tokens: " + "; ".join(special))
    if t.adds_special_tokens != d.adds_special_tokens:
        parts.append(f"adds special tokens to a prompt: target {t.adds_special_tokens}, draft {d.adds_special_tokens}")
    same = "" if t.tokenizer_class != d.tokenizer_class else " (the same)"
    parts.append(f"tokenizer classes: target {t.tokenizer_class}, draft {d.tokenizer_class}{same}")
    return "; ".join(parts)


def _at(tokens, i: int) -> str | None:
    return tokens[i] if i < len(tokens) and tokens[i] else None


def _show(tokens, i: int) -> str:
    tok = _at(tokens, i)
    return "none" if tok is None else repr(tok)
