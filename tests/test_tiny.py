"""The tiny model builder writes only into a new or empty folder, or one it built before: a folder of the user's
(`--out .`, a folder of notes) is refused with one line and left as it was, for every preset and family."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flux_cp import tiny
from flux_cp.errors import UsageError
from flux_cp.families.builder import MARKER, Recipe, build_once

RECIPE = Recipe("test-v1", "FluxPipeline", {"num_layers": 2, "axes_dims_rope": (4, 6, 6)})


def _write(folder: Path) -> None:
    """A stand-in for a pipeline's save_pretrained: model_index.json and the transformer's config."""
    (folder / "transformer").mkdir()
    (folder / "transformer" / "config.json").write_text(json.dumps({"num_layers": 2, "axes_dims_rope": [4, 6, 6]}))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))


def _calls(folder: Path) -> tuple[Path, list[Path]]:
    built = []
    return build_once(folder, lambda tmp: (built.append(tmp), _write(tmp)), RECIPE), built


def test_builds_into_a_new_or_empty_folder_and_reuses_its_own(tmp_path):
    for folder in (tmp_path / "new" / "model", tmp_path / "empty"):
        if folder.name == "empty":
            folder.mkdir()
        path, built = _calls(folder)
        assert path == folder and len(built) == 1 and built[0].parent == folder.parent and built[0] != folder
        assert json.loads((folder / MARKER).read_text())["recipe"] == "test-v1"
        assert not built[0].exists()  # built aside, renamed into place
        assert not [p for p in folder.parent.iterdir() if p.name.endswith(".tmp")]
        assert _calls(folder)[1] == []  # found, not rebuilt


def test_a_folder_built_before_the_marker_is_reused_and_never_written(tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    _write(folder)
    before = sorted(p.name for p in folder.iterdir())
    assert _calls(folder)[1] == [] and sorted(p.name for p in folder.iterdir()) == before


def test_a_folder_built_by_another_version_of_its_recipe_is_built_again_and_the_log_says_so(tmp_path, caplog):
    """The marker holds the key of the recipe's version (its builder's code and configs): a change to them builds the
    folder again, in place of the earlier build (the builder's own); the same version reuses it."""
    import logging
    import shutil

    from flux_cp.families.builder import recipe_key

    builder = tmp_path / "builder.py"
    builder.write_text("CONFIG = dict(num_layers=2)\n")
    recipe = Recipe("test-v1", "FluxPipeline", {"num_layers": 2}, str(builder))
    folder, built = tmp_path / "model", []

    def build() -> list[Path]:
        built.clear()
        build_once(folder, lambda tmp: (built.append(tmp), _write(tmp)), recipe)
        return built

    caplog.set_level(logging.INFO, logger="flux_cp")
    assert len(build()) == 1 and build() == []
    builder.write_text("CONFIG = dict(num_layers=2, in_channels=8)\n")  # the recipe changed, its name did not
    (folder / "transformer" / "extra.txt").write_text("of the earlier build")
    assert len(build()) == 1 and f"{folder} was built by another version of test-v1: built again" in caplog.text
    assert not (folder / "transformer" / "extra.txt").exists()
    assert json.loads((folder / MARKER).read_text())["key"] == recipe_key(recipe) and build() == []
    (folder / MARKER).write_text(json.dumps({"recipe": "test-v1"}))  # built before the marker held a key
    assert len(build()) == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model") and not p.name.endswith(".lock")]
    shutil.rmtree(folder)


@pytest.mark.parametrize("what", ["notes", "other_recipe", "other_model", "file"])
def test_any_other_folder_is_refused_and_left_as_it_was(tmp_path, what):
    folder = tmp_path / "victim"
    if what == "file":
        folder.write_text("mine")
    else:
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    if what == "other_recipe":
        _write(folder)
        (folder / MARKER).write_text(json.dumps({"recipe": "tiny-flux2-v1"}))
    if what == "other_model":  # a model folder of another kind (another transformer)
        _write(folder)
        (folder / "transformer" / "config.json").write_text(json.dumps({"num_layers": 19}))
    snapshot = {p: p.read_bytes() for p in [folder, *folder.rglob("*")] if p.is_file()}
    with pytest.raises(UsageError, match=f"^--out {folder} ") as e:
        _calls(folder)
    assert "\n" not in str(e.value)
    assert {p: p.read_bytes() for p in [folder, *folder.rglob("*")] if p.is_file()} == snapshot
    if what == "notes":
        assert "holds files this builder did not write (notes.txt)" in str(e.value)
    if what == "other_recipe":
        assert "holds the model of another recipe (tiny-flux2-v1, not test-v1): choose another --out" in str(e.value)


@pytest.mark.parametrize(
    "flags",
    [[], ["--family", "flux2"], ["--family", "flux2-klein"], ["--kontext"], ["--preset", "flux1-dev-shapes"],
     ["--preset", "flux2-dev-shapes"]],
    ids=["flux1", "flux2", "klein", "kontext", "flux1-shapes", "flux2-shapes"],
)  # fmt: skip
def test_the_command_line_refuses_a_folder_of_the_user_s_before_building(tmp_path, monkeypatch, capsys, flags):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("notes")
    assert tiny.main([*flags, "--out", str(victim)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out {victim} holds files this builder did not write (notes.txt)"), err
    assert "\n" not in err and os.listdir(victim) == ["notes.txt"] and (victim / "notes.txt").read_text() == "notes"
    monkeypatch.chdir(victim)  # --out . is the current folder: refused, not wiped
    assert tiny.main([*flags, "--out", "."]) == 2
    assert os.listdir(victim) == ["notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["victim"]  # nothing written beside it (no lock, no build)


def test_the_command_line_writes_no_model_into_a_folder_another_tool_owns(tmp_path, monkeypatch, capsys):
    from flux_cp.outputs import roles

    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip"))
    for out, how in (
        (tmp_path / "pip" / "tiny", "is inside pip's cache"),
        (roles.CHECKOUT / "docs" / "tiny", "is inside " + str(roles.CHECKOUT / "docs")),
    ):
        assert tiny.main(["--out", str(out)]) == 2
        assert capsys.readouterr().err.startswith(f"error: --out {out} {how}")
        assert not out.exists()
    built = tmp_path / "tiny"
    assert tiny.main(["--out", str(built)]) == 0 and tiny.main(["--out", str(built)]) == 0  # its own: reused
