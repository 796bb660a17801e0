"""The valid range of every numeric flag, checked before anything loads, and the flags that a run would accept
but not use (warned about).

argparse accepts any int or float, `nan` and `inf` included; the libraries behind the flags then either train
nothing without a word (--learning_rate 0, --lora_alpha 0, --lora_dropout 1, --max_grad_norm 0 in diffusers'
examples) or fail late with their own traceback (torch.optim's betas, peft's dropout). Each rule says why its
bound is there, and the message repeats it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cp.mode import DEFAULT_MODE
from flux_cp.errors import UsageError

# The SD3 paper's "mode" density is a valid distribution on [0, 1] only for -1 <= scale <= 2 / (pi - 2).
MODE_SCALE_MAX = 2 / (math.pi - 2)
SEED_MAX = 2**32 - 1  # numpy's and most samplers' limit; larger seeds are reduced differently by each library
# Upper bounds of counts and sizes, so that an absurd value is refused at start instead of exhausting memory or time
# after the models loaded. Each is far beyond what a run of FLUX uses.
RESOLUTION_MAX = 16384  # (16384 / 16)^2 = 1M image tokens per sample; the VAE encodes a whole image at once
_LARGEST = f"{RESOLUTION_MAX} px gives (16384 / 16)^2 = 1M image tokens"
REPEATS_MAX = 100_000
STEPS_MAX = 100_000_000  # optimizer steps (and intervals counted in them)
PROMPTS_MAX = 100  # --validation_prompt given this many times at most: each renders its images at every validation
RESOLUTIONS_MAX = 16  # sizes in one --resolution list: an epoch trains every image at each of them


def number(v: float) -> str:
    """A flag's value as the user would type it: whole numbers in full (4294967295, not 4.29497e+09)."""
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e18):
        return str(int(v))
    return f"{v:g}"


@dataclass(frozen=True)
class Rule:
    flag: str  # the attribute name (the flag without its dashes)
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # True: the value must be > low (else >= low)
    high_open: bool = False  # True: the value must be < high (else <= high)
    why: str = ""

    def bounds(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {number(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {number(self.high)}")
        return " and ".join(parts)

    def ok(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return not (self.high is not None and (v >= self.high if self.high_open else v > self.high))


RULES = (
    Rule("resolution", 16, RESOLUTION_MAX, why=f"the smallest image is one 2x2 patch of 8x VAE latents; {_LARGEST}"),
    Rule(
        "repeats",
        1,
        REPEATS_MAX,
        why="each image appears this many times per epoch: for a longer run set "
        "--max_train_steps or --num_train_epochs instead",
    ),
    Rule("caption_dropout", 0, 1, why="a probability"),
    Rule(
        "num_class_images",
        1,
        10_000,
        why="prior preservation trains on class images; each missing one is generated with the base model",
    ),
    Rule(
        "prior_loss_weight",
        0,
        low_open=True,
        why="at 0 the class images cost a second batch and change nothing; drop --with_prior_preservation instead",
    ),
    Rule(
        "validation_resolution",
        16,
        RESOLUTION_MAX,
        why=f"the smallest image is one 2x2 patch of 8x VAE latents; {_LARGEST}",
    ),
    Rule("max_sequence_length", 1, 512, why="FLUX.1's pipelines refuse longer prompts (T5's limit)"),
    Rule("seed", 0, SEED_MAX, why="seeds are 32-bit"),
    Rule("train_batch_size", 1, 1024, why="samples of one rank that pass the transformer together"),
    Rule("max_train_steps", 1, STEPS_MAX),
    Rule("profile_step", 1, STEPS_MAX),
    Rule("num_train_epochs", 1, 1_000_000),
    Rule("gradient_accumulation_steps", 1, 10_000, why="micro-batches per optimizer step"),
    Rule("learning_rate", 0, low_open=True, why="at 0 or below the weights never improve"),
    Rule("lr_warmup_steps", 0, STEPS_MAX),
    Rule("lr_num_cycles", 1, STEPS_MAX, why="the number of cosine restarts"),
    Rule("lr_power", 0, low_open=True, why="0 keeps the LR constant and a negative power makes it grow"),
    Rule("adam_beta1", 0, 1, high_open=True, why="AdamW's moment decay"),
    Rule("adam_beta2", 0, 1, high_open=True, why="AdamW's moment decay"),
    Rule("adam_weight_decay", 0, why="a negative decay pushes the weights away from zero"),
    Rule("prodigy_beta3", 0, 1, high_open=True, why="the decay of Prodigy's running averages"),
    Rule(
        "adam_epsilon",
        0,
        1e-3,
        low_open=True,
        why="0 divides by zero where a gradient is zero; above 1e-3 it swamps LoRA-sized gradients and the "
        "updates vanish",
    ),
    Rule("max_grad_norm", 0, why="0 turns clipping off"),
    Rule("text_encoder_lr", 0, low_open=True, why="at 0 or below the text encoder's LoRA never improves"),
    Rule("adam_weight_decay_text_encoder", 0, why="a negative decay pushes the weights away from zero"),
    Rule(
        "ema_decay",
        0,
        1,
        low_open=True,
        high_open=True,
        why="the share of the average kept at each update: at 0 the EMA is the raw weights, at 1 it never moves",
    ),
    Rule("ema_update_interval", 1, STEPS_MAX, why="optimizer steps between EMA updates"),
    Rule("logit_std", 0, low_open=True, why="the spread of the logit-normal timestep density"),
    Rule("logit_mean", -10, 10, why="beyond that every timestep lands at 0 or 1"),
    Rule("mode_scale", -1, MODE_SCALE_MAX, why="outside it the mode density leaves [0, 1]"),
    Rule("guidance_scale", 0, why="the guidance embedding of guidance-distilled models"),
    Rule(
        "rank",
        1,
        6144,
        why="the hidden size of FLUX.2 [dev], the widest layer LoRA adapts: a larger rank adds memory and nothing else",
    ),
    Rule("lora_alpha", 0, low_open=True, why="LoRA's output is scaled by alpha / rank: 0 learns nothing"),
    Rule("lora_dropout", 0, 1, high_open=True, why="at 1 every LoRA input is dropped and nothing is learned"),
    Rule("cp_size", 1),
    Rule("ulysses_size", 1),
    Rule(
        "collective_timeout",
        0,
        30 * 86400,
        low_open=True,
        why="seconds before a stuck collective aborts the run (at most 30 days)",
    ),
    Rule("cp_ulysses_chunks", 1, 1024, why="the heads are split into this many chunks, at most one head each"),
    Rule("checkpointing_steps", 1, STEPS_MAX),
    Rule("checkpoints_total_limit", 1, STEPS_MAX, why="the number of checkpoints kept, the newest included"),
    Rule("validation_steps", 1, STEPS_MAX),
    Rule("num_validation_images", 1, 100, why="images rendered per --validation_prompt, each a full sampling"),
    Rule("validation_inference_steps", 1, 1000, why="the scheduler has 1000 timesteps"),
    Rule("gpu_memory_gib", 0, 4096, low_open=True, why="GiB per GPU"),
    Rule("num_processes", 1, 65536, why="processes to plan for"),
    Rule("host_memory_gib", 0, 1 << 20, low_open=True, why="GiB of host memory"),
)


def check_ranges(values: Mapping[str, object], rules: Iterable[Rule] = RULES) -> None:
    """A UsageError naming the first flag outside its range. Unset optional flags (None) and flags this run
    does not have are skipped."""
    for rule in rules:
        value = values.get(rule.flag)
        if value is None or isinstance(value, bool):
            continue
        for v in value if isinstance(value, tuple) else (value,):  # a list flag (--resolution 1024,2048): each
            if not rule.ok(v):
                why = f" ({rule.why})" if rule.why else ""
                raise UsageError(f"--{rule.flag} {number(v)} is out of range: it must be {rule.bounds()}{why}")
    counts = (
        ("resolution", RESOLUTIONS_MAX, "sizes", "every image trains at each of them every epoch"),
        ("validation_prompt", PROMPTS_MAX, "prompts", "each renders its images at every validation"),
    )
    for flag, most, what, why in counts:
        given = values.get(flag)
        if isinstance(given, tuple) and len(given) > most:
            raise UsageError(f"--{flag} gives {len(given)} {what}: at most {most} ({why})")
    steps = values.get("max_train_steps")
    if isinstance(steps, int) and not isinstance(steps, bool):  # known from the flags (else the trainer checks)
        check_steps(values, steps, f"--max_train_steps {steps}")
    lr, decay = values.get("learning_rate"), values.get("adam_weight_decay")
    if lr is not None and decay is not None and lr * decay >= 1:
        raise UsageError(
            f"--learning_rate {lr:g} x --adam_weight_decay {decay:g} >= 1: AdamW's decoupled decay would zero or "
            "flip every weight each step; lower one of them"
        )


# flag -> (when it is used, a test on the values, and what to say). Only for flags whose default is never used
# by the run they are given to, so a flag given explicitly but unused is a sign of a mistaken command line.
_USED_ONLY = (
    (
        (
            "validation_steps",
            "num_validation_images",
            "validation_resolution",
            "validation_inference_steps",
            "validation_image",
        ),
        lambda v: bool(v.get("validation_prompt")),
        "without --validation_prompt",
    ),
    (
        ("ulysses_size",),
        lambda v: (v.get("cp_size") or 1) > 1,
        "at --cp_size 1 (one rank holds the whole sequence: no CP exchange runs, run_config.json records "
        f"{DEFAULT_MODE})",
    ),
    (
        ("rank", "lora_alpha", "lora_dropout", "lora_layers", "adapter"),
        lambda v: not v.get("full_finetune"),
        "with --full_finetune (it trains all weights, no LoRA)",
    ),
    (
        ("logit_mean", "logit_std"),
        lambda v: v.get("weighting_scheme") == "logit_normal",
        "without --weighting_scheme logit_normal",
    ),
    (("mode_scale",), lambda v: v.get("weighting_scheme") == "mode", "without --weighting_scheme mode"),
    (("lr_power",), lambda v: v.get("lr_scheduler") == "polynomial", "without --lr_scheduler polynomial"),
    (
        ("lr_num_cycles",),
        lambda v: v.get("lr_scheduler") == "cosine_with_restarts",
        "without --lr_scheduler cosine_with_restarts",
    ),
    (
        ("lr_warmup_steps",),
        lambda v: v.get("lr_scheduler") != "constant",
        "with --lr_scheduler constant (use constant_with_warmup)",
    ),
    (("encodings_dir",), lambda v: not v.get("no_cache"), "with --no_cache"),
    (
        ("prodigy_beta3", "prodigy_decouple", "prodigy_use_bias_correction", "prodigy_safeguard_warmup"),
        lambda v: v.get("optimizer") == "prodigy",
        "without --optimizer prodigy",
    ),
    (("use_8bit_adam",), lambda v: v.get("optimizer") == "adamw", "with --optimizer prodigy (it is 8-bit AdamW)"),
    (("caption_column",), lambda v: v.get("instance_prompt") is None, "with --instance_prompt (one prompt for all)"),
    (
        ("class_data_dir", "class_prompt", "num_class_images", "prior_loss_weight"),
        lambda v: bool(v.get("with_prior_preservation")),
        "without --with_prior_preservation",
    ),
    (
        ("text_encoder_lr", "adam_weight_decay_text_encoder"),
        lambda v: bool(v.get("train_text_encoder")),
        "without --train_text_encoder",
    ),
    (
        ("text_encoder_lr",),
        lambda v: not v.get("train_text_encoder") or v.get("optimizer") != "prodigy",
        "with --optimizer prodigy (it takes --learning_rate for both, as diffusers' example)",
    ),
    (("ema_decay", "ema_update_interval"), lambda v: bool(v.get("use_ema")), "without --use_ema"),
    (
        ("num_train_epochs",),
        lambda v: v.get("max_train_steps") is None,
        "with --max_train_steps (it sets the number of steps)",
    ),
    (("logging_dir",), lambda v: v.get("report_to") != "none", "with --report_to none (no tracker writes logs)"),
    (
        ("image_column", "dataset_config_name"),
        lambda v: bool(v.get("dataset_name")) and not os.path.isdir(str(v.get("dataset_name"))),
        "without a hub data set (--dataset_name owner/name; a local folder's metadata.jsonl names its images)",
    ),
    (("num_processes",), lambda v: bool(v.get("plan")), "without --plan (accelerate launch sets the processes)"),
    (("hub_model_id", "hub_token"), lambda v: bool(v.get("push_to_hub")), "without --push_to_hub"),
    (
        ("cp_overlap",),
        lambda v: _may_compile(v) and v.get("cp_size", 1) > 1,
        "without --compile and --cp_size > 1 (it orders a compiled block's CP exchanges)",
    ),
    (
        ("cp_exchange_first", "cp_ulysses_chunks"),
        lambda v: v.get("cp_size", 1) > 1,
        "with --cp_size 1 (no CP exchanges)",
    ),
    (
        ("recompute_attention",),
        lambda v: v.get("gradient_checkpointing", "none") not in ("none", "0") and _may_compile(v),
        "without --gradient_checkpointing and --compile (eager checkpointing always recomputes the attention)",
    ),
)


def _may_compile(values: Mapping[str, object]) -> bool:
    """Whether the blocks may be compiled (--compile auto decides at start: on for a GPU run where it pays)."""
    return values.get("compile", "auto") != "off" or bool(values.get("compile_mode"))


def unused_flags(given: Iterable[str], values: Mapping[str, object]) -> list[str]:
    """One warning per flag given on the command line that this run will not use."""
    given = set(given)
    out = []
    for flags, used, context in _USED_ONLY:
        if used(values):
            continue
        out += [f"--{f} has no effect {context}" for f in flags if f in given]
    mode = values.get("cp_mode")
    if "cp_mode" in given and mode not in ("auto", DEFAULT_MODE) and (values.get("cp_size") or 1) == 1:
        out.append(
            f"--cp_mode {mode} has no effect at --cp_size 1 (one rank holds the whole sequence: no CP exchange "
            f"runs, run_config.json records {DEFAULT_MODE})"
        )
    steps = values.get("max_train_steps")
    if steps:  # known from the flags (else from the data's epoch: the trainer says it then)
        out += step_warnings(given, values, steps, f"--max_train_steps {steps}")
    return out


def check_steps(values: Mapping[str, object], max_steps: int, steps: str) -> None:
    """A UsageError for a step flag whose effect a run of `max_steps` optimizer steps (`steps`: what set them, e.g.
    "--max_train_steps 200") can never give, where the user clearly expected it: a profile of a step past the last,
    and an EMA never updated (its interval beyond the run), which would make the run's output the initial weights."""
    profile = values.get("profile_step")
    if profile is not None and profile > max_steps:
        raise UsageError(
            f"--profile_step {profile} is past the last step of this run ({steps}): no step would be profiled; give a "
            f"step from 1 to {max_steps}"
        )
    every = values.get("ema_update_interval")
    if values.get("use_ema") and every is not None and every > max_steps:
        raise UsageError(
            f"--ema_update_interval {every} > {steps}: the EMA, the run's output with --use_ema, would never be "
            f"updated and would stay the initial weights; give an interval of at most {max_steps}"
        )


def step_warnings(
    given: Iterable[str], values: Mapping[str, object], max_steps: int, steps: str, batches_per_epoch: int | None = None
) -> list[str]:
    """One warning per interval or count flag given whose effect never happens in a run of `max_steps` optimizer
    steps (`steps`: what set them), and, for a run counted in epochs (`batches_per_epoch` global batches each), an
    accumulation that leaves batches of every epoch out of the count."""
    given, out = set(given), []
    every = values.get("validation_steps")
    if "validation_steps" in given and values.get("validation_prompt") and every and every >= max_steps:
        out.append(f"--validation_steps {every} >= {steps}: validation images are rendered at the end only")
    every = values.get("checkpointing_steps")
    if "checkpointing_steps" in given and every and every >= max_steps:
        out.append(f"--checkpointing_steps {every} >= {steps}: only the final checkpoint is written")
    limit = values.get("checkpoints_total_limit")
    if "checkpoints_total_limit" in given and limit and every and not values.get("resume_from_checkpoint"):
        saves = -(-max_steps // every)  # one every --checkpointing_steps, and the last
        if saves <= limit:
            written = f"{saves} checkpoint{'s' if saves > 1 else ''}"
            out.append(f"--checkpoints_total_limit {limit}: this run ({steps}) writes {written}, so none is removed")
    warmup = values.get("lr_warmup_steps")
    if "lr_warmup_steps" in given and warmup and warmup >= max_steps and values.get("lr_scheduler") != "constant":
        out.append(f"--lr_warmup_steps {warmup} >= {steps}: the LR never reaches --learning_rate")
    accumulation = values.get("gradient_accumulation_steps") or 1
    if batches_per_epoch and batches_per_epoch % accumulation:
        epochs = values.get("num_train_epochs") or 1
        out.append(
            f"an epoch has {batches_per_epoch} global batches, not a multiple of --gradient_accumulation_steps "
            f"{accumulation}: {steps} train {max_steps * accumulation} of the {epochs * batches_per_epoch} batches "
            f"of {epochs} epoch{'s' if epochs > 1 else ''}; set --max_train_steps to choose the count"
        )
    return out


def given_flags(parser, argv: list[str]) -> set[str]:
    """Destinations of the flags present in `argv` (not those left at their defaults)."""
    import argparse
    import copy

    quiet = copy.deepcopy(parser)
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    return set(vars(quiet.parse_known_args(argv)[0]))
