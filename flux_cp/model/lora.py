"""LoRA adapters on the transformer: checking the layers that get them (a family's defaults: `Family.lora_targets`),
adding them (seeded, layout-independent), and writing them (`--lora_format`: diffusers' layout, which the pipelines'
`load_lora_weights` read, or a layout of the family's own, FLUX.1's kohya)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from safetensors.torch import save_file

from flux_cp import files
from flux_cp.errors import UsageError
from flux_cp.families.lora_format import Origin, adapter_metadata, metadata, scaled
from flux_cp.model import adapters
from flux_cp.terminal import printable

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.config.training import LoraConfig


class LoraLayouts(Protocol):
    """What writing a LoRA file asks of the model family (`flux_cp.families.base.Family` has it)."""

    lora_alpha_keys: bool  # the scale as alpha keys (else alpha / rank multiplied into lora_B)

    def lora_layout(
        self, fmt: str, state: dict[str, torch.Tensor], lora: LoraConfig, origin: Origin | None, guidance: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]: ...


def check_targets(transformer: torch.nn.Module, targets: list[str]) -> None:
    """A UsageError naming the --lora_layers entries that match no module of the transformer."""
    names = [n for n, _ in transformer.named_modules()]
    unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        raise UsageError(f"--lora_layers {unknown} match no module of the transformer (e.g. attn.to_q, ff.net.2)")


def add_lora(transformer: torch.nn.Module, lora: LoraConfig, seed: int) -> None:
    """peft adapters of `--adapter` (LoRA, DoRA or LoKr: flux_cp.model.adapters); initialised from `seed` alone, so
    every layout starts from the same weights."""
    targets = list(lora.lora_layers)
    check_targets(transformer, targets)
    config = adapters.peft_config(lora.adapter, lora.rank, lora.lora_alpha, lora.lora_dropout, targets)  # --adapter's
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer.add_adapter(config)


def save_lora(
    transformer: torch.nn.Module,
    state: dict[str, torch.Tensor],
    output_dir: str,
    lora: LoraConfig,
    family: LoraLayouts,
    origin: Origin | None = None,
    text_encoder: tuple[dict[str, torch.Tensor], dict | None] | None = None,
) -> Path:
    """`pytorch_lora_weights.safetensors` in the `--lora_format` layout: diffusers' (flux_cp.families.lora_format, with
    the scale as `family`'s loaders read it), which the family's pipeline's `load_lora_weights` and ComfyUI load, or a
    layout of the family's own (`Family.lora_layout`). Its metadata says how it was trained and on which base model
    (`origin`). `text_encoder`: the text encoder's LoRA weights (`text_encoder.*` keys, --train_text_encoder) and its
    peft config, written beside the transformer's as `FluxPipeline.save_lora_weights` writes them."""
    from peft.utils import get_peft_model_state_dict  # peft at first use (its import takes seconds)

    weights = get_peft_model_state_dict(transformer, state_dict=state)
    weights = {f"transformer.{k}": v.detach().contiguous().cpu() for k, v in weights.items()}
    guidance = bool(dict(getattr(transformer, "config", {})).get("guidance_embeds"))
    if lora.lora_format == "diffusers" and lora.adapter == "lokr":  # its own keys, scale 1 (flux_cp.model.adapters)
        weights = adapters.lokr_weights(weights, lora.rank, lora.lora_alpha)
        header = metadata(rank=lora.rank, alpha=lora.lora_alpha, adapter=None, origin=origin)
    elif lora.lora_format == "diffusers":
        keys = family.lora_alpha_keys
        weights = scaled(weights, lora.rank, lora.lora_alpha, keys)
        peft_config = getattr(transformer, "peft_config", {}).get("default")
        adapter = adapter_metadata(peft_config.to_dict(), origin and origin.base_model) if peft_config else None
        text_adapter = None
        if text_encoder is not None:
            text_weights, text_config = text_encoder
            weights.update(scaled(text_weights, lora.rank, lora.lora_alpha, keys, prefix="text_encoder"))
            text_adapter = adapter_metadata(text_config, origin and origin.base_model) if text_config else None
        header = metadata(
            rank=lora.rank,
            alpha=lora.lora_alpha,
            adapter=adapter,
            origin=origin,
            alpha_keys=keys,
            text_encoder_adapter=text_adapter,
        )
    else:
        weights, header = family.lora_layout(lora.lora_format, weights, lora, origin, guidance)
    path = Path(output_dir) / "pytorch_lora_weights.safetensors"
    files.write_with(path, lambda tmp: save_file(weights, tmp, metadata=header))
    return path


def lora_origin(cfg: Config, pairs: bool) -> Origin:
    """The `origin` of a run's LoRA file: its base model (--pretrained_model_name_or_path; none for a transformer
    random-initialised from its config, which the LoRA belongs to instead), the run's name (its output folder's), the
    (largest) training resolution, and whether it trained on FLUX.1 Kontext pairs."""
    name = printable(Path(cfg.train.output_dir).resolve().name)  # shown by the tools that read the file's metadata
    base = cfg.model.pretrained_model_name_or_path if cfg.model.transformer_init == "pretrained" else None
    return Origin(printable(base) if base else base, name, cfg.data.largest_resolution, pairs)
