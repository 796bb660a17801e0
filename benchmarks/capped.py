"""train_flux_cp.py (or one CP rank with loopback peers, benchmarks/fake_peers.py) on a GPU capped to the memory of a
smaller one: `torch.cuda.set_per_process_memory_fraction` before anything is allocated, to the --gpu_memory_gib the
run is given (the number `--gradient_checkpointing auto` plans for).

    accelerate launch --config_file accelerate_configs/gpu1.yaml -m benchmarks.capped trainer \
        --gpu_memory_gib 48 --gradient_checkpointing ...
    accelerate launch --config_file accelerate_configs/gpu1.yaml -m benchmarks.capped fake_peers \
        --gpu_memory_gib 48 --cp_size 2 ...

(from the repository root). A cap at or above the GPU's memory leaves it uncapped. benchmarks/bench_trainer.py
launches this for every run whose flags hold --gpu_memory_gib.
"""

from __future__ import annotations

import os
import sys

ENTRIES = ("trainer", "fake_peers")


def cap_fraction(cap_gib: float, total_gib: float) -> float:
    """The fraction of the GPU's memory that is `cap_gib` (at most all of it)."""
    return min(1.0, cap_gib / total_gib)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ENTRIES or "--gpu_memory_gib" not in argv:
        raise SystemExit("usage: python -m benchmarks.capped {trainer,fake_peers} --gpu_memory_gib GIB TRAINER_FLAGS")
    entry, flags = argv[0], argv[1:]
    cap = float(flags[flags.index("--gpu_memory_gib") + 1])
    import torch

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(cap_fraction(cap, total), device)
        print(f"benchmarks.capped: {min(cap, total):.1f} of {total:.1f} GiB on {device}", file=sys.stderr)
    if entry == "fake_peers":
        from benchmarks.fake_peers import main as run
    else:
        from train_flux_cp import main as run
    return run(flags)


if __name__ == "__main__":
    from flux_cp.run import runner

    sys.exit(runner.run(main))
