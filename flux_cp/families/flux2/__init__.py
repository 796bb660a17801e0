"""FLUX.2 [dev] and [klein]: the family (`family.py`), diffusers' training recipe as pure functions (`recipe.py`) and
the tiny models (`tiny.py`)."""

from flux_cp.families.flux2.family import FLUX2, FLUX2_KLEIN, Flux2, Flux2Encoders

__all__ = ["FLUX2", "FLUX2_KLEIN", "Flux2", "Flux2Encoders"]
