"""The memory planner's terms for --base_precision and --offload_blocks, `auto`'s joint choice of checkpointed and
offloaded blocks by the modelled step time, the precision named when nothing fits, and --plan's lines for them
(FLUX.1-dev's built-in config, on the meta device: nothing is loaded)."""

from __future__ import annotations

import re

import pytest
import torch

from flux_cp.errors import UsageError
from flux_cp.families import FLUX1
from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER
from flux_cp.model.offload_plan import plan_offload
from flux_cp.plan import memory as plan
from flux_cp.plan import report, speed

DEV = "black-forest-labs/FLUX.1-dev"
GIB = plan.GIB


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)


def _run(*flags: str, world: int = 1):
    """(resolved flags, run shape) of a FLUX.1-dev LoRA run planned for `world` processes."""
    from flux_cp.config.parser import parse_config
    from flux_cp.shape.build import build_shape, resolved

    cfg = parse_config(["--pretrained_model_name_or_path", DEV, *flags])
    shape = build_shape(cfg, max(world, cfg.parallel.cp_size), planning=True)
    return resolved(cfg, shape.family, shape.pairs, shape.transformer_config), shape


def _estimate(precision: str = "bf16", checkpointed: int = 0, offloaded: int = 0, resolution: int = 1024):
    return plan.estimate(dict(FLUX1_DEV_TRANSFORMER), tokens=(resolution // 16) ** 2 + 512, batch=1, lora_rank=16,
                         lora_layers=["to_q", "to_k", "to_v", "to_out.0"], world=1, cp=1, checkpointed=checkpointed,
                         fsdp=False, precision=precision, offloaded=offloaded)  # fmt: skip


# --- the terms --------------------------------------------------------------------------------------------------


def test_the_frozen_base_is_counted_per_block_at_each_precision():
    """Per block and outside the blocks, by flux_cp.model.precision's rule; the totals are docs/small_gpus.md's."""
    from flux_cp.model.precision import base_bytes

    config = dict(FLUX1_DEV_TRANSFORMER)
    bases = {p: plan.frozen_base(FLUX1, config, p) for p in ("bf16", "fp8", "int8", "nf4")}
    with torch.device("meta"):
        model = FLUX1.transformer_class().from_config(config)
    for p, base in bases.items():
        assert base.total == base_bytes(model, p, parts=FLUX1.quantized_parts)
        assert len(base.blocks) == 57 and base.kinds == ("double",) * 19 + ("single",) * 38
    assert [round(bases[p].total / GIB, 2) for p in ("bf16", "fp8", "int8", "nf4")] == [22.17, 11.16, 11.16, 5.81]
    assert bases["bf16"].rest == bases["nf4"].rest  # embedders and final layer stay as loaded
    assert all(q == 0 for q in bases["bf16"].quantized) and all(q > 0 for q in bases["int8"].quantized)
    assert all(n < f < b for n, f, b in zip(bases["nf4"].blocks, bases["fp8"].blocks, bases["bf16"].blocks))
    # the LoRA run's resident weights are the base at its precision and the fp32 adapters
    e8, e16 = _estimate("fp8"), _estimate("bf16")
    assert e16.weights - e8.weights == bases["bf16"].total - bases["fp8"].total


def test_offload_moves_blocks_to_pinned_host_memory_and_keeps_their_slots_on_the_gpu():
    base = plan.frozen_base(FLUX1, dict(FLUX1_DEV_TRANSFORMER), "int8")
    for n in (10, 38, 57):
        off = plan_offload(base.kinds, base.blocks, n)
        e, whole = _estimate("int8", offloaded=n), _estimate("int8")
        assert whole.weights - e.weights == off.saved_bytes == off.host_bytes - off.slot_bytes
        assert e.host == off.host_bytes and e.offloaded == n and e.activations == whole.activations
    assert _estimate("int8").host == 0


def test_torchao_weight_only_linears_keep_a_dequantized_copy_of_their_weight_for_the_backward():
    """What `dequantized_weights_kept` rests on: torchao's fp8 / int8 linear dequantizes above autograd, which saves
    the bf16 copy (2 bytes per weight) for the input's gradient; a bf16 linear saves its own weight (no copy)."""
    pytest.importorskip("torchao")
    from flux_cp.model.precision import quantize_base

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer_blocks = torch.nn.ModuleList([torch.nn.Linear(256, 512)])

    for precision in ("bf16", "int8", "fp8"):
        model = Model().to(torch.bfloat16).requires_grad_(False)
        quantize_base(model, precision, parts=("transformer_blocks",))
        x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
        new = []  # bytes of saved tensors that are neither the input nor a parameter's own storage

        def pack(t, model=model, x=x, new=new):
            owned = {p.untyped_storage().data_ptr() for p in model.parameters() if type(p) is torch.nn.Parameter}
            if t.untyped_storage().data_ptr() not in owned | {x.untyped_storage().data_ptr()} and t.numel() > 512:
                new.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.transformer_blocks[0](x).sum().backward()
        assert sum(new) == plan.DEQUANTIZED_KEPT[precision] * 2 * 256 * 512, (precision, new)


def test_blocks_not_checkpointed_keep_their_dequantized_weights_on_a_torchao_base():
    base = plan.frozen_base(FLUX1, dict(FLUX1_DEV_TRANSFORMER), "int8")
    for n in (0, 19, 57):
        extra = _estimate("int8", n).activations - _estimate("bf16", n).activations
        kept = sum(base.quantized[n:]) + (base.quantized[-1] if n == 57 else 0)  # FLUX.1 checkpoints from the front
        assert extra == pytest.approx(2 * kept)
        assert _estimate("nf4", n).activations == _estimate("bf16", n).activations


# --- auto: the fastest exact setting that fits ------------------------------------------------------------------


def test_auto_takes_the_fastest_fitting_setting_of_all(monkeypatch):
    """Against every (checkpointed, offloaded) pair, by brute force: fits, and none that fits is faster."""
    cfg, shape = _run("--resolution", "1024", "--gradient_checkpointing", "--offload_blocks", "--base_precision",
                      "int8")  # fmt: skip
    chosen = plan.checkpointing_for(cfg, shape, 16)
    assert chosen.fits and chosen.planned_gib <= 0.9 * 16
    estimate_with = plan.run_estimate(cfg, shape)
    base = plan.frozen_base(FLUX1, shape.transformer_config, "int8")
    fitting = [e for o in plan.offload_options("auto", True, base) for n in range(0, 58, 3)
               for e in [estimate_with(n, o)] if e.total <= 0.9 * 16 * GIB]  # fmt: skip
    assert fitting and min(e.cost for e in fitting) >= chosen.cost - 1e-9


def figures(h2d_gib_per_s: float = 20.0) -> speed.Figures:
    """A 24 GB card's figures as the tests state them (not a class file's, which measurements replace)."""
    no = {"eager": 0.0, "compiled": 0.0, "graphs": 0.0}
    return speed.Figures(
        matmul_tflops=100.0,
        attention_tflops=80.0,
        elementwise_ps={"eager": 200.0, "compiled": 0.0, "graphs": 0.0},
        pass_ms=no,
        dequant_ms_per_gweight={p: {m: (5.0, 0.0) for m in no} for p in ("fp8", "int8", "nf4")},
        h2d_gib_per_s=h2d_gib_per_s,
        link_gib_per_s=20.0,
        step_ms=no,
        compile_s=60.0,
    )


def _pick(h2d_gib_per_s: float, gib: float, resolution: int):
    cfg, shape = _run("--resolution", str(resolution), "--gradient_checkpointing", "--offload_blocks",
                      "--base_precision", "fp8")  # fmt: skip
    with speed.using(figures(h2d_gib_per_s)):
        return plan.checkpointing_for(cfg, shape, gib)


def test_offload_beats_checkpointing_where_compute_hides_the_copies():
    """fp8 at 1024 px on 24 GiB: at 20 GiB/s a block's copy takes less than a block's compute, so offloading costs
    nothing and replaces recomputation."""
    fast = _pick(20.0, 24, 1024)
    assert fast.fits and fast.offloaded > 0
    cfg, shape = _run("--resolution", "1024", "--gradient_checkpointing", "--base_precision", "fp8")
    with speed.using(figures()):
        alone = plan.checkpointing_for(cfg, shape, 24)  # checkpointing alone fits too, more slowly
    assert alone.fits and len(alone.blocks) > len(fast.blocks) and alone.cost > fast.cost


def test_checkpointing_beats_offload_where_the_copies_would_wait():
    """The same run over slower links: fewer blocks offloaded (a few, spread out, still have many blocks' compute to
    arrive in), and at 0.05 GiB/s none (every copy would stall the step): auto recomputes instead."""
    fast, slower, slowest = (_pick(rate, 24, 1024) for rate in (20.0, 3.0, 0.05))
    assert fast.offloaded > slower.offloaded > slowest.offloaded == 0
    assert slowest.fits and len(slowest.blocks) > len(slower.blocks) > len(fast.blocks)


# --- nothing fits: the precision that would, at start and in --plan ---------------------------------------------


def test_auto_with_nothing_that_fits_is_refused_at_start_naming_the_precision_that_fits():
    cfg, shape = _run("--resolution", "2048", "--gradient_checkpointing", "--offload_blocks", "--gpu_memory_gib", "12")
    with speed.using(figures()), pytest.raises(UsageError) as e:
        plan.check_fits(cfg, shape, torch.device("cpu"))
    message = str(e.value)
    assert "\n" not in message and e.value.agreed
    assert message.startswith("FLUX.1 does not fit 90% of 12.0 GiB at --base_precision bf16 (planned ")
    named = re.search(
        r"with every block checkpointed and 57 of 57 blocks offloaded\); --base_precision (\w+) fits: "
        r".* s/step by the speed model: add --base_precision (\w+) \(",
        message,
    )
    assert named and named.group(1) == named.group(2) != "bf16", message
    # counts given by hand run as given (a warning at the start of training); no GPU and no --gpu_memory_gib: nothing
    by_hand, _ = _run("--resolution", "2048", "--gradient_checkpointing", "all", "--gpu_memory_gib", "12")
    plan.check_fits(by_hand, shape, torch.device("cpu"))
    no_gpu, _ = _run("--resolution", "2048", "--gradient_checkpointing")
    plan.check_fits(no_gpu, shape, torch.device("cpu"))


def test_without_offload_the_suggestion_may_be_offload_at_the_same_precision():
    cfg, shape = _run("--resolution", "1024", "--gradient_checkpointing", "--gpu_memory_gib", "24")
    with pytest.raises(UsageError, match=r"at --base_precision bf16 \(planned .* with every block checkpointed\); "
                                         r"--offload_blocks auto fits: "):  # fmt: skip
        plan.check_fits(cfg, shape, torch.device("cpu"))


def test_full_fine_tuning_and_fsdp2_are_offered_no_quantized_base():
    full, shape = _run("--resolution", "2048", "--gradient_checkpointing", "--full_finetune", "--gpu_memory_gib", "24")
    with pytest.raises(UsageError, match="no --base_precision fits either: use more GPUs"):
        plan.check_fits(full, shape, torch.device("cpu"))
    assert plan.suggestion(full, shape, 24) is None
    import dataclasses

    lora, shape = _run("--resolution", "2048", "--gradient_checkpointing", "--cp_size", "2", "--gpu_memory_gib", "8")
    assert plan.suggestion(lora, dataclasses.replace(shape, sharded=True), 8) is None


def test_plan_prints_base_precision_offload_and_pinned_host_memory(capsys):
    for gib in (12, 16, 24, 48, 80, 33.5):
        cfg, _ = _run("--plan", "--resolution", "1024", "--offload_blocks", "--gpu_memory_gib", str(gib))
        report.print_plan(cfg)
        out = capsys.readouterr().out
        assert f"GPU {gib:.0f} GiB" in out and "base bf16, --offload_blocks auto" in out
        assert "base precision bf16: 22.17 GiB of frozen weights per GPU (fp8 11.16, int8 11.16, nf4 5.81" in out
        assert "speed model: rtx4090 class figures" in out or gib > 32, out
        assert "recommended for 1 GPU of" in out and "settings compared" in out
        assert gib > 40 or "GiB of pinned host memory per process" in out, out
    cfg, _ = _run("--plan", "--resolution", "2048", "--gradient_checkpointing", "--gpu_memory_gib", "12")
    report.print_plan(cfg)
    out = capsys.readouterr().out
    assert (
        "these flags at --cp_size 1 (compile off): do not fit: FLUX.1 does not fit 90% of 12.0 GiB at "
        "--base_precision bf16" in out
    ), out
    assert re.search(
        r"at --base_precision bf16 \(planned [^)]*\); --base_precision (fp8|int8|nf4)( --offload_blocks auto)? "
        r"fits: ",
        out,
    ), out


def test_plan_on_several_gpus_compares_ddp_with_a_quantized_base_and_fsdp2(capsys):
    for n in (2, 4):
        cfg, _ = _run("--plan", "--resolution", "2048", "--cp_size", str(n), "--num_processes", str(n),
                      "--gpu_memory_gib", "24")  # fmt: skip
        report.print_plan(cfg)
        out = capsys.readouterr().out
        assert f"{n} process(es)" in out and f"recommended for {n} GPUs of 24 GiB" in out, out
        for row in ("bf16 DDP on", "fp8 DDP on", "nf4 DDP off", "bf16 FSDP2 on"):
            assert re.search(rf"\n  {row.replace(' ', ' +')} +{n} ", out), (row, out)
        assert not re.search(r"\n  (fp8|int8|nf4) +FSDP2", out)  # FSDP2 shards no quantized base
    # FSDP2 shards the bf16 base where DDP holds it whole: its weights per GPU are smaller, and at 512 px the
    # compute of a block no longer hides the all-gather of the next
    cfg, shape = _run("--resolution", "512", "--cp_size", "2", "--gradient_checkpointing", world=2)
    import dataclasses

    ddp = plan.run_estimate(cfg, shape)(57)
    fsdp = plan.run_estimate(cfg, dataclasses.replace(shape, sharded=True))(57)
    assert fsdp.weights < ddp.weights / 1.5 and fsdp.cost > ddp.cost  # and pays its all-gathers
