"""What a resume accepts, decided from the output folder, the flags and the checkpoint's meta.json before anything
loads, so that a resume never mixes two runs in one folder and never rewinds one.

- No `--resume_from_checkpoint`: a new run; a folder holding an earlier run is refused unless
  `--overwrite_output_dir` replaces it.
- `latest`: the newest complete `checkpoint-N` of `--output_dir`. Without one, the run starts at step 0 only in a
  folder that holds no earlier run; a folder with a finished (or crashed) run but no checkpoint is refused like a
  new run, since starting it again replaces its outputs.
- A `checkpoint-N` of `--output_dir`: the run continues from step N. When later checkpoints exist, the resume starts
  a new branch: the later checkpoints, the final model and loss curve, the validation images after step N and a
  copy of metrics.jsonl are moved to `abandoned-<date>-<time>/` (renamed, never deleted), so that `latest` picks
  this branch afterwards and metrics.jsonl holds one trajectory.
- A checkpoint of another folder: a fork. Accepted only into a new or empty `--output_dir` (or one that
  `--overwrite_output_dir` empties); its metrics.jsonl starts with the source's rows up to step N, and the source
  folder is only read.
- Step N beyond `--max_train_steps` is refused: the run would write step N's weights under a smaller step.

What a checkpoint must share with the run resuming it (model, LoRA, data, resolution, global batch, seed) is
`run_identity` (`check_compatible` refuses another); the settings a resume may change are `RESUMABLE_CHANGES`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from flux_cp import checkpoint_folders, distributed, files, manifest
from flux_cp.errors import UsageError
from flux_cp.model import network_weights
from flux_cp.model.optim import optimizer_name
from flux_cp.outputs import checkpoint
from flux_cp.outputs.metrics import read_metrics
from flux_cp.terminal import printable

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.config.training import DataConfig
    from flux_cp.data.sources import DataIdentity

logger = logging.getLogger("flux_cp")


@dataclass(frozen=True)
class Decision:
    """How a run starts: `new` (step 0), `continue` (a checkpoint of its folder), `branch` (an earlier checkpoint of
    its folder: `later` are set aside), or `fork` (a checkpoint of another folder, into a fresh one)."""

    kind: str
    checkpoint: Path | None = None
    step: int = 0
    later: tuple[Path, ...] = field(default_factory=tuple)


def describe(names: list[str]) -> str:
    """`3 checkpoints up to checkpoint-6, metrics.jsonl, ...` for a list of output names."""
    checkpoints = [n for n in names if manifest.CHECKPOINT.match(n)]
    rest = [n for n in names if not manifest.CHECKPOINT.match(n)]
    if len(checkpoints) > 1:
        rest.insert(0, f"{len(checkpoints)} checkpoints up to {checkpoints[-1]}")
    elif checkpoints:
        rest.insert(0, checkpoints[0])
    return ", ".join(rest)


def used_folder(folder: Path, earlier: list[str]) -> UsageError:
    return UsageError(
        f"--output_dir {folder} holds an earlier run ({describe(earlier)}): pass --resume_from_checkpoint latest to "
        "continue it, --overwrite_output_dir to replace it, or choose another folder"
    )


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def check_steps(step: int, max_steps: int | None, path: Path, source: str = "--max_train_steps") -> None:
    """Refuse to resume a checkpoint of step `step` into a run of `max_steps` steps (set by `source`) when it is
    beyond them: the run would write that step's weights under a smaller step, over the checkpoint of that step."""
    if max_steps is not None and step > max_steps:
        raise UsageError(
            f"--resume_from_checkpoint {path} is at step {step}, beyond the {max_steps} steps of this run ({source}): "
            f"it would write the weights of step {step} as step {max_steps}. Set --max_train_steps to {step} or more, "
            "or resume an earlier checkpoint"
        )


def decide(
    output_dir: str | os.PathLike,
    resume: str | None,
    overwrite: bool,
    max_train_steps: int | None,
    earlier: list[str],
) -> Decision:
    """The decision for `--resume_from_checkpoint resume` into `output_dir`, whose earlier outputs (names, oldest
    checkpoint first) are `earlier`; a UsageError saying what to change when it is refused. Reads only."""
    folder = Path(output_dir)
    if resume is None:
        if earlier and not overwrite:
            raise used_folder(folder, earlier)
        return Decision("new")
    if overwrite and earlier and (resume == "latest" or _inside(Path(resume), folder)):
        raise UsageError(
            f"--overwrite_output_dir would delete the checkpoint --resume_from_checkpoint {resume} resumes from: "
            "pass one of the two"
        )
    if resume == "latest":
        found = checkpoint_folders.list_checkpoints(folder)
        if not found:
            if earlier:
                raise UsageError(
                    f"--resume_from_checkpoint latest: --output_dir {folder} holds an earlier run "
                    f"({describe(earlier)}) but no checkpoint to resume: starting it again from step 0 would replace "
                    "it. Pass --overwrite_output_dir to do so, or choose another folder"
                )
            return Decision("new")
        path = found[-1][1]
    else:
        path = checkpoint_folders.resolve(resume, str(folder))
    meta = checkpoint_folders.read_meta(path)
    step = meta["step"]
    check_steps(step, max_train_steps, path)
    if path.resolve().parent == folder.resolve():
        later = tuple(p for s, p in checkpoint_folders.list_checkpoints(folder) if s > step)
        checkpoint.verify_quick(path, meta)  # sizes, the small files' checksums: a damaged checkpoint named now
        return Decision("branch" if later else "continue", path, step, later)
    if earlier and not overwrite:
        if _inside(path, folder):
            inside = f"is inside --output_dir {folder} but not one of its checkpoints"
        else:
            inside = f"is not in --output_dir {folder}, which holds an earlier run ({describe(earlier)})"
        raise UsageError(
            f"--resume_from_checkpoint {path} {inside}: resuming it there would mix two runs in one folder. Resume it "
            f"into a new or empty --output_dir (a fork; {path.parent} is only read), or continue its own run with "
            f"--output_dir {path.parent}"
        )
    checkpoint.verify_quick(path, meta)
    return Decision("fork", path, step)


def apply(decision: Decision, output_dir: str | os.PathLike) -> list[str]:
    """Carry out what the decision needs in the output folder (main process, folder claimed); log lines."""
    folder = Path(output_dir)
    if decision.kind == "branch":
        return [_set_aside(folder, decision)]
    if decision.kind == "fork":
        return [_fork(folder, decision)]
    return []


def _set_aside(folder: Path, decision: Decision) -> str:
    """Move what the abandoned branch wrote after `decision.step` into `abandoned-<date>-<time>/`."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name, n = f"abandoned-{stamp}", 1
    while os.path.lexists(folder / name):
        name, n = f"abandoned-{stamp}-{n}", n + 1
    manifest.record(folder, name)
    aside = folder / name
    aside.mkdir()
    moved = []
    for path in decision.later:
        os.rename(path, aside / path.name)
        manifest.forget(folder, path.name)
        moved.append(path.name)
    for final in ("pytorch_lora_weights.safetensors", "transformer", "loss_curve.png"):
        if os.path.lexists(folder / final):
            os.rename(folder / final, aside / final)
            manifest.forget(folder, final)
            moved.append(final)
    images = [
        p
        for p in sorted((folder / "validation").glob("step-*.png"))
        if (m := re.match(r"step-(\d+)\.png$", p.name)) and int(m.group(1)) > decision.step
    ]
    if images:
        (aside / "validation").mkdir()
        for p in images:
            os.rename(p, aside / "validation" / p.name)
        moved.append(f"{len(images)} validation images")
    if (folder / "metrics.jsonl").is_file():
        shutil.copyfile(folder / "metrics.jsonl", aside / "metrics.jsonl")
        moved.append("a copy of metrics.jsonl")
    files.apply_umask(aside)
    return (
        f"resuming {decision.checkpoint.name} while later checkpoints exist: a new branch from step {decision.step}. "
        f"The later branch's outputs were moved to {aside} ({', '.join(moved)}); `latest` now picks this branch"
    )


def _fork(folder: Path, decision: Decision) -> str:
    """A fork starts its metrics.jsonl with the source run's rows up to the checkpoint's step."""
    source = decision.checkpoint.resolve().parent
    rows = [r for r in read_metrics(source / "metrics.jsonl") if isinstance(r.get("step"), int)]
    rows = [r for r in rows if r["step"] <= decision.step]
    if rows:
        manifest.record(folder, "metrics.jsonl")
        files.write_text(folder / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return (
        f"resuming {decision.checkpoint} (step {decision.step}) into --output_dir {folder}: a fork of that run, which "
        f"stays as it is"
        + (f"; metrics.jsonl starts with its {len(rows)} rows up to step {decision.step}" if rows else "")
    )


# --- what a checkpoint must share with the run resuming it ---------------------------------------------------

# Settings a resumed run may change: each is applied from the resumed step on (the rest are in the run identity,
# which a checkpoint must match; flux_cp.outputs.resume decides what a resume accepts).
RESUMABLE_CHANGES = (
    "learning_rate",
    "scale_lr",
    "lr_scheduler",
    "lr_warmup_steps",
    "lr_num_cycles",
    "lr_power",
    "adam_beta1",
    "adam_beta2",
    "adam_weight_decay",
    "adam_epsilon",
    "max_grad_norm",
    "max_train_steps",
    "num_train_epochs",
    "weighting_scheme",
    "logit_mean",
    "logit_std",
    "mode_scale",
    "guidance_scale",
    "lora_dropout",
    "mixed_precision",
    "center_crop",
    "random_flip",
    "cp_kernels",
    "cp_overlap",
    "cp_exchange_first",
    "cp_ulysses_chunks",
    "gradient_checkpointing",
    "offload_blocks",
    "prodigy_beta3",
    "prodigy_decouple",
    "prodigy_use_bias_correction",
    "prodigy_safeguard_warmup",
    "prior_loss_weight",
    "base_precision",
    "text_encoder_lr",
    "adam_weight_decay_text_encoder",
    "ema_decay",
    "ema_update_interval",
)

# Entries of the run identity compared through "data" (the fingerprint of the data set's names, contents and
# captions): the rows behind it (kept in the checkpoint's data.json, read to say which files differ) and the
# fingerprint of versions that identified the data by its path, to compare with their checkpoints.
_DATA_DETAIL = ("data_files", "data_legacy", "prior_files")


def run_identity(
    cfg: Config,
    samples_per_step: int,
    data: DataIdentity | str,
    buckets: list[tuple[int, int]] | None,
    classes: DataIdentity | None = None,
    components: dict[str, str] | None = None,
) -> dict:
    """What a checkpoint must share with the run that resumes it: the model and trainable weights, the data and
    what it sees (global batch per optimizer step and its micro-steps, resolutions, buckets, repeats, caption
    dropout, the class images of prior preservation, seed). The layout may differ (`batch_layout_change`). Keys are
    stored in every checkpoint's meta.json (`rank` is the LoRA rank), so values are JSON's types (lists). `data`,
    `classes`: the identity of the data set and of the class images (flux_cp.data.sources.DataIdentity: relative names,
    contents and captions)."""
    lora = None if cfg.lora.full_finetune else cfg.lora
    resolution = cfg.data.resolution  # one resolution: its number, as checkpoints have always recorded it
    identity = {
        "model": str(cfg.model.pretrained_model_name_or_path or "embedded-tiny"),
        "transformer_init": cfg.model.transformer_init,
        "full_finetune": cfg.lora.full_finetune,
        "rank": lora and lora.rank,
        "lora_alpha": lora and lora.lora_alpha,
        "lora_layers": lora and ",".join(lora.lora_layers),
        "adapter": cfg.lora.adapter,
        "global_batch": samples_per_step,
        "gradient_accumulation_steps": cfg.train.gradient_accumulation_steps,
        "data": data if isinstance(data, str) else data.fingerprint,
        "resolution": resolution[0] if len(resolution) == 1 else list(resolution),
        "repeats": cfg.data.repeats,
        "caption_dropout": cfg.data.caption_dropout,
        "prior": classes.fingerprint if classes is not None else None,
        "seed": cfg.train.seed,
        "aspect_buckets": [list(b) for b in buckets] if buckets is not None else False,
        "max_sequence_length": cfg.data.max_sequence_length,
        "vae_encode_mode": cfg.data.vae_encode_mode,
        "optimizer": optimizer_name(cfg.train),
        "train_text_encoder": cfg.lora.train_text_encoder,
        "use_ema": cfg.train.use_ema,
        "network_weights": lora and lora.network_weights and network_weights.fingerprint(lora.network_weights),
        "revision": cfg.model.revision,
        "variant": cfg.model.variant,
        "components": dict(sorted((components or {}).items())),
    }
    if not isinstance(data, str):
        identity.update(data_files=data.files, data_legacy=data.legacy)
    if classes is not None:  # kept in meta.json (a few rows): a resume with other class images names them
        identity["prior_files"] = classes.files
    return identity


def flag_identity(cfg: Config, samples_per_step: int, buckets: list[tuple[int, int]] | None) -> dict:
    """The keys of the run identity that the flags and the layout decide (all but the data, the class images and the
    model's components), to refuse an incompatible checkpoint before anything loads."""
    identity = run_identity(cfg, samples_per_step, "", buckets)
    for key in ("data", "prior", "components"):
        identity.pop(key)
    return identity


def check_known(cfg: Config, identity: Callable[[], dict]) -> None:
    """The checkpoint the run of `cfg` resumes (if any) against the keys of this run's identity known so far
    (`identity()`, called only when there is a checkpoint): refused before the work that would find the rest. Every
    rank reads the same checkpoint: one rank prints a refusal."""
    try:
        path = checkpoint_folders.resolve(cfg.checkpoints.resume_from_checkpoint, cfg.train.output_dir)
        if path is not None:
            check_compatible(checkpoint_folders.read_meta(path), identity(), path)
    except UsageError as e:
        raise UsageError(str(e), agreed=True) from None


def _data_differences(saved: list, now: list) -> str:
    """Which files differ between a checkpoint's data set and this run's (rows: name, content, caption, then each
    reference's name and content)."""
    old, new = {r[0]: r for r in saved}, {r[0]: r for r in now}
    kinds = (
        ("added", [n for n in new if n not in old]),
        ("removed", [n for n in old if n not in new]),
        ("changed content", [n for n in new if n in old and new[n][1] != old[n][1]]),
        ("changed caption", [n for n in new if n in old and new[n][2] != old[n][2]]),
        ("changed reference image", [r for n in new if n in old for r in _changed_references(n, old[n], new[n])]),
    )
    parts = [
        f"{kind}: {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        for kind, names in kinds
        if names
    ]
    return "; ".join(parts) or "the same files and captions in another order"


def _changed_references(name: str, old: list, new: list) -> list[str]:
    """The references of sample `name` that differ (by name or content), each named by its file, and with its
    place among several: `b.png (reference 2 of t.png)`."""
    pairs = [list(old[k : k + 2]) for k in range(3, len(old), 2)], [list(new[k : k + 2]) for k in range(3, len(new), 2)]
    count = max(len(pairs[0]), len(pairs[1]))
    out = []
    for j in range(count):
        was, now = (p[j] if j < len(p) else None for p in pairs)
        if was != now:
            ref = (now or was)[0]
            out.append(ref if count == 1 else f"{ref} (reference {j + 1} of {name})")
    return out


# Keys added to the run identity later, with the value every checkpoint written before them had.
_IDENTITY_BEFORE = {
    "optimizer": "adamw",
    "repeats": 1,
    "caption_dropout": 0.0,
    "prior": None,
    "train_text_encoder": False,
    "use_ema": False,
    "network_weights": None,
    "adapter": "lora",
}
# Keys added later whose value earlier checkpoints did not know: compared only when the checkpoint has them.
_IDENTITY_UNKNOWN_BEFORE = ("revision", "variant", "components", "gradient_accumulation_steps")
# How the global batch is formed: the samples of an optimizer step, and how many micro-steps they are cut into.
# Samples, noise and timesteps are drawn per micro-step and slot of the micro-step's batch (flux_cp.data.batches), so
# another cut draws others; the layout (per-device batch x data-parallel size, CP size) of a micro-step does not.
_BATCH = ("global_batch", "gradient_accumulation_steps")
_LABELS = {"gradient_accumulation_steps": "micro-steps per optimizer step (--gradient_accumulation_steps)"}


def saved_identity(meta: dict) -> dict:
    """A checkpoint's run identity, with the values of keys added since it was written where they are known (the
    accumulation of a checkpoint written before the identity held it is in its flags)."""
    saved = {**_IDENTITY_BEFORE, **meta["run"]}
    accumulation = (meta.get("args") or {}).get("gradient_accumulation_steps")
    if "gradient_accumulation_steps" not in saved and isinstance(accumulation, int):
        saved["gradient_accumulation_steps"] = accumulation
    return saved


def _batch_geometry(meta: dict) -> tuple[int, int, int, int] | None:
    """(per-device batch, data-parallel size, CP size, accumulation) a checkpoint was written with, from its run
    identity and flags; None when they do not say (a checkpoint written by hand, or damaged)."""
    saved, args = saved_identity(meta), meta.get("args") or {}
    total, accumulation = saved.get("global_batch"), saved.get("gradient_accumulation_steps")
    per_device, cp = args.get("train_batch_size"), args.get("cp_size", 1)
    values = (total, accumulation, per_device, cp)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    if total % (accumulation * per_device):
        return None
    return per_device, total // (accumulation * per_device), cp, accumulation


def _as_written(meta: dict, others: bool) -> str:
    """The flags that continue a checkpoint's run as it was written: its per-device batch and accumulation on its
    number of processes and CP size (or any layout of the same samples per micro-step); `others`: other settings
    differ too."""
    geometry = _batch_geometry(meta)
    also = " and the checkpoint's other settings" if others else ""
    if geometry is None:
        return (
            f"Resume with the checkpoint's --train_batch_size, data-parallel size and --gradient_accumulation_steps"
            f"{also}, or start a new --output_dir"
        )
    per_device, dp, cp, accumulation = geometry
    processes = dp * cp
    return (
        f"To continue it as it was, resume with --train_batch_size {per_device} --gradient_accumulation_steps "
        f"{accumulation} --cp_size {cp} on {processes} process{'es' if processes > 1 else ''} (or any layout whose "
        f"--train_batch_size x data-parallel size is {per_device * dp}){also}, or start a new --output_dir"
    )


def check_compatible(meta: dict, run: dict, path: Path) -> None:
    """Refuse a checkpoint from an incompatible run, naming what differs and what to change. `run` may hold only some
    keys of the run identity (those known so far): only those are compared."""
    saved = saved_identity(meta)
    diffs = []
    for k, v in run.items():
        if k in _DATA_DETAIL or (k in _IDENTITY_UNKNOWN_BEFORE and k not in saved):
            continue
        if k == "components":  # by name: the components whose config or weights changed (or that came or went)
            was = saved.get(k) if isinstance(saved.get(k), dict) else {}
            changed = sorted(n for n in {*was, *v} if was.get(n) != v.get(n))
            if changed:
                diffs.append(
                    f"the config or weights of {', '.join(printable(n) for n in changed)} differ from the "
                    "checkpoint's model"
                )
            continue
        if k == "data" and "data_legacy" not in saved and "data_legacy" in run:
            # Written before the data were identified by content: compare the fingerprint of that time.
            if saved.get("data") != run["data_legacy"]:
                diffs.append(f"data: checkpoint {saved.get('data')!r}, now {run['data_legacy']!r}")
        elif k == "data" and saved.get("data") != v and (rows := checkpoint.saved_data_files(path)) is not None:
            diffs.append(f"data set differs ({_data_differences(rows, run.get('data_files', []))})")
        elif k == "prior" and saved.get(k) and v and saved[k] != v and isinstance(saved.get("prior_files"), list):
            diffs.append(f"class images differ ({_data_differences(saved['prior_files'], run.get('prior_files', []))})")
        elif saved.get(k) != v:
            diffs.append(f"{_LABELS.get(k, k)}: checkpoint {saved.get(k)!r}, now {v!r}")
    if not diffs:
        return
    batch = sum(k in run and k in saved and saved[k] != run[k] for k in _BATCH)
    if batch:
        then = (
            "The samples, noise and timesteps of a step are drawn per micro-step, so another global batch or another "
            f"cut of it into micro-steps trains on other draws. {_as_written(meta, others=len(diffs) > batch)}"
        )
    else:
        then = (
            "Resume with the same settings (another dp x cp layout is fine when --train_batch_size x data-parallel "
            "size and --gradient_accumulation_steps stay the same), or start a new --output_dir"
        )
    raise UsageError(f"--resume_from_checkpoint {path} comes from an incompatible run ({'; '.join(diffs)}). {then}.")


def batch_layout_change(meta: dict, cfg: Config) -> str | None:
    """What a resume of checkpoint `meta` changes in the layout of its global batch (per-device batch, data-parallel
    size, CP size), said as exact; None when nothing changes or the checkpoint does not say. Only called once the run
    identity matched: the global batch and its micro-steps are the checkpoint's."""
    geometry = _batch_geometry(meta)
    if geometry is None:
        return None
    per_device, dp, cp, accumulation = geometry
    micro = per_device * dp
    now_per_device, now_cp = cfg.train.train_batch_size, cfg.parallel.cp_size
    now_dp = micro // now_per_device
    changes = [
        f"{what} {was} -> {now}"
        for what, was, now in (
            ("--train_batch_size", per_device, now_per_device),
            ("data-parallel size", dp, now_dp),
            ("--cp_size", cp, now_cp),
        )
        if was != now
    ]
    if not changes:
        return None
    steps = f"{accumulation} micro-step{'s' if accumulation > 1 else ''}"
    return (
        f"{', '.join(changes)}: exact, the same {micro} samples per micro-step (--train_batch_size x data-parallel "
        f"size) and {steps} per optimizer step, so the same samples, noise and timesteps and the same update (its "
        "sums over the ranks in another order)"
    )


def changed_settings(saved: dict, now: dict, names: tuple[str, ...]) -> list[str]:
    """`--flag old -> new` for each of `names` whose value differs between a checkpoint's args and this run's."""
    return [f"--{n} {printable(saved[n])} -> {now.get(n)}" for n in names if n in saved and saved[n] != now.get(n)]


# --- the checkpoint a run resumes -------------------------------------------------------------------------------


def verify_shares(cfg: Config, rank: int, world: int) -> None:
    """The checkpoint the run of `cfg` resumes, checked against the checksums written with it, every rank a share of
    its shards (before any model loads: a damaged checkpoint is refused naming the file)."""
    path = checkpoint_folders.resolve(cfg.checkpoints.resume_from_checkpoint, cfg.train.output_dir)
    if path is not None:
        problem = checkpoint.verify_shared(path, checkpoint_folders.read_meta(path), rank, world)
        distributed.check_all_ranks(problem is None, problem or "")


def checkpoint_of(cfg: Config, run: dict, max_steps: int) -> tuple[Path, dict] | None:
    """(the checkpoint the run of `cfg` resumes, its meta.json), refused when it comes from an incompatible run (`run`:
    this run's identity) or lies beyond the run's `max_steps`; None to start from step 0. Every rank reads the same
    checkpoint and holds the same run identity: one rank prints a refusal."""
    resume, output_dir = cfg.checkpoints.resume_from_checkpoint, cfg.train.output_dir
    try:
        path = checkpoint_folders.resolve(resume, output_dir)
        meta = checkpoint_folders.read_meta(path) if path is not None else None
        if meta is not None:
            check_compatible(meta, run, path)
            check_steps(meta["step"], max_steps, path, "--max_train_steps, or --num_train_epochs")
    except UsageError as e:
        raise UsageError(str(e), agreed=True) from None
    if path is None:
        if resume == "latest":
            logger.info(f"no checkpoint in {output_dir} yet: starting from step 0")
        return None
    return path, meta


def restore(path: Path, meta: dict, cfg: Config, model, optimizer, lr_scheduler, extra: dict | None = None) -> int:
    """Load checkpoint `path` (its `meta`) into the model, optimizer and schedule (and `extra`, as checkpoint.load
    takes it), on any layout, saying which settings this run changes; returns its step."""
    with_optimizer = meta.get("optimizer_state", True)
    applied = checkpoint.load(path, model, optimizer, lr_scheduler, with_optimizer, extra)
    logger.info(f"resumed from {path} at step {meta['step']} (written with {printable(meta['layout'])})")
    changed = changed_settings(meta.get("args", {}), cfg.flat(), RESUMABLE_CHANGES)
    for change in changed or applied:
        logger.info(f"resume: {change} (applied from step {meta['step'] + 1})")
    if layout := batch_layout_change(meta, cfg):
        logger.info(f"resume: {layout}")
    if not with_optimizer:
        logger.warning(
            f"warning: {path} has no optimizer state (--checkpoint_weights_only): AdamW's moments start from "
            "zero, so the next steps differ from an uninterrupted run"
        )
    return meta["step"]


def check_prior_resume(meta: dict, data: DataConfig, path: Path) -> None:
    """Before anything is generated: a resume needs the class images its checkpoint trained with. A checkpoint of
    a run without prior preservation, or with another number of class images, is refused, naming the counts."""
    if not data.with_prior_preservation:
        return
    run, args = meta.get("run", {}), meta.get("args", {})
    if run.get("prior") is None:
        raise UsageError(
            f"--resume_from_checkpoint {path} was trained without --with_prior_preservation: resume it without it, "
            "or start a new --output_dir"
        )
    rows = run.get("prior_files")
    count = len(rows) if isinstance(rows, list) else args.get("num_class_images")
    if isinstance(count, int) and count != data.num_class_images:
        raise UsageError(
            f"--resume_from_checkpoint {path} was trained with {count} class images, and this run asks for "
            f"--num_class_images {data.num_class_images}: resume with --num_class_images {count} (nothing is "
            "generated), or start a new --output_dir"
        )
