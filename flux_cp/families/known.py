"""What a model family knows of a model on the Hugging Face Hub without downloading anything (`Family.known`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KnownModel:
    """A model on the Hugging Face Hub that a family knows without downloading anything: its transformer config (so
    `--plan` works offline for it), pipeline and license (the model card)."""

    model_id: str
    transformer: dict  # transformer/config.json's fields
    pipeline: str  # model_index.json's _class_name
    license: str  # the Hub's license identifier
    license_name: str | None = None  # for license "other"
    license_link: str | None = None
