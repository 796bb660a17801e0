"""Exact block offload (`--offload_blocks`, flux_cp/model/offload.py), on CPU: the same code path as on a GPU with the
copies run when issued. A tiny FLUX.1 and FLUX.2 with LoRA, offloaded blocks sharing few slots, trains bit for bit
as without offload (outputs, losses, LoRA gradients and weights; two optimizer steps, gradient accumulation, a
no_grad forward between steps, eager checkpointing either way, compiled blocks); the debug check sees the right
bytes in each slot at every use; the plan's byte counts are what the schedule copies; bad settings are refused."""

from __future__ import annotations

import pytest
import torch

import cp
from flux_cp.config.parser import parse_config
from flux_cp.config.training import LoraConfig
from flux_cp.errors import UsageError
from flux_cp.model.blocks import prepare_blocks
from flux_cp.model.loading import prepare_trainable
from flux_cp.model.offload import BlockOffload, block_kinds, frozen_block_bytes, offload_blocks
from flux_cp.model.offload_plan import (
    check_host_memory,
    check_offload,
    check_offload_count,
    choose_offloaded,
    offload_count,
    plan_offload,
)

DOUBLE, SINGLE = 3, 5  # blocks of the tiny models here: enough for slots to be shared
TARGETS = {"flux1": ["to_q", "to_k", "to_v", "to_out.0"], "flux2": ["to_q", "to_k", "to_v", "to_qkv_mlp_proj"]}


def _model(family: str, seed: int = 0, double: int = DOUBLE, single: int = SINGLE):
    """A tiny transformer of the family with LoRA (fp32 adapters, frozen base), as the trainer prepares it."""
    if family == "flux1":
        from flux_cp.families.flux1.tiny import tiny_transformer

        model = tiny_transformer(seed, num_layers=double, num_single_layers=single)
    else:
        from flux_cp.families.flux2.tiny import tiny_flux2_transformer

        model = tiny_flux2_transformer(seed, num_layers=double, num_single_layers=single)
    targets = [t for t in TARGETS[family] if double or t != "to_out.0"]  # to_out.0: the double blocks' alone
    prepare_trainable(model, LoraConfig(rank=4, lora_alpha=4, lora_layers=tuple(targets)), seed=1)
    with torch.no_grad():  # peft starts B at zero; make every adapter act from the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(hash(name) % 2**31))
    cp.apply_context_parallel(model, None)
    return model


def _batches(family: str, n: int) -> list[dict]:
    from flux_cp.families.flux1.tokens import image_ids, pack_latents, text_ids

    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        if family == "flux1":
            batch = dict(
                hidden_states=pack_latents(torch.randn(1, 4, 8, 12, generator=g)),
                encoder_hidden_states=torch.randn(1, 12, 32, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g),
                timestep=torch.rand(1, generator=g),
                guidance=torch.full((1,), 3.5),
                img_ids=image_ids(8, 12),
                txt_ids=text_ids(12),
            )
        else:
            img = torch.cartesian_prod(torch.zeros(1), torch.arange(4.0), torch.arange(6.0), torch.zeros(1))
            txt = torch.cartesian_prod(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.arange(12.0))
            batch = dict(
                hidden_states=torch.randn(1, 24, 16, generator=g),
                encoder_hidden_states=torch.randn(1, 12, 48, generator=g),
                timestep=torch.rand(1, generator=g),
                guidance=torch.full((1,), 3.5),
                img_ids=img[None],
                txt_ids=txt[None],
            )
        batch["target"] = torch.randn(1, 24, 16, generator=g)
        out.append(batch)
    return out


def _train(model, batches: list[dict], offload: BlockOffload | None = None, steps: int = 2, accumulation: int = 2,
           validate: bool = True) -> tuple[list[torch.Tensor], list[int]]:  # fmt: skip
    """Losses, LoRA gradients after each step's micro-steps, a no_grad forward after each step (`validate`) and the
    final LoRA weights; and the bytes the offload copied in each micro-step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    record, copied = [], []
    for step in range(steps):
        for micro in range(accumulation):
            batch = dict(batches[step * accumulation + micro])
            target = batch.pop("target")
            before = offload.copied_bytes if offload else 0
            loss = (model(**batch).sample - target).square().mean() / accumulation
            loss.backward()
            record.append(loss.detach())
            if offload:
                copied.append(offload.copied_bytes - before)
        record += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad()
        if validate:
            with torch.no_grad():
                batch = {k: v for k, v in batches[0].items() if k != "target"}
                record.append(model(**batch).sample)
    return record + [p.detach().clone() for p in params], copied


def _assert_same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected) > 10
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"item {i} differs: {(a - b).abs().max().item()}"


# --- the flag and the plan ------------------------------------------------------------------------------------------


def test_the_flag_takes_a_number_auto_or_none():
    assert parse_config([]).train.offload_blocks == "0"
    assert parse_config(["--offload_blocks"]).train.offload_blocks == "auto"
    assert parse_config(["--offload_blocks", "--compile"]).train.offload_blocks == "auto"
    for value, parsed in (("12", "12"), ("012", "12"), ("None", "0"), ("AUTO", "auto"), ("0", "0")):
        assert parse_config(["--offload_blocks", value]).train.offload_blocks == parsed
    with pytest.raises(UsageError, match="--offload_blocks: 'half': give auto, none or a number of blocks"):
        parse_config(["--offload_blocks", "half"])
    assert [offload_count(v) for v in ("auto", "0", "7")] == [None, 0, 7]


def _flux1_dev_blocks() -> tuple[list[str], list[int]]:
    """FLUX.1-dev's blocks in bf16, built on the meta device: their kinds and frozen bytes."""
    from diffusers import FluxTransformer2DModel

    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER

    with torch.device("meta"):
        model = FluxTransformer2DModel(**FLUX1_DEV_TRANSFORMER).to(torch.bfloat16)
    model.requires_grad_(False)
    return block_kinds(model), frozen_block_bytes(model)


def test_offloaded_blocks_are_spread_and_the_plan_counts_what_they_save_and_move():
    """FLUX.1-dev: the single blocks first, spread with resident blocks between them; bytes from the model's own
    frozen tensors; `auto`'s count is the fewest that save what is asked."""
    kinds, sizes = _flux1_dev_blocks()
    assert len(kinds) == 57 and kinds.count("double") == 19
    d, double, single = 3072, sizes[0], sizes[19]
    # double: adaLN 2 x 6D^2, attention 8 D^2, MLPs 2 x 8 D^2, their biases and the q/k norms; single: adaLN 3 D^2,
    # q/k/v 3 D^2, MLP in 4 D^2, out 5 D^2
    assert double == 2 * (36 * d**2 + 30 * d + 4 * 128) and single == 2 * (15 * d**2 + 11 * d + 2 * 128)
    for n in (3, 10, 19):
        chosen = choose_offloaded(kinds, n)
        assert len(chosen) == n and all(kinds[i] == "single" for i in chosen)
        assert all(b - a >= 2 for a, b in zip(chosen, chosen[1:]))  # a resident block between any two
        assert chosen[0] - 19 <= 38 // n and 56 - chosen[-1] <= 38 // n  # spread over the whole run of singles
    both = choose_offloaded(kinds, 47)
    assert sum(kinds[i] == "double" for i in both) == 9 and sum(kinds[i] == "single" for i in both) == 38
    assert choose_offloaded(kinds, 57) == tuple(range(57))

    plan = plan_offload(kinds, sizes, 10)
    assert plan.host_bytes == 10 * single and plan.slot_bytes == 2 * single
    assert plan.saved_bytes == 8 * single and plan.moved_bytes == 2 * 8 * single
    every = plan_offload(kinds, sizes, 57)
    assert every.saved_bytes == 17 * double + 36 * single and every.moved_bytes == 2 * every.saved_bytes
    assert "GiB of GPU memory saved" in every.describe() and plan_offload(kinds, sizes, 0).saved_bytes == 0
    saved = [plan_offload(kinds, sizes, n).saved_bytes for n in range(58)]
    assert saved == sorted(saved)  # more blocks never save less


def test_refusals_say_what_to_change():
    check_offload("0", full_finetune=True, sharded=True)  # not asked for: nothing to refuse
    with pytest.raises(UsageError, match="--full_finetune trains every weight: drop --offload_blocks"):
        check_offload("4", full_finetune=True, sharded=False)
    with pytest.raises(UsageError, match="use DDP with --offload_blocks .*, or FSDP2 without it"):
        check_offload("auto", full_finetune=False, sharded=True)
    kinds, sizes = ["double"] * 3 + ["single"] * 5, [2] * 3 + [1] * 5
    with pytest.raises(UsageError, match="--offload_blocks 9: the transformer has 8 blocks; give at most 8"):
        check_offload_count(9, kinds, sizes)
    with pytest.raises(UsageError, match="--offload_blocks 2 saves no GPU memory: .* offload at least 3"):
        check_offload_count(2, kinds, sizes)
    assert check_offload_count(3, kinds, sizes).saved_bytes == 1
    with pytest.raises(UsageError, match="nor does any count on this model of 4 blocks: .*; drop --offload_blocks"):
        check_offload_count(3, ["double"] * 2 + ["single"] * 2, [1] * 4)  # the tiny model: two kinds of two blocks
    plan = plan_offload(kinds, [2**30] * 8, 8)
    check_host_memory(plan, 1, available=10 * 2**30)
    with pytest.raises(UsageError, match=r"needs 16\.0 GiB of pinned host memory \(2 processes x 8\.0 GiB\)"):
        check_host_memory(plan, 2, available=10 * 2**30)
    with pytest.raises(UsageError, match="the transformer has 8 blocks"):
        offload_blocks(_model("flux1"), 9, "cpu")


def test_offloading_no_block_only_places_the_model():
    model = _model("flux1")
    assert offload_blocks(model, 0, "cpu") is None and not model._forward_pre_hooks


# --- exactness --------------------------------------------------------------------------------------------------


def _checkpoint(model, how: str) -> None:
    if how == "blocks":  # the trainer's per-block checkpointing, eager: blocks 2-5 (double and single)
        prepare_blocks(model, checkpointed=range(2, 6), recompute_attention=False, compile=False, compile_mode=None,
                       cp=1)  # fmt: skip
    elif how == "diffusers":  # diffusers' own: the recomputation calls the block itself (its hooks run again)
        model.enable_gradient_checkpointing()


@pytest.mark.parametrize(
    ("family", "checkpointing", "n", "slots"),
    [("flux1", "none", 6, 2), ("flux1", "blocks", 8, 1), ("flux1", "diffusers", 6, 2),
     ("flux2", "none", 8, 1), ("flux2", "blocks", 6, 2), ("flux2", "diffusers", 8, 1)],
)  # fmt: skip
def test_offloaded_training_equals_training_without_offload(family, checkpointing, n, slots):
    """Two optimizer steps of two micro-steps each, a no_grad forward after each step: the same losses, gradients,
    outputs and LoRA weights bit for bit; every slot held its block at every use (debug); each micro-step copied
    what the plan says."""
    batches = _batches(family, 4)
    reference = _model(family)
    _checkpoint(reference, checkpointing)
    expected, _ = _train(reference, batches)
    model = _model(family)
    _checkpoint(model, checkpointing)
    off = offload_blocks(model, n, "cpu", slots=slots, debug=True)
    assert len(off.plan.offloaded) == n and off.copies == 0
    got, copied = _train(model, batches, off)
    _assert_same(got, expected)
    # The no_grad forward after a step leaves the last blocks of each kind in their slots: the next micro-step
    # copies the first ones back on top of the plan's count.
    b, plan = off.plan.block_bytes, off.plan
    extra = sum(b[i] for g in plan.groups for k in [plan.slots_of(g)] for i in g[:k] if i not in g[-k:])
    assert copied == [plan.moved_bytes, plan.moved_bytes, plan.moved_bytes + extra, plan.moved_bytes]
    assert plan.moved_bytes > 0


def test_the_debug_check_sees_a_slot_holding_the_wrong_block():
    """The check the tests above rely on can fail: a slot overwritten behind the schedule's back is caught at the
    next use, and `check` sees weights moved off their slots."""
    model = _model("flux1")
    off = offload_blocks(model, 8, "cpu", slots=1, debug=True)
    batch = {k: v for k, v in _batches("flux1", 1)[0].items() if k != "target"}
    out = model(**batch).sample.sum()
    g = off.groups[0]  # the double blocks': the last one is in it, and the backward starts with it
    g.raw[0][0].add_(1)
    with pytest.raises(RuntimeError, match="block 2's slot does not hold its weights"):
        out.backward()
    off.check()
    block = model.transformer_blocks[0]
    block.attn.to_q.base_layer.weight.data = block.attn.to_q.base_layer.weight.data.clone()
    with pytest.raises(RuntimeError, match="frozen weights of block 0 are no longer its slot's memory"):
        off.check()


def test_other_orders_of_forward_and_backward_stay_exact():
    """A kept graph's second backward (retain_graph), and two forwards before the backward of their sum: the blocks
    are copied in again when due."""
    batches = [{k: v for k, v in b.items() if k != "target"} for b in _batches("flux1", 2)]
    grads = []
    for offloaded in (False, True):
        model = _model("flux1")
        if offloaded:
            offload_blocks(model, DOUBLE + SINGLE, "cpu", slots=1, debug=True)
        out = model(**batches[0]).sample.square().mean()
        out.backward(retain_graph=True)
        out.backward()
        first = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad()
        (model(**batches[0]).sample.square().mean() + model(**batches[1]).sample.abs().mean()).backward()
        grads.append(first + [p.grad for p in model.parameters() if p.requires_grad])
    _assert_same(*grads)


# --- compiled blocks ----------------------------------------------------------------------------------------------


def test_compiled_offloaded_blocks_equal_compiled_blocks():
    """Inductor on CPU, every block checkpointed inside its graph (prepare_blocks): with every block offloaded, the
    graphs compiled without offload run again unchanged (the hooks stay out of them, the slots change no guard) and
    compute the same, bit for bit. A tiny FLUX.1 of single blocks only, sharing one slot: one graph to compile (each
    kind of block is a graph of its own, and Inductor's C++ kernels take minutes on a CPU; the offload hooks are the
    same for both kinds, whose slots the eager tests above share)."""
    from torch._dynamo.utils import counters

    batches = _batches("flux1", 2)
    torch._dynamo.reset()
    results, graphs = [], []
    for offloaded in (False, True):
        model = _model("flux1", double=0, single=3)
        prepare_blocks(model, checkpointed=range(3), recompute_attention=False, compile=True, compile_mode=None,
                       cp=1)  # fmt: skip
        off = offload_blocks(model, 3, "cpu", slots=1, debug=True) if offloaded else None
        results.append(_train(model, batches, off, steps=2, accumulation=1, validate=False)[0])
        graphs.append(counters["stats"]["unique_graphs"])
        assert not offloaded or off.copies > 0
    _assert_same(*results)
    assert graphs[1] == graphs[0] > 0


# --- quantized base weights ---------------------------------------------------------------------------------------


def _quantized_pair(quantize, inner: str) -> list[list[torch.Tensor]]:
    """Output and LoRA gradients of the tiny FLUX.1 whose frozen MLP weights `quantize` replaced, with and without
    every block offloaded (one slot per kind); the offloaded tensors include ones named `inner`."""
    batch = {k: v for k, v in _batches("flux1", 1)[0].items() if k != "target"}
    runs = []
    for offloaded in (False, True):
        model = _model("flux1")
        quantize(model)
        if offloaded:
            off = offload_blocks(model, 8, "cpu", slots=1, debug=True)
            assert off.copies == 0 and len(off.groups) == 2
            assert all(any(inner in p for p in blk.paths) for blk in off.offloaded[:DOUBLE])
        out = model(**batch).sample
        out.square().mean().backward()
        runs.append([out.detach()] + [p.grad for p in model.parameters() if p.requires_grad])
    return runs


def test_torchao_quantized_weights_are_offloaded_as_their_inner_tensors():
    ao = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    from torchao.utils import TorchAOBaseTensor

    def quantize(model):
        mlp = ("ff.net.2", "proj_mlp")
        ao.quantize_(model, ao.Int8WeightOnlyConfig(), filter_fn=lambda _module, name: name.endswith(mlp))
        assert any(isinstance(p, TorchAOBaseTensor) for p in model.parameters())

    _assert_same(*_quantized_pair(quantize, ":qdata"))


def test_bitsandbytes_4bit_weights_are_offloaded_with_their_quant_state():
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")

    def quantize(model):
        for block in model.transformer_blocks:
            old = block.ff.net[2]
            new = bnb.nn.Linear4bit(old.in_features, old.out_features, compute_dtype=torch.float32, quant_type="nf4")
            new.load_state_dict(old.state_dict())
            block.ff.net[2] = new.to("cpu")  # quantizes
            new.requires_grad_(False)

    _assert_same(*_quantized_pair(quantize, ":quant_state.absmax"))


def test_lora_adapters_are_not_counted_or_moved():
    """What requires grad (the adapters) is neither in a block's frozen bytes nor offloaded."""
    model = _model("flux1")
    lora = sum(p.nbytes for p in model.transformer_blocks[0].parameters() if p.requires_grad)
    total = sum(p.nbytes for p in model.transformer_blocks[0].parameters())
    assert 0 < lora < total and frozen_block_bytes(model)[0] == total - lora
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    offload_blocks(model, 8, "cpu", slots=1)
    assert all(p is adapters[n] and not p.grad for n, p in model.named_parameters() if p.requires_grad)
