"""Time train_flux_cp.py itself: one `accelerate launch` per configuration on a FLUX.1-dev-shaped model (random
weights, tiny encoders, the bundled images at the chosen resolution), read back its metrics.jsonl and report the
median `s_per_step` / `mfu` after the warm-up steps, the peak memory, and the CP efficiency against the one-GPU
run of the same resolution and LoRA targets.

    python -m benchmarks.bench_trainer --out trainer.json RUN [RUN ...]

A RUN is `name:gpus:config:extra trainer flags`, e.g.
`cp2_2048:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile`. Runs of one GPU each go side by side on
separate GPUs when `--parallel` is given (each is timed alone on its GPU); the others one after another.
Every run gets `--transformer_init random --mixed_precision bf16 --gradient_checkpointing --rank 16` (LoRA unless
`--full_finetune` is in its flags; `--gradient_checkpointing` alone is `auto`: the fewest blocks checkpointed that
fit the GPU, a run's own `--gradient_checkpointing N` overrides it) and a fresh folder; it is told it runs 1000 steps
(RUN_STEPS: `--compile auto` then decides as for a user's run) and stopped once its steps are logged (no final
save). A run whose flags hold `--gpu_memory_gib` runs capped to that much GPU memory (benchmarks/capped.py).
The efficiency of a run on N GPUs is t1 / (N tN) against the one-GPU run of the same flags (less `--cp_size`).
With `--fake_peers`, a one-GPU run given `--cp_size N` runs benchmarks/fake_peers.py instead: rank 0 of a CP group
of N whose peers are copies of it (each exchange one local copy), its efficiency taken against N GPUs.
The results go to --out in the suite's schema (benchmarks/schema.py), rewritten after each run; each row holds the
exact trainer command (MODEL and WORK stand for the model folder and a temporary folder).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import schema

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = {
    "name": "run",
    "flags": "flags",
    "gpus": "GPUs",
    "s_per_step": "s/step",
    "mfu": "MFU",
    "peak_gib": "peak GiB/GPU",
    "efficiency": "efficiency",
    "loss_step1": "loss at step 1",
    "error": "error",
}
# Settings that change what a run measures without a trainer flag: recorded with the results.
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "CUDA_LAUNCH_BLOCKING", "PYTORCH_CUDA_ALLOC_CONF", "TORCHINDUCTOR_")


def parse_run(spec: str) -> dict:
    name, gpus, config, extra = spec.split(":", 3)
    return {"name": name, "gpus": int(gpus), "config": config, "extra": extra.split()}


def cp_size(flags: list[str]) -> int:
    return int(flags[flags.index("--cp_size") + 1]) if "--cp_size" in flags else 1


def without_cp_size(flags: list[str]) -> list[str]:
    if "--cp_size" not in flags:
        return list(flags)
    i = flags.index("--cp_size")
    return flags[:i] + flags[i + 2 :]


# The run's length the trainer is told (it is stopped once `--steps` steps are logged): a user's LoRA run, so that what
# depends on it (`--compile auto`: compile when the run's steps pay for it) is decided as for one. A row's own
# --max_train_steps comes later on the command line and wins.
RUN_STEPS = 1000


def command(run: dict, model: str, work: str, steps: int, port: int | None = None) -> list[str]:
    """The trainer's launch, from the repository root (`port`: None for the command as recorded)."""
    launch = ["accelerate", "launch", "--config_file", f"accelerate_configs/{run['config']}",
              "--num_processes", str(run["gpus"])]  # fmt: skip
    if port is not None:
        launch[:2] = [sys.executable, "-m", "accelerate.commands.launch"]
        launch += ["--main_process_port", str(port)]
    script = ["-m", "benchmarks.fake_peers"] if run.get("fake_peers") else ["train_flux_cp.py"]
    if "--gpu_memory_gib" in run["extra"]:  # capped to a smaller GPU's memory before anything is allocated
        script = ["-m", "benchmarks.capped", "fake_peers" if run.get("fake_peers") else "trainer"]
    return [*launch, *script, "--pretrained_model_name_or_path", model,
            "--transformer_init", "random", "--mixed_precision", "bf16", "--gradient_checkpointing",
            "--rank", "16", "--max_train_steps", str(max(steps, RUN_STEPS)), "--checkpointing_steps", "100000",
            "--report_to", "none", "--output_dir", f"{work}/{run['name']}",
            "--encodings_dir", f"{work}/cache_{run['name']}", *run["extra"]]  # fmt: skip


_RUNNING: list[subprocess.Popen] = []  # the trainers started and not yet stopped


def _stop_all(signum, _frame) -> None:
    """Stopped from outside (`timeout`, Ctrl-C): end every running trainer's process group too. Each runs in a session
    of its own, so a signal to this process alone would leave it holding its GPU's memory."""
    for proc in _RUNNING:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(128 + signum)


def start(run: dict, model: str, work: Path, steps: int, gpus: list[int], log_dir: Path) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)))
    log_path = log_dir / f"{run['name']}.log"
    log = open(log_path, "w")
    cmd = command(run, model, str(work), steps, port=29500 + gpus[0])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _RUNNING.append(proc)
    return {**run, "proc": proc, "log": log, "log_path": log_path, "t0": time.time()}


def rows(work: Path, name: str) -> list[dict]:
    path = work / name / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def timed_rows(got: list[dict], warmup: int, steps: int, flags: list[str]) -> list[dict]:
    """The metrics rows a run is timed by: those after the warm-up, up to `steps`, less the step --profile_step
    profiled (the profiler slows the step it records: a 12 GiB step of 0.61-0.66 s took 1.06 s profiled)."""
    profiled = int(flags[flags.index("--profile_step") + 1]) if "--profile_step" in flags else None
    return [r for r in [r for r in got if r["step"] > warmup][: steps - warmup] if r["step"] != profiled]


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
    result = {"name": job["name"], "gpus": job["gpus"], "config": job["config"], "flags": shlex.join(job["extra"])}
    if job.get("fake_peers"):
        result["fake_peers"] = job["fake_peers"]
    result["command"] = shlex.join(command(job, "MODEL", "WORK", steps))
    profile = work / job["name"] / "profile"  # runs given --profile_step: summaries here, traces beside the logs
    if profile.is_dir():
        result["profile"] = {
            p.name.split("_")[0]: json.loads(p.read_text()) for p in sorted(profile.glob("*_summary.json"))
        }
        trace = profile / "rank0.json"
        if trace.is_file():
            with open(trace, "rb") as src, gzip.open(job["log_path"].with_suffix(".trace.json.gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
    run_config = work / job["name"] / "run_config.json"
    if run_config.is_file():  # what the trainer resolved: blocks checkpointed and offloaded, planned peak, compile
        chosen = json.loads(run_config.read_text())
        result.update({k: chosen[k] for k in ("checkpointed_blocks", "planned_peak_gib", "offloaded_blocks",
                                              "pinned_host_gib", "compile") if k in chosen})  # fmt: skip
    timed = timed_rows(got, warmup, steps, job["extra"])
    result["wall_s"] = round(time.time() - job["t0"], 1)
    if len(timed) < 2:
        lines = [ln for ln in job["log_path"].read_text().splitlines() if ln.strip() and "Warning" not in ln]
        # The trainer's own one-line refusals ("error: ...") first, then exceptions.
        errors = [ln for ln in lines if ln.startswith("error:")] or [
            ln for ln in lines if "Error" in ln and "error_file" not in ln
        ]
        result["error"] = f"only {len(got)} steps logged (exit {proc.returncode}): " + " | ".join(errors[-3:])
        result["out_of_memory"] = any("out of memory" in ln.lower() for ln in lines)
        result["log_tail"] = lines[-40:]
        return result
    result.update(
        steps=len(timed),
        timed_steps=[r["step"] for r in timed],  # the profiled step never among them (timed_rows)
        s_per_step=round(statistics.median(r["s_per_step"] for r in timed), 4),
        mfu=round(statistics.median(r["mfu"] for r in timed), 3) if all("mfu" in r for r in timed) else None,
        peak_gib=round(max(r["peak_mem_gib"] for r in timed), 2),
        # The caching allocator near a cap: what it held, and how many times it freed its cache to retry (each a sync).
        reserved_gib=round(max(r.get("reserved_gib", 0) for r in timed), 2),
        alloc_retries=timed[-1].get("alloc_retries", 0),
        alloc_retries_timed=timed[-1].get("alloc_retries", 0) - timed[0].get("alloc_retries", 0),
        loss_step1=got[0]["loss"] if got else None,
        losses=[r["loss"] for r in got[:steps]],  # the same steps for every run: CP must not change them
    )
    return result


def model_preset(model: Path) -> str | None:
    """The `python -m flux_cp.tiny` preset a model folder was built with (its marker's recipe), else None."""
    from flux_cp.families.builder import MARKER

    try:
        recipe = json.loads((model / MARKER).read_text()).get("recipe", "")
    except (OSError, ValueError):
        return None
    return recipe.rsplit("-v", 1)[0] or None


def with_efficiency(rows: list[dict]) -> list[dict]:
    """Each run on N GPUs (or standing for N with fake peers) gets t1 / (N tN) against the one-GPU run of the same
    flags less --cp_size, where there is one."""
    one_gpu = {
        tuple(r["flags"].split()): r["s_per_step"]
        for r in rows
        if r["gpus"] == 1 and not r.get("fake_peers") and r.get("s_per_step") and cp_size(r["flags"].split()) == 1
    }
    for r in rows:
        n = r.get("fake_peers") or r["gpus"]
        t1 = one_gpu.get(tuple(without_cp_size(r["flags"].split())))
        if n > 1 and t1 and r.get("s_per_step"):
            r["efficiency"] = round(t1 / (n * r["s_per_step"]), 3)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=parse_run)
    p.add_argument("--out", required=True, help="result file (JSON, benchmarks/schema.py); replaced if it exists")
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
    p.add_argument("--dry_run", action="store_true", help="print each run's trainer command and stop")
    a = p.parse_args(argv)
    if a.fake_peers:
        for run in a.runs:
            if run["gpus"] == 1 and cp_size(run["extra"]) > 1:
                run["fake_peers"] = cp_size(run["extra"])
    if a.dry_run:
        for run in a.runs:
            print(f"{run['name']}: {shlex.join(command(run, a.model or 'MODEL', 'WORK', a.steps))}")
        return

    out = Path(a.out)
    log_dir = Path(a.logs) if a.logs else out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_trainer_"))
    model = Path(a.model) if a.model else work / "flux1-dev-shapes"
    if not a.model:
        subprocess.run([sys.executable, "-m", "flux_cp.tiny", "--preset", "flux1-dev-shapes", "--out", str(model)],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    import torch

    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES))
    settings = {
        "MODEL": a.model or "python -m flux_cp.tiny --preset flux1-dev-shapes --out MODEL (random weights at run time)",
        "timed": f"median of steps {a.warmup + 1}-{a.steps} of metrics.jsonl (less a step --profile_step profiled)",
        "side_by_side": "one-GPU runs side by side, one per GPU" if a.parallel else "one run at a time",
        "environment": env,
    }
    preset = model_preset(model)
    if preset:  # what benchmarks/bench_speed_model.py --check plans the rows with
        settings["model_preset"] = preset
    command_line = schema.command_line(argv, module="benchmarks.bench_trainer")
    n_gpus = torch.cuda.device_count()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop_all)
    results: list[dict] = []
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
            print(json.dumps({k: v for k, v in r.items() if k not in ("losses", "log_tail", "profile")}), flush=True)
        rows = with_efficiency(results)
        schema.write(out, schema.result("trainer", rows, command=command_line, settings=settings, columns=COLUMNS))
    from benchmarks.render import render

    print(render([str(out)]))


if __name__ == "__main__":
    main()
