"""tools/trace_summary.py on a hand-made trace: the compute stream's gaps, the part of them copies on another stream
cover, busy time per stream and the copies' bytes."""

import gzip
import json

from tools import trace_summary


def _event(cat, name, ts, dur, stream, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, **args}}


def test_gaps_of_the_compute_stream_that_copies_cover(tmp_path):
    events = [
        _event("kernel", "gemm", 0, 100, 7),
        _event("kernel", "gemm", 200, 100, 7),
        _event("kernel", "norm", 300, 50, 7),
        _event("kernel", "norm", 500, 20, 7),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 120, 60, 30, bytes=3_000_000_000),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 360, 200, 30, bytes=1_000_000_000),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # the host's: not the GPU's
    ]
    path = tmp_path / "step.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = trace_summary.summary(trace_summary.load(str(path)))
    assert s["main_stream"] == "7" and s["span_ms"] == 0.56
    assert s["stream_busy_ms"] == {"7": 0.27, "30": 0.26}
    # gaps 100-200 and 350-500 (0.25 ms); copies cover 120-180 and 360-500 of them (0.2 ms); one gap over 100 us
    assert (s["main_gaps_ms"], s["main_gaps_overlapping_copies_ms"], s["main_gaps_over_100us"]) == (0.25, 0.2, 1)
    assert s["memcpy"] == {"Memcpy HtoD (Pinned -> Device)@30": {"ms": 0.26, "n": 2, "GB": 4.0}}
    assert s["top_kernels_ms"][0] == ["gemm", 0.2, 2] and s["kernel_total_ms"] == 0.27
    assert s["gpu_busy_ms"] == 0.51  # 0-100, 120-180, 200-350, 360-560 (the last copy ends after the last kernel)
    assert trace_summary.summary([]) == {"gpu_events": 0}
