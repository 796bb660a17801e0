"""Per-block activation checkpointing (`--gradient_checkpointing auto|all|none|N`, flux_cp/model/blocks.py): any number
of checkpointed blocks, eager or compiled (a mix of checkpointed and plain compiled blocks), computes what no
checkpointing computes; `auto` takes the planner's choice (flux_cp/plan/memory.py) and the run records it."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import cp
from flux_cp.config.parser import parse_config
from flux_cp.errors import UsageError
from flux_cp.model.blocks import Checkpointing, checkpointed_blocks, prepare_blocks
from flux_cp.plan import memory as plan
from tests.distributed import flux_inputs, flux_model
from tests.launch import losses, ok, run_args, train


def _resolved(argv: list[str]):
    """The flags as the trainer holds them once the model is known (FLUX.1's default LoRA layers filled in)."""
    from flux_cp.families import FLUX1
    from flux_cp.shape.build import resolved

    return resolved(parse_config(argv), FLUX1, False, None)


def test_the_flag_takes_auto_alone_and_keeps_old_command_lines():
    assert parse_config([]).train.gradient_checkpointing == "none"
    assert parse_config(["--gradient_checkpointing"]).train.gradient_checkpointing == "auto"
    assert parse_config(["--gradient_checkpointing", "--compile"]).train.gradient_checkpointing == "auto"
    for value, parsed in (("all", "all"), ("None", "none"), ("012", "12"), ("0", "0")):
        assert parse_config(["--gradient_checkpointing", value]).train.gradient_checkpointing == parsed
    with pytest.raises(UsageError, match="--gradient_checkpointing: 'half': give auto, all, none or a number"):
        parse_config(["--gradient_checkpointing", "half"])
    assert [checkpointed_blocks(v, 57) for v in ("auto", "all", "none", "0", "12", "99")] == [None, 57, 0, 0, 12, 57]


def _step(model, inputs) -> list[torch.Tensor]:
    model.zero_grad()
    inputs = {k: v for k, v in inputs.items() if k != "target"}
    out = model(**inputs)[0]
    out.square().mean().backward()
    return [out.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _graphs(monkeypatch) -> dict[tuple[str, bool], list[str]]:
    """Compile blocks with aot_eager (no code generation) instead of Inductor, keeping each backward graph's code by
    the kind of block that compiled it: (its class, whether it is checkpointed). One backend per kind: blocks of a
    kind share their compiled code (as a run's blocks do), so each kind is compiled once, in the first model that
    has it."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes: dict[tuple[str, bool], list[str]] = {}
    backends = {}

    def backend(kind: tuple[str, bool]):
        def keep(gm, _inputs):
            codes.setdefault(kind, []).append(gm.code)
            return make_boxed_func(gm.forward)

        if kind not in backends:
            backends[kind] = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=keep)
        return backends[kind]

    def compile_with_kind(self, **kw):
        checkpointed = isinstance(self.__dict__.get("forward"), functools.partial)  # blocks.checkpoint_inside
        return compile_(self, backend=backend((type(self).__name__, checkpointed)))

    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", compile_with_kind)
    return codes


@pytest.mark.parametrize("compiled", [False, True])
def test_any_blocks_checkpointed_compute_what_none_do(compiled, monkeypatch):
    """The trainer's block preparation with 0 to 4 of the tiny model's 4 blocks checkpointed, from either end: same
    outputs and gradients as eager without checkpointing; compiled, each kind of block, (double, single) x (plain,
    checkpointed), gets a backward graph, and a checkpointed block's recomputes the block's projections (more matmuls
    than the plain block's backward) and keeps the attention's outputs."""
    inputs = flux_inputs(batch=1)
    reference = flux_model()
    cp.apply_context_parallel(reference, None)
    expected = _step(reference, inputs)
    torch._dynamo.reset()  # no compiled code of an earlier test counts against the recompilation limit
    codes = _graphs(monkeypatch) if compiled else {}
    for blocks in (range(0), range(1), range(0, 3), range(3, 4), range(4)):
        model = flux_model()
        cp.apply_context_parallel(model, None)
        prepare_blocks(model, checkpointed=blocks, recompute_attention=False, compile=compiled, compile_mode=None,
                       cp=1)  # fmt: skip
        got = _step(model, inputs)
        assert len(got) == len(expected) > 8
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if compiled:
        names = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
        assert set(codes) == {(name, checkpointed) for name in names for checkpointed in (False, True)}, sorted(codes)
        for name in names:
            plain, recomputed = ([_matmuls(c) for c in codes[(name, checkpointed)]] for checkpointed in (False, True))
            assert min(recomputed) > max(plain), (name, plain, recomputed)
        assert all("ring_attention.default(" not in c for kind in codes for c in codes[kind])  # kept, not recomputed


def _matmuls(code: str) -> int:
    return code.count("aten.mm.default") + code.count("aten.addmm.default")


def _shape(family, config: dict, resolution: int, text_tokens: int):
    """The run shape of one process training `config` on square `resolution` samples (no CP, DDP)."""
    from flux_cp.shape.run_shape import RunShape

    return RunShape(family, "m", None, None, ((resolution, resolution),), ((0,),), text_tokens, 1, 1, 1, False,
                    transformer_config=config)  # fmt: skip


def test_auto_fits_the_memory_given_with_the_planner_margin():
    """`auto` takes the fewest blocks whose planned peak fits 90% of the memory; none fit: all, and says so."""
    from flux_cp.families import FLUX1
    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER

    one = ["--train_batch_size", "1", "--resolution", "2048"]
    cfg = _resolved(["--gradient_checkpointing", "--compile_mode", "reduce-overhead", *one])

    shape = _shape(FLUX1, dict(FLUX1_DEV_TRANSFORMER), 2048, 512)

    def choice(gib: float | None) -> Checkpointing:
        return plan.checkpointing_for(cfg, shape, gib)

    assert len(choice(None).blocks) == 0  # no GPU and no --gpu_memory_gib: nothing to fit
    full, tight, none_fit = choice(141), choice(80), choice(24)
    assert len(full.blocks) == 0 and full.fits and full.planned_gib < 0.9 * 141
    assert 0 < len(tight.blocks) < 57 and tight.fits and tight.planned_gib <= 0.9 * 80
    assert list(tight.blocks) == list(range(len(tight.blocks)))  # FLUX.1: from the front (double blocks first)
    fewer = plan.checkpointing_for(
        _resolved(["--gradient_checkpointing", str(len(tight.blocks) - 1), "--compile", *one]), shape, 80
    )
    assert fewer.planned_gib > 0.9 * 80 and not fewer.fits  # one block fewer would not fit
    assert len(none_fit.blocks) == 57 and not none_fit.fits
    assert "gradient checkpointing auto: " in tight.describe("auto") and "of 80.0 GiB" in tight.describe("auto")


# --- end to end: the trainer on CPU ------------------------------------------------------------------------


def _auto_memory_for_a_partial_pick(tmp_path) -> tuple[float, int]:
    """A --gpu_memory_gib at which `auto` checkpoints some but not all of the tiny model's blocks, and how many."""
    from flux_cp.families import FLUX1
    from flux_cp.families.flux1.tiny import ensure_tiny_pipeline

    config = dict(FLUX1.transformer_class().load_config(ensure_tiny_pipeline(), subfolder="transformer"))
    cfg = _resolved(run_args(tmp_path, "probe", 10, "--gradient_checkpointing"))
    shape = _shape(FLUX1, config, cfg.data.largest_resolution, cfg.data.max_sequence_length)

    def pick(gib: float) -> int:
        return len(plan.checkpointing_for(cfg, shape, gib).blocks)

    none_needed = plan.checkpointing_for(cfg, shape, 1e6).planned_gib
    gib = none_needed / 0.9 * 0.999  # just too little for no checkpointing
    assert 0 < pick(gib) < 4, pick(gib)
    return gib, pick(gib)


@pytest.mark.e2e
def test_checkpointing_settings_train_identically_and_auto_is_recorded(tmp_path):
    """Eager on CPU: none, all, one block, and auto at a memory where it picks some blocks train the same losses
    bit for bit (a recomputation computes what it recomputes); run_config.json records the resolved count."""
    gib, n = _auto_memory_for_a_partial_pick(tmp_path)
    settings = {"none": [], "all": ["--gradient_checkpointing", "all"], "one": ["--gradient_checkpointing", "1"],
                "auto": ["--gradient_checkpointing", "--gpu_memory_gib", f"{gib:.9f}"]}  # fmt: skip
    for name, flags in settings.items():
        ok(train(1, *run_args(tmp_path, name, 10, "--seed", "3", "--learning_rate", "1e-3", *flags)))
    recorded = {name: json.loads((tmp_path / name / "run_config.json").read_text()) for name in settings}
    assert [recorded[s]["checkpointed_blocks"] for s in settings] == [0, 4, 1, n]
    assert recorded["auto"]["gradient_checkpointing"] == "auto" and recorded["auto"]["planned_peak_gib"] <= gib
    reference = losses(tmp_path / "none")
    assert len(set(reference)) > 1
    for name in settings:
        assert losses(tmp_path / name) == reference, name


def _fsdp2_gradients(blocks: range) -> list[torch.Tensor]:
    """The tiny model's parameter gradients under FSDP2 (each block and the root sharded, as accelerate's FSDP2 wraps
    them), eager, with `blocks` checkpointed per block (gathered to full tensors)."""
    from torch.distributed.fsdp import fully_shard

    from flux_cp.model.blocks import transformer_blocks

    model = flux_model()
    cp.apply_context_parallel(model, None)
    prepare_blocks(model, checkpointed=blocks, recompute_attention=False, compile=False, compile_mode=None, cp=1)
    for block in transformer_blocks(model):
        fully_shard(block)
    fully_shard(model)
    _step(model, flux_inputs(batch=1))
    return [p.grad.full_tensor() for p in model.parameters() if p.grad is not None]


def _fsdp2_errors(rank: int, world: int, cases: list[range]) -> list[tuple[int, float]]:
    plain = _fsdp2_gradients(range(0))
    out = []
    for blocks in cases:
        got = _fsdp2_gradients(blocks)
        out.append((len(got), max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, plain))))
    return out


@pytest.mark.distributed
def test_blocks_checkpointed_one_by_one_recompute_under_fsdp2():
    """FSDP2 reshards each block after its forward; a checkpointed block's recomputation in the backward runs on the
    parameters FSDP2 gathers again for that block's backward: the same gradients as without checkpointing."""
    from tests import distributed

    for n, error in distributed.run(_fsdp2_errors, 2, [range(4), range(1, 3)])[0]:
        assert n > 8 and error < 1e-6, (n, error)
