"""User-facing failures: one clear line, no traceback, non-zero exit, on every rank at once."""

from __future__ import annotations


class UsageError(Exception):
    """A bad flag, layout, data set or resume folder: the message says what to change.

    `agreed`: every rank raised this same error (through a collective check), so one rank prints it.
    Errors raised before the process group exists are deterministic and count as agreed too."""

    def __init__(self, message: str, agreed: bool = False):
        super().__init__(message)
        self.agreed = agreed


class NonFiniteError(Exception):
    """The loss or gradient norm became NaN/inf (every rank sees the same reduced values)."""


EXIT_USAGE = 2
EXIT_NONFINITE = 3
EXIT_PEER_FAILED = 4
