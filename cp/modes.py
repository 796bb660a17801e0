"""The built-in CP modes, registered one line each (`cp.mode` holds the registry and says what a mode is; a mode from
outside the package registers itself with `cp.register_mode`). Imported by the package, so the registry holds them
before any of `cp` runs."""

from __future__ import annotations

from .hybrid import HYBRID
from .mode import register_mode
from .ring import RING
from .ulysses import ULYSSES

register_mode(RING)
register_mode(ULYSSES)
register_mode(HYBRID)
