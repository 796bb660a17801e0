"""Run a function on N spawned processes joined in one process group, with a hard timeout: gloo on the CPU (the
default), or NCCL with one CUDA GPU per process (tests/gpu); and the tiny Flux model, inputs and error measure that
the CP exactness tests share."""

from __future__ import annotations

import functools
import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(fn: Callable, rank: int, world: int, init_file: str, queue, args: tuple, backend: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        kw: dict[str, Any] = {"timeout": timedelta(seconds=60)}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kw = {"timeout": timedelta(seconds=120), "device_id": torch.device("cuda", rank)}
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world, **kw)
        queue.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# CPU ranks fork from a server that has imported these once per test session, instead of each importing torch
# and diffusers anew (seconds per rank, the larger part of a small test on 2 cores). CUDA ranks are spawned: a
# forked process must not inherit a CUDA context.
_PRELOAD = ["torch", "torch.distributed", "diffusers", "diffusers.models.transformers", "cp", "cp.flux", "cp.flux2",
            "flux_cp.families.flux1.tiny", "flux_cp.families.flux2.tiny"]  # fmt: skip
mp.set_forkserver_preload(_PRELOAD)


def run(fn: Callable, world: int, *args: Any, timeout: float = 240, backend: str = "gloo") -> list[Any]:
    """Return [fn(rank, world, *args) for each rank]; raise with every failing rank's traceback."""
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared machines
    ctx = mp.get_context("spawn" if backend == "nccl" else "forkserver")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init_file, queue, args, backend)) for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, tuple[bool, Any]] = {}
        import time

        deadline = time.monotonic() + timeout
        while len(results) < world and time.monotonic() < deadline:
            if not queue.empty():
                rank, ok, value = queue.get()
                results[rank] = (ok, value)
            elif all(not p.is_alive() for p in procs) and queue.empty():
                break
            else:
                time.sleep(0.02)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    missing = [r for r in range(world) if r not in results]
    if failed or missing:
        msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
        if missing:
            codes = {r: procs[r].exitcode for r in missing}  # negative: ended by that signal (-11: a segfault)
            msg += f"\nranks {missing} gave no result within {timeout}s (hang or crash; exit codes {codes})"
        raise AssertionError(msg)
    return [results[r][1] for r in range(world)]


# 12 heads: Ulysses works at 2, 3, 4 and 6 ranks. 24 image + 12 text tokens: divisible by 2, 3, 4.
HEADS, HEAD_DIM, TEXT, LAT_H, LAT_W = 12, 8, 12, 8, 12


def flux_model(lora: bool = True):
    from flux_cp.families.flux1.tiny import tiny_transformer

    model = tiny_transformer(seed=0, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, axes_dims_rope=(2, 2, 4))
    if lora:
        from peft import LoraConfig

        targets = ["to_q", "to_k", "to_v", "to_out.0"]
        config = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=targets)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            model.add_adapter(config)
            for name, p in model.named_parameters():
                if "lora_B" in name:  # peft zero-initialises B; make the adapters do something
                    p.normal_(std=0.05)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def flux_inputs(batch: int = 2) -> dict:
    from flux_cp.families.flux1.tokens import image_ids, pack_latents, text_ids

    g = torch.Generator().manual_seed(7)
    latents = torch.randn(batch, 4, LAT_H, LAT_W, generator=g)
    return dict(
        hidden_states=pack_latents(latents),
        encoder_hidden_states=torch.randn(batch, TEXT, 32, generator=g),
        pooled_projections=torch.randn(batch, 32, generator=g),
        timestep=torch.rand(batch, generator=g),
        guidance=torch.full((batch,), 3.5),
        img_ids=image_ids(LAT_H, LAT_W),
        txt_ids=text_ids(TEXT),
        target=torch.randn(batch, (LAT_H // 2) * (LAT_W // 2), 16, generator=g),
    )


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


def set_checkpointing(model, kind: str | None) -> None:
    if kind == "reentrant":
        # Reentrant checkpointing only produces parameter gradients when a block input requires grad.
        model.enable_gradient_checkpointing(functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True))
    elif kind == "non_reentrant":
        model.enable_gradient_checkpointing()  # diffusers' default (use_reentrant=False)
