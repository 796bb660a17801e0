"""The LoRA file in diffusers' format (`--lora_format diffusers`, the default) and its metadata; other layouts are
a family's (FLUX.1's kohya / BFL layout: flux_cp/families/flux1/kohya.py).

Keys `transformer.<module>.lora_A/lora_B.weight` (a DoRA's also `lora_magnitude_vector`; a LoKr's file is
flux_cp.model.adapters'), as `FluxPipeline.save_lora_weights` writes, and the LoRA's scale
`alpha / rank` as the family's loaders read it (`Family.lora_alpha_keys`): `transformer.<module>.alpha` keys when
`--lora_alpha` differs from `--rank` (diffusers and ComfyUI both read these keys for FLUX.1; without them both would
apply the LoRA at scale 1), or, for a family whose loader refuses alpha keys (FLUX.2's `Flux2Pipeline`; ComfyUI reads
no other alpha), `alpha / rank` multiplied into lora_B: the same weight update at scale 1, with adapter metadata of
`lora_alpha` = rank.

Metadata (the safetensors header, `metadata()`): diffusers' adapter metadata (the peft LoraConfig, under
`lora_adapter_metadata` with the `transformer.` prefix, as `FluxPipeline.save_lora_weights` writes it given
`transformer_lora_adapter_metadata`), from which `load_lora_weights` builds the adapter (rank, alpha, targets) instead
of guessing them from the keys, and the base model. diffusers refuses a file with both adapter metadata and alpha
keys ("Both `network_alphas` and `metadata` cannot be specified"), and ComfyUI reads alphas only from the keys: a LoRA
whose alpha differs from its rank keeps its alpha keys and goes without the adapter metadata (diffusers then derives
rank, alpha and targets from the keys); one with the scale in its weights keeps the metadata.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

# diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY: where load_lora_weights looks for the adapter's config.
LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"
_PARTS = r"(?:lora_([AB])\.weight|lora_(magnitude)_vector)"  # DoRA's magnitude: `lora_magnitude_vector`


def lora_modules_of(state: dict[str, Tensor], prefix: str = "transformer") -> dict[str, dict[str, Tensor]]:
    """{diffusers module: {"A": lora_A, "B": lora_B}} of a diffusers-format Flux LoRA state dict (of the component
    `prefix`: the transformer, or the text encoder trained with --train_text_encoder); a DoRA's modules also hold
    "magnitude" (`lora_magnitude_vector`)."""
    pattern = re.compile(rf"^{re.escape(prefix)}\.(.+)\.{_PARTS}$")
    out: dict[str, dict[str, Tensor]] = {}
    for key, value in state.items():
        m = pattern.match(key)
        if not m:
            raise ValueError(f"not a diffusers Flux LoRA key: {key!r} (expected {prefix}.<module>.lora_A/B.weight)")
        out.setdefault(m.group(1), {})[m.group(2) or m.group(3)] = value
    return out


def with_alphas(state: dict[str, Tensor], rank: int, alpha: float, prefix: str = "transformer") -> dict[str, Tensor]:
    """The diffusers-format state dict, with `<module>.alpha` keys when `alpha != rank` (see the module doc)."""
    if alpha == rank:
        return dict(state)
    out = dict(state)
    for module in lora_modules_of(state, prefix):
        out[f"{prefix}.{module}.alpha"] = torch.tensor(float(alpha))
    return out


def with_scale(state: dict[str, Tensor], rank: int, alpha: float) -> dict[str, Tensor]:
    """The diffusers-format state dict with the scale `alpha / rank` multiplied into every lora_B, for loaders that
    take no alpha keys (FLUX.2: see the module doc): the same weight update at scale 1."""
    if alpha == rank:
        return dict(state)
    scale = alpha / rank
    return {k: v * scale if k.endswith(".lora_B.weight") else v for k, v in state.items()}


def scaled(
    state: dict[str, Tensor], rank: int, alpha: float, alpha_keys: bool, prefix: str = "transformer"
) -> dict[str, Tensor]:
    """The diffusers-format state dict with the scale as the family's loaders read it: alpha keys
    (`with_alphas`), or `alpha / rank` in lora_B (`with_scale`)."""
    return with_alphas(state, rank, alpha, prefix) if alpha_keys else with_scale(state, rank, alpha)


@dataclass(frozen=True)
class Origin:
    """Where a LoRA comes from, for its file's metadata."""

    base_model: str | None  # --pretrained_model_name_or_path (hub id or folder); None: the embedded tiny Flux
    title: str  # the run's name (its output folder's)
    resolution: int
    pairs: bool = False  # trained on FLUX.1 Kontext pairs


# The LoraConfig fields diffusers needs to rebuild the adapter. diffusers passes the metadata to LoraConfig(**...),
# and a peft release that lacks one of the fields a newer one writes would refuse the file: keep to these.
_ADAPTER_FIELDS = (
    "r",
    "lora_alpha",
    "target_modules",
    "lora_dropout",
    "init_lora_weights",
    "bias",
    "use_dora",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "base_model_name_or_path",
)


def adapter_metadata(peft_config: dict, base_model: str | None) -> dict:
    """diffusers' adapter metadata from a peft LoraConfig's `to_dict()`, with the base model."""
    out = {k: peft_config[k] for k in _ADAPTER_FIELDS if k in peft_config}
    out["base_model_name_or_path"] = base_model
    return {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}


def metadata(
    *,
    rank: int,
    alpha: float,
    adapter: dict | None,
    origin: Origin | None,
    alpha_keys: bool = True,
    text_encoder_adapter: dict | None = None,
) -> dict[str, str]:
    """The safetensors header metadata of a diffusers-format LoRA file (see the module doc). `adapter`: diffusers'
    adapter metadata (`adapter_metadata`); `alpha_keys`: as `scaled`'s (False: the scale is in lora_B, and the
    adapter's alpha is its rank). `text_encoder_adapter`: the text encoder's (--train_text_encoder), under
    `text_encoder.` as `FluxPipeline.save_lora_weights` writes it."""
    out = {"format": "pt"}  # what diffusers' save_lora_weights writes
    if adapter is not None and not alpha_keys:
        adapter = {**adapter, "lora_alpha": rank}
    if adapter is not None and (alpha == rank or not alpha_keys):  # (alpha keys otherwise: see the module doc)
        packed = {f"transformer.{k}": v for k, v in adapter.items()}
        if text_encoder_adapter is not None:
            packed.update({f"text_encoder.{k}": v for k, v in text_encoder_adapter.items()})
        out[LORA_ADAPTER_METADATA_KEY] = json.dumps(packed, indent=2, sort_keys=True)
    if origin is not None and origin.base_model:
        out["base_model"] = origin.base_model
    return out
