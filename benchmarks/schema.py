"""The one result format of the benchmark suite: every script writes one JSON file of this shape, and
`python -m benchmarks.render` turns any set of them into markdown tables (docs/benchmarks.md, "Result files").

    {
      "schema": "flux-cp-benchmark/1",
      "benchmark": "trainer",               # the script that wrote it: trainer, attention, diffusers_cp, check_gpu
      "command": "python -m benchmarks.bench_trainer --out ...",   # the command line that wrote the file
      "git_commit": "ff7068d...",           # HEAD of the checkout that ran; "git_dirty": true if it had changes
      "git_dirty": false,
      "date": "2026-12-01T10:02:11+00:00",  # when the file was written (UTC)
      "hardware": {"gpu": "NVIDIA H200", "gpus": 2, "gpu_memory_gib": 139.8, "driver": "580.159.04", ...},
      "software": {"python": "3.12.3", "torch": "2.11.0+cu130", "cuda": "13.0", "diffusers": "0.42.1", ...},
      "settings": {...},                    # what holds for every row (shapes, dtype, timed steps, environment)
      "columns": {"s_per_step": "s/step", ...},   # optional: the row keys a table shows, in order, and their headers
      "rows": [{"name": "cp2_2048", "command": "accelerate launch ...", "s_per_step": 1.288, ...}, ...]
    }

A row is one measurement: scalar values (numbers, strings, booleans, null) become table cells; lists and objects
(per-step losses, profiles) are kept in the file but not tabled. A row's `command`, where given, is the exact
command that measured it (temporary paths as placeholders named in `settings`). A row with `error` failed; its
other values may be missing. Readers ignore keys they do not know, so a script may add keys; a change of meaning
takes a new schema version.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA = "flux-cp-benchmark/1"
ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _nvidia_smi(query: str) -> list[str]:
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def hardware() -> dict[str, Any]:
    """The GPUs this process sees (or the CPU), and the host's CPU count."""
    import torch

    info: dict[str, Any] = {"cpus": os.cpu_count(), "machine": platform.machine()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpus=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sms=props.multi_processor_count,
        )
        drivers = _nvidia_smi("driver_version")
        info["driver"] = drivers[0] if drivers else None
    else:
        info.update(gpu=None, gpus=0, cpu=platform.processor() or platform.machine())
    return info


def software() -> dict[str, Any]:
    import torch

    versions: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
    }
    for name in ("diffusers", "accelerate", "peft", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return versions


def command_line(argv: list[str] | None = None, module: str | None = None) -> str:
    """The command that ran this process, as a user would type it: `python -m MODULE ARGS` for a suite module."""
    argv = sys.argv[1:] if argv is None else argv
    head = ["python", "-m", module] if module else ["python", *sys.argv[:1]]
    world = os.environ.get("WORLD_SIZE")
    if module and world and world != "1":  # launched by torchrun
        head = ["torchrun", "--nproc_per_node", world, "-m", module]
    return shlex.join([*head, *argv])


def result(
    benchmark: str,
    rows: list[dict[str, Any]],
    *,
    command: str,
    settings: dict[str, Any] | None = None,
    columns: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A result in the schema above, with this checkout's commit, this machine and these versions."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "command": command,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware(),
        "software": software(),
        "settings": settings or {},
        "rows": rows,
    }
    if columns:
        out["columns"] = columns
    return out


def write(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file


def load(path: str | Path) -> dict[str, Any]:
    """A result file, checked to be of this schema (ValueError naming the file otherwise)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: not a {SCHEMA} result file (schema: {found!r})")
    if not isinstance(data.get("rows"), list) or not all(isinstance(r, dict) for r in data["rows"]):
        raise ValueError(f"{path}: `rows` must be a list of objects")
    return data
