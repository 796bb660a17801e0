"""The CP context: what a CP attention call needs besides its tensors (the group, the mode, the hybrid mode's
sub-groups, the kernels, the tuning), built once at setup and passed in.

Building a context for the hybrid mode creates its sub-groups, which is collective over the default group: every
rank of the job builds its context at the same point (after `init_process_group`, before any forward). Every other
context is built without communicating, so one may also be made on the fly (`cp.attention(q, k, v, group=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from .comm import group_size
from .kernels import KernelChoice, check_names

MODES = ("ring", "ulysses", "hybrid")

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
        check_names(self.kernels)
        if self.overlap not in OVERLAPS:
            raise ValueError(f"unknown overlap {self.overlap!r}; choose one of {', '.join(OVERLAPS)}")
        if isinstance(self.ulysses_chunks, bool) or not isinstance(self.ulysses_chunks, int) or self.ulysses_chunks < 1:
            raise ValueError(f"ulysses_chunks must be a whole number >= 1, got {self.ulysses_chunks!r}")
        if self.exchange_first and self.overlap == "scheduler":
            raise ValueError(
                "exchange_first is added by a pass beside the reordering passes (fill, passes, compute, none), which "
                "Inductor's overlap scheduler replaces: choose another overlap or leave exchange_first off"
            )


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

    def ring_group(self) -> dist.ProcessGroup | None:
        return group_by_name(self.ring_group_name)

    def ulysses_group(self) -> dist.ProcessGroup | None:
        return group_by_name(self.ulysses_group_name)

    def kernel_choice(self) -> KernelChoice:
        return KernelChoice.from_key(self.kernels)


def group_by_name(name: str) -> dist.ProcessGroup | None:
    """The process group of a name ("" for none), as the compiled path passes groups."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group  # torch's own lookup by name

    return _resolve_process_group(name)


def ulysses_degree(n: int, mode: str, ulysses_size: int | None) -> int | None:
    """The Ulysses degree of a mode over a group of `n` ranks (None: no Ulysses); a ValueError naming what to change.
    The heads are checked per call (`cp.validate`)."""
    if mode not in MODES:
        raise ValueError(f"unknown CP mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "ring" or n == 1:
        return None
    if mode == "ulysses":
        if ulysses_size not in (None, n):
            raise ValueError(f"mode 'ulysses' uses the whole CP group: ulysses_size must be None or {n}")
        return n
    if ulysses_size is None:
        raise ValueError("mode 'hybrid' needs ulysses_size (the Ulysses degree inside each ring step)")
    u = ulysses_size
    if u < 1 or n % u:
        divisors = [d for d in range(2, n) if n % d == 0]
        raise ValueError(
            f"ulysses_size {u} does not divide the CP group size {n}; choose one of {divisors or 'none'}"
            + ("" if divisors else f" ({n} is prime: use mode 'ring' or 'ulysses')")
        )
    return u


class CPContext:
    """A CP group with its mode, kernels and tuning.

    group: the ranks that share one sequence (None or one rank: no CP). mode: "ring", "ulysses" or "hybrid"
    (Ulysses of degree `ulysses_size` inside blocks of neighbouring ranks, a ring across the blocks).
    timeout: of the sub-groups this context creates. cp_groups: the global ranks of every CP group of the job, for
    the hybrid mode's sub-groups (every rank creates every sub-group, a torch.distributed rule); None: gathered from
    all ranks, collective over the default group.

    Attributes the attention reads: `size`, `ulysses_size` (the degree used, None without Ulysses), the Ulysses
    and ring groups of this rank (`ulysses_group`, `ring_group`, None where there is none) and their names,
    `kernels` (a `cp.kernels.KernelChoice`) and `tuning`.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        mode: str = "ring",
        ulysses_size: int | None = None,
        *,
        tuning: Tuning | None = None,
        timeout: timedelta | None = None,
        cp_groups: list[list[int]] | None = None,
    ):
        self.size = group_size(group)
        self.ulysses_size = ulysses_degree(self.size, mode, ulysses_size)
        self.group = group if self.size > 1 else None
        self.mode = mode
        self.tuning = tuning or Tuning()
        self.timeout = timeout
        self.cp_groups = cp_groups
        self.kernels = KernelChoice.of(self.tuning.kernels)
        u = self.ulysses_size
        if u is None:
            self.ulysses_group, self.ring_group = None, self.group
        elif u == self.size:
            self.ulysses_group, self.ring_group = self.group, None
        else:
            self.ulysses_group, self.ring_group = _hybrid_groups(self.group, u, timeout, cp_groups)
        # by name, as the compiled path passes them
        self.ulysses_group_name = self.ulysses_group.group_name if self.ulysses_group is not None else ""
        self.ring_group_name = self.ring_group.group_name if self.ring_group is not None else ""

    def call_spec(self, scale: float) -> CallSpec:
        """This context's settings for one attention call of softmax scale `scale`."""
        t = self.tuning
        return CallSpec(scale, self.ulysses_size, self.ulysses_group_name, self.ring_group_name, t.ulysses_chunks,
                        self.kernels.key, t.exchange_first)  # fmt: skip

    def with_mode(self, mode: str, ulysses_size: int | None = None) -> CPContext:
        """This context in another mode (itself if unchanged); the hybrid mode's sub-groups are created as in the
        constructor (collective over the default group)."""
        if mode == self.mode and ulysses_degree(self.size, mode, ulysses_size) == self.ulysses_size:
            return self
        return CPContext(
            self.group, mode, ulysses_size, tuning=self.tuning, timeout=self.timeout, cp_groups=self.cp_groups
        )

    def describe(self) -> str:
        if self.size == 1:
            return "no CP"
        u = f" (ulysses {self.ulysses_size})" if self.mode == "hybrid" else ""
        return f"{self.mode}{u} over {self.size} ranks"

    def __repr__(self) -> str:
        return f"CPContext({self.describe()}, {self.tuning})"


def _hybrid_groups(
    group: dist.ProcessGroup, u: int, timeout: timedelta | None, cp_groups: list[list[int]] | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(Ulysses group, ring group) of this rank: Ulysses inside blocks of `u` neighbouring ranks of its CP group, the
    ring across the blocks, among ranks at the same place in their block. `new_group` is collective over the
    default group, so every rank creates the sub-groups of every CP group, in the same order."""
    mine = dist.get_process_group_ranks(group)
    if cp_groups is None:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        cp_groups = sorted({tuple(r) for r in everyone})
    me = dist.get_rank()
    kw = {"timeout": timeout} if timeout is not None else {}
    found: dict[str, dist.ProcessGroup] = {}
    for ranks in cp_groups:
        ranks = list(ranks)
        for b in range(len(ranks) // u):
            block = ranks[b * u : (b + 1) * u]
            g = dist.new_group(block, **kw)
            if me in block and ranks == mine:
                found["ulysses"] = g
        for j in range(u):
            across = ranks[j::u]
            g = dist.new_group(across, **kw)
            if me in across and ranks == mine:
                found["ring"] = g
    if set(found) != {"ulysses", "ring"}:
        raise ValueError(f"cp_groups {cp_groups} do not hold this rank's CP group {mine}")
    return found["ulysses"], found["ring"]
