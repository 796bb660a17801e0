"""A model folder's configs checked before anything is built from them: a size that is not a positive integer ends
in a raw error deep inside diffusers or transformers, and a size of hundreds of millions builds for hours.

For every component the run loads (the transformer, the VAE, the text encoders; which keys each has is the family's
`Family.config_sizes`), each size in its config.json must be an integer (a number, for a ratio) within its bounds,
which are generous: about ten times the family's largest released model. The family's rules across keys and
components follow (`Family.config_rules`: RoPE's axes fill a head, the transformer takes the VAE's packed latents
and the text encoders' widths). Where the component's weight files are on this machine, their safetensors headers are
read (no tensor is loaded) and must agree with the config: the shapes the family names (`Family.weight_shapes`) and
the number of blocks or layers (`Family.weight_layers`); a file that is not whole (a truncated or damaged header, data
shorter than the header says) is named too. Every problem is one line naming the file and the key.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from flux_cp.errors import UsageError
from flux_cp.families.components import component_folder
from flux_cp.terminal import printable

if TYPE_CHECKING:
    from flux_cp.config.training import ModelConfig
    from flux_cp.families.base import Family

HEADER_LIMIT = 100 * 2**20  # safetensors' own limit on a header's size
CONFIG_LIMIT = 2**20  # a config.json larger than this is no model's


def _lookup(config: dict, key: str) -> tuple[bool, object]:
    """(present, value) of a dotted `key` of a nested config."""
    value: object = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _fits(value: object, low: float, high: float) -> bool:
    """An integer in [low, high] (a number, when `high` is a float)."""
    if isinstance(value, bool):
        return False
    if isinstance(high, float):
        return isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high
    return isinstance(value, int) and low <= value <= high


def check_sizes(config: dict, sizes: dict[str, tuple[float, float]], where: str, label: str) -> None:
    """Refuse the first key of `sizes` that `config` holds outside its bounds (a list: any element outside them); None
    values are a class default's, left to the class. `where`: the config file; `label`: the family."""
    for key, (low, high) in sizes.items():
        present, value = _lookup(config, key)
        if not present or value is None:
            continue
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not values or not all(_fits(v, low, high) for v in values):
            kind = "a number" if isinstance(high, float) else "an integer"
            each = " (each of its values)" if isinstance(value, (list, tuple)) else ""
            shown = printable(json.dumps(value, default=str))[:80]
            raise UsageError(
                f"{where}: {key} is {shown}; it must be {kind} from {low:g} to {high:g}{each}, a size a {label} "
                "model can have (with room to spare): fix the file, or pass another --pretrained_model_name_or_path"
            )


def read_config(folder: Path) -> dict:
    """A component's config.json (a UsageError naming it when it is not a JSON object of a sane size)."""
    path = folder / "config.json"
    try:
        if path.stat().st_size > CONFIG_LIMIT:
            raise UsageError(f"{path} is {path.stat().st_size} bytes: no model's config is that large")
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} cannot be read ({type(e).__name__}: {printable(e)})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} is a JSON {type(data).__name__}, not an object of settings")
    return data


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor: shape} from a safetensors file's header, without loading any tensor; a UsageError naming the file when
    its header cannot be read or its data is shorter than the header says (a truncated download)."""

    def damaged(why: str) -> UsageError:
        return UsageError(f"{path} is not a whole safetensors file ({why}): download or copy it again")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > min(HEADER_LIMIT, size - 8):
                raise damaged(f"{size} bytes, with no header of a readable size")
            header = json.loads(f.read(n))
    except OSError as e:
        raise UsageError(f"{path} cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise damaged(f"its header is no JSON: {printable(e)}") from None
    if not isinstance(header, dict):
        raise damaged("its header is no JSON object")
    shapes, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        ok = isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
        if not ok or not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise damaged(f"tensor {printable(name)!r} has no valid shape and offsets")
        shapes[name] = tuple(shape)
        end = max(end, offsets[1])
    if end > size - 8 - n:
        raise damaged(f"its tensors need {8 + n + end} bytes, the file has {size}")
    return shapes


_INDEX = re.compile(r"^(?P<stem>.+)\.safetensors\.index(\.(?P<variant>[^.]+))?\.json$")
_SINGLE = ("diffusion_pytorch_model", "model")


def weight_shapes(folder: Path, variant: str | None = None) -> dict[str, tuple[int, ...]] | None:
    """{tensor: shape} of a component folder's safetensors weights as diffusers and transformers read them (a sharded
    checkpoint's index names its files; `variant`: e.g. fp16), None when it holds none (a config alone)."""
    for index in sorted(folder.glob("*.safetensors.index*.json")):
        m = _INDEX.match(index.name)
        if not m or m.group("variant") != variant:
            continue
        try:
            data = json.loads(index.read_bytes()) if index.stat().st_size <= HEADER_LIMIT else None
        except (OSError, ValueError) as e:
            raise UsageError(f"{index} cannot be read ({type(e).__name__}: {printable(e)})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UsageError(f"{index} has no 'weight_map' of tensor names to file names: download or copy it again")
        shapes: dict[str, tuple[int, ...]] = {}
        for name in sorted(set(weight_map.values())):
            if os.path.basename(name) != name or name in (".", ".."):
                raise UsageError(f"{index} names {printable(name)!r}, not a file of its folder")
            if not (folder / name).is_file():
                raise UsageError(f"{index} names {printable(name)}, which {folder} does not hold: download it again")
            shapes.update(safetensors_shapes(folder / name))
        return shapes
    for stem in _SINGLE:
        path = folder / (f"{stem}.{variant}.safetensors" if variant else f"{stem}.safetensors")
        if path.is_file():
            return safetensors_shapes(path)
    return None


def check_weights(family: Family, component: str, folder: Path, config: dict, variant: str | None) -> None:
    """The component's weight files (when the folder holds any) agree with its config: the family's shapes, and its
    number of blocks or layers."""
    shapes = weight_shapes(folder, variant)
    if shapes is None:
        return
    where = f"{folder}/config.json"
    for name, want in family.weight_shapes(component, config).items():
        got = shapes.get(name)
        if got is not None and got != tuple(want):
            raise UsageError(
                f"{where} does not match its weights: {name} is {list(got)} in the weight files, {list(want)} for "
                "this config: the config or the weights are another model's; use the folder's own files"
            )
    for prefix, key, exact in family.weight_layers(component):
        count = _lookup(config, key)[1]
        pattern = re.compile("^" + re.escape(prefix).replace(r"\{\}", r"(\d+)") + r"\.")
        found = {int(m.group(1)) for name in shapes if (m := pattern.match(name))}
        if not found or not isinstance(count, int):
            continue
        held = max(found) + 1
        if held < count or (exact and held != count):
            raise UsageError(
                f"{where} does not match its weights: {key} is {count}, and the weight files hold {held} "
                f"({prefix.replace('{}', 'N')}): the config or the weights are another model's; use the folder's own "
                "files"
            )


def check_model(family: Family, path: str, transformer: dict, model: ModelConfig, *, weights: bool = True) -> None:
    """Check the model at `path` before anything is built from it (see the module's text): the transformer's config
    `transformer` (read already) and every other component whose config is on this machine. `weights`: compare the
    weight files with the configs too (not for --plan, which reads no weights)."""
    configs = {"transformer": transformer}
    folders = {}
    for component, sizes in family.config_sizes.items():
        folder = component_folder(path, component, model.revision, model.cache_dir)
        if component != "transformer":
            if folder is None or not (folder / "config.json").is_file():
                continue
            configs[component] = read_config(folder)
        where = f"{folder}/config.json" if folder is not None else f"{path} {component}/config.json"
        check_sizes(configs[component], sizes, where, family.label)
        folders[component] = folder
    for component, key, why in family.config_rules(configs):
        folder = folders.get(component)
        where = f"{folder}/config.json" if folder is not None else f"{path} {component}/config.json"
        raise UsageError(f"{where}: {key} {why}: fix the file, or pass another --pretrained_model_name_or_path")
    if not weights:
        return
    for component, folder in folders.items():
        if folder is None or (component == "transformer" and model.transformer_init == "random"):
            continue
        check_weights(family, component, folder, configs[component], model.variant)
