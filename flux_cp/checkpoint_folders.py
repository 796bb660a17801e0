"""Training checkpoints on disk, read without loading anything: their folders (`checkpoint-N`) in an output folder,
which one `--resume_from_checkpoint` names, and their `meta.json`, every field this code reads checked. The flags,
the output folder, the disk check and resumes read them; flux_cp.outputs.checkpoint writes and loads checkpoints.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from flux_cp.errors import UsageError

FORMAT = 1


_NAME = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (a `meta.json` inside), oldest first."""
    out = []
    root = Path(output_dir)
    if root.is_dir():
        for p in root.iterdir():
            m = _NAME.match(p.name)
            if m and (p / "meta.json").is_file():
                out.append((int(m.group(1)), p))
    return sorted(out)


def named_folder(resume: str | None, output_dir: str) -> tuple[str | None, str | None]:
    """`--resume_from_checkpoint` as the folder to resume: 'latest' and paths as given; a bare name (no folder part)
    that is no folder here is a folder of `output_dir`, as diffusers' examples read one (checkpoint-2). Returns (the
    value to use, the line saying which folder a bare name named, or None). A UsageError naming the paths tried when
    a bare name names no folder, or one in each place."""
    if resume in (None, "latest") or not resume.strip() or resume.startswith("~") or "/" in resume or os.sep in resume:
        return resume, None  # a path: checked as given (flux_cp.config.flags)
    here, inside = Path(resume), Path(os.path.expanduser(output_dir)) / resume
    if here.is_dir() and inside.is_dir() and not os.path.samefile(here, inside):
        raise UsageError(
            f"--resume_from_checkpoint {resume} names two folders, {here.absolute()} (from the current folder) and "
            f"{inside} (in --output_dir): pass the path of the one to resume"
        )
    if here.is_dir():
        return resume, None
    if not inside.is_dir():
        raise UsageError(
            f"--resume_from_checkpoint {resume}: no such checkpoint folder (tried {here.absolute()} and {inside}, in "
            "--output_dir)"
        )
    return (
        str(inside),
        f"--resume_from_checkpoint {resume} is {inside} (a bare name is a folder of --output_dir, as in diffusers' "
        "examples)",
    )


def resolve(resume: str | None, output_dir: str) -> Path | None:
    """The checkpoint folder to resume from: None (fresh start), `latest` (None if there is none yet)."""
    if resume is None:
        return None
    if resume == "latest":
        found = list_checkpoints(output_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / "meta.json").is_file():
        raise UsageError(
            f"--resume_from_checkpoint {resume} is not a complete checkpoint (no meta.json): pass a checkpoint-N "
            "folder written by train_flux_cp.py, or 'latest'"
        )
    return path


def saved_run(resume: str | None, output_dir: str | os.PathLike) -> tuple[Path, dict] | None:
    """(the checkpoint `--resume_from_checkpoint resume` names, its meta.json) when it can be read, else None (no
    resume, no checkpoint yet, or a damaged one: the resume itself then says what is wrong). Reads only."""
    if resume is None:
        return None
    try:
        path = resolve(resume, str(output_dir))
        return (path, read_meta(path)) if path is not None else None
    except UsageError:
        return None


def read_meta(path: Path) -> dict:
    """A checkpoint's meta.json, every field this code reads checked (a damaged or foreign file is named)."""
    try:
        check_inside(path / "meta.json", path)
        with open(path / "meta.json", encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8, or a path outside the checkpoint
        raise UsageError(f"--resume_from_checkpoint {path}: meta.json cannot be read ({e})") from None
    if not isinstance(meta, dict):
        raise UsageError(f"--resume_from_checkpoint {path}: meta.json is a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        raise UsageError(f"--resume_from_checkpoint {path}: format {meta.get('format')} is not {FORMAT}")
    fields = (
        ("step", int),
        ("run", dict),
        ("layout", str),
        ("args", dict),
        ("optimizer_state", bool),
        ("checksums", dict),
    )
    for key, kind in fields:
        value = meta.get(key)
        # written since a later version; absent means the default (no checksums: written before them)
        missing_ok = key in ("args", "optimizer_state", "checksums")
        bad = (value is None and not missing_ok) or (value is not None and type(value) is not kind)
        if bad or (key == "step" and value < 0):
            raise UsageError(
                f"--resume_from_checkpoint {path}: meta.json has no valid '{key}' (got {value!r}); the checkpoint is "
                "damaged or was not written by train_flux_cp.py: resume from another checkpoint-N folder"
            )
    if "checksums" in meta and listed_files(meta) is None:
        raise UsageError(
            f"--resume_from_checkpoint {path}: meta.json's 'checksums' is not a list of files with their sizes and "
            "checksums; the checkpoint is damaged or was not written by train_flux_cp.py: resume from another "
            "checkpoint-N folder"
        )
    return meta


def listed_files(meta: dict) -> dict[str, dict] | None:
    """{relative name: {"bytes", "hash"}} of a checkpoint's meta.json (None: none, or malformed)."""
    sums = meta.get("checksums")
    if not isinstance(sums, dict) or sums.get("algorithm") not in ("xxh3_128", "sha256"):
        return None
    listed = sums.get("files")
    ok = isinstance(listed, dict) and all(
        isinstance(k, str) and isinstance(v, dict) and type(v.get("bytes")) is int and isinstance(v.get("hash"), str)
        for k, v in listed.items()
    )
    return listed if ok else None


def check_inside(path: Path, root: Path) -> None:
    """A ValueError unless `path` (links followed) lies inside `root`: a checkpoint is read from its own folder."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, base]) != base:
        raise ValueError(f"{path} leads outside {root} (to {real}): the checkpoint is damaged or was tampered with")
