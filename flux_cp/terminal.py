"""What reaches the terminal from files: values read from checkpoints, model folders, tokenizers and data sets
(meta.json fields, class names, file names, a chat template's errors) are shown escaped, so that a control
character in them (ESC starting an ANSI sequence, a carriage return, a newline forging a line) is written as its
escape instead of acting on the terminal. Error lines are escaped whole by the runner (`printable`); the trainer's
log lines by a filter on its logger (`escape_logs`), which keeps their newlines (the run's summary has several
lines)."""

from __future__ import annotations

import logging


def printable(text: object, keep: str = "") -> str:
    """`text` with every character a terminal would act on (control characters, newlines, bidirectional overrides)
    written as its escape, as repr writes it; the characters of `keep` and all other text unchanged."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in s)


class _Escape(logging.Filter):
    """Escapes the control characters of a log record's text (its newlines and tabs kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        escaped = printable(text, keep="\n\t")
        if escaped != text:
            record.msg, record.args = escaped, ()
        return True


def escape_logs(logger: logging.Logger) -> None:
    """Escape what `logger` logs from now on (idempotent)."""
    if not any(isinstance(f, _Escape) for f in logger.filters):
        logger.addFilter(_Escape())
