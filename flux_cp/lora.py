"""LoRA adapters on the Flux transformer: which layers get them, adding them (seeded, layout-independent),
and writing them in the format `FluxPipeline.load_lora_weights` reads."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .errors import UsageError

if TYPE_CHECKING:
    from .config import LoraConfig

# Attention projections of both streams (image: to_*, text: add_*_proj / to_add_out). The benchmarks' and the
# planner tests' LoRA setting.
ATTENTION_TARGETS = (
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
)  # fmt: skip
# The training default (`--lora_layers`): attention and the MLPs of both streams.
DEFAULT_TARGETS = (*ATTENTION_TARGETS, "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")


def add_lora(transformer: torch.nn.Module, lora: LoraConfig, seed: int) -> None:
    """peft LoRA adapters; initialised from `seed` alone, so every layout starts from the same weights."""
    from peft import LoraConfig as PeftLoraConfig

    targets = list(lora.lora_layers)
    names = [n for n, _ in transformer.named_modules()]
    unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        raise UsageError(f"--lora_layers {unknown} match no module of the transformer (e.g. attn.to_q, ff.net.2)")
    config = PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout, init_lora_weights="gaussian",
        target_modules=targets,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer.add_adapter(config)


def save_lora(transformer: torch.nn.Module, state: dict[str, torch.Tensor], output_dir: str) -> Path:
    """`pytorch_lora_weights.safetensors` in diffusers' format, loadable by FluxPipeline.load_lora_weights."""
    from diffusers import FluxPipeline
    from peft.utils import get_peft_model_state_dict

    weights = get_peft_model_state_dict(transformer, state_dict=state)
    weights = {k: v.contiguous() for k, v in weights.items()}
    FluxPipeline.save_lora_weights(output_dir, transformer_lora_layers=weights, safe_serialization=True)
    return Path(output_dir) / "pytorch_lora_weights.safetensors"
