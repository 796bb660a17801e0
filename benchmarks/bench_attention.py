"""Attention level, forward + backward, bf16, batch 1, 24 heads x 128 (FLUX.1-dev): one-GPU SDPA (cuDNN)
against cp.attention's ring, Ulysses and hybrid modes over 2 (and 4) GPUs.

    torchrun --nproc_per_node 4 benchmarks/bench_attention.py --out results/attention.json

Efficiency = t1 / (n * tn), t1 the one-GPU time of the full sequence, tn the slowest rank's time for its
chunk. On CPU (gloo) it runs with --smoke shapes, to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cp  # noqa: E402
from benchmarks.common import environment, group_of, init, max_over_ranks, median, time_fn, write_json  # noqa: E402

TOKENS = (4608, 16896, 66048)  # 1024 / 2048 / 4096 px + 512 text tokens


def modes_for(n: int, heads: int) -> list[tuple[str, int | None]]:
    out = [("ring", None)]
    if heads % n == 0:
        out.append(("ulysses", None))
    out += [("hybrid", u) for u in range(2, n) if n % u == 0 and heads % u == 0]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script only")
    args = p.parse_args()
    rank, world, device = init()
    dtype = torch.float32 if args.smoke else torch.bfloat16
    sizes = [n for n in (2, 4, 8) if n <= world]
    for n in sizes:  # collective over all launched ranks: make every group before any rank starts timing
        group_of(n)
        for mode, u in modes_for(n, args.heads):
            if mode == "hybrid":
                cp.comm.create_hybrid_groups([list(range(n))], u)
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
                    o = cp.attention(qs, ks, vs, group=None)
                o.backward(do)

            return step

        t1 = {}
        if rank == 0:
            for kind in ("sdpa", "cp_local"):
                t1[kind] = median(time_fn(single(kind), device, args.warmup, args.repeat))
        base = t1.get("sdpa")
        if rank == 0:
            rows.append({"tokens": s, "gpus": 1, "impl": "sdpa_cudnn", "s": base})
            rows.append({"tokens": s, "gpus": 1, "impl": "cp.attention(local)", "s": t1["cp_local"]})
        for n in sizes:
            group = group_of(n)
            if rank >= n or s % n:
                continue
            ql, kl, vl, dl = (cp.shard(t, 1, group) for t in (q, k, v, do))
            for mode, u in modes_for(n, args.heads):
                qs, ks, vs = (t.detach().requires_grad_(True) for t in (ql, kl, vl))

                def step(mode=mode, u=u, qs=qs, ks=ks, vs=vs, group=group, dl=dl):
                    o = cp.attention(qs, ks, vs, group=group, mode=mode, ulysses_size=u)
                    o.backward(dl)

                tn = max_over_ranks(median(time_fn(step, device, args.warmup, args.repeat, group)), group, device)
                if rank == 0:
                    rows.append(
                        {
                            "tokens": s,
                            "gpus": n,
                            "impl": f"{mode}" + (f"(u={u})" if u else ""),
                            "s": tn,
                            "efficiency": base / (n * tn) if base else None,
                        }
                    )
                    print(
                        f"tokens {s:6d} cp={n} {mode:8s} u={u}: {tn * 1e3:8.2f} ms  eff {base / (n * tn):.3f}",
                        flush=True,
                    )
        if rank == 0:
            print(
                f"tokens {s:6d} 1 GPU sdpa {base * 1e3:8.2f} ms, cp.attention local {t1['cp_local'] * 1e3:8.2f} ms",
                flush=True,
            )
    if rank == 0:
        from cp import kernels

        write_json(
            args.out,
            {
                "benchmark": "attention",
                "env": environment(),
                "kernels": kernels.chosen_kernels(),
                "heads": args.heads,
                "head_dim": args.head_dim,
                "dtype": str(dtype),
                "rows": rows,
            },
        )
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
