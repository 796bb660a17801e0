"""Building a local model folder once, for the tiny models of every family (tests, the embedded default) and the
full-size shapes presets: where they are built (`home`), the lock that lets every rank of a launch ask at once, the
marker that names the recipe a folder was built by and the key of its version (a folder without it is the user's and
is never written; one of another version of the recipe is built again), and the byte-level vocabulary the tiny
tokenizers share. No downloads."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flux_cp.errors import UsageError
from flux_cp.files import apply_umask, read_json

logger = logging.getLogger("flux_cp")


def home() -> Path:
    """Where the tiny models are built: FLUX_CP_HOME, else ~/.cache/flux_cp."""
    return Path(os.environ.get("FLUX_CP_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "flux_cp"))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-to-printable-character table: the characters of the tiny byte-level vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


# Written into every folder build_once makes: which recipe built it. A folder holding it is one this module built
# (reused when the recipe matches); a folder without it is the user's and is never written.
MARKER = ".flux_cp_tiny.json"


@dataclass(frozen=True)
class Recipe:
    """What a built folder holds: the recipe's `name` (with its version), the pipeline class model_index.json
    names and the transformer config it carries (to recognise a copy built before the marker existed). `builder`:
    the module that builds it, whose code and configs are part of the recipe's key (`recipe_key`)."""

    name: str
    pipeline: str
    transformer: dict
    builder: str = ""


def recipe_key(recipe: Recipe) -> str:
    """The key of what builds a recipe's folder: its name, pipeline and transformer config, and the content of the
    module that builds it and of this one (their configs and code: any change to them builds the folder again)."""
    h = hashlib.sha256(json.dumps([recipe.name, recipe.pipeline, recipe.transformer], default=str).encode())
    for module in (recipe.builder, __file__):
        if module:
            h.update(Path(module).read_bytes())
    return h.hexdigest()[:16]


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def _is_built(path: Path, recipe: Recipe) -> bool:
    """`path` holds the model `recipe` builds: written by build_once (its marker, with this version's key), or by a
    version before the marker (model_index.json and the transformer's config are the recipe's)."""
    if not (path / "model_index.json").is_file():
        return False
    marker = read_json(path / MARKER)
    if marker is not None:
        return (
            isinstance(marker, dict) and marker.get("recipe") == recipe.name and marker.get("key") == recipe_key(recipe)
        )
    index, config = read_json(path / "model_index.json"), read_json(path / "transformer" / "config.json")
    return (
        isinstance(index, dict)
        and index.get("_class_name") == recipe.pipeline
        and isinstance(config, dict)
        and all(config.get(k) == _plain(v) for k, v in recipe.transformer.items())
    )


def _stale(path: Path, recipe: Recipe) -> bool:
    """`path` holds the model of this recipe built by another version of it (its marker names the recipe, with
    another key): build_once's own, to build again."""
    marker = read_json(path / MARKER) if not path.is_symlink() else None
    return isinstance(marker, dict) and marker.get("recipe") == recipe.name and marker.get("key") != recipe_key(recipe)


def _check_target(path: Path, recipe: Recipe) -> bool:
    """Whether `path` holds the model already (True), or is new or empty or built by another version of the recipe
    (False, to build); any other folder is refused with a UsageError: the builder writes only into a new or empty
    folder, or one it built before."""
    if _is_built(path, recipe):
        return True
    if not os.path.lexists(path):
        return False
    if path.is_symlink() or not path.is_dir():
        raise UsageError(f"--out {path} is {'a link' if path.is_symlink() else 'a file'}: choose a new or empty folder")
    names = sorted(p.name for p in path.iterdir())
    if not names or _stale(path, recipe):
        return False
    marker = read_json(path / MARKER)
    if isinstance(marker, dict) and (path / "model_index.json").is_file():
        raise UsageError(
            f"--out {path} holds the model of another recipe ({marker.get('recipe')}, not "
            f"{recipe.name}): choose another --out"
        )
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise UsageError(
        f"--out {path} holds files this builder did not write ({shown}): it writes only into a new or "
        "empty folder, or one it built before; choose another --out"
    )


def build_once(path: Path, write: Callable[[Path], None], recipe: Recipe) -> Path:
    """The model folder `path`, written by `write(folder)` unless it holds the model of `recipe` already. Only a
    new or empty folder is written (any other is refused: `_check_target`). Safe when several processes call it at
    once (every rank of a launch does): one builds under a file lock while the others wait and then find the
    finished folder. The build goes to a temporary sibling, which is renamed into place once complete (with the
    marker naming the recipe), so a crash mid-build leaves no half-written folder."""
    path = Path(path)
    if _check_target(path, recipe):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Opened without following a link (a link named like the lock must not redirect the open) and not truncated.
    lock_path = path.parent / f".{path.name}.lock"
    try:
        fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        raise UsageError(
            f"cannot open {lock_path} ({e.strerror or e}): remove it (a link?), or set FLUX_CP_HOME"
        ) from None
    with open(fd, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _check_target(path, recipe):
            return path
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        old = path.parent / f".{path.name}.old"
        try:
            write(tmp)
            marker = {"written_by": "flux_cp.tiny", "recipe": recipe.name, "key": recipe_key(recipe)}
            (tmp / MARKER).write_text(json.dumps(marker) + "\n")
            apply_umask(tmp)
            if _stale(path, recipe):  # this builder's, of another version: replaced whole
                logger.info(f"{path} was built by another version of {recipe.name}: built again")
                shutil.rmtree(old, ignore_errors=True)
                os.rename(path, old)
            os.rename(tmp, path)  # replaces an empty folder; a folder filled meanwhile makes it fail
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
    return path


# black-forest-labs/FLUX.1-dev's scheduler (scheduler/scheduler_config.json), which FLUX.2's conversion script saves
# too (use_dynamic_shifting: the pipelines pass `mu` from compute_empirical_mu): every tiny model's.
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)

# The tiny VAEs' layers: 4 blocks, the same 8x spatial compression as the real VAEs, so --resolution means the same.
TINY_VAE_LAYERS = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 16, 16, 16),
    layers_per_block=1,
)
