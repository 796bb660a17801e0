"""Compiled, checkpointed blocks (flux_cp/model/blocks.py): the checkpoint is traced into each block's graph, the
backward keeps the CP attention's outputs instead of recomputing them (or recomputes them with
--recompute_attention), and the block computes what the eager block without checkpointing computes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import cp
from cp import Tuning
from cp.schedule import PASSES_VERSION, inductor_options
from flux_cp.model.blocks import checkpoint_inside
from tests import distributed

pytestmark = pytest.mark.distributed  # spawns gloo process groups (tests/distributed.py)

ATTENTION = "torch.ops.cp.ring_attention.default("
EXCHANGE = "all_to_all_single.default("


def _block_inputs(model, group):
    from tests.distributed import flux_inputs

    inputs = flux_inputs(batch=1)
    hidden = cp.shard(model.x_embedder(inputs["hidden_states"]), 1, group).detach()
    text = cp.shard(model.context_embedder(inputs["encoder_hidden_states"]), 1, group).detach()
    temb = model.time_text_embed(inputs["timestep"], inputs["guidance"], inputs["pooled_projections"]).detach()
    ids = torch.cat([cp.shard(inputs["txt_ids"], 0, group), cp.shard(inputs["img_ids"], 0, group)])
    return dict(hidden_states=hidden, encoder_hidden_states=text, temb=temb, image_rotary_emb=model.pos_embed(ids))


def _graphs_and_errors(rank: int, world: int, cases: list[tuple[str, str, bool]]) -> dict:
    """For each (mode, block kind, keep_attention): the largest difference of the compiled, checkpointed block from
    the eager block without checkpointing (outputs and parameter gradients), and how often the attention op and the
    exchanges occur in its forward and backward graphs."""
    from tests.distributed import flux_model

    group = dist.group.WORLD
    found = {}
    for mode, kind, keep in cases:
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
        found[(mode, kind, keep)] = {
            "error": max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(compiled, eager)),
            "n": len(eager),
            **{f"{g}_{op}": code[g].count(s) for g in code for op, s in (("attn", ATTENTION), ("a2a", EXCHANGE))},
        }
    return found


def test_compiled_checkpointed_blocks_keep_the_attention_and_equal_eager():
    cases = [
        ("ulysses", "double", True),
        ("ulysses", "single", True),
        ("ring", "double", True),
        ("ulysses", "double", False),
    ]
    found = distributed.run(_graphs_and_errors, 2, cases, timeout=300)[0]
    for case, f in found.items():
        mode, _, keep = case
        assert f["n"] > 8 and f["error"] < 1e-6, (case, f)
        assert f["fw_attn"] == 1, (case, f)
        # Ulysses: q, k, v and the output cross the group once each way in the forward...
        assert f["fw_a2a"] == (4 if mode == "ulysses" else 0), (case, f)
        if keep:  # ...and the backward only sends their gradients back: no second attention, no second exchange
            assert f["bw_attn"] == 0 and f["bw_a2a"] == f["fw_a2a"], (case, f)
        else:  # --recompute_attention: the backward runs the attention forward again, with its exchanges
            assert f["bw_attn"] == 1 and f["bw_a2a"] == 2 * f["fw_a2a"], (case, f)


def test_inductor_options_add_the_overlap_passes_to_the_compile_mode():
    assert inductor_options(None, Tuning(overlap="none")) == {}
    assert inductor_options("reduce-overhead", Tuning(overlap="none")) == {"triton.cudagraphs": True}
    passes = inductor_options("reduce-overhead", Tuning(overlap="passes"))
    assert passes["triton.cudagraphs"] and passes["reorder_for_compute_comm_overlap"]
    assert passes["reorder_for_compute_comm_overlap_passes"] == ["sink_waits", "raise_comms"]
    compute = inductor_options(None, Tuning(overlap="compute"))
    assert compute["reorder_for_compute_comm_overlap_passes"] == ["reorder_compute_for_overlap"]
    raise_comms, fill = inductor_options(None, Tuning(), 4)["reorder_for_compute_comm_overlap_passes"]
    assert raise_comms == "raise_comms" and fill.func.__name__ == "fill_exchanges"
    assert fill.keywords == {"cp": 4, "version": PASSES_VERSION}
    scheduler = inductor_options(None, Tuning(overlap="scheduler"))
    assert scheduler == {"aten_distributed_optimizations.enable_overlap_scheduling": True}
    with pytest.raises(ValueError, match="unknown overlap 'sometimes'; choose one of fill, passes, compute"):
        Tuning(overlap="sometimes")
    assert inductor_options("reduce-overhead", Tuning(), 1) == {"triton.cudagraphs": True}  # no CP: no exchanges


def test_a_compiled_graph_s_cache_key_holds_the_code_of_our_scheduling_passes(monkeypatch):
    """Inductor's graph cache (on disk, between runs) keys a graph by its config, where our passes are named by
    reference: their code's digest is in their arguments, so another version of them compiles the graph again."""
    import hashlib
    import inspect

    import torch._inductor.config as inductor_config
    from torch._inductor.codecache import FxGraphCachePickler

    from cp import schedule

    assert PASSES_VERSION == hashlib.sha256(inspect.getsource(schedule).encode()).hexdigest()[:16]

    def key() -> bytes:
        with inductor_config.patch(inductor_options(None, Tuning(exchange_first=True), 2)):
            config = inductor_config.save_config_portable()
        return FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())).dumps(config)

    before = key()
    assert key() == before
    monkeypatch.setattr(schedule, "PASSES_VERSION", "edited")
    assert key() != before


def test_exchange_first_adds_the_head_starts_after_the_reordering_passes():
    from cp.comm import head_start
    from cp.schedule import head_starts

    *_, fill, after = inductor_options(None, Tuning(exchange_first=True), 2)["reorder_for_compute_comm_overlap_passes"]
    assert fill.func.__name__ == "fill_exchanges" and after.func is head_starts
    (only,) = inductor_options(None, Tuning(overlap="none", exchange_first=True))[
        "reorder_for_compute_comm_overlap_passes"
    ]
    assert only.func is head_starts
    assert len(inductor_options(None, Tuning())["reorder_for_compute_comm_overlap_passes"]) == 2  # off: no pass
    with pytest.raises(ValueError, match="exchange_first is added beside the reordering passes, which overlap sched"):
        Tuning(overlap="scheduler", exchange_first=True)
    head_start()  # no CUDA here: nothing to hold, and no error


def test_tuning_refuses_unknown_kernels_and_chunk_counts():
    with pytest.raises(ValueError, match="kernels: unknown kernel fast; choose from cpu_flash, cudnn, efficient"):
        Tuning(kernels=("cudnn", "fast"))
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="ulysses_chunks must be a whole number >= 1"):
            Tuning(ulysses_chunks=bad)


def test_ulysses_chunks_are_decided_once_against_the_heads():
    """The chunks a run uses are computed once at start from the model's heads and the Ulysses size: any count asked
    for is checked in at most `heads` tries (a billion asked for once took a billion tries per attention call), more
    than the heads is refused, and a count reduced or unused is said."""
    from cp.ulysses import used_chunks
    from flux_cp.errors import UsageError
    from flux_cp.model.parallel import ulysses_chunks

    assert [used_chunks(24, 2, c) for c in (1, 2, 3, 4, 5, 7, 12, 13, 10**9)] == [1, 2, 3, 4, 4, 6, 12, 12, 12]
    assert used_chunks(4, 2, 10**18) == 2 and used_chunks(3, 2, 5) == 1  # at most heads tries, whatever is asked
    assert ulysses_chunks(1, 4, "ulysses", 2) == (1, None)
    assert ulysses_chunks(2, 4, "ulysses", 2) == (2, None)
    assert ulysses_chunks(3, 4, "ulysses", 2) == (
        2, "--cp_ulysses_chunks 3: 2 used, the most up to 3 whose chunks' heads divide over the Ulysses group of 2 "
        "(4 heads)",
    )  # fmt: skip
    assert ulysses_chunks(2, 4, "ring", None) == (
        1, "--cp_ulysses_chunks 2 has no effect with --cp_mode ring (no Ulysses exchange): 1 used"
    )  # fmt: skip
    with pytest.raises(UsageError, match=r"^--cp_ulysses_chunks 5: the model has 4 attention heads and a chunk holds "
                       r"at least one; use at most 4$"):  # fmt: skip
        ulysses_chunks(5, 4, "ulysses", 2)


def test_cp_kernels_are_checked_against_the_device_at_start():
    from flux_cp.errors import UsageError
    from flux_cp.model.parallel import check_kernels

    assert check_kernels((), "cpu") is None and check_kernels(("cudnn", "flash", "math"), "cuda") is None
    assert check_kernels(("cudnn", "math"), "cpu") == (
        "--cp_kernels cudnn,math: cudnn cannot run on the CPU; math serves every call"
    )
    with pytest.raises(
        UsageError,
        match=r"^--cp_kernels cudnn,flash: none of these attention kernels runs on the CPU "
        r"\(cudnn needs cuda; flash needs cuda\): name one of cpu_flash, math, or drop --cp_kernels",
    ):
        check_kernels(("cudnn", "flash"), "cpu")
    with pytest.raises(UsageError, match=r"runs on CUDA GPUs \(cpu_flash needs cpu\): name one of cudnn, efficient, "):
        check_kernels(("cpu_flash",), "cuda")


def test_the_overlap_scheduler_needs_a_gpu_with_triton_and_is_refused_at_start_without():
    import importlib.util

    from flux_cp.errors import UsageError
    from flux_cp.model.parallel import check_overlap

    check_overlap("scheduler", False, 2, "cpu")  # not compiled: no pass runs
    check_overlap("scheduler", True, 1, "cpu")  # no CP exchange to order
    check_overlap("compute", True, 2, "cpu")
    with pytest.raises(UsageError, match=r"^--cp_overlap scheduler is Inductor's overlap scheduler, which needs a CUDA "
                       r"GPU: choose --cp_overlap fill \(the default\), passes, compute or none$"):  # fmt: skip
        check_overlap("scheduler", True, 2, "cpu")
    if importlib.util.find_spec("triton") is None:
        with pytest.raises(UsageError, match=r"which needs triton \(pip install triton\)"):
            check_overlap("scheduler", True, 2, "cuda")


def test_a_count_of_blocks_above_the_model_s_is_refused_alike_for_checkpointing_and_offload():
    """One rule for counts larger than the model (a typo more often than a wish): refused at start, naming the
    model's blocks, for --gradient_checkpointing and --offload_blocks alike (the trainer and --plan call it)."""
    from flux_cp.errors import UsageError
    from flux_cp.model.blocks import check_counts

    with pytest.raises(
        UsageError,
        match=r"^--gradient_checkpointing 100: the transformer has 57 blocks; give at most "
        r"57, or 'all'$",
    ):
        check_counts("100", "0", 57)
    with pytest.raises(UsageError, match=r"^--offload_blocks 58: the transformer has 57 blocks; give at most 57$"):
        check_counts("none", "58", 57)
    for ok in (("57", "57"), ("all", "auto"), ("auto", "0"), ("none", "3")):
        check_counts(*ok, 57)
