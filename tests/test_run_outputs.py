"""A run as a diffusers user writes it, launched as users do (2 processes, cp 2): a hub model id found only in the
download cache that --cache_dir names (offline, so every loading call must look there), --encodings_dir, Prodigy
(--optimizer prodigy), validation images and checkpoints. It ends with a summary of its outputs and no third-party
noise; a second run resumes from its first checkpoint and continues exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.launch import ok, train

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outputs")
    _download_cache(tmp / "hf")
    fresh_fonts = {"MPLCONFIGDIR": str(tmp / "matplotlib")}  # matplotlib builds its font cache: the noisy case
    first = ok(train(2, *_flags(tmp, "run"), extra_env=fresh_fonts))
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
    assert f"    pipe = FluxPipeline.from_pretrained({HUB_ID!r}, dtype=dtype)" in tail
    assert f"    pipe.load_lora_weights({str(out)!r}, weight_name='pytorch_lora_weights.safetensors')" in tail


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
