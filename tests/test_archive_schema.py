"""benchmarks/archive/to_schema.py: the archived folders converted to the suite's schema and rendered, the figures
of docs/benchmarks.md's 2048 px rows as the renderer shows them."""

from __future__ import annotations

from pathlib import Path

from benchmarks import render, schema
from benchmarks.archive.to_schema import convert

FILL = Path(__file__).resolve().parent.parent / "benchmarks" / "archive" / "results" / "2026-12-01-h200x2-fill"


def test_the_fill_folder_renders_the_figures_of_the_current_table(tmp_path):
    converted = convert(FILL)
    assert set(converted) >= {"trainer_fill.json", "trainer_attn.json", "anchors_fill.json", "anchors_attn.json"}
    for name, data in converted.items():
        schema.write(tmp_path / name, data)
        assert schema.load(tmp_path / name)["hardware"]["gpu"] == "NVIDIA H200"
    rows = {r["name"]: r for r in converted["trainer_fill.json"]["rows"]}
    assert rows["cp2_2048_ro_fill"]["efficiency"] == 0.946 and rows["cp2_2048_ro"]["efficiency"] == 0.939
    lines = render.render([str(tmp_path)]).splitlines()
    fill = "| cp2_2048_ro_fill | `--cp_size 2 --resolution 2048 --compile_mode reduce-overhead` | 2 | 1.2876 | 0.685 |"
    assert any(line.startswith(fill + " 39.07 | 0.946 |") for line in lines), fill
    assert "| diffusers_ulysses_2048 | ulysses | 2 | 2048 | 16896 | 1.6682 | 26.4 |  |" in lines
    assert "| diffusers_ulysses_2048 | ulysses | 2 | 2048 | 16896 | 1.6248 | 26.4 |  |" in lines
