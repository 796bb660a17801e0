"""Flag parsing into typed sections: diffusers' flag names, derived defaults resolved at parse time, checks."""

from __future__ import annotations

import dataclasses

import pytest

from flux_cp.config.flags import Config
from flux_cp.config.parser import build_parser, parse_config
from flux_cp.config.training import DataConfig, LoraConfig
from flux_cp.errors import UsageError


def test_every_field_is_its_flag_and_every_flag_a_field():
    fields = {f.name for section in Config().sections() for f in dataclasses.fields(section)}
    dests = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert fields == dests
    # secrets stay out of the run's files; --config too (the flags it gives are recorded by their names)
    assert set(parse_config([]).flat()) == dests - {"hub_token", "config"}


def test_embedded_default_resolves_the_tiny_model_defaults():
    cfg = parse_config([])
    assert cfg.model.embedded_default
    assert (cfg.data.resolution, cfg.data.max_sequence_length) == ((64,), 48)
    assert cfg.validation.validation_resolution == 64
    assert (cfg.lora.rank, cfg.lora.lora_alpha) == (16, 16)
    assert cfg.lora.lora_layers is None  # the model family's, once the model is known (flux_cp.shape.build.resolved)


def test_a_named_model_gets_flux_defaults_and_derived_values_follow_their_flags():
    cfg = parse_config(["--pretrained_model_name_or_path", "some/model", "--rank", "8", "--resolution", "512"])
    assert not cfg.model.embedded_default
    assert (cfg.data.resolution, cfg.data.max_sequence_length) == ((512,), 512)
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
    assert DataConfig().resolution == (1024,) and LoraConfig().lora_layers is None
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
        (
            ["--cp_kernels", "cudnn,fast"],
            "--cp_kernels 'cudnn,fast': unknown kernel fast; choose from cpu_flash, cudnn",
        ),
        (["--cp_ulysses_chunks", "0"], "--cp_ulysses_chunks 0 is out of range: it must be >= 1"),
        (["--cp_overlap", "scheduler", "--cp_exchange_first"], "--cp_exchange_first is added beside the reordering"),
    ],
)
def test_flag_checks_name_the_flag(argv, message):
    with pytest.raises(UsageError, match="^" + message.replace("(", r"\(")):
        parse_config(argv)


def test_a_bare_checkpoint_name_is_a_folder_of_the_output_dir_and_a_path_from_here_still_works(
    tmp_path, monkeypatch, capsys
):
    """`--resume_from_checkpoint checkpoint-2` as diffusers' examples read it (a folder of --output_dir), said in one
    line; a folder of that name in the current folder is taken as given; one in both places, or in neither, is one
    line naming the paths tried."""
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cfg = parse_config(["--output_dir", str(out), "--resume_from_checkpoint", "checkpoint-2"])
    assert cfg.checkpoints.resume_from_checkpoint == str(out / "checkpoint-2")
    said = f"flux-cp: --resume_from_checkpoint checkpoint-2 is {out / 'checkpoint-2'} (a bare name is a folder of"
    assert said in capsys.readouterr().err
    cfg = parse_config(["--output_dir", str(out), "--resume_from_checkpoint", "out/checkpoint-2"])  # a path from here
    assert cfg.checkpoints.resume_from_checkpoint == "out/checkpoint-2"
    monkeypatch.chdir(out)  # the same folder both ways: not ambiguous
    cfg = parse_config(["--output_dir", ".", "--resume_from_checkpoint", "checkpoint-2"])
    assert cfg.checkpoints.resume_from_checkpoint == "checkpoint-2"
    (tmp_path / "here" / "checkpoint-2").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(UsageError, match="names two folders, .*here/checkpoint-2 .*and .*out/checkpoint-2"):
        parse_config(["--output_dir", str(out), "--resume_from_checkpoint", "checkpoint-2"])
    with pytest.raises(UsageError, match=r"checkpoint-3: no such checkpoint folder \(tried .*here/checkpoint-3 and "):
        parse_config(["--output_dir", str(out), "--resume_from_checkpoint", "checkpoint-3"])


# --- the command line ------------------------------------------------------------------------------------------


def _help_lines() -> dict[str, str]:
    """{flag: its help text as --help prints it, unwrapped}."""
    parser = build_parser()
    formatter = parser._get_formatter()
    return {a.option_strings[-1]: formatter._expand_help(a) for a in parser._actions if a.dest != "help"}


def test_every_flag_has_a_help_line_that_shows_its_default():
    lines = _help_lines()
    assert len(lines) > 60
    for flag, text in lines.items():
        assert text.split("(default:")[0].split("Default:")[0].strip(), f"{flag} has no help text"
        assert "Default:" in text or "(default: " in text, f"{flag}: {text}"
        assert "(default: None)" not in text, f"{flag} must say what it defaults to: {text}"
    assert lines["--output_dir"].endswith("(default: flux-cp-output)")
    assert lines["--gradient_checkpointing"].endswith("(default: none)")
    assert "hf auth login" in lines["--hub_token"]
    assert "train_flux_cp.py" in build_parser().format_help()  # renders (a stray % in a help text would raise)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--learnig_rate", "1e-4"], "unknown flag --learnig_rate: did you mean --learning_rate?"),
        (["--learning-rate=1e-4"], "unknown flag --learning-rate: did you mean --learning_rate?"),
        (["--resolutoin", "512", "--gradeint_checkpointing"],
         "unknown flags --resolutoin: did you mean --resolution?; --gradeint_checkpointing: did you mean "
         "--gradient_checkpointing?"),
        (["--frobnicate", "3"], "unknown flag --frobnicate (train_flux_cp.py --help lists every flag)"),
        # the start of a flag is not taken for it (argparse's prefix matching would train at --learning_rate)
        (["--learning_rat", "1e-4"], "unknown flag --learning_rat: did you mean --learning_rate?"),
        (["--output", "out"], "unknown flag --output: did you mean --output_dir?"),
        (["1e-4"], "unexpected argument '1e-4': every value follows its flag"),
        (["--lr_scheduler", "cosin"], "argument --lr_scheduler: invalid choice: 'cosin' (choose from"),
        (["--rank", "x"], "argument --rank: invalid int value: 'x' (train_flux_cp.py --help lists every flag)"),
    ],
)  # fmt: skip
def test_command_line_mistakes_get_one_line(argv, message):
    with pytest.raises(UsageError) as e:
        parse_config(argv)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    if "cosin" in argv:
        assert str(e.value).endswith("did you mean cosine?")


def test_a_mistake_prints_one_line_once_under_a_launcher(capfd, monkeypatch):
    """Through the trainer's exit path: one `error:` line on rank 0 and nothing on the other ranks (no usage
    block), exit code 2."""
    from flux_cp.run import runner

    for rank, expected in (("0", ["error: unknown flag --learnig_rate: did you mean --learning_rate?"]), ("1", [])):
        monkeypatch.setenv("RANK", rank)
        assert runner.run(lambda: parse_config(["--learnig_rate", "1e-4"])) == 2
        out, err = capfd.readouterr()
        assert out == "" and [ln for ln in err.splitlines() if ln.strip()] == expected, err


def _online(monkeypatch) -> None:
    """huggingface_hub as if HF_HUB_OFFLINE were not set (the tests set it)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_the_hub_token_is_kept_out_of_the_run_s_records(monkeypatch):
    import json

    _online(monkeypatch)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    cfg = parse_config(["--push_to_hub", "--hub_token", "hf_secret123", "--hub_model_id", "me/dog"])
    assert cfg.hub.hub_token == "hf_secret123" and cfg.hub.hub_model_id == "me/dog"
    # run_config.json, checkpoints' meta.json and the trackers' hyperparameters are all cfg.flat()
    assert "hf_secret123" not in json.dumps(cfg.flat(), default=str)
    with pytest.raises(UsageError, match="^--hub_token with --report_to wandb would put the token"):
        parse_config(["--hub_token", "hf_secret123", "--report_to", "all"])


def test_push_to_hub_without_any_token_is_refused_at_start(monkeypatch, tmp_path):
    import huggingface_hub.constants

    _online(monkeypatch)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(UsageError, match=r"^--push_to_hub needs a Hugging Face token: log in with `hf auth login`"):
        parse_config(["--push_to_hub"])
    parse_config(["--push_to_hub", "--hub_token", "hf_x"])
    (tmp_path / "no-token").write_text("hf_stored\n")  # what `hf auth login` stores
    parse_config(["--push_to_hub"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "still-none"))
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    parse_config(["--push_to_hub"])


def test_cp_tuning_flags_are_typed_recorded_and_become_the_cp_tuning():
    """The CP tuning is flags, not environment variables: in --help, in every run's recorded flags (run_config.json,
    checkpoints' meta, trackers: `Config.flat`), and handed to cp as one `cp.Tuning`."""
    import cp

    default = parse_config([])
    assert default.cp_tuning.tuning() == cp.Tuning()
    recorded = default.flat()
    assert {k: recorded[k] for k in ("cp_kernels", "cp_overlap", "cp_exchange_first", "cp_ulysses_chunks")} == {
        "cp_kernels": None, "cp_overlap": "fill", "cp_exchange_first": False, "cp_ulysses_chunks": 1,
    }  # fmt: skip
    argv = ["--cp_kernels", "flash, math", "--cp_overlap", "none", "--cp_exchange_first", "--cp_ulysses_chunks", "2"]
    cfg = parse_config(argv)
    assert cfg.flat()["cp_kernels"] == "flash,math"
    assert cfg.cp_tuning.tuning() == cp.Tuning(("flash", "math"), "none", True, 2)
    assert "advanced: CP tuning" in build_parser().format_help()


# --- --cache_dir: the download cache, as in diffusers' examples; --encodings_dir: ours -------------------------


def test_cache_dir_is_the_download_cache_and_still_holds_the_encodings_for_now(capsys, tmp_path):
    """A given --cache_dir is where models and hub data sets download (diffusers' meaning). Without --encodings_dir
    the encodings still go there, as before this release, and a warning says how to keep them there for good."""
    cache = str(tmp_path / "hf")
    cfg = parse_config(["--cache_dir", cache])
    assert (cfg.model.cache_dir, cfg.data.encodings_dir) == (cache, cache)
    assert capsys.readouterr().err == (
        f"warning: --cache_dir {cache} now holds downloaded models and hub data sets (as in diffusers' examples); the "
        f"encodings also go there, as before, for this release only: pass --encodings_dir {cache} to keep them there "
        "(or name another folder)\n"
    )
    cfg = parse_config(["--cache_dir", cache, "--encodings_dir", str(tmp_path / "enc")])
    assert (cfg.model.cache_dir, cfg.data.encodings_dir) == (cache, str(tmp_path / "enc"))
    parse_config(["--cache_dir", cache, "--no_cache"])  # nothing is encoded to a folder: nothing to say
    assert capsys.readouterr().err == ""
    cfg = parse_config(["--encodings_dir", str(tmp_path / "enc"), "--no_cache"])
    assert cfg.model.cache_dir is None
    assert capsys.readouterr().err == "warning: --encodings_dir has no effect with --no_cache\n"
    assert parse_config([]).data.encodings_dir is None  # the trainer's default: DEFAULT_ENCODINGS_DIR
    lines = _help_lines()
    assert "downloaded models and hub data sets" in lines["--cache_dir"]
    assert (
        "Default: ~/.cache/flux_cp/encodings (--cache_dir when that is given: deprecated)" in lines["--encodings_dir"]
    )


@pytest.mark.parametrize(
    "flag", ["--output_dir", "--logging_dir", "--encodings_dir", "--dataset_name", "--pretrained_model_name_or_path",
             "--resume_from_checkpoint", "--class_data_dir", "--revision", "--hub_model_id", "--lora_layers"]
)  # fmt: skip
def test_an_empty_path_or_name_is_refused_not_taken_for_a_default(flag):
    """An empty --output_dir was the current folder, an empty --logging_dir the output folder itself, an empty
    --encodings_dir the default one: refused, as every empty path or name."""
    for empty in ("", "  ", ","):
        if empty == "," and flag != "--lora_layers":
            continue
        with pytest.raises(UsageError, match=rf"^{flag} is empty: give a (path|value), or leave the flag out"):
            parse_config([flag, empty])


def test_a_tilde_the_shell_left_is_expanded_for_every_path_flag_and_said(monkeypatch, tmp_path, capsys):
    """`--output_dir=~/out` reaches the trainer with its '~' (the shell expands it only at a word's start): every path
    flag expands it alike (--output_dir made a folder named '~' while --encodings_dir expanded it), says so, and the
    run records the path used."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = parse_config(["--output_dir=~/out", "--encodings_dir=~/enc", "--seed_checkpoint=~/seed.safetensors"])
    assert (cfg.train.output_dir, cfg.data.encodings_dir) == (str(tmp_path / "out"), str(tmp_path / "enc"))
    assert cfg.flat()["output_dir"] == str(tmp_path / "out")  # run_config.json's value
    assert cfg.train.seed_checkpoint == str(tmp_path / "seed.safetensors")
    err = capsys.readouterr().err
    assert f"flux-cp: --output_dir ~/out is {tmp_path / 'out'}: '~' expanded (the shell leaves it as typed after '=' " \
           "or in quotes)" in err  # fmt: skip
    with pytest.raises(UsageError, match=r"^--output_dir ~nosuchuser4242/out: there is no user 'nosuchuser4242'"):
        parse_config(["--output_dir", "~nosuchuser4242/out"])
    assert parse_config(["--output_dir", "a~b"]).train.output_dir == "a~b"
