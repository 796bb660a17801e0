"""`train_flux_cp.py --plan`: the report of a configuration before anything heavy loads - the run as planned, the
speed model's figures, the disk a run needs, the encoding phase's peak, the memory table over CP sizes, the base
precisions, and the one command recommended for the hardware (flux_cp.plan.recommend). The figures come from the
planner's models (flux_cp.plan.memory, encoding, speed, diskspace); this module only prints them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from flux_cp.config.fields import PRECISIONS
from flux_cp.model import adapters
from flux_cp.model.blocks import check_counts
from flux_cp.plan import diskspace, speed
from flux_cp.plan import encoding as encoding_memory
from flux_cp.plan.memory import (
    GIB,
    MARGIN,
    checkpointing_for,
    frozen_base,
    host_limit,
    local_processes,
    run_estimate,
    shape_at,
    unmeasured,
)
from flux_cp.shape.build import build_shape, launched_world_size, resolved

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.shape.run_shape import RunShape


def print_disk(cfg: Config, shape: RunShape) -> None:
    """The disk a run needs in --output_dir: one checkpoint and the final model (flux_cp.plan.diskspace)."""
    dtype = torch.float32 if cfg.train.mixed_precision == "no" else torch.bfloat16
    s = diskspace.run_sizes(cfg, shape.family, shape.transformer_config, dtype, shape.world)
    limit = cfg.checkpoints.checkpoints_total_limit
    print(
        f"disk: {s.describe()}; keep at least {diskspace.gib(s.checkpoint + s.model)} free in --output_dir"
        + (f" ({limit} checkpoints kept: {diskspace.gib((limit + 1) * s.checkpoint + s.model)})" if limit else "")
    )


def print_plan(cfg: Config, argv: Sequence[str] | None = None) -> None:
    """The plan, printed once: under `accelerate launch` every rank runs this, and all but rank 0 return at once. The
    run shape is the trainer's (flux_cp.shape.build.build_shape), for the launched processes (or --num_processes, or
    --cp_size's, run as one plain process), and again at each CP size listed. Then the flags' own row, the command
    recommended for these GPUs and the settings behind it (flux_cp.plan.recommend; `argv`: the flags as given, which
    the command repeats)."""
    from flux_cp.plan import compiling, recommend, speed_measure

    if int(os.environ.get("RANK", "0")) != 0:
        return
    world = cfg.plan.num_processes or launched_world_size()
    shape = build_shape(cfg, max(world, cfg.parallel.cp_size), planning=True)
    blocks = sum(n for _, n in shape.family.block_kinds(shape.transformer_config))
    check_counts(cfg.train.gradient_checkpointing, cfg.train.offload_blocks, blocks)  # as the run refuses them
    cfg = resolved(cfg, shape.family, shape.pairs, shape.transformer_config)  # the family's default --lora_layers
    gpu = cfg.plan.gpu_memory_gib or (
        torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else 141.0
    )
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if speed_measure.times_this_gpu(cfg.plan.gpu_class, device):
        print("speed: timing this GPU's blocks (once for these shapes; cached)...", flush=True)
    # Eager blocks at every precision (seconds), compiled ones at bf16 and the flags' (compiling takes tens of
    # seconds a precision): the other precisions' compiled dequantization is the GPU class's.
    every = PRECISIONS if not cfg.lora.full_finetune else ("bf16",)
    compiled_mode = speed.mode(True, cfg.train.compile_mode)
    wanted = [(every, ("eager",)), ((cfg.model.base_precision,), (compiled_mode,))]
    figures = speed_measure.choose(cfg, shape, device, gpu, wanted)
    host = host_limit(local_processes(shape), cfg.plan.host_memory_gib)
    with speed.using(figures):
        # the flags as a GPU run would take them: --compile auto decided (flux_cp.plan.compiling)
        decided, _ = compiling.decide(cfg, shape, torch.device("cuda"), gpu, host)
        _print_plan(decided, shape, gpu, host, given_compile=cfg.train.compile)
        recommend.print_answer(cfg, shape, gpu, host, print_encoding(cfg, shape, gpu * GIB, quiet=True), argv)
        print(
            f"figures are estimates: planned peaks within ~15% of measured ones ({1 - MARGIN:.0%} of each GPU kept "
            "free), step times within ~15% of the steps measured on the GPU classes of flux_cp/plan/speed_data "
            "(docs/small_gpus.md)"
        )


def _print_plan(cfg: Config, shape: RunShape, gpu: float, host: float | None, given_compile: str = "") -> None:
    """The header, the disk and the encoding phase, and the memory of these flags at each CP size (`given_compile`:
    --compile as given, when `cfg` holds what auto decided)."""
    world = shape.world
    tokens, references = shape.largest_sequence, shape.images_per_sample - 1
    batch = cfg.train.train_batch_size * cfg.data.samples_per_slot  # prior preservation: a class image per sample
    lora = None if cfg.lora.full_finetune else cfg.lora.rank
    trained = "full fine-tuning" if lora is None else f"{adapters.label(cfg.lora.adapter)} r{lora}"
    value, offload = cfg.train.gradient_checkpointing, cfg.train.offload_blocks
    precision = cfg.model.base_precision
    print(
        f"plan: {shape.config_source}, {cfg.data.largest_resolution} px"
        f"{f' {shape.family.pairs_label} pairs' if references == 1 else ''}"
        f"{f' with {references} references' if references > 1 else ''} ({tokens} tokens/sample), "
        f"batch {batch}/rank, "
        f"{trained}, {world} process(es), GPU {gpu:.0f} GiB, "
        + ("weights sharded over all GPUs (FSDP2)" if shape.sharded else "weights whole on every GPU (DDP)")
        + f", --compile {cfg.train.compile_mode or given_compile or cfg.train.compile}"
        + (f" (a GPU run: {cfg.train.compile})" if given_compile == "auto" and not cfg.train.compile_mode else "")
        + (f", base {precision}" if lora is not None else "")
        + (f", --offload_blocks {offload}" if offload != "0" else "")
    )
    fig = speed.active()
    print(f"speed model: {fig.describe} (--gpu_class h100|h200|rtx4090 for another GPU's)")
    print_disk(cfg, shape)
    encoding = print_encoding(cfg, shape, gpu * GIB)
    if note := unmeasured(shape.family):
        print(f"note: {note}")
    print(
        f"{'cp':>3} {'world':>5} {'weights':>8} {'grads':>7} {'adam':>7} {'act.ckpt':>9} {'act.full':>9} "
        f"{'total(ckpt)':>12} {'total(no ckpt)':>15} {'ckpt ' + value:>12} {'offload':>8} {'total':>7} "
        f"{'s/step':>7}  fits"
    )
    sizes = sorted({c for c in (1, 2, 4, 8, 16) if c <= max(world, 8)} | {shape.cp})
    for c in sizes:  # the shape at each CP size: its world, and the mode the heads allow there
        at = shape_at(cfg, shape, c, world)
        e = checkpointing_for(cfg, at, gpu, host)
        est = run_estimate(cfg, at)(len(e.blocks), e.offloaded)
        ck, full = est.total_with(est.activations_with_ckpt) / GIB, est.total_with(est.activations_without_ckpt) / GIB
        print(
            f"{c:>3} {at.world:>5} {est.weights / GIB:>8.1f} {est.grads / GIB:>7.1f} {est.optimizer / GIB:>7.1f} "
            f"{est.activations_with_ckpt / GIB:>9.1f} {est.activations_without_ckpt / GIB:>9.1f} {ck:>12.1f} "
            f"{full:>15.1f} {f'{len(e.blocks)}/{e.total}':>12} {f'{e.offloaded}/{e.total}':>8} {e.planned_gib:>7.1f} "
            f"{e.seconds:>7.2f}  " + ("yes" if e.fits and encoding else "no")
        )
    print_memory_lines(cfg, shape, gpu)


def print_encoding(cfg: Config, shape: RunShape, gpu_bytes: float, quiet: bool = False) -> bool:
    """The encoding phase's and validation decode's planned peaks (flux_cp.plan.encoding), from the components'
    configs; whether the encoding phase fits (a run fits when both it and the training step do). `quiet`: only
    whether it fits."""
    p = encoding_memory.plan_from_configs(cfg, shape, gpu_bytes, run_estimate(cfg, shape)(None).fixed)
    if p is None:
        if not quiet:
            print("encoding phase: not planned (the text encoders' and VAE's configs are not on this machine)")
        return True
    for line in () if quiet else p.lines():
        print(line)
    return p.encoding_bytes <= encoding_memory.MARGIN * gpu_bytes


def print_memory_lines(cfg: Config, shape: RunShape, gpu: float) -> None:
    """The frozen base at each --base_precision, and the pinned host memory of the run's offload."""
    if cfg.lora.full_finetune:
        return
    dtype = 4 if cfg.train.mixed_precision == "no" else 2
    sizes = {p: frozen_base(shape.family, shape.transformer_config, p, dtype).total / GIB for p in PRECISIONS}
    precision = cfg.model.base_precision
    others = ", ".join(f"{p} {gib:.2f}" for p, gib in sizes.items() if p != precision)
    sharded = " before sharding" if shape.sharded and shape.world > 1 else ""
    print(
        f"base precision {precision}: {sizes[precision]:.2f} GiB of frozen weights per GPU{sharded} ({others}: "
        "--base_precision)"
    )
    ckpt = checkpointing_for(cfg, shape, gpu)
    if cfg.train.offload_blocks != "0" or ckpt.offloaded:
        processes = local_processes(shape)
        machine = ""
        if processes > 1:
            machine = f" ({ckpt.host_gib * processes:.2f} GiB for the {processes} processes of a machine)"
        print(
            f"block offload at --cp_size {shape.cp}: {ckpt.offloaded} of {ckpt.total} blocks, "
            f"{ckpt.host_gib:.2f} GiB of pinned host memory per process{machine} (CPU RAM the run needs beside its own)"
        )
