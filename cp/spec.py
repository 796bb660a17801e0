"""What one CP attention call needs besides its tensors, in plain values (`CallSpec`), and the process group of a name.
The modes read it (`cp.mode.Mode.attention`); a `CPContext` makes it (`CPContext.call_spec`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .kernels import KernelChoice


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

    def kernel_choice(self) -> KernelChoice:
        return KernelChoice.from_key(self.kernels)


def group_by_name(name: str) -> dist.ProcessGroup | None:
    """The process group of a name ("" for none), as the compiled path passes groups."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group  # torch's own lookup by name

    return _resolve_process_group(name)


def name_of(group: dist.ProcessGroup | None) -> str:
    """A group's name as a `CallSpec` holds it ("" for none)."""
    return group.group_name if group is not None else ""
