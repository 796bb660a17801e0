"""The command line of `train_flux_cp.py`: the parser built from the flag table (`--help` grouped by section, every
flag's help ending with its default), one-line errors (an unknown or misspelt flag gets the closest known one), flags
from a `--config` file, the demo's settings (and a resumed demo's, from its checkpoint), derived defaults and the
checks; `parse_config` gives the `Config` a run uses."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import sys
import types
import typing
from typing import Any

from flux_cp.checkpoint_folders import named_folder, saved_run
from flux_cp.config import file as config_file
from flux_cp.config.demo import DEMO_FLAGS, DEMO_KEY, DEMO_OFF_FLAGS, DEMOS, Demo, demo_of, is_embedded, same_folder
from flux_cp.config.flags import Config
from flux_cp.config.paths import as_typed
from flux_cp.config.ranges import given_flags, unused_flags
from flux_cp.errors import UsageError
from flux_cp.terminal import printable


def _resumed_demo(raw: dict) -> tuple[Demo, str, dict] | None:
    """When these flags resume a run of a demo (the embedded default on its data set, as its checkpoint records
    them): (the demo, the checkpoint, {flag: the checkpoint's value} of the flags the demo sets and these flags do
    not give). A step count given to extend it then keeps the demo's batch, learning rate and validation images, as
    the run had them. Reads the checkpoint's meta.json only; None for anything else."""
    if not is_embedded(raw) or raw["resume_from_checkpoint"] is None:
        return None
    demo = next((d for d in DEMOS if same_folder(raw["dataset_name"], d.data)), None)
    if demo is None:
        return None
    saved = saved_run(raw["resume_from_checkpoint"], raw["output_dir"])
    if saved is None:
        return None
    path, meta = saved
    args = meta.get("args") or {}
    # Checkpoints name their demo; older ones are recognised by the demo's batch and validation prompts.
    prompts = args.get("validation_prompt")
    prompts = tuple(prompts) if isinstance(prompts, list) else prompts
    same = (args.get("train_batch_size"), prompts or ()) == (demo.batch, demo.prompts)
    was = meta.get("demo", demo.name if same else None)
    if was != demo.name or args.get("pretrained_model_name_or_path") is not None:
        return None
    kept = {
        f: tuple(args[f]) if isinstance(args[f], list) else args[f] for f in DEMO_FLAGS if raw[f] is None and f in args
    }
    for flag, value in kept.items():
        if not _DEMO_FLAG_TYPES[flag](value):
            raise UsageError(
                f"--resume_from_checkpoint {path}: meta.json's args.{flag} is {printable(repr(value))[:80]}, not a "
                f"value of --{flag}; the checkpoint is damaged or was not written by train_flux_cp.py: give --{flag}, "
                "or resume from another checkpoint-N folder"
            )
    return demo, str(path), kept


def _strings(value: object) -> bool:
    return value is None or (isinstance(value, tuple) and all(isinstance(v, str) for v in value))


# What each of DEMO_FLAGS may hold, as a resumed demo takes it from its checkpoint's meta.json
_DEMO_FLAG_TYPES = {
    "max_train_steps": lambda v: v is None or (type(v) is int),
    "learning_rate": lambda v: type(v) in (int, float),
    "train_batch_size": lambda v: type(v) is int,
    "validation_prompt": _strings,
    "validation_image": _strings,
}


# Argument-group titles of --help, in the order sections appear there.
_TITLES = {
    "model": "model",
    "data": "data",
    "train": "training",
    "lora": "LoRA / full fine-tuning",
    "parallel": "parallelism",
    "checkpoints": "checkpoints",
    "validation": "validation and logging",
    "hub": "Hugging Face Hub",
    "plan": "memory plan",
    "cp_tuning": "advanced: CP tuning",
}


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(Config)
    return [(name, hints[name]) for name in _TITLES]


def _scalar_type(annotation: Any) -> type:
    """int / float / str of an annotation such as `int | None` or `tuple[str, ...] | None`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _scalar_type(args[0])
    if typing.get_origin(annotation) is tuple:
        return args[0]
    return annotation


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default: its own "Default: ..." sentence (flags whose default is None or
    derived from other flags), else argparse's "(default: X)", "(default: off)" for a switch."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "Default:" in text:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: an unknown flag gets the closest known one ("did you mean
    --learning_rate?"), and argparse's own errors (a bad choice or number) are a UsageError instead of the usage
    block, so that under `accelerate launch` one rank prints one line (flux_cp.run.runner)."""

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001 - argparse's signature
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            raise UsageError(self._unknown(unknown))
        return parsed

    def error(self, message: str):  # noqa: ANN201 - argparse's signature
        bad = re.match(r"argument (--\w+): invalid choice: '([^']*)'", message)
        choices = next((a.choices for a in self._actions if bad and bad.group(1) in a.option_strings), None)
        close = difflib.get_close_matches(bad.group(2), [str(c) for c in choices], n=1) if choices else []
        if close:
            raise UsageError(f"{message}: did you mean {close[0]}?")
        raise UsageError(f"{message} ({self.prog} --help lists every flag)")

    def closest(self, given: str) -> str | None:
        """The flag `given` (--learning-rate, -learning_rate, learning_rate) stands for, or the known flag closest to
        it (a misspelling), as `--name`; None when none is close."""
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        name = "--" + given.lstrip("-").replace("-", "_")
        close = [name] if name in known else difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        return close[0] if close else None

    def _unknown(self, unknown: list[str]) -> str:
        flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-") and len(u) > 1]
        if not flags:
            return (
                f"unexpected argument {unknown[0]!r}: every value follows its flag (e.g. --resolution 1024); "
                f"{self.prog} --help lists every flag"
            )
        parts = []
        for given in flags:
            close = self.closest(given)
            parts.append(f"{given}: did you mean {close}?" if close else given)
        more = "" if all("did you mean" in p for p in parts) else f" ({self.prog} --help lists every flag)"
        return f"unknown flag{'s' if len(parts) > 1 else ''} " + "; ".join(parts) + more


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="train_flux_cp.py",
        description="Fine-tune FLUX.1, FLUX.1 Kontext and FLUX.2 ([dev], [klein]) models (LoRA or full) with context "
        "parallelism. With no model and no data flags it trains a tiny FLUX.1 built locally on the bundled data set "
        "(the embedded default).",
        allow_abbrev=False,  # a misspelt flag is named (did you mean ...?), never taken for the flag it begins
        formatter_class=_HelpFormatter,
    )
    for name, section in _sections():
        group = p.add_argument_group(_TITLES[name])
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            m, kind = f.metadata, _scalar_type(hints[f.name])
            kw: dict[str, Any] = {"help": m["help"]() if callable(m["help"]) else m["help"]}
            if kind is bool and not m["parse"]:  # a switch; a boolean with `parse` takes a value (true/false)
                if f.default is not False:  # a switch turns something on; name it for that (e.g. --no_cache)
                    raise TypeError(f"{section.__name__}.{f.name}: boolean flags must default to False")
                kw["action"] = "store_true"
            else:
                # argparse also passes a string default through `type`: a parsed field shows its default as text.
                kw["type"] = m["parse"] or kind
                kw["default"] = None if m["derive"] else f.default
                if m["parse"] and isinstance(f.default, tuple) and not m["derive"]:
                    kw["default"] = ",".join(map(str, f.default))
                if m["choices"]:
                    kw["choices"] = m["choices"]() if callable(m["choices"]) else m["choices"]
                if m["const"] is not None:
                    kw["nargs"], kw["const"] = "?", m["const"]
                if m["repeat"]:
                    kw["action"] = "append"
            group.add_argument(f"--{f.name}", **kw)
    return p


def parse_config(argv: list[str] | None = None) -> Config:
    """Parse the flags once, resolve derived defaults, check them; the Config the whole run uses."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    raw = dict(vars(parser.parse_args(argv)))
    given = given_flags(parser, argv)
    file_notes, from_file = _read_config_file(raw, parser, given) if raw["config"] is not None else ([], set())
    off = tuple(f for f in DEMO_OFF_FLAGS if raw[f] is not None)  # given: none of them has a default before derive
    if raw["instance_data_dir"] is not None:  # diffusers' DreamBooth name of a local --dataset_name
        if raw["dataset_name"] is not None:
            raise UsageError("--dataset_name and --instance_data_dir both name the training data: give one of them")
        raw["dataset_name"] = raw["instance_data_dir"]
    # a bare checkpoint name is a folder of --output_dir (as diffusers' examples read it), said below
    raw["resume_from_checkpoint"], resume_note = named_folder(raw["resume_from_checkpoint"], raw["output_dir"])
    raw[DEMO_KEY] = demo_of(raw)  # the embedded default on a bundled data set with no step count (the README's demos)
    resumed = _resumed_demo(raw)  # ... or a resume of such a run, which keeps its settings (a step count extends it)
    if resumed is not None:
        raw[DEMO_KEY], demo_from, kept = resumed
        raw.update(kept)
    else:
        demo_from = None
    sections = {}
    for name, section in _sections():
        values = {}
        for f in dataclasses.fields(section):
            m, value = f.metadata, raw[f.name]
            if value is None and m["derive"]:
                value = raw[f.name] = m["derive"](raw)  # later derivations see it (validation <- resolution)
            elif isinstance(value, list):  # a repeated flag
                value = tuple(value)
            values[f.name] = value
        sections[name] = section(**values)
    off = off if is_embedded(raw) and raw[DEMO_KEY] is None else ()
    # empty paths refused, "~" expanded (said below)
    try:
        parsed = Config(**sections, demo=raw[DEMO_KEY], demo_off=off, demo_from=demo_from, given=tuple(sorted(given)))
        config, notes = as_typed(parsed)
        config.check()
    except UsageError as e:
        flag = re.match(r"--(\w+)", str(e))
        if flag is None or flag.group(1) not in from_file:
            raise
        raise UsageError(f"{e} (--{flag.group(1)} is from --config {raw['config']})") from None
    if os.environ.get("RANK", "0") == "0":
        for warning in unused_flags(given, config.flat()) + _setting_warnings(config, given):
            print(f"warning: {warning}", file=sys.stderr)
        for note in file_notes + notes + ([resume_note] if resume_note else []):
            print(f"flux-cp: {note}", file=sys.stderr)
    return config


def _read_config_file(raw: dict, parser: _Parser, given: set[str]) -> tuple[list[str], set[str]]:
    """--config: the file's flags into `raw` where the command line did not give them (flux_cp.config.file); the
    flags it sets to other than their defaults (derived ones left out: run_config.json records every flag) added to
    `given`, for the warnings about flags without effect. Returns the lines to print and the flags taken from it."""
    fields = {name: {f.name: f for f in dataclasses.fields(section)} for name, section in _sections()}
    sections = {name: set(flags) for name, flags in fields.items()}
    path = os.path.expanduser(raw["config"])  # as every path flag ('~' left as typed after '=': flux_cp.config.paths)
    values, notes = config_file.flag_values(path, parser, sections, parser.closest)
    data = ("dataset_name", "instance_data_dir")
    if values.get("instance_data_dir") is not None and values.get("dataset_name") == values["instance_data_dir"]:
        del values["dataset_name"]  # run_config.json records --instance_data_dir as both
    if given & set(data):  # the command line names the data: the file's choice of either gives way
        values = {k: v for k, v in values.items() if k not in data}
    by_name = {name: f for flags in fields.values() for name, f in flags.items()}
    taken = {name for name in values if name not in given}
    for name in taken:
        value = values[name]
        raw[name] = value
        f = by_name[name]
        default = f.default
        if not f.metadata["derive"] and (tuple(value) if isinstance(value, list) else value) != default:
            given.add(name)
    return notes, taken


def _setting_warnings(config: Config, given: set[str]) -> list[str]:
    """Settings that run, but probably not as meant: the deprecated use of --cache_dir, and Prodigy's learning rate
    (as diffusers' examples warn)."""
    out = []
    data, train = config.data, config.train
    if "cache_dir" in given and "encodings_dir" not in given and not data.no_cache:
        out.append(
            f"--cache_dir {config.model.cache_dir} now holds downloaded models and hub data sets (as in diffusers' "
            "examples); the encodings also go there, as before, for this release only: pass --encodings_dir "
            f"{config.model.cache_dir} to keep them there (or name another folder)"
        )
    if train.optimizer == "prodigy" and train.learning_rate <= 0.1:
        out.append(
            f"--learning_rate {train.learning_rate:g} is low for --optimizer prodigy: its learning rate is a factor on "
            "the step size it estimates itself, and around 1.0 is usual"
        )
    return out
