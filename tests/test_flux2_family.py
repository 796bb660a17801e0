"""FLUX.2 on the family seam: which family a folder is, its encoders against Flux2Pipeline / Flux2KleinPipeline, the
trainer's micro-batches against diffusers' FLUX.2 examples on equal draws (loss and every gradient), CP chunks of
FLUX.2 sequences, the default LoRA targets and the flags it refuses."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline

import cp
from flux_cp.config.parser import parse_config
from flux_cp.config.training import DataConfig, ModelConfig, TrainConfig
from flux_cp.data.batches import Batches
from flux_cp.data.flow import per_sample_draws
from flux_cp.data.schedule import BatchSchedule
from flux_cp.errors import UsageError
from flux_cp.families import FLUX1, FLUX2, FLUX2_KLEIN, detect
from flux_cp.families.flux2.family import load_tokenizer
from flux_cp.families.flux2.recipe import text_ids
from flux_cp.families.flux2.tiny import FLUX2_KLEIN_4B_TRANSFORMER, default_flux2_cache_dir
from flux_cp.layout import Layout
from flux_cp.loss import batch_loss
from flux_cp.rng import Stream, generator
from tests.flux2_example import Args, example_step

CPU = torch.device("cpu")
PIPELINES = {False: Flux2Pipeline, True: Flux2KleinPipeline}


@pytest.fixture(scope="module")
def folders():
    """The families' embedded tiny defaults (built under the test session's FLUX_CP_HOME)."""
    built = {klein: Path(family.embedded_default(pairs=False)) for klein, family in ((0, FLUX2), (1, FLUX2_KLEIN))}
    assert built[0] == default_flux2_cache_dir() and built[1] == default_flux2_cache_dir(klein=True)
    return built


@pytest.fixture(scope="module")
def encoders(folders):
    return {
        klein: family.load_encoders(ModelConfig(str(folders[klein])), str(folders[klein]), torch.float32, CPU)
        for klein, family in ((False, FLUX2), (True, FLUX2_KLEIN))
    }


# --- which family ------------------------------------------------------------------------------------------------


def _folder_with(tmp_path, pipeline: str | None, transformer: str) -> str:
    folder = tmp_path / f"{pipeline}-{transformer}"
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": transformer}))
    if pipeline:
        (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    return str(folder)


def test_the_pipeline_class_tells_dev_from_klein_and_the_transformer_class_decides_otherwise(folders, tmp_path):
    assert detect(str(folders[False])) is FLUX2 and detect(str(folders[True])) is FLUX2_KLEIN
    assert detect(_folder_with(tmp_path, "Flux2KleinKVPipeline", "Flux2Transformer2DModel")) is FLUX2_KLEIN
    assert detect(_folder_with(tmp_path, "FluxKontextPipeline", "FluxTransformer2DModel")) is FLUX1
    # no model_index.json, or a pipeline no family names: the transformer's class
    assert detect(str(folders[False] / "transformer")) is FLUX2
    assert detect(_folder_with(tmp_path, "SomeFlux2EditPipeline", "Flux2Transformer2DModel")) is FLUX2
    assert detect(_folder_with(tmp_path, None, "FluxTransformer2DModel")) is FLUX1


def test_an_unsupported_model_is_one_line_naming_its_classes_and_the_supported_ones(tmp_path):
    with pytest.raises(UsageError) as e:
        detect(_folder_with(tmp_path, "StableDiffusion3Pipeline", "SD3Transformer2DModel"))
    message = str(e.value)
    assert "\n" not in message
    assert "is a StableDiffusion3Pipeline with a SD3Transformer2DModel; flux-cp trains FLUX.1" in message
    assert "FLUX.2 [dev] (Flux2Pipeline, Flux2Transformer2DModel)" in message
    assert "FLUX.2 [klein] (Flux2KleinPipeline, Flux2Transformer2DModel)" in message


# --- encoders ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("klein", [False, True], ids=["dev", "klein"])
def test_prompt_embeddings_are_the_pipelines_and_the_vae_keeps_fp32_statistics(folders, encoders, klein):
    enc = encoders[klein]
    pipe = PIPELINES[klein].from_pretrained(folders[klein])
    prompts = ["a red circle", "two blue squares on grass"]
    expected, _ = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=256)
    got = enc.prompts(prompts, 256)
    assert set(got) == set(enc.text_keys) == {"prompt_embeds"}
    assert torch.equal(got["prompt_embeds"], expected)
    assert list(enc.text_encoders) == ["text_encoder"] and enc.text_recipe  # the cache key names the layers
    assert not enc.is_distilled  # the tiny [klein] is a base model: its validation runs classifier-free guidance
    family = FLUX2_KLEIN if klein else FLUX2
    bf16 = family.load_encoders(ModelConfig(str(folders[klein])), str(folders[klein]), torch.bfloat16, CPU)
    assert bf16.vae.encoder.conv_in.weight.dtype == torch.bfloat16
    assert torch.equal(bf16.vae.bn.running_var, pipe.vae.bn.running_var)  # as the examples read them


def test_klein_validation_caches_the_empty_prompt_for_classifier_free_guidance(encoders):
    prompts = ["a red circle", "a blue square"]
    dev = FLUX2.validation_embeds(encoders[False], prompts, 64)
    klein = FLUX2_KLEIN.validation_embeds(encoders[True], prompts, 64)
    assert set(dev) == {"prompt_embeds"} and set(klein) == {"prompt_embeds", "negative_prompt_embeds"}
    empty = encoders[True].prompts([""], 64)["prompt_embeds"]
    assert klein["negative_prompt_embeds"].shape == klein["prompt_embeds"].shape
    assert all(torch.equal(row, empty[0]) for row in klein["negative_prompt_embeds"])


def test_a_chat_template_beside_the_tokenizer_is_read_and_a_missing_one_is_one_line(folders, tmp_path):
    folder = shutil.copytree(folders[False], tmp_path / "dev")
    tok = folder / "tokenizer"
    template = (tok / "chat_template.jinja").read_text()
    (tok / "chat_template.jinja").unlink()  # as a processor keeps it: chat_template.json beside the tokenizer
    (tok / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert load_tokenizer(str(folder), None).chat_template == template
    (tok / "chat_template.json").unlink()
    with pytest.raises(UsageError, match=r"^the tokenizer of .* has no chat template .*needs the text encoder's$"):
        load_tokenizer(str(folder), None)


def _cfg(folder, *flags: str):
    return parse_config(["--pretrained_model_name_or_path", str(folder), *flags])


def test_a_window_the_chat_template_fills_is_refused_naming_the_least_that_works(folders):
    """[dev]'s system message takes 172 tokens of the tiny byte-level tokenizer before the caption: at 64 or 128
    every caption encoded alike (the run trained unconditionally without a word); the family counts its template's
    tokens and refuses a window leaving the caption fewer than 16, naming the least (a multiple of --cp_size)."""
    dev, klein = folders[False], folders[True]
    for length in (64, 128, 172):
        with pytest.raises(UsageError, match=rf"^--max_sequence_length {length}: FLUX.2 \[dev\]'s chat template takes "
                           r"172 tokens before the caption \(the tokenizer of .*\), leaving none: every caption would "
                           r"encode alike and the run would train without its captions. Use --max_sequence_length 188 "
                           r"or more \(at least 16 caption tokens\)$"):  # fmt: skip
            FLUX2.check_text(_cfg(dev, "--max_sequence_length", str(length)), str(dev))
    with pytest.raises(UsageError, match=r"leaving 8 for the caption. Use --max_sequence_length 189 or more"):
        FLUX2.check_text(_cfg(dev, "--max_sequence_length", "180", "--cp_size", "3"), str(dev))
    FLUX2.check_text(_cfg(dev, "--max_sequence_length", "188"), str(dev))
    FLUX2_KLEIN.check_text(_cfg(klein, "--max_sequence_length", "64"), str(klein))  # its template: 17 tokens before
    with pytest.raises(UsageError, match=r"takes 17 tokens before the caption .* leaving 15 for the caption. Use "
                       r"--max_sequence_length 33 or more"):  # fmt: skip
        FLUX2_KLEIN.check_text(_cfg(klein, "--max_sequence_length", "32"), str(klein))


def test_captions_the_window_cuts_are_counted_once(encoders):
    """Captions longer than the window after the template's tokens are cut by the pipelines' encoding: said in one
    line (how many, the longest), not silently."""
    enc = encoders[False]
    captions = ["a red circle", "x" * 40, "a much longer caption " * 4]
    assert enc.truncation_warnings(captions, 260) == []
    (line,) = enc.truncation_warnings(captions, 200)
    assert line == ("warning: 2 of 3 captions do not fit in the 200 tokens of --max_sequence_length, 172 of which the "
                    "chat template takes before the caption and are cut there (the longest needs 260 tokens): raise "
                    "--max_sequence_length (at most 512) or shorten them")  # fmt: skip


def _with_template(folder: Path, tmp_path: Path, template: str) -> Path:
    copy_ = shutil.copytree(folder, tmp_path / "crafted")
    (copy_ / "tokenizer" / "chat_template.jinja").write_text(template)
    return copy_


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}",
         r"cannot be rendered \(SecurityError: access to attribute '__class__' of 'str' object is unsafe"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         r"takes more than 0.5 s to render one caption"),
        ("{% for i in range(20000) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}{% endfor %}",
         r"renders 1080000 characters for one caption \(at most 1000000\)"),
        ("{{ raise_exception('\x1b[31mred') }}", r"cannot be rendered \(TemplateError: \\x1b\[31mred\)"),
        ("{% for m in messages %}{{ m['role'] }}{% endfor %}", r": the chat template leaves the caption out"),
    ],
    ids=["sandbox", "nested-loops", "endless-output", "escapes", "no-caption"],
)  # fmt: skip
def test_a_crafted_chat_template_is_rendered_once_within_bounds_and_refused_naming_its_file(
    folders, tmp_path, monkeypatch, template, message
):
    """The template is rendered at start with a time and a size bound: one that jinja's sandbox refuses, that loops
    for minutes, writes without end or leaves the caption out is one line naming chat_template.jinja (control
    characters from it escaped), before any model loads."""
    import flux_cp.families.flux2.family as flux2

    monkeypatch.setattr(flux2, "TEMPLATE_SECONDS", 0.5)
    folder = _with_template(folders[False], tmp_path, template)
    with pytest.raises(UsageError) as e:
        FLUX2.check_text(_cfg(folder, "--max_sequence_length", "256"), str(folder))
    text = str(e.value)
    assert re.search(message, text), text
    assert str(folder / "tokenizer" / "chat_template.jinja") in text and "\x1b" not in text  # no raw ESC


# --- micro-batches against diffusers' examples ---------------------------------------------------------------------


class PixelData:
    """A TrainingData of encoded images (the VAE's distribution, as the cache holds it), random prompt embeddings and,
    for pairs, the reference's mean latent."""

    def __init__(self, enc, pixels, cond, embeds):
        mean, std = enc.latents(pixels)
        self.samples = [{"latent_mean": mean[i], "latent_std": std[i], "prompt_embeds": embeds[i]}
                        for i in range(len(pixels))]  # fmt: skip
        if cond is not None:
            for s, ref in zip(self.samples, enc.latents(cond)[0]):
                s["reference_latent"] = ref
        self.buckets = [0] * len(pixels)

    def load(self, index: int, flip: bool, epoch: int) -> dict:
        assert not flip
        return self.samples[index]


def _batches(family, data, scheduler, train, cp_size=1, cp_rank=0, group=None, mode=None, vae=None):
    layout = Layout(cp_size, cp_rank, cp_size, 1, 0, cp_rank, group)
    schedule = BatchSchedule(data.buckets, train.train_batch_size, seed=train.seed)
    guidance = family is not FLUX2_KLEIN
    return Batches(data, schedule, layout, DataConfig(vae_encode_mode=mode), train, scheduler, family,
                   family.normalizer(vae), guidance, CPU)  # fmt: skip


CASES = [(False, False, "none"), (False, True, "logit_normal"), (True, False, "cosmap"), (True, True, "none")]


@pytest.mark.parametrize("klein, pairs, scheme", CASES)
def test_loss_and_gradients_equal_the_examples_on_the_trainers_draws(folders, encoders, klein, pairs, scheme):
    """The trainer's micro-batch (Batches with the default --vae_encode_mode, the family's CP processors, MicroBatch.
    loss) against train_dreambooth_lora_flux2[_klein][_img2img].py's step on the same images, prompts and draws."""
    family, enc = (FLUX2_KLEIN if klein else FLUX2), encoders[klein]
    pipe = PIPELINES[klein].from_pretrained(folders[klein])
    g = torch.Generator().manual_seed(7)
    pixels = torch.rand(2, 3, 64, 64, generator=g) * 2 - 1
    cond = torch.rand(2, 3, 64, 64, generator=g) * 2 - 1 if pairs else None
    embeds = torch.randn(2, 8, pipe.transformer.config.joint_attention_dim, generator=g)
    data = PixelData(enc, pixels, cond, embeds)
    train = TrainConfig(train_batch_size=2, seed=3, weighting_scheme=scheme)
    m = 1
    mb = _batches(family, data, pipe.scheduler, train, vae=enc.vae).micro(m)
    _, order = BatchSchedule(data.buckets, 2, seed=3).batch(m)
    draws = per_sample_draws([generator(Stream.NOISE, 3, m, s) for s in range(2)], (4, 8, 8), train, pipe.scheduler,
                             family.model_latent_shape((4, 8, 8)))  # fmt: skip

    args = Args()
    args.weighting_scheme = scheme
    batch = {"pixel_values": pixels[order]}
    if pairs:
        batch["cond_pixel_values"] = cond[order]
    results = []
    for ours in (False, True):
        model = copy.deepcopy(pipe.transformer).requires_grad_(True)
        if ours:
            cp.apply_context_parallel(model, None)
            loss = batch_loss(model(**mb.inputs)[0], mb)
        else:
            loss = example_step(model, pipe.vae, copy.deepcopy(pipe.scheduler), batch, embeds[order],
                                text_ids(8).expand(2, -1, -1), args, 0, klein=klein, i2i=pairs,
                                draws=(draws["noise"], draws["u"]))  # fmt: skip
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    assert ref_loss > 0 and abs(loss - ref_loss) <= 1e-6 * ref_loss, (loss, ref_loss)
    assert mb.inputs["guidance"] is None if klein else mb.inputs["guidance"].tolist() == [3.5, 3.5]
    assert mb.image_tokens == (32 if pairs else 16) and mb.text_tokens == 8
    for n, ref in ref_grads.items():
        assert ref is not None and torch.allclose(grads[n], ref, rtol=1e-5, atol=1e-7 * ref.abs().max()), n


@pytest.mark.parametrize("pairs", [False, True], ids=["t2i", "pairs"])
def test_cp_chunks_of_flux2_sequences_are_the_whole_and_keep_the_loss(request, encoders, pairs):
    group, state = request.getfixturevalue("fake_cp_group")
    enc = encoders[False]
    g = torch.Generator().manual_seed(1)
    pixels = torch.rand(2, 3, 64, 64, generator=g) * 2 - 1
    data = PixelData(enc, pixels, -pixels if pairs else None, torch.randn(2, 8, 48, generator=g))
    train, scheduler = TrainConfig(train_batch_size=2, seed=2), FlowMatchEulerDiscreteScheduler()
    whole = _batches(FLUX2, data, scheduler, train, vae=enc.vae).micro(0)
    chunks = []
    for r in (0, 1):
        state["rank"] = r
        chunks.append(_batches(FLUX2, data, scheduler, train, 2, r, group, vae=enc.vae).micro(0))
    for key, dim in {"hidden_states": 1, "encoder_hidden_states": 1, "img_ids": 0, "txt_ids": 0}.items():
        assert torch.equal(torch.cat([c.inputs[key] for c in chunks], dim), whole.inputs[key]), key
    ids = whole.inputs["img_ids"]
    assert ids.shape == (32 if pairs else 16, 4) and ids[:16, 0].eq(0).all() and ids[16:, 0].eq(10).all()
    assert whole.inputs["txt_ids"][:, 3].tolist() == list(range(8))  # text has its own RoPE axis
    pred = torch.randn_like(whole.inputs["hidden_states"])
    half = pred.shape[1] // 2
    mean_of_chunks = (batch_loss(pred[:, :half], chunks[0]) + batch_loss(pred[:, half:], chunks[1])) / 2
    assert torch.allclose(mean_of_chunks, batch_loss(pred, whole), rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", [FLUX1, FLUX2], ids=["flux1", "flux2"])
def test_the_vae_encode_mode_changes_the_latent_and_no_draw(family, encoders):
    """--vae_encode_mode sample takes mean + std * eps, mode the mean; the noise and timesteps are the same draws
    either way (eps is drawn in both), so runs in the two modes stay comparable."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    c = 4
    samples = [{"latent_mean": torch.randn(c, 8, 8, generator=g), "latent_std": torch.rand(c, 8, 8, generator=g) + .1,
                "prompt_embeds": torch.randn(8, 48, generator=g), "pooled_prompt_embeds": torch.zeros(8)}
               for _ in range(2)]  # fmt: skip
    data = SimpleNamespace(buckets=[0, 0], load=lambda i, flip, epoch: samples[i])
    if family is FLUX1:
        vae = SimpleNamespace(config=SimpleNamespace(shift_factor=0.1, scaling_factor=0.5))
    else:
        vae = encoders[False].vae
    normalize = family.normalizer(vae)
    train, scheduler = TrainConfig(train_batch_size=2, seed=9), FlowMatchEulerDiscreteScheduler()
    built = {}
    for mode in ("sample", "mode"):
        built[mode] = _batches(family, data, scheduler, train, mode=mode, vae=vae).micro(0)
    _, order = BatchSchedule([0, 0], 2, seed=9).batch(0)
    draws = per_sample_draws([generator(Stream.NOISE, 9, 0, s) for s in range(2)], (c, 8, 8), train, scheduler,
                             family.model_latent_shape((c, 8, 8)))  # fmt: skip
    mean = torch.stack([samples[i]["latent_mean"] for i in order])
    std = torch.stack([samples[i]["latent_std"] for i in order])
    latents = {"sample": normalize(mean + std * draws["eps"]), "mode": normalize(mean)}
    for mode, mb in built.items():
        assert torch.equal(mb.inputs["timestep"], draws["timesteps"] / 1000)
        assert torch.allclose(mb.target, family.pack(draws["noise"] - latents[mode]), atol=1e-6), mode
    assert not torch.allclose(built["sample"].target, built["mode"].target)
    default = _batches(family, data, scheduler, train, vae=vae).micro(0)  # FLUX.1 samples, FLUX.2 takes the mode
    assert torch.equal(default.target, built[family.default_vae_encode_mode(False)].target)


# --- LoRA targets and flags ----------------------------------------------------------------------------------------


def test_default_lora_targets_are_the_examples_and_match_every_single_block(folders):
    from diffusers import Flux2Transformer2DModel

    from flux_cp.model.lora import check_targets

    expected = ["to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj"]
    assert FLUX2.lora_targets(False)[:5] == tuple(expected) and len(FLUX2.lora_targets(False)) == 5 + 48
    assert FLUX2_KLEIN.lora_targets(True)[-1] == "single_transformer_blocks.23.attn.to_out"  # the example's 24
    with torch.device("meta"):
        klein4b = Flux2Transformer2DModel.from_config(FLUX2_KLEIN_4B_TRANSFORMER)
    targets = FLUX2_KLEIN.lora_targets(False, dict(klein4b.config))
    assert len(targets) == 5 + 20  # [klein] 4B has 20 single blocks: every name matches one
    check_targets(klein4b, list(targets))
    tiny = Flux2Transformer2DModel.from_pretrained(folders[False], subfolder="transformer")
    from peft import LoraConfig

    tiny.add_adapter(LoraConfig(r=2, target_modules=list(FLUX2.lora_targets(False, dict(tiny.config)))))
    adapted = sorted({n.rsplit(".lora_A", 1)[0] for n, _ in tiny.named_parameters() if ".lora_A." in n})
    blocks = [f"transformer_blocks.{i}.attn.{p}" for i in range(2) for p in ("to_k", "to_out.0", "to_q", "to_v")]
    single = [f"single_transformer_blocks.{i}.attn.{p}" for i in range(2) for p in ("to_out", "to_qkv_mlp_proj")]
    assert adapted == sorted(blocks + single)


def test_lora_files_flux2_pipelines_cannot_load_are_refused_before_anything_loads(folders, tmp_path):
    from flux_cp.run.trainer import Trainer

    cfg = parse_config(["--pretrained_model_name_or_path", str(folders[True]), "--lora_format", "kohya",
                        "--output_dir", str(tmp_path / "out")])  # fmt: skip
    with pytest.raises(UsageError, match=r"^--lora_format kohya maps FLUX.1's module names; for FLUX.2 \[klein\] "
                       r"keep --lora_format diffusers \(the default: .* ComfyUI loads it\)$"):  # fmt: skip
        Trainer(cfg).setup()
    assert not (tmp_path / "out").exists()
    # --lora_alpha other than --rank is fine: the file carries the scale in lora_B (tests/test_lora_format.py)
    FLUX2.check(parse_config(["--pretrained_model_name_or_path", str(folders[False]), "--rank", "4", "--lora_alpha",
                              "8"]))  # fmt: skip


def test_lora_layers_comfyui_skips_are_warned_about_at_start(folders, tmp_path, caplog):
    """A LoRA on a layer ComfyUI maps no name for is said at the start of the run, not only in the model card."""
    from flux_cp.run.trainer import Trainer

    def warnings(*argv: str) -> list[str]:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        cfg = parse_config(["--pretrained_model_name_or_path", str(folders[False]), "--output_dir", str(out),
                            *argv])  # fmt: skip
        trainer = Trainer(cfg)
        caplog.clear()
        try:
            trainer.setup()
        finally:
            trainer.close()
        return [r.getMessage() for r in caplog.records if "ComfyUI maps no name" in r.getMessage()]

    assert warnings() == []  # the default layers all load in ComfyUI
    (line,) = warnings("--lora_layers", "to_q,double_stream_modulation_img.linear")
    assert line.startswith("warning: ComfyUI maps no name for double_stream_modulation_img.linear of FLUX.2 [dev]")
    assert warnings("--full_finetune") == []


def test_the_memory_plan_counts_flux2_with_its_own_blocks(folders, capsys):
    """--plan of a FLUX.2 folder: the family's parameter counts and blocks (the tiny [dev] has 2 + 2), and one
    recommended command for it."""
    from flux_cp.plan.report import print_plan

    print_plan(parse_config(["--plan", "--pretrained_model_name_or_path", str(folders[False]), "--gpu_memory_gib", "80",
                             "--gradient_checkpointing"]))  # fmt: skip
    out = capsys.readouterr().out
    assert "/4 " in out and "recommended for 1 GPU of 80 GiB" in out, out
    assert f"train_flux_cp.py --pretrained_model_name_or_path {folders[False]} " in out, out
