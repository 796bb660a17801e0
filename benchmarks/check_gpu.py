"""GPU exactness check in bf16: cp.attention (cuDNN block kernel) and a Flux transformer with CP against an
fp32 reference without CP, for CP sizes 2 and 4 and every mode. The bf16 error of CP should be that of
plain bf16 attention (also reported), and within 2e-2 of the fp32 reference.

    torchrun --nproc_per_node 4 -m benchmarks.check_gpu --out check_gpu.json

The rows go to --out in the suite's schema (benchmarks/schema.py); relative errors are the largest over the output
and the three input gradients (attention) or of the output and the median parameter gradient (model).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cp
from benchmarks import schema
from benchmarks.bench_attention import modes_for
from benchmarks.common import group_of, init

SETTINGS = {
    "reference": "fp32 without CP, on the full sequence",
    "attention": "bf16 cp.attention (the block kernel of cp/kernels.py), batch 1, 24 heads",
    "model": "a 4-block Flux transformer (2 double, 2 single; 24 heads x 128), LoRA r16, bf16 autocast",
}


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def attention_checks(rank, world, device, tokens, heads, head_dim, dtype) -> list[dict]:
    rows = []
    for s in tokens:
        g = torch.Generator().manual_seed(s)
        q, k, v, do = (torch.randn(1, s, heads, head_dim, generator=g).to(device) for _ in range(4))
        ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ro = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref)).transpose(1, 2)
        ro.backward(do)
        refs = [ro.detach(), *(t.grad for t in ref)]
        # plain bf16 attention on one GPU, for scale
        loc = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        lo = cp.attention(*loc, group=None)
        lo.backward(do.to(dtype))
        base = [lo.detach(), *(t.grad for t in loc)]
        rows.append(
            {
                "check": "attention",
                "tokens": s,
                "cp": 1,
                "mode": "none",
                "rel_max": max(rel_max(a, b) for a, b in zip(base, refs)),
                "rel_norm": max(rel_norm(a, b) for a, b in zip(base, refs)),
            }
        )
        for n in [n for n in (2, 4, 8) if n <= world]:
            group = group_of(n)
            if rank >= n:
                continue
            for mode, u in modes_for(n, heads):
                loc = [cp.shard(t, 1, group).to(dtype).requires_grad_(True) for t in (q, k, v)]
                out = cp.attention(*loc, context=context_of(n, mode, u))
                out.backward(cp.shard(do, 1, group).to(dtype))
                got = [out.detach(), *(t.grad for t in loc)]
                exp = [cp.shard(t, 1, group) for t in refs]
                row = {
                    "check": "attention",
                    "tokens": s,
                    "cp": n,
                    "mode": mode,
                    "ulysses": u,
                    "rel_max": max(rel_max(a, b) for a, b in zip(got, exp)),
                    "rel_norm": max(rel_norm(a, b) for a, b in zip(got, exp)),
                }
                t = torch.tensor([row["rel_max"], row["rel_norm"]], device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                row["rel_max"], row["rel_norm"] = t.tolist()
                rows.append(row)
    return rows


_CONTEXTS: dict[tuple, cp.CPContext] = {}


def context_of(n: int, mode: str, u: int | None) -> cp.CPContext:
    """The CP context of the first n ranks in this mode, built once (the first build is collective: `main` builds
    them all on every rank before any check runs)."""
    key = (n, mode, u)
    if key not in _CONTEXTS:
        _CONTEXTS[key] = cp.CPContext(group_of(n), mode, u)
    return _CONTEXTS[key]


def model_checks(rank, world, device, dtype, heads=24, head_dim=128, rope=(16, 56, 56)) -> list[dict]:
    """Flux transformer with FLUX.1-dev attention dims (24 x 128), 2 double + 2 single blocks, LoRA."""
    from peft import LoraConfig

    from flux_cp.families.flux1.tiny import tiny_transformer
    from flux_cp.families.flux1.tokens import image_ids, pack_latents, text_ids

    def build():
        m = tiny_transformer(
            seed=0,
            num_attention_heads=heads,
            attention_head_dim=head_dim,
            axes_dims_rope=rope,
            joint_attention_dim=256,
            pooled_projection_dim=64,
            in_channels=64,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            m.add_adapter(
                LoraConfig(
                    r=16,
                    lora_alpha=16,
                    init_lora_weights="gaussian",
                    target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                )
            )
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    with torch.no_grad():
                        p.normal_(std=0.02)
        m.requires_grad_(True)
        return m.to(device)

    g = torch.Generator().manual_seed(5)
    lat_h = lat_w = 64  # 1024 image tokens
    inputs = dict(
        hidden_states=pack_latents(torch.randn(1, 16, lat_h, lat_w, generator=g)).to(device),
        encoder_hidden_states=torch.randn(1, 512, 256, generator=g).to(device),
        pooled_projections=torch.randn(1, 64, generator=g).to(device),
        timestep=torch.tensor([0.7], device=device),
        guidance=torch.tensor([3.5], device=device),
        img_ids=image_ids(lat_h, lat_w, device=device),
        txt_ids=text_ids(512, device=device),
    )
    target = torch.randn(1, (lat_h // 2) * (lat_w // 2), 64, generator=g).to(device)
    ref = build()
    out_ref = ref(**inputs).sample
    F.mse_loss(out_ref, target).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    def run(n, group, mode, u, ours=True):
        # As train_flux_cp.py holds a model it fine-tunes fully: trainable weights in fp32, bf16 autocast.
        # (With bf16 trainable weights, checkpointing and autocast, a first run on H200s ended in
        # CUBLAS_STATUS_EXECUTION_FAILED inside backward; that configuration is not the product's.)
        model = build()
        model.enable_gradient_checkpointing()
        # Our processor at n = 1 too, as train_flux_cp.py installs it: diffusers' own bf16 path picks cuDNN and
        # hands its backward a non-contiguous grad_out, an illegal memory access on H200s (torch 2.11).
        if ours:
            cp.apply_context_parallel(model, context_of(n, mode, u) if n > 1 else None)
        local = dict(inputs)
        for key, dim in (("hidden_states", 1), ("encoder_hidden_states", 1), ("img_ids", 0), ("txt_ids", 0)):
            local[key] = cp.shard(inputs[key], dim, group)
        with torch.autocast(device.type, dtype=dtype):
            out = model(**local).sample
        F.mse_loss(out.float(), cp.shard(target, 1, group)).backward()
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.float()
            if group is not None:
                dist.all_reduce(grad, group=group)
                grad /= n
            grads[name] = grad
        return cp.gather(out.detach().float(), 1, group), grads

    # bf16 without CP, on every rank: CP in bf16 should match it as closely as bf16 rounding allows.
    def no_cp_row(out, grads, processor):
        vs_ref = sorted(rel_norm(grads[k], ref_grads[k]) for k in ref_grads)
        return {
            "check": "model",
            "cp": 1,
            "mode": "none" if processor == "ours" else f"none ({processor} processor)",
            "out_vs_fp32_rel_max": rel_max(out, out_ref),
            "out_vs_fp32_rel_norm": rel_norm(out, out_ref),
            "grad_vs_fp32_rel_norm_median": vs_ref[len(vs_ref) // 2],
        }

    base_out, base_grads = run(1, None, "ring", None)
    rows = [no_cp_row(base_out, base_grads, "ours")]
    if device.type == "cpu":
        # How far bf16 autocast alone takes this model from fp32: diffusers' own processor (it crashes on H200s).
        rows.append(no_cp_row(*run(1, None, "ring", None, ours=False), "diffusers"))
    for n in [n for n in (2, 4, 8) if n <= world]:
        group = group_of(n)
        if rank >= n:
            continue
        for mode, u in modes_for(n, heads):
            out, grads = run(n, group, mode, u)
            vs_base = sorted(rel_norm(grads[k], base_grads[k]) for k in grads)
            vs_ref = sorted(rel_norm(grads[k], ref_grads[k]) for k in grads)
            rows.append(
                {
                    "check": "model",
                    "cp": n,
                    "mode": mode,
                    "ulysses": u,
                    "out_vs_fp32_rel_max": rel_max(out, out_ref),
                    "out_vs_fp32_rel_norm": rel_norm(out, out_ref),
                    "out_vs_bf16_nocp_rel_norm": rel_norm(out, base_out),
                    "grad_vs_fp32_rel_norm_median": vs_ref[len(vs_ref) // 2],
                    "grad_vs_bf16_nocp_rel_norm_median": vs_base[len(vs_base) // 2],
                    "grad_vs_bf16_nocp_rel_norm_max": vs_base[-1],
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, nargs="*", default=[4608, 16896])
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    rank, world, device = init()
    dtype = torch.bfloat16
    for n in [n for n in (2, 4, 8) if n <= world]:  # every context on every rank: hybrid ones create sub-groups
        for mode, u in modes_for(n, 24):
            context_of(n, mode, u)
    heads, head_dim = (24, 128) if not args.smoke else (24, 8)
    rows = attention_checks(rank, world, device, args.tokens, heads, head_dim, dtype)
    command = schema.command_line(module="benchmarks.check_gpu")
    if rank == 0:  # print and keep the attention rows before the model checks, which may fail on their own
        for r in rows:
            print(r, flush=True)
        schema.write(args.out, schema.result("check_gpu", rows, command=command, settings=SETTINGS))
    try:
        dims = dict(heads=4, head_dim=16, rope=(4, 6, 6)) if args.smoke else {}
        model_rows = model_checks(rank, world, device, dtype, **dims)
    except Exception as e:  # noqa: BLE001 - recorded in the results instead of losing them
        model_rows = [{"check": "model", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}]
    rows += model_rows
    if rank == 0:
        for r in model_rows:
            print(r, flush=True)
        from cp import kernels

        settings = {**SETTINGS, "kernels": "; ".join(f"{k}: {v}" for k, v in kernels.chosen_kernels().items())}
        schema.write(args.out, schema.result("check_gpu", rows, command=command, settings=settings))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
