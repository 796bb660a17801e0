"""Block offload's plan (`--offload_blocks N|auto`), before any weight moves: which blocks are offloaded, what that
takes off the GPU and what it copies per step (`OffloadPlan`, which the memory planner counts), and the refusals of
the flag (full fine-tuning, FSDP2, more blocks than the model has, more pinned host memory than the machine has). The
runtime that moves the weights: flux_cp.model.offload."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flux_cp.errors import UsageError

SLOTS = 2  # per kind of block: one in use while the next one arrives


GIB = 2**30


def offload_count(value: str) -> int | None:
    """Blocks to offload for an --offload_blocks value; None for 'auto' (the memory planner decides, with
    --gradient_checkpointing: flux_cp.plan.memory)."""
    return None if value == "auto" else int(value)


def choose_offloaded(kinds: Sequence[str], n: int) -> tuple[int, ...]:
    """The indices (in run order) of the n blocks to offload: the kind with more blocks first, its blocks taken at
    the centres of n equal parts of that kind's run, then the other kind's likewise."""
    order = sorted(set(kinds), key=lambda k: (-kinds.count(k), kinds.index(k)))
    chosen, left = [], n
    for kind in order:
        own = [i for i, k in enumerate(kinds) if k == kind]
        take = min(left, len(own))
        chosen += [own[(2 * j + 1) * len(own) // (2 * take)] for j in range(take)]
        left -= take
    return tuple(sorted(chosen))


@dataclass(frozen=True)
class OffloadPlan:
    """What offloading blocks costs and saves. `groups`: the offloaded blocks (indices in run order, ascending) that
    share slots, one group per kind; `block_bytes`: the frozen bytes of every block, in run order."""

    block_bytes: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    slots: int = SLOTS

    @property
    def offloaded(self) -> tuple[int, ...]:
        return tuple(sorted(i for g in self.groups for i in g))

    def slots_of(self, group: Sequence[int]) -> int:
        return min(self.slots, len(group))

    @property
    def host_bytes(self) -> int:
        """Pinned host memory: the offloaded blocks' frozen weights (per process)."""
        return sum(self.block_bytes[i] for i in self.offloaded)

    @property
    def slot_bytes(self) -> int:
        """GPU memory the slots take."""
        return sum(self.slots_of(g) * max(self.block_bytes[i] for i in g) for g in self.groups)

    @property
    def saved_bytes(self) -> int:
        """GPU memory saved: the offloaded blocks' frozen weights less the slots."""
        return self.host_bytes - self.slot_bytes

    @property
    def moved_bytes(self) -> int:
        """Bytes copied host to GPU per forward + backward (a micro-step) of training, once running: per kind, all
        offloaded blocks but the first SLOTS in the forward (the backward before left them in their slots) and all
        but the last SLOTS in the backward (the forward left them). A forward under no_grad (validation) copies what
        a forward copies, and the forward after it the first SLOTS blocks of each kind again."""
        b = self.block_bytes
        return sum(
            sum(b[i] for i in g[k:]) + sum(b[i] for i in g[:-k]) for g in self.groups for k in [self.slots_of(g)]
        )

    def describe(self) -> str:
        n = len(self.offloaded)
        if not n:
            return "block offload: none"
        return (
            f"block offload: {n} blocks' frozen weights in pinned host memory ({self.host_bytes / GIB:.2f} GiB per "
            f"process), {sum(self.slots_of(g) for g in self.groups)} slots on the GPU ({self.slot_bytes / GIB:.2f} "
            f"GiB): {self.saved_bytes / GIB:.2f} GiB of GPU memory saved, {self.moved_bytes / GIB:.2f} GiB copied to "
            "the GPU per micro-step"
        )


def plan_offload(kinds: Sequence[str], block_bytes: Sequence[int], n: int, slots: int = SLOTS) -> OffloadPlan:
    """The plan for offloading n blocks of a transformer whose blocks (in run order) have these kinds and frozen
    bytes (`block_kinds`, `frozen_block_bytes`)."""
    chosen = choose_offloaded(kinds, n)
    groups = [tuple(i for i in chosen if kinds[i] == k) for k in dict.fromkeys(kinds)]
    return OffloadPlan(tuple(block_bytes), tuple(g for g in groups if g), slots)


def check_offload(value: str, *, full_finetune: bool, sharded: bool) -> None:
    """One line when --offload_blocks cannot apply to this run, before anything loads."""
    if value == "0":
        return
    if full_finetune:
        raise UsageError(
            "--offload_blocks moves frozen weights, and --full_finetune trains every weight: drop --offload_blocks "
            "(or train LoRA)",
            agreed=True,
        )
    if sharded:
        raise UsageError(
            "--offload_blocks does not combine with FSDP2, which already shards the weights over the GPUs: use DDP "
            "with --offload_blocks (a ddp_*.yaml accelerate config), or FSDP2 without it",
            agreed=True,
        )


def check_offload_count(n: int, kinds: Sequence[str], block_bytes: Sequence[int], slots: int = SLOTS) -> OffloadPlan:
    """The plan for --offload_blocks n on this model, or one line when n is more than its blocks or saves nothing."""
    if n > len(kinds):
        raise UsageError(f"--offload_blocks {n}: the transformer has {len(kinds)} blocks; give at most {len(kinds)}")
    plan = plan_offload(kinds, block_bytes, n, slots)
    if n and plan.saved_bytes <= 0:
        # The fewest that save memory, counted on this model: how the blocks split into kinds decides it.
        saving = (m for m in range(n + 1, len(kinds) + 1) if plan_offload(kinds, block_bytes, m, slots).saved_bytes > 0)
        least = next(saving, None)
        room = f"each kind of block offloaded takes {slots} blocks' room on the GPU (its slots)"
        if least is None:
            raise UsageError(
                f"--offload_blocks {n} saves no GPU memory, nor does any count on this model of "
                f"{len(kinds)} blocks: {room}; drop --offload_blocks"
            )
        raise UsageError(f"--offload_blocks {n} saves no GPU memory: {room}; offload at least {least}")
    return plan


def check_host_memory(plan: OffloadPlan, processes: int, available: int | None = None) -> None:
    """One line when the pinned host memory of `processes` processes on this machine would not fit 90% of what is
    available (page-locked memory cannot be swapped out: the machine would run out of memory instead)."""
    available = available_host_memory() if available is None else available
    need = plan.host_bytes * processes
    if available is not None and need > 0.9 * available:
        raise UsageError(
            f"--offload_blocks {len(plan.offloaded)} needs {need / GIB:.1f} GiB of pinned host memory ({processes} "
            f"process{'es' if processes > 1 else ''} x {plan.host_bytes / GIB:.1f} GiB), more than 90% of the "
            f"{available / GIB:.1f} GiB available: offload fewer blocks"
        )


def available_host_memory() -> int | None:
    """The host memory available now (/proc/meminfo's MemAvailable), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
