"""Every folder the flags name has one role - the model, the training data, the class images, the output folder, the
tracker logs, the encoding cache - and the trainer writes into a folder only in the role it was given, and reads a
folder only for its role. Checked on the main process before anything loads (flux_cp.outdir keeps the output folder
apart from the model and the data; this module the rest):

- `--class_data_dir` is a folder of its own: one that is, holds or is inside the model, the training data, the
  bundled data sets, the encoding cache, the tracker folder or another run's output folder is refused (the class
  images flux-cp generates are written there, and everything there is read as a class image).
- `--logging_dir` (when a tracker writes it) names none of the run's own outputs (checkpoints, the final model,
  metrics.jsonl, README.md...) nor the output folder itself, is neither inside the model, the data or the class
  images, and is not the encoding cache (nor, inside the output folder, holds it or lies in it).
- `--encodings_dir` (when the cache is used) is not the output folder, one of its outputs or the tracker folder, nor
  the model folder, the training data folder or inside the model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from . import manifest
from .errors import UsageError

# Names at the top of an output folder that a run writes, besides RUN_OUTPUTS and its checkpoints.
_OWN = (manifest.NAME, ".flux_cp.lock", "README.md", "README.flux-cp.md")
_HIDDEN_OUTPUT = re.compile(r"^\.(.+)\.(partial|old)$")


def relation(path: str | os.PathLike, other: str | os.PathLike) -> str | None:
    """How `path` lies to `other` (both resolved): 'is', 'is inside', 'holds', or None when apart."""
    a, b = Path(os.path.realpath(path)), Path(os.path.realpath(other))
    if a == b:
        return "is"
    if b in a.parents:
        return "is inside"
    if a in b.parents:
        return "holds"
    return None


def run_folder(path: str | os.PathLike, holds: bool = False) -> Path | None:
    """The output folder of a flux-cp run that `path` is or is inside (with `holds`, also one it holds), else None:
    a folder holding a manifest, or marked as a run's by its run_config.json or a checkpoint."""
    p = Path(os.path.realpath(path))
    for folder in (p, *p.parents):
        if os.path.lexists(folder / manifest.NAME) or manifest.is_run_folder(folder):
            return folder
    if holds and p.is_dir():
        for found in p.rglob(manifest.NAME):
            return found.parent
    return None


def output_entry(rel: str) -> str | None:
    """The run output that a path relative to the output folder names or lies in (its first part), else None."""
    parts = Path(rel).parts
    first = parts[0] if parts else ""
    written = m.group(1) if (m := _HIDDEN_OUTPUT.match(first)) else first  # a final output's partial write
    if written in (*manifest.RUN_OUTPUTS, *_OWN) or manifest.CHECKPOINT.match(first) or manifest.ABANDONED.match(first):
        return first
    return None


def _inside_output(output_dir: str, path: str) -> str | None:
    """`path` relative to the output folder when it lies inside it ('.' for the folder itself), else None."""
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(output_dir))
    return None if rel == ".." or rel.startswith(".." + os.sep) else rel


def _not_an_output(flag: str, value: str, path: str, output_dir: str, fix: str) -> str | None:
    """Refuse a folder flag whose `path` is the output folder itself or one of the run's outputs in it (removing or
    rewriting that output would take the folder with it); its place relative to the output folder otherwise."""
    rel = _inside_output(output_dir, path)
    if rel == ".":
        raise UsageError(f"{flag} {value} is the output folder itself: {fix}")
    if rel is not None and (entry := output_entry(rel)):
        raise UsageError(f"{flag} {value} {'names' if rel == entry else 'is in'} {entry}, one of the run's own "
                         f"outputs in --output_dir {output_dir}: {fix}")  # fmt: skip
    return rel


def check(
    output_dir: str,
    *,
    model: str | None,
    data: str | None,
    bundled: Path,
    data_flag: str = "--dataset_name",
    class_dir: str | None = None,
    encodings: str | None = None,
    logs: str | None = None,
) -> None:
    """Refuse folders whose roles collide (see the module's text), with one line naming both. `model`, `data`: the
    local model and data folders (None or a hub id: skipped), `data_flag` the flag naming the data; `bundled`: the
    folder of the bundled data sets;
    `class_dir`: --class_data_dir with prior preservation; `encodings`: the cache folder when used; `logs`:
    --logging_dir as given (relative to the output folder) when a tracker writes it."""
    local = {flag: p for flag, p in (("--pretrained_model_name_or_path", model), (data_flag, data),
                                     ("the bundled data", str(bundled))) if p and os.path.isdir(p)}  # fmt: skip
    logs_path = os.path.join(output_dir, logs) if logs is not None else None
    if class_dir is not None:
        others = {**local, **({"--encodings_dir": encodings} if encodings else {}),
                  **({"--logging_dir": logs_path} if logs_path else {})}  # fmt: skip
        for flag, other in others.items():
            how = relation(class_dir, other)
            if how:
                raise UsageError(
                    f"--class_data_dir {class_dir} {how} {flag} {other}: the class images need a folder of their own "
                    "(everything in it is read as a class image, and generated ones are written into it): choose "
                    "another --class_data_dir"
                )
        found = run_folder(class_dir, holds=True)
        if found is not None and relation(found, output_dir) is None:
            how = relation(class_dir, found)
            run = "the output folder of another run" + ("" if how == "is" else f" ({found})")
            raise UsageError(
                f"--class_data_dir {class_dir} {how} {run}: its images and plots are no class images, and generated "
                "ones would be written into it: choose a folder of class images of its own"
            )
    if logs_path is not None:
        rel = _not_an_output("--logging_dir", logs, logs_path, output_dir, "name a folder in it (default logs)")
        for flag, other in local.items():
            how = relation(logs_path, other)
            if how in ("is", "is inside"):
                raise UsageError(f"--logging_dir {logs} {how} {flag} {other}: the tracker logs would be written "
                                 "there; choose a folder of their own")  # fmt: skip
        # Nested, the two collide where one is removed: a tracker folder inside the output folder goes with the run
        # (--overwrite_output_dir). One outside it is never removed, so it may hold the cache or lie in it.
        how = relation(logs_path, encodings) if encodings else None
        if how == "is" or (how and rel is not None):
            raise UsageError(
                f"--logging_dir {logs} {how} --encodings_dir {encodings}: the tracker logs and the encoding cache "
                "need folders of their own (removing one would remove the other): choose another"
            )
    if encodings:
        _not_an_output("--encodings_dir", encodings, encodings, output_dir, "choose a folder of its own")
        for flag, other in local.items():
            how = relation(encodings, other)
            if how == "is" or (how == "is inside" and flag.startswith("--pretrained")):
                raise UsageError(f"--encodings_dir {encodings} {how} {flag} {other}: choose a folder of its own for "
                                 "the encoding cache")  # fmt: skip
