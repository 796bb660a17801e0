"""The memory-capped checkpointing measurement (benchmarks/bench_memory.py, benchmarks/capped.py): which runs it
plans, how a capped run is launched, and how the table reads the trials."""

from __future__ import annotations

from benchmarks import bench_memory
from benchmarks.bench_trainer import command, parse_run
from benchmarks.capped import cap_fraction
from tests.launch import ROOT, env, python_cmd

H200 = 139.8


def test_trials_run_each_pick_once_under_the_smallest_cap_that_picks_it_then_the_neighbours():
    planned = bench_memory.trials(H200)
    whys = [t["why"] for t in planned]
    assert whys == sorted(whys, key=lambda w: w != "pick")  # every pick before any neighbour
    picks = [(t["layout"], t["resolution"], t["blocks"]) for t in planned if t["why"] == "pick"]
    assert len(picks) == len(set(picks))
    for t in planned:
        cell = bench_memory.plan_cell(t["layout"], t["resolution"], t["cap"], H200)
        assert cell.fits  # nothing planned not to fit is run
        if t["why"] == "pick":
            assert len(cell.blocks) == t["blocks"]
        else:  # fits without the margin, with fewer blocks than the pick
            assert t["blocks"] < len(cell.blocks)
            edge = bench_memory.plan_cell(t["layout"], t["resolution"], t["cap"], H200, margin=1.0)
            assert len(edge.blocks) == t["blocks"] and edge.planned_gib <= (t["cap"] or H200)
    assert ("gpu1", 2048, 0) in picks  # the whole H200 keeps every block at 2048 px
    assert 8 <= len(planned) <= 14


def test_a_capped_run_launches_the_wrapper_with_the_same_memory():
    spec = bench_memory.run_spec({"layout": "fake2", "resolution": 2048, "blocks": 46, "cap": 48.0, "why": "pick"})
    run = parse_run(spec)
    assert run["name"] == "fake2_2048_ck46_cap48"
    cmd = command({**run, "fake_peers": 2}, "MODEL", "WORK", steps=6)
    assert cmd[6:9] == ["-m", "benchmarks.capped", "fake_peers"]
    assert cmd[-6:] == ["--gradient_checkpointing", "auto", "--cp_size", "2", "--gpu_memory_gib", "48"]
    neighbour = bench_memory.run_spec({"layout": "gpu1", "resolution": 2048, "blocks": 16, "cap": 80.0, "why": "n"})
    assert parse_run(neighbour)["extra"][-4:] == ["--gradient_checkpointing", "16", "--gpu_memory_gib", "80"]
    assert command(parse_run(spec.replace("fake2", "gpu1")), "M", "W", 6)[6:9] == ["-m", "benchmarks.capped", "trainer"]
    full = bench_memory.run_spec({"layout": "gpu1", "resolution": 1024, "blocks": 0, "cap": None, "why": "pick"})
    assert command(parse_run(full), "M", "W", 6)[6] == "train_flux_cp.py"
    assert cap_fraction(48, 139.8) == 48 / 139.8 and cap_fraction(141, 139.8) == 1.0


def test_the_table_takes_the_fastest_setting_that_ran_under_each_cap():
    def trial(blocks, cap, **row):
        return row, {"layout": "gpu1", "resolution": 2048, "blocks": blocks, "cap": cap}

    runs = [trial(0, None, s_per_step=2.12, peak_gib=104.9), trial(23, 80.0, s_per_step=2.25, peak_gib=70.0),
            trial(16, 80.0, out_of_memory=True), trial(52, 48.0, s_per_step=2.36, peak_gib=42.0)]  # fmt: skip
    rows = {(r["layout"], r["resolution"], r["cap_gib"]): r for r in bench_memory.table(runs, H200)}
    at80, at48, full = rows[("gpu1", 2048, 80.0)], rows[("gpu1", 2048, 48.0)], rows[("gpu1", 2048, H200)]
    assert at80["pick"] == 23 and at80["measured_gib"] == 70.0 and at80["fastest"] == 23
    assert "out of memory by trial: [16]" in at80["note"]
    assert at48["fastest"] == 52 and at48["fastest_s"] == 2.36
    assert full["pick"] == 0 and full["fastest"] == 0 and full["s_per_step"] == 2.12
    assert "not to fit" in rows[("gpu1", 2048, 24.0)]["note"] and "fastest" not in rows[("gpu1", 2048, 24.0)]


def test_variants_run_each_precision_and_offload_value_once_per_cap():
    trials = bench_memory.variant_trials(bench_memory.variant_flags("fp8,nf4", "auto"), [16.0, 24.0], 1024)
    assert [(t["extra"], t["cap"]) for t in trials] == [
        (("--base_precision", "fp8"), 24.0), (("--base_precision", "fp8"), 16.0),
        (("--base_precision", "nf4"), 24.0), (("--base_precision", "nf4"), 16.0),
        (("--offload_blocks", "auto"), 24.0), (("--offload_blocks", "auto"), 16.0),
    ]  # fmt: skip
    run = parse_run(bench_memory.variant_spec(trials[1]))
    assert run["name"] == "var_base_fp8_1024_cap16"
    assert run["extra"][-6:] == [
        "--gradient_checkpointing",
        "auto",
        "--base_precision",
        "fp8",
        "--gpu_memory_gib",
        "16",
    ]
    assert command(run, "M", "W", 6)[6:9] == ["-m", "benchmarks.capped", "trainer"]


# `python -m benchmarks.bench_memory ARGS`, whose trainer launches fork from the tests' fork server (tests/launch.py)
_FORKED_BENCH_MEMORY = """
import sys
from benchmarks import bench_memory, bench_trainer
from tests.launch import forked

command = bench_trainer.command
bench_trainer.command = lambda *args, **kwargs: forked(command(*args, **kwargs))
bench_memory.main(sys.argv[1:])
"""


def test_the_variants_smoke_run_writes_planned_against_measured_rows(tmp_path):
    """--smoke: the tiny FLUX.1 on the CPU, an int8 base and three blocks offloaded, each one row with the planner's
    pick and the run's measured peak and step time."""
    import json
    import subprocess

    out = tmp_path / "memory.json"
    subprocess.run(python_cmd("-c", _FORKED_BENCH_MEMORY, "--smoke", "--out", str(out)), cwd=ROOT, env=env(),
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    data = json.loads((tmp_path / "memory_variants.json").read_text())
    assert data["benchmark"] == "memory_variants"
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"--base_precision int8", "--offload_blocks 3"}, rows
    for row in rows.values():
        assert "note" not in row and row["s_per_step"] > 0 and row["measured_gib"] > 0 and row["planned_gib"] > 0, row
    assert rows["--offload_blocks 3"]["offloaded"] == 3 and rows["--base_precision int8"]["offloaded"] == 0
