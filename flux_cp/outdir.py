"""An output folder belongs to one run.

Before anything loads, the main process makes sure `--output_dir` is a folder it can write to, takes a lock
that keeps a second live run out (held until the process ends; the kernel drops it when a process dies, so a
crash never leaves a stale lock), and refuses a folder that holds another run's outputs unless told to resume
it (`--resume_from_checkpoint`) or to replace it (`--overwrite_output_dir`, which removes that run's outputs
and nothing else).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError

from . import files
from .errors import UsageError

LOCK_NAME = ".flux_cp.lock"
# What a run writes into its folder (its tracker folder, --logging_dir, is added by the caller).
RUN_OUTPUTS = ("run_config.json", "metrics.jsonl", "pytorch_lora_weights.safetensors", "transformer",
               "loss_curve.png", "validation", "README.md")  # fmt: skip
_CHECKPOINT = re.compile(r"^(checkpoint-\d+|\.checkpoint-\d+\.partial)$")

_held: dict[str, int] = {}  # folder -> open file descriptor of its lock, for the life of this process


def earlier_outputs(folder: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """Names in `folder` that an earlier run wrote (checkpoints first, newest last)."""
    if not folder.is_dir():
        return []
    names = sorted(p.name for p in folder.iterdir() if _CHECKPOINT.match(p.name))
    names.sort(key=lambda n: int(re.sub(r"\D", "", n)))
    return names + [n for n in (*RUN_OUTPUTS, *extra) if (folder / n).exists()]


def _describe(names: list[str]) -> str:
    checkpoints = [n for n in names if _CHECKPOINT.match(n)]
    rest = [n for n in names if not _CHECKPOINT.match(n)]
    if len(checkpoints) > 1:
        rest.insert(0, f"{len(checkpoints)} checkpoints up to {checkpoints[-1]}")
    elif checkpoints:
        rest.insert(0, checkpoints[0])
    return ", ".join(rest)


def check_writable(folder: Path, flag: str) -> None:
    """Create `folder` if needed and write a probe file into it; a UsageError naming `flag` if that fails."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} {folder} is a file, not a folder: choose a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".flux_cp_write_test.{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise UsageError(
            f"{flag} {folder} cannot be written ({e.strerror or e}): choose a folder you can write to"
        ) from None


def _lock(folder: Path) -> None:
    import fcntl

    key = str(folder.resolve())
    if key in _held:
        return
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        who = (f" (pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')})"
               if holder else "")  # fmt: skip
        raise UsageError(
            f"--output_dir {folder} is in use by another run{who}: wait for it to end, or choose another folder"
        ) from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    _held[key] = fd


def release(folder: str | os.PathLike) -> None:
    """Drop the lock (the end of the process drops it too)."""
    fd = _held.pop(str(Path(folder).resolve()), None)
    if fd is not None:
        os.close(fd)


def claim(
    output_dir: str | os.PathLike, resume: str | None, overwrite: bool, extra_outputs: tuple[str, ...] = ()
) -> list[str]:
    """Make `output_dir` this run's (main process only). Returns the earlier outputs removed by `overwrite`."""
    folder = Path(output_dir)
    check_writable(folder, "--output_dir")
    _lock(folder)
    earlier = earlier_outputs(folder, extra_outputs)
    if not earlier:
        return []
    if resume is not None:
        if overwrite and (resume == "latest" or _inside(Path(resume), folder)):
            raise UsageError(
                f"--overwrite_output_dir would delete the checkpoint --resume_from_checkpoint {resume} resumes from: "
                "pass one of the two"
            )
        if not overwrite:
            return []
    elif not overwrite:
        raise UsageError(
            f"--output_dir {folder} holds an earlier run ({_describe(earlier)}): pass --resume_from_checkpoint "
            "latest to continue it, --overwrite_output_dir to replace it, or choose another folder"
        )
    for name in earlier:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return earlier


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def write_final(output_dir: str | os.PathLike, name: str, write: Callable[[Path], Path]) -> Path:
    """Write the final output `name` (a file or folder in `output_dir`): `write(folder)` writes it into a hidden
    temporary folder beside it and returns its path there; it is then renamed into place, so the folder holds the
    previous version or the complete new one, never a part. A failure is a UsageError naming the output."""
    root = Path(output_dir)
    final, staging = root / name, root / f".{name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        written = write(staging)
        files.apply_umask(written)
        if final.is_dir() and not final.is_symlink():
            old = root / f".{name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(written, final)
            shutil.rmtree(old)
        else:
            os.replace(written, final)
    except (OSError, SafetensorError) as e:  # safetensors' I/O failures are not OSErrors
        why = getattr(e, "strerror", None) or e
        raise UsageError(
            f"writing {final} failed ({why}); the checkpoints are intact. Free disk space or choose another "
            "--output_dir, then resume (--resume_from_checkpoint latest) to write it again"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
