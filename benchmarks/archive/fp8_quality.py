"""How far `--fp8` moves training from bf16: two runs of the same flags, seed, data and noise, one with --fp8. The
mean relative difference of their per-step losses, the cosine between their LoRA updates (every adapter's
delta B @ A x alpha / rank, flattened into one vector), and a plot of both loss curves.

    python -m benchmarks.fp8_quality BF16_DIR FP8_DIR --out RESULTS/fp8_quality.json [--plot RESULTS/fp8_quality.png]

Each folder is a finished run's --output_dir (metrics.jsonl, pytorch_lora_weights.safetensors). The bar --fp8 must
pass to ship: losses within 1% on average, update cosine >= 0.99. Writes the suite's schema (benchmarks/schema.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks import schema

LOSS_BAR, COSINE_BAR = 0.01, 0.99


def losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in sorted(rows, key=lambda r: r["step"])]


def mean_relative_difference(reference: list[float], other: list[float]) -> float:
    if len(reference) != len(other) or not reference:
        raise ValueError(f"the runs logged {len(reference)} and {len(other)} steps: compare runs of the same length")
    return sum(abs(b - a) / abs(a) for a, b in zip(reference, other)) / len(reference)


def lora_deltas(run: Path) -> dict[str, torch.Tensor]:
    """{module: its LoRA update B @ A x alpha / rank} of a run's pytorch_lora_weights.safetensors (alpha as in the
    run's run_config.json, else the rank)."""
    from safetensors.torch import load_file

    weights = load_file(run / "pytorch_lora_weights.safetensors")
    config = run / "run_config.json"
    settings = json.loads(config.read_text()) if config.is_file() else {}
    out = {}
    for key, a in weights.items():
        if ".lora_A." not in key:
            continue
        b = weights[key.replace(".lora_A.", ".lora_B.")]
        rank = a.shape[0]
        scale = settings.get("lora_alpha", rank) / rank
        out[key.split(".lora_A.")[0]] = (b.double() @ a.double()) * scale
    return out


def update_cosine(reference: Path, other: Path) -> float:
    da, db = lora_deltas(reference), lora_deltas(other)
    if da.keys() != db.keys() or not da:
        raise ValueError("the runs' LoRA files hold different adapters")
    a = torch.cat([da[k].flatten() for k in sorted(da)])
    b = torch.cat([db[k].flatten() for k in sorted(da)])
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def plot(reference: list[float], other: list[float], labels: tuple[str, str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(reference) + 1)
    ax.plot(steps, reference, label=labels[0], linewidth=1)
    ax.plot(steps, other, label=labels[1], linewidth=1, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(bf16: Path, fp8: Path) -> dict:
    la, lb = losses(bf16), losses(fp8)
    difference, cosine = mean_relative_difference(la, lb), update_cosine(bf16, fp8)
    return {"name": fp8.name, "steps": len(la), "mean_rel_loss_diff": round(difference, 5),
            "lora_update_cosine": round(cosine, 5), "loss_bar": LOSS_BAR, "cosine_bar": COSINE_BAR,
            "passes": difference <= LOSS_BAR and cosine >= COSINE_BAR,
            "final_loss_bf16": la[-1], "final_loss_fp8": lb[-1]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bf16", type=Path, help="the bf16 run's --output_dir")
    p.add_argument("fp8", type=Path, help="the --fp8 run's --output_dir")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--plot", type=Path, default=None, help="PNG of both loss curves (default: beside --out)")
    a = p.parse_args(argv)
    row = compare(a.bf16, a.fp8)
    figure = a.plot or a.out.with_suffix(".png")
    plot(losses(a.bf16), losses(a.fp8), ("bf16", f"fp8 ({a.fp8.name})"), figure)
    settings = {"bf16": str(a.bf16), "fp8": str(a.fp8), "plot": figure.name}
    keys = ("fp8", "resolution", "seed", "learning_rate", "rank", "max_train_steps", "compile_mode",
            "checkpointed_blocks")  # fmt: skip
    for run in (a.bf16, a.fp8):
        config = run / "run_config.json"
        if config.is_file():
            settings[f"flags_{run.name}"] = {k: v for k, v in json.loads(config.read_text()).items() if k in keys}
    command = schema.command_line(argv, "benchmarks.fp8_quality")
    schema.write(a.out, schema.result("fp8_quality", [row], command=command, settings=settings))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
