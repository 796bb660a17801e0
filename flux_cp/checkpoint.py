"""Training checkpoints: crash-safe, sharded, resumable on another dp x cp layout.

A checkpoint is written into `.checkpoint-N.partial/` and renamed to `checkpoint-N/` by rank 0 only after
every rank has finished writing and `meta.json` is on disk, so a folder named `checkpoint-N` is always
complete: a process killed at any moment leaves the previous checkpoints intact, and
`--resume_from_checkpoint latest` never picks a partial one. Weights and optimizer state go through
torch.distributed.checkpoint (DCP), which reshards on load, so a run written with one layout resumes
on another; the LR schedule and the data position are plain state (the data order is a function of
the seed and the global micro-step alone).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import distributed, files
from .errors import UsageError

if TYPE_CHECKING:
    from .config import Config

FORMAT = 1
_NAME = re.compile(r"^checkpoint-(\d+)$")


def _fsync_tree(path: Path) -> None:
    for root, _, names in os.walk(path):
        for f in names:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def read_meta(path: Path) -> dict:
    try:
        with open(path / "meta.json") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"--resume_from_checkpoint {path}: meta.json cannot be read ({e})") from None
    if meta.get("format") != FORMAT:
        raise UsageError(f"--resume_from_checkpoint {path}: format {meta.get('format')} is not {FORMAT}")
    return meta


def run_identity(
    cfg: Config, samples_per_step: int, data_fingerprint: str, buckets: list[tuple[int, int]] | None
) -> dict:
    """What a checkpoint must share with the run that resumes it: the model and trainable weights, the data and
    what it sees (global batch per optimizer step, resolution, buckets, seed). The layout may differ. Keys
    are stored in every checkpoint's meta.json (`rank` is the LoRA rank), so values are JSON's types (lists)."""
    lora = None if cfg.lora.full_finetune else cfg.lora
    return {
        "model": str(cfg.model.pretrained_model_name_or_path or "embedded-tiny"),
        "transformer_init": cfg.model.transformer_init, "full_finetune": cfg.lora.full_finetune,
        "rank": lora and lora.rank, "lora_alpha": lora and lora.lora_alpha,
        "lora_layers": lora and ",".join(lora.lora_layers),
        "global_batch": samples_per_step, "data": data_fingerprint, "resolution": cfg.data.resolution,
        "seed": cfg.train.seed, "aspect_buckets": [list(b) for b in buckets] if buckets is not None else False,
        "max_sequence_length": cfg.data.max_sequence_length,
    }  # fmt: skip


def check_compatible(meta: dict, run: dict, path: Path) -> None:
    """Refuse a checkpoint from an incompatible run, naming what differs and what to change."""
    diffs = [f"{k}: checkpoint {meta['run'].get(k)!r}, now {v!r}" for k, v in run.items() if meta["run"].get(k) != v]
    if diffs:
        raise UsageError(
            f"--resume_from_checkpoint {path} comes from an incompatible run ({'; '.join(diffs)}). Resume with the "
            "same settings (a different dp x cp layout is fine if --train_batch_size x dp x "
            "--gradient_accumulation_steps stays the same), or start a new --output_dir."
        )


def _state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(ignore_frozen_params=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    return {"model": model_sd, "optim": optim_sd}


def save(
    output_dir: str,
    step: int,
    model,
    optimizer,
    lr_scheduler,
    meta: dict,
    is_main: bool,
    total_limit: int | None,
    fault=None,
) -> Path:
    """Write checkpoint-`step` atomically; every rank calls it. Returns the final folder."""
    import torch.distributed.checkpoint as dcp

    root = Path(output_dir)
    final = root / f"checkpoint-{step}"
    partial = root / f".checkpoint-{step}.partial"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
    distributed.barrier()
    error = None
    try:
        dcp.save(_state(model, optimizer), checkpoint_id=str(partial / "state"))
        if fault is not None:
            fault.during_save(step)
        if is_main:
            # Only what `load` restores: every random draw is keyed by seed and step (flux_cp.rng), so no RNG
            # state is needed to resume exactly.
            torch.save({"lr_scheduler": lr_scheduler.state_dict()}, partial / "train.pt")
            files.write_json(partial / "meta.json", {**meta, "format": FORMAT, "step": step})
            _fsync_tree(partial)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    failed = distributed.any_rank(error is not None)
    if failed:
        if is_main:
            shutil.rmtree(partial, ignore_errors=True)
        prev = list_checkpoints(output_dir)
        raise UsageError(
            f"writing checkpoint-{step} failed ({error or 'on another rank'}); nothing was renamed, "
            + (f"{prev[-1][1]} is intact" if prev else "no earlier checkpoint exists")
            + ". Free disk space or choose another --output_dir, then resume.",
            agreed=True,
        )
    if is_main:
        if final.exists():  # same step written again after a resume: replace it atomically enough
            shutil.rmtree(final)
        os.rename(partial, final)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        if total_limit is not None:
            for _, old in list_checkpoints(output_dir)[:-total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return final


def load(path: Path, model, optimizer, lr_scheduler) -> None:
    """Restore weights, optimizer and LR schedule from `path` into the (wrapped) model, on any layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path / "state"))
    except Exception as e:  # noqa: BLE001 - a damaged or foreign checkpoint is a usage problem
        raise UsageError(f"--resume_from_checkpoint {path}: cannot load its weights/optimizer state ({e})") from None
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )  # fmt: skip
    train = torch.load(path / "train.pt", weights_only=False)
    lr_scheduler.load_state_dict(train["lr_scheduler"])
