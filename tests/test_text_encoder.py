"""--train_text_encoder's pieces that need no trainer: the FSDP refusal, the optimizer's parameter groups as
diffusers' example builds them, one gradient norm over the transformer's and the text encoder's LoRA, and the LoRA
file's text_encoder.* keys with their scale. (End to end, CP against one process and the load into FluxPipeline:
tests/test_train.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flux_cp.config.training import TrainConfig
from flux_cp.errors import UsageError
from flux_cp.families.lora_format import metadata, scaled
from flux_cp.model.optim import clip_grad_norm, make_optimizer
from flux_cp.model.text_encoder import check_sharding


def test_fsdp_is_refused_with_a_line_naming_what_works():
    check_sharding(True, sharded=False)
    check_sharding(False, sharded=True)
    with pytest.raises(UsageError, match="launch with a DDP config"):
        check_sharding(True, sharded=True)


def test_the_text_encoder_trains_in_its_own_group_at_its_learning_rate_and_decay():
    train = dataclasses.replace(TrainConfig(), learning_rate=1e-4, text_encoder_lr=5e-6,
                                adam_weight_decay_text_encoder=1e-3, scale_lr=True)  # fmt: skip
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    groups = make_optimizer(train, [a], 4, [b]).param_groups
    assert [g["params"] for g in groups] == [[a], [b]]
    # --scale_lr scales --learning_rate only, as diffusers' example
    assert (groups[0]["lr"], groups[0]["weight_decay"]) == (4e-4, train.adam_weight_decay)
    assert (groups[1]["lr"], groups[1]["weight_decay"]) == (5e-6, 1e-3)
    assert len(make_optimizer(train, [a], 4).param_groups) == 1


class _Accelerator:
    def unscale_gradients(self) -> None:
        pass


def test_one_gradient_norm_clips_both_as_clip_grad_norm_over_all_of_them():
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(5)) for _ in range(4)]
    grads = [torch.randn(5, generator=g) for _ in params]
    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    norm = clip_grad_norm(_Accelerator(), params[:3], 0.5, params[3:])
    reference = [torch.nn.Parameter(torch.zeros(5)) for _ in params]
    for p, grad in zip(reference, grads):
        p.grad = grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    assert torch.allclose(norm, expected, rtol=1e-6)
    assert all(torch.allclose(p.grad, r.grad, rtol=1e-6) for p, r in zip(params, reference))


def test_the_text_encoders_keys_get_alphas_and_adapter_metadata_as_the_transformers():
    lora = {"text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 8),
            "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(8, 4)}  # fmt: skip
    with_alpha = scaled(lora, 4, 8, True, prefix="text_encoder")
    assert with_alpha["text_encoder.text_model.encoder.layers.0.self_attn.q_proj.alpha"].item() == 8.0
    header = metadata(rank=4, alpha=4, adapter={"r": 4}, origin=None, text_encoder_adapter={"r": 4})
    assert '"text_encoder.r": 4' in header["lora_adapter_metadata"]
    assert '"transformer.r": 4' in header["lora_adapter_metadata"]
