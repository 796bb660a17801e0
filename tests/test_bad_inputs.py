"""Bad input: exit non-zero with one clear message naming the flag or file, before training, no traceback."""

from __future__ import annotations

import pytest

from tests.bad_input_cases import CASES
from tests.launch import train


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_a_clear_message(case, tmp_path):
    args = case.args(tmp_path)
    base = [
        "--output_dir",
        str(tmp_path / "out"),
        "--cache_dir",
        str(tmp_path / "cache"),
        "--report_to",
        "none",
        "--max_train_steps",
        "2",
    ]
    r = train(case.nproc, *base, *args, timeout=300, extra_env=case.env)
    assert r.returncode != 0
    assert case.expect in r.stderr, r.stderr[-3000:]
    # Ours: one line starting with "error:" (argparse: its usage line and "error:"). No frame of our code.
    assert "flux_cp/" not in r.stderr and 'train_flux_cp.py", line' not in r.stderr, r.stderr[-3000:]
    if case.nproc == 1:
        assert "Traceback" not in r.stderr
    if case.name != "disk_full_while_saving":
        assert "steps:" not in r.stderr, "training started before the error"
