"""Bad input: exit non-zero with one clear message naming the flag or file, before training, no traceback.

Each case records what it ran and the error line it got (pytest's record_property): tools/bad_inputs_table.py
turns a run of this file into docs/bad_inputs.md. Single-process cases call the trainer's entry point in this
process (the same code path as `python train_flux_cp.py`, without a new interpreter's ~8 s of imports); cases of
several processes are launched with `accelerate launch`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from flux_cp.outputs.roles import CHECKOUT
from tests.bad_input_cases import CASES
from tests.launch import in_process, train


def first_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip().startswith(("error:", "train_flux_cp.py: error"))]
    return lines[0] if lines else "(no error line)"


def _scratch(text: str, folder: Path) -> str:
    """A case's message or variable with `{t}` standing for its scratch folder, `{checkout}` for flux-cp's."""
    return text.replace("{t}", str(folder)).replace("{checkout}", str(CHECKOUT))


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=() if c.flags_only else pytest.mark.e2e) for c in CASES],
    ids=[c.name for c in CASES],
)
def test_bad_input_gets_a_clear_message(case, tmp_path, monkeypatch, record_property):
    args = case.args(tmp_path)
    base = [
        "--output_dir",
        str(tmp_path / "out"),
        "--encodings_dir",
        str(tmp_path / "cache"),
        "--report_to",
        "none",
        "--max_train_steps",
        "2",
    ]
    start = time.monotonic()
    # One process: in this process, unless asked to launch as users do (tools/bad_inputs_table.py, for the seconds
    # it reports); flag errors always here.
    if case.flags_only or (case.nproc == 1 and not os.environ.get("FLUX_CP_LAUNCH_BAD_INPUTS")):
        for key, value in case.env.items():
            monkeypatch.setenv(key, _scratch(value, tmp_path))
        returncode, stderr = in_process([*base, *args])
    else:
        variables = {key: _scratch(value, tmp_path) for key, value in case.env.items()}
        r = train(case.nproc, *base, *args, timeout=300, extra_env=variables)
        returncode, stderr = r.returncode, r.stderr
    took = time.monotonic() - start
    for key, value in (("what", case.what), ("nproc", case.nproc), ("flags", " ".join(args)),
                       ("message", first_error(stderr)), ("returncode", returncode), ("seconds", f"{took:.1f}"),
                       ("scratch", str(tmp_path))):  # fmt: skip
        record_property(key, value)
    assert returncode != 0
    assert _scratch(case.expect, tmp_path) in stderr, stderr[-3000:]
    # What the error quotes from files cannot act on the terminal (flux_cp.terminal)
    assert "\x1b" not in first_error(stderr)
    # Ours: one line starting with "error:" (argparse: its usage line and "error:"). No frame of our code.
    assert "flux_cp/" not in stderr and 'train_flux_cp.py", line' not in stderr, stderr[-3000:]
    if case.nproc == 1:
        assert "Traceback" not in stderr
    else:  # accelerate launch: our line first, once; the launcher's own failure report then ends with it again
        lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
        ours = [ln for ln in lines if ln.startswith("error:")]
        assert len(ours) == 1 and lines.index(ours[0]) < lines.index("Traceback (most recent call last):"), stderr
        assert [ln for ln in lines if ln.startswith("traceback :")][-1] == f"traceback : {ours[0]}", stderr[-3000:]
    if case.name != "disk_full_while_saving":
        assert "steps:" not in stderr, "training started before the error"
