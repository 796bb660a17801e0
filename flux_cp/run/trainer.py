"""The trainer: one run of fine-tuning, phase by phase.

    setup -> load_data (encode once, cached) -> build_model (LoRA or full, CP, compile, FSDP/DDP) -> resume
    -> train: for each step `train_step`, then `after_step` (metrics, validation, checkpoint) -> finish

Each phase is a method that reads what the earlier ones set on the trainer; the details of each live in flux_cp's
modules: the run shape (flux_cp.shape), the data (flux_cp.run.data_phase), the model (flux_cp.model.loading,
flux_cp.model.parallel), the outputs (flux_cp.run.output_phase). What is specific to a model family (FLUX.1, FLUX.2)
comes from `self.shape.family`; what benchmarks and tests replace is a method of its own (a seam): `launched_world_size`
and `make_layout` (the process group), `open_source` and `encode_share` (the data source and who encodes it),
`make_timer` (the clock) and `save_checkpoint`.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flux_cp import distributed, quiet
from flux_cp.bars import StepBar
from flux_cp.config import ranges as flag_ranges
from flux_cp.config.flags import Config
from flux_cp.data.batches import Batches
from flux_cp.data.sources import ImageSource, open_source
from flux_cp.errors import UsageError
from flux_cp.families.flops import NO_FLOPS, StepFlops
from flux_cp.layout import Layout
from flux_cp.loss import batch_loss
from flux_cp.model import blocks, optim, parallel
from flux_cp.model.adapters import start_line as adapter_line
from flux_cp.model.ema import EMA
from flux_cp.model.loading import load_trainee, transformer_fingerprint
from flux_cp.model.text_encoder import TrainedTextEncoder
from flux_cp.outputs import metrics, outdir, resume
from flux_cp.outputs.profiling import profiled
from flux_cp.plan import compiling, diskspace, speed, speed_measure
from flux_cp.plan import memory as plan
from flux_cp.run import data_phase as run_data
from flux_cp.run import faults
from flux_cp.run.output_phase import Outputs
from flux_cp.run.start import check_start
from flux_cp.shape.build import build_shape, launched_world_size, resolved
from flux_cp.shape.run_shape import RunShape
from flux_cp.terminal import escape_logs

logger = logging.getLogger("flux_cp")


@dataclass
class StepResult:
    """A step as queued on the device: its loss, gradient norm and skip flag are 0-d tensors there until
    `after_step` reads them, once the next step is queued too, so the GPU never waits for the host between
    steps."""

    step: int
    epoch: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    skipped: torch.Tensor
    lr: float  # the schedule's LR after this step, as diffusers' examples log it
    tokens: int
    flops: StepFlops
    end: Any  # metrics.StepTimer.mark() after the step's update


def recipe_lines(cfg: Config) -> list[str]:
    """What --adapter, --transformer_init random, --train_text_encoder and --use_ema change in the run, said at its
    start."""
    lines = [line] if (line := adapter_line(cfg.lora)) else []
    if cfg.model.transformer_init == "random":
        model = cfg.model.pretrained_model_name_or_path or "the embedded tiny Flux"
        trained = "fine-tuned transformer" if cfg.lora.full_finetune else "LoRA"
        lines.append(
            f"--transformer_init random: the transformer is built from the config of {model} with random weights "
            f"(seed {cfg.train.seed}), not its pretrained weights: the {trained} belongs to that random base (the "
            "model card, run_config.json and the summary say so)"
        )
    if cfg.lora.train_text_encoder:
        lines.append(
            f"--train_text_encoder: a LoRA on CLIP (q_proj, k_proj, v_proj, out_proj; rank {cfg.lora.rank}) at "
            f"learning rate {cfg.train.text_encoder_lr:g}; CLIP runs every step on the captions (its encodings are not "
            "cached; T5's are), on every rank of a CP group alike"
        )
    if cfg.train.use_ema:
        every = cfg.train.ema_update_interval
        lines.append(
            f"--use_ema: an EMA of the trained weights (decay up to {cfg.train.ema_decay:g}, updated every "
            f"{'step' if every == 1 else f'{every} steps'}) is the run's output: the final weights and the validation "
            "images are the EMA's; checkpoints hold the raw weights and the EMA"
        )
    return lines


class Trainer:
    """A run of `train_flux_cp.py`: build it from the parsed flags, then `run` it (every phase in order)."""

    # setup: fixed for the whole run
    shape: RunShape
    tuning: Any  # cp.Tuning: the CP tuning this device and model run
    accelerator: Any
    layout: Layout
    device: torch.device
    weight_dtype: torch.dtype  # the frozen weights' and the inputs' dtype (mixed precision)
    sizes: diskspace.Sizes  # of one checkpoint and of the final model, from parameter counts
    # load_data: the encoded data (its shape has the opened data set's reference counts), its batch order, and what
    # validation needs of the encoders
    data: run_data.RunData
    components: dict[str, str]  # {component: fingerprint of its config and weights' content}
    # build_model: the wrapped model and its optimizer, ready to step
    model: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    params: list[torch.nn.Parameter]  # trainable, after accelerate.prepare (sharded under FSDP2)
    offload: Any  # flux_cp.model.offload.BlockOffload, or None without --offload_blocks
    text: TrainedTextEncoder | None  # --train_text_encoder: the text encoder's LoRA, trained beside the transformer
    ema: EMA | None  # --use_ema: the EMA of every trained weight
    state_model: torch.nn.Module  # what checkpoints hold the weights of: the model, and the text encoder beside it
    checkpointing: blocks.Checkpointing  # --gradient_checkpointing resolved: which blocks recompute
    compile_guard: compiling.FirstStep | None  # compiled blocks: their first step, which falls back to eager ones
    compile_time: compiling.CompileTime
    max_steps: int
    run_identity: dict  # what a checkpoint must match to be resumed by this run
    # train: per-step machinery
    batches: Batches
    metrics: metrics.MetricsLog
    timer: metrics.StepTimer
    bar: Any
    peak: float | None  # bf16 FLOP/s that MFU and HFU are measured against (None: not on a GPU)
    fault: faults.Fault
    progress: optim.Progress  # which steps since the start applied their update (--on_nonfinite skip)
    outputs: Outputs  # checkpoints, validation images, and at the end the weights, card, upload, summary
    done_before: Path | None = None  # resume: the last checkpoint of a run that had already finished

    def __init__(self, cfg: Config):
        self.cfg = cfg

    # --- seams: what benchmarks and tests replace ------------------------------------------------------------

    def launched_world_size(self) -> int:
        return launched_world_size()

    def make_layout(self, accelerator) -> Layout:
        """The layout and its CP context, in the mode and with the tuning decided in `setup`."""
        return parallel.make_layout(accelerator, self.shape, self.cfg.parallel.collective_timeout, self.tuning)

    def open_source(self) -> ImageSource:
        return open_source(self.cfg.data, self.shape.metadata, self.cfg.model.cache_dir)

    def encode_share(self) -> tuple[int, int]:
        """(this process's index, number of processes) among those that share the encoding of the data set."""
        return self.layout.rank, self.layout.world

    def make_timer(self) -> metrics.StepTimer:
        return metrics.StepTimer(self.device)

    def save_checkpoint(self, step: int) -> None:
        self.outputs.checkpoint(step)

    # --- phases ----------------------------------------------------------------------------------------------

    def run(self) -> None:
        """Every phase in order, then the process group's teardown. A finished run that is resumed does nothing: no
        model loads and nothing is written."""
        cfg, steps = self.cfg, self.cfg.train.max_train_steps
        done = outdir.finished(cfg.checkpoints.resume_from_checkpoint, cfg.train.output_dir, steps)
        if done is not None and not cfg.train.overwrite_output_dir:
            if os.environ.get("RANK", "0") == "0":
                print(f"flux-cp: {outdir.finished_line(done, steps)}", file=sys.stderr)
            return
        self.setup()
        self.load_data()
        self.build_model()
        start = self.resume()
        if self.done_before is None:
            self.train(start)
            self.finish()
        self.close()

    def setup(self) -> None:
        """Flag checks that need the launch size, the model folder and this machine, then accelerate, the dp x cp
        layout, logging and precision, and the output folder."""
        cfg = self.cfg
        quiet.install()  # third-party messages that say nothing to a user (flux_cp/quiet.py)
        # Everything that needs only the flags, the launch size and the model's config fails here, before any
        # process group. transformers' save_pretrained writes weights only on rank 0 once torch.distributed is up,
        # so the tiny default is built (by whichever process locks first) here too.
        self.shape = shape = build_shape(cfg, self.launched_world_size())
        self.cfg = cfg = resolved(cfg, shape.family, shape.pairs, shape.transformer_config)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"  # accelerate's device (cpu=True without CUDA)
        self.tuning, start_warnings = parallel.cp_tuning(cfg, shape, device_type)
        check_start(cfg, shape, device_type)
        self.accelerator = parallel.make_accelerator(cfg.parallel, cfg.train, cfg.validation, shape)
        self.layout = layout = self.make_layout(self.accelerator)
        logging.basicConfig(level=logging.INFO if layout.is_main else logging.WARNING, format="%(message)s")
        escape_logs(logger)  # values read from files (checkpoints, model folders, data) cannot act on the terminal
        if cfg.model.embedded_default:
            logger.info(
                f"flux-cp: embedded default - a tiny {shape.family.pairs_label if shape.pairs else shape.family.label} "
                "built locally, "
                f"trained on {cfg.data.dataset_name or 'the bundled data set (data/tiny_shapes)'}; pass "
                "--pretrained_model_name_or_path and --dataset_name for real runs"
            )
        for line in cfg.demo_lines():
            logger.info(f"flux-cp: {line}")
        for line in recipe_lines(cfg):
            logger.info(f"flux-cp: {line}")
        for warning in shape.family.output_warnings(cfg) if layout.is_main else ():
            logger.warning(warning)
        for warning in start_warnings if layout.is_main else ():
            logger.warning(f"warning: {warning}")
        logger.info(
            f"flux-cp: {layout.describe()}, {self.accelerator.distributed_type}, device {self.accelerator.device}"
        )
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if cfg.train.allow_tf32 and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = True
        self.device = self.accelerator.device
        self.cfg = cfg = self.plan_speed(cfg, shape)  # the speed model's figures, and --compile auto decided by them
        plan.check_fits(cfg, shape, self.device)  # auto with nothing that fits: refused before any model loads
        self.weight_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            self.accelerator.mixed_precision, torch.float32
        )
        self.claim_output_dir()
        shape.family.check_export(shape.transformer_config, cfg.lora)  # a kohya file diffusers could not read back
        self.sizes = diskspace.run_sizes(cfg, shape.family, shape.transformer_config, self.weight_dtype, layout.world)
        problem = None
        if layout.is_main:
            try:  # one checkpoint and the final model must fit; how many checkpoints fit is known once steps are
                diskspace.check_start(cfg.train.output_dir, self.sizes, saves=1, total_limit=None)
            except UsageError as e:
                problem = str(e)
        distributed.check_all_ranks(problem is None, problem or "")

    def plan_speed(self, cfg: Config, shape: RunShape) -> Config:
        """The figures the planner predicts step times with (flux_cp.plan.speed): on a GPU where a choice rests on them
        (--compile auto, --offload_blocks auto) this GPU's, measured once for the run's blocks (cached on disk) by the
        main process for every rank; else a GPU class's. Then --compile auto decided with them
        (flux_cp.plan.compiling)."""
        device, train = self.device, cfg.train
        gpu = plan.gpu_memory_gib(cfg, device)
        needs = device.type == "cuda" and "auto" in (train.compile, train.offload_blocks)
        modes = (
            ("eager", speed.mode(True, train.compile_mode))
            if train.compile == "auto"
            else (speed.mode(blocks.compiled(train), train.compile_mode),)
        )
        precision = (cfg.model.base_precision,)
        if needs:
            figures = speed_measure.agreed(
                lambda: speed_measure.choose(cfg, shape, device, gpu, [(precision, modes)]), self.layout.is_main
            )
            logger.info(f"flux-cp: speed model: {figures.describe}")
        else:
            figures = speed_measure.choose(cfg, shape, device, gpu, [(precision, modes)], measure=False)
        speed.use(figures)
        host = plan.host_limit(plan.local_processes(shape), cfg.plan.host_memory_gib)
        cfg, choice = compiling.decide(cfg, shape, device, gpu, host)
        if choice.line:
            logger.info(f"flux-cp: {choice.line}")
        return cfg

    def claim_output_dir(self) -> None:
        """The output folder becomes this run's, and how the run starts is decided (flux_cp.outputs.outdir,
        flux_cp.outputs.resume: a damaged or foreign checkpoint, or one of a run with other flags or another batch, is
        found now, not after the models load); every rank learns the result."""
        known = resume.flag_identity(self.cfg, self.samples_per_step(), self.identity_buckets())
        outdir.claim_run(self.cfg, self.shape.model_path, self.layout.is_main, known)
        resume.verify_shares(self.cfg, self.layout.rank, self.layout.world)

    def samples_per_step(self) -> int:
        """Samples of one optimizer step over all data-parallel ranks (their class images not counted)."""
        return self.cfg.train.train_batch_size * self.layout.dp * self.cfg.train.gradient_accumulation_steps

    def identity_buckets(self) -> list[tuple[int, int]] | None:
        """The buckets the run identity records: aspect buckets, else None (square crops)."""
        return list(self.shape.buckets) if self.cfg.data.aspect_buckets else None

    def load_data(self) -> None:
        """Encode the data set once (cached on disk, spread over all ranks), then free the text encoders
        (flux_cp.run.data_phase). A resume on another data set or a changed model is refused before any encoding."""
        cfg, shape, layout, device, dtype = self.cfg, self.shape, self.layout, self.device, self.weight_dtype
        seams = self.open_source, self.encode_share, self.check_resume_before_encoding
        self.data = data = run_data.load(cfg, shape, layout, device, dtype, self.accelerator.autocast, *seams)
        self.shape, self.components = data.shape, dict(data.components)

    def check_resume_before_encoding(self, source: ImageSource, components: dict[str, str]) -> None:
        """The checkpoint this run resumes against the data set and every model component (their configs and weight
        files' content; the transformer's from its files, before it loads), before the encoding it would waste."""
        cfg, shape = self.cfg, self.shape

        def identity() -> dict:
            transformer = transformer_fingerprint(cfg.model, shape.model_path, shape.family.transformer_class())
            components_now = {**components, "transformer": transformer}
            known = resume.run_identity(
                cfg, self.samples_per_step(), source.identity(), self.identity_buckets(), components=components_now
            )
            known.pop("prior")  # the class images are known once rendered: checked when the model is built
            return known

        resume.check_known(cfg, identity)

    def build_model(self) -> None:
        """The transformer to train (flux_cp.model.loading.load_trainee: its frozen base quantized with
        --base_precision, LoRA or full, the seed checkpoint), made to run on the layout by `parallelize` (CP,
        checkpointing and compile, block offload, the optimizer, FSDP2 or DDP), and the LR schedule."""
        cfg, layout, train, shape = self.cfg, self.layout, self.cfg.train, self.shape
        data, family, device, dtype = self.data, shape.family, self.device, self.weight_dtype
        steps_per_epoch = data.schedule.batches_per_epoch // train.gradient_accumulation_steps
        if steps_per_epoch == 0 and train.max_train_steps is None:
            raise UsageError(
                f"one epoch has {data.schedule.batches_per_epoch} batches, fewer than "
                f"--gradient_accumulation_steps {train.gradient_accumulation_steps}: set --max_train_steps",
                agreed=True,  # every rank counts the same batches
            )
        self.max_steps = max_steps = train.max_train_steps or train.num_train_epochs * steps_per_epoch
        if train.max_train_steps is None:  # the step flags against the count only now known (else: at parse time)
            self.check_step_flags(data.schedule.batches_per_epoch)
        transformer, self.components["transformer"] = load_trainee(
            cfg, shape.model_path, family.transformer_class(), family.quantized_parts, dtype, device, layout.is_main
        )
        self.checkpointing = plan.checkpointing_for_run(cfg, shape, device)
        self.text = text = None
        if cfg.lora.train_text_encoder:  # kept whole on every rank, outside prepare (flux_cp.model.text_encoder)
            self.text = text = TrainedTextEncoder(
                data.encoders, family.trained_text_encoder, family.trained_text_encoder_targets, cfg.lora, train.seed
            )
        text_params = text.parameters() if text is not None else None
        ready = parallel.parallelize(
            transformer,
            shape,
            layout,
            cfg,
            checkpointing=self.checkpointing,
            device=device,
            accelerator=self.accelerator,
            make_optimizer=lambda p: optim.make_optimizer(train, p, data.global_batch, text_params),
        )
        self.model, self.optimizer, self.offload = ready.model, ready.optimizer, ready.offload
        compiled = blocks.compiled(train)
        self.lr_scheduler = optim.make_lr_scheduler(train, ready.base_optimizer, max_steps)
        # After prepare: FSDP2 replaces the parameters with sharded ones (the optimizer is remapped by accelerate;
        # a list taken before would clip and measure gradients that no longer exist).
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        inner = self.accelerator.unwrap_model(self.model)  # its parameters are the wrapped model's (the names differ)
        self.state_model = self.model
        named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
        if text is not None:  # checkpoints hold both under one module: the optimizer's state is keyed by their names
            self.state_model = torch.nn.ModuleDict({"transformer": inner, text.name: text.module})
            named = [(f"transformer.{n}", p) for n, p in named]
            named += [(f"{text.name}.{n}", p) for n, p in text.named_parameters()]
        self.ema = EMA(named, train.ema_decay, train.ema_update_interval) if train.use_ema else None
        trained = self.params + (list(text.parameters()) if text is not None else [])
        self.compile_guard = (
            compiling.FirstStep(blocks.transformer_blocks(inner), trained, self.accelerator, self.device)
            if compiled
            else None
        )
        self.compile_time = compiling.CompileTime(compiled)
        classes = data.class_source.identity() if data.class_source is not None else None
        self.run_identity = resume.run_identity(
            cfg, self.samples_per_step(), data.source.identity(), self.identity_buckets(), classes, self.components
        )
        every = cfg.checkpoints.checkpointing_steps
        if layout.is_main:
            saves = max_steps // every + (1 if max_steps % every else 0)
            warning = diskspace.check_start(
                train.output_dir, self.sizes, saves, cfg.checkpoints.checkpoints_total_limit
            )
            if warning:
                logger.warning(f"warning: {warning}")

    def check_step_flags(self, batches_per_epoch: int) -> None:
        """The interval, step and count flags against the run's steps counted from its epochs (flux_cp.config.ranges):
        refused where the run can never give what they ask, a warning for each whose effect never happens."""
        cfg, steps = self.cfg, f"the {self.max_steps} steps of --num_train_epochs {self.cfg.train.num_train_epochs}"
        try:
            flag_ranges.check_steps(cfg.flat(), self.max_steps, steps)
        except UsageError as e:
            raise UsageError(str(e), agreed=True) from None  # every rank counts the same batches
        warnings = flag_ranges.step_warnings(cfg.given, cfg.flat(), self.max_steps, steps, batches_per_epoch)
        for warning in warnings if self.layout.is_main else ():
            logger.warning(f"warning: {warning}")

    def resume(self) -> int:
        """The step to start after: a compatible checkpoint's, restored on any layout, or 0. A run already finished
        (its last checkpoint at the last step, its outputs written) sets `done_before` and loads nothing."""
        ckpt, output_dir = self.cfg.checkpoints, self.cfg.train.output_dir
        self.done_before = outdir.finished(ckpt.resume_from_checkpoint, output_dir, self.max_steps, claimed=True)
        if self.done_before is not None:
            logger.info(f"flux-cp: {outdir.finished_line(self.done_before, self.max_steps)}")
            return self.max_steps
        found = resume.checkpoint_of(self.cfg, self.run_identity, self.max_steps)
        if found is None:
            return 0
        extra = {"ema": self.ema.state_dict()} if self.ema is not None else None
        step = resume.restore(*found, self.cfg, self.state_model, self.optimizer, self.lr_scheduler, extra)
        profile = self.cfg.train.profile_step
        if profile is not None and profile <= step and self.layout.is_main:
            logger.warning(
                f"warning: --profile_step {profile} is not after the resumed step {step}: nothing is profiled"
            )
        return step

    def train(self, start_step: int) -> None:
        """Every step after `start_step`, each queued on the device before the previous one is read."""
        self.start_loop(start_step)
        queued = None  # the previous step, read once this one is queued behind it
        guard = self.compile_guard  # the first step compiles the blocks: a failure falls back to eager ones
        for step in range(start_step + 1, self.max_steps + 1):
            profile = step == self.cfg.train.profile_step
            with profiled(profile, self.cfg.train.output_dir, self.layout.rank, self.layout.is_main):
                result = self.train_step(step) if guard is None else guard.run(functools.partial(self.train_step, step))
            guard = None
            if queued is not None:
                self.after_step(queued)
            queued = result
            if self.uses_model_after(step):
                self.after_step(result)
                queued = None

    def start_loop(self, start_step: int) -> None:
        """Record the run's settings, open the metrics and trackers, and build the batch source and the outputs."""
        cfg, layout, device, shape, data = self.cfg, self.layout, self.device, self.shape, self.data
        self.fault = faults.from_env(layout.rank)
        self.outputs = Outputs(
            cfg,
            shape,
            layout,
            self.accelerator,
            self.model,
            self.optimizer,
            self.lr_scheduler,
            self.sizes,
            self.weight_dtype,
            self.run_identity,
            self.fault,
            self.max_steps,
            data.previews,
            save=self.save_checkpoint,
            state_model=self.state_model,
            text=self.text,
            ema=self.ema,
            source=data.source,
        )
        self.outputs.record_settings(self.tuning, self.checkpointing)
        if self.accelerator.log_with:
            flat = {**cfg.flat(), "resolution": ",".join(map(str, cfg.data.resolution))}  # trackers take scalars
            hparams = {k: v for k, v in flat.items() if isinstance(v, (int, float, str, bool))}
            kwargs = parallel.tracker_init_kwargs(cfg.train, cfg.validation)
            if layout.is_main and "wandb" in kwargs:  # (a tracker folder outside the output folder is not made yet)
                os.makedirs(kwargs["wandb"]["dir"], exist_ok=True)
            self.accelerator.init_trackers("flux-cp", config=hparams, init_kwargs=kwargs)
            if layout.is_main and (where := parallel.wandb_folder(self.accelerator)):
                logger.info(f"wandb: this run's files are in {where}")
        self.metrics = metrics.MetricsLog(cfg.train.output_dir, start_step, layout.is_main)
        self.progress = optim.Progress(start_step)
        if device.type == "cuda":  # peak memory of training, not of loading and initialisation
            torch.cuda.reset_peak_memory_stats(device)
        self.bar = StepBar(self.max_steps, start_step, layout.is_main)
        guidance = bool(shape.transformer_config.get("guidance_embeds"))
        captions = None
        if self.text is not None:  # the trained text encoder reads each sample's caption
            n, samples = len(data.source), data.source.samples
            position = getattr(data.samples, "position", lambda index: index)  # a copy's sample (flux_cp.data.encode)
            captions = (lambda index: samples[position(index) % n].caption, cfg.data.class_prompt)
        self.batches = Batches(
            data.samples,
            data.schedule,
            layout,
            cfg.data,
            cfg.train,
            data.noise_scheduler,
            shape.family,
            shape.family.normalizer(data.encoders.vae),
            guidance,
            device,
            self.weight_dtype,
            data.classes,
            captions,
        )
        peak = metrics.peak_flops(device)
        self.peak = peak and peak[0]
        if peak:
            logger.info(f"MFU and HFU against {peak[1]}")
        self.timer = self.make_timer()
        if cfg.model.embedded_default and data.previews is not None and start_step == 0:
            self.outputs.validate(0)  # the tiny model before training, to set beside the images at the end
            self.timer.restart()
        self.model.train()

    def train_step(self, step: int) -> StepResult:
        """One optimizer step queued on the device: forward/backward over the accumulated micro-batches, clip,
        update. Nothing in it waits for the GPU."""
        cfg, accelerator, model, family = self.cfg, self.accelerator, self.model, self.shape.family
        accum = cfg.train.gradient_accumulation_steps
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        tokens, flops = 0, NO_FLOPS
        recomputed = len(self.checkpointing.blocks) / self.checkpointing.total  # share of the blocks
        attention = recomputed if blocks.attention_recomputed(cfg.train) else 0.0
        lora, config = not cfg.lora.full_finetune, self.shape.transformer_config
        samples = self.data.global_batch * cfg.data.samples_per_slot  # with their class images (prior preservation)
        for micro in range(accum):
            mb = self.batches.micro((step - 1) * accum + micro)
            tokens += samples * (mb.image_tokens + mb.text_tokens)
            flops += family.step_flops(config, mb.image_tokens, mb.text_tokens, samples, lora, recomputed, attention)
            blocks.step_begins(cfg.train.compile_mode)
            with accelerator.accumulate(model):
                if self.text is not None:  # its forward in the step, with the weights of this step
                    with accelerator.autocast():
                        mb.inputs.update(self.text.inputs(mb.captions, self.weight_dtype))
                loss = self.fault.maybe_corrupt(step, batch_loss(model(**mb.inputs)[0], mb))
                accelerator.backward(loss)
                loss_sum += loss.detach().double()
                upcoming = (step - 1) * accum + micro + 1
                if upcoming < self.max_steps * accum:  # the host builds it while the GPU runs this backward
                    self.batches.prefetch(upcoming)
                if accelerator.sync_gradients:
                    text_params = None
                    if self.text is not None:  # averaged over the ranks as DDP averages the transformer's
                        self.text.average_gradients()
                        text_params = self.text.parameters()
                    grad_norm = optim.clip_grad_norm(accelerator, self.params, cfg.train.max_grad_norm, text_params)
        self.fault.maybe_fail(step)
        step_loss = accelerator.reduce(loss_sum / accum, reduction="mean")
        skipped = optim.apply_update(self.optimizer, self.lr_scheduler, step_loss, grad_norm)
        if self.ema is not None:  # after the update (a skipped step's weights are those before it), on the device
            self.ema.update(step)
        lr = self.lr_scheduler.get_last_lr()[0]
        return StepResult(step, mb.epoch, step_loss, grad_norm, skipped, lr, tokens, flops, self.timer.mark())

    def due_after(self, step: int) -> tuple[bool, bool]:
        """Whether validation images and whether a checkpoint are due after `step`."""
        every = self.cfg.validation.validation_steps
        validating = bool(self.data.previews is not None and every and step % every == 0)
        return validating, step % self.cfg.checkpoints.checkpointing_steps == 0

    def uses_model_after(self, step: int) -> bool:
        """Whether what follows `step` needs the model as that step left it (validation images, a checkpoint, the
        outputs of the last step) or an idle GPU (the next step is profiled): then the next step is queued only
        after `after_step` of this one."""
        return any(self.due_after(step)) or step >= self.max_steps or step + 1 == self.cfg.train.profile_step

    def after_step(self, result: StepResult) -> None:
        """Read the step's loss (stopping on a non-finite one, --on_nonfinite), write its metrics row and send it to
        the trackers, update the progress bar; validation images when due, a checkpoint when due."""
        cfg, layout, step = self.cfg, self.layout, result.step
        read = torch.stack([result.loss.double(), result.grad_norm.double(), result.skipped.double()])
        loss, grad_norm, skipped = read.tolist()  # one copy to the host
        dt = self.timer.seconds(result.end)
        optim.check_finite(loss, grad_norm, cfg.train.on_nonfinite, step)
        self.progress.note(step, bool(skipped))
        per_s = result.tokens / dt
        row = {"step": step, "epoch": result.epoch, "loss": loss, "lr": result.lr, "grad_norm": grad_norm}
        row |= {"s_per_step": dt, "tokens_per_s": per_s, "tokens_per_s_per_gpu": per_s / layout.world}
        row |= metrics.memory_row(self.device) | {"skipped": bool(skipped)}
        if self.peak:  # model FLOPs (no recomputation) and executed FLOPs per GPU-second, against the GPU's peak
            row["mfu"] = result.flops.model / dt / layout.world / self.peak
            row["hfu"] = result.flops.executed / dt / layout.world / self.peak
        self.metrics.write(row)
        fell_back = self.compile_guard is not None and self.compile_guard.fell_back is not None
        if line := self.compile_time.step_done(dt, fell_back):
            logger.info(f"flux-cp: {line}")
        if self.accelerator.log_with:
            self.accelerator.log({k: v for k, v in row.items() if k != "step"}, step=step)
        self.bar.step(step, loss, row["lr"], dt, row["tokens_per_s"], row.get("mfu"))
        if step < self.max_steps:  # the last step's outputs are written by `finish`, the model first
            validating, saving = self.due_after(step)
            if validating:
                self.outputs.validate(step)
            if saving and skipped:  # the weights of a skipped step gave a non-finite loss: no checkpoint of them
                logger.warning(f"step {step} was skipped: no checkpoint of it (the last one is kept)")
            elif saving:
                self.save_checkpoint(step)
            if self.uses_model_after(step):  # keep what ran here out of the next step's time
                self.timer.restart()

    def finish(self) -> None:
        """The outputs of the last step (flux_cp.run.output_phase): the trained weights, the final checkpoint,
        validation images, the loss curve, the model card, the upload and the summary."""
        self.bar.close()
        self.metrics.close()
        self.outputs.finish(self.progress)

    def close(self) -> None:
        """Free what holds the process group while it is up, then end accelerate's trackers. The wrapped model's
        gradient reducer holds the group: freed after the group was destroyed, its teardown can deadlock gloo (a
        worker thread waits for the GIL the destructor holds)."""
        for name in "model optimizer lr_scheduler params batches metrics bar outputs text ema state_model".split():
            self.__dict__.pop(name, None)
        self.accelerator.free_memory()
        self.accelerator.end_training()
