"""README's "Which command for my GPU" table (benchmarks/gpu_table.py): it is what the committed result files render,
each line showing the newest row measured at its GPU size, never a failed row or one of another size."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_table, schema


def test_readme_gpu_table_is_what_the_committed_results_render():
    readme = gpu_table.README.read_text()
    assert gpu_table.current_block(readme) == gpu_table.render(), (
        "README.md's GPU table differs from the result files: python -m benchmarks.gpu_table --write"
    )


def _result(tmp_path, name: str, date: str, rows: list[dict], gpu_gib: float = 79.2) -> None:
    data = schema.result("trainer", rows, command="python -m benchmarks.bench_trainer ...")
    data["date"] = date
    data["hardware"] = {"gpu": "NVIDIA H100 80GB HBM3", "gpus": 1, "gpu_memory_gib": gpu_gib}
    schema.write(tmp_path / name / "trainer.json", data)


def _line(text: str, start: str) -> str:
    (found,) = [ln for ln in text.splitlines() if ln.startswith(start)]
    return found


def test_a_line_shows_the_newest_row_measured_at_its_size(tmp_path):
    fp8 = "--resolution 1024 --gpu_memory_gib 24 --base_precision fp8 --offload_blocks auto --compile"
    row = {"name": "small24_fp8_auto_c", "gpus": 1, "flags": fp8, "peak_gib": 19.05, "planned_peak_gib": 21.54}
    _result(tmp_path, "a", "2026-01-01T00:00:00+00:00", [{**row, "s_per_step": 0.6}])
    _result(tmp_path, "b", "2026-02-01T00:00:00+00:00", [{**row, "s_per_step": 0.5}])
    _result(tmp_path, "c", "2026-03-01T00:00:00+00:00", [{**row, "error": "out of memory"}])  # failed: not shown
    profiled = {**row, "flags": fp8 + " --profile_step 6", "s_per_step": 0.45}  # a profiled step: not a user's
    _result(tmp_path, "c2", "2026-03-02T00:00:00+00:00", [profiled])
    bf16 = "--gpu_memory_gib 24 --gradient_checkpointing --offload_blocks --compile"
    plain = {**row, "name": "small24_bf16_auto_c", "flags": bf16}
    _result(tmp_path, "c3", "2026-03-03T00:00:00+00:00", [{**plain, "s_per_step": 0.7}])
    # Uncapped on a 141 GB GPU: not an 80 GB answer. Capped to 12 GiB: not a 24 GiB one.
    _result(
        tmp_path,
        "d",
        "2026-04-01T00:00:00+00:00",
        [
            {
                "name": "cp1_2048",
                "gpus": 1,
                "flags": "--resolution 2048 --compile",
                "s_per_step": 2.1,
                "peak_gib": 100.0,
            },
            {**row, "flags": fp8.replace("24", "12"), "s_per_step": 0.4},
        ],
        gpu_gib=139.8,
    )
    fake = "--cp_size 2 --resolution 2048 --gradient_checkpointing all --gpu_memory_gib 24 --base_precision fp8"
    _result(
        tmp_path,
        "e",
        "2026-05-01T00:00:00+00:00",
        [
            {
                "name": "small24_fp8_fake2_2048",
                "gpus": 1,
                "fake_peers": 2,
                "flags": fake,
                "s_per_step": 2.2,
                "peak_gib": 16.53,
            },
        ],
    )
    (tmp_path / "e" / "other.json").write_text(json.dumps({"runs": []}))  # another format: skipped

    text = gpu_table.render(gpu_table.trainer_results(tmp_path), root=tmp_path)
    assert _line(text, "| 1 x 24 GB | FLUX.1 [dev], 1024 px (fastest)") == (
        "| 1 x 24 GB | FLUX.1 [dev], 1024 px (fastest) | `--base_precision fp8 --offload_blocks auto --compile` | "
        "0.500 | 19.1 (21.5) | H100, capped to 24 GiB, [2026-02-01](b/trainer.json) |"
    )
    assert _line(text, "| 1 x 24 GB | FLUX.1 [dev], 1024 px (exact").startswith(  # the common command's flag once
        "| 1 x 24 GB | FLUX.1 [dev], 1024 px (exact: the weights as loaded) | `--offload_blocks --compile` | 0.700 |"
    )
    assert (
        _line(text, "| 1 x 80 GB | FLUX.1 [dev]")
        == "| 1 x 80 GB | FLUX.1 [dev], 2048 px | `--compile` | not measured | | |"
    )
    assert _line(text, "| 2 x 24 GB (`ddp_cp2.yaml`) | FLUX.1") == (
        "| 2 x 24 GB (`ddp_cp2.yaml`) | FLUX.1 [dev], 2048 px | `--cp_size 2 --gradient_checkpointing all "
        "--base_precision fp8` | 2.200 | 16.5 | H100, capped to 24 GiB, one rank with loopback peers, "
        "[2026-05-01](e/trainer.json) |"
    )
    assert len([ln for ln in text.splitlines() if ln.startswith("| ") and "GB" in ln]) == len(gpu_table.ENTRIES)


def test_a_profiled_row_answers_only_when_its_profiled_step_was_left_out_of_its_median(tmp_path):
    nf4 = "--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --offload_blocks auto --compile --profile_step 7"
    row = {"name": "small12_nf4_auto_c", "gpus": 1, "flags": nf4, "peak_gib": 9.83}
    line = "| 1 x 12 GB | FLUX.1 [dev], 1024 px (the smallest base)"
    _result(tmp_path, "a", "2026-01-01T00:00:00+00:00", [{**row, "s_per_step": 0.6, "timed_steps": [3, 4, 5, 6]}])
    _result(tmp_path, "b", "2026-02-01T00:00:00+00:00", [{**row, "s_per_step": 0.9, "timed_steps": [4, 5, 6, 7]}])
    _result(tmp_path, "c", "2026-03-01T00:00:00+00:00", [{**row, "s_per_step": 0.8}])  # older: no timed_steps
    text = gpu_table.render(gpu_table.trainer_results(tmp_path), root=tmp_path)
    assert "| 0.600 |" in _line(text, line) and "(a/trainer.json)" in _line(text, line)


def test_a_line_measured_with_its_blocks_left_eager_by_compile_auto_says_so(tmp_path):
    klein = "--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --offload_blocks auto"
    row = {"name": "small12_klein_nf4_auto", "gpus": 1, "flags": klein, "s_per_step": 0.36, "compile": "off"}
    _result(tmp_path, "a", "2026-01-01T00:00:00+00:00", [row])
    text = gpu_table.render(gpu_table.trainer_results(tmp_path), root=tmp_path)
    assert "blocks eager (`--compile auto`" in _line(text, "| 1 x 12 GB | FLUX.2 [klein] 4B, 1024 px (the smallest")
    _result(tmp_path, "b", "2026-02-01T00:00:00+00:00", [{**row, "compile": "on"}])
    text = gpu_table.render(gpu_table.trainer_results(tmp_path), root=tmp_path)
    assert "eager" not in _line(text, "| 1 x 12 GB | FLUX.2 [klein] 4B, 1024 px (the smallest")


def test_write_replaces_only_the_marked_block_and_check_sees_a_stale_one(tmp_path, monkeypatch, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n\n{gpu_table.START}\nold table\n{gpu_table.END}\n\nafter\n")
    monkeypatch.setattr(gpu_table, "README", readme)
    assert gpu_table.main(["--check"]) == 1
    assert "python -m benchmarks.gpu_table --write" in capsys.readouterr().out
    assert gpu_table.main(["--write"]) == 0
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith(f"{gpu_table.END}\n\nafter\n")
    assert gpu_table.current_block(text) == gpu_table.render()
    assert gpu_table.main(["--check"]) == 0
    with pytest.raises(ValueError, match="expected one"):
        gpu_table.replace_block("no markers here", "table")
