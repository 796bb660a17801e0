"""Checkpoint I/O without a launch: sizes known in advance, disk checks, safe loading, one-line failures, and
changed hyperparameters applied on resume."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from diffusers.optimization import get_scheduler

from flux_cp import checkpoint_folders
from flux_cp.config.training import LoraConfig
from flux_cp.errors import UsageError
from flux_cp.families import FLUX1
from flux_cp.families.flux1 import DEFAULT_TARGETS
from flux_cp.families.flux1.tiny import TRANSFORMER_CONFIG, tiny_transformer
from flux_cp.model.loading import prepare_trainable, save_full, trainable_parameters
from flux_cp.model.lora import save_lora
from flux_cp.outputs import checkpoint, resume
from flux_cp.plan import diskspace
from flux_cp.plan.counts import parameter_counts


def _tree(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _trained(lr: float = 1e-3, betas=(0.9, 0.999), full: bool = False, steps: int = 2):
    model = tiny_transformer()
    prepare_trainable(model, LoraConfig(full_finetune=full, rank=4, lora_alpha=4, lora_layers=DEFAULT_TARGETS), seed=0)
    params = [p for _, p in trainable_parameters(model)]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas)
    sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=1, num_training_steps=10)
    for _ in range(steps):
        loss = sum((p.float() ** 2).sum() for p in params)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def _save(out: Path, step: int, model, opt, sched, **kw) -> Path:
    return checkpoint.save(str(out), step, model, opt, sched, {"run": {}, "layout": "world 1 = dp 1 x cp 1"}, True,
                           None, **kw)  # fmt: skip


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_sizes_known_in_advance_match_what_is_written(tmp_path, full):
    model, opt, sched = _trained(full=full)
    counts = parameter_counts(FLUX1, TRANSFORMER_CONFIG, None if full else 4, list(DEFAULT_TARGETS))
    assert counts.trainable == sum(p.numel() for _, p in trainable_parameters(model))
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    trained = {k: v for k, v in state.items() if k in {n for n, _ in trainable_parameters(model)}}

    def lora_file(folder: Path) -> Path:  # a LoRA run's checkpoints hold the LoRA file of their step
        return save_lora(model, trained, str(folder), LoraConfig(), FLUX1)

    for with_opt in (True, False):
        s = diskspace.sizes(counts, full, with_opt, torch.bfloat16, world=1)
        writes = None if full else lora_file
        ckpt = _save(tmp_path / f"c{with_opt}", 2, model, opt, sched, optimizer_state=with_opt, write_files=writes)
        written = _tree(ckpt)
        assert written <= s.checkpoint <= written * 1.1 + 256 * 1024, (with_opt, written, s.checkpoint)
        assert (ckpt / "pytorch_lora_weights.safetensors").is_file() is not full
    if full:
        out = save_full(model, state, str(tmp_path / "model"), torch.bfloat16)
    else:
        out = lora_file(tmp_path / "model")
    written = _tree(out) if out.is_dir() else out.stat().st_size
    assert written <= s.model <= written * 1.1 + 2 * 2**20, (written, s.model)


def test_flux1_dev_full_finetuning_needs_a_143_gb_checkpoint_and_is_refused_on_a_128_gb_disk(tmp_path, monkeypatch):
    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER

    counts = parameter_counts(FLUX1, FLUX1_DEV_TRANSFORMER, None, [])
    assert counts.trainable == 11_901_408_320
    s = diskspace.sizes(counts, True, True, torch.bfloat16, world=2)
    assert 142.8e9 < s.checkpoint < 142.9e9 and 23.8e9 < s.model < 23.9e9
    monkeypatch.setenv("FLUX_CP_DISK_BYTES", str(128 * 10**9))
    with pytest.raises(UsageError) as e:
        diskspace.check_start(tmp_path, s, saves=1, total_limit=None)
    assert str(e.value) == (
        f"the disk of --output_dir {tmp_path} has 119.2 GiB free, but this run needs 155.2 GiB at least: one "
        "checkpoint 133.0 GiB (fp32 weights 44.3 GiB + AdamW state 88.7 GiB), the final transformer 22.2 GiB. Free "
        "space or choose another --output_dir; --checkpoint_weights_only makes checkpoints of 44.3 GiB"
    )
    small = diskspace.sizes(counts, True, False, torch.bfloat16, world=2)
    assert diskspace.check_start(tmp_path, small, saves=1, total_limit=None) is None
    warning = diskspace.check_start(tmp_path, small, saves=4, total_limit=None)
    assert warning.startswith("4 checkpoints of 44.3 GiB and the final transformer need 199.5 GiB")


def test_a_save_that_does_not_fit_stops_before_writing_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = _trained()
    first = _save(tmp_path, 2, model, opt, sched)
    size = _tree(first)
    monkeypatch.setenv("FLUX_CP_DISK_BYTES", str(size + size // 2))  # a disk holding only this folder
    with pytest.raises(UsageError) as e:
        diskspace.check_checkpoint(tmp_path, 4, size, is_main=True)  # before each save (flux_cp.run.output_phase)
    assert str(e.value).startswith(f"not enough disk space for checkpoint-4: it needs {diskspace.gib(size)}")
    assert f"Nothing was written; {first} is the last good checkpoint." in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_a_write_failure_inside_torch_is_one_line(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    model, opt, sched = _trained()
    _save(tmp_path, 2, model, opt, sched)

    def full_disk(*a, **k):
        raise CheckpointException("save", {0: (RuntimeError("unexpected pos 6841792 vs 6841680"), None)})

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(UsageError) as e:
        _save(tmp_path, 4, model, opt, sched)
    assert str(e.value) == (
        "writing checkpoint-4 failed (rank 0: RuntimeError: unexpected pos 6841792 vs 6841680); nothing was renamed, "
        f"{tmp_path / 'checkpoint-2'} is intact. Free disk space or choose another --output_dir, then resume."
    )


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_resume_runs_no_code_from_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, opt, sched = _trained()
    ckpt = _save(tmp_path / "out", 2, model, opt, sched)
    meta = (ckpt / "state" / ".metadata").read_bytes()
    (ckpt / "state" / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(UsageError, match=r"cannot load it \(.*refusing to load posix.system"):
        checkpoint.load(ckpt, *_trained(steps=0))
    (ckpt / "state" / ".metadata").write_bytes(meta)
    torch.save({"lr_scheduler": _RunsCode()}, ckpt / "train.pt")
    with pytest.raises(UsageError, match="cannot load it .*Weights only load failed"):
        checkpoint.load(ckpt, *_trained(steps=0))
    # a non-tensor entry of the optimizer state (DCP reads those with weights_only=False)
    model, opt, sched = _trained()
    opt.param_groups[0]["eps"] = _RunsCode()
    ckpt = _save(tmp_path / "out2", 2, model, opt, sched)
    with pytest.raises(UsageError, match="cannot load it .*Weights only load failed"):
        checkpoint.load(ckpt, *_trained(steps=0))
    assert not (tmp_path / "pwned").exists()


def test_a_truncated_shard_is_one_line_naming_the_checkpoint(tmp_path):
    model, opt, sched = _trained()
    ckpt = _save(tmp_path, 2, model, opt, sched)
    shard = next((ckpt / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(UsageError) as e:
        checkpoint.load(ckpt, *_trained(steps=0))
    message = str(e.value)
    assert message.startswith(f"--resume_from_checkpoint {ckpt}: cannot load it (rank 0: ") and "\n" not in message


def test_changed_hyperparameters_are_applied_on_resume(tmp_path):
    model, opt, sched = _trained(lr=1e-3)
    ckpt = _save(tmp_path, 2, model, opt, sched)
    saved_moments = [opt.state[p]["exp_avg"].clone() for p in opt.param_groups[0]["params"]]
    model2, opt2, sched2 = _trained(lr=5e-4, betas=(0.8, 0.99), steps=0)
    changes = checkpoint.load(ckpt, model2, opt2, sched2)
    assert changes == ["AdamW betas (0.9, 0.999) -> (0.8, 0.99)", "learning rate 0.001 -> 0.0005"]
    g = opt2.param_groups[0]
    assert g["betas"] == (0.8, 0.99) and sched2.last_epoch == 2
    assert g["lr"] == pytest.approx(5e-4 * sched2.lr_lambdas[0](2), rel=1e-12) == sched2.get_last_lr()[0]
    assert all(torch.equal(opt2.state[p]["exp_avg"], m) for p, m in zip(g["params"], saved_moments))
    sched2.step()
    assert g["lr"] == pytest.approx(5e-4 * sched2.lr_lambdas[0](3), rel=1e-12)
    # unchanged flags: nothing to say, the checkpoint's values stand
    model3, opt3, sched3 = _trained(lr=1e-3, steps=0)
    assert checkpoint.load(ckpt, model3, opt3, sched3) == []
    assert opt3.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_a_checkpoint_without_optimizer_state_restores_weights_and_schedule(tmp_path):
    model, opt, sched = _trained()
    ckpt = _save(tmp_path, 2, model, opt, sched, optimizer_state=False)
    model2, opt2, sched2 = _trained(steps=0)
    checkpoint.load(ckpt, model2, opt2, sched2, optimizer_state=False)
    a, b = dict(trainable_parameters(model)), dict(trainable_parameters(model2))
    assert all(torch.equal(a[k], b[k]) for k in a) and sched2.last_epoch == 2 and not opt2.state


def test_a_checkpoint_exception_outside_our_checkpoint_code_still_ends_as_one_line(capsys):
    from torch.distributed.checkpoint.api import CheckpointException

    from flux_cp.run.runner import run

    def main() -> int:
        raise CheckpointException("save", {0: (RuntimeError("unexpected pos 6841792 vs 6841680"), None)})

    assert run(main) == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: [rank 0] CheckpointException: RuntimeError: unexpected pos 6841792 vs 6841680"


def test_the_plan_shows_the_disk_a_run_needs(capsys):
    from flux_cp.config.parser import parse_config
    from flux_cp.plan.report import print_plan

    print_plan(parse_config(["--plan", "--checkpoints_total_limit", "2"]))
    disk = [line for line in capsys.readouterr().out.splitlines() if line.startswith("disk:")]
    assert disk == [
        "disk: one checkpoint 2.0 MiB (fp32 weights 0.5 MiB + AdamW state 1.0 MiB + the step's LoRA file 0.4 MiB), "
        "the final LoRA 0.4 MiB; keep at least 2.4 MiB free in --output_dir (2 checkpoints kept: 6.3 MiB)"
    ]


@pytest.mark.parametrize(
    "meta, message",
    [
        ("not json", "meta.json cannot be read"),
        (b"\xff\xfe", "meta.json cannot be read"),
        ("[1, 2]", "meta.json is a JSON list, not an object"),
        ('{"format": 2}', "format 2 is not 1"),
        ('{"format": 1, "run": {}, "layout": "x"}', "meta.json has no valid 'step' (got None)"),
        ('{"format": 1, "step": -3, "run": {}, "layout": "x"}', "meta.json has no valid 'step' (got -3)"),
        ('{"format": 1, "step": "3", "run": {}, "layout": "x"}', "meta.json has no valid 'step' (got '3')"),
        ('{"format": 1, "step": 3, "run": [], "layout": "x"}', "meta.json has no valid 'run' (got [])"),
        ('{"format": 1, "step": 3, "run": {}}', "meta.json has no valid 'layout'"),
        ('{"format": 1, "step": 3, "run": {}, "layout": "x", "args": 1}', "meta.json has no valid 'args' (got 1)"),
        ('{"format": 1, "step": 3, "run": {}, "layout": "x", "optimizer_state": "no"}', "no valid 'optimizer_state'"),
    ],
)
def test_every_field_of_meta_json_is_checked(tmp_path, meta, message):
    (tmp_path / "meta.json").write_bytes(meta if isinstance(meta, bytes) else meta.encode())
    with pytest.raises(
        UsageError, match=re.escape(f"--resume_from_checkpoint {tmp_path}: ") + ".*" + re.escape(message)
    ):
        checkpoint_folders.read_meta(tmp_path)


def _small(seed: int):
    """A model, optimizer and schedule small enough to checkpoint in milliseconds."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _rewrite_storage_paths(ckpt: Path, new_path) -> None:
    """Rewrite every storage entry's relative path in a checkpoint's DCP `.metadata` (as a hostile file would)."""
    metadata_file = ckpt / "state" / ".metadata"
    with open(metadata_file, "rb") as f:
        metadata = checkpoint._MetadataUnpickler(f).load()
    for key, info in list(metadata.storage_data.items()):
        metadata.storage_data[key] = type(info)(new_path(info.relative_path), info.offset, info.length)
    metadata_file.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("where", ["climbing", "absolute", "link"])
def test_a_checkpoint_path_leading_outside_its_state_folder_is_refused_before_it_is_opened(tmp_path, where):
    """Paths read from a checkpoint's `.metadata` name the files DCP opens: `../../other/state/__0_0.distcp` would
    load another run's weights without a word, an absolute path any file. Both are refused, as is a shard that is a
    link leading out of the folder."""
    other = _save(tmp_path / "other", 2, *_small(0))  # another run's shards, a valid target
    ckpt = _save(tmp_path / "run", 2, *_small(1))
    if where == "climbing":
        _rewrite_storage_paths(ckpt, lambda rel: f"../../../other/checkpoint-2/state/{rel}")
    elif where == "absolute":
        _rewrite_storage_paths(ckpt, lambda rel: str(other / "state" / rel))
    else:
        for shard in (ckpt / "state").glob("*.distcp"):
            shard.unlink()
            os.symlink(other / "state" / shard.name, shard)
    import builtins
    import io

    opened, real_open = [], io.open

    def spy(file, *a, **k):
        opened.append(os.path.realpath(file) if isinstance(file, (str, os.PathLike)) else str(file))
        return real_open(file, *a, **k)

    builtins.open = io.open = spy  # pathlib's open (DCP's) goes through io.open
    try:
        with pytest.raises(UsageError, match="leads outside|not a path inside"):
            checkpoint.load(ckpt, *_small(2))
    finally:
        builtins.open = io.open = real_open
    assert any(f.endswith(".metadata") for f in opened), opened  # the spy sees the files read
    assert not [f for f in opened if f.startswith(str(other))], opened


def test_a_changed_data_set_is_named_file_by_file(tmp_path):
    """The data set is identified by relative names, contents and captions; a resume onto another data set says
    which files differ. The checkpoint keeps the rows in data.json (meta.json stays small)."""
    from flux_cp.config.parser import parse_config
    from flux_cp.data.sources import DataIdentity

    def identity(rows):
        return DataIdentity("fp-" + str(hash(str(rows))), rows, "legacy")

    from flux_cp.families import FLUX1
    from flux_cp.shape.build import resolved

    before = [["a.png", "c1", "t1"], ["b.png", "c2", "t2"], ["c.png", "c3", "t3"]]
    after = [["a.png", "c1", "t9"], ["b.png", "cX", "t2"], ["d.png", "c4", "t4"]]
    cfg = resolved(parse_config([]), FLUX1, False, None)  # as the trainer holds the flags
    model, opt, sched = _small(0)
    meta = {"run": resume.run_identity(cfg, 1, identity(before), None), "layout": "x", "args": {}}
    ckpt = checkpoint.save(str(tmp_path), 2, model, opt, sched, meta, True, None)
    saved = checkpoint_folders.read_meta(ckpt)
    assert "data_files" not in saved["run"] and (ckpt / "data.json").is_file()
    resume.check_compatible(saved, resume.run_identity(cfg, 1, identity(before), None), ckpt)
    with pytest.raises(UsageError) as e:
        resume.check_compatible(saved, resume.run_identity(cfg, 1, identity(after), None), ckpt)
    assert (
        "incompatible run (data set differs (added: d.png; removed: c.png; changed content: b.png; changed caption: "
        "a.png)). Resume with the same settings"
    ) in str(e.value)
    # A checkpoint of a version that identified the data by its path: compared by that fingerprint.
    old = {"run": {**saved["run"], "data": "legacy"}}
    del old["run"]["data_legacy"]
    resume.check_compatible(old, resume.run_identity(cfg, 1, identity(after), None), ckpt)


# --- Prodigy and 8-bit AdamW: their state through DCP ------------------------------------------------------------


def _with(name: str, steps: int, **flags):
    """The tiny LoRA trained `steps` steps by the trainer's optimizer `name` (a quadratic pull of every weight to 1)."""
    from flux_cp.config.training import TrainConfig
    from flux_cp.model.optim import make_optimizer

    if name == "adamw8bit":
        pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install -e .[optim])")
    model = tiny_transformer()
    prepare_trainable(model, LoraConfig(rank=4, lora_alpha=4, lora_layers=DEFAULT_TARGETS), seed=0)
    params = [p for _, p in trainable_parameters(model)]
    train = TrainConfig(optimizer="adamw" if name == "adamw8bit" else name, use_8bit_adam=name == "adamw8bit",
                        learning_rate=1.0 if name == "prodigy" else 1e-2, **flags)  # fmt: skip
    opt = make_optimizer(train, params, global_batch=1)
    sched = get_scheduler("constant", optimizer=opt)
    _pull(params, opt, sched, steps)
    return model, opt, sched


def _pull(params, opt, sched, steps: int) -> None:
    for _ in range(steps):
        sum(((p.float() - 1.0) ** 2).sum() for p in params).backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", ["prodigy", "adamw8bit"])
def test_prodigy_and_8bit_adamw_resume_exactly(tmp_path, name):
    """Their state goes through torch.distributed.checkpoint's get/set_state_dict whole: Prodigy's step-size
    estimate (d, d_max, d_numerator, k: in its param groups) and its per-weight state, 8-bit AdamW's uint8 moments
    with their scales and maps. Resumed, they continue to the last bit as if never stopped; without the optimizer
    state they would not (the control)."""
    flags = {"prodigy_safeguard_warmup": False} if name == "prodigy" else {}  # so that d grows within 5 steps
    model, opt, sched = _with(name, 5, **flags)
    if name == "prodigy":
        assert opt.param_groups[0]["d"] > opt.param_groups[0]["d0"]  # the estimate moved: restoring it matters
    ckpt = _save(tmp_path, 5, model, opt, sched)
    params = [p for _, p in trainable_parameters(model)]
    _pull(params, opt, sched, 3)
    for with_state in (True, False):
        model2, opt2, sched2 = _with(name, 0, **flags)
        checkpoint.load(ckpt, model2, opt2, sched2, optimizer_state=with_state)
        _pull([p for _, p in trainable_parameters(model2)], opt2, sched2, 3)
        same = all(
            torch.equal(a, b) for (_, a), (_, b) in zip(trainable_parameters(model), trainable_parameters(model2))
        )
        assert same is with_state, f"optimizer state restored: {with_state}"


def test_changed_prodigy_settings_are_applied_on_resume(tmp_path):
    model, opt, sched = _with("prodigy", 2)
    ckpt = _save(tmp_path, 2, model, opt, sched)
    model2, opt2, sched2 = _with("prodigy", 0, prodigy_beta3=0.9, prodigy_decouple=False)
    changes = checkpoint.load(ckpt, model2, opt2, sched2)
    assert changes == ["Prodigy beta3 None -> 0.9", "Prodigy decouple True -> False"]
    group, saved = opt2.param_groups[0], opt.param_groups[0]
    assert (group["beta3"], group["decouple"]) == (0.9, False)
    assert (group["k"], group["d_numerator"]) == (saved["k"], saved["d_numerator"]) == (2, saved["d_numerator"])


@pytest.mark.parametrize("name", ["prodigy", "adamw8bit"])
def test_checkpoint_sizes_of_prodigy_and_8bit_adamw_are_known_in_advance(tmp_path, name):
    model, opt, sched = _with(name, 2)
    counts = parameter_counts(FLUX1, TRANSFORMER_CONFIG, 4, list(DEFAULT_TARGETS))
    s = diskspace.sizes(counts, False, True, torch.bfloat16, world=1, optimizer=name)
    written = _tree(_save(tmp_path, 2, model, opt, sched))
    assert written <= s.checkpoint, (written, s)
    if name == "prodigy":  # 8-bit AdamW: an upper bound here, every tensor of the tiny LoRA is too small for 8 bits
        assert s.checkpoint <= written * 1.1 + 256 * 1024, (written, s)
    label = {"prodigy": "Prodigy", "adamw8bit": "8-bit AdamW"}[name]
    assert f"+ {label} state" in s.describe()


def test_8bit_adamw_state_of_flux1_dev_is_a_quarter_of_adamws():
    """At FLUX.1-dev size (full fine-tuning) the estimate is the state bitsandbytes keeps, per tensor: two uint8
    moments with an fp32 scale per 256 values (fp32 moments under 4096 values) and two 256-entry maps."""
    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER

    with torch.device("meta"):
        from diffusers import FluxTransformer2DModel

        sizes = [p.numel() for p in FluxTransformer2DModel.from_config(FLUX1_DEV_TRANSFORMER).parameters()]
    exact = sum(2 * v + 2 * 4 * -(-v // 256) + 2 * 256 * 4 if v >= 4096 else 8 * v for v in sizes)
    counts = parameter_counts(FLUX1, FLUX1_DEV_TRANSFORMER, None, [])
    eight, adamw = (diskspace.sizes(counts, True, True, torch.bfloat16, 2, optimizer=o) for o in ("adamw8bit", "adamw"))
    assert exact <= eight.checkpoint_optimizer <= exact * 1.001 + len(sizes) * 64 * 1024
    assert 0.25 < eight.checkpoint_optimizer / adamw.checkpoint_optimizer < 0.26


def test_the_optimizer_is_part_of_a_runs_identity(tmp_path):
    from flux_cp.config.parser import parse_config
    from flux_cp.families import FLUX1
    from flux_cp.shape.build import resolved

    adamw = resume.run_identity(resolved(parse_config([]), FLUX1, False, None), 4, "data", None)
    prodigy = resume.run_identity(resolved(parse_config(["--optimizer", "prodigy"]), FLUX1, False, None), 4,
                                      "data", None)  # fmt: skip
    assert (adamw["optimizer"], prodigy["optimizer"]) == ("adamw", "prodigy")
    with pytest.raises(UsageError, match=r"incompatible run \(optimizer: checkpoint 'adamw', now 'prodigy'\)"):
        resume.check_compatible({"run": adamw}, prodigy, tmp_path)
    before = {k: v for k, v in adamw.items() if k != "optimizer"}  # written before the optimizer was recorded
    resume.check_compatible({"run": before}, adamw, tmp_path)
    with pytest.raises(UsageError, match=r"optimizer: checkpoint 'adamw', now 'prodigy'"):
        resume.check_compatible({"run": before}, prodigy, tmp_path)


def test_a_seed_checkpoint_that_cannot_be_one_is_refused_before_the_model_loads(tmp_path):
    """--seed_checkpoint naming a folder, something else than a file, or a file that is no safetensors: one line at
    start (a folder was written into after the model loaded, with a traceback)."""
    from safetensors.torch import save_file

    from flux_cp.errors import UsageError
    from flux_cp.model.loading import check_seed_checkpoint

    check_seed_checkpoint(str(tmp_path / "new" / "seed.safetensors"))  # absent: written there later
    save_file({"w": torch.zeros(2)}, tmp_path / "seed.safetensors")
    check_seed_checkpoint(str(tmp_path / "seed.safetensors"))
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00" * 64)
    os.mkfifo(tmp_path / "fifo")
    for path, message in (
        (tmp_path, "is a folder: name a file in it"),
        (tmp_path / "fifo", "is not a regular file"),
        (tmp_path / "garbage.safetensors", "cannot be read"),
        ("", "--seed_checkpoint is empty"),
    ):
        with pytest.raises(UsageError, match=message):
            check_seed_checkpoint(str(path))


def test_every_file_of_a_checkpoint_has_its_size_and_checksum_in_meta_json(tmp_path):
    model, opt, sched = _trained()
    ckpt = _save(tmp_path, 2, model, opt, sched)
    meta = checkpoint_folders.read_meta(ckpt)
    listed = meta["checksums"]["files"]
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != "meta.json")
    assert sorted(listed) == on_disk and "state/.metadata" in listed and "train.pt" in listed
    algorithm = meta["checksums"]["algorithm"]
    for name, info in listed.items():
        assert info == {"bytes": (ckpt / name).stat().st_size, "hash": checkpoint.file_checksum(ckpt / name, algorithm)}
    checkpoint.verify_quick(ckpt, meta)
    assert checkpoint.verify_shared(ckpt, meta, 0, 1) is None


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":  # same size, one byte changed
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["truncated", "flipped", "missing"])
@pytest.mark.parametrize("name", ["state/.metadata", "train.pt", "shard"])
def test_a_damaged_checkpoint_is_refused_at_resume_naming_the_file(tmp_path, monkeypatch, name, how):
    """Sizes and the small files are checked before any model loads (the main process), the shards' checksums by
    every rank's share; a truncated .metadata once gave two tracebacks before its line, a damaged shard NaNs."""
    model, opt, sched = _trained()
    ckpt = _save(tmp_path, 2, model, opt, sched)
    if name == "shard":
        name = next((ckpt / "state").glob("*.distcp")).relative_to(ckpt).as_posix()
        monkeypatch.setattr(checkpoint, "_SMALL", 0)  # the tiny shard checked as a large one is
    _damage(ckpt / name, how)
    meta = checkpoint_folders.read_meta(ckpt)
    why = {"truncated": "bytes, ", "flipped": "the checksum differs", "missing": "missing"}[how]
    expected = rf"^--resume_from_checkpoint {re.escape(str(ckpt))}: {re.escape(name)} is damaged \(.*{why}"
    if name.endswith(".distcp") and how == "flipped":
        checkpoint.verify_quick(ckpt, meta)  # the same size: found by its checksum, every rank a share
        found = [checkpoint.verify_shared(ckpt, meta, rank, 2) for rank in (0, 1)]  # one rank's share holds it
        assert len([f for f in found if f]) == 1 and re.match(expected, next(f for f in found if f))
        return
    with pytest.raises(UsageError, match=expected):
        checkpoint.verify_quick(ckpt, meta)


def test_a_checkpoint_written_before_checksums_still_has_its_metadata_read_at_start(tmp_path):
    model, opt, sched = _trained()
    ckpt = _save(tmp_path, 2, model, opt, sched)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["checksums"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    checkpoint.verify_quick(ckpt, checkpoint_folders.read_meta(ckpt))
    _damage(ckpt / "state" / ".metadata", "truncated")
    with pytest.raises(UsageError, match=r"state/.metadata is damaged \(it cannot be read: UnpicklingError"):
        checkpoint.verify_quick(ckpt, checkpoint_folders.read_meta(ckpt))
    meta["checksums"] = {"algorithm": "xxh3_128", "files": {"train.pt": {"bytes": "12"}}}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UsageError, match="meta.json's 'checksums' is not a list of files"):
        checkpoint_folders.read_meta(ckpt)


def test_non_finite_values_in_a_loaded_checkpoint_are_named_as_such(tmp_path):
    """A checkpoint whose weights or moments hold a NaN (a diverged run, or damage after the checksums) is refused
    when loaded, naming the tensors, instead of training on and blaming the learning rate at the next step."""
    model, opt, sched = _trained()
    name, param = next((n, p) for n, p in trainable_parameters(model))
    with torch.no_grad():
        param[0, 0] = float("nan")
    opt.state[param]["exp_avg"].fill_(float("inf"))
    ckpt = _save(tmp_path, 2, model, opt, sched)
    with pytest.raises(UsageError) as e:
        checkpoint.load(ckpt, *_trained(steps=0))
    assert str(e.value).startswith(f"--resume_from_checkpoint {ckpt} holds values that are not finite (NaN or inf) in "
                                   f"{name}, {name} (exp_avg): the run that wrote it had diverged")  # fmt: skip
    model2, opt2, sched2 = _trained(steps=0)
    checkpoint.load(_save(tmp_path / "fine", 2, *_trained()), model2, opt2, sched2)  # finite: loads
