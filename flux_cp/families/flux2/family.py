"""FLUX.2 [dev] and FLUX.2 [klein]: `Flux2Transformer2DModel` (the same class for both; [klein] has no guidance
embedding), the 32-channel `AutoencoderKLFlux2` whose latents are normalised with its batch-norm statistics, and one
causal language model as text encoder ([dev]: Mistral 3, `Flux2Pipeline`; [klein]: Qwen3, `Flux2KleinPipeline`).
The model folder's pipeline class tells the two apart. Editing samples (one or more reference images per target)
train the same model on `[target; reference_1; ...; reference_k]`, as diffusers' img2img examples (one reference)
and the pipelines' `image=[...]` argument (any number).

The recipe is diffusers' FLUX.2 LoRA examples', as the pure functions of `recipe.py` beside this module (each citing
the example's lines): latents are the posterior's mode, 2x2-patchified to 128 channels and normalised with the VAE's
batch-norm statistics; tokens are the patchified latent's pixels in row-major order; ids have four axes (t, row,
column, text position), reference j's t = 10 + 10 j; the prompt embedding stacks three hidden layers of the text
encoder; guidance only where the transformer embeds it. Where this differs from the examples: docs/design.md.
"""

from __future__ import annotations

import functools
import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flux_cp.errors import UsageError
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
from flux_cp.families.flux2 import recipe
from flux_cp.families.flux2.tiny import (
    FLUX2_LATENT_CHANNELS,
    ensure_tiny_flux2_pipeline,
    write_flux2_full_shapes,
    write_flux2_shapes,
)
from flux_cp.terminal import printable

if TYPE_CHECKING:
    from PIL import Image

    from flux_cp.config.flags import Config
    from flux_cp.config.training import ModelConfig

Tensor = torch.Tensor

# diffusers' FLUX.2 LoRA examples' targets (train_dreambooth_lora_flux2.py:1297-1300): the double blocks' image
# attention (q, k, v, out), the single blocks' fused qkv + MLP input, and each single block's fused output (named
# per block: `to_out.0` matches only the double blocks' ModuleList entry).
ATTENTION_TARGETS = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj")


def single_block_outputs(n: int) -> tuple[str, ...]:
    return tuple(f"single_transformer_blocks.{i}.attn.to_out" for i in range(n))


# The caption's share of --max_sequence_length at least, after the chat template's own tokens before it: a window
# with less room trains on captions cut to a few words (none: every caption encodes alike, unconditional training).
MIN_CAPTION_TOKENS = 16
# Bounds of one rendering of the tokenizer's chat template (rendered once at start with them): a template that loops
# without end, or writes without end, is refused naming its file instead of stalling the encoding of every caption.
TEMPLATE_SECONDS = 5.0
TEMPLATE_CHARS = 1_000_000


class _TooSlow(BaseException):
    """Raised by the timer inside a rendering that ran out of time (not an Exception: nothing in jinja catches it)."""


def _within(seconds: float, work):
    """`work()` stopped after `seconds` by the main thread's interval timer (raising _TooSlow); elsewhere unbounded."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return work()

    def stop(signum, frame):  # noqa: ANN001, ARG001 - a signal handler's signature
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return work()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _tokenizer_file(path: str, name: str, revision: str | None, cache_dir: str | None) -> str | None:
    """A file of a FLUX.2 folder's tokenizer/ (local or from the hub's cache), None where there is none."""
    from transformers.utils import cached_file

    return cached_file(
        path,
        name,
        subfolder="tokenizer",
        revision=revision,
        cache_dir=cache_dir,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )


def template_file(path: str, revision: str | None, cache_dir: str | None = None) -> str:
    """Where the tokenizer's chat template of a FLUX.2 folder is read from (for messages)."""
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        found = _tokenizer_file(path, name, revision, cache_dir)
        if found:
            return found
    return f"{path}/tokenizer"


def bounded_chat_text(tokenizer, caption: str, klein: bool, where: str) -> str:
    """`recipe.chat_text` within TEMPLATE_SECONDS and TEMPLATE_CHARS; a template that fails or exceeds them is a
    UsageError naming its file `where`."""
    try:
        text = _within(TEMPLATE_SECONDS, lambda: recipe.chat_text(tokenizer, caption, klein))
    except _TooSlow:
        raise UsageError(
            f"the tokenizer's chat template ({printable(where)}) takes more than {TEMPLATE_SECONDS:g} s to render one "
            "caption: FLUX.2's prompt encoding renders it for every caption. Use the model's own tokenizer files"
        ) from None
    except Exception as e:  # noqa: BLE001 - jinja's sandbox, its syntax and the template's own errors alike
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UsageError(
            f"the tokenizer's chat template ({printable(where)}) cannot be rendered ({type(e).__name__}: "
            f"{printable(first)}): FLUX.2's prompt encoding renders it for every caption. Use the model's own "
            "tokenizer files"
        ) from None
    if not isinstance(text, str) or len(text) > TEMPLATE_CHARS:
        size = f"{len(text)} characters" if isinstance(text, str) else f"a {type(text).__name__}"
        raise UsageError(
            f"the tokenizer's chat template ({printable(where)}) renders {size} for one caption (at most "
            f"{TEMPLATE_CHARS}): use the model's own tokenizer files"
        )
    return text


class Flux2Encoders(Encoders):
    """FLUX.2's VAE (its batch-norm statistics kept in fp32) and its text encoder with tokenizer: the prompt
    embedding is three hidden layers of the language model stacked on the feature axis, as the pipeline's
    `encode_prompt` (`flux_cp.families.flux2.recipe.encode_prompts`)."""

    tokenizer_folders = ("tokenizer",)  # its chat template too

    def __init__(
        self, vae, text_encoder, tokenizer, klein: bool, is_distilled: bool, device: torch.device, dtype: torch.dtype
    ):
        super().__init__(vae, {"text_encoder": text_encoder}, device, dtype)
        self.tokenizer, self.klein, self.is_distilled = tokenizer, klein, is_distilled
        self.layers = recipe.KLEIN_TEXT_LAYERS if klein else recipe.DEV_TEXT_LAYERS
        self.text_recipe = "layers=" + ",".join(map(str, self.layers))

    @torch.no_grad()
    def prompts(self, captions: list[str], max_sequence_length: int) -> dict[str, Tensor]:
        """`prompt_embeds` `[B, L, 3 * hidden]`, as Flux2Pipeline / Flux2KleinPipeline.encode_prompt."""
        with self.placement.use("text_encoder") as text_encoder:  # alone on the accelerator (flux_cp.placement)

            def encode(batch: list[str]) -> dict[str, Tensor]:
                embeds, _ = recipe.encode_prompts(
                    text_encoder,
                    self.tokenizer,
                    batch,
                    klein=self.klein,
                    max_sequence_length=max_sequence_length,
                    layers=self.layers,
                    device=self.device,
                )
                return {"prompt_embeds": embeds.to(self.dtype)}

            return in_batches(encode, captions)

    def truncation_warnings(self, captions: list[str], max_sequence_length: int) -> list[str]:
        """The window is --max_sequence_length tokens of the chat template with the caption in it: the template's
        tokens before the caption, then the caption's (the template's end is cut first, as in the pipelines)."""
        before = recipe.tokens_before_caption(self.tokenizer, self.klein)
        lengths = [before + len(ids) for ids in self.tokenizer(captions, add_special_tokens=False)["input_ids"]]
        window = (
            f"the {max_sequence_length} tokens of --max_sequence_length, {before} of which the chat template "
            "takes before the caption"
        )
        line = truncation_line(
            lengths, max_sequence_length, window, "raise --max_sequence_length (at most 512) or shorten them"
        )
        return [line] if line else []

    def text_shapes(self, max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        """`prompt_embeds` `[L, 3 * hidden]` (the language model's hidden size: its input embeddings' width)."""
        hidden = self.text_encoders["text_encoder"].get_input_embeddings().embedding_dim
        return {"prompt_embeds": (max_sequence_length, len(self.layers) * hidden)}


def load_tokenizer(path: str, revision: str | None, cache_dir: str | None = None):
    """The `tokenizer` component of a FLUX.2 folder as a plain tokenizer (AutoTokenizer), with its chat template.

    FLUX.2 [dev] ships a PixtralProcessor there, which transformers loads only with torchvision (not a dependency
    here); the pipeline's prompt encoding calls nothing but `apply_chat_template`, which the tokenizer has. A
    processor may keep the chat template beside the tokenizer (chat_template.jinja / chat_template.json) instead of
    in it: it is read from there when the tokenizer has none."""
    from transformers import AutoTokenizer  # transformers at first use (seconds to import)

    tokenizer = load_component(AutoTokenizer, path, "tokenizer", revision, cache_dir=cache_dir)
    if tokenizer.chat_template:
        return tokenizer
    for name in ("chat_template.jinja", "chat_template.json"):
        found = _tokenizer_file(path, name, revision, cache_dir)
        if found:
            try:
                with open(found, encoding="utf-8") as f:
                    text = f.read()
                template = json.loads(text)["chat_template"] if name.endswith(".json") else text
            except (OSError, ValueError, KeyError, TypeError) as e:  # ValueError: not UTF-8 or not JSON
                raise UsageError(
                    f"the tokenizer's chat template ({printable(found)}) cannot be read: "
                    f"{type(e).__name__}: {printable(e)}"
                ) from None
            if not isinstance(template, str):
                raise UsageError(f"the tokenizer's chat template ({printable(found)}) is not text")
            tokenizer.chat_template = template
            return tokenizer
    raise UsageError(
        f"the tokenizer of --pretrained_model_name_or_path {path} has no chat template (none in tokenizer/, nor a "
        "chat_template.jinja or chat_template.json there): FLUX.2's prompt encoding needs the text encoder's"
    )


def forward_flops(config: dict, image_tokens: int, text_tokens: int, batch: int) -> tuple[float, float]:
    """(linear, attention) forward FLOPs of a `Flux2Transformer2DModel` on `batch` samples of these token counts,
    matmuls only, per-token layers exactly:

    - every token passes one stream of each double block and each single block: (4 + 3r) D^2 weights, r the
      mlp_ratio (double: q, k, v, out and the SwiGLU MLP, D -> 2rD -> rD -> D; single: the fused q, k, v + MLP input,
      D -> 3D + 2rD, and the fused output, (1 + r)D -> D), 2 FLOPs each;
    - image tokens pass x_embedder and proj_out, text tokens the context_embedder;
    - attention: q k^T and p v over the whole sequence, 4 S^2 D per layer.
    The modulations and the timestep / guidance embedders act once per sample and are left out."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    layers = config["num_layers"] + config["num_single_layers"]
    r = config["mlp_ratio"]
    s = image_tokens + text_tokens
    out = (config.get("patch_size") or 1) ** 2 * (config.get("out_channels") or config["in_channels"])
    embed = image_tokens * (config["in_channels"] + out) * d + text_tokens * config["joint_attention_dim"] * d
    linear = 2 * ((4 + 3 * r) * d * d * layers * s + embed) * batch
    attention = 4 * s * s * d * layers * batch
    return float(linear), float(attention)


# FLUX.2 layers whose diffusers names ComfyUI's Flux LoRA mapping (comfy/utils.py `flux_to_diffusers`, which ComfyUI
# applies to FLUX.2 too) does not list: it logs their LoRAs "lora key not loaded" and leaves them out. Every other
# linear layer of Flux2Transformer2DModel it maps (tests/test_lora_format.py checks this list against its rules).
COMFYUI_UNMAPPED = (
    "time_guidance_embed.timestep_embedder.linear_1",
    "time_guidance_embed.timestep_embedder.linear_2",
    "time_guidance_embed.guidance_embedder.linear_1",
    "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.linear",
    "single_stream_modulation.linear",
)


# The language models' sizes: Mistral Small 3.1 24B ([dev]) and Qwen3-8B ([klein] 9B), about ten times over
_LM_SIZES = {
    "vocab_size": (1, 1520000),
    "hidden_size": (1, 51200),
    "intermediate_size": (1, 327680),
    "num_hidden_layers": (1, 400),
    "num_attention_heads": (1, 320),
    "num_key_value_heads": (1, 320),
    "head_dim": (1, 1280),
    "max_position_embeddings": (1, 1310720),
}
# FLUX.2's config sizes (flux_cp.families.model_config): each (smallest, largest), the largest about ten times FLUX.2
# [dev]'s (its transformer, the VAE, and the text encoder: [dev]'s Mistral 3 with its Pixtral vision tower, [klein]'s
# Qwen3)
CONFIG_SIZES = {
    "transformer": {
        "patch_size": (1, 16),
        "in_channels": (1, 1280),
        "out_channels": (1, 1280),
        "num_layers": (0, 100),
        "num_single_layers": (0, 480),
        "attention_head_dim": (1, 1280),
        "num_attention_heads": (1, 480),
        "joint_attention_dim": (1, 153600),
        "timestep_guidance_channels": (1, 2560),
        "mlp_ratio": (0.0, 40.0),
        "axes_dims_rope": (1, 1280),
    },
    "vae": VAE_SIZES,
    "text_encoder": {
        **_LM_SIZES,
        **{f"text_config.{k}": v for k, v in _LM_SIZES.items()},
        "vision_config.hidden_size": (1, 10240),
        "vision_config.num_hidden_layers": (1, 240),
        "vision_config.num_attention_heads": (1, 160),
        "vision_config.intermediate_size": (1, 40960),
        "vision_config.image_size": (1, 15400),
        "vision_config.patch_size": (1, 140),
    },
}


class Flux2(Family):
    """FLUX.2 [dev] (`klein=False`) or [klein]."""

    transformer_class_name = "Flux2Transformer2DModel"
    block_lists = (
        ("double", "transformer_blocks", "num_layers"),
        ("single", "single_transformer_blocks", "num_single_layers"),
    )
    # Flux2Pipeline.load_lora_weights refuses alpha keys, and ComfyUI reads no other alpha: the scale goes in lora_B
    lora_alpha_keys = False
    card_tags = ("flux2", "flux2-diffusers")
    comfyui_mapping = "Flux (FLUX.2 included)"
    # comfy/model_detection.py convert_diffusers_mmdit reads Flux's x_embedder.bias, which FLUX.2 lacks
    comfyui_transformer = (
        "`transformer/` is in diffusers' layout, in shards of at most 10 GB. ComfyUI's *Load Diffusion Model* node "
        "converts diffusers' key names for FLUX.1 only: convert the transformer to BFL's layout for FLUX.2 first (not "
        "tested here)."
    )
    comfyui_unmapped = COMFYUI_UNMAPPED
    config_sizes = CONFIG_SIZES
    # its blocks, and the modulation linears they share (quantized like the blocks' own)
    quantized_parts = (
        "transformer_blocks",
        "single_transformer_blocks",
        "double_stream_modulation_img",
        "double_stream_modulation_txt",
        "single_stream_modulation",
    )

    def __init__(self, klein: bool):
        self.klein = klein
        self.name = "flux2-klein" if klein else "flux2"
        self.label = self.pairs_label = "FLUX.2 [klein]" if klein else "FLUX.2 [dev]"
        self.pipeline_class_names = (
            ("Flux2KleinPipeline", "Flux2KleinKVPipeline", "Flux2KleinInpaintPipeline") if klein else ("Flux2Pipeline",)
        )
        # the examples' count of single blocks named in the LoRA targets when the transformer is not known
        self.released_single_blocks = 24 if klein else 48

    def transformer_class(self) -> type:
        from diffusers import Flux2Transformer2DModel

        return Flux2Transformer2DModel

    def embedded_default(self, pairs: bool) -> str:
        return str(ensure_tiny_flux2_pipeline(klein=self.klein))

    @property
    def shapes_preset(self) -> tuple[str, str]:
        return ("flux2-klein-shapes", f"{self.label} 4B") if self.klein else ("flux2-dev-shapes", self.label)

    def tiny_builds(self) -> dict[tuple[str, str], Callable[[str], Path]]:
        name, shapes = self.name, "flux2-klein" if self.klein else "flux2-dev"
        return {
            (name, "tiny"): functools.partial(ensure_tiny_flux2_pipeline, klein=self.klein),
            (name, f"{shapes}-shapes"): functools.partial(write_flux2_shapes, klein=self.klein),
            (name, f"{shapes}-full-shapes"): functools.partial(write_flux2_full_shapes, klein=self.klein),
        }

    def embedded_snippet(self, pairs: bool) -> tuple[str, str]:
        return (
            "from flux_cp.families.flux2.tiny import ensure_tiny_flux2_pipeline  # the tiny FLUX.2 this run trained",
            f"ensure_tiny_flux2_pipeline({'klein=True' if self.klein else ''})",
        )

    def config_rules(self, configs: dict[str, dict]) -> list[tuple[str, str, str]]:
        t, vae, text = (configs.get(k, {}) for k in ("transformer", "vae", "text_encoder"))
        out = rope_rules(t) + vae_rules(vae)
        latent = vae.get("latent_channels", FLUX2_LATENT_CHANNELS) if vae else None
        if isinstance(latent, int) and t.get("in_channels") != 4 * latent:
            out.append(
                (
                    "transformer",
                    "in_channels",
                    f"is {t.get('in_channels')}, not 4 x the VAE's latent_channels (2x2 patches): {4 * latent}",
                )
            )
        width = (text.get("text_config") or text).get("hidden_size") if isinstance(text, dict) else None
        if isinstance(width, int) and t.get("joint_attention_dim") != 3 * width:
            out.append(
                (
                    "transformer",
                    "joint_attention_dim",
                    f"is {t.get('joint_attention_dim')}, not 3 x the text "
                    f"encoder's hidden_size (three of its layers stacked): {3 * width}",
                )
            )
        return out

    def weight_shapes(self, component: str, config: dict) -> dict[str, tuple[int, ...]]:
        c = config
        if component == "transformer":
            return transformer_weight_shapes(c)
        if component == "vae":
            return vae_weight_shapes(c, FLUX2_LATENT_CHANNELS)
        text = c.get("text_config") if isinstance(c.get("text_config"), dict) else c
        if component == "text_encoder" and all(isinstance(text.get(k), int) for k in ("vocab_size", "hidden_size")):
            names = (
                "model.embed_tokens.weight",
                "language_model.model.embed_tokens.weight",
                "model.language_model.embed_tokens.weight",
            )
            return {name: (text["vocab_size"], text["hidden_size"]) for name in names}
        return {}

    def encoder_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKLFlux2
        from transformers import Mistral3ForConditionalGeneration, Qwen3ForCausalLM

        return {
            "text_encoder": Qwen3ForCausalLM if self.klein else Mistral3ForConditionalGeneration,
            "vae": AutoencoderKLFlux2,
        }

    def load_encoders(self, model: ModelConfig, path: str, dtype: torch.dtype, device: torch.device) -> Encoders:
        from diffusers import AutoencoderKLFlux2, DiffusionPipeline
        from transformers import Mistral3ForConditionalGeneration, Qwen3ForCausalLM

        rev, kw = (
            model.revision,
            {"cache_dir": model.cache_dir, **({"variant": model.variant} if model.variant else {})},
        )
        # The batch-norm statistics that normalise the latents stay in fp32 (the examples read them from the VAE
        # as loaded, before casting it); nothing else uses the batch-norm layer.
        # Into host memory: flux_cp.placement puts one component at a time on `device`.
        vae = load_part(AutoencoderKLFlux2, path, "vae", model, torch.float32, torch_dtype=torch.float32, **kw).eval()
        for part in vae.children():
            part.to(dtype=dtype if part is not vae.bn else torch.float32)
        cls = Qwen3ForCausalLM if self.klein else Mistral3ForConditionalGeneration
        text_encoder = load_part(cls, path, "text_encoder", model, dtype, dtype=dtype, **kw).eval()
        for m in (vae, text_encoder):
            m.requires_grad_(False)
        is_distilled = False
        if self.klein:  # step-distilled [klein] checkpoints run without classifier-free guidance
            config = DiffusionPipeline.load_config(path, revision=rev, cache_dir=model.cache_dir)
            is_distilled = bool(config.get("is_distilled", False))
        tokenizer = load_tokenizer(path, rev, model.cache_dir)
        return Flux2Encoders(vae, text_encoder, tokenizer, self.klein, is_distilled, device, dtype)

    def check_text(self, cfg: Config, path: str) -> None:
        """The chat template, rendered once within bounds, must leave --max_sequence_length room for the caption:
        [dev]'s system message alone takes ~170 tokens of a byte-level tokenizer, so a short window encoded every
        caption alike and trained unconditionally without a word."""
        model, data = cfg.model, cfg.data
        tokenizer = load_tokenizer(path, model.revision, model.cache_dir)
        where = template_file(path, model.revision, model.cache_dir)
        render = lambda tok, caption, klein: bounded_chat_text(tok, caption, klein, where)  # noqa: E731
        try:
            before = recipe.tokens_before_caption(tokenizer, self.klein, render)
        except ValueError as e:
            raise UsageError(f"the tokenizer's chat template ({printable(where)}): {e}") from None
        room, cp_size = data.max_sequence_length - before, cfg.parallel.cp_size
        if room < MIN_CAPTION_TOKENS:
            least = -(-(before + MIN_CAPTION_TOKENS) // cp_size) * cp_size  # a multiple of --cp_size
            if least > recipe.MAX_SEQUENCE_LENGTH:
                raise UsageError(
                    f"{self.label}'s chat template takes {before} tokens before the caption (the tokenizer of "
                    f"{printable(path)}): even --max_sequence_length {recipe.MAX_SEQUENCE_LENGTH}, the most, leaves "
                    f"fewer than {MIN_CAPTION_TOKENS} for the caption. Use the model's own tokenizer files"
                )
            left = (
                "none: every caption would encode alike and the run would train without its captions"
                if room <= 0
                else f"{room} for the caption"
            )
            raise UsageError(
                f"--max_sequence_length {data.max_sequence_length}: {self.label}'s chat template takes {before} tokens "
                f"before the caption (the tokenizer of {printable(path)}), leaving {left}. Use --max_sequence_length "
                f"{least} or more (at least {MIN_CAPTION_TOKENS} caption tokens)"
            )

    # --- latents ----------------------------------------------------------------------------------------------

    def normalizer(self, vae):
        mean, std = recipe.latent_statistics(vae)
        # copied where the latents are, once per device: the VAE (and its statistics) may be in host memory by then
        stats = {mean.device: (mean.float(), std.float())}

        def normalize(latents: Tensor) -> Tensor:
            if latents.device not in stats:
                stats[latents.device] = tuple(s.to(latents.device) for s in stats[mean.device])
            return recipe.model_latents(latents, *stats[latents.device])

        return normalize

    def model_latent_shape(self, vae_shape: tuple[int, ...]) -> tuple[int, ...]:
        c, h, w = vae_shape
        return (4 * c, h // 2, w // 2)

    def default_vae_encode_mode(self, pairs: bool) -> str:
        return "mode"  # every FLUX.2 example encodes with latent_dist.mode()

    # --- validation -----------------------------------------------------------------------------------------

    def validation_embeds(self, encoders: Encoders, prompts: list[str], max_sequence_length: int) -> dict:
        embeds = encoders.prompts(prompts, max_sequence_length)
        if self.klein and not encoders.is_distilled:
            # [klein] base models run true classifier-free guidance against "": the pipeline would encode it with
            # the text encoder, which is freed by then.
            empty = encoders.prompts([""], max_sequence_length)["prompt_embeds"]
            embeds["negative_prompt_embeds"] = empty.expand(len(prompts), -1, -1).contiguous()
        return embeds

    def validation_pipeline(self, pairs: bool, scheduler, encoders: Encoders, transformer):
        from diffusers import Flux2KleinPipeline, Flux2Pipeline

        parts = dict(scheduler=scheduler, vae=encoders.vae, text_encoder=None, tokenizer=None, transformer=transformer)
        if self.klein:
            return Flux2KleinPipeline(**parts, is_distilled=encoders.is_distilled)
        return Flux2Pipeline(**parts)

    def reference_inputs(
        self, image: Image.Image | list[Image.Image], encoders: Encoders, device: torch.device
    ) -> dict:
        # The pipelines take references as images only (no latents), one or a list: they encode them as training
        # does (mode, patchify, batch-norm statistics, reference j at time id 10 + 10 j); an image of at most 1024^2
        # pixels and sides of multiples of 16 keeps its size. Their tokens follow the target's (full_sequence_io
        # splits them as one segment, as in training).
        return {"image": image}

    # --- context parallelism --------------------------------------------------------------------------------

    # --- the token sequence ----------------------------------------------------------------------------------

    def pack(self, latents: Tensor) -> Tensor:
        return recipe.pack(latents)

    def image_ids(self, height: int, width: int, device=None) -> Tensor:
        return recipe.image_ids(height, width, device=device)

    def reference_ids(self, height: int, width: int, device=None, index: int = 0) -> Tensor:
        return recipe.image_ids(height, width, t=recipe.REFERENCE_T_SCALE * (index + 1), device=device)

    def text_ids(self, length: int, device=None) -> Tensor:
        return recipe.text_ids(length, device=device)

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
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )

    # --- training and accounting -----------------------------------------------------------------------------

    def lora_targets(self, pairs: bool, config: dict | None = None) -> tuple[str, ...]:
        # Every single block's output, as many as this transformer has (the [klein] example names 24, which
        # [klein] 4B's 20 do not all match).
        n = config["num_single_layers"] if config else self.released_single_blocks
        return (*ATTENTION_TARGETS, *single_block_outputs(n))

    def forward_flops(self, config: dict, image_tokens: int, text_tokens: int, batch: int) -> tuple[float, float]:
        return forward_flops(config, image_tokens, text_tokens, batch)


FLUX2 = Flux2(klein=False)
FLUX2_KLEIN = Flux2(klein=True)
