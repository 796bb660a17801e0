"""Run a function on N spawned processes, one CUDA GPU each, joined in an NCCL process group."""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(fn: Callable, rank: int, world: int, init_file: str, queue, args: tuple) -> None:
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120),
            device_id=torch.device("cuda", rank),
        )  # fmt: skip
        queue.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn: Callable, world: int, *args: Any, timeout: float = 600) -> list[Any]:
    """[fn(rank, world, *args) for each rank]; raises with every failing rank's traceback, or on a timeout."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared machines
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, os.path.join(tmp, "init"), queue, args))
                 for r in range(world)]  # fmt: skip
        for p in procs:
            p.start()
        results: dict[int, tuple[bool, Any]] = {}
        for p in procs:
            p.join(timeout=timeout)
        while not queue.empty():
            rank, ok, value = queue.get()
            results[rank] = (ok, value)
        for p in procs:
            if p.is_alive():
                p.kill()
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    missing = [r for r in range(world) if r not in results]
    if failed or missing:
        msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
        raise AssertionError(msg + (f"\nranks {missing} gave no result within {timeout}s" if missing else ""))
    return [results[r][1] for r in range(world)]
