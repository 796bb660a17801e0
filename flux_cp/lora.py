"""LoRA adapters on the Flux transformer: which layers get them, adding them (seeded, layout-independent),
and writing them (`--lora_format`: diffusers' layout, which `FluxPipeline.load_lora_weights` reads, or kohya's)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .errors import UsageError
from .lora_format import Origin

if TYPE_CHECKING:
    from .config import Config, LoraConfig

# Attention projections of both streams (image: to_*, text: add_*_proj / to_add_out). The benchmarks' and the
# planner tests' LoRA setting.
ATTENTION_TARGETS = (
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
)  # fmt: skip
# The training default (`--lora_layers`): attention and the MLPs of both streams.
DEFAULT_TARGETS = (*ATTENTION_TARGETS, "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")


def check_targets(transformer: torch.nn.Module, targets: list[str]) -> None:
    """A UsageError naming the --lora_layers entries that match no module of the transformer."""
    names = [n for n, _ in transformer.named_modules()]
    unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        raise UsageError(f"--lora_layers {unknown} match no module of the transformer (e.g. attn.to_q, ff.net.2)")


def add_lora(transformer: torch.nn.Module, lora: LoraConfig, seed: int) -> None:
    """peft LoRA adapters; initialised from `seed` alone, so every layout starts from the same weights."""
    from peft import LoraConfig as PeftLoraConfig

    targets = list(lora.lora_layers)
    check_targets(transformer, targets)
    config = PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout, init_lora_weights="gaussian",
        target_modules=targets,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer.add_adapter(config)


def save_lora(
    transformer: torch.nn.Module,
    state: dict[str, torch.Tensor],
    output_dir: str,
    lora: LoraConfig,
    origin: Origin | None = None,
) -> Path:
    """`pytorch_lora_weights.safetensors` in the `--lora_format` layout (flux_cp.lora_format); the default is
    diffusers' format, which FluxPipeline.load_lora_weights and ComfyUI load. Its metadata says how it was trained
    and on which base model (`origin`; lora_format.metadata)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from . import files
    from .lora_format import adapter_metadata, convert, metadata

    weights = get_peft_model_state_dict(transformer, state_dict=state)
    weights = {f"transformer.{k}": v.detach().contiguous().cpu() for k, v in weights.items()}
    alpha_keys = not _is_flux2(transformer)  # FLUX.2's LoRA loader refuses alpha keys (lora_format's doc)
    weights = convert(weights, lora.lora_format, lora.rank, lora.lora_alpha, alpha_keys)
    peft_config = getattr(transformer, "peft_config", {}).get("default")
    adapter = adapter_metadata(peft_config.to_dict(), origin and origin.base_model) if peft_config else None
    guidance = bool(dict(getattr(transformer, "config", {})).get("guidance_embeds"))
    header = metadata(lora.lora_format, rank=lora.rank, alpha=lora.lora_alpha, adapter=adapter, origin=origin,
                      guidance=guidance, alpha_keys=alpha_keys)  # fmt: skip
    path = Path(output_dir) / "pytorch_lora_weights.safetensors"
    files.write_with(path, lambda tmp: save_file(weights, tmp, metadata=header))
    return path


def _is_flux2(transformer: torch.nn.Module) -> bool:
    from diffusers import Flux2Transformer2DModel

    return isinstance(transformer, Flux2Transformer2DModel)


def lora_origin(cfg: Config, kontext: bool) -> Origin:
    """The `origin` of a run's LoRA file: its base model (--pretrained_model_name_or_path), the run's name (its
    output folder's), the (largest) training resolution, and whether it trained on FLUX.1 Kontext pairs."""
    name = Path(cfg.train.output_dir).resolve().name
    return Origin(cfg.model.pretrained_model_name_or_path, name, cfg.data.largest_resolution, kontext)
