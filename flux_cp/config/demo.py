"""The demos: the embedded default (no model named) on a bundled data set with no step count given, with settings of
their own so that the loss curve visibly falls within a minute on 2 CPU cores (the README's figures, checked by
tests/test_readme_demos.py); which flags select one. A resumed demo keeps its settings (flux_cp.config.parser)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def is_embedded(raw: dict) -> bool:
    return raw["pretrained_model_name_or_path"] is None


BUNDLED = Path(__file__).resolve().parents[2] / "data"  # the bundled data sets (tiny_shapes, tiny_pairs)


@dataclass(frozen=True)
class Demo:
    """The settings of a demo: the embedded default (no model named) on one of the bundled data sets with no step
    count given, trained so that its loss curve visibly falls within a minute on 2 CPU cores, with validation
    images before and after (the README's figures, checked by tests/test_readme_demos.py). Flags given still win;
    other runs get the usual defaults (docs/design.md lists those that differ from diffusers' examples)."""

    name: str
    data: Path | None  # the --dataset_name that selects it (None: none given, the bundled data/tiny_shapes)
    steps: int
    learning_rate: float
    batch: int  # samples per data-parallel rank per step
    prompts: tuple[str, ...]
    validation_image: Path | None = None  # FLUX.1 Kontext: the reference the prompts edit


DEMO = Demo(
    "the demo",
    None,
    steps=200,
    learning_rate=1e-3,
    batch=4,
    prompts=("a white circle on a black background", "a yellow triangle on a purple background"),
)
PAIRS_DEMO = Demo(
    "the FLUX.1 Kontext demo",
    BUNDLED / "tiny_pairs",
    steps=100,
    learning_rate=2e-3,
    batch=4,
    prompts=("make the circle purple", "make the circle orange"),
    validation_image=BUNDLED / "tiny_pairs" / "00_blue_circle.png",  # its pair's target is the purple circle
)
DEMOS = (DEMO, PAIRS_DEMO)
TINY_TEXT_TOKENS = 48  # --max_sequence_length of the embedded default: divisible by every CP size up to 8
DEMO_STEPS, DEMO_LEARNING_RATE, DEMO_BATCH, DEMO_PROMPTS = DEMO.steps, DEMO.learning_rate, DEMO.batch, DEMO.prompts
# Flags that turn a demo's settings off when given (with the embedded default): a step count, or other data.
DEMO_OFF_FLAGS = ("max_train_steps", "num_train_epochs", "dataset_name", "instance_data_dir")
DEMO_KEY = "demo_in"  # key in the raw flag values: decided on the flags as given, before any default is derived


def same_folder(given: str | None, bundled: Path | None) -> bool:
    if given is None or bundled is None:
        return given is None and bundled is None
    return os.path.realpath(given) == str(bundled.resolve())


def demo_of(raw: dict) -> Demo | None:
    """The demo these flags (as given) select, if any."""
    if not is_embedded(raw) or raw["max_train_steps"] is not None or raw["num_train_epochs"] is not None:
        return None
    return next((d for d in DEMOS if same_folder(raw["dataset_name"], d.data)), None)


def demo_in(raw: dict) -> Demo | None:
    return raw[DEMO_KEY]


# The flags a demo sets (when not given): what a resumed demo run takes from its checkpoint instead.


DEMO_FLAGS = ("max_train_steps", "learning_rate", "train_batch_size", "validation_prompt", "validation_image")
