"""Minimal reproduction of the fault that stops diffusers' FLUX.1 LoRA step on one GPU with torch's cuDNN attention:
`torch.nn.functional.scaled_dot_product_attention` forward + backward, cuDNN backend only, at Flux's shapes, with
the query/key/value and the incoming gradient in the layouts diffusers' processors produce, each case in a fresh
process (a fault leaves the CUDA context unusable).

    python -m benchmarks.repro_cudnn_sdpa --out RESULTS/cudnn_sdpa.json

diffusers' Flux processors hold q, k, v as `[B, S, H, D]` and call SDPA on `.transpose(1, 2)` views (its native
backends), then `.transpose(1, 2).flatten(2, 3)` the output: the gradient then reaches SDPA's backward as a
transposed view of a `[B, S, H * D]` tensor (not contiguous in the `[B, H, S, D]` layout the output has). Each case
says whether the forward and backward ran, and the largest difference of the gradients from the same computation
with the math backend in fp32 (a wrong result without a fault shows there).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = [
    # (heads, tokens, inputs as transposed views of [B, S, H, D], grad_out as such a view)
    (heads, tokens, views, grad_view)
    for heads in (24, 48)
    for tokens in (4608, 16896)
    for views in (False, True)
    for grad_view in (False, True)
]


def one(heads: int, tokens: int, views: bool, grad_view: bool) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    dev, b, d = torch.device("cuda"), 1, 128
    if views:
        q, k, v = (torch.randn(b, tokens, heads, d, device=dev, dtype=torch.bfloat16).transpose(1, 2) for _ in "qkv")
    else:
        q, k, v = (torch.randn(b, heads, tokens, d, device=dev, dtype=torch.bfloat16) for _ in "qkv")
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    if grad_view:
        dout = torch.randn(b, tokens, heads * d, device=dev, dtype=torch.bfloat16).view(b, tokens, heads, d)
        dout = dout.transpose(1, 2)
    else:
        dout = torch.randn(b, heads, tokens, d, device=dev, dtype=torch.bfloat16)
    row = {"heads": heads, "tokens": tokens, "qkv_views": views, "grad_out_view": grad_view}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v)
        torch.cuda.synchronize()
        row["forward"] = "ok"
        grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        row["backward"] = "ok"
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.autograd.grad(F.scaled_dot_product_attention(q32, k32, v32), (q32, k32, v32), dout.float())
    row["max_rel_grad_error"] = max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(grads, ref))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="JSON lines of the cases")
    p.add_argument("--case", type=int, help=argparse.SUPPRESS)  # one case, in this process
    args = p.parse_args()
    if args.case is not None:
        print(json.dumps(one(*CASES[args.case])), flush=True)
        return
    rows = []
    for i, case in enumerate(CASES):
        r = subprocess.run([sys.executable, "-m", "benchmarks.repro_cudnn_sdpa", "--case", str(i)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines else dict(zip(("heads", "tokens", "qkv_views", "grad_out_view"), case))
        if r.returncode:
            err = [ln for ln in r.stderr.splitlines() if "Error" in ln or "error" in ln]
            row["fault"] = (err[-1] if err else f"exit {r.returncode}")[:300]
        print(row, flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
