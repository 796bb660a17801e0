"""flux_cp/families/flux2/recipe.py and the recipe's steps (tests/flux2_recipe_steps.py) against diffusers' FLUX.2
LoRA examples and pipelines: on equal draws the recipe gives the example's loss and gradients on a tiny
Flux2Transformer2DModel ([dev] with guidance, [klein] without, text-to-image and with a reference image), and each
piece equals the Flux2Pipeline method it follows."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline

from flux_cp.data.flow import sample_timesteps
from flux_cp.families.flux2 import recipe as r
from flux_cp.families.flux2.tiny import build_tiny_flux2_pipeline, ensure_tiny_flux2_pipeline
from flux_cp.loss import loss_weighting
from tests import flux2_recipe_steps as steps
from tests.flux2_example import Args, example_step


def recipe_step(transformer, vae, scheduler, batch, prompt_embeds, text_ids, args, seed, i2i):
    """The same step from the recipe (flux_cp/families/flux2/recipe.py, tests/flux2_recipe_steps.py), with the draws
    from a generator seeded with `seed`."""
    mean, std = r.latent_statistics(vae)
    x = r.model_latents(steps.encode_latents(vae, batch["pixel_values"]), mean, std)
    refs = [r.model_latents(steps.encode_latents(vae, batch["cond_pixel_values"]), mean, std)] if i2i else []
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(x.shape, generator=g)
    u = sample_timesteps(x.shape[0], args.weighting_scheme, g, args.logit_mean, args.logit_std, args.mode_scale)
    timesteps, sigmas = steps.sample_sigmas(u, scheduler)
    tokens, ids = steps.image_sequence(steps.noisy_latents(x, noise, sigmas), refs)
    pred = transformer(
        hidden_states=tokens,
        timestep=steps.model_timestep(timesteps),
        guidance=steps.guidance_input(transformer.config, x.shape[0], args.guidance_scale),
        encoder_hidden_states=prompt_embeds,
        txt_ids=text_ids,
        img_ids=ids,
    ).sample
    n_target = x.shape[-2] * x.shape[-1]
    target = r.pack(steps.flow_target(x, noise))
    return steps.flow_loss(steps.target_tokens(pred, n_target), target, loss_weighting(args.weighting_scheme, sigmas))


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
    x = r.model_latents(steps.encode_latents(pipe.vae, pixels), mean, std)
    # Flux2Pipeline encodes reference images with exactly this recipe (mode, patchify, batch-norm statistics).
    assert torch.equal(x, pipe._encode_vae_image(pixels, generator=None))
    assert x.shape == (1, 16, 4, 4) and abs(x.mean()) < 2
    raw = steps.encode_latents(pipe.vae, pixels)
    assert torch.allclose(steps.vae_latents(x, mean, std), raw, atol=1e-6)
    assert torch.equal(steps.unpatchify(r.patchify(raw)), raw)
    assert torch.equal(r.patchify(raw), Flux2Pipeline._patchify_latents(raw))
    assert torch.equal(steps.unpatchify(x), Flux2Pipeline._unpatchify_latents(x))


def test_tokens_and_ids_follow_flux2_pipeline():
    x = torch.randn(2, 16, 3, 5)
    tokens = r.pack(x)
    assert torch.equal(tokens, Flux2Pipeline._pack_latents(x))
    ids = r.image_ids(3, 5)
    assert torch.equal(ids, Flux2Pipeline._prepare_latent_ids(x)[0])
    assert torch.equal(
        steps.unpack(tokens, 3, 5), Flux2Pipeline._unpack_latents_with_ids(tokens, ids.expand(2, -1, -1))
    )
    assert torch.equal(r.text_ids(7), Flux2Pipeline._prepare_text_ids(torch.zeros(2, 7, 4))[0])
    # Several references of different sizes: t = 10, 20, ... each with its own grid, as the pipeline.
    refs = [torch.randn(1, 16, 2, 2), torch.randn(1, 16, 3, 4), torch.randn(1, 16, 1, 2)]
    assert torch.equal(steps.reference_ids([t.shape[-2:] for t in refs]), Flux2Pipeline._prepare_image_ids(refs)[0])
    assert steps.reference_ids([]).shape == (0, 4)
    seq, seq_ids = steps.image_sequence(x, [t.expand(2, -1, -1, -1) for t in refs])
    assert seq.shape == (2, 15 + 4 + 12 + 2, 16) and seq_ids.shape == (33, 4)
    assert torch.equal(seq[:, 15:19], Flux2Pipeline._pack_latents(refs[0]).expand(2, -1, -1))
    assert seq_ids[:15, 0].eq(0).all() and seq_ids[15:19, 0].eq(10).all() and seq_ids[31:, 0].eq(30).all()
    with pytest.raises(ValueError, match="batch size or channels"):
        steps.image_sequence(x, [torch.randn(2, 8, 3, 5)])


def test_draws_noise_target_and_guidance(parts):
    scheduler = parts[False].scheduler
    u = torch.tensor([0.0, 0.25, 0.999])
    timesteps, sigmas = steps.sample_sigmas(u, scheduler)
    # FLUX.2's scheduler config (use_dynamic_shifting) leaves the training sigmas unshifted: sigma = t / 1000.
    assert torch.allclose(sigmas, timesteps / 1000) and torch.allclose(sigmas, torch.tensor([1.0, 0.75, 0.001]))
    x, n = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    noisy = steps.noisy_latents(x, n, sigmas)
    assert torch.equal(noisy[0], n[0]) and torch.allclose(noisy[1], 0.25 * x[1] + 0.75 * n[1])
    assert torch.equal(steps.flow_target(x, n), n - x)
    assert torch.equal(steps.model_timestep(timesteps), timesteps / 1000)
    assert steps.guidance_input(parts[True].transformer.config, 3, 3.5) is None
    assert steps.guidance_input(parts[False].transformer.config, 3, 3.5).tolist() == [3.5] * 3
    pred = torch.randn(3, 5, 4)
    assert torch.equal(steps.target_tokens(pred, 2), pred[:, :2])
    w = torch.tensor([1.0, 2.0, 0.5])
    loss = steps.flow_loss(pred, torch.zeros_like(pred), w)
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
