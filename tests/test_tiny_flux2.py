"""The tiny FLUX.2 folders: diffusers' Flux2Pipeline / Flux2KleinPipeline load them and generate; the shapes presets
carry FLUX.2's transformer configs with encoders of the matching output sizes; `python -m flux_cp.tiny --family`."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel

from flux_cp import tiny
from flux_cp.families.flux2.tiny import (
    FLUX2_DEV_TRANSFORMER,
    FLUX2_KLEIN_4B_TRANSFORMER,
    FLUX2_KLEIN_9B_TRANSFORMER,
    build_tiny_flux2_pipeline,
    default_flux2_cache_dir,
    ensure_tiny_flux2_pipeline,
)

PIPELINES = {False: Flux2Pipeline, True: Flux2KleinPipeline}
ENCODERS = {False: "Mistral3ForConditionalGeneration", True: "Qwen3ForCausalLM"}


@pytest.fixture(scope="module", params=[False, True], ids=["dev", "klein"])
def folder(request, tmp_path_factory):
    klein = request.param
    return klein, ensure_tiny_flux2_pipeline(tmp_path_factory.mktemp("tiny") / "flux2", klein=klein)


def test_the_pipeline_loads_the_folder_and_generates_64px_in_2_steps(folder):
    klein, path = folder
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == PIPELINES[klein].__name__
    pipe = PIPELINES[klein].from_pretrained(path)
    assert type(pipe.text_encoder).__name__ == ENCODERS[klein]
    assert isinstance(pipe.vae, AutoencoderKLFlux2) and isinstance(pipe.transformer, Flux2Transformer2DModel)
    # [klein] has no guidance embedding (Flux2KleinPipeline passes guidance=None); [dev] has one.
    assert pipe.transformer.config.guidance_embeds is (not klein)
    # The latent statistics the pipelines normalise with are saved, and are not the identity.
    bn = pipe.vae.bn
    assert bn.num_features == pipe.transformer.config.in_channels
    assert bn.running_mean.abs().min() > 0 and not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))

    def generate(prompt: str) -> torch.Tensor:
        pipe.set_progress_bar_config(disable=True)
        out = pipe(
            prompt=prompt,
            height=64,
            width=64,
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        )
        return out.images

    a, b = generate("a red circle"), generate("a blue square")
    assert a.shape == (1, 3, 64, 64) and torch.isfinite(a).all()
    # The prompt reaches the transformer: the tokenizer keeps it inside max_sequence_length after the chat template.
    assert not torch.equal(a, b)
    assert torch.equal(a, generate("a red circle"))


def test_prompt_encoding_fits_the_chat_template_and_the_stacked_layers(folder):
    klein, path = folder
    pipe = PIPELINES[klein].from_pretrained(path)
    embeds, text_ids = pipe.encode_prompt("a red circle", device="cpu", max_sequence_length=512)
    # Three hidden layers stacked: the width the transformer takes.
    assert embeds.shape == (1, 512, pipe.transformer.config.joint_attention_dim)
    assert text_ids.shape == (1, 512, 4) and text_ids[0, :, 3].tolist() == list(range(512))
    tok = pipe.tokenizer
    if klein:
        text = tok.apply_chat_template(
            [{"role": "user", "content": "a red circle"}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        assert text == "<|im_start|>user\na red circle<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    else:
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        ids = tok.apply_chat_template(format_input(["a red circle"]), tokenize=True, return_dict=True)["input_ids"]
        text = tok.decode(ids[0] if isinstance(ids[0], list) else ids)
        assert text.startswith("<s>[SYSTEM_PROMPT]You are an AI") and text.endswith("[INST]a red circle[/INST]")


def test_ensure_builds_once_under_flux_cp_home(monkeypatch, tmp_path):
    monkeypatch.setenv("FLUX_CP_HOME", str(tmp_path))
    path = ensure_tiny_flux2_pipeline(klein=True)
    assert path == default_flux2_cache_dir(klein=True) and path.parent == tmp_path
    stamp = (path / "model_index.json").stat().st_mtime_ns
    assert ensure_tiny_flux2_pipeline(klein=True) == path
    assert (path / "model_index.json").stat().st_mtime_ns == stamp  # found, not rebuilt
    assert default_flux2_cache_dir(klein=False) != path


def test_the_same_seed_builds_the_same_weights():
    a, b = build_tiny_flux2_pipeline(klein=True), build_tiny_flux2_pipeline(klein=True)
    for name in ("transformer", "text_encoder", "vae"):
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name


def _count(config: dict) -> float:
    with torch.device("meta"):
        model = Flux2Transformer2DModel(**config)
    return sum(p.numel() for p in model.parameters()) / 1e9


def test_full_size_configs_have_the_published_sizes():
    # FLUX.2 [dev] is a 32B transformer, [klein] 4B and 9B.
    assert round(_count(FLUX2_DEV_TRANSFORMER)) == 32
    assert round(_count(FLUX2_KLEIN_4B_TRANSFORMER)) == 4
    assert round(_count(FLUX2_KLEIN_9B_TRANSFORMER)) == 9


@pytest.mark.parametrize("klein", [False, True], ids=["dev", "klein"])
def test_shapes_preset_from_the_command_line(klein, tmp_path, capsys):
    out = tmp_path / "shapes"
    preset = "flux2-klein-shapes" if klein else "flux2-dev-shapes"
    assert tiny.main(["--preset", preset, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = Flux2Transformer2DModel.load_config(out / "transformer")
    expected = FLUX2_KLEIN_4B_TRANSFORMER if klein else FLUX2_DEV_TRANSFORMER
    assert {k: config[k] for k in expected} == {k: list(v) if isinstance(v, tuple) else v for k, v in expected.items()}
    assert not list((out / "transformer").glob("*.safetensors"))  # no weights: --transformer_init random
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == PIPELINES[klein].__name__
    # The encoders feed a transformer of that config: 3 stacked hidden layers = joint_attention_dim, and the VAE's
    # batch norm covers its input channels.
    pipe = PIPELINES[klein].from_pretrained(out, transformer=None)
    embeds, _ = pipe.encode_prompt("a red circle", device="cpu", max_sequence_length=64)
    assert embeds.shape == (1, 64, expected["joint_attention_dim"])
    assert pipe.vae.bn.num_features == expected["in_channels"]
    assert 2 ** (len(pipe.vae.config.block_out_channels) - 1) == 8


def test_family_flag_builds_each_family(tmp_path, capsys):
    for family, cls in [("flux2", "Flux2Pipeline"), ("flux2-klein", "Flux2KleinPipeline"), ("flux1", "FluxPipeline")]:
        out = tmp_path / family
        assert tiny.main(["--family", family, "--out", str(out)]) == 0
        assert json.loads((out / "model_index.json").read_text())["_class_name"] == cls
    assert tiny.main(["--kontext", "--out", str(tmp_path / "k")]) == 0  # as before
    assert json.loads((tmp_path / "k" / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    capsys.readouterr()
    for bad in (
        ["--family", "flux2", "--kontext"],
        ["--family", "flux2", "--preset", "flux1-dev-shapes"],
        ["--family", "flux1", "--preset", "flux2-dev-shapes"],
        ["--family", "flux2-klein", "--preset", "flux2-dev-shapes"],
    ):
        with pytest.raises(SystemExit) as e:
            tiny.main([*bad, "--out", str(tmp_path / "bad")])
        assert e.value.code == 2
        assert "error: --" in capsys.readouterr().err, bad
    assert not (tmp_path / "bad").exists()
