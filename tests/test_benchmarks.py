"""The benchmark suite's result schema and renderer (benchmarks/schema.py, benchmarks/render.py), and how
bench_trainer pairs each CP run with its one-GPU run."""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks import render, schema
from benchmarks.bench_trainer import command, parse_run, timed_rows, with_efficiency


def _trainer_rows() -> list[dict]:
    return [
        {"name": "cp1_2048", "gpus": 1, "flags": "--resolution 2048 --compile", "s_per_step": 2.4},
        {"name": "cp2_2048", "gpus": 2, "flags": "--cp_size 2 --resolution 2048 --compile", "s_per_step": 1.25},
        {"name": "cp2_1024", "gpus": 2, "flags": "--cp_size 2 --resolution 1024 --compile", "s_per_step": 0.3},
        {
            "name": "fake2_2048",
            "gpus": 1,
            "flags": "--cp_size 2 --resolution 2048 --compile",
            "fake_peers": 2,
            "s_per_step": 1.2,
        },  # fmt: skip
        {"name": "cp2_2048_bad", "gpus": 2, "flags": "--cp_size 2 --resolution 2048 --compile", "error": "exit 1"},
    ]


def test_efficiency_is_against_the_one_gpu_run_of_the_same_flags():
    rows = {r["name"]: r for r in with_efficiency(_trainer_rows())}
    assert rows["cp2_2048"]["efficiency"] == round(2.4 / (2 * 1.25), 3)
    assert rows["fake2_2048"]["efficiency"] == 1.0  # loopback peers stand for two GPUs
    assert "efficiency" not in rows["cp1_2048"]  # the reference itself
    assert "efficiency" not in rows["cp2_1024"]  # no one-GPU run at 1024 px
    assert "efficiency" not in rows["cp2_2048_bad"]


def test_a_profiled_step_is_not_timed():
    """bench_trainer's median leaves out the step --profile_step profiled (the profiler slows it), and only it."""
    got = [{"step": i, "s_per_step": 0.6} for i in range(1, 9)]
    assert [r["step"] for r in timed_rows(got, 2, 6, ["--compile"])] == [3, 4, 5, 6]
    assert [r["step"] for r in timed_rows(got, 2, 6, ["--profile_step", "6", "--compile"])] == [3, 4, 5]
    assert [r["step"] for r in timed_rows(got, 2, 6, ["--profile_step", "8"])] == [3, 4, 5, 6]


def test_a_recorded_command_is_the_trainer_launch_with_placeholders():
    run = parse_run("cp2_2048:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048")
    cmd = command(run, "MODEL", "WORK", steps=8)
    assert cmd[:6] == [
        "accelerate",
        "launch",
        "--config_file",
        "accelerate_configs/ddp_cp2.yaml",
        "--num_processes",
        "2",
    ]
    assert cmd[6] == "train_flux_cp.py" and cmd[-4:] == ["--cp_size", "2", "--resolution", "2048"]
    assert cmd[cmd.index("--output_dir") + 1] == "WORK/cp2_2048"
    fake = command({**run, "gpus": 1, "fake_peers": 2}, "MODEL", "WORK", steps=8)
    assert fake[6:8] == ["-m", "benchmarks.fake_peers"]


def test_a_run_is_told_a_users_run_length_so_compile_auto_decides_as_for_one():
    from flux_cp.config.parser import parse_config

    def told(extra: str) -> int:
        cmd = command(parse_run(f"r:1:gpu1.yaml:{extra}"), "MODEL", "WORK", steps=8)
        return parse_config(cmd[cmd.index("train_flux_cp.py") + 1 :]).train.max_train_steps

    assert told("--resolution 1024") == 1000  # stopped after 8 logged steps all the same
    assert told("--resolution 1024 --max_train_steps 57") == 57  # a row's own length wins


def test_result_files_render_as_tables_with_their_commands(tmp_path, capsys):
    rows = with_efficiency(_trainer_rows())
    rows[1]["command"] = "accelerate launch --config_file accelerate_configs/ddp_cp2.yaml train_flux_cp.py --cp_size 2"
    rows[1]["losses"] = [1.0, 0.9]  # not a scalar: kept, not tabled
    columns = {"name": "run", "flags": "flags", "s_per_step": "s/step", "efficiency": "efficiency", "error": "error"}
    data = schema.result("trainer", rows, command="python -m benchmarks.bench_trainer --out t.json", columns=columns)
    assert data["schema"] == schema.SCHEMA and data["software"]["torch"] and data["date"]
    schema.write(tmp_path / "trainer.json", data)
    schema.write(tmp_path / "attention.json", schema.result("attention", [{"tokens": 16896, "ms": 21.68}], command="x"))
    (tmp_path / "other.json").write_text(json.dumps({"runs": []}))  # an older format: skipped, with a note

    text = render.render([str(tmp_path)])
    assert "skipped" in capsys.readouterr().err
    lines = text.splitlines()
    header = lines.index("| run | flags | s/step | efficiency | error |")
    assert lines[header + 1] == "|---|---|---:|---:|---|"
    assert lines[header + 3] == "| cp2_2048 | `--cp_size 2 --resolution 2048 --compile` | 1.25 | 0.96 |  |"
    assert lines[header + 6] == "| cp2_2048_bad | `--cp_size 2 --resolution 2048 --compile` |  |  | exit 1 |"
    assert (
        "- cp2_2048: `accelerate launch --config_file accelerate_configs/ddp_cp2.yaml train_flux_cp.py --cp_size 2`"
        in lines
    )
    assert "| tokens | ms |" in lines and "| 16896 | 21.68 |" in lines  # columns from the rows themselves
    assert "Command: `python -m benchmarks.bench_trainer --out t.json`" in lines


def test_files_of_another_schema_are_refused_by_name(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": "flux-cp-benchmark/0", "rows": []}))
    with pytest.raises(ValueError, match="old.json: not a flux-cp-benchmark/1 result file"):
        schema.load(path)
    with pytest.raises(SystemExit, match="no flux-cp-benchmark/1 result file"):
        render.render([str(tmp_path)])


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_diffusers_cp_benchmark_runs_each_family_with_the_trainers_adapters(family, tmp_path, monkeypatch):
    """bench_diffusers_cp --smoke (one process, CPU) writes a timed row, and its default adapters sit on the modules
    the trainer's do for the comparison the suite draws (FLUX.1: `--lora_layers` ATTENTION_TARGETS, as run.sh passes
    it; FLUX.2: the trainer's default). The script's `main` runs in this process, with the command line
    `python -m benchmarks.bench_diffusers_cp` gives it (a new interpreter would add seconds of imports)."""
    import argparse
    import sys

    from benchmarks import bench_diffusers_cp as bench
    from flux_cp.config.training import LoraConfig
    from flux_cp.families.flux1 import ATTENTION_TARGETS
    from flux_cp.families.flux2 import FLUX2
    from flux_cp.model.lora import add_lora

    out = tmp_path / "d.json"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # one process, as `python -m` starts it
        monkeypatch.delenv(name, raising=False)
    argv = ["bench_diffusers_cp.py", "--smoke", "--no_compile", "--family", family, "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    data = json.loads(out.read_text())
    assert data["schema"] == schema.SCHEMA and data["benchmark"] == "diffusers_cp"
    (row,) = data["rows"]
    assert "error" not in row and row["s_per_step"] > 0 and row["gpus"] == 1, row

    config = bench.SMOKE_TRANSFORMER[family]
    layers = bench.default_lora_layers(family, config)
    args = argparse.Namespace(family=family, lora_layers=layers, backend="", compile=False, mode="ulysses",
                              checkpointing=True)  # fmt: skip
    ours_targets = ATTENTION_TARGETS if family == "flux1" else FLUX2.lora_targets(pairs=False, config=config)
    theirs = bench.build(config, args, world=1, device=torch.device("cpu"))
    ours = type(theirs)(**config)
    add_lora(ours, LoraConfig(lora_layers=tuple(ours_targets)), seed=0)

    def adapted(model):
        return sorted(
            n.removesuffix(".lora_A.default") for n, _ in model.named_modules() if n.endswith("lora_A.default")
        )

    assert adapted(theirs) == adapted(ours) and adapted(ours)
    if family == "flux2":  # every single block's fused output is among them
        assert "single_transformer_blocks.0.attn.to_out" in adapted(theirs)


def test_the_precision_error_benchmark_measures_each_precision_against_the_unquantized_model(tmp_path):
    """bench_precision_error --smoke (the tiny FLUX.1 on the CPU) writes one row per precision: each block stream's
    update error and the model's, int8 closer to the unquantized model than fp8 (as at full size)."""
    import json

    from benchmarks import bench_precision_error

    out = tmp_path / "precision_error.json"
    bench_precision_error.main(["--smoke", "--precisions", "fp8,int8", "--out", str(out)])
    rows = {r["precision"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"fp8", "int8"}
    for r in rows.values():
        assert len(r["block_errors"]) == 8 and 0 < r["block_min"] <= r["block_median"] <= r["block_max"] < 0.2
        assert 0 < r["model"] < 0.2
    assert rows["int8"]["block_max"] < rows["fp8"]["block_min"] and rows["int8"]["model"] < rows["fp8"]["model"]


def test_kohya_settings_are_its_documented_commands():
    """bench_kohya's three settings are kohya's 24 GB setting (--fp8_base), bf16 with 8 blocks swapped at 24 GiB and
    its 12 GB setting (--fp8_base --blocks_to_swap 16, 8-bit AdamW), each with the same documented flags; --tiny
    changes values in place (kohya's parser would take a repeated flag's last value, the recorded command both)."""
    import shlex

    from benchmarks import bench_kohya as kohya

    caps = {name: cap for name, (cap, _) in kohya.SETTINGS.items()}
    assert caps == {"kohya_fp8_24gib": 24.0, "kohya_bf16_swap8_24gib": 24.0, "kohya_fp8_swap16_12gib": 12.0}
    twelve = shlex.split(kohya.kohya_command(kohya.kohya_flags(kohya.SETTINGS["kohya_fp8_swap16_12gib"][1], False)))
    assert twelve[:5] == ["accelerate", "launch", "--num_cpu_threads_per_process", "1", "flux_train_network.py"]
    for flag, value in [
        ("--blocks_to_swap", "16"),
        ("--optimizer_type", "AdamW8bit"),
        ("--network_dim", "16"),
        ("--resolution", "1024,1024"),
        ("--t5xxl_max_token_length", "512"),
    ]:
        assert twelve[twelve.index(flag) + 1] == value
    assert "--fp8_base" in twelve and "--network_train_unet_only" in twelve and "--cache_latents" in twelve
    bf16 = kohya.kohya_flags(kohya.SETTINGS["kohya_bf16_swap8_24gib"][1], False)
    assert "--fp8_base" not in bf16 and bf16[bf16.index("--blocks_to_swap") + 1] == "8"
    assert "--blocks_to_swap" not in kohya.kohya_flags(kohya.SETTINGS["kohya_fp8_24gib"][1], False)
    tiny = kohya.kohya_flags(kohya.SETTINGS["kohya_fp8_swap16_12gib"][1], True)
    full = kohya.kohya_flags(kohya.SETTINGS["kohya_fp8_swap16_12gib"][1], False)
    assert [f for f in tiny if f.startswith("--")] == [f for f in full if f.startswith("--")]
    assert tiny[tiny.index("--blocks_to_swap") + 1] == "2" and tiny[tiny.index("--optimizer_type") + 1] == "AdamW"


@pytest.mark.skipif(
    not os.environ.get("KOHYA_SD_SCRIPTS"),
    reason="needs a kohya-ss/sd-scripts checkout in KOHYA_SD_SCRIPTS (and its dependencies: KOHYA_SITE)",
)
def test_kohya_step_runs_its_fp8_and_block_swap_paths_on_a_tiny_flux(tmp_path):
    """bench_kohya --tiny: kohya's own setup and loop on a tiny Flux on the CPU for each setting: its LoRA on every
    linear of the double and single blocks, the base cast to float8_e4m3fn with --fp8_base, blocks swapped with
    --blocks_to_swap, finite losses, and the commit of the checkout recorded."""
    import math

    from benchmarks import bench_kohya

    out = tmp_path / "kohya.json"
    site = ["--kohya_site", os.environ["KOHYA_SITE"]] if os.environ.get("KOHYA_SITE") else []
    bench_kohya.main(["--sd_scripts", os.environ["KOHYA_SD_SCRIPTS"], *site, "--out", str(out), "--tiny"])
    data = json.loads(out.read_text())
    assert data["schema"] == schema.SCHEMA and data["benchmark"] == "kohya" and data["settings"]["sd_scripts_commit"]
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == set(bench_kohya.SETTINGS)
    for name, r in rows.items():
        assert "error" not in r, r
        assert r["lora_modules"] == 4 * 10 + 6 * 3  # 10 linears per double block, 3 per single block
        assert r["base_dtype"] == ("torch.float8_e4m3fn" if "fp8" in name else "torch.bfloat16")
        assert r["swapped_blocks"] == (2 if "swap" in name else 0)
        assert all(math.isfinite(x) for x in r["losses"]) and r["s_per_step"] > 0
        assert r["kohya_command"].startswith("accelerate launch --num_cpu_threads_per_process 1 flux_train_network.py")


def test_diffusers_flux2_example_step_runs_and_trains_the_trainers_layers(tmp_path):
    """bench_diffusers_flux2 --smoke (a tiny Flux2Transformer2DModel on the CPU): the example's step gives a timed
    row with a finite loss, and the example's default LoRA targets adapt the modules the trainer's FLUX.2 default
    does (the comparison the peers set draws)."""
    import math

    from benchmarks import bench_diffusers_flux2 as bench
    from flux_cp.config.training import LoraConfig
    from flux_cp.families.flux2 import FLUX2
    from flux_cp.model.lora import add_lora

    out = tmp_path / "flux2.json"
    bench.main(["--smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "diffusers_flux2"
    (row,) = data["rows"]
    assert "error" not in row, row
    assert row["s_per_step"] > 0 and row["lora_params"] > 0 and all(math.isfinite(x) for x in row["losses"])

    from diffusers import Flux2Transformer2DModel
    from peft import LoraConfig as PeftLoraConfig

    config = bench.transformer_config(smoke=True)
    theirs = Flux2Transformer2DModel(**config)
    theirs.add_adapter(PeftLoraConfig(r=4, target_modules=bench.example_targets(config["num_single_layers"])))
    ours = Flux2Transformer2DModel(**config)
    add_lora(ours, LoraConfig(lora_layers=tuple(FLUX2.lora_targets(pairs=False, config=config))), seed=0)

    def adapted(model):
        return sorted(
            n.removesuffix(".lora_A.default") for n, _ in model.named_modules() if n.endswith("lora_A.default")
        )

    assert adapted(theirs) == adapted(ours) and adapted(ours)


def test_diffusers_flux2_weights_are_drawn_where_from_pretrained_reads_them():
    """random_checkpoint: from_pretrained (diffusers' own loading, which quantizes on the GPU) gets seeded weights of
    the fan-in scale, the same on every load, and diffusers' file reader is back once the block ends."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.models import model_loading_utils

    from benchmarks import bench_diffusers_flux2 as bench

    config = bench.transformer_config(smoke=True)
    reader = model_loading_utils.load_state_dict
    loaded = []
    for _ in range(2):
        with bench.random_checkpoint(config, seed=0, device=torch.device("cpu")) as root:
            loaded.append(
                Flux2Transformer2DModel.from_pretrained(root, subfolder="transformer", torch_dtype=torch.bfloat16)
            )
    assert model_loading_utils.load_state_dict is reader
    first, second = (dict(m.named_parameters()) for m in loaded)
    weight = first["context_embedder.weight"].float()
    assert abs(weight.std().item() * weight.shape[1] ** 0.5 - 1) < 0.2
    norms = [n for n in first if "norm" in n and n.endswith("weight") and first[n].ndim == 1]
    assert norms and all(torch.equal(first[n], torch.ones_like(first[n])) for n in norms)
    assert all(torch.equal(first[n], second[n]) for n in first)


def test_small_gpu_sets_run_only_flags_the_trainer_accepts(monkeypatch):
    """run.sh's small-GPU sets (peers, pairs, pairs_flux2, table, table_b, picks; printed by DRY_RUN=1): every
    trainer run's flags parse as the trainer parses them, each small-GPU run is capped, and the peers' scripts are
    called. (Whether torchao and bitsandbytes are installed is the GPU machine's matter, not the flags'.)"""
    import shlex
    import subprocess

    from flux_cp.config import flags as config
    from flux_cp.config.parser import parse_config

    monkeypatch.setattr(config, "check_installed", lambda precision: None)

    done = subprocess.run(
        ["bash", "benchmarks/run.sh", "/tmp/dry", "peers", "pairs", "pairs_flux2", "table", "table_b", "picks"],
        cwd=schema.ROOT,
        env={**os.environ, "DRY_RUN": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    lines = done.stdout.splitlines()
    runs = {ln.split(":", 1)[0]: shlex.split(ln.split(":", 1)[1]) for ln in lines if ": accelerate launch" in ln}
    # peers 1, pairs 1, pairs_flux2 1 (named as peers' own), table 4, table_b 3, picks 3 (its nf4 run is table's)
    assert len(runs) == 12, runs
    for name, cmd in runs.items():
        flags = (
            cmd[cmd.index("trainer") + 1 :] if "benchmarks.capped" in cmd else cmd[cmd.index("train_flux_cp.py") + 1 :]
        )
        cfg = parse_config(flags)
        assert cfg.train.offload_blocks in ("0", "auto") and ("--gpu_memory_gib" in flags) == (name != "cp1_2048")
    for script in ("benchmarks.bench_kohya", "benchmarks.bench_diffusers_flux2", "benchmarks.bench_diffusers_qlora"):
        assert any(script in ln for ln in lines), script
