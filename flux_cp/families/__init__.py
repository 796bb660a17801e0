"""Model families: what is specific to one kind of FLUX model lives in one package per family, behind the `Family`
interface that the trainer, the data path, validation, the planner and the outputs use.

A family answers: which diffusers classes make up the model (transformer, encoders, pipelines), how an image
becomes the transformer's tokens (latent normalisation, packing, position ids), what the transformer's forward
takes, its blocks in the order they run, which layers get LoRA by default and how its LoRA files carry their scale,
and what a step costs (FLOPs, parameter counts). The trainer recognises the family from the model folder (`detect`)
among the registered ones: the built-in FLUX.1 (`flux1/`) and FLUX.2 (`flux2/`), and any other given to `register`.
"""

from __future__ import annotations

from flux_cp.families.base import (
    FAMILIES,
    Family,
    blocks_of,
    detect,
    for_transformer,
    known_model,
    known_models,
    of_model,
    register,
    transformer_class_name,
)
from flux_cp.families.flux1.family import FLUX1
from flux_cp.families.flux2.family import FLUX2, FLUX2_KLEIN
from flux_cp.families.known import KnownModel

# The built-in families, one line each (the first is the default: the tiny FLUX.1 of the embedded default)
register(FLUX1)
register(FLUX2)
register(FLUX2_KLEIN)

__all__ = [
    "FAMILIES",
    "FLUX1",
    "FLUX2",
    "FLUX2_KLEIN",
    "Family",
    "blocks_of",
    "detect",
    "for_transformer",
    "KnownModel",
    "known_model",
    "known_models",
    "of_model",
    "register",
    "transformer_class_name",
]
