"""Checkpoints on one process: save/load restore exactly what training needs, folders appear complete or
not at all, `latest` and the total limit, and the compatibility check's message."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from flux_cp import checkpoint_folders
from flux_cp.errors import UsageError
from flux_cp.outputs import checkpoint, resume
from flux_cp.run.faults import Fault


def _trainee(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)  # frozen weights are not part of a checkpoint
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    return model, optimizer, scheduler


def _steps(model, optimizer, scheduler, n: int) -> None:
    for _ in range(n):
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _save(out: Path, step: int, trainee, limit: int | None = None, fault: Fault | None = None) -> Path:
    meta = {"run": {"seed": 1}, "layout": "world 1 = dp 1 x cp 1"}
    return checkpoint.save(str(out), step, *trainee, meta, True, limit, fault)


def test_load_restores_weights_optimizer_and_schedule_and_reads_everything_save_wrote(tmp_path):
    trainee = _trainee(0)
    _steps(*trainee, 3)
    saved = _save(tmp_path, 3, trainee)
    expected = {k: v.clone() for k, v in trainee[0].state_dict().items()}
    moments = [s["exp_avg"].clone() for s in trainee[1].state.values()]
    lr = trainee[2].get_last_lr()

    other = _trainee(1)  # different weights, no optimizer state yet
    _steps(*other, 1)
    model, optimizer, scheduler = other
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(torch.equal(model.state_dict()[k], expected[k]) for k in trainable)
    checkpoint.load(saved, *other)
    for k in trainable:
        assert torch.equal(model.state_dict()[k], expected[k]), k
    assert all(torch.equal(a["exp_avg"], b) for a, b in zip(optimizer.state.values(), moments))
    assert scheduler.get_last_lr() == lr and scheduler.last_epoch == 3
    # Nothing is written that load does not read (the data order and noise are keyed by step, not RNG state).
    assert set(torch.load(saved / "train.pt", weights_only=False)) == {"lr_scheduler"}
    meta = checkpoint_folders.read_meta(saved)
    assert meta["step"] == 3 and meta["format"] == checkpoint_folders.FORMAT


def test_latest_skips_partial_folders_and_the_limit_keeps_the_newest(tmp_path):
    trainee = _trainee(0)
    for step in (2, 4, 6):
        _save(tmp_path, step, trainee, limit=2)
    (tmp_path / ".checkpoint-8.partial").mkdir()
    (tmp_path / "checkpoint-9").mkdir()  # no meta.json: not a complete checkpoint
    assert [s for s, _ in checkpoint_folders.list_checkpoints(tmp_path)] == [4, 6]
    assert checkpoint_folders.resolve("latest", str(tmp_path)) == tmp_path / "checkpoint-6"
    assert checkpoint_folders.resolve("latest", str(tmp_path / "empty")) is None
    assert checkpoint_folders.resolve(None, str(tmp_path)) is None
    with pytest.raises(UsageError, match="is not a complete checkpoint"):
        checkpoint_folders.resolve(str(tmp_path / "checkpoint-9"), str(tmp_path))


def test_a_failed_save_removes_its_partial_folder_and_names_the_intact_one(tmp_path):
    trainee = _trainee(0)
    _save(tmp_path, 2, trainee)
    with pytest.raises(UsageError, match=r"writing checkpoint-4 failed \(\[Errno 28\].*checkpoint-2 is intact"):
        _save(tmp_path, 4, trainee, fault=Fault(0, 4, "enospc_in_save"))
    assert [s for s, _ in checkpoint_folders.list_checkpoints(tmp_path)] == [2]
    assert not (tmp_path / ".checkpoint-4.partial").exists()


def test_a_run_is_compatible_with_its_own_checkpoint_after_the_json_round_trip(tmp_path):
    from flux_cp.config.parser import parse_config
    from flux_cp.families import FLUX1
    from flux_cp.shape.build import resolved

    cfg = resolved(parse_config(["--aspect_buckets", "--resolution", "128"]), FLUX1, False, None)  # as the trainer
    identity = resume.run_identity(cfg, 2, "abc", [(128, 128), (112, 144)])
    meta = json.loads(json.dumps({"run": identity}))
    resume.check_compatible(meta, identity, tmp_path)
    assert identity["rank"] == 16 and identity["lora_layers"].startswith("attn.to_k,")
    full = resume.run_identity(parse_config(["--full_finetune"]), 2, "abc", None)
    assert full["rank"] is None and full["aspect_buckets"] is False


def test_incompatible_runs_and_formats_are_refused_with_what_differs(tmp_path):
    meta = {"run": {"global_batch": 1, "seed": 5}}
    resume.check_compatible(meta, {"global_batch": 1, "seed": 5}, tmp_path)
    with pytest.raises(UsageError, match=r"incompatible run \(global_batch: checkpoint 1, now 2\)"):
        resume.check_compatible(meta, {"global_batch": 2, "seed": 5}, tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(UsageError, match="format 99 is not"):
        checkpoint_folders.read_meta(tmp_path)


ACCUMULATION = "micro-steps per optimizer step (--gradient_accumulation_steps): checkpoint 1, now 2"


def _written(flags: list[str], dp: int = 1) -> tuple[dict, dict]:
    """(meta.json of a checkpoint written with `flags` on `dp` data-parallel ranks, the run identity of `flags`)."""
    from flux_cp.config.parser import parse_config

    cfg = parse_config(["--lora_layers", "attn.to_q", *flags])
    samples = cfg.train.train_batch_size * dp * cfg.train.gradient_accumulation_steps
    identity = resume.run_identity(cfg, samples, "abc", None)
    return json.loads(json.dumps({"run": identity, "args": cfg.flat()})), identity


def test_another_cut_of_the_global_batch_into_micro_steps_is_refused_with_the_flags_that_continue_the_run(tmp_path):
    """Batch 2 resumed as batch 1 with 2 accumulated micro-steps: the same global batch, but the samples, noise and
    timesteps are drawn per micro-step, so the run would continue on other draws. Refused naming the checkpoint's
    per-device batch, accumulation, CP size and processes; a checkpoint written before the identity held the
    accumulation is compared through its flags."""
    from flux_cp.config.parser import parse_config

    meta, _ = _written(["--train_batch_size", "2", "--cp_size", "2"])
    _, accumulated = _written(["--train_batch_size", "1", "--gradient_accumulation_steps", "2"])
    advice = (
        "To continue it as it was, resume with --train_batch_size 2 --gradient_accumulation_steps 1 --cp_size 2 "
        "on 2 processes (or any layout whose --train_batch_size x data-parallel size is 2)"
    )
    with pytest.raises(UsageError) as refused:
        resume.check_compatible(meta, accumulated, tmp_path)
    assert f"incompatible run ({ACCUMULATION})." in str(refused.value)
    assert advice in str(refused.value)
    older = {**meta, "run": {k: v for k, v in meta["run"].items() if k != "gradient_accumulation_steps"}}
    with pytest.raises(UsageError, match=re.escape(ACCUMULATION)):
        resume.check_compatible(older, accumulated, tmp_path)
    _, doubled = _written(["--train_batch_size", "2"], dp=2)  # another global batch: the same advice
    with pytest.raises(UsageError, match=r"\(global_batch: checkpoint 2, now 4\)\. The samples") as refused:
        resume.check_compatible(meta, doubled, tmp_path)
    assert advice in str(refused.value)
    # What the flags decide is compared before anything loads (flux_cp.outputs.outdir.claim_run): the same refusal
    flags = parse_config(
        ["--lora_layers", "attn.to_q", "--train_batch_size", "1", "--gradient_accumulation_steps", "2"]
    )
    with pytest.raises(UsageError, match=re.escape(ACCUMULATION)):
        resume.check_compatible(meta, resume.flag_identity(flags, 2, None), tmp_path)


def test_a_resume_on_another_layout_of_the_same_micro_steps_is_said_to_be_exact():
    """Per-device batch x data-parallel size and the accumulation kept, the CP size or the split between batch and
    ranks changed: the same draws (docs/design.md, rule 1); the resume says so in one line. The same layout: no
    line."""
    from flux_cp.config.parser import parse_config

    meta, _ = _written(["--train_batch_size", "2", "--cp_size", "2"])
    line = resume.batch_layout_change(meta, parse_config(["--train_batch_size", "1", "--cp_size", "1"]))
    assert line.startswith(
        "--train_batch_size 2 -> 1, data-parallel size 1 -> 2, --cp_size 2 -> 1: exact, the same "
        "2 samples per micro-step (--train_batch_size x data-parallel size) and 1 micro-step per "
        "optimizer step"
    )
    line = resume.batch_layout_change(meta, parse_config(["--train_batch_size", "2", "--cp_size", "4"]))
    assert line.startswith("--cp_size 2 -> 4: exact")
    assert resume.batch_layout_change(meta, parse_config(["--train_batch_size", "2", "--cp_size", "2"])) is None
    assert (
        resume.batch_layout_change({"run": {}, "args": {}}, parse_config([])) is None
    )  # a checkpoint that does not say


def test_a_resume_with_another_seed_is_refused():
    """The seed keys every draw (data order, crops, flips, noise, timesteps, the LoRA's initial weights): a resume
    with another one would continue on other draws."""
    meta, _ = _written(["--seed", "1"])
    _, other = _written(["--seed", "2"])
    with pytest.raises(UsageError, match=r"incompatible run \(seed: checkpoint 1, now 2\)"):
        resume.check_compatible(meta, other, Path("checkpoint-2"))


def test_other_class_images_are_named_file_by_file(tmp_path):
    """Prior preservation: the class images' rows are in the run identity (meta.json), so a resume with others says
    which files differ, not only two fingerprints."""
    from flux_cp.config.parser import parse_config
    from flux_cp.data.sources import DataIdentity
    from flux_cp.families import FLUX1
    from flux_cp.shape.build import resolved

    flags = ["--with_prior_preservation", "--class_data_dir", str(tmp_path), "--class_prompt", "a dog"]
    cfg = resolved(parse_config(flags), FLUX1, False, None)  # as the trainer holds the flags
    before = DataIdentity("fp1", [["dog1.png", "c1", "t"], ["generated/00000-a.png", "c2", "t"]], "l")
    after = DataIdentity("fp2", [["dog1.png", "c9", "t"], ["generated/00000-a.png", "c2", "t"]], "l")
    meta = json.loads(json.dumps({"run": resume.run_identity(cfg, 2, "abc", None, before)}))
    resume.check_compatible(meta, resume.run_identity(cfg, 2, "abc", None, before), tmp_path)
    with pytest.raises(UsageError, match=r"incompatible run \(class images differ \(changed content: dog1.png\)\)"):
        resume.check_compatible(meta, resume.run_identity(cfg, 2, "abc", None, after), tmp_path)


def test_a_resume_on_changed_model_components_or_revision_is_refused_naming_them(tmp_path):
    """The run identity holds every component's fingerprint (config and weights' content) and the revision: a resume
    on weights changed in place is refused naming the components; a checkpoint written before they were recorded
    is compared without them."""
    from flux_cp.config.parser import parse_config

    cfg = parse_config(["--lora_layers", "attn.to_q"])
    components = {"transformer": "t1", "vae": "v1", "text_encoder": "c1", "text_encoder_2": "e1"}
    identity = resume.run_identity(cfg, 2, "abc", None, components=components)
    meta = json.loads(json.dumps({"run": identity}))
    resume.check_compatible(meta, identity, tmp_path)
    changed = resume.run_identity(cfg, 2, "abc", None, components={**components, "transformer": "t2",
                                                                       "text_encoder_2": "e2"})  # fmt: skip
    with pytest.raises(UsageError, match=r"incompatible run \(the config or weights of text_encoder_2, transformer "
                       r"differ from the checkpoint's model\)"):  # fmt: skip
        resume.check_compatible(meta, changed, tmp_path)
    revised = parse_config(["--lora_layers", "attn.to_q", "--revision", "v2"])
    other = resume.run_identity(revised, 2, "abc", None, components=components)
    with pytest.raises(UsageError, match=r"incompatible run \(revision: checkpoint None, now 'v2'\)"):
        resume.check_compatible(meta, other, tmp_path)
    before = {"run": {k: v for k, v in identity.items() if k not in ("components", "revision", "variant")}}
    resume.check_compatible(before, changed, tmp_path)


def test_the_total_limit_never_prunes_the_checkpoint_just_written(tmp_path):
    """With checkpoints of later steps in the folder (another branch, had it not been set aside by
    flux_cp.outputs.resume), the limit prunes older checkpoints only: the checkpoint just written always stays."""
    trainee = _trainee(0)
    for step in (4, 6):
        _save(tmp_path, step, trainee)
    _save(tmp_path, 2, trainee, limit=2)
    _save(tmp_path, 3, trainee, limit=2)
    assert [s for s, _ in checkpoint_folders.list_checkpoints(tmp_path)] == [2, 3, 4, 6]
    _save(tmp_path, 5, trainee, limit=2)  # keeps itself and the newest older one (by step)
    assert [s for s, _ in checkpoint_folders.list_checkpoints(tmp_path)] == [4, 5, 6]
