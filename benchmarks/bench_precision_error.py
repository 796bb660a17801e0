"""How far each `--base_precision` moves FLUX.1-dev's transformer from its bf16 self, block by block: every block of
the quantized model is given the input the bf16 block got in the same forward pass, and its output compared with
the bf16 block's (relative error of the block's update, `|out_q - out| / |out - in|`, per stream); then the whole
model's output (`|y_q - y| / |y|`). FLUX.1-dev shapes, weights drawn from N(0, 1/fan_in) (as trained linears are
distributed; uniform weights would not fit NF4's normal quantiles), 1024 px (4096 image + 512 text tokens), random
latents and text embeddings. Random weights, not FLUX.1-dev's: how quantization moves the pretrained model is not
measured by this.

    python -m benchmarks.bench_precision_error --out RESULTS/precision_error.json [--precisions fp8,int8,nf4]

`--smoke`: the tiny FLUX.1 on the CPU at 64 px (checks the script; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

GIB = 2**30
COLUMNS = {"precision": "base", "block_median": "block update error (median)", "block_max": "(max)",
           "model": "model output error", "quantize_s": "quantize s"}  # fmt: skip


def normal_linears_(model: torch.nn.Module, seed: int) -> None:
    """Every linear weight of `model` redrawn from N(0, 1/in_features), in place (a seeded generator on its device)."""
    g = None
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                if g is None:
                    g = torch.Generator(m.weight.device).manual_seed(seed)
                w = torch.randn(m.weight.shape, generator=g, device=m.weight.device, dtype=torch.float32)
                m.weight.copy_(w * m.in_features**-0.5)


def record_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module], inputs: dict) -> tuple[list, torch.Tensor]:
    """One forward of `model` on `inputs`: each block's (index, args, kwargs, output), and the model's output."""
    calls = []

    def hook(m, args, kwargs, out):
        calls.append((blocks.index(m), args, kwargs, out))

    handles = [b.register_forward_hook(hook, with_kwargs=True) for b in blocks]
    try:
        with torch.no_grad():
            out = model(**inputs).sample
    finally:
        for h in handles:
            h.remove()
    return calls, out


def block_errors(calls: list, blocks: list[torch.nn.Module]) -> list[float]:
    """The relative error of each recorded block call's update when `blocks[index]` computes it instead (one value
    per output stream: FLUX.1's double blocks update text and image tokens)."""
    errors = []
    for index, args, kwargs, want_all in calls:
        with torch.no_grad():
            have_all = blocks[index](*args, **kwargs)
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        want_all, have_all = (t if isinstance(t, tuple) else (t,) for t in (want_all, have_all))
        for want, have in zip(want_all, have_all, strict=True):
            x = next(t for t in inputs if t.shape == want.shape)  # the stream this output updates
            errors.append(((have.float() - want.float()).norm() / (want.float() - x.float()).norm()).item())
    return errors


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--precisions", default="fp8,int8,nf4")
    p.add_argument("--smoke", action="store_true", help="the tiny FLUX.1 on the CPU (checks that the script runs)")
    args = p.parse_args(argv)

    import time

    from diffusers import FluxTransformer2DModel

    from benchmarks import schema
    from flux_cp import quiet
    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER, TRANSFORMER_CONFIG
    from flux_cp.families.flux1.tokens import image_ids, text_ids
    from flux_cp.model.blocks import transformer_blocks
    from flux_cp.model.precision import quantize_base
    from flux_cp.random_weights import build_random

    quiet.install()
    config, resolution, text = (TRANSFORMER_CONFIG, 64, 32) if args.smoke else (FLUX1_DEV_TRANSFORMER, 1024, 512)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16  # bitsandbytes' CPU path and torchao's take either
    ref = build_random(FluxTransformer2DModel, dict(config), dtype, device, seed=0)
    normal_linears_(ref, seed=1)
    g = torch.Generator(device).manual_seed(0)
    h = w = resolution // 16
    t = dict(device=device, dtype=dtype)
    inputs = dict(
        hidden_states=torch.randn(1, h * w, config["in_channels"], generator=g, **t),
        encoder_hidden_states=torch.randn(1, text, config["joint_attention_dim"], generator=g, **t),
        pooled_projections=torch.randn(1, config["pooled_projection_dim"], generator=g, **t),
        timestep=torch.rand(1, generator=g, **t), guidance=torch.full((1,), 3.5, **t),
        img_ids=image_ids(2 * h, 2 * w).to(device), txt_ids=text_ids(text).to(device),
    )  # fmt: skip
    calls, expected = record_blocks(ref, transformer_blocks(ref), inputs)
    rows = []
    for precision in args.precisions.split(","):
        model = copy.deepcopy(ref)
        t0 = time.perf_counter()
        quantize_base(model, precision, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        quantize_s = time.perf_counter() - t0
        errors = block_errors(calls, transformer_blocks(model))
        with torch.no_grad():
            got = model(**inputs).sample
        model_error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
        row = {"precision": precision, "block_median": statistics.median(errors), "block_min": min(errors),
               "block_max": max(errors), "model": model_error, "quantize_s": quantize_s,
               "block_errors": errors}  # fmt: skip
        print({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items() if k != "block_errors"})
        rows.append({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()})
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    settings = {"model": "the tiny FLUX.1 on the CPU (smoke)" if args.smoke else "FLUX.1-dev shapes, random weights",
                "weights": "linears N(0, 1/fan_in), seeded", "resolution": resolution, "text_tokens": text,
                "reference": f"the same model in {'fp32' if args.smoke else 'bf16'}"}  # fmt: skip
    schema.write(args.out, schema.result("precision_error", rows, command=schema.command_line(
        argv, "benchmarks.bench_precision_error"), settings=settings, columns=COLUMNS))  # fmt: skip


if __name__ == "__main__":
    main()
