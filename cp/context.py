"""The CP context: what a CP attention call needs besides its tensors (the group, the mode and the groups it makes,
the kernels, the tuning), built once at setup and passed in.

Building a context whose mode makes sub-groups (the hybrid mode's) is collective over the default group: every rank of
the job builds its context at the same point (after `init_process_group`, before any forward). Every other context
is built without communicating, so one may also be made on the fly (`cp.attention(q, k, v, group=...)`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from .comm import group_size
from .kernels import KERNELS, KernelChoice
from .mode import Mode
from .modes import DEFAULT_MODE, MODES, degree
from .spec import CallSpec, group_by_name, name_of

__all__ = ["OVERLAPS", "CPContext", "CallSpec", "Tuning", "group_by_name", "refusal"]

# How a compiled block orders its exchanges against its compute (cp/schedule.py says what each does).
OVERLAPS = ("fill", "passes", "compute", "scheduler", "none")


@dataclass(frozen=True)
class Tuning:
    """How CP runs, never what it computes: every setting gives the same results.

    kernels: attention kernel names in order of preference (the first that serves an input is used); empty: the
        device's default order (`cp.kernels.DEFAULT_PREFERENCE`).
    overlap: how a compiled block orders its exchanges against its compute (`cp.schedule.inductor_options`).
    exchange_first: after launching each exchange and after each wait for one, the compute stream waits ~0.5 us
        (`cp.comm.head_start`), so that an exchange kernel that becomes ready with a compute kernel starts first and
        runs beside it instead of after it. Off by default: its effect on a training step is not measured.
    ulysses_chunks: head chunks of the Ulysses attention, pipelined so that the exchange of one chunk runs beside
        the attention of another (reduced until the chunks' heads divide over the group). 1 by default: the
        pipeline's gain on two GPUs is not measured.
    """

    kernels: tuple[str, ...] = ()
    overlap: str = "fill"
    exchange_first: bool = False
    ulysses_chunks: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", tuple(self.kernels))
        problem = refusal(self.kernels, self.overlap, self.exchange_first, self.ulysses_chunks)
        if problem:
            raise ValueError(problem)


def refusal(
    kernels: tuple[str, ...],
    overlap: str,
    exchange_first: bool,
    ulysses_chunks: int,
    names: Mapping[str, str] | None = None,
) -> str | None:
    """Why these `Tuning` settings cannot run, or None. `names`: what to call each setting in the message (by field
    name; a trainer passes its flags), the field's own name for those it leaves out."""
    n = {f: (names or {}).get(f, f) for f in ("kernels", "overlap", "exchange_first", "ulysses_chunks")}
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        return f"{n['kernels']}: unknown kernel {', '.join(unknown)}; choose from {', '.join(sorted(KERNELS))}"
    if overlap not in OVERLAPS:
        return f"unknown {n['overlap']} {overlap!r}; choose one of {', '.join(OVERLAPS)}"
    if isinstance(ulysses_chunks, bool) or not isinstance(ulysses_chunks, int) or ulysses_chunks < 1:
        return f"{n['ulysses_chunks']} must be a whole number >= 1, got {ulysses_chunks!r}"
    if exchange_first and overlap == "scheduler":
        return (
            f"{n['exchange_first']} is added beside the reordering passes, which {n['overlap']} scheduler replaces: "
            f"choose another {n['overlap']} or drop {n['exchange_first']}"
        )
    return None


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
        return CallSpec(scale, self.ulysses_size, self.ulysses_group_name, self.ring_group_name, t.ulysses_chunks,
                        self.kernels.key, t.exchange_first, self.group_name)  # fmt: skip

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
