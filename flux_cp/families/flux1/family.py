"""FLUX.1 [dev] / [schnell] and FLUX.1 Kontext [dev]: `FluxTransformer2DModel` with CLIP + T5 text encoders and
the 16-channel `AutoencoderKL`. Kontext is the same transformer fed the reference image's tokens after the
target's (flux_cp/data/pairs.py, with `tokens.reference_ids`); which of the two a run trains follows from its data
(pairs or single images).

The recipe follows diffusers' Flux training examples: latents `(x - shift_factor) * scaling_factor`, 2x2 patches
packed into tokens (`FluxPipeline._pack_latents`), position ids `(0, row, column)` for image tokens and zeros for
text, timestep / 1000, the guidance embedding for guidance-distilled checkpoints.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flux_cp.families.base import (
    FLUX_CP_PLAN,
    VAE_SIZES,
    Family,
    rope_rules,
    transformer_weight_shapes,
    vae_rules,
    vae_weight_shapes,
)
from flux_cp.families.components import load_component, load_part
from flux_cp.families.encoders import Encoders, in_batches, truncation_line
from flux_cp.families.flux1 import kohya, tokens
from flux_cp.families.flux1.known import KNOWN
from flux_cp.families.flux1.tiny import ensure_tiny_pipeline, write_flux1_dev_full_shapes, write_flux1_dev_shapes
from flux_cp.images import to_pixels
from flux_cp.terminal import printable

if TYPE_CHECKING:
    from PIL import Image

    from flux_cp.config.training import LoraConfig, ModelConfig
    from flux_cp.families.lora_format import Origin

Tensor = torch.Tensor

# Attention projections of both streams (image: to_*, text: add_*_proj / to_add_out). The benchmarks' and the
# planner tests' LoRA setting.
ATTENTION_TARGETS = (
    "attn.to_k",       "attn.to_q",       "attn.to_v",       "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
)  # fmt: skip
# The training default (`--lora_layers`), diffusers' FLUX.1 LoRA example's: attention and the MLPs of both streams.
DEFAULT_TARGETS = (*ATTENTION_TARGETS, "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
# diffusers' FLUX.1 Kontext LoRA example's default targets: FLUX.1's, and the single blocks' MLP input.
KONTEXT_TARGETS = (*DEFAULT_TARGETS, "proj_mlp")


class Flux1Encoders(Encoders):
    """FLUX.1's VAE, CLIP (pooled embedding) and T5 (token embeddings)."""

    text_keys = ("prompt_embeds", "pooled_prompt_embeds")
    tokenizer_folders = ("tokenizer_2", "tokenizer")

    def __init__(self, vae, clip, tokenizer, t5, tokenizer_2, device: torch.device, dtype: torch.dtype):
        # T5 first: the order of the fingerprints in the text cache key
        super().__init__(vae, {"text_encoder_2": t5, "text_encoder": clip}, device, dtype)
        self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2

    @torch.no_grad()
    def prompts(self, captions: list[str], max_sequence_length: int) -> dict[str, Tensor]:
        """`prompt_embeds`: T5 embeddings `[B, L, D]`, and `pooled_prompt_embeds`: CLIP pooled embeddings `[B, D']`,
        as FluxPipeline.encode_prompt."""
        # One text encoder on the accelerator at a time, each over all the captions (flux_cp.placement)
        with self.placement.use("text_encoder") as clip:
            pooled = in_batches(lambda batch: {"pooled_prompt_embeds": self._clip(clip, batch)}, captions)
        with self.placement.use("text_encoder_2") as t5:
            embeds = in_batches(lambda batch: {"prompt_embeds": self._t5(t5, batch, max_sequence_length)}, captions)
        return {**embeds, **pooled}

    def _clip(self, clip, captions: list[str]) -> Tensor:
        ids = self.tokenizer(
            captions,
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        return clip(ids.to(self.device), output_hidden_states=False).pooler_output.to(self.dtype)

    def _t5(self, t5, captions: list[str], max_sequence_length: int) -> Tensor:
        ids = self.tokenizer_2(
            captions, padding="max_length", max_length=max_sequence_length, truncation=True, return_tensors="pt"
        ).input_ids
        return t5(ids.to(self.device), output_hidden_states=False)[0].to(self.dtype)

    def trained_text(self, module: torch.nn.Module, captions: list[str]) -> Tensor:
        """CLIP's pooled embedding `[B, D']` of `captions` from `module` (--train_text_encoder), as `prompts` computes
        it."""
        ids = self.tokenizer(
            captions,
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        return module(ids.to(self.device), output_hidden_states=False).pooler_output

    def truncation_warnings(self, captions: list[str], max_sequence_length: int) -> list[str]:
        """T5's window is --max_sequence_length (its end-of-text token included); CLIP's, its 77 tokens (only its
        pooled embedding is used), as FluxPipeline cuts them."""
        t5 = [len(ids) for ids in self.tokenizer_2(captions)["input_ids"]]
        clip = [len(ids) for ids in self.tokenizer(captions)["input_ids"]]
        clip_window = self.tokenizer.model_max_length
        t5_window = f"T5's {max_sequence_length} tokens (--max_sequence_length)"
        t5_fix = "raise --max_sequence_length (at most 512) or shorten them"
        clip_note = "its pooled embedding sees their beginning only, as in FluxPipeline"
        lines = [
            truncation_line(t5, max_sequence_length, t5_window, t5_fix),
            truncation_line(clip, clip_window, f"CLIP's {clip_window} tokens", clip_note),
        ]
        return [line for line in lines if line]

    def text_shapes(self, max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        """`prompt_embeds` (T5, `[L, D]`) and `pooled_prompt_embeds` (CLIP, `[D']`)."""
        return {
            "prompt_embeds": (max_sequence_length, self.text_encoders["text_encoder_2"].config.d_model),
            "pooled_prompt_embeds": (self.text_encoders["text_encoder"].config.hidden_size,),
        }


def forward_flops(config: dict, image_tokens: int, text_tokens: int, batch: int) -> tuple[float, float]:
    """(linear, attention) forward FLOPs of a FLUX.1 transformer (`FluxTransformer2DModel`'s config) on `batch`
    samples of these token counts, matmuls only, per-token layers exactly:

    - every token passes one stream of each double block and each single block: 12 D^2 weights (double: q, k,
      v, out + the 4x MLP; single: q, k, v + the 4x MLP + the 5D -> D output projection), 2 FLOPs each;
    - image tokens pass x_embedder and proj_out, text tokens the context_embedder;
    - attention: q k^T and p v over the whole sequence, 4 S^2 D per layer.
    The adaLN modulation and the timestep, guidance and pooled-text embedders act once per sample (a few
    hundred-thousandths of a 1024 px step at FLUX.1-dev's size) and are left out."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    layers = config["num_layers"] + config["num_single_layers"]
    s = image_tokens + text_tokens
    out = config.get("out_channels") or config["in_channels"]
    embed = image_tokens * (config["in_channels"] + out) * d + text_tokens * config["joint_attention_dim"] * d
    linear = 2 * (12 * d * d * layers * s + embed) * batch
    attention = 4 * s * s * d * layers * batch
    return float(linear), float(attention)


# FLUX.1's config sizes (flux_cp.families.model_config): each (smallest, largest), the largest about ten times FLUX.1
# [dev]'s (its transformer, the VAE, CLIP ViT-L/14's text tower, the T5 v1.1 XXL encoder)
CONFIG_SIZES = {
    "transformer": {
        "patch_size": (1, 16),
        "in_channels": (1, 640),
        "out_channels": (1, 640),
        "num_layers": (0, 200),
        "num_single_layers": (0, 400),
        "attention_head_dim": (1, 1280),
        "num_attention_heads": (1, 240),
        "joint_attention_dim": (1, 40960),
        "pooled_projection_dim": (1, 7680),
        "axes_dims_rope": (1, 1280),
    },
    "vae": VAE_SIZES,
    "text_encoder": {
        "vocab_size": (1, 494080),
        "hidden_size": (1, 7680),
        "intermediate_size": (1, 30720),
        "num_hidden_layers": (1, 120),
        "num_attention_heads": (1, 120),
        "max_position_embeddings": (1, 770),
        "projection_dim": (1, 7680),
    },
    "text_encoder_2": {
        "vocab_size": (1, 321280),
        "d_model": (1, 40960),
        "d_kv": (1, 640),
        "d_ff": (1, 102400),
        "num_layers": (1, 240),
        "num_heads": (1, 640),
        "relative_attention_num_buckets": (1, 320),
        "relative_attention_max_distance": (1, 1280),
    },
}


class Flux1(Family):
    name = "flux1"
    label = "FLUX.1"
    pairs_label = "FLUX.1 Kontext"
    max_references = 1  # FluxKontextPipeline edits one image
    transformer_class_name = "FluxTransformer2DModel"
    pipeline_class_names = (
        "FluxPipeline",
        "FluxKontextPipeline",
        "FluxImg2ImgPipeline",
        "FluxInpaintPipeline",
        "FluxFillPipeline",
        "FluxControlPipeline",
    )
    block_lists = (
        ("double", "transformer_blocks", "num_layers"),
        ("single", "single_transformer_blocks", "num_single_layers"),
    )
    lora_layouts = ("diffusers", "kohya")
    card_tags, pairs_card_tags = ("flux",), ("flux-kontext",)
    comfyui_mapping = "Flux"
    known = KNOWN
    trained_text_encoder = ("text_encoder", "pooled_projections", "pooled_prompt_embeds")  # CLIP, as diffusers' example
    trained_text_encoder_targets = ("q_proj", "k_proj", "v_proj", "out_proj")  # CLIP's attention, as diffusers' example
    config_sizes = CONFIG_SIZES
    comfyui_transformer = (
        "`transformer/` is in diffusers' layout, in shards of at most 10 GB. ComfyUI's *Load Diffusion Model* node "
        "reads one `.safetensors` file from `ComfyUI/models/diffusion_models/` and converts diffusers' key names "
        "for Flux: merge the shards into one file first (not tested here)."
    )

    def transformer_class(self) -> type:
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel

    def embedded_default(self, pairs: bool) -> str:
        return str(ensure_tiny_pipeline(kontext=pairs))

    shapes_preset = ("flux1-dev-shapes", "FLUX.1")
    tiny_aliases = {"kontext": ("flux1-kontext", "Save it as a FluxKontextPipeline (FLUX.1 Kontext).")}

    def tiny_builds(self) -> dict[tuple[str, str], Callable[[str], Path]]:
        out = {}
        for name, kontext in (("flux1", False), ("flux1-kontext", True)):
            out[(name, "tiny")] = functools.partial(ensure_tiny_pipeline, kontext=kontext)
            out[(name, "flux1-dev-shapes")] = functools.partial(write_flux1_dev_shapes, kontext=kontext)
            out[(name, "flux1-dev-full-shapes")] = functools.partial(write_flux1_dev_full_shapes, kontext=kontext)
        return out

    def embedded_snippet(self, pairs: bool) -> tuple[str, str]:
        return (
            "from flux_cp.tiny import ensure_tiny_pipeline  # the tiny Flux this demo trained",
            f"ensure_tiny_pipeline({'kontext=True' if pairs else ''})",
        )

    def snippet_call(self, pairs: bool, size: int) -> tuple[str, str]:
        if not pairs:
            return "", ""
        # FluxKontextPipeline renders max_area pixels (default 1024^2) whatever height and width, and would resize the
        # reference to one of its preferred sizes (about 1024^2): both as trained instead
        return (
            f", max_area={size * size}, _auto_resize=False",
            "  # at the trained size, which the pipeline keeps (_auto_resize=False)",
        )

    def read_lora_layout(
        self, fmt: str, state: dict[str, Tensor], linears: dict[str, tuple[int, int]], trained: set[str], rank: int
    ) -> tuple[dict, dict]:
        if fmt != "kohya":
            return super().read_lora_layout(fmt, state, linears, trained, rank)
        return kohya.from_kohya(state, linears, trained, rank)

    def check_export(self, config: dict, lora: LoraConfig) -> None:
        kohya.check_export(config, lora)

    def lora_layout(
        self, fmt: str, state: dict[str, Tensor], lora: LoraConfig, origin: Origin | None, guidance: bool
    ) -> tuple[dict[str, Tensor], dict[str, str]]:
        if fmt != "kohya":
            return super().lora_layout(fmt, state, lora, origin, guidance)
        weights = kohya.to_kohya(state, lora.rank, lora.lora_alpha)
        return weights, kohya.metadata(rank=lora.rank, alpha=lora.lora_alpha, origin=origin, guidance=guidance)

    def config_rules(self, configs: dict[str, dict]) -> list[tuple[str, str, str]]:
        t, vae, clip, t5 = (configs.get(k, {}) for k in ("transformer", "vae", "text_encoder", "text_encoder_2"))
        out = rope_rules(t) + vae_rules(vae)
        feeds = (
            ("in_channels", vae, "latent_channels", 4, "4 x the VAE's latent_channels (2x2 patches)"),
            ("joint_attention_dim", t5, "d_model", 1, "the T5 encoder's d_model (text_encoder_2)"),
            ("pooled_projection_dim", clip, "hidden_size", 1, "the CLIP encoder's hidden_size (text_encoder)"),
        )
        for key, other, other_key, times, what in feeds:
            if isinstance(other.get(other_key), int) and t.get(key) != times * other[other_key]:
                out.append(("transformer", key, f"is {t.get(key)}, not {what}: {times * other[other_key]}"))
        return out

    def weight_shapes(self, component: str, config: dict) -> dict[str, tuple[int, ...]]:
        c = config
        if component == "transformer":  # and the pooled CLIP projection, FLUX.1's own
            inner = c["num_attention_heads"] * c["attention_head_dim"]
            pooled = {"time_text_embed.text_embedder.linear_1.weight": (inner, c["pooled_projection_dim"])}
            return transformer_weight_shapes(c) | pooled
        if component == "vae":
            return vae_weight_shapes(c, 4)
        if component == "text_encoder" and isinstance(c.get("hidden_size"), int):
            embeds = {"token_embedding": c.get("vocab_size"), "position_embedding": c.get("max_position_embeddings")}
            return {
                f"{prefix}embeddings.{name}.weight": (rows, c["hidden_size"])
                for name, rows in embeds.items()
                if isinstance(rows, int)
                for prefix in ("text_model.", "")
            }
        if component == "text_encoder_2" and isinstance(c.get("vocab_size"), int) and isinstance(c.get("d_model"), int):
            return {name: (c["vocab_size"], c["d_model"]) for name in ("shared.weight", "encoder.embed_tokens.weight")}
        return {}

    def weight_layers(self, component: str) -> tuple[tuple[str, str, bool], ...]:
        layers = {
            "text_encoder": (
                ("text_model.encoder.layers.{}", "num_hidden_layers", False),
                ("encoder.layers.{}", "num_hidden_layers", False),
            ),
            "text_encoder_2": (("encoder.block.{}", "num_layers", False),),
        }
        return layers.get(component, super().weight_layers(component))

    def encoder_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKL
        from transformers import CLIPTextModel, T5EncoderModel

        return {"text_encoder": CLIPTextModel, "text_encoder_2": T5EncoderModel, "vae": AutoencoderKL}

    def load_encoders(self, model: ModelConfig, path: str, dtype: torch.dtype, device: torch.device) -> Encoders:
        from diffusers import AutoencoderKL  # diffusers and transformers at first use (seconds to import)
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        rev, cache = model.revision, model.cache_dir
        kw = {"variant": model.variant} if model.variant else {}

        def load(cls, subfolder: str):  # into host memory: flux_cp.placement puts one at a time on `device`
            return load_part(cls, path, subfolder, model, dtype, torch_dtype=dtype, cache_dir=cache, **kw).eval()

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
        return Flux1Encoders(vae, clip, tokenizer, t5, tokenizer_2, device, dtype)

    def pairs_warning(self, path: str, pipeline_class: str | None) -> str | None:
        if pipeline_class in (None, "FluxKontextPipeline"):
            return None
        return (
            f"the data has reference images but {path} is a {printable(pipeline_class)}: training it on pairs starts "
            "FLUX.1 Kontext from scratch; for image editing fine-tune black-forest-labs/FLUX.1-Kontext-dev"
        )

    def normalizer(self, vae):
        shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor
        return lambda latents: (latents - shift) * scale

    def default_vae_encode_mode(self, pairs: bool) -> str:
        # diffusers' FLUX.1 LoRA example samples the posterior; its Kontext example takes the mode by default
        return "mode" if pairs else "sample"

    def pipeline_class_name(self, pairs: bool) -> str:
        return "FluxKontextPipeline" if pairs else "FluxPipeline"

    def validation_pipeline(self, pairs: bool, scheduler, encoders: Encoders, transformer):
        from diffusers import FluxKontextPipeline, FluxPipeline

        return (FluxKontextPipeline if pairs else FluxPipeline)(
            scheduler=scheduler,
            vae=encoders.vae,
            transformer=transformer,
            text_encoder=None,
            tokenizer=None,
            text_encoder_2=None,
            tokenizer_2=None,
        )

    @torch.no_grad()
    def reference_inputs(
        self, image: Image.Image | list[Image.Image], encoders: Encoders, device: torch.device
    ) -> dict:
        # FluxKontextPipeline takes the reference as ready latents (the VAE's mean, normalised), so its own
        # resizing to preferred resolutions does not apply; it appends their tokens after the target's
        # (cp.full_sequence_io splits the two as one segment, as in training); max_area keeps the requested size.
        if isinstance(image, list):  # refused with the flags (check_reference_limit)
            raise ValueError("FLUX.1 Kontext validation edits one reference image")
        vae = encoders.vae
        pixels = to_pixels(image, image.size, image.size, (0, 0), False)[None].to(device, vae.dtype)
        with encoders.placement.use("vae"), encoders.vae_tiles(encoders.tiled_encode):
            latents = self.normalizer(vae)(vae.encode(pixels).latent_dist.mean)
        return {"image": latents, "max_area": image.size[0] * image.size[1]}

    def pack(self, latents: Tensor) -> Tensor:
        return tokens.pack_latents(latents)

    def image_ids(self, height: int, width: int, device=None) -> Tensor:
        return tokens.image_ids(height, width, device=device)

    def reference_ids(self, height: int, width: int, device=None, index: int = 0) -> Tensor:
        if index:
            raise ValueError("FLUX.1 Kontext takes one reference image per target")
        return tokens.reference_ids(height, width, device=device)

    def text_ids(self, length: int, device=None) -> Tensor:
        return tokens.text_ids(length, device=device)

    cp_plan = FLUX_CP_PLAN

    def transformer_inputs(
        self,
        hidden: Tensor,
        img_ids: Tensor,
        text: dict[str, Tensor],
        txt_ids: Tensor,
        timestep: Tensor,
        guidance: Tensor | None,
    ) -> dict:
        return dict(
            hidden_states=hidden,
            encoder_hidden_states=text["prompt_embeds"],
            pooled_projections=text["pooled_prompt_embeds"],
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )

    def lora_targets(self, pairs: bool, config: dict | None = None) -> tuple[str, ...]:
        return KONTEXT_TARGETS if pairs else DEFAULT_TARGETS

    def forward_flops(self, config: dict, image_tokens: int, text_tokens: int, batch: int) -> tuple[float, float]:
        return forward_flops(config, image_tokens, text_tokens, batch)


FLUX1 = Flux1()
