"""Model families: what is specific to one kind of FLUX model lives in one package per family, behind the `Family`
interface that the trainer, the data path, validation, the planner and the outputs use.

A family answers: which diffusers classes make up the model (transformer, encoders, pipelines), how an image
becomes the transformer's tokens (latent normalisation, packing, position ids), what the transformer's forward
takes, its blocks in the order they run, which layers get LoRA by default and how its LoRA files carry their scale,
and what a step costs (FLOPs, parameter counts). The trainer recognises the family from the model folder (`detect`)
among the registered ones: the built-in FLUX.1 (`flux1/`) and FLUX.2 (`flux2/`), and any other given to `register`.
"""

from __future__ import annotations

import torch

from flux_cp.families import base
from flux_cp.families.base import Family, transformer_class_name
from flux_cp.families.flux1 import FLUX1
from flux_cp.families.flux2 import FLUX2, FLUX2_KLEIN
from flux_cp.families.known import KnownModel

FAMILIES: list[Family] = [FLUX1, FLUX2, FLUX2_KLEIN]


def register(family: Family) -> None:
    """Train `family`'s models too: `detect` recognises their folders, and every module asking a family of a model
    finds it. Call it in every process of a run before the trainer starts (its CP processors registered with
    `cp.register` by then)."""
    if family not in FAMILIES:
        FAMILIES.append(family)


def detect(path: str, revision: str | None = None, cache_dir: str | None = None) -> Family:
    """The family of the model folder or hub id `path`: its pipeline class decides where a family names it (FLUX.2
    [dev] and [klein] share the transformer class), else its transformer class (a UsageError naming the classes if
    no family trains them). `cache_dir`: the download cache."""
    return base.detect(path, revision, tuple(FAMILIES), cache_dir)


def for_transformer(config: dict) -> Family:
    """The family whose transformer a transformer config describes (its `_class_name`; FLUX.1 when it names none,
    as the built-in configs of the known FLUX.1 models)."""
    name = config.get("_class_name")
    return next((f for f in FAMILIES if f.transformer_class_name == name), FLUX1)


def of_model(transformer: torch.nn.Module) -> Family:
    """The family of a transformer (by its class, also under peft's adapters)."""
    names = {cls.__name__ for cls in type(transformer).__mro__}
    found = next((f for f in FAMILIES if f.transformer_class_name in names), None)
    if found is None:
        raise ValueError(f"no registered model family trains a {type(transformer).__name__}")
    return found


def blocks_of(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(kind, block) of every block of a transformer, in the order they run (`Family.blocks`)."""
    return of_model(transformer).blocks(transformer)


def known_model(name: str | None) -> KnownModel | None:
    """What a registered family knows of a hub id offline (`Family.known_model`), else None."""
    return next((k for f in FAMILIES if (k := f.known_model(name)) is not None), None)


def known_models() -> list[KnownModel]:
    """Every hub id a registered family knows offline."""
    return [k for f in FAMILIES for k in f.known]


__all__ = [
    "FAMILIES", "FLUX1", "FLUX2", "FLUX2_KLEIN", "Family", "blocks_of", "detect", "for_transformer",
    "KnownModel", "known_model", "known_models", "of_model", "register", "transformer_class_name",
]  # fmt: skip
