"""The planner's speed model (flux_cp/plan/speed.py) against the GPU: measure a GPU class's figures, check the model's
predictions against measured steps, or fit figures to measured steps where no measurement of the blocks exists.

    python -m benchmarks.bench_speed_model --out flux_cp/plan/speed_data/h100.json [--results RESULTS/speed_model.json]
    python -m benchmarks.bench_speed_model --check RESULTS/trainer_small.json [--gpu_class h100] [--tolerance 0.15]
    python -m benchmarks.bench_speed_model --fit FILE [FILE ...] --gpu_class h100 --free GROUPS --out FILE

Measure (a CUDA GPU; `--smoke`: the tiny FLUX.1 on the CPU, to check the command runs): flux_cp/plan/speed_measure.py's
timings of FLUX.1-dev's blocks (random weights, LoRA r16 on the default layers) at each --resolutions (one sample, 512
text tokens), every --precisions in every --modes, and the host-to-GPU copy rate; the figures derived from them
(speed_measure.derive, pooled over the resolutions) replace the class file's, which keeps what was not measured (the
step outside the blocks, the link between GPUs) with its source.

Check: every row of the result files (bench_trainer's schema) that has a step time and the blocks its run
checkpointed (and offloaded, when its flags offload) is planned again with the same flags (train_flux_cp.py --plan's
own code, on the tiny presets' configs: `flux1-dev-shapes` unless the file names another), its step predicted with
the class's figures (`--gpu_class`, else the class of the file's GPU), and set beside the measured one. It passes when
every prediction is within --tolerance and every two rows of one model and resolution whose measured steps differ by
more than --order_margin come out in the measured order; exit 1 otherwise.

Fit: the figures named by --free (GROUPS: comma-separated; `a=b` ties values, `a*b` scales them by one factor, each
name a dotted key of the figures, e.g. dequant_ms_per_gweight.fp8.eager.0) chosen to minimise the squared log error
of the predictions of those rows, starting from --base (default: the class file); the rest kept.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import schema

ROOT = Path(__file__).resolve().parent.parent
# The flags bench_trainer.py gives every run (its `command`), before the run's own.
TRAINER_FLAGS = [
    "--transformer_init",
    "random",
    "--mixed_precision",
    "bf16",
    "--gradient_checkpointing",
    "--rank",
    "16",
]
PRESET = re.compile(r"flux[12]-[a-z0-9-]*shapes")
FULL = re.compile(r"full-(flux1-dev|flux2-dev|flux2-klein)")  # benchmarks/run.sh's small_full folders
COLUMNS = {
    "name": "run",
    "flags": "flags",
    "s_per_step": "measured s/step",
    "predicted_s": "predicted s/step",
    "error": "error",
    "checkpointed_blocks": "checkpointed",
    "offloaded_blocks": "offloaded",
}


# --- predicting a measured row -------------------------------------------------------------------------------


class Models:
    """The tiny presets' folders (configs at full size), built once in a temporary folder."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="speed-models-"))
        self.built: dict[str, str] = {}

    def path(self, preset: str) -> str:
        if preset not in self.built:
            from flux_cp.tiny import main as tiny

            out = self.dir / preset
            with contextlib.redirect_stdout(io.StringIO()):  # it prints the folder
                failed = tiny(["--preset", preset, "--out", str(out)])
            if failed:
                raise SystemExit(f"error: python -m flux_cp.tiny --preset {preset} failed")
            self.built[preset] = str(out)
        return self.built[preset]


def preset_of(data: dict, row: dict) -> str:
    """The tiny preset a row's model was built from: the row's or the file's `model_preset`, else the preset its
    settings name, else FLUX.1-dev's shapes."""
    for text in (
        row.get("model_preset"),
        data.get("settings", {}).get("model_preset"),
        json.dumps(data.get("settings", {})),
    ):
        found = PRESET.search(text or "")
        if found:
            return found.group(0)
        found = FULL.search(text or "")
        if found:
            return f"{found.group(1)}-full-shapes"
    return "flux1-dev-shapes"


def row_flags(row: dict) -> list[str]:
    flags = shlex.split(row.get("flags") or "")
    if "compile" in row:  # what the run resolved --compile to (train_flux_cp.py records it)
        flags = [*flags, "--compile", row["compile"]]
    return flags


@dataclasses.dataclass
class Planned:
    """A measured row and the estimate of its setting."""

    row: dict
    gpu: str | None
    model: str  # preset
    estimate: Callable[[], float]  # the predicted seconds with the figures in use


def planned(data: dict, row: dict, models: Models) -> Planned | None:
    """The row planned as its run was (None: no step time, or not known which blocks it checkpointed/offloaded)."""
    from flux_cp.config.parser import parse_config
    from flux_cp.plan import memory as plan
    from flux_cp.shape.build import build_shape, resolved

    if not row.get("s_per_step") or row.get("checkpointed_blocks") is None:
        return None
    flags = row_flags(row)
    offloaded = row.get("offloaded_blocks")
    if offloaded is None:
        if "--offload_blocks" in flags:
            return None
        offloaded = 0
    preset = preset_of(data, row)
    # A row recorded before --compile defaulted to auto ran eager unless its flags say otherwise
    off = [] if "--compile" in flags or "--compile_mode" in flags else ["--compile", "off"]
    argv = ["--plan", "--pretrained_model_name_or_path", models.path(preset), *TRAINER_FLAGS, *off, *flags]
    cfg = parse_config(argv)
    cp = cfg.parallel.cp_size
    shape = build_shape(cfg, max(row.get("gpus") or 1, cp), planning=True)
    cfg = resolved(cfg, shape.family, shape.pairs, shape.transformer_config)
    estimate_with = plan.run_estimate(cfg, shape)
    n = int(row["checkpointed_blocks"])
    return Planned(row, data.get("hardware", {}).get("gpu"), preset, lambda: estimate_with(n, int(offloaded)).seconds)


def load_rows(files: Sequence[str], models: Models, names: Sequence[str] = ()) -> list[Planned]:
    from flux_cp.errors import UsageError

    out = []
    for f in files:
        data = schema.load(f)
        for row in data["rows"]:
            if names and row["name"] not in names:
                continue
            try:
                p = planned(data, row, models)
            except UsageError as e:  # flags of an older trainer (a flag since removed)
                print(f"{f}: {row['name']} left out: {e}", file=sys.stderr)
                continue
            if p is not None:
                out.append(p)
    return out


def predictions(rows: Sequence[Planned], figures) -> list[float]:
    from flux_cp.plan import speed

    with speed.using(figures):
        return [p.estimate() for p in rows]


def resolution(row: dict) -> str:
    flags = shlex.split(row.get("flags") or "")
    return flags[flags.index("--resolution") + 1] if "--resolution" in flags else "?"


def order_violations(rows: Sequence[Planned], predicted: Sequence[float], margin: float) -> list[str]:
    """Pairs of rows of one model and resolution whose measured steps differ by more than `margin` (relative) and
    whose predictions come out the other way round."""
    out = []
    for i, a in enumerate(rows):
        for j in range(i + 1, len(rows)):
            b = rows[j]
            if (a.model, resolution(a.row)) != (b.model, resolution(b.row)):
                continue
            ma, mb = a.row["s_per_step"], b.row["s_per_step"]
            if abs(ma - mb) <= margin * min(ma, mb):
                continue
            if (ma < mb) != (predicted[i] < predicted[j]):
                out.append(
                    f"{a.row['name']} ({ma:.3f} s) and {b.row['name']} ({mb:.3f} s) are predicted the other "
                    f"way round ({predicted[i]:.3f} s, {predicted[j]:.3f} s)"
                )
    return out


def check(
    files: Sequence[str], figures, tolerance: float = 0.15, margin: float = 0.1, models: Models | None = None
) -> tuple[list[dict], list[str]]:
    """(a row per measured step: measured, predicted, relative error; the failures: rows outside `tolerance`, pairs
    out of order)."""
    rows = load_rows(files, models or Models())
    predicted = predictions(rows, figures)
    table, failures = [], []
    for p, s in zip(rows, predicted):
        r = p.row
        err = s / r["s_per_step"] - 1
        table.append(
            {
                "name": r["name"],
                "flags": r.get("flags"),
                "model": p.model,
                "s_per_step": r["s_per_step"],
                "predicted_s": round(s, 4),
                "error": round(err, 3),
                "checkpointed_blocks": r.get("checkpointed_blocks"),
                "offloaded_blocks": r.get("offloaded_blocks", 0),
            }
        )
        if abs(err) > tolerance:
            failures.append(f"{r['name']}: predicted {s:.3f} s, measured {r['s_per_step']:.3f} s ({err:+.0%})")
    return table, failures + order_violations(rows, predicted, margin)


# --- fitting figures to measured steps --------------------------------------------------------------------------


def _get(figures: dict, key: str) -> float:
    value = figures
    for part in key.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return float(value)


def _set(figures: dict, key: str, value: float) -> None:
    parts = key.split(".")
    target = figures
    for part in parts[:-1]:
        target = target[int(part)] if isinstance(target, list) else target[part]
    last = parts[-1]
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value


def parse_groups(text: str) -> list[tuple[str, list[str]]]:
    """--free: [("tie" | "scale", [keys])]."""
    groups = []
    for group in text.split(","):
        group = group.strip()
        if "*" in group:
            groups.append(("scale", group.split("*")))
        elif group:
            groups.append(("tie", group.split("=")))
    return groups


def nelder_mead(
    f: Callable[[list[float]], float], x0: list[float], step: float = 0.3, iters: int = 2000, tol: float = 1e-12
) -> tuple[list[float], float]:
    """The minimum of f near x0 (Nelder and Mead's simplex)."""
    n = len(x0)
    pts = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        c = [sum(p[i] for p in pts[:-1]) / n for i in range(n)]
        worst = pts[-1]

        def at(t: float, c: list[float] = c, worst: list[float] = worst) -> list[float]:
            return [c[i] + t * (worst[i] - c[i]) for i in range(n)]

        xr = at(-1.0)
        fr = f(xr)
        if fr < vals[0]:
            xe = at(-2.0)
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = at(0.5)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [[pts[0][i] + 0.5 * (p[i] - pts[0][i]) for i in range(n)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[0], vals[0]


def fit(rows: Sequence[Planned], base: dict, groups: list[tuple[str, list[str]]]) -> tuple[dict, float]:
    """The figures (a class file's "figures") with the free groups fitted to the rows' steps, and the loss."""
    from flux_cp.plan import speed

    start = [_get(base, keys[0]) if how == "tie" else 1.0 for how, keys in groups]

    def figures_at(logs: list[float]) -> dict:
        fig = json.loads(json.dumps(base))
        for (how, keys), v in zip(groups, logs):
            for key in keys:
                _set(fig, key, math.exp(v) if how == "tie" else _get(base, key) * math.exp(v))
        return fig

    def loss(logs: list[float]) -> float:
        predicted = predictions(rows, speed.Figures.from_json(figures_at(logs)))
        return sum(math.log(s / p.row["s_per_step"]) ** 2 for p, s in zip(rows, predicted))

    logs = [math.log(max(v, 1e-9)) for v in start]
    best, value = nelder_mead(loss, logs)
    for _ in range(2):  # restarted, smaller steps: the simplex may have collapsed early
        best, value = nelder_mead(loss, best, step=0.1)
    fitted = figures_at(best)
    for _, keys in groups:
        for key in keys:
            v = _get(fitted, key)
            _set(fitted, key, speed.rounded(v) if v > 1e-6 else 0.0)  # the fit's floor is nothing
    return fitted, value


# --- measuring on this GPU ------------------------------------------------------------------------------------


def calibrate(
    resolutions: Sequence[int],
    precisions: Sequence[str],
    modes: Sequence[str],
    base_figures,
    models: Models,
    device=None,
    preset: str = "flux1-dev-shapes",
    flags: Sequence[str] = (),
):
    """(the raw timings of each resolution, the figures derived from all of them). FLUX.1-dev's blocks as a run of
    the suite's flags plans them (the `flux1-dev-shapes` preset), measured through the cache such a run reads
    (flux_cp.plan.speed_measure: FLUX_CP_HOME/speed/), so that the runs after it measure nothing again. `device`: the
    first GPU by default (the CPU, the tiny preset and `flags` for --smoke)."""
    import torch

    from flux_cp.config.parser import parse_config
    from flux_cp.plan import speed_measure
    from flux_cp.shape.build import build_shape, resolved

    device = device or torch.device("cuda", torch.cuda.current_device())
    raws = []
    for res in resolutions:
        argv = ["--plan", "--pretrained_model_name_or_path", models.path(preset), *TRAINER_FLAGS, *flags]
        argv += ["--resolution", str(res)]
        cfg = parse_config(argv)
        shape = build_shape(cfg, 1, planning=True)
        cfg = resolved(cfg, shape.family, shape.pairs, shape.transformer_config)
        request = speed_measure.Request(
            shape.family,
            dict(shape.transformer_config),
            tokens=shape.largest_sequence,
            text_tokens=shape.text_tokens,
            batch=1,
            precisions=tuple(precisions),
            modes=tuple(modes),
            lora_rank=16,
            lora_layers=tuple(cfg.lora.lora_layers),
        )
        speed_measure.figures_for(request, device, base_figures)
        raws.append((res, json.loads(speed_measure.cached_path(request, device).read_text())))
    return raws, speed_measure.derive(pooled(raws), base_figures, "measured")


def pooled(raws: list[tuple[int, dict]]) -> dict:
    """One measurement of several resolutions: each kind at each resolution a kind of its own, the rates averaged."""
    out = {"gpu": raws[0][1]["gpu"], "kinds": {}, "blocks": {}}
    for key in ("matmul_tflops", "attention_tflops", "h2d_gib_per_s"):
        values = [r[key] for _, r in raws if r.get(key)]
        out[key] = sum(values) / len(values) if values else None
    for res, raw in raws:
        for kind, k in raw["kinds"].items():
            out["kinds"][f"{kind}@{res}"] = k
        for p, by_mode in raw["blocks"].items():
            for how, by_kind in by_mode.items():
                for kind, t in by_kind.items():
                    out["blocks"].setdefault(p, {}).setdefault(how, {})[f"{kind}@{res}"] = t
    return out


# --- the command ------------------------------------------------------------------------------------------------


def class_data(name: str) -> dict:
    from flux_cp.plan import speed

    return json.loads(speed.class_file(name).read_text())


def write_class(path: str, data: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="the class file to write (measure, fit)")
    p.add_argument("--results", help="measure: also the raw timings in the suite's schema; check: the table")
    p.add_argument("--check", nargs="+", metavar="FILE", help="result files whose steps to predict")
    p.add_argument("--fit", nargs="+", metavar="FILE", help="result files whose steps to fit the figures to")
    p.add_argument("--rows", default="", help="fit/check: only these rows (comma-separated names)")
    p.add_argument("--gpu_class", help="the class whose figures to check or fit (default: the files' GPU's)")
    p.add_argument("--base", help="fit: start from this class file (default: the class's own)")
    p.add_argument("--free", default="", help="fit: the figures to fit (groups, see above)")
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--order_margin", type=float, default=0.1)
    p.add_argument("--resolutions", default="1024,2048")
    p.add_argument("--precisions", default="bf16,fp8,int8,nf4")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--smoke", action="store_true", help="measure: the tiny FLUX.1 on the CPU, eager (a test)")
    a = p.parse_args(argv)
    from flux_cp.plan import speed

    command = schema.command_line(argv, "benchmarks.bench_speed_model")
    names = [n for n in a.rows.split(",") if n]
    models = Models()
    if a.check or a.fit:
        files = a.check or a.fit
        gpu_class = a.gpu_class or speed.class_of_gpu(schema.load(files[0])["hardware"].get("gpu") or "")
        if gpu_class is None and not (a.check and a.out):
            p.error("--gpu_class: the files' GPU is of no known class")
    if a.check:
        figures = (
            speed.Figures.from_json(json.loads(Path(a.out).read_text())["figures"])
            if a.out
            else speed.load_class(gpu_class)
        )
        table, failures = check(a.check, figures, a.tolerance, a.order_margin, models)
        for r in table:
            print(
                f"{r['name']:28} {r['model']:24} measured {r['s_per_step']:7.3f} s  predicted {r['predicted_s']:7.3f} s"
                f"  {r['error']:+6.1%}  ({r['checkpointed_blocks']} checkpointed, {r['offloaded_blocks']} offloaded)"
            )
        print("\n".join(f"FAIL {f}" for f in failures) or f"all {len(table)} within {a.tolerance:.0%}, in order")
        if a.results:
            schema.write(
                a.results,
                schema.result(
                    "speed_model_check",
                    table,
                    command=command,
                    settings={"gpu_class": gpu_class, "tolerance": a.tolerance},
                    columns=COLUMNS,
                ),
            )
        return 1 if failures else 0
    if a.fit:
        if not a.out or not a.free:
            p.error("--fit needs --free and --out")
        base = json.loads(Path(a.base).read_text()) if a.base else class_data(gpu_class)
        rows = load_rows(a.fit, models, names)
        fitted, loss = fit(rows, base["figures"], parse_groups(a.free))
        got = predictions(rows, speed.Figures.from_json(fitted))
        for pl, s in zip(rows, got):
            print(
                f"{pl.row['name']:28} measured {pl.row['s_per_step']:.3f} s  fitted {s:.3f} s  "
                f"{s / pl.row['s_per_step'] - 1:+.1%}"
            )
        sources = dict(base.get("sources", {}))
        for _, keys in parse_groups(a.free):
            for key in keys:
                sources[key] = "fitted to measured steps (`fit`)"
        record = {
            "command": command,
            "rows": [f"{Path(f).parent.name}/{Path(f).name}" for f in a.fit],
            "predicted": {pl.row["name"]: [pl.row["s_per_step"], round(s, 4)] for pl, s in zip(rows, got)},
            "loss": speed.rounded(loss),
        }
        write_class(
            a.out,
            {
                **base,
                "gpu_class": gpu_class,
                "status": "fitted",
                "figures": fitted,
                "sources": sources,
                "fit": record,
                "date": datetime.now(timezone.utc).date().isoformat(),
            },
        )
        print(f"loss {loss:.4g}; wrote {a.out}")
        return 0
    import torch

    if a.smoke:  # the tiny FLUX.1 on the CPU, eager: that the command runs (its figures mean nothing)
        if not a.out:
            p.error("--smoke needs --out (a class file written there, never flux_cp/plan/speed_data/)")
        gpu, name, device = "cpu (smoke)", None, torch.device("cpu")
        resolutions, modes, preset, flags = [64], ["eager"], "tiny", ["--max_sequence_length", "32"]
    else:
        if not torch.cuda.is_available():
            p.error("measuring needs a CUDA GPU (--check and --fit run anywhere)")
        gpu, device = torch.cuda.get_device_name(), None
        name = a.gpu_class if a.gpu_class in speed.CLASSES else speed.class_of_gpu(gpu)
        resolutions, modes = [int(r) for r in a.resolutions.split(",")], a.modes.split(",")
        preset, flags = "flux1-dev-shapes", []
    out = a.out or (str(speed.class_file(name)) if name else None)
    if out is None:
        p.error(f"{gpu} is of no known class: give --out")
    base = class_data(name or "h100")  # what is not measured: the class's, or an H100's for another GPU
    raws, figures = calibrate(
        resolutions,
        a.precisions.split(","),
        modes,
        speed.Figures.from_json(base["figures"], sources=base.get("sources")),
        models,
        device,
        preset,
        flags,
    )
    sources = {k: (f"measured on {gpu}: {command}" if v == "measured" else v) for k, v in figures.sources.items()}
    write_class(
        out,
        {
            **base,
            "gpu_class": name,
            "gpu": gpu,
            "status": "measured",
            "figures": figures.to_json(),
            "sources": sources,
            "command": command,
            "date": datetime.now(timezone.utc).date().isoformat(),
        },
    )
    if a.results:
        rows = [
            {"name": f"{p}_{how}_{kind}_{res}", "precision": p, "mode": how, "kind": kind, "resolution": res, **t}
            for res, raw in raws
            for p, by in raw["blocks"].items()
            for how, bk in by.items()
            for kind, t in bk.items()
        ]
        schema.write(
            a.results, schema.result("speed_model", rows, command=command, settings={"raw": [r for _, r in raws]})
        )
    print(json.dumps(figures.to_json(), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
