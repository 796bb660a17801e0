"""The run shape (`RunShape`): the model family and its transformer config, single images or pairs (one or more
reference images per target), the training buckets and their token counts, the dp x cp layout, whether the weights
are sharded, and the CP mode the model's heads allow; built once by flux_cp.shape.build.

Every count of tokens that CP splits must divide by the CP size (docs/design.md, data flow, rule 2): `split_tokens` is
that rule, and `check_tokens` applies it to every sequence of a run at start."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cp.mode import DEFAULT_MODE
from cp.mode import auto_mode as modes_auto
from flux_cp.errors import UsageError
from flux_cp.families.base import Family

if TYPE_CHECKING:
    from flux_cp.config.flags import ValidationConfig
    from flux_cp.config.training import DataConfig
    from flux_cp.data.folders import Metadata


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
    # the transformer's config.json, with its class's defaults for what it leaves out (as the model gets them), and
    # where it was read (--plan says so)
    transformer_config: dict = field(default_factory=dict)
    config_source: str = ""
    cp_mode: str = DEFAULT_MODE  # --cp_mode as the heads allow it (auto: `auto_mode`); the default without CP
    ulysses_size: int | None = None  # the Ulysses degree of that mode (None: no Ulysses exchange)

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

    @property
    def heads(self) -> int:
        return self.transformer_config["num_attention_heads"]

    def describe(self) -> str:
        kind = f"{self.family.pairs_label} pairs" if self.pairs else self.family.label
        return f"{kind}, world {self.world} = dp {self.dp} x cp {self.cp}, {'FSDP2' if self.sharded else 'DDP'}"


def auto_mode(heads: int, cp_size: int) -> tuple[str, int | None]:
    """The CP mode `--cp_mode auto` picks for `heads` attention heads over `cp_size` ranks, and its Ulysses size: the
    CP modes' own preferences (`cp.auto_mode`; each mode's file gives the measurements behind its place)."""
    return modes_auto(heads, cp_size)


def split_tokens(tokens: int, cp_size: int) -> int:
    """Tokens per rank when a sequence of `tokens` (text, or a sample's image segment: a target and its references
    cut as one) is split over `cp_size` ranks; a ValueError when they do not divide."""
    if tokens % cp_size:
        raise ValueError(f"{tokens} tokens do not split over {cp_size} ranks")
    return tokens // cp_size


def check_tokens(shape: RunShape, data: DataConfig, validation: ValidationConfig) -> None:
    """Every sequence the run splits over its CP group, checked before any GPU work (`split_tokens`): the text, each
    --resolution's samples, the validation images and the class images of prior preservation. A UsageError naming
    the flag and the nearest values that work."""
    n = shape.cp
    if n == 1:
        return
    try:
        split_tokens(data.max_sequence_length, n)
    except ValueError:
        raise UsageError(
            f"--max_sequence_length {data.max_sequence_length} (text tokens) is not divisible by --cp_size {n}: "
            f"use {data.max_sequence_length // n * n or n} or another CP size"
        ) from None
    # Each reference has its target's size and they are split as one segment: (1 + references) times the target's
    # tokens (validation too, with one reference per --validation_image). Aspect buckets are chosen with token counts
    # that divide. Pairs whose reference counts are not known yet (a hub data set) are checked once it is opened.
    counts = () if data.aspect_buckets else shape.images_per_sample_options()
    checks = [("--resolution", r, images) for r in data.resolution for images in counts]
    if validation.validation_prompt:  # no prompt, no validation images
        images = 1 + len(validation.validation_image or ()) if shape.pairs else 1
        checks.append(("--validation_resolution", validation.validation_resolution, images))
    if data.with_prior_preservation:  # class images are generated at the largest resolution, square
        checks.append(("--resolution", data.largest_resolution, 1))
    for flag, res, images in checks:
        tokens = images * shape.family.image_tokens(res, res)
        try:
            split_tokens(tokens, n)
        except ValueError:
            ok = [r for r in range(16, res + 33 * 16, 16) if (images * shape.family.image_tokens(r, r)) % n == 0]
            below, above = [r for r in ok if r < res], [r for r in ok if r > res]
            options = " or ".join(str(r) for r in (below[-1:] + above[:1]))
            per = {1: "", 2: " per pair"}.get(images, f" per target with {images - 1} references")
            raise UsageError(
                f"{flag} {res} gives {tokens} image tokens{per}, not divisible by --cp_size {n}: use {options}, or "
                "another CP size"
            ) from None
