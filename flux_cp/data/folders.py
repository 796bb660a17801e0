"""A local data folder: which files are training images and which caption each one has.

Images are the files PIL reads as pictures (flux_cp.images), in the folder and its sub-folders, hidden files and
folders left out (and the encoding cache, should it lie inside). A caption comes from `metadata.jsonl` (one JSON
object per line with `file_name`, a path relative to the folder, and the caption column), else from a UTF-8 `.txt`
file of the same name, else from `--instance_prompt` (which replaces all of them).

metadata.jsonl is read once, by `read_metadata_file`, and every line checked before anything is derived from it
(captions, FLUX.1 Kontext pairs and their reference column): a line that is not a JSON object, or names a file
outside the folder, a file that does not exist or is no image, or the same image twice, is refused with its line
number, because a silently ignored line trains on a different data set than the one written down. Every path column
(`file_name` and each `<column>_file_name`) gets the same checks; a `<column>_file_name` may also hold a list of
paths (FLUX.2's several reference images of one target), each checked so, none named twice. Lines end at "\\n" only:
JSON strings may hold U+2028, U+2029 and U+0085, which `str.splitlines` would take for line ends.

Containment applies to the name written in the folder, not to where a symbolic link leads: images linked into a
blob store (the hub cache, git-annex, DVC) are read through their links, and a link that leads nowhere is named.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from flux_cp.errors import UsageError
from flux_cp.images import IMAGE_EXTENSIONS, is_image_file, read_caption

METADATA = "metadata.jsonl"
FILE_NAME = "file_name"
_PATH_SUFFIX = "_file_name"  # datasets' imagefolder reads `<column>_file_name` as an image column `<column>`


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _dangling(path: Path) -> UsageError:
    return UsageError(
        f"{path} is a symbolic link to {os.readlink(path)}, which does not exist: fetch the file it stands for "
        "(git annex get, dvc pull, a hub download) or remove the link"
    )


def image_files(folder: Path, exclude: tuple[Path, ...] = ()) -> list[Path]:
    """Image files under `folder`, sorted, hidden files and anything inside hidden folders or inside `exclude`
    (folders, e.g. the encoding cache) left out. Symbolic links to images and to folders are followed (a linked folder
    was skipped without a word, while metadata.jsonl could name images through it); a dangling link is refused, and
    so is a link to a folder listed already (a loop, or the same images twice)."""
    root = os.path.realpath(folder)
    skip = []
    for other in exclude:
        rel = os.path.relpath(os.path.realpath(other), root)
        if rel not in (".", "..") and not rel.startswith(".." + os.sep):
            skip.append(Path(rel).parts)

    def left_out(rel: Path) -> bool:
        return _hidden(rel) or any(rel.parts[: len(s)] == s for s in skip)

    found, listed = [], {root: folder}
    for here, folders, names in os.walk(folder, followlinks=True):
        base = Path(here)
        keep = []
        for name in sorted(folders):
            path = base / name
            if left_out(path.relative_to(folder)):
                continue
            real = os.path.realpath(path)
            if real in listed:  # each real folder once: a link loop, or two names of one folder
                raise UsageError(
                    f"{path} and {listed[real]} are the same folder (through a symbolic link): its images would be "
                    "listed twice, or without end; remove the link"
                )
            listed[real] = path
            keep.append(name)
        folders[:] = keep
        for name in names:
            path = base / name
            if not is_image_file(path) or left_out(path.relative_to(folder)):
                continue
            if path.is_symlink() and not path.exists():
                raise _dangling(path)
            if path.is_file():
                found.append(path)
    return sorted(found)


def metadata_text(path: Path) -> str:
    """The text of a metadata.jsonl, which must be UTF-8 (a byte-order mark is allowed); the bad line named."""
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise UsageError(
            f"{path} line {line} is not UTF-8 text (byte {e.object[e.start]:#04x}): save it as UTF-8"
        ) from None


@dataclass(frozen=True)
class Row:
    """One line of metadata.jsonl: its number, the JSON object as written, and the files it names (path column ->
    the name relative to the folder, normalised: `./a.png` -> `a.png`; a column holding a list of paths -> a tuple of
    them, in order)."""

    line: int
    values: dict
    files: dict[str, str | tuple[str, ...]]


@dataclass(frozen=True)
class Metadata:
    """A folder's metadata.jsonl, read and checked (`read_metadata_file`)."""

    path: Path
    folder: Path
    rows: tuple[Row, ...]
    image_columns: tuple[str, ...]  # `<column>` of every `<column>_file_name` key (FLUX.1 Kontext references)

    def where(self, row: Row) -> str:
        return f"{self.path} line {row.line}"


def _relative_name(where: str, key: str, name: str, folder: Path) -> str:
    """`name` as a path relative to `folder`, refused when it is absolute or climbs out of it (by its name: a
    symbolic link inside the folder may lead anywhere), names no existing file or no image."""
    pure = PurePosixPath(name.replace("\\", "/"))
    parts = [p for p in pure.parts if p != "."]
    if pure.is_absolute() or os.path.isabs(name) or not parts or ".." in parts:
        raise UsageError(f"{where}: {key} {name!r} must be a path inside {folder}, relative to it")
    rel = "/".join(parts)
    path = folder / rel
    if path.is_symlink() and not path.exists():
        raise UsageError(f"{where}: {key} {name!r} is a symbolic link to {os.readlink(path)}, which does not exist")
    if not path.is_file():
        raise UsageError(f"{where}: {key} {name!r} does not exist in {folder}")
    if not is_image_file(path) or _hidden(Path(rel)):
        raise UsageError(
            f"{where}: {key} {name!r} is not an image this trainer reads ({', '.join(IMAGE_EXTENSIONS[:8])}, "
            "...; hidden files are skipped)"
        )
    return rel


def _relative_names(where: str, key: str, names: list, folder: Path) -> tuple[str, ...]:
    """A list of paths in one column (several reference images): each checked as `_relative_name`, none twice."""
    if not names:
        raise UsageError(f"{where}: {key} is an empty list: name one or more images, as paths relative to {folder}")
    out: list[str] = []
    for j, name in enumerate(names):
        if not isinstance(name, str):
            raise UsageError(f"{where}: {key}[{j}] is {json.dumps(name)}, not a path relative to {folder}")
        rel = _relative_name(where, f"{key}[{j}]", name, folder)
        if rel in out:
            raise UsageError(f"{where}: {key} names {name!r} twice: list each image once")
        out.append(rel)
    return tuple(out)


def read_metadata_file(folder: Path) -> Metadata | None:
    """The folder's metadata.jsonl, every line checked (see the module's text); None when the folder has none.
    Captions are checked by their users (`captions`, FLUX.1 Kontext pairs), which know the caption column."""
    path = folder / METADATA
    if not path.is_file():
        return None
    text = metadata_text(path)
    rows, first_line, columns = [], {}, set()
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            values = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where} is not valid JSON: {e}") from None
        if not isinstance(values, dict):
            raise UsageError(f"{where} is a JSON {type(values).__name__}, not an object with 'file_name' and a caption")
        name = values.get(FILE_NAME)
        if not isinstance(name, str) or not name.strip():
            raise UsageError(f"{where} has no 'file_name' (a path relative to {folder})")
        files = {FILE_NAME: _relative_name(where, FILE_NAME, name, folder)}
        if files[FILE_NAME] in first_line:
            raise UsageError(
                f"{where}: file_name {name!r} already has a caption on line {first_line[files[FILE_NAME]]}"
            )
        first_line[files[FILE_NAME]] = n
        for key, value in values.items():
            if key == FILE_NAME or not key.endswith(_PATH_SUFFIX):
                continue
            columns.add(key[: -len(_PATH_SUFFIX)])
            if value is None or value == "":
                continue  # a row without this image: its user says whether that is allowed
            if isinstance(value, list):
                files[key] = _relative_names(where, key, value, folder)
                continue
            if not isinstance(value, str):
                raise UsageError(f"{where}: {key} is {json.dumps(value)}, not a path relative to {folder}")
            files[key] = _relative_name(where, key, value, folder)
        rows.append(Row(n, values, files))
    return Metadata(path, folder, tuple(rows), tuple(sorted(columns)))


def caption_of(meta: Metadata, row: Row, caption_column: str) -> str:
    """The row's caption in `caption_column`, which must be a string."""
    if caption_column not in row.values:
        raise UsageError(
            f"{meta.where(row)} has no caption column '{caption_column}' (columns: {sorted(row.values)}); set "
            "--caption_column or --instance_prompt"
        )
    caption = row.values[caption_column]
    if not isinstance(caption, str):
        raise UsageError(
            f"{meta.where(row)}: '{caption_column}' is {json.dumps(caption)}, not a string: give every image a "
            'caption (an empty string "" trains that image without one)'
        )
    return caption


def captions(meta: Metadata, caption_column: str) -> dict[str, str]:
    """Image name (relative to the folder) -> caption, of every row."""
    return {row.files[FILE_NAME]: caption_of(meta, row, caption_column) for row in meta.rows}


def read_metadata(path: Path, folder: Path, caption_column: str) -> dict[str, str]:
    """Image name (relative to `folder`) -> caption, from `folder`'s metadata.jsonl (`path`); every line checked."""
    meta = read_metadata_file(folder) if path == folder / METADATA else None
    if meta is None:
        raise UsageError(f"{path} is not the metadata.jsonl of {folder}")
    return captions(meta, caption_column)


def list_folder(
    folder: Path,
    caption_column: str,
    instance_prompt: str | None,
    exclude: tuple[Path, ...] = (),
    meta: Metadata | None = None,
) -> list[tuple[str, str]]:
    """(image path, caption) of every image in `folder`; a UsageError that says what to add or fix. `meta`: the
    folder's metadata.jsonl already read (read here when None)."""
    meta = meta or read_metadata_file(folder)  # its errors name a line
    files = image_files(folder, exclude)
    if not files:
        raise UsageError(f"--dataset_name {folder}: no images ({', '.join(IMAGE_EXTENSIONS)}) in this folder")
    if instance_prompt is not None:  # captions of metadata.jsonl and .txt files are not read
        return [(str(p), instance_prompt) for p in files]
    named = captions(meta, caption_column) if meta is not None else {}
    samples, missing = [], []
    for p in files:
        caption = named.get(p.relative_to(folder).as_posix())
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
