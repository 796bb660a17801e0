"""The FLUX.2 training recipe of diffusers' own LoRA examples, as pure functions: VAE latents to model latents (the
VAE's batch-norm statistics), 2x2 patchify and packing to tokens, four-axis position ids for the image, the text and
reference images, the timestep draw, the noisy input and target, guidance, the loss on the target tokens, and the
prompt encoding of FLUX.2 [dev] (Mistral 3) and [klein] (Qwen3).

Line numbers cite diffusers' examples/dreambooth at commit 58eb52c0 (the scripts of diffusers 0.42.1's FLUX.2
pipelines): `flux2.py` is train_dreambooth_lora_flux2.py, `flux2_img2img.py` train_dreambooth_lora_flux2_img2img.py,
`klein.py` train_dreambooth_lora_flux2_klein.py. The timestep density and loss weighting are the SD3 schemes FLUX.1
uses too (`flux_cp.flow`).

Shapes: "model latents" are `[B, 4C, H/16, W/16]` (C = 32 VAE channels for FLUX.2: 128 per token), patchified and
normalised; tokens are `[B, h * w, 4C]` in row-major order; ids are `[S, 4]` integer (t, h, w, l) rows, shared by
the batch (Flux2Transformer2DModel reads `ids[0]` of batched ids).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...flow import sigmas_for

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


def encode_latents(vae, pixels: Tensor) -> Tensor:
    """VAE latents `[B, C, H/8, W/8]` of images in [-1, 1]: the posterior's mode, not a sample (flux2.py:1857, and
    the cached path flux2.py:1665; Flux2Pipeline encodes references with sample_mode="argmax", the same)."""
    return vae.encode(pixels).latent_dist.mode()


def patchify(latents: Tensor) -> Tensor:
    """`[B, C, H, W]` -> `[B, 4C, H/2, W/2]`: each 2x2 patch becomes channels, as Flux2Pipeline._patchify_latents
    (flux2.py:1859). Channel order: c * 4 + dy * 2 + dx."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: Tensor) -> Tensor:
    """Inverse of `patchify`, as Flux2Pipeline._unpatchify_latents."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // 4, h * 2, w * 2)


def model_latents(latents: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """VAE latents -> the latents the transformer is trained on: patchified, then normalised with the batch-norm
    statistics (flux2.py:1859-1860; the same for reference images, flux2_img2img.py:1754-1755)."""
    x = patchify(latents)
    return (x - mean.to(x)) / std.to(x)


def vae_latents(model: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Inverse of `model_latents`: what the VAE decodes (Flux2Pipeline.__call__'s decode step)."""
    return unpatchify(model * std.to(model) + mean.to(model))


def pack(latents: Tensor) -> Tensor:
    """`[B, C, h, w]` -> `[B, h * w, C]` tokens in row-major order, as Flux2Pipeline._pack_latents (flux2.py:1885).
    Unlike FLUX.1 there is no 2x2 packing here: `patchify` did it."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def unpack(tokens: Tensor, height: int, width: int) -> Tensor:
    """Inverse of `pack` for an `height x width` token grid. Flux2Pipeline._unpack_latents_with_ids (flux2.py:1903)
    scatters by the ids instead; for `image_ids`' row-major ids that is this reshape."""
    b, _, c = tokens.shape
    return tokens.permute(0, 2, 1).reshape(b, c, height, width)


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


def reference_ids(grids: Sequence[tuple[int, int]], device=None) -> Tensor:
    """Ids `[sum h_j * w_j, 4]` of reference images with token grids `grids`, in order: reference j has time
    coordinate 10 + 10 * j and its own (row, column) grid from 0, as Flux2Pipeline._prepare_image_ids (which
    flux2_img2img.py:1758-1764 calls). Each reference may have its own size."""
    if not grids:
        return torch.zeros(0, 4, dtype=torch.long, device=device)
    ids = [image_ids(h, w, t=REFERENCE_T_SCALE * (j + 1), device=device) for j, (h, w) in enumerate(grids)]
    return torch.cat(ids)


def image_sequence(noisy: Tensor, references: Sequence[Tensor] = ()) -> tuple[Tensor, Tensor]:
    """The transformer's image input: the packed noisy target, then each clean reference's packed model latents,
    `[B, T + sum R_j, 4C]`, and their ids `[T + sum R_j, 4]` (flux2_img2img.py:1788-1796, and Flux2Pipeline.__call__
    for any number of references). Only the first T outputs are predictions (`target_tokens`)."""
    h, w = noisy.shape[-2:]
    for ref in references:
        if ref.shape[:2] != noisy.shape[:2]:
            raise ValueError(
                f"reference latents {tuple(ref.shape)} differ from the target's {tuple(noisy.shape)} in batch size or "
                "channels"
            )
    tokens = torch.cat([pack(noisy), *(pack(r) for r in references)], dim=1)
    ids = torch.cat(
        [image_ids(h, w, device=noisy.device), reference_ids([r.shape[-2:] for r in references], device=noisy.device)]
    )
    return tokens, ids


def sample_sigmas(u: Tensor, scheduler) -> tuple[Tensor, Tensor]:
    """Timesteps (0-1000) and sigmas of density draws `u` in [0, 1) on the training schedule: index u * 1000 into the
    scheduler's timesteps and sigmas (flux2.py:1869-1881; `u` from `flux_cp.flow.sample_timesteps`, the SD3 density
    `compute_density_for_timestep_sampling`). No resolution shift at training: the sigmas are those the scheduler
    was built with (FLUX.2's config has use_dynamic_shifting, which leaves them unshifted at construction; the
    pipelines shift only at inference, with compute_empirical_mu)."""
    return sigmas_for(u, scheduler)


def noisy_latents(latents: Tensor, noise: Tensor, sigmas: Tensor) -> Tensor:
    """(1 - sigma) x + sigma noise, one sigma per sample (flux2.py:1881-1882). `noise` is drawn in model-latent
    space (`torch.randn_like` of the normalised, patchified latents: flux2.py:1864)."""
    s = sigmas.view(-1, *([1] * (latents.ndim - 1))).to(latents)
    return (1.0 - s) * latents + s * noise


def flow_target(latents: Tensor, noise: Tensor) -> Tensor:
    """The regression target, noise - latents (flux2.py:1910)."""
    return noise - latents


def model_timestep(timesteps: Tensor) -> Tensor:
    """The transformer's `timestep` argument: timesteps / 1000 (flux2.py:1894); it multiplies by 1000 itself."""
    return timesteps / 1000


def guidance_input(transformer_config, batch: int, scale: float, device=None) -> Tensor | None:
    """The transformer's `guidance` argument: `scale` for every sample when it embeds guidance ([dev]: flux2.py:
    1888-1889, --guidance_scale 3.5 by default), None when it does not ([klein]: klein.py:1857-1861)."""
    if not transformer_config.guidance_embeds:
        return None
    return torch.full([1], scale, device=device).expand(batch)


def target_tokens(pred: Tensor, n_target: int) -> Tensor:
    """The predictions of the target's tokens: the first `n_target` of the image outputs; reference tokens are
    inputs only and carry no loss (flux2_img2img.py:1812)."""
    return pred[:, :n_target]


def flow_loss(pred: Tensor, target: Tensor, weighting: Tensor) -> Tensor:
    """The weighted flow-matching loss, in fp32: per sample the mean of weighting * (pred - target)^2 over all its
    elements, then the mean over the batch (flux2.py:1905-1932). `weighting` has one value per sample
    (`flux_cp.flow.loss_weighting` of the sigmas); `pred` and `target` are tokens or latents of the same layout."""
    w = weighting.view(-1, *([1] * (pred.ndim - 1)))
    err = w.float() * (pred.float() - target.float()) ** 2
    return err.reshape(err.shape[0], -1).mean(1).mean()


def chat_text(tokenizer, caption: str, klein: bool) -> str:
    """The text the pipeline's prompt encoding tokenizes for `caption`: its chat template rendered around it ([dev]:
    the system message, then the caption as the user's, flux2.py's `format_input`; [klein]: the caption as the
    user's and the assistant's turn opened without thinking)."""
    if klein:
        return tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)  # fmt: skip
    from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input

    return tokenizer.apply_chat_template(format_input([caption], SYSTEM_MESSAGE), add_generation_prompt=False,
                                         tokenize=False)[0]  # fmt: skip


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
) -> tuple[Tensor, Tensor]:
    """(prompt_embeds `[B, L, 3 * hidden]`, text ids `[B, L, 4]`) as Flux2Pipeline.encode_prompt ([dev]: Mistral 3
    over its chat template with the system message, padded to `max_sequence_length`) or Flux2KleinPipeline's
    ([klein]: Qwen3 over its chat template, no thinking): the hidden states after `layers` (default the pipeline's:
    DEV_TEXT_LAYERS / KLEIN_TEXT_LAYERS) stacked on the feature axis. What flux2.py:1530-1537 computes through a
    text-encoding pipeline, without building one. Pad tokens are kept (the transformer sees all L tokens)."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    if klein:
        embeds = Flux2KleinPipeline._get_qwen3_prompt_embeds(
            text_encoder, tokenizer, prompts, max_sequence_length=max_sequence_length,
            hidden_states_layers=tuple(layers or KLEIN_TEXT_LAYERS),
        )  # fmt: skip
    else:
        embeds = Flux2Pipeline._get_mistral_3_small_prompt_embeds(
            text_encoder, tokenizer, prompts, max_sequence_length=max_sequence_length,
            hidden_states_layers=tuple(layers or DEV_TEXT_LAYERS),
        )  # fmt: skip
    return embeds, Flux2Pipeline._prepare_text_ids(embeds).to(embeds.device)
