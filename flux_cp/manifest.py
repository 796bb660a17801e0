"""Which entries of an output folder a flux-cp run wrote: the manifest `.flux_cp_manifest.json`.

`--overwrite_output_dir` deletes the entries listed here and nothing else, so a folder (or file) flux-cp did not
create is never deleted, whatever its name. From a folder entry (a checkpoint, the final `transformer/`, a branch set
aside, validation/, profile/, the tracker folder) only the files flux-cp writes there are removed (`owned`, `remove`):
a user's file is kept wherever it is, and named. The manifest also records the hash of a file a user may edit (the
model card) when the run wrote it, so that an edit is seen and kept (`edited`).

Each writer records its entry just before creating it (checkpoints, the final model, metrics.jsonl, run_config.json,
the loss curve, the model card, validation/, profile/, the tracker folder when it is inside the output folder); the
file is rewritten atomically, by the main process only (the output folder's lock keeps other runs out). Entries are
paths relative to the output folder, checked when read: an entry that is absolute, climbs out with `..` or passes
through a symbolic link is refused, so a damaged or hostile manifest cannot make the trainer delete anything outside
the folder.

Folders written by versions before the manifest are recognised by their content (`legacy_outputs`): only entries
that hold nothing but what flux-cp writes there count, and only in a folder marked as a flux-cp run by its
run_config.json or a checkpoint's meta.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from flux_cp import files
from flux_cp.errors import UsageError

NAME = ".flux_cp_manifest.json"
FORMAT = 1

# Files and folders a run writes at the top of its output folder, besides checkpoints and its tracker folder.
RUN_OUTPUTS = (
    "run_config.json",
    "metrics.jsonl",
    "pytorch_lora_weights.safetensors",
    "transformer",
    "loss_curve.png",
    "validation",
    "profile",
)
# Files a run writes that a user may edit (the model card): kept, not replaced or removed, once edited (`edited`).
EDITABLE = ("README.md", "README.flux-cp.md")
CHECKPOINT = re.compile(r"^(checkpoint-\d+|\.checkpoint-\d+\.partial)$")
ABANDONED = re.compile(r"^abandoned-\d{8}-\d{6}(-\d+)?$")


def _load(folder: str | os.PathLike) -> dict | None:
    """The manifest of `folder`, its entries checked (None: there is none); a UsageError if it is damaged."""
    path = Path(folder) / NAME
    if not os.path.lexists(path):
        return None
    where = f"--output_dir {folder}: {NAME}"
    if path.is_symlink() or not path.is_file():
        raise UsageError(f"{where} is not a regular file (a link or a folder): remove it; flux-cp writes it itself")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(
            f"{where} cannot be read ({e}): it lists what flux-cp may delete there; remove it, and the folder's "
            "outputs are recognised by their content"
        ) from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list) or data.get("format") != FORMAT:
        raise UsageError(f"{where} is not a flux-cp manifest (format {FORMAT} with a list of 'entries'): remove it")
    for entry in entries:
        check_entry(entry, where)
    digests = data.get("digests")
    return {"entries": entries, "digests": digests if isinstance(digests, dict) else {}}


def read(folder: str | os.PathLike) -> list[str] | None:
    """The entries of `folder`'s manifest (None: there is none); a UsageError if it is damaged."""
    data = _load(folder)
    return None if data is None else data["entries"]


def check_entry(entry: object, where: str = "manifest") -> str:
    """An entry is a relative path inside the folder, without `.`/`..` parts or our own bookkeeping files."""
    parts = PurePosixPath(entry).parts if isinstance(entry, str) and entry and "\0" not in entry else ()
    if not parts or PurePosixPath(entry).is_absolute() or any(p in (".", "..") for p in parts) or "\\" in entry:
        raise UsageError(f"{where} has an entry outside the folder ({entry!r}): remove the manifest")
    if parts[0] in (NAME, ".flux_cp.lock") or str(PurePosixPath(*parts)) != entry:
        raise UsageError(f"{where} has an entry that is not an output ({entry!r}): remove the manifest")
    return entry


def _write(folder: Path, entries: list[str], digests: dict | None = None) -> None:
    """Rewrite the manifest with `entries`, keeping the recorded digests of those still listed (`digests`: all)."""
    if digests is None:
        digests = (_load(folder) or {}).get("digests", {}) if os.path.lexists(folder / NAME) else {}
    kept = {k: v for k, v in digests.items() if k in entries}
    data = {"format": FORMAT, "written_by": "flux-cp", "entries": sorted(set(entries))}
    files.write_json(folder / NAME, {**data, **({"digests": kept} if kept else {})})


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def note_written(folder: str | os.PathLike, name: str) -> None:
    """Record the hash of `name` (a listed file) as this run just wrote it, to tell a user's later edits by."""
    folder = Path(folder)
    data = _load(folder)
    if data is None or name not in data["entries"]:
        return
    _write(folder, data["entries"], {**data["digests"], name: _digest(folder / name)})


def edited(folder: str | os.PathLike, name: str) -> str | None:
    """Why the file `name` of `folder` is the user's (None: it is absent, or flux-cp wrote it as it is now): not
    written by flux-cp, or changed since (or written when no hash was recorded, so an edit cannot be told)."""
    folder = Path(folder)
    path = folder / name
    if not os.path.lexists(path):
        return None
    data = _load(folder)
    if data is None or name not in data["entries"] or path.is_symlink() or not path.is_file():
        return "was not written by flux-cp"
    recorded = data["digests"].get(name)
    if recorded is None:
        return "was written by an earlier version of flux-cp, which kept no record to tell your edits by"
    return None if recorded == _digest(path) else "was edited since flux-cp wrote it"


def start(folder: str | os.PathLike, entries: list[str]) -> None:
    """Write the manifest of `folder` with `entries` (a run taking the folder over)."""
    _write(Path(folder), [check_entry(e) for e in entries])


def record(folder: str | os.PathLike, *names: str) -> None:
    """Record `names` (paths relative to `folder`) as written by this run, just before writing them. A folder that
    exists already and is not listed is left out: it is not this run's, and files written into it are not recorded
    (the output folder's claim refused such names where a new run writes). Without a manifest (a folder no run
    claimed, e.g. in a test) nothing is recorded."""
    folder = Path(folder)
    entries = read(folder)
    if entries is None:  # a folder no run claimed (the claim writes the manifest first)
        return
    new = []
    for name in names:
        check_entry(name)
        path = folder / name
        if name in entries or _under_listed(name, entries):
            continue
        if path.is_dir() and not path.is_symlink():
            continue
        new.append(name)
    if new:
        _write(folder, entries + new)


def forget(folder: str | os.PathLike, *names: str) -> None:
    """Drop `names` from the manifest (removed, or renamed into another entry)."""
    folder = Path(folder)
    entries = read(folder)
    if entries is None:
        return
    kept = [e for e in entries if e not in names]
    if len(kept) != len(entries):
        _write(folder, kept)


def _under_listed(name: str, entries: list[str]) -> bool:
    parts = PurePosixPath(name).parts
    return any(PurePosixPath(*parts[:i]).as_posix() in entries for i in range(1, len(parts)))


# What flux-cp writes inside each kind of folder entry, as paths relative to the entry (`owned`). Everything else
# in them is a user's: kept and reported, wherever it is.
# (a checkpoint holds its step's LoRA file, named as the final one: flux_cp.outputs)
_CHECKPOINT_FILES = (
    r"(meta\.json|train\.pt|data\.json|pytorch_lora_weights\.safetensors|state/(\.metadata|__\d+_\d+\.distcp))"
)
_MODEL_FILES = r"(config\.json|diffusion_pytorch_model(-\d+-of-\d+)?\.safetensors(\.index\.json)?)"
_WANDB_RUN = r"(.+/)?wandb/(offline-)?run-\d{8}_\d{6}-[^/]+/.+"  # a wandb run's folder, under the tracker folder
_OWNED = {
    "checkpoint": re.compile(rf"^{_CHECKPOINT_FILES}$"),
    "transformer": re.compile(rf"^{_MODEL_FILES}$"),
    "abandoned": re.compile(
        rf"^(checkpoint-\d+/{_CHECKPOINT_FILES}|transformer/{_MODEL_FILES}|validation/step-\d+\.png|"
        r"pytorch_lora_weights\.safetensors|loss_curve\.png|metrics\.jsonl)$"
    ),
    "validation": re.compile(r"^step-\d+\.png$"),
    "profile": re.compile(r"^rank\d+(_summary)?\.json$"),
    # TensorBoard's event files (accelerate's tracker writes them in a subfolder per project), wandb's run folders
    "tracker": re.compile(rf"^((.+/)?(events\.out\.tfevents\.[^/]+|hparams\.yml)|{_WANDB_RUN})$"),
}
# Links flux-cp's trackers make (wandb's, to its newest run and logs, and in a run's folder to its service's log):
# unlinking one never touches what it points to
_OWNED_LINKS = re.compile(rf"^((.+/)?wandb/(latest-run|debug\.log|debug-internal\.log)|{_WANDB_RUN})$")


def _kind(entry: str) -> str | None:
    """The kind of folder entry `entry` is (`_OWNED`'s keys), None for a temporary folder of a write in progress
    (`.checkpoint-N.partial`, `.transformer.partial`...), which holds nothing but what flux-cp wrote into it."""
    name = PurePosixPath(entry).parts[0]
    if re.match(r"^\..+\.(partial|old)$", name):
        return None
    if CHECKPOINT.match(name):
        return "checkpoint"
    if ABANDONED.match(name):
        return "abandoned"
    return name if name in ("transformer", "validation", "profile") else "tracker"


def owned(entry: str) -> Callable[[str, bool], bool]:
    """Whether a path inside the folder entry `entry` (relative to it; and whether it is a link) is a file flux-cp
    writes there."""
    kind = _kind(entry)
    if kind is None:
        return lambda rel, link: not link
    pattern = _OWNED[kind]
    return lambda rel, link: bool(_OWNED_LINKS.match(rel) if link else pattern.match(rel))


def remove_owned(path: Path, ours: Callable[[str, bool], bool]) -> list[Path]:
    """Delete the files of the folder `path` that `ours` names (relative to `path`), then the folders left empty
    (`path` too); links are unlinked when `ours` names them, never followed. Returns the paths kept."""
    kept = []
    for root, dirs, names in os.walk(path, topdown=False):  # links are not followed: listed as names
        for name in [*names, *(d for d in dirs if (Path(root) / d).is_symlink())]:
            p = Path(root) / name
            if ours(p.relative_to(path).as_posix(), p.is_symlink()):
                p.unlink()
            else:
                kept.append(p)
        for name in dirs:
            d = Path(root) / name
            if d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
                d.rmdir()
    if not any(path.iterdir()):
        path.rmdir()
    return sorted(kept)


def carry_over(old: Path, new: Path, ours: Callable[[str, bool], bool]) -> list[str]:
    """Before the folder `new` takes the place of `old` (the same output written again): delete what flux-cp wrote in
    `old` and move what else it holds (a user's files) into `new`, at the same paths, then remove `old` when that
    empties it. Returns the paths moved (relative)."""
    if not old.is_dir() or old.is_symlink():
        return []
    moved = []
    for p in remove_owned(old, ours):
        rel = p.relative_to(old)
        if not os.path.lexists(new / rel):
            (new / rel).parent.mkdir(parents=True, exist_ok=True)
            os.rename(p, new / rel)
            moved.append(rel.as_posix())
    if old.is_dir():
        remove_owned(old, lambda rel, link: False)  # the folders the moves emptied
    return sorted(moved)


def remove(folder: Path, entry: str) -> list[str]:
    """Delete one entry of `folder`: a link or file is unlinked (a link is never followed); from a folder only the
    files flux-cp writes there (`owned`) are removed, then the folders left empty. Returns the files kept (paths
    relative to `folder`). An entry below a link (`logs` -> elsewhere, then `logs/x`) is refused."""
    check_entry(entry)
    path = folder / entry
    parent = folder
    for part in PurePosixPath(entry).parts[:-1]:
        parent = parent / part
        if parent.is_symlink():
            raise UsageError(f"--output_dir {folder}: {entry} lies behind the link {parent}: not removing it")
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        return [p.relative_to(folder).as_posix() for p in remove_owned(path, owned(entry))]
    return []


# --- folders of versions before the manifest --------------------------------------------------------------

_DCP_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")
_MODEL_FILE = re.compile(rf"^{_MODEL_FILES}$")
_VALIDATION_FILE = _OWNED["validation"]
_PROFILE_FILE = _OWNED["profile"]
_TRACKER_FILE = re.compile(r"^(events\.out\.tfevents\..+|hparams\.yml)$")


def _only(path: Path, allowed: re.Pattern, depth: int = 0) -> bool:
    """`path` is a real folder holding only files named by `allowed` (and, with depth, folders of them)."""
    if path.is_symlink() or not path.is_dir():
        return False
    for p in path.iterdir():
        if p.is_symlink():
            return False
        if p.is_dir():
            if depth == 0 or not _only(p, allowed, depth - 1):
                return False
        elif not allowed.match(p.name):
            return False
    return True


def _is_checkpoint(path: Path) -> bool:
    if path.is_symlink() or not path.is_dir():
        return False
    for p in path.iterdir():
        if p.name == "state":
            if not _only(p, _DCP_FILE):
                return False
        elif not _OWNED["checkpoint"].match(p.name) or p.is_symlink() or not p.is_file():
            return False
    return True


def is_run_folder(folder: Path) -> bool:
    """A flux-cp output folder: its run_config.json or a checkpoint's meta.json says so (a model folder never is)."""
    if (folder / "model_index.json").exists():
        return False
    config = files.read_json(folder / "run_config.json")
    if isinstance(config, dict) and {"output_dir", "cp_size", "resume_from_checkpoint"} <= set(config):
        return True
    for p in folder.glob("checkpoint-*"):
        meta = files.read_json(p / "meta.json")
        if isinstance(meta, dict) and meta.get("format") == 1 and isinstance(meta.get("run"), dict):
            return True
    return False


def legacy_outputs(folder: str | os.PathLike, tracker_dir: str | None) -> list[str]:
    """Entries of a folder written before the manifest that are recognisably flux-cp's (see the module's text).
    `tracker_dir`: the tracker folder relative to `folder` when it is inside it."""
    folder = Path(folder)
    if not folder.is_dir() or not is_run_folder(folder):
        return []
    found = []
    for p in folder.iterdir():
        name = p.name
        if CHECKPOINT.match(name):
            ok = _is_checkpoint(p)
        elif name in ("run_config.json", "metrics.jsonl", "loss_curve.png", "pytorch_lora_weights.safetensors"):
            ok = p.is_file() and not p.is_symlink()
        elif name == "transformer":
            ok = _only(p, _MODEL_FILE)
        elif name == "validation":
            ok = _only(p, _VALIDATION_FILE)
        elif name == "profile":
            ok = _only(p, _PROFILE_FILE)
        else:
            ok = False
        if ok:
            found.append(name)
    if tracker_dir and _only(folder / tracker_dir, _TRACKER_FILE, depth=3):
        found.append(tracker_dir)
    return found
