"""An output folder belongs to one run: earlier runs are refused unless resumed or overwritten; one live run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flux_cp import outdir
from flux_cp.errors import UsageError
from tests.launch import ROOT


def _earlier_run(folder):
    (folder / "checkpoint-2").mkdir(parents=True)
    (folder / "checkpoint-10").mkdir()
    (folder / ".checkpoint-12.partial").mkdir()
    (folder / "metrics.jsonl").write_text("{}\n")
    (folder / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    (folder / "logs").mkdir()
    (folder / "notes.txt").write_text("mine")


def test_an_earlier_run_is_refused_resumed_or_overwritten(tmp_path):
    folder = tmp_path / "out"
    assert outdir.claim(folder, None, False) == []  # new and empty: created
    outdir.release(folder)
    _earlier_run(folder)
    with pytest.raises(UsageError) as e:
        outdir.claim(folder, None, False, ("logs",))
    assert str(e.value) == (
        f"--output_dir {folder} holds an earlier run (3 checkpoints up to .checkpoint-12.partial, metrics.jsonl, "
        "pytorch_lora_weights.safetensors, logs): pass --resume_from_checkpoint latest to continue it, "
        "--overwrite_output_dir to replace it, or choose another folder"
    )
    assert outdir.claim(folder, "latest", False, ("logs",)) == []
    with pytest.raises(UsageError, match="would delete the checkpoint --resume_from_checkpoint latest resumes from"):
        outdir.claim(folder, "latest", True, ("logs",))
    removed = outdir.claim(folder, None, True, ("logs",))
    assert removed == ["checkpoint-2", "checkpoint-10", ".checkpoint-12.partial", "metrics.jsonl",
                       "pytorch_lora_weights.safetensors", "logs"]  # fmt: skip
    assert sorted(p.name for p in folder.iterdir()) == [outdir.LOCK_NAME, "notes.txt"]  # the user's file stays
    outdir.release(folder)


def test_unusable_folders_are_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a folder: choose a folder"):
        outdir.claim(tmp_path / "file", None, False)
    with pytest.raises(UsageError, match=r"file/sub cannot be written \(Not a directory\)"):
        outdir.claim(tmp_path / "file" / "sub", None, False)


def test_a_second_live_run_is_kept_out_until_the_first_ends(tmp_path):
    folder = tmp_path / "out"
    outdir.claim(folder, None, False)
    code = f"from flux_cp import outdir; outdir.claim({str(folder)!r}, 'latest', False)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and f"--output_dir {folder} is in use by another run (pid " in r.stderr, r.stderr
    outdir.release(folder)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
