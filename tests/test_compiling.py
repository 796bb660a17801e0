"""--compile on|off|auto (flux_cp/plan/compiling.py): the flag's values, auto's choice by the speed model (off on the
CPU), and a compile failure at the first step falling back to eager blocks that compute what --compile off computes."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flux_cp.config.parser import parse_config
from flux_cp.errors import UsageError
from flux_cp.outputs.metrics import read_metrics
from flux_cp.plan import compiling, speed


def test_the_flag_is_on_alone_off_on_or_auto_and_auto_by_default():
    assert parse_config([]).train.compile == "auto"
    assert parse_config(["--compile"]).train.compile == "on"
    for given, value in (("on", "on"), ("off", "off"), ("auto", "auto"), ("true", "on"), ("no", "off"), ("0", "off")):
        assert parse_config(["--compile", given]).train.compile == value
    with pytest.raises(UsageError, match=r"'sometimes': give on, off or auto"):
        parse_config(["--compile", "sometimes"])
    with pytest.raises(UsageError, match=r"^--compile off with --compile_mode reduce-overhead: a compile mode"):
        parse_config(["--compile", "off", "--compile_mode", "reduce-overhead"])
    # a compile mode compiles: auto with one is on
    from flux_cp.model.blocks import compiled

    assert compiled(parse_config(["--compile_mode", "reduce-overhead"]).train)
    assert not compiled(parse_config([]).train)  # auto counts as off until a run decides it


def _figures(compile_s: float = 60.0) -> speed.Figures:
    no = {"eager": 0.0, "compiled": 0.0, "graphs": 0.0}
    return speed.Figures(
        matmul_tflops=600.0,
        attention_tflops=500.0,
        elementwise_ps={"eager": 80.0, "compiled": 0.0, "graphs": 0.0},
        pass_ms=no,
        dequant_ms_per_gweight={p: {m: (0.0, 0.0) for m in no} for p in ("fp8", "int8", "nf4")},
        h2d_gib_per_s=50.0,
        link_gib_per_s=100.0,
        step_ms=no,
        compile_s=compile_s,
        describe="the test's figures",
    )


def _plan(*flags: str):
    from flux_cp.shape.build import build_shape, resolved

    cfg = parse_config(
        [
            "--pretrained_model_name_or_path",
            "black-forest-labs/FLUX.1-dev",
            "--resolution",
            "1024",
            "--gradient_checkpointing",
            "--gpu_memory_gib",
            "80",
            *flags,
        ]
    )
    shape = build_shape(cfg, 1, planning=True)
    return resolved(cfg, shape.family, shape.pairs, shape.transformer_config), shape


@pytest.fixture
def offline(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)


def test_auto_is_off_on_the_cpu_and_on_a_gpu_on_where_the_steps_pay_for_compiling(offline):
    cfg, shape = _plan()
    decided, choice = compiling.decide(cfg, shape, torch.device("cpu"), 80)
    assert decided.train.compile == "off" and choice.line is None  # the CPU: no compiling, nothing said
    gpu = torch.device("cuda")  # planned for a GPU: nothing runs on it
    with speed.using(_figures()):
        from flux_cp.plan import memory as plan

        on, off = (plan.checkpointing_for(compiling.with_compile(cfg, v), shape, 80).seconds for v in ("on", "off"))
        assert 0 < on < off  # compiled blocks are faster by the figures (their elementwise work is fused)
        pays = int(60.0 / (off - on)) + 1  # steps whose saving covers compiling's 60 s
        for steps, value in ((pays, "on"), (pays - 1, "off")):
            run = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_train_steps=steps))
            decided, choice = compiling.decide(run, shape, gpu, 80)
            assert decided.train.compile == choice.value == value
            assert choice.line.startswith(f"--compile auto: {value} (by the speed model, the test's figures: ")
            assert f"{steps} steps save ~" in choice.line and "compiling takes ~60 s" in choice.line
        decided, choice = compiling.decide(cfg, shape, gpu, 80)  # epochs: the steps are not known yet
        assert decided.train.compile == "on" and "it pays after ~" in choice.line
    for given in ("on", "off"):  # given values stay as given
        run, _ = _plan("--compile", given)
        assert compiling.decide(run, shape, gpu, 80)[0].train.compile == given


def test_a_compile_failure_is_told_from_other_errors():
    from torch._dynamo.exc import BackendCompilerFailed

    def raised(fn) -> BaseException:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - the test keeps what was raised
            return e
        raise AssertionError("nothing raised")

    def backend(gm, inputs):
        raise RuntimeError("injected: cannot compile")

    failed = raised(lambda: torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2)))
    assert isinstance(failed, BackendCompilerFailed) and compiling.is_compile_failure(failed)
    assert compiling.summary(failed).startswith("BackendCompilerFailed: ")
    assert not compiling.is_compile_failure(raised(lambda: torch.ones(2) @ torch.ones(3)))  # the model's own error
    assert not compiling.is_compile_failure(torch.OutOfMemoryError("out of memory"))
    assert not compiling.is_compile_failure(UsageError("a flag"))
    assert not compiling.is_compile_failure(KeyboardInterrupt())


def test_compile_time_is_said_once_after_the_second_step():
    timer = compiling.CompileTime(True)
    assert timer.step_done(41.5) is None
    assert (
        timer.step_done(0.5) == "compile: the first step took 41.5 s and the second 0.50 s: compiling the blocks "
        "took ~41 s"
    )
    assert timer.step_done(0.5) is None
    assert compiling.CompileTime(False).step_done(41.5) is None


# --- the fallback, end to end on the CPU --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The tiny FLUX.1 with one double and one single block: one graph of each kind to trace."""
    import shutil

    from flux_cp.families.flux1.tiny import ensure_tiny_pipeline, tiny_transformer

    path = tmp_path_factory.mktemp("model") / "tiny-1-1"
    shutil.copytree(ensure_tiny_pipeline(), path)
    shutil.rmtree(path / "transformer")
    tiny_transformer(seed=0, num_layers=1, num_single_layers=1).save_pretrained(path / "transformer")
    return path


def _failing_compile(monkeypatch, where: str) -> list[str]:
    """Blocks compile through a backend that fails: at once (`forward`, Dynamo raising at the first forward), or
    AOTAutograd's second backward graph (`backward`: the single block's backward ran and left its gradients, then the
    double block's backward graph fails to compile)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    calls: list[str] = []

    def fail_now(gm, inputs):
        calls.append("forward")
        raise RuntimeError("injected: this backend compiles nothing")

    def backward(gm, inputs):
        calls.append("backward")
        if calls.count("backward") == 2:
            raise RuntimeError("injected: the second backward graph does not compile")
        return make_boxed_func(gm.forward)

    failing = (
        fail_now
        if where == "forward"
        else aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward)
    )
    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_(self, backend=failing))
    return calls


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_compile_failure_at_the_first_step_falls_back_to_eager_blocks_exactly(
    where, model, tmp_path, monkeypatch, caplog
):
    """The run with a compile that fails at the first step (its forward, or after part of its backward) goes on with
    eager blocks and trains what --compile off trains: the same losses and LoRA weights, bit for bit; one line says
    so. Gradient accumulation and a checkpointed block, so that the step's own state (the accumulation's count, the
    partial gradients) must be put back as it was."""
    from tests.launch import in_process, run_args

    def args(name: str, *extra: str) -> list[str]:
        return run_args(
            tmp_path,
            name,
            4,
            "--pretrained_model_name_or_path",
            str(model),
            "--resolution",
            "64",
            "--max_sequence_length",
            "32",
            "--seed",
            "3",
            "--learning_rate",
            "1e-3",
            "--gradient_accumulation_steps",
            "2",
            "--gradient_checkpointing",
            "1",
            *extra,
        )

    code, err = in_process(args("eager", "--compile", "off"))
    assert code == 0, err
    torch._dynamo.reset()
    calls = _failing_compile(monkeypatch, where)
    with caplog.at_level(logging.WARNING, logger="flux_cp"):
        code, err = in_process(args("fell_back", "--compile"))
    assert code == 0, err
    assert calls.count(where) >= 1 and (where == "forward" or calls.count("backward") == 2), calls
    said = [r.getMessage() for r in caplog.records if "compiling the blocks failed" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("warning: compiling the blocks failed at the first step (")
    assert "the run goes on with eager blocks, which compute the same; --compile off skips compiling" in said[0]
    eager, fell_back = (read_metrics(tmp_path / n / "metrics.jsonl") for n in ("eager", "fell_back"))
    assert [r["loss"] for r in eager] == [r["loss"] for r in fell_back] and len(eager) == 4
    assert len({r["loss"] for r in eager}) > 1
    a, b = (load_file(tmp_path / n / "pytorch_lora_weights.safetensors") for n in ("eager", "fell_back"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
