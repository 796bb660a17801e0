"""Hub data sets (datasets.load_dataset replaced by an in-memory set): every row's caption and image is checked,
and a set that cannot be loaded is one line naming the id."""

from __future__ import annotations

import io

import datasets
import pytest
from PIL import Image

from flux_cp.config.training import DataConfig
from flux_cp.data.sources import open_source
from flux_cp.errors import UsageError


def _png(colour) -> dict:
    b = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(b, "PNG")
    return {"bytes": b.getvalue(), "path": None}


def _hub(monkeypatch, images, captions):
    ds = datasets.Dataset.from_dict({"image": images, "text": captions}).cast_column("image", datasets.Image())
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, split, cache_dir: ds)
    return DataConfig(dataset_name="someone/shapes")


def test_every_row_needs_a_string_caption_and_an_image(monkeypatch):
    with pytest.raises(UsageError, match=r"someone/shapes row 1: 'text' is None, not a string"):
        open_source(_hub(monkeypatch, [_png("red"), _png("blue")], ["a", None]))
    source = open_source(_hub(monkeypatch, [_png("red"), None], ["a", "b"]))
    assert source.load(0).getpixel((0, 0)) == (255, 0, 0)
    with pytest.raises(UsageError, match="someone/shapes row 1 has no image in column 'image'"):
        source.load(1)


def test_a_hub_id_that_cannot_be_loaded_is_one_line(monkeypatch):
    def offline(name, config, split, cache_dir):
        raise ConnectionError("Couldn't reach 'someone/shapes' on the Hub (LocalEntryNotFoundError)\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UsageError) as e:
        open_source(DataConfig(dataset_name="someone/shapes"))
    assert str(e.value).startswith(
        "--dataset_name someone/shapes is not a local folder, and datasets cannot load it from the hub "
        "(ConnectionError: Couldn't reach 'someone/shapes' on the Hub (LocalEntryNotFoundError))."
    )
