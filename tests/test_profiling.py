"""--profile_step's summary: GPU time by kernel kind and how much communication overlapped compute."""

from __future__ import annotations

import json

import pytest

from flux_cp.outputs.profiling import idle_gaps, kernel_kind, main, streams, summarize


def _k(name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_kernel_kinds():
    assert kernel_kind("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "communication"
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
    assert kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "matmul"
    assert kernel_kind("triton_poi_fused_add_mul_0") == "other"
    # Inductor names some compute kernels after a fused all_to_all view: they are not communication
    assert kernel_kind("triton_poi_fused__fused_rms_norm__to_copy__unsafe_view_add_all_to_all_single_clone") == "other"
    assert kernel_kind("triton_tem_fused_mm_3") == "matmul"


def test_summary_counts_overlap_idle_and_kinds():
    events = [
        _k("nvjet_gemm", 0, 100),  # compute 0-100
        _k("ncclDevKernel_SendRecv", 50, 100, stream=20),  # comm 50-150: 50 overlapped, 50 exposed
        _k("cudnn_sdpa_fprop", 200, 100),  # idle 150-200
        _k("ncclDevKernel_SendRecv", 210, 40, stream=20),  # fully hidden
        _k("triton_poi_fused", 290, 20),  # overlaps the attention by 10
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # not a kernel: ignored
    ]
    s = summarize(events)
    assert s["kernels"] == 5
    assert s["span_ms"] == pytest.approx(0.310)
    assert s["busy_ms"] == pytest.approx(0.260)
    assert s["idle_ms"] == pytest.approx(0.050)
    assert s["communication_ms"] == pytest.approx(0.140)
    assert s["matmul_ms"] == pytest.approx(0.100) and s["attention_ms"] == pytest.approx(0.100)
    assert s["communication_exposed_ms"] == pytest.approx(0.050)
    assert s["communication_hidden"] == pytest.approx(90 / 140, abs=1e-3)


def test_summary_without_kernels():
    assert summarize([{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 5}]) == {"kernels": 0}


def test_idle_gaps_are_the_longest_stretches_without_a_kernel_and_name_the_host_work_beside_them():
    events = [
        _k("nvjet_gemm", 0, 100),
        _k("triton_poi_fused", 400, 100),  # 300 us without a kernel before it
        _k("ncclDevKernel_SendRecv", 450, 100, stream=20),  # overlaps: no gap
        _k("cudnn_sdpa_fprop", 700, 100),  # 150 us gap
        _k("nvjet_gemm", 850, 10),  # 50 us: below min_us
        {"ph": "X", "cat": "cpu_op", "name": "Optimizer.step#AdamW.step", "ts": 90, "dur": 300},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add_", "ts": 120, "dur": 5},  # too short to explain the gap
        {"ph": "X", "cat": "cpu_op", "name": "aten::randn", "ts": 560, "dur": 130},
    ]
    gaps = idle_gaps(events, count=5, min_us=100)
    assert [g["ms"] for g in gaps] == [0.3, 0.15]
    assert [g["at_ms"] for g in gaps] == [0.1, 0.55]
    assert gaps[0]["host"] == ["Optimizer.step#AdamW.step"] and gaps[1]["host"] == ["aten::randn"]
    assert idle_gaps(events, count=1) == gaps[:1]
    assert idle_gaps([{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 5}]) == []


def _copy(ts: float, dur: float, nbytes: int, stream: int = 30) -> dict:
    args = {"stream": stream, "bytes": nbytes}
    return {
        "ph": "X",
        "cat": "gpu_memcpy",
        "name": "Memcpy HtoD (Pinned -> Device)",
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def test_streams_say_how_long_the_compute_stream_waited_beside_copies(tmp_path, capsys):
    """The compute stream's gaps, the part of them copies on another stream cover (a step waiting for offloaded
    blocks), busy time per stream, the copies' bytes and the longest kernels; and the command prints them."""
    events = [
        _k("gemm", 0, 100),
        _k("gemm", 200, 100),
        _k("norm", 300, 50),
        _k("norm", 500, 20),
        _copy(120, 60, 3_000_000_000),
        _copy(360, 200, 1_000_000_000),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # the host's: not the GPU's
    ]
    s = streams(events)
    assert s["main_stream"] == "7" and s["stream_busy_ms"] == {"7": 0.27, "30": 0.26}
    # gaps 100-200 and 350-500 (0.25 ms); copies cover 120-180 and 360-500 of them (0.2 ms); one gap over 100 us
    assert (s["main_gaps_ms"], s["main_gaps_overlapping_copies_ms"], s["main_gaps_over_100us"]) == (0.25, 0.2, 1)
    assert s["memcpy"] == {"Memcpy HtoD (Pinned -> Device)@30": {"ms": 0.26, "n": 2, "GB": 4.0}}
    assert s["top_kernels_ms"] == [["gemm", 0.2, 2], ["norm", 0.07, 2]]
    assert streams([]) == {}
    trace = tmp_path / "step.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    main([str(trace)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["streams"] == s and printed["kernels"] == 4
