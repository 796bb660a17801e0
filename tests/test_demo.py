"""The README's demo: the embedded default with no data set and no step count gets settings under which its loss
visibly falls (measured in README); any of those flags, a model or a data set given brings back the defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flux_cp.config import DEMO_BATCH, DEMO_LEARNING_RATE, DEMO_PROMPTS, DEMO_STEPS, KONTEXT_DEMO, parse_config
from flux_cp.data import BUNDLED_DATA
from flux_cp.errors import UsageError


def test_the_bare_embedded_default_is_the_demo():
    cfg = parse_config([])
    assert (cfg.train.max_train_steps, cfg.train.learning_rate, cfg.train.train_batch_size) == (
        DEMO_STEPS, DEMO_LEARNING_RATE, DEMO_BATCH,
    )  # fmt: skip
    assert cfg.validation.validation_prompt == DEMO_PROMPTS and cfg.train.num_train_epochs == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["--max_train_steps", "3"],
        ["--num_train_epochs", "2"],
        ["--dataset_name", str(BUNDLED_DATA)],
        ["--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-dev"],
    ],
)
def test_a_step_count_model_or_data_set_keeps_the_usual_defaults(argv):
    cfg = parse_config(argv)
    assert (cfg.train.learning_rate, cfg.train.train_batch_size, cfg.validation.validation_prompt) == (1e-4, 1, None)
    assert cfg.train.max_train_steps == (3 if "--max_train_steps" in argv else None)


def test_flags_given_to_the_demo_win():
    cfg = parse_config(["--learning_rate", "5e-4", "--train_batch_size", "2", "--validation_prompt", "a red circle"])
    assert cfg.train.max_train_steps == DEMO_STEPS
    assert (cfg.train.learning_rate, cfg.train.train_batch_size) == (5e-4, 2)
    assert cfg.validation.validation_prompt == ("a red circle",)


def test_lora_format_flag():
    assert parse_config([]).lora.lora_format == "diffusers"
    assert parse_config(["--lora_format", "kohya"]).lora.lora_format == "kohya"
    with pytest.raises(UsageError, match="--lora_format kohya applies to LoRA files"):
        parse_config(["--lora_format", "kohya", "--full_finetune"])


def test_the_kontext_demo_on_the_bundled_pairs_learns_and_validates_before_and_after(monkeypatch, tmp_path):
    """--dataset_name data/tiny_pairs alone (the README's Kontext command, from any folder): the Kontext demo's steps,
    learning rate and batch, and validation images of two of its captions editing one of its references."""
    pairs = BUNDLED_DATA.parent / "tiny_pairs"
    for name in (str(pairs), "data/tiny_pairs"):
        monkeypatch.chdir(BUNDLED_DATA.parent.parent if name.startswith("data/") else tmp_path)
        cfg = parse_config(["--dataset_name", name])
        assert cfg.demo is KONTEXT_DEMO
        assert (cfg.train.max_train_steps, cfg.train.learning_rate, cfg.train.train_batch_size) == (
            KONTEXT_DEMO.steps, KONTEXT_DEMO.learning_rate, KONTEXT_DEMO.batch,
        )  # fmt: skip
        assert cfg.validation.validation_prompt == KONTEXT_DEMO.prompts
        assert [Path(p) for p in cfg.validation.validation_image] == [pairs / "00_blue_circle.png"]
    captions = {json.loads(line)["text"] for line in (pairs / "metadata.jsonl").read_text().splitlines()}
    assert set(KONTEXT_DEMO.prompts) <= captions  # what it learns, from the reference every prompt edits
    cfg = parse_config(["--dataset_name", str(pairs), "--max_train_steps", "3"])
    assert cfg.demo is None and cfg.validation.validation_image is None and cfg.train.learning_rate == 1e-4


def test_the_log_says_which_demo_settings_apply_or_which_flag_turned_them_off():
    (line,) = parse_config([]).demo_lines()
    assert line.startswith("the demo's settings: 200 steps at learning rate 0.001, 4 samples per step, validation ")
    assert "--max_train_steps, --num_train_epochs or another --dataset_name turn them off" in line
    (line,) = parse_config(["--dataset_name", "data/tiny_pairs", "--learning_rate", "5e-4"]).demo_lines()
    assert line.startswith("the FLUX.1 Kontext demo's settings: 100 steps at learning rate 0.0005, 4 samples")
    assert "editing data/tiny_pairs/00_blue_circle.png before and after training" in line
    (line,) = parse_config(["--max_train_steps", "3", "--num_train_epochs", "2"]).demo_lines()
    assert line == (
        "the demo's settings are off (--max_train_steps, --num_train_epochs given): 3 steps, learning rate 0.0001, "
        "1 sample per step, as for real runs"
    )
    (line,) = parse_config(["--dataset_name", str(BUNDLED_DATA)]).demo_lines()
    assert line.startswith("the demo's settings are off (--dataset_name given): 1 epoch, learning rate 0.0001")
    assert parse_config(["--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-dev"]).demo_lines() == []
