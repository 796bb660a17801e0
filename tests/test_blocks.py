"""Compiled, checkpointed blocks (flux_cp/blocks.py): the checkpoint is traced into each block's graph, the
backward keeps the CP attention's outputs instead of recomputing them (or recomputes them with
--recompute_attention), and the block computes what the eager block without checkpointing computes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import cp
from flux_cp.blocks import checkpoint_inside, inductor_options
from flux_cp.errors import UsageError
from tests import distributed

pytestmark = pytest.mark.distributed  # spawns gloo process groups (tests/distributed.py)

ATTENTION = "torch.ops.flux_cp.ring_attention.default("
EXCHANGE = "all_to_all_single.default("


def _block_inputs(model, group):
    from tests.distributed import flux_inputs

    inputs = flux_inputs(batch=1)
    hidden = cp.shard(model.x_embedder(inputs["hidden_states"]), 1, group).detach()
    text = cp.shard(model.context_embedder(inputs["encoder_hidden_states"]), 1, group).detach()
    temb = model.time_text_embed(inputs["timestep"], inputs["guidance"], inputs["pooled_projections"]).detach()
    ids = torch.cat([cp.shard(inputs["txt_ids"], 0, group), cp.shard(inputs["img_ids"], 0, group)])
    return dict(hidden_states=hidden, encoder_hidden_states=text, temb=temb, image_rotary_emb=model.pos_embed(ids))


def _graphs_and_errors(rank: int, world: int, cases: list[tuple[str, str, bool, str]]) -> dict:
    """For each (mode, block kind, keep_attention, FLUX_CP_GRAD_EXCHANGE): the largest difference of the compiled,
    checkpointed block from the eager block without checkpointing (outputs and parameter gradients), and how often
    the attention op and the exchanges occur in its forward and backward graphs."""
    import os

    from tests.distributed import flux_model

    group = dist.group.WORLD
    found = {}
    for mode, kind, keep, grad_exchange in cases:
        os.environ["FLUX_CP_GRAD_EXCHANGE"] = grad_exchange
        model = flux_model()
        cp.apply_context_parallel(model, group, mode=mode)
        inputs = _block_inputs(model, group)
        block = model.transformer_blocks[0] if kind == "double" else model.single_transformer_blocks[0]

        def step(fn, model=model, inputs=inputs):
            model.zero_grad()
            enc, hid = fn(**inputs)
            (hid.square().mean() + enc.square().mean()).backward()
            return [hid.detach(), enc.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

        eager = step(block)
        code = {"fw": "", "bw": ""}

        def keep_code(which, code=code):
            def compiler(gm, _inputs):
                code[which] += gm.code
                return make_boxed_func(gm.forward)

            return compiler

        torch._dynamo.reset()
        checkpoint_inside(block, keep_attention=keep)
        block.compile(backend=aot_autograd(fw_compiler=keep_code("fw"), bw_compiler=keep_code("bw")), fullgraph=True)
        compiled = step(block)
        found[(mode, kind, keep, grad_exchange)] = {
            "error": max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(compiled, eager)),
            "n": len(eager),
            **{f"{g}_{op}": code[g].count(s) for g in code for op, s in (("attn", ATTENTION), ("a2a", EXCHANGE))},
        }
    return found


def test_compiled_checkpointed_blocks_keep_the_attention_and_equal_eager():
    cases = [
        ("ulysses", "double", True, "separate"),
        ("ulysses", "single", True, "joint"),
        ("ring", "double", True, "separate"),
        ("ulysses", "double", False, "separate"),
    ]
    found = distributed.run(_graphs_and_errors, 2, cases, timeout=300)[0]
    for case, f in found.items():
        mode, _, keep, grad_exchange = case
        assert f["n"] > 8 and f["error"] < 1e-6, (case, f)
        assert f["fw_attn"] == 1, (case, f)
        # Ulysses: q, k, v and the output cross the group once each way in the forward...
        assert f["fw_a2a"] == (4 if mode == "ulysses" else 0), (case, f)
        if keep:  # ...and the backward only sends their gradients back: no second attention, no second exchange
            # (the gradients of q, k and v as one exchange: FLUX_CP_GRAD_EXCHANGE=joint)
            assert f["bw_attn"] == 0 and f["bw_a2a"] == (2 if grad_exchange == "joint" else f["fw_a2a"]), (case, f)
        else:  # --recompute_attention: the backward runs the attention forward again, with its exchanges
            assert f["bw_attn"] == 1 and f["bw_a2a"] == 2 * f["fw_a2a"], (case, f)


def test_inductor_options_add_the_overlap_passes_to_the_compile_mode():
    assert inductor_options(None, "none") == {}
    assert inductor_options("reduce-overhead", "none") == {"triton.cudagraphs": True}
    passes = inductor_options("reduce-overhead", "passes")
    assert passes["triton.cudagraphs"] and passes["reorder_for_compute_comm_overlap"]
    assert passes["reorder_for_compute_comm_overlap_passes"] == ["sink_waits", "raise_comms"]
    compute = inductor_options(None, "compute")
    assert compute["reorder_for_compute_comm_overlap_passes"] == ["reorder_compute_for_overlap"]
    raise_comms, fill = inductor_options(None, "fill", cp=4)["reorder_for_compute_comm_overlap_passes"]
    assert raise_comms == "raise_comms" and fill.func.__name__ == "fill_exchanges" and fill.keywords == {"cp": 4}
    assert inductor_options(None, "scheduler") == {"aten_distributed_optimizations.enable_overlap_scheduling": True}
    with pytest.raises(UsageError, match="'sometimes': choose passes, fill, compute, scheduler or none"):
        inductor_options(None, "sometimes")


def test_sm_carveout_is_read_from_the_environment_and_checked():
    from flux_cp.blocks import sm_carveout

    assert sm_carveout(None) == 0 and sm_carveout("") == 0 and sm_carveout("0") == 0 and sm_carveout("8") == 8
    for bad in ("-1", "eight"):
        with pytest.raises(UsageError, match="FLUX_CP_SM_CARVEOUT=.*give a number of streaming multiprocessors"):
            sm_carveout(bad)
    fill, around = inductor_options(None, "fill", cp=2, sms=8)["reorder_for_compute_comm_overlap_passes"][1:]
    assert fill.func.__name__ == "fill_exchanges" and around.func.__name__ == "around_exchanges"
    assert around.keywords == {"sms": 8, "first": False}
    (only,) = inductor_options(None, "none", first=True)["reorder_for_compute_comm_overlap_passes"]
    assert only.keywords == {"sms": 0, "first": True}
    assert len(inductor_options(None, "fill")["reorder_for_compute_comm_overlap_passes"]) == 2  # neither: no pass
    with pytest.raises(UsageError, match="FLUX_CP_SM_CARVEOUT and FLUX_CP_EXCHANGE_FIRST work with the reordering"):
        inductor_options(None, "scheduler", sms=8)


def test_exchange_first_is_read_from_the_environment_and_checked(monkeypatch):
    from cp.comm import exchange_first, head_start

    monkeypatch.delenv("FLUX_CP_EXCHANGE_FIRST", raising=False)
    assert exchange_first() is False
    monkeypatch.setenv("FLUX_CP_EXCHANGE_FIRST", "1")
    assert exchange_first() is True
    head_start()  # no CUDA here: nothing to hold, and no error
    monkeypatch.setenv("FLUX_CP_EXCHANGE_FIRST", "yes")
    with pytest.raises(ValueError, match="FLUX_CP_EXCHANGE_FIRST='yes': use 1 .on. or 0 .off."):
        exchange_first()


def test_carveout_holds_while_any_exchange_is_in_flight():
    """The calls compiled code makes around its exchanges (flux_cp/overlap.py): the carveout is set from the first
    exchange launched until the last one is waited for, and a stray wait does not unbalance the count."""
    from flux_cp.overlap import exchange_started, exchange_waited

    try:
        exchange_waited()
        assert torch._C._get_sm_carveout_experimental() is None
        exchange_started(8)
        exchange_started(8)
        assert torch._C._get_sm_carveout_experimental() == 8
        exchange_waited()
        assert torch._C._get_sm_carveout_experimental() == 8
        exchange_waited()
        assert torch._C._get_sm_carveout_experimental() is None
        exchange_started(4)
        assert torch._C._get_sm_carveout_experimental() == 4
    finally:
        exchange_waited()
    assert torch._C._get_sm_carveout_experimental() is None
