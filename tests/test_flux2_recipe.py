"""flux_cp.flux2_recipe against diffusers' FLUX.2 LoRA examples and pipelines: on equal draws the recipe gives the
example's loss and gradients on a tiny Flux2Transformer2DModel ([dev] with guidance, [klein] without, text-to-image
and with a reference image), and each piece equals the Flux2Pipeline method it follows."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from flux_cp import flux2_recipe as r
from flux_cp.flow import loss_weighting, sample_timesteps
from flux_cp.tiny_flux2 import build_tiny_flux2_pipeline, ensure_tiny_flux2_pipeline


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


def recipe_step(transformer, vae, scheduler, batch, prompt_embeds, text_ids, args, seed, i2i):
    """The same step from flux_cp.flux2_recipe, with the draws from a generator seeded with `seed`."""
    mean, std = r.latent_statistics(vae)
    x = r.model_latents(r.encode_latents(vae, batch["pixel_values"]), mean, std)
    refs = [r.model_latents(r.encode_latents(vae, batch["cond_pixel_values"]), mean, std)] if i2i else []
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(x.shape, generator=g)
    u = sample_timesteps(x.shape[0], args.weighting_scheme, g, args.logit_mean, args.logit_std, args.mode_scale)
    timesteps, sigmas = r.sample_sigmas(u, scheduler)
    tokens, ids = r.image_sequence(r.noisy_latents(x, noise, sigmas), refs)
    pred = transformer(
        hidden_states=tokens,
        timestep=r.model_timestep(timesteps),
        guidance=r.guidance_input(transformer.config, x.shape[0], args.guidance_scale),
        encoder_hidden_states=prompt_embeds,
        txt_ids=text_ids,
        img_ids=ids,
    ).sample
    n_target = x.shape[-2] * x.shape[-1]
    target = r.pack(r.flow_target(x, noise))
    return r.flow_loss(r.target_tokens(pred, n_target), target, loss_weighting(args.weighting_scheme, sigmas))


@pytest.fixture(scope="module")
def parts():
    return {klein: build_tiny_flux2_pipeline(klein=klein) for klein in (False, True)}


def _batch(i2i: bool, batch: int = 2, size: int = 64) -> dict:
    g = torch.Generator().manual_seed(3)
    out = {"pixel_values": torch.rand(batch, 3, size, size, generator=g) * 2 - 1}
    if i2i:
        out["cond_pixel_values"] = torch.rand(batch, 3, size, size, generator=g) * 2 - 1
    return out


CASES = [  # (klein, img2img, weighting scheme)
    (False, False, "none"),
    (False, False, "logit_normal"),
    (False, False, "cosmap"),
    (False, True, "none"),
    (True, False, "mode"),
    (True, True, "sigma_sqrt"),
]


@pytest.mark.parametrize("klein, i2i, scheme", CASES)
def test_loss_and_gradients_equal_the_examples_on_equal_draws(parts, klein, i2i, scheme):
    pipe = parts[klein]
    args = Args()
    args.weighting_scheme = scheme
    batch = _batch(i2i)
    g = torch.Generator().manual_seed(5)
    prompt_embeds = torch.randn(2, 8, pipe.transformer.config.joint_attention_dim, generator=g)
    text_ids = r.text_ids(8).expand(2, -1, -1)
    results = []
    for step in (example_step, recipe_step):
        model = copy.deepcopy(pipe.transformer).requires_grad_(True)
        scheduler = copy.deepcopy(pipe.scheduler)
        kw = dict(klein=klein, i2i=i2i) if step is example_step else dict(i2i=i2i)
        loss = step(model, pipe.vae, scheduler, batch, prompt_embeds, text_ids, args, 11, **kw)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    assert ref_loss > 0 and torch.isfinite(ref_loss)
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss, (loss, ref_loss)
    assert set(grads) == set(ref_grads) and all(g is not None for g in ref_grads.values())
    for n, ref in ref_grads.items():
        assert torch.allclose(grads[n], ref, rtol=1e-5, atol=1e-7 * ref.abs().max()), n
    # Equal draws matter: another seed gives another loss.
    other = recipe_step(pipe.transformer, pipe.vae, pipe.scheduler, batch, prompt_embeds, text_ids, args, 12, i2i)
    assert abs(other.detach() - ref_loss) > 1e-4 * ref_loss


def test_latents_follow_flux2_pipeline(parts):
    pipe = parts[False]
    pixels = _batch(False, batch=1)["pixel_values"]
    mean, std = r.latent_statistics(pipe.vae)
    x = r.model_latents(r.encode_latents(pipe.vae, pixels), mean, std)
    # Flux2Pipeline encodes reference images with exactly this recipe (mode, patchify, batch-norm statistics).
    assert torch.equal(x, pipe._encode_vae_image(pixels, generator=None))
    assert x.shape == (1, 16, 4, 4) and abs(x.mean()) < 2
    raw = r.encode_latents(pipe.vae, pixels)
    assert torch.allclose(r.vae_latents(x, mean, std), raw, atol=1e-6)
    assert torch.equal(r.unpatchify(r.patchify(raw)), raw)
    assert torch.equal(r.patchify(raw), Flux2Pipeline._patchify_latents(raw))
    assert torch.equal(r.unpatchify(x), Flux2Pipeline._unpatchify_latents(x))


def test_tokens_and_ids_follow_flux2_pipeline():
    x = torch.randn(2, 16, 3, 5)
    tokens = r.pack(x)
    assert torch.equal(tokens, Flux2Pipeline._pack_latents(x))
    ids = r.image_ids(3, 5)
    assert torch.equal(ids, Flux2Pipeline._prepare_latent_ids(x)[0])
    assert torch.equal(r.unpack(tokens, 3, 5), Flux2Pipeline._unpack_latents_with_ids(tokens, ids.expand(2, -1, -1)))
    assert torch.equal(r.text_ids(7), Flux2Pipeline._prepare_text_ids(torch.zeros(2, 7, 4))[0])
    # Several references of different sizes: t = 10, 20, ... each with its own grid, as the pipeline.
    refs = [torch.randn(1, 16, 2, 2), torch.randn(1, 16, 3, 4), torch.randn(1, 16, 1, 2)]
    assert torch.equal(r.reference_ids([t.shape[-2:] for t in refs]), Flux2Pipeline._prepare_image_ids(refs)[0])
    assert r.reference_ids([]).shape == (0, 4)
    seq, seq_ids = r.image_sequence(x, [t.expand(2, -1, -1, -1) for t in refs])
    assert seq.shape == (2, 15 + 4 + 12 + 2, 16) and seq_ids.shape == (33, 4)
    assert torch.equal(seq[:, 15:19], Flux2Pipeline._pack_latents(refs[0]).expand(2, -1, -1))
    assert seq_ids[:15, 0].eq(0).all() and seq_ids[15:19, 0].eq(10).all() and seq_ids[31:, 0].eq(30).all()
    with pytest.raises(ValueError, match="batch size or channels"):
        r.image_sequence(x, [torch.randn(2, 8, 3, 5)])


def test_draws_noise_target_and_guidance(parts):
    scheduler = parts[False].scheduler
    u = torch.tensor([0.0, 0.25, 0.999])
    timesteps, sigmas = r.sample_sigmas(u, scheduler)
    # FLUX.2's scheduler config (use_dynamic_shifting) leaves the training sigmas unshifted: sigma = t / 1000.
    assert torch.allclose(sigmas, timesteps / 1000) and torch.allclose(sigmas, torch.tensor([1.0, 0.75, 0.001]))
    x, n = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    noisy = r.noisy_latents(x, n, sigmas)
    assert torch.equal(noisy[0], n[0]) and torch.allclose(noisy[1], 0.25 * x[1] + 0.75 * n[1])
    assert torch.equal(r.flow_target(x, n), n - x)
    assert torch.equal(r.model_timestep(timesteps), timesteps / 1000)
    assert r.guidance_input(parts[True].transformer.config, 3, 3.5) is None
    assert r.guidance_input(parts[False].transformer.config, 3, 3.5).tolist() == [3.5] * 3
    pred = torch.randn(3, 5, 4)
    assert torch.equal(r.target_tokens(pred, 2), pred[:, :2])
    w = torch.tensor([1.0, 2.0, 0.5])
    loss = r.flow_loss(pred, torch.zeros_like(pred), w)
    assert torch.allclose(loss, (w[:, None] * pred.pow(2).mean((1, 2))[:, None]).mean())


@pytest.mark.parametrize("klein", [False, True], ids=["dev", "klein"])
def test_encode_prompts_equals_the_pipelines_encode_prompt(klein, tmp_path):
    cls = Flux2KleinPipeline if klein else Flux2Pipeline
    pipe = cls.from_pretrained(ensure_tiny_flux2_pipeline(tmp_path / "tiny", klein=klein))
    prompts = ["a red circle", "two blue squares on grass"]
    expected, expected_ids = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=64)
    embeds, ids = r.encode_prompts(pipe.text_encoder, pipe.tokenizer, prompts, klein=klein, max_sequence_length=64)
    assert torch.equal(embeds, expected) and torch.equal(ids, expected_ids)
    assert embeds.shape == (2, 64, pipe.transformer.config.joint_attention_dim)
    other, _ = r.encode_prompts(pipe.text_encoder, pipe.tokenizer, prompts, klein=klein, max_sequence_length=64,
                                layers=(1, 2, 3))  # fmt: skip
    assert not torch.equal(other, embeds)
