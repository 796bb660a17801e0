"""The planner's speed model (flux_cp/plan/speed.py): the committed GPU classes' figures against the steps measured on
those GPUs, the offload and FSDP2 schedules it plays out, which figures a plan uses, and the measured figures' cache. On
the CPU, nothing measured here: the timing routine itself runs on the tiny model (flux_cp/plan/speed_measure.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from benchmarks import bench_speed_model as bench
from flux_cp.plan import speed, speed_measure

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "archive" / "results"
H100 = sorted((RESULTS / "2026-12-05-h100-small").glob("trainer_*.json"))
H200 = [RESULTS / "2026-12-02-h200" / f for f in ("auto.json", "parity_new.json", "flux2.json", "fp8.json")] + [
    RESULTS / "2026-12-03-h200-small" / "trainer_small.json",
    RESULTS / "2026-12-03-h200-small" / "trainer_small_b.json",
    RESULTS / "2026-12-03-h200-small-c" / "trainer_small.json",
    RESULTS / "2026-12-03-h200-small-c" / "trainer_small_b.json",
    RESULTS / "2026-12-03-h200-small-c" / "trainer_full_flux1_c.json",
]


@pytest.fixture(scope="module")
def models() -> bench.Models:
    return bench.Models()


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)


# --- the classes' figures against the measured steps ---------------------------------------------------------------


@pytest.mark.parametrize("name, files", [("h100", H100), ("h200", H200)])
def test_each_class_predicts_its_measured_steps_within_15_percent_and_in_their_order(name, files, models):
    """Every measured row of the class's GPU (the settings as they ran: flags, blocks checkpointed and offloaded) is
    planned again and its step predicted with the committed figures: within 15%, and every two rows of one model and
    resolution more than 10% apart come out in the measured order. The H100's small-GPU rows are those of the table
    the README's advice rests on: fp8 with offload, bf16 with offload, nf4 at 12 GiB, fp8 eager, FLUX.2 at full size,
    and the 2048 px step. The figures were fitted to these rows (flux_cp/plan/speed_data/*.json's `fit`): this checks
    the file against them, and once the figures are measured on the GPU, the model."""
    assert files and all(f.is_file() for f in files)
    table, failures = bench.check([str(f) for f in files], speed.load_class(name), models=models)
    assert len(table) >= (7 if name == "h100" else 12), table
    assert not failures, failures


def test_on_an_h100_fp8_with_offload_is_predicted_faster_than_bf16_with_offload_by_the_measured_ratio(models):
    """At 24 GiB, compiled, the settings as measured (0.506 s against 0.707 s, 1.40x): the old stated constants had
    them the other way round."""
    rows = bench.load_rows(
        [str(RESULTS / "2026-12-05-h100-small" / "trainer_small.json")],
        models,
        ["small24_fp8_auto_c", "small24_bf16_auto_c"],
    )
    fp8, bf16 = bench.predictions(rows, speed.load_class("h100"))
    assert 1.25 < bf16 / fp8 < 1.6


def test_the_recommendation_on_an_h100_capped_to_24_gib_is_fp8_compiled_with_offload(monkeypatch):
    """What --plan --gpu_class h100 --gpu_memory_gib 24 recommends for FLUX.1-dev at 1024 px, with host memory for
    the offloaded blocks."""
    from flux_cp.config.parser import parse_config
    from flux_cp.plan import recommend
    from flux_cp.shape.build import build_shape, resolved

    cfg = parse_config(
        [
            "--plan",
            "--pretrained_model_name_or_path",
            "black-forest-labs/FLUX.1-dev",
            "--resolution",
            "1024",
            "--gpu_memory_gib",
            "24",
        ]
    )
    shape = build_shape(cfg, 1, planning=True)
    cfg = resolved(cfg, shape.family, shape.pairs, shape.transformer_config)
    with speed.using(speed.load_class("h100")):
        settings = recommend.compared(cfg, shape, 24, 100 * 2**30, True, [1])
        best = recommend.best(settings, None)
        assert (best.precision, best.compile, best.fits) == ("fp8", "on", True) and best.chosen.offloaded > 0
        lines = recommend.command(
            best,
            cfg,
            [
                "--plan",
                "--pretrained_model_name_or_path",
                "M",
                "--resolution",
                "1024",
                "--gpu_memory_gib",
                "24",
                "--compile",
                "off",
            ],
        )
    assert lines[0].startswith("pip install -e .[quant]    # --base_precision fp8 needs torchao")
    assert lines[1] == (
        "accelerate launch --config_file accelerate_configs/gpu1.yaml train_flux_cp.py "
        "--pretrained_model_name_or_path M --resolution 1024 --base_precision fp8 "
        "--gradient_checkpointing --offload_blocks --compile"
    )


# --- the schedules -------------------------------------------------------------------------------------------------


def test_offload_copies_cost_only_what_the_compute_between_them_does_not_hide():
    """Four blocks of one kind, all offloaded to two slots, each computing 1 s forward and 2 s backward: at the start
    of each pass two are in their slots; the third's copy starts when the first is done, the fourth's when the second
    is and the copy before it ended. Copies of 0.5 s hide; copies of 1.5 s stall the third block by 0.5 s and the
    fourth by 0.5 s more in the forward, and nothing in the backward (2 s blocks)."""
    fwd, bwd = [1.0] * 4, [2.0] * 4
    assert speed._passes(fwd, bwd, [0.5] * 4, [(0, 1, 2, 3)], slots=2) == pytest.approx(4 + 8)
    # forward: block 2's copy 1..2.5 (ready 0.5 s late), block 3's 2.5..4 (block 3 starts at 4 instead of 3.5)
    # backward: block 1's copy starts when block 3 ends (2) and ends 3.5, block 1 starts at 4: hidden; block 0's copy
    # 3.5..5 after block 2's end (4): 4..5.5, block 0 starts at 6: hidden
    assert speed._passes(fwd, bwd, [1.5] * 4, [(0, 1, 2, 3)], slots=2) == pytest.approx(5 + 8)
    # FSDP2: every block gathered while the one before computes (the first one before anything)
    assert speed._passes(fwd, bwd, [0.5] * 4, [range(4)], slots=0) == pytest.approx(4.5 + 8.5)


def test_a_step_adds_recomputation_dequantization_and_the_step_outside_the_blocks():
    fig = speed.load_class("h100")
    block = speed.Block("single", linear=1e12, attention=5e11, features=1e7, weights=10**8, nbytes=10**8)
    plain = speed.step_seconds(fig, [block] * 3, precision="bf16", how="compiled", lora=True)
    f, b, r = speed.block_seconds(fig, block, "bf16", "compiled", True, attention_recomputed=False)
    outside = fig.step_ms["compiled"] / 1e3
    assert plain.seconds == pytest.approx(3 * (f + b) + outside) and plain.stall == 0
    ck = speed.step_seconds(
        fig, [block] * 3, precision="bf16", how="compiled", lora=True, checkpointed=[0, 1], attention_recomputed=False
    )
    assert ck.seconds == pytest.approx(plain.seconds + 2 * r) and r < f  # the attention's outputs are kept
    eager_f, _, eager_r = speed.block_seconds(fig, block, "bf16", "eager", True, attention_recomputed=True)
    assert eager_r == eager_f  # eager blocks recompute all of it
    quantized = speed.step_seconds(fig, [block] * 3, precision="nf4", how="compiled", lora=True)
    dq_f, dq_b = fig.dequant("nf4", "compiled")
    assert quantized.seconds == pytest.approx(plain.seconds + 3 * 10**8 * (dq_f + dq_b))


# --- which figures -------------------------------------------------------------------------------------------------


def test_which_class_stands_for_a_gpu():
    assert [speed.class_for_memory(g) for g in (12, 24, 32, 48, 80, 96, 141)] == [
        "rtx4090",
        "rtx4090",
        "rtx4090",
        "h100",
        "h100",
        "h100",
        "h200",
    ]
    assert speed.class_of_gpu("NVIDIA H100 80GB HBM3") == "h100" and speed.class_of_gpu("NVIDIA H200") == "h200"
    assert speed.class_of_gpu("NVIDIA GeForce RTX 4090") == "rtx4090" and speed.class_of_gpu("NVIDIA A100") is None
    cpu = torch.device("cpu")
    assert (
        speed_measure.class_name("auto", cpu, 24) == "rtx4090" and speed_measure.class_name("h100", cpu, 24) == "h100"
    )
    for name in speed.CLASSES:  # every file loads and says what it is
        fig = speed.load_class(name)
        data = json.loads(speed.class_file(name).read_text())
        assert data["status"] in ("measured", "fitted", "sourced") and fig.describe.startswith(f"{name} class figures")
        assert all(v > 0 for v in (fig.matmul_tflops, fig.attention_tflops, fig.h2d_gib_per_s, fig.compile_s))


def test_plan_on_the_cpu_says_whose_figures_it_used_and_plans_host_memory(capsys):
    from flux_cp.config.parser import parse_config
    from flux_cp.plan.report import print_plan

    argv = [
        "--plan",
        "--pretrained_model_name_or_path",
        "black-forest-labs/FLUX.1-dev",
        "--resolution",
        "1024",
        "--gpu_memory_gib",
        "24",
        "--host_memory_gib",
        "8",
    ]
    print_plan(parse_config(argv), argv)
    out = capsys.readouterr().out
    assert (
        "speed model: rtx4090 class figures (NVIDIA GeForce RTX 4090: sourced from datasheets, not measured; "
        "flux_cp/plan/speed_data/rtx4090.json)" in out
    )
    assert "recommended for 1 GPU of 24 GiB (host memory 8 GiB)" in out
    rows = [line for line in out.splitlines() if line.startswith("  ") and " one GPU " in line]
    pinned = [float([t for t in line.split() if t.endswith("G")][1][:-1]) for line in rows]
    assert rows and max(pinned) <= 0.9 * 8  # the offloaded blocks' homes fit 90% of the host memory given
    with speed.using(speed.load_class("h200")):
        argv = ["--plan", "--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-dev", "--gpu_class", "h100"]
        print_plan(parse_config(argv), argv)
    assert "speed model: h100 class figures (NVIDIA H100 80GB: fitted to its measured steps" in capsys.readouterr().out


def test_a_gpu_of_a_fitted_class_plans_with_its_file_and_others_time_their_blocks(monkeypatch):
    """--gpu_class auto on an H100 or H200 takes the class file (fitted to whole measured steps) without timing
    anything; a GPU of no class, or of a class sourced from datasheets, times its blocks; 'measure' always does; a
    named class and a CPU never do. choose() calls the timing routine exactly where times_this_gpu says so."""
    from flux_cp.config.parser import parse_config

    gpu = torch.device("cuda", 0)  # only its type is read: the name comes from the patched device_name
    names = {"NVIDIA H100 80GB HBM3": False, "NVIDIA H200": False, "NVIDIA GeForce RTX 4090": True, "NVIDIA A100": True}
    for name, times in names.items():
        monkeypatch.setattr(speed_measure, "device_name", lambda device, name=name: name)
        assert speed_measure.times_this_gpu("auto", gpu) is times, name
        assert speed_measure.times_this_gpu("measure", gpu) and not speed_measure.times_this_gpu("h100", gpu)
    assert not speed_measure.times_this_gpu("auto", torch.device("cpu"))
    assert not speed_measure.times_this_gpu("measure", torch.device("cpu"))

    class Shape:  # what choose() reads of a run's shape
        cp, family, transformer_config, largest_sequence, text_tokens = 1, None, {}, 4608, 512

    timed = []
    monkeypatch.setattr(speed_measure, "figures_for", lambda request, device, base: timed.append(request) or base)
    for name, flag, expect in (
        ("NVIDIA H100 80GB HBM3", "auto", 0),
        ("NVIDIA H100 80GB HBM3", "measure", 1),
        ("NVIDIA A100-SXM4-80GB", "auto", 1),
    ):
        monkeypatch.setattr(speed_measure, "device_name", lambda device, name=name: name)
        argv = ["--pretrained_model_name_or_path", "m", "--gpu_class", flag]
        timed.clear()
        fig = speed_measure.choose(parse_config(argv), Shape, gpu, 80.0, [(("fp8",), ("compiled",))])
        assert len(timed) == expect, (name, flag)
        assert fig.describe.startswith("h100 class figures")  # the A100's class by its memory: 80 GiB, an h100


# --- measured on the GPU: the routine and its cache ----------------------------------------------------------------


def _request() -> speed_measure.Request:
    from flux_cp.families import FLUX1
    from flux_cp.families.flux1.tiny import TRANSFORMER_CONFIG

    return speed_measure.Request(
        FLUX1,
        dict(TRANSFORMER_CONFIG),
        tokens=96,
        text_tokens=32,
        batch=1,
        precisions=("bf16", "int8"),
        modes=("eager",),
    )


def test_measured_figures_are_cached_by_gpu_torch_and_shapes_and_filled_by_precision_and_mode(tmp_path, monkeypatch):
    """A second plan of the same shapes reads the first one's measurement (and says so); one that needs another
    precision or mode measures only that (bf16 is there already); other shapes are measured anew."""
    monkeypatch.setenv("FLUX_CP_HOME", str(tmp_path))
    base = speed.load_class("h100")
    measured = []

    def fake(request, device, pairs=None, known=None):
        measured.append((request.tokens, sorted(pairs), known is not None))
        times = {"forward": 0.01, "backward": 0.02, "first": 0.03}
        kinds = {k: {"linear": 1e9, "attention": 1e8, "features": 1e5, "weights": 1000} for k in ("double", "single")}
        blocks = {}
        for p, m in pairs:
            blocks.setdefault(p, {})[m] = {k: times for k in kinds}
        return {
            "gpu": "a GPU",
            "kinds": kinds,
            "matmul_tflops": 300.0,
            "attention_tflops": 200.0,
            "h2d_gib_per_s": 25.0,
            "blocks": blocks,
        }

    request, cpu = _request(), torch.device("cpu")
    first = speed_measure.figures_for(request, cpu, base, fake)
    again = speed_measure.figures_for(request, cpu, base, fake)
    assert measured == [(96, [("bf16", "eager"), ("int8", "eager")], False)] and first.to_json() == again.to_json()
    path = speed_measure.cached_path(request, cpu)
    assert path.is_file() and path.parent == tmp_path / "speed"
    assert first.describe.startswith("measured on this GPU (a GPU, in ") and again.describe.endswith(f"cached: {path})")
    assert (again.matmul_tflops, again.h2d_gib_per_s, again.step_ms) == (300.0, 25.0, base.step_ms)
    more = dataclasses.replace(request, precisions=("fp8",), modes=("eager", "compiled"))
    speed_measure.figures_for(more, cpu, base, fake)
    assert measured[1] == (96, [("bf16", "compiled"), ("fp8", "compiled"), ("fp8", "eager")], True)
    assert speed_measure.cached_path(more, cpu) == path and set(json.loads(path.read_text())["blocks"]) == {
        "bf16",
        "int8",
        "fp8",
    }
    speed_measure.figures_for(dataclasses.replace(request, tokens=128), cpu, base, fake)
    assert measured[2][0] == 128 and len(measured) == 3


def test_the_timing_routine_runs_the_blocks_as_a_run_prepares_them(monkeypatch):
    """On the CPU with the tiny FLUX.1: both kinds of block, bf16 and int8 (torchao's weight-only layers, as
    --base_precision quantizes), LoRA on the default layers, eager and compiled (Dynamo with its eager backend here:
    Inductor's C++ kernels take minutes on a CPU); the figures derived from the timings are finite and the bf16
    block's work beyond its matrix products is the elementwise figure."""
    pytest.importorskip("torchao")
    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_(self, backend="eager"))
    request = dataclasses.replace(_request(), modes=("eager", "compiled"))
    raw = speed_measure.measure_blocks(request, torch.device("cpu"), repeats=1)
    assert set(raw["blocks"]) == {"bf16", "int8"} and raw["h2d_gib_per_s"] is None  # no GPU: no copies timed
    for by_mode in raw["blocks"].values():
        assert set(by_mode) == {"eager", "compiled"}
        for t in (*by_mode["eager"].values(), *by_mode["compiled"].values()):
            assert 0 < t["forward"] and 0 < t["backward"] and t["first"] > 0
    fig = speed_measure.derive(raw, speed.load_class("h100"), "measured")
    assert fig.matmul_tflops == raw["matmul_tflops"] > 0 and fig.attention_tflops > 0
    assert fig.elementwise_ps["eager"] >= 0 and fig.elementwise_ps["compiled"] >= 0
    assert fig.sources["dequant_ms_per_gweight.int8.compiled"] == "measured" and len(fig.dequant("int8", "eager")) == 2
    assert fig.h2d_gib_per_s == speed.load_class("h100").h2d_gib_per_s  # not measured here: the class's


def test_a_runs_per_block_lora_targets_fall_on_the_timed_blocks():
    """FLUX.2's default targets name every single block's output (`single_transformer_blocks.N.attn.to_out`); the
    timing routine's transformer has one block of each kind, and the run's targets put LoRA on its one single
    block as on each of the run's (a run that gave them whole stopped at start: blocks 1.. match no module)."""
    from flux_cp.families import FLUX2
    from flux_cp.families.flux2.tiny import TRANSFORMER_CONFIG

    config = {**TRANSFORMER_CONFIG, "num_single_layers": 5}
    targets = FLUX2.lora_targets(False, config)
    assert "single_transformer_blocks.4.attn.to_out" in targets
    folded = speed_measure.one_block_targets(FLUX2, targets)
    assert [t for t in folded if "single_transformer_blocks" in t] == ["single_transformer_blocks.0.attn.to_out"]
    request = speed_measure.Request(FLUX2, config, tokens=96, text_tokens=32, batch=1, precisions=("bf16",),
                                    modes=("eager",), lora_layers=targets)  # fmt: skip
    model = speed_measure._one_of_each(request, "bf16", torch.device("cpu"), torch.float32)
    lora = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert "single_transformer_blocks.0.attn.to_out" in lora and "transformer_blocks.0.attn.to_q" in lora


def test_the_timing_routine_runs_flux2_with_the_runs_own_targets():
    """What a FLUX.2 GPU run measures at its start, on the CPU: the tiny FLUX.2 [dev] transformer's blocks with the
    LoRA targets the run resolved (one per single block), eager bf16; every timing is positive."""
    from flux_cp.families import FLUX2
    from flux_cp.families.flux2.tiny import TRANSFORMER_CONFIG

    config = dict(TRANSFORMER_CONFIG)
    request = speed_measure.Request(
        FLUX2, config, tokens=96, text_tokens=32, batch=1, precisions=("bf16",), modes=("eager",),
        lora_layers=FLUX2.lora_targets(False, config),
    )  # fmt: skip
    rates = {"matmul_tflops": 1.0, "attention_tflops": 1.0, "h2d_gib_per_s": None}  # the blocks only (the rates
    # are the FLUX.1 test's)
    raw = speed_measure.measure_blocks(request, torch.device("cpu"), known=rates, repeats=1)
    timings = raw["blocks"]["bf16"]["eager"]
    assert set(timings) == {"double", "single"}
    assert all(t["forward"] > 0 and t["backward"] > 0 for t in timings.values())


def test_the_calibration_command_runs_and_writes_a_class_file(tmp_path, monkeypatch):
    """`python -m benchmarks.bench_speed_model --smoke`: the measuring branch of the command, on the tiny FLUX.1 on
    the CPU (its figures mean nothing), writes a class file the planner loads, and the raw timings in the suite's
    schema."""
    from benchmarks import schema

    monkeypatch.setenv("FLUX_CP_HOME", str(tmp_path / "home"))
    out, results = tmp_path / "smoke.json", tmp_path / "speed_model.json"
    argv = ["--smoke", "--out", str(out), "--results", str(results), "--precisions", "bf16"]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["status"] == "measured" and data["gpu"] == "cpu (smoke)"
    fig = speed.Figures.from_json(data["figures"])
    assert fig.matmul_tflops > 0 and data["sources"]["matmul_tflops"].startswith("measured on cpu (smoke): python -m")
    rows = schema.load(results)["rows"]
    assert {(r["precision"], r["mode"], r["kind"]) for r in rows} == {
        ("bf16", "eager", "double"),
        ("bf16", "eager", "single"),
    }
