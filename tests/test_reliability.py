"""Crash safety, exact resume (also on another layout), no hangs, non-finite losses, disk full, two nodes."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flux_cp import checkpoint_folders, manifest
from flux_cp.families import FLUX1
from flux_cp.outputs import outdir
from flux_cp.outputs.metrics import read_metrics
from flux_cp.plan import diskspace
from flux_cp.plan.counts import parameter_counts
from tests.launch import (
    ROOT,
    env,
    free_port,
    in_process,
    launch_cmd,
    losses,
    max_rel_weights,
    ok,
    python_cmd,
    run_args,
    train,
    worker_args,
)

pytestmark = pytest.mark.e2e  # every test here launches train_flux_cp.py


def _common(tmp: Path, name: str, steps: int, *extra: str) -> list[str]:
    return run_args(tmp, name, steps, "--seed", "5", "--learning_rate", "1e-3", *extra)


def _weights(run: Path) -> dict:
    return load_file(run / "pytorch_lora_weights.safetensors")


def _complete(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*") if (p / "meta.json").is_file())


# One uninterrupted dp=1 x cp=2 run, shared by the tests that compare against it or resume from it.
# --use_ema: the final weights are the EMA, so the resumes below continue the EMA exactly too (its updates after
# steps 3 and 6 straddle the resume at 4; at 6 the decay is --ema_decay's bound)
EMA = ["--use_ema", "--ema_decay", "0.3", "--ema_update_interval", "3"]
STRAIGHT = ["--cp_size", "2", "--checkpointing_steps", "2", "--lr_scheduler", "cosine", "--lr_warmup_steps", "2",
            "--random_flip", *EMA]  # fmt: skip
STRAIGHT_STEPS = 8


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("straight")
    ok(train(2, *_common(tmp, "straight", STRAIGHT_STEPS, *STRAIGHT)))
    return tmp / "straight"


def test_a_full_disk_a_kill_while_saving_and_a_kill_in_a_step_keep_the_complete_checkpoints_and_resume_exactly(
    tmp_path, straight
):
    """The straight run's flags, interrupted three times, each resumed from `latest`: rank 0's disk fills while it
    writes checkpoint-4 (one line, the previous checkpoint intact, nothing partial left); rank 0 is SIGKILLed while
    writing checkpoint-4 (checkpoint-2 alone looks complete, the half-written one is left as .partial); rank 1 is
    SIGKILLed in the middle of step 5 (checkpoint-4 written, the .partial gone). The last resume ends with the
    uninterrupted run's losses and weights, bit for bit (schedule, flips, noise, AdamW and EMA state restored)."""
    run = tmp_path / "run"
    args = _common(tmp_path, "run", STRAIGHT_STEPS, *STRAIGHT)
    resume = [*args, "--resume_from_checkpoint", "latest"]

    r = train(2, *args, extra_env={"FLUX_CP_FAULT": "rank=0,step=4,kind=enospc_in_save"})
    assert r.returncode != 0
    assert "writing checkpoint-4 failed ([Errno 28] No space left on device" in r.stderr, r.stderr[-3000:]
    assert "checkpoint-2 is intact" in r.stderr
    assert "flux_cp/" not in r.stderr and 'train_flux_cp.py", line' not in r.stderr, "a traceback of ours"
    assert _complete(run) == [2] and not (run / ".checkpoint-4.partial").exists()

    killed = train(2, *resume, extra_env={"FLUX_CP_FAULT": "rank=0,step=4,kind=kill_in_save"})
    assert killed.returncode != 0
    assert _complete(run) == [2], "only the checkpoint written before the kill may look complete"
    assert (run / ".checkpoint-4.partial").is_dir(), "the half-written checkpoint should be left as .partial"

    killed = train(2, *resume, extra_env={"FLUX_CP_FAULT": "rank=1,step=5,kind=kill"})
    assert killed.returncode != 0
    assert _complete(run) == [2, 4] and not (run / "checkpoint-6").exists()
    assert not (run / ".checkpoint-4.partial").exists()

    ok(train(2, *resume))
    assert losses(run) == losses(straight)
    a, b = _weights(run), _weights(straight)
    assert all((a[k] == b[k]).all() for k in a), "resumed weights differ from the uninterrupted run"


def test_resume_on_other_layouts_continues_the_same_trajectory(tmp_path):
    """Written by dp=1 x cp=2 (batch 2 per rank); resumed by dp=1 x cp=1 on one process (batch 2), by dp=2 x cp=1 and
    by dp=2 x cp=2 over 4 processes (ring; batch 1 per rank): the samples of a micro-step (batch x dp) and the
    micro-steps of an optimizer step are the same, so the remaining steps - schedule, losses and final LoRA weights
    (fp32) - must be those of the run that wrote the checkpoint, and each resume says in one line that it is exact.
    This is also the test that dp x cp over 4 processes trains as data parallelism alone does."""
    sched = ["--lr_scheduler", "cosine", "--lr_warmup_steps", "2"]
    ok(
        train(
            2,
            *_common(tmp_path, "cp2", 8, "--cp_size", "2", "--train_batch_size", "2", "--checkpointing_steps", "4",
                     *sched),
        )
    )  # fmt: skip
    ckpt = tmp_path / "cp2" / "checkpoint-4"
    written = [r for r in read_metrics(tmp_path / "cp2" / "metrics.jsonl") if r["step"] > 4]
    exact = ": exact, the same 2 samples per micro-step (--train_batch_size x data-parallel size) and 1 micro-step per "
    layouts = (
        ("cp1", 1, ["--cp_size", "1", "--train_batch_size", "2"], "resume: --cp_size 2 -> 1"),
        ("dp2", 2, ["--cp_size", "1", "--train_batch_size", "1"],
         "resume: --train_batch_size 2 -> 1, data-parallel size 1 -> 2, --cp_size 2 -> 1"),
        ("dp2cp2", 4, ["--cp_size", "2", "--cp_mode", "ring", "--train_batch_size", "1"],
         "resume: --train_batch_size 2 -> 1, data-parallel size 1 -> 2"),
    )  # fmt: skip
    for name, nproc, layout, said in layouts:
        r = ok(train(nproc, *_common(tmp_path, name, 8, *layout, "--resume_from_checkpoint", str(ckpt), *sched)))
        assert said + exact in r.stderr, r.stderr[-3000:]
        # A fork into a new folder starts its metrics.jsonl with the source's rows up to the checkpoint.
        rows = read_metrics(tmp_path / name / "metrics.jsonl")
        assert [r["step"] for r in rows[:4]] == [1, 2, 3, 4]
        rows = [r for r in rows if r["step"] > 4]
        assert [r["step"] for r in rows] == [r["step"] for r in written] == [5, 6, 7, 8]
        assert [r["lr"] for r in rows] == [r["lr"] for r in written], name
        worst = max(abs(r["loss"] - w["loss"]) / abs(w["loss"]) for r, w in zip(rows, written))
        assert worst < 1e-5, f"{name}: losses after resuming differ by {worst:.2e}: {rows} vs {written}"
        assert max_rel_weights(tmp_path / name, tmp_path / "cp2") < 1e-5, name
    assert len({round(w["loss"], 6) for w in written}) > 1, "losses do not change: the check would be blind"


def test_resume_refuses_a_different_global_batch(tmp_path, straight):
    """The straight run's checkpoint-2 (dp=1 x cp=2, global batch 1) resumed by dp=2 x cp=1 (global batch 2)."""
    ckpt = str(straight / "checkpoint-2")
    r = train(2, *_common(tmp_path, "b", 4, "--cp_size", "1", *EMA, "--resume_from_checkpoint", ckpt))
    assert r.returncode != 0  # accelerate launch exits 1 whatever its workers' codes (ours: 2)
    assert "incompatible run (global_batch: checkpoint 1, now 2)" in r.stderr


@pytest.mark.parametrize("changed", ["transformer", "vae"])
def test_a_model_changed_since_the_checkpoint_is_refused_before_any_encoding(tmp_path, changed):
    """A copy of the tiny model trains 2 steps; then one value of its transformer's weights, or its VAE's config,
    changes in place, and the run is resumed with an empty encoding cache: refused naming the component before
    anything is encoded (the cache stays empty), not after the whole encoding phase."""
    from safetensors.torch import save_file

    model = Path(shutil.copytree(FLUX1.embedded_default(pairs=False), tmp_path / "model"))
    tiny = "--resolution 64 --max_sequence_length 32 --report_to none".split()
    flags = ["--pretrained_model_name_or_path", str(model), *tiny, "--output_dir", str(tmp_path / "out")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a process of its own would run it, on a machine the test workers share
    try:
        code, stderr = in_process([*flags, "--encodings_dir", str(tmp_path / "cache"), "--max_train_steps", "2"])
        assert code == 0, stderr[-3000:]
        if changed == "transformer":
            file = model / "transformer" / "diffusion_pytorch_model.safetensors"
            weights = load_file(file)
            name = sorted(weights)[0]
            weights[name] = weights[name] + 1e-3
            save_file(weights, file)
        else:
            config = json.loads((model / "vae" / "config.json").read_text())
            (model / "vae" / "config.json").write_text(json.dumps({**config, "scaling_factor": 0.5}))
        fresh = tmp_path / "fresh-cache"
        code, stderr = in_process(
            [*flags, "--encodings_dir", str(fresh), "--max_train_steps", "3", "--resume_from_checkpoint", "latest"]
        )
    finally:
        torch.set_num_threads(threads)
    assert code != 0
    assert f"incompatible run (the config or weights of {changed} differ from the checkpoint's model)" in stderr
    assert not fresh.exists() or not any(p.is_file() for p in fresh.rglob("*")), "encoded before the refusal"
    assert "encodings:" not in stderr


def test_a_rank_that_raises_stops_every_rank_with_its_name_and_cause(tmp_path):
    t = time.monotonic()
    r = train(
        2, *_common(tmp_path, "raise", 6, "--cp_size", "2"), extra_env={"FLUX_CP_FAULT": "rank=1,step=2,kind=raise"}
    )
    assert r.returncode != 0 and time.monotonic() - t < 120
    assert "error: [rank 1] RuntimeError: injected fault at step 2" in r.stderr


_AGREED_ERROR = """
import os, sys, time
from flux_cp.errors import UsageError
from flux_cp.run.runner import run

def main():
    if os.environ["RANK"] == "0":
        time.sleep(3)  # the main rank gets to the error last, as when it alone builds a model first
    raise UsageError("--resolution 48 gives 9 image tokens", agreed=True)

sys.exit(run(main))
"""


def test_an_error_every_rank_raises_is_printed_once_even_when_another_rank_gets_there_first(tmp_path):
    """Launchers stop every rank as soon as one exits: the main rank's line must not be cut off by another rank
    that raised the same error sooner, and the other rank must not outlive the main one."""
    script = tmp_path / "agreed.py"
    script.write_text(_AGREED_ERROR)
    cmd = python_cmd("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                     *worker_args(script))  # fmt: skip
    t = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=50)
    assert r.returncode != 0 and time.monotonic() - t < 40
    # printed once by the ranks; torchrun's failure report after it quotes the main rank's error file
    printed = [ln for ln in r.stderr.splitlines() if ln.startswith("error: --resolution 48 gives 9 image tokens")]
    assert len(printed) == 1, r.stderr[-2000:]


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


def test_an_output_folder_belongs_to_one_run(tmp_path):
    """One run, then: a new run in its folder is refused and changes nothing; a live run's lock keeps another out;
    --overwrite_output_dir replaces it, recomputing a corrupt cache entry; every file follows the umask."""
    old = os.umask(0o027)
    try:
        ok(train(1, *_common(tmp_path, "run", 2, "--checkpointing_steps", "2")))
    finally:
        os.umask(old)
    run, cache = tmp_path / "run", tmp_path / "cache"
    written = [p for p in [*run.rglob("*"), *cache.rglob("*")] if p.is_file()]
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
    assert set(modes.values()) == {"0o640"}, modes  # 0o666 & ~umask, as open() gives (mkstemp gives 0o600)
    lora = (run / "pytorch_lora_weights.safetensors").read_bytes()

    r = train(1, *_common(tmp_path, "run", 2))
    assert r.returncode == 2 and "steps:" not in r.stderr, r.stderr[-3000:]
    assert f"error: --output_dir {run} holds an earlier run (checkpoint-2, run_config.json, metrics.jsonl" in r.stderr
    assert (run / "pytorch_lora_weights.safetensors").read_bytes() == lora

    outdir.claim(run, "latest", False)  # as if another run were using the folder
    try:
        r = train(1, *_common(tmp_path, "run", 2, "--resume_from_checkpoint", "latest"))
    finally:
        outdir.release(run)
    assert r.returncode == 2 and f"is in use by another run (pid {os.getpid()} on " in r.stderr, r.stderr[-3000:]

    latent = sorted((cache / "latents").glob("*.safetensors"))[0]
    latent.write_bytes(latent.read_bytes()[:40])  # a truncated cache entry
    r = ok(train(1, *_common(tmp_path, "run", 2, "--overwrite_output_dir")))
    removed = next(line for line in r.stderr.splitlines() if "removed the earlier run's outputs (" in line)
    assert "checkpoint-2, " in removed and "pytorch_lora_weights.safetensors" in removed, removed
    assert f"cache entry {latent} cannot be read" in r.stderr and "newly computed: 1 image latent (" in r.stderr
    load_file(latent)


def test_final_outputs_are_written_before_validation_and_the_model_before_the_checkpoint(tmp_path):
    r = train(
        1,
        *_common(tmp_path, "v", 2, "--validation_prompt", "a red circle", "--validation_inference_steps", "1",
                 "--num_validation_images", "1"),
        extra_env={"FLUX_CP_FAULT": "rank=0,step=2,kind=raise_in_validation"},
    )  # fmt: skip
    assert r.returncode != 0 and "injected validation failure at step 2" in r.stderr, r.stderr[-3000:]
    run = tmp_path / "v"
    assert _complete(run) == [2]
    lora = run / "pytorch_lora_weights.safetensors"
    assert lora.stat().st_mtime_ns <= (run / "checkpoint-2" / "meta.json").stat().st_mtime_ns


def test_a_disk_that_fills_up_stops_the_run_at_the_save_that_no_longer_fits(tmp_path):
    from flux_cp.families.flux1 import DEFAULT_TARGETS
    from flux_cp.families.flux1.tiny import TRANSFORMER_CONFIG

    counts = parameter_counts(FLUX1, TRANSFORMER_CONFIG, 16, list(DEFAULT_TARGETS))
    s = diskspace.sizes(counts, False, True, torch.float32, world=1)
    disk = s.checkpoint + s.model + 64 * 1024  # one checkpoint and the final LoRA fit, not two checkpoints
    r = train(1, *_common(tmp_path, "d", 6, "--checkpointing_steps", "2"), extra_env={"FLUX_CP_DISK_BYTES": str(disk)})
    assert r.returncode == 2, r.stderr[-3000:]
    assert "3 checkpoints of 2.0 MiB and the final LoRA need" in r.stderr  # the warning at start
    run = tmp_path / "d"
    assert "error: not enough disk space for checkpoint-4: it needs 2.0 MiB" in r.stderr
    assert f"Nothing was written; {run / 'checkpoint-2'} is the last good checkpoint." in r.stderr
    assert "Traceback" not in r.stderr and _complete(run) == [2] and not (run / ".checkpoint-4.partial").exists()


def test_resume_applies_a_changed_learning_rate_and_says_what_a_weights_only_checkpoint_lacks(tmp_path):
    """Then a resume with a learning rate that diverges (--on_nonfinite skip): the step after it applies an update
    whose weights give non-finite losses from then on. The run did not train: it exits non-zero, writes no
    checkpoint of a skipped step and no final model, and the folder keeps the earlier run's LoRA and card."""
    ok(train(1, *_common(tmp_path, "r", 2, "--checkpointing_steps", "2", "--checkpoint_weights_only")))
    # a weights-only checkpoint holds the LoRA file of its step too
    lora = load_file(tmp_path / "r" / "checkpoint-2" / "pytorch_lora_weights.safetensors")
    assert lora.keys() == load_file(tmp_path / "r" / "pytorch_lora_weights.safetensors").keys()
    r = ok(train(1, *_common(tmp_path, "r", 4, "--checkpointing_steps", "2", "--checkpoint_weights_only",
                             "--resume_from_checkpoint", "latest", "--learning_rate", "5e-4")))  # fmt: skip
    assert "resume: --learning_rate 0.001 -> 0.0005" in r.stderr and "--max_train_steps 2 -> 4" in r.stderr
    assert "has no optimizer state (--checkpoint_weights_only): AdamW's moments start from zero" in r.stderr
    assert [row["lr"] for row in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [1e-3, 1e-3, 5e-4, 5e-4]

    run = tmp_path / "r"
    kept = {name: (run / name).read_bytes() for name in ("pytorch_lora_weights.safetensors", "README.md")}
    r = train(1, *_common(tmp_path, "r", 7, "--checkpointing_steps", "2", "--resume_from_checkpoint", "latest",
                          "--learning_rate", "1e10", "--adam_weight_decay", "0", "--on_nonfinite", "skip"))  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    assert (
        "error: steps 6-7, the last 2 of the run, had a non-finite loss or gradient norm and were skipped" in r.stderr
    )
    assert f"no final model or checkpoint was written, and {run} keeps its earlier outputs. checkpoint-4 is the " in (
        r.stderr
    )
    assert "step 6 was skipped: no checkpoint of it" in r.stderr and "done:" not in r.stderr
    assert _complete(run) == [2, 4] and {name: (run / name).read_bytes() for name in kept} == kept


def test_a_resume_from_an_earlier_checkpoint_branches_and_overwrite_removes_only_the_runs_files(tmp_path):
    """A finished run resumed from its checkpoint-2 with another learning rate: the later branch's checkpoints, final
    LoRA, loss curve and metrics are set aside (renamed, not deleted), metrics.jsonl holds one trajectory, the limit
    never prunes the live branch's newest checkpoint, and `latest` picks it; the model card the user edited in between
    is kept, the new one written beside it. --overwrite_output_dir then removes what the two runs wrote (their
    manifest) and nothing else."""
    run = tmp_path / "run"
    ok(train(1, *_common(tmp_path, "run", 6, "--checkpointing_steps", "2")))
    first = read_metrics(run / "metrics.jsonl")
    edited = (run / "README.md").read_text() + "\nMy notes on this LoRA.\n"
    (run / "README.md").write_text(edited)
    branch = ["--checkpoints_total_limit", "1", "--resume_from_checkpoint", str(run / "checkpoint-2"),
              "--learning_rate", "5e-4"]  # fmt: skip
    r = ok(train(1, *_common(tmp_path, "run", 6, "--checkpointing_steps", "2", *branch)))
    assert "resuming checkpoint-2 while later checkpoints exist: a new branch from step 2" in r.stderr, r.stderr[-3000:]
    assert f"warning: {run}/README.md was edited since flux-cp wrote it: kept; this run's model card is " in r.stderr
    assert (run / "README.md").read_text() == edited and "learning rate | 0.0005" in (
        run / "README.flux-cp.md"
    ).read_text()
    aside = list(run.glob("abandoned-*"))
    moved = ["checkpoint-4", "checkpoint-6", "loss_curve.png", "metrics.jsonl", "pytorch_lora_weights.safetensors"]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == moved
    assert read_metrics(aside[0] / "metrics.jsonl") == first
    rows = read_metrics(run / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6] and rows[:2] == first[:2]
    assert [row["lr"] for row in rows] == [1e-3, 1e-3, 5e-4, 5e-4, 5e-4, 5e-4]
    assert _complete(run) == [6]
    latest = checkpoint_folders.resolve("latest", str(run))
    assert latest == run / "checkpoint-6" and checkpoint_folders.read_meta(latest)["args"]["learning_rate"] == 5e-4
    (run / "notes.txt").write_text("mine")
    (run / "my_validation").mkdir()
    removed = outdir.claim(run, None, True).removed
    assert aside[0].name in removed and "checkpoint-6" in removed
    assert sorted(p.name for p in run.iterdir()) == sorted([outdir.LOCK_NAME, manifest.NAME, "my_validation",
                                                            "notes.txt", "README.md"])  # fmt: skip
    assert (run / "README.md").read_text() == edited  # the user's card: edited, so theirs
    outdir.release(run)
