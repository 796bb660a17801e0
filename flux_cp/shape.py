"""The run shape: what kind of run this is, worked out once in setup from the flags, the launch and the model
folder, and read everywhere else: the model family, single images or pairs (one or more reference images per
target), the training buckets and their token counts, the dp x cp layout and whether the weights are sharded."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import UsageError
from .families import FLUX1, Family, detect
from .parallel import check_layout, uses_fsdp

if TYPE_CHECKING:
    from .config import Config, DataConfig, ModelConfig, ValidationConfig
    from .folders import Metadata


@dataclass(frozen=True)
class RunShape:
    family: Family
    model_path: str  # the folder or hub id to load (the embedded default's tiny model, built by now)
    reference_column: str | None  # the data's reference-image column (pairs), None for single images
    metadata: Metadata | None  # a local data folder's metadata.jsonl, read and checked once
    buckets: tuple[tuple[int, int], ...]  # (width, height) of every training bucket, in pixels
    placements: tuple[tuple[int, ...], ...]  # per --resolution, the indices of its buckets
    text_tokens: int  # per sample
    world: int
    dp: int
    cp: int
    sharded: bool  # FSDP2 shards the weights over all ranks (else DDP keeps them whole on every rank)
    # pairs: the numbers of reference images the samples have, ascending (None until known: a hub data set's are
    # read when it is opened, `with_reference_counts`)
    reference_counts: tuple[int, ...] | None = None

    @property
    def pairs(self) -> bool:
        """Each sample is a target with one or more reference images (FLUX.1 Kontext, FLUX.2 editing)."""
        return self.reference_column is not None

    @property
    def images_per_sample(self) -> int:
        """Images in the longest sample: the target and its references (one reference until their counts are known)."""
        return 1 + max(self.reference_counts or (1,)) if self.pairs else 1

    def images_per_sample_options(self) -> tuple[int, ...]:
        """Every number of images a sample has (target and references); () for pairs whose counts are not known yet."""
        if not self.pairs:
            return (1,)
        return tuple(1 + k for k in self.reference_counts or ())

    def with_reference_counts(self, counts: tuple[int, ...]) -> RunShape:
        return dataclasses.replace(self, reference_counts=tuple(counts))

    def image_tokens(self, bucket: int = 0) -> int:
        """Image tokens of the longest sample in `bucket` (target and references for pairs)."""
        width, height = self.buckets[bucket]
        return self.images_per_sample * self.family.image_tokens(width, height)

    def sequence_tokens(self, bucket: int = 0) -> int:
        """Text and image tokens of one sample in `bucket`."""
        return self.image_tokens(bucket) + self.text_tokens

    @property
    def largest_sequence(self) -> int:
        return max(self.sequence_tokens(b) for b in range(len(self.buckets)))

    def describe(self) -> str:
        kind = f"{self.family.pairs_label} pairs" if self.pairs else self.family.label
        return f"{kind}, world {self.world} = dp {self.dp} x cp {self.cp}, {'FSDP2' if self.sharded else 'DDP'}"


def check_tokens(shape: RunShape, data: DataConfig, validation: ValidationConfig) -> None:
    """Image and text token counts must split evenly over the CP group (before any GPU work): a UsageError naming
    the flag and the nearest values that work."""
    n = shape.cp
    if n == 1:
        return
    if data.max_sequence_length % n:
        raise UsageError(
            f"--max_sequence_length {data.max_sequence_length} (text tokens) is not divisible by --cp_size {n}: "
            f"use {data.max_sequence_length // n * n or n} or another CP size"
        )
    # Each reference has its target's size and they are split as one segment: (1 + references) times the target's
    # tokens (validation too, with one reference per --validation_image). Aspect buckets are chosen with token counts
    # that divide. Pairs whose reference counts are not known yet (a hub data set) are checked once it is opened.
    counts = () if data.aspect_buckets else shape.images_per_sample_options()
    checks = [("--resolution", r, images) for r in data.resolution for images in counts]
    if validation.validation_prompt:  # no prompt, no validation images
        images = 1 + len(validation.validation_image or ()) if shape.pairs else 1
        checks.append(("--validation_resolution", validation.validation_resolution, images))
    for flag, res, images in checks:
        tokens = images * shape.family.image_tokens(res, res)
        if tokens % n:
            ok = [r for r in range(16, res + 33 * 16, 16) if (images * shape.family.image_tokens(r, r)) % n == 0]
            below, above = [r for r in ok if r < res], [r for r in ok if r > res]
            options = " or ".join(str(r) for r in (below[-1:] + above[:1]))
            per = {1: "", 2: " per pair"}.get(images, f" per target with {images - 1} references")
            raise UsageError(
                f"{flag} {res} gives {tokens} image tokens{per}, not divisible by --cp_size {n}: use {options}, or "
                "another CP size"
            )


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


def model_of(model: ModelConfig, pairs: bool) -> tuple[Family, str]:
    """The family and the folder or hub id of the model to train: the one named, or the embedded default's tiny
    FLUX.1 (its Kontext variant for `pairs`), built here on first use."""
    if model.embedded_default:
        return FLUX1, FLUX1.embedded_default(pairs)
    return detect(
        model.pretrained_model_name_or_path, model.revision, model.cache_dir
    ), model.pretrained_model_name_or_path


def build_shape(cfg: Config, world: int) -> RunShape:
    """The run shape of these flags for `world` launched processes. Refuses (UsageError) a layout the CP size
    does not divide and a model folder of no known family; builds the embedded default's tiny model when no
    model is named (before any process group: every rank of a launch calls this, one builds, the others wait)."""
    from .data import local_metadata, reference_column, reference_counts
    from .encode import run_buckets

    dp = check_layout(world, cfg.parallel.cp_size)
    metadata = local_metadata(cfg.data)
    column = reference_column(cfg.data, metadata)
    family, path = model_of(cfg.model, column is not None)
    buckets, placements = run_buckets(cfg.data.resolution, cfg.parallel.cp_size, cfg.data.aspect_buckets)
    return RunShape(
        family=family, model_path=path, reference_column=column, metadata=metadata, buckets=tuple(buckets),
        placements=tuple(tuple(p) for p in placements),
        text_tokens=cfg.data.max_sequence_length, world=world, dp=dp, cp=cfg.parallel.cp_size, sharded=uses_fsdp(),
        reference_counts=reference_counts(metadata, column),
    )  # fmt: skip
