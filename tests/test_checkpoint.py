"""Checkpoints on one process: save/load restore exactly what training needs, folders appear complete or
not at all, `latest` and the total limit, and the compatibility check's message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flux_cp import checkpoint, resume
from flux_cp.errors import UsageError
from flux_cp.faults import Fault


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
    meta = checkpoint.read_meta(saved)
    assert meta["step"] == 3 and meta["format"] == checkpoint.FORMAT


def test_latest_skips_partial_folders_and_the_limit_keeps_the_newest(tmp_path):
    trainee = _trainee(0)
    for step in (2, 4, 6):
        _save(tmp_path, step, trainee, limit=2)
    (tmp_path / ".checkpoint-8.partial").mkdir()
    (tmp_path / "checkpoint-9").mkdir()  # no meta.json: not a complete checkpoint
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [4, 6]
    assert checkpoint.resolve("latest", str(tmp_path)) == tmp_path / "checkpoint-6"
    assert checkpoint.resolve("latest", str(tmp_path / "empty")) is None
    assert checkpoint.resolve(None, str(tmp_path)) is None
    with pytest.raises(UsageError, match="is not a complete checkpoint"):
        checkpoint.resolve(str(tmp_path / "checkpoint-9"), str(tmp_path))


def test_a_failed_save_removes_its_partial_folder_and_names_the_intact_one(tmp_path):
    trainee = _trainee(0)
    _save(tmp_path, 2, trainee)
    with pytest.raises(UsageError, match=r"writing checkpoint-4 failed \(\[Errno 28\].*checkpoint-2 is intact"):
        _save(tmp_path, 4, trainee, fault=Fault(0, 4, "enospc_in_save"))
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2]
    assert not (tmp_path / ".checkpoint-4.partial").exists()


def test_a_run_is_compatible_with_its_own_checkpoint_after_the_json_round_trip(tmp_path):
    from flux_cp.config import parse_config
    from flux_cp.families import FLUX1
    from flux_cp.shape import resolved

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
        checkpoint.read_meta(tmp_path)


def test_other_class_images_are_named_file_by_file(tmp_path):
    """Prior preservation: the class images' rows are in the run identity (meta.json), so a resume with others says
    which files differ, not only two fingerprints."""
    from flux_cp.config import parse_config
    from flux_cp.data import DataIdentity
    from flux_cp.families import FLUX1
    from flux_cp.shape import resolved

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
    from flux_cp.config import parse_config

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
    """With checkpoints of later steps in the folder (another branch, had it not been set aside by flux_cp.resume),
    the limit prunes older checkpoints only: the checkpoint just written always stays."""
    trainee = _trainee(0)
    for step in (4, 6):
        _save(tmp_path, step, trainee)
    _save(tmp_path, 2, trainee, limit=2)
    _save(tmp_path, 3, trainee, limit=2)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2, 3, 4, 6]
    _save(tmp_path, 5, trainee, limit=2)  # keeps itself and the newest older one (by step)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [4, 5, 6]
