"""Exact context parallelism (ring, Ulysses, hybrid) for diffusion transformers, with FLUX.1 and FLUX.2 support.

Public API: `CPContext` and `Tuning` (a CP group with its mode, kernels and tuning, built once at setup),
`attention`, `shard`, `gather`; the modes (`MODES`, a registry of `Mode` objects, one module each; `register_mode`
adds one, `auto_mode` picks one for a model's heads); for diffusers' Flux transformers (`FluxTransformer2DModel`,
`Flux2Transformer2DModel`) `apply_context_parallel`, `remove_context_parallel`, `full_sequence_io` and the
processors (`FluxCPAttnProcessor`; `Flux2CPAttnProcessor`, `Flux2CPParallelSelfAttnProcessor`); for other models
`register` (their attention module class, their `CPAttnProcessor` subclass, the processor it replaces);
`cp.schedule` orders a compiled block's exchanges against its compute. The attention core needs only torch; the
model pieces import diffusers when first used.
"""

from . import modes  # noqa: F401 - registers the built-in modes (cp/modes.py)
from .attention import attention
from .comm import check_divisible, gather, group_rank, group_size, shard
from .context import CPContext
from .mode import DEFAULT_MODE, MODES, Mode, auto_mode, register_mode, validate
from .tuning import Tuning

# name -> the module that defines it, imported on first use (it imports diffusers)
_LAZY = {
    "apply_context_parallel": "processor",
    "remove_context_parallel": "processor",
    "full_sequence_io": "processor",
    "register": "processor",
    "CPAttnProcessor": "processor",
    "FluxCPAttnProcessor": "flux",
    "Flux2CPAttnProcessor": "flux2",
    "Flux2CPParallelSelfAttnProcessor": "flux2",
}
# The model files of this package, which register their processors when imported (cp.processor knows no model).
MODELS = ("flux", "flux2")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        for model in MODELS:
            importlib.import_module(f"{__name__}.{model}")
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'cp' has no attribute {name!r}")


__all__ = [
    "DEFAULT_MODE",
    "MODES",
    "Mode",
    "auto_mode",
    "register_mode",
    "CPAttnProcessor",
    "CPContext",
    "Tuning",
    "Flux2CPAttnProcessor",
    "Flux2CPParallelSelfAttnProcessor",
    "FluxCPAttnProcessor",
    "apply_context_parallel",
    "attention",
    "check_divisible",
    "full_sequence_io",
    "gather",
    "group_rank",
    "register",
    "group_size",
    "remove_context_parallel",
    "shard",
    "validate",
]
