"""Logging set-up: one JSON object per line (or plain text), with a request id when known."""
from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, r: logging.LogRecord) -> str:
        d = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(r.created)) + f".{int(r.msecs):03d}Z",
            "level": r.levelname.lower(),
            "logger": r.name,
            "msg": r.getMessage(),
        }
        d.update(getattr(r, "fields", {}) or {})
        if r.exc_info:
            d["exc"] = self.formatException(r.exc_info)
        return json.dumps(d, default=str)


class TextFormatter(logging.Formatter):
    """One line of text: time, level, logger and message, then the record's fields as key=value
    (the request id, code, tokens, ... that the JSON lines carry)."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, r: logging.LogRecord) -> str:  # the line before any traceback, which format() appends
        line = super().formatMessage(r)
        fields = getattr(r, "fields", None) or {}
        return " ".join([line, *(f"{k}={_plain(v)}" for k, v in sorted(fields.items()))])


def _plain(v) -> str:
    """A field's value as text: a string that is not one plain word is quoted (JSON's escapes)."""
    text = v if isinstance(v, str) else str(v)
    plain = isinstance(v, str) and text and text.isprintable() and not any(c in text for c in ' ="')
    return text if plain or not isinstance(v, str) else json.dumps(text)


def setup(fmt: str = "json", level: str = "INFO") -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level.upper())
