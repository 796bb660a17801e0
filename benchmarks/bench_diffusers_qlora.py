"""diffusers' QLoRA recipe for FLUX.1-dev (examples/research_projects/flux_lora_quantization,
train_dreambooth_lora_flux_miniature.py) on the step the trainer's small-GPU rows time, on one GPU capped to the
memory of a smaller one: the comparison of README's "Small GPUs" table.

    python -m benchmarks.bench_diffusers_qlora --out RESULTS/diffusers_qlora.json --gpu_memory_gib 24 16 12

What the recipe does, as it does it: the transformer loaded with `BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=...)` through `from_pretrained`, `prepare_model_for_kbit_training(
use_gradient_checkpointing=False)`, LoRA through `add_adapter` with the trainable weights in fp32, diffusers'
`enable_gradient_checkpointing`, bitsandbytes' 8-bit AdamW, latents and text embeddings computed beforehand (here:
random tensors of their shapes; the recipe computes them in a separate process, so the encoders are not in its
training peak). Deviations, each to match the trainer's rows: bf16 autocast instead of the recipe's fp16 (the README
of the recipe suggests it), LoRA r16 on --lora_layers (default: the trainer's FLUX.1 default layers) instead of its r4
on the attention, one sample of --resolution's tokens and 512 text tokens.

A FLUX.1-dev-shaped transformer with seeded random weights is written once to --model_dir (bf16 safetensors, ~22
GiB) so that the recipe's own loading path (quantization during `from_pretrained`) runs; each cap then runs in a
process of its own, capped with `torch.cuda.set_per_process_memory_fraction` before anything is allocated (as
benchmarks/capped.py caps the trainer). Per row: the peak while loading, the peak over the timed steps, the median
step time. `--smoke`: a tiny model on the CPU (no bitsandbytes quantization: the CPU path of the script only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks import schema
from benchmarks.steps import timed

GIB = 2**30
COLUMNS = {
    "name": "run", "cap_gib": "cap GiB", "resolution": "px", "load_peak_gib": "load peak GiB",
    "step_peak_gib": "step peak GiB", "s_per_step": "s/step", "loss_step1": "loss at step 1", "error": "error",
}  # fmt: skip


def build_model_dir(model_dir: Path, smoke: bool) -> None:
    """The seeded random FLUX.1-dev-shaped transformer, saved as diffusers saves a transformer (bf16 safetensors)."""
    import torch
    from diffusers import FluxTransformer2DModel

    from benchmarks.bench_diffusers_cp import FULL_TRANSFORMER, SMOKE_TRANSFORMER

    if (model_dir / "config.json").is_file():
        return
    config = SMOKE_TRANSFORMER["flux1"] if smoke else FULL_TRANSFORMER["flux1"]
    device = torch.device("cpu" if smoke else "cuda")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = FluxTransformer2DModel(**config)
    torch.set_default_dtype(default)
    model.save_pretrained(model_dir)
    del model


def one(model_dir: str, cap: float | None, resolution: int, lora_layers: str, steps: int, warmup: int, cudnn: bool,
        smoke: bool) -> dict:  # fmt: skip
    import torch
    import torch.nn.functional as F
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from flux_cp.families.flux1.tokens import image_ids, pack_latents, text_ids

    gpu = not smoke
    row: dict = {"cap_gib": cap, "resolution": resolution}
    if gpu:
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        if cap:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        from diffusers import BitsAndBytesConfig
        from peft import prepare_model_for_kbit_training

        nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        model = FluxTransformer2DModel.from_pretrained(model_dir, quantization_config=nf4, torch_dtype=torch.bfloat16)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model = FluxTransformer2DModel.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
        model.requires_grad_(False)
    device = torch.device("cuda" if gpu else "cpu")
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian",
                                 target_modules=lora_layers.split(",")))  # fmt: skip
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    model.enable_gradient_checkpointing()
    params = [p for p in model.parameters() if p.requires_grad]
    if gpu:
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(params, lr=1e-4)
        row["load_peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-4)
    config = model.config
    g = torch.Generator().manual_seed(resolution)
    side = resolution // 8  # the VAE's latent grid
    latents = torch.randn(1, config.in_channels // 4, side, side, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    text = 32 if smoke else 512
    bf16 = dict(device=device, dtype=torch.bfloat16)
    prompt = torch.randn(1, text, config.joint_attention_dim, generator=g).to(**bf16)
    pooled = torch.randn(1, config.pooled_projection_dim, generator=g).to(**bf16)
    sigma = 0.5
    noisy = pack_latents((1 - sigma) * latents + sigma * noise).to(**bf16)
    target = pack_latents(noise - latents).to(device)
    inputs = dict(hidden_states=noisy, encoder_hidden_states=prompt, pooled_projections=pooled,
                  timestep=torch.full((1,), sigma, device=device), guidance=torch.full((1,), 1.0, device=device),
                  img_ids=image_ids(side, side, device=device), txt_ids=text_ids(text, device=device),
                  return_dict=False)  # fmt: skip
    losses = []

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = model(**inputs)[0]
        loss = F.mse_loss(pred.float(), target.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    row |= timed(step, warmup, steps, gpu)
    row["loss_step1"] = round(losses[0], 6)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="result file (JSON, benchmarks/schema.py)")
    p.add_argument("--gpu_memory_gib", type=float, nargs="+", default=[24.0, 16.0, 12.0])
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--lora_layers", help="comma-separated LoRA targets (default: the trainer's FLUX.1 default)")
    p.add_argument("--model_dir", default="/tmp/flux1-dev-shapes-random", help="where the random transformer goes")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--cudnn", action="store_true", help="let SDPA pick cuDNN (default off: benchmarks/repro_cudnn_sdpa)"
    )
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script only")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a row's arguments as JSON, run in this process
    args = p.parse_args()
    if args.one:
        print("ROW " + json.dumps(one(**json.loads(args.one))), flush=True)
        return
    from flux_cp.families.flux1 import DEFAULT_TARGETS

    layers = args.lora_layers or ",".join(DEFAULT_TARGETS)
    if args.smoke:
        args.gpu_memory_gib, args.resolution, args.steps, args.warmup = [0.0], 64, 2, 1
    model_dir = Path(args.model_dir)
    build_model_dir(model_dir, args.smoke)
    rows = []
    for cap in args.gpu_memory_gib:
        spec = dict(model_dir=str(model_dir), cap=cap or None, resolution=args.resolution, lora_layers=layers,
                    steps=args.steps, warmup=args.warmup, cudnn=args.cudnn, smoke=args.smoke)  # fmt: skip
        r = subprocess.run([sys.executable, "-m", "benchmarks.bench_diffusers_qlora", "--out", args.out,
                            "--one", json.dumps(spec)], capture_output=True, text=True)  # fmt: skip
        found = [ln[4:] for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
        row = json.loads(found[-1]) if found else {"cap_gib": cap, "resolution": args.resolution}
        if not found:
            last = [ln for ln in r.stderr.splitlines() if ln.strip()]
            row["error"] = (last[-1] if last else f"exit {r.returncode}")[:300]
        row["name"] = f"diffusers_qlora_nf4_{args.resolution}_{cap:g}gib"
        print(row, flush=True)
        rows.append(row)
    settings = {
        "recipe": "diffusers examples/research_projects/flux_lora_quantization (nf4 base, 8-bit AdamW, checkpointing)",
        "model": "FLUX.1-dev-shaped FluxTransformer2DModel, seeded random weights" if not args.smoke else "tiny",
        "lora": f"r16 on {layers}",
        "autocast": "bf16",
        "cudnn_sdpa": args.cudnn,
        "timed": f"median of {args.steps} steps after {args.warmup}",
    }
    command = schema.command_line(module="benchmarks.bench_diffusers_qlora")
    schema.write(args.out, schema.result("diffusers_qlora", rows, command=command, settings=settings, columns=COLUMNS))


if __name__ == "__main__":
    main()
