"""Exact context parallelism (ring, Ulysses, hybrid) for diffusion transformers, with Flux support.

Public API: `attention`, `shard`, `gather`, `FluxCPAttnProcessor`, `apply_context_parallel`,
`remove_context_parallel`. The attention core needs only torch; the Flux pieces import diffusers
when first used.
"""

from .attention import MODES, attention, validate
from .comm import check_divisible, gather, group_rank, group_size, shard

_FLUX = ("FluxCPAttnProcessor", "apply_context_parallel", "remove_context_parallel", "full_sequence_io")


def __getattr__(name: str):
    if name in _FLUX:
        from . import flux

        return getattr(flux, name)
    raise AttributeError(f"module 'cp' has no attribute {name!r}")


__all__ = [
    "MODES",
    "FluxCPAttnProcessor",
    "apply_context_parallel",
    "attention",
    "check_divisible",
    "full_sequence_io",
    "gather",
    "group_rank",
    "group_size",
    "remove_context_parallel",
    "shard",
    "validate",
]
