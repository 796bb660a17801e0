"""Named random streams. Every random draw of the data path (sample order, crops, flips, noise and timesteps,
caption dropout, class images) comes from a generator keyed by the seed, the draw's own keys (epoch, sample,
micro-step, global batch slot) and its stream, never from a global RNG state: all ranks of a CP group draw the same
values, and what a run sees does not depend on its layout or on where it resumed."""

from __future__ import annotations

import hashlib
from enum import IntEnum

import torch


class Stream(IntEnum):
    """The values are part of every run's data: changing one changes which samples, crops and noise runs see."""

    BUCKET_ORDER = 1  # order of the samples within an aspect bucket, per epoch
    BATCH_ORDER = 2  # order of the global batches within an epoch
    CROP = 3  # random crop offset of a sample (once for cached encodings, per epoch for --no_cache)
    FLIP = 4  # whether a sample is flipped (--random_flip), per epoch
    NOISE = 7  # latent sampling noise, flow-matching noise and timestep of one global batch slot
    CAPTION_DROPOUT = 8  # whether a global batch slot's caption is replaced by the empty one (--caption_dropout)
    CLASS_ORDER = 9  # the order in which the run's batch slots take the class images (prior preservation)
    CLASS_CROP = 10  # random crop of a class image in one bucket
    CLASS_IMAGE = 11  # the starting noise of a generated class image
    TEXT_ENCODER_LORA = 12  # the initial weights of the text encoder's LoRA (--train_text_encoder)


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator whose state is a function of the integer keys only."""
    digest = hashlib.sha256(",".join(str(int(k)) for k in keys).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def generator(stream: Stream, seed: int, *keys: int) -> torch.Generator:
    """The generator of `stream` for (seed, *keys)."""
    return seeded_generator(seed, *keys, int(stream))
