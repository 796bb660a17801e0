"""diffusers' FLUX.2 LoRA examples' training step, copied line for line as the reference that
flux_cp.families.flux2.recipe and the trainer's FLUX.2 batches are tested against (tests/test_flux2_recipe.py,
tests/test_flux2_family.py)."""

from __future__ import annotations

import torch
from diffusers import Flux2Pipeline
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3


class Args:
    """The example's command-line defaults that the training step reads (flux2.py:535-597)."""

    weighting_scheme = "none"
    logit_mean, logit_std, mode_scale = 0.0, 1.0, 1.29
    guidance_scale = 3.5


def example_step(
    transformer, vae, noise_scheduler_copy, batch, prompt_embeds, text_ids, args, seed, klein, i2i, draws=None
):
    """The training step of diffusers' examples/dreambooth (commit 58eb52c0), line for line, without prior
    preservation, caching or accelerate: train_dreambooth_lora_flux2.py:1209-1211 (statistics), 1810-1818
    (get_sigmas) and 1855-1932 (the step); with `i2i`, train_dreambooth_lora_flux2_img2img.py:1744-1830 (the
    condition image after the target); with `klein`, train_dreambooth_lora_flux2_klein.py:1857-1861 (guidance).
    Changes: `accelerator.device` -> "cpu", `unwrap_model(transformer)` -> `transformer`, and the global RNG is seeded
    with `seed` just before the noise draw (the example's RNG is the global one); `draws` = (noise, u), when given,
    replaces the two random draws (to compare on the trainer's own draws)."""
    latents_bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to("cpu")
    latents_bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to("cpu")

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler_copy.sigmas.to(device="cpu", dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps.to("cpu")
        timesteps = timesteps.to("cpu")
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]

        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    pixel_values = batch["pixel_values"].to(device="cpu", dtype=vae.dtype)
    model_input = vae.encode(pixel_values).latent_dist.mode()
    if i2i:
        cond_pixel_values = batch["cond_pixel_values"].to(device="cpu", dtype=vae.dtype)
        cond_model_input = vae.encode(cond_pixel_values).latent_dist.mode()

    model_input = Flux2Pipeline._patchify_latents(model_input)
    model_input = (model_input - latents_bn_mean) / latents_bn_std

    if i2i:
        cond_model_input = Flux2Pipeline._patchify_latents(cond_model_input)
        cond_model_input = (cond_model_input - latents_bn_mean) / latents_bn_std

    model_input_ids = Flux2Pipeline._prepare_latent_ids(model_input).to(device=model_input.device)
    if i2i:
        cond_model_input_list = [cond_model_input[i].unsqueeze(0) for i in range(cond_model_input.shape[0])]
        cond_model_input_ids = Flux2Pipeline._prepare_image_ids(cond_model_input_list).to(
            device=cond_model_input.device
        )
        cond_model_input_ids = cond_model_input_ids.view(cond_model_input.shape[0], -1, model_input_ids.shape[-1])

    if draws is None:
        torch.manual_seed(seed)
        noise = torch.randn_like(model_input)
    else:
        noise = draws[0]
    bsz = model_input.shape[0]

    if draws is None:
        u = compute_density_for_timestep_sampling(
            weighting_scheme=args.weighting_scheme,
            batch_size=bsz,
            logit_mean=args.logit_mean,
            logit_std=args.logit_std,
            mode_scale=args.mode_scale,
        )
    else:
        u = draws[1]
    indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
    timesteps = noise_scheduler_copy.timesteps[indices].to(device=model_input.device)

    sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise

    packed_noisy_model_input = Flux2Pipeline._pack_latents(noisy_model_input)
    if i2i:
        packed_cond_model_input = Flux2Pipeline._pack_latents(cond_model_input)
        orig_input_shape = packed_noisy_model_input.shape
        orig_input_ids_shape = model_input_ids.shape
        packed_noisy_model_input = torch.cat([packed_noisy_model_input, packed_cond_model_input], dim=1)
        model_input_ids = torch.cat([model_input_ids, cond_model_input_ids], dim=1)

    if not klein:
        guidance = torch.full([1], args.guidance_scale, device="cpu")
        guidance = guidance.expand(model_input.shape[0])
    elif transformer.config.guidance_embeds:
        guidance = torch.full([1], args.guidance_scale, device="cpu")
        guidance = guidance.expand(model_input.shape[0])
    else:
        guidance = None

    model_pred = transformer(
        hidden_states=packed_noisy_model_input,
        timestep=timesteps / 1000,
        guidance=guidance,
        encoder_hidden_states=prompt_embeds,
        txt_ids=text_ids,
        img_ids=model_input_ids,
        return_dict=False,
    )[0]
    if i2i:
        model_pred = model_pred[:, : orig_input_shape[1], :]
        model_input_ids = model_input_ids[:, : orig_input_ids_shape[1], :]
    else:
        model_pred = model_pred[:, : packed_noisy_model_input.size(1) :]

    model_pred = Flux2Pipeline._unpack_latents_with_ids(model_pred, model_input_ids)

    weighting = compute_loss_weighting_for_sd3(weighting_scheme=args.weighting_scheme, sigmas=sigmas)

    target = noise - model_input

    loss = torch.mean(
        (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1),
        1,
    )
    loss = loss.mean()
    return loss
