"""The hybrid mode: Ulysses of degree u inside blocks of u neighbouring ranks of the CP group, a ring across the
blocks (among the ranks at the same place in their block). Its attention is Ulysses' (cp/ulysses.py, eager and
compiled) over its Ulysses group, whose attention on the exchanged heads is the ring (cp/ring.py) over its ring group;
what is its own are its rules (u divides the group and the heads) and its sub-groups, whose making is collective over
the default group: a hybrid `CPContext` is built by every rank at the same point, at setup."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .mode import CallSpec, Mode
from .ulysses import SAVED_OPS, check_heads, ulysses_attention, ulysses_traced

Tensor = torch.Tensor


class Hybrid(Mode):
    """Ulysses inside blocks of `ulysses_size` ranks, a ring across the blocks."""

    name = "hybrid"
    summary = "Ulysses inside ring"
    takes_ulysses_size = True
    # Second for `auto`, where the heads do not divide over the whole group, with the largest Ulysses degree that
    # divides both: at 4 ranks it sits between Ulysses and the ring at every size (benchmarks/archive/history.md).
    auto_rank = 1
    exchanges_kept = True
    saved_ops = SAVED_OPS

    def degree(self, size: int, ulysses_size: int | None) -> int:
        if ulysses_size is None:
            raise ValueError("mode 'hybrid' needs ulysses_size (the Ulysses degree inside each ring step)")
        u = ulysses_size
        if u < 1 or size % u:
            divisors = [d for d in range(2, size) if size % d == 0]
            raise ValueError(
                f"ulysses_size {u} does not divide the CP group size {size}; choose one of {divisors or 'none'}"
                + ("" if divisors else f" ({size} is prime: use mode 'ring' or 'ulysses')")
            )
        return u

    def check_heads(self, heads: int, degree: int | None) -> None:
        check_heads(heads, degree)

    def auto(self, heads: int, size: int) -> tuple[str, int | None] | None:
        for u in range(size - 1, 1, -1):
            if size % u == 0 and heads % u == 0:
                return self.name, u
        return None

    def needs_context(self, size: int, degree: int | None) -> bool:
        return degree is not None and degree < size  # at the whole group's size it is Ulysses: no sub-groups

    def groups(self, group, degree, timeout, cp_groups):
        if degree == dist.get_world_size(group):
            return group, None
        return _hybrid_groups(group, degree, timeout, cp_groups)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
        return ulysses_attention(q, k, v, spec)

    def traced(self, q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
        return ulysses_traced(q, k, v, spec)


HYBRID = Hybrid()


def _hybrid_groups(
    group: dist.ProcessGroup, u: int, timeout: timedelta | None, cp_groups: list[list[int]] | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(Ulysses group, ring group) of this rank: Ulysses inside blocks of `u` neighbouring ranks of its CP group, the
    ring across the blocks, among ranks at the same place in their block. `new_group` is collective over the
    default group, so every rank creates the sub-groups of every CP group, in the same order. `cp_groups`: the
    global ranks of every CP group of the job; None: gathered from all ranks (collective over the default group)."""
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
