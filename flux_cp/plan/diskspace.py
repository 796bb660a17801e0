"""Disk space: the size of one checkpoint and of the final model, known before training from parameter counts on
the meta device, and the checks that keep a run from failing half-way through a write.

A run is refused at start when its output disk cannot hold one checkpoint and the final model; every save checks
again before it writes, so a full disk stops the run cleanly with the last good checkpoint kept. Sizes are the
tensor bytes plus a per-tensor allowance for the file formats' own records (measured on torch.distributed.checkpoint:
about 1.8 KiB per tensor for weights alone, 7.4 KiB with AdamW's state; safetensors: well under 512 bytes).

Tests pretend the output disk is small with FLUX_CP_DISK_BYTES=N: the disk then holds N bytes and nothing but
`--output_dir`, so free space shrinks as the run writes (see flux_cp/run/faults.py).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flux_cp import checkpoint_folders, distributed
from flux_cp.errors import UsageError
from flux_cp.model.optim import LABELS, optimizer_name, state_bytes
from flux_cp.plan.counts import ParameterCounts, parameter_counts

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.families.base import Family

GIB = 2**30
CHECKPOINT_TENSOR_BYTES = 2048  # torch.save record of one tensor in a DCP shard file, per writing rank
CHECKPOINT_OPTIMIZER_TENSOR_BYTES = 8192  # the same with AdamW's two moments, its step and the param-group entries
CHECKPOINT_FIXED_BYTES = 64 * 1024  # .metadata, meta.json, train.pt
SAFETENSORS_TENSOR_BYTES = 512  # one header entry
# The optimizer's state beyond its bytes per parameter (flux_cp.model.optim.state_bytes): bytes per trainable tensor
# beyond AdamW's records. Prodigy: two more records. 8-bit AdamW: two 256-entry fp32 maps, four more records, and up to
# 24 KiB more where a tensor under 4096 values keeps fp32 moments instead.
OPTIMIZER_TENSOR_BYTES = {"adamw": 0, "prodigy": 4096, "adamw8bit": 2048 + 8192 + 24576}
MODEL_FIXED_BYTES = 1024 * 1024  # a transformer folder's config.json and shard index
LORA_FIXED_BYTES = 64 * 1024


@dataclass(frozen=True)
class Sizes:
    checkpoint: int
    checkpoint_weights: int  # of which the fp32 trainable weights
    checkpoint_optimizer: int  # of which the optimizer's state (0: checkpoints without it)
    model: int
    model_name: str  # what the final model is: a LoRA file or a transformer folder
    optimizer_label: str = "AdamW"
    checkpoint_lora: int = 0  # of which the LoRA file of its step (LoRA runs: flux_cp.outputs.checkpoint)

    def describe(self) -> str:
        parts = [f"fp32 weights {gib(self.checkpoint_weights)}"]
        if self.checkpoint_optimizer:
            parts.append(f"{self.optimizer_label} state {gib(self.checkpoint_optimizer)}")
        if self.checkpoint_lora:
            parts.append(f"the step's LoRA file {gib(self.checkpoint_lora)}")
        held = " + ".join(parts) + ("" if self.checkpoint_optimizer else ", no optimizer state")
        return f"one checkpoint {gib(self.checkpoint)} ({held}), the final {self.model_name} {gib(self.model)}"


def run_sizes(cfg: Config, family: Family, config: dict, model_dtype: torch.dtype, world: int) -> Sizes:
    """`sizes` of a run with these flags, of a transformer of `config` of the model `family`: the trainer's disk
    checks and `--plan` alike."""
    lora = None if cfg.lora.full_finetune else cfg.lora.rank
    counts = parameter_counts(family, config, lora, list(cfg.lora.lora_layers), cfg.lora.adapter)
    return sizes(
        counts,
        cfg.lora.full_finetune,
        not cfg.checkpoints.checkpoint_weights_only,
        model_dtype,
        world,
        optimizer_name(cfg.train),
    )


def sizes(
    counts: ParameterCounts,
    full_finetune: bool,
    optimizer_state: bool,
    model_dtype: torch.dtype,
    world: int,
    optimizer: str = "adamw",
) -> Sizes:
    """Bytes of one checkpoint (trainable weights in fp32, the optimizer's state when kept: AdamW's exp_avg,
    exp_avg_sq and step, or `optimizer`'s, flux_cp.model.optim.optimizer_name; a LoRA run's also the LoRA file of its
    step) and of the final model (a fp32 LoRA file, or the transformer in the training dtype)."""
    n, tensors = counts.trainable, counts.trainable_tensors
    per_param, per_tensor = state_bytes(optimizer), OPTIMIZER_TENSOR_BYTES[optimizer]
    weights = n * 4 + tensors * CHECKPOINT_TENSOR_BYTES * world
    records = CHECKPOINT_OPTIMIZER_TENSOR_BYTES - CHECKPOINT_TENSOR_BYTES + per_tensor
    optimizer_bytes = math.ceil(n * per_param) + tensors * 4 + tensors * records * world if optimizer_state else 0
    fixed = CHECKPOINT_FIXED_BYTES + 16 * 1024 * world
    if full_finetune:
        size = torch.empty((), dtype=model_dtype).element_size()
        model = counts.base * size + counts.base_tensors * SAFETENSORS_TENSOR_BYTES + MODEL_FIXED_BYTES
        name = "transformer"
    else:
        model = n * 4 + tensors * SAFETENSORS_TENSOR_BYTES + LORA_FIXED_BYTES
        name = "LoRA"
    lora = 0 if full_finetune else model
    total = weights + optimizer_bytes + fixed + lora
    return Sizes(total, weights + fixed, optimizer_bytes, model, name, LABELS[optimizer], lora)


def gib(n: float) -> str:
    """Bytes in GiB (or MiB, KiB for small ones)."""
    if n >= GIB / 10:
        return f"{n / GIB:.1f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 / 10 else f"{n / 2**10:.1f} KiB"


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _tree_bytes(path: Path) -> int:
    return sum(
        os.path.getsize(os.path.join(r, f))
        for r, _, fs in os.walk(path)
        for f in fs
        if not os.path.islink(os.path.join(r, f))
    )


def pretend_bytes() -> int | None:
    """FLUX_CP_DISK_BYTES (tests: the output disk's pretended size), None when unset; a UsageError naming the
    variable when it is not a whole number of bytes."""
    value = os.environ.get("FLUX_CP_DISK_BYTES")
    if not value:
        return None
    if not value.strip().isdigit():
        raise UsageError(
            f"FLUX_CP_DISK_BYTES={value!r} is not a whole number of bytes (e.g. 1000000000): fix or unset it (it "
            "pretends the output disk holds that many bytes, for tests)"
        )
    return int(value)


def free_bytes(folder: str | os.PathLike) -> int:
    """Free bytes on the disk that holds `folder` (or would hold it)."""
    pretend = pretend_bytes()
    if pretend is not None:
        return pretend - (_tree_bytes(Path(folder)) if Path(folder).is_dir() else 0)
    return shutil.disk_usage(_existing(Path(folder))).free


def check_start(folder: str | os.PathLike, s: Sizes, saves: int, total_limit: int | None) -> str | None:
    """Refuse a run whose output disk cannot hold one checkpoint and the final model; a warning (or None) when all
    the checkpoints it would keep do not fit. `saves`: checkpoints this run will write."""
    free = free_bytes(folder)
    need = s.checkpoint + s.model
    if free < need:
        smaller = (
            f"; --checkpoint_weights_only makes checkpoints of {gib(s.checkpoint_weights + s.checkpoint_lora)}"
            if s.checkpoint_optimizer
            else ""
        )
        raise UsageError(
            f"the disk of --output_dir {folder} has {gib(free)} free, but this run needs {gib(need)} at least: "
            f"{s.describe()}. Free space or choose another --output_dir{smaller}"
        )
    kept = min(saves, (total_limit or saves) + 1)  # a new checkpoint is written before the oldest is removed
    if kept > 1 and free < kept * s.checkpoint + s.model:
        return (
            f"{kept} checkpoints of {gib(s.checkpoint)} and the final {s.model_name} need "
            f"{gib(kept * s.checkpoint + s.model)}, and the disk of --output_dir has {gib(free)} free: the run will "
            "stop at the save that no longer fits (set --checkpoints_total_limit to keep fewer)"
        )
    return None


def check_write(folder: str | os.PathLike, need: int, what: str, kept: str, resumable: bool = True) -> None:
    """Before writing `what` (`need` bytes): a UsageError with the numbers if the disk cannot hold it. `kept`: what
    stays usable when the run stops here; `resumable`: whether a checkpoint exists to resume from."""
    free = free_bytes(folder)
    if free < need:
        then = (
            "then resume with --resume_from_checkpoint latest"
            if resumable
            else "then run again with --overwrite_output_dir (no checkpoint to resume: it starts from step 0)"
        )
        raise UsageError(
            f"not enough disk space for {what}: it needs {gib(need)}, the disk of {folder} has {gib(free)} free. "
            f"Nothing was written; {kept}. Free space (or keep fewer checkpoints: --checkpoints_total_limit, "
            f"--checkpoint_weights_only), {then}"
        )


def check_checkpoint(output_dir: str | os.PathLike, step: int, need: int, is_main: bool) -> None:
    """Before checkpoint-`step` is written (every rank calls it): a UsageError, the same on every rank, when the disk
    cannot hold its `need` bytes; nothing is written then and the last good checkpoint is kept."""
    prev = checkpoint_folders.list_checkpoints(output_dir)
    kept = f"{prev[-1][1]} is the last good checkpoint" if prev else "no checkpoint was written before"
    short = None
    if is_main:
        try:
            check_write(output_dir, need, f"checkpoint-{step}", kept, resumable=bool(prev))
        except UsageError as e:
            short = str(e)
    if distributed.any_rank(short is not None):
        raise UsageError(short or f"not enough disk space for checkpoint-{step}; {kept}", agreed=True)
