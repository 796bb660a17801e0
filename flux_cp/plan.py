"""`train_flux_cp.py --plan`: per-GPU memory of a configuration before anything heavy is loaded, the smallest CP
size that fits, and how many blocks `--gradient_checkpointing auto` checkpoints.

Weights, gradients and AdamW state are counted exactly from the transformer's config (the model is built on
the meta device, with the LoRA adapters the flags would add). Activations are counted in units of one
token's hidden state in bf16 (2 x D bytes per token; the model family gives D and its blocks, in the order they
run). A block that is not checkpointed keeps what its backward needs: `block_keeps` per block kind, eager and
compiled apart (Inductor fuses away intermediates autograd would keep), counted on CPU by tests/test_plan.py. A
checkpointed block keeps its input (1 unit) and, compiled, its attention's outputs (`saved_attention_units`).
The peak is at the start of the backward: everything kept, plus the temporaries of the first backward
(`backward_start_units`) - or, when the last block is checkpointed too, while a block is recomputed
(`block_peak_units`). Those two are fitted to one measured peak each (FLUX.1-dev, LoRA, one H200); the other
measured peaks check the whole estimate (tests/test_plan.py). The constants and those peaks, with their sources,
are in plan_data.json beside this module.
The optimizer step has a peak of its own: torch's multi-tensor AdamW holds sqrt(v) for all of a rank's
trainable parameters at once (fp32), after the activations are freed; it decides full fine-tuning's peak.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import diskspace
from .blocks import attention_recomputed, checkpointed_blocks, more_blocks_than_there_are
from .families import for_transformer
from .optim import optimizer_name, state_bytes
from .shape import RunShape, auto_mode, build_shape, launched_world_size, resolved

if TYPE_CHECKING:
    from .config import Config
    from .families import Family

logger = logging.getLogger("flux_cp")

GIB = 2**30
DATA = json.loads((Path(__file__).parent / "plan_data.json").read_text())  # its "notes" say what each constant is
BLOCK_PEAK_UNITS: float = DATA["block_peak_units"]
BACKWARD_START_UNITS: float = DATA["backward_start_units"]
BLOCK_KEEPS: dict[str, dict[str, dict[str, float]]] = DATA["block_keeps"]
FSDP_GATHERED_BLOCKS: int = DATA["fsdp_gathered_blocks"]
SAVED_ATTENTION_UNITS: dict[str, float] = DATA["saved_attention_units"]
MARGIN = 0.9  # of the GPU's memory a plan may use: the estimates are within ~10% of measured peaks


@dataclass
class Estimate:
    weights: float
    grads: float
    optimizer: float
    activations: float  # with the blocks checkpointed that the estimate was asked for
    activations_without_ckpt: float
    activations_with_ckpt: float
    step_temporaries: float  # AdamW's sqrt(v) during the optimizer step, when no activations are held
    checkpointed: int = 0  # blocks checkpointed in `activations`
    blocks: int = 0  # blocks of the transformer

    @property
    def fixed(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.total_with(self.activations)

    def total_with(self, activations: float) -> float:
        return self.fixed + max(activations, self.step_temporaries)


def count_parameters(config: dict, lora_rank: int | None, lora_layers: list[str]) -> tuple[int, int, int]:
    """(all base parameters, trainable parameters, parameters of the largest block), exact, on the meta device."""
    c = for_transformer(config).count_parameters(config, lora_rank, lora_layers)
    return c.base, c.trainable, c.largest_block


def block_keeps(family: Family, compiled: bool) -> dict[str, float]:
    """Units each block kind of `family` keeps for its backward without checkpointing (plan_data.json, by transformer
    class). A family without measured counts gets the most that any measured block keeps, for every kind of its
    blocks: an estimate on the safe side (`unmeasured` says so)."""
    how = "compiled" if compiled else "eager"
    keeps = BLOCK_KEEPS.get(family.transformer_class_name)
    if keeps is None:
        most = max(units for measured in BLOCK_KEEPS.values() for units in measured[how].values())
        return {kind: most for kind, _, _ in family.block_lists}
    return keeps[how]


def unmeasured(family: Family) -> str | None:
    """What to say when the planner has no measured activation counts for the family's blocks (None: it has)."""
    if family.transformer_class_name in BLOCK_KEEPS:
        return None
    return (
        f"the memory planner has no measured activation counts for {family.transformer_class_name}: it counts every "
        "block as keeping what the most demanding measured block keeps (an estimate on the safe side)"
    )


def checkpoint_from_end(kinds: tuple[tuple[str, int], ...], keeps: dict[str, float]) -> bool:
    """Whether partial checkpointing takes the last blocks rather than the first: the end whose blocks keep the
    most frees the most memory per block recomputed (every block of FLUX.1 and FLUX.2 costs the same FLOPs per
    token). FLUX.1: the double blocks (first); FLUX.2: the single blocks (last)."""
    return keeps[kinds[-1][0]] > keeps[kinds[0][0]]


def checkpointed_indices(blocks: int, checkpointed: int, from_end: bool) -> range:
    """Indices (in the order the blocks run) of the `checkpointed` blocks checkpointed."""
    n = max(0, min(checkpointed, blocks))
    return range(blocks - n, blocks) if from_end else range(n)


def activation_units(
    kinds: tuple[tuple[str, int], ...], keeps: dict[str, float], checkpointed: int, saved_attention: float
) -> float:
    """Units held at the peak with `checkpointed` blocks checkpointed, from the end `checkpoint_from_end` picks."""
    order = [kind for kind, n in kinds for _ in range(n)]
    chosen = checkpointed_indices(len(order), checkpointed, checkpoint_from_end(kinds, keeps))
    held = len(chosen) * (1 + saved_attention) + sum(keeps[k] for i, k in enumerate(order) if i not in chosen)
    # The backward starts at the last block: its recomputation, or the temporaries of a block that kept everything.
    return held + (BLOCK_PEAK_UNITS if len(order) - 1 in chosen else BACKWARD_START_UNITS)


def estimate(
    config: dict,
    *,
    tokens: int,
    batch: int,
    lora_rank: int | None,
    lora_layers: list[str],
    world: int,
    cp: int,
    checkpointing: bool = True,
    checkpointed: int | None = None,
    compiled: bool = False,
    weight_bytes: int = 2,
    fsdp: bool | None = None,
    saved_attention: float = 0.0,
    family: Family | None = None,
    optimizer: str = "adamw",
) -> Estimate:
    """Bytes per GPU. `tokens` per sample (image + text); FSDP (default: world > 1) shards weights, gradients
    and optimizer state over all `world` ranks; each rank holds tokens / cp of each of its `batch` samples.
    `checkpointed`: blocks checkpointed (default: all with `checkpointing`, else none); `compiled`: torch.compile'd
    blocks (they keep less without checkpointing); `saved_attention`: units each checkpointed block keeps of its
    attention (`saved_attention_units`). `family`: default the one the config names. `optimizer`: whose state
    (flux_cp.optim.state_bytes; AdamW by default)."""
    family = family or for_transformer(config)
    counts = family.count_parameters(config, lora_rank, lora_layers)
    base, trainable, block = counts.base, counts.trainable, counts.largest_block
    fsdp = world > 1 if fsdp is None else fsdp
    shard = world if fsdp else 1
    frozen = base - trainable if lora_rank is not None else 0
    weights = frozen * weight_bytes / shard + trainable * 4 / shard
    if fsdp:
        weights += FSDP_GATHERED_BLOCKS * block * weight_bytes
    grads = trainable * 4 / shard
    optimizer_bytes = trainable * state_bytes(optimizer) / shard
    step_temporaries = trainable * 4 / shard
    kinds, keeps = family.block_kinds(config), block_keeps(family, compiled)
    blocks = sum(n for _, n in kinds)
    unit = batch * math.ceil(tokens / cp) * family.hidden_size(config) * 2
    if checkpointed is None:
        checkpointed = blocks if checkpointing else 0

    def activations(n: int) -> float:
        return unit * activation_units(kinds, keeps, n, saved_attention)

    return Estimate(weights, grads, optimizer_bytes, activations(checkpointed), activations(0), activations(blocks),
                    step_temporaries, min(checkpointed, blocks), blocks)  # fmt: skip


def choose_checkpointing(estimate_with, gpu_bytes: float) -> tuple[Estimate, bool]:
    """`--gradient_checkpointing auto`: the estimate with the fewest checkpointed blocks whose total fits `MARGIN`
    of `gpu_bytes`, and whether one fits (if none does: every block checkpointed). `estimate_with(n)` is the
    estimate with n blocks checkpointed."""
    blocks = estimate_with(0).blocks
    for n in range(blocks + 1):
        e = estimate_with(n)
        if e.total <= MARGIN * gpu_bytes:
            return e, True
    return estimate_with(blocks), False


@dataclass(frozen=True)
class Checkpointing:
    """A run's `--gradient_checkpointing` resolved: which blocks, and the plan behind the choice."""

    blocks: range  # indices of the checkpointed blocks, in the order the blocks run
    total: int  # blocks of the transformer
    planned_gib: float  # the planned peak per GPU with them
    gpu_gib: float | None  # the memory it was fitted to (None: no GPU and no --gpu_memory_gib)
    fits: bool

    def describe(self, value: str) -> str:
        n = len(self.blocks)
        which = "" if n in (0, self.total) else f" ({'the last' if self.blocks.start else 'the first'} {n})"
        gpu = f" of {self.gpu_gib:.1f} GiB" if self.gpu_gib else ""
        how = f"{value}: " if value == "auto" else ""
        peak = f"planned peak {self.planned_gib:.1f} GiB{gpu}"
        return f"gradient checkpointing {how}{n} of {self.total} blocks{which}, {peak}"


def run_estimate(cfg: Config, shape: RunShape) -> Callable[[int | None], Estimate]:
    """The estimate of a run of these flags and this shape with n blocks checkpointed (`estimate_with(n)`), for its
    largest sample."""
    train = cfg.train
    lora = None if cfg.lora.full_finetune else cfg.lora.rank

    def estimate_with(n: int | None) -> Estimate:
        return estimate(shape.transformer_config, tokens=shape.largest_sequence,
                        batch=train.train_batch_size * cfg.data.samples_per_slot, lora_rank=lora,
                        lora_layers=list(cfg.lora.lora_layers), world=shape.world, cp=shape.cp, checkpointed=n,
                        compiled=bool(train.compile or train.compile_mode),
                        weight_bytes=4 if train.mixed_precision == "no" else 2, fsdp=shape.sharded and shape.world > 1,
                        saved_attention=saved_attention_units(train, shape.cp_mode, shape.cp), family=shape.family,
                        optimizer=optimizer_name(train))  # fmt: skip

    return estimate_with


def checkpointing_for_run(cfg: Config, shape: RunShape, device: torch.device) -> Checkpointing:
    """The trainer's `--gradient_checkpointing` on `device`: a count as given, or `auto`'s choice for --gpu_memory_gib,
    else the GPU's memory (on the CPU, without either: nothing to fit, no block checkpointed). Logged, with what the
    choice rests on; run_config.json records it."""
    gpu = cfg.plan.gpu_memory_gib
    if gpu is None and device.type == "cuda":
        gpu = torch.cuda.get_device_properties(device).total_memory / GIB
    ckpt = checkpointing_for(cfg, shape, gpu)
    value = cfg.train.gradient_checkpointing
    if value != "none":  # asked for: say what it resolved to
        logger.info(ckpt.describe(value))
    if note := more_blocks_than_there_are(value, ckpt.total):
        logger.warning(f"warning: {note}")
    if note := unmeasured(shape.family):
        logger.info(f"flux-cp: {note}")
    if not ckpt.fits:
        logger.warning(
            f"warning: the planned peak ({ckpt.planned_gib:.1f} GiB) exceeds 90% of {ckpt.gpu_gib:.1f} GiB even "
            "with every block checkpointed: expect out-of-memory; use --cp_size (train_flux_cp.py --plan)"
        )
    return ckpt


def checkpointing_for(cfg: Config, shape: RunShape, gpu_gib: float | None) -> Checkpointing:
    """`--gradient_checkpointing` for a GPU of `gpu_gib` (None: nothing to fit, no block checkpointed for `auto`)."""
    train, family = cfg.train, shape.family
    estimate_with = run_estimate(cfg, shape)
    value = train.gradient_checkpointing
    if value == "auto" and gpu_gib is None:
        e, fits = estimate_with(0), True
    else:
        e, fits = checkpointing_choice(value, estimate_with, (gpu_gib or 0) * GIB)
        fits = fits if gpu_gib else True
    kinds = family.block_kinds(shape.transformer_config)
    from_end = checkpoint_from_end(kinds, block_keeps(family, bool(train.compile or train.compile_mode)))
    blocks = checkpointed_indices(e.blocks, e.checkpointed, from_end)
    return Checkpointing(blocks, e.blocks, e.total / GIB, gpu_gib, fits)


def saved_attention_units(train, mode: str, cp: int) -> float:
    """Units of its attention a compiled, checkpointed block keeps with these training flags (`TrainConfig`) and CP
    mode."""
    if attention_recomputed(train):
        return 0.0
    return SAVED_ATTENTION_UNITS["exchanged" if cp > 1 and mode in ("ulysses", "hybrid") else "local"]


def print_disk(cfg: Config, shape: RunShape) -> None:
    """The disk a run needs in --output_dir: one checkpoint and the final model (flux_cp.diskspace)."""
    dtype = torch.float32 if cfg.train.mixed_precision == "no" else torch.bfloat16
    s = diskspace.run_sizes(cfg, shape.family, shape.transformer_config, dtype, shape.world)
    limit = cfg.checkpoints.checkpoints_total_limit
    print(
        f"disk: {s.describe()}; keep at least {diskspace.gib(s.checkpoint + s.model)} free in --output_dir"
        + (f" ({limit} checkpoints kept: {diskspace.gib((limit + 1) * s.checkpoint + s.model)})" if limit else "")
    )


def print_plan(cfg: Config) -> None:
    """The plan, printed once: under `accelerate launch` every rank runs this, and all but rank 0 return at once. The
    run shape is the trainer's (flux_cp.shape.build_shape), for the launched processes (or --cp_size's, run as one
    plain process), and again at each CP size listed."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    world = launched_world_size()
    shape = build_shape(cfg, max(world, cfg.parallel.cp_size), planning=True)
    cfg = resolved(cfg, shape.family, shape.pairs, shape.transformer_config)  # the family's default --lora_layers
    tokens, references = shape.largest_sequence, shape.images_per_sample - 1
    batch = cfg.train.train_batch_size * cfg.data.samples_per_slot  # prior preservation: a class image per sample
    lora = None if cfg.lora.full_finetune else cfg.lora.rank
    gpu = cfg.plan.gpu_memory_gib or (
        torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else 141.0
    )
    compiled = bool(cfg.train.compile or cfg.train.compile_mode)
    value = cfg.train.gradient_checkpointing
    print(
        f"plan: {shape.config_source}, {cfg.data.largest_resolution} px{' Kontext pairs' if references == 1 else ''}"
        f"{f' with {references} references' if references > 1 else ''} ({tokens} tokens/sample), "
        f"batch {batch}/rank, "
        f"{'full fine-tuning' if lora is None else f'LoRA r{lora}'}, {world} process(es), GPU {gpu:.0f} GiB, "
        + ("weights sharded over all GPUs (FSDP2)" if shape.sharded else "weights whole on every GPU (DDP)")
        + (", blocks compiled" if compiled else ", blocks eager")
    )
    print_disk(cfg, shape)
    encoding = print_encoding(cfg, shape, gpu * GIB)
    if note := unmeasured(shape.family):
        print(f"note: {note}")
    print(
        f"{'cp':>3} {'world':>5} {'weights':>8} {'grads':>7} {'adam':>7} {'act.ckpt':>9} {'act.full':>9} "
        f"{'total(ckpt)':>12} {'total(no ckpt)':>15} {'ckpt ' + value:>12} {'total':>7}  fits"
    )
    fits_at = None
    sizes = sorted({c for c in (1, 2, 4, 8, 16) if c <= max(world, 8)} | {shape.cp})
    for c in sizes:  # the shape at each CP size: its world, and the mode the heads allow there
        w = max(world, c)
        mode = cfg.parallel.cp_mode if cfg.parallel.cp_mode != "auto" else auto_mode(shape.heads, c)[0]
        at = dataclasses.replace(shape, world=w, dp=w // c, cp=c, cp_mode=mode)
        estimate_with = run_estimate(cfg, at)
        e, chosen_fits = checkpointing_choice(value, estimate_with, gpu * GIB)
        auto, auto_fits = checkpointing_choice("auto", estimate_with, gpu * GIB)
        chosen_fits, auto_fits = chosen_fits and encoding, auto_fits and encoding  # the run's peak: both phases
        ck, full = e.total_with(e.activations_with_ckpt) / GIB, e.total_with(e.activations_without_ckpt) / GIB
        if auto_fits and fits_at is None:
            fits_at = (c, auto)
        print(
            f"{c:>3} {w:>5} {e.weights / GIB:>8.1f} {e.grads / GIB:>7.1f} {e.optimizer / GIB:>7.1f} "
            f"{e.activations_with_ckpt / GIB:>9.1f} {e.activations_without_ckpt / GIB:>9.1f} {ck:>12.1f} "
            f"{full:>15.1f} {f'{e.checkpointed}/{e.blocks}':>12} {e.total / GIB:>7.1f}  "
            + ("yes" if chosen_fits else "no")
        )
    if fits_at is None:
        print(
            "suggestion: nothing listed fits; use more GPUs"
            + (
                " (FSDP shards the weights over all of them)"
                if shape.sharded
                else ", or an fsdp2_* config to shard the weights"
            )
        )
        return
    c, auto = fits_at
    mode, u = auto_mode(shape.heads, c) if c > 1 else ("none", None)
    extra = " --gradient_checkpointing" if auto.checkpointed else ""
    print(
        f"suggestion: --cp_size {c}{extra}"
        + (f" (auto mode: {mode}" + (f", ulysses {u}" if u else "") + ")" if c > 1 else "")
        + (f" (auto: {auto.checkpointed} of {auto.blocks} blocks checkpointed)" if auto.checkpointed else "")
        + f"; figures are estimates within ~15% of measured peaks (GiB per GPU; {1 - MARGIN:.0%} headroom kept)."
    )


def print_encoding(cfg: Config, shape: RunShape, gpu_bytes: float) -> bool:
    """The encoding phase's and validation decode's planned peaks (flux_cp.encoding_memory), from the components'
    configs; whether the encoding phase fits (a run fits when both it and the training step do)."""
    from .encoding_memory import MARGIN as ENCODING_MARGIN
    from .encoding_memory import plan_from_configs

    p = plan_from_configs(cfg, shape, gpu_bytes)
    if p is None:
        print("encoding phase: not planned (the text encoders' and VAE's configs are not on this machine)")
        return True
    for line in p.lines():
        print(line)
    return p.encoding_bytes <= ENCODING_MARGIN * gpu_bytes


def checkpointing_choice(value: str, estimate_with, gpu_bytes: float) -> tuple[Estimate, bool]:
    """The estimate of a `--gradient_checkpointing` value (auto: `choose_checkpointing`) and whether it fits."""
    n = checkpointed_blocks(value, estimate_with(0).blocks)
    if n is None:
        return choose_checkpointing(estimate_with, gpu_bytes)
    e = estimate_with(n)
    return e, e.total <= MARGIN * gpu_bytes
