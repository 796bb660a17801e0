"""`--gradient_checkpointing auto` on GPUs of 24, 48, 80 GiB and a whole H200, one GPU and a CP=2 rank (loopback
peers, benchmarks/fake_peers.py), 1024 and 2048 px: the planner's pick and its planned peak for every cell, and by
trial on one GPU capped to each size (benchmarks/capped.py): the pick's measured peak and step time, and the fastest
setting that runs.

    python -m benchmarks.bench_memory --out RESULTS/memory.json [--dry_run]

The trials: for each (layout, resolution), the pick of every cap, run under the smallest cap that picks it (a
setting that runs under a cap runs under every larger one); and its neighbour, the fewest blocks whose planned
peak fits the cap without the planner's 10% margin, run under the same cap (it runs: the margin cost time; it runs
out of memory: the margin was needed). Cells where even every block checkpointed is planned not to fit are not
run. Runs start, picks first, until --budget seconds have passed. FLUX.1-dev shapes with random weights, LoRA r16
on the default layers, bf16, `--compile_mode reduce-overhead`; each run stopped after --steps steps, the last
steps - warmup timed. The trials go to RESULTS/memory_runs.json (benchmarks/bench_trainer.py's rows), the table to
--out; both in the suite's schema.

Variants (`--base_precision fp8,int8,nf4`, `--offload_blocks auto,20`, `--variant_caps 24,16`): one run per value and
cap, one GPU at --variant_resolution (default 1024) with `--gradient_checkpointing auto` (and `--offload_blocks auto`
beside a precision, where the cap needs it), each a row of the variants table (RESULTS/memory_variants.json): the
planner's pick (blocks checkpointed and offloaded), its planned peak and modelled step time against the measured peak
and step time. They check the planner's peaks with a quantized base or offload (flux_cp/plan/plan_data.json) and its
speed model (flux_cp/plan/speed.py). `--variants_only` runs them alone.

    python -m benchmarks.bench_memory --out RESULTS/memory.json --variants_only --base_precision fp8,int8,nf4 \
        --offload_blocks auto --variant_caps 24,16

`--smoke`: the tiny FLUX.1 (four single blocks) on the CPU, an int8 base and three blocks offloaded, 64 px, to check
the script runs (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from benchmarks import schema

CAPS = (24.0, 48.0, 80.0, None)  # GiB; None: the whole GPU (an H200: 139.8 GiB)
LAYOUTS = {"gpu1": [], "fake2": ["--cp_size", "2"]}  # one GPU; rank 0 of cp=2 with loopback peers
RESOLUTIONS = (1024, 2048)
FLAGS = ["--compile_mode", "reduce-overhead"]
COLUMNS = {
    "layout": "layout", "resolution": "px", "cap_gib": "GiB", "pick": "auto: blocks", "planned_gib": "planned GiB",
    "measured_gib": "measured GiB", "s_per_step": "s/step", "fastest": "fastest by trial", "fastest_s": "its s/step",
    "note": "note",
}  # fmt: skip


def _cap_name(cap: float | None) -> str:
    return "full" if cap is None else f"{cap:g}"


def plan_cell(layout: str, resolution: int, cap: float | None, gpu_gib: float, margin: float = 0.9,
              extra: tuple[str, ...] = (), config: dict | None = None, flags: list[str] = FLAGS):  # fmt: skip
    """The planner's `Checkpointing` for a cell, as the trainer computes it (`margin`: of the memory usable; `extra`:
    a variant's flags, e.g. --base_precision int8; `config`: the transformer's, FLUX.1-dev's by default; `flags`: the
    runs' common flags)."""
    from flux_cp.config.parser import parse_config
    from flux_cp.families import FLUX1
    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER
    from flux_cp.plan import memory as plan
    from flux_cp.shape.build import resolved
    from flux_cp.shape.run_shape import RunShape

    config = dict(config or FLUX1_DEV_TRANSFORMER)
    flags = ["--plan", "--resolution", str(resolution), "--gradient_checkpointing", "--mixed_precision", "bf16",
             "--train_batch_size", "1", *flags, *LAYOUTS[layout], *extra]  # fmt: skip
    cfg = resolved(parse_config(flags), FLUX1, False, config)  # FLUX.1's default LoRA layers
    cp = cfg.parallel.cp_size
    shape = RunShape(FLUX1, "m", None, None, ((resolution, resolution),), ((0,),), 512, cp, 1, cp, False,
                     transformer_config=config, cp_mode="ulysses" if cp > 1 else "ring")  # fmt: skip
    gib = (cap or gpu_gib) * margin / plan.MARGIN
    return plan.checkpointing_for(cfg, shape, gib)


def trials(gpu_gib: float) -> list[dict]:
    """The runs, most telling first: every (layout, resolution)'s picks from the largest cap down, then the
    neighbours. A pick runs under the smallest cap that picks it; a neighbour is left out where its count of blocks
    runs as a pick under a cap as small."""
    picks: list[dict] = []
    neighbours: list[dict] = []
    for res in sorted(RESOLUTIONS, reverse=True):
        for layout in LAYOUTS:
            chosen: dict[int, float] = {}  # blocks -> the smallest cap that picks them
            cells = []
            for cap in CAPS:
                pick = plan_cell(layout, res, cap, gpu_gib)
                if pick.fits:
                    n = len(pick.blocks)
                    chosen[n] = min(chosen.get(n, float("inf")), cap or gpu_gib)
                    cells.append((cap, n, len(plan_cell(layout, res, cap, gpu_gib, margin=1.0).blocks)))
            for cap, n, edge in reversed(cells):
                if chosen[n] == (cap or gpu_gib):
                    picks.append({"layout": layout, "resolution": res, "blocks": n, "cap": cap, "why": "pick"})
                if edge < n and chosen.get(edge, float("inf")) > (cap or gpu_gib):
                    neighbours.append({"layout": layout, "resolution": res, "blocks": edge, "cap": cap,
                                       "why": "neighbour: fits without the margin"})  # fmt: skip
    return picks + neighbours


def run_spec(t: dict) -> str:
    """A bench_trainer RUN: a pick runs as `auto` under its cap (the trainer's own choice, recorded by the run), a
    neighbour with its count of blocks."""
    value = "auto" if t["why"] == "pick" else str(t["blocks"])
    flags = ["--resolution", str(t["resolution"]), *FLAGS, "--gradient_checkpointing", value,
             *LAYOUTS[t["layout"]]]  # fmt: skip
    if t["cap"] is not None:
        flags += ["--gpu_memory_gib", f"{t['cap']:g}"]
    name = f"{t['layout']}_{t['resolution']}_ck{t['blocks']}_cap{_cap_name(t['cap'])}"
    return f"{name}:1:gpu1.yaml:{' '.join(flags)}"


VARIANT_COLUMNS = {
    "variant": "variant", "cap_gib": "GiB", "pick": "checkpointed", "offloaded": "offloaded",
    "planned_gib": "planned GiB", "measured_gib": "measured GiB", "planned_cost": "modelled x", "s_per_step": "s/step",
    "pinned_host_gib": "pinned host GiB", "note": "note",
}  # fmt: skip


def variant_flags(precisions: str, offloads: str) -> list[tuple[str, ...]]:
    """One flag set per value: `--base_precision P` for each of `precisions`, `--offload_blocks N` for each of
    `offloads` (comma-separated; empty: none)."""
    return [("--base_precision", p) for p in precisions.split(",") if p] + [
        ("--offload_blocks", o) for o in offloads.split(",") if o
    ]


def variant_trials(flag_sets: list[tuple[str, ...]], caps: list[float | None], resolution: int) -> list[dict]:
    """A run per variant and cap (one GPU), most memory first."""
    return [{"layout": "gpu1", "resolution": resolution, "cap": cap, "extra": flags, "why": "variant"}
            for flags in flag_sets for cap in sorted(caps, key=lambda c: -(c or 1e9))]  # fmt: skip


def variant_spec(t: dict, flags: list[str] = FLAGS) -> str:
    """A bench_trainer RUN for a variant: `auto` checkpointing (and offload when given auto) under its cap."""
    extra = ["--resolution", str(t["resolution"]), *flags, "--gradient_checkpointing", "auto", *t["extra"]]
    if t["cap"] is not None:
        extra += ["--gpu_memory_gib", f"{t['cap']:g}"]
    slug = "_".join(v.replace(",", "-") for v in t["extra"][1::2])
    name = f"var_{t['extra'][0].strip('-').split('_')[0]}_{slug}_{t['resolution']}_cap{_cap_name(t['cap'])}"
    return f"{name}:1:gpu1.yaml:{' '.join(extra)}"


def variant_table(runs: list[tuple[dict, dict]], gpu_gib: float, config: dict | None = None,
                  flags: list[str] = FLAGS) -> list[dict]:  # fmt: skip
    """One row per variant run: the planner's pick, planned peak and modelled step time, and what the run measured
    (its own resolved pick from run_config.json where it differs)."""
    rows = []
    for r, t in runs:
        pick = plan_cell(t["layout"], t["resolution"], t["cap"], gpu_gib, extra=tuple(t["extra"]), config=config,
                         flags=flags)  # fmt: skip
        row = {"variant": " ".join(t["extra"]), "cap_gib": round(t["cap"] or gpu_gib, 1), "pick": len(pick.blocks),
               "offloaded": pick.offloaded, "planned_gib": round(pick.planned_gib, 2),
               "planned_cost": round(pick.cost, 3), "pinned_host_gib": round(pick.host_gib, 2)}  # fmt: skip
        notes = [] if pick.fits else ["planned not to fit"]
        if r.get("s_per_step"):
            row["measured_gib"], row["s_per_step"] = r["peak_gib"], r["s_per_step"]
            ran = (r.get("checkpointed_blocks"), r.get("offloaded_blocks"))
            if ran[0] is not None and ran != (row["pick"], row["offloaded"]):
                notes.append(f"the run chose {ran[0]} checkpointed, {ran[1]} offloaded")
        elif r.get("error"):
            notes.append("out of memory" if r.get("out_of_memory") else r["error"][:120])
        if notes:
            row["note"] = "; ".join(notes)
        rows.append(row)
    return rows


def table(runs: list[dict], gpu_gib: float) -> list[dict]:
    """One row per cell: the pick and what the trials found."""
    by = {}
    for r, t in runs:
        by.setdefault((t["layout"], t["resolution"]), []).append((r, t))
    rows = []
    for layout in LAYOUTS:
        for res in RESOLUTIONS:
            done = by.get((layout, res), [])
            for cap in CAPS:
                pick = plan_cell(layout, res, cap, gpu_gib)
                n, limit = len(pick.blocks), cap or gpu_gib
                row = {"layout": layout, "resolution": res, "cap_gib": round(limit, 1), "pick": n,
                       "planned_gib": round(pick.planned_gib, 1)}  # fmt: skip
                if not pick.fits:
                    row["note"] = "planned not to fit with every block checkpointed"
                same = [r for r, t in done if t["blocks"] == n and r.get("s_per_step")]
                if same:
                    row["measured_gib"], row["s_per_step"] = same[0]["peak_gib"], same[0]["s_per_step"]
                    resolved = same[0].get("checkpointed_blocks")
                    if resolved is not None and resolved != n:  # the trainer's auto chose otherwise than planned
                        row["note"] = f"the run's auto chose {resolved} blocks"
                # fits by trial: ran under this cap or a smaller one
                fitting = [(r["s_per_step"], t["blocks"]) for r, t in done
                           if r.get("s_per_step") and (t["cap"] or gpu_gib) <= limit]  # fmt: skip
                if fitting:
                    row["fastest_s"], row["fastest"] = min(fitting)
                failed = [t["blocks"] for r, t in done if r.get("out_of_memory") and t["cap"] == cap]
                if failed:
                    row["note"] = (row.get("note", "") + f" out of memory by trial: {failed}").strip()
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the table (JSON, benchmarks/schema.py); the runs go beside it")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--model", default=None, help="model folder (default: a fresh FLUX.1-dev-shaped one)")
    p.add_argument("--budget", type=float, default=420, help="seconds after which no further run starts")
    p.add_argument("--dry_run", action="store_true", help="print the picks and the runs, run nothing")
    p.add_argument("--base_precision", default="", help="variants: comma-separated precisions (fp8,int8,nf4)")
    p.add_argument("--offload_blocks", default="", help="variants: comma-separated --offload_blocks values (auto,20)")
    p.add_argument("--variant_caps", default="24,16", help="variants: GiB caps, comma-separated ('full': uncapped)")
    p.add_argument("--variant_resolution", type=int, default=1024)
    p.add_argument("--variants_only", action="store_true", help="run the variants alone, not the checkpointing trials")
    p.add_argument("--smoke", action="store_true", help="the tiny FLUX.1 on the CPU: int8, 3 blocks offloaded, 64 px")
    a = p.parse_args(argv)
    import torch

    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 139.8
    if a.smoke or a.variants_only or a.base_precision or a.offload_blocks:
        run_variants(a, argv, gpu_gib)
        if a.smoke or a.variants_only:
            return
    planned = trials(gpu_gib)
    if a.dry_run:
        for layout in LAYOUTS:
            for res in RESOLUTIONS:
                for cap in CAPS:
                    c = plan_cell(layout, res, cap, gpu_gib)
                    print(f"{layout} {res} px, {cap or gpu_gib:.1f} GiB: auto {len(c.blocks)}/{c.total} blocks, "
                          f"planned {c.planned_gib:.1f} GiB{'' if c.fits else ' (does not fit)'}")  # fmt: skip
        print(f"{len(planned)} runs:")
    specs = [run_spec(t) for t in planned]
    for t, spec in zip(planned, specs):
        if a.dry_run:
            print(f"  {spec}   # {t['why']}")
    from benchmarks import bench_trainer

    out = Path(a.out)
    runs_file = out.with_name(out.stem + "_runs.json")
    common = ["--steps", str(a.steps), "--warmup", str(a.warmup), "--timeout", str(a.timeout), "--fake_peers",
              "--logs", str(out.parent / "logs"), *(["--model", a.model] if a.model else [])]  # fmt: skip
    if a.dry_run:
        print(f"(runs are started while less than --budget {a.budget:g} s has passed; picks first)")
        bench_trainer.main(["--out", str(runs_file), "--dry_run", *common, *specs])
        return
    start, rows, done = time.monotonic(), [], []
    for spec in specs:  # one bench_trainer call per run: the budget is checked between runs
        if time.monotonic() - start > a.budget:
            print(f"budget of {a.budget:g} s spent: {spec.split(':')[0]} and later runs not started", flush=True)
            break
        one = out.with_name(f"{out.stem}_{spec.split(':')[0]}.json")
        bench_trainer.main(["--out", str(one), *common, spec])
        rows += schema.load(one)["rows"]
        done.append(spec)
        one.unlink()
    schema.write(runs_file, schema.result("trainer", rows, command=schema.command_line(argv, "benchmarks.bench_memory"),
                                          columns=bench_trainer.COLUMNS))  # fmt: skip
    rows = schema.load(runs_file)["rows"]
    by_name = {r["name"]: r for r in rows}
    paired = [(by_name.get(spec.split(":")[0], {}), t) for spec, t in zip(specs, planned) if spec in done]
    command = schema.command_line(argv, "benchmarks.bench_memory")
    result = schema.result("memory", table(paired, gpu_gib), command=command,
                           settings={"trials": str(runs_file.name), "flags": shlex.join(FLAGS),
                                     "model": "FLUX.1-dev shapes, random weights, LoRA r16 (default layers), bf16"},
                           columns=COLUMNS)  # fmt: skip
    schema.write(out, result)
    from benchmarks.render import render

    print(render([str(out)]))


def run_variants(a: argparse.Namespace, argv: list[str] | None, gpu_gib: float) -> None:
    """The variant runs (--base_precision, --offload_blocks) and their table, RESULTS/<out>_variants.json."""
    from benchmarks import bench_trainer

    config, flags, model = None, FLAGS, a.model
    if a.smoke:  # the tiny FLUX.1, eager, on the CPU, with 4 single blocks: 3 of them offloaded save one
        import json
        import shutil

        from flux_cp.families.flux1.tiny import ensure_tiny_pipeline

        model = str(Path(a.out).parent / "smoke_model")  # its config alone counts: the runs build random weights
        shutil.copytree(ensure_tiny_pipeline(), model, dirs_exist_ok=True)
        path = Path(model) / "transformer" / "config.json"
        config = {**json.loads(path.read_text()), "num_single_layers": 4}
        path.write_text(json.dumps(config))
        flags = []
        planned = variant_trials(variant_flags("int8", "3"), [None], 64)
    else:
        caps = [None if c == "full" else float(c) for c in a.variant_caps.split(",") if c]
        planned = variant_trials(variant_flags(a.base_precision, a.offload_blocks), caps, a.variant_resolution)
    for t in planned:  # a precision that does not fit the cap alone runs with --offload_blocks auto
        pick = plan_cell(t["layout"], t["resolution"], t["cap"], gpu_gib, extra=tuple(t["extra"]), config=config,
                         flags=flags)  # fmt: skip
        if not pick.fits and "--offload_blocks" not in t["extra"]:
            t["extra"] = (*t["extra"], "--offload_blocks", "auto")
    specs = [variant_spec(t, flags) for t in planned]
    out = Path(a.out)
    target = out.with_name(out.stem + "_variants.json")
    common = ["--steps", str(3 if a.smoke else a.steps), "--warmup", str(1 if a.smoke else a.warmup), "--timeout",
              str(a.timeout), "--logs", str(out.parent / "logs"), *(["--model", model] if model else [])]  # fmt: skip
    if a.dry_run:
        for t, spec in zip(planned, specs):
            pick = plan_cell(t["layout"], t["resolution"], t["cap"], gpu_gib, extra=tuple(t["extra"]), config=config,
                             flags=flags)  # fmt: skip
            print(f"  {spec}   # planned {pick.planned_gib:.1f} GiB, {len(pick.blocks)} checkpointed, "
                  f"{pick.offloaded} offloaded, ~{pick.cost:.2f}x{'' if pick.fits else ' (does not fit)'}")  # fmt: skip
        return
    start, runs = time.monotonic(), []
    for t, spec in zip(planned, specs):
        if time.monotonic() - start > a.budget:
            print(f"budget of {a.budget:g} s spent: {spec.split(':')[0]} and later runs not started", flush=True)
            break
        one = out.with_name(f"{out.stem}_{spec.split(':')[0]}.json")
        bench_trainer.main(["--out", str(one), *common, spec])
        runs.append((schema.load(one)["rows"][0], t))
        one.unlink()
    command = schema.command_line(argv, "benchmarks.bench_memory")
    settings = {"flags": shlex.join(flags), "model": "the tiny FLUX.1 on the CPU (smoke)" if a.smoke else
                "FLUX.1-dev shapes, random weights, LoRA r16 (default layers), bf16"}  # fmt: skip
    rows = variant_table(runs, gpu_gib, config, flags)
    for row, (r, _) in zip(rows, runs):
        row["run"] = r["name"]
    schema.write(target, schema.result("memory_variants", rows, command=command, settings=settings,
                                       columns={"run": "run", **VARIANT_COLUMNS}))  # fmt: skip
    from benchmarks.render import render

    print(render([str(target)]))


if __name__ == "__main__":
    main()
