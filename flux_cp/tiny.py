"""`python -m flux_cp.tiny`: build a local model folder without downloads - a family's tiny model (the embedded
default and the tests' models) or a full-size shapes preset for benchmarks. What can be built is the registered
families' (`Family.tiny_builds`: each family's builders, flux_cp/families/*/tiny.py); this module only chooses one.
`ensure_tiny_pipeline` stays importable from here: the model cards of demo runs load their LoRA into it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flux_cp.errors import UsageError
from flux_cp.families import FAMILIES
from flux_cp.families.builder import MARKER
from flux_cp.families.flux1.tiny import ensure_tiny_pipeline  # the name demo model cards import (their snippets)
from flux_cp.outputs import roles

__all__ = ["ensure_tiny_pipeline", "main"]


def builds() -> dict[tuple[str, str], object]:
    """{(--family name, --preset): builder} of every registered family, in their order."""
    return {key: build for family in FAMILIES for key, build in family.tiny_builds().items()}


def main(argv: list[str] | None = None) -> int:
    table = builds()
    names = list(dict.fromkeys(name for name, _ in table))
    presets = list(dict.fromkeys(preset for _, preset in table))
    p = argparse.ArgumentParser(description="Build a local model folder of a registered model family (no downloads).")
    p.add_argument(
        "--preset",
        choices=presets,
        default="tiny",
        help="tiny: a tiny model with weights; *-shapes: the transformer's config at full size (no weights) with tiny "
        "encoders and VAE; *-full-shapes: every component's config at full size (no weights). Train the shapes presets "
        "with --transformer_init random, which builds what has no weights from its config.",
    )
    p.add_argument("--out", required=True)
    p.add_argument(
        "--family",
        choices=names,
        help=f"The kind of model folder (default: {names[0]}); a preset that one kind alone has implies it.",
    )
    aliases = {flag: name for family in FAMILIES for flag, (name, _) in family.tiny_aliases.items()}
    for family in FAMILIES:
        for flag, (name, what) in family.tiny_aliases.items():
            p.add_argument(f"--{flag}", action="store_true", help=f"{what} The same as --family {name}.")
    a = p.parse_args(argv)
    try:
        print(_build(p, a, table, names, aliases))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _build(p, a, table: dict, names: list[str], aliases: dict[str, str]) -> Path:
    # A download cache, the Python environment, flux-cp's own files, a model (but one this builder made)...
    if not (Path(a.out) / MARKER).is_file() and (how := roles.foreign_owner(a.out)):
        raise UsageError(f"--out {a.out} {how}, which is not this builder's: choose another folder")
    given = [flag for flag in aliases if getattr(a, flag)]
    for flag in given:
        if a.family not in (None, aliases[flag]):
            p.error(f"--{flag} is --family {aliases[flag]}; it does not combine with --family {a.family}")
    family = a.family or (aliases[given[0]] if given else None)
    kinds = [name for name, preset in table if preset == a.preset]  # the kinds of folder this preset builds
    if family is None:
        family = kinds[0] if len(kinds) == 1 else names[0]
    if (family, a.preset) not in table:
        own = [preset for name, preset in table if name == family and preset != "tiny"]
        p.error(
            f"--preset {a.preset} builds a {' or '.join(kinds)} folder, not --family {family}"
            + (f"'s: use --preset {' or '.join(own)}" if own else "")
        )
    return table[(family, a.preset)](a.out)


if __name__ == "__main__":
    raise SystemExit(main())
