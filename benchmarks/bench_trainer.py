"""Time train_flux_cp.py itself: one `accelerate launch` per configuration on a FLUX.1-dev-shaped model (random
weights, tiny encoders, the bundled images at the chosen resolution), read back its metrics.jsonl and report the
median `s_per_step` / `mfu` after the warm-up steps, the peak memory, and the CP efficiency against the one-GPU
run of the same resolution and LoRA targets.

    python benchmarks/bench_trainer.py --out results.json RUN [RUN ...]

A RUN is `name:gpus:config:extra trainer flags`, e.g.
`cp2_2048:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile`. Runs of one GPU each go side by side on
separate GPUs when `--parallel` is given (each is timed alone on its GPU); the others one after another.
Every run gets `--transformer_init random --mixed_precision bf16 --gradient_checkpointing --rank 16` (LoRA unless
`--full_finetune` is in its flags) and a fresh folder; it is stopped once its steps are logged (no final save).
With `--fake_peers`, a one-GPU run given `--cp_size N` runs benchmarks/fake_peers.py instead: rank 0 of a CP group
of N whose peers are copies of it (each exchange one local copy), its efficiency taken against N GPUs.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_run(spec: str) -> dict:
    name, gpus, config, extra = spec.split(":", 3)
    return {"name": name, "gpus": int(gpus), "config": config, "extra": extra.split()}


def cp_size(run: dict) -> int:
    flags = run["extra"]
    return int(flags[flags.index("--cp_size") + 1]) if "--cp_size" in flags else 1


def command(run: dict, model: str, work: Path, steps: int, port: int) -> list[str]:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(ROOT / "accelerate_configs" / run["config"]), "--num_processes", str(run["gpus"]),
              "--main_process_port", str(port)]  # fmt: skip
    script = ROOT / ("benchmarks/fake_peers.py" if run.get("fake_peers") else "train_flux_cp.py")
    return [*launch, str(script), "--pretrained_model_name_or_path", model,
            "--transformer_init", "random", "--mixed_precision", "bf16", "--gradient_checkpointing",
            "--rank", "16", "--max_train_steps", str(steps + 50), "--checkpointing_steps", "100000",
            "--report_to", "none", "--output_dir", str(work / run["name"]),
            "--cache_dir", str(work / f"cache_{run['name']}"), *run["extra"]]  # fmt: skip


def start(run: dict, model: str, work: Path, steps: int, gpus: list[int], log_dir: Path) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)))
    log_path = log_dir / f"{run['name']}.log"
    log = open(log_path, "w")
    cmd = command(run, model, work, steps, port=29500 + gpus[0])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return {**run, "proc": proc, "log": log, "log_path": log_path, "t0": time.time()}


def rows(work: Path, name: str) -> list[dict]:
    path = work / name / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finish(job: dict, work: Path, steps: int, warmup: int, timeout: float) -> dict:
    """Wait until the run logged `steps` steps (or ended, or timed out), stop it, summarise its rows."""
    proc = job["proc"]
    while proc.poll() is None and len(rows(work, job["name"])) < steps and time.time() - job["t0"] < timeout:
        time.sleep(2)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    job["log"].close()
    got = rows(work, job["name"])
    result = {k: job[k] for k in ("name", "gpus", "config", "extra")}
    if job.get("fake_peers"):
        result["fake_peers"] = job["fake_peers"]
    profile = work / job["name"] / "profile"  # runs given --profile_step: summaries here, traces beside the logs
    if profile.is_dir():
        result["profile"] = {
            p.name.split("_")[0]: json.loads(p.read_text()) for p in sorted(profile.glob("*_summary.json"))
        }
        trace = profile / "rank0.json"
        if trace.is_file():
            with open(trace, "rb") as src, gzip.open(job["log_path"].with_suffix(".trace.json.gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
    timed = [r for r in got if r["step"] > warmup][: steps - warmup]
    result["wall_s"] = round(time.time() - job["t0"], 1)
    if len(timed) < 2:
        lines = [ln for ln in job["log_path"].read_text().splitlines() if ln.strip() and "Warning" not in ln]
        # The trainer's own one-line refusals ("error: ...") first, then exceptions.
        errors = [ln for ln in lines if ln.startswith("error:")] or [
            ln for ln in lines if "Error" in ln and "error_file" not in ln
        ]
        result["error"] = f"only {len(got)} steps logged (exit {proc.returncode}): " + " | ".join(errors[-3:])
        result["log_tail"] = lines[-40:]
        return result
    result.update(
        steps=len(timed),
        s_per_step=statistics.median(r["s_per_step"] for r in timed),
        mfu=statistics.median(r["mfu"] for r in timed) if all("mfu" in r for r in timed) else None,
        peak_mem_gib=max(r["peak_mem_gib"] for r in timed),
        losses=[r["loss"] for r in got[:steps]],  # the same steps for every run: CP must not change them
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=parse_run)
    p.add_argument("--out", required=True, help="JSON file for the results (appended to when it exists)")
    p.add_argument("--logs", default=None, help="folder for each run's log (default: next to --out)")
    p.add_argument("--steps", type=int, default=8, help="steps logged per run, warm-up included")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=420, help="seconds per run")
    p.add_argument("--parallel", action="store_true", help="run the one-GPU runs side by side, one per GPU")
    p.add_argument("--model", default=None, help="model folder (default: a fresh FLUX.1-dev-shaped one)")
    p.add_argument(
        "--fake_peers",
        action="store_true",
        help="one-GPU runs with --cp_size N: rank 0 of N with loopback peers (benchmarks/fake_peers.py)",
    )
    a = p.parse_args()
    if a.fake_peers:
        for run in a.runs:
            if run["gpus"] == 1 and cp_size(run) > 1:
                run["fake_peers"] = cp_size(run)

    out = Path(a.out)
    log_dir = Path(a.logs) if a.logs else out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_trainer_"))
    model = Path(a.model) if a.model else work / "flux1-dev-shapes"
    if not a.model:
        subprocess.run([sys.executable, "-m", "flux_cp.tiny", "--preset", "flux1-dev-shapes", "--out", str(model)],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    import torch

    n_gpus = torch.cuda.device_count()
    results = json.loads(out.read_text())["runs"] if out.exists() else []
    pending = list(a.runs)
    while pending:
        batch = [pending.pop(0)]
        if a.parallel and batch[0]["gpus"] == 1:
            while pending and pending[0]["gpus"] == 1 and len(batch) < n_gpus:
                batch.append(pending.pop(0))
        jobs, gpu = [], 0
        for run in batch:
            jobs.append(start(run, str(model), work, a.steps, list(range(gpu, gpu + run["gpus"])), log_dir))
            gpu += run["gpus"]
        for job in jobs:
            r = finish(job, work, a.steps, a.warmup, a.timeout)
            r["side_by_side"] = len(batch) > 1
            results.append(r)
            print(json.dumps(r), flush=True)
        out.write_text(json.dumps({"runs": results}, indent=1))
    table(results)


def table(results: list[dict]) -> None:
    """One line per run, with the CP efficiency t1 / (n t_n) against the one-GPU run of the same resolution,
    training kind and compile flags (its name with the `cpN` prefix replaced by `cp1`)."""
    by_name = {r["name"]: r for r in results}
    print(f"{'run':34s} {'gpus':>4s} {'s/step':>7s} {'mfu':>5s} {'GiB':>6s} {'eff':>5s}")
    for r in results:
        if "error" in r:
            print(f"{r['name']:34s} {r['gpus']:4d} error: {r['error'][:80]}")
            continue
        eff = ""
        n = r.get("fake_peers") or r["gpus"]  # a fake-peers run stands for n GPUs
        base = by_name.get("cp1_" + r["name"].split("_", 1)[-1]) if n > 1 else None
        if base and "s_per_step" in base:
            eff = f"{base['s_per_step'] / (n * r['s_per_step']):.2f}"
        mfu = f"{r['mfu']:.0%}" if r["mfu"] is not None else "-"
        print(f"{r['name']:34s} {r['gpus']:4d} {r['s_per_step']:7.3f} {mfu:>5s} {r['peak_mem_gib']:6.1f} {eff:>5s}")


if __name__ == "__main__":
    main()
