"""Coming from kohya, end to end on CPU: a data folder in kohya's layout (N_name sub-folders) trains with its repeats,
starting from an existing LoRA file (--network_weights) in diffusers' or kohya's layout, and CP over 2 processes
trains it as one process does (loss and LoRA weights). Five trainer launches, one with CP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from flux_cp.data.sources import BUNDLED_DATA
from flux_cp.families.flux1.kohya import to_kohya
from flux_cp.model.network_weights import fingerprint
from tests.launch import assert_same_trajectory, losses, ok, run_args, train

pytestmark = pytest.mark.e2e  # every test here launches train_flux_cp.py

STEPS = 10


def kohya_folder(root: Path) -> Path:
    """`2_sks shape`: three images with .txt captions; `1_other`: two without, captioned `other` by kohya's rule."""
    captions = {
        json.loads(line)["file_name"]: json.loads(line)["text"]
        for line in (BUNDLED_DATA / "metadata.jsonl").read_text().splitlines()
    }
    images = sorted(BUNDLED_DATA.glob("*.png"))
    for k, image in enumerate(images[:5]):
        folder = root / ("2_sks shape" if k < 3 else "1_other")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / image.name).write_bytes(image.read_bytes())
        if k < 3:
            (folder / image.name).with_suffix(".txt").write_text(captions[image.name] + "\n")
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("kohya")
    # The LoRA file to start from: 3 steps on the bundled data set (diffusers' layout), and the same in kohya's
    ok(train(1, *run_args(tmp, "lora", 3, "--rank", "4", "--seed", "3", "--learning_rate", "1e-3")))
    lora = tmp / "lora" / "pytorch_lora_weights.safetensors"
    save_file(to_kohya(load_file(lora), 4, 4), tmp / "kohya_lora.safetensors")
    data = kohya_folder(tmp / "data")
    flags = ["--dataset_name", str(data), "--repeats", "2", "--rank", "4", "--seed", "5", "--learning_rate", "1e-3",
             "--random_flip", "--checkpointing_steps", "1000"]  # fmt: skip
    for name, nproc, extra in (
        ("one", 1, ["--network_weights", str(lora)]),
        ("cp2", 2, ["--network_weights", str(lora), "--cp_size", "2"]),
        ("from_kohya", 1, ["--network_weights", str(tmp / "kohya_lora.safetensors")]),
    ):
        out = ok(train(nproc, *run_args(tmp, name, STEPS, *flags, *extra)))
        (tmp / f"{name}.log").write_text(out.stdout + out.stderr)
    ok(train(1, *run_args(tmp, "fresh", 2, *flags)))  # the same run without the file
    return tmp


def test_a_kohya_folder_trains_with_its_repeats_and_captions(runs):
    log = (runs / "one.log").read_text()
    assert (
        "flux-cp: kohya layout: 2 folders, 1_other (2 images x 1), 2_sks shape (3 images x 2); 2 images without a "
        "caption file captioned with the folder's name; x 2 (--repeats): 16 samples per epoch"
    ) in log
    rows = json.loads((runs / "one" / "checkpoint-10" / "data.json").read_text())["data_files"]
    names = [row[0] for row in rows]  # the run identity names each image with its folder, so its N
    assert names == ["1_other/03_green_circle.png", "1_other/04_purple_square.png",
                     "2_sks shape/00_white_circle.png", "2_sks shape/01_black_square.png",
                     "2_sks shape/02_yellow_triangle.png"]  # fmt: skip


def test_a_run_starts_from_a_lora_file_of_either_layout_and_trains_with_cp_as_one_process(runs):
    lora = runs / "lora" / "pytorch_lora_weights.safetensors"
    assert f"flux-cp: LoRA weights from {lora} (diffusers layout, " in (runs / "one.log").read_text()
    assert "(kohya layout, " in (runs / "from_kohya.log").read_text()
    assert_same_trajectory(runs / "one", runs / "cp2")
    # the kohya file holds the same weights: the same run, to the last bit
    assert losses(runs / "from_kohya") == losses(runs / "one")
    # the file's weights, not the run's seeded ones, are what the first step trains
    assert losses(runs / "fresh")[0] != losses(runs / "one")[0]
    config = json.loads((runs / "one" / "run_config.json").read_text())
    assert config["network_weights"] == str(lora)
    meta = json.loads((runs / "one" / "checkpoint-10" / "meta.json").read_text())["run"]
    assert meta["network_weights"] == fingerprint(str(lora))  # a resume must use the same file
