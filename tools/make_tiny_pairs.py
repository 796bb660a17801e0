"""Regenerates data/tiny_pairs: the small image-editing pair set bundled for the FLUX.1 Kontext variant of the
embedded default.

Each pair is a coloured shape (the reference) and the same shape, same place, recoloured (the target); the
caption is the edit instruction. Pairs share their size; sizes and aspect ratios vary (so aspect buckets have
something to do). metadata.jsonl names both images per row (`file_name`, `reference_file_name`), the layout
that `datasets`' imagefolder also reads. Deterministic: `python tools/make_tiny_pairs.py` rewrites the same files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from make_tiny_dataset import COLORS, SHAPES, SIZES, draw

OUT = Path(__file__).resolve().parent.parent / "data" / "tiny_pairs"


def main(out: Path = OUT) -> None:
    rng = random.Random(1)
    out.mkdir(parents=True, exist_ok=True)
    names = list(COLORS)
    rows = []
    for i in range(16):
        shape = SHAPES[i % 3]
        before, after, bg = rng.sample(names, 3)
        size = SIZES[i % len(SIZES)]
        place = rng.randrange(1 << 30)  # the same seed draws the same shape at the same place in both images
        reference, target = f"{i:02d}_{before}_{shape}.png", f"{i:02d}_{after}_{shape}_edited.png"
        draw(shape, COLORS[before], COLORS[bg], size, random.Random(place)).save(out / reference, optimize=True)
        draw(shape, COLORS[after], COLORS[bg], size, random.Random(place)).save(out / target, optimize=True)
        rows.append({"file_name": target, "reference_file_name": reference, "text": f"make the {shape} {after}"})
    with open(out / "metadata.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
