"""Parallelism applied: the accelerator, the dp x cp layout with its process groups and CP context (built once, in
the CP mode the run shape chose), and `parallelize`, the one place a transformer is made to run on that layout (CP
attention, checkpointing and compile, block offload, FSDP2 or DDP), for training and for class-image generation alike.

GPU: accelerate's FSDP2 plugin with a `ParallelismConfig(dp_shard_size=dp, cp_size=cp)` mesh; FSDP
shards the weights over all dp x cp ranks and our CP group is the mesh's 'cp' dimension.
CPU: the same script as DDP over gloo (accelerate refuses FSDP2 on CPU), CP groups made here with the
same rank layout. Either way gradients are averaged over all dp x cp ranks, which with equal token
chunks and per-rank token-mean losses equals the full-sequence gradient (docs/design.md, data flow).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import cp
from cp.kernels import KERNELS
from cp.ulysses import used_chunks
from flux_cp.errors import UsageError
from flux_cp.layout import Layout, cp_group_ranks
from flux_cp.model.blocks import Checkpointing, compiled, prepare_blocks, uses_cuda_graphs
from flux_cp.model.loading import trainable_parameters
from flux_cp.model.offload import BlockOffload, block_kinds, frozen_block_bytes, offload_blocks
from flux_cp.model.offload_plan import check_host_memory, check_offload_count, offload_count

if TYPE_CHECKING:
    from flux_cp.config.flags import Config, ParallelConfig, ValidationConfig
    from flux_cp.config.training import TrainConfig
    from flux_cp.shape.run_shape import RunShape

logger = logging.getLogger("flux_cp")


def make_accelerator(parallel: ParallelConfig, train: TrainConfig, validation: ValidationConfig, shape: RunShape):
    """The Accelerator for a run of this shape, with the collective timeout and, under FSDP2, the dp x cp mesh."""
    kwargs = {}
    if shape.sharded and shape.cp > 1:
        from accelerate.parallelism_config import ParallelismConfig

        kwargs["parallelism_config"] = ParallelismConfig(dp_shard_size=shape.dp, cp_size=shape.cp)
    accelerator = _accelerator(parallel, train, validation, kwargs)
    if accelerator.is_fsdp2 and accelerator.mixed_precision in ("bf16", "fp16"):
        # accelerate's default FSDP2 policy reduces gradients in bf16; reduce them in fp32 instead. And do not
        # let FSDP cast block inputs: it casts the fp32 RoPE tables in the forward but not in the recomputation
        # of gradient checkpointing, which then fails (seen on H200s, torch 2.11). The model inputs are cast to
        # bf16 by the batch builder instead, and the RoPE tables stay fp32 as without FSDP.
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dt = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float16
        accelerator.state.fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy(
            param_dtype=dt, reduce_dtype=torch.float32, output_dtype=dt, cast_forward_inputs=False
        )
    return accelerator


def _accelerator(parallel: ParallelConfig, train: TrainConfig, validation: ValidationConfig, kwargs: dict):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    report = validation.report_to
    log_with = None if report == "none" else ("all" if report == "all" else [report])
    return Accelerator(
        # Without CUDA, accelerate would run one non-distributed process per launched process; cpu=True
        # makes the launched processes one gloo group (MULTI_CPU, DDP).
        cpu=not torch.cuda.is_available(),
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        mixed_precision=train.mixed_precision,
        log_with=log_with,
        project_config=ProjectConfiguration(
            project_dir=train.output_dir, logging_dir=os.path.join(train.output_dir, validation.logging_dir)
        ),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=parallel.collective_timeout))],
        **kwargs,
    )


def tracker_init_kwargs(train: TrainConfig, validation: ValidationConfig) -> dict[str, dict]:
    """accelerate's `init_kwargs` of the trackers: wandb writes its `wandb/` folder into the run's tracker folder, as
    TensorBoard does (wandb itself would write it into the current folder), unless WANDB_DIR names a place."""
    if validation.report_to not in ("wandb", "all") or os.environ.get("WANDB_DIR"):
        return {}
    return {"wandb": {"dir": os.path.join(train.output_dir, validation.logging_dir)}}


def wandb_folder(accelerator) -> str | None:
    """The folder of this process's wandb run (`.../wandb/run-...`), None without one."""
    try:
        run = accelerator.get_tracker("wandb", unwrap=True)
        return os.path.dirname(run.dir) if getattr(run, "dir", None) else None
    except Exception:  # noqa: BLE001 - no wandb tracker (or not on this process): nothing to say
        return None


def make_layout(accelerator, shape: RunShape, timeout_s: float, tuning: cp.Tuning | None = None) -> Layout:
    """This rank's layout and its CP context, built once in the shape's CP mode: the CP group (the mesh's 'cp'
    dimension under FSDP2, else made here), with `timeout_s` for the sub-groups its mode creates (the hybrid mode's:
    collective over the default group, so every rank builds its layout at the same point) and the CP `tuning`."""
    rank, n = accelerator.process_index, shape.cp
    groups = cp_group_ranks(shape.world, n)
    timeout = timedelta(seconds=timeout_s)
    group = None
    if n > 1:
        mesh = getattr(accelerator, "torch_device_mesh", None)
        if mesh is not None and "cp" in mesh.mesh_dim_names:
            group = mesh["cp"].get_group()
        else:  # every rank creates every group, in the same order (a torch.distributed rule)
            made = [dist.new_group(ranks, timeout=timeout) for ranks in groups]
            group = made[rank // n]
        members = dist.get_process_group_ranks(group)
        if members != groups[rank // n]:  # the data sampler assumes dp_rank = rank // cp
            raise RuntimeError(f"CP group of rank {rank} is {members}, expected neighbouring ranks {groups[rank // n]}")
    context = cp.CPContext(group, shape.cp_mode, shape.ulysses_size, tuning=tuning, timeout=timeout, cp_groups=groups)
    if context.size != n:
        raise RuntimeError(f"the CP group of rank {rank} has {context.size} ranks, --cp_size {n}")
    return Layout(shape.world, rank, n, shape.dp, rank // n, rank % n, group, context)


def cp_tuning(cfg: Config, shape: RunShape, device_type: str) -> tuple[cp.Tuning, list[str]]:
    """The CP tuning of the flags as this device and model run it, decided once at start: the kernels this device
    runs, the overlap pass it can apply, the Ulysses head chunks the model's heads allow. Returns the tuning and the
    warnings for what is used otherwise than given."""
    tuning = cfg.cp_tuning
    warnings = [check_kernels(tuning.kernels, device_type)]
    check_overlap(tuning.cp_overlap, compiled(cfg.train), shape.cp, device_type)
    chunks = 1
    if shape.cp > 1:
        chunks, warning = ulysses_chunks(tuning.cp_ulysses_chunks, shape.heads, shape.cp_mode, shape.ulysses_size)
        warnings.append(warning)
    return dataclasses.replace(tuning.tuning(), ulysses_chunks=chunks), [w for w in warnings if w]


def check_kernels(names: tuple[str, ...], device_type: str) -> str | None:
    """--cp_kernels against the device the run trains on, at start: refused when none of them runs there (the first
    attention call would fail), a warning naming those that do not (skipped at every call)."""
    where = {"cpu": "the CPU", "cuda": "CUDA GPUs"}.get(device_type, device_type)
    off = [n for n in names if device_type not in KERNELS[n].devices]
    if not off:
        return None
    runs = sorted(n for n, k in KERNELS.items() if device_type in k.devices)
    if len(off) == len(names):
        raise UsageError(
            f"--cp_kernels {','.join(names)}: none of these attention kernels runs on {where} ("
            + "; ".join(f"{n} needs {' or '.join(KERNELS[n].devices)}" for n in off)
            + f"): name one of {', '.join(runs)}, or drop --cp_kernels for the default order",
            agreed=True,
        )
    used = [n for n in names if n not in off]
    serve = "serves" if len(used) == 1 else "serve"
    given = ",".join(names)
    return f"--cp_kernels {given}: {', '.join(off)} cannot run on {where}; {', '.join(used)} {serve} every call"


def check_overlap(overlap: str, compiled: bool, cp_size: int, device_type: str) -> None:
    """--cp_overlap scheduler is Inductor's overlap scheduler, which orders by its GPU runtime estimates: it needs a
    CUDA device and triton (without them the first compiled step fails). Refused at start otherwise."""
    if overlap != "scheduler" or not compiled or cp_size == 1:
        return
    missing = "a CUDA GPU" if device_type != "cuda" else None
    if missing is None and importlib.util.find_spec("triton") is None:
        missing = "triton (pip install triton)"
    if missing:
        raise UsageError(
            f"--cp_overlap scheduler is Inductor's overlap scheduler, which needs {missing}: choose --cp_overlap fill "
            "(the default), passes, compute or none",
            agreed=True,
        )


def ulysses_chunks(requested: int, heads: int, mode: str, ulysses_size: int | None) -> tuple[int, str | None]:
    """--cp_ulysses_chunks as this model and CP mode use it, computed once at start: (chunks, a warning when that is
    not the number asked for). More chunks than the model has heads is refused (a chunk holds at least one head)."""
    if requested > heads:
        raise UsageError(
            f"--cp_ulysses_chunks {requested}: the model has {heads} attention heads and a chunk holds at least one; "
            f"use at most {heads}",
            agreed=True,
        )
    if requested == 1:
        return 1, None
    if ulysses_size is None:
        return 1, f"--cp_ulysses_chunks {requested} has no effect with --cp_mode {mode} (no Ulysses exchange): 1 used"
    used = used_chunks(heads, ulysses_size, requested)
    if used == requested:
        return used, None
    return used, (
        f"--cp_ulysses_chunks {requested}: {used} used, the most up to {requested} whose chunks' heads divide over the "
        f"Ulysses group of {ulysses_size} ({heads} heads)"
    )


@dataclass
class Parallelized:
    """A transformer made to run on the layout (`parallelize`)."""

    model: torch.nn.Module  # wrapped by accelerate (DDP or FSDP2) for training; the transformer itself otherwise
    optimizer: Any = None  # accelerate's wrapper of `base_optimizer`
    base_optimizer: Any = None  # the optimizer as built: the LR schedule steps it
    offload: BlockOffload | None = None


def parallelize(
    transformer: torch.nn.Module,
    shape: RunShape,
    layout: Layout,
    cfg: Config,
    *,
    checkpointing: Checkpointing | None = None,
    device: torch.device | None = None,
    accelerator=None,
    make_optimizer: Callable[[list[torch.nn.Parameter]], Any] | None = None,
) -> Parallelized:
    """Make `transformer` run on `layout`. In this order, each step needing the one before (a quantized frozen base
    and the LoRA adapters are added before: flux_cp.model.loading):

    1. CP: the attention processors of the layout's CP context (installed at cp=1 too: their kernels, cuDNN on
       Hopper, beat diffusers' default SDPA path);
    2. activation checkpointing of the blocks `checkpointing` names, and torch.compile of every block with
       --compile (flux_cp.model.blocks);
    3. training: block offload (--offload_blocks): the frozen weights of some blocks to pinned host memory, the rest
       of the model to `device` (flux_cp.model.offload);
    4. training: the optimizer over the trainable parameters where they now live (`make_optimizer`), then
       accelerate's prepare: FSDP2 or DDP.

    Without an accelerator (class images): steps 1 and 2 without checkpointing, nothing offloaded or wrapped."""
    train = cfg.train
    cp.apply_context_parallel(transformer, layout.cp_context)
    if accelerator is not None and layout.cp > 1:
        mode, u = shape.cp_mode, shape.ulysses_size
        auto = "auto-chosen " if cfg.parallel.cp_mode == "auto" else ""
        logger.info(f"{auto}context parallel: {mode}" + (f" (ulysses {u})" if u else "") + f" over {layout.cp} ranks")
        advice = cp_advice(shape.image_tokens() + shape.text_tokens, layout.cp, uses_cuda_graphs(train.compile_mode))
        if advice and device is not None and device.type == "cuda":  # measured on GPUs; the CPU demo's are for tests
            logger.warning(advice)
    checkpointed = checkpointing.blocks if checkpointing is not None and accelerator is not None else range(0)
    prepare_blocks(
        transformer,
        checkpointed=checkpointed,
        recompute_attention=train.recompute_attention,
        compile=compiled(train),
        compile_mode=train.compile_mode,
        cp=layout.cp,
        tuning=layout.cp_context.tuning,
    )
    if accelerator is None:
        return Parallelized(transformer)
    offload = _offload(transformer, cfg, checkpointing, layout, device)
    optimizer = make_optimizer([p for _, p in trainable_parameters(transformer)])
    # An offloaded model is where it must be already: accelerate's move to its device (on the CPU "cpu:0", which copies
    # every CPU tensor) would undo the slots
    model, prepared = accelerator.prepare(transformer, optimizer, device_placement=[offload is None, True])
    if offload is not None:
        offload.check()  # nothing moved or converted its weights since
    return Parallelized(model, prepared, optimizer, offload)


def _offload(
    transformer: torch.nn.Module, cfg: Config, checkpointing: Checkpointing | None, layout: Layout, device: torch.device
) -> BlockOffload | None:
    """--offload_blocks applied (auto: the count the memory planner chose with the checkpointed blocks, in
    `checkpointing`); the transformer on `device` either way."""
    n = offload_count(cfg.train.offload_blocks)
    kinds = block_kinds(transformer)
    if n is None:
        n = checkpointing.offloaded if checkpointing is not None else 0
    if n == 0:
        transformer.to(device)
        return None
    plan = check_offload_count(n, kinds, frozen_block_bytes(transformer))
    check_host_memory(plan, int(os.environ.get("LOCAL_WORLD_SIZE", layout.world)))
    offload = offload_blocks(transformer, n, device)
    logger.info(offload.plan.describe())
    return offload


# CP on H200s at 2,304 tokens per rank (1024 px on 2 GPUs), LoRA step through the trainer: compiled, no faster
# than one GPU (0.456 s against 0.448 s); with CUDA graphs (--compile_mode reduce-overhead) 0.280 s against 0.440 s,
# 0.78 efficient. At 8,448 per rank (2048 px) 0.92-0.95 efficient either way (benchmarks/archive/history.md). The
# threshold sits between the two measured points; lengths in between were not measured.
SHORT_TOKENS_PER_RANK = 4096


def cp_advice(tokens: int, cp_size: int, cuda_graphs: bool) -> str | None:
    """A warning for CP groups whose ranks get too few tokens to gain from the split without CUDA graphs (None: no
    advice)."""
    per_rank = tokens // cp_size
    if cp_size == 1 or per_rank >= SHORT_TOKENS_PER_RANK or cuda_graphs:
        return None
    return (
        f"--cp_size {cp_size} leaves {per_rank} tokens per rank: at 2,304 per rank compiled CP was no faster than one "
        "GPU on H200s, and 1.6x faster with CUDA graphs (benchmarks/archive/history.md). Add --compile_mode "
        "reduce-overhead; or, unless one sample must be split to fit, --cp_size 1 (each GPU its own sample) trains "
        "more samples per second."
    )
