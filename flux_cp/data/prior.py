"""DreamBooth prior preservation, as diffusers' DreamBooth LoRA examples define it: the class images of
`--class_data_dir` and their encodings in the buckets the training images use.

The user's class images in `--class_data_dir` are read, never written: the ones flux-cp generates go into its
subfolder `generated/`, which a marker file (`.flux_cp_class_images.json`) marks as flux-cp's; a `generated/` without
it is the user's, listed like their other images, and never written. The class images are the user's (sorted by
name) followed by the generated ones (by index), so a generated image never takes the place of one of theirs.

The marker also holds the key of what rendered the generated images (the model's configs and weights' content, the
class prompt, the size, the seed, the precision, the scheduler): generated images of another key are never used.
Generating the missing ones needs the model and CP: flux_cp.run.class_images. The loss and which class image each
batch slot trains beside: flux_cp.loss, flux_cp.data.schedule.BatchSchedule.class_images.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from flux_cp import distributed, files
from flux_cp.data.folders import image_files
from flux_cp.data.sources import ImageSource, Sample
from flux_cp.errors import UsageError

if TYPE_CHECKING:
    pass

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


def marked_key(folder: Path) -> str | None:
    """The key of the generated images the marker records (None: none recorded, as before keys)."""
    marker = files.read_json(generated_folder(folder) / MARKER) if _ours(folder) else None
    key = marker.get("key") if isinstance(marker, dict) else None
    return key if isinstance(key, str) else None


def generated_images(folder: Path, key: str | None = None) -> dict[int, Path]:
    """The generated class images of `folder` by index (none when generated/ is not flux-cp's, or, given a `key`,
    when they were rendered for another one)."""
    if not _ours(folder) or (key is not None and marked_key(folder) != key):
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
    generated = generated_images(folder)
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
    generated = generated_images(folder, key)
    todo = [k for k in range(needed) if k not in generated]
    return min(own, wanted) + needed - len(todo), todo


def missing_count(folder: Path, wanted: int, is_main: bool, key: str | None = None) -> tuple[int, list[int]]:
    """`missing`, as the main process sees the folder (every rank gets its answer)."""
    return distributed.all_gather(missing(folder, wanted, key) if is_main else None)[0]


def check_generated_folder(folder: Path) -> None:
    """Before generating into `folder`/generated: it is flux-cp's (marked), or new or empty; a UsageError else."""
    target = generated_folder(folder)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise UsageError(
            f"--class_data_dir {folder}: {GENERATED} is a link or a file, where flux-cp writes the class "
            "images it generates: remove or rename it"
        )
    if target.is_dir() and not _ours(folder) and any(target.iterdir()):
        raise UsageError(
            f"--class_data_dir {folder}: {GENERATED}/ holds files flux-cp did not write (no {MARKER}), and flux-cp "
            f"writes the class images it generates there: rename that folder, or give --num_class_images at most the "
            "number of class images the folder holds"
        )
