"""diffusers' built-in context parallelism on the step the trainer's benchmark times, blocks compiled: the
comparison of docs/benchmarks.md.

    torchrun --nproc_per_node 2 -m benchmarks.bench_diffusers_cp --out diffusers_cp.json --resolution 1024 2048

A FLUX.1-dev-shaped FluxTransformer2DModel (--family flux1) or a FLUX.2 [dev]-shaped Flux2Transformer2DModel
(--family flux2), seeded random weights, bf16, LoRA r16 on --lora_layers (default for FLUX.1: the attention
projections of both streams, the trainer's attention-only `--lora_layers`; for FLUX.2: the trainer's default FLUX.2
targets, those of diffusers' FLUX.2 LoRA example; trainable weights in fp32),
gradient checkpointing (unless --no_checkpointing), each transformer block compiled (`block.compile()`, the
regional compilation diffusers documents), diffusers' attention backend --backend. One sample of the resolution's
image tokens and 512 text tokens;
a step is the forward, an MSE loss, the backward and an AdamW step; the median of --steps timed steps after
--warmup. On N launched processes `enable_parallelism(ContextParallelConfig(ulysses_degree=N))` (--mode ulysses) or
`ring_degree=N` (--mode ring) splits the sequence; on one process there is no CP. The LoRA's gradients are not
all-reduced across the ranks (a data-parallel wrapper would add one small all-reduce). It times the transformer's step
only: no data loading, encoders or noise sampling, which the trainer's step includes. The results go to --out in
the suite's schema (benchmarks/schema.py). --smoke: a tiny model on the CPU in one process (diffusers' CP itself
needs GPUs), to check the script.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks import schema
from benchmarks.common import init, max_over_ranks
from flux_cp.families.flux1 import ATTENTION_TARGETS
from flux_cp.families.flux1 import tokens as flux1_tokens
from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER
from flux_cp.families.flux2 import FLUX2
from flux_cp.families.flux2 import recipe as flux2_recipe
from flux_cp.families.flux2.tiny import FLUX2_DEV_TRANSFORMER

SMOKE_TRANSFORMER = {
    "flux1": dict(FLUX1_DEV_TRANSFORMER, num_layers=1, num_single_layers=1, attention_head_dim=16,
                  num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6)),
    "flux2": dict(FLUX2_DEV_TRANSFORMER, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                  num_attention_heads=4, joint_attention_dim=48, timestep_guidance_channels=32,
                  axes_dims_rope=(4, 4, 4, 4)),
}  # fmt: skip
FULL_TRANSFORMER = {"flux1": FLUX1_DEV_TRANSFORMER, "flux2": FLUX2_DEV_TRANSFORMER}
MODEL_NAME = {
    "flux1": "FLUX.1-dev-shaped FluxTransformer2DModel",
    "flux2": "FLUX.2 [dev]-shaped Flux2Transformer2DModel",
}
COLUMNS = {
    "name": "run",
    "mode": "CP",
    "gpus": "GPUs",
    "resolution": "px",
    "tokens": "tokens",
    "s_per_step": "s/step",
    "peak_gib": "peak GiB/GPU",
    "error": "error",
}


def default_lora_layers(family: str, config: dict) -> str:
    """The adapters ours are compared with: FLUX.1's attention projections of both streams (the `diffusers` set of
    run.sh passes the trainer the same), FLUX.2's default targets (the trainer's default too)."""
    targets = ATTENTION_TARGETS if family == "flux1" else FLUX2.lora_targets(pairs=False, config=config)
    return ",".join(targets)


def build(config: dict, args: argparse.Namespace, world: int, device: torch.device) -> torch.nn.Module:
    from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel
    from peft import LoraConfig

    cls = FluxTransformer2DModel if args.family == "flux1" else Flux2Transformer2DModel
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(**config).to(torch.bfloat16)
    model.requires_grad_(False)
    targets = args.lora_layers.split(",")
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=targets))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    if args.backend:
        model.set_attention_backend(args.backend)
    if world > 1:
        from diffusers import ContextParallelConfig

        degree = {"ulysses_degree": world} if args.mode == "ulysses" else {"ring_degree": world}
        model.enable_parallelism(config=ContextParallelConfig(**degree))
    if args.compile:
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.compile()
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model, config: dict, resolution: int, args, device: torch.device) -> tuple[float, float | None]:
    """(median seconds per step, peak GiB) at one resolution; every rank passes the whole sample (diffusers'
    hooks split it)."""
    side = resolution // 16  # latent / 2: the packed token grid
    n = side * side
    g = torch.Generator().manual_seed(resolution)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    hidden = torch.randn(1, n, config["in_channels"], generator=g).to(**bf16)
    text = torch.randn(1, args.text_tokens, config["joint_attention_dim"], generator=g).to(**bf16)
    pooled = torch.randn(1, config.get("pooled_projection_dim", 1), generator=g).to(**bf16)
    target = torch.randn(1, n, config["in_channels"], generator=g).to(**bf16)
    inputs = dict(
        hidden_states=hidden,
        encoder_hidden_states=text,
        timestep=torch.full((1,), 0.5, device=device),
        guidance=torch.full((1,), 3.5, device=device),
        return_dict=False,
    )
    if args.family == "flux1":  # [S, 3] ids and a pooled CLIP embedding
        inputs.update(
            pooled_projections=pooled,
            img_ids=flux1_tokens.image_ids(2 * side, 2 * side, device=device),
            txt_ids=flux1_tokens.text_ids(args.text_tokens, device=device),
        )
    else:  # [B, S, 4] ids as Flux2Pipeline passes them (its CP plan splits them on dim 1)
        inputs.update(
            img_ids=flux2_recipe.image_ids(side, side, device=device)[None],
            txt_ids=flux2_recipe.text_ids(args.text_tokens, device=device)[None],
        )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step() -> None:
        out = model(**inputs)[0]
        F.mse_loss(out.float(), target.float()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="result file (JSON, benchmarks/schema.py)")
    p.add_argument("--resolution", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--family", choices=["flux1", "flux2"], default="flux1", help="the transformer's shapes")
    p.add_argument("--mode", choices=["ulysses", "ring"], default="ulysses")
    p.add_argument("--backend", default="_native_cudnn", help="diffusers' attention backend ('' for its default)")
    p.add_argument("--lora_layers", help="comma-separated LoRA target modules (default: see above)")
    p.add_argument("--no_compile", dest="compile", action="store_false", help="leave the blocks eager")
    p.add_argument(
        "--no_checkpointing",
        dest="checkpointing",
        action="store_false",
        help="no gradient checkpointing (its fastest setting where the activations fit)",
    )
    p.add_argument("--text_tokens", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script only")
    args = p.parse_args()
    config = dict(FULL_TRANSFORMER[args.family])
    if args.smoke:
        config = SMOKE_TRANSFORMER[args.family]
        args.resolution, args.text_tokens, args.warmup, args.steps = [64], 16, 1, 2
        args.backend = args.backend if args.backend != "_native_cudnn" else ""
    args.lora_layers = args.lora_layers or default_lora_layers(args.family, config)
    rank, world, device = init()
    if world > 1 and device.type != "cuda":  # diffusers 0.42 picks each rank's device from torch.accelerator
        raise SystemExit("error: diffusers' built-in CP needs GPUs; on the CPU run --smoke as one process")
    model = build(config, args, world, device)
    group = torch.distributed.group.WORLD if world > 1 else None
    rows = []
    for res in args.resolution:
        mode = args.mode if world > 1 else None
        prefix = "diffusers" if args.family == "flux1" else "diffusers_flux2"
        name = f"{prefix}_{mode or 'one_gpu'}_{res}" + ("" if args.checkpointing else "_no_ckpt")
        row = {"name": name, "mode": mode, "gpus": world, "resolution": res, "backend": args.backend or "default"}
        row["tokens"] = (res // 16) ** 2 + args.text_tokens
        seconds, peak = float("inf"), None
        try:
            seconds, peak = measure(model, config, res, args, device)
        except Exception as e:  # noqa: BLE001 - recorded, and the next resolution still runs
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" if str(e) else type(e).__name__
        seconds = max_over_ranks(seconds, group, device)  # every rank takes part, also after an error
        if seconds != float("inf"):
            row["s_per_step"] = round(seconds, 4)
            row["peak_gib"] = round(peak, 2) if peak is not None else None
        if rank == 0:
            print(row, flush=True)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        settings = {
            "model": f"{MODEL_NAME[args.family]}, seeded random weights, bf16" if not args.smoke else "tiny",
            "lora": f"r16 on {args.lora_layers}",
            "attention_backend": args.backend or "diffusers' default",
            "compiled": "each transformer block (block.compile())" if args.compile else "no",
            "gradient_checkpointing": args.checkpointing,
            "timed": f"median of {args.steps} steps after {args.warmup}; a CP step is its slowest rank's",
        }
        command = schema.command_line(module="benchmarks.bench_diffusers_cp")
        data = schema.result("diffusers_cp", rows, command=command, settings=settings, columns=COLUMNS)
        schema.write(args.out, data)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
