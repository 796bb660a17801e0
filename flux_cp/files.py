"""Atomic file writes: a reader (or a resumed run) sees the old file or the complete new one, never a part.
The data goes to a temporary file in the same folder (same file system), is fsynced, then os.replace()d
over the target. The file gets the mode any new file gets under the user's umask (mkstemp alone makes it 0600)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# Read once, at import: os.umask can only be read by setting it, which must not race with files being created.
_UMASK = _umask()


def apply_umask(path: str | os.PathLike) -> None:
    """Give `path` (and everything under a folder) the mode a new file or folder gets under the user's umask:
    some writers (tempfile, safetensors) create files readable by their owner only."""
    path = Path(path)
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~_UMASK)


@contextmanager
def _replacing(path: str | os.PathLike) -> Iterator[str]:
    """Yields a temporary path beside `path` to write to; on success it replaces `path`, else it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        apply_umask(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_with(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """`write(temporary path)` then atomically move the result to `path` (for writers that take a path)."""
    with _replacing(path) as tmp:
        write(tmp)


def write_text(path: str | os.PathLike, text: str) -> None:
    with _replacing(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    plain = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    with _replacing(path) as tmp:
        try:
            save_file(plain, tmp)
        except SafetensorError as e:  # its I/O failures (a full disk) are not OSErrors: make them one
            raise OSError(f"cannot write {path}: {e}") from None


def read_json(path: str | os.PathLike) -> object:
    """A JSON file's value, or None where there is no such regular file (a link is not followed) or it does not
    parse: for markers and records that another run or a crash may have left half-written."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes()) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError):
        return None
