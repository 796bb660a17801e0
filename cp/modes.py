"""The registry of CP modes: one line per mode below (`register_mode` adds one from outside the package), and what is
read from all of them: a mode by its name, the Ulysses degree a mode runs, `auto`'s choice, the ops a compiled,
checkpointed block keeps. Each mode is one module (`cp.mode.Mode` says what it holds)."""

from __future__ import annotations

from .hybrid import HYBRID
from .mode import Mode
from .ring import RING
from .ulysses import ULYSSES

MODES: dict[str, Mode] = {}  # name -> mode, in the order registered


def register_mode(mode: Mode) -> None:
    """Make `mode` a CP mode of `cp.attention`, `cp.CPContext` and flux-cp's --cp_mode, by its name. Call it in every
    process before anything of that mode is built."""
    if not mode.name or MODES.get(mode.name, mode) is not mode:
        raise ValueError(f"a CP mode needs a name of its own: {mode.name!r} is {'taken' if mode.name else 'empty'}")
    MODES[mode.name] = mode


register_mode(RING)
register_mode(ULYSSES)
register_mode(HYBRID)

# A group of one rank exchanges nothing, whatever mode it is given: it runs this one, which over no group is the
# attention kernel alone (and a run without CP records it).
DEFAULT_MODE = RING.name


def get(name: str) -> Mode:
    """The mode of a name; a ValueError naming the modes there are."""
    if name not in MODES:
        raise ValueError(f"unknown CP mode {name!r}; choose one of {', '.join(MODES)}")
    return MODES[name]


def degree(size: int, name: str, ulysses_size: int | None) -> int | None:
    """The Ulysses degree mode `name` runs over a group of `size` ranks (None: no Ulysses exchange, as at one rank);
    a ValueError naming what to change. The heads are checked per call (`cp.validate`)."""
    mode = get(name)
    return None if size == 1 else mode.degree(size, ulysses_size)


def auto_mode(heads: int, size: int) -> tuple[str, int | None]:
    """(mode, ulysses_size) that `auto` picks for a model of `heads` attention heads over `size` ranks: of the modes
    with an `auto_rank`, lowest first, the first that serves them (each mode's file says why it stands where it does:
    Ulysses where the heads divide over the group, else hybrid with the largest Ulysses degree dividing both, else
    the ring)."""
    ranked = sorted((m for m in MODES.values() if m.auto_rank is not None), key=lambda m: m.auto_rank)
    for mode in ranked:
        choice = mode.auto(heads, size)
        if choice is not None:
            return choice
    raise ValueError(f"no CP mode serves {heads} attention heads over {size} ranks")


def saved_ops() -> tuple:
    """The ops whose outputs a compiled, checkpointed block keeps for its backward instead of recomputing them: those
    of every registered mode (`Mode.saved_ops`)."""
    return tuple(dict.fromkeys(op for mode in MODES.values() for op in mode.saved_ops))
