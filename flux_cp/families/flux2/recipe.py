"""The FLUX.2 training recipe of diffusers' own LoRA examples, the parts the trainer takes from it as pure functions:
VAE latents to model latents (the VAE's batch-norm statistics), 2x2 patchify and packing to tokens, four-axis position
ids for the image and the text, and the prompt encoding of FLUX.2 [dev] (Mistral 3) and [klein] (Qwen3). The steps
every family shares (the timestep draw, the noisy input and target, the loss) are flux_cp.data.flow's and
flux_cp.data.batches'; the tests hold the recipe's own steps beside diffusers' example (tests/flux2_recipe_steps.py).

Line numbers cite diffusers' examples/dreambooth at commit 58eb52c0 (the scripts of diffusers 0.42.1's FLUX.2
pipelines): `flux2.py` is train_dreambooth_lora_flux2.py, `flux2_img2img.py` train_dreambooth_lora_flux2_img2img.py,
`klein.py` train_dreambooth_lora_flux2_klein.py. The timestep density and loss weighting are the SD3 schemes FLUX.1
uses too (`flux_cp.data.flow`).

Shapes: "model latents" are `[B, 4C, H/16, W/16]` (C = 32 VAE channels for FLUX.2: 128 per token), patchified and
normalised; tokens are `[B, h * w, 4C]` in row-major order; ids are `[S, 4]` integer (t, h, w, l) rows, shared by
the batch (Flux2Transformer2DModel reads `ids[0]` of batched ids).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor

# The hidden layers of the text encoder that are stacked into the prompt embedding (Flux2Pipeline.encode_prompt and
# Flux2KleinPipeline.encode_prompt defaults: `text_encoder_out_layers`). flux2.py:359-365 passes [dev]'s default;
# klein.py:359-365 passes (10, 20, 30) to Flux2KleinPipeline too, unlike the pipeline's own default (see
# KLEIN_TEXT_LAYERS), which klein's img2img example and inference use.
DEV_TEXT_LAYERS = (10, 20, 30)
KLEIN_TEXT_LAYERS = (9, 18, 27)
MAX_SEQUENCE_LENGTH = 512  # flux2.py:353-357; the pipelines' default

# Reference image j's time coordinate: 10 + 10 * j (Flux2Pipeline._prepare_image_ids, scale=10); the target's is 0.
REFERENCE_T_SCALE = 10


def latent_statistics(vae) -> tuple[Tensor, Tensor]:
    """The per-channel mean and std `[1, 4C, 1, 1]` that normalise FLUX.2's patchified latents: the VAE's batch-norm
    running statistics, std = sqrt(running_var + batch_norm_eps) (flux2.py:1209-1211)."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return mean, std


def patchify(latents: Tensor) -> Tensor:
    """`[B, C, H, W]` -> `[B, 4C, H/2, W/2]`: each 2x2 patch becomes channels, as Flux2Pipeline._patchify_latents
    (flux2.py:1859). Channel order: c * 4 + dy * 2 + dx."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def model_latents(latents: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """VAE latents -> the latents the transformer is trained on: patchified, then normalised with the batch-norm
    statistics (flux2.py:1859-1860; the same for reference images, flux2_img2img.py:1754-1755)."""
    x = patchify(latents)
    return (x - mean.to(x)) / std.to(x)


def pack(latents: Tensor) -> Tensor:
    """`[B, C, h, w]` -> `[B, h * w, C]` tokens in row-major order, as Flux2Pipeline._pack_latents (flux2.py:1885).
    Unlike FLUX.1 there is no 2x2 packing here: `patchify` did it."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def image_ids(height: int, width: int, t: int = 0, device=None) -> Tensor:
    """Ids `[h * w, 4]` of an `height x width` token grid: (t, row, column, 0). t = 0 for the image being generated
    (Flux2Pipeline._prepare_latent_ids, flux2.py:1862), 10 + 10 * j for reference j (`reference_ids`)."""
    return torch.cartesian_prod(
        torch.tensor([t], device=device),
        torch.arange(height, device=device),
        torch.arange(width, device=device),
        torch.arange(1, device=device),
    )


def text_ids(length: int, device=None) -> Tensor:
    """Ids `[L, 4]` of the text tokens: (0, 0, 0, position), as Flux2Pipeline._prepare_text_ids: text gets its own
    RoPE axis instead of FLUX.1's all-zero ids."""
    return torch.cartesian_prod(
        torch.arange(1, device=device),
        torch.arange(1, device=device),
        torch.arange(1, device=device),
        torch.arange(length, device=device),
    )


def chat_text(tokenizer, caption: str, klein: bool) -> str:
    """The text the pipeline's prompt encoding tokenizes for `caption`: its chat template rendered around it ([dev]:
    the system message, then the caption as the user's, flux2.py's `format_input`; [klein]: the caption as the
    user's and the assistant's turn opened without thinking)."""
    if klein:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": caption}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
    from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input

    return tokenizer.apply_chat_template(
        format_input([caption], SYSTEM_MESSAGE), add_generation_prompt=False, tokenize=False
    )[0]


def token_count(tokenizer, text: str, klein: bool) -> int:
    """Tokens of `text` as the pipeline counts them: [dev]'s apply_chat_template adds no special tokens (its template
    writes them), [klein]'s tokenizer call adds the tokenizer's own (Qwen's: none)."""
    return len(tokenizer(text, add_special_tokens=klein)["input_ids"])


def tokens_before_caption(tokenizer, klein: bool, render=chat_text) -> int:
    """The template's tokens before the caption in the window of `max_sequence_length` tokens: what is left of the
    window after them is the caption's (and the template's end, cut first when the window is short). `render`:
    `chat_text`, or a bounded stand-in for it (flux_cp.families.flux2)."""
    marker = "\u2063caption\u2063"  # invisible separators: no template writes them
    text = render(tokenizer, marker, klein)
    if marker not in text:
        raise ValueError("the chat template leaves the caption out of what it renders")
    return token_count(tokenizer, text[: text.index(marker)], klein)


def encode_prompts(
    text_encoder,
    tokenizer,
    prompts: str | list[str],
    klein: bool,
    max_sequence_length: int = MAX_SEQUENCE_LENGTH,
    layers: Sequence[int] | None = None,
    device: torch.device | None = None,
) -> tuple[Tensor, Tensor]:
    """(prompt_embeds `[B, L, 3 * hidden]`, text ids `[B, L, 4]`) as Flux2Pipeline.encode_prompt ([dev]: Mistral 3
    over its chat template with the system message, padded to `max_sequence_length`) or Flux2KleinPipeline's
    ([klein]: Qwen3 over its chat template, no thinking): the hidden states after `layers` (default the pipeline's:
    DEV_TEXT_LAYERS / KLEIN_TEXT_LAYERS) stacked on the feature axis. What flux2.py:1530-1537 computes through a
    text-encoding pipeline, without building one. Pad tokens are kept (the transformer sees all L tokens). `device`:
    where the embeddings go (default: the text encoder's; give it for one streamed from host memory)."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    if klein:
        embeds = Flux2KleinPipeline._get_qwen3_prompt_embeds(
            text_encoder,
            tokenizer,
            prompts,
            max_sequence_length=max_sequence_length,
            hidden_states_layers=tuple(layers or KLEIN_TEXT_LAYERS),
            device=device,
        )
    else:
        embeds = Flux2Pipeline._get_mistral_3_small_prompt_embeds(
            text_encoder,
            tokenizer,
            prompts,
            max_sequence_length=max_sequence_length,
            hidden_states_layers=tuple(layers or DEV_TEXT_LAYERS),
            device=device,
        )
    return embeds, Flux2Pipeline._prepare_text_ids(embeds).to(embeds.device)
