"""Class images of DreamBooth prior preservation generated with the base model: the ones `--class_data_dir` lacks
(up to `--num_class_images`) rendered by the model family's validation pipeline with CP across each group, before
the training data is encoded (flux_cp.run.data_phase). Which class images there are and where generated ones go:
flux_cp.data.prior.

Generated image k starts from noise keyed by the seed and k (flux_cp.rng), so the images do not depend on the layout,
and each is written (atomically) as soon as it is rendered: an interrupted generation resumes with the images it
lacks. The marker of the generated/ folder holds the key of what rendered them (`class_key`): images of another key
are rendered again."""

from __future__ import annotations

import gc
import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from PIL import Image

from flux_cp import distributed, files
from flux_cp.data.prior import (
    MARKER,
    check_generated_folder,
    generated_folder,
    generated_images,
    generated_name,
    marked_key,
    missing_count,
)
from flux_cp.errors import UsageError
from flux_cp.model.loading import load_transformer
from flux_cp.model.parallel import parallelize
from flux_cp.model.precision import quantize_base
from flux_cp.outputs.validation import render
from flux_cp.rng import Stream, generator

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.families.encoders import Encoders
    from flux_cp.layout import Layout
    from flux_cp.shape.run_shape import RunShape

logger = logging.getLogger("flux_cp")


# Bump when how class images are rendered changes (the pipeline call, its steps and guidance, the file written), so
# that images rendered before are rendered again.
GENERATION_VERSION = 1


def class_key(
    cfg: Config, shape: RunShape, components: dict[str, str] | None, scheduler_config: dict, weight_dtype: torch.dtype
) -> str:
    """What rendered the generated class images, as a key: the model (the transformer's config and weights' content,
    the other components' fingerprints), the class prompt and its text tokens, the size, the seed, the precision and
    the scheduler."""
    from flux_cp.families.components import component_folder, weights_fingerprint

    model, data = cfg.model, cfg.data
    config = {k: v for k, v in (getattr(shape, "transformer_config", None) or {}).items() if not k.startswith("_")}
    if model.transformer_init == "pretrained":
        weights = weights_fingerprint(
            component_folder(shape.model_path, "transformer", model.revision, model.cache_dir)
        )
    else:
        weights = "random"  # built from the config and the seed
    parts = {
        "version": GENERATION_VERSION,
        "transformer": [config, weights, model.variant],
        "components": components or {},
        "prompt": data.class_prompt,
        "text_tokens": shape.text_tokens,
        "resolution": data.largest_resolution,
        "seed": cfg.train.seed,
        "dtype": str(weight_dtype),
        "base_precision": model.base_precision,
        "scheduler": {k: v for k, v in dict(scheduler_config).items() if not k.startswith("_")},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _mark(target: Path, prompt: str, key: str) -> int:
    """Mark generated/ as flux-cp's, for images of `key`; images of another key there are removed first (flux-cp's
    own, rendered for other settings). Returns how many were removed."""
    target.mkdir(parents=True, exist_ok=True)
    stale = [] if marked_key(target.parent) == key else list(generated_images(target.parent).values())
    for path in stale:
        path.unlink()
    text = json.dumps(
        {
            "written_by": "flux-cp",
            "what": "class images generated for --with_prior_preservation",
            "class_prompt": prompt,
            "key": key,
        },
        indent=2,
    )
    files.write_text(target / MARKER, text + "\n")
    return len(stale)


def generate_class_images(
    cfg: Config,
    shape: RunShape,
    layout: Layout,
    encoders: Encoders,
    scheduler_config: dict,
    weight_dtype: torch.dtype,
    device: torch.device,
    autocast,
    components: dict[str, str] | None = None,
) -> int:
    """Fill `--class_data_dir` up to `--num_class_images`: the missing ones rendered by the base model with the
    family's validation pipeline (its default steps and guidance, as diffusers' examples call it) at the largest
    `--resolution`, CP across each group, split over the data-parallel ranks, into generated/ (each group's first
    rank writes each of its images as soon as it is rendered). Generated images of other settings (`class_key`;
    `components`: the fingerprints of the model's other components) are rendered again. Returns how many were
    generated. Every rank calls it."""
    data = cfg.data
    folder = Path(data.class_data_dir)
    key = class_key(cfg, shape, components, scheduler_config, weight_dtype)
    have, indices = missing_count(folder, data.num_class_images, layout.is_main, key)
    if not indices:
        return 0
    resolution = data.largest_resolution  # its tokens split over the CP group: checked at start (shape.check_tokens)
    target = generated_folder(folder)
    logger.info(
        f"prior preservation: {have} class images in {folder}, generating {len(indices)} with the base model "
        f"into {target}"
    )
    problem = None
    if layout.is_main:
        try:
            check_generated_folder(folder)
            if removed := _mark(target, data.class_prompt, key):
                logger.info(
                    f"prior preservation: the {removed} class images generated in {target} before were "
                    "rendered with other settings (model, class prompt, size, seed, precision or scheduler): "
                    "rendering them again"
                )
        except UsageError as e:
            problem = str(e)
        except OSError as e:
            problem = f"cannot create {target}: {e.strerror or e}"
    distributed.check_all_ranks(problem is None, problem or "")
    embeds = shape.family.validation_embeds(encoders, [data.class_prompt], shape.text_tokens)
    encoders.placement.release()  # no text encoder beside the transformer (flux_cp.placement)
    precision = cfg.model.base_precision
    # On the CPU first with a quantized base, which quantize_base moves to the device a layer at a time: a 24 GB GPU
    # cannot hold a bf16 FLUX.1.
    loaded_on = device if precision == "bf16" else torch.device("cpu")
    transformer = load_transformer(
        cfg.model, shape.model_path, shape.family.transformer_class(), weight_dtype, loaded_on, cfg.train.seed
    )
    if precision != "bf16":
        quantize_base(transformer, precision, device=device, parts=shape.family.quantized_parts)
    transformer.requires_grad_(False)
    transformer = parallelize(transformer, shape, layout, cfg).model  # CP across each group (and --compile)
    jobs = [(0, generator(Stream.CLASS_IMAGE, cfg.train.seed, k)) for k in indices]
    failed: list[str] = []

    def write(job: int, pixels) -> None:
        """Each image as soon as it is rendered (the group's first rank): an interruption keeps those done. A
        failed write is reported once every rank has rendered its share (a rank leaving early would hang the
        others' collectives)."""
        if layout.cp_rank != 0 or failed:
            return
        image = Image.fromarray(pixels)
        try:
            files.write_with(target / generated_name(indices[job], image), lambda tmp: image.save(tmp, format="PNG"))
        except OSError as e:
            failed.append(f"cannot write class images into {target}: {e.strerror or e}")

    try:
        render(
            transformer,
            encoders,
            scheduler_config,
            embeds,
            layout,
            shape.family,
            autocast,
            jobs,
            resolution,
            on_image=write,
        )
    finally:
        del transformer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    distributed.check_all_ranks(not failed, failed[0] if failed else "")
    return len(indices)
