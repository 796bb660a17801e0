"""`python -m flux_cp.tiny`: build a local model folder without downloads - a family's tiny model (the embedded
default and the tests' models) or a full-size shapes preset for benchmarks. The builders are the families'
(flux_cp/families/flux1/tiny.py, flux_cp/families/flux2/tiny.py); `ensure_tiny_pipeline` is the tiny FLUX.1 that
a demo's model card loads its LoRA into."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flux_cp.errors import UsageError
from flux_cp.families.builder import MARKER
from flux_cp.families.flux1.tiny import ensure_tiny_pipeline, write_flux1_dev_full_shapes, write_flux1_dev_shapes
from flux_cp.families.flux2.tiny import ensure_tiny_flux2_pipeline, write_flux2_full_shapes, write_flux2_shapes
from flux_cp.outputs import roles

__all__ = ["ensure_tiny_pipeline", "main"]

PRESETS = ("tiny", "flux1-dev-shapes", "flux2-dev-shapes", "flux2-klein-shapes", "flux1-dev-full-shapes",
           "flux2-dev-full-shapes", "flux2-klein-full-shapes")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build a local Flux pipeline folder (no downloads).")
    p.add_argument(
        "--preset", choices=PRESETS, default="tiny",
        help="tiny: a tiny model with weights; *-shapes: the transformer's config at full size (no weights) with tiny "
        "encoders and VAE; *-full-shapes: every component's config at full size (no weights). Train the shapes presets "
        "with --transformer_init random, which builds what has no weights from its config.",
    )  # fmt: skip
    p.add_argument("--out", required=True)
    p.add_argument(
        "--family",
        choices=("flux1", "flux1-kontext", "flux2", "flux2-klein"),
        help="The model family of the folder: FluxPipeline (default), FluxKontextPipeline, Flux2Pipeline or "
        "Flux2KleinPipeline. The flux2 shapes presets imply theirs.",
    )
    p.add_argument("--kontext", action="store_true", help="Save it as a FluxKontextPipeline (FLUX.1 Kontext).")
    a = p.parse_args(argv)
    try:
        print(_build(p, a))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _build(p, a) -> Path:
    # A download cache, the Python environment, flux-cp's own files, a model (but one this builder made)...
    if not (Path(a.out) / MARKER).is_file() and (how := roles.foreign_owner(a.out)):
        raise UsageError(f"--out {a.out} {how}, which is not this builder's: choose another folder")
    family = a.family or ("flux1-kontext" if a.kontext else "flux1")
    if a.kontext and family != "flux1-kontext":
        p.error(f"--kontext is --family flux1-kontext; it does not combine with --family {family}")
    full = a.preset.endswith("-full-shapes")
    if a.preset.startswith("flux2-"):
        implied = "flux2-klein" if a.preset.startswith("flux2-klein") else "flux2"
        if (a.family or implied) != implied or a.kontext:
            p.error(
                f"--preset {a.preset} builds a {implied} folder; drop --family/--kontext or pass --family {implied}"
            )
        return (write_flux2_full_shapes if full else write_flux2_shapes)(a.out, klein=implied == "flux2-klein")
    if family.startswith("flux2"):
        if a.preset != "tiny":
            shapes = {"flux2": "flux2-dev-shapes", "flux2-klein": "flux2-klein-shapes"}[family]
            p.error(f"--preset {a.preset} is FLUX.1's; for --family {family} use --preset {shapes}")
        return ensure_tiny_flux2_pipeline(a.out, klein=family == "flux2-klein")
    if a.preset == "tiny":
        return ensure_tiny_pipeline(a.out, kontext=family == "flux1-kontext")
    return (write_flux1_dev_full_shapes if full else write_flux1_dev_shapes)(a.out, kontext=family == "flux1-kontext")


if __name__ == "__main__":
    raise SystemExit(main())
