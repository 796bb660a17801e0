"""The archived result folders in the suite's schema (benchmarks/schema.py), so that the renderer shows them too:

    python -m benchmarks.archive.to_schema benchmarks/archive/results/2026-12-01-h200x2-fill OUT_DIR
    python -m benchmarks.render OUT_DIR

Converts what the suite's scripts wrote then: bench_trainer's `trainer*.json`, bench_attention's `attention*.json`
and the `anchors*.jsonl` of diffusers' built-in CP (their `model` lines). The machine and versions come from the
folder's `env.txt` (or the attention file's own), the date from the folder's name; the commit was not recorded, and
the commands are in the folder's `commands.txt` where it has one. Runs of one file that differ only by an
environment variable have the same flags; their names say which (benchmarks/archive/history.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import schema
from benchmarks.bench_attention import COLUMNS as ATTENTION_COLUMNS
from benchmarks.bench_diffusers_cp import COLUMNS as DIFFUSERS_COLUMNS
from benchmarks.bench_trainer import COLUMNS as TRAINER_COLUMNS
from benchmarks.bench_trainer import with_efficiency


def machine(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hardware, software) from env.txt: `NAME, DRIVER, MEMORY MiB` per GPU, then `torch X diffusers Y`."""
    path = folder / "env.txt"
    if not path.is_file():
        return {}, {}
    lines = path.read_text().splitlines()
    gpus = [[f.strip() for f in ln.split(",")] for ln in lines if ln.startswith("NVIDIA")]
    hardware: dict[str, Any] = {}
    if gpus:
        name, driver, memory = gpus[0]
        hardware = {"gpu": name, "gpus": len(gpus), "driver": driver}
        hardware["gpu_memory_gib"] = round(float(memory.split()[0]) / 1024, 1)
    words = next((ln.split() for ln in lines if ln.startswith("torch ")), [])
    return hardware, dict(zip(words[::2], words[1::2]))


def archived(folder: Path, benchmark: str, rows: list[dict], columns: dict, settings: dict | None = None) -> dict:
    hardware, software = machine(folder)
    commands = folder / "commands.txt"
    return {
        "schema": schema.SCHEMA,
        "benchmark": benchmark,
        "command": f"see {commands}" if commands.is_file() else "not recorded",
        "git_commit": None,
        "git_dirty": None,
        "date": folder.name[:10],
        "hardware": hardware,
        "software": software,
        "settings": {"archived": str(folder), **(settings or {})},
        "columns": columns,
        "rows": rows,
    }


def trainer(folder: Path, path: Path) -> dict:
    rows = []
    for run in json.loads(path.read_text())["runs"]:
        row = {"name": run["name"], "gpus": run["gpus"], "config": run["config"], "flags": " ".join(run["extra"])}
        if run.get("fake_peers"):
            row["fake_peers"] = run["fake_peers"]
        if "error" in run:
            row["error"] = run["error"]
        else:
            row.update(s_per_step=round(run["s_per_step"], 4), mfu=round(run["mfu"], 3) if run.get("mfu") else None)
            row.update(peak_gib=round(run["peak_mem_gib"], 2), loss_step1=run["losses"][0] if run["losses"] else None)
        rows.append(row)
    return archived(folder, "trainer", with_efficiency(rows), TRAINER_COLUMNS, {"file": path.name})


def attention(folder: Path, path: Path) -> dict:
    data = json.loads(path.read_text())
    rows = [
        {"tokens": r["tokens"], "gpus": r["gpus"], "impl": r["impl"], "ms": round(r["s"] * 1e3, 3)}
        | ({"efficiency": round(r["efficiency"], 4)} if r.get("efficiency") else {})
        for r in data["rows"]
    ]
    out = archived(folder, "attention", rows, ATTENTION_COLUMNS, {"file": path.name, "compiled": data.get("compiled")})
    env = data.get("env", {})
    out["hardware"] = out["hardware"] or {k: env.get(k) for k in ("gpu", "gpus", "driver")}
    out["software"] = {k: env.get(k) for k in ("python", "torch", "cuda", "cudnn", "diffusers", "accelerate", "peft")}
    return out


def anchors(folder: Path, path: Path) -> dict:
    rows, backends = [], set()
    for line in path.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if r.get("kind") != "model":
            continue
        backends.add(r.get("backend"))
        row = {"name": f"diffusers_{r['mode']}_{r['res']}", "mode": r["mode"], "gpus": r.get("gpus")}
        row.update(resolution=r["res"], tokens=r.get("tokens"))
        if "error" in r:
            row["error"] = r["error"]
        else:
            row.update(s_per_step=round(r["s_per_step"], 4), peak_gib=round(r["peak_gib"], 2))
        rows.append(row)
    settings = {"file": path.name, "attention_backend": ", ".join(sorted(b for b in backends if b))}
    return archived(folder, "diffusers_cp", rows, DIFFUSERS_COLUMNS, settings)


def convert(folder: Path) -> dict[str, dict]:
    """{output file name: result} for every file of the folder this module knows."""
    out = {}
    for path in sorted(folder.glob("trainer*.json")):
        out[path.name] = trainer(folder, path)
    for path in sorted(folder.glob("attention*.json")):
        out[path.name] = attention(folder, path)
    for path in sorted(folder.glob("anchors*.jsonl")):
        out[path.with_suffix(".json").name] = anchors(folder, path)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", type=Path, help="archived result folders")
    p.add_argument("out", type=Path, help="folder for the converted files (one sub-folder per archived folder)")
    args = p.parse_args(argv)
    for folder in args.folders:
        for name, data in convert(folder).items():
            schema.write(args.out / folder.name / name, data)
            print(args.out / folder.name / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
