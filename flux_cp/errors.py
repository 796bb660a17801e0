"""User-facing failures: one clear line, no traceback, non-zero exit, on every rank at once."""

from __future__ import annotations


class UsageError(Exception):
    """A bad flag, layout, data set or resume folder: the message says what to change."""


EXIT_USAGE = 2
EXIT_NONFINITE = 3
EXIT_PEER_FAILED = 4
