"""The order Inductor gives a compiled Flux block's CP exchanges and compute, for each FLUX_CP_OVERLAP choice, at
FLUX.1's width (3072, 24 heads x 128, LoRA-like: frozen weights), checkpointed as the trainer does it. Runs on the
CPU over gloo as well as on GPUs; the order does not depend on the device except for `compute`, whose runtime
estimates exist on GPUs only.

    torchrun --nproc_per_node 2 -m benchmarks.archive.schedule --block single double --overlap passes fill

For each block, choice and graph (forward, backward) it prints the kernel sequence (A2A = an exchange issued,
wait = where it is waited for, mm = a matrix product, k = another kernel) and, by flux_cp/overlap.py's cost model
(H200 figures), how much of the exchanges' time has no compute between issue and wait: the estimated exposed
communication per block at `--tokens` image and `--text_tokens` text tokens per rank (default: 2048 px on two
ranks).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

import cp
from benchmarks.common import init
from cp import schedule as overlap
from cp.schedule import inductor_options
from flux_cp.model.blocks import checkpoint_inside


def recorder(graphs: list, cp: int) -> Callable:
    """A pass that changes nothing and keeps each graph's final order as (kind, estimated us)."""
    from torch._inductor.utils import contains_collective, contains_wait

    def record(snodes: list) -> list:
        seq = []
        for s in snodes:
            if contains_collective(s):
                seq.append(("A2A", overlap.estimate_exchange(s, cp) * 1e6))
            elif contains_wait(s):
                seq.append(("wait", 0.0))
            else:
                kernel = str(getattr(s.node, "python_kernel_name", "") or "")
                kind = "mm" if "mm" in kernel else "attn" if "attention" in kernel else "k"
                seq.append((kind, overlap.estimate_compute(s) * 1e6))
        graphs.append(seq)
        return snodes

    return record


def compress(seq: list[tuple[str, float]]) -> str:
    out: list[list] = []
    for kind, _ in seq:
        if out and out[-1][0] == kind:
            out[-1][1] += 1
        else:
            out.append([kind, 1])
    return " ".join(k if n == 1 else f"{k}x{n}" for k, n in out)


def block_of(kind: str, group) -> tuple[torch.nn.Module, dict]:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=256, pooled_projection_dim=64, guidance_embeds=False,
        axes_dims_rope=(16, 56, 56),
    )  # fmt: skip
    cp.apply_context_parallel(model, group, mode="ulysses")
    model.requires_grad_(False)
    return model, (model.transformer_blocks[0] if kind == "double" else model.single_transformer_blocks[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--block", nargs="+", default=["single", "double"], choices=["single", "double"])
    p.add_argument("--overlap", nargs="+", default=["passes", "fill"])
    p.add_argument("--tokens", type=int, default=8192, help="image tokens per rank (2048 px on 2 ranks: 8192)")
    p.add_argument("--text_tokens", type=int, default=256, help="text tokens per rank (512 on 2 ranks: 256)")
    p.add_argument("--out", default=None, help="JSON lines file for the results")
    args = p.parse_args()
    rank, world, device = init()
    group = torch.distributed.group.WORLD
    n_img, n_txt = args.tokens, args.text_tokens
    ids = torch.zeros(world * (n_img + n_txt), 3)
    ids[:, 1], ids[:, 2] = torch.arange(len(ids)) % 64, torch.arange(len(ids)) // 64
    for kind in args.block:
        for choice in args.overlap:
            model, block = block_of(kind, group)
            model.to(device, torch.bfloat16)  # the trainer's dtype: the cost model counts bytes
            rope = model.pos_embed(cp.shard(ids, 0, group).to(device))
            bf16 = dict(device=device, dtype=torch.bfloat16)
            hidden = torch.randn(1, n_img, 3072, **bf16, requires_grad=True)
            text = torch.randn(1, n_txt, 3072, **bf16, requires_grad=True)
            temb = torch.randn(1, 3072, **bf16)
            graphs: list = []
            options = inductor_options(None, choice, world)
            options["reorder_for_compute_comm_overlap"] = True
            options["reorder_for_compute_comm_overlap_passes"] = [
                *options.get("reorder_for_compute_comm_overlap_passes", []),
                recorder(graphs, world),
            ]
            options["fx_graph_cache"] = False  # a cached graph would skip the passes
            torch._dynamo.reset()
            checkpoint_inside(block, keep_attention=True)
            block.compile(options=options, fullgraph=True)
            enc, hid = block(hidden_states=hidden, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope)
            (hid.float().square().mean() + enc.float().square().mean()).backward()
            if rank != 0:
                continue
            for name, seq in zip(("forward", "backward"), graphs):
                total = sum(us for kind, us in seq if kind == "A2A")
                seconds = lambda n: n[1] / 1e6  # noqa: E731
                kinds = overlap.NodeKinds(lambda n: n[0] == "A2A", lambda n: n[0] == "wait", seconds, seconds)
                exposed = 1e6 * overlap.exposed(seq, kinds)
                row = {"block": kind, "overlap": choice, "graph": name, "tokens_per_rank": n_img + n_txt}
                row.update(exchange_us=round(total, 1), exposed_us=round(exposed, 1), order=compress(seq))
                print(
                    f"{kind:6s} {choice:8s} {name:8s} exchanges {total:7.1f} us, exposed {exposed:7.1f} us: "
                    f"{row['order']}"
                )
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
