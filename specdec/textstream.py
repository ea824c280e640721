"""Turns generated token ids into streamed text: incremental detokenization that never emits
half a multi-byte character (each character as soon as its last byte is in, even where a token
ends inside the next one), after the prompt's last ids (so a first token keeps its leading
space), and stop strings (the stop string itself is not emitted); and into the GenerateResponse
chunks both services stream."""
from __future__ import annotations

import os
import time

from specdec.v1 import specdec_pb2 as pb


CONTEXT = 4  # prompt ids a stream decodes its first tokens after: a SentencePiece (Metaspace) decode drops a first token's space
WIDEN = 8  # more prompt ids the window may take so that it starts on a whole character


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None, context: list[int] | None = None):
        """context: the prompt's ids; its last CONTEXT are decoded before the first generated ids (not emitted)."""
        self.tok = tokenizer
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()))  # decoded to nothing (skip_special_tokens)
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars that may start a stop
        context = list(context or [])
        n = min(CONTEXT, len(context))  # a window that starts inside a character decodes it as U+FFFD: start it earlier
        while n < min(CONTEXT + WIDEN, len(context)) and self._decode(context[-n:]).startswith("\ufffd"):
            n += 1
        self.ids: list[int] = context[len(context) - n :]  # the context, then the generated ids
        # the window's text, until the first delta moves the window past the context (None then, or with no context):
        # the generated text is what their decode adds after what it shares with it (`_delta`)
        self.context_text = self._decode(self.ids) if self.ids else None
        self.base = ""  # decoded text of the generated ids up to `read`
        self.text = ""  # base, and the complete characters after it: what a stop is looked for in
        self.sent = 0  # chars of self.text already emitted
        self.prefix = 0  # ids[prefix:read] were decoded last time: the context for the next delta
        self.read = len(self.ids)
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _delta(self) -> str:
        """The decoded text of ids[read:], in the context of ids[prefix:read]. After the prompt's
        window, what the decode adds past the text it shares with the window's own: a prompt that
        ends inside a character (its decode ends in U+FFFD) gives the whole character once the
        generated ids complete it, and U+FFFD the window's decode starts or ends with that the
        generated ids leave as they are (a character cut by the window's start; a byte-fallback
        run the window holds) is not taken for new text (stripping every trailing U+FFFD took it
        for new text where the window decoded to nothing else)."""
        full = self._decode(self.ids[self.prefix :])
        if self.context_text is not None:
            return full[len(os.path.commonprefix([self.context_text, full])) :]
        return full[len(self._decode(self.ids[self.prefix : self.read])) :]

    def _advance(self) -> None:
        delta = self._delta()
        if delta.endswith("\ufffd"):  # the last id ends inside a character: the complete ones before it count already
            self.text = self.base + delta.rstrip("\ufffd")
        elif delta:
            self.base = self.text = self.base + delta
            # the first delta's context stays in the next one's: a prompt that ends inside a character leaves its first
            # generated ids continuation bytes, which a byte-fallback decoder turns into U+FFFD without the bytes before
            self.prefix, self.read = (0 if self.context_text is not None else self.read), len(self.ids)
            self.context_text = None

    def push(self, ids: list[int]) -> tuple[list[int], str]:
        """Adds generated ids; returns (ids kept, text safe to emit now). Ids after a stop string
        are dropped; check .stopped afterwards."""
        kept = []
        for t in ids:
            if self.stopped:
                break
            kept.append(t)
            if t in self.special:  # no text in any context: kept out of the decode window, which would otherwise
                continue  # grow with each one and be decoded whole at every push (quadratic in a run of them)
            self.ids.append(t)
            n0 = len(self.text)
            self._advance()
            if self.stop and len(self.text) > n0:
                start = max(0, n0 - self.hold)  # a stop can only end inside the new text
                hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
                if hits:
                    self.text = self.text[: min(hits)]
                    self.stopped = True
        limit = len(self.text) if self.stopped else len(self.text) - self.hold
        return kept, self._take(limit)

    def finish(self) -> str:
        """Everything not yet emitted (call once the sequence has ended): the text is then the ids'
        whole decode, a character the ids end inside of included (as U+FFFD, as decode gives it)."""
        if not self.stopped:
            self.text = self.base + self._delta()
        return self._take(len(self.text))

    def _take(self, limit: int) -> str:
        if limit <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : limit], limit
        return out


class Chunks:
    """The GenerateResponse stream of one request: `push()` the tokens each step commits with the
    model's finish reason; it answers the chunk to send (or None) and the final finish reason."""

    def __init__(self, tokenizer, stop: list[str], request_id: str, context: list[int] | None = None):
        self.text = TextStream(tokenizer, stop, context)
        self.request_id = request_id
        self.generated = 0
        self._first = True

    def push(self, new: list[int], finish: int) -> tuple[pb.GenerateResponse | None, int]:
        ids, delta = self.text.push(new)
        self.generated += len(ids)
        if self.text.stopped:
            finish = pb.FINISH_REASON_STOP
        if finish:
            return pb.GenerateResponse(token_ids=ids, text=delta + self.text.finish(), finish_reason=finish, request_id=self.request_id), finish
        if not (ids or delta):
            return None, finish
        chunk = pb.GenerateResponse(token_ids=ids, text=delta, request_id=self.request_id if self._first else "")
        self._first = False
        return chunk, finish

    def last(self, chunk: pb.GenerateResponse, stats: pb.Stats, seed: int, t0: float) -> pb.GenerateResponse:
        """Completes the final chunk: stats (generated tokens, server time since t0) and seed.
        (The tokens returned are counted in the metrics by the request observer.)"""
        stats.generated_tokens = self.generated
        stats.server_s = time.perf_counter() - t0
        chunk.stats.CopyFrom(stats)
        chunk.seed = seed
        return chunk
