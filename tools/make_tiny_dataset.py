"""Regenerates data/tiny_shapes: the small image + caption set bundled for the embedded default.

Simple coloured shapes with captions that describe them, mixed sizes and aspect ratios (so aspect
buckets have something to do). Deterministic: `python tools/make_tiny_dataset.py` rewrites the same files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 210, 40),
    "purple": (140, 60, 180),
    "orange": (240, 140, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle")
SIZES = ((96, 96), (128, 128), (128, 96), (96, 128), (160, 96), (112, 112))


def draw(shape: str, fg, bg, size, rng: random.Random) -> Image.Image:
    w, h = size
    img = Image.new("RGB", size, bg)
    d = ImageDraw.Draw(img)
    r = rng.randint(min(w, h) // 5, min(w, h) // 3)
    cx, cy = rng.randint(r, w - r), rng.randint(r, h - r)
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fg)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    return img


OUT = Path(__file__).resolve().parent.parent / "data" / "tiny_shapes"


def main(out: Path = OUT) -> None:
    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    names = list(COLORS)
    rows = []
    for i in range(24):
        shape = SHAPES[i % 3]
        fg, bg = rng.sample(names, 2)
        size = SIZES[i % len(SIZES)]
        name = f"{i:02d}_{fg}_{shape}.png"
        draw(shape, COLORS[fg], COLORS[bg], size, rng).save(out / name, optimize=True)
        rows.append({"file_name": name, "text": f"a {fg} {shape} on a {bg} background"})
    with open(out / "metadata.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
