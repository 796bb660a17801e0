"""The `Family` interface: what the rest of flux-cp asks of a model family, and how a model folder names its
family (the `_class_name` of its transformer's config, else of its pipeline's model_index.json)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import UsageError
from ..metrics import StepFlops, step_flops

if TYPE_CHECKING:
    from ..config import ModelConfig

Tensor = torch.Tensor


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of the transformer (`base`) and of what trains (LoRA adapters, or all of it), with tensor counts,
    and the parameters of its largest block (what FSDP gathers at once)."""

    base: int
    base_tensors: int
    trainable: int
    trainable_tensors: int
    largest_block: int


class Family(ABC):
    """One kind of FLUX model. Subclasses fill in the class attributes and the methods below; nothing here loads
    a model until asked."""

    name: str = ""  # short id, e.g. "flux1"
    label: str = ""  # for people, e.g. "FLUX.1"
    transformer_class_name: str = ""  # diffusers' class in transformer/config.json
    pipeline_class_names: tuple[str, ...] = ()  # model_index.json classes of this family's pipelines
    # Pixels per side of one image token: the VAE's downsampling times the 2x2 packing.
    pixels_per_token: int = 16

    # --- components -----------------------------------------------------------------------------------------

    @abstractmethod
    def transformer_class(self) -> type:
        """diffusers' transformer class of this family."""

    @abstractmethod
    def embedded_default(self, pairs: bool) -> str:
        """The tiny model folder trained when no model is named (built locally on first use)."""

    @abstractmethod
    def load_encoders(self, model: ModelConfig, path: str, dtype: torch.dtype, device: torch.device) -> Any:
        """The VAE and the text encoders (`flux_cp.encode.Encoders`-like: `prompts`, `latents`,
        `free_text_encoders`)."""

    @abstractmethod
    def normalizer(self, vae) -> Callable[[Tensor], Tensor]:
        """Latents as the VAE gives them -> latents as the transformer sees them (before packing)."""

    def pipeline_class_name(self, pairs: bool) -> str:
        """diffusers' pipeline class that loads this family's trained weights for inference (the model card's and
        the run summary's snippets). `pairs`: trained on image-editing pairs."""
        return self.pipeline_class_names[0]

    @abstractmethod
    def validation_pipeline(self, pairs: bool, scheduler, vae, transformer):
        """The diffusers pipeline that renders validation images with these components, from encoded prompts (its
        text encoders left out). `pairs`: it edits a reference image."""

    @abstractmethod
    def reference_inputs(self, reference: Tensor, resolution: int) -> dict:
        """The pipeline's keyword arguments for editing the reference image whose latents are `reference` at
        `resolution`^2 (`flux_cp.validation.reference_latents`)."""

    # --- the token sequence ----------------------------------------------------------------------------------

    def image_tokens(self, width: int, height: int) -> int:
        """Image tokens of one `width x height` image."""
        return (width // self.pixels_per_token) * (height // self.pixels_per_token)

    @abstractmethod
    def pack(self, latents: Tensor) -> Tensor:
        """Model latents `[B, C, H, W]` -> tokens `[B, N, D]`, in the order of `image_ids`."""

    @abstractmethod
    def image_ids(self, height: int, width: int, device=None) -> Tensor:
        """Position ids of the tokens of a `height x width` model latent."""

    @abstractmethod
    def text_ids(self, length: int, device=None) -> Tensor:
        """Position ids of `length` text tokens."""

    @abstractmethod
    def transformer_inputs(self, hidden: Tensor, img_ids: Tensor, text: dict[str, Tensor], txt_ids: Tensor,
                           timestep: Tensor, guidance: Tensor | None) -> dict:  # fmt: skip
        """Keyword arguments of the transformer's forward. `hidden`, `img_ids`, `txt_ids` and `text["prompt_embeds"]`
        are this rank's sequence chunks; the other text entries are whole."""

    # --- training and accounting -----------------------------------------------------------------------------

    @abstractmethod
    def lora_targets(self, pairs: bool) -> tuple[str, ...]:
        """Module name suffixes that get LoRA adapters by default."""

    def count_parameters(self, config: dict, lora_rank: int | None, lora_layers: list[str]) -> ParameterCounts:
        """Exact counts from the transformer's config, on the meta device (nothing allocated or loaded)."""
        import json

        return _count(self, json.dumps(config, sort_keys=True), lora_rank, tuple(lora_layers))

    @abstractmethod
    def forward_flops(self, config: dict, image_tokens: int, text_tokens: int, batch: int) -> tuple[float, float]:
        """(linear layers, attention) matmul FLOPs of one forward of `batch` samples of these token counts."""

    def step_flops(self, config: dict, image_tokens: int, text_tokens: int, batch: int, lora: bool, ckpt: bool,
                   attn_recomputed: bool) -> StepFlops:  # fmt: skip
        """Model and executed FLOPs of one micro-step (`flux_cp.metrics.step_flops`)."""
        linear, attention = self.forward_flops(config, image_tokens, text_tokens, batch)
        return step_flops(linear, attention, lora, ckpt, attn_recomputed)


_COUNTS: dict[tuple, ParameterCounts] = {}


def _count(family: Family, config: str, lora_rank: int | None, lora_layers: tuple[str, ...]) -> ParameterCounts:
    import json

    key = (family.name, config, lora_rank, lora_layers)
    if key in _COUNTS:  # --plan asks for every CP size; building the model is the slow part
        return _COUNTS[key]
    with torch.device("meta"):
        model = family.transformer_class().from_config(json.loads(config))
        base = [p.numel() for p in model.parameters()]
        blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
        largest = max(sum(p.numel() for p in b.parameters()) for b in blocks)
        if lora_rank is None:
            counts = ParameterCounts(sum(base), len(base), sum(base), len(base), largest)
        else:
            from peft import LoraConfig

            from ..lora import check_targets

            check_targets(model, list(lora_layers))
            model.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=list(lora_layers)))
            lora = [p.numel() for n, p in model.named_parameters() if "lora_" in n]
            counts = ParameterCounts(sum(base), len(base), sum(lora), len(lora), largest)
    _COUNTS[key] = counts
    return counts


def transformer_class_name(path: str, revision: str | None, cache_dir: str | None = None) -> str:
    """The class a model folder or hub id declares for its transformer (transformer/config.json), else the pipeline
    class of its model_index.json; a UsageError when neither can be read. `cache_dir`: the download cache."""
    from diffusers import ConfigMixin, DiffusionPipeline

    class AnyModelConfig(ConfigMixin):  # reads a model's config.json without knowing its class
        config_name = "config.json"

    first = None
    for read in (
        lambda: AnyModelConfig.load_config(path, subfolder="transformer", revision=revision, cache_dir=cache_dir),
        lambda: DiffusionPipeline.load_config(path, revision=revision, cache_dir=cache_dir),
    ):
        try:
            name = read().get("_class_name")
        except (OSError, ValueError) as e:
            first = first or (str(e).strip().splitlines() or [type(e).__name__])[0]
            continue
        if name:
            return name
    raise UsageError(f"cannot load transformer from --pretrained_model_name_or_path {path}: {first}")


def detect(path: str, revision: str | None, families: tuple[Family, ...], cache_dir: str | None = None) -> Family:
    """The family of the model at `path` (a folder or hub id), from the classes its configs declare; a UsageError
    naming the class and the supported ones when no family claims it."""
    name = transformer_class_name(path, revision, cache_dir)
    for family in families:
        if name == family.transformer_class_name or name in family.pipeline_class_names:
            return family
    supported = ", ".join(f"{f.label} ({f.transformer_class_name})" for f in families)
    raise UsageError(f"--pretrained_model_name_or_path {path} is a {name}; flux-cp trains {supported}")
