"""Parameter counts of a run's transformer and of what it trains (LoRA, DoRA or LoKr adapters, or all of it), exact
from the transformer's config on the meta device (nothing allocated or loaded): what the planner and the disk check
size memory and checkpoints from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flux_cp.errors import UsageError
from flux_cp.model.adapters import is_adapter_parameter, peft_config
from flux_cp.model.lora import check_targets

if TYPE_CHECKING:
    from flux_cp.families.base import Family


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of the transformer (`base`) and of what trains (LoRA adapters, or all of it), with tensor counts,
    and the parameters of its largest block (what FSDP gathers at once)."""

    base: int
    base_tensors: int
    trainable: int
    trainable_tensors: int
    largest_block: int


_COUNTS: dict[tuple, ParameterCounts] = {}


def _count(
    family: Family, config: str, lora_rank: int | None, lora_layers: tuple[str, ...], adapter: str = "lora"
) -> ParameterCounts:
    key = (family.name, config, lora_rank, lora_layers, adapter)
    if key in _COUNTS:  # --plan asks for every CP size; building the model is the slow part
        return _COUNTS[key]
    with torch.device("meta"):
        try:
            model = family.transformer_class().from_config(json.loads(config))
        except (ValueError, RuntimeError, TypeError, IndexError, KeyError, ZeroDivisionError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(f"the transformer cannot be built from its config.json ({first})") from None
        base = [p.numel() for p in model.parameters()]
        largest = max(sum(p.numel() for p in b.parameters()) for _, b in family.blocks(model))
        if lora_rank is None:
            counts = ParameterCounts(sum(base), len(base), sum(base), len(base), largest)
        else:
            check_targets(model, list(lora_layers))
            model.add_adapter(peft_config(adapter, lora_rank, lora_rank, 0.0, list(lora_layers)))
            lora = [p.numel() for n, p in model.named_parameters() if is_adapter_parameter(n)]
            counts = ParameterCounts(sum(base), len(base), sum(lora), len(lora), largest)
    _COUNTS[key] = counts
    return counts


def parameter_counts(
    family: Family, config: dict, lora_rank: int | None, lora_layers: list[str], adapter: str = "lora"
) -> ParameterCounts:
    """Exact counts of `family`'s transformer of this config. `adapter`: --adapter's kind (LoRA, DoRA or LoKr) at
    `lora_rank` (None: full fine-tuning) on `lora_layers`."""
    return _count(family, json.dumps(config, sort_keys=True), lora_rank, tuple(lora_layers), adapter)
