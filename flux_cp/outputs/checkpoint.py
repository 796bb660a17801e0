"""Training checkpoints: crash-safe, sharded, resumable on another dp x cp layout.

A checkpoint is written into `.checkpoint-N.partial/` and renamed to `checkpoint-N/` by rank 0 only after
every rank has finished writing and `meta.json` is on disk, so a folder named `checkpoint-N` is always
complete: a process killed at any moment leaves the previous checkpoints intact, and
`--resume_from_checkpoint latest` never picks a partial one. Weights and optimizer state go through
torch.distributed.checkpoint (DCP), which reshards on load, so a run written with one layout resumes
on another; the LR schedule and the data position are plain state (the data order is a function of
the seed and the global micro-step alone). A LoRA run's checkpoint also holds the LoRA file of its step
(`pytorch_lora_weights.safetensors`, in the run's --lora_format, the EMA's with --use_ema: the final file's
contents at that step), written inside it before it is complete (`write_files`), for the pipelines to load; a
resume does not read it.

Reading a checkpoint runs no code from it: torch.distributed.checkpoint unpickles its `.metadata` file and its
non-tensor entries with plain pickle, so here the metadata goes through an unpickler that knows only DCP's own
record classes, every non-tensor entry must load with `torch.load(weights_only=True)`, and `train.pt` is read with
`weights_only=True`. On resume the current flags' optimizer hyperparameters win over the checkpoint's (the caller
logs what changed). Every failure of checkpoint I/O ends as one UsageError naming the folder.

Every file of a checkpoint (but meta.json, which lists them) has its size and a checksum in meta.json's
`checksums`, computed when it is written: each rank hashes the shard files it wrote (xxHash's XXH3-128, several GB/s
per core, read back from the page cache). A resume checks sizes and the small files before any model loads
(`verify_quick`) and every shard's checksum spread over the ranks (`verify_shared`), so a damaged checkpoint is
refused naming the file. Checkpoints written before this have no checksums: their DCP metadata is still read at
start. Loaded weights and optimizer moments that are not finite are refused by name (`check_finite_state`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import torch

from flux_cp import distributed, files, manifest
from flux_cp.checkpoint_folders import FORMAT, check_inside, list_checkpoints, listed_files
from flux_cp.errors import UsageError

logger = logging.getLogger("flux_cp")


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


def _damaged(path: Path, name: str, why: str) -> UsageError:
    return UsageError(
        f"--resume_from_checkpoint {path}: {name} is damaged ({why}): resume from another checkpoint-N folder, or copy "
        "this one again from where it was written"
    )


def verify_quick(path: Path, meta: dict) -> None:
    """Before any model loads (one process): every file meta.json lists is there with its size, the small ones
    (DCP's .metadata, train.pt, data.json) with their checksum, and DCP's metadata reads. A UsageError names the
    damaged file. Checkpoints written before checksums get the last check only."""
    listed = listed_files(meta) if "checksums" in meta else None
    for name, info in (listed or {}).items():
        file = path / name
        try:
            check_inside(file, path)
        except ValueError as e:
            raise _damaged(path, name, str(e)) from None
        if not file.is_file():
            raise _damaged(path, name, "missing")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise _damaged(path, name, f"{size} bytes, {info['bytes']} when written")
        if size <= _SMALL and file_checksum(file, meta["checksums"]["algorithm"]) != info["hash"]:
            raise _damaged(path, name, "its bytes changed since it was written: the checksum differs")
    if not (path / "state" / ".metadata").is_file():
        raise _damaged(path, "state/.metadata", "missing")
    try:
        _safe_reader(path / "state").read_metadata()
    except Exception as e:  # noqa: BLE001 - a truncated or foreign pickle raises any of several errors
        raise _damaged(path, "state/.metadata", f"it cannot be read: {_cause(e)}") from None


def verify_shared(path: Path, meta: dict, rank: int, world: int) -> str | None:
    """The checksums of the large files (the shards), each rank a share of them (every rank calls it): the problem
    this rank found, or None. Checkpoints without checksums: None."""
    listed = listed_files(meta) if "checksums" in meta else None
    large = sorted(n for n, info in (listed or {}).items() if info["bytes"] > _SMALL)
    for name in large[rank::world]:
        try:
            same = file_checksum(path / name, meta["checksums"]["algorithm"]) == listed[name]["hash"]
        except OSError as e:
            return str(_damaged(path, name, f"it cannot be read: {_cause(e)}"))
        if not same:
            return str(_damaged(path, name, "its bytes changed since it was written: the checksum differs"))
    return None


def saved_data_files(path: Path) -> list | None:
    """The data set's rows of a checkpoint (data.json, flux_cp.outputs.resume.run_identity), None when absent or
    unreadable."""
    try:
        check_inside(path / "data.json", path)
        rows = json.loads((path / "data.json").read_bytes()).get("data_files")
    except (OSError, ValueError, AttributeError):
        return None
    return rows if isinstance(rows, list) and all(isinstance(r, list) and r for r in rows) else None


def _state(model, optimizer, with_optimizer: bool = True, extra: dict | None = None):
    """What a checkpoint holds of the training state: the trainable weights, the optimizer's state and `extra`
    ({name: {key: tensor}}, e.g. the EMA's shadow): tensors DCP reshards by name, loaded into in place."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    opts = StateDictOptions(ignore_frozen_params=True)
    if not with_optimizer:  # (get_state_dict would also create AdamW's state, with a first step taken)
        return {"model": _tensors_of(model, get_model_state_dict(model, options=opts)), **(extra or {})}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    return {"model": _tensors_of(model, model_sd), "optim": optim_sd, **(extra or {})}


def _tensors_of(model, state: dict) -> dict:
    """The entries of `state` that are parameters or buffers of the model. A layer may add more to its state dict:
    bitsandbytes' 4-bit layer (--base_precision nf4) adds its frozen weight's statistics, which are not trained and
    which `ignore_frozen_params` does not recognise as frozen."""
    inner = getattr(model, "module", model)  # DDP's wrapper
    names = {n for n, _ in inner.named_parameters()} | {n for n, _ in inner.named_buffers()}
    return {k: v for k, v in state.items() if k in names}


def _cause(e: BaseException) -> str:
    """One line for an I/O failure. DCP's CheckpointException (a BaseException) carries every rank's traceback in
    its text; only the first rank's exception is kept."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items())[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {_cause(inner)}"
    text = str(e).strip()
    if isinstance(e, OSError) and text:  # "[Errno 28] No space left on device: ..." says it all
        return text.splitlines()[0]
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


# Files up to this size are checksummed at start by the main process alone (DCP's .metadata, train.pt, data.json);
# the shards, by every rank's share (`verify_shared`).
_SMALL = 64 * 2**20
_SHARD = re.compile(r"^__(\d+)_\d+")  # DCP's shard files: __<rank>_<n>.distcp, written by that rank


def _algorithm() -> str:
    """The checksum new checkpoints get: XXH3-128 (xxhash comes with `datasets`), else SHA-256."""
    try:
        import xxhash  # noqa: F401

        return "xxh3_128"
    except ImportError:  # pragma: no cover - datasets requires xxhash
        return "sha256"


def file_checksum(path: Path, algorithm: str) -> str:
    """`algorithm`'s checksum (xxh3_128 or sha256) of a file's bytes, read in 16 MiB blocks."""
    if algorithm == "xxh3_128":
        import xxhash

        h = xxhash.xxh3_128()
    elif algorithm == "sha256":
        h = hashlib.sha256()
    else:
        raise ValueError(f"unknown checksum {algorithm!r}")
    buf = bytearray(16 * 2**20)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _owner(relative: str, world: int) -> int:
    """The rank that checksums a file when it is written: a shard's writer, the main process for the rest."""
    m = _SHARD.match(Path(relative).name)
    return int(m.group(1)) if m and int(m.group(1)) < world else 0


def _checksums(folder: Path, names: list[str]) -> dict[str, dict]:
    algorithm = _algorithm()
    return {n: {"bytes": (folder / n).stat().st_size, "hash": file_checksum(folder / n, algorithm)} for n in names}


def _files_of(folder: Path) -> list[str]:
    """Every file of a checkpoint folder but meta.json, relative, sorted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != "meta.json")


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
    optimizer_state: bool = True,
    extra: dict | None = None,
    write_files: Callable[[Path], object] | None = None,
) -> Path:
    """Write checkpoint-`step` atomically; every rank calls it. Returns the final folder. `optimizer_state`: keep
    AdamW's moments (exact resume) or only the trainable weights. `extra`: more state, as `_state` takes it.
    `write_files(folder)`: writes files of the main rank's into the checkpoint before it is complete (the LoRA file
    of the step: flux_cp.run.output_phase), checksummed with the rest and renamed into place with it. Whether the disk
    holds it is the caller's check (`flux_cp.plan.diskspace.check_checkpoint`), before it calls this."""
    import torch.distributed.checkpoint as dcp

    root = Path(output_dir)
    final = root / f"checkpoint-{step}"
    partial = root / f".checkpoint-{step}.partial"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        manifest.record(root, partial.name)
        _remove(partial)  # left by a crash during an earlier save
    prev = list_checkpoints(output_dir)
    distributed.barrier()
    error, sums = None, {}
    rank, world = distributed.rank(), distributed.world_size()
    try:
        dcp.save(_state(model, optimizer, optimizer_state, extra), checkpoint_id=str(partial / "state"))
        if fault is not None:
            fault.during_save(step)
        if is_main:
            # Only what `load` restores: every random draw is keyed by seed and step (flux_cp.rng), so no RNG
            # state is needed to resume exactly.
            torch.save({"lr_scheduler": lr_scheduler.state_dict()}, partial / "train.pt")
            run = dict(meta.get("run", {}))
            if "data_files" in run:  # one row per sample: its own file, so that meta.json stays small
                files.write_json(partial / "data.json", {"data_files": run.pop("data_files")})
            if write_files is not None:
                write_files(partial)
        # Each rank its own shards (read back from the page cache), the main process the rest, all at once. No
        # collective before the one below: a rank that failed above goes straight to it.
        sums = _checksums(partial, [n for n in _files_of(partial) if _owner(n, world) == rank])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; reported below
        error = _cause(e)
    shares = distributed.all_gather((error, sums))  # every rank reaches it, failed or not
    error = error or next((f"rank {r}: {e}" for r, (e, _) in enumerate(shares) if e), None)
    if error is None and is_main:
        try:
            listed = {k: v for _, share in shares for k, v in share.items()}
            checksums = {"algorithm": _algorithm(), "files": dict(sorted(listed.items()))}
            record = {"run": run, "format": FORMAT, "step": step, "optimizer_state": optimizer_state}
            files.write_json(partial / "meta.json", {**meta, **record, "checksums": checksums})
            _fsync_tree(partial)
        except OSError as e:
            error = _cause(e)
    failed = distributed.any_rank(error is not None)
    if failed:
        if is_main:
            _remove(partial)
        then = (
            f"{prev[-1][1]} is intact. Free disk space or choose another --output_dir, then resume."
            if prev
            else "no earlier checkpoint exists, so there is nothing to resume: free disk space, then run again with "
            "--overwrite_output_dir (from step 0)."
        )
        raise UsageError(
            f"writing checkpoint-{step} failed ({error or 'on another rank'}); nothing was renamed, {then}",
            agreed=True,
        )
    if is_main:
        manifest.record(root, final.name)
        if final.is_symlink():
            final.unlink()
        # The same step written again after a resume: a user's files in the old folder move into the new one
        kept = manifest.carry_over(final, partial, manifest.owned(final.name))
        if kept:
            logger.warning(f"{final}: kept {_shown(kept)}, which flux-cp did not write, in the new {final.name}")
        os.rename(partial, final)
        manifest.forget(root, partial.name)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        if total_limit is not None:
            # Only checkpoints older than this one: the newest of the run that writes is never pruned.
            older = [p for s, p in list_checkpoints(output_dir) if s < step]
            for old in older[: max(0, len(older) - (total_limit - 1))]:
                if kept := _remove(old):  # a user's files are kept, and the folder stays listed (with them)
                    logger.warning(
                        f"--checkpoints_total_limit: removed {old.name} but kept {_shown(kept)}, which "
                        "flux-cp did not write"
                    )
                else:
                    manifest.forget(root, old.name)
    distributed.barrier()
    return final


def _shown(paths: list) -> str:
    names = [str(p) for p in paths]
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _remove(path: Path) -> list[Path]:
    """Remove what flux-cp wrote in a checkpoint folder (a link in its place is unlinked, never followed); returns
    the files kept, a user's."""
    if path.is_symlink():
        path.unlink()
    elif path.is_dir():
        return manifest.remove_owned(path, manifest.owned(path.name))
    return []


# The classes a DCP `.metadata` pickle refers to (torch 2.x): its own records, torch.Size, dtypes and layouts,
# and the checkpoint's path. Anything else in a checkpoint is refused unread.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = _METADATA_GLOBALS.get(module, ())
        if name in allowed or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _safe_reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            state = Path(self.path)
            check_inside(state / ".metadata", state)
            with open(state / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            # Every file DCP will open is named here: each must lie inside the state folder, checked before any
            # is opened (`../../` would read another run's shards, an absolute path any file).
            for info in (getattr(metadata, "storage_data", None) or {}).values():
                relative = getattr(info, "relative_path", None)
                if not isinstance(relative, str) or not relative or "\0" in relative or os.path.isabs(relative):
                    raise ValueError(f"{state / '.metadata'} names the file {relative!r}, not a path inside {state}")
                check_inside(state / relative, state)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _safe_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            # DCP reads non-tensor entries (the optimizer's lr, betas, ...) with weights_only=False: check them with
            # the weights-only unpickler first (plain data passes; anything that would run code is refused).
            data = value.read()
            torch.load(io.BytesIO(data), weights_only=True)
            super().load_bytes(read_item, io.BytesIO(data))

    return SafePlanner()


# Optimizer hyperparameters a resumed run takes from its flags rather than from the checkpoint (those its optimizer
# has: AdamW's, Prodigy's). Prodigy's step-size estimate (d, d_max, k, ...) lives beside them and is restored.
_GROUP_KEYS = ("betas", "eps", "weight_decay", "beta3", "decouple", "use_bias_correction", "safeguard_warmup")


def load(
    path: Path, model, optimizer, lr_scheduler, optimizer_state: bool = True, extra: dict | None = None
) -> list[str]:
    """Restore weights, optimizer and LR schedule from `path` into the (wrapped) model, on any layout. The current
    learning rate and optimizer settings win over the checkpoint's; returns what they changed, one line each.
    `optimizer_state`: whether the checkpoint holds AdamW's moments (False: they start from zero). `extra`: more state
    as `save` was given it, loaded into its tensors in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    current = [{k: g[k] for k in _GROUP_KEYS if k in g} for g in optimizer.param_groups]
    base_lrs = list(getattr(lr_scheduler, "base_lrs", []))
    state = _state(model, optimizer, optimizer_state, extra)
    try:
        check_inside(path / "state", path)
        check_inside(path / "train.pt", path)
        dcp.load(
            state,
            checkpoint_id=str(path / "state"),
            storage_reader=_safe_reader(path / "state"),
            planner=_safe_planner(),
        )
        train = torch.load(path / "train.pt", weights_only=True)
        lr_scheduler.load_state_dict(train["lr_scheduler"])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a damaged or foreign checkpoint is a usage problem
        raise UsageError(
            f"--resume_from_checkpoint {path}: cannot load it ({_cause(e)}). Resume from an earlier checkpoint-N "
            "folder, or start a new --output_dir"
        ) from None
    opts = StateDictOptions(ignore_frozen_params=True, strict=False)
    if optimizer_state:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts)
    else:
        set_model_state_dict(model, state["model"], options=opts)
    bad = nonfinite_state(model, optimizer)
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    problem = (
        f"--resume_from_checkpoint {path} holds values that are not finite (NaN or inf) in {', '.join(bad[:3])}"
        f"{more}: the run that wrote it had diverged, or the checkpoint was damaged after its checksums were written. "
        "Resume from an earlier checkpoint-N folder"
    )
    distributed.check_all_ranks(not bad, problem)
    return _apply_current(optimizer, lr_scheduler, current, base_lrs)


def nonfinite_state(model, optimizer) -> list[str]:
    """The trainable weights and optimizer moments (of this rank's shards) that hold a NaN or an inf, by name."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = {id(p): n for n, p in named}
    tensors = [(n, p) for n, p in named]
    for p, st in getattr(optimizer, "state", {}).items():
        kept = [(k, v) for k, v in st.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        tensors += [(f"{names.get(id(p), '?')} ({k})", v) for k, v in kept if v.numel() > 1]
    local = [(n, t.to_local() if hasattr(t, "to_local") else t) for n, t in tensors]
    local = [(n, t) for n, t in local if t.numel()]
    if not local:
        return []
    finite = torch.stack([torch.isfinite(t.detach()).all() for _, t in local]).tolist()  # one read for all
    return [n for (n, _), ok in zip(local, finite) if not ok]


def _apply_current(optimizer, lr_scheduler, current: list[dict], base_lrs: list[float]) -> list[str]:
    changes = []
    name = type(getattr(optimizer, "optimizer", optimizer)).__name__  # under accelerate's wrapper: AdamW, Prodigy, ...
    for g, now in zip(optimizer.param_groups, current):
        for k, v in now.items():
            if g[k] != v:
                changes.append(f"{name} {k} {g[k]} -> {v}")
                g[k] = v
    old = list(getattr(lr_scheduler, "base_lrs", []))
    if base_lrs and old != base_lrs:
        changes.append(f"learning rate {', '.join(f'{x:g}' for x in old)} -> {', '.join(f'{x:g}' for x in base_lrs)}")
    if base_lrs and hasattr(lr_scheduler, "lr_lambdas"):
        # The schedule's shape (scheduler, warmup, length) comes from the current flags already; its scale, the
        # base LR, was restored from the checkpoint: put the current one back and recompute this step's LR.
        lr_scheduler.base_lrs = base_lrs
        step = lr_scheduler.last_epoch
        lrs = [base * f(step) for base, f in zip(base_lrs, lr_scheduler.lr_lambdas)]
        for g, base, lr in zip(optimizer.param_groups, base_lrs, lrs):
            g["initial_lr"], g["lr"] = base, lr
        lr_scheduler._last_lr = lrs
    return changes
