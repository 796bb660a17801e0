"""The interface of a CP mode: how attention exchanges keys and values over a CP group.

A mode is one module that defines a `Mode` subclass and an instance of it, and one registry line (`cp/modes.py` for
the built-in ring, Ulysses and hybrid; `cp.register_mode(MODE)` from outside the package). The instance holds
everything that is the mode's own: which group sizes and head counts it accepts and its one setting, the Ulysses
degree (`degree`, `check_heads`); how its process groups are made (`groups`); whether and with which setting
`auto` picks it (`auto_rank`, `auto`); its eager and compiled paths (`attention`, `traced`); what a compiled,
checkpointed block keeps of it (`saved_ops`, `exchanges_kept`). Everything else (the context, the processors,
flux-cp's `--cp_mode` and its checks, help and planner) reads the registry. A group of one rank exchanges nothing
whatever its mode: it runs the default mode (`cp.modes.DEFAULT_MODE`), which over no group is the kernel alone.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .spec import CallSpec

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
