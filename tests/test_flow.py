"""The flow-matching pieces against diffusers' own: packing, position ids, timestep densities, loss weights."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from flux_cp.config.fields import WEIGHTING_SCHEMES
from flux_cp.config.training import TrainConfig
from flux_cp.data.flow import per_sample_draws, sample_timesteps, sigmas_for
from flux_cp.families.flux1.tokens import image_ids, pack_latents, text_ids, unpack_latents
from flux_cp.loss import loss_weighting


def test_packing_and_ids_match_flux_pipeline():
    latents = torch.randn(2, 16, 6, 10)
    packed = pack_latents(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 6, 10))
    assert torch.equal(unpack_latents(packed, 6, 10), latents)
    assert torch.equal(image_ids(6, 10), FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32))
    assert torch.equal(text_ids(7), torch.zeros(7, 3))


@pytest.mark.parametrize("scheme", WEIGHTING_SCHEMES)
def test_timestep_density_and_loss_weights_match_diffusers(scheme):
    ours = sample_timesteps(64, scheme, torch.Generator().manual_seed(1), 0.2, 1.1, 1.29)
    theirs = compute_density_for_timestep_sampling(
        scheme, 64, 0.2, 1.1, 1.29, generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(ours, theirs)
    sigmas = torch.rand(64) * 0.9 + 0.05
    assert torch.allclose(loss_weighting(scheme, sigmas), compute_loss_weighting_for_sd3(scheme, sigmas))


def test_sigmas_index_the_training_schedule_like_diffusers_examples():
    scheduler = FlowMatchEulerDiscreteScheduler()
    u = torch.tensor([0.0, 0.5, 0.999999])
    timesteps, sigmas = sigmas_for(u, scheduler)
    idx = (u * scheduler.config.num_train_timesteps).long()
    assert torch.equal(timesteps, scheduler.timesteps[idx].float()) and torch.equal(
        sigmas, scheduler.sigmas[idx].float()
    )


def test_each_sample_draws_only_from_its_own_generator():
    """The draws of a batch slot do not depend on which other slots are drawn with it (layout independence)."""
    train, scheduler = TrainConfig(weighting_scheme="logit_normal"), FlowMatchEulerDiscreteScheduler()

    def gens(*seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    both = per_sample_draws(gens(3, 4), (4, 2, 2), train, scheduler)
    second = per_sample_draws(gens(4), (4, 2, 2), train, scheduler)
    for key in ("eps", "noise", "timesteps", "sigmas"):
        assert torch.equal(both[key][1:], second[key])
    assert not torch.equal(both["noise"][0], both["noise"][1])
