"""The few torch.distributed helpers the trainer needs, each in one place: is a process group up, a barrier,
"did any rank fail" (a collective every rank calls, so none is left waiting), and gathering small objects.
Every helper also works in a single process without a process group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flux_cp.errors import UsageError


def is_distributed() -> bool:
    """A process group is up (False in a plain single-process run)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def _collective_device() -> torch.device:
    """Where a tensor for a collective must live: the current GPU under NCCL, else the CPU (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is True on any rank."""
    if world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], device=_collective_device())
    dist.all_reduce(t)
    return bool(t.item())


def all_gather(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order ([obj] without a process group)."""
    if world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def check_all_ranks(ok: bool, message: str) -> None:
    """If any rank is not ok, every rank raises the same UsageError, joining the failing ranks' messages
    (printed once; no rank is left waiting in a later collective)."""
    if world_size() == 1:
        if not ok:
            raise UsageError(message)
        return
    if not any_rank(not ok):
        return
    unique = list(dict.fromkeys(m for m in all_gather(None if ok else message) if m))
    raise UsageError("; ".join(unique), agreed=True)
