"""DreamBooth prior preservation, as diffusers' DreamBooth LoRA examples define it: the class images of
`--class_data_dir` (the missing ones, up to `--num_class_images`, generated with the base model and
`--class_prompt`), and their encodings in the buckets the training images use.

The user's class images in `--class_data_dir` are read, never written: the ones flux-cp generates go into its
subfolder `generated/`, which a marker file (`.flux_cp_class_images.json`) marks as flux-cp's; a `generated/` without
it is the user's, listed like their other images, and never written. The class images are the user's (sorted by
name) followed by the generated ones (by index), so a generated image never takes the place of one of theirs.

The marker also holds the key of what rendered the generated images (`class_key`: the model's configs and weights'
content, the class prompt, the size, the seed, the precision, the scheduler): generated images of another key are
never used, but rendered again (those of the other key removed, as flux-cp's own), which the log says.

Generation runs before the training data is encoded, through the model family's validation pipeline with CP across
each group (`flux_cp.outputs.validation.render`), the class images split over the data-parallel ranks. Generated image k
starts from noise keyed by the seed and k (flux_cp.rng), so the images do not depend on the layout, and each is
written (atomically) as soon as it is rendered: an interrupted generation resumes with the images it lacks. The
loss and which class image each batch slot trains beside: flux_cp.data.batches,
flux_cp.data.sources.BatchSchedule.class_images.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from PIL import Image

from flux_cp import distributed, files
from flux_cp.data.folders import image_files
from flux_cp.data.sources import ImageSource, Sample
from flux_cp.errors import UsageError
from flux_cp.model.loading import load_transformer
from flux_cp.model.parallel import parallelize
from flux_cp.model.precision import quantize_base
from flux_cp.outputs.validation import render
from flux_cp.rng import Stream, generator

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.data.encode import TrainingData
    from flux_cp.families.encoders import Encoders
    from flux_cp.layout import Layout
    from flux_cp.shape import RunShape

logger = logging.getLogger("flux_cp")

GENERATED = "generated"  # the subfolder of --class_data_dir the generated class images go to
MARKER = ".flux_cp_class_images.json"  # in it: the folder is flux-cp's
_GENERATED_NAME = re.compile(r"^(\d{5,})-[0-9a-f]{40}\.png$")


def generated_folder(folder: Path) -> Path:
    return Path(folder) / GENERATED


def _ours(folder: Path) -> bool:
    """`--class_data_dir`'s generated/ subfolder exists and holds flux-cp's marker."""
    marker = generated_folder(folder) / MARKER
    return marker.is_file() and not marker.is_symlink()


def _marked_key(folder: Path) -> str | None:
    """The key of the generated images the marker records (None: none recorded, as before keys)."""
    marker = files.read_json(generated_folder(folder) / MARKER) if _ours(folder) else None
    key = marker.get("key") if isinstance(marker, dict) else None
    return key if isinstance(key, str) else None


def _generated(folder: Path, key: str | None = None) -> dict[int, Path]:
    """The generated class images of `folder` by index (none when generated/ is not flux-cp's, or, given a `key`,
    when they were rendered for another one)."""
    if not _ours(folder) or (key is not None and _marked_key(folder) != key):
        return {}
    found = {}
    for p in sorted(image_files(generated_folder(folder)), reverse=True):  # the first name of an index wins
        m = _GENERATED_NAME.match(p.name)
        if m and p.parent == generated_folder(folder):
            found[int(m.group(1))] = p
    return found


def _own_images(folder: Path) -> list[Path]:
    """The user's class images: every image of `folder` but flux-cp's generated/ subfolder, sorted by name."""
    if not folder.is_dir():
        return []
    return image_files(folder, exclude=(generated_folder(folder),) if _ours(folder) else ())


def class_images(folder: Path) -> list[Path]:
    """The images of a class folder: the user's (sorted by name, hidden files left out), then the generated ones
    (by index)."""
    folder = Path(folder)
    generated = _generated(folder)
    return _own_images(folder) + [generated[k] for k in sorted(generated)]


def class_source(folder: Path, prompt: str, count: int) -> ImageSource:
    """The first `count` class images of `folder`, each captioned `prompt` (as diffusers' examples take
    `--num_class_images` of the folder's images)."""
    found = class_images(folder)[:count]
    return ImageSource([Sample(str(p), prompt) for p in found], f"--class_data_dir {folder}", root=folder)


def generated_name(index: int, image) -> str:
    """A generated class image's file name in generated/: its index (the order they sort in) and the hash of its
    pixels, as diffusers' examples name theirs; PNG, so that the image trained on is the one rendered."""
    return f"{index:05d}-{hashlib.sha1(image.tobytes()).hexdigest()}.png"


def missing(folder: Path, wanted: int, key: str | None = None) -> tuple[int, list[int]]:
    """(class images present among the first `wanted`, the indices of the generated images still to render): the
    user's images count first, generated image k fills place (user's count + k). `key`: only generated images of
    that key count."""
    folder = Path(folder)
    own = len(_own_images(folder))
    needed = max(0, wanted - own)
    generated = _generated(folder, key)
    todo = [k for k in range(needed) if k not in generated]
    return min(own, wanted) + needed - len(todo), todo


def missing_count(folder: Path, wanted: int, is_main: bool, key: str | None = None) -> tuple[int, list[int]]:
    """`missing`, as the main process sees the folder (every rank gets its answer)."""
    return distributed.all_gather(missing(folder, wanted, key) if is_main else None)[0]


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


def check_generated_folder(folder: Path) -> None:
    """Before generating into `folder`/generated: it is flux-cp's (marked), or new or empty; a UsageError else."""
    target = generated_folder(folder)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise UsageError(f"--class_data_dir {folder}: {GENERATED} is a link or a file, where flux-cp writes the class "
                         "images it generates: remove or rename it")  # fmt: skip
    if target.is_dir() and not _ours(folder) and any(target.iterdir()):
        raise UsageError(
            f"--class_data_dir {folder}: {GENERATED}/ holds files flux-cp did not write (no {MARKER}), and flux-cp "
            f"writes the class images it generates there: rename that folder, or give --num_class_images at most the "
            "number of class images the folder holds"
        )


def _mark(target: Path, prompt: str, key: str) -> int:
    """Mark generated/ as flux-cp's, for images of `key`; images of another key there are removed first (flux-cp's
    own, rendered for other settings). Returns how many were removed."""
    target.mkdir(parents=True, exist_ok=True)
    stale = [] if _marked_key(target.parent) == key else list(_generated(target.parent).values())
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
    logger.info(f"prior preservation: {have} class images in {folder}, generating {len(indices)} with the base model "
                f"into {target}")  # fmt: skip
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
    transformer = load_transformer(cfg.model, shape.model_path, shape.family.transformer_class(), weight_dtype,
                                   device if precision == "bf16" else torch.device("cpu"), cfg.train.seed)  # fmt: skip
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
            files.write_with(target / generated_name(indices[job], image),
                             lambda tmp: image.save(tmp, format="PNG"))  # fmt: skip
        except OSError as e:
            failed.append(f"cannot write class images into {target}: {e.strerror or e}")

    try:
        render(transformer, encoders, scheduler_config, embeds, layout, shape.family, autocast, jobs, resolution,
               on_image=write)  # fmt: skip
    finally:
        del transformer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    distributed.check_all_ranks(not failed, failed[0] if failed else "")
    return len(indices)


class ClassSamples:
    """The class images' encodings: `data` holds class image c in the p-th of the buckets the training images use
    (`used`) at index `p * count + c` (flux_cp.data.encode.ClassGeometry)."""

    def __init__(self, data: TrainingData, count: int, used: list[int]):
        self.data, self.count, self.used = data, count, list(used)

    def load(self, image: int, bucket: int, epoch: int) -> dict[str, torch.Tensor]:
        return self.data.load(self.used.index(bucket) * self.count + image, False, epoch)
