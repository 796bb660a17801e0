"""Data folders of targets with several reference images each, built from the bundled pairs (shared by the tests
of several references)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PAIRS = Path(__file__).resolve().parent.parent / "data" / "tiny_pairs"


def rows_of_pairs(n: int) -> list[dict]:
    return [json.loads(line) for line in (PAIRS / "metadata.jsonl").read_text().splitlines()[:n]]


def references_folder(folder: Path, n: int = 4, counts: list[int] | None = None) -> Path:
    """`n` targets of the bundled pairs, target r with `counts[r]` references (default 2): its own, then images of
    its own name `second_r.png`, `third_r.png` (copies of other rows' references), in that order."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = rows_of_pairs(16)
    out = []
    for r, row in enumerate(rows[:n]):
        k = counts[r] if counts else 2
        refs = [row["reference_file_name"]]
        for j, name in enumerate(("second", "third")[: k - 1]):
            refs.append(f"{name}_{r}.png")
            shutil.copy(PAIRS / rows[(r + 5 + 3 * j) % 16]["reference_file_name"], folder / refs[-1])
        for name in (row["file_name"], row["reference_file_name"]):
            shutil.copy(PAIRS / name, folder / name)
        out.append({"file_name": row["file_name"], "reference_file_name": refs, "text": row["text"]})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))
    return folder
