"""One launch of the embedded default with wandb offline and `--lora_format kohya`: every step's scalars and the
validation images (before training and at the end) reach the wandb run file, and the LoRA file is in kohya's
layout, complete under ComfyUI's key rules, the same in the final checkpoint, and loaded by the lines of the model
card and of the log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from wandb.proto import wandb_internal_pb2  # requirements-test.txt

from tests import snippets
from tests.launch import comfy_lora_prefixes, comfy_not_loaded, losses, ok, run_args, train


def _records(path: Path):
    """The protobuf records of a `.wandb` run file (a LevelDB-style log: 32 KiB blocks of chunks, each with a
    7-byte header of checksum, length and type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4), after a 7-byte file header."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""
        elif kind == 0:
            pending = b""


@pytest.mark.e2e
def test_wandb_offline_logs_scalars_and_validation_images_and_a_kohya_lora_is_written(tmp_path):
    # The tiny model's single blocks are not FLUX.1's size, so diffusers could not split their linear1 back: the
    # kohya file gets a double block's fused q/k/v, the MLPs and the single blocks' linear2
    # (flux_cp.families.lora_format).
    layers = ",".join(["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "ff.net.2",
                       "single_transformer_blocks.0.proj_out"])  # fmt: skip
    args = run_args(tmp_path, "wb", 2, "--report_to", "wandb", "--lora_format", "kohya", "--lora_layers", layers,
                    "--validation_prompt", "a red circle", "--num_validation_images", "1", "--validation_steps", "2",
                    "--validation_inference_steps", "2", "--validation_resolution", "64")  # fmt: skip
    result = ok(
        train(1, *args, extra_env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"})
    )
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    history = []
    for record in _records(runs[0]):
        if record.WhichOneof("record_type") == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    assert [h["_step"] for h in history] == [0, 1, 2], history
    before, steps = history[0], history[1:]
    for h in steps:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gib"} <= set(h), h
    assert [h["loss"] for h in steps] == pytest.approx(losses(tmp_path / "wb"), rel=1e-6)
    for images in (before, steps[-1]):  # the embedded default renders before training too
        assert images["validation/_type"] == "images/separated" and images["validation/captions"] == ["a red circle"]
        for name in images["validation/filenames"]:
            assert (runs[0].parent / "files" / name).stat().st_size > 0
    lora = load_file(tmp_path / "wb" / "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("lora_unet_") for k in lora), sorted(lora)[:4]
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight" in lora
    assert "lora_unet_single_blocks_0_linear2.lora_up.weight" in lora
    assert comfy_not_loaded(lora, comfy_lora_prefixes(2, 2)) == set()
    with safe_open(str(tmp_path / "wb" / "pytorch_lora_weights.safetensors"), "pt") as f:
        header = f.metadata()
    assert (header["ss_network_module"], header["ss_base_model_version"]) == ("networks.lora_flux", "flux1")
    # the checkpoint holds the kohya file too: the final one, at its step (written at another time)
    in_checkpoint = tmp_path / "wb" / "checkpoint-2" / "pytorch_lora_weights.safetensors"
    saved = load_file(in_checkpoint)
    assert saved.keys() == lora.keys() and all(torch.equal(saved[k], lora[k]) for k in lora)
    with safe_open(str(in_checkpoint), "pt") as f:
        assert {**f.metadata(), "modelspec.date": None} == {**header, "modelspec.date": None}
    # the lines of the card and the log load the kohya file into FluxPipeline (diffusers converts its keys)
    code = snippets.check(tmp_path / "wb", result.stderr, 64)
    assert "pipe.load_lora_weights(folder, weight_name='pytorch_lora_weights.safetensors')" in code


@pytest.mark.e2e
def test_wandb_writes_into_the_run_s_tracker_folder_and_an_overwrite_removes_it_there(tmp_path):
    """Without WANDB_DIR, wandb's files go to --logging_dir (inside the output folder), not into the current folder,
    and the log says where; --overwrite_output_dir then removes them as the run's, naming no file as a user's."""
    import subprocess

    from tests.launch import env, launch_cmd

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    args = run_args(tmp_path, "out", 1, "--report_to", "wandb")
    variables = {k: v for k, v in env(WANDB_MODE="offline", WANDB_SILENT="true").items() if k != "WANDB_DIR"}
    first = ok(
        subprocess.run(launch_cmd(1, *args), cwd=cwd, env=variables, capture_output=True, text=True, timeout=600)
    )
    assert not (cwd / "wandb").exists(), sorted(p.name for p in cwd.iterdir())
    (run,) = (tmp_path / "out" / "logs" / "wandb").glob("offline-run-*")
    assert list(run.glob("run-*.wandb"))
    assert f"wandb: this run's files are in {run}" in first.stderr, first.stderr[-3000:]
    second = ok(
        subprocess.run(
            launch_cmd(1, *args, "--overwrite_output_dir"),
            cwd=cwd,
            env=variables,
            capture_output=True,
            text=True,
            timeout=600,
        )
    )
    assert not run.exists()
    assert "which flux-cp did not write" not in second.stderr, second.stderr[-3000:]
    assert len(list((tmp_path / "out" / "logs" / "wandb").glob("offline-run-*"))) == 1
