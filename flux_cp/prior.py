"""DreamBooth prior preservation, as diffusers' DreamBooth LoRA examples define it: the class images of
`--class_data_dir` (the missing ones, up to `--num_class_images`, generated with the base model and
`--class_prompt`), and their encodings in the buckets the training images use.

Generation runs before the training data is encoded, through the model family's validation pipeline with CP across
each group (`flux_cp.validation.render`), the class images split over the data-parallel ranks. Class image k starts
from noise keyed by the seed and k (flux_cp.rng), so the images do not depend on the layout. The loss and which class
image each batch slot trains beside: flux_cp.batches, flux_cp.data.BatchSchedule.class_images.
"""

from __future__ import annotations

import gc
import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import cp

from . import distributed, files
from .data import ImageSource, Sample
from .errors import UsageError
from .folders import image_files
from .rng import Stream, generator

if TYPE_CHECKING:
    from .config import Config
    from .encode import Encoders, TrainingData
    from .parallel import Layout
    from .shape import RunShape

logger = logging.getLogger("flux_cp")


def class_images(folder: Path) -> list[Path]:
    """The images of a class folder, sorted by name (hidden files left out)."""
    return image_files(folder) if folder.is_dir() else []


def class_source(folder: Path, prompt: str, count: int) -> ImageSource:
    """The first `count` class images of `folder`, each captioned `prompt` (as diffusers' examples take
    `--num_class_images` of the folder's images)."""
    found = class_images(folder)[:count]
    return ImageSource([Sample(str(p), prompt) for p in found], f"--class_data_dir {folder}", root=folder)


def generated_name(index: int, image) -> str:
    """A generated class image's file name: its index (the order they sort in) and the hash of its pixels, as
    diffusers' examples name theirs; PNG, so that the image trained on is the one rendered."""
    return f"{index:05d}-{hashlib.sha1(image.tobytes()).hexdigest()}.png"


def missing_count(folder: Path, wanted: int, is_main: bool) -> tuple[int, int]:
    """(class images present, how many to generate), as the main process sees the folder (every rank gets its
    answer)."""
    have = distributed.all_gather(len(class_images(folder)) if is_main else 0)[0]
    return have, max(0, wanted - have)


def generate_class_images(cfg: Config, shape: RunShape, layout: Layout, encoders: Encoders, scheduler_config: dict,
                          weight_dtype: torch.dtype, device: torch.device, autocast) -> int:  # fmt: skip
    """Fill `--class_data_dir` up to `--num_class_images`: the missing ones rendered by the base model with the
    family's validation pipeline (its default steps and guidance, as diffusers' examples call it) at the largest
    `--resolution`, CP across each group, split over the data-parallel ranks; each group's first rank writes its
    share. Returns how many were generated. Every rank calls it."""
    from PIL import Image

    from .model import load_transformer
    from .parallel import choose_cp_mode
    from .validation import render

    data = cfg.data
    folder = Path(data.class_data_dir)
    have, missing = missing_count(folder, data.num_class_images, layout.is_main)
    if not missing:
        return 0
    resolution = data.largest_resolution
    tokens = shape.family.image_tokens(resolution, resolution)
    if tokens % layout.cp:
        raise UsageError(
            f"the class images are generated at --resolution {resolution} ({tokens} image tokens), not divisible by "
            f"--cp_size {layout.cp}: put the class images in --class_data_dir, or train at another resolution",
            agreed=True,
        )
    logger.info(f"prior preservation: {have} class images in {folder}, generating {missing} with the base model")
    problem = None
    if layout.is_main:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            problem = f"cannot create --class_data_dir {folder}: {e.strerror or e}"
    distributed.check_all_ranks(problem is None, problem or "")
    embeds = shape.family.validation_embeds(encoders, [data.class_prompt], shape.text_tokens)
    transformer = load_transformer(cfg.model, shape.model_path, shape.family.transformer_class(), weight_dtype,
                                   device, cfg.train.seed)  # fmt: skip
    transformer.requires_grad_(False)
    config = dict(transformer.config)
    mode, ulysses = choose_cp_mode(cfg.parallel, config["num_attention_heads"], layout.cp)
    cp.apply_context_parallel(transformer, layout.cp_context, mode=mode, ulysses_size=ulysses)
    indices = list(range(have, have + missing))
    jobs = [(0, generator(Stream.CLASS_IMAGE, cfg.train.seed, k)) for k in indices]
    try:
        images = render(transformer, encoders, scheduler_config, embeds, layout, shape.family, autocast, jobs,
                        resolution)  # fmt: skip
    finally:
        del transformer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    problem = None
    if layout.cp_rank == 0:
        try:
            for job, pixels in sorted(images.items()):
                image = Image.fromarray(pixels)
                files.write_with(folder / generated_name(indices[job], image),
                                 lambda tmp, image=image: image.save(tmp, format="PNG"))  # fmt: skip
        except OSError as e:
            problem = f"cannot write class images into --class_data_dir {folder}: {e.strerror or e}"
    distributed.check_all_ranks(problem is None, problem or "")
    return missing


class ClassSamples:
    """The class images' encodings: `data` holds class image c in the p-th of the buckets the training images use
    (`used`) at index `p * count + c` (flux_cp.encode.ClassGeometry)."""

    def __init__(self, data: TrainingData, count: int, used: list[int]):
        self.data, self.count, self.used = data, count, list(used)

    def load(self, image: int, bucket: int, epoch: int) -> dict[str, torch.Tensor]:
        return self.data.load(self.used.index(bucket) * self.count + image, False, epoch)
