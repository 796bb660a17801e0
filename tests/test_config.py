"""Flag parsing into typed sections: diffusers' flag names, derived defaults resolved at parse time, checks."""

from __future__ import annotations

import dataclasses

import pytest

from flux_cp.config import Config, DataConfig, LoraConfig, build_parser, parse_config
from flux_cp.errors import UsageError


def test_every_field_is_its_flag_and_every_flag_a_field():
    sections = [getattr(Config(), s.name) for s in dataclasses.fields(Config)]
    fields = {f.name for section in sections for f in dataclasses.fields(section)}
    dests = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert fields == dests
    assert set(parse_config([]).flat()) == dests


def test_embedded_default_resolves_the_tiny_model_defaults():
    cfg = parse_config([])
    assert cfg.model.embedded_default
    assert (cfg.data.resolution, cfg.data.max_sequence_length) == (64, 32)
    assert cfg.validation.validation_resolution == 64
    assert (cfg.lora.rank, cfg.lora.lora_alpha) == (16, 16)
    assert cfg.lora.lora_layers is None  # the model family's, once the model is known (flux_cp.shape.resolved)


def test_a_named_model_gets_flux_defaults_and_derived_values_follow_their_flags():
    cfg = parse_config(["--pretrained_model_name_or_path", "some/model", "--rank", "8", "--resolution", "512"])
    assert not cfg.model.embedded_default
    assert (cfg.data.resolution, cfg.data.max_sequence_length) == (512, 512)
    assert cfg.validation.validation_resolution == 512
    assert (cfg.lora.rank, cfg.lora.lora_alpha) == (8, 8)
    given = parse_config(["--rank", "8", "--lora_alpha", "4", "--validation_resolution", "96"])
    assert (given.lora.lora_alpha, given.validation.validation_resolution) == (4, 96)


def test_list_flags_become_tuples_and_sections_are_frozen():
    cfg = parse_config(
        ["--lora_layers", "attn.to_q, attn.to_k", "--validation_prompt", "a", "--validation_prompt", "b"]
    )
    assert cfg.lora.lora_layers == ("attn.to_q", "attn.to_k")
    assert cfg.validation.validation_prompt == ("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lora.rank = 3  # type: ignore[misc]
    assert isinstance(hash(cfg), int)


def test_sections_built_in_code_have_the_flag_defaults():
    assert DataConfig().resolution == 1024 and LoraConfig().lora_layers is None
    assert DataConfig(dataset_name="x").image_column == "image"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--resolution", "100"], "--resolution 100 must be a multiple of 16"),
        (["--validation_resolution", "40"], "--validation_resolution 40 must be a multiple of 16"),
        (["--max_sequence_length", "513"], "--max_sequence_length 513 is out of range: it must be >= 1 and <= 512"),
        (["--rank", "0"], "--rank 0 is out of range: it must be >= 1"),
        (["--train_batch_size", "0"], "--train_batch_size 0 is out of range: it must be >= 1"),
        (["--checkpointing_steps", "0"], "--checkpointing_steps 0 is out of range: it must be >= 1"),
        (["--max_train_steps", "0"], "--max_train_steps 0 is out of range: it must be >= 1"),
        (["--cp_size", "0"], "--cp_size 0 is out of range: it must be >= 1"),
        (["--cp_mode", "hybrid"], "--cp_mode hybrid needs --ulysses_size"),
        (["--cp_mode", "ring", "--ulysses_size", "2"], "--ulysses_size is only used with --cp_mode hybrid"),
        (["--cp_size", "4", "--cp_mode", "hybrid", "--ulysses_size", "3"], "--ulysses_size 3 must divide --cp_size 4"),
        (["--collective_timeout", "0"], "--collective_timeout 0 is out of range: it must be > 0"),
        (["--dataset_name", "/no/such/folder"], "--dataset_name /no/such/folder: no such folder"),
        (["--resume_from_checkpoint", "/no/such/ckpt"], "--resume_from_checkpoint /no/such/ckpt: no such checkpoint"),
    ],
)
def test_flag_checks_name_the_flag(argv, message):
    with pytest.raises(UsageError, match="^" + message.replace("(", r"\(")):
        parse_config(argv)
