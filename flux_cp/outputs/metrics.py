"""Step metrics: `metrics.jsonl` (one JSON object per optimizer step), speed and model FLOPs utilisation,
and the loss-curve plot (also a command: `python -m flux_cp.metrics metrics.jsonl [out.png]`)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from flux_cp import files, manifest
from flux_cp.terminal import printable

# Dense bf16 tensor-core peaks from NVIDIA's datasheets (FLOP/s; the sheets quote twice these "with sparsity"),
# by the name torch.cuda.get_device_name gives. Matched in order: the first entry contained in the name wins.
DATASHEET_BF16_PEAKS = (
    ("H200 NVL", 835e12),
    ("H200", 989e12),  # H200 SXM
    ("GH200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # H100 SXM (HBM3)
    ("B200", 2250e12),
    ("A100", 312e12),
)


def datasheet_peak(device_name: str) -> float | None:
    for name, flops in DATASHEET_BF16_PEAKS:
        if name.lower() in device_name.lower():
            return flops
    return None


def peak_flops(device: torch.device) -> tuple[float, str] | None:
    """The bf16 peak FLOP/s MFU and HFU are measured against, and where it comes from: the GPU's datasheet, or for
    a GPU not in `DATASHEET_BF16_PEAKS` a measured 8192^3 bf16 matmul (named as such). None on CPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    flops = datasheet_peak(name)
    if flops is not None:
        return flops, f"{name}: datasheet dense bf16 peak {flops / 1e12:.0f} TFLOP/s"
    flops = measure_matmul_peak(device)
    return flops, f"{name}: not in the datasheet table; measured bf16 matmul peak {flops / 1e12:.0f} TFLOP/s"


def measure_matmul_peak(device: torch.device) -> float | None:
    """bf16 dense matmul FLOP/s of this GPU (8192^3, mean of 10 after warm-up); None on CPU."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 10 * 2 * 8192**3 / (start.elapsed_time(end) / 1e3)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: process peak RSS
    except ImportError:  # pragma: no cover
        return float("nan")


def memory_row(device: torch.device) -> dict:
    """A step's memory columns: the peak allocated (peak RSS on the CPU) and, on a GPU, what the caching allocator holds
    and how often it had to free its cache and retry (a run planned near a memory cap pays a sync for each retry)."""
    row = {"peak_mem_gib": peak_memory_gib(device)}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        row["reserved_gib"] = stats.get("reserved_bytes.all.peak", 0) / 2**30
        row["alloc_retries"] = stats.get("num_alloc_retries", 0)
    return row


class MetricsLog:
    """Appends one JSON object per optimizer step to `<output_dir>/metrics.jsonl` (main process).
    On resume the file is cut back to the checkpoint's step, so it always holds one trajectory."""

    def __init__(self, output_dir: str, resume_step: int, enabled: bool):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = enabled
        if not enabled:
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step] if resume_step else []
        manifest.record(output_dir, self.path.name)
        files.write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        # Appended to without following a link put in its place since (a link would redirect the rows elsewhere).
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        self._f = open(fd, "a", buffering=1)

    def write(self, row: dict) -> None:
        if self.enabled:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self.enabled:
            self._f.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    rows = []
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue  # a line cut by a crash
    return rows


def plot_loss_curve(metrics_path: str | os.PathLike, out_png: str | os.PathLike, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if "loss" in r]
    if not rows:
        raise ValueError(f"{metrics_path} holds no loss values")
    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, loss, lw=0.8, alpha=0.5, label="loss")
    if len(loss) >= 10:
        k = max(2, len(loss) // 20)
        smooth = [sum(loss[max(0, i - k + 1) : i + 1]) / len(loss[max(0, i - k + 1) : i + 1]) for i in range(len(loss))]
        ax.plot(steps, smooth, lw=1.6, label=f"mean of last {k}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("flow-matching loss")
    # The title is a path: its control characters escaped, and its `$` taken as text, not as the start of math
    ax.set_title(printable(title or str(metrics_path)).replace("$", r"\$"))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    files.write_with(out_png, lambda tmp: fig.savefig(tmp, format="png"))  # atomic, and never through a link
    plt.close(fig)
    return Path(out_png)


class StepTimer:
    """Seconds per step as the device ran them: from the end of one step to the end of the next. On a GPU a
    step's end is a CUDA event (`mark`), so timing a step makes the host wait for that step alone, not for the
    next one it has queued behind it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.last = self.mark()

    def mark(self) -> torch.cuda.Event | float:
        """The end of what has been queued so far."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()  # on the CPU every operation has finished when it returns

    def seconds(self, end: torch.cuda.Event | float) -> float:
        """Time from the previous step's end to `end` (waits for `end`); marks are read in the order made."""
        if isinstance(end, float):
            dt = end - self.last
        else:
            end.synchronize()
            dt = self.last.elapsed_time(end) / 1e3
        self.last = end
        return dt

    def restart(self) -> None:
        """After validation or a checkpoint: the next step's time starts now, without them."""
        self.last = self.mark()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m flux_cp.metrics METRICS_JSONL [OUT_PNG]")
        return 0 if argv else 2
    out = argv[1] if len(argv) > 1 else str(Path(argv[0]).with_name("loss_curve.png"))
    print(plot_loss_curve(argv[0], out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
