"""Writes docs/bad_inputs.md: every bad input of tests/bad_input_cases.py, run for real on this machine
(CPU, the tiny default), with the message it got. `python tools/bad_inputs_table.py`."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.bad_input_cases import CASES  # noqa: E402
from tests.launch import train  # noqa: E402


def first_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip().startswith(("error:", "train_flux_cp.py: error"))]
    return lines[0] if lines else "(no error line!)"


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            t = Path(tmp) / case.name
            args = case.args(t)
            base = [
                "--output_dir",
                str(t / "out"),
                "--cache_dir",
                str(Path(tmp) / "cache"),
                "--report_to",
                "none",
                "--max_train_steps",
                "2",
            ]
            start = time.monotonic()
            r = train(case.nproc, *base, *args, timeout=300, extra_env=case.env)
            took = time.monotonic() - start
            shown = " ".join(a if str(tmp) not in a else "<path>" for a in args)
            ours = "Traceback" not in r.stderr.split("torch.distributed.elastic")[0] or case.nproc > 1
            message = first_error(r.stderr).replace(str(tmp), "<path>").replace("|", "\\|")
            rows.append((case.what, case.nproc, shown, message, r.returncode, took, ours))
            print(case.name, r.returncode, f"{took:.1f}s", first_error(r.stderr)[:100], flush=True)
    lines = [
        "# Bad inputs and the messages they get",
        "",
        "Every case below is a test (`tests/test_bad_inputs.py`, cases in `tests/bad_input_cases.py`, plus the "
        "failure tests of `tests/test_reliability.py`). This table was written by `python tools/bad_inputs_table.py`, "
        "which runs each case on the tiny default on CPU (`<path>` stands for a scratch folder). Each exits non-zero "
        "before training starts (the disk-full case, at the checkpoint), with one `error:` line and no traceback "
        "of ours. Under `accelerate launch` (the cases with 2-3 processes) the launcher exits 1 and then prints "
        "its own failure summary (a Python traceback of `accelerate`/`torch.distributed.elastic`, not of this "
        "code); run one process with `python train_flux_cp.py ...` to see only our line.",
        "",
        "| bad input | processes | flags | message | exit code | seconds |",
        "|---|---:|---|---|---:|---:|",
    ]
    for what, n, shown, msg, rc, took, _ in rows:
        lines.append(f"| {what} | {n} | `{shown}` | {msg} | {rc} | {took:.0f} |")
    lines += [
        "",
        "Failures during training, tested in `tests/test_reliability.py`:",
        "",
        "| failure | what every rank does |",
        "|---|---|",
        "| a rank raises (`FLUX_CP_FAULT=rank=1,step=2,kind=raise`) | rank 1 prints `error: [rank 1] RuntimeError: "
        "injected fault at step 2` and its traceback (a bug, not a usage error); the launcher stops the others "
        "at once |",
        "| a rank hangs (`kind=hang`, `--collective_timeout 15`) | the others print `error: [rank 0] a collective "
        "operation failed (...)` within the timeout; the launcher then stops the hung one (test: under 2 min "
        "in all) |",
        "| a rank is killed (`kind=kill`, SIGKILL) | the launcher stops the others; `--resume_from_checkpoint "
        "latest` continues from the last complete checkpoint |",
        "| killed while writing a checkpoint (`kind=kill_in_save`) | the half-written `.checkpoint-N.partial` is "
        "never picked by `latest` and is removed by the next save |",
        "| NaN loss on one rank (`kind=nan`) | every rank stops: `error: non-finite loss (nan) or gradient norm "
        "(nan) at step 3; no checkpoint was written for it...` (exit 3); with `--on_nonfinite skip` the step is "
        "skipped and marked `skipped` in metrics.jsonl |",
    ]
    (ROOT / "docs" / "bad_inputs.md").write_text("\n".join(lines) + "\n")
    print(ROOT / "docs" / "bad_inputs.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
