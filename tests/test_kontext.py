"""FLUX.1 Kontext sequence helpers: the same sequence and ids as diffusers' FluxKontextPipeline, the split of
the image segment over CP ranks, and the target-only loss."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flux_cp.config.training import DataConfig
from flux_cp.data.pairs import image_segment
from flux_cp.data.sources import open_source, reference_column
from flux_cp.errors import UsageError
from flux_cp.families import FLUX1
from flux_cp.families.flux1.tokens import pack_latents, reference_ids
from flux_cp.loss import PairSplit, batch_loss, target_loss
from tests.fakes import C, FakeData, H, W, make_batches


def test_sequence_and_ids_match_flux_kontext_pipeline():
    from flux_cp.families.flux1.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline(kontext=True, transformer=False)
    g = torch.Generator().manual_seed(0)
    # A reference of another size than the target (the pipeline allows it), passed as latents.
    ref = torch.randn(2, 4, 6, 10, generator=g)
    latents, image_latents, latent_ids, image_ids = pipe.prepare_latents(
        ref, 2, 4, 8 * 8, 12 * 8, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(1)
    )
    target = torch.randn(2, 4, 8, 12, generator=g)
    hidden, ids = image_segment(pack_latents(target), [pack_latents(ref)], (8, 12), [(6, 10)], FLUX1)
    torch.testing.assert_close(ids, torch.cat([latent_ids, image_ids], dim=0), rtol=0, atol=0)
    torch.testing.assert_close(hidden[:, 24:], image_latents, rtol=0, atol=0)
    assert latents.shape[1] == 24 and image_latents.shape[1] == 15
    assert (reference_ids(6, 10)[:, 0] == 1).all() and (ids[:24, 0] == 0).all()


def test_image_segment_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="differ in batch size or channels"):
        image_segment(torch.zeros(1, 4, 16), [torch.zeros(1, 4, 8)], (4, 4), [(4, 4)], FLUX1)
    with pytest.raises(ValueError, match="a 4x6 latent packs to 6"):
        image_segment(torch.zeros(1, 4, 16), [torch.zeros(1, 4, 16)], (4, 4), [(4, 6)], FLUX1)


@pytest.mark.parametrize("t,r,n", [(24, 24, 2), (24, 12, 4), (15, 1, 4), (9, 9, 2), (16, 16, 8)])
def test_split_covers_the_segment_and_every_target_once(t, r, n):
    split = PairSplit(t, r, n)
    spans = [split.span(k) for k in range(n)]
    assert spans[0][0] == 0 and spans[-1][1] == t + r
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert sum(split.local_targets(k) for k in range(n)) == t
    for k, (start, stop) in enumerate(spans):  # a rank's target tokens are the first ones of its chunk
        assert split.local_targets(k) == len([p for p in range(start, stop) if p < t])


def test_split_refuses_what_does_not_divide():
    with pytest.raises(ValueError, match="do not split over 4 ranks"):
        PairSplit(15, 2, 4)
    PairSplit(4225, 4225, 2)  # 1040 px pairs: odd target and reference, even together


@pytest.mark.parametrize("t,r,n", [(24, 24, 2), (24, 12, 4), (15, 1, 4), (24, 24, 1)])
def test_target_loss_averaged_over_ranks_is_the_full_loss(t, r, n):
    g = torch.Generator().manual_seed(3)
    pred = torch.randn(3, t + r, 8, generator=g, dtype=torch.float64)
    target = torch.randn(3, t, 8, generator=g, dtype=torch.float64)
    weighting = torch.rand(3, 1, 1, generator=g, dtype=torch.float64) + 0.5
    full = (weighting * (pred[:, :t] - target) ** 2).mean()
    split = PairSplit(t, r, n)
    chunks = pred.chunk(n, dim=1)
    per_rank = [target_loss(chunks[k], target, weighting, split, k) for k in range(n)]
    torch.testing.assert_close((sum(per_rank) / n).double(), full, rtol=1e-6, atol=0)
    if n == 1:
        plain = F.mse_loss(pred[:, :t], target, reduction="none").mul(weighting).mean()
        torch.testing.assert_close(per_rank[0].double(), plain, rtol=1e-6, atol=0)


# --- pair data sets -----------------------------------------------------------------------------------------

PAIRS = Path(__file__).resolve().parent.parent / "data" / "tiny_pairs"


def _data_flags(**overrides) -> DataConfig:
    return DataConfig(**{"dataset_name": str(PAIRS), **overrides})


def _copy_pairs(folder: Path, rows: int = 4, edit=None) -> Path:
    folder.mkdir(parents=True)
    lines = [json.loads(line) for line in (PAIRS / "metadata.jsonl").read_text().splitlines()[:rows]]
    for row in lines:
        for key in ("file_name", "reference_file_name"):
            shutil.copy(PAIRS / row[key], folder / row[key])
    if edit:
        edit(lines)
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def test_bundled_pairs_are_found_from_their_metadata_and_read_with_the_target_loader():
    assert reference_column(_data_flags()) == "reference"
    source = open_source(_data_flags())
    assert source.pairs and len(source) == 16
    assert all("_edited" in s.ref and "_edited" not in s.reference for s in source.samples)
    assert source.samples[0].caption.startswith("make the ")
    target, reference = source.load(0), source.load(0, reference=True)
    assert target.size == reference.size and target.tobytes() != reference.tobytes()
    assert not open_source(_data_flags(dataset_name=None)).pairs


def test_a_row_without_its_reference_is_refused(tmp_path):
    folder = _copy_pairs(tmp_path / "d", edit=lambda rows: rows[2].pop("reference_file_name"))
    with pytest.raises(UsageError, match="line 3 .* has no reference image 'reference_file_name'"):
        open_source(_data_flags(dataset_name=str(folder)))


def test_a_reference_column_that_no_row_has_is_refused(tmp_path):
    folder = _copy_pairs(tmp_path / "d")
    with pytest.raises(UsageError, match="--cond_image_column source: no row of .* has 'source_file_name'"):
        open_source(_data_flags(dataset_name=str(folder), cond_image_column="source"))


def test_an_undecodable_reference_names_the_file(tmp_path):
    folder = _copy_pairs(tmp_path / "d")
    name = json.loads((folder / "metadata.jsonl").read_text().splitlines()[1])["reference_file_name"]
    (folder / name).write_bytes(b"not a png")
    source = open_source(_data_flags(dataset_name=str(folder)))
    source.load(1)  # the target is fine
    with pytest.raises(UsageError, match=f"cannot read reference image .*{name}: not an image format"):
        source.load(1, reference=True)


def _hub(monkeypatch, references: list) -> None:
    import datasets

    files = sorted(str(p) for p in PAIRS.glob("*_edited.png"))[: len(references)]
    table = {"image": files, "source": references, "text": [f"edit {i}" for i in range(len(files))]}
    ds = (
        datasets.Dataset.from_dict(table).cast_column("image", datasets.Image()).cast_column("source", datasets.Image())
    )
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: ds)


def test_hub_pairs_read_the_cond_image_column(monkeypatch):
    refs = sorted(str(p) for p in PAIRS.glob("*.png") if "_edited" not in p.name)[:3]
    _hub(monkeypatch, refs)
    source = open_source(_data_flags(dataset_name="someone/pairs", cond_image_column="source"))
    assert source.pairs and len(source) == 3
    assert source.raw_bytes(2, reference=True) == Path(refs[2]).read_bytes()
    assert source.where(2, reference=True) == "someone/pairs row 2 column 'source'"
    with pytest.raises(UsageError, match="--cond_image_column 'reference' is not in someone/pairs"):
        open_source(_data_flags(dataset_name="someone/pairs", cond_image_column="reference"))


def test_hub_rows_without_a_reference_are_refused(monkeypatch):
    refs = sorted(str(p) for p in PAIRS.glob("*.png") if "_edited" not in p.name)[:3]
    _hub(monkeypatch, [refs[0], None, refs[2]])
    with pytest.raises(UsageError, match="row 1 has no reference image in --cond_image_column 'source'"):
        open_source(_data_flags(dataset_name="someone/pairs", cond_image_column="source"))


# --- flags that count pair tokens ----------------------------------------------------------------------------


def test_plan_counts_kontext_pair_sequences(capsys):
    from flux_cp.config.parser import parse_config
    from flux_cp.plan.report import print_plan

    print_plan(parse_config(["--plan", "--dataset_name", str(PAIRS), "--resolution", "1024",
                             "--max_sequence_length", "512", "--gpu_memory_gib", "141"]))  # fmt: skip
    # 8,192 image tokens (target and reference, 4,096 each) + 512 text tokens
    assert "1024 px FLUX.1 Kontext pairs (8704 tokens/sample)" in capsys.readouterr().out


def test_pairs_need_only_target_plus_reference_tokens_to_divide():
    from flux_cp.config.parser import parse_config
    from flux_cp.shape.build import build_shape
    from flux_cp.shape.run_shape import check_tokens

    def check(*flags: str) -> None:
        cfg = parse_config(["--resolution", "1040", "--max_sequence_length", "512", *flags])
        check_tokens(build_shape(cfg, cfg.parallel.cp_size), cfg.data, cfg.validation)

    check("--dataset_name", str(PAIRS), "--cp_size", "2")  # 4,225 + 4,225 tokens: each odd, together even
    with pytest.raises(UsageError, match="--resolution 1040 gives 4225 image tokens, not divisible by --cp_size 2"):
        check("--cp_size", "2")  # the same resolution without pairs
    with pytest.raises(UsageError, match="--resolution 1040 gives 8450 image tokens per pair, not divisible by"):
        check("--dataset_name", str(PAIRS), "--cp_size", "4")
    # Validation edits the reference at --validation_resolution: a pair too (checked only when it will run).
    edit = ["--validation_prompt", "red", "--validation_image", str(PAIRS / "00_blue_circle.png")]
    check("--dataset_name", str(PAIRS), "--cp_size", "2", *edit)
    with pytest.raises(UsageError, match="--validation_resolution 1040 gives 8450 image tokens per pair"):
        check("--dataset_name", str(PAIRS), "--cp_size", "4", "--aspect_buckets", *edit)


# --- micro-batches of pairs ----------------------------------------------------------------------------------


class FakePairs(FakeData):
    """FakeData whose samples are Kontext pairs: a reference latent beside each target's distribution."""

    def __init__(self, n: int):
        super().__init__(n)
        g = torch.Generator().manual_seed(1)
        for s in self.samples:
            s["reference_latent"] = torch.randn(C, H, W, generator=g)

    def load(self, index: int, flip: bool, epoch: int) -> dict:
        s = super().load(index, flip, epoch)
        return {**s, "reference_latent": s["reference_latent"].flip(-1) if flip else s["reference_latent"]}


def test_pair_micro_batches_hold_target_then_reference_and_cp_chunks_keep_the_loss(request):
    group, state = request.getfixturevalue("fake_cp_group")
    data = FakePairs(4)
    whole = make_batches(data, dp=1, dp_rank=0).micro(1)
    t = (H // 2) * (W // 2)
    assert whole.image_tokens == 2 * t and whole.target.shape[1] == t and whole.pair == PairSplit(t, t, 1)
    index, flip, _ = data.calls[-1]
    reference = data.samples[index]["reference_latent"]
    reference = (reference.flip(-1) if flip else reference) * 0.5 - 0.1 * 0.5  # (x - shift) * scale
    torch.testing.assert_close(whole.inputs["hidden_states"][:, t:], pack_latents(reference[None]))
    assert (whole.inputs["img_ids"][:t, 0] == 0).all() and (whole.inputs["img_ids"][t:, 0] == 1).all()
    chunks = []
    for r in (0, 1):
        state["rank"] = r
        chunks.append(make_batches(data, dp=1, dp_rank=0, cp_size=2, cp_rank=r, group=group).micro(1))
    for key, dim in {"hidden_states": 1, "encoder_hidden_states": 1, "img_ids": 0, "txt_ids": 0}.items():
        assert torch.equal(torch.cat([c.inputs[key] for c in chunks], dim), whole.inputs[key]), key
    assert all(torch.equal(c.target, whole.target) for c in chunks)  # each rank keeps the whole target
    pred = torch.randn_like(whole.inputs["hidden_states"])
    mean_of_chunks = (batch_loss(pred[:, :t], chunks[0]) + batch_loss(pred[:, t:], chunks[1])) / 2
    assert torch.allclose(mean_of_chunks, batch_loss(pred, whole), rtol=1e-6, atol=0)
    assert batch_loss(pred[:, t:], chunks[1]) == 0  # rank 1 holds only reference tokens


def test_the_pipeline_class_tells_kontext_models_apart(tmp_path):
    from flux_cp.families.components import pipeline_class
    from flux_cp.families.flux1.tiny import ensure_tiny_pipeline

    kontext = ensure_tiny_pipeline(kontext=True)
    assert pipeline_class(str(kontext), None) == "FluxKontextPipeline"  # pairs train it without a warning
    assert pipeline_class(str(ensure_tiny_pipeline()), None) == "FluxPipeline"  # the trainer warns on pairs
    assert pipeline_class(str(kontext / "transformer"), None) is None  # nothing to tell: no warning


# --- against diffusers' Kontext example ------------------------------------------------------------------------------


def kontext_example_step(transformer, vae, noise_scheduler_copy, batch, prompt_embeds, pooled_prompt_embeds, text_ids,
                         args, draws):  # fmt: skip
    """The training step of diffusers' examples/dreambooth/train_dreambooth_lora_flux_kontext.py (commit 58eb52c0)
    with a condition image, line for line, without prior preservation, latent caching or accelerate: 1945-1956
    (get_sigmas, has_guidance) and 2019-2147 (the step). Changes: `accelerator.device` -> "cpu", `weight_dtype` ->
    fp32, `unwrap_model(transformer)` -> `transformer`, and `draws` = (noise, u) replaces the two random draws (the
    trainer's own, to compare on equal draws)."""
    from diffusers import FluxKontextPipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    weight_dtype = torch.float32
    vae_config_shift_factor = vae.config.shift_factor
    vae_config_scaling_factor = vae.config.scaling_factor
    vae_config_block_out_channels = vae.config.block_out_channels
    has_image_input = True

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler_copy.sigmas.to(device="cpu", dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps.to("cpu")
        timesteps = timesteps.to("cpu")
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]

        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    has_guidance = transformer.config.guidance_embeds

    pixel_values = batch["pixel_values"].to(dtype=vae.dtype)
    if has_image_input:
        cond_pixel_values = batch["cond_pixel_values"].to(dtype=vae.dtype)
    if args.vae_encode_mode == "sample":
        model_input = vae.encode(pixel_values).latent_dist.sample()
        if has_image_input:
            cond_model_input = vae.encode(cond_pixel_values).latent_dist.sample()
    else:
        model_input = vae.encode(pixel_values).latent_dist.mode()
        if has_image_input:
            cond_model_input = vae.encode(cond_pixel_values).latent_dist.mode()
    model_input = (model_input - vae_config_shift_factor) * vae_config_scaling_factor
    model_input = model_input.to(dtype=weight_dtype)
    if has_image_input:
        cond_model_input = (cond_model_input - vae_config_shift_factor) * vae_config_scaling_factor
        cond_model_input = cond_model_input.to(dtype=weight_dtype)

    vae_scale_factor = 2 ** (len(vae_config_block_out_channels) - 1)

    latent_image_ids = FluxKontextPipeline._prepare_latent_image_ids(
        model_input.shape[0], model_input.shape[2] // 2, model_input.shape[3] // 2, "cpu", weight_dtype
    )
    if has_image_input:
        cond_latents_ids = FluxKontextPipeline._prepare_latent_image_ids(
            cond_model_input.shape[0], cond_model_input.shape[2] // 2, cond_model_input.shape[3] // 2, "cpu",
            weight_dtype,
        )  # fmt: skip
        cond_latents_ids[..., 0] = 1
        latent_image_ids = torch.cat([latent_image_ids, cond_latents_ids], dim=0)

    noise = draws[0]  # torch.randn_like(model_input)
    u = draws[1]  # compute_density_for_timestep_sampling(weighting_scheme=args.weighting_scheme, ...)
    indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
    timesteps = noise_scheduler_copy.timesteps[indices].to(device=model_input.device)

    sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    packed_noisy_model_input = FluxKontextPipeline._pack_latents(
        noisy_model_input, batch_size=model_input.shape[0], num_channels_latents=model_input.shape[1],
        height=model_input.shape[2], width=model_input.shape[3],
    )  # fmt: skip
    orig_inp_shape = packed_noisy_model_input.shape
    if has_image_input:
        packed_cond_input = FluxKontextPipeline._pack_latents(
            cond_model_input, batch_size=cond_model_input.shape[0], num_channels_latents=cond_model_input.shape[1],
            height=cond_model_input.shape[2], width=cond_model_input.shape[3],
        )  # fmt: skip
        packed_noisy_model_input = torch.cat([packed_noisy_model_input, packed_cond_input], dim=1)

    guidance = None
    if has_guidance:
        guidance = torch.tensor([args.guidance_scale], device="cpu")
        guidance = guidance.expand(model_input.shape[0])

    model_pred = transformer(
        hidden_states=packed_noisy_model_input, timestep=timesteps / 1000, guidance=guidance,
        pooled_projections=pooled_prompt_embeds, encoder_hidden_states=prompt_embeds, txt_ids=text_ids,
        img_ids=latent_image_ids, return_dict=False,
    )[0]  # fmt: skip
    if has_image_input:
        model_pred = model_pred[:, : orig_inp_shape[1]]
    model_pred = FluxKontextPipeline._unpack_latents(
        model_pred, height=model_input.shape[2] * vae_scale_factor, width=model_input.shape[3] * vae_scale_factor,
        vae_scale_factor=vae_scale_factor,
    )  # fmt: skip

    weighting = compute_loss_weighting_for_sd3(weighting_scheme=args.weighting_scheme, sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean(
        (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1),
        1,
    )
    return loss.mean()


@pytest.mark.parametrize("scheme", ["none", "logit_normal"])
def test_pair_loss_and_gradients_equal_the_kontext_examples_with_default_flags(scheme):
    """The trainer's Kontext micro-batch with the default --vae_encode_mode (the mode, as the example) and
    MicroBatch.loss, against the example's step on the same images, prompts and draws: equal loss and gradients."""
    import copy
    from types import SimpleNamespace

    from diffusers import FlowMatchEulerDiscreteScheduler

    from flux_cp.config.training import DataConfig, TrainConfig
    from flux_cp.data.batches import Batches
    from flux_cp.data.flow import per_sample_draws
    from flux_cp.data.schedule import BatchSchedule
    from flux_cp.families import FLUX1
    from flux_cp.families.flux1.tiny import build_tiny_pipeline
    from flux_cp.layout import Layout
    from flux_cp.rng import Stream, generator

    pipe = build_tiny_pipeline(kontext=True)
    vae, transformer = pipe.vae, pipe.transformer
    g = torch.Generator().manual_seed(4)
    pixels, cond = (torch.rand(2, 3, 64, 64, generator=g) * 2 - 1 for _ in range(2))
    embeds = torch.randn(2, 8, transformer.config.joint_attention_dim, generator=g)
    pooled = torch.randn(2, transformer.config.pooled_projection_dim, generator=g)
    with torch.no_grad():
        mean, std = (getattr(vae.encode(pixels).latent_dist, k) for k in ("mean", "std"))
        ref = vae.encode(cond).latent_dist.mean
    samples = [{"latent_mean": mean[i], "latent_std": std[i], "prompt_embeds": embeds[i],
                "pooled_prompt_embeds": pooled[i], "reference_latent": ref[i]} for i in range(2)]  # fmt: skip
    data = SimpleNamespace(buckets=[0, 0], load=lambda i, flip, epoch: samples[i])
    train = TrainConfig(train_batch_size=2, seed=6, weighting_scheme=scheme)
    scheduler = FlowMatchEulerDiscreteScheduler()
    schedule = BatchSchedule([0, 0], 2, seed=6)
    batches = Batches(data, schedule, Layout(1, 0, 1, 1, 0, 0, None), DataConfig(), train, scheduler, FLUX1,
                      FLUX1.normalizer(vae), True, torch.device("cpu"))  # fmt: skip
    m = 2
    mb = batches.micro(m)
    _, order = schedule.batch(m)
    draws = per_sample_draws([generator(Stream.NOISE, 6, m, s) for s in range(2)], tuple(mean.shape[1:]), train,
                             scheduler)  # fmt: skip
    args = SimpleNamespace(vae_encode_mode="mode", weighting_scheme=scheme, guidance_scale=3.5)  # the example's
    results = []
    for ours in (False, True):
        model = copy.deepcopy(transformer).requires_grad_(True)
        if ours:
            loss = batch_loss(model(**mb.inputs)[0], mb)
        else:
            batch = {"pixel_values": pixels[order], "cond_pixel_values": cond[order]}
            loss = kontext_example_step(model, vae, copy.deepcopy(scheduler), batch, embeds[order], pooled[order],
                                        torch.zeros(8, 3), args, (draws["noise"], draws["u"]))  # fmt: skip
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    assert ref_loss > 0 and abs(loss - ref_loss) <= 1e-6 * ref_loss, (loss, ref_loss)
    for n, want in ref_grads.items():
        assert want is not None and torch.allclose(grads[n], want, rtol=1e-5, atol=1e-7 * want.abs().max()), n
