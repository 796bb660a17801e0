"""Turn a folder of raw benchmark outputs into benchmarks/results/<name>.json and docs/benchmarks.md (+ PNG),
and the equivalence runs into docs/equivalence.md (+ PNG).

    python benchmarks/report.py benchmarks/results/2026-11-29-h200x4

Raw inputs in the folder: attention.json (bench_attention.py), model_*.json (bench_model.py runs, merged by
run_model_bench.sh), equivalence_A.jsonl / equivalence_B.jsonl (metrics of benchmarks/equivalence.sh).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def load_model_rows(folder: Path) -> tuple[list[dict], dict]:
    rows, env = [], {}
    for path in sorted(glob.glob(str(folder / "model_*.json"))):
        d = json.load(open(path))
        runs = d.get("runs", [d])
        for run in runs:
            env = env or run.get("env", {})
            for row in run["rows"]:
                rows.append(
                    {
                        **row,
                        "source": os.path.basename(path),
                        "argv": " ".join(run.get("argv", [])),
                        "matmul_peak_tflops": run.get("matmul_peak_tflops"),
                    }
                )
    return rows, env


def best(rows: list[dict], **match) -> dict | None:
    cands = [
        r
        for r in rows
        if all(r.get(k) == v for k, v in match.items())
        and r.get("s_per_step") == r.get("s_per_step")
        and r.get("error") is None
    ]
    return min(cands, key=lambda r: r["s_per_step"]) if cands else None


def render_benchmarks(folder: Path, out_json: Path) -> None:
    attention = json.load(open(folder / "attention.json"))
    rows, env = load_model_rows(folder)
    # one-GPU time per resolution: the fastest of our cp=1 runs
    t1 = {res: best(rows, impl="ours", cp=1, dp=1, res=res) for res in (1024, 2048, 4096)}
    for r in rows:
        base = t1.get(r["res"])
        r["efficiency_vs_our_1gpu"] = (
            (base["s_per_step"] / (r["gpus"] * r["s_per_step"])) if base and r["samples_per_step"] == 1 else None
        )
    summary = {
        "name": folder.name,
        "env": env,
        "attention_env": attention["env"],
        "kernels": attention["kernels"],
        "attention": attention["rows"],
        "model": rows,
    }
    out_json.write_text(json.dumps(summary, indent=1))

    lines = [
        "# Benchmarks",
        "",
        f"Measured on {env.get('gpus')}x {env.get('gpu')} (driver {env.get('driver')}), torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, diffusers {env.get('diffusers')}, accelerate "
        f"{env.get('accelerate')}, peft {env.get('peft')}, on {env.get('date')}. Raw outputs: "
        f"`benchmarks/results/{folder.name}/`; combined: `benchmarks/results/{out_json.name}`. "
        "Rendered by `python benchmarks/report.py benchmarks/results/" + folder.name + "`.",
        "",
        "## Attention level (forward + backward, bf16, batch 1, 24 heads x 128)",
        "",
        "Command: `torchrun --nproc_per_node 4 benchmarks/bench_attention.py --ulysses_chunks 1 2 4 --profile "
        "--out attention.json` (median of 10 after 3 warm-ups; a CP time is its slowest rank's). Efficiency = "
        "t1 / (n x tn) against one-GPU cuDNN SDPA on the full sequence. The profile columns are one profiled step: "
        "summed GPU time of compute kernels and of NCCL kernels; wall close to compute means the communication "
        "is hidden.",
        "",
        "| tokens | GPUs | implementation | ms | efficiency | profile wall / compute / NCCL ms |",
        "|---:|---:|---|---:|---:|---|",
    ]
    for r in attention["rows"]:
        prof = r.get("profile")
        p = f"{prof['wall_ms']:.1f} / {prof['compute_kernels_ms']:.1f} / {prof['nccl_kernels_ms']:.1f}" if prof else ""
        eff = f"{r['efficiency']:.3f}" if r.get("efficiency") else ""
        lines.append(f"| {r['tokens']} | {r['gpus']} | {r['impl']} | {r['s'] * 1e3:.2f} | {eff} | {p} |")
    lines += [
        "",
        "## Model level (FLUX.1-dev config, random weights, bf16, gradient checkpointing, LoRA r16 on attention)",
        "",
        "One optimizer step per iteration; s/step is the median over the timed steps of the slowest rank; MFU counts "
        "the FLOPs the step executes (recomputation included, DESIGN.md) against the bf16 matmul peak measured in the "
        "same process; memory is the peak allocated per GPU. Ours: `cp.apply_context_parallel` + FSDP2 (weights "
        "sharded over all GPUs). diffusers: 0.42.1 `enable_parallelism` with the named attention backend, weights "
        "replicated. Commands: `benchmarks/run_model_bench.sh lora` (each row's exact argv is in the JSON).",
        "",
        "| res | GPUs | implementation | s/step | tokens/s/GPU | MFU | peak GiB/GPU | efficiency vs our 1 GPU |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["train"], r["res"], r["gpus"], r["impl"] != "ours", r["mode"])):
        name = (
            ("ours " if r["impl"] == "ours" else "diffusers ")
            + r["mode"]
            + (" (full FT)" if r["train"] == "full" else "")
        )
        eff = f"{r['efficiency_vs_our_1gpu']:.2f}" if r.get("efficiency_vs_our_1gpu") else ""
        mfu = f"{r['mfu']:.0%}" if r.get("mfu") else ""
        lines.append(
            f"| {r['res']} | {r['gpus']} | {name} | {r['s_per_step']:.3f} | {r['tokens_per_s_per_gpu']:.0f} "
            f"| {mfu} | {r['peak_mem_gib']:.1f} | {eff} |"
        )
    lines += ["", "![speed-up](benchmarks.png)", ""]
    lines += targets(attention["rows"], rows)
    plot(attention["rows"], rows, DOCS / "benchmarks.png")
    (DOCS / "benchmarks.md").write_text("\n".join(lines) + "\n")


def targets(att: list[dict], rows: list[dict]) -> list[str]:
    """The issue's targets, each with its measured value and verdict."""

    def a(tokens, gpus):
        return max(
            (r["efficiency"] for r in att if r["tokens"] == tokens and r["gpus"] == gpus and r.get("efficiency")),
            default=None,
        )

    t1 = {res: best(rows, impl="ours", cp=1, dp=1, res=res) for res in (1024, 2048)}
    ours2 = {res: best(rows, impl="ours", gpus=2, dp=1, res=res, train="lora") for res in (1024, 2048)}
    diff2 = {res: best(rows, impl="diffusers", gpus=2, res=res) for res in (1024, 2048)}
    eff = {res: t1[res]["s_per_step"] / (2 * ours2[res]["s_per_step"]) for res in (1024, 2048)}
    vs = ours2[2048]["s_per_step"] and diff2[2048]["s_per_step"] / ours2[2048]["s_per_step"]

    def v(ok):
        return "met" if ok else "**missed**"

    out = [
        "## Targets (issue 5)",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
        f"| 2048 px LoRA, cp=2 efficiency t1/(2 t2) >= 0.90 | {eff[2048]:.2f} ({ours2[2048]['s_per_step']:.3f} s vs "
        f"{t1[2048]['s_per_step']:.3f} s on 1 GPU, {ours2[2048]['mode']}) | {v(eff[2048] >= 0.9)} |",
        f"| 2048 px LoRA, cp=2 >= 1.2x faster than diffusers' fastest built-in CP | {vs:.2f}x (diffusers "
        f"{diff2[2048]['mode']} {diff2[2048]['s_per_step']:.3f} s) | {v(vs >= 1.2)} |",
        f"| 1024 px LoRA, cp=2 efficiency >= 0.75 | {eff[1024]:.2f} ({ours2[1024]['s_per_step']:.3f} s vs "
        f"{t1[1024]['s_per_step']:.3f} s; diffusers {diff2[1024]['s_per_step']:.3f} s) | {v(eff[1024] >= 0.75)} |",
        f"| attention, 16,896 tokens, efficiency >= 0.90 (cp=2) | {a(16896, 2):.3f} | {v(a(16896, 2) >= 0.9)} |",
        f"| attention, 66,048 tokens, efficiency >= 0.97 (cp=2) | {a(66048, 2):.3f} | {v(a(66048, 2) >= 0.97)} |",
        f"| MFU >= 50% at 2048 px, cp=2 | {ours2[2048]['mfu']:.0%} | {v(ours2[2048]['mfu'] >= 0.5)} |",
        f"| activation memory per GPU close to 1/cp | peak {t1[2048]['peak_mem_gib']:.1f} / "
        f"{ours2[2048]['peak_mem_gib']:.1f} / "
        f"{(best(rows, impl='ours', gpus=4, res=2048) or {}).get('peak_mem_gib', float('nan')):.1f} GiB per GPU "
        "at cp = 1 / 2 / 4 (2048 px; weights sharded by FSDP at cp >= 2) | see notes |",
        "| full fine-tuning of the 12B transformer at 2048 px on two H200s | not run (GPU time ran out) | "
        "**not measured** |",
        "",
        "Why the step-time targets were missed, and what would close the gap, is in `benchmarks/NOTES.md`. Not run "
        "in this session (its 30 minutes of GPU time were spent): 4096 px at model level, full fine-tuning rows, "
        "`--compile`, and anything on 8 GPUs (none was lent). The cp=2/cp=4 rows of ours come from a second call on "
        "a 4x H200 machine of the same kind, after a fix to FSDP2 + gradient checkpointing; the cp=1 and diffusers "
        "rows from the first.",
        "",
    ]
    return out


def plot(att_rows: list[dict], rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for res, color in ((1024, "tab:blue"), (2048, "tab:orange")):
        base = best(rows, impl="ours", cp=1, dp=1, res=res)
        if not base:
            continue
        for impl, style in (("ours", "-o"), ("diffusers", "--s")):
            pts = [(1, 1.0)] if impl == "ours" else []
            for n in (2, 4, 8):
                r = best(rows, impl=impl, res=res, gpus=n, dp=1, train="lora")
                if r:
                    pts.append((n, base["s_per_step"] / r["s_per_step"]))
            if pts:
                a.plot(*zip(*pts), style, color=color, label=f"{impl} {res} px")
    a.plot([1, 4], [1, 4], ":", color="gray", label="linear")
    a.set_xlabel("GPUs (one CP group)")
    a.set_ylabel("speed-up over our 1-GPU step")
    a.set_title("LoRA step, FLUX.1-dev size")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    tokens = sorted({r["tokens"] for r in att_rows})
    for n, marker in ((2, "o"), (4, "s")):
        for impl in ("ring", "ulysses[chunks=1]"):
            pts = [
                (t, r["efficiency"])
                for t in tokens
                for r in att_rows
                if r["tokens"] == t and r["gpus"] == n and r["impl"] == impl
            ]
            if pts:
                b.plot(*zip(*pts), marker=marker, label=f"cp={n} {impl}")
    b.set_xscale("log")
    b.set_xlabel("total tokens (1024 / 2048 / 4096 px)")
    b.set_ylabel("efficiency t1 / (n tn)")
    b.set_title("attention fwd+bwd")
    b.axhline(1.0, color="gray", ls=":")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def render_equivalence(folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = [json.loads(x) for x in open(folder / "equivalence_A.jsonl") if x.strip()]
    b = [json.loads(x) for x in open(folder / "equivalence_B.jsonl") if x.strip()]
    n = min(len(a), len(b))
    rel = [abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a[:n], b[:n])]
    fig, (p, q) = plt.subplots(2, 1, figsize=(8, 6), dpi=120, sharex=True)
    p.plot([x["step"] for x in a], [x["loss"] for x in a], lw=1.2, label="A: dp=2 x cp=1 (2 GPUs)")
    p.plot([x["step"] for x in b], [x["loss"] for x in b], lw=1.0, ls="--", label="B: dp=2 x cp=2 (4 GPUs)")
    p.set_ylabel("loss")
    p.legend()
    p.grid(alpha=0.3)
    q.semilogy(range(1, n + 1), [max(r, 1e-9) for r in rel], lw=0.8)
    q.set_ylabel("|A - B| / |A|")
    q.set_xlabel("optimizer step")
    q.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(DOCS / "equivalence.png")
    plt.close(fig)
    worst = max(range(n), key=lambda i: rel[i])
    lines = [
        "# Loss equivalence at FLUX.1-dev size: CP on and off",
        "",
        "Run by `benchmarks/equivalence.sh 2 200` on one 4x H200 machine (2026-11-29; torch 2.11, diffusers 0.42.1, "
        "accelerate 1.15, FSDP2). The same training through `train_flux_cp.py`, twice:",
        "",
        "- Task A: dp=2 x cp=1 on 2 GPUs (`accelerate_configs/fsdp2_cp2.yaml`, `--cp_size 1`)",
        "- Task B: dp=2 x cp=2 on 4 GPUs (`accelerate_configs/fsdp2_dp2_cp2.yaml`, `--cp_size 2`, Ulysses)",
        "",
        "Both: a transformer with the FLUX.1-dev config and seeded random weights (`--transformer_init random`), "
        "tiny matching encoders (`python -m flux_cp.tiny --preset flux1-dev-shapes`), the bundled data set at "
        "1024 px, LoRA r16, bf16, `--deterministic`, seed 0, batch 1 per data-parallel rank, one seed checkpoint "
        "(written by A, read by B). The exact flags are in `benchmarks/equivalence.sh`.",
        "",
        f"Both tasks ran out of the session's GPU time before step 200: A reached step {len(a)}, B step {len(b)}; "
        f"the comparison covers the {n} steps both completed.",
        "",
        "| steps compared | max relative loss difference | at step | mean relative difference |",
        "|---:|---:|---:|---:|",
        f"| {n} | {max(rel):.2e} | {worst + 1} | {sum(rel) / n:.2e} |",
        "",
        "Per-step losses of the first steps (A, B): "
        + ", ".join(f"{x['loss']:.5f} / {y['loss']:.5f}" for x, y in zip(a[:5], b[:5]))
        + f". Mean relative difference over the first 20 steps {sum(rel[:20]) / 20:.1e}, over the last 20 "
        f"{sum(rel[-20:]) / 20:.1e}: bf16 rounding that drifts slowly, no divergence.",
        "",
        "One defect affected both tasks alike: gradient clipping was not applied and the logged `grad_norm` read "
        "0, because the script clipped the parameter list taken before FSDP2 replaced the parameters (fixed "
        "after this run: the list is now taken after `accelerator.prepare`).",
        "",
        "![loss curves](equivalence.png)",
        "",
        "Not run: the 8-GPU comparison (dp=2 x cp=4), because no 8-GPU machine was lent (issue 7).",
    ]
    (DOCS / "equivalence.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    folder = Path(argv[0]).resolve()
    DOCS.mkdir(exist_ok=True)
    render_benchmarks(folder, folder.parent / f"{folder.name}.json")
    if (folder / "equivalence_A.jsonl").is_file():
        render_equivalence(folder)
    print(DOCS / "benchmarks.md", DOCS / "equivalence.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
