"""A run as a diffusers user writes it, launched as users do (2 processes, cp 2): a hub model id found only in the
download cache that --cache_dir names (offline, so every loading call must look there), --encodings_dir, Prodigy
(--optimizer prodigy), validation images and checkpoints. It ends with a summary of its outputs and no third-party
noise; a second run resumes from its first checkpoint and continues exactly."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests import snippets
from tests.launch import ROOT, env, launch_cmd, ok, train

pytestmark = pytest.mark.e2e

HUB_ID = "flux-cp-tests/tiny-flux"  # exists nowhere but in the test's download cache
# (the last three: torchao's, where it is installed)
NOISE = ("generated new fontManager", "requires torchvision", "Using decoupled weight decay",
         "torch.distributed is disabled", "Failed to load", "is an Enum subclass",
         "Unable to import `torchao`")  # fmt: skip


def _download_cache(root: Path) -> Path:
    """A Hugging Face download cache holding the tiny Flux as the snapshot of HUB_ID's main branch."""
    from flux_cp.families.flux1.tiny import ensure_tiny_pipeline

    repo = root / f"models--{HUB_ID.replace('/', '--')}"
    commit = "0" * 40
    shutil.copytree(ensure_tiny_pipeline(), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root


def _flags(tmp: Path, out: str, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", HUB_ID, "--cache_dir", str(tmp / "hf"), "--encodings_dir",
            str(tmp / "encodings"), "--resolution", "64", "--max_sequence_length", "32", "--cp_size", "2",
            "--optimizer", "prodigy", "--train_batch_size", "2", "--max_train_steps", "4", "--checkpointing_steps", "2",
            "--validation_prompt", "a red circle", "--num_validation_images", "1", "--validation_inference_steps", "2",
            "--output_dir", str(tmp / out), "--report_to", "none", *extra]  # fmt: skip


def _logged(log: Path, *flags: str, extra_env: dict) -> subprocess.CompletedProcess:
    """A launch with its output in a file, as a run in the background writes its log (stderr: the file's text)."""
    with open(log, "w") as f:
        cmd = launch_cmd(2, *flags)
        r = subprocess.run(cmd, cwd=ROOT, env=env(**extra_env), stdout=f, stderr=subprocess.STDOUT, timeout=600)
    return subprocess.CompletedProcess(r.args, r.returncode, "", log.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outputs")
    _download_cache(tmp / "hf")
    fresh_fonts = {"MPLCONFIGDIR": str(tmp / "matplotlib")}  # matplotlib builds its font cache: the noisy case
    first = ok(_logged(tmp / "run.log", *_flags(tmp, "run"), extra_env=fresh_fonts))
    resumed = ok(train(2, *_flags(tmp, "resumed", "--resume_from_checkpoint", str(tmp / "run" / "checkpoint-2"))))
    return tmp, first, resumed


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_component_loads_from_the_download_cache_and_encodings_go_to_their_own_folder(runs):
    tmp, first, _ = runs
    assert "warning: --cache_dir" not in first.stderr  # --encodings_dir given: no deprecated use
    assert (tmp / "encodings" / "latents").is_dir() and (tmp / "encodings" / "text").is_dir()
    assert not (tmp / "hf" / "latents").exists()
    assert json.loads((tmp / "run" / "run_config.json").read_text())["optimizer"] == "prodigy"


def test_the_run_ends_with_a_summary_of_its_outputs_and_how_to_load_them(runs):
    tmp, first, _ = runs
    out = tmp / "run"
    tail = first.stderr[first.stderr.index("done: 4 steps, loss ") :].splitlines()
    assert tail[0].endswith(f"%, the first step against the last). Outputs in {out}:")
    for name in ("pytorch_lora_weights.safetensors", "README.md", "run_config.json", "metrics.jsonl",
                 "loss_curve.png", "validation/", "checkpoint-2/, checkpoint-4/"):  # fmt: skip
        assert any(line.startswith(f"  {name} ") for line in tail), name
        assert (out / name.split(",")[0]).exists()
    assert f"Load the LoRA with diffusers (also in the model card, {out / 'README.md'}):" in tail
    # the base from where the run found it (--cache_dir), not downloaded again: the lines run as pasted, offline
    assert f"    pipe = FluxPipeline.from_pretrained({HUB_ID!r}, cache_dir={str(tmp / 'hf')!r}, dtype=dtype)" in tail
    assert f"    folder = {str(out)!r}  # the run's output folder (moved? its new path here)" in tail
    snippets.check(out, first.stderr, 64)


def test_a_log_file_gets_a_line_per_step_and_no_progress_bars(runs):
    """Its output in a file (not a terminal): a plain line for each step (every step of a run of 4: one every
    max(1, steps // 100)) with its loss, learning rate and time, and no progress bar redrawn with carriage returns -
    the steps', the encoding's or the libraries' while they load weights."""
    tmp, first, _ = runs
    lines = first.stderr.splitlines()
    assert "steps: 0/4, a line every step" in lines
    rows = _rows(tmp / "run")
    for row in rows:
        (line,) = [x for x in lines if x.startswith(f"steps: {row['step']}/4: ")]
        assert line.startswith(f"steps: {row['step']}/4: loss {row['loss']:.4f}, lr {row['lr']:.2e}, "), line
        assert re.search(r", \d+\.\d\d s/step, \d+ tok/s$", line), line
    assert len(rows) == 4 and "\r" not in first.stderr and "it/s]" not in first.stderr
    # what the encoding counts: each image's latent, each distinct caption once (the bundled set: 22 of 24), though
    # the two ranks each encoded the captions of their images
    assert (
        "encodings: 24 samples; newly computed: 24 image latents (one per image, size and flip), 22 caption embeddings "
        f"(one per distinct caption); the rest read from the cache {tmp / 'encodings'}"
    ) in lines


def test_third_party_noise_stays_out_of_the_output(runs):
    _, first, resumed = runs
    for result in (first, resumed):
        for noise in NOISE:
            assert noise not in result.stdout + result.stderr, noise


def test_prodigy_resumes_exactly(runs):
    """Prodigy's state (its step-size estimate, moments, running sums, initial weights) goes through the
    checkpoint: the resumed steps are the uninterrupted run's, to the last bit."""
    tmp, _, resumed = runs
    assert f"resumed from {tmp / 'run' / 'checkpoint-2'} at step 2" in resumed.stderr
    straight = [r for r in _rows(tmp / "run") if r["step"] > 2]
    again = [r for r in _rows(tmp / "resumed") if r["step"] > 2]  # after the source's rows of a fork
    assert [r["step"] for r in again] == [3, 4] and [r["loss"] for r in again] == [r["loss"] for r in straight]
    assert len({r["loss"] for r in _rows(tmp / "run")}) > 1
    a, b = (load_file(tmp / name / "pytorch_lora_weights.safetensors") for name in ("run", "resumed"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # the checkpoint it resumed from holds the LoRA of its step (2 processes, each gathering its part), which the
    # resume checked with the checkpoint's other files and did not need
    meta = json.loads((tmp / "run" / "checkpoint-2" / "meta.json").read_text())
    assert "pytorch_lora_weights.safetensors" in meta["checksums"]["files"]
    at_2 = load_file(tmp / "run" / "checkpoint-2" / "pytorch_lora_weights.safetensors")
    assert at_2.keys() == a.keys() and not all((at_2[k] == a[k]).all() for k in a if "lora_B" in k)
