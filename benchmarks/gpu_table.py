"""README's "Which command for my GPU" table, rendered from the committed result files: for each GPU size and model
the flags to add to one common command, with the step time and peak memory of the newest result row that measured
them (its file linked), or "not measured" and the flags that would measure it.

    python -m benchmarks.gpu_table            # print the table
    python -m benchmarks.gpu_table --write    # write it into README.md between its markers
    python -m benchmarks.gpu_table --check    # exit 1 when README.md's table is not what the results render

Rows are `trainer` rows of the suite's schema (benchmarks/schema.py, written by benchmarks/bench_trainer.py) under
benchmarks/archive/results/. A row answers an entry when its name is one of the entry's, it has a step time (no
`error`) and the step it profiled (`--profile_step`: the profiler slows the step it records) is not among those it
timed (`timed_steps`; older rows without them do not answer), it ran on the
entry's number of GPUs (a rank with loopback peers standing for them) and within the entry's
memory: the `--gpu_memory_gib` cap it ran under, or uncapped the GPU's own memory, between 90% and 100% of the
entry's. Among those the newest file wins. tests/test_gpu_table.py fails when README.md's table differs from this.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.schema import ROOT, load

START = "<!-- gpu-table:start -->"
END = "<!-- gpu-table:end -->"
RESULTS = ROOT / "benchmarks" / "archive" / "results"
README = ROOT / "README.md"
COMMON = (
    "accelerate launch --config_file accelerate_configs/CONFIG train_flux_cp.py \\\n"
    "      --pretrained_model_name_or_path MODEL --dataset_name DATA --resolution PX --rank 16 \\\n"
    "      --mixed_precision bf16 --gradient_checkpointing FLAGS"
)
HIDDEN = ("--resolution", "--gpu_memory_gib")  # a column of their own, and the card the cap stands for
IN_COMMON = ("--gradient_checkpointing",)  # COMMON gives them already (bare: a value after one is kept)


@dataclass(frozen=True)
class Entry:
    gib: int  # the GPU's memory
    gpus: int
    model: str
    resolution: int
    flags: str  # what to add to COMMON (a measured row shows its own)
    names: tuple[str, ...]  # trainer rows that measure it
    note: str = ""

    @property
    def config(self) -> str:
        return "gpu1.yaml" if self.gpus == 1 else "ddp_cp2.yaml"


F1, F2, KLEIN = "FLUX.1 [dev]", "FLUX.2 [dev]", "FLUX.2 [klein] 4B"
ENTRIES = (
    Entry(80, 1, F1, 2048, "--compile", ("cp1_2048",)),
    Entry(48, 1, F1, 2048, "--compile", ("cp1_2048_48gib",)),
    Entry(
        24,
        1,
        F1,
        1024,
        "--base_precision fp8 --offload_blocks auto --compile",
        ("small24_fp8_auto_c", "readme24"),
        "fastest",
    ),
    Entry(24, 1, F1, 1024, "--offload_blocks --compile", ("small24_bf16_auto_c",), "exact: the weights as loaded"),
    Entry(16, 1, F1, 1024, "--base_precision int8 --offload_blocks auto --compile", ("small16_int8_auto_c",)),
    Entry(12, 1, F1, 1024, "--base_precision fp8 --offload_blocks --compile", ("small12_fp8_auto_c",), "fastest"),
    Entry(
        12,
        1,
        F1,
        1024,
        "--base_precision nf4 --offload_blocks auto --compile",
        ("small12_nf4_auto_c", "full12_flux1_nf4_c"),
        "the smallest base",
    ),
    Entry(
        24,
        2,
        F1,
        2048,
        "--cp_size 2 --base_precision fp8 --compile",
        ("small24_fp8_cp2_2048", "small24_fp8_fake2_2048"),
    ),
    Entry(24, 4, F1, 2048, "--cp_size 4 --base_precision fp8 --compile", ("small24_fp8_cp4_2048",)),
    Entry(80, 1, F2, 1024, "--base_precision fp8 --compile", ("flux2_fp8_1024_80gib",)),
    Entry(48, 1, F2, 1024, "--base_precision fp8 --offload_blocks auto --compile", ("small48_flux2_fp8_auto_c",)),
    Entry(24, 1, F2, 1024, "--base_precision fp8 --offload_blocks --compile", ("small24_flux2_fp8_auto_c",), "fastest"),
    Entry(
        24,
        1,
        F2,
        1024,
        "--base_precision nf4 --offload_blocks auto",
        ("small24_flux2_nf4_auto", "full24_flux2_nf4"),
        "the smallest base",
    ),
    Entry(16, 1, KLEIN, 1024, "--base_precision int8 --offload_blocks auto", ("small16_klein_int8_auto",)),
    Entry(
        12, 1, KLEIN, 1024, "--base_precision fp8 --offload_blocks --compile", ("small12_klein_fp8_auto_c",), "fastest"
    ),
    Entry(
        12,
        1,
        KLEIN,
        1024,
        "--base_precision nf4 --offload_blocks auto",
        ("small12_klein_nf4_auto", "full12_klein_nf4"),
        "the smallest base",
    ),
    Entry(24, 2, F2, 1024, "--cp_size 2 --base_precision nf4 --offload_blocks auto", ("small24_flux2_nf4_cp2",)),
    Entry(24, 4, F2, 2048, "--cp_size 4 --base_precision fp8 --offload_blocks auto", ("small24_flux2_fp8_cp4_2048",)),
)


def flag_value(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags and flags.index(name) + 1 < len(flags) else None


def memory_gib(row: dict[str, Any], data: dict[str, Any]) -> float | None:
    """The GPU memory a row ran within: its cap, else the GPU's."""
    cap = flag_value(shlex.split(row.get("flags", "")), "--gpu_memory_gib")
    return float(cap) if cap is not None else data.get("hardware", {}).get("gpu_memory_gib")


def answers(entry: Entry, row: dict[str, Any], data: dict[str, Any]) -> bool:
    if row.get("name") not in entry.names or row.get("error") or not row.get("s_per_step"):
        return False
    flags = shlex.split(row.get("flags") or "")
    if "--profile_step" in flags and (
        "timed_steps" not in row  # older than bench_trainer leaving the profiled step out of its median
        or int(flag_value(flags, "--profile_step") or 0) in row["timed_steps"]
    ):
        return False
    if (row.get("fake_peers") or row.get("gpus", 1)) != entry.gpus:
        return False
    gib = memory_gib(row, data)
    return gib is not None and 0.9 * entry.gib <= gib <= entry.gib


def trainer_results(folder: Path = RESULTS) -> list[tuple[Path, dict[str, Any]]]:
    """Every trainer result file under `folder` (files of other formats are not results of this schema: skipped)."""
    found = []
    for path in sorted(folder.rglob("*.json")):
        try:
            data = load(path)
        except (ValueError, OSError, UnicodeDecodeError):
            continue
        if data.get("benchmark") == "trainer":
            found.append((path, data))
    return found


def newest(entry: Entry, results: list[tuple[Path, dict[str, Any]]]) -> tuple[Path, dict, dict] | None:
    hits = [(str(d.get("date", "")), str(p), p, d, r) for p, d in results for r in d["rows"] if answers(entry, r, d)]
    if not hits:
        return None
    *_, path, data, row = max(hits, key=lambda h: h[:2])
    return path, data, row


def shown_flags(flags: str) -> str:
    words = shlex.split(flags)
    out, i = [], 0
    while i < len(words):
        if words[i] in HIDDEN:
            i += 2
            continue
        if words[i] in IN_COMMON and (i + 1 == len(words) or words[i + 1].startswith("--")):
            i += 1
            continue
        out.append(words[i])
        i += 1
    return shlex.join(out)


def gpu_name(data: dict[str, Any]) -> str:
    name = str(data.get("hardware", {}).get("gpu") or "CPU").removeprefix("NVIDIA ")
    return name.split()[0]


def line(entry: Entry, hit: tuple[Path, dict, dict] | None, root: Path) -> str:
    gpus = f"{entry.gpus} x {entry.gib} GB" + ("" if entry.gpus == 1 else f" (`{entry.config}`)")
    model = f"{entry.model}, {entry.resolution} px" + (f" ({entry.note})" if entry.note else "")
    if hit is None:
        return f"| {gpus} | {model} | `{entry.flags}` | not measured | | |"
    path, data, row = hit
    peak = f"{row['peak_gib']:.1f}" if row.get("peak_gib") is not None else ""
    if row.get("planned_peak_gib") is not None:
        peak += f" ({row['planned_peak_gib']:.1f})"
    cap = memory_gib(row, data)
    where = f"{gpu_name(data)}" + (f", capped to {cap:g} GiB" if "--gpu_memory_gib" in row.get("flags", "") else "")
    if row.get("fake_peers"):
        where += ", one rank with loopback peers"
    if row.get("compile") == "off" and "--compile" not in shlex.split(row.get("flags", "")):
        where += ", blocks eager (`--compile auto` chose off for the run's length)"
    link = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
    measured = f"{where}, [{str(data.get('date', ''))[:10]}]({link})"
    return f"| {gpus} | {model} | `{shown_flags(row['flags'])}` | {row['s_per_step']:.3f} | {peak} | {measured} |"


def render(results: list[tuple[Path, dict[str, Any]]] | None = None, root: Path = ROOT) -> str:
    """The table's markdown, markers excluded."""
    results = trainer_results() if results is None else results
    lines = [
        "**Which command for my GPU.** Each line's flags go at the end of one command (`CONFIG`: `gpu1.yaml` for",
        "one GPU, the line's config for several, with `--num_processes N` for more than 2; `PX`: the line's",
        "resolution):",
        "",
        f"    {COMMON}",
        "",
        "Measured with random weights at the model's shapes, one sample per step, each GPU size by capping a larger",
        "GPU (`benchmarks/capped.py`); peak: the training step's, in brackets what `--plan` planned. Each line links",
        "the newest result file that measured it (`python -m benchmarks.gpu_table --write` renders this table from",
        "them). `--base_precision` needs `pip install -e .[quant]`.",
        "",
        "| GPUs | model | flags | s/step | peak GiB (planned) | measured |",
        "|---|---|---|---:|---:|---|",
    ]
    lines += [line(entry, newest(entry, results), root) for entry in ENTRIES]
    return "\n".join(lines)


def block(text: str) -> str:
    return f"{START}\n{text}\n{END}"


def replace_block(document: str, text: str) -> str:
    """`document` with what lies between its markers replaced by `text` (ValueError without exactly one pair)."""
    if document.count(START) != 1 or document.count(END) != 1 or document.index(START) > document.index(END):
        raise ValueError(f"expected one {START} ... {END} pair")
    head, rest = document.split(START)
    _, tail = rest.split(END)
    return head + block(text) + tail


def current_block(document: str) -> str:
    start, end = document.index(START) + len(START), document.index(END)
    return document[start:end].strip("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="write the table into README.md between its markers")
    p.add_argument("--check", action="store_true", help="exit 1 when README.md's table differs from the results'")
    args = p.parse_args(argv)
    text = render()
    readme = README.read_text()
    if args.write:
        README.write_text(replace_block(readme, text))
    elif args.check:
        if current_block(readme) != text:
            print("error: README.md's GPU table differs from the results: python -m benchmarks.gpu_table --write")
            return 1
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
