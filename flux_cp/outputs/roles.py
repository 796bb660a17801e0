"""Every folder the flags name has one role - the model, the training data, the class images, the output folder, the
tracker logs, the encoding cache - and the trainer writes into a folder only in the role it was given, and reads a
folder only for its role. Checked on the main process before anything loads (flux_cp.outputs.outdir keeps the output
folder apart from the model and the data; this module the rest). Folders are compared by their resolved paths (links
followed as far as the path exists, the rest as typed), so the answer is the same before and after a folder is
created:

- `--class_data_dir` is a folder of its own: one that is, holds or is inside the model, the training data, the
  bundled data sets, the output folder, the encoding cache (this run's, the default one, or any folder holding one),
  the tracker folder or another run's output folder is refused (the class images flux-cp generates are written
  there, and everything there is read as a class image).
- `--logging_dir` (when a tracker writes it) names none of the run's own outputs (checkpoints, the final model,
  metrics.jsonl, README.md...) nor the output folder itself, is neither inside the model, the data or the class
  images, and is not the encoding cache (nor, inside the output folder, holds it or lies in it).
- `--encodings_dir` (when the cache is used) is not the output folder, one of its outputs or the tracker folder, nor
  the model folder, the training data folder or inside the model.
- No folder the run writes (the output folder, the class images, the cache, the tracker logs, and the seed
  checkpoint it writes) is or lies inside a folder another tool owns (`foreign_owner`): a download or package cache
  (the Hugging Face cache, pip's), the Python environment, flux-cp's own files, a model folder (by its content:
  model_index.json, or a model's config.json), or another run's output folder (by its manifest or records).
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
from pathlib import Path

from flux_cp import manifest
from flux_cp.errors import UsageError

# Names at the top of an output folder that a run writes, besides RUN_OUTPUTS and its checkpoints.
_OWN = (manifest.NAME, ".flux_cp.lock", "README.md", "README.flux-cp.md")
_HIDDEN_OUTPUT = re.compile(r"^\.(.+)\.(partial|old)$")

# flux-cp's own files: the entries of its checkout (where it runs from one). A run writes into a new folder of the
# checkout (the default --output_dir is one, relative to the current folder), never into these.
CHECKOUT = Path(__file__).resolve().parents[2]
CHECKOUT_ENTRIES = (
    ".ci",
    ".git",
    ".gitignore",
    "README.md",
    "accelerate_configs",
    "benchmarks",
    "cp",
    "data",
    "docs",
    "flux_cp",
    "pyproject.toml",
    "requirements-cpu.txt",
    "requirements-test.txt",
    "requirements.txt",
    "tests",
    "tools",
    "train_flux_cp.py",
)
# An encoding cache's own folders (flux_cp.data.encode): entries named by a 32-digit hex key
_CACHE_PARTS = ("latents", "text")
_CACHE_ENTRY = re.compile(r"^[0-9a-f]{32}\.safetensors$")


def resolved(path: str | os.PathLike) -> Path:
    """`path` with its links resolved as far as it exists, the rest as typed (`..` applied): where it is or will be."""
    return Path(os.path.realpath(os.path.expanduser(path)))


def relation(path: str | os.PathLike, other: str | os.PathLike) -> str | None:
    """How `path` lies to `other` (both resolved, whether they exist or not): 'is', 'is inside', 'holds', or None
    when apart."""
    a, b = resolved(path), resolved(other)
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
    p = resolved(path)
    for folder in (p, *p.parents):
        if os.path.lexists(folder / manifest.NAME) or manifest.is_run_folder(folder):
            return folder
    if holds and p.is_dir():
        for found in p.rglob(manifest.NAME):
            return found.parent
    return None


def _is_model(folder: Path) -> str | None:
    """The file that makes `folder` a model's (a pipeline's model_index.json, a component's config.json), else None."""
    if (folder / "model_index.json").is_file():
        return "model_index.json"
    config = folder / "config.json"
    try:
        if config.is_file() and config.stat().st_size < 2**20:
            data = json.loads(config.read_bytes())
            if isinstance(data, dict) and ("_diffusers_version" in data or "architectures" in data):
                return "config.json"
    except (OSError, ValueError):
        pass
    return None


def is_encodings_cache(folder: Path) -> bool:
    """`folder` holds an encoding cache of flux-cp (latents/ or text/ of entries named by their key)."""
    for part in _CACHE_PARTS:
        sub = folder / part
        if sub.is_dir() and not sub.is_symlink():
            try:
                if any(_CACHE_ENTRY.match(p.name) for p in sub.iterdir()):
                    return True
            except OSError:
                pass
    return False


def _tool_folders(cache_dir: str | None) -> list[tuple[str, Path]]:
    """(what, folder) of the folders other tools own: download and package caches, the Python environment."""
    from huggingface_hub import constants

    found = [
        ("the Hugging Face cache (HF_HOME)", constants.HF_HOME),
        ("the Hugging Face hub cache (HF_HUB_CACHE)", constants.HF_HUB_CACHE),
    ]
    if os.environ.get("HF_DATASETS_CACHE"):
        found.append(("the data sets cache (HF_DATASETS_CACHE)", os.environ["HF_DATASETS_CACHE"]))
    if cache_dir:
        found.append(("--cache_dir, the download cache", cache_dir))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    found.append(("pip's cache", os.environ.get("PIP_CACHE_DIR") or os.path.join(xdg, "pip")))
    found.append(("uv's cache", os.environ.get("UV_CACHE_DIR") or os.path.join(xdg, "uv")))
    paths = sysconfig.get_paths()
    for key in ("purelib", "platlib"):
        found.append(("the Python environment's packages (site-packages)", paths[key]))
    if sys.prefix != sys.base_prefix:  # a virtual environment: all of it is the environment's
        found.append(("the Python environment (sys.prefix)", sys.prefix))
    # A cache or environment set to the current folder, the home folder or one above them owns not all of them
    broad = {resolved(os.getcwd()), resolved(os.path.expanduser("~"))}
    broad |= {parent for folder in list(broad) for parent in folder.parents}
    return [(what, resolved(folder)) for what, folder in found if resolved(folder) not in broad]


def foreign_owner(
    path: str | os.PathLike,
    *,
    own_run: str | os.PathLike | None = None,
    runs: bool = True,
    cache_dir: str | None = None,
    skip: tuple[str, ...] = (),
) -> str | None:
    """How `path` (a folder a run writes, which need not exist) lies in a folder another tool owns, e.g. 'is inside
    pip's cache (~/.cache/pip)', else None. `own_run`: this run's output folder, which it may be or lie in; `runs`:
    whether another run's output folder counts; `cache_dir`: --cache_dir; `skip`: folders whose relation to `path` is
    judged elsewhere (the model and the data named by the flags), with a line of their own."""
    p = resolved(path)
    if any(relation(p, other) for other in skip):
        return None
    for what, folder in _tool_folders(cache_dir):
        if p == folder or folder in p.parents:
            return f"{'is' if p == folder else 'is inside'} {what} ({folder})"
    if (CHECKOUT / "flux_cp").is_dir() and (CHECKOUT / "train_flux_cp.py").is_file():
        if p == CHECKOUT:
            return f"is flux-cp's own checkout ({CHECKOUT})"
        for name in CHECKOUT_ENTRIES:
            entry = CHECKOUT / name
            if p == entry or entry in p.parents:
                how = "is" if p == entry else "is inside"
                return f"{how} {entry}, one of flux-cp's own files"
    for folder in (p, *p.parents):
        if folder.is_dir() and (why := _is_model(folder)):
            return f"{'is' if folder == p else 'is inside'} a model folder ({folder}: it holds {why})"
    found = run_folder(p) if runs else None
    if found is not None and (own_run is None or found != resolved(own_run)):
        return f"{'is' if found == p else 'is inside'} the output folder of another run ({found})"
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
    rel = os.path.relpath(resolved(path), resolved(output_dir))
    return None if rel == ".." or rel.startswith(".." + os.sep) else rel


def _not_an_output(flag: str, value: str, path: str, output_dir: str, fix: str) -> str | None:
    """Refuse a folder flag whose `path` is the output folder itself or one of the run's outputs in it (removing or
    rewriting that output would take the folder with it); its place relative to the output folder otherwise."""
    rel = _inside_output(output_dir, path)
    if rel == ".":
        raise UsageError(f"{flag} {value} is the output folder itself: {fix}")
    if rel is not None and (entry := output_entry(rel)):
        raise UsageError(
            f"{flag} {value} {'names' if rel == entry else 'is in'} {entry}, one of the run's own "
            f"outputs in --output_dir {output_dir}: {fix}"
        )
    return rel


def _caches(class_dir: str, encodings: str | None, default_encodings: str | None) -> str | None:
    """How `class_dir` lies to an encoding cache: this run's, the default one, or one found by its content (the class
    folder, a folder it is in, or a folder it holds directly)."""
    for what, cache in (("--encodings_dir", encodings), ("the default encoding cache", default_encodings)):
        if cache and (how := relation(class_dir, cache)):
            return f"{how} {what} {cache}"
    p = resolved(class_dir)
    for folder in (p, *p.parents):
        if is_encodings_cache(folder):
            return f"{'is' if folder == p else 'is inside'} an encoding cache ({folder})"
    if p.is_dir():
        for sub in p.iterdir():
            if sub.is_dir() and not sub.is_symlink() and is_encodings_cache(sub):
                return f"holds an encoding cache ({sub})"
    return None


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
    default_encodings: str | None = None,
    cache_dir: str | None = None,
    seed: str | None = None,
) -> None:
    """Refuse folders whose roles collide (see the module's text), with one line naming both. `model`, `data`: the
    local model and data folders (None or a hub id: skipped), `data_flag` the flag naming the data; `bundled`: the
    folder of the bundled data sets;
    `class_dir`: --class_data_dir with prior preservation; `encodings`: the cache folder when used; `logs`:
    --logging_dir as given (relative to the output folder) when a tracker writes it; `default_encodings`: the default
    cache folder (another run's, which no class folder may be); `cache_dir`: --cache_dir; `seed`: --seed_checkpoint
    when the run writes it (it does not exist yet)."""
    named = (("--pretrained_model_name_or_path", model), (data_flag, data), ("the bundled data", str(bundled)))
    local = {flag: p for flag, p in named if p and os.path.isdir(p)}
    logs_path = os.path.join(output_dir, logs) if logs is not None else None
    if class_dir is not None:
        others = {
            **local,
            **({"--encodings_dir": encodings} if encodings else {}),
            **({"--logging_dir": logs_path} if logs_path else {}),
            "--output_dir": output_dir,
        }
        for flag, other in others.items():
            how = relation(class_dir, other)
            if how:
                raise UsageError(
                    f"--class_data_dir {class_dir} {how} {flag} {other}: the class images need a folder of their own "
                    "(everything in it is read as a class image, and generated ones are written into it): choose "
                    "another --class_data_dir"
                )
        if how := _caches(class_dir, encodings, default_encodings):
            raise UsageError(
                f"--class_data_dir {class_dir} {how}: its files are no class images, and generated ones would be "
                "written among them: choose another --class_data_dir"
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
                raise UsageError(
                    f"--logging_dir {logs} {how} {flag} {other}: the tracker logs would be written "
                    "there; choose a folder of their own"
                )
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
                raise UsageError(
                    f"--encodings_dir {encodings} {how} {flag} {other}: choose a folder of its own for "
                    "the encoding cache"
                )
    # Last, what the lines above do not name: folders of other tools (the model and the data are named above, and the
    # output folder's relation to them by flux_cp.outputs.outdir)
    written = [
        ("--output_dir", output_dir, output_dir),
        ("--class_data_dir", class_dir, class_dir),
        ("--logging_dir", logs, logs_path),
        ("--encodings_dir", encodings, encodings),
        ("--seed_checkpoint", seed, seed),
    ]
    if seed is not None:  # a file the run writes: in none of the run's outputs, nor in the model or the data
        _not_an_output("--seed_checkpoint", seed, seed, output_dir, "name a file of its own")
        for flag, other in local.items():
            if relation(seed, other) == "is inside":
                raise UsageError(
                    f"--seed_checkpoint {seed} is inside {flag} {other}: the run would write it there; name a file of "
                    "its own"
                )
    for flag, value, path in written:
        # (the encodings in --cache_dir: its deprecated use, kept for this release)
        if path is None or (flag == "--encodings_dir" and cache_dir and relation(path, cache_dir) == "is"):
            continue
        how = foreign_owner(
            path, own_run=output_dir, runs=flag != "--class_data_dir", cache_dir=cache_dir, skip=tuple(local.values())
        )
        if how is not None:
            raise UsageError(
                f"--{flag[2:]} {value} {how}: flux-cp writes there, and that folder is not its own; "
                "choose another folder"
            )
