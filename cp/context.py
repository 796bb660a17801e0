"""The CP context: what a CP attention call needs besides its tensors (the group, the mode and the groups it makes,
the kernels, the tuning), built once at setup and passed in.

Building a context whose mode makes sub-groups (the hybrid mode's) is collective over the default group: every rank of
the job builds its context at the same point (after `init_process_group`, before any forward). Every other context
is built without communicating, so one may also be made on the fly (`cp.attention(q, k, v, group=...)`).
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import group_size
from .kernels import KernelChoice
from .mode import DEFAULT_MODE, MODES, CallSpec, Mode, degree, name_of, validate
from .tuning import Tuning


class CPContext:
    """A CP group with its mode, kernels and tuning.

    group: the ranks that share one sequence (None or one rank: no CP). mode: the name of a registered mode
    (`cp.MODES`: "ring", "ulysses", "hybrid", or one given to `cp.register_mode`); the hybrid mode runs Ulysses of
    degree `ulysses_size` inside blocks of neighbouring ranks, a ring across the blocks. timeout: of the sub-groups
    this context creates. cp_groups: the global ranks of every CP group of the job, for the sub-groups a mode creates
    (every rank creates every sub-group, a torch.distributed rule); None: gathered from all ranks, collective over
    the default group.

    Attributes the attention reads: `size`, `runs` (the mode that runs: the default mode over one rank),
    `ulysses_size` (the degree used, None without Ulysses), the Ulysses and ring groups of this rank
    (`ulysses_group`, `ring_group`, None where there is none) and their names, `kernels` (a
    `cp.kernels.KernelChoice`) and `tuning`.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        mode: str = DEFAULT_MODE,
        ulysses_size: int | None = None,
        *,
        tuning: Tuning | None = None,
        timeout: timedelta | None = None,
        cp_groups: list[list[int]] | None = None,
    ):
        self.size = group_size(group)
        self.ulysses_size = degree(self.size, mode, ulysses_size)
        self.group = group if self.size > 1 else None
        self.mode = mode
        self.runs: Mode = MODES[mode] if self.size > 1 else MODES[DEFAULT_MODE]
        self.tuning = tuning or Tuning()
        self.timeout = timeout
        self.cp_groups = cp_groups
        self.kernels = KernelChoice.of(self.tuning.kernels)
        self.ulysses_group, self.ring_group = None, None
        if self.group is not None:
            self.ulysses_group, self.ring_group = self.runs.groups(self.group, self.ulysses_size, timeout, cp_groups)
        # by name, as the compiled path passes them
        self.group_name = name_of(self.group)
        self.ulysses_group_name = name_of(self.ulysses_group)
        self.ring_group_name = name_of(self.ring_group)

    def call_spec(self, scale: float) -> CallSpec:
        """This context's settings for one attention call of softmax scale `scale`."""
        t = self.tuning
        return CallSpec(
            scale,
            ulysses_size=self.ulysses_size,
            ulysses_group_name=self.ulysses_group_name,
            ring_group_name=self.ring_group_name,
            chunks=t.ulysses_chunks,
            kernels=self.kernels.key,
            exchange_first=t.exchange_first,
            group_name=self.group_name,
        )

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        """Attention of this rank's chunks `[batch, seq_local, heads, head_dim]` against the whole sequence, in this
        context's mode: its compiled path under torch.compile, else its eager one (`cp.attention` with `context=`;
        the Flux processors call it directly)."""
        validate(tuple(query.shape), self.size, self.mode, self.ulysses_size)
        spec = self.call_spec(1.0 / math.sqrt(query.shape[-1]) if scale is None else scale)
        if torch.compiler.is_compiling():
            return self.runs.traced(query, key, value, spec)
        return self.runs.attention(query, key, value, spec)

    def with_mode(self, mode: str, ulysses_size: int | None = None) -> CPContext:
        """This context in another mode (itself if unchanged); sub-groups the mode makes are created as in the
        constructor (collective over the default group)."""
        if mode == self.mode and degree(self.size, mode, ulysses_size) == self.ulysses_size:
            return self
        return CPContext(
            self.group, mode, ulysses_size, tuning=self.tuning, timeout=self.timeout, cp_groups=self.cp_groups
        )

    def describe(self) -> str:
        if self.size == 1:
            return "no CP"
        u = f" (ulysses {self.ulysses_size})" if self.runs.takes_ulysses_size else ""
        return f"{self.mode}{u} over {self.size} ranks"

    def __repr__(self) -> str:
        return f"CPContext({self.describe()}, {self.tuning})"
