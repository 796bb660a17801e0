#!/usr/bin/env python
"""Fine-tune FLUX.1 (LoRA or full) with context parallelism under `accelerate launch`.

    accelerate launch --config_file accelerate_configs/fsdp2_cp2.yaml train_flux_cp.py \
        --pretrained_model_name_or_path black-forest-labs/FLUX.1-dev --dataset_name DATA \
        --resolution 2048 --cp_size 2 --rank 16 --mixed_precision bf16 --gradient_checkpointing

With no model and data flags it trains a tiny Flux built locally on the bundled data set.
The recipe: check flags -> layout -> encode data (cached) -> model + LoRA + CP -> FSDP/DDP -> loop.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

import torch

import cp
from flux_cp import checkpoint, faults, validation
from flux_cp.args import parse_args
from flux_cp.batches import Batches
from flux_cp.data import BatchSchedule, open_source
from flux_cp.encode import Geometry, LiveData, encode_dataset, model_fingerprint
from flux_cp.errors import UsageError
from flux_cp.metrics import MetricsLog, StepTimer, flux_flops_per_step, measure_matmul_peak, peak_memory_gib
from flux_cp.model import (
    apply_seed_checkpoint,
    full_state_dict,
    load_encoders,
    load_scheduler,
    load_transformer,
    model_path,
    prepare_trainable,
    save_full,
    save_lora,
    trainable_parameters,
    write_json,
)
from flux_cp.parallel import (
    all_ranks_ok,
    check_layout,
    check_tokens,
    choose_cp_mode,
    cp_advice,
    launched_world_size,
    make_accelerator,
    make_layout,
)
from flux_cp.runner import NonFiniteError, run

logger = logging.getLogger("flux_cp")


def clip_grad_norm(accelerator, params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global gradient norm of the trainable parameters, clipped to `max_norm` (<= 0: no clipping).
    (accelerate's clip_grad_norm_ under FSDP2 only handles the whole model's parameters, not LoRA's.)"""
    from torch.distributed.tensor import DTensor

    accelerator.unscale_gradients()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan:
        from flux_cp.plan import print_plan

        print_plan(args)
        return 0
    # Everything that needs only the flags and the launch size fails here, before any process group.
    check_layout(launched_world_size(), args.cp_size)
    check_tokens(args)

    # Before any process group: transformers' save_pretrained writes weights only on rank 0 once
    # torch.distributed is up, so the tiny default must be built (by whichever process locks first) now.
    path = model_path(args)
    accelerator = make_accelerator(args)
    layout = make_layout(accelerator, args.cp_size, args.collective_timeout)
    device = accelerator.device
    logging.basicConfig(level=logging.INFO if layout.is_main else logging.WARNING, format="%(message)s")
    if args.embedded_default:
        logger.info(
            "flux-cp: embedded default - a tiny Flux built locally, trained on the bundled data set "
            "(data/tiny_shapes); pass --pretrained_model_name_or_path and --dataset_name for real runs"
        )
    logger.info(f"flux-cp: {layout.describe()}, {accelerator.distributed_type}, device {device}")
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    weight_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)

    # --- data: encode once (cached), then free the text encoders ----------------------------------------
    encoders = load_encoders(args, path, weight_dtype, device)
    noise_scheduler = load_scheduler(args, path)
    source = open_source(args)
    geometry = Geometry(args.resolution, args.cp_size, args.aspect_buckets)
    validation_embeds = None
    if args.validation_prompt:
        validation_embeds = encoders.prompts(args.validation_prompt, args.max_sequence_length)
    check = lambda ok, msg: all_ranks_ok(ok, msg, device)  # noqa: E731
    if args.no_cache:
        data = LiveData(source, encoders, geometry, args)
    else:
        cache_dir = Path(args.cache_dir or Path.home() / ".cache" / "flux_cp" / "encodings")
        fps = (model_fingerprint(encoders.vae, path, args.revision),
               model_fingerprint(encoders.text_encoder_2, path, args.revision)
               + model_fingerprint(encoders.text_encoder, path, args.revision))  # fmt: skip
        data = encode_dataset(source, encoders, geometry, args, cache_dir, fps, layout.rank, layout.world, check)
        logger.info(f"encodings: {len(source)} samples, {data.computed} newly computed, cache {cache_dir}")
        encoders.free_text_encoders()
    global_batch = args.train_batch_size * layout.dp
    schedule = BatchSchedule(data.buckets, global_batch, args.seed)

    # --- model: transformer, LoRA or full, seed checkpoint, CP, then FSDP/DDP -------------------------
    transformer = load_transformer(args, path, weight_dtype, device)
    config = dict(transformer.config)
    prepare_trainable(transformer, args)
    if args.seed_checkpoint:
        how = apply_seed_checkpoint(transformer, args.seed_checkpoint, layout.is_main)
        logger.info(f"seed checkpoint {how}: {args.seed_checkpoint}")
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    mode, ulysses_size = choose_cp_mode(args, config["num_attention_heads"], layout.cp)
    # Installed at cp=1 too: its block kernels (cuDNN on Hopper) beat diffusers' default SDPA path.
    cp.apply_context_parallel(transformer, layout.cp_group, mode=mode, ulysses_size=ulysses_size)
    if layout.cp > 1:
        logger.info(
            ("auto-chosen " if args.cp_mode == "auto" else "")
            + f"context parallel: {mode}"
            + (f" (ulysses {ulysses_size})" if ulysses_size else "")
            + f" over {layout.cp} ranks"
        )
        advice = cp_advice((args.resolution // 16) ** 2 + args.max_sequence_length, layout.cp)
        if advice and device.type == "cuda":  # measured on GPUs; the CPU demo's tiny sequences are for testing
            logger.warning(advice)
    if args.compile or args.compile_mode:
        for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
            block.compile(mode=args.compile_mode)
    lr = args.learning_rate * (global_batch * args.gradient_accumulation_steps if args.scale_lr else 1)
    optimizer = torch.optim.AdamW(
        [p for _, p in trainable_parameters(transformer)], lr=lr, betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay, eps=args.adam_epsilon,
    )  # fmt: skip
    steps_per_epoch = schedule.batches_per_epoch // args.gradient_accumulation_steps
    if steps_per_epoch == 0 and args.max_train_steps is None:
        raise UsageError(
            f"one epoch has {schedule.batches_per_epoch} batches, fewer than "
            f"--gradient_accumulation_steps {args.gradient_accumulation_steps}: set --max_train_steps"
        )
    max_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    from diffusers.optimization import get_scheduler

    lr_scheduler = get_scheduler(
        args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps,
        num_training_steps=max_steps, num_cycles=args.lr_num_cycles, power=args.lr_power,
    )  # fmt: skip
    model, optimizer = accelerator.prepare(transformer, optimizer)
    # After prepare: FSDP2 replaces the parameters with sharded ones (the optimizer is remapped by accelerate;
    # a list taken before would clip and measure gradients that no longer exist).
    params = [p for p in model.parameters() if p.requires_grad]

    # --- resume -----------------------------------------------------------------------------------------
    run_identity = {
        "model": str(args.pretrained_model_name_or_path or "embedded-tiny"), "transformer_init": args.transformer_init,
        "full_finetune": args.full_finetune, "rank": None if args.full_finetune else args.rank,
        "lora_alpha": None if args.full_finetune else args.lora_alpha,
        "lora_layers": None if args.full_finetune else args.lora_layers,
        "global_batch": global_batch * args.gradient_accumulation_steps, "data": source.fingerprint(),
        "resolution": args.resolution, "seed": args.seed,
        "aspect_buckets": geometry.buckets if args.aspect_buckets else False,
        "max_sequence_length": args.max_sequence_length,
    }  # fmt: skip
    start_step = 0
    resume_path = checkpoint.resolve(args.resume_from_checkpoint, args.output_dir)
    if resume_path is not None:
        meta = checkpoint.read_meta(resume_path)
        checkpoint.check_compatible(meta, run_identity, resume_path)
        checkpoint.load(resume_path, model, optimizer, lr_scheduler)
        start_step = meta["step"]
        logger.info(f"resumed from {resume_path} at step {start_step} (written with {meta['layout']})")
    elif args.resume_from_checkpoint == "latest":
        logger.info(f"no checkpoint in {args.output_dir} yet: starting from step 0")

    # --- train -----------------------------------------------------------------------------------------
    if layout.is_main:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        write_json(
            Path(args.output_dir) / "run_config.json",
            {**vars(args), "layout": layout.describe(), "cp_mode": mode, "ulysses_size": ulysses_size},
        )
    if accelerator.log_with:
        accelerator.init_trackers(
            "flux-cp", config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
        )
    metrics = MetricsLog(args.output_dir, start_step, layout.is_main)
    if device.type == "cuda":  # peak memory of training, not of loading and initialisation
        torch.cuda.reset_peak_memory_stats(device)

    def validate(step: int) -> None:
        images = validation.generate(
            accelerator.unwrap_model(model),
            encoders.vae,
            noise_scheduler.config,
            validation_embeds,
            layout,
            args,
            accelerator.autocast,
        )
        if layout.is_main:
            logger.info(f"validation images: {validation.save_and_log(images, step, args, accelerator)}")

    peak = measure_matmul_peak(device)
    fault = faults.from_env(layout.rank)
    timer = StepTimer(device)
    from tqdm.auto import tqdm

    bar = tqdm(range(max_steps), initial=start_step, desc="steps", disable=not layout.is_main, dynamic_ncols=True)
    accum = args.gradient_accumulation_steps
    guidance = bool(config.get("guidance_embeds"))
    vae_config = encoders.vae.config
    batches = Batches(data, schedule, layout, args, noise_scheduler, vae_config, guidance, device, weight_dtype)
    model.train()
    for step in range(start_step + 1, max_steps + 1):
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        tokens = flops = 0
        for micro in range(accum):
            mb = batches.micro((step - 1) * accum + micro)
            tokens += global_batch * (mb.image_tokens + mb.text_tokens)
            flops += flux_flops_per_step(
                config,
                mb.image_tokens,
                mb.text_tokens,
                global_batch,
                not args.full_finetune,
                args.gradient_checkpointing,
            )
            with accelerator.accumulate(model):
                loss = fault.maybe_corrupt(step, mb.loss(model(**mb.inputs)[0]))
                accelerator.backward(loss)
                loss_sum += loss.detach().double()
                if accelerator.sync_gradients:
                    grad_norm = clip_grad_norm(accelerator, params, args.max_grad_norm)
        fault.maybe_fail(step)
        step_loss = accelerator.reduce(loss_sum / accum, reduction="mean").item()
        if not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
            if args.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"non-finite loss ({step_loss}) or gradient norm ({grad_norm}) at step {step}; "
                    f"no checkpoint was written for it. Lower --learning_rate, check the data, or "
                    f"pass --on_nonfinite skip to skip such steps"
                )
            optimizer.zero_grad(set_to_none=True)
            logger.warning(f"step {step}: non-finite loss or gradient norm, update skipped (--on_nonfinite skip)")
            lr_scheduler.step()
        else:
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        dt = timer.lap()
        row = {
            "step": step, "epoch": mb.epoch, "loss": step_loss, "lr": lr_scheduler.get_last_lr()[0],
            "grad_norm": grad_norm, "s_per_step": dt, "tokens_per_s": tokens / dt,
            "tokens_per_s_per_gpu": tokens / dt / layout.world, "peak_mem_gib": peak_memory_gib(device),
            "skipped": not math.isfinite(step_loss),
        }  # fmt: skip
        if peak:
            row["mfu"] = flops / dt / layout.world / peak
        metrics.write(row)
        if accelerator.log_with:
            accelerator.log({k: v for k, v in row.items() if k != "step"}, step=step)
        bar.update(1)
        bar.set_postfix(
            loss=f"{step_loss:.4f}",
            lr=f"{row['lr']:.2e}",
            s_step=f"{dt:.2f}",
            tok_s=f"{row['tokens_per_s']:.0f}",
            **({"mfu": f"{row['mfu']:.0%}"} if peak else {}),
        )
        if validation_embeds is not None and (
            step == max_steps or (args.validation_steps and step % args.validation_steps == 0)
        ):
            validate(step)
        if step % args.checkpointing_steps == 0 or step == max_steps:
            meta = {"run": run_identity, "layout": layout.describe(), "args": vars(args)}
            saved = checkpoint.save(
                args.output_dir,
                step,
                model,
                optimizer,
                lr_scheduler,
                meta,
                layout.is_main,
                args.checkpoints_total_limit,
                fault,
            )
            logger.info(f"saved {saved}")
        if timer.elapsed_since_lap() > dt:  # validation or a checkpoint ran: keep it out of the next step's time
            timer.lap()
    bar.close()
    metrics.close()

    # --- outputs ---------------------------------------------------------------------------------------
    state = full_state_dict(model, trainable_only=not args.full_finetune)
    if layout.is_main:
        inner = accelerator.unwrap_model(model)
        if args.full_finetune:
            out = save_full(inner, state, args.output_dir, weight_dtype)
        else:
            out = save_lora(inner, state, args.output_dir)
        logger.info(f"wrote {out}")
        from flux_cp.metrics import plot_loss_curve

        plot_loss_curve(Path(args.output_dir) / "metrics.jsonl", Path(args.output_dir) / "loss_curve.png")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
