"""The dp x cp layout: which ranks share a sample (a CP group of neighbouring ranks) and which see
different samples (data-parallel ranks), the accelerator, and the process groups.

GPU: accelerate's FSDP2 plugin with a `ParallelismConfig(dp_shard_size=dp, cp_size=cp)` mesh; FSDP
shards the weights over all dp x cp ranks and our CP group is the mesh's 'cp' dimension.
CPU: the same script as DDP over gloo (accelerate refuses FSDP2 on CPU), CP groups made here with the
same rank layout. Either way gradients are averaged over all dp x cp ranks, which with equal token
chunks and per-rank token-mean losses equals the full-sequence gradient (docs/design.md, data flow).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import cp

from .errors import UsageError

if TYPE_CHECKING:
    from .config import ParallelConfig, TrainConfig, ValidationConfig
    from .shape import RunShape


@dataclass
class Layout:
    """This process's place in the dp x cp grid. `rank` is the process rank (the LoRA rank is `LoraConfig.rank`).
    `cp_context`: the CP group with its timeout and tuning (`cp.CPContext`; its mode is chosen once the model's heads
    are known, by `cp.apply_context_parallel`); one with the default tuning when not given."""

    world: int
    rank: int
    cp: int
    dp: int
    dp_rank: int
    cp_rank: int
    cp_group: dist.ProcessGroup | None
    cp_context: cp.CPContext | None = None

    def __post_init__(self) -> None:
        if self.cp_context is None:
            self.cp_context = cp.CPContext(self.cp_group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return f"world {self.world} = dp {self.dp} x cp {self.cp}"


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(world: int, cp_size: int) -> int:
    """dp size for `world` processes with CP groups of `cp_size`; a UsageError that says what to change."""
    if world % cp_size:
        options = [c for c in range(1, world + 1) if world % c == 0]
        raise UsageError(
            f"--cp_size {cp_size} does not divide the {world} launched processes: choose --cp_size from {options}, "
            f"or launch a multiple of {cp_size} processes (accelerate launch --num_processes)"
        )
    return world // cp_size


def launched_with_fsdp() -> bool | None:
    """Whether `accelerate launch`'s config asks for FSDP (it sets ACCELERATE_USE_FSDP); None when accelerate did
    not launch this process (a plain `python train_flux_cp.py`, e.g. for --plan)."""
    if "ACCELERATE_MIXED_PRECISION" not in os.environ and "ACCELERATE_USE_FSDP" not in os.environ:
        return None
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def uses_fsdp() -> bool:
    """FSDP2 shards this run's weights: the launch config asks for it, and there is CUDA (FSDP2 needs it here)."""
    return bool(launched_with_fsdp()) and torch.cuda.is_available()


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


def make_layout(accelerator, cp_size: int, timeout_s: float, tuning: cp.Tuning | None = None) -> Layout:
    """This rank's layout and its CP context: the CP group (the mesh's 'cp' dimension under FSDP2, else made here),
    with `timeout_s` for the sub-groups its modes create and the CP `tuning`."""
    world, rank = accelerator.num_processes, accelerator.process_index
    dp = world // cp_size  # the run shape checked that it divides
    group = None
    if cp_size > 1:
        mesh = getattr(accelerator, "torch_device_mesh", None)
        if mesh is not None and "cp" in mesh.mesh_dim_names:
            group = mesh["cp"].get_group()
        else:
            # Every rank creates every group, in the same order (a torch.distributed rule).
            for d in range(dp):
                g = dist.new_group(list(range(d * cp_size, (d + 1) * cp_size)), timeout=timedelta(seconds=timeout_s))
                if d == rank // cp_size:
                    group = g
        members = dist.get_process_group_ranks(group)
        expected = list(range((rank // cp_size) * cp_size, (rank // cp_size + 1) * cp_size))
        if members != expected:  # the data sampler assumes dp_rank = rank // cp
            raise RuntimeError(f"CP group of rank {rank} is {members}, expected neighbouring ranks {expected}")
    all_groups = [list(range(d * cp_size, (d + 1) * cp_size)) for d in range(dp)]
    context = cp.CPContext(group, tuning=tuning, timeout=timedelta(seconds=timeout_s), cp_groups=all_groups)
    return Layout(world, rank, cp_size, dp, rank // cp_size, rank % cp_size, group, context)


def choose_cp_mode(parallel: ParallelConfig, heads: int, cp_size: int) -> tuple[str, int | None]:
    """Resolve --cp_mode (auto: `auto_mode`) and check it against the model; a UsageError if it cannot work."""
    mode, u = parallel.cp_mode, parallel.ulysses_size
    if cp_size == 1:
        return "ring", None
    if mode == "auto":
        mode, u = auto_mode(heads, cp_size)
    try:
        u = cp.validate((1, cp_size, heads, 1), cp_size, mode, u)
    except ValueError as e:
        raise UsageError(f"--cp_mode {parallel.cp_mode}: {e}", agreed=True) from None  # same on every rank
    return mode, u


def check_kernels(names: tuple[str, ...], device_type: str) -> str | None:
    """--cp_kernels against the device the run trains on, at start: refused when none of them runs there (the first
    attention call would fail), a warning naming those that do not (skipped at every call)."""
    from cp.kernels import KERNELS

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
    import importlib.util

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
    from cp.ulysses import used_chunks

    used = used_chunks(heads, ulysses_size, requested)
    if used == requested:
        return used, None
    return used, (
        f"--cp_ulysses_chunks {requested}: {used} used, the most up to {requested} whose chunks' heads divide over the "
        f"Ulysses group of {ulysses_size} ({heads} heads)"
    )


def auto_mode(heads: int, cp_size: int) -> tuple[str, int | None]:
    """The CP mode, by the H200 measurements in benchmarks/archive/history.md (the same at every sequence length):

    - Ulysses when the heads divide over the group: fewer, larger messages. Compiled, on 2 H200s, its
      attention beat the ring's at 16,896 and 66,048 tokens on three machines (12.36 / 173.3 against 13.62 /
      180.8 ms on the latest; 12.07 / 173.8 against 13.71 / 180.2 ms; 12.25 / 174.1 against 13.59 / 181.5 ms before
      the exchanges moved to the kernel's layout). Eager, it
      matched or beat the ring at every size (LoRA step at 2048 px: 1.98 against 2.21 s; at 1024 px: 0.87 against
      0.99 s; attention at 16,896 / 66,048 tokens: 12.9 / 176 against 14.1 / 183 ms); on 4, at every size too
      (attention 3.09 / 6.86 / 90.2 ms against the ring's 6.52 / 10.5 / 95.6 ms at 4,608 / 16,896 / 66,048
      tokens). One earlier run on 4 H200s had the ring ahead at 1024 px on 2 of them (0.815 against 0.893 s);
      the next did not reproduce it, so no exception is made for short sequences.
    - else hybrid with the largest Ulysses degree dividing both (at 4 ranks it sits between the two at
      every size), else ring.
    """
    if heads % cp_size == 0:
        return "ulysses", None
    for u in range(cp_size - 1, 1, -1):
        if cp_size % u == 0 and heads % u == 0:
            return "hybrid", u
    return "ring", None


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
