"""What running the attention in head chunks costs in kernel time (one GPU, bf16, cuDNN, forward + backward).

    python benchmarks/archive/probe_head_chunks.py --out chunks.jsonl [--tokens 4608 16896 66048] [--heads 24 12]

The Ulysses head-chunk pipeline (FLUX_CP_ULYSSES_CHUNKS) runs each rank's heads as c smaller attention kernels so
that one chunk's exchange can run beside another's attention. This measures only the price side: the same heads
(q, k, v as transposed views of `[B, S, H, D]` memory, as an exchange delivers them) in one kernel pair or in c,
one after another. The chunk counts are timed in turn within each repetition, so that drift in the GPU's clocks
falls on all of them alike; each row is the median.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

aten = torch.ops.aten


def attention_in_chunks(q, k, v, dout, chunks: int) -> None:
    heads = q.shape[1] // chunks
    for i in range(chunks):
        h = slice(i * heads, (i + 1) * heads)
        out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q[:, h], k[:, h], v[:, h], None, True, 0.0, False, False, scale=q.shape[-1] ** -0.5
        )
        aten._scaled_dot_product_cudnn_attention_backward(
            dout[:, h], q[:, h], k[:, h], v[:, h], out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, False,
            scale=q.shape[-1] ** -0.5,
        )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, nargs="*", default=[4608, 16896, 66048])
    p.add_argument("--heads", type=int, nargs="*", default=[24, 12], help="24: one GPU; 12: one rank of cp=2")
    p.add_argument("--chunks", type=int, nargs="*", default=[1, 2, 3, 4, 6])
    p.add_argument("--repeat", type=int, default=12)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens in args.tokens:
        for heads in args.heads:
            base = [
                torch.randn(1, tokens, heads, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
            ]
            q, k, v, dout = (t.transpose(1, 2) for t in base)
            chunks = [c for c in args.chunks if heads % c == 0]
            for c in chunks:
                attention_in_chunks(q, k, v, dout, c)
            times: dict[int, list[float]] = {c: [] for c in chunks}
            for _ in range(args.repeat if tokens < 60000 else max(3, args.repeat // 3)):
                for c in chunks:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    attention_in_chunks(q, k, v, dout, c)
                    end.record()
                    torch.cuda.synchronize()
                    times[c].append(start.elapsed_time(end))
            one = statistics.median(times[1])
            for c in chunks:
                ms = statistics.median(times[c])
                row = {"tokens": tokens, "heads": heads, "chunks": c, "ms": round(ms, 3), "vs_one": round(ms / one, 4)}
                print(json.dumps(row), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
