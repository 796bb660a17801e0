"""This process's place in the dp x cp grid of a run: its ranks, its CP group and the CP context built for it
(`flux_cp.model.parallel.make_layout` builds it once at setup; the data path, validation and the outputs read it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from cp.context import CPContext


@dataclass
class Layout:
    """This process's place in the dp x cp grid (from the run shape). `rank` is the process rank (the LoRA rank is
    `LoraConfig.rank`). `cp_context`: the CP group with its mode, timeout and tuning (`cp.CPContext`), built once by
    `make_layout`; one in the default mode (`cp.DEFAULT_MODE`) with the default tuning when not given."""

    world: int
    rank: int
    cp: int
    dp: int
    dp_rank: int
    cp_rank: int
    cp_group: dist.ProcessGroup | None
    cp_context: CPContext | None = None

    def __post_init__(self) -> None:
        if self.cp_context is None:
            self.cp_context = CPContext(self.cp_group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return f"world {self.world} = dp {self.dp} x cp {self.cp}"


def cp_group_ranks(world: int, cp_size: int) -> list[list[int]]:
    """The global ranks of every CP group: neighbouring ranks, the data sampler's `dp_rank = rank // cp`."""
    return [list(range(d * cp_size, (d + 1) * cp_size)) for d in range(world // cp_size)]
