"""`--base_precision` on one GPU: the frozen transformer's memory, the peak and the time of a LoRA step, at each
precision. FLUX.1-dev shapes with random weights (seeded), bf16, LoRA r16 on FLUX.1's default layers, 1024 px (4096
image + 512 text tokens, one sample), every block checkpointed (what a 24 GB card needs), the trainer's pieces at
cp=1 (its attention processors, `prepare_blocks`, fused AdamW). Each row runs in its own process.

    python -m benchmarks.bench_base_precision --out RESULTS/base_precision.json [--compile] [--from_cpu nf4,int8]

`--smoke`: the tiny FLUX.1 on the CPU at 64 px, to check the script runs (its figures mean nothing).

Per row: the transformer's bytes once quantized (`weights_gib`, torch's allocated memory; `planned_gib`:
`flux_cp.model.precision.base_bytes`, the planner's count), the peak while loading and quantizing (`load_peak_gib`), the
peak and mean time of the timed steps. `--from_cpu P,...`: those precisions also from a model built on the CPU and
quantized layer by layer onto the GPU (`quantize_base(..., device=...)`), the way a card smaller than the bf16 model
loads it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

GIB = 2**30
COLUMNS = {
    "precision": "base", "from_cpu": "built on CPU", "compile": "compiled", "weights_gib": "weights GiB",
    "planned_gib": "planned GiB", "load_peak_gib": "load peak GiB", "step_peak_gib": "step peak GiB",
    "s_per_step": "s/step", "quantize_s": "quantize s",
}  # fmt: skip


def one(precision: str, from_cpu: bool, compile: bool, steps: int, warmup: int, smoke: bool = False) -> dict:
    import torch
    from diffusers import FluxTransformer2DModel

    import cp
    from flux_cp import quiet
    from flux_cp.config.parser import parse_config
    from flux_cp.families import FLUX1
    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER, TRANSFORMER_CONFIG
    from flux_cp.families.flux1.tokens import image_ids, text_ids
    from flux_cp.model.blocks import prepare_blocks, transformer_blocks
    from flux_cp.model.loading import prepare_trainable
    from flux_cp.model.precision import base_bytes, quantize_base
    from flux_cp.shape.build import resolved

    quiet.install()
    config, resolution, text = (TRANSFORMER_CONFIG, 64, 32) if smoke else (FLUX1_DEV_TRANSFORMER, 1024, 512)
    device = torch.device("cpu" if smoke else "cuda")
    gpu = device.type == "cuda"
    torch.manual_seed(0)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cpu" if from_cpu else device):
        model = FluxTransformer2DModel.from_config(config)
    torch.set_default_dtype(default)
    built = time.perf_counter()
    with torch.device("meta"):
        planned = base_bytes(FluxTransformer2DModel.from_config(config), precision)
    report = quantize_base(model, precision, device=device)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    row = {"precision": precision, "from_cpu": from_cpu, "compile": compile,
           "quantize_s": time.perf_counter() - built, "planned_gib": planned / GIB,
           "stored_gib": report.bytes_after / GIB, "weights_gib": torch.cuda.memory_allocated() / GIB if gpu else None,
           "load_peak_gib": torch.cuda.max_memory_allocated() / GIB if gpu else None}  # fmt: skip
    cfg = resolved(parse_config(["--rank", "16", "--resolution", str(resolution)]), FLUX1, False, dict(model.config))
    prepare_trainable(model, cfg.lora, seed=0)
    cp.apply_context_parallel(model, cp.CPContext(None))
    n = len(transformer_blocks(model))
    prepare_blocks(model, checkpointed=range(n), recompute_attention=False, compile=compile, compile_mode=None, cp=1)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    g = torch.Generator(device).manual_seed(0)
    h = w = resolution // 16
    channels, bf16 = config["in_channels"], dict(device=device, dtype=torch.bfloat16)
    inputs = dict(
        hidden_states=torch.randn(1, h * w, channels, generator=g, **bf16),
        encoder_hidden_states=torch.randn(1, text, config["joint_attention_dim"], generator=g, **bf16),
        pooled_projections=torch.randn(1, config["pooled_projection_dim"], generator=g, **bf16),
        timestep=torch.rand(1, generator=g, **bf16), guidance=torch.full((1,), 3.5, **bf16),
        img_ids=image_ids(2 * h, 2 * w).to(device), txt_ids=text_ids(text).to(device),
    )  # fmt: skip
    target = torch.randn(1, h * w, channels, generator=g, **bf16)
    times, losses = [], []
    for step in range(steps):
        if step == warmup:
            sync()
            if gpu:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16):
            out = model(**inputs).sample
        loss = torch.nn.functional.mse_loss(out.float(), target.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    timed = times[warmup:]
    row.update(step_peak_gib=torch.cuda.max_memory_allocated() / GIB if gpu else None,
               s_per_step=sum(timed) / len(timed), first_step_s=times[0], losses=losses,
               lora_parameters=sum(p.numel() for p in params), quantized_linears=report.linears)  # fmt: skip
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--precisions", default="bf16,fp8,int8,nf4")
    p.add_argument("--from_cpu", default="", help="precisions also built on the CPU and quantized onto the GPU")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (as --compile)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="the tiny FLUX.1 on the CPU (checks that the script runs)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a row, in this process: precision,from_cpu
    args = p.parse_args(argv)
    if args.one:
        precision, from_cpu = args.one.split(",")
        row = one(precision, from_cpu == "1", args.compile, args.steps, args.warmup, args.smoke)
        print("ROW " + json.dumps(row), flush=True)
        return
    from benchmarks import schema
    from flux_cp import quiet

    quiet.install()  # the versions it records import diffusers, and with it torchao
    runs = [(pr, False) for pr in args.precisions.split(",")] + [(pr, True) for pr in args.from_cpu.split(",") if pr]
    rows = []
    for precision, from_cpu in runs:
        cmd = [sys.executable, "-m", "benchmarks.bench_base_precision", "--out", args.out, "--one",
               f"{precision},{int(from_cpu)}", "--steps", str(args.steps), "--warmup", str(args.warmup),
               *(["--compile"] if args.compile else []), *(["--smoke"] if args.smoke else [])]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        row = json.loads(found[0]) if found else {"precision": precision, "from_cpu": from_cpu,
                                                  "error": (done.stderr or done.stdout)[-2000:]}  # fmt: skip
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
        rows.append(row)
    settings = {"model": "the tiny FLUX.1 on the CPU (smoke)" if args.smoke else "FLUX.1-dev shapes, random weights",
                "resolution": 64 if args.smoke else 1024, "lora_rank": 16, "checkpointed": "every block",
                "steps": args.steps, "warmup": args.warmup}  # fmt: skip
    schema.write(args.out, schema.result("base_precision", rows, command=schema.command_line(
        argv, "benchmarks.bench_base_precision"), settings=settings, columns=COLUMNS))  # fmt: skip


if __name__ == "__main__":
    main()
