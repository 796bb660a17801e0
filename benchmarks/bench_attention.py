"""Attention level, forward + backward, bf16, batch 1, 24 heads x 128 (FLUX.1-dev): one-GPU SDPA (cuDNN)
against cp.attention's ring, Ulysses and hybrid modes over 2 (and 4) GPUs.

    torchrun --nproc_per_node 4 -m benchmarks.bench_attention --out attention.json [--compile]

Efficiency = t1 / (n * tn), t1 the one-GPU time of the full sequence, tn the slowest rank's time for its
chunk. The results go to --out in the suite's schema (benchmarks/schema.py). The CP tuning flags are the trainer's
(--cp_kernels, --cp_overlap, --cp_exchange_first, --cp_ulysses_chunks). On CPU (gloo) it runs with --smoke shapes,
to check the script, not to measure.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import cp
from benchmarks import schema
from benchmarks.common import group_of, init, max_over_ranks, median, time_fn

TOKENS = (4608, 16896, 66048)  # 1024 / 2048 / 4096 px + 512 text tokens
COLUMNS = {"tokens": "tokens", "gpus": "GPUs", "impl": "attention", "ms": "ms", "efficiency": "efficiency"}


def tuning(args: argparse.Namespace, chunks: int | None = None) -> cp.Tuning:
    """The tuning flags as cp takes them (the trainer's --cp_* flags)."""
    kernels = tuple(k.strip() for k in (args.cp_kernels or "").split(",") if k.strip())
    return cp.Tuning(kernels, args.cp_overlap, args.cp_exchange_first, chunks or 1)


def compiled_attention(args: argparse.Namespace):
    """cp.attention compiled as the trainer compiles its blocks (flux_cp/model/blocks.py): the same Inductor passes."""
    from cp.schedule import inductor_options

    return torch.compile(cp.attention, fullgraph=True, options=inductor_options(None, tuning(args), 2))


def modes_for(n: int, heads: int) -> list[tuple[str, int | None]]:
    out = [("ring", None)]
    if heads % n == 0:
        out.append(("ulysses", None))
    out += [("hybrid", u) for u in range(2, n) if n % u == 0 and heads % u == 0]
    return out


def profile(step, device) -> dict:
    """One profiled step: wall time, and the summed GPU time of compute kernels and of NCCL kernels. If the
    wall time is close to the compute time, the communication is hidden behind it."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    torch.cuda.synchronize(device)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
    nccl = compute = 0.0
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if "nccl" in evt.key.lower():
            nccl += t
        else:
            compute += t
    return {
        "wall_ms": round(start.elapsed_time(end), 3),
        "compute_kernels_ms": round(compute / 1e3, 3),
        "nccl_kernels_ms": round(nccl / 1e3, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script only")
    p.add_argument(
        "--compile",
        action="store_true",
        help="time cp.attention under torch.compile(fullgraph=True) with the trainer's Inductor options",
    )
    p.add_argument("--cp_kernels", default=None, help="attention kernel order, e.g. cudnn,flash (default: cp's)")
    p.add_argument(
        "--cp_overlap",
        default="fill",
        choices=["fill", "passes", "compute", "scheduler", "none"],
        help="compiled: how Inductor orders the exchanges against compute (the trainer's default: fill)",
    )
    p.add_argument(
        "--cp_exchange_first", action="store_true", help="start each exchange kernel before the compute behind it"
    )
    p.add_argument(
        "--cp_ulysses_chunks",
        type=int,
        nargs="*",
        default=[1],
        help="head chunks of the Ulysses pipeline, each a measured variant (default 1, as the trainer's)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after timing, profile one step of each CP mode: kernel time vs communication time",
    )
    args = p.parse_args()
    if args.smoke:  # shapes a CPU gets through in seconds
        args.tokens, args.heads, args.head_dim, args.warmup, args.repeat = [512], 4, 32, 1, 2
    rank, world, device = init()
    dtype = torch.float32 if args.smoke else torch.bfloat16
    sizes = [n for n in (2, 4, 8) if n <= world]
    contexts = {}  # collective over all launched ranks (hybrid sub-groups): every context before any rank times
    for n in sizes:
        for mode, u in modes_for(n, args.heads):
            for c in args.cp_ulysses_chunks if mode == "ulysses" else [None]:
                contexts[(n, mode, u, c)] = cp.CPContext(group_of(n), mode, u, tuning=tuning(args, c))
    attention = compiled_attention(args) if args.compile else cp.attention
    rows = []
    for s in args.tokens:
        g = torch.Generator(device="cpu").manual_seed(s)
        q, k, v, do = (torch.randn(1, s, args.heads, args.head_dim, generator=g).to(device, dtype) for _ in range(4))

        def single(kind: str, q=q, k=k, v=v, do=do):
            qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))

            def step():
                if kind == "sdpa":
                    backends = [torch.nn.attention.SDPBackend.CUDNN_ATTENTION] if device.type == "cuda" else None
                    ctx = torch.nn.attention.sdpa_kernel(backends) if backends else torch.enable_grad()
                    with ctx:
                        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qs, ks, vs))).transpose(1, 2)
                else:
                    o = cp.attention(qs, ks, vs, context=cp.CPContext(tuning=tuning(args)))
                o.backward(do)

            return step

        t1 = {}
        if rank == 0:
            for kind in ("sdpa", "cp_local"):
                t1[kind] = median(time_fn(single(kind), device, args.warmup, args.repeat))
        base = t1.get("sdpa")
        if rank == 0:
            rows.append({"tokens": s, "gpus": 1, "impl": "sdpa_cudnn", "ms": round(base * 1e3, 3)})
            rows.append({"tokens": s, "gpus": 1, "impl": "cp.attention(local)", "ms": round(t1["cp_local"] * 1e3, 3)})
        for n in sizes:
            group = group_of(n)
            if rank >= n or s % n:
                continue
            ql, kl, vl, dl = (cp.shard(t, 1, group) for t in (q, k, v, do))
            variants = [
                (m, u, c)
                for m, u in modes_for(n, args.heads)
                for c in (args.cp_ulysses_chunks if m == "ulysses" else [None])
            ]
            for mode, u, chunks in variants:
                qs, ks, vs = (t.detach().requires_grad_(True) for t in (ql, kl, vl))

                def step(context=contexts[(n, mode, u, chunks)], qs=qs, ks=ks, vs=vs, dl=dl):
                    o = attention(qs, ks, vs, context=context)
                    o.backward(dl)

                tn = max_over_ranks(median(time_fn(step, device, args.warmup, args.repeat, group)), group, device)
                name = mode + (f"(u={u})" if u else "") + (f"[chunks={chunks}]" if chunks else "")
                prof = profile(step, device) if args.profile and device.type == "cuda" else None
                if rank == 0:
                    eff = base / (n * tn) if base else None
                    ms = round(tn * 1e3, 3)
                    efficiency = round(eff, 4) if eff else None
                    rows.append(
                        {"tokens": s, "gpus": n, "impl": name, "ms": ms, "efficiency": efficiency, "profile": prof}
                    )
                    print(
                        f"tokens {s:6d} cp={n} {name:24s}: {tn * 1e3:8.2f} ms  eff {eff:.3f}  {prof or ''}", flush=True
                    )
        if rank == 0:
            print(
                f"tokens {s:6d} 1 GPU sdpa {base * 1e3:8.2f} ms, cp.attention local {t1['cp_local'] * 1e3:8.2f} ms",
                flush=True,
            )
    if rank == 0:
        from cp import kernels

        settings = {
            "heads": args.heads,
            "head_dim": args.head_dim,
            "dtype": str(dtype).removeprefix("torch."),
            "batch": 1,
            "compiled": args.compile,
            "cp_overlap": args.cp_overlap if args.compile else None,
            "cp_exchange_first": args.cp_exchange_first,
            "timed": f"median of {args.repeat} after {args.warmup} warm-ups; a CP time is its slowest rank's",
            "efficiency": "t1 / (n tn) against one-GPU cuDNN SDPA on the full sequence",
            "kernels": "; ".join(f"{k}: {v}" for k, v in kernels.chosen_kernels().items()),
        }
        command = schema.command_line(module="benchmarks.bench_attention")
        schema.write(args.out, schema.result("attention", rows, command=command, settings=settings, columns=COLUMNS))
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
