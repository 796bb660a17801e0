"""Markdown tables from benchmark result files (the schema of benchmarks/schema.py), one section per file:
what ran (command, commit, hardware, versions, settings), a table of its rows, and each row's own command.

    python -m benchmarks.render RESULTS_DIR [MORE_DIRS_OR_FILES ...] [--out results.md]

A folder stands for the result files directly in it (`*.json` of the schema; other JSON files are skipped with a
note on stderr). Sections come in the order of their dates. Columns: the file's `columns` where it names them,
else every key holding a scalar in any row, in the order first seen; `command` and `flags` are shown as code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.schema import SCHEMA, load

CODE_KEYS = ("command", "flags")  # command-line text


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def cell(value: Any, code: bool = False) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):  # writers round what they measure; shown as stored, up to 6 digits
        return f"{value:.6g}"
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if code and text else text


def columns(data: dict[str, Any]) -> dict[str, str]:
    """Row key -> header."""
    if data.get("columns"):
        return dict(data["columns"])
    keys: dict[str, str] = {}
    for row in data["rows"]:
        for k, v in row.items():
            if k != "command" and k not in keys and _scalar(v):
                keys[k] = k
    return keys


def machine(data: dict[str, Any]) -> str:
    hw, sw = data.get("hardware", {}), data.get("software", {})
    if hw.get("gpu"):
        gpus = f"{hw.get('gpus', 1)}x {hw['gpu']}"
        if hw.get("gpu_memory_gib"):
            gpus += f" ({hw['gpu_memory_gib']} GiB)"
        if hw.get("driver"):
            gpus += f", driver {hw['driver']}"
    else:
        gpus = f"CPU ({hw.get('cpus', '?')} cores)"
    names = ("torch", "cuda", "cudnn", "diffusers", "accelerate", "peft", "transformers", "python")
    versions = ", ".join(f"{n} {sw[n]}" for n in names if sw.get(n) is not None)
    return f"{gpus}; {versions}" if versions else gpus


def section(path: Path, data: dict[str, Any]) -> list[str]:
    commit = data.get("git_commit") or "unknown"
    if data.get("git_dirty"):
        commit += " with local changes"
    lines = [
        f"### {data.get('benchmark', '?')}, {str(data.get('date', '?'))[:10]}",
        "",
        f"`{path}`: {machine(data)}; commit {commit}.",
        "",
        f"Command: `{data.get('command', '?')}`",
        "",
    ]
    settings = {k: v for k, v in data.get("settings", {}).items() if _scalar(v) and v not in (None, "")}
    if settings:
        lines += ["Settings:", "", *(f"- {k}: {cell(v, k in CODE_KEYS)}" for k, v in settings.items()), ""]
    cols = columns(data)
    rows = data["rows"]
    if not rows:
        return [*lines, "No rows.", ""]
    if not cols:
        return [*lines, f"{len(rows)} rows without a scalar value to table.", ""]

    def numeric(key: str) -> bool:
        values = [r.get(key) for r in rows if r.get(key) is not None]
        return bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)

    lines.append("| " + " | ".join(cols.values()) + " |")
    lines.append("|" + "|".join("---:" if numeric(k) else "---" for k in cols) + "|")
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(k), k in CODE_KEYS) for k in cols) + " |")
    lines.append("")
    commands = [(r.get("name", i + 1), r["command"]) for i, r in enumerate(rows) if r.get("command")]
    if commands:
        lines += ["Commands:", "", *(f"- {name}: `{cmd}`" for name, cmd in commands), ""]
    return lines


def result_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.json"))
        elif p.is_file():
            files.append(p)
        else:
            raise SystemExit(f"error: {p} is neither a file nor a folder")
    return files


def render(paths: list[str]) -> str:
    loaded = []
    for f in result_files(paths):
        try:
            loaded.append((f, load(f)))
        except ValueError as e:
            print(f"skipped {e}", file=sys.stderr)
    if not loaded:
        raise SystemExit(f"error: no {SCHEMA} result file in {' '.join(paths)}")
    loaded.sort(key=lambda fd: (str(fd[1].get("date", "")), str(fd[0])))
    lines: list[str] = []
    for f, data in loaded:
        lines += section(f, data)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="result files, or folders of them")
    p.add_argument("--out", default=None, help="write the markdown here instead of printing it")
    args = p.parse_args(argv)
    text = render(args.paths)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
