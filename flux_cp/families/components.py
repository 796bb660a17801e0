"""A model folder's components, read for the families and the trainer: where a component's files are, the fingerprint
of its weights, the configs it declares, and loading one (one error line for what a damaged or foreign folder
raises)."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flux_cp.errors import UsageError
from flux_cp.random_weights import WEIGHT_SUFFIXES, build_random, has_weight_files, name_seed

if TYPE_CHECKING:
    from flux_cp.config.training import ModelConfig

logger = logging.getLogger("flux_cp")


def pipeline_class(path: str, revision: str | None, cache_dir: str | None = None) -> str | None:
    """The pipeline class a model folder or hub id declares in model_index.json (e.g. FluxKontextPipeline);
    None when there is none to read (a bare transformer folder, no network). `cache_dir`: the download cache."""
    from diffusers import DiffusionPipeline

    try:
        config = DiffusionPipeline.load_config(path, revision=revision, cache_dir=cache_dir)
    except (OSError, ValueError):
        return None
    return config.get("_class_name") if isinstance(config, dict) else None


def load_component(cls, path: str, subfolder: str, revision: str | None, **kwargs):
    """`cls.from_pretrained` of one component (subfolder) of the model at `path`; kwargs go to it (`cache_dir`: the
    download cache, --cache_dir). A failure is one UsageError line."""
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    try:
        return cls.from_pretrained(path, subfolder=subfolder, revision=revision, **kwargs)
    # What a damaged or foreign folder raises from inside the libraries (a weight of another shape, a config of
    # sizes that do not fit together or of a wrong type, a damaged file): one line naming the component
    except (
        OSError,
        ValueError,
        RuntimeError,
        TypeError,
        IndexError,
        KeyError,
        ZeroDivisionError,
        SafetensorError,
        StrictDataclassError,
    ) as e:
        raise UsageError(f"cannot load {subfolder} from --pretrained_model_name_or_path {path}: {cause(e)}") from None


def cause(e: BaseException) -> str:
    """An error's message on one line: its first line, with the next when the first only introduces it (ends in
    ':')."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__]
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def load_part(cls, path: str, subfolder: str, model: ModelConfig, weights_dtype: torch.dtype, **kwargs):
    """A component other than the transformer (VAE, text encoder) into host memory: `load_component`, or with
    `--transformer_init random` and a component folder holding a config but no weight files (the full-size shapes
    presets of flux_cp.tiny) built from that config with random weights in `weights_dtype`, the same in every run
    (flux_cp.random_weights)."""
    if model.transformer_init == "random":
        folder = component_folder(path, subfolder, model.revision, model.cache_dir)
        if folder is not None and (folder / "config.json").is_file() and not has_weight_files(folder):
            if hasattr(cls, "config_class"):  # transformers
                config = cls.config_class.from_pretrained(folder)
            else:
                config = dict(cls.load_config(folder))
            logger.info(f"{subfolder}: no weights in {folder}, built from its config with random weights")
            return build_random(cls, config, weights_dtype, torch.device("cpu"), name_seed(subfolder))
    return load_component(cls, path, subfolder, model.revision, **kwargs)


def transformer_config(path: str, cls: type, revision: str | None, cache_dir: str | None) -> dict:
    """The transformer's config.json (of diffusers class `cls`), with the class's defaults for what it leaves out (as
    the model gets them)."""
    try:
        config = cls.load_config(path, subfolder="transformer", revision=revision, cache_dir=cache_dir)
    except (OSError, ValueError) as e:
        first = str(e).splitlines()[0]
        raise UsageError(f"cannot load transformer from --pretrained_model_name_or_path {path}: {first}") from None
    if not isinstance(config, dict):
        kind = type(config).__name__
        raise UsageError(
            f"--pretrained_model_name_or_path {path}: its transformer/config.json is a JSON {kind}, not an object of "
            "settings"
        )
    return with_class_defaults(dict(config), cls)


def with_class_defaults(config: dict, cls: type) -> dict:
    """`config` with `cls`'s defaults for the arguments it leaves out."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {**{p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}, **config}


# A component's weight files are identified by content: where the hub cache holds them, by their blob's name (the
# content's SHA-256); elsewhere by their size, their safetensors header (names, shapes, dtypes, offsets) and
# FINGERPRINT_BLOCKS blocks of FINGERPRINT_BLOCK bytes spread through each file: a copied folder keeps its identity,
# weights saved again (any training changes them all) get another. Hashing every byte of tens of GB at each start
# would cost tens of seconds.
FINGERPRINT_BLOCKS = 64


FINGERPRINT_BLOCK = 64 * 1024


def component_folder(path: str, subfolder: str, revision: str | None, cache_dir: str | None = None) -> Path | None:
    """The local folder of a model component: `path/subfolder` of a model folder, or the hub cache's snapshot of a hub
    id (no network: it was just loaded from there); None when there is none."""
    if os.path.isdir(path):
        folder = Path(path) / subfolder
        return folder if folder.is_dir() else None
    try:
        from huggingface_hub import snapshot_download

        root = snapshot_download(
            path, revision=revision, cache_dir=cache_dir, local_files_only=True, allow_patterns=[f"{subfolder}/*"]
        )
    except Exception:  # noqa: BLE001 - not in the cache: the component is identified by its config alone
        return None
    folder = Path(root) / subfolder
    return folder if folder.is_dir() else None


def weights_fingerprint(folder: Path | None) -> str:
    """The content identity of the weight files in `folder` ("" for none; see FINGERPRINT_BLOCKS)."""
    if folder is None:
        return ""
    h = hashlib.sha256()
    for file in sorted(p for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file()):
        real = Path(os.path.realpath(file))
        h.update(f"{file.name}\0".encode())
        if real.parent.name == "blobs":  # huggingface_hub's cache: the blob is named by its content's hash
            h.update(real.name.encode())
            continue
        size = real.stat().st_size
        h.update(f"{size}\0".encode())
        with open(real, "rb") as f:
            if file.suffix == ".safetensors" and size >= 8:
                n = min(int.from_bytes(f.read(8), "little"), size - 8, 64 * 2**20)
                h.update(f.read(n))
            for k in range(FINGERPRINT_BLOCKS):
                f.seek(size * k // FINGERPRINT_BLOCKS)
                h.update(f.read(FINGERPRINT_BLOCK))
    return h.hexdigest()[:16]


def model_fingerprint(module: torch.nn.Module, folder: Path | None) -> str:
    """Identifies a component: its config (what it computes) and the content of its weight files in `folder`
    (`component_folder`; `weights_fingerprint`). Neither the path it was loaded from nor the files' times."""
    h = hashlib.sha256()
    cfg = getattr(module, "config", None)
    if cfg is not None:
        d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
        for key in ("_name_or_path", "_commit_hash", "transformers_version", "_diffusers_version"):
            d.pop(key, None)
        h.update(json.dumps(d, sort_keys=True, default=str).encode())
    h.update(weights_fingerprint(folder).encode())
    return h.hexdigest()[:16]


def files_fingerprint(folder: Path | None) -> str:
    """The content of every file in `folder` (a tokenizer's vocabulary, merges, chat template: small), hashed whole;
    "" for none."""
    if folder is None:
        return ""
    h = hashlib.sha256()
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        h.update(f"{file.name}\0".encode())
        with open(file, "rb") as f:
            while block := f.read(2**20):
                h.update(block)
    return h.hexdigest()[:16]
