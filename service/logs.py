"""Structured logs: one JSON object per line, with the request id when there is one.

Query and title texts stay out of the logs (search queries can be personal) unless `log_texts` is on. No log
line of ours formats them; as a safety net, the texts of the request being handled are noted
(`keep_private`, by the routes) and taken out of every log record made while it runs, whoever logs it: an
exception message that quotes a title, uvicorn's traceback of an unhandled error. The batcher and the model
processes see token ids only.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
import traceback
from collections.abc import Iterable

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
# The texts of the request being handled, longest first; set in the request's own context (a task's copy).
private_texts: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("private_texts", default=())
REDACTED = "[text]"
# Shorter texts are left alone: "ab" occurs in every other log line, and two characters say nothing of anyone.
MIN_PRIVATE_CHARS = 3


def keep_private(texts: Iterable[str]) -> None:
    """Note the request's texts: from now on, in this request's context, log records have them replaced by
    [text] (redact_private_texts installs the record factory that does it)."""
    private_texts.set(tuple(sorted({t for t in texts if len(t) >= MIN_PRIVATE_CHARS}, key=len, reverse=True)))


def redact_private_texts() -> None:
    """Install, once per process, the log record factory that takes the noted texts out of each record: its
    message, its arguments and its traceback. Records made outside a request that noted texts are untouched
    (one context variable read)."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "qtrel_redacts", False):
        return

    def make(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        texts = private_texts.get()
        if texts:
            _redact(record, texts)
        return record

    make.qtrel_redacts = True  # type: ignore[attr-defined]  # marks the factory, so it is installed once
    logging.setLogRecordFactory(make)


def _scrub(text: str, texts: tuple[str, ...]) -> str:
    for t in texts:
        if t in text:
            text = text.replace(t, REDACTED)
    return text


def _redact(record: logging.LogRecord, texts: tuple[str, ...]) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a broken format: logging reports it when the record is emitted
        return
    clean = _scrub(message, texts)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[1] is not None:
        shown = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        clean = _scrub(shown, texts)
        if clean != shown:  # formatters print exc_text when there is no exc_info
            record.exc_info, record.exc_text = None, clean


class JsonFormatter(logging.Formatter):
    # Attributes every LogRecord has; anything else was passed with `extra=` and is logged as a field.
    _STD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "color_message"}

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id.get()
        if rid:
            out["request_id"] = rid
        out.update({k: v for k, v in vars(record).items() if k not in self._STD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:  # a traceback redacted at the record's making
            out["exc"] = record.exc_text
        return json.dumps(out, default=str)


def configure(level: str = "info", as_json: bool = True) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if as_json else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # qtrel logs each request itself
