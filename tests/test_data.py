"""Data decoding on one process: captions from metadata.jsonl, .txt files or --instance_prompt, clear errors,
crops keyed by the seed alone, pixel ranges, and the data set's fingerprint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flux_cp.config.training import DataConfig
from flux_cp.data.buckets import crop_box
from flux_cp.data.sources import BUNDLED_DATA, open_source, reference_column
from flux_cp.errors import UsageError
from flux_cp.images import to_pixels
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


def _pairs(folder: Path, rows: list[dict]) -> Path:
    """A pair folder of the bundled pair set's images, with the given metadata rows."""
    pairs = BUNDLED_DATA.parent / "tiny_pairs"
    folder.mkdir(parents=True, exist_ok=True)
    for src in sorted(pairs.glob("*.png"))[:4]:
        (folder / src.name).write_bytes(src.read_bytes())
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_pair_metadata_gets_the_checks_of_plain_metadata(tmp_path):
    """A target or reference outside the folder, and a target named twice, are refused as in plain metadata."""
    names = sorted(p.name for p in (BUNDLED_DATA.parent / "tiny_pairs").glob("*.png"))[:4]
    (tmp_path / "outside.png").write_bytes((BUNDLED_DATA.parent / "tiny_pairs" / names[0]).read_bytes())
    good = {"file_name": names[1], "reference_file_name": names[0], "text": "edit"}
    for rows, message in (
        ([{**good, "file_name": "../outside.png"}], "line 1: file_name '../outside.png' must be a path inside"),
        ([{**good, "reference_file_name": str(tmp_path / "outside.png")}], "line 1: reference_file_name '/"),
        ([good, {**good, "file_name": f"./{names[1]}"}], f"line 2: file_name './{names[1]}' already has a caption"),
    ):  # fmt: skip
        folder = _pairs(tmp_path / "pairs", rows)
        with pytest.raises(UsageError, match=re.escape(message)):
            open_source(DataConfig(dataset_name=str(folder)))


def test_a_metadata_line_that_is_not_an_object_is_named_before_pairs_are_detected(tmp_path):
    folder, names = _folder(tmp_path / "a", 2)
    (folder / "metadata.jsonl").write_text(json.dumps({"file_name": names[0], "text": "a"}) + "\n42\n")
    with pytest.raises(UsageError, match=r"metadata.jsonl line 2 is a JSON int, not an object"):
        reference_column(DataConfig(dataset_name=str(folder)))


def test_the_data_fingerprint_is_names_and_content_not_the_path_string(tmp_path, monkeypatch):
    """The same folder by a relative and an absolute path is the same data set; changed pixels under the same
    names are another one."""
    folder, names = _folder(tmp_path / "a", 3)
    for n in names:
        (folder / n).with_suffix(".txt").write_text(f"caption of {n}")
    monkeypatch.chdir(tmp_path)
    relative = open_source(DataConfig(dataset_name="a")).fingerprint()
    assert open_source(DataConfig(dataset_name=str(folder))).fingerprint() == relative
    (folder / names[1]).write_bytes((folder / names[2]).read_bytes())  # other pixels, same name and caption
    assert open_source(DataConfig(dataset_name="a")).fingerprint() != relative


def test_an_extreme_aspect_ratio_resizes_only_the_crop(monkeypatch):
    """A 1 x 100,000 px image covering a 1024 px square would be resized to 1024 x 102,400,000 px (300 GB) before
    the crop; only the crop box is resized, and ordinary images keep the exact pixels of resize-then-crop."""
    sizes = []
    resize = Image.Image.resize

    def spy(self, size, *a, **k):
        assert size[0] * size[1] <= 64 * 1024 * 1024, f"resizing to {size}"
        sizes.append(size)
        return resize(self, size, *a, **k)

    monkeypatch.setattr(Image.Image, "resize", spy)
    tall = Image.linear_gradient("L").resize((1, 256)).resize((1, 100_000)).convert("RGB")
    target = (1024, 1024)
    resized, offset = crop_box(tall.size, target, False, generator(Stream.CROP, 0, 0))
    assert resized == (1024, 102_400_000)
    x = to_pixels(tall, target, resized, offset, flip=False)
    assert x.shape == (3, 1024, 1024) and x.min() >= -1 and x.max() <= 1
    # the crop is a thin band of the gradient: nearly one grey
    assert float(x.max() - x.min()) < 0.05
    img = Image.open(sorted(BUNDLED_DATA.glob("*.png"))[0]).convert("RGB").resize((90, 60))
    resized, offset = crop_box(img.size, (32, 32), False, generator(Stream.CROP, 0, 1))
    expected = np.asarray(resize(img, resized, Image.BICUBIC).crop((*offset, offset[0] + 32, offset[1] + 32)))
    got = to_pixels(img, (32, 32), resized, offset, flip=False)
    assert torch.equal(got, torch.from_numpy(expected.astype(np.float32) / 127.5 - 1.0).permute(2, 0, 1))


def test_captions_flux1_cuts_are_counted_once_per_window():
    """T5's window is --max_sequence_length and CLIP's 77 tokens: captions either cuts are counted in a line each
    (FluxPipeline cuts them; the trainer did so without a word)."""
    from transformers import CLIPTokenizer, T5TokenizerFast

    from flux_cp.families.flux1 import FLUX1, Flux1Encoders

    folder = FLUX1.embedded_default(pairs=False)
    enc = Flux1Encoders.__new__(Flux1Encoders)  # the tokenizers are all this reads
    enc.tokenizer = CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer")
    enc.tokenizer_2 = T5TokenizerFast.from_pretrained(folder, subfolder="tokenizer_2")
    captions = ["a red circle", "a red circle on a blue square " * 3, "word " * 100]
    assert enc.truncation_warnings(captions[:1], 32) == []
    t5, clip = enc.truncation_warnings(captions, 32)
    assert re.fullmatch(r"warning: 2 of 3 captions do not fit in T5's 32 tokens \(--max_sequence_length\) and are "
                        r"cut there \(the longest needs \d+ tokens\): raise --max_sequence_length \(at most 512\) or "
                        r"shorten them", t5), t5  # fmt: skip
    assert clip.startswith("warning: 1 of 3 captions do not fit in CLIP's 77 tokens and are cut there (the longest")
