"""The paths and names a run is given, used as typed: an empty value is refused (an empty --output_dir was the
current folder, an empty --logging_dir the output folder itself, an empty --encodings_dir the default one), and a
leading '~' that the shell left as typed (after '=', or in quotes) is expanded for every path flag alike, with a
line saying so (before, --encodings_dir expanded it and --output_dir made a folder named '~'). The Config then
holds the values used, so run_config.json records them."""

from __future__ import annotations

import dataclasses
import os
from typing import TypeVar

from flux_cp.errors import UsageError

Config = TypeVar("Config")  # flux_cp.config.flags.Config, which parses the flags with this module's help

PATHS = (
    "pretrained_model_name_or_path",
    "cache_dir",
    "dataset_name",
    "instance_data_dir",
    "class_data_dir",
    "encodings_dir",
    "output_dir",
    "logging_dir",
    "seed_checkpoint",
    "resume_from_checkpoint",
    "validation_image",
    "network_weights",
    "config",
)
# Names that mean nothing when empty (a revision, a column, a repository, the LoRA's layers)
NAMES = (
    "revision",
    "variant",
    "hub_model_id",
    "dataset_config_name",
    "image_column",
    "caption_column",
    "cond_image_column",
    "lora_layers",
)


def _expanded(flag: str, value: str) -> str:
    if not value.startswith("~"):
        return value
    path = os.path.expanduser(value)
    if path.startswith("~"):
        user = value[1:].split("/", 1)[0]
        raise UsageError(f"--{flag} {value}: there is no user {user!r} whose home '~{user}' would stand for")
    return path


def as_typed(config: Config) -> tuple[Config, list[str]]:
    """`config` with '~' expanded in its path flags, and a line for each expansion; a UsageError for an empty path
    or name."""
    notes, sections = [], {}
    for section_field in dataclasses.fields(config):
        if section_field.metadata.get("resolution"):  # the demo's entries, not flags
            continue
        section, changes = getattr(config, section_field.name), {}
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if f.name not in PATHS + NAMES or value is None:
                continue
            values = value if isinstance(value, tuple) else (value,)
            if not values or any(not str(v).strip() for v in values):
                what = "a path" if f.name in PATHS else "a value"
                raise UsageError(f"--{f.name} is empty: give {what}, or leave the flag out for its default")
            if f.name in PATHS:
                used = tuple(_expanded(f.name, v) for v in values)
                if used != values:
                    changes[f.name] = used if isinstance(value, tuple) else used[0]
                    if not (f.name == "dataset_name" and config.data.instance_data_dir is not None):  # said once
                        notes.append(
                            f"--{f.name} {' '.join(values)} is {' '.join(used)}: '~' expanded (the shell "
                            "leaves it as typed after '=' or in quotes)"
                        )
        if changes:
            sections[section_field.name] = dataclasses.replace(section, **changes)
    return dataclasses.replace(config, **sections), notes
