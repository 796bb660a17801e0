"""How a flag is declared and read: `flag()`, a dataclass field that is also the flag `--<field name>`; the value
parsers of the flags that take more than a plain type; and the choices of the flags that name one (the modules that
use them import them from here)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import field
from typing import Any

OPTIMIZERS = ("adamw", "prodigy")
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
WEIGHTING_SCHEMES = ("none", "sigma_sqrt", "logit_normal", "mode", "cosmap")  # diffusers' examples' (flux_cp.data.flow)
LORA_FORMATS = ("diffusers", "kohya")  # flux_cp.families.lora_format
# What each --adapter is called in lines for people (flux_cp.model.adapters trains each)
ADAPTER_LABELS = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr"}
ADAPTERS = tuple(ADAPTER_LABELS)
# Bits per weight of the frozen base that each --base_precision stores (flux_cp.model.precision stores them)
PRECISION_BITS = {"bf16": 16, "fp8": 8, "int8": 8, "nf4": 4}
PRECISIONS = tuple(PRECISION_BITS)


def flag(
    default: Any,
    help: str | Callable[[], str] | None = None,  # noqa: A002 - argparse's name
    *,
    choices: tuple | Callable[[], tuple] | None = None,
    derive: Callable[[dict], Any] | None = None,
    parse: Callable[[str], Any] | None = None,
    repeat: bool = False,
    secret: bool = False,
    const: Any = None,
    record: bool = True,
) -> Any:
    """A dataclass field that is also the flag `--<field name>`.

    help: one line for --help; a flag whose default is None or derived says what it defaults to ("Default: ..."),
        the others get their default appended. help and choices may be functions, called when the parser is built
        (for those read from a registry that may grow after this module is imported: the CP modes). derive:
        computes the value from the other raw flag values when the flag is not given (the parser's default is then
        None, so "not given" is seen). parse: converts the
        command-line string (the field keeps the converted value). repeat: the flag may be given several times (a
        tuple of values). secret: kept out of `Config.flat()`, so out of run_config.json, checkpoints and trackers.
        const: the value of the flag given without one (its value is then optional). record=False: kept out of
        `Config.flat()` too, for a flag whose effect the other flags record (--config)."""
    meta = dict(
        help=help, choices=choices, derive=derive, parse=parse, repeat=repeat, secret=secret, const=const, record=record
    )
    return field(default=default, metadata=meta)


DEFAULT_ENCODINGS_DIR = "~/.cache/flux_cp/encodings"


def boolean(text: str) -> bool:
    """A flag's true/false value (true, false, yes, no, on, off, 1, 0; any case). diffusers' examples parse these
    flags with `type=bool`, which makes every given value true: here `--prodigy_decouple false` turns it off."""
    value = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
    try:
        return value[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false") from None


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def parse_resolutions(text: str) -> tuple[int, ...]:
    """--resolution's value: one size or several, comma-separated ("1024,2048"), kept in ascending order (the same
    set trains the same in any order)."""
    parts = comma_list(text)
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes in pixels, e.g. 1024 or 1024,2048") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes in pixels, e.g. 1024 or 1024,2048")
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} names {', '.join(map(str, twice))} more than once")
    return tuple(sorted(values))


def parse_checkpointing(text: str) -> str:
    """--gradient_checkpointing's value: auto, all, none, or a number of blocks (kept as text: "12")."""
    value = text.strip().lower()
    if value in ("auto", "all", "none"):
        return value
    if value.isdigit():
        return str(int(value))
    raise argparse.ArgumentTypeError(f"{text!r}: give auto, all, none or a number of blocks")


def parse_on_off_auto(text: str) -> str:
    """--compile's value: on, off or auto (true/false, yes/no and 1/0 also read as on/off)."""
    value = text.strip().lower()
    if value == "auto":
        return value
    try:
        return "on" if boolean(value) else "off"
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: give on, off or auto") from None


def parse_offload_blocks(text: str) -> str:
    """--offload_blocks' value: auto, or a number of blocks (kept as text: "12"; none is "0")."""
    value = text.strip().lower()
    if value in ("auto", "none"):
        return "0" if value == "none" else value
    if value.isdigit():
        return str(int(value))
    raise argparse.ArgumentTypeError(f"{text!r}: give auto, none or a number of blocks")


# A hub data set id: `name` or `owner/name` (letters, digits, '-', '_', '.'); anything else is a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_hub_id(name: str) -> bool:
    return _HUB_ID.fullmatch(name) is not None and ".." not in name
