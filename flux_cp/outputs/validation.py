"""Validation images from the model family's pipeline (FLUX.1: `FluxPipeline`, `FluxKontextPipeline` editing a
reference image; FLUX.2: `Flux2Pipeline`, `Flux2KleinPipeline`) with the current weights, with CP across each
group (so a preview too large for one GPU still renders), under DDP or FSDP2 (the sharded model is used as is:
every rank takes part in every forward, so all ranks make the same number of pipeline calls)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

import cp
from flux_cp import distributed, files, manifest
from flux_cp.data.buckets import crop_box
from flux_cp.data.sources import ImageSource, Sample

if TYPE_CHECKING:
    from flux_cp.config.flags import ValidationConfig
    from flux_cp.families.base import Family
    from flux_cp.families.encoders import Encoders
    from flux_cp.layout import Layout


def _grid(images: list[np.ndarray], columns: int) -> Image.Image:
    h, w = images[0].shape[:2]
    rows = math.ceil(len(images) / columns)
    grid = Image.new("RGB", (columns * w, rows * h), (255, 255, 255))
    for k, img in enumerate(images):
        grid.paste(Image.fromarray(img), ((k % columns) * w, (k // columns) * h))
    return grid


def reference_image(path: str, resolution: int) -> Image.Image:
    """The `--validation_image` as a square training pair's reference: read by the training data's loader, resized
    and center-cropped to `resolution`^2 (the family's `reference_inputs` hands it to its pipeline)."""
    return square(ImageSource([Sample(path, "")], "--validation_image").load(0), resolution)


def square(img: Image.Image, resolution: int) -> Image.Image:
    """`img` resized and center-cropped to `resolution`^2, as a square training pair's reference is."""
    size = (resolution, resolution)
    (width, height), (left, top) = crop_box(img.size, size, True, torch.Generator())
    return img.resize((width, height), Image.BICUBIC).crop((left, top, left + size[0], top + size[1]))


@torch.no_grad()
def render(
    transformer,
    encoders: Encoders,
    scheduler_config: dict,
    embeds: dict[str, torch.Tensor],
    layout: Layout,
    family: Family,
    autocast,
    jobs: list[tuple[int, torch.Generator]],
    resolution: int,
    reference: dict | None = None,
    on_image: Callable[[int, np.ndarray], None] | None = None,
    **call: Any,
) -> dict[int, np.ndarray]:
    """Images of `jobs` (row of `embeds`, the generator of its starting noise), split over the data-parallel ranks:
    each CP group renders its share with CP across the group; every rank of a group gets its group's images,
    {job index: HxWx3 uint8}. Every rank makes the same number of pipeline calls (a short share repeats its last
    job), so every forward has all ranks. `on_image(job, image)`: called on every rank of the group as soon as an
    image is rendered. `call`: more arguments of the pipeline (steps, guidance)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    pipe = family.validation_pipeline(reference is not None, scheduler, encoders, transformer)
    pipe.set_progress_bar_config(disable=True)
    calls = math.ceil(len(jobs) / layout.dp)
    mine = list(range(len(jobs)))[layout.dp_rank :: layout.dp]
    padded = mine + [mine[-1] if mine else 0] * (calls - len(mine))  # equal call counts on every rank
    was_training = transformer.training
    transformer.eval()
    out = {}
    # The VAE on the accelerator beside the transformer (no text encoder), in tiles where --vae_tiling says so, and
    # back in host memory afterwards (flux_cp.placement)
    placement = encoders.placement
    try:
        with (
            placement.use("vae"),
            encoders.vae_tiles(encoders.tiled_decode),
            cp.full_sequence_io(transformer, layout.cp_group),
            autocast(),
        ):
            for j, job in enumerate(padded):
                row, gen = jobs[job]
                image = pipe(
                    **{name: e[row : row + 1] for name, e in embeds.items()},
                    height=resolution,
                    width=resolution,
                    **(reference or {}),
                    generator=gen,
                    output_type="np",
                    **call,
                ).images[0]
                if j < len(mine):
                    out[job] = (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
                    if on_image is not None:
                        on_image(job, out[job])
    finally:
        transformer.train(was_training)
        placement.release()
    return out


def generate(
    transformer,
    encoders: Encoders,
    scheduler_config: dict,
    embeds: dict[str, torch.Tensor],
    layout: Layout,
    validation: ValidationConfig,
    guidance_scale: float,
    seed: int,
    autocast,
    family: Family,
    reference: dict | None = None,
) -> list[np.ndarray]:
    """All validation images (prompt-major order), on every rank. `encoders`: the VAE (the text encoders may be
    freed); `embeds`: the validation prompts' encodings, one row per prompt, named as the pipeline's arguments
    (`Family.validation_embeds`). `reference`: pairs, the pipeline's arguments for the image every prompt edits
    (`Family.reference_inputs`)."""
    v = validation
    items = [(p, k) for p in range(len(v.validation_prompt)) for k in range(v.num_validation_images)]
    jobs = [(p, torch.Generator("cpu").manual_seed(seed * 1000 + p * 100 + k)) for p, k in items]
    out = render(
        transformer,
        encoders,
        scheduler_config,
        embeds,
        layout,
        family,
        autocast,
        jobs,
        v.validation_resolution,
        reference,
        num_inference_steps=v.validation_inference_steps,
        guidance_scale=guidance_scale,
    )
    merged = {}
    for part in distributed.all_gather(out if layout.cp_rank == 0 else {}):
        merged.update(part)
    return [merged[j] for j in range(len(items))]


def save_and_log(
    images: list[np.ndarray], step: int, validation: ValidationConfig, output_dir: str, accelerator
) -> Path:
    """A PNG grid per step under <output_dir>/validation (one row per prompt), and the trackers."""
    path = Path(output_dir) / "validation" / f"step-{step:06d}.png"
    manifest.record(output_dir, "validation")
    grid = _grid(images, validation.num_validation_images)
    files.write_with(path, lambda tmp: grid.save(tmp, format="PNG"))
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_images("validation", np.stack(images), step, dataformats="NHWC")
        elif tracker.name == "wandb":
            import wandb

            prompts = [p for p in validation.validation_prompt for _ in range(validation.num_validation_images)]
            tracker.log({"validation": [wandb.Image(im, caption=c) for im, c in zip(images, prompts)]}, step=step)
    return path


@dataclass
class Previews:
    """What validation images need once the text encoders are freed: the VAE (in `encoders`), the scheduler's
    config, the validation prompts' encodings and, for pairs, the pipeline's arguments for the reference they edit."""

    encoders: Any
    scheduler_config: dict
    embeds: dict[str, torch.Tensor]
    reference: dict | None = None
