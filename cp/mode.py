"""A CP mode: how attention exchanges keys and values over a CP group; what one call passes it; the registry of modes.

A mode is one module that defines a `Mode` subclass and an instance of it, and one registry line (`cp/modes.py` for
the built-in ring, Ulysses and hybrid; `cp.register_mode(MODE)` from outside the package). The instance holds
everything that is the mode's own: which group sizes and head counts it accepts and its one setting, the Ulysses
degree (`degree`, `check_heads`); how its process groups are made (`groups`); whether and with which setting
`auto` picks it (`auto_rank`, `auto`); its eager and compiled paths (`attention`, `traced`); what a compiled,
checkpointed block keeps of it (`saved_ops`, `exchanges_kept`). Everything else (the context, the processors,
flux-cp's `--cp_mode` and its checks, help and planner) reads the registry (`MODES`, and what is read from all
modes below). A group of one rank exchanges nothing whatever its mode: it runs the default mode (`DEFAULT_MODE`),
which over no group is the kernel alone.

What one call needs besides its tensors travels as plain values (`CallSpec`): the compiled path's custom ops take
plain arguments only (torch's rule), so groups travel by name and the kernels by their order's key. This module
imports nothing else of `cp`, so that what reads the registry (the context, flux-cp's flags) stays below the modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

Tensor = torch.Tensor
ProcessGroup = dist.ProcessGroup


class Mode:
    """A CP mode (see the module's note). Tensors at `attention` and `traced` are this rank's contiguous chunks
    `[batch, seq_local, heads, head_dim]`, the same length on every rank; they return this rank's output chunk in the
    same layout, and their gradients are the matching slices of the full gradients."""

    name: str = ""  # what `CPContext(mode=...)` and --cp_mode call it
    summary: str = ""  # what it exchanges, a few words for --cp_mode's help
    takes_ulysses_size: bool = False  # it needs `ulysses_size` (--ulysses_size), which no other mode takes
    auto_rank: int | None = None  # where `auto` tries it, lowest first; None: never picked by `auto`
    exchanges_kept: bool = False  # a compiled, checkpointed block keeps its exchanged q, k, v and output too
    saved_ops: tuple = ()  # ops whose outputs a compiled, checkpointed block keeps rather than recomputes

    def degree(self, size: int, ulysses_size: int | None) -> int | None:
        """The Ulysses degree this mode runs over a group of `size` > 1 ranks, from the `ulysses_size` asked for (None:
        no Ulysses exchange); a ValueError naming what to change. Default: none (`ulysses_size` is not read)."""
        return None

    def check_heads(self, heads: int, degree: int | None) -> None:
        """A ValueError naming what to change when `heads` attention heads cannot run in this mode at `degree`."""

    def auto(self, heads: int, size: int) -> tuple[str, int | None] | None:
        """(this mode's name, the `ulysses_size` to ask for) when `auto` may pick it for `heads` heads over `size`
        ranks; None when it may not. Read only for modes with an `auto_rank`."""
        return None

    def needs_context(self, size: int, degree: int | None) -> bool:
        """Whether making this mode's groups is collective over the default group (then every rank builds a
        `CPContext` at the same point, at setup, and an attention call over a plain group is refused)."""
        return False

    def groups(
        self, group: ProcessGroup, degree: int | None, timeout: timedelta | None, cp_groups: list[list[int]] | None
    ) -> tuple[ProcessGroup | None, ProcessGroup | None]:
        """(Ulysses group, ring group) of this rank in a CP group of several ranks (None where the mode has none).
        `timeout`, `cp_groups`: see `CPContext`, for modes that create sub-groups. Default: neither."""
        return None, None

    def attention(self, q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
        """The eager path."""
        raise NotImplementedError

    def traced(self, q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
        """The path torch.compile traces (without a graph break). Default: the eager path, for a mode written in ops
        the compiler traces."""
        return self.attention(q, k, v, spec)

    def __repr__(self) -> str:
        return f"<CP mode {self.name}>"


# --- one call's settings ---


@dataclass(frozen=True)
class CallSpec:
    """What one attention call needs besides its tensors, in plain values (`CPContext.call_spec`): the compiled
    path's custom ops take plain arguments only (torch's rule), so groups travel by name ("" for none) and the kernels
    by their order's key (`KernelChoice.key`), as torch finds a process group by its name. The eager path resolves
    them the same way (`ring_group`, `kernel_choice`)."""

    scale: float
    ulysses_size: int | None = None  # the Ulysses degree; None: no Ulysses exchange (ring, or no CP)
    ulysses_group_name: str = ""
    ring_group_name: str = ""
    chunks: int = 1  # Tuning.ulysses_chunks
    kernels: str = ""  # KernelChoice.key
    exchange_first: bool = False  # Tuning.exchange_first
    group_name: str = ""  # the whole CP group ("" without CP), for a mode that exchanges over it directly

    def ring_group(self) -> dist.ProcessGroup | None:
        return group_by_name(self.ring_group_name)

    def ulysses_group(self) -> dist.ProcessGroup | None:
        return group_by_name(self.ulysses_group_name)

    def group(self) -> dist.ProcessGroup | None:
        return group_by_name(self.group_name)


def group_by_name(name: str) -> dist.ProcessGroup | None:
    """The process group of a name ("" for none), as the compiled path passes groups."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group  # torch's own lookup by name

    return _resolve_process_group(name)


def name_of(group: dist.ProcessGroup | None) -> str:
    """A group's name as a `CallSpec` holds it ("" for none)."""
    return group.group_name if group is not None else ""


# --- the registry ---

MODES: dict[str, Mode] = {}  # name -> mode, in the order registered


def register_mode(mode: Mode) -> None:
    """Make `mode` a CP mode of `cp.attention`, `cp.CPContext` and flux-cp's --cp_mode, by its name. Call it in every
    process before anything of that mode is built."""
    if not mode.name or MODES.get(mode.name, mode) is not mode:
        raise ValueError(f"a CP mode needs a name of its own: {mode.name!r} is {'taken' if mode.name else 'empty'}")
    MODES[mode.name] = mode


# A group of one rank exchanges nothing, whatever mode it is given: it runs this one, which over no group is the
# attention kernel alone (and a run without CP records it). The ring's name (cp/ring.py); cp/modes.py registers it.
DEFAULT_MODE = "ring"


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


def validate(shape: tuple[int, ...], group_size_: int, mode: str, ulysses_size: int | None) -> int | None:
    """Check a CP attention configuration before any communication; returns the Ulysses size used.

    `shape` is `[batch, seq_local, heads, head_dim]`. Raises ValueError naming what to change.
    """
    runs = get(mode)
    if len(shape) != 4:
        raise ValueError(f"CP attention expects [batch, seq, heads, head_dim] tensors, got shape {tuple(shape)}")
    u = degree(group_size_, mode, ulysses_size)
    if group_size_ > 1:
        runs.check_heads(shape[2], u)
    return u


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
