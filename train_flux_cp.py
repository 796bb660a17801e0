#!/usr/bin/env python
"""Fine-tune FLUX.1 (LoRA or full) with context parallelism under `accelerate launch`.

    accelerate launch --config_file accelerate_configs/fsdp2_cp2.yaml train_flux_cp.py \
        --pretrained_model_name_or_path black-forest-labs/FLUX.1-dev --dataset_name DATA \
        --resolution 2048 --cp_size 2 --rank 16 --mixed_precision bf16 --gradient_checkpointing

With no model and data flags it trains a tiny Flux built locally on the bundled data set.

The recipe, one function per phase, top to bottom:
    setup -> load_data (encode once, cached) -> build_model (LoRA or full, CP, FSDP/DDP) -> resume
    -> for each step: train_step, after_step (metrics, validation, checkpoint) -> finish (final weights).
Flags arrive as typed sections (flux_cp.config); the details of each phase live in flux_cp/.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import cp
from flux_cp import checkpoint, diskspace, distributed, environment, faults, files, manifest, outdir, runner, validation
from flux_cp.batches import Batches
from flux_cp.blocks import attention_recomputed, prepare_blocks, step_begins, uses_cuda_graphs
from flux_cp.config import Config, parse_config
from flux_cp.data import BUNDLED_DATA, BatchSchedule, ImageSource, check_pair_flags, open_source, reference_column
from flux_cp.encode import Encoders, Geometry, LiveData, TrainingData, encode_dataset, encoder_fingerprints
from flux_cp.errors import UsageError
from flux_cp.lora import save_lora
from flux_cp.metrics import MetricsLog, StepTimer, flux_flops_per_step, measure_matmul_peak, peak_memory_gib
from flux_cp.model import (
    apply_seed_checkpoint,
    full_state_dict,
    load_encoders,
    load_scheduler,
    load_transformer,
    model_path,
    pipeline_class,
    prepare_trainable,
    save_full,
    trainable_parameters,
)
from flux_cp.optim import apply_update, check_finite, clip_grad_norm, make_lr_scheduler, make_optimizer
from flux_cp.parallel import (
    Layout,
    check_layout,
    check_tokens,
    choose_cp_mode,
    cp_advice,
    launched_world_size,
    make_accelerator,
    make_layout,
)
from flux_cp.profiling import profiled
from flux_cp.resume import check_steps as check_resume_steps

logger = logging.getLogger("flux_cp")


# --- what each phase hands to the next -----------------------------------------------------------------


@dataclass
class Run:
    """The flags, the process layout and the accelerator: fixed for the whole run."""

    cfg: Config
    accelerator: Any
    layout: Layout
    device: torch.device
    weight_dtype: torch.dtype  # the frozen weights' and the inputs' dtype (mixed precision)
    model_path: str
    sizes: diskspace.Sizes  # of one checkpoint and of the final model, from parameter counts


@dataclass
class Data:
    """The encoded training data, its batch order, and what validation needs of the encoders."""

    encoders: Encoders  # the VAE stays; the text encoders are freed once the data is cached
    noise_scheduler: Any
    source: ImageSource
    geometry: Geometry
    samples: TrainingData
    schedule: BatchSchedule
    global_batch: int  # samples per micro-step over all data-parallel ranks
    validation_embeds: tuple[torch.Tensor, torch.Tensor] | None
    validation_reference: torch.Tensor | None  # Kontext: latents of the --validation_image the prompts edit


@dataclass
class Trainee:
    """The wrapped model and its optimizer, ready to step."""

    model: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    params: list[torch.nn.Parameter]  # trainable, after accelerate.prepare (sharded under FSDP2)
    transformer_config: dict
    cp_mode: str
    ulysses_size: int | None
    max_steps: int
    run_identity: dict  # what a checkpoint must match to be resumed by this run


@dataclass
class Loop:
    """Per-step machinery: batches, metrics, timing, progress bar, injected faults."""

    batches: Batches
    metrics: MetricsLog
    timer: StepTimer
    bar: Any
    matmul_peak: float | None
    fault: faults.Fault


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
    flops: float
    end: Any  # StepTimer.mark() after the step's update


# --- phases --------------------------------------------------------------------------------------------


def setup(cfg: Config) -> Run:
    """Flag checks that need the launch size, then accelerate, the dp x cp layout, logging and precision."""
    # Everything that needs only the flags and the launch size fails here, before any process group.
    check_layout(launched_world_size(), cfg.parallel.cp_size)
    check_tokens(cfg.parallel, cfg.data, cfg.validation)
    check_pair_flags(cfg.data, cfg.validation)
    kontext = reference_column(cfg.data) is not None  # pair data: FLUX.1 Kontext (the tiny default's variant)
    # Before any process group: transformers' save_pretrained writes weights only on rank 0 once
    # torch.distributed is up, so the tiny default must be built (by whichever process locks first) now.
    path = model_path(cfg.model, kontext)
    accelerator = make_accelerator(cfg.parallel, cfg.train, cfg.validation)
    layout = make_layout(accelerator, cfg.parallel.cp_size, cfg.parallel.collective_timeout)
    logging.basicConfig(level=logging.INFO if layout.is_main else logging.WARNING, format="%(message)s")
    if cfg.model.embedded_default:
        logger.info(
            f"flux-cp: embedded default - a tiny {'FLUX.1 Kontext' if kontext else 'Flux'} built locally, trained on "
            f"{cfg.data.dataset_name or 'the bundled data set (data/tiny_shapes)'}; pass "
            "--pretrained_model_name_or_path and --dataset_name for real runs"
        )
    logger.info(f"flux-cp: {layout.describe()}, {accelerator.distributed_type}, device {accelerator.device}")
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if cfg.train.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    weight_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    claim_output_dir(cfg, layout, path)
    sizes = output_sizes(cfg, path, weight_dtype, layout.world)
    problem = None
    if layout.is_main:
        try:  # one checkpoint and the final model must fit; how many checkpoints fit is known once steps are
            diskspace.check_start(cfg.train.output_dir, sizes, saves=1, total_limit=None)
        except UsageError as e:
            problem = str(e)
    distributed.check_all_ranks(problem is None, problem or "")
    return Run(cfg, accelerator, layout, accelerator.device, weight_dtype, path, sizes)


def claim_output_dir(cfg: Config, layout: Layout, model_folder: str) -> None:
    """The output folder becomes this run's (flux_cp.outdir), and how the run starts is decided (flux_cp.resume:
    a damaged or foreign checkpoint is found now, not after the models load); every rank learns the result."""
    problem, claimed = None, None
    if layout.is_main:
        try:
            trackers = cfg.validation.report_to in ("tensorboard", "all")  # the ones writing into --logging_dir
            claimed = outdir.claim(
                cfg.train.output_dir, cfg.checkpoints.resume_from_checkpoint, cfg.train.overwrite_output_dir,
                logging_dir=cfg.validation.logging_dir if trackers else None, max_train_steps=cfg.train.max_train_steps,
                apart={"--pretrained_model_name_or_path": model_folder,
                       "--dataset_name": cfg.data.dataset_name or str(BUNDLED_DATA)},
            )  # fmt: skip
            if not cfg.data.no_cache:
                outdir.check_writable(Path(cache_dir(cfg)), "--cache_dir")
        except UsageError as e:
            problem = str(e)
    distributed.check_all_ranks(problem is None, problem or "")
    if claimed and claimed.removed:
        logger.info(f"--overwrite_output_dir: removed the earlier run's outputs ({', '.join(claimed.removed)})")
    for note in claimed.notes if claimed else ():
        logger.info(note)


def cache_dir(cfg: Config) -> str:
    return cfg.data.cache_dir or str(Path.home() / ".cache" / "flux_cp" / "encodings")


def output_sizes(cfg: Config, path: str, weight_dtype: torch.dtype, world: int) -> diskspace.Sizes:
    """Bytes of one checkpoint and of the final model, from the transformer's config (nothing loaded)."""
    from diffusers import FluxTransformer2DModel

    try:
        config = dict(FluxTransformer2DModel.load_config(path, subfolder="transformer", revision=cfg.model.revision))
    except (OSError, ValueError) as e:
        first = str(e).splitlines()[0]
        raise UsageError(f"cannot load transformer from --pretrained_model_name_or_path {path}: {first}") from None
    lora = None if cfg.lora.full_finetune else cfg.lora.rank
    counts = diskspace.count(config, lora, list(cfg.lora.lora_layers))
    with_optimizer = not cfg.checkpoints.checkpoint_weights_only
    return diskspace.sizes(counts, cfg.lora.full_finetune, with_optimizer, weight_dtype, world)


def load_data(run: Run) -> Data:
    """Encode the data set once (cached on disk, spread over all ranks), then free the text encoders."""
    cfg, layout = run.cfg, run.layout
    source = open_source(cfg.data)  # listing errors (captions, pairs) before any model loads
    if source.pairs:
        logger.info(f"FLUX.1 Kontext pairs: {len(source)} targets with their reference images, loss on the targets")
        declared = pipeline_class(run.model_path, cfg.model.revision)
        if declared not in (None, "FluxKontextPipeline"):
            logger.warning(
                f"the data has reference images but {run.model_path} is a {declared}: training it on pairs starts "
                "FLUX.1 Kontext from scratch; for image editing fine-tune black-forest-labs/FLUX.1-Kontext-dev"
            )
    encoders = load_encoders(cfg.model, run.model_path, run.weight_dtype, run.device)
    noise_scheduler = load_scheduler(cfg.model, run.model_path)
    geometry = Geometry(cfg.data.resolution, cfg.parallel.cp_size, cfg.data.aspect_buckets)
    validation_embeds = validation_reference = None
    if cfg.validation.validation_prompt:
        validation_embeds = encoders.prompts(list(cfg.validation.validation_prompt), cfg.data.max_sequence_length)
        if cfg.validation.validation_image:
            validation_reference = validation.reference_latents(
                cfg.validation.validation_image, cfg.validation.validation_resolution, encoders.vae, run.device
            )
    if cfg.data.no_cache:
        samples: TrainingData = LiveData(source, encoders, geometry, cfg.data, cfg.train.seed)
    else:
        cache = Path(cache_dir(cfg))
        fingerprints = encoder_fingerprints(encoders, run.model_path, cfg.model.revision)
        samples = encode_dataset(
            source, encoders, geometry, cfg.data, cfg.train.seed, cache, fingerprints, layout.rank, layout.world
        )
        logger.info(f"encodings: {len(source)} samples, {samples.computed} newly computed, cache {cache}")
        encoders.free_text_encoders()
    global_batch = cfg.train.train_batch_size * layout.dp
    schedule = BatchSchedule(samples.buckets, global_batch, cfg.train.seed)
    return Data(encoders, noise_scheduler, source, geometry, samples, schedule, global_batch, validation_embeds,
                validation_reference)  # fmt: skip


def build_model(run: Run, data: Data) -> Trainee:
    """Transformer, LoRA or full, seed checkpoint, CP attention, compile, optimizer, then FSDP/DDP."""
    cfg, layout, train = run.cfg, run.layout, run.cfg.train
    transformer = load_transformer(cfg.model, run.model_path, run.weight_dtype, run.device, train.seed)
    config = dict(transformer.config)
    prepare_trainable(transformer, cfg.lora, train.seed)
    if train.seed_checkpoint:
        how = apply_seed_checkpoint(transformer, train.seed_checkpoint, layout.is_main)
        logger.info(f"seed checkpoint {how}: {train.seed_checkpoint}")
    mode, ulysses_size = choose_cp_mode(cfg.parallel, config["num_attention_heads"], layout.cp)
    # Installed at cp=1 too: its block kernels (cuDNN on Hopper) beat diffusers' default SDPA path.
    cp.apply_context_parallel(transformer, layout.cp_group, mode=mode, ulysses_size=ulysses_size)
    if layout.cp > 1:
        logger.info(
            ("auto-chosen " if cfg.parallel.cp_mode == "auto" else "")
            + f"context parallel: {mode}"
            + (f" (ulysses {ulysses_size})" if ulysses_size else "")
            + f" over {layout.cp} ranks"
        )
        images = 2 if data.source.pairs else 1  # a Kontext pair: target and reference tokens
        tokens = images * (cfg.data.resolution // 16) ** 2 + cfg.data.max_sequence_length
        advice = cp_advice(tokens, layout.cp, uses_cuda_graphs(cfg.train.compile_mode))
        if advice and run.device.type == "cuda":  # measured on GPUs; the CPU demo's tiny sequences are for testing
            logger.warning(advice)
    prepare_blocks(transformer, gradient_checkpointing=train.gradient_checkpointing,
                   recompute_attention=train.recompute_attention, compile=bool(train.compile or train.compile_mode),
                   compile_mode=train.compile_mode, cp=layout.cp)  # fmt: skip
    optimizer = make_optimizer(train, [p for _, p in trainable_parameters(transformer)], data.global_batch)
    steps_per_epoch = data.schedule.batches_per_epoch // train.gradient_accumulation_steps
    if steps_per_epoch == 0 and train.max_train_steps is None:
        raise UsageError(
            f"one epoch has {data.schedule.batches_per_epoch} batches, fewer than "
            f"--gradient_accumulation_steps {train.gradient_accumulation_steps}: set --max_train_steps"
        )
    max_steps = train.max_train_steps or train.num_train_epochs * steps_per_epoch
    lr_scheduler = make_lr_scheduler(train, optimizer, max_steps)
    model, optimizer = run.accelerator.prepare(transformer, optimizer)
    # After prepare: FSDP2 replaces the parameters with sharded ones (the optimizer is remapped by accelerate;
    # a list taken before would clip and measure gradients that no longer exist).
    params = [p for p in model.parameters() if p.requires_grad]
    samples_per_step = data.global_batch * train.gradient_accumulation_steps
    buckets = data.geometry.buckets if cfg.data.aspect_buckets else None
    identity = checkpoint.run_identity(cfg, samples_per_step, data.source.identity(), buckets)
    every = cfg.checkpoints.checkpointing_steps
    if run.layout.is_main:
        saves = max_steps // every + (1 if max_steps % every else 0)
        warning = diskspace.check_start(train.output_dir, run.sizes, saves, cfg.checkpoints.checkpoints_total_limit)
        if warning:
            logger.warning(f"warning: {warning}")
    return Trainee(model, optimizer, lr_scheduler, params, config, mode, ulysses_size, max_steps, identity)


def resume(run: Run, trainee: Trainee) -> int:
    """The step to start after: a compatible checkpoint's, restored on any layout, or 0."""
    ckpt, output_dir = run.cfg.checkpoints, run.cfg.train.output_dir
    path = checkpoint.resolve(ckpt.resume_from_checkpoint, output_dir)
    if path is None:
        if ckpt.resume_from_checkpoint == "latest":
            logger.info(f"no checkpoint in {output_dir} yet: starting from step 0")
        return 0
    meta = checkpoint.read_meta(path)
    checkpoint.check_compatible(meta, trainee.run_identity, path)
    check_resume_steps(meta["step"], trainee.max_steps, path, "--max_train_steps, or --num_train_epochs")
    with_optimizer = meta.get("optimizer_state", True)
    applied = checkpoint.load(path, trainee.model, trainee.optimizer, trainee.lr_scheduler, with_optimizer)
    logger.info(f"resumed from {path} at step {meta['step']} (written with {meta['layout']})")
    changed = checkpoint.changed_settings(meta.get("args", {}), run.cfg.flat(), checkpoint.RESUMABLE_CHANGES)
    for change in changed or applied:
        logger.info(f"resume: {change} (applied from step {meta['step'] + 1})")
    if not with_optimizer:
        logger.warning(
            f"warning: {path} has no optimizer state (--checkpoint_weights_only): AdamW's moments start from zero, "
            "so the next steps differ from an uninterrupted run"
        )
    return meta["step"]


def start_loop(run: Run, data: Data, trainee: Trainee, start_step: int) -> Loop:
    """Record the run's settings, open the metrics and trackers, and build the batch source."""
    cfg, layout, device = run.cfg, run.layout, run.device
    if layout.is_main:
        chosen = {"layout": layout.describe(), "cp_mode": trainee.cp_mode, "ulysses_size": trainee.ulysses_size}
        manifest.record(cfg.train.output_dir, "run_config.json")
        files.write_json(Path(cfg.train.output_dir) / "run_config.json", {**cfg.flat(), **chosen})
    if run.accelerator.log_with:
        hparams = {k: v for k, v in cfg.flat().items() if isinstance(v, (int, float, str, bool))}
        run.accelerator.init_trackers("flux-cp", config=hparams)
    metrics = MetricsLog(cfg.train.output_dir, start_step, layout.is_main)
    if device.type == "cuda":  # peak memory of training, not of loading and initialisation
        torch.cuda.reset_peak_memory_stats(device)
    from tqdm.auto import tqdm

    bar = tqdm(range(trainee.max_steps), initial=start_step, desc="steps", disable=not layout.is_main,
               dynamic_ncols=True)  # fmt: skip
    guidance = bool(trainee.transformer_config.get("guidance_embeds"))
    batches = Batches(data.samples, data.schedule, layout, cfg.data, cfg.train, data.noise_scheduler,
                      data.encoders.vae.config, guidance, device, run.weight_dtype)  # fmt: skip
    peak = measure_matmul_peak(device)
    loop = Loop(batches, metrics, StepTimer(device), bar, peak, faults.from_env(layout.rank))
    if cfg.model.embedded_default and data.validation_embeds is not None and start_step == 0:
        validate(run, data, trainee, loop, 0)  # the tiny model before training, to set beside the images at the end
        loop.timer.restart()
    trainee.model.train()
    return loop


def train_step(run: Run, data: Data, trainee: Trainee, loop: Loop, step: int) -> StepResult:
    """One optimizer step queued on the device: forward/backward over the accumulated micro-batches, clip,
    update. Nothing in it waits for the GPU."""
    cfg, accelerator, model = run.cfg, run.accelerator, trainee.model
    accum = cfg.train.gradient_accumulation_steps
    loss_sum = torch.zeros((), device=run.device, dtype=torch.float64)
    tokens = flops = 0
    for micro in range(accum):
        mb = loop.batches.micro((step - 1) * accum + micro)
        tokens += data.global_batch * (mb.image_tokens + mb.text_tokens)
        flops += flux_flops_per_step(trainee.transformer_config, mb.image_tokens, mb.text_tokens, data.global_batch,
                                     not cfg.lora.full_finetune, cfg.train.gradient_checkpointing,
                                     attention_recomputed(cfg.train))  # fmt: skip
        step_begins(cfg.train.compile_mode)
        with accelerator.accumulate(model):
            loss = loop.fault.maybe_corrupt(step, mb.loss(model(**mb.inputs)[0]))
            accelerator.backward(loss)
            loss_sum += loss.detach().double()
            upcoming = (step - 1) * accum + micro + 1
            if upcoming < trainee.max_steps * accum:  # the host builds it while the GPU runs this backward
                loop.batches.prefetch(upcoming)
            if accelerator.sync_gradients:
                grad_norm = clip_grad_norm(accelerator, trainee.params, cfg.train.max_grad_norm)
    loop.fault.maybe_fail(step)
    step_loss = accelerator.reduce(loss_sum / accum, reduction="mean")
    skipped = apply_update(trainee.optimizer, trainee.lr_scheduler, step_loss, grad_norm)
    lr = trainee.lr_scheduler.get_last_lr()[0]
    return StepResult(step, mb.epoch, step_loss, grad_norm, skipped, lr, tokens, flops, loop.timer.mark())


def due_after(run: Run, data: Data, step: int) -> tuple[bool, bool]:
    """Whether validation images and whether a checkpoint are due after `step`."""
    every = run.cfg.validation.validation_steps
    validating = bool(data.validation_embeds is not None and every and step % every == 0)
    return validating, step % run.cfg.checkpoints.checkpointing_steps == 0


def uses_model_after(run: Run, data: Data, trainee: Trainee, step: int) -> bool:
    """Whether what follows `step` needs the model as that step left it (validation images, a checkpoint, the
    outputs of the last step) or an idle GPU (the next step is profiled): then the next step is queued only
    after `after_step` of this one."""
    return any(due_after(run, data, step)) or step >= trainee.max_steps or step + 1 == run.cfg.train.profile_step


def after_step(run: Run, data: Data, trainee: Trainee, loop: Loop, result: StepResult) -> None:
    """Read the step's loss (stopping on a non-finite one, --on_nonfinite), write its metrics row and send it to
    the trackers, update the progress bar; validation images when due, a checkpoint when due."""
    cfg, layout, step = run.cfg, run.layout, result.step
    loss, grad_norm, skipped = torch.stack([result.loss.double(), result.grad_norm.double(),
                                            result.skipped.double()]).tolist()  # fmt: skip
    dt = loop.timer.seconds(result.end)
    check_finite(loss, grad_norm, cfg.train.on_nonfinite, step)
    row = {
        "step": step, "epoch": result.epoch, "loss": loss, "lr": result.lr, "grad_norm": grad_norm,
        "s_per_step": dt, "tokens_per_s": result.tokens / dt, "tokens_per_s_per_gpu": result.tokens / dt / layout.world,
        "peak_mem_gib": peak_memory_gib(run.device), "skipped": bool(skipped),
    }  # fmt: skip
    if loop.matmul_peak:
        row["mfu"] = result.flops / dt / layout.world / loop.matmul_peak
    loop.metrics.write(row)
    if run.accelerator.log_with:
        run.accelerator.log({k: v for k, v in row.items() if k != "step"}, step=step)
    loop.bar.update(1)
    loop.bar.set_postfix(
        loss=f"{loss:.4f}", lr=f"{row['lr']:.2e}", s_step=f"{dt:.2f}", tok_s=f"{row['tokens_per_s']:.0f}",
        **({"mfu": f"{row['mfu']:.0%}"} if loop.matmul_peak else {}),
    )  # fmt: skip
    if step < trainee.max_steps:  # the last step's outputs are written by `finish`, the model first
        validating, saving = due_after(run, data, step)
        if validating:
            validate(run, data, trainee, loop, step)
        if saving:
            save_checkpoint(run, trainee, loop, step)
        if uses_model_after(run, data, trainee, step):  # keep what ran here out of the next step's time
            loop.timer.restart()


def save_checkpoint(run: Run, trainee: Trainee, loop: Loop, step: int) -> None:
    cfg, layout = run.cfg, run.layout
    meta = {"run": trainee.run_identity, "layout": layout.describe(), "args": cfg.flat()}
    saved = checkpoint.save(
        cfg.train.output_dir, step, trainee.model, trainee.optimizer, trainee.lr_scheduler, meta, layout.is_main,
        cfg.checkpoints.checkpoints_total_limit, loop.fault,
        optimizer_state=not cfg.checkpoints.checkpoint_weights_only, need_bytes=run.sizes.checkpoint,
    )  # fmt: skip
    logger.info(f"saved {saved}")


def validate(run: Run, data: Data, trainee: Trainee, loop: Loop, step: int) -> None:
    """Validation images with the current weights (CP across each group), saved and sent to the trackers."""
    cfg = run.cfg
    loop.fault.during_validation(step)
    images = validation.generate(
        run.accelerator.unwrap_model(trainee.model), data.encoders.vae, data.noise_scheduler.config,
        data.validation_embeds, run.layout, cfg.validation, cfg.train.guidance_scale, cfg.train.seed,
        run.accelerator.autocast, data.validation_reference,
    )  # fmt: skip
    if run.layout.is_main:
        path = validation.save_and_log(images, step, cfg.validation, cfg.train.output_dir, run.accelerator)
        logger.info(f"validation images: {path}")


def finish(run: Run, data: Data, trainee: Trainee, loop: Loop, step: int) -> None:
    """The outputs of the last step, most valuable first: the trained weights in diffusers' format (LoRA file or
    transformer folder), then the final checkpoint, then what is optional (validation images, the loss curve)."""
    cfg, output_dir, layout = run.cfg, run.cfg.train.output_dir, run.layout
    loop.bar.close()
    loop.metrics.close()
    state = full_state_dict(trainee.model, trainable_only=not cfg.lora.full_finetune)  # every rank: FSDP gathers
    problem = None
    if layout.is_main:
        inner = run.accelerator.unwrap_model(trainee.model)
        try:
            prev = checkpoint.list_checkpoints(output_dir)
            kept = f"{prev[-1][1]} is the last good checkpoint" if prev else "no checkpoint was written"
            diskspace.check_write(output_dir, run.sizes.model, f"the final {run.sizes.model_name}", kept,
                                  resumable=bool(prev))  # fmt: skip
            if cfg.lora.full_finetune:
                out = outdir.write_final(output_dir, "transformer",
                                         lambda d: save_full(inner, state, str(d), run.weight_dtype))  # fmt: skip
            else:
                out = outdir.write_final(output_dir, "pytorch_lora_weights.safetensors",
                                         lambda d: save_lora(inner, state, str(d), cfg.lora))  # fmt: skip
            logger.info(f"wrote {out}")
        except UsageError as e:
            problem = str(e)
    state.clear()  # the gathered full weights: free them before the checkpoint is written
    distributed.check_all_ranks(problem is None, problem or "")
    save_checkpoint(run, trainee, loop, step)
    if data.validation_embeds is not None:
        validate(run, data, trainee, loop, step)
    if layout.is_main:
        from flux_cp.metrics import plot_loss_curve

        manifest.record(output_dir, "loss_curve.png")
        plot_loss_curve(Path(output_dir) / "metrics.jsonl", Path(output_dir) / "loss_curve.png")
    run.accelerator.wait_for_everyone()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    environment.check_environment(cfg.validation.report_to)  # FLUX_CP_* values, a wandb login: before anything
    if cfg.plan.plan:
        from flux_cp.plan import print_plan

        print_plan(cfg)
        return 0
    run = setup(cfg)
    data = load_data(run)
    trainee = build_model(run, data)
    start_step = resume(run, trainee)
    loop = start_loop(run, data, trainee, start_step)
    queued = None  # the previous step, read once this one is queued behind it
    for step in range(start_step + 1, trainee.max_steps + 1):
        with profiled(step == cfg.train.profile_step, cfg.train.output_dir, run.layout.rank, run.layout.is_main):
            result = train_step(run, data, trainee, loop, step)
        if queued is not None:
            after_step(run, data, trainee, loop, queued)
        queued = result
        if uses_model_after(run, data, trainee, step):
            after_step(run, data, trainee, loop, result)
            queued = None
    finish(run, data, trainee, loop, trainee.max_steps)
    # The wrapped model's gradient reducer holds the process group: free it while the group is up. Freed after the
    # group was destroyed, its teardown can deadlock gloo (a worker thread waits for the GIL the destructor holds).
    del trainee, loop
    run.accelerator.free_memory()
    run.accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(runner.run(main))
