"""The README's demo: the embedded default with no data set and no step count gets settings under which its loss
visibly falls (measured in README); any of those flags, a model or a data set given brings back the defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flux_cp.config.demo import DEMO_BATCH, DEMO_LEARNING_RATE, DEMO_PROMPTS, DEMO_STEPS, PAIRS_DEMO
from flux_cp.config.parser import parse_config
from flux_cp.data.sources import BUNDLED_DATA
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
        assert cfg.demo is PAIRS_DEMO
        assert (cfg.train.max_train_steps, cfg.train.learning_rate, cfg.train.train_batch_size) == (
            PAIRS_DEMO.steps, PAIRS_DEMO.learning_rate, PAIRS_DEMO.batch,
        )  # fmt: skip
        assert cfg.validation.validation_prompt == PAIRS_DEMO.prompts
        assert [Path(p) for p in cfg.validation.validation_image] == [pairs / "00_blue_circle.png"]
    captions = {json.loads(line)["text"] for line in (pairs / "metadata.jsonl").read_text().splitlines()}
    assert set(PAIRS_DEMO.prompts) <= captions  # what it learns, from the reference every prompt edits
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


def test_every_copy_of_the_config_keeps_what_the_log_says_about_the_demo():
    """The trainer holds `resolved()`'s copy (the family's defaults filled in): the demo's line is its to say."""
    from flux_cp.families import FLUX1
    from flux_cp.shape.build import resolved

    for argv in ([], ["--max_train_steps", "3"], ["--dataset_name", "data/tiny_pairs"]):
        cfg = parse_config(argv)
        copy = resolved(cfg, FLUX1, "--dataset_name" in argv, None)
        assert copy.lora.lora_layers and copy.demo_lines() == cfg.demo_lines() != [], argv
        assert copy.flat() == {
            **cfg.flat(),
            **{k: v for k, v in copy.flat().items() if k in ("lora_layers", "vae_encode_mode")},
        }


def _checkpoint(out: Path, step: int, args: dict, **meta) -> Path:
    """A checkpoint folder as a resume reads it at start: meta.json and DCP metadata (of no tensors)."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    path = out / f"checkpoint-{step}"
    (path / "state").mkdir(parents=True)
    (path / "state" / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
    (path / "meta.json").write_text(json.dumps({"format": 1, "step": step, "run": {}, "layout": "dp 1 x cp 2",
                                                "args": args, **meta}))  # fmt: skip
    return path


def test_a_step_count_extends_a_resumed_demo_run_with_the_settings_it_had(tmp_path):
    """`--resume_from_checkpoint latest --max_train_steps 220` on the demo's folder: the demo's batch, learning rate
    and validation prompts as its checkpoint recorded them (so the resume matches it), the given step count."""
    out = tmp_path / "tiny"
    demo = parse_config(["--output_dir", str(out), "--learning_rate", "5e-4"])
    path = _checkpoint(out, 200, json.loads(json.dumps(demo.flat())), demo="the demo")
    cfg = parse_config(["--output_dir", str(out), "--resume_from_checkpoint", "latest", "--max_train_steps", "220"])
    assert cfg.demo is demo.demo and cfg.demo_from == str(path) and cfg.demo_off == ()
    assert (cfg.train.max_train_steps, cfg.train.learning_rate, cfg.train.train_batch_size) == (220, 5e-4, DEMO_BATCH)
    assert cfg.validation.validation_prompt == DEMO_PROMPTS
    (line,) = cfg.demo_lines()
    assert line.startswith(f"the demo's settings, as the run of {path} had them: 220 steps at learning rate 0.0005, ")
    # without a step count: the run's own (it is then finished, and the trainer says so)
    assert parse_config(["--output_dir", str(out), "--resume_from_checkpoint", "latest"]).train.max_train_steps == 200
    # a checkpoint written before checkpoints named their demo: recognised by the demo's batch and prompts
    extend = ["--output_dir", str(out), "--resume_from_checkpoint", "latest", "--max_train_steps", "220"]
    meta = json.loads((path / "meta.json").read_text())
    for recorded, demo_kept in (({"demo": None}, False), ({}, True)):
        (path / "meta.json").write_text(json.dumps({**{k: v for k, v in meta.items() if k != "demo"}, **recorded}))
        assert (parse_config(extend).demo is demo.demo) == demo_kept


def test_a_resumed_run_that_was_not_the_demo_keeps_the_usual_defaults(tmp_path):
    out = tmp_path / "tiny"
    run = parse_config(["--output_dir", str(out), "--max_train_steps", "4"])
    _checkpoint(out, 4, json.loads(json.dumps(run.flat())), demo=None)
    cfg = parse_config(["--output_dir", str(out), "--resume_from_checkpoint", "latest", "--max_train_steps", "8"])
    assert cfg.demo is None and cfg.demo_off == ("max_train_steps",) and cfg.train.train_batch_size == 1
    for damaged in ("{", "[]"):  # the resume itself says what is wrong with it
        (out / "checkpoint-4" / "meta.json").write_text(damaged)
        extend = ["--output_dir", str(out), "--resume_from_checkpoint", "latest", "--max_train_steps", "8"]
        assert parse_config(extend).demo is None


def test_a_finished_run_is_known_from_its_last_checkpoint_and_outputs(tmp_path):
    from flux_cp.outputs.outdir import finished

    out = tmp_path / "tiny"
    assert finished("latest", out, 200) is None
    _checkpoint(out, 100, {})
    last = _checkpoint(out, 200, {})
    assert finished("latest", out, 200) is None  # stopped before its weights and card were written: resume it
    (out / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    assert finished("latest", out, 200) is None
    (out / "README.md").write_text("card")
    assert finished("latest", out, 200) == last and finished(str(last), out, 200) == last
    assert finished("latest", out, 220) is None and finished(None, out, 200) is None  # extended; not a resume
    assert finished(str(out / "checkpoint-100"), out, 200) is None  # an earlier checkpoint: a branch
    from flux_cp.outputs import outdir

    outdir.claim(out, "latest")  # a live run in the folder: its start says the folder is in use, not this
    try:
        assert finished("latest", out, 200) is None
    finally:
        outdir.release(out)
    assert finished("latest", out, 200) == last


def test_a_refused_resume_is_printed_once_under_a_launcher(tmp_path, capfd, monkeypatch):
    """Every rank reads the same checkpoint and holds the same run identity, so the refusal is agreed: the main rank
    prints it, the others nothing (it was printed once per rank)."""
    from flux_cp.run import runner
    from flux_cp.run.trainer import Trainer

    out = tmp_path / "tiny"
    _checkpoint(out, 4, {}, run={"global_batch": 4})
    trainer = Trainer(parse_config(["--output_dir", str(out), "--resume_from_checkpoint", "latest",
                                    "--max_train_steps", "8"]))  # fmt: skip
    trainer.max_steps, trainer.run_identity = 8, {"global_batch": 1}
    monkeypatch.setattr(runner, "MAIN_RANK_GRACE_S", 0.0)
    monkeypatch.setattr(runner, "is_distributed", lambda: True)  # the process group is up by the resume
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        assert runner.run(trainer.resume) == 2
        err = capfd.readouterr().err
        assert len([ln for ln in err.splitlines() if "global_batch: checkpoint 4, now 1" in ln]) == lines, err
