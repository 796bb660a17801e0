"""The steps of FLUX.2's training recipe that the trainer computes the way every family does (flux_cp.data.flow,
flux_cp.data.batches, flux_cp.data.pairs), written as diffusers' LoRA examples compute them, each citing their lines
(see flux_cp/families/flux2/recipe.py for the commit): the tests' reference for FLUX.2's step
(tests/test_flux2_recipe.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flux_cp.data.flow import sigmas_for
from flux_cp.families.flux2.recipe import REFERENCE_T_SCALE, image_ids, pack

Tensor = torch.Tensor


def encode_latents(vae, pixels: Tensor) -> Tensor:
    """VAE latents `[B, C, H/8, W/8]` of images in [-1, 1]: the posterior's mode, not a sample (flux2.py:1857, and
    the cached path flux2.py:1665; Flux2Pipeline encodes references with sample_mode="argmax", the same)."""
    return vae.encode(pixels).latent_dist.mode()


def unpatchify(latents: Tensor) -> Tensor:
    """Inverse of `patchify`, as Flux2Pipeline._unpatchify_latents."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // 4, h * 2, w * 2)


def vae_latents(model: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Inverse of `model_latents`: what the VAE decodes (Flux2Pipeline.__call__'s decode step)."""
    return unpatchify(model * std.to(model) + mean.to(model))


def unpack(tokens: Tensor, height: int, width: int) -> Tensor:
    """Inverse of `pack` for an `height x width` token grid. Flux2Pipeline._unpack_latents_with_ids (flux2.py:1903)
    scatters by the ids instead; for `image_ids`' row-major ids that is this reshape."""
    b, _, c = tokens.shape
    return tokens.permute(0, 2, 1).reshape(b, c, height, width)


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
    scheduler's timesteps and sigmas (flux2.py:1869-1881; `u` from `flux_cp.data.flow.sample_timesteps`, the SD3 density
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
    (`flux_cp.loss.loss_weighting` of the sigmas); `pred` and `target` are tokens or latents of the same layout."""
    w = weighting.view(-1, *([1] * (pred.ndim - 1)))
    err = w.float() * (pred.float() - target.float()) ** 2
    return err.reshape(err.shape[0], -1).mean(1).mean()
