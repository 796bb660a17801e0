"""Run train_flux_cp.py as users do: `accelerate launch` for several processes, plain python for one."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "train_flux_cp.py"
CPU_CONFIG = ROOT / "accelerate_configs" / "cpu_cp2.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict:
    e = dict(os.environ)
    e.update(
        {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    )
    e.update(extra)
    return e


def launch_cmd(nproc: int, *args: str, launcher: tuple[str, ...] = ()) -> list[str]:
    """`accelerate launch` of train_flux_cp.py with the CPU config (plain python for one process)."""
    if nproc == 1 and not launcher:
        return [sys.executable, str(SCRIPT), *args]
    port = () if "--main_process_port" in launcher else ("--main_process_port", str(free_port()))
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG),
            "--num_processes", str(nproc), *port, *launcher, str(SCRIPT), *args]  # fmt: skip


def train(nproc: int, *args: str, timeout: float = 600, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(launch_cmd(nproc, *args), cwd=ROOT, env=env(**(extra_env or {})), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


_STDERR = io.StringIO()  # one for every call: loggers set up by an earlier call keep writing to it


def in_process(argv: list[str]) -> tuple[int, str]:
    """The trainer's entry point as `python train_flux_cp.py` runs it, in this process (a second or two instead
    of the ~8 s of a new interpreter importing torch, diffusers and transformers): (exit code, stderr)."""
    import train_flux_cp
    from flux_cp import runner

    _STDERR.seek(0)
    _STDERR.truncate()
    with contextlib.redirect_stderr(_STDERR):
        try:
            code = runner.run(lambda: train_flux_cp.main(argv))
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
    return code, _STDERR.getvalue()


def run_args(tmp: Path, name: str, steps: int, *extra: str, cache: bool = True) -> list[str]:
    """Flags every test run shares: its own output folder, the test's encoding cache, no trackers."""
    cache_flags = ["--cache_dir", str(tmp / "cache")] if cache else []
    return ["--output_dir", str(tmp / name), *cache_flags, "--report_to", "none", "--max_train_steps", str(steps),
            *extra]  # fmt: skip


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    out, err = result.stdout[-4000:], result.stderr[-8000:]
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    return result


def losses(output_dir: str | Path) -> list[float]:
    with open(Path(output_dir) / "metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def max_rel_weights(a: str | Path, b: str | Path) -> float:
    """Relative L2 error between two runs' LoRA weights, over all of them and over the B matrices alone (they start
    at zero, so their norm is the training update itself). Per-element comparison would measure Adam's
    normalisation of near-zero gradient elements, whose fp32 summation-order noise it scales up to the step size."""
    import torch
    from safetensors.torch import load_file

    wa, wb = (load_file(Path(r) / "pytorch_lora_weights.safetensors") for r in (a, b))
    assert wa.keys() == wb.keys() and len(wa) > 0

    def flat(w: dict, part: str) -> torch.Tensor:
        return torch.cat([w[k].flatten().double() for k in sorted(w) if part in k])

    return max(((flat(wa, p) - flat(wb, p)).norm() / flat(wb, p).norm()).item() for p in ("", "lora_B"))
