"""`--profile_step N`: a torch.profiler trace of one training step, and what it says about the GPU's time.

Each rank writes `OUTPUT_DIR/profile/rank{R}.json` (a Chrome trace: chrome://tracing or ui.perfetto.dev) and
`rank{R}_summary.json`; the main rank logs its summary. `python -m flux_cp.profiling TRACE` prints the summary of
a trace (.json or .json.gz). The summary splits the step's GPU time into kernels of
each kind (attention, matrix products, communication, the rest) and says how much of the communication ran
while a compute kernel ran beside it: communication not overlapped is time CP adds to the step. It also names
the longest stretches with no kernel at all and what the host did meanwhile (`idle_gaps`), and per CUDA stream
(`streams`) how busy each was, how long the compute stream sat idle while host-to-GPU copies ran on another (a step
waiting for offloaded blocks), the copies by kind and the longest kernels.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from flux_cp import manifest

logger = logging.getLogger("flux_cp")

KINDS = ("attention", "matmul", "communication", "other")


def kernel_kind(name: str) -> str:
    n = name.lower()
    if n.startswith("triton_"):  # Inductor's kernels, some named after a fused all_to_all view: compute
        return "matmul" if n.startswith("triton_tem_") and "mm" in n else "other"
    if "nccl" in n:
        return "communication"
    if any(s in n for s in ("fmha", "flash", "cudnn", "sdpa", "attention")):
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "matmul", "sm90_")):
        return "matmul"
    return "other"


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(events: list[dict]) -> dict:
    """Milliseconds of GPU time by kernel kind from Chrome-trace events (`ph: X`, `cat: kernel`, `ts`/`dur` in
    microseconds): `span` from the first kernel's start to the last one's end, `busy` when any kernel runs,
    `idle` = span - busy, per kind the summed kernel time, `communication_exposed` the communication time with no
    compute kernel beside it, and `communication_hidden` the fraction of communication time that overlapped."""
    by_kind: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel" and e.get("dur", 0) > 0:
            by_kind[kernel_kind(e.get("name", ""))].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    everything = union([iv for ivs in by_kind.values() for iv in ivs])
    if not everything:
        return {"kernels": 0}
    compute = union([iv for k in ("attention", "matmul", "other") for iv in by_kind[k]])
    comm = union(by_kind["communication"])
    comm_ms = length(comm) / 1e3
    overlapped = intersection(comm, compute) / 1e3
    span = (everything[-1][1] - everything[0][0]) / 1e3
    busy = length(everything) / 1e3
    out = {"kernels": sum(len(v) for v in by_kind.values()), "span_ms": span, "busy_ms": busy, "idle_ms": span - busy}
    for k in KINDS:
        out[f"{k}_ms"] = sum(b - a for a, b in by_kind[k]) / 1e3
    out["communication_exposed_ms"] = comm_ms - overlapped
    out["communication_hidden"] = overlapped / comm_ms if comm_ms else None
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


def idle_gaps(events: list[dict], count: int = 5, min_us: float = 100.0) -> list[dict]:
    """The `count` longest stretches (of at least `min_us`) in which no GPU kernel ran, longest first: where the step
    waited for the host. Each gap gives `ms`, `at_ms` (from the first kernel) and `host`, the longest host
    operations that ran through at least a third of it (what the host was doing meanwhile)."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and e.get("dur", 0) > 0]
    busy = union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels])
    if not busy:
        return []
    host = [
        e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function")
    ]
    gaps = sorted(((b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= min_us), reverse=True)
    out = []
    for length_us, start, end in gaps[:count]:
        meanwhile = sorted(
            (
                e
                for e in host
                if e["ts"] < end and e["ts"] + e.get("dur", 0) > start and e.get("dur", 0) >= length_us / 3
            ),
            key=lambda e: -e["dur"],
        )
        names = [e["name"] for e in meanwhile[:3]]
        out.append({"ms": round(length_us / 1e3, 3), "at_ms": round((start - busy[0][0]) / 1e3, 3), "host": names})
    return out


def streams(events: list[dict], top: int = 25) -> dict:
    """The GPU's time by CUDA stream (ms): `stream_busy_ms` per stream (kernels, copies and sets), the compute stream
    (`main_stream`, the busiest), its idle gaps (`main_gaps_ms`, `main_gaps_over_100us`) and how much of them a copy on
    another stream overlapped (`main_gaps_overlapping_copies_ms`: waiting for an offloaded block, or the host),
    `memcpy` per kind and stream (ms, count, GB) and the `top` kernels by summed time (name, ms, count)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {}
    by_stream: dict[str, list[tuple[float, float]]] = {}
    kernels: dict[str, list[float]] = {}
    copies: dict[str, list[float]] = {}
    for e in gpu:
        stream = str(e.get("args", {}).get("stream"))
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        by_stream.setdefault(stream, []).append(span)
        if e["cat"] == "kernel":
            k = kernels.setdefault(e.get("name", "")[:90], [0.0, 0])
            k[0], k[1] = k[0] + e["dur"], k[1] + 1
        elif e["cat"] == "gpu_memcpy":
            c = copies.setdefault(f"{e.get('name', '')}@{stream}", [0.0, 0, 0])
            c[0], c[1], c[2] = c[0] + e["dur"], c[1] + 1, c[2] + e.get("args", {}).get("bytes", 0)
    busy = {s: union(iv) for s, iv in by_stream.items()}
    main = max(busy, key=lambda s: length(busy[s]))
    gaps = [(a[1], b[0]) for a, b in zip(busy[main], busy[main][1:]) if b[0] > a[1]]
    elsewhere = union(
        [
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in gpu
            if e["cat"] == "gpu_memcpy" and str(e.get("args", {}).get("stream")) != main
        ]
    )
    longest = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "stream_busy_ms": {s: round(length(iv) / 1e3, 2) for s, iv in busy.items()},
        "main_stream": main,
        "main_gaps_ms": round(length(gaps) / 1e3, 2),
        "main_gaps_overlapping_copies_ms": round(intersection(gaps, elsewhere) / 1e3, 2),
        "main_gaps_over_100us": sum(1 for a, b in gaps if b - a > 100),
        "memcpy": {k: {"ms": round(v[0] / 1e3, 2), "n": v[1], "GB": round(v[2] / 1e9, 2)} for k, v in copies.items()},
        "top_kernels_ms": [[name, round(v[0] / 1e3, 2), v[1]] for name, v in longest],
    }


@contextlib.contextmanager
def profiled(active: bool, output_dir: str, rank: int, is_main: bool) -> Iterator[None]:
    """Profile the code inside when `active` (the step named by --profile_step), else do nothing."""
    if not active:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    if is_main:  # before the step, whose collectives keep the other ranks from creating the folder first
        manifest.record(output_dir, "profile")
    with profile(activities=activities) as prof:
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    folder = Path(output_dir) / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / f"rank{rank}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    summary = summarize(events)
    if summary["kernels"]:
        summary["longest_idle"] = idle_gaps(events)
        summary["streams"] = streams(events)
    (folder / f"rank{rank}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if is_main:
        if summary["kernels"]:
            logger.info("profile of this step: %s (trace: %s)", json.dumps(summary), trace)
        else:  # a CPU run: the trace holds the operators, there are no GPU kernels to sum up
            logger.info("profile of this step: no GPU kernels in it (trace: %s)", trace)


def load_trace(path: str) -> list[dict]:
    """The events of a Chrome trace file, plain or gzipped."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def main(argv: list[str] | None = None) -> None:
    for path in argv if argv is not None else sys.argv[1:]:
        events = load_trace(path)
        summary = {"trace": path, **summarize(events), "longest_idle": idle_gaps(events), "streams": streams(events)}
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
