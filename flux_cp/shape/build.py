"""The run shape worked out once in setup from the flags, the launch and the model folder (`build_shape`): the launch
(how many processes, sharded or not), the model folder read and checked (its family, its transformer config, read
offline for --plan where it can be), the CP mode its heads allow, and the defaults that depend on the model family
(`resolved`). The shape itself and the CP split rule: flux_cp.shape.run_shape."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cp.mode import DEFAULT_MODE, validate
from flux_cp import hub
from flux_cp.data.buckets import run_buckets
from flux_cp.data.sources import (
    local_metadata,
    reference_column,
    reference_counts,
)
from flux_cp.errors import UsageError
from flux_cp.families.base import FAMILIES, Family, default_family, detect, for_transformer, known_model
from flux_cp.families.components import transformer_config, with_class_defaults
from flux_cp.families.model_config import check_model
from flux_cp.shape.run_shape import RunShape, auto_mode

if TYPE_CHECKING:
    from flux_cp.config.flags import Config, ParallelConfig
    from flux_cp.config.training import ModelConfig


# --- the launch: how many processes, sharded or not -------------------------------------------------------------


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_with_fsdp() -> bool | None:
    """Whether `accelerate launch`'s config asks for FSDP (it sets ACCELERATE_USE_FSDP); None when accelerate did
    not launch this process (a plain `python train_flux_cp.py`, e.g. for --plan)."""
    if "ACCELERATE_MIXED_PRECISION" not in os.environ and "ACCELERATE_USE_FSDP" not in os.environ:
        return None
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def uses_fsdp() -> bool:
    """FSDP2 shards this run's weights: the launch config asks for it, and there is CUDA (FSDP2 needs it here)."""
    return bool(launched_with_fsdp()) and torch.cuda.is_available()


def planned_sharding(full_finetune: bool) -> bool:
    """FSDP2 (sharded) or DDP (replicated) for --plan: the launch config's choice when accelerate launched us, else the
    README's advice (DDP for LoRA, FSDP2 for full fine-tuning)."""
    launched = launched_with_fsdp()
    return full_finetune if launched is None else launched


def check_layout(world: int, cp_size: int, planned: bool = False) -> int:
    """dp size for `world` processes with CP groups of `cp_size`; a UsageError that says what to change. `planned`:
    `world` is --plan's --num_processes (its own flag names the processes, not accelerate launch's)."""
    if world % cp_size:
        options = [c for c in range(1, world + 1) if world % c == 0]
        if planned:
            raise UsageError(
                f"--cp_size {cp_size} does not divide --num_processes {world}: choose --cp_size from {options}, or "
                f"plan for a multiple of {cp_size} processes (--num_processes)"
            )
        raise UsageError(
            f"--cp_size {cp_size} does not divide the {world} launched processes: choose --cp_size from {options}, "
            f"or launch a multiple of {cp_size} processes (accelerate launch --num_processes)"
        )
    return world // cp_size


# --- the CP mode the model's heads allow ---------------------------------------------------------------------


def choose_cp_mode(parallel: ParallelConfig, heads: int, cp_size: int) -> tuple[str, int | None]:
    """Resolve --cp_mode (auto: `auto_mode`) and check it against the model; a UsageError if it cannot work."""
    mode, u = parallel.cp_mode, parallel.ulysses_size
    if cp_size == 1:
        return DEFAULT_MODE, None
    if mode == "auto":
        mode, u = auto_mode(heads, cp_size)
    try:
        u = validate((1, cp_size, heads, 1), cp_size, mode, u)
    except ValueError as e:
        raise UsageError(f"--cp_mode {parallel.cp_mode}: {e}", agreed=True) from None  # same on every rank
    return mode, u


# --- the split: every sequence CP cuts divides by the CP size ----------------------------------------------------


# --- the shape --------------------------------------------------------------------------------------------------


def resolved(cfg: Config, family: Family, pairs: bool, transformer_config: dict | None) -> Config:
    """`cfg` with the defaults that depend on the model family filled in, so that the run (its run_config.json and
    checkpoints too) holds final values: `--lora_layers` (the family's targets for this transformer) and
    `--vae_encode_mode` (diffusers' example's for this family and data)."""
    lora, data = cfg.lora, cfg.data
    if lora.lora_layers is None:
        lora = dataclasses.replace(lora, lora_layers=tuple(family.lora_targets(pairs, transformer_config)))
    if data.vae_encode_mode is None:
        data = dataclasses.replace(data, vae_encode_mode=family.default_vae_encode_mode(pairs))
    return dataclasses.replace(cfg, lora=lora, data=data)


def transformer_config_offline(
    path: str, revision: str | None = None, cache_dir: str | None = None
) -> tuple[dict, str]:
    """(transformer config, where it came from) of a model folder or hub id, without waiting on the network: a
    folder's own file; a hub id's from the local HF cache (`cache_dir`: --cache_dir's, else the default), else built
    in for the hub ids a family knows offline (`Family.known`), else from the Hub in one short attempt (not when
    HF_HUB_OFFLINE is set). Whatever fails is one UsageError line."""
    flag = f"--pretrained_model_name_or_path {path}"
    file = "transformer/config.json"
    if os.path.isdir(path):
        try:
            return json.loads((Path(path) / file).read_text(encoding="utf-8")), path
        except (OSError, ValueError) as e:
            raise UsageError(f"{flag}: cannot read {file} there ({str(e).splitlines()[0]})") from None
    try:
        cached = hub.read_cached_json(path, file, revision, cache_dir)
    except ValueError:
        raise UsageError(f"{flag}: no such folder (and not a hub id like owner/name)") from None
    if cached is not None:
        return cached, f"{path} (local HF cache)"
    known = known_model(path)
    if known is not None:
        return dict(known.transformer), f"{known.model_id} (built-in config)"
    known = ", ".join(
        f"a {f.label} model known offline ({', '.join(m.model_id for m in f.known)})" for f in FAMILIES if f.known
    )
    presets = [f.shapes_preset for f in FAMILIES if f.shapes_preset]
    offline_ids = (
        f"{known}, or a folder with a model's shapes built without downloads: python -m flux_cp.tiny --preset "
        f"{presets[0][0]} --out DIR ({presets[0][1]}; {'; '.join(f'{name}: {what}' for name, what in presets[1:])})"
    )
    if hub.offline():
        raise UsageError(
            f"{flag}: not a local folder, and its {file} is not in the local HF cache (HF_HUB_OFFLINE is set): "
            f"pass the model's folder, {offline_ids}"
        )
    try:
        return hub.read_json(path, file, revision, cache_dir), path
    except OSError as e:
        raise UsageError(
            f"{flag}: not a local folder or in the local HF cache, and {file} could not be read from the Hugging Face "
            f"Hub ({e}): pass the model's folder, {offline_ids}"
        ) from None


def read_model(model: ModelConfig, pairs: bool, planning: bool = False) -> tuple[Family, str, dict, str]:
    """(family, folder or hub id, transformer config, where the config was read) of the model to train: the one
    named, or the embedded default's tiny model (`default_family`'s, its pair variant for `pairs`), built here on
    first use.
    `planning` (--plan): a hub id's config without waiting on the network (`transformer_config_offline`)."""
    if model.embedded_default:
        family = default_family()
        path = family.embedded_default(pairs)
    else:
        path = model.pretrained_model_name_or_path
        if planning and not os.path.isdir(path):
            config, source = transformer_config_offline(path, model.revision, model.cache_dir)
            family = for_transformer(config)
            config = with_class_defaults(config, family.transformer_class())
            check_model(family, path, config, model)  # what is on this machine of it
            return family, path, config, source
        family = detect(path, model.revision, model.cache_dir)
    config = transformer_config(path, family.transformer_class(), model.revision, model.cache_dir)
    check_model(family, path, config, model)  # before anything is built from its configs
    return family, path, config, path


def build_shape(cfg: Config, world: int, planning: bool = False) -> RunShape:
    """The run shape of these flags for `world` launched processes. Refuses (UsageError) a layout the CP size does
    not divide, a model folder of no known family and a CP mode the model's heads do not allow; builds the embedded
    default's tiny model when no model is named (before any process group: every rank of a launch calls this, one
    builds, the others wait). `planning` (--plan): the weights' sharding is the launch's or the README's advice, and
    a hub id's config is read without waiting on the network."""
    cp_size = cfg.parallel.cp_size
    dp = check_layout(world, cp_size, planned=planning and cfg.plan.num_processes == world)
    metadata = local_metadata(cfg.data)
    column = reference_column(cfg.data, metadata)
    family, path, config, source = read_model(cfg.model, column is not None, planning)
    buckets, placements = run_buckets(cfg.data.resolution, cp_size, cfg.data.aspect_buckets)
    mode, ulysses_size = choose_cp_mode(cfg.parallel, config["num_attention_heads"], cp_size)
    sharded = planned_sharding(cfg.lora.full_finetune) if planning else uses_fsdp()
    return RunShape(
        family=family,
        model_path=path,
        reference_column=column,
        metadata=metadata,
        buckets=tuple(buckets),
        placements=tuple(tuple(p) for p in placements),
        text_tokens=cfg.data.max_sequence_length,
        world=world,
        dp=dp,
        cp=cp_size,
        sharded=sharded,
        reference_counts=reference_counts(metadata, column),
        transformer_config=config,
        config_source=source,
        cp_mode=mode,
        ulysses_size=ulysses_size,
    )
