"""Model level: a transformer with the FLUX.1-dev config (random weights; speed does not depend on their
values), bf16, gradient checkpointing, one optimizer step per iteration, synthetic inputs.

    # ours, one configuration per launch (the launch's world = dp x cp)
    torchrun --nproc_per_node 2 benchmarks/bench_model.py --impl ours --cp 2 --train lora --res 1024 2048 --out X.json
    # diffusers 0.42's built-in CP (enable_parallelism), on the same GPUs
    torchrun --nproc_per_node 2 benchmarks/bench_model.py --impl diffusers --cp 2 --mode ulysses --out Y.json

Ours: cp.apply_context_parallel + FSDP2 (fully_shard per block, bf16 params, fp32 reduce) as
train_flux_cp.py does through accelerate's FSDP2 configs, or with --replicate (LoRA) DDP with the frozen weights
replicated and autocast, as it does through the DDP configs (accelerate_configs/ddp_*.yaml).
diffusers: full inputs on every rank, its hooks shard and gather, weights replicated, LoRA gradients all-reduced.
Reports s/step (median, slowest rank), tokens/s per GPU,
MFU against the bf16 matmul peak measured in the same process, and peak memory per GPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cp  # noqa: E402
from benchmarks.common import environment, init, median, write_json  # noqa: E402
from flux_cp.flow import image_ids, pack_latents, text_ids  # noqa: E402
from flux_cp.metrics import flux_flops_per_step, measure_matmul_peak  # noqa: E402
from flux_cp.tiny import FLUX1_DEV_TRANSFORMER  # noqa: E402

LORA_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
TEXT_TOKENS = 512


def build(args, device, dtype):
    from diffusers import FluxTransformer2DModel

    config = dict(FLUX1_DEV_TRANSFORMER)
    if args.layers:
        config["num_layers"], config["num_single_layers"] = args.layers
    if args.heads:
        config["num_attention_heads"], config["attention_head_dim"] = args.heads
        config["axes_dims_rope"] = tuple(args.rope)
    with torch.device(device):
        torch.manual_seed(0)
        model = FluxTransformer2DModel.from_config(config).to(dtype)
    if args.train == "lora":
        from peft import LoraConfig

        model.requires_grad_(False)
        torch.manual_seed(0)
        model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=LORA_ATTENTION))
    else:
        model.requires_grad_(True)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 master weights, as train_flux_cp.py keeps them
    return model, config


def make_inputs(res: int, config: dict, device, batch: int = 1) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(res)
    lat = res // 8
    latents = pack_latents(torch.randn(batch, config["in_channels"] // 4, lat, lat, generator=g))
    inputs = dict(
        hidden_states=latents.to(device),
        encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, config["joint_attention_dim"], generator=g).to(device),
        pooled_projections=torch.randn(batch, config["pooled_projection_dim"], generator=g).to(device),
        timestep=torch.full((batch,), 0.5, device=device),
        guidance=torch.full((batch,), 3.5, device=device),
        img_ids=image_ids(lat, lat, device=device),
        txt_ids=text_ids(TEXT_TOKENS, device=device),
    )
    return inputs, torch.randn(latents.shape, generator=g).to(device)


def prepare_ours(model, args, world, device):
    group = dist.group.WORLD if args.cp > 1 else None
    cp.apply_context_parallel(model, None)  # our kernels at cp=1 too (cuDNN), as train_flux_cp.py does
    if args.cp > 1:
        if args.cp != world:
            group = dist.new_group(list(range(args.cp)))  # benchmark: one CP group (dp only via --dp)
        mode, u = args.mode, args.ulysses_size
        if mode == "auto":
            from flux_cp.parallel import auto_mode

            mode, u = auto_mode(model.config.num_attention_heads, args.cp)
        cp.apply_context_parallel(model, group, mode=mode, ulysses_size=u)
        args.resolved_mode = mode + (f"(u={u})" if u else "")
    model.enable_gradient_checkpointing()
    if args.compile:
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.compile(dynamic=False)  # one static graph per resolution: no dynamic-shape kernels
    if world > 1 and args.replicate:
        # accelerate's MULTI_GPU path: DDP averages the (LoRA) gradients over all dp x cp ranks, bucketed and
        # overlapped with the backward; the frozen bf16 weights stay whole on every GPU.
        return group, torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Blocks do not cast their inputs (FSDP would cast the fp32 RoPE tables in the forward but not in the
        # recomputation of gradient checkpointing); the root casts the model inputs, as the training script's
        # batch builder does.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16)
        blocks_mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16,
            cast_forward_inputs=False,
        )  # fmt: skip
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            fully_shard(block, mp_policy=blocks_mp, reshard_after_forward=args.reshard_after_forward)
        fully_shard(model, mp_policy=mp)
    return group, model


def prepare_diffusers(model, args, world):
    from diffusers import ContextParallelConfig

    if not torch.cuda.is_available():  # CPU smoke runs: diffusers picks the device by accelerator count
        torch.accelerator.device_count = lambda: 1

    model.set_attention_backend(args.backend)
    cfg = (
        ContextParallelConfig(ulysses_degree=args.cp)
        if args.mode == "ulysses"
        else ContextParallelConfig(ring_degree=args.cp)
    )
    model.enable_parallelism(config=cfg)
    if args.mode == "ring":
        # diffusers' ring only trains with reentrant checkpointing (DESIGN.md)
        model.enable_gradient_checkpointing(functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True))
    else:
        model.enable_gradient_checkpointing()
    args.resolved_mode = f"{args.mode}[{args.backend}]"


def train_step(model, inputs, target, opt, params, autocast, average_grads: bool):
    with autocast:
        out = model(**inputs, return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(out.float(), target.float())
    loss.backward()
    if average_grads:  # replicated weights (diffusers' CP): average the LoRA gradients over the group
        for q in params:
            dist.all_reduce(q.grad)
            q.grad /= dist.get_world_size()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=("ours", "diffusers"), default="ours")
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1, help="ours only: data-parallel ranks (each its own sample)")
    p.add_argument("--mode", default="auto")
    p.add_argument("--ulysses_size", type=int, default=None)
    p.add_argument("--backend", default="_native_cudnn", help="diffusers attention backend")
    p.add_argument("--train", choices=("lora", "full"), default="lora")
    p.add_argument("--res", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--no_reshard", dest="reshard_after_forward", action="store_false")
    p.add_argument("--replicate", action="store_true", help="ours, LoRA: DDP with replicated weights, not FSDP2")
    p.add_argument("--layers", type=int, nargs=2, default=None, help="smoke runs: double, single blocks")
    p.add_argument("--heads", type=int, nargs=2, default=None, help="smoke runs: heads, head_dim")
    p.add_argument("--rope", type=int, nargs=3, default=(16, 56, 56))
    p.add_argument("--tag", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, world, device = init()
    if world != args.cp * args.dp:
        raise SystemExit(f"launch {args.cp * args.dp} processes for --cp {args.cp} x --dp {args.dp}, not {world}")
    dtype = torch.bfloat16
    peak = measure_matmul_peak(device)
    t0 = time.perf_counter()
    model, config = build(args, device, dtype)
    args.resolved_mode = "none"
    group, runner = None, model
    if args.impl == "ours":
        group, runner = prepare_ours(model, args, world, device)
    else:
        prepare_diffusers(model, args, world)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)
    build_s = time.perf_counter() - t0
    rows = []
    for res in args.res:
        inputs, target = make_inputs(res, config, device)
        if args.impl == "ours":
            for key, dim in (("hidden_states", 1), ("encoder_hidden_states", 1), ("img_ids", 0), ("txt_ids", 0)):
                inputs[key] = cp.shard(inputs[key], dim, group)
            target = cp.shard(target, 1, group)
            if args.dp > 1:  # each data-parallel rank: its own sample
                inputs["hidden_states"] = inputs["hidden_states"] + 0.01 * rank
        elif args.mode == "ring":
            inputs["hidden_states"].requires_grad_(True)

        # FSDP2's policy casts to bf16; without FSDP (one GPU, diffusers' CP) autocast does, as accelerate's does.
        fsdp = args.impl == "ours" and world > 1 and not args.replicate
        autocast = torch.autocast(device.type, dtype=dtype, enabled=not fsdp)
        step = functools.partial(
            train_step, runner, inputs, target, opt, params, autocast, args.impl == "diffusers" and world > 1
        )
        error = None
        times = []
        try:
            for i in range(args.warmup + args.steps):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    if i == args.warmup:
                        torch.cuda.reset_peak_memory_stats(device)
                if world > 1:
                    dist.barrier()
                t = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t)
        except torch.OutOfMemoryError as e:
            error = f"out of memory: {str(e).splitlines()[0]}"
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        t_step = median(times) if times else float("nan")
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        stats = torch.tensor([t_step, mem], device=device, dtype=torch.float64)
        if world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        t_step, mem = stats.tolist()
        img_tokens = (res // 16) ** 2
        flops = flux_flops_per_step(config, img_tokens, TEXT_TOKENS, args.dp, args.train == "lora", True)
        row = {"impl": args.impl, "mode": args.resolved_mode, "train": args.train, "res": res, "cp": args.cp,
               "dp": args.dp, "gpus": world, "compile": args.compile,
               "weights": "fsdp2" if fsdp else "replicated", "tag": args.tag, "s_per_step": t_step,
               "samples_per_step": args.dp,
               "tokens_per_s_per_gpu": args.dp * (img_tokens + TEXT_TOKENS) / t_step / world,
               "mfu": flops / t_step / world / peak if peak else None, "peak_mem_gib": mem, "error": error,
               "steps_timed": len(times)}  # fmt: skip
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
        del inputs, target, step
    if rank == 0:
        write_json(
            args.out,
            {
                "benchmark": "model",
                "env": environment(),
                "matmul_peak_tflops": (peak or 0) / 1e12,
                "build_s": build_s,
                "config": config,
                "argv": sys.argv,
                "rows": rows,
            },
        )
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
