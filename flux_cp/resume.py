"""What a resume accepts, decided from the output folder, the flags and the checkpoint's meta.json before anything
loads, so that a resume never mixes two runs in one folder and never rewinds one.

- No `--resume_from_checkpoint`: a new run; a folder holding an earlier run is refused unless
  `--overwrite_output_dir` replaces it.
- `latest`: the newest complete `checkpoint-N` of `--output_dir`. Without one, the run starts at step 0 only in a
  folder that holds no earlier run; a folder with a finished (or crashed) run but no checkpoint is refused like a
  new run, since starting it again replaces its outputs.
- A `checkpoint-N` of `--output_dir`: the run continues from step N. When later checkpoints exist, the resume starts
  a new branch: the later checkpoints, the final model and loss curve, the validation images after step N and a
  copy of metrics.jsonl are moved to `abandoned-<date>-<time>/` (renamed, never deleted), so that `latest` picks
  this branch afterwards and metrics.jsonl holds one trajectory.
- A checkpoint of another folder: a fork. Accepted only into a new or empty `--output_dir` (or one that
  `--overwrite_output_dir` empties); its metrics.jsonl starts with the source's rows up to step N, and the source
  folder is only read.
- Step N beyond `--max_train_steps` is refused: the run would write step N's weights under a smaller step.

What a checkpoint must share with the run resuming it (model, LoRA, data, resolution, global batch, seed) is
`checkpoint.run_identity`; the settings a resume may change are `checkpoint.RESUMABLE_CHANGES`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import checkpoint, files, manifest
from .errors import UsageError


@dataclass(frozen=True)
class Decision:
    """How a run starts: `new` (step 0), `continue` (a checkpoint of its folder), `branch` (an earlier checkpoint of
    its folder: `later` are set aside), or `fork` (a checkpoint of another folder, into a fresh one)."""

    kind: str
    checkpoint: Path | None = None
    step: int = 0
    later: tuple[Path, ...] = field(default_factory=tuple)


def describe(names: list[str]) -> str:
    """`3 checkpoints up to checkpoint-6, metrics.jsonl, ...` for a list of output names."""
    checkpoints = [n for n in names if manifest.CHECKPOINT.match(n)]
    rest = [n for n in names if not manifest.CHECKPOINT.match(n)]
    if len(checkpoints) > 1:
        rest.insert(0, f"{len(checkpoints)} checkpoints up to {checkpoints[-1]}")
    elif checkpoints:
        rest.insert(0, checkpoints[0])
    return ", ".join(rest)


def used_folder(folder: Path, earlier: list[str]) -> UsageError:
    return UsageError(
        f"--output_dir {folder} holds an earlier run ({describe(earlier)}): pass --resume_from_checkpoint latest to "
        "continue it, --overwrite_output_dir to replace it, or choose another folder"
    )


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def check_steps(step: int, max_steps: int | None, path: Path, source: str = "--max_train_steps") -> None:
    """Refuse to resume a checkpoint of step `step` into a run of `max_steps` steps (set by `source`) when it is
    beyond them: the run would write that step's weights under a smaller step, over the checkpoint of that step."""
    if max_steps is not None and step > max_steps:
        raise UsageError(
            f"--resume_from_checkpoint {path} is at step {step}, beyond the {max_steps} steps of this run ({source}): "
            f"it would write the weights of step {step} as step {max_steps}. Set --max_train_steps to {step} or more, "
            "or resume an earlier checkpoint"
        )


def saved_run(resume: str | None, output_dir: str | os.PathLike) -> tuple[Path, dict] | None:
    """(the checkpoint `--resume_from_checkpoint resume` names, its meta.json) when it can be read, else None (no
    resume, no checkpoint yet, or a damaged one: the resume itself then says what is wrong). Reads only."""
    if resume is None:
        return None
    try:
        path = checkpoint.resolve(resume, str(output_dir))
        return (path, checkpoint.read_meta(path)) if path is not None else None
    except UsageError:
        return None


def finished(
    resume: str | None, output_dir: str | os.PathLike, steps: int | None, *, claimed: bool = False
) -> Path | None:
    """The checkpoint of a run that is already done, when `--resume_from_checkpoint resume` resumes one: its own
    folder's newest checkpoint, at the run's last step (`steps`), with the final weights and the model card written
    after it (a run stopped on its way out, before those, is finished by resuming it), and no live run in the folder
    (`claimed`: this process holds the folder, flux_cp.outdir). Else None. Reads only."""
    from .outdir import FINAL_OUTPUTS

    folder = Path(output_dir)
    found = checkpoint.list_checkpoints(folder)
    if resume is None or steps is None or not found:
        return None
    path = found[-1][1]
    if resume != "latest" and Path(resume).resolve() != path.resolve():
        return None  # an earlier checkpoint (a branch) or another folder's (a fork)
    if found[-1][0] != steps or not (folder / "README.md").is_file():
        return None
    if not any(os.path.lexists(folder / name) for name in FINAL_OUTPUTS) or (not claimed and _in_use(folder)):
        return None  # a live run there: the resume says so (flux_cp.outdir) rather than this
    return path


def _in_use(folder: Path) -> bool:
    """Whether a live run holds the folder's lock (flux_cp.outdir's), probed without writing anything."""
    import fcntl

    from .outdir import LOCK_NAME

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


def decide(
    output_dir: str | os.PathLike,
    resume: str | None,
    overwrite: bool,
    max_train_steps: int | None,
    earlier: list[str],
) -> Decision:
    """The decision for `--resume_from_checkpoint resume` into `output_dir`, whose earlier outputs (names, oldest
    checkpoint first) are `earlier`; a UsageError saying what to change when it is refused. Reads only."""
    folder = Path(output_dir)
    if resume is None:
        if earlier and not overwrite:
            raise used_folder(folder, earlier)
        return Decision("new")
    if overwrite and earlier and (resume == "latest" or _inside(Path(resume), folder)):
        raise UsageError(
            f"--overwrite_output_dir would delete the checkpoint --resume_from_checkpoint {resume} resumes from: "
            "pass one of the two"
        )
    if resume == "latest":
        found = checkpoint.list_checkpoints(folder)
        if not found:
            if earlier:
                raise UsageError(
                    f"--resume_from_checkpoint latest: --output_dir {folder} holds an earlier run "
                    f"({describe(earlier)}) but no checkpoint to resume: starting it again from step 0 would replace "
                    "it. Pass --overwrite_output_dir to do so, or choose another folder"
                )
            return Decision("new")
        path = found[-1][1]
    else:
        path = checkpoint.resolve(resume, str(folder))
    meta = checkpoint.read_meta(path)
    step = meta["step"]
    check_steps(step, max_train_steps, path)
    if path.resolve().parent == folder.resolve():
        later = tuple(p for s, p in checkpoint.list_checkpoints(folder) if s > step)
        checkpoint.verify_quick(path, meta)  # sizes, the small files' checksums: a damaged checkpoint named now
        return Decision("branch" if later else "continue", path, step, later)
    if earlier and not overwrite:
        if _inside(path, folder):
            inside = f"is inside --output_dir {folder} but not one of its checkpoints"
        else:
            inside = f"is not in --output_dir {folder}, which holds an earlier run ({describe(earlier)})"
        raise UsageError(
            f"--resume_from_checkpoint {path} {inside}: resuming it there would mix two runs in one folder. Resume it "
            f"into a new or empty --output_dir (a fork; {path.parent} is only read), or continue its own run with "
            f"--output_dir {path.parent}"
        )
    checkpoint.verify_quick(path, meta)
    return Decision("fork", path, step)


def apply(decision: Decision, output_dir: str | os.PathLike) -> list[str]:
    """Carry out what the decision needs in the output folder (main process, folder claimed); log lines."""
    folder = Path(output_dir)
    if decision.kind == "branch":
        return [_set_aside(folder, decision)]
    if decision.kind == "fork":
        return [_fork(folder, decision)]
    return []


def _set_aside(folder: Path, decision: Decision) -> str:
    """Move what the abandoned branch wrote after `decision.step` into `abandoned-<date>-<time>/`."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name, n = f"abandoned-{stamp}", 1
    while os.path.lexists(folder / name):
        name, n = f"abandoned-{stamp}-{n}", n + 1
    manifest.record(folder, name)
    aside = folder / name
    aside.mkdir()
    moved = []
    for path in decision.later:
        os.rename(path, aside / path.name)
        manifest.forget(folder, path.name)
        moved.append(path.name)
    for final in ("pytorch_lora_weights.safetensors", "transformer", "loss_curve.png"):
        if os.path.lexists(folder / final):
            os.rename(folder / final, aside / final)
            manifest.forget(folder, final)
            moved.append(final)
    images = [p for p in sorted((folder / "validation").glob("step-*.png"))
              if (m := re.match(r"step-(\d+)\.png$", p.name)) and int(m.group(1)) > decision.step]  # fmt: skip
    if images:
        (aside / "validation").mkdir()
        for p in images:
            os.rename(p, aside / "validation" / p.name)
        moved.append(f"{len(images)} validation images")
    if (folder / "metrics.jsonl").is_file():
        shutil.copyfile(folder / "metrics.jsonl", aside / "metrics.jsonl")
        moved.append("a copy of metrics.jsonl")
    files.apply_umask(aside)
    return (
        f"resuming {decision.checkpoint.name} while later checkpoints exist: a new branch from step {decision.step}. "
        f"The later branch's outputs were moved to {aside} ({', '.join(moved)}); `latest` now picks this branch"
    )


def _fork(folder: Path, decision: Decision) -> str:
    """A fork starts its metrics.jsonl with the source run's rows up to the checkpoint's step."""
    from .metrics import read_metrics

    source = decision.checkpoint.resolve().parent
    rows = [r for r in read_metrics(source / "metrics.jsonl") if isinstance(r.get("step"), int)]
    rows = [r for r in rows if r["step"] <= decision.step]
    if rows:
        manifest.record(folder, "metrics.jsonl")
        files.write_text(folder / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return (
        f"resuming {decision.checkpoint} (step {decision.step}) into --output_dir {folder}: a fork of that run, which "
        f"stays as it is"
        + (f"; metrics.jsonl starts with its {len(rows)} rows up to step {decision.step}" if rows else "")  # fmt: skip
    )
