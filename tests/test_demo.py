"""The README's demo: the embedded default with no data set and no step count gets settings under which its loss
visibly falls (measured in README); any of those flags, a model or a data set given brings back the defaults."""

from __future__ import annotations

import pytest

from flux_cp.config import DEMO_BATCH, DEMO_LEARNING_RATE, DEMO_PROMPTS, DEMO_STEPS, parse_config
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
