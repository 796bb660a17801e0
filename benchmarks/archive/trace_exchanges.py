"""Where a profiled step's CP exchanges lose time, from rank 0's trace of `train_flux_cp.py --profile_step N`
(benchmarks/bench_trainer.py keeps it next to the run's log as NAME.trace.json.gz).

    python -m benchmarks.archive.trace_exchanges \
        benchmarks/archive/results/2026-12-01-h200x2-fill/cp2_2048_fill.trace.json.gz

For the exchange kernels (NCCL's send/receive kernels, which carry the all-to-alls) it prints their count and time,
how much of that time no compute kernel ran beside (exposed), and how many started late: after a compute kernel of
more than 50 us that the host launched *after* the exchange ran first on the GPU. Such an exchange had its input
(the compute stream runs in order, and the product came later on it), yet it began only when the product ended:
most likely the product held every streaming multiprocessor. The scheduling pass (flux_cp/overlap.py) decides the
order on the host; this is what the GPU made of it.
"""

from __future__ import annotations

import argparse
import bisect
import json

from flux_cp.outputs.profiling import intersection, length, load_trace, union


def analyse(events: list[dict], long_us: float = 50.0) -> dict:
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    # by NCCL's name only: Inductor names some compute kernels after a fused all_to_all view
    exchanges = [k for k in kernels if "nccl" in k["name"].lower() and "SendRecv" in k["name"]]
    compute = [k for k in kernels if "nccl" not in k["name"].lower()]
    starts = [k["ts"] for k in compute]
    spans = union([(x["ts"], x["ts"] + x["dur"]) for x in exchanges])
    total = length(spans)
    exposed = total - intersection(spans, union([(k["ts"], k["ts"] + k["dur"]) for k in compute]))
    behind: dict[str, list[float]] = {}  # the kernel each late exchange waited for: count and delay by name
    for x in exchanges:
        issued = launches.get(x["args"].get("correlation"))
        if issued is None:
            continue
        issued_end = issued["ts"] + issued["dur"]
        ahead = [
            k
            for k in compute[bisect.bisect_left(starts, x["ts"] - 50_000) : bisect.bisect_left(starts, x["ts"])]
            if k["dur"] > long_us
            and k["ts"] + k["dur"] > x["ts"] - 15  # it ended just before the exchange began
            and (lk := launches.get(k["args"].get("correlation"))) is not None
            and lk["ts"] > issued_end  # and the host launched it after the exchange
        ]
        if ahead:
            first = min(ahead, key=lambda k: k["ts"])
            behind.setdefault(first["name"][:60], []).append(x["ts"] - first["ts"])
    delays = [d for ds in behind.values() for d in ds]
    return {
        "exchanges": len(exchanges),
        "exchange_ms": round(total / 1e3, 3),
        "exposed_ms": round(exposed / 1e3, 3),
        "late": len(delays),
        "late_delay_ms": round(sum(delays) / 1e3, 3),
        "late_behind": {
            name: {"count": len(ds), "delay_ms": round(sum(ds) / 1e3, 3)}
            for name, ds in sorted(behind.items(), key=lambda kv: -sum(kv[1]))
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a profiler trace (.json or .json.gz)")
    p.add_argument("--long_us", type=float, default=50.0, help="a compute kernel this long counts as taking the GPU")
    args = p.parse_args()
    r = analyse(load_trace(args.trace), args.long_us)
    print(json.dumps(r))
    print(
        f"{r['exchanges']} exchange kernels, {r['exchange_ms']:.1f} ms, "
        f"{r['exposed_ms']:.1f} ms with no compute beside; "
        f"{r['late']} started only after a longer kernel launched behind them ran "
        f"(together {r['late_delay_ms']:.1f} ms late)"
    )


if __name__ == "__main__":
    main()
