"""Every numeric flag has its range checked by the parser (no launch needed), and unused flags are named."""

from __future__ import annotations

import re

import pytest

from flux_cp.config.fields import is_hub_id
from flux_cp.config.parser import build_parser, parse_config
from flux_cp.config.ranges import RULES, given_flags, unused_flags
from flux_cp.errors import UsageError

# (flags, the start of the message). Values that turn training off, that a library would refuse with a traceback,
# and the non-finite values argparse lets through.
BAD = [
    (["--learning_rate", "0"], "--learning_rate 0 is out of range: it must be > 0 (at 0 or below"),
    (["--learning_rate", "-0.0001"], "--learning_rate -0.0001 is out of range"),
    (["--learning_rate", "nan"], "--learning_rate nan is out of range"),
    (["--learning_rate", "inf"], "--learning_rate inf is out of range"),
    (["--lora_alpha", "0"], "--lora_alpha 0 is out of range: it must be > 0 (LoRA's output is scaled"),
    (["--lora_alpha", "-4"], "--lora_alpha -4 is out of range"),
    (["--lora_dropout", "1"], "--lora_dropout 1 is out of range: it must be >= 0 and < 1"),
    (["--lora_dropout", "-0.1"], "--lora_dropout -0.1 is out of range"),
    (["--rank", "0"], "--rank 0 is out of range: it must be >= 1"),
    (["--adam_beta1", "1"], "--adam_beta1 1 is out of range: it must be >= 0 and < 1"),
    (["--adam_beta2", "-0.5"], "--adam_beta2 -0.5 is out of range"),
    (["--adam_epsilon", "0"], "--adam_epsilon 0 is out of range: it must be > 0 and <= 0.001"),
    (["--adam_epsilon", "1"], "--adam_epsilon 1 is out of range"),
    (["--adam_weight_decay", "-0.01"], "--adam_weight_decay -0.01 is out of range: it must be >= 0"),
    (
        ["--learning_rate", "1e-4", "--adam_weight_decay", "2e4"],
        "--learning_rate 0.0001 x --adam_weight_decay 20000 >= 1",
    ),
    (["--max_grad_norm", "-1"], "--max_grad_norm -1 is out of range: it must be >= 0 (0 turns clipping off)"),
    (["--max_grad_norm", "nan"], "--max_grad_norm nan is out of range"),
    (["--lr_power", "0"], "--lr_power 0 is out of range"),
    (["--lr_num_cycles", "0"], "--lr_num_cycles 0 is out of range"),
    (["--lr_warmup_steps", "-1"], "--lr_warmup_steps -1 is out of range"),
    (["--logit_std", "0"], "--logit_std 0 is out of range"),
    (["--logit_mean", "50"], "--logit_mean 50 is out of range"),
    (["--mode_scale", "3"], "--mode_scale 3 is out of range: it must be >= -1 and <= 1.75194"),
    (["--guidance_scale", "-1"], "--guidance_scale -1 is out of range"),
    (["--seed", "-1"], "--seed -1 is out of range: it must be >= 0 and <= 4294967295"),
    (["--seed", str(2**40)], "--seed 1099511627776 is out of range"),
    (["--resolution", "0"], "--resolution 0 is out of range: it must be >= 16"),
    (["--resolution", "-16"], "--resolution -16 is out of range"),
    (["--resolution", "64,0"], "--resolution 0 is out of range: it must be >= 16"),
    (["--repeats", "0"], "--repeats 0 is out of range: it must be >= 1"),
    (["--caption_dropout", "-0.1"], "--caption_dropout -0.1 is out of range: it must be >= 0 and <= 1"),
    (["--num_class_images", "0"], "--num_class_images 0 is out of range: it must be >= 1"),
    (["--prior_loss_weight", "0"], "--prior_loss_weight 0 is out of range: it must be > 0 (at 0 the class images"),
    (["--validation_resolution", "-32"], "--validation_resolution -32 is out of range"),
    (["--max_sequence_length", "0"], "--max_sequence_length 0 is out of range: it must be >= 1 and <= 512"),
    (["--max_sequence_length", "513"], "--max_sequence_length 513 is out of range"),
    (["--train_batch_size", "0"], "--train_batch_size 0 is out of range"),
    (["--max_train_steps", "0"], "--max_train_steps 0 is out of range"),
    (["--num_train_epochs", "0"], "--num_train_epochs 0 is out of range"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0 is out of range"),
    (["--cp_size", "0"], "--cp_size 0 is out of range"),
    (["--cp_mode", "hybrid", "--ulysses_size", "0"], "--ulysses_size 0 is out of range"),
    (["--collective_timeout", "-5"], "--collective_timeout -5 is out of range"),
    (["--collective_timeout", "inf"], "--collective_timeout inf is out of range"),
    (["--checkpointing_steps", "0"], "--checkpointing_steps 0 is out of range"),
    (["--checkpoints_total_limit", "0"], "--checkpoints_total_limit 0 is out of range"),
    (["--validation_steps", "0"], "--validation_steps 0 is out of range"),
    (["--num_validation_images", "0"], "--num_validation_images 0 is out of range"),
    (["--validation_inference_steps", "0"], "--validation_inference_steps 0 is out of range"),
    (["--gpu_memory_gib", "0"], "--gpu_memory_gib 0 is out of range"),
    # Counts and sizes that would exhaust memory or time after the models loaded
    (["--repeats", "1000000000"], "--repeats 1000000000 is out of range: it must be >= 1 and <= 100000 (each image"),
    (["--resolution", "1048576"], "--resolution 1048576 is out of range: it must be >= 16 and <= 16384"),
    (["--validation_resolution", "65536"], "--validation_resolution 65536 is out of range"),
    (["--num_class_images", "10000000"], "--num_class_images 10000000 is out of range"),
    (["--train_batch_size", "100000"], "--train_batch_size 100000 is out of range: it must be >= 1 and <= 1024"),
    (["--gradient_accumulation_steps", "1000000000"], "--gradient_accumulation_steps 1000000000 is out of range"),
    (["--max_train_steps", "10000000000"], "--max_train_steps 10000000000 is out of range"),
    (["--checkpointing_steps", "10000000000"], "--checkpointing_steps 10000000000 is out of range"),
    (["--num_validation_images", "1000000"], "--num_validation_images 1000000 is out of range"),
    (["--validation_inference_steps", "100000"], "--validation_inference_steps 100000 is out of range"),
    (["--rank", "100000"], "--rank 100000 is out of range: it must be >= 1 and <= 6144"),
    (["--cp_ulysses_chunks", "1000000000"], "--cp_ulysses_chunks 1000000000 is out of range"),
    (["--collective_timeout", "1e30"], "--collective_timeout 1e+30 is out of range"),
    (["--resolution", ",".join(str(16 * k) for k in range(1, 18))], "--resolution gives 17 sizes: at most 16"),
    (["--validation_prompt", "a"] * 101, "--validation_prompt gives 101 prompts: at most 100"),
    (["--dataset_name", "./no/such/folder"], "--dataset_name ./no/such/folder: no such folder"),
    (["--dataset_name", "a/b/c"], "--dataset_name a/b/c: no such folder (and not a hub id like owner/name)"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_out_of_range_values_are_refused_by_the_parser(argv, message):
    with pytest.raises(UsageError) as e:
        parse_config(argv)
    assert str(e.value).startswith(message), str(e.value)


def test_every_numeric_flag_has_a_rule_and_the_bounds_themselves_are_accepted():
    numeric = {a.dest for a in build_parser()._actions if a.type in (int, float)}
    assert numeric <= {r.flag for r in RULES}, f"flags without a range: {numeric - {r.flag for r in RULES}}"
    edges = ["--learning_rate", "1e-12", "--lora_dropout", "0.999", "--adam_beta2", "0", "--adam_epsilon", "1e-3",
             "--max_grad_norm", "0", "--mode_scale", "-1", "--seed", str(2**32 - 1), "--resolution", "16",
             "--max_sequence_length", "512", "--guidance_scale", "0", "--lora_alpha", "1"]  # fmt: skip
    args = parse_config(edges)
    assert args.train.learning_rate == 1e-12 and args.train.seed == 2**32 - 1
    parse_config([])  # the defaults are in range


# Flags whose absurd value would exhaust memory or time (a count of images, steps, tokens, samples or pixels): each
# has an upper bound, so that it is refused at start rather than after the models loaded.
COUNTS = ("resolution", "repeats", "num_class_images", "validation_resolution", "max_sequence_length",
          "train_batch_size", "max_train_steps", "profile_step", "num_train_epochs", "gradient_accumulation_steps",
          "lr_warmup_steps", "lr_num_cycles", "rank", "collective_timeout", "cp_ulysses_chunks", "checkpointing_steps",
          "checkpoints_total_limit", "validation_steps", "num_validation_images", "validation_inference_steps",
          "gpu_memory_gib")  # fmt: skip


def test_counts_and_sizes_have_upper_bounds_that_are_accepted():
    rules = {r.flag: r for r in RULES}
    assert [f for f in COUNTS if rules[f].high is None] == []
    edges = [arg for f in ("repeats", "num_class_images", "train_batch_size", "gradient_accumulation_steps",
                           "max_train_steps", "checkpointing_steps", "num_validation_images", "rank")
             for arg in (f"--{f}", str(int(rules[f].high)))]  # fmt: skip
    cfg = parse_config(edges + ["--resolution", "16384", "--validation_prompt", "a"])
    assert cfg.data.repeats == rules["repeats"].high and cfg.data.resolution == (16384,)


def test_hub_ids_are_not_mistaken_for_missing_folders():
    assert is_hub_id("owner/name") and is_hub_id("lambdalabs/naruto-blip-captions") and is_hub_id("mnist")
    assert not any(is_hub_id(p) for p in ("./data", "/abs/path", "a/b/c", "~/x", "../x", "owner/..", "a\\b"))
    assert parse_config(["--dataset_name", "owner/name"]).data.dataset_name == "owner/name"


def test_flags_that_this_run_would_not_use_are_named(capsys):
    argv = ["--full_finetune", "--rank", "4", "--validation_steps", "5", "--mode_scale", "1.0", "--lr_power", "2",
            "--lr_warmup_steps", "10", "--max_train_steps", "5", "--lr_scheduler", "linear"]  # fmt: skip
    args = parse_config(argv)
    warnings = unused_flags(given_flags(build_parser(), argv), args.flat())
    assert warnings == [
        "--validation_steps has no effect without --validation_prompt",
        "--rank has no effect with --full_finetune (it trains all weights, no LoRA)",
        "--mode_scale has no effect without --weighting_scheme mode",
        "--lr_power has no effect without --lr_scheduler polynomial",
        "--lr_warmup_steps 10 >= --max_train_steps 5: the LR never reaches --learning_rate",
    ]
    assert "warning: --rank has no effect with --full_finetune" in capsys.readouterr().err
    assert unused_flags(given_flags(build_parser(), []), parse_config([]).flat()) == []


@pytest.mark.parametrize(
    "argv, warning",
    [
        (["--validation_image", "ref.png"], "--validation_image has no effect without --validation_prompt"),
        (["--cp_mode", "ulysses"], "--cp_mode ulysses has no effect at --cp_size 1 (one rank holds the whole sequence: "
         "no CP exchange runs, run_config.json records ring)"),
        (["--cp_mode", "hybrid", "--ulysses_size", "1"], "--ulysses_size has no effect at --cp_size 1"),
    ],
)  # fmt: skip
def test_flags_ignored_at_one_rank_or_without_prompts_are_named(argv, warning):
    values = {**parse_config(["--max_train_steps", "2"]).flat(), **dict(zip(argv[::2], argv[1::2]))}  # no demo prompts
    values = {k.lstrip("-"): (int(v) if k == "--ulysses_size" else v) for k, v in values.items()}
    warnings = unused_flags(given_flags(build_parser(), argv), values)
    assert any(w.startswith(warning) for w in warnings), warnings
    assert not unused_flags(
        given_flags(build_parser(), ["--cp_mode", "ring"]), parse_config(["--cp_mode", "ring"]).flat()
    )


# --- flags whose effect never happens in the run: refused where the user clearly expected it, else one warning ----

NEVER = {
    "profile past the last step": (
        "--max_train_steps 3 --profile_step 5",
        "--profile_step 5 is past the last step of this run (--max_train_steps 3): no step would be profiled",
    ),
    "EMA never updated": (
        "--max_train_steps 3 --use_ema --ema_update_interval 5",
        "--ema_update_interval 5 > --max_train_steps 3: the EMA, the run's output with --use_ema, would never be "
        "updated and would stay the initial weights",
    ),
}


@pytest.mark.parametrize("case", list(NEVER))
def test_a_step_the_run_never_reaches_is_refused_where_its_effect_was_clearly_wanted(case):
    flags, message = NEVER[case]
    with pytest.raises(UsageError, match="^" + re.escape(message)):
        parse_config(flags.split())
    parse_config(flags.replace("3", "5").split())  # at the last step: accepted


MOOT = {
    "validation at the end only": (
        "--max_train_steps 4 --validation_prompt a --validation_steps 4",
        "--validation_steps 4 >= --max_train_steps 4: validation images are rendered at the end only",
    ),
    "only the final checkpoint": (
        "--max_train_steps 4 --checkpointing_steps 10",
        "--checkpointing_steps 10 >= --max_train_steps 4: only the final checkpoint is written",
    ),
    "a limit never reached": (
        "--max_train_steps 4 --checkpointing_steps 2 --checkpoints_total_limit 2",
        "--checkpoints_total_limit 2: this run (--max_train_steps 4) writes 2 checkpoints, so none is removed",
    ),
    "epochs beside a step count": (
        "--max_train_steps 4 --num_train_epochs 3",
        "--num_train_epochs has no effect with --max_train_steps (it sets the number of steps)",
    ),
    "logs no tracker writes": (
        "--max_train_steps 4 --report_to none --logging_dir tb",
        "--logging_dir has no effect with --report_to none (no tracker writes logs)",
    ),
    "hub columns of a local folder": (
        "--max_train_steps 4 --dataset_name data/tiny_shapes --image_column img --dataset_config_name c",
        "--image_column has no effect without a hub data set",
    ),
    "text encoder LR under Prodigy": (
        "--max_train_steps 4 --train_text_encoder --optimizer prodigy --text_encoder_lr 1e-5",
        "--text_encoder_lr has no effect with --optimizer prodigy (it takes --learning_rate for both",
    ),
}


@pytest.mark.parametrize("case", list(MOOT))
def test_a_flag_whose_effect_never_happens_in_the_run_is_said_in_one_line(case):
    """Each flag given whose effect this run never has gets one warning; the same flag where it has one gets none."""
    flags, warning = MOOT[case]
    argv = flags.split()
    warnings = unused_flags(given_flags(build_parser(), argv), parse_config(argv).flat())
    assert [w for w in warnings if w.startswith(warning)], warnings


def test_flags_that_take_effect_get_no_warning():
    argv = (
        "--max_train_steps 8 --validation_prompt a --validation_steps 4 --checkpointing_steps 2 "
        "--checkpoints_total_limit 2 --report_to tensorboard --logging_dir tb --dataset_name owner/name "
        "--image_column img --train_text_encoder --text_encoder_lr 1e-5 --use_ema --ema_update_interval 8 "
        "--profile_step 8"
    ).split()
    assert unused_flags(given_flags(build_parser(), argv), parse_config(argv).flat()) == []


def test_an_epoch_count_that_accumulation_does_not_divide_is_said_and_step_flags_are_checked_against_it():
    """A run counted in epochs knows its steps once the data is listed (the trainer calls these then): an epoch of 24
    batches with 5 accumulated micro-steps trains 4 steps, 20 of the 24 batches; the step flags are checked against
    those 4 steps as against --max_train_steps."""
    from flux_cp.config.ranges import check_steps, step_warnings

    argv = ["--gradient_accumulation_steps", "5", "--checkpointing_steps", "9", "--pretrained_model_name_or_path", "m"]
    values, steps = parse_config(argv).flat(), "the 4 steps of --num_train_epochs 1"
    assert step_warnings(given_flags(build_parser(), argv), values, 4, steps, batches_per_epoch=24) == [
        f"--checkpointing_steps 9 >= {steps}: only the final checkpoint is written",
        "an epoch has 24 global batches, not a multiple of --gradient_accumulation_steps 5: the 4 steps of "
        "--num_train_epochs 1 train 20 of the 24 batches of 1 epoch; set --max_train_steps to choose the count",
    ]
    assert step_warnings(set(), values, 4, steps, batches_per_epoch=20) == []
    with pytest.raises(UsageError, match=r"^--profile_step 9 is past the last step of this run \(the 4 steps of"):
        check_steps({**values, "profile_step": 9}, 4, steps)
