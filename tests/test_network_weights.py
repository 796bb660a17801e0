"""--network_weights: a LoRA file, in diffusers' or kohya's layout, starts a run's LoRA with its weights bit for bit;
a file of other layers, rank or alpha is refused at start naming what differs (tiny FLUX.1 on the CPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flux_cp.config.parser import parse_config
from flux_cp.config.training import LoraConfig
from flux_cp.errors import UsageError
from flux_cp.families import FLUX1, FLUX2
from flux_cp.families.flux1 import DEFAULT_TARGETS
from flux_cp.families.flux1.kohya import from_kohya, to_kohya
from flux_cp.families.flux1.tiny import TRANSFORMER_CONFIG, tiny_transformer
from flux_cp.model import network_weights
from flux_cp.model.loading import prepare_trainable, trainable_parameters
from flux_cp.model.lora import save_lora
from flux_cp.outputs.resume import run_identity


def _lora(rank: int = 4, alpha: int = 4, layers=DEFAULT_TARGETS, fmt: str = "diffusers", path=None) -> LoraConfig:
    return LoraConfig(
        rank=rank,
        lora_alpha=alpha,
        lora_layers=tuple(layers),
        lora_format=fmt,
        network_weights=None if path is None else str(path),
    )


def _trained(lora: LoraConfig, seed: int = 1) -> torch.nn.Module:
    """The tiny transformer with LoRA adapters as after training: A and B both non-zero."""
    model = tiny_transformer(seed=0)
    prepare_trainable(model, lora, seed)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    return model


def _written(model: torch.nn.Module, lora: LoraConfig, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return save_lora(model, dict(model.state_dict()), str(folder), lora, FLUX1)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainable_parameters(model)}


@pytest.mark.parametrize("fmt, alpha", [("diffusers", 4), ("diffusers", 8), ("kohya", 4)])
def test_a_lora_file_starts_the_run_with_its_weights_bit_for_bit(tmp_path, fmt, alpha):
    lora = _lora(alpha=alpha, fmt=fmt)
    source = _trained(lora)
    path = _written(source, lora, tmp_path / "run")
    run = dataclasses.replace(lora, lora_format="diffusers", network_weights=str(path))
    network_weights.check_start(run, FLUX1, dict(TRANSFORMER_CONFIG))  # what is checked before any model loads
    model = tiny_transformer(seed=0)
    prepare_trainable(model, run, seed=7)  # other seeded weights, replaced by the file's
    fresh = _weights(model)
    line = network_weights.apply(model, run)
    assert line.startswith(f"LoRA weights from {path} ({fmt} layout, ")
    assert f"rank 4, alpha {alpha}): training starts from them at step 0" in line
    loaded, expected = _weights(model), _weights(source)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in loaded)
    assert not all(torch.equal(fresh[k], loaded[k]) for k in loaded)  # the run's own start differed


def test_kohya_s_shared_lora_of_a_fused_layer_is_one_lora_per_layer_of_the_same_update():
    """sd-scripts trains one LoRA on BFL's fused q/k/v: each of diffusers' q, k and v gets its down matrix and its rows
    of the up matrix (the same weight update)."""
    model = tiny_transformer(seed=0)
    linears, _ = network_weights.model_layers(model)
    hidden, width = linears["transformer_blocks.0.attn.to_q"]
    down, up = torch.randn(4, width), torch.randn(3 * hidden, 4)
    state = {
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": down,
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": up,
        "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(2.0),
    }
    slots = [f"transformer_blocks.0.attn.to_{x}" for x in "qkv"]
    modules, scales = from_kohya(state, linears, set(slots), rank=4)
    assert list(modules) == slots and set(scales.values()) == {0.5}
    fused = torch.cat([modules[s][1] @ modules[s][0] for s in slots])
    assert torch.equal(fused, up @ down)
    # a run that trains q alone gets k and v too: the check names them as layers it does not train
    assert list(from_kohya(state, linears, {slots[0]}, rank=4)[0]) == slots
    with pytest.raises(ValueError, match=r"has rank 4: neither --rank 2 \(one LoRA for attn.to_q/attn.to_k/attn.to_v"):
        from_kohya(state, linears, set(slots), rank=2)


def _refusal(tmp_path, file_lora: LoraConfig, run: LoraConfig) -> str:
    path = _written(_trained(file_lora), file_lora, tmp_path / "file")
    with pytest.raises(UsageError) as e:
        network_weights.check_start(
            dataclasses.replace(run, network_weights=str(path)), FLUX1, dict(TRANSFORMER_CONFIG)
        )
    assert e.value.agreed  # every rank reads the same file: one rank prints it
    return str(e.value)


def test_a_file_of_another_rank_alpha_or_layers_is_refused_naming_what_differs(tmp_path):
    message = _refusal(tmp_path / "rank", _lora(rank=4, alpha=8), _lora(rank=8, alpha=8))
    assert message.endswith(
        "holds LoRAs of rank 4, this run's --rank is 8: pass --rank 4 --lora_alpha 8 as the file has them"
    )
    message = _refusal(tmp_path / "alpha", _lora(alpha=8), _lora(alpha=4))
    assert message.endswith(
        "applies its LoRA at alpha 8 for rank 4 (scale 2), this run at --lora_alpha 4 (scale 1): pass --lora_alpha 8"
    )
    # flux-cp's kohya files hold the scale in their up matrices: alpha = rank
    message = _refusal(tmp_path / "kohya", _lora(alpha=8, fmt="kohya"), _lora(alpha=8))
    assert message.endswith(
        "applies its LoRA at alpha 4 for rank 4 (scale 1), this run at --lora_alpha 8 (scale 2): pass --lora_alpha 4"
    )
    message = _refusal(tmp_path / "layers", _lora(), _lora(layers=("attn.to_q", "attn.to_k")))
    assert "holds LoRAs on " in message and "layers this run does not train (" in message
    assert message.endswith(f"give --lora_layers {','.join(sorted(DEFAULT_TARGETS))} as the file has them")
    message = _refusal(tmp_path / "fewer", _lora(layers=("attn.to_q",)), _lora())
    assert "holds none on " in message and "layers it trains (" in message


def test_files_of_no_lora_layout_are_refused(tmp_path):
    lora = _lora()
    run = dataclasses.replace(lora, network_weights=str(tmp_path / "f.safetensors"))
    path = Path(run.network_weights)
    state = load_file(_written(_trained(lora), lora, tmp_path / "run"))
    cases = [
        (
            {**state, "transformer.x_embedder.lora_magnitude_vector": torch.ones(2)},
            "which is not a LoRA weight of "
            "diffusers' layout (transformer.<layer>.lora_A/lora_B.weight; DoRA and LoKr files are not read)",
        ),
        ({"text_encoder.a.lora_A.weight": torch.ones(1)}, "holds no transformer LoRA weights"),
    ]
    for bad, message in cases:
        save_file(bad, path)
        with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            network_weights.check_start(run, FLUX1, dict(TRANSFORMER_CONFIG))
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(UsageError, match="cannot be read as a .safetensors LoRA file"):
        network_weights.check_start(run, FLUX1, dict(TRANSFORMER_CONFIG))
    save_file(to_kohya(state, 4, 4), path)
    with pytest.raises(UsageError, match=r"is in kohya's layout \(lora_unet_...\), which FLUX.2 \[dev\] does not read"):
        network_weights.read(str(path), FLUX2, {}, set(), 4)


def test_a_text_encoder_lora_in_the_file_is_left_out_and_said(tmp_path):
    lora = _lora()
    source = _trained(lora)
    path = _written(source, lora, tmp_path / "run")
    save_file({**load_file(path), "text_encoder.text_model.x.lora_A.weight": torch.ones(1)}, path)
    model = tiny_transformer(seed=0)
    run = dataclasses.replace(lora, network_weights=str(path))
    prepare_trainable(model, run, seed=7)
    assert network_weights.apply(model, run).endswith("; its text encoder's LoRA is not used")


def test_the_file_is_part_of_the_run_identity_and_refused_beside_other_starts(tmp_path):
    lora = _lora()
    path = _written(_trained(lora), lora, tmp_path / "run")
    flags = ["--network_weights", str(path), "--lora_layers", ",".join(DEFAULT_TARGETS)]
    identity = run_identity(parse_config(flags), 1, "data", None)
    assert identity["network_weights"] == network_weights.fingerprint(str(path))
    assert run_identity(parse_config(flags[2:]), 1, "data", None)["network_weights"] is None
    for other, message in (
        (["--full_finetune"], "--full_finetune trains every weight and no LoRA"),
        (["--train_text_encoder"], "not the text encoder's of --train_text_encoder"),
        (["--seed_checkpoint", str(tmp_path / "s.safetensors")], "both set the initial LoRA"),
    ):
        with pytest.raises(UsageError, match=message):
            parse_config([*flags, *other])
    with pytest.raises(UsageError, match="--network_weights .*nope.safetensors: no such file"):
        parse_config(["--network_weights", str(tmp_path / "nope.safetensors")])
