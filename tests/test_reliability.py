"""Crash safety, exact resume (also on another layout), no hangs, non-finite losses, disk full, two nodes."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flux_cp.metrics import read_metrics
from tests.launch import ROOT, env, free_port, launch_cmd, losses, ok, run_args, train

pytestmark = pytest.mark.e2e  # every test here launches train_flux_cp.py


def _common(tmp: Path, name: str, steps: int, *extra: str) -> list[str]:
    return run_args(tmp, name, steps, "--seed", "5", "--learning_rate", "1e-3", *extra)


def _weights(run: Path) -> dict:
    return load_file(run / "pytorch_lora_weights.safetensors")


def _complete(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*") if (p / "meta.json").is_file())


# One uninterrupted dp=1 x cp=2 run, shared by the tests that compare against it or resume from it.
STRAIGHT = ["--cp_size", "2", "--checkpointing_steps", "2", "--lr_scheduler", "cosine", "--lr_warmup_steps", "2"]
STRAIGHT_STEPS = 8


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("straight")
    ok(train(2, *_common(tmp, "straight", STRAIGHT_STEPS, *STRAIGHT)))
    return tmp / "straight"


def test_kill_while_writing_a_checkpoint_keeps_the_previous_one_and_resume_is_exact(tmp_path, straight):
    args = STRAIGHT
    killed = train(
        2, *_common(tmp_path, "run", 8, *args), extra_env={"FLUX_CP_FAULT": "rank=0,step=4,kind=kill_in_save"}
    )
    assert killed.returncode != 0
    run = tmp_path / "run"
    assert _complete(run) == [2], "only the checkpoint written before the kill may look complete"
    assert (run / ".checkpoint-4.partial").is_dir(), "the half-written checkpoint should be left as .partial"
    ok(train(2, *_common(tmp_path, "run", 8, *args, "--resume_from_checkpoint", "latest")))
    assert losses(run) == losses(straight)
    a, b = _weights(run), _weights(straight)
    assert all((a[k] == b[k]).all() for k in a), "resumed weights differ from the uninterrupted run"
    assert not (run / ".checkpoint-4.partial").exists()


def test_resume_on_other_layouts_continues_the_same_trajectory(tmp_path):
    """Written by dp=1 x cp=2 (batch 2 per rank); resumed by dp=2 x cp=1 and by dp=2 x cp=2 (batch 1 per
    rank): the global batch is the same, so the remaining steps must give the same losses."""
    ok(
        train(
            2, *_common(tmp_path, "cp2", 8, "--cp_size", "2", "--train_batch_size", "2", "--checkpointing_steps", "4")
        )
    )
    ckpt = tmp_path / "cp2" / "checkpoint-4"
    reference = [r["loss"] for r in read_metrics(tmp_path / "cp2" / "metrics.jsonl") if r["step"] > 4]
    for name, nproc, cp in (("dp2", 2, "1"), ("dp2cp2", 4, "2")):
        ok(
            train(
                nproc,
                *_common(
                    tmp_path, name, 8, "--cp_size", cp, "--train_batch_size", "1", "--resume_from_checkpoint", str(ckpt)
                ),
            )
        )
        got = losses(tmp_path / name)
        assert len(got) == len(reference) == 4
        worst = max(abs(x - y) / abs(y) for x, y in zip(got, reference))
        assert worst < 1e-5, f"{name}: losses after resuming differ by {worst:.2e}: {got} vs {reference}"


def test_resume_refuses_a_different_global_batch(tmp_path, straight):
    """The straight run's checkpoint-2 (dp=1 x cp=2, global batch 1) resumed by dp=2 x cp=1 (global batch 2)."""
    r = train(
        2, *_common(tmp_path, "b", 4, "--cp_size", "1", "--resume_from_checkpoint", str(straight / "checkpoint-2"))
    )
    assert r.returncode != 0  # accelerate launch exits 1 whatever its workers' codes (ours: 2)
    assert "incompatible run (global_batch: checkpoint 1, now 2)" in r.stderr


def test_a_rank_that_raises_stops_every_rank_with_its_name_and_cause(tmp_path):
    t = time.monotonic()
    r = train(
        2, *_common(tmp_path, "raise", 6, "--cp_size", "2"), extra_env={"FLUX_CP_FAULT": "rank=1,step=2,kind=raise"}
    )
    assert r.returncode != 0 and time.monotonic() - t < 120
    assert "error: [rank 1] RuntimeError: injected fault at step 2" in r.stderr


def test_a_hung_rank_makes_the_others_exit_within_the_collective_timeout(tmp_path):
    t = time.monotonic()
    r = train(
        2,
        *_common(tmp_path, "hang", 6, "--cp_size", "2", "--collective_timeout", "15"),
        extra_env={"FLUX_CP_FAULT": "rank=1,step=2,kind=hang"},
        timeout=300,
    )
    elapsed = time.monotonic() - t
    assert r.returncode != 0
    assert elapsed < 120, f"took {elapsed:.0f}s with a 15 s collective timeout"
    assert "error: [rank 0] a collective operation failed" in r.stderr


def test_a_nan_loss_stops_the_run_before_any_checkpoint_of_it(tmp_path):
    r = train(
        2,
        *_common(tmp_path, "nan", 6, "--cp_size", "2", "--checkpointing_steps", "1"),
        extra_env={"FLUX_CP_FAULT": "rank=1,step=3,kind=nan"},
    )
    assert r.returncode != 0, r.stderr[-2000:]
    assert "error: non-finite loss (nan) or gradient norm (nan) at step 3; no checkpoint was written for it" in r.stderr
    assert _complete(tmp_path / "nan") == [1, 2]


def test_a_nan_loss_is_skipped_when_asked(tmp_path):
    ok(
        train(
            2,
            *_common(tmp_path, "skip", 5, "--cp_size", "2", "--on_nonfinite", "skip"),
            extra_env={"FLUX_CP_FAULT": "rank=1,step=3,kind=nan"},
        )
    )
    rows = read_metrics(tmp_path / "skip" / "metrics.jsonl")
    assert [r["skipped"] for r in rows] == [False, False, True, False, False]
    w = _weights(tmp_path / "skip")
    assert all(v.isfinite().all() for v in w.values())


def test_disk_full_while_saving_fails_cleanly_and_keeps_the_previous_checkpoint(tmp_path):
    r = train(
        2,
        *_common(tmp_path, "full", 6, "--cp_size", "2", "--checkpointing_steps", "2"),
        extra_env={"FLUX_CP_FAULT": "rank=0,step=4,kind=enospc_in_save"},
    )
    assert r.returncode != 0
    assert "writing checkpoint-4 failed ([Errno 28] No space left on device" in r.stderr
    assert "checkpoint-2 is intact" in r.stderr
    assert "flux_cp/" not in r.stderr and 'train_flux_cp.py", line' not in r.stderr, "a traceback of ours"
    run = tmp_path / "full"
    assert _complete(run) == [2] and not (run / ".checkpoint-4.partial").exists()
    ok(
        train(
            2,
            *_common(
                tmp_path,
                "full",
                6,
                "--cp_size",
                "2",
                "--checkpointing_steps",
                "2",
                "--resume_from_checkpoint",
                "latest",
            ),
        )
    )


def test_two_nodes_on_loopback_train_like_one(tmp_path, straight):
    """Two launchers (one process each) meet over loopback rendezvous and form one CP group across the
    'node' boundary; the losses equal the single-node cp=2 run (the straight run, same flags)."""
    port = str(free_port())
    out = tmp_path / "two_nodes"
    nargs = _common(tmp_path, "two_nodes", STRAIGHT_STEPS, *STRAIGHT)
    procs = []
    for node in (0, 1):
        launcher = ("--num_machines", "2", "--machine_rank", str(node), "--main_process_ip", "127.0.0.1",
                    "--main_process_port", port)  # fmt: skip
        procs.append(subprocess.Popen(launch_cmd(2, *nargs, launcher=launcher), cwd=ROOT, env=env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    results = [p.communicate(timeout=400) for p in procs]
    for p, (_, e) in zip(procs, results):
        assert p.returncode == 0, e[-4000:]
    assert "world 2 = dp 1 x cp 2" in results[0][1] + results[0][0]
    assert losses(out) == losses(straight)
    json.loads((out / f"checkpoint-{STRAIGHT_STEPS}" / "meta.json").read_text())
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
