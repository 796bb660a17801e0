"""The timed loop the peers' step scripts share (kohya's, diffusers' FLUX.2 example, diffusers' QLoRA recipe): each
runs its tool's step as that tool runs it and hands it here to be timed the same way."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

GIB = 2**30


def timed(step: Callable[[], None], warmup: int, steps: int, gpu: bool) -> dict:
    """`step` called `warmup + steps` times: the median time of the last `steps` (the GPU synchronised around each)
    and, on a GPU, the peak memory allocated over them."""
    times = []
    for i in range(warmup + steps):
        if gpu and i == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        step()
        if gpu:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    row = {"s_per_step": round(statistics.median(times), 4)}
    if gpu:
        row["step_peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    return row
