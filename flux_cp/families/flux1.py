"""FLUX.1 [dev] / [schnell] and FLUX.1 Kontext [dev]: `FluxTransformer2DModel` with CLIP + T5 text encoders and
the 16-channel `AutoencoderKL`. Kontext is the same transformer fed the reference image's tokens after the
target's (flux_cp/kontext.py); which of the two a run trains follows from its data (pairs or single images).

The recipe follows diffusers' Flux training examples: latents `(x - shift_factor) * scaling_factor`, 2x2 patches
packed into tokens (`FluxPipeline._pack_latents`), position ids `(0, row, column)` for image tokens and zeros for
text, timestep / 1000, the guidance embedding for guidance-distilled checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import flow, lora, metrics
from .base import Family

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..encode import Encoders

Tensor = torch.Tensor


class Flux1(Family):
    name = "flux1"
    label = "FLUX.1"
    transformer_class_name = "FluxTransformer2DModel"
    pipeline_class_names = ("FluxPipeline", "FluxKontextPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline",
                            "FluxFillPipeline", "FluxControlPipeline")  # fmt: skip

    def transformer_class(self) -> type:
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel

    def embedded_default(self, pairs: bool) -> str:
        from ..tiny import ensure_tiny_pipeline

        return str(ensure_tiny_pipeline(kontext=pairs))

    def load_encoders(self, model: ModelConfig, path: str, dtype: torch.dtype, device: torch.device) -> Encoders:
        from diffusers import AutoencoderKL
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        from ..encode import Encoders
        from ..model import load_component

        rev, cache = model.revision, model.cache_dir
        kw = {"variant": model.variant} if model.variant else {}

        def load(cls, subfolder: str):
            return load_component(cls, path, subfolder, rev, torch_dtype=dtype, cache_dir=cache, **kw).to(device).eval()

        vae, clip, t5 = (
            load(AutoencoderKL, "vae"),
            load(CLIPTextModel, "text_encoder"),
            load(T5EncoderModel, "text_encoder_2"),
        )
        for m in (vae, clip, t5):
            m.requires_grad_(False)
        tokenizer, tokenizer_2 = (
            load_component(CLIPTokenizer, path, "tokenizer", rev, cache_dir=cache),
            load_component(T5TokenizerFast, path, "tokenizer_2", rev, cache_dir=cache),
        )
        return Encoders(vae, clip, tokenizer, t5, tokenizer_2, device, dtype)

    def normalizer(self, vae):
        shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor
        return lambda latents: (latents - shift) * scale

    def pipeline_class_name(self, pairs: bool) -> str:
        return "FluxKontextPipeline" if pairs else "FluxPipeline"

    def validation_pipeline(self, pairs: bool, scheduler, vae, transformer):
        from diffusers import FluxKontextPipeline, FluxPipeline

        return (FluxKontextPipeline if pairs else FluxPipeline)(
            scheduler=scheduler, vae=vae, transformer=transformer, text_encoder=None, tokenizer=None,
            text_encoder_2=None, tokenizer_2=None,
        )  # fmt: skip

    def reference_inputs(self, reference: Tensor, resolution: int) -> dict:
        # FluxKontextPipeline appends the reference tokens after the target's (cp.full_sequence_io splits the two
        # as one segment, as in training); max_area keeps the requested size (it defaults to 1024^2).
        return {"image": reference, "max_area": resolution * resolution}

    def pack(self, latents: Tensor) -> Tensor:
        return flow.pack_latents(latents)

    def image_ids(self, height: int, width: int, device=None) -> Tensor:
        return flow.image_ids(height, width, device=device)

    def text_ids(self, length: int, device=None) -> Tensor:
        return flow.text_ids(length, device=device)

    def transformer_inputs(self, hidden: Tensor, img_ids: Tensor, text: dict[str, Tensor], txt_ids: Tensor,
                           timestep: Tensor, guidance: Tensor | None) -> dict:  # fmt: skip
        return dict(
            hidden_states=hidden, encoder_hidden_states=text["prompt_embeds"],
            pooled_projections=text["pooled_prompt_embeds"], timestep=timestep, img_ids=img_ids, txt_ids=txt_ids,
            guidance=guidance, return_dict=False,
        )  # fmt: skip

    def lora_targets(self, pairs: bool) -> tuple[str, ...]:
        return lora.DEFAULT_TARGETS

    def forward_flops(self, config: dict, image_tokens: int, text_tokens: int, batch: int) -> tuple[float, float]:
        return metrics.flux_forward_flops(config, image_tokens, text_tokens, batch)


FLUX1 = Flux1()
