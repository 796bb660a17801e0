"""FLUX.1 [dev] / [schnell] and FLUX.1 Kontext [dev]: the family (`family.py`), its tokens and ids (`tokens.py`), its
kohya LoRA layout (`kohya.py`), the hub ids it knows offline (`known.py`) and its tiny model (`tiny.py`)."""

from flux_cp.families.flux1.family import (
    ATTENTION_TARGETS,
    DEFAULT_TARGETS,
    FLUX1,
    KONTEXT_TARGETS,
    Flux1,
    Flux1Encoders,
)

__all__ = ["ATTENTION_TARGETS", "DEFAULT_TARGETS", "FLUX1", "KONTEXT_TARGETS", "Flux1", "Flux1Encoders"]
