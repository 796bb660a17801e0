"""LoRA files other tools load: ComfyUI's Flux key mapping accepts both of our formats, and the kohya export
round-trips through diffusers' own converter to the same weights and the same pipeline output."""

from __future__ import annotations

import pytest
import torch
from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from flux_cp.families import FLUX2, of_model
from flux_cp.families.flux1 import DEFAULT_TARGETS
from flux_cp.families.flux1.kohya import to_kohya
from flux_cp.families.flux1.tiny import TRANSFORMER_CONFIG, build_tiny_pipeline, tiny_transformer
from flux_cp.families.flux2.family import COMFYUI_UNMAPPED
from flux_cp.families.lora_format import with_alphas
from tests.launch import (
    comfy_apply,
    comfy_convert_lora_leaves,
    comfy_flux2_key_map,
    comfy_flux2_weights,
    comfy_lora_prefixes,
    comfy_not_loaded,
)

# ComfyUI's key rules (comfy_lora_prefixes, comfy_not_loaded) are in tests/launch.py.


# --- LoRAs to convert ----------------------------------------------------------------------------------------


def _lora_transformer(targets, rank: int, alpha: int, seed: int = 0):
    model = tiny_transformer(seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # peft starts B at zero; a trained LoRA has both
                    p.normal_(std=0.1)
    return model


def _diffusers_state(model) -> dict[str, torch.Tensor]:
    """What train_flux_cp.py saves: peft's state dict with diffusers' `transformer.` prefix."""
    return {f"transformer.{k}": v.contiguous() for k, v in get_peft_model_state_dict(model).items()}


def _deltas(sd: dict[str, torch.Tensor], scale: float = 1.0) -> dict[str, torch.Tensor]:
    """{module: scale * B @ A @ P} of a diffusers-format LoRA state dict, P a fixed random probe of 8 columns
    (the full B @ A of FLUX.1's shapes would be hundreds of MB each)."""
    out = {}
    for k, a in sd.items():
        if k.endswith(".lora_A.weight"):
            probe = torch.randn(a.shape[1], 8, generator=torch.Generator().manual_seed(a.shape[1]), dtype=torch.float64)
            out[k[: -len(".lora_A.weight")]] = scale * sd[k.replace("lora_A", "lora_B")].double() @ (a.double() @ probe)
    return out


def convert(state: dict, fmt: str, rank: int, alpha: float) -> dict:
    """A FLUX.1 LoRA's weights as `save_lora` writes them in `fmt`."""
    return with_alphas(state, rank, alpha) if fmt == "diffusers" else to_kohya(state, rank, alpha)


def test_default_lora_of_both_formats_loads_completely_under_comfyui_rules():
    cfg = TRANSFORMER_CONFIG
    prefixes = comfy_lora_prefixes(cfg["num_layers"], cfg["num_single_layers"])
    model = _lora_transformer(list(DEFAULT_TARGETS), rank=4, alpha=8)
    state = _diffusers_state(model)
    for fmt in ("diffusers", "kohya"):
        sd = convert(state, fmt, rank=4, alpha=8)
        assert comfy_not_loaded(sd, prefixes) == set(), fmt
        assert any(k.endswith(".alpha") for k in sd), f"{fmt}: rank 4 with alpha 8 needs alpha keys for ComfyUI"
    # with alpha == rank the diffusers file is exactly what diffusers' own trainers write
    assert convert(state, "diffusers", rank=4, alpha=4) == state


def _flux1_lora(rank: int) -> dict[str, torch.Tensor]:
    """A LoRA of FLUX.1-dev's shapes on every module the kohya layout knows, in two double and two single
    blocks (first and last: diffusers' converter walks 19 and 38)."""
    h, mlp = 3072, 12288
    g = torch.Generator().manual_seed(0)
    shapes = {}
    for i in (0, 18):
        d = f"transformer_blocks.{i}"
        for m in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            shapes[f"{d}.attn.{m}"] = (h, h)
        for ff in ("ff", "ff_context"):
            shapes[f"{d}.{ff}.net.0.proj"], shapes[f"{d}.{ff}.net.2"] = (h, mlp), (mlp, h)
        shapes[f"{d}.norm1.linear"] = shapes[f"{d}.norm1_context.linear"] = (h, 6 * h)
    for i in (0, 37):
        d = f"single_transformer_blocks.{i}"
        for m in ("attn.to_q", "attn.to_k", "attn.to_v"):
            shapes[f"{d}.{m}"] = (h, h)
        shapes[f"{d}.proj_mlp"], shapes[f"{d}.proj_out"], shapes[f"{d}.norm.linear"] = (
            (h, mlp),
            (h + mlp, h),
            (h, 3 * h),
        )
    shapes.update({"x_embedder": (64, h), "context_embedder": (4096, h), "proj_out": (h, 64)})
    shapes.update({"time_text_embed.guidance_embedder.linear_1": (256, h), "norm_out.linear": (h, 2 * h)})
    sd = {}
    for module, (fan_in, fan_out) in shapes.items():
        sd[f"transformer.{module}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.01
        sd[f"transformer.{module}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    return sd


@pytest.mark.parametrize("alpha", [4, 8])
def test_kohya_export_round_trips_through_diffusers_converter_at_flux1_shapes(alpha):
    rank = 4
    ours = _flux1_lora(rank)
    kohya = to_kohya(ours, rank, alpha)
    assert "lora_unet_single_blocks_37_linear1.lora_up.weight" in kohya
    assert comfy_not_loaded(kohya, comfy_lora_prefixes(19, 38)) == set()
    back = _convert_kohya_flux_lora_to_diffusers(dict(kohya))
    # diffusers' converter names the top-level modules without the `transformer.` prefix
    back = {(k if k.startswith("transformer.") else f"transformer.{k}"): v for k, v in back.items()}
    want, got = _deltas(ours, alpha / rank), _deltas(back)
    assert set(want) <= set(got)
    for module, delta in want.items():
        err = (got[module] - delta).abs().max() / delta.abs().max()
        assert err < 1e-6, f"{module}: relative error {err:.1e}"
    # modules diffusers adds for slots without LoRA (proj_mlp beside q/k/v) must be zero
    assert all(got[m].abs().max() == 0 for m in set(got) - set(want))


def test_diffusers_file_with_alphas_and_kohya_file_give_the_trained_pipeline_output(tmp_path):
    """Both files, loaded by `FluxPipeline.load_lora_weights` into a fresh pipeline, reproduce the pipeline
    holding the trained peft LoRA. The targets avoid single-block q/k/v, whose split diffusers' kohya converter
    does with FLUX.1-dev's fixed sizes (covered at FLUX.1 shapes above), and the top-level modules (proj_out,
    x_embedder, ...), which that converter names without the `transformer.` prefix, so diffusers drops them."""
    rank, alpha = 4, 8
    targets = [f"transformer_blocks.{i}.attn.{m}" for i in range(2) for m in ("to_q", "to_k", "to_v")]
    targets += ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_out.0"]
    targets += ["ff.net.0.proj", "ff_context.net.2", "norm.linear"]
    targets += [f"single_transformer_blocks.{i}.proj_out" for i in range(2)]
    trained = _lora_transformer(targets, rank, alpha)
    state = _diffusers_state(trained)
    for fmt in ("diffusers", "kohya"):
        save_file(convert(state, fmt, rank, alpha), tmp_path / f"{fmt}.safetensors")
    assert set(load_file(tmp_path / "kohya.safetensors")) == set(to_kohya(state, rank, alpha))

    def sample(pipe) -> torch.Tensor:
        out = pipe(
            "a red circle", height=64, width=64, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=16,
            generator=torch.Generator().manual_seed(0), output_type="latent",
        )  # fmt: skip
        return out.images

    def pipeline(transformer=None):
        pipe = build_tiny_pipeline(transformer=transformer is None)
        if transformer is not None:
            pipe.transformer = transformer
        for m in pipe.components.values():
            if isinstance(m, torch.nn.Module):
                m.eval()  # built, not loaded: T5's dropout would be on
        return pipe

    with torch.no_grad():
        expected = sample(pipeline(trained))
        outputs = {}
        for fmt in ("diffusers", "kohya"):
            pipe = pipeline()
            pipe.load_lora_weights(str(tmp_path), weight_name=f"{fmt}.safetensors")
            outputs[fmt] = sample(pipe)
        base = sample(pipeline())
    scale = expected.abs().max()
    assert (base - expected).abs().max() / scale > 1e-3, "the LoRA should change the output"
    for fmt, out in outputs.items():
        assert (out - expected).abs().max() / scale < 1e-5, fmt


def test_with_alphas_and_layouts_a_family_lacks():
    sd = {
        "transformer.x_embedder.lora_A.weight": torch.ones(2, 3),
        "transformer.x_embedder.lora_B.weight": torch.ones(3, 2),
    }
    assert with_alphas(sd, 2, 2) == sd
    assert with_alphas(sd, 2, 6)["transformer.x_embedder.alpha"].item() == 6.0
    with pytest.raises(ValueError, match=r"FLUX.2 \[dev\] writes no kohya LoRA files"):
        FLUX2.lora_layout("kohya", sd, None, None, False)
    with pytest.raises(ValueError, match="no place for a LoRA on 'pos_embed'"):
        to_kohya(
            {
                "transformer.pos_embed.lora_A.weight": torch.ones(1, 1),
                "transformer.pos_embed.lora_B.weight": torch.ones(1, 1),
            },
            1,
            1,
        )


# --- metadata ------------------------------------------------------------------------------------------------


def _save_trained_lora(model, cfg, tmp_path, origin=None):
    """Adapters for `cfg.lora` on `model`, lora_B drawn non-zero (as after training), written by `save_lora`."""
    from flux_cp.model.lora import add_lora, save_lora

    add_lora(model, cfg.lora, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    return save_lora(model, state, str(tmp_path), cfg.lora, of_model(model), origin)


def _saved(tmp_path, argv: list[str], origin=None):
    """A LoRA file written by `save_lora` for the flags `argv` (the tiny transformer, B non-zero)."""
    from flux_cp.config.parser import parse_config
    from flux_cp.families import FLUX1
    from flux_cp.shape.build import resolved

    cfg = resolved(parse_config(argv), FLUX1, False, None)
    model = tiny_transformer(seed=0)
    return cfg, model, _save_trained_lora(model, cfg, tmp_path, origin)


def _header(path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def _loaded_adapter(path):
    """The peft config and LoRA weights `FluxPipeline.load_lora_weights` builds from the file."""
    pipe = build_tiny_pipeline(transformer=True)
    pipe.load_lora_weights(str(path.parent), weight_name=path.name)
    (config,) = pipe.transformer.peft_config.values()
    weights = {n: p.detach() for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    return config, weights


def test_diffusers_file_carries_the_adapter_metadata_diffusers_builds_the_adapter_from(tmp_path):
    import json

    from flux_cp.config.parser import parse_config
    from flux_cp.families import FLUX1
    from flux_cp.model.lora import lora_origin
    from flux_cp.shape.build import resolved

    argv = ["--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-dev", "--output_dir", str(tmp_path / "dog")]
    origin = lora_origin(resolved(parse_config(argv), FLUX1, False, None), pairs=False)
    assert (origin.title, origin.resolution) == ("dog", 1024)
    cfg, model, path = _saved(tmp_path, ["--rank", "4", "--lora_dropout", "0.1"], origin)
    header = _header(path)
    assert header["format"] == "pt" and header["base_model"] == "black-forest-labs/FLUX.1-dev"
    packed = json.loads(header["lora_adapter_metadata"])  # diffusers' key and its `transformer.` prefix
    assert packed["transformer.r"] == 4 and packed["transformer.lora_alpha"] == 4
    assert set(packed["transformer.target_modules"]) == set(DEFAULT_TARGETS)
    config, weights = _loaded_adapter(path)
    # built from the metadata: the suffixes we trained with (from the keys diffusers would list every module),
    # the alpha, the dropout and the base model
    assert set(config.target_modules) == set(DEFAULT_TARGETS)
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 4, 0.1)
    assert config.base_model_name_or_path == "black-forest-labs/FLUX.1-dev"
    ours = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    assert {n.replace(".default_0", ""): p for n, p in weights.items()}.keys() == ours.keys()
    for n, p in weights.items():
        assert torch.equal(p, ours[n.replace(".default_0", "")]), n


def test_a_diffusers_file_with_alpha_keys_goes_without_adapter_metadata_and_diffusers_reads_its_alpha(tmp_path):
    """diffusers refuses adapter metadata beside alpha keys, and ComfyUI needs the alpha keys: alpha != rank keeps
    the keys, and diffusers takes the alpha from them."""
    _, _, path = _saved(tmp_path, ["--rank", "4", "--lora_alpha", "8"])
    header = _header(path)
    assert "lora_adapter_metadata" not in header and "base_model" not in header
    assert any(k.endswith(".alpha") for k in load_file(path))
    config, _ = _loaded_adapter(path)
    assert (config.r, float(config.lora_alpha)) == (4, 8.0)


@pytest.mark.parametrize(
    "guidance, kontext, architecture",
    [(True, False, "flux-1-dev/lora"), (False, False, "flux-1-schnell/lora"), (True, True, "flux-1/lora")],
)
def test_kohya_file_carries_the_fields_kohya_readers_show(tmp_path, guidance, kontext, architecture):
    from flux_cp.families.flux1.kohya import metadata
    from flux_cp.families.lora_format import Origin

    base = tmp_path / "FLUX.1-local"
    base.mkdir()
    for name, expect in (("black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.1-dev"), (str(base), base.name)):
        origin = Origin(name, "my-dog", 2048, kontext)
        header = metadata(rank=16, alpha=8, origin=origin, guidance=guidance)
        assert header["ss_sd_model_name"] == expect  # sd-scripts: a local model by its name, a hub id as it is
    assert {k: header[k] for k in ("ss_network_module", "ss_network_dim", "ss_network_alpha")} == {
        "ss_network_module": "networks.lora_flux", "ss_network_dim": "16", "ss_network_alpha": "8",
    }  # fmt: skip
    assert header["ss_base_model_version"] == "flux1" and header["modelspec.architecture"] == architecture
    assert header["modelspec.resolution"] == "2048x2048" and header["modelspec.title"] == "my-dog"
    assert header["modelspec.implementation"] == "https://github.com/black-forest-labs/flux"
    assert "lora_adapter_metadata" not in header  # kohya readers show ss_*; diffusers converts the keys


def test_kohya_file_written_by_save_lora_has_its_metadata(tmp_path):
    _, _, path = _saved(tmp_path, ["--rank", "4", "--lora_format", "kohya"])
    header = _header(path)
    assert header["ss_network_dim"] == "4" and header["ss_network_alpha"] == "4"
    assert all(k.startswith("lora_unet_") for k in load_file(path))


# --- what the kohya export refuses ----------------------------------------------------------------------------


def test_what_diffusers_cannot_read_back_from_kohya_files(tmp_path):
    """diffusers' kohya loader (0.42.1) drops top-level layers without a word and fails on a single block's linear1
    of other sizes than FLUX.1's: what `kohya_problem` refuses. When diffusers fixes either, this test fails, and
    the refusal can go."""
    from flux_cp.families.flux1.kohya import kohya_problem, lora_modules

    targets = ["transformer_blocks.0.attn.to_q", "x_embedder", "norm_out.linear"]
    save_file(to_kohya(_diffusers_state(_lora_transformer(targets, 4, 4)), 4, 4), tmp_path / "top.safetensors")
    _, weights = _loaded_adapter(tmp_path / "top.safetensors")
    assert any(n.startswith("transformer_blocks.0.attn.to_q.") for n in weights)
    assert not any(n.startswith(("x_embedder.", "norm_out.")) for n in weights), "diffusers now reads them"
    assert "top-level layers (norm_out.linear, x_embedder)" in kohya_problem(
        lora_modules(TRANSFORMER_CONFIG, targets), TRANSFORMER_CONFIG
    )

    targets = ["single_transformer_blocks.0.attn.to_q"]
    save_file(to_kohya(_diffusers_state(_lora_transformer(targets, 4, 4)), 4, 4), tmp_path / "single.safetensors")
    with pytest.raises(AssertionError):  # `assert sum(dims) == up_weight.shape[0]` with FLUX.1's dims
        _loaded_adapter(tmp_path / "single.safetensors")
    assert "FLUX.1's sizes (3 x 3072 + 12288), not this model's (3 x 64 + 256)" in kohya_problem(
        lora_modules(TRANSFORMER_CONFIG, targets), TRANSFORMER_CONFIG
    )


def test_kohya_problem_names_what_diffusers_would_drop_and_accepts_what_it_reads():
    from flux_cp.families.flux1.kohya import kohya_problem, lora_modules
    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER

    dev = dict(FLUX1_DEV_TRANSFORMER)
    assert kohya_problem(lora_modules(dev, list(DEFAULT_TARGETS)), dev) is None
    # FLUX.1's single-block sizes split correctly (round trip at FLUX.1 shapes above)
    assert kohya_problem(lora_modules(dev, ["attn.to_q", "proj_mlp", "norm.linear"]), dev) is None
    problem = kohya_problem(lora_modules(dev, ["proj_out"]), dev)
    assert problem.startswith("diffusers' kohya loader drops LoRAs on top-level layers (proj_out)")
    deeper = {**dev, "num_layers": 20}
    assert "not transformer_blocks.*.attn.to_q" in kohya_problem(lora_modules(deeper, ["attn.to_q"]), deeper)
    # a double block's own q/k/v on the tiny model are fine (equal thirds); its single blocks' are not
    tiny = dict(TRANSFORMER_CONFIG)
    assert kohya_problem(lora_modules(tiny, ["transformer_blocks.0.attn.to_q", "attn.to_out.0"]), tiny) is None
    assert kohya_problem(lora_modules(tiny, ["attn.to_v"]), tiny).endswith("single_transformer_blocks.*.attn.to_v")


def test_check_export_refuses_at_start_in_one_line():
    from flux_cp.config.parser import parse_config
    from flux_cp.errors import UsageError
    from flux_cp.families import FLUX1
    from flux_cp.families.flux1.kohya import check_export
    from flux_cp.shape.build import resolved

    tiny = dict(TRANSFORMER_CONFIG)
    with pytest.raises(UsageError, match=r"^--lora_format kohya: diffusers' kohya loader splits .* or leave those "):
        check_export(tiny, resolved(parse_config(["--lora_format", "kohya"]), FLUX1, False, None).lora)
    check_export(tiny, resolved(parse_config([]), FLUX1, False, None).lora)  # diffusers' format holds any LoRA
    check_export(
        tiny,
        resolved(
            parse_config(["--lora_format", "kohya", "--lora_layers", "transformer_blocks.0.attn.to_q"]),
            FLUX1,
            False,
            None,
        ).lora,
    )


# --- FLUX.2 under ComfyUI's rules -----------------------------------------------------------------------------


def _flux2_config(klein: bool) -> dict:
    from flux_cp.families.flux2.tiny import TRANSFORMER_CONFIG as FLUX2_TINY

    return {**FLUX2_TINY, "guidance_embeds": not klein}  # [klein] has no guidance embedding


def _bfl_flux2(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of ComfyUI's FLUX.2 model of `config`, by its (BFL) names."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) * 0.1 for k, shape in comfy_flux2_weights(config).items()}


def _from_bfl(config: dict, bfl: dict[str, torch.Tensor]):
    """The Flux2Transformer2DModel holding BFL-named weights, through diffusers' own FLUX.2 checkpoint converter
    (`from_single_file`'s), loaded strictly: the names and shapes of `comfy_flux2_weights` must be a BFL
    checkpoint's, every one of them."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    model = Flux2Transformer2DModel(**config)
    model.load_state_dict(convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl)), strict=True)
    return model


def _flux2_saved(tmp_path, klein: bool, argv: list[str]):
    """A FLUX.2 transformer on random BFL weights, its LoRA for the flags `argv` (the family's default targets, B
    non-zero) and the file `save_lora` writes: (config, BFL weights, transformer, path)."""
    from flux_cp.config.parser import parse_config
    from flux_cp.families import FLUX2, FLUX2_KLEIN
    from flux_cp.shape.build import resolved

    config = _flux2_config(klein)
    bfl = _bfl_flux2(config)
    model = _from_bfl(config, bfl)
    cfg = resolved(parse_config(argv), FLUX2_KLEIN if klein else FLUX2, False, config)
    return config, bfl, model, _save_trained_lora(model, cfg, tmp_path)


def _merged(model) -> dict[str, torch.Tensor]:
    """The transformer's weights with its LoRA merged in by peft (the trained function), diffusers' names."""
    import copy

    from peft.tuners.lora import LoraLayer

    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.merge()
    return {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}


@pytest.mark.parametrize("rank, alpha", [(4, 4), (4, 8)], ids=["alpha=rank", "alpha=2rank"])
@pytest.mark.parametrize("klein", [False, True], ids=["dev", "klein"])
def test_flux2_lora_file_loads_completely_under_comfyui_rules_as_the_trained_weights(tmp_path, klein, rank, alpha):
    """ComfyUI's loader (comfy_apply, tests/launch.py) applies every key of the default FLUX.2 LoRA file to a
    weight ComfyUI's FLUX.2 model has (q/k/v as slices of the fused qkv), and the weights it computes, converted to
    diffusers' names by diffusers' own FLUX.2 checkpoint converter, are the trained transformer's with its LoRA
    merged by peft: right modules, slices and scale."""
    config, bfl, model, path = _flux2_saved(tmp_path, klein, ["--rank", str(rank), "--lora_alpha", str(alpha)])
    sd = load_file(path)
    modules = {k.rsplit(".lora_", 1)[0] for k in sd if ".lora_" in k}
    # the default targets: the double blocks' image q/k/v/out, the single blocks' fused input and output
    assert len(modules) == 4 * config["num_layers"] + 2 * config["num_single_layers"]
    assert comfy_convert_lora_leaves(sd)
    not_loaded, unreached, patched = comfy_apply(sd, comfy_flux2_key_map(config), bfl)
    assert not_loaded == set() and unreached == set()
    comfy, trained = _from_bfl(config, patched).state_dict(), _merged(model)
    assert comfy.keys() == trained.keys()
    worst = max((comfy[k] - trained[k]).abs().max().item() for k in trained)
    assert worst < 1e-5, worst
    # not blind: exactly the weights the LoRA targets changed, q, k and v each in its third of the fused qkv
    changed = {k for k in bfl if not torch.equal(patched[k], bfl[k])}
    assert changed == {k for k in bfl if k.endswith(("img_attn.qkv.weight", "img_attn.proj.weight", "linear1.weight",
                                                     "linear2.weight"))}  # fmt: skip
    for k in changed:
        assert all((part != 0).any() for part in (patched[k] - bfl[k]).chunk(3 if "qkv" in k else 1)), k


@pytest.mark.parametrize("klein", [False, True], ids=["dev", "klein"])
def test_comfyui_applies_a_flux2_lora_on_every_layer_but_those_it_names_no_diffusers_name_for(tmp_path, klein):
    """A LoRA on every linear layer of FLUX.2 (alpha 8, rank 4): ComfyUI applies each to its weight (both streams'
    q/k/v, the MLPs, the embedders, norm_out with BFL's shift/scale order) as the trained weights, and skips exactly
    the layers `COMFYUI_UNMAPPED` lists, which `Family.comfyui_skips` names for the targets."""
    from diffusers import Flux2Transformer2DModel

    config = _flux2_config(klein)
    with torch.device("meta"):
        linear = [n for n, m in Flux2Transformer2DModel(**config).named_modules() if isinstance(m, torch.nn.Linear)]
    argv = ["--rank", "4", "--lora_alpha", "8", "--lora_layers", ",".join(linear)]
    config, bfl, model, path = _flux2_saved(tmp_path, klein, argv)
    sd = load_file(path)
    not_loaded = comfy_apply(sd, comfy_flux2_key_map(config), bfl)[0]
    skipped = {k.rsplit(".lora_", 1)[0].removeprefix("transformer.") for k in not_loaded}
    assert skipped == set(FLUX2.comfyui_skips(linear)) == {n for n in COMFYUI_UNMAPPED if n in linear}
    assert ("time_guidance_embed.guidance_embedder.linear_1" in skipped) != klein
    # what it applies is the trained weights (the skipped layers' LoRAs left out of both)
    applied = {k: v for k, v in sd.items() if not k.startswith(tuple(f"transformer.{n}." for n in skipped))}
    not_loaded, unreached, patched = comfy_apply(applied, comfy_flux2_key_map(config), bfl)
    assert not_loaded == unreached == set()
    trained = _merged(model)
    base = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    for n in skipped:
        trained[f"{n}.weight"] = base[f"{n}.weight"]
    comfy = _from_bfl(config, patched).state_dict()
    assert max((comfy[k] - trained[k]).abs().max().item() for k in trained) < 1e-5
    assert all(not torch.equal(trained[f"{n}.weight"], base[f"{n}.weight"]) for n in linear if n not in skipped)


def test_the_comfyui_check_sees_a_dropped_a_renamed_and_a_flux1_named_key(tmp_path):
    """What comfy_apply reports when a file's key is missing, misnamed, or named as FLUX.1's diffusers layer of
    the same place (`proj_out` of a single block: ComfyUI maps it, the weight update is the same)."""
    config, bfl, _, path = _flux2_saved(tmp_path, False, [])
    sd, key_map = load_file(path), comfy_flux2_key_map(config)
    a = "transformer.single_transformer_blocks.1.attn.to_out.lora_A.weight"
    b = a.replace("lora_A", "lora_B")
    _, _, whole = comfy_apply(sd, key_map, bfl)

    dropped = {k: v for k, v in sd.items() if k != b}
    assert comfy_apply(dropped, key_map, bfl)[0] == {a}
    renamed = {k.replace(".attn.to_out.", ".attn.to_out.0.") if "single" in k else k: v for k, v in sd.items()}
    assert comfy_apply(renamed, key_map, bfl)[0] == {k for k in renamed if "single" in k and ".to_out.0." in k}
    flux1 = {k.replace(".attn.to_out.", ".proj_out.") if "single" in k else k: v for k, v in sd.items()}
    not_loaded, unreached, patched = comfy_apply(flux1, key_map, bfl)
    assert not_loaded == unreached == set() and all(torch.equal(patched[k], whole[k]) for k in bfl)


@pytest.mark.parametrize("klein", [False, True], ids=["dev", "klein"])
def test_a_flux2_lora_with_alpha_other_than_rank_renders_the_trained_models_output_in_flux2_pipelines(tmp_path, klein):
    """FLUX.2's LoRA loader refuses alpha keys: the file carries alpha / rank in lora_B, with adapter metadata of
    alpha = rank, and `Flux2Pipeline` / `Flux2KleinPipeline.load_lora_weights` give the output of the pipeline that
    holds the trained peft LoRA (rank 4, alpha 8)."""
    import json

    from flux_cp.config.parser import parse_config
    from flux_cp.families import FLUX2, FLUX2_KLEIN
    from flux_cp.families.flux2.tiny import build_tiny_flux2_pipeline
    from flux_cp.model.lora import add_lora, save_lora
    from flux_cp.shape.build import resolved

    def pipeline():
        pipe = build_tiny_flux2_pipeline(klein=klein)
        for m in pipe.components.values():
            if isinstance(m, torch.nn.Module):
                m.eval()
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sample(pipe) -> torch.Tensor:
        out = pipe(
            prompt="a red circle", height=64, width=64, num_inference_steps=2, guidance_scale=3.5,
            max_sequence_length=64 if klein else 256, generator=torch.Generator().manual_seed(0), output_type="latent",
        )  # fmt: skip
        return out.images

    trained = pipeline()
    config = dict(trained.transformer.config)
    cfg = resolved(parse_config(["--rank", "4", "--lora_alpha", "8"]), FLUX2_KLEIN if klein else FLUX2, False, config)
    add_lora(trained.transformer, cfg.lora, seed=0)
    with torch.no_grad():
        for name, p in trained.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    state = {k: v for k, v in trained.transformer.state_dict().items() if "lora_" in k}
    path = save_lora(trained.transformer, state, str(tmp_path), cfg.lora, of_model(trained.transformer))
    assert not any(k.endswith(".alpha") for k in load_file(path))
    packed = json.loads(_header(path)["lora_adapter_metadata"])
    assert (packed["transformer.r"], packed["transformer.lora_alpha"]) == (4, 4)
    with torch.no_grad():
        expected, base = sample(trained), sample(pipeline())
        loaded = pipeline()
        loaded.load_lora_weights(str(tmp_path))
        got = sample(loaded)
    scale = expected.abs().max()
    assert (base - expected).abs().max() / scale > 1e-3, "the LoRA should change the output"
    assert (got - expected).abs().max() / scale < 1e-5


def test_the_lora_file_s_title_and_base_model_hold_no_control_characters(tmp_path):
    """The run's name (its output folder's) and the base model's go into the file's metadata, which model browsers
    show: their control characters are written as escapes."""
    from flux_cp.config.parser import parse_config
    from flux_cp.model.lora import lora_origin

    out, base = tmp_path / "run\x1b[2J", tmp_path / "model\x07"
    base.mkdir()
    origin = lora_origin(parse_config(["--output_dir", str(out), "--pretrained_model_name_or_path", str(base)]), False)
    assert origin.title == "run\\x1b[2J" and origin.base_model == f"{tmp_path}/model\\x07"


def test_lora_format_offers_the_layouts_the_families_write():
    """--lora_format's choices are the layouts the registered families write (`Family.lora_layouts`): the flag table
    cannot import the families, so it lists them, and this keeps the list the families'."""
    from flux_cp.config.fields import LORA_FORMATS
    from flux_cp.families import FAMILIES

    assert set(LORA_FORMATS) == {layout for family in FAMILIES for layout in family.lora_layouts}
