"""Does a kernel launched on a side stream start while a matrix product holds the GPU? (one GPU, bf16)

    python benchmarks/probe_sms.py --out sms.json [--tokens 8448] [--repeat 10] [--carveouts 0,8,16]

The profile of a cp=2 step showed exchanges that the host launched before a matrix product, with their input
ready, start only when the product ended. This reproduces that order on one GPU and measures the delay: on the
main stream a product A, an event, then the product P under test; on a side stream, waiting for the event and
launched by the host *before* P, a probe: a small elementwise kernel (like NCCL's, it needs a free SM) or a
device-to-device copy (a copy engine, no SM). The main stream first sleeps, so that the host has queued everything
before the GPU reaches A. (An all-to-all of a one-rank NCCL group launches no kernel, so NCCL itself is not used.)

Cases: FLUX.1's feed-forward products at `--tokens` rows (the up-projection with bias and without, the
down-projection), through cuBLAS and through cuBLASLt (`torch.backends.cuda.preferred_blas_library`), with each SM
carveout set around P only (`torch._C._set_sm_carveout_experimental`, the knob behind FLUX_CP_SM_CARVEOUT); the
same captured in a CUDA graph; the side stream at high priority; and cuDNN's attention forward over twice as many
tokens with 12 heads (Ulysses at cp=2). Per case: the probe's start after A's end (`delay_us_median`), how often it
started in P's first half, P's duration, grid and kernel. Prints each case and writes one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch


def kernels(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]
    return sorted(out, key=lambda e: e["ts"])


def trial_set(
    product: str, blas: str, carveout: int, probe: str, high_priority: bool, graph: bool, tokens: int, repeat: int
) -> dict:
    dev = torch.device("cuda")
    torch.backends.cuda.preferred_blas_library(blas)
    g = torch.Generator(device=dev).manual_seed(0)
    down = product == "down"  # the feed-forward's down-projection: 12,288 -> 3,072 features
    x = torch.randn(tokens, 12288 if down else 3072, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(3072, 12288, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    w = w if down else w.t().contiguous()
    b = torch.randn(12288, device=dev, dtype=torch.bfloat16, generator=g) if product == "up_bias" else None
    send = torch.randn(tokens * 3072 // 2, device=dev, dtype=torch.bfloat16, generator=g)  # one q/k/v exchange
    recv = torch.empty_like(send)
    side = torch.cuda.Stream(priority=-1 if high_priority else 0)
    main = torch.cuda.current_stream()

    if product == "attention":  # Ulysses at cp=2: half the heads over the whole sequence
        q, k, v = (torch.randn(1, 12, 2 * tokens, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in "qkv")

    def product_op() -> torch.Tensor:
        if product == "attention":
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return torch.nn.functional.linear(x, w, b)

    def probe_op() -> None:
        if probe == "elementwise":
            torch.add(send[:4096], 1.0, out=recv[:4096])
        else:
            recv.copy_(send)

    def one() -> None:
        torch.cuda._sleep(2_000_000)  # ~1 ms: the host queues the rest before the GPU gets there
        product_op()  # A
        ready = torch.cuda.Event()
        ready.record(main)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            probe_op()
        torch._C._set_sm_carveout_experimental(carveout or None)
        product_op()  # P
        torch._C._set_sm_carveout_experimental(None)
        main.wait_stream(side)

    for _ in range(3):
        one()
    torch.cuda.synchronize()
    step = one
    if graph:  # the launches as a CUDA graph replays them: grids and stream order fixed at capture
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            one()
        step = cuda_graph.replay
        step()
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        ks = kernels(path)
    main_id = None
    sleeps = [i for i, k in enumerate(ks) if "sleep" in k["name"].lower() or "spin" in k["name"].lower()]
    if sleeps:
        main_id = ks[sleeps[0]]["args"].get("stream")
    delays, p_durs, beside, grids, names, probe_names = [], [], [], set(), set(), set()
    for n, s in enumerate(sleeps):
        end = sleeps[n + 1] if n + 1 < len(sleeps) else len(ks)
        group = ks[s + 1 : end]
        on_main = [k for k in group if k["args"].get("stream") == main_id]
        on_side = [k for k in group if k["args"].get("stream") != main_id]
        if len(on_main) < 2:
            continue
        a, p = on_main[0], on_main[-1]
        a_end, p_start, p_end = a["ts"] + a["dur"], p["ts"], p["ts"] + p["dur"]
        p_durs.append(p["dur"])
        grids.add(str(p["args"].get("grid")))
        names.add(p["name"][:70])
        if on_side:
            k = on_side[0]
            probe_names.add(k["name"][:60])
            delays.append(k["ts"] - a_end)
            beside.append(k["ts"] < p_end and k["ts"] + k["dur"] > p_start and k["ts"] < p_end - 0.5 * p["dur"])
    torch.backends.cuda.preferred_blas_library("cublas")
    return {
        "product": product,
        "blas": blas,
        "carveout": carveout,
        "probe": probe,
        "high_priority": high_priority,
        "graph": graph,
        "trials": len(p_durs),
        "probe_kernels_seen": len(delays),
        "delay_us_median": statistics.median(delays) if delays else None,
        "probe_started_in_first_half_of_P": sum(beside),
        "P_us_median": statistics.median(p_durs) if p_durs else None,
        "P_grid": sorted(grids),
        "P_kernel": sorted(names),
        "probe_kernel": sorted(probe_names),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=8448, help="rows of the product: one rank's tokens at 2048 px, cp=2")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--carveouts", default="0,8,16")
    args = p.parse_args()
    torch.cuda.set_device(0)
    rows = []
    carveouts = [int(c) for c in args.carveouts.split(",")]
    cases = [
        (product, blas, carveout, probe, False, False)
        for product in ("up_bias", "up", "down")
        for blas in ("cublas", "cublaslt")
        for carveout in carveouts
        for probe in ("elementwise", "copy")
    ]
    cases += [("up", "cublaslt", c, "elementwise", False, True) for c in carveouts]  # CUDA graph
    cases += [("up", "cublas", 0, "elementwise", True, False)]  # side stream at high priority
    cases += [("attention", "cublas", 0, probe, False, False) for probe in ("elementwise", "copy")]
    for case in cases:
        row = trial_set(*case, args.tokens, args.repeat)
        print(json.dumps(row), flush=True)
        rows.append(row)
    doc = {
        "command": "python benchmarks/probe_sms.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "device": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
