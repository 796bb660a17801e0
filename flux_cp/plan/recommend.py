"""--plan's answer for the hardware it is given (GPUs, their memory, the host's memory): one command to run, and the
table of the settings behind it.

The settings compared, for a run of these flags (model, data, resolution, LoRA or full, batch) on the launched or
--num_processes GPUs: every --base_precision (LoRA), DDP or FSDP2 (several GPUs; FSDP2 with a bf16 base), compiled or
eager blocks, each with `--gradient_checkpointing` and `--offload_blocks` auto (the planner's pair of blocks
checkpointed and offloaded that fits with the least modelled step time), at the flags' --cp_size, whose samples per
step it keeps. When nothing fits there, the other CP sizes the GPUs divide into are compared too, and the command
says how many samples a step then trains. The recommendation is the fastest that fits by the speed model
(flux_cp.plan.speed: the step time, and with a step count given, compiling's one-time cost against it); ties go to the
more exact base (bf16 first, then fp8, int8, nf4).
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flux_cp.config.fields import PRECISIONS
from flux_cp.extras import INSTALL, PACKAGES
from flux_cp.model.blocks import Checkpointing
from flux_cp.plan import compiling, speed
from flux_cp.plan import memory as plan

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.shape.run_shape import RunShape

# Flags the recommendation sets, and --plan's own: the rest of the user's flags are the command's too.
SET = ("base_precision", "gradient_checkpointing", "offload_blocks", "compile", "compile_mode", "cp_size")
PLAN_ONLY = ("plan", "gpu_memory_gib", "num_processes", "host_memory_gib", "gpu_class")


@dataclass(frozen=True)
class Setting:
    precision: str
    layout: str  # "one GPU", "DDP" or "FSDP2"
    compile: str  # on / off
    cp: int
    world: int
    samples: int  # per optimizer step
    chosen: Checkpointing  # the blocks checkpointed and offloaded, the planned peak, the modelled step
    fits: bool

    @property
    def label(self) -> str:
        return f"{self.precision} {self.layout} compile {self.compile} cp {self.cp}"


def variant(cfg: Config, precision: str, compile: str, lora: bool, sharded: bool) -> Config:
    """The flags of one setting: this base and compile, checkpointing and (LoRA with DDP) offload auto."""
    train = cfg.train
    mode = train.compile_mode if compile == "on" else None
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, base_precision=precision),
        train=dataclasses.replace(
            train,
            gradient_checkpointing="auto",
            compile=compile,
            compile_mode=mode,
            offload_blocks="auto" if lora and not sharded else "0",
        ),
    )


def compared(
    cfg: Config, shape: RunShape, gpu: float, host: float | None, encoding_fits: bool, sizes: Sequence[int]
) -> list[Setting]:
    """Every setting at each CP size of `sizes`, in the order bf16 first."""
    lora = not cfg.lora.full_finetune
    world = shape.world
    layouts = [("one GPU", False)] if world == 1 else [("DDP", False), ("FSDP2", True)]
    out = []
    accumulate = cfg.train.gradient_accumulation_steps
    for c in sizes:
        at = plan.shape_at(cfg, shape, c, world)
        for precision in PRECISIONS if lora else ("bf16",):
            for layout, sharded in layouts:
                if sharded and precision != "bf16":
                    continue  # FSDP2 cannot shard a quantized base (flux_cp.model.precision.check_sharding)
                if not sharded and not lora and world > 1:
                    continue  # full fine-tuning's weights and AdamW whole on every GPU: the README's FSDP2 only
                for compile in ("on", "off"):
                    v = variant(cfg, precision, compile, lora, sharded)
                    where = dataclasses.replace(at, sharded=sharded)
                    chosen = plan.checkpointing_for(v, where, gpu, host)
                    samples = at.dp * cfg.train.train_batch_size * accumulate
                    out.append(
                        Setting(precision, layout, compile, c, world, samples, chosen, chosen.fits and encoding_fits)
                    )
    return out


def seconds(s: Setting, steps: int | None) -> float:
    """What ranks a setting: its step, and over a known number of steps compiling's one-time cost with it."""
    once = speed.active().compile_s if s.compile == "on" else 0.0
    return s.chosen.seconds if steps is None else s.chosen.seconds + once / steps


def best(settings: Sequence[Setting], steps: int | None) -> Setting | None:
    fitting = [s for s in settings if s.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda s: (round(seconds(s, steps), 4), PRECISIONS.index(s.precision)))


def accelerate_config(s: Setting) -> list[str]:
    """`--config_file ...` (and `--num_processes N` where the file's count differs) of accelerate launch."""
    if s.world == 1:
        return ["--config_file", "accelerate_configs/gpu1.yaml"]
    name = "fsdp2_cp2.yaml" if s.layout == "FSDP2" else "ddp_cp2.yaml"
    return ["--config_file", f"accelerate_configs/{name}"] + (["--num_processes", str(s.world)] if s.world != 2 else [])


def user_flags(argv: Sequence[str] | None, cfg: Config) -> list[str]:
    """The flags of `argv` the recommendation keeps (all but those it sets and --plan's own); without `argv`, the
    model, data and resolution of `cfg`."""
    if argv is None:
        out = []
        if cfg.model.pretrained_model_name_or_path:
            out += ["--pretrained_model_name_or_path", cfg.model.pretrained_model_name_or_path]
        if cfg.data.dataset_name:
            out += ["--dataset_name", cfg.data.dataset_name]
        return out + ["--resolution", ",".join(map(str, cfg.data.resolution))]
    from flux_cp.config.parser import build_parser

    actions = {o: a for a in build_parser()._actions for o in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        start, token = i, argv[i]
        action = actions.get(token.split("=", 1)[0])
        i += 1
        if action is not None and "=" not in token:
            if action.nargs == "?":
                i += 1 if i < len(argv) and not argv[i].startswith("--") else 0
            elif action.nargs != 0:
                i += 1
        if action is None or action.dest not in SET + PLAN_ONLY:
            out += argv[start:i]
    return out


def command(s: Setting, cfg: Config, argv: Sequence[str] | None) -> list[str]:
    """The lines of the recommended command: pip's, where the base needs a package, and accelerate launch."""
    flags = user_flags(argv, cfg)
    if s.precision != "bf16":
        flags += ["--base_precision", s.precision]
    if s.cp != 1:
        flags += ["--cp_size", str(s.cp)]
    if s.chosen.blocks:
        flags.append("--gradient_checkpointing")
    if s.chosen.offloaded:
        flags.append("--offload_blocks")
    if s.compile == "on":
        flags += ["--compile_mode", cfg.train.compile_mode] if cfg.train.compile_mode else ["--compile"]
    else:
        flags += ["--compile", "off"]
    lines = []
    if s.precision in PACKAGES:
        lines.append(f"{INSTALL}    # --base_precision {s.precision} needs {PACKAGES[s.precision][0]}")
    lines.append(shlex.join(["accelerate", "launch", *accelerate_config(s), "train_flux_cp.py", *flags]))
    return lines


def print_answer(
    cfg: Config, shape: RunShape, gpu: float, host: float | None, encoding_fits: bool, argv: Sequence[str] | None
) -> None:
    """The flags' own row, the recommended command and the table behind it (module doc)."""
    steps = cfg.train.max_train_steps
    own_cfg, _ = compiling.decide(cfg, shape, torch.device("cuda"), gpu, host)  # as a GPU run would decide auto
    own = plan.checkpointing_for(own_cfg, shape, gpu, host)
    compile = own_cfg.train.compile if not own_cfg.train.compile_mode else "on"
    these = f"these flags at --cp_size {shape.cp} (compile {compile}): " + (
        f"fit, {own.planned_gib:.1f} GiB planned with {own.setting}, ~{own.seconds:.2f} s/step"
        if own.fits and encoding_fits
        else f"do not fit: {plan.does_not_fit(own_cfg, shape, own)}"
    )
    print(these)
    settings = compared(cfg, shape, gpu, host, encoding_fits, [shape.cp])
    chosen = best(settings, steps)
    if chosen is None and shape.world > 1:  # other CP sizes of the same GPUs: fewer samples per step
        others = [c for c in range(1, shape.world + 1) if shape.world % c == 0 and c != shape.cp]
        settings += compared(cfg, shape, gpu, host, encoding_fits, others)
        chosen = best(settings, steps)
    gpus = f"{shape.world} GPU{'s' if shape.world > 1 else ''} of {gpu:.0f} GiB"
    machine = host * plan.local_processes(shape) / plan.HOST_MARGIN if host is not None else None  # `host`: a process's
    host_text = f"{machine / plan.GIB:.0f} GiB" if machine is not None else "unknown (--host_memory_gib)"
    if chosen is None:
        print(
            f"recommended for {gpus} (host memory {host_text}): nothing fits; use more GPUs (--num_processes, CP "
            "splits each sample's tokens) or a lower --resolution"
        )
    else:
        c = chosen.chosen
        own_samples = settings[0].samples if settings else chosen.samples
        samples = (
            f"; {chosen.samples} samples per step instead of {own_samples} (--cp_size {chosen.cp})"
            if chosen.samples != own_samples
            else ""
        )
        pinned = f", {c.host_gib:.1f} GiB of pinned host memory per process" if c.offloaded else ""
        print(
            f"recommended for {gpus} (host memory {host_text}), the fastest that fits by the speed model: "
            f"~{c.seconds:.2f} s/step, {c.planned_gib:.1f} GiB planned ({c.setting}){pinned}{samples}"
        )
        for line in command(chosen, cfg, argv):
            print(f"    {line}")
    print_table(settings, chosen, steps)


def print_table(settings: Sequence[Setting], chosen: Setting | None, steps: int | None) -> None:
    print(
        "settings compared (--gradient_checkpointing and --offload_blocks auto; planned peak per GPU, modelled s/step):"
    )
    print(
        f"  {'base':<5} {'layout':<7} {'compile':<7} {'cp':>2} {'samples':>7} {'ckpt':>6} {'offload':>7} "
        f"{'planned':>8} {'pinned':>7} {'s/step':>7}  fits"
    )
    for s in settings:
        c = s.chosen
        mark = "  <- recommended" if s is chosen else ""
        print(
            f"  {s.precision:<5} {s.layout:<7} {s.compile:<7} {s.cp:>2} {s.samples:>7} "
            f"{f'{len(c.blocks)}/{c.total}':>6} {f'{c.offloaded}/{c.total}':>7} {c.planned_gib:>7.1f}G "
            f"{c.host_gib:>6.1f}G {c.seconds:>7.2f}  {'yes' if s.fits else 'no'}{mark}"
        )
    if steps is not None:
        print(
            f"  (over --max_train_steps {steps}, compiling's ~{speed.active().compile_s:.0f} s counts "
            f"{speed.active().compile_s / steps:.2f} s per step)"
        )
