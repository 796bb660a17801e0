"""Block offload (`--offload_blocks`, flux_cp/model/offload.py) on one GPU: step time and peak memory for several counts
of offloaded blocks, and the host-to-GPU copy rate of one block from its page-locked home. FLUX.1-dev's shapes, random
weights, LoRA r16 on the default layers, bf16, every block checkpointed (eager), batch 1, one JSON line per count.

    python -m benchmarks.bench_offload [--blocks 0,19,38,57] [--resolution 1024] [--steps 5] [--compile]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import cp
from flux_cp.config.training import LoraConfig
from flux_cp.families.flux1 import DEFAULT_TARGETS
from flux_cp.families.flux1.tokens import image_ids, pack_latents, text_ids
from flux_cp.model.blocks import prepare_blocks
from flux_cp.model.loading import prepare_trainable
from flux_cp.model.offload import offload_blocks

GIB = 2**30


def _model(device: torch.device):
    from diffusers import FluxTransformer2DModel

    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER

    with torch.device(device):
        torch.manual_seed(0)
        model = FluxTransformer2DModel(**FLUX1_DEV_TRANSFORMER).to(torch.bfloat16)
    prepare_trainable(model, LoraConfig(rank=16, lora_alpha=16, lora_layers=DEFAULT_TARGETS), seed=0)
    cp.apply_context_parallel(model, None)
    return model


def _batch(resolution: int, device: torch.device) -> dict:
    lat = resolution // 8
    return dict(
        hidden_states=pack_latents(torch.randn(1, 16, lat, lat, device=device)).bfloat16(),
        encoder_hidden_states=torch.randn(1, 512, 4096, device=device).bfloat16(),
        pooled_projections=torch.randn(1, 768, device=device).bfloat16(),
        timestep=torch.rand(1, device=device),
        guidance=torch.full((1,), 3.5, device=device),
        img_ids=image_ids(lat, lat, device=device),
        txt_ids=text_ids(512, device=device),
    )


def run(n: int, resolution: int, steps: int, compile: bool, device: torch.device) -> dict:
    model = _model(device)
    prepare_blocks(model, checkpointed=range(57), recompute_attention=False, compile=compile, compile_mode=None, cp=1)
    off = None
    setup = 0.0
    if n:
        model.cpu()
        gc.collect()
        torch.cuda.empty_cache()
        start = time.perf_counter()
        off = offload_blocks(model, n, device)
        setup = time.perf_counter() - start
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    batch = _batch(resolution, device)
    times = []
    for step in range(steps):
        if step == 1:
            torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).sample.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    plan = off.plan if off else None
    row = {
        "offloaded": n, "resolution": resolution, "compiled": compile, "s_per_step": statistics.median(times[1:]),
        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB, "setup_s": setup,
        **{k: getattr(plan, f"{k}_bytes") / GIB if plan else 0.0 for k in ("saved", "moved", "host")},
    }  # fmt: skip
    if off:
        row["copy_gb_per_s"] = _copy_rate(off, device)
    del model, off, opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return row


def _copy_rate(off, device: torch.device) -> float:
    """GB/s of copying one block's home into its slot on the copy stream, alone (median of 5)."""
    blk = off.offloaded[-1]
    rates = []
    for _ in range(5):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        off._issue(blk)
        torch.cuda.synchronize(device)
        rates.append(blk.nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="0,19,38,57")
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    for n in (int(b) for b in args.blocks.split(",")):
        print(json.dumps(run(n, args.resolution, args.steps, args.compile, device)), flush=True)


if __name__ == "__main__":
    main()
