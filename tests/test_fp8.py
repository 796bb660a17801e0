"""`--fp8` (flux_cp/fp8.py): which modules run in FP8 for FLUX.1 and FLUX.2 with LoRA, the one-line refusals where it
cannot run, and - where torchao installs (it is not a CPU requirement) - that the conversion keeps peft's LoRA
working, with float8 arithmetic emulated on the CPU."""

from __future__ import annotations

import sys

import pytest
import torch
from peft import LoraConfig

from flux_cp import fp8
from flux_cp.config import parse_config
from flux_cp.errors import UsageError
from flux_cp.lora import DEFAULT_TARGETS
from tests.launch import run_args, train

DOUBLE_FLUX1 = [f"attn.{n}.base_layer" for n in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                                  "add_v_proj", "to_add_out")] + [
    f"{ff}.{n}.base_layer" for ff in ("ff", "ff_context") for n in ("net.0.proj", "net.2")]  # fmt: skip
SINGLE_FLUX1 = ["proj_mlp", "proj_out", "attn.to_q.base_layer", "attn.to_k.base_layer", "attn.to_v.base_layer"]


def _flux1():
    from flux_cp.tiny import tiny_transformer

    model = tiny_transformer(num_attention_heads=2, attention_head_dim=16, axes_dims_rope=(4, 6, 6))
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, target_modules=list(DEFAULT_TARGETS)))
    return model


def _flux2():
    from flux_cp.tiny_flux2 import tiny_flux2_transformer
    from tests.saved_activations import flux2_targets

    model = tiny_flux2_transformer()
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, target_modules=list(flux2_targets(model.config.num_single_layers))))
    return model


def _expected(model, double: list[str], single: list[str]) -> list[str]:
    return sorted([f"transformer_blocks.{i}.{n}" for i in range(len(model.transformer_blocks)) for n in double]
                  + [f"single_transformer_blocks.{i}.{n}" for i in range(len(model.single_transformer_blocks))
                     for n in single])  # fmt: skip


def test_flux1_converts_every_frozen_block_linear_but_the_modulation_and_the_adapters():
    model = _flux1()
    assert sorted(fp8.selected(model)) == _expected(model, DOUBLE_FLUX1, SINGLE_FLUX1)
    # left in bf16: AdaLayerNorm's modulation, the LoRA adapters, embedders and the output layer
    names = dict(model.named_modules())
    assert isinstance(names["transformer_blocks.0.norm1.linear"], torch.nn.Linear)
    assert not any(fp8.converts(n, m) for n, m in names.items() if "norm" in n or "lora_" in n or "embed" in n)
    assert not fp8.converts("proj_out", names["proj_out"]) and not fp8.converts("x_embedder", names["x_embedder"])


def test_flux2_converts_attention_and_swiglu_linears_of_both_block_kinds():
    model = _flux2()
    double = ["attn.to_q.base_layer", "attn.to_k.base_layer", "attn.to_v.base_layer", "attn.to_out.0.base_layer",
              "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.linear_in",
              "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"]  # fmt: skip
    single = ["attn.to_qkv_mlp_proj.base_layer", "attn.to_out.base_layer"]
    assert sorted(fp8.selected(model)) == _expected(model, double, single)


def test_trained_weights_and_sizes_fp8_cannot_multiply_stay_bf16():
    model = _flux1()
    base = model.transformer_blocks[0].ff.net[2].base_layer
    base.weight.requires_grad_(True)
    odd = torch.nn.Linear(24, 40).requires_grad_(False)
    assert not fp8.converts("transformer_blocks.0.ff.net.2.base_layer", base)
    assert not fp8.converts("transformer_blocks.0.ff.net.2", odd)
    assert fp8.converts("transformer_blocks.0.ff.net.2", torch.nn.Linear(32, 48).requires_grad_(False))


def _cfg(*flags: str):
    return parse_config(["--max_train_steps", "1", *flags])


def test_refusals_are_one_line_each(monkeypatch):
    def refused(match: str, *flags: str, dtype=None):
        with pytest.raises(UsageError, match=match) as e:
            fp8.check(_cfg(*flags), dtype)
        assert "\n" not in str(e.value)

    fp8.check(_cfg())  # off: nothing asked
    refused("--fp8 rowwise runs LoRA's frozen base weights in FP8; --full_finetune trains them", "--fp8", "rowwise",
            "--compile", "--full_finetune")  # fmt: skip
    refused("--fp8 rowwise needs --compile", "--fp8", "rowwise")
    refused("--fp8 tensorwise scales each rank's tokens by their own maximum, so --cp_size 2 would not compute",
            "--fp8", "tensorwise", "--compile", "--cp_size", "2")  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refused("--fp8 rowwise needs a CUDA GPU with FP8 tensor cores", "--fp8", "rowwise", "--compile")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    refused("compute capability 8.9 or newer; NVIDIA A100-SXM4-80GB has 8.0: drop --fp8", "--fp8", "tensorwise",
            "--compile_mode", "reduce-overhead")  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 9))
    refused("compute capability 9.0 or newer; .* has 8.9: try --fp8 tensorwise", "--fp8", "rowwise", "--compile")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # not installed
    refused(r"needs torchao: pip install torchao==0\.16\.0", "--fp8", "rowwise", "--compile")
    monkeypatch.delitem(sys.modules, "torchao.float8")
    pytest.importorskip("torchao.float8")
    refused("this run's weights are torch.float16: use bf16", "--fp8", "rowwise", "--compile", dtype=torch.float16)
    fp8.check(_cfg("--fp8", "rowwise", "--compile", "--cp_size", "2"), torch.bfloat16)  # an H100/H200: runs


@pytest.mark.e2e
def test_the_trainer_refuses_fp8_on_this_cpu_before_anything_loads(tmp_path):
    r = train(1, *run_args(tmp_path, "out", 2, "--fp8", "rowwise", "--compile"))
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --fp8 rowwise needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer)"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


# --- with torchao: the conversion itself, float8 emulated on the CPU --------------------------------------------


def test_conversion_keeps_peft_lora_working():
    pytest.importorskip("torchao.float8")
    from peft.tuners.lora import LoraLayer
    from peft.utils import get_peft_model_state_dict
    from torchao.float8.float8_linear import Float8Linear

    import cp
    from tests.distributed import flux_inputs

    model = _flux1()
    before = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    chosen = fp8.selected(model)
    assert fp8.convert(model, "rowwise", emulate=True).startswith(f"--fp8 rowwise: {len(chosen)} frozen linears")
    modules = dict(model.named_modules())
    for name in chosen:
        assert isinstance(modules[name], Float8Linear) and isinstance(modules[name], torch.nn.Linear)
    lora = modules["transformer_blocks.0.attn.to_q"]
    assert isinstance(lora, LoraLayer) and lora.get_base_layer() is modules["transformer_blocks.0.attn.to_q.base_layer"]
    assert type(lora.lora_A["default"]) is torch.nn.Linear and type(lora.lora_B["default"]) is torch.nn.Linear
    assert type(modules["transformer_blocks.0.norm1.linear"]) is torch.nn.Linear
    after = get_peft_model_state_dict(model)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    # forward and backward through the emulated float8 base layers: every adapter gets a gradient
    cp.apply_context_parallel(model, None)
    model.to(torch.bfloat16)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
            torch.nn.init.normal_(p, std=0.02)
    ids = ("img_ids", "txt_ids", "timestep", "guidance")
    inputs = {k: v if k in ids else v.bfloat16() for k, v in flux_inputs(1).items() if k != "target"}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**inputs)[0]
    out.float().square().mean().backward()
    trained = [p for n, p in model.named_parameters() if "lora_" in n]
    assert trained and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)


@pytest.mark.parametrize("scaling", fp8.SCALINGS)
def test_rowwise_scales_each_token_by_itself_so_a_cp_shard_computes_what_one_gpu_does(scaling):
    """Why tensorwise is refused under CP: a rank's half of the tokens gets other scales than the whole sequence."""
    pytest.importorskip("torchao.float8")
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 96)).requires_grad_(False).bfloat16()
    convert_to_float8_training(layer, config=fp8.float8_config(scaling, emulate=True))
    x = torch.randn(1, 40, 64, dtype=torch.bfloat16)
    x[:, 25] *= 30  # one outlier token in the second half
    whole, first_half = layer(x), layer(x[:, :20])
    if scaling == "rowwise":
        assert torch.equal(whole[:, :20], first_half)
    else:
        assert not torch.equal(whole[:, :20], first_half)
