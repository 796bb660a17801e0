"""DreamBooth prior preservation, as diffusers' DreamBooth LoRA examples define it: the class images of
`--class_data_dir` (the missing ones, up to `--num_class_images`, generated with the base model and
`--class_prompt`), and their encodings in the buckets the training images use.

The user's class images in `--class_data_dir` are read, never written: the ones flux-cp generates go into its
subfolder `generated/`, which a marker file (`.flux_cp_class_images.json`) marks as flux-cp's; a `generated/` without
it is the user's, listed like their other images, and never written. The class images are the user's (sorted by
name) followed by the generated ones (by index), so a generated image never takes the place of one of theirs.

Generation runs before the training data is encoded, through the model family's validation pipeline with CP across
each group (`flux_cp.validation.render`), the class images split over the data-parallel ranks. Generated image k
starts from noise keyed by the seed and k (flux_cp.rng), so the images do not depend on the layout, and each is
written (atomically) as soon as it is rendered: an interrupted generation resumes with the images it lacks. The
loss and which class image each batch slot trains beside: flux_cp.batches, flux_cp.data.BatchSchedule.class_images.
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

from . import distributed, files
from .data import ImageSource, Sample
from .errors import UsageError
from .folders import image_files
from .model import load_transformer
from .parallel import parallelize
from .precision import quantize_base
from .rng import Stream, generator
from .validation import render

if TYPE_CHECKING:
    from .config import Config, DataConfig
    from .encode import Encoders, TrainingData
    from .parallel import Layout
    from .shape import RunShape

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


def _generated(folder: Path) -> dict[int, Path]:
    """The generated class images of `folder` by index (none when generated/ is not flux-cp's)."""
    if not _ours(folder):
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


def missing(folder: Path, wanted: int) -> tuple[int, list[int]]:
    """(class images present among the first `wanted`, the indices of the generated images still to render): the
    user's images count first, generated image k fills place (user's count + k)."""
    folder = Path(folder)
    own = len(_own_images(folder))
    needed = max(0, wanted - own)
    generated = _generated(folder)
    todo = [k for k in range(needed) if k not in generated]
    return min(own, wanted) + needed - len(todo), todo


def missing_count(folder: Path, wanted: int, is_main: bool) -> tuple[int, list[int]]:
    """`missing`, as the main process sees the folder (every rank gets its answer)."""
    return distributed.all_gather(missing(folder, wanted) if is_main else None)[0]


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


def check_resume(meta: dict, data: DataConfig, path: Path) -> None:
    """Before anything is generated: a resume needs the class images its checkpoint trained with. A checkpoint of
    a run without prior preservation, or with another number of class images, is refused, naming the counts."""
    if not data.with_prior_preservation:
        return
    run, args = meta.get("run", {}), meta.get("args", {})
    if run.get("prior") is None:
        raise UsageError(
            f"--resume_from_checkpoint {path} was trained without --with_prior_preservation: resume it without it, "
            "or start a new --output_dir"
        )
    rows = run.get("prior_files")
    count = len(rows) if isinstance(rows, list) else args.get("num_class_images")
    if isinstance(count, int) and count != data.num_class_images:
        raise UsageError(
            f"--resume_from_checkpoint {path} was trained with {count} class images, and this run asks for "
            f"--num_class_images {data.num_class_images}: resume with --num_class_images {count} (nothing is "
            "generated), or start a new --output_dir"
        )


def _mark(target: Path, prompt: str) -> None:
    target.mkdir(parents=True, exist_ok=True)
    if not (target / MARKER).exists():
        text = json.dumps({"written_by": "flux-cp", "what": "class images generated for --with_prior_preservation",
                           "class_prompt": prompt}, indent=2)  # fmt: skip
        files.write_text(target / MARKER, text + "\n")


def generate_class_images(cfg: Config, shape: RunShape, layout: Layout, encoders: Encoders, scheduler_config: dict,
                          weight_dtype: torch.dtype, device: torch.device, autocast) -> int:  # fmt: skip
    """Fill `--class_data_dir` up to `--num_class_images`: the missing ones rendered by the base model with the
    family's validation pipeline (its default steps and guidance, as diffusers' examples call it) at the largest
    `--resolution`, CP across each group, split over the data-parallel ranks, into generated/ (each group's first
    rank writes each of its images as soon as it is rendered). Returns how many were generated. Every rank calls
    it."""
    data = cfg.data
    folder = Path(data.class_data_dir)
    have, indices = missing_count(folder, data.num_class_images, layout.is_main)
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
            _mark(target, data.class_prompt)
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
    (`used`) at index `p * count + c` (flux_cp.encode.ClassGeometry)."""

    def __init__(self, data: TrainingData, count: int, used: list[int]):
        self.data, self.count, self.used = data, count, list(used)

    def load(self, image: int, bucket: int, epoch: int) -> dict[str, torch.Tensor]:
        return self.data.load(self.used.index(bucket) * self.count + image, False, epoch)
