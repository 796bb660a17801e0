"""Writes docs/bad_inputs.md from a run of tests/test_bad_inputs.py: every bad input tried, run for real on
this machine (CPU, the tiny default), with the message it got. `python tools/bad_inputs_table.py`.

The cases are the test's; this tool only runs pytest and reads the properties each case records."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "bad_inputs.md"

HEADER = [
    "# Bad inputs and the messages they get",
    "",
    "Every case below is a test (`tests/test_bad_inputs.py`, cases in `tests/bad_input_cases.py`, plus the "
    "failure tests of `tests/test_reliability.py`). This table was written by `python tools/bad_inputs_table.py`, "
    "which runs that test file on the tiny default on CPU and reads what each case got (`<path>` stands for a "
    "scratch folder). Each exits non-zero before training starts (the disk-full case, at the checkpoint), with "
    "one `error:` line and no traceback of ours. Cases refused while the flags are checked run the trainer's entry "
    "point in the test process; the others are launched as users do. Under `accelerate launch` (the cases with "
    "2-3 processes) the launcher exits 1 and then prints its own failure summary (a Python traceback of "
    "`accelerate`/`torch.distributed.elastic`, not of this code), which ends with our line again; run one process "
    "with `python train_flux_cp.py ...` to see only our line.",
    "",
    "| bad input | processes | flags | message | exit code | seconds |",
    "|---|---:|---|---|---:|---:|",
]

FOOTER = [
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
    "| a new run in a folder holding an earlier one | refused before anything loads (`holds an earlier run (...): "
    "pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to replace it, or choose another "
    "folder`); the earlier run's files are untouched. `--overwrite_output_dir` removes the entries of the folder's "
    "manifest (what flux-cp runs wrote) and nothing else; a `--logging_dir` outside the folder is never removed |",
    "| a resume from an earlier checkpoint of a finished run (`checkpoint-2` of 6, another learning rate) | a new "
    "branch: the later checkpoints, final LoRA, loss curve and a copy of metrics.jsonl move to "
    "`abandoned-<date>-<time>/`; metrics.jsonl holds one trajectory, `--checkpoints_total_limit` keeps the branch's "
    "newest checkpoint and `latest` picks it |",
    "| a checkpoint whose DCP metadata names files outside it (`../../other/...`, an absolute path, a link) | "
    "refused before any of them is opened: `--resume_from_checkpoint ...: cannot load it (... leads outside ...)` "
    "(`tests/test_checkpoint_io.py`) |",
    "| two runs at once on one folder | the second is refused: `--output_dir ... is in use by another run (pid N on "
    "HOST, started ...)`; the lock goes with the first run's process, even when it is killed |",
    "| the disk fills up between checkpoints (`FLUX_CP_DISK_BYTES`) | a warning at start when not every "
    "checkpoint fits; the save that no longer fits stops every rank before writing: `not enough disk space for "
    "checkpoint-4: it needs 1.5 MiB, ... Nothing was written; .../checkpoint-2 is the last good checkpoint` (exit 2) |",
    "| validation fails after the last step (`kind=raise_in_validation`) | the final LoRA (or transformer folder) "
    "and then the final checkpoint are already written; validation and the loss curve come last |",
    "| a damaged encoding-cache entry | `cache entry ... cannot be read (...): recomputing it`, and the run goes on |",
    "| a checkpoint whose files would run code when unpickled | refused: `--resume_from_checkpoint ...: cannot load "
    "it (... refusing to load posix.system ...)` (DCP metadata, optimizer entries and train.pt are read without "
    "running code) |",
    "| resume with a changed `--learning_rate` (or AdamW, schedule, loss settings) | applied and logged: `resume: "
    "--learning_rate 0.001 -> 0.0005 (applied from step 3)` |",
]


def rows_from_junit(path: Path) -> list[dict]:
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        failed = case.find("failure") is not None or case.find("error") is not None
        if props:
            rows.append({**props, "failed": failed, "name": case.get("name")})
    return rows


def scrub(text: str, scratch: str) -> str:
    """`text` without this machine's paths: the case's scratch folder and pytest's other temporary folders are
    `<path>`, the repository is the current folder."""
    text = text.replace(scratch, "<path>")
    text = re.sub(r"/tmp/pytest-of-[^/\s]+/pytest-\d+/[^/\s]+?\d+", "<path>", text)
    return text.replace(f"{ROOT}/", "").replace(str(ROOT), ".")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "bad_inputs.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "tests/test_bad_inputs.py", f"--junitxml={junit}",
               "-o", "junit_family=xunit1", "-p", "no:cacheprovider"]  # fmt: skip
        # Every case past the flag checks launched as users do, so that its seconds are what a user waits.
        subprocess.run(cmd, cwd=ROOT, check=False, env={**os.environ, "FLUX_CP_LAUNCH_BAD_INPUTS": "1"})
        rows = rows_from_junit(junit)
    if not rows:
        print("no test results: see pytest's output above", file=sys.stderr)
        return 1
    lines = list(HEADER)
    for r in rows:
        scratch = r["scratch"]
        flags = scrub(r["flags"], scratch)
        message = scrub(r["message"], scratch).replace("|", "\\|")
        if r["failed"]:
            message += " **(test failed)**"
        lines.append(f"| {r['what']} | {r['nproc']} | `{flags}` | {message} | {r['returncode']} | "
                     f"{float(r['seconds']):.0f} |")  # fmt: skip
    OUT.write_text("\n".join(lines + FOOTER) + "\n")
    print(OUT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
