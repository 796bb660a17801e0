"""Shared pieces of the benchmarks: process groups over a subset of the launched ranks, CUDA-event timing.
Launch with torchrun (NCCL on GPUs, gloo on CPU for smoke runs)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def init() -> tuple[int, int, torch.device]:
    """Join the launched process group; returns (rank, world, device)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world > 1 and not dist.is_initialized():
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=600), **kw)
    return rank, world, device


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup | None] = {}


def group_of(n: int) -> dist.ProcessGroup | None:
    """The group of ranks [0, n) (every launched rank must call this, in the same order); None for n = 1."""
    if n == 1:
        return None
    key = tuple(range(n))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key)) if n < dist.get_world_size() else dist.group.WORLD
    return _GROUPS[key]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device: torch.device, warmup: int, repeat: int, group: dist.ProcessGroup | None = None) -> list[float]:
    """Seconds per call, one value per repetition (each rank of `group` starts every repetition together)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        if group is not None:
            dist.barrier(group=group)
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            sync(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return times


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def max_over_ranks(x: float, group: dist.ProcessGroup | None, device: torch.device) -> float:
    """Step time of a CP group is its slowest rank's."""
    if group is None:
        return x
    t = torch.tensor([x], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()
