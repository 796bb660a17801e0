"""Whole-model exactness: a tiny FluxTransformer2DModel (double + single blocks, guidance embedding, LoRA on
its attention) with CP over 2, 3 and 4 processes against the same model without CP (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cp
from tests import distributed
from tests.distributed import flux_inputs, flux_model, rel_error, set_checkpointing

pytestmark = pytest.mark.distributed  # spawns gloo process groups (tests/distributed.py)


def _model_errors(rank: int, world: int, mode: str, ulysses_size: int | None, ckpt: str | None) -> dict:
    group = dist.group.WORLD
    inputs = flux_inputs()
    target = inputs.pop("target")

    ref_model = flux_model()
    set_checkpointing(ref_model, ckpt)
    ref_out = ref_model(**inputs).sample
    F.mse_loss(ref_out, target).backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}

    model = flux_model()
    set_checkpointing(model, ckpt)
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
        grad_errors[n] = rel_error(g / world, ref_grads[n])
    lora = [n for n in grad_errors if "lora" in n]
    return {
        "out": rel_error(cp.gather(out.detach(), 1, group), ref_out.detach()),
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
    with pytest.raises(ValueError, match="has no attention module of a supported model .*FluxAttention"):
        cp.apply_context_parallel(torch.nn.Linear(2, 2), None)
