"""The lines a run ends with: every output it wrote (what is in its output folder, and where it was pushed), how
the loss moved, and the diffusers lines that load the trained weights."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from flux_cp import manifest
from flux_cp.checkpoint_folders import list_checkpoints
from flux_cp.errors import UsageError
from flux_cp.families.base import default_family
from flux_cp.model.adapters import label
from flux_cp.outputs.card import LORA_FILE, run_notes, snippet

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.families.base import Family

LISTED_GRIDS = 4  # validation grids named one by one; more are counted


def loss_change(metrics: Path) -> tuple[float, float, int] | None:
    """(mean loss of the first n steps, of the last n steps, n) from metrics.jsonl, n a fifth of the steps (the
    README's demo figures); None with fewer than 2 finite losses."""
    try:
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    if len(losses) < 2:
        return None
    n = max(1, len(losses) // 5)
    return sum(losses[:n]) / n, sum(losses[-n:]) / n, n


def _grids(folder: Path) -> str:
    names = [p.name for p in sorted(folder.glob("step-*.png"))]
    if len(names) <= LISTED_GRIDS:
        return ", ".join(names)
    return f"{len(names)} grids, {names[0]} ... {names[-1]}"


def outputs(
    cfg: Config, hub_url: str | None = None, tracker_urls: tuple[str, ...] = (), references: tuple[str, ...] = ()
) -> list[tuple[str, str]]:
    """(name, what it is) of every output of the run that exists in its output folder, then where it went.
    `references`: the reference images the run copied there (flux_cp.outputs.card.reference_names)."""
    out = Path(cfg.train.output_dir)
    found: list[tuple[str, str]] = []
    if (out / LORA_FILE).is_file():
        found.append((LORA_FILE, f"the {label(cfg.lora.adapter)} ({cfg.lora.lora_format} format)"))
    if (out / "transformer").is_dir():
        found.append(("transformer/", "the fine-tuned transformer (diffusers' format)"))
    for name, what in (
        ("README.md", "model card"),
        ("README.flux-cp.md", "this run's model card (README.md is yours)"),
        ("run_config.json", "every setting of the run"),
        ("metrics.jsonl", "one row per step: loss, lr, speed, memory"),
        ("loss_curve.png", "the loss curve"),
    ):
        if (out / name).is_file():
            found.append((name, what))
    refs = [n for n in references if (out / n).is_file()]
    if refs:
        found.append((", ".join(refs), "the reference image" + "s" * (len(refs) > 1) + " the lines below edit"))
    if (out / "validation").is_dir() and any((out / "validation").glob("step-*.png")):
        found.append(("validation/", f"validation images: {_grids(out / 'validation')}"))
    paths = [path for _, path in list_checkpoints(out)]
    if paths:
        kept = [p.name for p in paths]
        which = "latest" if len(kept) == 1 else "latest or one of them"
        # with the LoRA file of its step (flux_cp.run.output_phase; not those of versions before), which the lines load
        # too
        holds = "each holds its step's LoRA" if len(kept) > 1 else "holds its step's LoRA"
        lora = f"; {holds}" if all((p / LORA_FILE).is_file() for p in paths) else ""
        found.append((", ".join(f"{k}/" for k in kept), f"resumable: --resume_from_checkpoint {which}{lora}"))
    logs = out / cfg.validation.logging_dir
    if cfg.validation.report_to in ("tensorboard", "all") and logs.is_dir():
        found.append((f"{cfg.validation.logging_dir}/", f"tensorboard --logdir {logs}"))
    if cfg.validation.report_to in ("wandb", "all") and (logs / "wandb").is_dir():
        found.append((f"{cfg.validation.logging_dir}/wandb/", "wandb's files (offline runs: wandb sync)"))
    if (out / "profile").is_dir():
        found.append(("profile/", "the profiled step's traces and summary"))
    found += [(url, "the run in wandb") for url in tracker_urls]
    if hub_url:
        found.append((hub_url, "pushed: the model, its card, validation images and metrics"))
    return found


def _card_written(out: Path) -> Path | None:
    """The model card this run wrote: `README.md`, or `README.flux-cp.md` beside a README of the user's (kept);
    None when it wrote none."""
    try:
        written = manifest.read(out) or []
    except UsageError:  # a damaged manifest: the run already said so
        return None
    return next((out / n for n in ("README.md", "README.flux-cp.md") if n in written and (out / n).is_file()), None)


def summary(
    cfg: Config,
    *,
    steps: int,
    pairs: bool,
    hub_url: str | None = None,
    repo_id: str | None = None,
    tracker_urls: tuple[str, ...] = (),
    family: Family | None = None,
    references: tuple[str, ...] | None = None,
) -> str:
    """The closing summary of a finished run of `steps` optimizer steps: its outputs, what its weights rest on where
    it is not the plain case (flux_cp.outputs.card.run_notes), how to load them. `family`: the model family trained
    (default: the first registered, the embedded default's; its pipeline loads the weights); `pairs`: trained on its
    image-editing pairs; `repo_id`: where they were pushed;
    `references`: the reference images the lines edit (flux_cp.outputs.card.snippet)."""
    out = Path(cfg.train.output_dir)
    change = loss_change(out / "metrics.jsonl")
    head = f"done: {steps} step{'s' * (steps != 1)}"
    if change:
        first, last, n = change
        which = "the first step against the last" if n == 1 else f"means of the first and last {n} steps"
        head += f", loss {first:.3f} -> {last:.3f} ({(last - first) / first:+.0%}, {which})"
    found = outputs(cfg, hub_url, tracker_urls, references or ())
    width = max((len(name) for name, _ in found if len(name) <= 40), default=0)
    lines = [f"{head}. Outputs in {out}:"]
    lines += [f"  {name.ljust(width)}  {what}" for name, what in found]
    lines += run_notes(cfg, cfg.model.pretrained_model_name_or_path or "the embedded tiny Flux")
    what = "transformer" if cfg.lora.full_finetune else label(cfg.lora.adapter)
    code = snippet(
        cfg,
        pairs,
        repo_id or str(out),
        cfg.model.pretrained_model_name_or_path,
        family or default_family(),
        hub=bool(repo_id),
        references=references,
        image_folder=str(out) if repo_id else None,
    )
    written = _card_written(out)
    card = f" (also in the model card, {written})" if written else ""
    lines.append(f"Load the {what} with diffusers{card}:")
    lines += [f"    {line}" if line else "" for line in code.splitlines()]
    return "\n".join(lines)
