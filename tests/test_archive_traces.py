"""benchmarks/archive/trace_exchanges.py on a hand-made trace: exposed exchange time, and exchanges that a matrix
product launched behind them kept waiting."""

from __future__ import annotations

from benchmarks.archive.trace_exchanges import analyse


def _kernel(name: str, ts: float, dur: float, corr: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _launch(ts: float, corr: int) -> dict:
    args = {"correlation": corr}
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5, "args": args}


def test_a_product_launched_behind_an_exchange_that_ran_first_makes_it_late():
    events = [
        _launch(0, 1),  # the exchange is launched first ...
        _launch(10, 2),  # ... the product behind it, yet the product runs first and the exchange starts at its end
        _launch(20, 3),
        _kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 305, 100, 1),
        _kernel("nvjet_gemm", 100, 200, 2),
        _kernel("triton_small", 310, 50, 3),  # beside the exchange for 50 of its 100 us
    ]
    r = analyse(events)
    assert r == {
        "exchanges": 1,
        "exchange_ms": 0.1,
        "exposed_ms": 0.05,
        "late": 1,
        "late_delay_ms": 0.205,
        "late_behind": {"nvjet_gemm": {"count": 1, "delay_ms": 0.205}},  # the product it waited for
    }


def test_an_exchange_waiting_for_its_own_input_is_not_late():
    events = [
        _launch(0, 2),  # the product is launched first: the exchange needs its output
        _launch(10, 1),
        _kernel("nvjet_gemm", 100, 200, 2),
        _kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 305, 100, 1),
    ]
    r = analyse(events)
    assert r["late"] == 0 and r["exposed_ms"] == 0.1 and r["late_behind"] == {}
