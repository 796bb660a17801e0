"""Continuing a run whose step count comes from its epochs: resuming it once it has finished changes nothing (the
count is known only once the data is listed), and a larger --num_train_epochs extends it. The demo's own case (a
step count known from the flags) is in test_readme_demos.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from flux_cp.data.sources import BUNDLED_DATA
from tests.launch import in_process

pytestmark = pytest.mark.e2e


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_an_epoch_run_resumed_after_it_finished_changes_nothing_and_more_epochs_extend_it(tmp_path, caplog):
    data = tmp_path / "data"
    data.mkdir()
    for src in sorted(BUNDLED_DATA.glob("*.png"))[:2]:
        shutil.copy(src, data / src.name)
    out = tmp_path / "run"
    flags = ["--output_dir", str(out), "--encodings_dir", str(tmp_path / "cache"), "--instance_data_dir", str(data),
             "--instance_prompt", "a shape", "--report_to", "none", "--validation_prompt", "a shape",
             "--validation_inference_steps", "1", "--num_validation_images", "1",
             "--checkpointing_steps", "5"]  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a process of its own would run it, on a machine the test workers share
    try:
        with caplog.at_level(logging.INFO, logger="flux_cp"):
            code, stderr = in_process(flags)  # one epoch of 2 images: 2 steps
        assert code == 0, stderr[-3000:]
        # the interval flags are checked against the steps once the epoch's are known
        said = "warning: --checkpointing_steps 5 >= the 2 steps of --num_train_epochs 1: only the final checkpoint"
        assert said in caplog.text
        caplog.clear()
        before = _files(out)
        with caplog.at_level(logging.INFO, logger="flux_cp"):
            code, stderr = in_process([*flags, "--resume_from_checkpoint", "latest"])
        assert code == 0, stderr[-3000:]
        assert f"{out} already finished: checkpoint-2 is its last step (2 steps)" in caplog.text
        assert "done:" not in caplog.text and "resumed from" not in caplog.text
        changed = {k for k in before.keys() | _files(out).keys() if before.get(k) != _files(out).get(k)}
        assert changed <= {".flux_cp.lock", ".flux_cp_manifest.json"}, changed  # the claim's lock and record only
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="flux_cp"):
            code, stderr = in_process([*flags, "--resume_from_checkpoint", "latest", "--num_train_epochs", "2"])
        assert code == 0, stderr[-3000:]
        assert f"resumed from {out / 'checkpoint-2'} at step 2" in caplog.text and "done: 4 steps" in caplog.text
    finally:
        torch.set_num_threads(threads)
