"""Exact context parallelism (ring, Ulysses, hybrid) for diffusion transformers, with Flux support.

Public API: `CPContext` and `Tuning` (a CP group with its mode, kernels and tuning, built once at setup),
`attention`, `shard`, `gather`, `FluxCPAttnProcessor`, `apply_context_parallel`, `remove_context_parallel`;
`cp.schedule` orders a compiled block's exchanges against its compute. The attention core needs only torch; the
Flux pieces import diffusers when first used.
"""

from .attention import attention, validate
from .comm import check_divisible, gather, group_rank, group_size, shard
from .context import MODES, CPContext, Tuning

_FLUX = ("FluxCPAttnProcessor", "apply_context_parallel", "remove_context_parallel", "full_sequence_io")


def __getattr__(name: str):
    if name in _FLUX:
        from . import flux

        return getattr(flux, name)
    raise AttributeError(f"module 'cp' has no attribute {name!r}")


__all__ = [
    "MODES",
    "CPContext",
    "Tuning",
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
