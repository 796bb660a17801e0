"""Writes docs/flags.md, the reference of every flag of `train_flux_cp.py`, from the flag table itself
(flux_cp/config/): the parser's sections in --help's order, and for each flag its type or choices, its default and
its help line. `python tools/flags_reference.py` writes the page; `--check` exits 1 when the page differs from what
the table renders (tests/test_flags_reference.py runs the same comparison), so the page can never leave a flag out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

from flux_cp.config.flags import Config
from flux_cp.config.parser import build_parser

ROOT = Path(__file__).resolve().parent.parent

OUT = ROOT / "docs" / "flags.md"

HEADER = """# Flags of `train_flux_cp.py`

Every flag, by the section `--help` lists it under, generated from the flag table (`flux_cp/config/training.py` and
`flags.py`: each field of a section is its flag) by `python tools/flags_reference.py`; `tests/test_flags_reference.py`
fails when this page differs from what the table renders. A flag may also be given in a config file (`--config FILE`, by
its name without `--`: [config_files.md](config_files.md)). Where a flag takes an optional value, the flag given alone
means the value in the type column. Type `switch`: on when given, off otherwise.
"""


def annotations() -> dict[str, tuple[str, Any]]:
    """{flag name: (its section's name in a config file, its field's type annotation)}, over the flag table."""
    sections = {type(s): f.name for f in dataclasses.fields(Config) for s in [getattr(Config(), f.name)]}
    out = {}
    for section in Config().sections():
        for name, annotation in typing.get_type_hints(type(section)).items():
            out[name] = (sections[type(section)], annotation)
    return out


def type_text(action: argparse.Action, annotation: Any) -> str:
    """The type column: switch, a choice of values, or the value's type (a list, repeatable, an optional value)."""
    if isinstance(action, argparse._StoreTrueAction):
        return "switch"
    repeatable = isinstance(action, argparse._AppendAction)
    if action.choices:
        text = " \\| ".join(f"`{c}`" for c in action.choices)
    else:
        text = _kind(annotation, repeatable)
    if repeatable:
        text += ", repeatable"
    if action.nargs == "?":
        text += f"; alone: `{action.const}`"
    return text


def _kind(annotation: Any, repeatable: bool = False) -> str:
    """integer, number, text, true/false; a tuple is a list (comma-separated), or one value a time when repeatable."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _kind(args[0], repeatable)
    if typing.get_origin(annotation) is tuple:
        return _kind(args[0]) if repeatable else f"{_kind(args[0])} list"
    return {bool: "true/false", int: "integer", float: "number", str: "text"}.get(annotation, str(annotation))


def split_help(action: argparse.Action) -> tuple[str, str]:
    """(what the flag does, its default): a help line's own "Default: ..." sentence, else the parser's default."""
    text = " ".join((action.help or "").split())
    if "Default:" in text:
        what, default = text.split("Default:", 1)
        return what.strip(), default.strip().removesuffix(".")
    if isinstance(action, argparse._StoreTrueAction):
        return text, "off"
    return text, f"`{action.default}`"


def cell(text: str) -> str:
    """Table-cell text: a bar does not end the cell, and <column> is text, not an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def render() -> str:
    """The page's markdown."""
    types_of = annotations()
    parser = build_parser()
    lines = [HEADER]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.dest in types_of]
        if not actions:
            continue  # argparse's own groups (--help)
        table = types_of[actions[0].dest][0]
        lines += [
            f"## {group.title}",
            "",
            f"In a config file: the table `{table}`.",
            "",
            "| flag | type | default | what it does |",
            "|---|---|---|---|",
        ]
        for action in actions:
            what, default = split_help(action)
            flag = action.option_strings[0]
            lines.append(
                f"| `{flag}` | {type_text(action, types_of[action.dest][1])} | {cell(default)} | {cell(what)} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 when docs/flags.md differs from the flag table's")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print("error: docs/flags.md differs from the flag table: python tools/flags_reference.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT) if OUT.is_relative_to(ROOT) else OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
