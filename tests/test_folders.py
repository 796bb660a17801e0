"""Local data folders: every field of metadata.jsonl and every caption file is checked, hidden files are skipped."""

from __future__ import annotations

import json
import re

import pytest
from PIL import Image

from flux_cp.data.folders import list_folder, read_metadata_file
from flux_cp.errors import UsageError


def _folder(tmp_path, names=("a.png", "b.png")):
    d = tmp_path / "data"
    d.mkdir()
    for n in names:
        (d / n).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(d / n)
    return d


def _meta(d, *rows):
    (d / "metadata.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


# (metadata.jsonl lines, the message's tail after "<path> line N")
BAD_ROWS = [
    (['{"file_name": "a.png", "text": "x"', '{"file_name": "b.png", "text": "y"}'], " is not valid JSON"),
    (['["a.png", "x"]'], " is a JSON list, not an object with 'file_name' and a caption"),
    (['"a.png"'], " is a JSON str, not an object"),
    ([{"text": "x"}], " has no 'file_name'"),
    ([{"file_name": 3, "text": "x"}], " has no 'file_name'"),
    ([{"file_name": "", "text": "x"}], " has no 'file_name'"),
    ([{"file_name": "c.png", "text": "x"}], ": file_name 'c.png' does not exist in"),
    ([{"file_name": "../a.png", "text": "x"}], ": file_name '../a.png' must be a path inside"),
    ([{"file_name": "/etc/passwd", "text": "x"}], ": file_name '/etc/passwd' must be a path inside"),
    ([{"file_name": "metadata.jsonl", "text": "x"}], ": file_name 'metadata.jsonl' is not an image this trainer reads"),
    ([{"file_name": "a.png", "text": "x"}, {"file_name": "./a.png", "text": "y"}],
     ": file_name './a.png' already has a caption on line 1"),
    ([{"file_name": "a.png", "caption": "x"}], " has no caption column 'text' (columns: ['caption', 'file_name'])"),
    ([{"file_name": "a.png", "text": None}], ": 'text' is null, not a string: give every image a caption"),
    ([{"file_name": "a.png", "text": 3}], ": 'text' is 3, not a string"),
    ([{"file_name": "a.png", "text": ["x"]}], ': \'text\' is ["x"], not a string'),
]  # fmt: skip


@pytest.mark.parametrize("rows,tail", BAD_ROWS, ids=[t.strip()[:40] for _, t in BAD_ROWS])
def test_every_bad_metadata_line_is_named(tmp_path, rows, tail):
    d = _folder(tmp_path)
    (d / "b.txt").write_text("b")
    _meta(d, *rows)
    bad_line = 2 if "already has" in tail else 1
    with pytest.raises(UsageError) as e:
        list_folder(d, "text", None)
    assert str(e.value).startswith(f"{d / 'metadata.jsonl'} line {bad_line}{tail}"), str(e.value)


def test_metadata_txt_captions_and_encodings(tmp_path):
    d = _folder(tmp_path, ("a.png", "sub/b.png", "c.jpg", ".hidden.png", "._a.png", ".ipynb_checkpoints/x.png"))
    _meta(d, "\ufeff" + json.dumps({"file_name": "a.png", "text": "ünïcode", "extra": 1}), "",
          {"file_name": "sub/b.png", "text": ""})  # fmt: skip
    (d / "c.txt").write_bytes("\ufeffa cat\n".encode())
    (d / "a.txt").write_text("ignored: metadata.jsonl wins")
    got = [(p.replace(str(d) + "/", ""), c) for p, c in list_folder(d, "text", None)]
    assert got == [("a.png", "ünïcode"), ("c.jpg", "a cat"), ("sub/b.png", "")]
    assert [c for _, c in list_folder(d, "text", "sks dog")] == ["sks dog"] * 3
    (d / "metadata.jsonl").write_bytes(b'{"file_name": "a.png", "text": "caf\xe9"}\n')
    with pytest.raises(UsageError, match=r"metadata.jsonl line 1 is not UTF-8 text \(byte 0xe9\): save it as UTF-8"):
        list_folder(d, "text", None)
    (d / "metadata.jsonl").unlink()
    (d / "a.txt").write_bytes(b"caf\xe9")
    with pytest.raises(UsageError, match=r"a.txt is not UTF-8 text"):
        list_folder(d, "text", None)


def test_missing_captions_and_empty_folders(tmp_path):
    d = _folder(tmp_path)
    (d / "metadata.csv").write_text("file_name,text\na.png,x\n")
    with pytest.raises(UsageError) as e:
        list_folder(d, "text", None)
    assert "2 images in" in str(e.value) and "metadata.csv is not read: convert it to metadata.jsonl" in str(e.value)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "._x.png").write_bytes(b"\x00\x05\x16\x07")  # a macOS resource fork is not an image
    with pytest.raises(UsageError, match="no images"):
        list_folder(tmp_path / "empty", "text", None)


def test_captions_may_hold_unicode_line_separators(tmp_path):
    """JSON lines end at "\\n" only: U+2028, U+2029 and U+0085 are ordinary characters of a JSON string."""
    d = _folder(tmp_path)
    captions = ["two\u2028lines", "a\u2029paragraph and a\u0085next line"]
    rows = [{"file_name": n, "text": c} for n, c in zip(("a.png", "b.png"), captions)]
    (d / "metadata.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert "\u2028" in (d / "metadata.jsonl").read_text()  # the characters themselves, not JSON escapes
    assert [c for _, c in list_folder(d, "text", None)] == captions


def test_images_linked_into_a_blob_store_are_read_through_their_links(tmp_path):
    """The hub cache, git-annex and DVC keep the files elsewhere and link them into the folder: the names in the
    folder count (metadata.jsonl or .txt captions alike); a link that leads nowhere is named, not dropped."""
    store = tmp_path / "store"
    store.mkdir()
    d = tmp_path / "data"
    d.mkdir()
    for n in ("a", "b"):
        Image.new("RGB", (8, 8)).save(store / f"blob-{n}", format="PNG")
        (d / f"{n}.png").symlink_to(store / f"blob-{n}")
    _meta(d, {"file_name": "a.png", "text": "x"}, {"file_name": "b.png", "text": "y"})
    assert [(p.replace(str(d) + "/", ""), c) for p, c in list_folder(d, "text", None)] == [("a.png", "x"),
                                                                                           ("b.png", "y")]  # fmt: skip
    (d / "metadata.jsonl").unlink()
    (d / "a.txt").write_text("x")
    (d / "b.txt").write_text("y")
    assert [c for _, c in list_folder(d, "text", None)] == ["x", "y"]
    (d / "c.png").symlink_to(store / "not-fetched")  # git annex without `git annex get`
    with pytest.raises(UsageError, match=r"c.png is a symbolic link to .*not-fetched, which does not exist"):
        list_folder(d, "text", None)
    _meta(d, {"file_name": "c.png", "text": "z"})
    with pytest.raises(UsageError, match=r"line 1: file_name 'c.png' is a symbolic link to .*, which does not exist"):
        list_folder(d, "text", "one prompt")


def test_a_linked_folder_is_listed_like_a_linked_image_and_a_loop_is_named(tmp_path):
    """A symbolic link to a folder inside the data folder: its images are listed as its name says (they were left
    out without a word, while metadata.jsonl could name them through it); a link back into what is listed already
    (a loop, or a second name of one folder) is refused instead of listing images twice or without end."""
    d, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    for folder, n in ((d, "a"), (elsewhere, "b")):
        folder.mkdir()
        Image.new("RGB", (8, 8)).save(folder / f"{n}.png")
        (folder / f"{n}.txt").write_text(n)
    (d / "linked").symlink_to(elsewhere)
    listed = [(p.replace(str(d) + "/", ""), c) for p, c in list_folder(d, "text", None)]
    assert listed == [("a.png", "a"), ("linked/b.png", "b")]
    (d / ".hidden").symlink_to(d)  # hidden: never listed, so never a loop
    assert len(list_folder(d, "text", None)) == 2
    (d / "again").symlink_to(d)
    with pytest.raises(UsageError, match=r"data/again and .*data are the same folder \(through a symbolic link\): its "
                       r"images would be listed twice, or without end; remove the link"):  # fmt: skip
        list_folder(d, "text", None)


def test_every_path_column_of_pair_metadata_is_checked(tmp_path):
    """The reference column of FLUX.1 Kontext pairs gets the checks of file_name: inside the folder, existing, an
    image; and a target named twice is refused."""
    d = _folder(tmp_path, ("a.png", "b.png", "r.png"))
    Image.new("RGB", (8, 8)).save(tmp_path / "outside.png")
    row = {"file_name": "a.png", "reference_file_name": "r.png", "text": "x"}
    for bad, tail in (
        ({"reference_file_name": "../outside.png"}, "reference_file_name '../outside.png' must be a path inside"),
        ({"reference_file_name": str(tmp_path / "outside.png")}, "must be a path inside"),
        ({"file_name": "../outside.png"}, "file_name '../outside.png' must be a path inside"),
        ({"reference_file_name": "gone.png"}, "reference_file_name 'gone.png' does not exist in"),
        ({"reference_file_name": "metadata.jsonl"}, "is not an image this trainer reads"),
        ({"reference_file_name": 3}, "reference_file_name is 3, not a path relative to"),
    ):  # fmt: skip
        _meta(d, {**row, **bad})
        with pytest.raises(UsageError, match=f"line 1: .*{re.escape(tail)}"):
            read_metadata_file(d)
    _meta(d, row, {**row, "file_name": "./a.png", "text": "y"}, {**row, "file_name": "b.png"})
    with pytest.raises(UsageError, match=r"line 2: file_name './a.png' already has a caption on line 1"):
        read_metadata_file(d)
    _meta(d, row, {**row, "file_name": "b.png"})  # one reference for two targets (two edits of one picture)
    meta = read_metadata_file(d)
    assert [r.files for r in meta.rows] == [{"file_name": "a.png", "reference_file_name": "r.png"},
                                            {"file_name": "b.png", "reference_file_name": "r.png"}]  # fmt: skip
    assert meta.image_columns == ("reference",)


def test_the_encoding_cache_inside_the_data_folder_is_not_listed(tmp_path):
    """(An output folder inside the data folder is refused: tests/test_outdir.py.)"""
    from flux_cp.config.training import DataConfig
    from flux_cp.data.sources import open_source

    d = _folder(tmp_path)
    (d / "cache" / "previews").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(d / "cache" / "previews" / "x.png")
    source = open_source(DataConfig(dataset_name=str(d), encodings_dir=str(d / "cache"), instance_prompt="x"))
    assert [p.replace(str(d) + "/", "") for p in (s.ref for s in source.samples)] == ["a.png", "b.png"]
    assert len(open_source(DataConfig(dataset_name=str(d), no_cache=True, instance_prompt="x"))) == 3
