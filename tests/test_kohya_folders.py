"""kohya's data set layout (sub-folders `N_name`, N the repeats): found as sd-scripts finds it, captions and class
tokens as it reads them, and each image N times per epoch (times --repeats), sharing its encodings."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from flux_cp.config.training import DataConfig
from flux_cp.data.encode import Repeated
from flux_cp.data.kohya_folders import kohya_subfolders, list_kohya, mixed_names
from flux_cp.data.schedule import BatchSchedule, Repeats
from flux_cp.data.sources import BUNDLED_DATA, open_source
from flux_cp.errors import UsageError
from tests.test_dreambooth import _listed_schedule

IMAGES = sorted(BUNDLED_DATA.glob("*.png"))


def _image(folder: Path, k: int, caption: str | None = None, ext: str = ".txt") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / IMAGES[k].name
    path.write_bytes(IMAGES[k].read_bytes())
    if caption is not None:
        path.with_suffix(ext).write_text(caption)
    return path


def kohya_folder(root: Path) -> Path:
    """Two N_name folders: `3_sks shape` (a .txt caption, and an image captioned by the folder's name) and
    `1_style_a` (a .caption file of two lines)."""
    _image(root / "3_sks shape", 0, "a white circle\n")
    _image(root / "3_sks shape", 1)
    _image(root / "1_style_a", 2, "a triangle\nsecond line", ext=".caption")
    return root


def test_the_layout_is_found_when_every_sub_folder_is_n_name(tmp_path):
    root = kohya_folder(tmp_path / "k")
    assert [p.name for p in kohya_subfolders(root)] == ["1_style_a", "3_sks shape"]
    (root / ".hidden").mkdir()
    (root / "cache").mkdir()
    assert kohya_subfolders(root, exclude=(root / "cache",)) is not None  # hidden folders and the cache left out
    assert mixed_names(root, exclude=(root / "cache",)) is None
    assert kohya_subfolders(root) is None  # another sub-folder: a plain folder ...
    assert "3_sks shape are named as in kohya's layout" in mixed_names(root)  # ... said in a warning
    (root / "cache").rmdir()
    (root / "metadata.jsonl").write_text("")
    assert kohya_subfolders(root) is None and mixed_names(root) is None  # metadata.jsonl decides
    assert kohya_subfolders(BUNDLED_DATA) is None  # no sub-folders


def test_captions_and_repeats_are_read_as_kohya_reads_them(tmp_path):
    root = kohya_folder(tmp_path / "k")
    _image(root / "0_off", 3, "never read")  # 0 repeats: skipped, as sd-scripts skips it
    (root / "2_empty").mkdir()
    _image(root / "3_sks shape" / "deeper", 4, "not read")  # only the images directly in an N_name folder
    (root / "10_under_scored").mkdir()
    _image(root / "010_under_scored", 5)  # leading zeros: 10; the class token keeps its underscores
    samples, layout = list_kohya(root, kohya_subfolders(root), None)
    got = [(Path(p).relative_to(root).as_posix(), caption, n) for p, caption, n in samples]
    assert got == [
        ("010_under_scored/05_black_triangle.png", "under_scored", 10),
        ("1_style_a/02_yellow_triangle.png", "a triangle", 1),  # the first line of the .caption file
        ("3_sks shape/00_white_circle.png", "a white circle", 3),
        ("3_sks shape/01_black_square.png", "sks shape", 3),  # no caption file: the folder's class token
    ]
    assert layout.skipped == ("0_off (0 repeats)", "10_under_scored (no images)", "2_empty (no images)")
    assert "1 image(s) in folders inside the N_name sub-folders" in layout.warnings[0]
    assert "1 caption file(s)" in layout.warnings[1] and "more than one line" in layout.warnings[1]
    line = layout.describe(2)
    assert line.startswith(
        "kohya layout: 3 folders, 010_under_scored (1 image x 10), 1_style_a (1 image x 1), "
        "3_sks shape (2 images x 3); skipped 0_off (0 repeats)"
    )
    assert "2 images without a caption file captioned with the folder's name" in line
    assert line.endswith("x 2 (--repeats): 34 samples per epoch")  # (10 + 1 + 2 x 3) x 2
    replaced, _ = list_kohya(root, kohya_subfolders(root), "a photo of sks")
    assert {caption for _, caption, _ in replaced} == {"a photo of sks"}  # --instance_prompt replaces every caption


def test_images_beside_the_sub_folders_and_a_layout_without_images_are_refused(tmp_path):
    root = kohya_folder(tmp_path / "k")
    _image(root, 5)
    with pytest.raises(
        UsageError,
        match=r"and 1 image\(s\) beside them \(e\.g\. 05_black_triangle\.png\), which "
        r"kohya does not read: move them into a sub-folder such as .*1_style_a",
    ):
        list_kohya(root, kohya_subfolders(root), None)
    empty = tmp_path / "empty"
    (empty / "0_a").mkdir(parents=True)
    _image(empty / "0_a", 1)
    with pytest.raises(UsageError, match=r"hold no images to train on \(0_a \(0 repeats\)\)"):
        list_kohya(empty, kohya_subfolders(empty), None)


def test_the_data_set_has_each_image_n_times_per_epoch_times_repeats(tmp_path):
    root = kohya_folder(tmp_path / "k")
    source = open_source(DataConfig(dataset_name=str(root)))
    assert [(s.caption, s.repeats) for s in source.samples] == [
        ("a triangle", 1),
        ("a white circle", 3),
        ("sks shape", 3),
    ]
    assert source.copies() == [1, 3, 3] and source.kohya is not None
    assert source.sample_name(2) == "3_sks shape/01_black_square.png"  # the run identity names the folder and so N
    for repeats in (1, 2):
        order = Repeats([0, 1, 2], repeats, source.copies())
        schedule = BatchSchedule(order, 1, seed=3)
        epoch = [order.position(b[0]) for b in schedule.epoch(0)]
        assert Counter(epoch) == {0: repeats, 1: 3 * repeats, 2: 3 * repeats}
        # the schedule of every copy listed, round by round: the batches a list of the copies would give
        listed = [order[t] for t in range(len(order))]
        assert schedule.epoch(1) == _listed_schedule(listed, 1, 3, 1)
    plain = open_source(DataConfig(dataset_name=str(BUNDLED_DATA)))
    assert plain.copies() is None and plain.kohya is None


def test_one_count_for_every_image_is_repeats_of_that_count():
    """A kohya folder of N repeats lists its copies as --repeats N does: the same schedule, so the same training."""
    groups = [0, 1, 0, 2, 1, 0, 0]
    for n, repeats in ((3, 1), (2, 3)):
        kohya = Repeats(groups, repeats, [n] * len(groups))
        plain = Repeats(groups, n * repeats)
        assert list(kohya) == list(plain) and [kohya.position(t) for t in range(len(kohya))] == [
            plain.position(t) for t in range(len(plain))
        ]
        assert BatchSchedule(kohya, 2, seed=4).epoch(0) == BatchSchedule(plain, 2, seed=4).epoch(0)


class _Encoded:
    """Encodings of three samples: sample i's latent is full of i."""

    buckets = [0, 0, 1]

    def load(self, index: int, flip: bool, epoch: int) -> dict:
        return {"latent_mean": torch.full((1,), float(index))}

    def text(self, caption: str) -> dict:
        return {}


def test_copies_share_their_sample_s_encodings():
    repeated = Repeated(_Encoded(), 2, [1, 3, 2])
    assert len(repeated.buckets) == 12
    for t in range(12):
        i = repeated.position(t)
        assert repeated.load(t, False, 0)["latent_mean"].item() == i and repeated.buckets[t] == _Encoded.buckets[i]
    assert Counter(repeated.position(t) for t in range(12)) == {0: 2, 1: 6, 2: 4}
