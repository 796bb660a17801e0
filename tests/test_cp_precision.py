"""CP with a quantized base (--base_precision fp8, int8, nf4): every rank quantizes the same loaded weights and holds
the same quantized ones; the output and the LoRA gradients under CP 2 and 3 (ring, Ulysses) then equal one process's
with that base, for FLUX.1 and FLUX.2 (its fused single-block projection included). The gradients are averaged over
the ranks by DDP, as in training, which the quantized weights are kept out of (`quantize_base`)."""

from __future__ import annotations

import hashlib
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cp
from flux_cp.extras import PACKAGES
from flux_cp.model.precision import QUANTIZED, quantize_base, stored
from tests import distributed
from tests.distributed import HEAD_DIM, HEADS, flux_inputs, rel_error

pytestmark = pytest.mark.distributed  # spawns gloo process groups (tests/distributed.py)

AVAILABLE = [p for p in QUANTIZED if importlib.util.find_spec(PACKAGES[p][0]) is not None]
MISSING = sorted({PACKAGES[p][0] for p in QUANTIZED if p not in AVAILABLE})
TARGETS = {"flux1": ["to_q", "to_k", "to_v", "to_out.0"],
           "flux2": ["to_q", "to_k", "to_v", "to_out.0", "to_qkv_mlp_proj",
                     *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(2))]}  # fmt: skip
# FLUX.2: 12 text + 24 image tokens (a 4 x 6 latent grid), 16 input channels, text of 3 x 16 (tiny_flux2).
F2_TEXT, F2_H, F2_W = 12, 4, 6


def _model(family: str, precision: str) -> torch.nn.Module:
    """The tiny transformer of `family` with 12 heads (Ulysses at 2 and 3 ranks), quantized, then LoRA on its
    attention with lora_B drawn non-zero; fp32 (the trainer's LoRA weights are fp32)."""
    from peft import LoraConfig

    if family == "flux1":
        from flux_cp.families.flux1.tiny import tiny_transformer

        model = tiny_transformer(
            seed=0, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, axes_dims_rope=(2, 2, 4)
        )
    else:
        from flux_cp.families.flux2.tiny import tiny_flux2_transformer

        model = tiny_flux2_transformer(seed=0, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                                       axes_dims_rope=(2, 2, 2, 2))  # fmt: skip
    quantize_base(model, precision)
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=TARGETS[family]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.float()
                    if "lora_B" in name:
                        p.normal_(std=0.05)
    return model


def _inputs(family: str) -> tuple[dict, torch.Tensor, tuple]:
    """(inputs, target, the inputs CP splits and their sequence dimension)."""
    if family == "flux1":
        inputs = flux_inputs()
        target = inputs.pop("target")
        return inputs, target, (("hidden_states", 1), ("encoder_hidden_states", 1), ("img_ids", 0), ("txt_ids", 0))
    g = torch.Generator().manual_seed(7)
    img = torch.cartesian_prod(torch.tensor([0]), torch.arange(F2_H), torch.arange(F2_W), torch.arange(1))
    txt = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(F2_TEXT))
    inputs = dict(hidden_states=torch.randn(2, F2_H * F2_W, 16, generator=g),
                  encoder_hidden_states=torch.randn(2, F2_TEXT, 48, generator=g), timestep=torch.rand(2, generator=g),
                  guidance=torch.full((2,), 3.5), img_ids=img.expand(2, -1, -1),
                  txt_ids=txt.expand(2, -1, -1))  # fmt: skip
    target = torch.randn(2, F2_H * F2_W, 16, generator=g)
    return inputs, target, (("hidden_states", 1), ("encoder_hidden_states", 1), ("img_ids", 1), ("txt_ids", 1))


def _fingerprint(model: torch.nn.Module) -> str:
    """A hash of every stored byte of the quantized weights."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            for t in stored(p):
                h.update(name.encode())
                h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _errors(rank: int, world: int, family: str, precision: str, mode: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    group = dist.group.WORLD
    inputs, target, split = _inputs(family)
    ref = _model(family, precision)
    ref_out = ref(**inputs).sample
    F.mse_loss(ref_out, target).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}

    model = _model(family, precision)
    cp.apply_context_parallel(model, group, mode=mode)
    ddp = DistributedDataParallel(model)  # its start-up broadcast skips the quantized weights
    local = dict(inputs)
    for key, dim in split:
        local[key] = cp.shard(inputs[key], dim, group)
    out = ddp(**local).sample
    # The training rule: loss = mean over the rank's local tokens; DDP averages the gradients over the ranks.
    F.mse_loss(out, cp.shard(target, 1, group)).backward()
    errors = {n: rel_error(p.grad, ref_grads[n]) for n, p in model.named_parameters() if p.requires_grad}
    return {
        "out": rel_error(cp.gather(out.detach(), 1, group), ref_out.detach()),
        "grad": max(errors.values()),
        "worst": max(errors, key=errors.get),
        "lora": len(errors),
        "lora_kinds": {type(m).__name__ for m in model.modules() if hasattr(m, "lora_A")},
        "weights": _fingerprint(model),
        "same_as_reference": _fingerprint(model) == _fingerprint(ref),
    }


MODES = ("ring", "ulysses")


def _world_errors(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Every case in one process group: starting the processes costs more than a case."""
    return [_errors(rank, world, *case) for case in cases]


@pytest.mark.skipif(not AVAILABLE, reason="torchao and bitsandbytes are not installed (pip install -e .[quant])")
@pytest.mark.parametrize("world", [2, 3])
def test_cp_with_a_quantized_base_equals_one_process_with_it(world):
    if MISSING:  # the others still run; say which were left out
        print(f"not installed, so not tested: {', '.join(MISSING)} (pip install -e .[quant])")
    cases = [(f, p, m) for f in ("flux1", "flux2") for p in AVAILABLE for m in MODES]
    results = distributed.run(_world_errors, world, cases, timeout=400)
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        assert len({r["weights"] for r in per_rank}) == 1, f"{case}: the ranks hold different quantized weights"
        for rank, r in enumerate(per_rank):
            where = f"{case}, rank {rank} of {world}"
            assert r["same_as_reference"] and r["lora"] > 0, (where, r)
            assert r["lora_kinds"] == {"Linear4bit" if case[1] == "nf4" else "TorchaoLoraLinear"}, (where, r)
            assert r["out"] < 2e-5, f"{where}: output rel err {r['out']:.2e}"
            assert r["grad"] < 2e-5, f"{where}: LoRA grad rel err {r['grad']:.2e} at {r['worst']}"
