"""--config FILE: flags written down in YAML, TOML or JSON parse as the same flags on the command line do, the command
line wins, a run's run_config.json reads back as the flags the run had (and repeats the run: the e2e test at the
end), and a bad key or value is one line naming the file and the key."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from flux_cp.config.file import RUN_CHOICES
from flux_cp.config.parser import parse_config
from flux_cp.data.sources import BUNDLED_DATA
from flux_cp.errors import UsageError

# A handful of flags of every kind: a float, a list flag, a repeatable flag, a switch, a true/false flag, an int, a
# comma-separated list, a choice.
ARGV = shlex.split(
    "--learning_rate 0.0002 --resolution 64,128 --validation_prompt 'a cat' --validation_prompt 'a dog' "
    "--random_flip --prodigy_decouple false --rank 4 --lora_layers attn.to_q,attn.to_k --lr_scheduler cosine --seed 7"
)

YAML = """\
learning_rate: 2e-4          # PyYAML reads this as text: the flag's own parser makes it a number
resolution: [64, 128]
validation_prompt: [a cat, a dog]
random_flip: true
prodigy_decouple: false
lora:                        # a table named after a section holds that section's flags
  rank: 4
  lora_layers: [attn.to_q, attn.to_k]
lr_scheduler: cosine
seed: 7
"""

TOML = """\
learning_rate = 2e-4
resolution = [64, 128]
validation_prompt = ["a cat", "a dog"]
lr_scheduler = "cosine"

[data]
random_flip = true

[train]
prodigy_decouple = false
seed = 7

[lora]
rank = 4
lora_layers = "attn.to_q,attn.to_k"
"""

JSON = json.dumps(
    {
        "learning_rate": 2e-4,
        "resolution": [64, 128],
        "validation_prompt": ["a cat", "a dog"],
        "random_flip": True,
        "prodigy_decouple": False,
        "rank": 4,
        "lora_layers": ["attn.to_q", "attn.to_k"],
        "lr_scheduler": "cosine",
        "seed": 7,
    }
)


def _file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("name, text", [("run.yaml", YAML), ("run.yml", YAML), ("run.toml", TOML), ("run.json", JSON)])
def test_a_file_gives_the_flags_the_command_line_gives(tmp_path, name, text):
    from_file = parse_config(["--config", _file(tmp_path, name, text)])
    expected = parse_config(ARGV)
    assert from_file.flat() == expected.flat()
    assert from_file.validation.validation_prompt == ("a cat", "a dog") and from_file.data.resolution == (64, 128)
    assert from_file.lora.lora_alpha == 4  # derived from the file's rank, as from the command line's
    assert parse_config([]).flat() != expected.flat()  # the flags are not the defaults: the check could fail


def test_the_command_line_wins_over_the_file(tmp_path):
    path = _file(tmp_path, "run.yaml", YAML)
    cfg = parse_config(["--config", path, "--rank", "8", "--validation_prompt", "a bird", "--learning_rate", "1e-3"])
    assert (cfg.lora.rank, cfg.lora.lora_alpha, cfg.train.learning_rate) == (8, 8, 1e-3)
    assert cfg.validation.validation_prompt == ("a bird",)  # a repeatable flag: the command line's list replaces
    assert cfg.data.resolution == (64, 128) and cfg.train.seed == 7  # the rest from the file
    # The data set named on the command line replaces the file's, under either of its two names
    data = _file(tmp_path, "data.yaml", f"instance_data_dir: {BUNDLED_DATA}\n")
    assert parse_config(["--config", data, "--dataset_name", str(BUNDLED_DATA)]).data.dataset_name == str(BUNDLED_DATA)


def test_null_leaves_the_default_and_false_leaves_a_switch_off(tmp_path):
    path = _file(
        tmp_path,
        "run.json",
        json.dumps({"max_train_steps": None, "random_flip": False, "rank": 4, "validation_prompt": []}),
    )
    cfg = parse_config(["--config", path])
    assert cfg.train.max_train_steps == parse_config([]).train.max_train_steps  # the demo's: nothing given
    assert cfg.data.random_flip is False and cfg.lora.rank == 4


def _run_config(cfg, path: Path, **chosen) -> str:
    """A run_config.json as a run writes it (flux_cp.run.output_phase.Outputs.record_settings): every recorded flag,
    then what the run chose."""
    path.write_text(json.dumps({**cfg.flat(), **{k: 1 for k in RUN_CHOICES}, **chosen}))
    return str(path)


@pytest.mark.parametrize(
    "argv",
    [
        [],  # the demo: its settings are in the file as the flags they are
        ["--instance_data_dir", str(BUNDLED_DATA), "--rank", "4", "--lora_alpha", "8", "--max_train_steps", "3"],
        ["--pretrained_model_name_or_path", "some/model", "--optimizer", "prodigy", "--resolution", "512,1024"],
        ["--validation_prompt", "x", "--validation_image", str(BUNDLED_DATA / "00_white_circle.png")],
    ],
)
def test_run_config_json_reads_back_as_the_flags_of_its_run(tmp_path, argv, capsys):
    cfg = parse_config(argv)
    again = parse_config(["--config", _run_config(cfg, tmp_path / "run_config.json")])
    assert again.flat() == cfg.flat()
    assert f"{', '.join(RUN_CHOICES)} skipped (what that run chose, not flags)" in capsys.readouterr().err


def test_run_config_json_of_a_cp_run_reads_back():
    """A CP run records the CP mode it chose (Ulysses over the whole group records its size too)."""
    cfg = parse_config(["--cp_size", "2", "--cp_mode", "ulysses", "--ulysses_size", "2"])
    assert (cfg.parallel.cp_mode, cfg.parallel.ulysses_size) == ("ulysses", 2)
    with pytest.raises(UsageError, match="--ulysses_size is only used with --cp_mode hybrid"):
        parse_config(["--cp_size", "4", "--cp_mode", "ulysses", "--ulysses_size", "2"])


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("a.yaml", "learnig_rate: 1e-4\n", "a.yaml: unknown flag 'learnig_rate': did you mean learning_rate?"),
        ("a.toml", "[train]\nlearnig_rate = 1e-4\n", "unknown flag 'train.learnig_rate': did you mean learning_rate?"),
        ("a.yaml", "learning-rate: 1e-4\n", "unknown flag 'learning-rate': did you mean learning_rate?"),
        ("a.json", '{"rank": "four"}', 'a.json: rank is "four": not a whole number'),
        ("a.json", '{"rank": 4.5}', "rank is 4.5: not a whole number"),
        ("a.yaml", "learning_rate: fast\n", 'learning_rate is "fast": not a number'),
        ("a.yaml", "lr_scheduler: cosin\n", 'lr_scheduler is "cosin", not one of linear, cosine, '),
        ("a.yaml", "lr_scheduler: cosin\n", "did you mean cosine?"),
        ("a.yaml", "random_flip: maybe\n", 'random_flip is "maybe": give true or false'),
        ("a.yaml", "resolution: 64,100\n", "patches) (--resolution is from --config "),
        ("a.yaml", "resolution: [64, big]\n", "resolution is \"64,big\": '64,big': give sizes in pixels"),
        ("a.yaml", "train:\n  rank: 4\n", "train.rank: rank is a flag of section 'lora', not 'train'"),
        ("a.yaml", "training:\n  rank: 4\n", "'training' is a table; tables are named after the config's sections"),
        ("a.yaml", "rank: 4\nlora:\n  rank: 8\n", "'rank' is given twice"),
        ("a.yaml", "rank: 4\nrank: 8\n", "'rank' is given twice"),
        ("a.json", '{"rank": 4, "rank": 8}', "'rank' is given twice"),
        ("a.yaml", "- rank\n", "holds a YAML list, not a table of flags"),
        ("a.yaml", "rank: [4\n", "is not valid YAML"),
        ("a.toml", "rank = \n", "is not valid TOML"),
        ("a.yaml", "config: other.yaml\n", "'config': a config file cannot name another one"),
        ("a.ini", "rank = 4\n", "a.ini: name a .yaml, .yml, .toml or .json file"),
    ],
)
def test_a_bad_key_or_value_names_the_file_and_the_key(tmp_path, name, text, message):
    path = _file(tmp_path, name, text)
    with pytest.raises(UsageError) as e:
        parse_config(["--config", path])
    assert message in str(e.value)
    assert f"--config {path}" in str(e.value)


def test_a_leading_tilde_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _file(tmp_path, "run.yaml", "rank: 4\n")
    assert parse_config(["--config=~/run.yaml"]).lora.rank == 4


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(UsageError, match=r"--config .*nope\.yaml: no such file"):
        parse_config(["--config", str(tmp_path / "nope.yaml")])


@pytest.mark.e2e
def test_run_config_json_repeats_the_run(tmp_path):
    """`--config OUTPUT/run_config.json --output_dir OTHER` trains the same run again: the same losses and LoRA, bit
    for bit (the same flags and layout: CP over 2 processes, which records the CP mode the run chose)."""
    import torch
    from safetensors.torch import load_file

    from tests.launch import losses, ok, run_args, train

    flags = "--cp_size 2 --rank 4 --lora_alpha 8 --random_flip --seed 5 --learning_rate 1e-3 --checkpointing_steps 1000"
    ok(train(2, *run_args(tmp_path, "first", 4, *flags.split())))
    recorded = tmp_path / "first" / "run_config.json"
    config = json.loads(recorded.read_text())
    assert "config" not in config and "hub_token" not in config  # the flags it gave are recorded; secrets never
    again = ok(train(2, "--config", str(recorded), "--output_dir", str(tmp_path / "again")))
    assert f"--config {recorded}: {', '.join(RUN_CHOICES)} skipped" in again.stderr
    first_losses = losses(tmp_path / "first")
    assert len(first_losses) == 4 and losses(tmp_path / "again") == first_losses
    a, b = (load_file(tmp_path / run / "pytorch_lora_weights.safetensors") for run in ("first", "again"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k)  # trained: the comparison could fail
    repeated = json.loads((tmp_path / "again" / "run_config.json").read_text())
    assert {**repeated, "output_dir": None} == {**config, "output_dir": None}
