"""Atomic file writes: a reader (or a resumed run) sees the old file or the complete new one, never a part.
The data goes to a temporary file in the same folder (same file system), is fsynced, then os.replace()d
over the target."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


@contextmanager
def _replacing(path: str | os.PathLike) -> Iterator[str]:
    """Yields a temporary path beside `path` to write to; on success it replaces `path`, else it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
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
    from safetensors.torch import save_file

    plain = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    with _replacing(path) as tmp:
        save_file(plain, tmp)
