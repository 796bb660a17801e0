"""The FLOP counts behind MFU and HFU: the formula's forward FLOPs equal what torch's FLOP counter counts on a real
FLUX.1 transformer (per-token layers and attention; the per-sample modulation and embedders, which the formula
leaves out, are left out of the count too), and model / executed FLOPs follow the recipe (no recomputation /
recomputation included); the peak is the datasheet's for known GPUs."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from flux_cp.families import FLUX1, flops
from flux_cp.families.flux1.tiny import tiny_transformer
from flux_cp.families.flux1.tokens import image_ids, pack_latents, text_ids
from flux_cp.outputs import metrics

PER_SAMPLE = ("norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear", "time_text_embed")


def _counted_forward(model, h: int, w: int, text: int) -> float:
    """FLOPs torch counts in one forward, less the modules that act once per sample."""
    config = model.config
    hidden = pack_latents(torch.randn(1, config.in_channels // 4, h, w))
    inputs = dict(
        hidden_states=hidden, encoder_hidden_states=torch.randn(1, text, config.joint_attention_dim),
        pooled_projections=torch.randn(1, config.pooled_projection_dim), timestep=torch.tensor([0.5]),
        img_ids=image_ids(h, w), txt_ids=text_ids(text), guidance=torch.tensor([3.5]), return_dict=False,
    )  # fmt: skip
    counter = FlopCounterMode(display=False)
    # The math kernel: attention as the two matmuls torch's counter sees (its fused CPU kernel is not counted).
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(**inputs)
    per_module = counter.get_flop_counts()
    total = sum(per_module["Global"].values())
    leaves = [n for n in per_module if n != "Global" and not any(o.startswith(n + ".") for o in per_module)]
    excluded = sum(sum(per_module[n].values()) for n in leaves if any(f".{p}" in n for p in PER_SAMPLE))
    return total - excluded


@pytest.mark.parametrize("h, w, text", [(8, 8, 8), (16, 12, 20)])
def test_the_forward_formula_counts_what_torch_counts(h, w, text):
    model = tiny_transformer().eval()
    linear, attention = FLUX1.forward_flops(dict(model.config), (h // 2) * (w // 2), text, batch=1)
    counted = _counted_forward(model, h, w, text)
    assert counted > 0
    assert linear + attention == pytest.approx(counted, rel=1e-9)


FLUX2_PER_SAMPLE = ("modulation", "norm_out.linear", "time_guidance_embed")


@pytest.mark.parametrize("h, w, text, pairs", [(4, 4, 8, False), (6, 4, 20, True)])
def test_the_flux2_forward_formula_counts_what_torch_counts(h, w, text, pairs):
    """FLUX.2's (4 + 3r) D^2 per token and layer (the SwiGLU MLP, the single blocks' fused projections), its
    embedders and attention, against torch's count on the tiny Flux2Transformer2DModel (a reference image's tokens
    count as image tokens)."""
    from flux_cp.families import FLUX2
    from flux_cp.families.flux2 import recipe as flux2_recipe
    from flux_cp.families.flux2.tiny import tiny_flux2_transformer
    from tests import flux2_recipe_steps

    model = tiny_flux2_transformer(mlp_ratio=2.5).eval()
    config = model.config
    latents = torch.randn(1, config.in_channels, h, w)
    hidden, ids = flux2_recipe_steps.image_sequence(
        latents, [torch.randn(1, config.in_channels, 2, 4)] if pairs else []
    )
    inputs = dict(
        hidden_states=hidden, encoder_hidden_states=torch.randn(1, text, config.joint_attention_dim),
        timestep=torch.tensor([0.5]), img_ids=ids, txt_ids=flux2_recipe.text_ids(text), guidance=torch.tensor([3.5]),
        return_dict=False,
    )  # fmt: skip
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(**inputs)
    per_module = counter.get_flop_counts()
    leaves = [n for n in per_module if n != "Global" and not any(o.startswith(n + ".") for o in per_module)]
    excluded = sum(sum(per_module[n].values()) for n in leaves if any(p in n for p in FLUX2_PER_SAMPLE))
    counted = sum(per_module["Global"].values()) - excluded
    linear, attention = FLUX2.forward_flops(dict(config), hidden.shape[1], text, batch=1)
    assert counted > 0 and excluded > 0
    assert linear + attention == pytest.approx(counted, rel=1e-9)


def test_model_flops_leave_out_recomputation_and_executed_flops_count_it():
    lin, att = 1e12, 3e11
    plain = flops.step_flops(lin, att, lora=True, ckpt=False, attn_recomputed=False)
    assert plain.model == plain.executed - 0.5 * att  # flash kernels recompute the scores in the backward
    assert plain.model == 2 * lin + 3 * att  # LoRA: forward and input gradients; attention forward + 2x backward
    ckpt = flops.step_flops(lin, att, lora=True, ckpt=True, attn_recomputed=True)
    assert ckpt.model == plain.model  # the same training, whatever is recomputed
    assert ckpt.executed == plain.executed + lin + att
    full = flops.step_flops(lin, att, lora=False, ckpt=False, attn_recomputed=False)
    assert full.model == 3 * lin + 3 * att  # weight gradients too


def test_the_peak_is_the_datasheet_one_for_known_gpus():
    assert metrics.datasheet_peak("NVIDIA H200") == 989e12
    assert metrics.datasheet_peak("NVIDIA H200 NVL") == 835e12
    assert metrics.datasheet_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert metrics.datasheet_peak("NVIDIA H100 PCIe") == 756e12
    assert metrics.datasheet_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert metrics.datasheet_peak("NVIDIA B200") == 2250e12
    assert metrics.datasheet_peak("NVIDIA GeForce RTX 4090") is None  # measured instead, and named so
    assert metrics.peak_flops(torch.device("cpu")) is None
