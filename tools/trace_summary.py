"""A profiled step's trace (torch.profiler's Chrome trace, `--profile_step N` writes one) summarised: the GPU's busy
time per stream, the compute stream's idle gaps and how much of them overlaps host-to-GPU copies on another stream
(a step waiting for offloaded blocks), the copies by kind, and the kernels that took longest.

    python tools/trace_summary.py OUTPUT_DIR/NAME.trace.json.gz [...] > NAME.analysis.json

The compute stream is the one busiest with kernels and copies; a gap is time between two of its events.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from collections.abc import Iterable

Interval = tuple[float, float]
GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def union(intervals: Iterable[Interval]) -> list[list[float]]:
    """The intervals merged where they overlap, in order."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def length(intervals: Iterable[Iterable[float]]) -> float:
    return sum(b - a for a, b in intervals)


def overlap(xs: list[list[float]], ys: list[list[float]]) -> float:
    """Total time inside both of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def summary(events: list[dict], top: int = 45) -> dict:
    """The figures of one trace (times in ms; the trace's are in microseconds)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_EVENTS]
    if not gpu:
        return {"gpu_events": 0}
    start = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    streams: dict = collections.defaultdict(list)
    kernels: dict = collections.defaultdict(lambda: [0.0, 0])
    copies_by_kind: dict = collections.defaultdict(lambda: [0.0, 0, 0])
    for e in gpu:
        stream = e.get("args", {}).get("stream")
        streams[stream].append((e["ts"], e["ts"] + e["dur"]))
        if e["cat"] == "kernel":
            k = kernels[e["name"][:90]]
            k[0], k[1] = k[0] + e["dur"], k[1] + 1
        elif e["cat"] == "gpu_memcpy":
            m = copies_by_kind[f"{e['name']}@{stream}"]
            m[0], m[1], m[2] = m[0] + e["dur"], m[1] + 1, m[2] + e.get("args", {}).get("bytes", 0)
    main = max(streams, key=lambda s: length(union(streams[s])))
    busy = union(streams[main])
    gaps = [[a[1], b[0]] for a, b in zip(busy, busy[1:]) if b[0] > a[1]]
    copies = union(
        (e["ts"], e["ts"] + e["dur"])
        for e in gpu
        if e["cat"] == "gpu_memcpy" and e.get("args", {}).get("stream") != main
    )
    longest = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "span_ms": round((end - start) / 1e3, 2),
        "gpu_busy_ms": round(length(union((e["ts"], e["ts"] + e["dur"]) for e in gpu)) / 1e3, 2),
        "stream_busy_ms": {str(s): round(length(union(iv)) / 1e3, 2) for s, iv in streams.items()},
        "main_stream": str(main),
        "main_gaps_ms": round(length(gaps) / 1e3, 2),
        "main_gaps_overlapping_copies_ms": round(overlap(gaps, copies) / 1e3, 2),
        "main_gaps_over_100us": sum(1 for a, b in gaps if b - a > 100),
        "memcpy": {
            k: {"ms": round(v[0] / 1e3, 2), "n": v[1], "GB": round(v[2] / 1e9, 2)} for k, v in copies_by_kind.items()
        },
        "top_kernels_ms": [[name, round(v[0] / 1e3, 2), v[1]] for name, v in longest],
        "kernel_total_ms": round(sum(v[0] for v in kernels.values()) / 1e3, 2),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome trace files (.json or .json.gz)")
    a = p.parse_args(argv)
    print(json.dumps({path: summary(load(path)) for path in a.traces}, indent=1))


if __name__ == "__main__":
    main()
