"""The flag table: every flag of `train_flux_cp.py` as typed, frozen config sections (`Config`), parsed once
(flux_cp.config.parser).

Each section is a frozen dataclass; each of its fields is the flag `--<field name>` (diffusers' Flux
examples' names where they exist). Adding a flag is one field with `flag(...)` in the section whose module
uses it: the parser, `--help`, the run's `run_config.json` and the trackers' hyperparameters all follow.
Defaults that depend on other flags (the embedded tiny model's resolution, `--lora_alpha` = `--rank`,
`--validation_resolution` = `--resolution`) are resolved while parsing (`derive=`), so sections always hold
final values. Checks that need only the flags (no model, data or GPU) live in each section's `check()`, and those
across sections in `Config.check`. The sections of what a run trains (model, LoRA, data, training) are in
flux_cp.config.training; here the sections of how it runs and what it writes, and `Config`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from cp.kernels import DEFAULT_PREFERENCE, KERNELS
from cp.mode import MODES
from cp.tuning import OVERLAPS, Tuning, refusal
from flux_cp import hub
from flux_cp.config.demo import DEMO_KEY, DEMO_OFF_FLAGS, Demo, demo_in
from flux_cp.config.fields import comma_list, flag
from flux_cp.config.ranges import check_ranges
from flux_cp.config.training import (
    DataConfig,
    LoraConfig,
    ModelConfig,
    TrainConfig,
    check_adapter,
    check_base_precision,
)
from flux_cp.errors import UsageError
from flux_cp.extras import check_installed


def cp_modes() -> tuple[str, ...]:
    """--cp_mode's choices: auto and every registered CP mode (`cp.MODES`)."""
    return ("auto", *MODES)


def _cp_mode_help() -> str:
    modes = ", ".join(f"{name} ({mode.summary})" if mode.summary else name for name, mode in MODES.items())
    ranked = sorted((m for m in MODES.values() if m.auto_rank is not None), key=lambda m: m.auto_rank)
    return (
        f"How attention exchanges keys and values in a CP group: {modes}; auto picks the first of "
        f"{', '.join(m.name for m in ranked)} that the model's heads and --cp_size allow."
    )


def _ulysses_modes() -> str:
    """The modes that take --ulysses_size."""
    return " or ".join(name for name, mode in MODES.items() if mode.takes_ulysses_size)


@dataclass(frozen=True)
class ParallelConfig:
    """The CP group and collectives (flux_cp.model.parallel, cp)."""

    cp_size: int = flag(1, "Ranks that share one sample's tokens.")
    cp_mode: str = flag("auto", _cp_mode_help, choices=cp_modes)
    ulysses_size: int | None = flag(
        None, lambda: f"Ulysses degree of the {_ulysses_modes()} mode. Default: chosen by --cp_mode auto."
    )
    collective_timeout: float = flag(
        600.0, "Seconds before a stuck collective aborts the run (a dead rank never hangs the others)."
    )

    def check(self) -> None:
        mode = MODES.get(self.cp_mode)  # None: auto
        if mode is not None and mode.takes_ulysses_size and self.ulysses_size is None:
            raise UsageError(
                f"--cp_mode {self.cp_mode} needs --ulysses_size (the Ulysses degree, a divisor of --cp_size)"
            )
        # run_config.json records the degree a mode runs itself (the whole group for Ulysses): read back, it is no
        # request of a degree
        own = mode is not None and not mode.takes_ulysses_size and self.ulysses_size == mode.degree(self.cp_size, None)
        if self.ulysses_size is not None and mode is not None and not mode.takes_ulysses_size and not own:
            raise UsageError(
                f"--ulysses_size is only used with --cp_mode {_ulysses_modes()} (got --cp_mode {self.cp_mode})"
            )
        if self.ulysses_size is not None and self.cp_size % self.ulysses_size:
            raise UsageError(f"--ulysses_size {self.ulysses_size} must divide --cp_size {self.cp_size}")


@dataclass(frozen=True)
class CPTuningConfig:
    """How CP runs, never what it computes (cp.Tuning): the attention kernels and how the exchanges are scheduled.
    Every setting gives the same results; they are for benchmarks and debugging."""

    cp_kernels: str | None = flag(
        None,
        "Comma-separated attention kernels in order of preference (the first that serves an input is used), from "
        f"{', '.join(sorted(KERNELS))}. Default: {','.join(DEFAULT_PREFERENCE['cuda'])} on CUDA, "
        f"{','.join(DEFAULT_PREFERENCE['cpu'])} on CPU.",
        parse=lambda text: ",".join(comma_list(text)),  # kept as text: run_config.json and resumes compare it
    )
    cp_overlap: str = flag(
        "fill",
        "How a compiled block orders its CP exchanges against its compute: 'fill' (our scheduling pass puts ready "
        "compute beside each exchange), 'passes' (each exchange starts as early and is waited for as late as "
        "possible), 'compute' or 'scheduler' (Inductor's own, by its GPU runtime estimates) or 'none'.",
        choices=OVERLAPS,
    )
    cp_exchange_first: bool = flag(
        False,
        "After launching each CP exchange and after each wait for one, hold the compute stream ~0.5 us so that the "
        "exchange starts before the compute kernel behind it and runs beside it. Effect on a step not measured.",
    )
    cp_ulysses_chunks: int = flag(
        1,
        "Head chunks of the Ulysses attention, pipelined so that one chunk's exchange runs beside another's "
        "attention (reduced until the chunks' heads divide over the group). Gain on two GPUs not measured.",
    )

    @property
    def kernels(self) -> tuple[str, ...]:
        return comma_list(self.cp_kernels or "")

    def tuning(self) -> Tuning:
        return Tuning(self.kernels, self.cp_overlap, self.cp_exchange_first, self.cp_ulysses_chunks)

    def check(self) -> None:
        if self.cp_kernels == "":
            raise UsageError(f"--cp_kernels '': no kernel named; choose from {', '.join(sorted(KERNELS))}")
        flags = {
            "kernels": f"--cp_kernels {self.cp_kernels!r}",
            "overlap": "--cp_overlap",
            "exchange_first": "--cp_exchange_first",
            "ulysses_chunks": "--cp_ulysses_chunks",
        }
        problem = refusal(self.kernels, self.cp_overlap, self.cp_exchange_first, self.cp_ulysses_chunks, flags)
        if problem:
            raise UsageError(problem)


@dataclass(frozen=True)
class CheckpointConfig:
    """Training checkpoints and resume (flux_cp.outputs.checkpoint)."""

    checkpointing_steps: int = flag(
        500, "Save a resumable checkpoint of the training state every X optimizer steps (and at the end)."
    )
    checkpoints_total_limit: int | None = flag(
        None, "Max number of checkpoints to store (the oldest are removed). Default: keep them all."
    )
    resume_from_checkpoint: str | None = flag(
        None,
        "'latest' (of --output_dir) or a checkpoint folder; a bare name (checkpoint-2) that is no folder here is one "
        "of --output_dir, as in diffusers' examples. Default: start from step 0.",
    )
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
    """Validation images and logging (flux_cp.outputs.validation, flux_cp.outputs.metrics, trackers)."""

    validation_prompt: tuple[str, ...] | None = flag(
        None,
        "A prompt to render validation images of; repeatable. The embedded default also renders them before training "
        "(step 0). Default: none (no validation), or two captions of the bundled set for the demo.",
        repeat=True,
        derive=lambda raw: demo_in(raw).prompts if demo_in(raw) else None,
    )
    validation_image: tuple[str, ...] | None = flag(
        None,
        "Pair data: the reference image every --validation_prompt edits (FluxKontextPipeline, Flux2Pipeline, "
        "Flux2KleinPipeline); repeatable for FLUX.2, whose pipelines take several references (image=[...]). "
        "Default: none, or a reference of the bundled pairs for the Kontext demo.",
        repeat=True,
        derive=lambda raw: (str(demo.validation_image),) if (demo := demo_in(raw)) and demo.validation_image else None,
    )
    validation_steps: int | None = flag(
        None, "Render validation images every X optimizer steps. Default: only at the end of training."
    )
    num_validation_images: int = flag(2, "Number of images generated per --validation_prompt.")
    validation_resolution: int = flag(
        1024,
        "Size of the validation images in pixels. Default: --resolution (the largest).",
        derive=lambda raw: max(raw["resolution"]),
    )
    validation_inference_steps: int = flag(28, "Denoising steps of each validation image.")
    report_to: str = flag(
        "tensorboard", "The integration to report results and logs to.", choices=("tensorboard", "wandb", "all", "none")
    )
    logging_dir: str = flag("logs", "Tracker folder, relative to --output_dir.")

    @property
    def writes_logs(self) -> bool:
        """Whether a tracker writes files into --logging_dir: TensorBoard, and wandb (its wandb/ folder)."""
        return self.report_to != "none"

    def check(self) -> None:
        if self.validation_resolution % 16:
            raise UsageError(f"--validation_resolution {self.validation_resolution} must be a multiple of 16")
        for image in self.validation_image or ():
            if not os.path.isfile(image):
                raise UsageError(f"--validation_image {image}: no such file")
        if self.report_to == "wandb":
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise UsageError("--report_to wandb needs the wandb package (pip install wandb), or use tensorboard")


@dataclass(frozen=True)
class HubConfig:
    """Uploading the output folder to the Hugging Face Hub at the end (flux_cp.hub; the model card:
    flux_cp.outputs.card)."""

    push_to_hub: bool = flag(
        False, "Whether or not to push the model (LoRA or transformer, its card, validation images) to the Hub."
    )
    hub_model_id: str | None = flag(
        None, "The name of the repository to keep in sync with the local --output_dir. Default: the folder's name."
    )
    hub_token: str | None = flag(
        None,
        "The token to use to push to the Model Hub. Prefer `hf auth login` (or HF_TOKEN): a token on the command "
        "line shows in the process list and shell history. Never written to the run's files. Default: HF_TOKEN, "
        "else the stored login's.",
        secret=True,
    )


@dataclass(frozen=True)
class PlanConfig:
    """`--plan`: the memory planner instead of training (flux_cp.plan.memory)."""

    plan: bool = flag(
        False,
        "Print the estimated per-GPU memory of this configuration, and the smallest CP size that fits, then exit "
        "(loads nothing heavy).",
    )
    gpu_memory_gib: float | None = flag(
        None,
        "For --plan and --gradient_checkpointing / --offload_blocks auto: memory per GPU in GiB (e.g. a per-process "
        "memory cap, or a smaller card's: 12, 16, 24). Default: the GPU's own, or 141 (an H200) for --plan without "
        "one.",
    )
    num_processes: int | None = flag(
        None,
        "For --plan: the processes (GPUs) to plan for, as accelerate launch's --num_processes; with 2 or more and "
        "LoRA, --plan also compares DDP with a quantized base against FSDP2 with a bf16 one. Default: the launched "
        "processes (WORLD_SIZE), else --cp_size.",
    )
    host_memory_gib: float | None = flag(
        None,
        "For --plan and --offload_blocks auto: host memory (CPU RAM) in GiB of one machine, of which the pinned homes "
        "of offloaded blocks may take nine tenths, shared by its processes. Default: this machine's available memory.",
    )
    gpu_class: str = flag(
        "auto",
        "For --plan and auto's choices: whose speed figures predict step times (flux_cp/plan/speed_data/): 'auto' "
        "takes this GPU's class file (fitted to steps measured on it), times this GPU's blocks (cached) where no "
        "such file exists, and without a GPU takes the class of --gpu_memory_gib (up to 32 GiB a 24 GB card's, "
        "rtx4090; up to 100 an h100; else an h200); 'measure' times this GPU's blocks; or name a class.",
        choices=("auto", "measure", "h100", "h200", "rtx4090"),
    )


@dataclass(frozen=True)
class Config:
    """Every flag of a run, by section. Sections are frozen: a module gets the section(s) it needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cp_tuning: CPTuningConfig = field(default_factory=CPTuningConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    # How parse_config resolved the flags (not flags): the demo whose settings this run got; with the embedded
    # default, the flags given that turned a demo's settings off; and the checkpoint whose run's demo settings a
    # resume keeps. Fields, so that every copy (dataclasses.replace) keeps them.
    demo: Demo | None = field(default=None, metadata={"resolution": True})
    demo_off: tuple[str, ...] = field(default=(), metadata={"resolution": True})
    demo_from: str | None = field(default=None, metadata={"resolution": True})
    given: tuple[str, ...] = field(default=(), metadata={"resolution": True})  # the flags on the command line

    def sections(self) -> list[Any]:
        """The flag sections (model, lora, data, ...), in field order."""
        return [getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("resolution")]

    def check(self) -> None:
        """Every check that needs only the flags; the first failure is a UsageError naming the flag. (What needs the
        launch, the model or the machine too is checked at the start of the run: flux_cp.run.trainer.)"""
        check_ranges(self.flat())
        for section in self.sections():
            check = getattr(section, "check", None)
            if check is not None:
                check()
        check_base_precision(self.model.base_precision, self.lora.full_finetune)
        if self.lora.network_weights is not None and self.train.seed_checkpoint is not None:
            raise UsageError(
                "--network_weights and --seed_checkpoint both set the initial LoRA weights: give one of the two"
            )
        check_adapter(self.lora, self.model.base_precision)
        if not self.plan.plan:  # the planner loads nothing and runs on any machine
            check_installed(self.model.base_precision)
        if self.hub.push_to_hub:  # what would fail the upload at the end whatever the run does
            hub.check_start(self.hub.hub_model_id, self.hub.hub_token, self.train.output_dir)
        if self.hub.hub_token and self.validation.report_to in ("wandb", "all"):
            # as diffusers' examples: wandb records the command line, and the token with it
            raise UsageError(
                "--hub_token with --report_to wandb would put the token in wandb's record of the command line: log "
                "in with `hf auth login` (or set HF_TOKEN) instead of --hub_token"
            )

    def flat(self) -> dict[str, Any]:
        """{flag name: value} of every flag but the secret ones (run_config.json, checkpoints' meta, trackers)."""
        return {
            f.name: getattr(section, f.name)
            for section in self.sections()
            for f in dataclasses.fields(section)
            if not f.metadata["secret"] and f.metadata["record"]
        }

    def demo_lines(self) -> list[str]:
        """What the log says about the demo settings: the ones this run got, or which flags turned them off (with
        the embedded default only; a named model never had them)."""
        demo, train = self.demo, self.train
        if demo is not None:
            images = f"validation images of {len(self.validation.validation_prompt or ())} prompts"
            if self.validation.validation_image:
                images += f" editing {', '.join(os.path.relpath(p) for p in self.validation.validation_image)}"
            settings = (
                f"{train.max_train_steps} steps at learning rate {train.learning_rate:g}, {train.train_batch_size} "
                f"samples per step, {images} before and after training"
            )
            if self.demo_from is not None:
                return [
                    f"{demo.name}'s settings, as the run of {self.demo_from} had them: {settings} (given flags win)"
                ]
            return [
                f"{demo.name}'s settings: {settings} (given flags win; "
                f"{', '.join('--' + f for f in DEMO_OFF_FLAGS[:2])} or another --dataset_name turn them off)"
            ]
        if self.demo_off:
            given = ", ".join("--" + f for f in self.demo_off)
            n = train.train_batch_size
            lr = f"learning rate {train.learning_rate:g}, {n} sample{'s' if n > 1 else ''} per step"
            epochs = train.num_train_epochs
            steps = train.max_train_steps
            steps = f"{steps} step{'s' * (steps > 1)}" if steps else f"{epochs} epoch{'s' * (epochs > 1)}"
            return [f"the demo's settings are off ({given} given): {steps}, {lr}, as for real runs"]
        return []


def non_default(cfg: Config) -> dict[str, Any]:
    """{flag: value} of every flag (the secret ones aside) whose value is not its default; a derived default is taken
    from the run's other values as parsing derives it (--lora_alpha against --rank, the demo's settings for a
    demo)."""
    raw = {**cfg.flat(), DEMO_KEY: cfg.demo}
    out = {}
    for section in cfg.sections():
        for f in dataclasses.fields(section):
            if f.metadata["secret"]:
                continue
            value, derive = getattr(section, f.name), f.metadata["derive"]
            default = derive(raw) if derive else f.default
            if value != default:
                out[f.name] = value
    return out
