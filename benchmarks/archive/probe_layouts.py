"""Which memory layouts cuDNN's attention accepts, forward and backward, and what each costs (bf16, one GPU).

    python benchmarks/archive/probe_layouts.py --out layouts.jsonl [--tokens 16896] [--heads 12]

Each case runs in its own process (an illegal memory access ends the CUDA context): q, k, v in the
`[B, H, S, D]` layout (contiguous, "bhsd") or as a transposed view of `[B, S, H, D]` memory ("bshd", what an
all-to-all of sequence chunks receives), with grad_out either contiguous or in the output's layout, or as views
of one `[B, S, 3, H, D]` buffer ("packed", q, k and v interleaved as the joint exchange of the later Ulysses head
chunks receives them; grad_out in the output's layout). Each
case reports the strides of the output and gradients, their largest difference from the contiguous case, and
the median time of forward + backward.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = ("bhsd", "bshd_dout_contiguous", "bshd_dout_like_out", "packed_dout_like_out")


def tensors(layout: str, b: int, h: int, s: int, d: int, seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    base = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
    if layout == "bhsd":
        return [t.transpose(1, 2).contiguous() for t in base]
    if layout == "packed":  # q, k, v as views of one [B, S, 3, H, D] buffer
        packed = torch.stack(base[:3], dim=2)
        return [packed[:, :, i].transpose(1, 2) for i in range(3)] + [base[3].transpose(1, 2)]
    return [t.transpose(1, 2) for t in base]  # [B, H, S, D] views of [B, S, H, D] memory


def run_case(case: str, tokens: int, heads: int, repeat: int) -> dict:
    import torch

    aten = torch.ops.aten
    b, d, scale = 1, 128, 128**-0.5
    layout = case.split("_")[0]
    q, k, v, dout = tensors(layout, b, heads, tokens, d, seed=0)

    def fwd():
        return aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)

    def bwd(res, grad):
        out, lse, cq, ck, mq, mk, seed, offset, _ = res
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, False, scale=scale
        )

    def grad_for(out):
        if case.endswith("dout_like_out"):
            return torch.empty_like(out).copy_(dout)  # same strides as out
        return dout.contiguous()

    res = fwd()
    grads = bwd(res, grad_for(res[0]))
    torch.cuda.synchronize()
    # the reference: the same inputs, contiguous
    qc, kc, vc, dc = (t.contiguous() for t in (q, k, v, dout))
    ref = aten._scaled_dot_product_cudnn_attention(qc, kc, vc, None, True, 0.0, False, False, scale=scale)
    ref_g = aten._scaled_dot_product_cudnn_attention_backward(
        dc, qc, kc, vc, ref[0], ref[1], ref[6], ref[7], None, ref[2], ref[3], ref[4], ref[5], 0.0, False, scale=scale
    )
    diffs = [(res[0].float() - ref[0].float()).abs().max().item()]
    diffs += [(g.float() - r.float()).abs().max().item() for g, r in zip(grads, ref_g)]

    times = []
    for i in range(3 + repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        r = fwd()
        bwd(r, grad_for(r[0]))
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    times.sort()
    return {
        "case": case, "tokens": tokens, "heads": heads, "ok": True,
        "q_stride": list(q.stride()), "out_stride": list(res[0].stride()),
        "dq_stride": list(grads[0].stride()), "dk_stride": list(grads[1].stride()),
        "max_abs_diff_vs_contiguous": diffs, "ms": round(times[len(times) // 2], 3),
        "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, nargs="*", default=[16896])
    p.add_argument("--heads", type=int, nargs="*", default=[12, 24])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--case", help="run one case in this process (used by the driver)")
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.tokens[0], args.heads[0], args.repeat)))
        return
    with open(args.out, "a") as f:
        for tokens in args.tokens:
            for heads in args.heads:
                for case in CASES:
                    cmd = [sys.executable, __file__, "--out", args.out, "--case", case, "--tokens", str(tokens),
                           "--heads", str(heads), "--repeat", str(args.repeat)]  # fmt: skip
                    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
                    row = json.loads(lines[-1]) if lines else {
                        "case": case, "tokens": tokens, "heads": heads, "ok": False,
                        "error": (r.stderr.strip().splitlines() or ["no output"])[-1][:300],
                    }  # fmt: skip
                    print(json.dumps(row), flush=True)
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
