"""Model families: what is specific to one kind of FLUX model lives in one module per family, behind the `Family`
interface that the trainer, the data path, validation, the planner and the outputs use.

A family answers: which diffusers classes make up the model (transformer, encoders, pipelines), how an image
becomes the transformer's tokens (latent normalisation, packing, position ids), what the transformer's forward
takes, which layers get LoRA by default, and what a step costs (FLOPs, parameter counts). The trainer recognises
the family from the model folder (`detect`); adding a family is a new module here, its tests, and one entry in
`FAMILIES`.
"""

from __future__ import annotations

from . import base
from .base import Family, ParameterCounts, transformer_class_name
from .flux1 import FLUX1
from .flux2 import FLUX2, FLUX2_KLEIN

FAMILIES: tuple[Family, ...] = (FLUX1, FLUX2, FLUX2_KLEIN)


def detect(path: str, revision: str | None = None, cache_dir: str | None = None) -> Family:
    """The family of the model folder or hub id `path`: its pipeline class decides where a family names it (FLUX.2
    [dev] and [klein] share the transformer class), else its transformer class (a UsageError naming the classes if
    no family trains them). `cache_dir`: the download cache."""
    return base.detect(path, revision, FAMILIES, cache_dir)


def for_transformer(config: dict) -> Family:
    """The family whose transformer a transformer config describes (its `_class_name`; FLUX.1 when it names none,
    as the built-in configs of the known FLUX.1 models)."""
    name = config.get("_class_name")
    return next((f for f in FAMILIES if f.transformer_class_name == name), FLUX1)


__all__ = [
    "FAMILIES", "FLUX1", "FLUX2", "FLUX2_KLEIN", "Family", "ParameterCounts", "detect", "for_transformer",
    "transformer_class_name",
]  # fmt: skip
