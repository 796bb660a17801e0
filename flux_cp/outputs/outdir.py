"""An output folder belongs to one run, and the trainer deletes only what a flux-cp run wrote there.

Before anything loads, the main process makes sure `--output_dir` is a folder it can write to, apart from the model
and the data set (an output folder that is, holds or is inside either is refused: a run would train on its own
outputs, or replace the model's files), takes a lock that keeps a second live run out (held until the process ends;
the kernel drops it when a process dies, so a crash never leaves a stale lock), refuses a symbolic link where the
trainer writes its own file, and decides with flux_cp.outputs.resume whether the folder's earlier run is continued,
branched from, forked, replaced (`--overwrite_output_dir`) or refused. Replacing deletes the entries of the folder's
manifest (flux_cp.manifest) and nothing else. The tracker folder (`--logging_dir`) is relative to the output folder; one
outside it (absolute, or climbing out with `..`) is used but never removed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError

from flux_cp import checkpoint_folders, distributed, files, manifest
from flux_cp.config.fields import DEFAULT_ENCODINGS_DIR
from flux_cp.data.sources import BUNDLED_DATA, encodings_folder
from flux_cp.errors import UsageError
from flux_cp.outputs import resume, roles
from flux_cp.outputs.resume import check_prior_resume

if TYPE_CHECKING:
    from flux_cp.config.flags import Config

logger = logging.getLogger("flux_cp")

LOCK_NAME = ".flux_cp.lock"
FINAL_OUTPUTS = ("pytorch_lora_weights.safetensors", "transformer")

_held: dict[str, int] = {}  # folder -> open file descriptor of its lock, for the life of this process


@dataclass
class Claim:
    """What claiming the output folder did: earlier outputs removed (--overwrite_output_dir), how the run starts
    (flux_cp.outputs.resume.Decision), and lines to log."""

    removed: list[str] = field(default_factory=list)
    decision: resume.Decision = field(default_factory=lambda: resume.Decision("new"))
    notes: list[str] = field(default_factory=list)


def tracker_folder(output_dir: str | os.PathLike, logging_dir: str | None) -> str | None:
    """`--logging_dir` relative to the output folder when it lies inside it (not through a link), else None."""
    if logging_dir is None:
        return None
    base = os.path.normpath(os.path.abspath(output_dir))
    full = os.path.normpath(os.path.join(base, logging_dir))
    rel = os.path.relpath(full, base)
    if rel == "." or rel == ".." or rel.startswith(".." + os.sep):
        return None
    path = Path(base)
    for part in Path(rel).parts:
        path = path / part
        if path.is_symlink():
            return None
    return Path(rel).as_posix()


def _known(folder: Path, tracker: str | None) -> list[str]:
    """Names in `folder` a run writes (checkpoints oldest first, then the outputs in a fixed order)."""
    if not folder.is_dir():
        return []
    names = [p.name for p in folder.iterdir()]
    checkpoints = sorted(
        (n for n in names if manifest.CHECKPOINT.match(n)), key=lambda n: int(n.split("-")[1].split(".")[0])
    )
    aside = sorted(n for n in names if manifest.ABANDONED.match(n))
    outputs = [n for n in manifest.RUN_OUTPUTS if os.path.lexists(folder / n)]
    return checkpoints + outputs + aside + ([tracker] if tracker and os.path.lexists(folder / tracker) else [])


def earlier_outputs(folder: Path, tracker: str | None = None) -> tuple[list[str], list[str]]:
    """(earlier outputs in `folder`, those of them that flux-cp wrote): the first are refused for a new run, the
    second are what --overwrite_output_dir may delete. Known names that no manifest lists and that do not look
    like flux-cp's outputs are in the first list only."""
    entries = manifest.read(folder)
    owned = (
        manifest.legacy_outputs(folder, tracker)
        if entries is None
        else [e for e in entries if os.path.lexists(folder / e)]
    )
    known = _known(folder, tracker)
    if tracker and tracker not in owned:
        known = [n for n in known if n != tracker]  # a tracker folder we did not create: appended to, never removed
    return known + [n for n in owned if n not in known], owned


def check_writable(folder: Path, flag: str) -> None:
    """Create `folder` if needed and write a probe file into it; a UsageError naming `flag` if that fails."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} {folder} is a file, not a folder: choose a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".flux_cp_write_test.{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            probe.unlink()
    except OSError as e:
        raise UsageError(
            f"{flag} {folder} cannot be written ({e.strerror or e}): choose a folder you can write to"
        ) from None


def check_apart(output_dir: str | os.PathLike, others: dict[str, str | os.PathLike | None]) -> None:
    """Refuse an output folder that is, holds or is inside one of `others` (flag -> local folder; None and hub
    ids are skipped): a run would write into the model's or the data set's folder, or train on its own outputs."""
    out = Path(os.path.realpath(output_dir))
    for flag, other in others.items():
        if other is None or not os.path.isdir(other):
            continue
        there = Path(os.path.realpath(other))
        if out == there:
            how = "is the folder of"
        elif there in out.parents:
            how = "is inside"
        elif out in there.parents:
            how = "holds"
        else:
            continue
        raise UsageError(
            f"--output_dir {output_dir} {how} {flag} {other}: a run writes checkpoints, weights and images there, "
            "which would mix with the model or the data set (the next run would train on them). Choose an "
            "--output_dir outside it"
        )


def _lock(folder: Path) -> None:
    key = str(folder.resolve())
    if key in _held:
        return
    path = folder / LOCK_NAME
    try:  # never through a link: a link named like the lock would otherwise truncate the file it points to
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
        raise UsageError(
            f"--output_dir {folder}: {LOCK_NAME} cannot be opened ({e.strerror or e}); "
            + (
                "it is a symbolic link: remove it (flux-cp writes its own lock there)"
                if path.is_symlink()
                else "remove it or choose another folder"
            )
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise UsageError(
            f"--output_dir {folder}: {LOCK_NAME} is not a plain file of its own (a hard link or a special file): "
            "remove it; flux-cp writes its own lock there"
        )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        who = (
            f" (pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')})"
            if isinstance(holder, dict) and holder
            else ""
        )
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


def _check_links(folder: Path) -> None:
    """A symbolic link where the trainer writes its own file or folder is refused: writing through it would change
    whatever it points to."""
    names = sorted(
        p.name for p in folder.iterdir() if manifest.CHECKPOINT.match(p.name) or manifest.ABANDONED.match(p.name)
    )
    names += [manifest.NAME, *manifest.RUN_OUTPUTS, *(f".{n}.partial" for n in FINAL_OUTPUTS), ".transformer.old"]
    for name in names:
        if (folder / name).is_symlink():
            raise UsageError(
                f"--output_dir {folder}: {name} is a symbolic link (to {os.readlink(folder / name)}), where flux-cp "
                "writes its own file: remove the link, or choose another folder"
            )


def claim(
    output_dir: str | os.PathLike,
    resume_from: str | None = None,
    overwrite: bool = False,
    *,
    logging_dir: str | None = None,
    apart: dict[str, str | os.PathLike | None] | None = None,
    max_train_steps: int | None = None,
    accept: Callable[[resume.Decision], None] | None = None,
) -> Claim:
    """Make `output_dir` this run's (main process only), before anything loads: see the module's text.
    `logging_dir`: the tracker folder as given (relative to the output folder), None when no tracker writes one;
    `apart`: flag -> folder the output folder must stay apart from (the model, the data set); `accept(decision)`:
    raises a UsageError to refuse how the run would start, before anything in the folder changes."""
    folder = Path(output_dir)
    check_apart(folder, apart or {})
    check_writable(folder, "--output_dir")
    _lock(folder)
    _check_links(folder)
    tracker = tracker_folder(folder, logging_dir)
    earlier, owned = earlier_outputs(folder, tracker)
    decision = resume.decide(folder, resume_from, overwrite, max_train_steps, earlier)
    if accept is not None:
        accept(decision)
    removed: list[str] = []
    notes: list[str] = []
    if decision.kind in ("new", "fork") and earlier:  # with --overwrite_output_dir (else decide refused)
        foreign = [n for n in earlier if n not in owned]
        if foreign:
            raise UsageError(
                f"--overwrite_output_dir: --output_dir {folder} holds {', '.join(foreign)}, which flux-cp did not "
                "write (no manifest lists them and they do not look like its outputs), so it removes nothing: move "
                "them away, or choose another folder"
            )
        edited = [n for n in owned if n in manifest.EDITABLE and manifest.edited(folder, n)]  # the user's now
        owned = [n for n in owned if n not in edited]
        kept = [path for name in owned for path in manifest.remove(folder, name)]
        removed, owned = owned, [n for n in owned if os.path.lexists(folder / n)]  # holding the user's files
        if kept:
            shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
            notes.append(f"--overwrite_output_dir: kept {shown}, which flux-cp did not write")
        if edited:
            notes.append(
                f"--overwrite_output_dir: kept {', '.join(edited)}, edited since flux-cp wrote it (or with "
                "no record to tell)"
            )
    if tracker and not os.path.lexists(folder / tracker):  # created by this run, so removed with it
        parts = Path(tracker).parts
        created = next(
            Path(*parts[:i]) for i in range(1, len(parts) + 1) if not os.path.lexists(folder.joinpath(*parts[:i]))
        )
        (folder / tracker).mkdir(parents=True)
        if not any(Path(o) in (created, *created.parents) for o in owned):
            owned.append(created.as_posix())
    manifest.start(folder, owned)
    return Claim(removed, decision, notes + resume.apply(decision, folder))


CARD = "README.md"
CARD_BESIDE = "README.flux-cp.md"  # the model card's name when README.md is the user's


def card_name(output_dir: str | os.PathLike) -> tuple[str | None, str | None]:
    """Where the model card goes, and a line to log when not README.md: README.md unless the user wrote it or edited
    it since flux-cp wrote it (flux_cp.manifest.edited); then it is kept and the card goes beside it, to
    README.flux-cp.md, unless that one is theirs too (no card is written)."""
    why = manifest.edited(output_dir, CARD)
    if why is None:
        return CARD, None
    if manifest.edited(output_dir, CARD_BESIDE) is None:
        return CARD_BESIDE, f"{output_dir}/{CARD} {why}: kept; this run's model card is {CARD_BESIDE}"
    return None, f"{output_dir}/{CARD} {why}: kept, and {CARD_BESIDE} is not flux-cp's either: no model card written"


def write_final(output_dir: str | os.PathLike, name: str, write: Callable[[Path], Path]) -> Path:
    """Write the final output `name` (a file or folder in `output_dir`): `write(folder)` writes it into a hidden
    temporary folder beside it and returns its path there; it is then renamed into place, so the folder holds the
    previous version or the complete new one, never a part. A failure is a UsageError naming the output and saying
    what a resume would do."""

    root = Path(output_dir)
    final, staging, old = root / name, root / f".{name}.partial", root / f".{name}.old"
    manifest.record(root, name, staging.name, old.name)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        written = write(staging)
        files.apply_umask(written)
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(written, final)
            # flux-cp's files of the earlier version go; a user's files in it move into the new one
            if kept := manifest.carry_over(old, final, manifest.owned(name)):
                shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
                logger.warning(f"{final}: kept {shown}, which flux-cp did not write, in the new {name}")
        else:
            os.replace(written, final)
    except (OSError, SafetensorError) as e:  # safetensors' I/O failures are not OSErrors
        why = getattr(e, "strerror", None) or e
        found = checkpoint_folders.list_checkpoints(root)
        then = (
            f"Free disk space, then resume with --resume_from_checkpoint latest: it restarts from step {found[-1][0]} "
            f"({found[-1][1]}, the last good checkpoint) and writes it again at the end"
            if found
            else "No checkpoint was written, so a resume has nothing to start from: free disk space, then run "
            "again with --overwrite_output_dir (from step 0)"
        )
        raise UsageError(f"writing {final} failed ({why}). {then}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    manifest.forget(root, staging.name, old.name)
    return final


def finished(
    resume_from: str | None, output_dir: str | os.PathLike, steps: int | None, *, claimed: bool = False
) -> Path | None:
    """The checkpoint of a run that is already done, when `--resume_from_checkpoint resume_from` resumes one: its own
    folder's newest checkpoint, at the run's last step (`steps`), with the final weights and the model card written
    after it (a run stopped on its way out, before those, is finished by resuming it), and no live run in the folder
    (`claimed`: this process holds the folder). Else None. Reads only."""
    folder = Path(output_dir)
    found = checkpoint_folders.list_checkpoints(folder)
    if resume_from is None or steps is None or not found:
        return None
    path = found[-1][1]
    if resume_from != "latest" and Path(resume_from).resolve() != path.resolve():
        return None  # an earlier checkpoint (a branch) or another folder's (a fork)
    if found[-1][0] != steps or not (folder / "README.md").is_file():
        return None
    if not any(os.path.lexists(folder / name) for name in FINAL_OUTPUTS) or (not claimed and _in_use(folder)):
        return None  # a live run there: the resume says so (`claim`) rather than this
    return path


def _in_use(folder: Path) -> bool:
    """Whether a live run holds the folder's lock, probed without writing anything."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # a lock that cannot be opened: the run's own start names the problem
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # drops the probe's shared lock with it


def finished_line(path: Path, steps: int) -> str:
    return (
        f"{path.parent} already finished: {path.name} is its last step ({steps} steps) and its weights and model card "
        "are written, so there is nothing to do and nothing was changed. To train further, pass a larger "
        "--max_train_steps with --resume_from_checkpoint latest"
    )


def claim_run(cfg: Config, model_path: str, is_main: bool, identity: dict | None = None) -> None:
    """`claim` the output folder for the run of `cfg` (the main process; every rank learns the result): apart from
    the model, the data set, the class images, the encoding cache and the tracker logs (flux_cp.outputs.roles), and a
    resume needing other class images than this run's, or of a run whose `identity` (the keys of the run identity the
    flags decide: flux_cp.outputs.resume.flag_identity) differs, refused before anything is set aside, loaded or
    generated; the lines to log are logged."""
    problem, claimed = None, None
    if is_main:
        data = cfg.data
        try:
            logs = cfg.validation.logging_dir if cfg.validation.writes_logs else None
            classes = data.class_data_dir if data.with_prior_preservation else None
            data_flag = "the bundled data set"
            if data.instance_data_dir or data.dataset_name:
                data_flag = "--instance_data_dir" if data.instance_data_dir else "--dataset_name"
            encodings = None if data.no_cache else encodings_folder(data)
            seed = cfg.train.seed_checkpoint
            roles.check(
                cfg.train.output_dir,
                model=model_path,
                data=data.dataset_name or str(BUNDLED_DATA),
                data_flag=data_flag,
                bundled=BUNDLED_DATA.parent,
                class_dir=classes,
                encodings=encodings,
                logs=logs,
                default_encodings=os.path.expanduser(DEFAULT_ENCODINGS_DIR),
                cache_dir=cfg.model.cache_dir,
                seed=seed if seed and not os.path.lexists(seed) else None,
            )

            def accept(decision: resume.Decision) -> None:  # a resume needing other class images: refused now
                if decision.checkpoint is not None:
                    meta = checkpoint_folders.read_meta(decision.checkpoint)
                    check_prior_resume(meta, data, decision.checkpoint)
                    if identity is not None:
                        resume.check_compatible(meta, identity, decision.checkpoint)

            claimed = claim(
                cfg.train.output_dir,
                cfg.checkpoints.resume_from_checkpoint,
                cfg.train.overwrite_output_dir,
                logging_dir=logs,
                max_train_steps=cfg.train.max_train_steps,
                accept=accept,
                apart={
                    "--pretrained_model_name_or_path": model_path,
                    data_flag: data.dataset_name or str(BUNDLED_DATA),
                },
            )
            if encodings is not None:
                check_writable(Path(encodings), "--encodings_dir")
        except UsageError as e:
            problem = str(e)
    distributed.check_all_ranks(problem is None, problem or "")
    if claimed and claimed.removed:
        logger.info(f"--overwrite_output_dir: removed the earlier run's outputs ({', '.join(claimed.removed)})")
    for note in claimed.notes if claimed else ():
        logger.info(note)
