"""A local data folder: which files are training images and which caption each one has.

Images are the files PIL reads as pictures (flux_cp.images), in the folder and its sub-folders, hidden files and
folders left out. A caption comes from `metadata.jsonl` (one JSON object per line with `file_name`, a path relative
to the folder, and the caption column), else from a UTF-8 `.txt` file of the same name, else from
`--instance_prompt` (which replaces all of them). Every line of metadata.jsonl is checked: a line that names no
image of the folder, names one twice, or has no usable caption is refused with its line number, because a
silently ignored line trains on a different data set than the one written down.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UsageError
from .images import IMAGE_EXTENSIONS, is_image_file, read_caption

METADATA = "metadata.jsonl"


def image_files(folder: Path) -> list[Path]:
    """Image files under `folder`, sorted, hidden files and anything inside hidden folders left out."""
    return sorted(
        p for p in folder.rglob("*")
        if is_image_file(p) and not any(part.startswith(".") for part in p.relative_to(folder).parts) and p.is_file()
    )  # fmt: skip


def metadata_text(path: Path) -> str:
    """The text of a metadata.jsonl, which must be UTF-8 (a byte-order mark is allowed); the bad line named."""
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise UsageError(
            f"{path} line {line} is not UTF-8 text (byte {e.object[e.start]:#04x}): save it as UTF-8"
        ) from None


def read_metadata(path: Path, folder: Path, caption_column: str) -> dict[Path, str]:
    """Resolved image path -> caption, from metadata.jsonl; every line checked."""
    text = metadata_text(path)
    root = folder.resolve()
    captions: dict[Path, str] = {}
    first_line: dict[Path, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where} is not valid JSON: {e}") from None
        if not isinstance(row, dict):
            raise UsageError(f"{where} is a JSON {type(row).__name__}, not an object with 'file_name' and a caption")
        name = row.get("file_name")
        if not isinstance(name, str) or not name.strip():
            raise UsageError(f"{where} has no 'file_name' (a path relative to {folder})")
        image = (folder / name).resolve()
        if Path(name).is_absolute() or root not in image.parents:
            raise UsageError(f"{where}: file_name {name!r} must be a path inside {folder}, relative to it")
        if not image.is_file():
            raise UsageError(f"{where}: file_name {name!r} does not exist in {folder}")
        if not is_image_file(image):
            raise UsageError(
                f"{where}: file_name {name!r} is not an image this trainer reads ({', '.join(IMAGE_EXTENSIONS[:8])}, "
                "...; hidden files are skipped)"
            )
        if image in first_line:
            raise UsageError(f"{where}: file_name {name!r} already has a caption on line {first_line[image]}")
        first_line[image] = n
        if caption_column not in row:
            raise UsageError(
                f"{where} has no caption column '{caption_column}' (columns: {sorted(row)}); set --caption_column or "
                "--instance_prompt"
            )
        caption = row[caption_column]
        if not isinstance(caption, str):
            raise UsageError(
                f"{where}: '{caption_column}' is {json.dumps(caption)}, not a string: give every image a caption "
                '(an empty string "" trains that image without one)'
            )
        captions[image] = caption
    return captions


def list_folder(folder: Path, caption_column: str, instance_prompt: str | None) -> list[tuple[str, str]]:
    """(image path, caption) of every image in `folder`; a UsageError that says what to add or fix."""
    files = image_files(folder)
    if not files:
        raise UsageError(f"--dataset_name {folder}: no images ({', '.join(IMAGE_EXTENSIONS)}) in this folder")
    if instance_prompt is not None:  # metadata.jsonl and .txt files are not read
        return [(str(p), instance_prompt) for p in files]
    meta = folder / METADATA
    captions = read_metadata(meta, folder, caption_column) if meta.is_file() else {}
    samples, missing = [], []
    for p in files:
        caption = captions.get(p.resolve())
        if caption is None and p.with_suffix(".txt").is_file():
            caption = read_caption(p.with_suffix(".txt"))
        if caption is None:
            missing.append(str(p.relative_to(folder)))
        else:
            samples.append((str(p), caption))
    if missing:
        hint = (
            f" ({folder / 'metadata.csv'} is not read: convert it to {METADATA})"
            if (folder / "metadata.csv").is_file()
            else ""
        )
        raise UsageError(
            f"{len(missing)} images in {folder} have no caption (e.g. {', '.join(missing[:3])}): add {METADATA} with "
            f"'file_name' and '{caption_column}', a .txt beside each image, or --instance_prompt{hint}"
        )
    return samples
