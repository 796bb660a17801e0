"""Data decoding on one process: captions from metadata.jsonl, .txt files or --instance_prompt, clear errors,
crops keyed by the seed alone, pixel ranges, and the data set's fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from flux_cp.config import DataConfig
from flux_cp.data import BUNDLED_DATA, crop_box, open_source, to_pixels
from flux_cp.errors import UsageError
from flux_cp.rng import Stream, generator


def _folder(tmp: Path, n: int = 3) -> tuple[Path, list[str]]:
    tmp.mkdir(parents=True, exist_ok=True)
    names = []
    for src in sorted(BUNDLED_DATA.glob("*.png"))[:n]:
        (tmp / src.name).write_bytes(src.read_bytes())
        names.append(src.name)
    return tmp, names


def test_captions_come_from_metadata_txt_files_or_the_instance_prompt(tmp_path):
    folder, names = _folder(tmp_path / "a")
    rows = [{"file_name": n, "caption": f"shape {i}"} for i, n in enumerate(names)]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = open_source(DataConfig(dataset_name=str(folder), caption_column="caption"))
    assert [s.caption for s in source.samples] == ["shape 0", "shape 1", "shape 2"]
    assert source.load(0).mode == "RGB"

    txt, names = _folder(tmp_path / "b", 2)
    for n in names:
        (txt / n).with_suffix(".txt").write_text(f"  caption of {n}\n")
    assert [s.caption for s in open_source(DataConfig(dataset_name=str(txt))).samples] == [
        f"caption of {n}" for n in names
    ]
    dreambooth = open_source(DataConfig(dataset_name=str(txt), instance_prompt="sks"))
    assert {s.caption for s in dreambooth.samples} == {"sks"}
    assert dreambooth.fingerprint() != open_source(DataConfig(dataset_name=str(txt))).fingerprint()


def test_data_set_problems_are_usage_errors_naming_the_file(tmp_path):
    folder, names = _folder(tmp_path / "a", 2)
    with pytest.raises(UsageError, match="2 images in .* have no caption"):
        open_source(DataConfig(dataset_name=str(folder)))
    (folder / "metadata.jsonl").write_text(json.dumps({"file_name": names[0], "text": "a"}) + "\nnot json\n")
    with pytest.raises(UsageError, match="metadata.jsonl line 2 is not valid JSON"):
        open_source(DataConfig(dataset_name=str(folder)))
    (folder / "metadata.jsonl").write_text(json.dumps({"file_name": names[0], "caption": "a"}) + "\n")
    with pytest.raises(UsageError, match="line 1 has no caption column 'text'"):
        open_source(DataConfig(dataset_name=str(folder)))
    (folder / "broken.png").write_bytes(b"not a png")
    source = open_source(DataConfig(dataset_name=str(folder), instance_prompt="x"))
    broken = [s.ref for s in source.samples].index(str(folder / "broken.png"))
    with pytest.raises(UsageError, match="cannot read image .*broken.png"):
        source.load(broken)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="no images"):
        open_source(DataConfig(dataset_name=str(empty)))


def test_crops_depend_on_the_seed_and_sample_only_and_cover_the_target():
    def box(seed, sample, center=False):
        return crop_box((300, 200), (128, 128), center, generator(Stream.CROP, seed, sample))

    assert box(1, 5) == box(1, 5)
    assert len({box(1, s) for s in range(8)}) > 1, "random crops should vary between samples"
    (rw, rh), (left, top) = box(1, 5)
    assert (rw, rh) == (192, 128) and 0 <= left <= rw - 128 and top == 0
    assert box(1, 5, center=True)[1] == (32, 0)


def test_pixels_are_cropped_flipped_and_in_minus_one_to_one():
    img = Image.new("RGB", (40, 20))
    img.paste((255, 255, 255), (0, 0, 20, 20))  # white left half
    x = to_pixels(img, (16, 16), (32, 16), (8, 0), flip=False)
    assert x.shape == (3, 16, 16) and x.min() >= -1 and x.max() <= 1
    flipped = to_pixels(img, (16, 16), (32, 16), (8, 0), flip=True)
    assert torch.equal(flipped, x.flip(-1))
    assert x[:, :, 0].mean() > 0.9 and x[:, :, -1].mean() < -0.9
