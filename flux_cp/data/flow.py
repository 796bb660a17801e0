"""The flow-matching draws of diffusers' Flux training examples, for every family: timestep densities, the
schedule's sigmas, and each sample's noise and timestep (the loss and its weighting: flux_cp.loss; how a family packs
latents into tokens is its own: flux_cp/families).

Noise, timesteps and the target are drawn for the *full* latent on every rank of a CP group (same
generator state), then each rank keeps its sequence chunk (docs/design.md, data flow).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flux_cp.config.training import TrainConfig

Tensor = torch.Tensor


def sample_timesteps(
    batch: int,
    scheme: str,
    generator: torch.Generator,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
) -> Tensor:
    """u in [0, 1] as diffusers' `compute_density_for_timestep_sampling` (SD3 paper schemes)."""
    if scheme == "logit_normal":
        u = torch.normal(logit_mean, logit_std, size=(batch,), generator=generator)
        return torch.sigmoid(u)
    u = torch.rand(batch, generator=generator)
    if scheme == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def sigmas_for(u: Tensor, scheduler) -> tuple[Tensor, Tensor]:
    """Timesteps and sigmas of the training schedule at density samples `u` (diffusers' Flux examples:
    index = u * num_train_timesteps into the scheduler's timesteps and sigmas)."""
    n = scheduler.config.num_train_timesteps
    idx = (u * n).long().clamp_(0, n - 1)
    return scheduler.timesteps[idx].float(), scheduler.sigmas[idx].float()


def per_sample_draws(
    generators: list[torch.Generator],
    latent_shape: tuple[int, ...],
    train: TrainConfig,
    scheduler,
    noise_shape: tuple[int, ...] | None = None,
) -> dict:
    """Latent-sampling noise `eps` (`latent_shape`, the VAE's latent), flow-matching noise (`noise_shape`, the
    model's latent, in which diffusers' examples draw it; default `latent_shape`), timesteps and sigmas for each
    sample of a batch, each from its own generator (keyed by seed, micro-step and position in the *global* batch:
    layout-independent). `eps` is drawn whether or not the latent is sampled, so that the noise and timesteps of
    a sample do not depend on --vae_encode_mode."""
    eps, noise, u = [], [], []
    for g in generators:
        eps.append(torch.randn(latent_shape, generator=g))
        noise.append(torch.randn(noise_shape or latent_shape, generator=g))
        u.append(sample_timesteps(1, train.weighting_scheme, g, train.logit_mean, train.logit_std, train.mode_scale))
    u = torch.cat(u)
    timesteps, sigmas = sigmas_for(u, scheduler)
    return {"eps": torch.stack(eps), "noise": torch.stack(noise), "u": u, "timesteps": timesteps, "sigmas": sigmas}
