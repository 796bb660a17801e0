"""Validation images from `FluxPipeline` (`FluxKontextPipeline`, editing a reference image, for Kontext) with the
current weights, with CP across each group (so a preview too large for one GPU still renders), under DDP or
FSDP2 (the sharded model is used as is: every rank takes part in every forward, so all ranks make the same
number of pipeline calls)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

import cp

from . import distributed, files, manifest

if TYPE_CHECKING:
    from .config import ValidationConfig
    from .families import Family
    from .parallel import Layout


def _grid(images: list[np.ndarray], columns: int) -> Image.Image:
    h, w = images[0].shape[:2]
    rows = math.ceil(len(images) / columns)
    grid = Image.new("RGB", (columns * w, rows * h), (255, 255, 255))
    for k, img in enumerate(images):
        grid.paste(Image.fromarray(img), ((k % columns) * w, (k // columns) * h))
    return grid


@torch.no_grad()
def reference_latents(path: str, resolution: int, vae, normalize, device: torch.device) -> torch.Tensor:
    """The `--validation_image` as the pipeline takes ready latents: read by the training data's loader, resized
    and center-cropped to `resolution`^2 like a square training pair, the VAE's mean, normalised as the transformer
    sees latents (`normalize`, the family's; `[1, C, h, w]`)."""
    from .data import ImageSource, Sample, crop_box, to_pixels

    img = ImageSource([Sample(path, "")], "--validation_image").load(0)
    size = (resolution, resolution)
    resized, offset = crop_box(img.size, size, True, torch.Generator())
    pixels = to_pixels(img, size, resized, offset, False)[None].to(device, vae.dtype)
    return normalize(vae.encode(pixels).latent_dist.mean)


@torch.no_grad()
def generate(
    transformer,
    vae,
    scheduler_config: dict,
    embeds: dict[str, torch.Tensor],
    layout: Layout,
    validation: ValidationConfig,
    guidance_scale: float,
    seed: int,
    autocast,
    family: Family,
    reference: torch.Tensor | None = None,
) -> list[np.ndarray]:
    """All validation images (prompt-major order), on every rank. `embeds`: the validation prompts' encodings
    (named as the pipeline's arguments), computed before the text encoders were freed. `reference`: pairs, the
    latents of the image every prompt edits (`reference_latents`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    pipe = family.validation_pipeline(reference is not None, scheduler=scheduler, vae=vae, transformer=transformer)
    v, res = validation, validation.validation_resolution
    extra = {} if reference is None else family.reference_inputs(reference, res)
    pipe.set_progress_bar_config(disable=True)
    items = [(p, k) for p in range(len(v.validation_prompt)) for k in range(v.num_validation_images)]
    calls = math.ceil(len(items) / layout.dp)
    mine = items[layout.dp_rank :: layout.dp]
    mine += [mine[-1] if mine else items[0]] * (calls - len(mine))  # equal call counts on every rank
    was_training = transformer.training
    transformer.eval()
    out = {}
    try:
        with cp.full_sequence_io(transformer, layout.cp_group), autocast():
            for j, (p, k) in enumerate(mine):
                image = pipe(
                    **{name: e[p : p + 1] for name, e in embeds.items()}, height=res, width=res, **extra,
                    num_inference_steps=v.validation_inference_steps, guidance_scale=guidance_scale,
                    generator=torch.Generator("cpu").manual_seed(seed * 1000 + p * 100 + k), output_type="np",
                ).images[0]  # fmt: skip
                if j < len(items[layout.dp_rank :: layout.dp]):
                    out[(p, k)] = (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
    finally:
        transformer.train(was_training)
    for part in distributed.all_gather(out if layout.cp_rank == 0 else {}):
        out.update(part)
    return [out[i] for i in items]


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
