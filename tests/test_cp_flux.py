"""Whole-model exactness: a tiny FluxTransformer2DModel (double + single blocks, guidance embedding, LoRA on
its attention) with CP over 2, 3 and 4 processes against the same model without CP (fp32)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cp
from flux_cp.flow import image_ids, pack_latents, text_ids
from flux_cp.tiny import tiny_transformer
from tests import distributed

# 12 heads: Ulysses works at 2, 3, 4 and 6 ranks. 24 image + 12 text tokens: divisible by 2, 3, 4.
HEADS, HEAD_DIM, TEXT, LAT_H, LAT_W = 12, 8, 12, 8, 12


def _model(lora: bool = True):
    model = tiny_transformer(seed=0, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, axes_dims_rope=(2, 2, 4))
    if lora:
        from peft import LoraConfig

        targets = ["to_q", "to_k", "to_v", "to_out.0"]
        config = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=targets)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            model.add_adapter(config)
            for name, p in model.named_parameters():
                if "lora_B" in name:  # peft zero-initialises B; make the adapters do something
                    p.normal_(std=0.05)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def _inputs(batch: int = 2) -> dict:
    g = torch.Generator().manual_seed(7)
    latents = torch.randn(batch, 4, LAT_H, LAT_W, generator=g)
    return dict(
        hidden_states=pack_latents(latents),
        encoder_hidden_states=torch.randn(batch, TEXT, 32, generator=g),
        pooled_projections=torch.randn(batch, 32, generator=g),
        timestep=torch.rand(batch, generator=g),
        guidance=torch.full((batch,), 3.5),
        img_ids=image_ids(LAT_H, LAT_W),
        txt_ids=text_ids(TEXT),
        target=torch.randn(batch, (LAT_H // 2) * (LAT_W // 2), 16, generator=g),
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


def _checkpointing(model, kind: str | None) -> None:
    if kind == "reentrant":
        # Reentrant checkpointing only produces parameter gradients when a block input requires grad.
        model.enable_gradient_checkpointing(functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True))
    elif kind == "non_reentrant":
        model.enable_gradient_checkpointing()  # diffusers' default (use_reentrant=False)


def _model_errors(rank: int, world: int, mode: str, ulysses_size: int | None, ckpt: str | None) -> dict:
    group = dist.group.WORLD
    inputs = _inputs()
    target = inputs.pop("target")

    ref_model = _model()
    _checkpointing(ref_model, ckpt)
    ref_out = ref_model(**inputs).sample
    F.mse_loss(ref_out, target).backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}

    model = _model()
    _checkpointing(model, ckpt)
    cp.apply_context_parallel(model, group, mode=mode, ulysses_size=ulysses_size)
    local = dict(inputs)
    for key, dim in (("hidden_states", 1), ("encoder_hidden_states", 1), ("img_ids", 0), ("txt_ids", 0)):
        local[key] = cp.shard(inputs[key], dim, group)
    out = model(**local).sample
    # The training rule: loss = mean over the rank's local tokens; gradients averaged over all CP ranks.
    F.mse_loss(out, cp.shard(target, 1, group)).backward()
    grad_errors = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grad_errors[n] = _rel(g / world, ref_grads[n])
    lora = [n for n in grad_errors if "lora" in n]
    return {
        "out": _rel(cp.gather(out.detach(), 1, group), ref_out.detach()),
        "grad": max(grad_errors.values()),
        "worst": max(grad_errors, key=grad_errors.get),
        "n_params": len(grad_errors),
        "n_lora": len(lora),
        "restored": _restores(model),
    }


def _restores(model) -> bool:
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    cp.remove_context_parallel(model)
    return all(type(m.processor) is FluxAttnProcessor for m in model.modules() if hasattr(m, "processor"))


CASES = [  # (CP size, mode, ulysses_size, checkpointing)
    (2, "ring", None, None),
    (2, "ulysses", None, "non_reentrant"),
    (3, "ring", None, "non_reentrant"),
    (3, "ring", None, "reentrant"),
    (3, "ulysses", None, None),
    (4, "ring", None, None),
    (4, "ulysses", None, None),
    (4, "hybrid", 2, "non_reentrant"),
    (4, "hybrid", 2, "reentrant"),
]


def _world_errors(rank: int, world: int, variants: list[tuple]) -> list[dict]:
    """Every variant of one CP size in the same process group: starting the processes costs more than a case."""
    return [_model_errors(rank, world, *v) for v in variants]


@pytest.mark.parametrize("world", sorted({c[0] for c in CASES}))
def test_flux_transformer_with_cp_equals_without(world):
    variants = [c[1:] for c in CASES if c[0] == world]
    for rank, results in enumerate(distributed.run(_world_errors, world, variants, timeout=300)):
        for (mode, ulysses_size, ckpt), r in zip(variants, results, strict=True):
            case = f"rank {rank}, {mode} (ulysses_size {ulysses_size}, checkpointing {ckpt})"
            assert r["n_lora"] > 0 and r["n_params"] > r["n_lora"], (case, r)
            assert r["out"] < 2e-5, f"{case}: output rel err {r['out']:.2e}"
            assert r["grad"] < 2e-5, f"{case}: grad rel err {r['grad']:.2e} at {r['worst']}"
            assert r["restored"], f"{case}: remove_context_parallel did not restore FluxAttnProcessor"


def test_apply_rejects_a_model_without_flux_attention():
    with pytest.raises(ValueError, match="no FluxAttention modules"):
        cp.apply_context_parallel(torch.nn.Linear(2, 2), None)
