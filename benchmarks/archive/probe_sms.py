"""Does a kernel launched on a side stream start while a matrix product holds the GPU? (one GPU, bf16)

    python benchmarks/archive/probe_sms.py --out sms.json [--tokens 8448] [--repeat 10] [--carveouts 0,8,16]

The profile of a cp=2 step showed exchanges that the host launched before a matrix product, with their input
ready, start only when the product ended. This reproduces that order on one GPU and measures the delay: on the
main stream a product A, an event, then the product P under test; on a side stream, waiting for the event and
launched by the host *before* P, a probe: a small elementwise kernel (like NCCL's, it needs a free SM) or a
device-to-device copy (a copy engine could run it beside P; on one GPU it is a kernel too). The main stream first
sleeps, so that the host has queued everything before the GPU reaches A. (An all-to-all of a one-rank NCCL group
launches no kernel, so NCCL itself is not used.)

Cases: FLUX.1's feed-forward products at `--tokens` rows (the up-projection with bias and without, the
down-projection), through cuBLAS and through cuBLASLt (`torch.backends.cuda.preferred_blas_library`), with each SM
carveout set around P only (`torch._C._set_sm_carveout_experimental`, the knob behind FLUX_CP_SM_CARVEOUT); the
same captured in a CUDA graph; the side stream at high priority; and cuDNN's attention forward over twice as many
tokens with 12 heads (Ulysses at cp=2); a short kernel ahead of P (`lead_cycles`, what FLUX_CP_EXCHANGE_FIRST
adds). Per case: the probe's start after A's end (`delay_us_median`), how often it
started in P's first half, P's duration, grid and kernel. And the other order (`head_start`): a kernel holding 32
SMs (a product with the rest carved out, standing in for NCCL's exchange kernel of 32 blocks) ready just before
P: how much later P ends than alone. Prints each case and writes one JSON document.
"""

from __future__ import annotations

import argparse
import functools
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


def profiled_trials(step, repeat: int) -> list[tuple[list[dict], list[dict]]]:
    """Run `step` `repeat` times under the profiler; per trial (from one long sleep kernel to the next), the
    kernels and copies on the main stream (the sleep's) and on the others, in time order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        ks = kernels(path)
    sleeps = [i for i, k in enumerate(ks) if is_sleep(k)]
    main_id = ks[sleeps[0]]["args"].get("stream") if sleeps else None
    trials = []
    for n, first in enumerate(sleeps):
        group = ks[first + 1 : sleeps[n + 1] if n + 1 < len(sleeps) else len(ks)]
        on_main = [k for k in group if k["args"].get("stream") == main_id]
        trials.append((on_main, [k for k in group if k["args"].get("stream") != main_id]))
    return trials


def is_sleep(kernel: dict) -> bool:  # the long torch.cuda._sleep kernel where each trial begins
    name = kernel["name"].lower()
    return ("sleep" in name or "spin" in name) and kernel["dur"] > 200


def trial_set(
    product: str,
    blas: str,
    carveout: int,
    probe: str,
    high_priority: bool,
    graph: bool,
    lead: int,
    tokens: int,
    repeat: int,
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
        if lead:  # a short kernel ahead of P: the side kernel is ready a moment before P
            torch.cuda._sleep(lead)
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
    delays, p_durs, beside, grids, names, probe_names = [], [], [], set(), set(), set()
    for on_main, on_side in profiled_trials(step, repeat):
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
        "lead_cycles": lead,
        "trials": len(p_durs),
        "probe_kernels_seen": len(delays),
        "delay_us_median": statistics.median(delays) if delays else None,
        "probe_started_in_first_half_of_P": sum(beside),
        "P_us_median": statistics.median(p_durs) if p_durs else None,
        "P_grid": sorted(grids),
        "P_kernel": sorted(names),
        "probe_kernel": sorted(probe_names),
    }


def head_start(product: str, blocker_sms: int, tokens: int, repeat: int) -> dict:
    """The other order: a kernel holding `blocker_sms` SMs (a product with the rest carved out, standing in for
    NCCL's exchange kernel) becomes ready a few microseconds before P. Does P then end later by the blocker's
    whole length (its blocks wait for the SMs the blocker holds), or only by the blocker's share of the GPU?"""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, 3072, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(12288, 3072, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(12288, device=dev, dtype=torch.bfloat16, generator=g)
    xb = torch.randn(1024, 3072, device=dev, dtype=torch.bfloat16, generator=g)
    q, k, v = (torch.randn(1, 12, 2 * tokens, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in "qkv")
    small = torch.zeros(4096, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()

    def product_op() -> torch.Tensor:
        if product == "attention":
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return torch.nn.functional.linear(x, w, b)

    def one(blocked: bool) -> None:
        torch.cuda._sleep(2_000_000)
        torch.nn.functional.linear(x, w, b)  # A
        ready = torch.cuda.Event()
        ready.record(main)
        if blocked:
            with torch.cuda.stream(side):
                side.wait_event(ready)
                torch._C._set_sm_carveout_experimental(sms - blocker_sms)
                torch.nn.functional.linear(xb, w, b)
                torch._C._set_sm_carveout_experimental(None)
        small.add_(1.0)  # a few microseconds: the blocker is ready first
        product_op()  # P
        main.wait_stream(side)

    out: dict = {"product": product, "blocker_sms": blocker_sms}
    for blocked in (False, True):
        for _ in range(3):
            one(blocked)
        torch.cuda.synchronize()
        ends, durs, blockers = [], [], []
        for on_main, on_side in profiled_trials(functools.partial(one, blocked), repeat):
            a, p = on_main[0], on_main[-1]
            ends.append(p["ts"] + p["dur"] - (a["ts"] + a["dur"]))
            durs.append(p["dur"])
            blockers += [kern["dur"] for kern in on_side]
        key = "blocked" if blocked else "alone"
        out[f"P_end_after_A_us_{key}"] = statistics.median(ends)
        out[f"P_us_{key}"] = statistics.median(durs)
        if blockers:
            out["blocker_us"] = statistics.median(blockers)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=8448, help="rows of the product: one rank's tokens at 2048 px, cp=2")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--carveouts", default="0,8,16")
    p.add_argument("--parts", default="rows,lead,head_start", help="which experiments: rows, lead, head_start")
    args = p.parse_args()
    torch.cuda.set_device(0)
    rows = []
    carveouts = [int(c) for c in args.carveouts.split(",")]
    cases = [
        (product, blas, carveout, probe, False, False, 0)
        for product in ("up_bias", "up", "down")
        for blas in ("cublas", "cublaslt")
        for carveout in carveouts
        for probe in ("elementwise", "copy")
    ]
    cases += [("up", "cublaslt", c, "elementwise", False, True, 0) for c in carveouts]  # CUDA graph
    cases += [("up", "cublas", 0, "elementwise", True, False, 0)]  # side stream at high priority
    cases += [("attention", "cublas", 0, probe, False, False, 0) for probe in ("elementwise", "copy")]
    leads = [
        (product, "cublas", 0, "elementwise", False, False, lead)
        for product in ("up_bias", "attention")
        for lead in (1000, 4000)
    ]
    for case in (cases if "rows" in args.parts else []) + (leads if "lead" in args.parts else []):
        row = trial_set(*case, args.tokens, args.repeat)
        print(json.dumps(row), flush=True)
        rows.append(row)
    first = []
    for product in ("up_bias", "attention") if "head_start" in args.parts else ():
        first.append(head_start(product, 32, args.tokens, args.repeat))
        print(json.dumps(first[-1]), flush=True)
    doc = {
        "command": "python benchmarks/archive/probe_sms.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "device": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "rows": rows,
        "head_start": first,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
