"""Command-line flags of `train_flux_cp.py` as typed, frozen config sections, parsed once.

Each section is a frozen dataclass; each of its fields is the flag `--<field name>` (diffusers' Flux
examples' names where they exist). Adding a flag is one field with `flag(...)` in the section whose module
uses it: the parser, `--help`, the run's `run_config.json` and the trackers' hyperparameters all follow.
Defaults that depend on other flags (the embedded tiny model's resolution, `--lora_alpha` = `--rank`,
`--validation_resolution` = `--resolution`) are resolved while parsing (`derive=`), so sections always hold
final values. Checks that need only the flags (no model, data or GPU) live in each section's `check()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError
from .flag_ranges import check_ranges, given_flags, unused_flags
from .flow import WEIGHTING_SCHEMES
from .lora import DEFAULT_TARGETS
from .lora_format import FORMATS as LORA_FORMATS

CP_MODES = ("auto", "ring", "ulysses", "hybrid")
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")


def flag(
    default: Any,
    help: str | None = None,  # noqa: A002 - argparse's name
    *,
    choices: tuple | None = None,
    derive: Callable[[dict], Any] | None = None,
    parse: Callable[[str], Any] | None = None,
    repeat: bool = False,
) -> Any:
    """A dataclass field that is also the flag `--<field name>`.

    derive: computes the value from the other raw flag values when the flag is not given (the parser's
        default is then None, so "not given" is seen). parse: converts the command-line string (the field
        keeps the converted value). repeat: the flag may be given several times (a tuple of values)."""
    meta = {"help": help, "choices": choices, "derive": derive, "parse": parse, "repeat": repeat}
    return field(default=default, metadata=meta)


def _is_embedded(raw: dict) -> bool:
    return raw["pretrained_model_name_or_path"] is None


# The embedded default run as the README's demo (no model, no data set, no step count): settings under which
# its loss curve visibly falls within about a minute on 2 CPU cores, and validation images before and after.
# Measured (docs in README): 200 steps at 1e-3 with 4 samples per step. Real runs keep diffusers' defaults.
DEMO_STEPS, DEMO_LEARNING_RATE, DEMO_BATCH = 200, 1e-3, 4
DEMO_PROMPTS = ("a white circle on a black background", "a yellow triangle on a purple background")
_DEMO = "_demo"  # key in the raw flag values: decided on the flags as given, before any default is derived


def _is_demo(raw: dict) -> bool:
    return raw[_DEMO]


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


# --- the sections ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Which FLUX.1 to load (flux_cp.model)."""

    pretrained_model_name_or_path: str | None = flag(
        None, "Diffusers-layout folder or hub id of FLUX.1. Default: a tiny Flux built locally."
    )
    revision: str | None = flag(None)
    variant: str | None = flag(None, "Weight file variant, e.g. fp16.")
    transformer_init: str = flag(
        "pretrained",
        "'random': build the transformer from its config with seeded random weights (benchmarks and "
        "equivalence runs of FLUX.1-sized models without downloading them).",
        choices=("pretrained", "random"),
    )

    @property
    def embedded_default(self) -> bool:
        """No model named: the tiny Flux built locally, trained on the bundled data set."""
        return self.pretrained_model_name_or_path is None


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters or full fine-tuning (flux_cp.lora, flux_cp.model). `rank` is the LoRA rank (the process
    rank is `Layout.rank`)."""

    full_finetune: bool = flag(False, "Train all transformer weights instead of LoRA.")
    rank: int = flag(16, "LoRA rank.")
    lora_alpha: int = flag(16, "Default: the rank.", derive=lambda raw: raw["rank"])
    lora_dropout: float = flag(0.0)
    lora_layers: tuple[str, ...] | None = flag(
        None,
        "Comma-separated module name suffixes that get LoRA adapters. Default: diffusers' LoRA example's for the "
        f"model family: FLUX.1 {','.join(DEFAULT_TARGETS)} (Kontext pairs add proj_mlp); FLUX.2 "
        "to_k,to_q,to_v,to_out.0,to_qkv_mlp_proj and every single block's attn.to_out.",
        parse=_comma_list,
    )
    lora_format: str = flag(
        "diffusers",
        "Layout of pytorch_lora_weights.safetensors: 'diffusers' (FluxPipeline.load_lora_weights, ComfyUI) or "
        "'kohya' (kohya / BFL names: ComfyUI, Forge, kohya's tools).",
        choices=LORA_FORMATS,
    )

    def check(self) -> None:
        if self.full_finetune and self.lora_format != "diffusers":
            raise UsageError(
                f"--lora_format {self.lora_format} applies to LoRA files; --full_finetune writes a transformer "
                "folder in diffusers' layout: drop one of the two"
            )


@dataclass(frozen=True)
class DataConfig:
    """Images, captions and their encodings (flux_cp.data, flux_cp.encode)."""

    dataset_name: str | None = flag(
        None,
        "Hub data set id, or a local folder of images with metadata.jsonl or a .txt caption beside each image. "
        "Default: the bundled data set.",
    )
    dataset_config_name: str | None = flag(None)
    image_column: str = flag("image")
    caption_column: str = flag("text")
    cond_image_column: str | None = flag(
        None,
        "FLUX.1 Kontext: the column of each target's reference image (a local folder's metadata.jsonl names it in "
        "'<column>_file_name'; found there without this flag when it is the only one).",
    )
    instance_prompt: str | None = flag(
        None, "DreamBooth-style: use this prompt for every image (captions are ignored)."
    )
    resolution: int = flag(
        1024,
        "Training resolution in pixels (multiple of 16). Default: 1024, or 64 for the tiny default.",
        derive=lambda raw: 64 if _is_embedded(raw) else 1024,
    )
    center_crop: bool = flag(False, "Center crop (default: random crop).")
    random_flip: bool = flag(False)
    aspect_buckets: bool = flag(
        False, "Group images into aspect-ratio buckets of about resolution^2 pixels instead of square crops."
    )
    max_sequence_length: int = flag(
        512,
        "T5 tokens per prompt (<= 512). Default: 512, or 32 for the tiny default.",
        derive=lambda raw: 32 if _is_embedded(raw) else 512,
    )
    vae_encode_mode: str | None = flag(
        None,
        "The VAE latent of each image: 'sample' (a draw from its posterior, every step) or 'mode' (its mean). "
        "Default: diffusers' example's for the model family and data: FLUX.1 sample, FLUX.1 Kontext pairs and "
        "FLUX.2 mode. Reference images always use the mode.",
        choices=("sample", "mode"),
    )
    cache_dir: str | None = flag(
        None, "Where encoded latents and prompt embeddings are cached. Default: ~/.cache/flux_cp/encodings."
    )
    no_cache: bool = flag(
        False, "Encode every batch on the fly (keeps VAE and text encoders loaded; per-epoch random crops)."
    )

    def check(self) -> None:
        if self.resolution % 16:
            raise UsageError(f"--resolution {self.resolution} must be a multiple of 16 (8x VAE, 2x2 patches)")
        name = self.dataset_name
        if name and not os.path.exists(name) and not is_hub_id(name):
            raise UsageError(f"--dataset_name {name}: no such folder (and not a hub id like owner/name)")
        if self.cond_image_column is not None and self.dataset_name is None:
            raise UsageError("--cond_image_column needs --dataset_name (the bundled data set has no reference images)")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation: batch, steps, optimizer, schedule, loss, precision (train_flux_cp.py, flux_cp.flow)."""

    output_dir: str = flag("flux-cp-output")
    overwrite_output_dir: bool = flag(
        False,
        "Replace an earlier run in --output_dir (its checkpoints, weights, metrics, validation images and logs are "
        "removed; other files stay). Without it, a folder holding another run is refused unless resumed.",
    )
    seed: int = flag(0)
    train_batch_size: int = flag(
        1,
        f"Samples per data-parallel rank per micro-step. Default: 1, or {DEMO_BATCH} for the demo.",
        derive=lambda raw: DEMO_BATCH if _is_demo(raw) else 1,
    )
    max_train_steps: int | None = flag(
        None,
        f"Optimizer steps. Overrides --num_train_epochs. The demo: {DEMO_STEPS}.",
        derive=lambda raw: DEMO_STEPS if _is_demo(raw) else None,
    )
    num_train_epochs: int = flag(1, "Default: 1.", derive=lambda raw: 1)
    gradient_accumulation_steps: int = flag(1)
    gradient_checkpointing: bool = flag(False)
    learning_rate: float = flag(
        1e-4,
        f"Default: 1e-4, or {DEMO_LEARNING_RATE:g} for the demo.",
        derive=lambda raw: DEMO_LEARNING_RATE if _is_demo(raw) else 1e-4,
    )
    scale_lr: bool = flag(False, "Multiply the LR by the global batch size.")
    lr_scheduler: str = flag("constant", choices=LR_SCHEDULERS)
    lr_warmup_steps: int = flag(0)
    lr_num_cycles: int = flag(1)
    lr_power: float = flag(1.0)
    adam_beta1: float = flag(0.9)
    adam_beta2: float = flag(0.999)
    adam_weight_decay: float = flag(1e-4)
    adam_epsilon: float = flag(1e-8)
    max_grad_norm: float = flag(1.0)
    mixed_precision: str | None = flag(
        None, "Default: accelerate's config (bf16 in the GPU configs here).", choices=("no", "fp16", "bf16")
    )
    allow_tf32: bool = flag(False)
    weighting_scheme: str = flag("none", choices=WEIGHTING_SCHEMES)
    logit_mean: float = flag(0.0)
    logit_std: float = flag(1.0)
    mode_scale: float = flag(1.29)
    guidance_scale: float = flag(
        3.5,
        "Guidance embedding value for guidance-distilled checkpoints (FLUX.1-dev); also used for validation images.",
    )
    deterministic: bool = flag(False, "Deterministic kernels (slower).")
    profile_step: int | None = flag(
        None,
        "Profile this step (torch.profiler): a Chrome trace per rank and a summary of the GPU time by kernel kind, "
        "with how much of the communication overlapped compute, under OUTPUT_DIR/profile/.",
    )
    seed_checkpoint: str | None = flag(
        None,
        "Initial trainable weights: written here when absent, read when present, so runs with different layouts "
        "start from identical parameters.",
    )
    on_nonfinite: str = flag("stop", "What to do when the loss or gradient norm is NaN/inf.", choices=("stop", "skip"))
    compile: bool = flag(False, "torch.compile each transformer block.")
    recompute_attention: bool = flag(
        False,
        "With --gradient_checkpointing and --compile: recompute the attention (and its CP exchanges) in the backward "
        "instead of keeping its outputs. Saves memory (--plan shows how much) at the cost of a second attention "
        "forward per block.",
    )
    compile_mode: str | None = flag(
        None,
        "torch.compile mode of the blocks (implies --compile); reduce-overhead replays each block's forward and "
        "backward as CUDA graphs, communication included: the fastest on GPUs, most of all for short sequences.",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )


@dataclass(frozen=True)
class ParallelConfig:
    """The CP group and collectives (flux_cp.parallel, cp)."""

    cp_size: int = flag(1, "Ranks that share one sample's tokens.")
    cp_mode: str = flag("auto", choices=CP_MODES)
    ulysses_size: int | None = flag(None, "Ulysses degree of the hybrid mode.")
    collective_timeout: float = flag(
        600.0, "Seconds before a stuck collective aborts the run (a dead rank never hangs the others)."
    )

    def check(self) -> None:
        if self.cp_mode == "hybrid" and self.ulysses_size is None:
            raise UsageError("--cp_mode hybrid needs --ulysses_size (the Ulysses degree, a divisor of --cp_size)")
        if self.ulysses_size is not None and self.cp_mode not in ("hybrid", "auto"):
            raise UsageError(f"--ulysses_size is only used with --cp_mode hybrid (got --cp_mode {self.cp_mode})")
        if self.ulysses_size is not None and self.cp_size % self.ulysses_size:
            raise UsageError(f"--ulysses_size {self.ulysses_size} must divide --cp_size {self.cp_size}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Training checkpoints and resume (flux_cp.checkpoint)."""

    checkpointing_steps: int = flag(500)
    checkpoints_total_limit: int | None = flag(None)
    resume_from_checkpoint: str | None = flag(None, "'latest' or a checkpoint folder.")
    checkpoint_weights_only: bool = flag(
        False,
        "Checkpoints hold the trainable weights and the LR schedule but not AdamW's moments (a third of the size). "
        "Resuming from one restarts the moments from zero: training continues, but not exactly as uninterrupted.",
    )

    def check(self) -> None:
        resume = self.resume_from_checkpoint
        if resume not in (None, "latest") and not os.path.isdir(resume):
            raise UsageError(f"--resume_from_checkpoint {resume}: no such checkpoint folder")


@dataclass(frozen=True)
class ValidationConfig:
    """Validation images and logging (flux_cp.validation, flux_cp.metrics, trackers)."""

    validation_prompt: tuple[str, ...] | None = flag(
        None,
        "Repeatable. The embedded default also renders them before training (step 0). The demo: two captions of "
        "the bundled set.",
        repeat=True,
        derive=lambda raw: DEMO_PROMPTS if _is_demo(raw) else None,
    )
    validation_image: str | None = flag(
        None, "FLUX.1 Kontext: the reference image every --validation_prompt edits (FluxKontextPipeline)."
    )
    validation_steps: int | None = flag(None, "Default: only at the end of training.")
    num_validation_images: int = flag(2)
    validation_resolution: int = flag(1024, "Default: --resolution.", derive=lambda raw: raw["resolution"])
    validation_inference_steps: int = flag(28)
    report_to: str = flag("tensorboard", choices=("tensorboard", "wandb", "all", "none"))
    logging_dir: str = flag("logs", "Tracker folder, relative to --output_dir.")

    def check(self) -> None:
        if self.validation_resolution % 16:
            raise UsageError(f"--validation_resolution {self.validation_resolution} must be a multiple of 16")
        if self.validation_image is not None and not os.path.isfile(self.validation_image):
            raise UsageError(f"--validation_image {self.validation_image}: no such file")
        if self.report_to == "wandb":
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise UsageError("--report_to wandb needs the wandb package (pip install wandb), or use tensorboard")


@dataclass(frozen=True)
class PlanConfig:
    """`--plan`: the memory planner instead of training (flux_cp.plan)."""

    plan: bool = flag(
        False,
        "Print the estimated per-GPU memory of this configuration, and the smallest CP size that fits, then exit "
        "(loads nothing heavy).",
    )
    gpu_memory_gib: float | None = flag(None, "For --plan: memory per GPU (default: read).")


@dataclass(frozen=True)
class Config:
    """Every flag of a run, by section. Sections are frozen: a module gets the section(s) it needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    def check(self) -> None:
        """Every check that needs only the flags; the first failure is a UsageError naming the flag."""
        check_ranges(self.flat())
        for f in dataclasses.fields(self):
            check = getattr(getattr(self, f.name), "check", None)
            if check is not None:
                check()

    def flat(self) -> dict[str, Any]:
        """{flag name: value} of every flag (run_config.json, checkpoints' meta, trackers)."""
        return {k: v for f in dataclasses.fields(self) for k, v in dataclasses.asdict(getattr(self, f.name)).items()}


# Argument-group titles of --help, in the order sections appear there.
_TITLES = {
    "model": "model",
    "data": "data",
    "train": "training",
    "lora": "LoRA / full fine-tuning",
    "parallel": "parallelism",
    "checkpoints": "checkpoints",
    "validation": "validation and logging",
    "plan": "memory plan",
}


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(Config)
    return [(name, hints[name]) for name in _TITLES]


def _scalar_type(annotation: Any) -> type:
    """int / float / str of an annotation such as `int | None` or `tuple[str, ...] | None`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _scalar_type(args[0])
    if typing.get_origin(annotation) is tuple:
        return args[0]
    return annotation


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_flux_cp.py",
        description="Fine-tune FLUX.1 (LoRA or full) with context parallelism. With no model and no data flags it "
        "trains a tiny Flux built locally on the bundled data set (the embedded default).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for name, section in _sections():
        group = p.add_argument_group(_TITLES[name])
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            m, kind = f.metadata, _scalar_type(hints[f.name])
            kw: dict[str, Any] = {"help": m["help"]}
            if kind is bool:
                if f.default is not False:  # a switch turns something on; name it for that (e.g. --no_cache)
                    raise TypeError(f"{section.__name__}.{f.name}: boolean flags must default to False")
                kw["action"] = "store_true"
            else:
                # argparse also passes a string default through `type`: a parsed field shows its default as text.
                kw["type"] = m["parse"] or kind
                kw["default"] = None if m["derive"] else f.default
                if m["parse"] and isinstance(f.default, tuple):
                    kw["default"] = ",".join(f.default)
                if m["choices"]:
                    kw["choices"] = m["choices"]
                if m["repeat"]:
                    kw["action"] = "append"
            group.add_argument(f"--{f.name}", **kw)
    return p


def parse_config(argv: list[str] | None = None) -> Config:
    """Parse the flags once, resolve derived defaults, check them; the Config the whole run uses."""
    parser = build_parser()
    raw = dict(vars(parser.parse_args(argv)))
    # The demo: the embedded default with no data set and no step count (the README's first command).
    raw[_DEMO] = _is_embedded(raw) and raw["dataset_name"] is None and raw["max_train_steps"] is None
    raw[_DEMO] = raw[_DEMO] and raw["num_train_epochs"] is None
    sections = {}
    for name, section in _sections():
        values = {}
        for f in dataclasses.fields(section):
            m, value = f.metadata, raw[f.name]
            if value is None and m["derive"]:
                value = raw[f.name] = m["derive"](raw)  # later derivations see it (validation <- resolution)
            elif isinstance(value, list):  # a repeated flag
                value = tuple(value)
            values[f.name] = value
        sections[name] = section(**values)
    config = Config(**sections)
    config.check()
    if os.environ.get("RANK", "0") == "0":
        for warning in unused_flags(given_flags(parser, sys.argv[1:] if argv is None else argv), config.flat()):
            print(f"warning: {warning}", file=sys.stderr)
    return config


# A hub data set id: `name` or `owner/name` (letters, digits, '-', '_', '.'); anything else is a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_hub_id(name: str) -> bool:
    return _HUB_ID.fullmatch(name) is not None and ".." not in name
