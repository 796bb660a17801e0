"""LoRA files other tools load: ComfyUI's Flux key mapping accepts both of our formats, and the kohya export
round-trips through diffusers' own converter to the same weights and the same pipeline output."""

from __future__ import annotations

import pytest
import torch
from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from flux_cp.lora import DEFAULT_TARGETS
from flux_cp.lora_format import convert, to_kohya, with_alphas
from flux_cp.tiny import TRANSFORMER_CONFIG, build_tiny_pipeline, tiny_transformer
from tests.launch import comfy_lora_prefixes, comfy_not_loaded

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


def test_with_alphas_and_unknown_formats():
    sd = {
        "transformer.x_embedder.lora_A.weight": torch.ones(2, 3),
        "transformer.x_embedder.lora_B.weight": torch.ones(3, 2),
    }
    assert with_alphas(sd, 2, 2) == sd
    assert with_alphas(sd, 2, 6)["transformer.x_embedder.alpha"].item() == 6.0
    with pytest.raises(ValueError, match="unknown LoRA format 'onnx'"):
        convert(sd, "onnx", 2, 2)
    with pytest.raises(ValueError, match="no place for a LoRA on 'pos_embed'"):
        to_kohya(
            {
                "transformer.pos_embed.lora_A.weight": torch.ones(1, 1),
                "transformer.pos_embed.lora_B.weight": torch.ones(1, 1),
            },
            1,
            1,
        )
