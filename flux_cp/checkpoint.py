"""Training checkpoints: crash-safe, sharded, resumable on another dp x cp layout.

A checkpoint is written into `.checkpoint-N.partial/` and renamed to `checkpoint-N/` by rank 0 only after
every rank has finished writing and `meta.json` is on disk, so a folder named `checkpoint-N` is always
complete: a process killed at any moment leaves the previous checkpoints intact, and
`--resume_from_checkpoint latest` never picks a partial one. Weights and optimizer state go through
torch.distributed.checkpoint (DCP), which reshards on load, so a run written with one layout resumes
on another; the LR schedule and the data position are plain state (the data order is a function of
the seed and the global micro-step alone).

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
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import diskspace, distributed, files, manifest
from .errors import UsageError
from .terminal import printable

if TYPE_CHECKING:
    from .config import Config
    from .data import DataIdentity

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
    """A checkpoint's meta.json, every field this code reads checked (a damaged or foreign file is named)."""
    try:
        _check_inside(path / "meta.json", path)
        with open(path / "meta.json", encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8, or a path outside the checkpoint
        raise UsageError(f"--resume_from_checkpoint {path}: meta.json cannot be read ({e})") from None
    if not isinstance(meta, dict):
        raise UsageError(f"--resume_from_checkpoint {path}: meta.json is a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        raise UsageError(f"--resume_from_checkpoint {path}: format {meta.get('format')} is not {FORMAT}")
    fields = (("step", int), ("run", dict), ("layout", str), ("args", dict), ("optimizer_state", bool),
              ("checksums", dict))  # fmt: skip
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
    if "checksums" in meta and _listed(meta) is None:
        raise UsageError(
            f"--resume_from_checkpoint {path}: meta.json's 'checksums' is not a list of files with their sizes and "
            "checksums; the checkpoint is damaged or was not written by train_flux_cp.py: resume from another "
            "checkpoint-N folder"
        )
    return meta


def _listed(meta: dict) -> dict[str, dict] | None:
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


def _damaged(path: Path, name: str, why: str) -> UsageError:
    return UsageError(
        f"--resume_from_checkpoint {path}: {name} is damaged ({why}): resume from another checkpoint-N folder, or copy "
        "this one again from where it was written"
    )


def verify_quick(path: Path, meta: dict) -> None:
    """Before any model loads (one process): every file meta.json lists is there with its size, the small ones
    (DCP's .metadata, train.pt, data.json) with their checksum, and DCP's metadata reads. A UsageError names the
    damaged file. Checkpoints written before checksums get the last check only."""
    listed = _listed(meta) if "checksums" in meta else None
    for name, info in (listed or {}).items():
        file = path / name
        try:
            _check_inside(file, path)
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
    listed = _listed(meta) if "checksums" in meta else None
    large = sorted(n for n, info in (listed or {}).items() if info["bytes"] > _SMALL)
    for name in large[rank::world]:
        try:
            same = file_checksum(path / name, meta["checksums"]["algorithm"]) == listed[name]["hash"]
        except OSError as e:
            return str(_damaged(path, name, f"it cannot be read: {_cause(e)}"))
        if not same:
            return str(_damaged(path, name, "its bytes changed since it was written: the checksum differs"))
    return None


# Settings a resumed run may change: each is applied from the resumed step on (the rest are in the run identity,
# which a checkpoint must match; flux_cp.resume decides what a resume accepts).
RESUMABLE_CHANGES = (
    "learning_rate", "scale_lr", "lr_scheduler", "lr_warmup_steps", "lr_num_cycles", "lr_power", "adam_beta1",
    "adam_beta2", "adam_weight_decay", "adam_epsilon", "max_grad_norm", "max_train_steps", "num_train_epochs",
    "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "guidance_scale", "lora_dropout", "mixed_precision",
    "center_crop", "random_flip", "cp_kernels", "cp_overlap", "cp_exchange_first", "cp_ulysses_chunks",
    "gradient_checkpointing", "offload_blocks", "prodigy_beta3", "prodigy_decouple", "prodigy_use_bias_correction",
    "prodigy_safeguard_warmup", "prior_loss_weight", "base_precision",
)  # fmt: skip

# Entries of the run identity compared through "data" (the fingerprint of the data set's names, contents and
# captions): the rows behind it (kept in the checkpoint's data.json, read to say which files differ) and the
# fingerprint of versions that identified the data by its path, to compare with their checkpoints.
_DATA_DETAIL = ("data_files", "data_legacy", "prior_files")


def run_identity(
    cfg: Config,
    samples_per_step: int,
    data: DataIdentity | str,
    buckets: list[tuple[int, int]] | None,
    classes: DataIdentity | None = None,
    components: dict[str, str] | None = None,
) -> dict:
    """What a checkpoint must share with the run that resumes it: the model and trainable weights, the data and
    what it sees (global batch per optimizer step, resolutions, buckets, repeats, caption dropout, the class images
    of prior preservation, seed). The layout may differ. Keys are stored in every checkpoint's meta.json (`rank` is
    the LoRA rank), so values are JSON's types (lists). `data`, `classes`: the identity of the data set and of the
    class images (flux_cp.data.DataIdentity: relative names, contents and captions)."""
    from .optim import optimizer_name

    lora = None if cfg.lora.full_finetune else cfg.lora
    resolution = cfg.data.resolution  # one resolution: its number, as checkpoints have always recorded it
    identity = {
        "model": str(cfg.model.pretrained_model_name_or_path or "embedded-tiny"),
        "transformer_init": cfg.model.transformer_init, "full_finetune": cfg.lora.full_finetune,
        "rank": lora and lora.rank, "lora_alpha": lora and lora.lora_alpha,
        "lora_layers": lora and ",".join(lora.lora_layers),
        "global_batch": samples_per_step, "data": data if isinstance(data, str) else data.fingerprint,
        "resolution": resolution[0] if len(resolution) == 1 else list(resolution),
        "repeats": cfg.data.repeats, "caption_dropout": cfg.data.caption_dropout,
        "prior": classes.fingerprint if classes is not None else None,
        "seed": cfg.train.seed, "aspect_buckets": [list(b) for b in buckets] if buckets is not None else False,
        "max_sequence_length": cfg.data.max_sequence_length, "vae_encode_mode": cfg.data.vae_encode_mode,
        "optimizer": optimizer_name(cfg.train),
        "revision": cfg.model.revision, "variant": cfg.model.variant,
        "components": dict(sorted((components or {}).items())),
    }  # fmt: skip
    if not isinstance(data, str):
        identity.update(data_files=data.files, data_legacy=data.legacy)
    if classes is not None:  # kept in meta.json (a few rows): a resume with other class images names them
        identity["prior_files"] = classes.files
    return identity


def _data_differences(saved: list, now: list) -> str:
    """Which files differ between a checkpoint's data set and this run's (rows: name, content, caption, then each
    reference's name and content)."""
    old, new = {r[0]: r for r in saved}, {r[0]: r for r in now}
    kinds = (
        ("added", [n for n in new if n not in old]),
        ("removed", [n for n in old if n not in new]),
        ("changed content", [n for n in new if n in old and new[n][1] != old[n][1]]),
        ("changed caption", [n for n in new if n in old and new[n][2] != old[n][2]]),
        ("changed reference image", [r for n in new if n in old for r in _changed_references(n, old[n], new[n])]),
    )
    parts = [
        f"{kind}: {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        for kind, names in kinds
        if names
    ]
    return "; ".join(parts) or "the same files and captions in another order"


def _changed_references(name: str, old: list, new: list) -> list[str]:
    """The references of sample `name` that differ (by name or content), each named by its file, and with its
    place among several: `b.png (reference 2 of t.png)`."""
    pairs = [list(old[k : k + 2]) for k in range(3, len(old), 2)], [list(new[k : k + 2]) for k in range(3, len(new), 2)]
    count = max(len(pairs[0]), len(pairs[1]))
    out = []
    for j in range(count):
        was, now = (p[j] if j < len(p) else None for p in pairs)
        if was != now:
            ref = (now or was)[0]
            out.append(ref if count == 1 else f"{ref} (reference {j + 1} of {name})")
    return out


def _saved_data_files(path: Path) -> list | None:
    """The data set's rows of a checkpoint (data.json), None when absent or unreadable."""
    try:
        _check_inside(path / "data.json", path)
        rows = json.loads((path / "data.json").read_bytes()).get("data_files")
    except (OSError, ValueError, AttributeError):
        return None
    return rows if isinstance(rows, list) and all(isinstance(r, list) and r for r in rows) else None


# Keys added to the run identity later, with the value every checkpoint written before them had.
_IDENTITY_BEFORE = {"optimizer": "adamw", "repeats": 1, "caption_dropout": 0.0, "prior": None}
# Keys added later whose value earlier checkpoints did not know: compared only when the checkpoint has them.
_IDENTITY_UNKNOWN_BEFORE = ("revision", "variant", "components")


def check_compatible(meta: dict, run: dict, path: Path) -> None:
    """Refuse a checkpoint from an incompatible run, naming what differs and what to change."""
    saved = {**_IDENTITY_BEFORE, **meta["run"]}
    diffs = []
    for k, v in run.items():
        if k in _DATA_DETAIL or (k in _IDENTITY_UNKNOWN_BEFORE and k not in saved):
            continue
        if k == "components":  # by name: the components whose config or weights changed (or that came or went)
            was = saved.get(k) if isinstance(saved.get(k), dict) else {}
            changed = sorted(n for n in {*was, *v} if was.get(n) != v.get(n))
            if changed:
                diffs.append(f"the config or weights of {', '.join(printable(n) for n in changed)} differ from the "
                             "checkpoint's model")  # fmt: skip
            continue
        if k == "data" and "data_legacy" not in saved and "data_legacy" in run:
            # Written before the data were identified by content: compare the fingerprint of that time.
            if saved.get("data") != run["data_legacy"]:
                diffs.append(f"data: checkpoint {saved.get('data')!r}, now {run['data_legacy']!r}")
        elif k == "data" and saved.get("data") != v and (rows := _saved_data_files(path)) is not None:
            diffs.append(f"data set differs ({_data_differences(rows, run.get('data_files', []))})")
        elif k == "prior" and saved.get(k) and v and saved[k] != v and isinstance(saved.get("prior_files"), list):
            diffs.append(f"class images differ ({_data_differences(saved['prior_files'], run.get('prior_files', []))})")
        elif saved.get(k) != v:
            diffs.append(f"{k}: checkpoint {saved.get(k)!r}, now {v!r}")
    if diffs:
        raise UsageError(
            f"--resume_from_checkpoint {path} comes from an incompatible run ({'; '.join(diffs)}). Resume with the "
            "same settings (a different dp x cp layout is fine if --train_batch_size x dp x "
            "--gradient_accumulation_steps stays the same), or start a new --output_dir."
        )


def _state(model, optimizer, with_optimizer: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    opts = StateDictOptions(ignore_frozen_params=True)
    if not with_optimizer:  # (get_state_dict would also create AdamW's state, with a first step taken)
        return {"model": _tensors_of(model, get_model_state_dict(model, options=opts))}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    return {"model": _tensors_of(model, model_sd), "optim": optim_sd}


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
    need_bytes: int | None = None,
) -> Path:
    """Write checkpoint-`step` atomically; every rank calls it. Returns the final folder. `optimizer_state`: keep
    AdamW's moments (exact resume) or only the trainable weights. `need_bytes`: the checkpoint's size
    (diskspace.sizes); when given, a disk that cannot hold it stops the run before anything is written."""
    import torch.distributed.checkpoint as dcp

    root = Path(output_dir)
    final = root / f"checkpoint-{step}"
    partial = root / f".checkpoint-{step}.partial"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        manifest.record(root, partial.name)
        _remove(partial)  # left by a crash during an earlier save
    prev = list_checkpoints(output_dir)
    kept = f"{prev[-1][1]} is the last good checkpoint" if prev else "no checkpoint was written before"
    if need_bytes is not None:
        short = None
        if is_main:
            try:
                diskspace.check_write(root, need_bytes, f"checkpoint-{step}", kept, resumable=bool(prev))
            except UsageError as e:
                short = str(e)
        if distributed.any_rank(short is not None):
            raise UsageError(short or f"not enough disk space for checkpoint-{step}; {kept}", agreed=True)
    distributed.barrier()
    error, sums = None, {}
    rank, world = distributed.rank(), distributed.world_size()
    try:
        dcp.save(_state(model, optimizer, optimizer_state), checkpoint_id=str(partial / "state"))
        if fault is not None:
            fault.during_save(step)
        if is_main:
            # Only what `load` restores: every random draw is keyed by seed and step (flux_cp.rng), so no RNG
            # state is needed to resume exactly.
            torch.save({"lr_scheduler": lr_scheduler.state_dict()}, partial / "train.pt")
            run = dict(meta.get("run", {}))
            if "data_files" in run:  # one row per sample: its own file, so that meta.json stays small
                files.write_json(partial / "data.json", {"data_files": run.pop("data_files")})
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
            files.write_json(partial / "meta.json", {**meta, "run": run, "format": FORMAT, "step": step,
                                                     "optimizer_state": optimizer_state,
                                                     "checksums": checksums})  # fmt: skip
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
        _remove(final)  # same step written again after a resume: replace it atomically enough
        os.rename(partial, final)
        manifest.forget(root, partial.name)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        if total_limit is not None:
            # Only checkpoints older than this one: the newest of the run that writes is never pruned.
            older = [p for s, p in list_checkpoints(output_dir) if s < step]
            for old in older[: max(0, len(older) - (total_limit - 1))]:
                _remove(old)
                manifest.forget(root, old.name)
    distributed.barrier()
    return final


def _remove(path: Path) -> None:
    """Remove a checkpoint folder; a link in its place is unlinked, never followed."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


# The classes a DCP `.metadata` pickle refers to (torch 2.x): its own records, torch.Size, dtypes and layouts,
# and the checkpoint's path. Anything else in a checkpoint is refused unread.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}  # fmt: skip


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
            _check_inside(state / ".metadata", state)
            with open(state / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            # Every file DCP will open is named here: each must lie inside the state folder, checked before any
            # is opened (`../../` would read another run's shards, an absolute path any file).
            for info in (getattr(metadata, "storage_data", None) or {}).values():
                relative = getattr(info, "relative_path", None)
                if not isinstance(relative, str) or not relative or "\0" in relative or os.path.isabs(relative):
                    raise ValueError(f"{state / '.metadata'} names the file {relative!r}, not a path inside {state}")
                _check_inside(state / relative, state)
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


def _check_inside(path: Path, root: Path) -> None:
    """A ValueError unless `path` (links followed) lies inside `root`: a checkpoint is read from its own folder."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, base]) != base:
        raise ValueError(f"{path} leads outside {root} (to {real}): the checkpoint is damaged or was tampered with")


# Optimizer hyperparameters a resumed run takes from its flags rather than from the checkpoint (those its optimizer
# has: AdamW's, Prodigy's). Prodigy's step-size estimate (d, d_max, k, ...) lives beside them and is restored.
_GROUP_KEYS = ("betas", "eps", "weight_decay", "beta3", "decouple", "use_bias_correction", "safeguard_warmup")


def load(path: Path, model, optimizer, lr_scheduler, optimizer_state: bool = True) -> list[str]:
    """Restore weights, optimizer and LR schedule from `path` into the (wrapped) model, on any layout. The current
    learning rate and optimizer settings win over the checkpoint's; returns what they changed, one line each.
    `optimizer_state`: whether the checkpoint holds AdamW's moments (False: they start from zero)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    current = [{k: g[k] for k in _GROUP_KEYS if k in g} for g in optimizer.param_groups]
    base_lrs = list(getattr(lr_scheduler, "base_lrs", []))
    state = _state(model, optimizer, optimizer_state)
    try:
        _check_inside(path / "state", path)
        _check_inside(path / "train.pt", path)
        dcp.load(state, checkpoint_id=str(path / "state"), storage_reader=_safe_reader(path / "state"),
                 planner=_safe_planner())  # fmt: skip
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
    distributed.check_all_ranks(not bad, (
        f"--resume_from_checkpoint {path} holds values that are not finite (NaN or inf) in {', '.join(bad[:3])}{more}: "
        "the run that wrote it had diverged, or the checkpoint was damaged after its checksums were written. Resume "
        "from an earlier checkpoint-N folder"
    ))  # fmt: skip
    return _apply_current(optimizer, lr_scheduler, current, base_lrs)


def nonfinite_state(model, optimizer) -> list[str]:
    """The trainable weights and optimizer moments (of this rank's shards) that hold a NaN or an inf, by name."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = {id(p): n for n, p in named}
    tensors = [(n, p) for n, p in named]
    for p, st in getattr(optimizer, "state", {}).items():
        tensors += [(f"{names.get(id(p), '?')} ({k})", v) for k, v in st.items()
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1]  # fmt: skip
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


def changed_settings(saved: dict, now: dict, names: tuple[str, ...]) -> list[str]:
    """`--flag old -> new` for each of `names` whose value differs between a checkpoint's args and this run's."""
    return [f"--{n} {printable(saved[n])} -> {now.get(n)}" for n in names if n in saved and saved[n] != now.get(n)]
