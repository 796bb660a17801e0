"""Whole-model exactness for FLUX.1 Kontext sequences: [text; target; reference] through a tiny
FluxTransformer2DModel with LoRA, CP over 2 and 4 processes (ring, Ulysses), loss on the target tokens
only, against the same model without CP (fp32): loss, target prediction and every parameter gradient."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cp
from flux_cp.data.pairs import image_segment
from flux_cp.families import FLUX1
from flux_cp.families.flux1.tokens import pack_latents, text_ids
from flux_cp.loss import PairSplit, target_loss
from tests import distributed
from tests.distributed import TEXT, flux_model, rel_error, set_checkpointing

pytestmark = pytest.mark.distributed  # spawns gloo process groups (tests/distributed.py)


def _inputs(target_hw: tuple[int, int], reference_hw: tuple[int, int], batch: int = 2) -> dict:
    g = torch.Generator().manual_seed(11)
    target = pack_latents(torch.randn(batch, 4, *target_hw, generator=g))
    reference = pack_latents(torch.randn(batch, 4, *reference_hw, generator=g))
    hidden, ids = image_segment(target, [reference], target_hw, [reference_hw], FLUX1)
    return dict(
        hidden_states=hidden,
        encoder_hidden_states=torch.randn(batch, TEXT, 32, generator=g),
        pooled_projections=torch.randn(batch, 32, generator=g),
        timestep=torch.rand(batch, generator=g),
        guidance=torch.full((batch,), 2.5),
        img_ids=ids,
        txt_ids=text_ids(TEXT),
        target=torch.randn(batch, target.shape[1], 16, generator=g),
        weighting=torch.rand(batch, 1, 1, generator=g) + 0.5,  # per-sample weights, as --weighting_scheme
    )


def _errors(rank: int, world: int, target_hw, reference_hw, mode: str, ulysses_size: int | None, ckpt) -> dict:
    group = dist.group.WORLD
    inputs = _inputs(target_hw, reference_hw)
    target, weighting = inputs.pop("target"), inputs.pop("weighting")
    t = target.shape[1]
    r = inputs["hidden_states"].shape[1] - t

    ref_model = flux_model()
    set_checkpointing(ref_model, ckpt)
    ref_pred = ref_model(**inputs).sample
    ref_loss = target_loss(ref_pred, target, weighting, PairSplit(t, r, 1), 0)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}

    model = flux_model()
    set_checkpointing(model, ckpt)
    cp.apply_context_parallel(model, group, mode=mode, ulysses_size=ulysses_size)
    local = dict(inputs)
    local["hidden_states"] = cp.shard(inputs["hidden_states"], 1, group)
    local["img_ids"] = cp.shard(inputs["img_ids"], 0, group)
    local["encoder_hidden_states"] = cp.shard(inputs["encoder_hidden_states"], 1, group)
    local["txt_ids"] = cp.shard(inputs["txt_ids"], 0, group)
    pred = model(**local).sample
    split = PairSplit(t, r, world)
    loss = target_loss(pred, target, weighting, split, rank)
    loss.backward()
    # The trainer's rule: gradients (and the logged loss) averaged over the CP group, as DDP/FSDP do.
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    grad_errors = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grad_errors[n] = rel_error(g / world, ref_grads[n])
    full_pred = cp.gather(pred.detach(), 1, group)
    return {
        "local_targets": split.local_targets(rank),
        "loss": abs(mean_loss.item() / world - ref_loss.item()) / ref_loss.item(),
        "pred": rel_error(full_pred[:, :t], ref_pred.detach()[:, :t]),
        "grad": max(grad_errors.values()),
        "worst": max(grad_errors, key=grad_errors.get),
        "n_lora": sum("lora" in n for n in grad_errors),
    }


# Latent sizes (tokens = h/2 * w/2). Target 8x12 = 24 tokens. "same": a reference of the target's size (the
# trainer's pairs); at cp 2 rank 1 then holds only reference tokens. "inside": 12 reference tokens, so the
# target/reference boundary falls inside a chunk. "odd": 15 target + 1 reference tokens, neither divisible by 4.
SAME, INSIDE, ODD = ((8, 12), (8, 12)), ((8, 12), (4, 12)), ((6, 10), (2, 2))
# (shapes, mode, ulysses_size, checkpointing) per CP size; one process group per size runs all its cases.
CASES = {
    2: [(SAME, "ring", None, None), (INSIDE, "ulysses", None, "non_reentrant")],
    4: [(ODD, "ring", None, None), (SAME, "ulysses", None, None)],
}


def _all_cases(rank: int, world: int) -> list[dict]:
    return [_errors(rank, world, *shapes, mode, u, ckpt) for shapes, mode, u, ckpt in CASES[world]]


@pytest.mark.parametrize("world", sorted(CASES))
def test_kontext_sequence_with_cp_equals_without(world):
    per_rank = distributed.run(_all_cases, world, timeout=400)
    for c, (shapes, mode, _, _) in enumerate(CASES[world]):
        results = [r[c] for r in per_rank]
        t = (shapes[0][0] // 2) * (shapes[0][1] // 2)
        assert sum(r["local_targets"] for r in results) == t
        for rank, r in enumerate(results):
            where = f"cp {world} {mode} {shapes}, rank {rank}"
            assert r["n_lora"] > 0, r
            assert r["loss"] < 2e-6, f"{where}: loss rel err {r['loss']:.2e}"
            assert r["pred"] < 2e-5, f"{where}: target prediction rel err {r['pred']:.2e}"
            assert r["grad"] < 2e-5, f"{where}: grad rel err {r['grad']:.2e} at {r['worst']}"
