"""`--config FILE`: flags written down in a YAML (.yaml, .yml), TOML (.toml) or JSON (.json) file, by the names they
have on the command line (without `--`).

A file is flat (`learning_rate: 1e-4`) or holds tables named after the config's sections (`[train]`,
`lora:`: the fields of flux_cp.config.flags.Config), each holding only its own section's flags; both may mix, a flag
given once. Values are what the command line takes, in the file's own types: booleans true/false, numbers, strings, a
list for a repeatable flag (`validation_prompt`) and for a list flag (`resolution`, `lora_layers`, `cp_kernels`; their
comma-separated text works too), null for the flag's default. Each value goes through the flag's own parser, so
a wrong type or choice is refused as on the command line, naming the file and the key. Flags on the command line
win over the file; paths are read relative to the current folder, as on the command line.

A run's `run_config.json` is such a file: `--config OUTPUT/run_config.json --output_dir OTHER` repeats the run. Its
keys beside the flags, what the run chose (`RUN_CHOICES`), are accepted and skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flux_cp.config.fields import boolean  # the flags' true/false words
from flux_cp.errors import UsageError

# run_config.json's keys that are what a run chose rather than flags (flux_cp.run.output_phase.Outputs.record_settings):
# read back, they are skipped with a line.
RUN_CHOICES = (
    "layout",
    "checkpointed_blocks",
    "planned_peak_gib",
    "offloaded_blocks",
    "pinned_host_gib",
    "base_weights",
)
FORMATS = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML", ".json": "JSON"}
CONFIG_FLAG = "config"  # the flag naming the file: not read from one (a file names no other file)


def _duplicate_key(where: str, key: str) -> UsageError:
    return UsageError(f"{where}: {key!r} is given twice: keep one")


def _json(text: str, where: str) -> Any:
    def pairs(items: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for k, v in items:
            if k in out:
                raise _duplicate_key(where, k)
            out[k] = v
        return out

    try:
        return json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where} is not valid JSON: {e}") from None


def _yaml(text: str, where: str) -> Any:
    import yaml  # PyYAML: a dependency of accelerate, transformers and datasets

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
        keys = [loader.construct_object(k, deep=True) for k, _ in node.value]
        twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
        if twice is not None:
            raise _duplicate_key(where, str(twice))
        return loader.construct_mapping(node, deep=True)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        raise UsageError(f"{where} is not valid YAML: {' '.join(str(e).split())}") from None


def _toml(text: str, where: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise UsageError(
                f"{where}: reading TOML needs Python 3.11 or the tomli package on Python 3.10 (pip install tomli); "
                "or write the file as YAML or JSON"
            ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{where} is not valid TOML: {e}") from None


_READERS: dict[str, Callable[[str, str], Any]] = {"YAML": _yaml, "TOML": _toml, "JSON": _json}


def read(path: str) -> dict[str, Any]:
    """The file's top level as written: {key: value} (tables of sections not yet flattened)."""
    where = f"--config {path}"
    kind = FORMATS.get(Path(path).suffix.lower())
    if kind is None:
        raise UsageError(f"{where}: name a .yaml, .yml, .toml or .json file (the format is read from the extension)")
    if os.path.isdir(path):
        raise UsageError(f"{where} is a folder: name a .yaml, .toml or .json file")
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except OSError as e:
        raise UsageError(f"{where}: cannot read it ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UsageError(f"{where} is not UTF-8 text (byte {e.object[e.start]:#04x}): save it as UTF-8") from None
    values = _READERS[kind](text, where)
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise UsageError(
            f"{where} holds a {kind} {type(values).__name__}, not a table of flags (e.g. learning_rate: 1e-4)"
        )
    return values


def flattened(values: dict[str, Any], sections: dict[str, set[str]], path: str) -> dict[str, Any]:
    """{flag: value}: the top-level keys, and those of tables named after a section (`sections`: {section: its
    flags}), each checked to be of that section and given once."""
    out: dict[str, Any] = {}
    where = f"--config {path}"
    for key, value in values.items():
        if isinstance(value, dict):
            if key not in sections:
                raise UsageError(
                    f"{where}: {key!r} is a table; tables are named after the config's sections "
                    f"({', '.join(sections)}), or write the flags at the top level"
                )
            for flag, inner in value.items():
                if flag not in sections[key]:
                    home = next((s for s, flags in sections.items() if flag in flags), None)
                    if home is not None:
                        raise UsageError(f"{where}: {key}.{flag}: {flag} is a flag of section {home!r}, not {key!r}")
                    out.setdefault(f"{key}.{flag}", inner)  # unknown: named (with its table) below
                    continue
                if flag in out:
                    raise _duplicate_key(where, flag)
                out[flag] = inner
        else:
            if key in out:
                raise _duplicate_key(where, key)
            out[key] = value
    return out


def _as_text(value: Any) -> str:
    """A scalar as the command line would give it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _value(action: argparse.Action, key: str, value: Any, where: str) -> Any:
    """`value` from the file as the flag's parser makes it (a UsageError naming the file and key otherwise)."""
    if value is None or value == []:  # null, or an empty list of a repeatable flag: the flag's default
        return None
    if isinstance(action, argparse._StoreTrueAction):
        if isinstance(value, bool):
            return value
        try:
            return boolean(str(value))
        except argparse.ArgumentTypeError:
            raise UsageError(f"{where}: {key} is {json.dumps(value)}: give true or false") from None
    repeat = isinstance(action, argparse._AppendAction)
    if isinstance(value, dict):
        raise UsageError(f"{where}: {key} is a table: give a value")
    if isinstance(value, list):
        if not repeat:  # a list flag (--resolution 64,128) takes the list as its comma-separated text
            if any(isinstance(v, (list, dict)) for v in value):
                raise UsageError(f"{where}: {key} holds a nested list: give a list of values")
            value = ",".join(_as_text(v) for v in value)
    items = value if repeat and isinstance(value, list) else [value]
    out = []
    for item in items:
        if isinstance(item, (list, dict)):
            raise UsageError(f"{where}: {key} holds a nested list: give a list of values")
        text = _as_text(item)
        try:
            parsed = action.type(text) if action.type is not None else text
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            kind = {int: "a whole number", float: "a number"}.get(action.type)
            why = f"not {kind}" if kind else str(e)
            raise UsageError(f"{where}: {key} is {json.dumps(item)}: {why}") from None
        if action.choices is not None and parsed not in action.choices:
            import difflib

            close = difflib.get_close_matches(str(parsed), [str(c) for c in action.choices], n=1)
            hint = f": did you mean {close[0]}?" if close else ""
            raise UsageError(
                f"{where}: {key} is {json.dumps(item)}, not one of {', '.join(map(str, action.choices))}{hint}"
            )
        out.append(parsed)
    return out if repeat else out[0]


def flag_values(
    path: str, parser: argparse.ArgumentParser, sections: dict[str, set[str]], closest: Callable[[str], str | None]
) -> tuple[dict[str, Any], list[str]]:
    """({flag: value as the parser makes it} of the flags `path` gives, a null leaving the flag's default, and the
    lines to print: the keys skipped). `closest`: the known flag nearest a misspelt key (the parser's "did you
    mean")."""
    where = f"--config {path}"
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    values = flattened(read(path), sections, path)
    out, skipped = {}, []
    for key, value in values.items():
        if key in RUN_CHOICES:
            skipped.append(key)
            continue
        if key == CONFIG_FLAG:
            raise UsageError(f"{where}: {key!r}: a config file cannot name another one; merge the two files")
        action = actions.get(key)
        if action is None:
            name = key.rsplit(".", 1)[-1]
            close = closest(name)
            hint = f": did you mean {close.removeprefix('--')}?" if close else " (train_flux_cp.py --help lists them)"
            raise UsageError(f"{where}: unknown flag {key!r}{hint}")
        parsed = _value(action, key, value, where)
        if parsed is not None:
            out[key] = parsed
    notes = []
    if skipped:
        notes.append(f"--config {path}: {', '.join(skipped)} skipped (what that run chose, not flags)")
    return out, notes
