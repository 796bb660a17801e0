"""An output folder belongs to one run: earlier runs are refused unless resumed or overwritten; one live run; the
trainer deletes only what a flux-cp run wrote (its manifest), never a folder it did not create; the output folder
stays apart from the model and the data; what a resume accepts (flux_cp.outputs.resume)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from flux_cp import checkpoint_folders, manifest
from flux_cp.errors import UsageError
from flux_cp.outputs import checkpoint, outdir
from tests.launch import ROOT, env, in_process, python_cmd


def _checkpoint(folder: Path, step: int) -> Path:
    """A checkpoint folder as flux-cp writes it (meta.json with the run identity `_run`'s flags decide, and DCP
    metadata of no tensors: a resume reads them at start; the rest of the state is not read by these tests)."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from flux_cp.config.parser import parse_config
    from flux_cp.families import FLUX1
    from flux_cp.outputs.resume import flag_identity
    from flux_cp.shape.build import resolved

    path = folder / f"checkpoint-{step}"
    (path / "state").mkdir(parents=True, exist_ok=True)
    (path / "state" / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
    run = flag_identity(resolved(parse_config(["--max_train_steps", "2"]), FLUX1, False, None), 1, None)
    meta = {"format": 1, "step": step, "run": run, "layout": "world 1 = dp 1 x cp 1", "args": {}}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def _earlier_run(folder: Path, steps: tuple[int, ...] = (2, 10), partial: bool = False) -> None:
    """A folder written by a version before the manifest: its run_config.json marks it as flux-cp's."""
    folder.mkdir(parents=True, exist_ok=True)
    for step in steps:
        _checkpoint(folder, step)
    if partial:  # left by a crash while writing a checkpoint
        (folder / ".checkpoint-12.partial" / "state").mkdir(parents=True, exist_ok=True)
    (folder / "run_config.json").write_text(json.dumps({"output_dir": str(folder), "cp_size": 1,
                                                        "resume_from_checkpoint": None}))  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 11)))
    (folder / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    (folder / "logs" / "flux-cp").mkdir(parents=True, exist_ok=True)
    (folder / "logs" / "flux-cp" / "events.out.tfevents.1.host.1.0").write_bytes(b"x")
    (folder / "notes.txt").write_text("mine")


def test_an_earlier_run_is_refused_resumed_or_overwritten(tmp_path):
    folder = tmp_path / "out"
    assert outdir.claim(folder, None, False).removed == []  # new and empty: created
    outdir.release(folder)
    (folder / manifest.NAME).unlink()
    _earlier_run(folder, partial=True)
    with pytest.raises(UsageError) as e:
        outdir.claim(folder, None, False, logging_dir="logs")
    assert str(e.value) == (
        f"--output_dir {folder} holds an earlier run (3 checkpoints up to .checkpoint-12.partial, run_config.json, "
        "metrics.jsonl, pytorch_lora_weights.safetensors, logs): pass --resume_from_checkpoint latest to continue "
        "it, --overwrite_output_dir to replace it, or choose another folder"
    )
    claimed = outdir.claim(folder, "latest", False, logging_dir="logs")
    assert claimed.decision.kind == "continue" and claimed.decision.checkpoint == folder / "checkpoint-10"
    assert sorted(manifest.read(folder)) == sorted(  # the earlier run's outputs, adopted by the resuming run
        [".checkpoint-12.partial", "checkpoint-10", "checkpoint-2", "logs", "metrics.jsonl",
         "pytorch_lora_weights.safetensors", "run_config.json"]
    )  # fmt: skip
    with pytest.raises(UsageError, match="would delete the checkpoint --resume_from_checkpoint latest resumes from"):
        outdir.claim(folder, "latest", True, logging_dir="logs")
    removed = outdir.claim(folder, None, True, logging_dir="logs").removed
    assert sorted(removed) == [".checkpoint-12.partial", "checkpoint-10", "checkpoint-2", "logs", "metrics.jsonl",
                               "pytorch_lora_weights.safetensors", "run_config.json"]  # fmt: skip
    # the user's file stays; the tracker folder is created again, by this run
    assert sorted(p.name for p in folder.iterdir()) == sorted([manifest.NAME, outdir.LOCK_NAME, "logs", "notes.txt"])
    assert manifest.read(folder) == ["logs"]
    outdir.release(folder)


def test_overwrite_removes_only_what_the_manifest_lists(tmp_path):
    folder = tmp_path / "out"
    outdir.claim(folder)
    for name in ("run_config.json", "metrics.jsonl"):
        manifest.record(folder, name)
        (folder / name).write_text("{}\n")
    manifest.record(folder, "validation")
    (folder / "validation").mkdir()
    (folder / "validation" / "step-000002.png").write_bytes(b"x")
    (folder / "my_transformer").mkdir()
    (folder / "keep.txt").write_text("mine")
    removed = outdir.claim(folder, None, True).removed
    assert sorted(removed) == ["metrics.jsonl", "run_config.json", "validation"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [manifest.NAME, outdir.LOCK_NAME, "keep.txt", "my_transformer"]
    )
    # A folder at an output's name that no manifest lists and that does not look like flux-cp's is not removed:
    # the overwrite is refused before anything is deleted.
    manifest.record(folder, "metrics.jsonl")
    (folder / "metrics.jsonl").write_text("{}\n")
    (folder / "transformer").mkdir()
    (folder / "transformer" / "model.bin").write_bytes(b"someone's model")
    with pytest.raises(UsageError, match=r"holds transformer, which flux-cp did not write .* removes nothing"):
        outdir.claim(folder, None, True)
    assert (folder / "metrics.jsonl").exists() and (folder / "transformer" / "model.bin").exists()
    outdir.release(folder)


def test_overwrite_removes_only_flux_cp_s_files_from_the_folders_a_user_may_add_to(tmp_path):
    """validation/, profile/ and the tracker folder: the run wrote files into them, a user may add theirs (notes,
    an encoding cache put inside the logs); only flux-cp's files go, and the folders stay listed."""
    folder = tmp_path / "out"
    outdir.claim(folder, logging_dir="tb")
    written = [
        "validation/step-000002.png",
        "profile/rank0.json",
        "profile/rank0_summary.json",
        "tb/flux-cp/events.out.tfevents.1.host",
        "tb/flux-cp/1700000000.1/events.out.tfevents.2.host",
        "tb/flux-cp/1700000000.1/hparams.yml",
        "checkpoint-2/meta.json",
        "transformer/config.json",
    ]
    theirs = ["validation/my_notes.txt", "tb/cache/latents/0.safetensors", "profile/readme.md"]
    for rel in written + theirs:
        manifest.record(folder, rel.split("/")[0])
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(rel)
    (folder / "validation" / "link.png").symlink_to(tmp_path / "elsewhere.png")
    (tmp_path / "elsewhere.png").write_text("not the run's")
    claimed = outdir.claim(folder, None, True, logging_dir="tb")
    assert sorted(claimed.removed) == ["checkpoint-2", "profile", "tb", "transformer", "validation"]
    left = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink())
    assert left == sorted([manifest.NAME, outdir.LOCK_NAME, *theirs, "validation/link.png"])
    assert (tmp_path / "elsewhere.png").read_text() == "not the run's"
    assert claimed.notes == ["--overwrite_output_dir: kept profile/readme.md, tb/cache/latents/0.safetensors, "
                             "validation/link.png, validation/my_notes.txt, which flux-cp did not write"]  # fmt: skip
    assert sorted(manifest.read(folder)) == ["profile", "tb", "validation"]  # the run writes into them again
    outdir.release(folder)


def test_overwrite_keeps_a_user_s_file_wherever_it_is_in_the_run_s_folders(tmp_path):
    """Checkpoints, a branch set aside, the final transformer/ and the tracker folder (TensorBoard's and wandb's files)
    lose flux-cp's files only: a file the run did not write is kept where it is and reported, and its folder stays
    listed, so the next overwrite looks at it again."""
    folder = tmp_path / "out"
    outdir.claim(folder, logging_dir="logs")
    run = "logs/wandb/offline-run-20250101_120000-abc123"
    written = [
        "checkpoint-2/meta.json",
        "checkpoint-2/train.pt",
        "checkpoint-2/state/.metadata",
        "checkpoint-2/state/__0_0.distcp",
        "checkpoint-2/data.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors",
        "abandoned-20250101-120000/checkpoint-4/meta.json",
        "abandoned-20250101-120000/loss_curve.png",
        "abandoned-20250101-120000/validation/step-000004.png",
        f"{run}/run-abc123.wandb",
        f"{run}/files/config.yaml",
        f"{run}/logs/debug.log",
        ".checkpoint-6.partial/state/__0_0.distcp",
    ]
    theirs = [
        "checkpoint-2/notes.txt",
        "checkpoint-2/state/mine.pt",
        "transformer/README.md",
        "abandoned-20250101-120000/why.txt",
        "abandoned-20250101-120000/checkpoint-4/eval.json",
        "logs/wandb/notes.md",
        "validation/sub/step-000001.png",
    ]
    for rel in written + theirs:
        manifest.record(folder, rel.split("/")[0])
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(rel)
    (folder / "logs" / "wandb" / "latest-run").symlink_to(folder / run)  # wandb's own links: removed, not followed
    (tmp_path / "core.log").write_text("wandb's service log")
    (folder / run / "logs" / "debug-core.log").symlink_to(tmp_path / "core.log")
    claimed = outdir.claim(folder, None, True, logging_dir="logs")
    left = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink())
    assert left == sorted([manifest.NAME, outdir.LOCK_NAME, *theirs])
    assert claimed.notes == [
        f"--overwrite_output_dir: kept {', '.join(sorted(theirs)[:5])} and 2 more, which flux-cp did not write"
    ]
    assert (tmp_path / "core.log").read_text() == "wandb's service log"
    assert sorted(manifest.read(folder)) == [
        "abandoned-20250101-120000",
        "checkpoint-2",
        "logs",
        "transformer",
        "validation",
    ]
    outdir.release(folder)


def test_a_user_s_file_in_an_output_written_again_moves_into_the_new_one(tmp_path):
    """The final transformer/ written again (a resumed run that finishes again), and a checkpoint pruned by
    --checkpoints_total_limit: flux-cp's files are replaced or removed, a user's file stays."""
    folder = tmp_path / "out"
    outdir.claim(folder)
    (folder / "transformer").mkdir()
    (folder / "transformer" / "config.json").write_text("old")
    (folder / "transformer" / "NOTES.md").write_text("mine")

    def write(staging: Path) -> Path:
        (staging / "transformer").mkdir()
        (staging / "transformer" / "config.json").write_text("new")
        return staging / "transformer"

    outdir.write_final(folder, "transformer", write)
    assert sorted(p.name for p in (folder / "transformer").iterdir()) == ["NOTES.md", "config.json"]
    assert (folder / "transformer" / "config.json").read_text() == "new"
    assert not any(p.name.startswith(".transformer") for p in folder.iterdir())
    old = _checkpoint(folder, 2)
    (old / "notes.txt").write_text("mine")
    assert checkpoint._remove(old) == [old / "notes.txt"]
    assert sorted(p.name for p in old.iterdir()) == ["notes.txt"]
    outdir.release(folder)


def test_a_model_card_the_user_wrote_or_edited_is_kept_and_the_card_goes_beside_it(tmp_path):
    folder = tmp_path / "out"
    outdir.claim(folder)
    assert outdir.card_name(folder) == ("README.md", None)
    manifest.record(folder, "README.md")
    (folder / "README.md").write_text("card")
    manifest.note_written(folder, "README.md")
    assert outdir.card_name(folder) == ("README.md", None)  # flux-cp's, as it wrote it: replaced
    (folder / "README.md").write_text("card, and my notes")
    name, note = outdir.card_name(folder)
    assert name == "README.flux-cp.md"
    assert (
        note
        == f"{folder}/README.md was edited since flux-cp wrote it: kept; this run's model card is README.flux-cp.md"
    )
    (folder / "README.flux-cp.md").write_text("mine too")  # not flux-cp's either: no card at all
    name, note = outdir.card_name(folder)
    assert name is None and note.endswith("kept, and README.flux-cp.md is not flux-cp's either: no model card written")
    (folder / "README.flux-cp.md").unlink()
    manifest.record(folder, "README.flux-cp.md")
    (folder / "README.flux-cp.md").write_text("card")
    manifest.note_written(folder, "README.flux-cp.md")
    claimed = outdir.claim(folder, None, True)  # the edited card is the user's now: kept; the unedited one goes
    assert claimed.removed == ["README.flux-cp.md"] and (folder / "README.md").read_text() == "card, and my notes"
    assert claimed.notes == ["--overwrite_output_dir: kept README.md, edited since flux-cp wrote it (or with no "
                             "record to tell)"]  # fmt: skip
    assert manifest.edited(folder, "README.md") == "was not written by flux-cp"
    manifest.record(folder, "README.md")  # listed, no hash recorded (an earlier version): an edit cannot be told
    assert "kept no record to tell your edits by" in manifest.edited(folder, "README.md")
    outdir.release(folder)


@pytest.mark.parametrize("entry", ["../victim", "/etc", "a/../../victim", "./x", ".flux_cp.lock", ""])
def test_a_manifest_entry_outside_the_folder_is_refused(tmp_path, entry):
    folder = tmp_path / "out"
    folder.mkdir()
    (tmp_path / "victim").mkdir()
    (folder / manifest.NAME).write_text(json.dumps({"format": 1, "entries": [entry]}))
    with pytest.raises(UsageError, match="has an entry"):
        outdir.claim(folder, None, True)
    assert (tmp_path / "victim").exists()


def _run(tmp_path: Path, *flags: str) -> tuple[int, str]:
    """The trainer in this process, stopped after the output folder is claimed: the data folder holds no image,
    which is found when the data is listed, after the claim (flux_cp.outputs.outdir runs before anything loads)."""
    (tmp_path / "no_images").mkdir(exist_ok=True)
    argv = ["--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache"), "--max_train_steps", "2",
            "--report_to", "none", "--dataset_name", str(tmp_path / "no_images"), *flags]  # fmt: skip
    return in_process(argv)


def test_overwrite_keeps_a_logging_dir_outside_the_output_folder(tmp_path):
    """An absolute --logging_dir (a TensorBoard root shared by runs) and one climbing out with `..` are used, never
    removed by --overwrite_output_dir, nor is anything else outside the output folder."""
    shared = tmp_path / "tensorboard"
    (shared / "other-run").mkdir(parents=True)
    (shared / "other-run" / "events.out.tfevents.1").write_bytes(b"x")
    (tmp_path / "sibling.txt").write_text("next to the output folder")
    for logging_dir in (str(shared), "..", "../tensorboard"):
        _earlier_run(tmp_path / "out", steps=(2,))
        code, err = _run(tmp_path, "--overwrite_output_dir", "--report_to", "tensorboard", "--logging_dir", logging_dir)
        assert code == 2 and "no_images: no images" in err, err[-2000:]
        assert (shared / "other-run" / "events.out.tfevents.1").exists(), logging_dir
        assert (tmp_path / "sibling.txt").exists() and (tmp_path / "out" / "notes.txt").exists(), logging_dir
        assert not (tmp_path / "out" / "checkpoint-2").exists(), "the earlier run's outputs are removed"
        outdir.release(tmp_path / "out")
        (tmp_path / "out" / "notes.txt").unlink()
        (tmp_path / "out" / manifest.NAME).unlink()  # the next round's earlier run is one of before the manifest


def test_an_output_folder_that_is_holds_or_is_inside_the_model_or_the_data_is_refused(tmp_path):
    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    (model / "transformer" / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    (model / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    data = tmp_path / "data"
    data.mkdir()
    for flags, message in (
        (["--output_dir", str(model), "--overwrite_output_dir", "--full_finetune"], "is the folder of "
         f"--pretrained_model_name_or_path {model}"),
        (["--output_dir", str(model / "out")], f"is inside --pretrained_model_name_or_path {model}"),
        (["--output_dir", str(tmp_path)], f"holds --pretrained_model_name_or_path {model}"),
        (["--output_dir", str(data / "out")], f"is inside --dataset_name {data}"),
    ):  # fmt: skip
        code, err = in_process([*flags, "--pretrained_model_name_or_path", str(model), "--dataset_name", str(data),
                                "--max_train_steps", "2", "--report_to", "none"])  # fmt: skip
        assert code == 2 and f"error: --output_dir {flags[1]} {message}" in err, err[-2000:]
    assert (model / "transformer" / "config.json").exists() and not (data / "out").exists()


def test_resume_latest_without_a_checkpoint_in_a_finished_run_is_refused(tmp_path):
    folder = tmp_path / "out"
    _earlier_run(folder, steps=(), partial=True)
    lora = (folder / "pytorch_lora_weights.safetensors").read_bytes()
    code, err = _run(tmp_path, "--resume_from_checkpoint", "latest")
    expected = (
        f"error: --resume_from_checkpoint latest: --output_dir {folder} holds an earlier run (.checkpoint-12.partial, "
        "run_config.json, metrics.jsonl, pytorch_lora_weights.safetensors) but no checkpoint to resume: starting "
        "it again from step 0 would replace it. Pass --overwrite_output_dir to do so, or choose another folder"
    )
    assert code == 2 and expected in err, err[-2000:]
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == 10
    assert (folder / "pytorch_lora_weights.safetensors").read_bytes() == lora
    outdir.release(folder)
    # An empty (or new) folder: `latest` starts from step 0, as a run that may resume always passes it.
    assert outdir.claim(tmp_path / "fresh", "latest").decision.kind == "new"


def test_a_checkpoint_of_another_folder_forks_only_into_a_new_one(tmp_path):
    other = tmp_path / "other"
    _earlier_run(other, steps=(2, 4))
    folder = tmp_path / "out"
    _earlier_run(folder, steps=(6,))
    rows = (folder / "metrics.jsonl").read_text()
    code, err = _run(tmp_path, "--resume_from_checkpoint", str(other / "checkpoint-2"))
    expected = (
        f"error: --resume_from_checkpoint {other / 'checkpoint-2'} is not in --output_dir {folder}, which holds an "
        "earlier run (checkpoint-6, run_config.json, metrics.jsonl, pytorch_lora_weights.safetensors): resuming it "
        "there would mix two runs in one folder. Resume it into a new or empty --output_dir (a fork;"
    )
    assert code == 2 and expected in err, err[-2000:]
    assert (folder / "metrics.jsonl").read_text() == rows
    outdir.release(folder)
    claimed = outdir.claim(tmp_path / "fork", str(other / "checkpoint-2"))
    assert claimed.decision.kind == "fork" and "a fork of that run, which stays as it is" in claimed.notes[0]
    forked = [json.loads(line)["step"] for line in (tmp_path / "fork" / "metrics.jsonl").read_text().splitlines()]
    assert forked == [1, 2]  # the source's history up to the checkpoint; the source is unchanged
    assert len((other / "metrics.jsonl").read_text().splitlines()) == 10 and (other / "checkpoint-4").exists()


def test_resuming_beyond_max_train_steps_is_refused(tmp_path):
    folder = tmp_path / "out"
    _earlier_run(folder, steps=(2, 4))
    code, err = _run(tmp_path, "--resume_from_checkpoint", str(folder / "checkpoint-4"))
    expected = (
        f"error: --resume_from_checkpoint {folder / 'checkpoint-4'} is at step 4, beyond the 2 steps of this run "
        "(--max_train_steps): it would write the weights of step 4 as step 2. Set --max_train_steps to 4 or more, "
        "or resume an earlier checkpoint"
    )
    assert code == 2 and expected in err, err[-2000:]
    assert sorted(p.name for p in folder.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_resuming_an_earlier_checkpoint_sets_the_later_branch_aside(tmp_path):
    folder = tmp_path / "out"
    _earlier_run(folder, steps=(2, 4, 6))
    (folder / "validation").mkdir()
    for step in (0, 2, 4, 6):
        (folder / "validation" / f"step-{step:06d}.png").write_bytes(b"x")
    code, err = _run(tmp_path, "--resume_from_checkpoint", str(folder / "checkpoint-2"), "--max_train_steps", "6")
    assert code == 2 and "no_images: no images" in err, err[-2000:]
    aside = [p for p in folder.iterdir() if p.name.startswith("abandoned-")]
    assert len(aside) == 1, sorted(p.name for p in folder.iterdir())
    assert sorted(p.name for p in aside[0].iterdir()) == ["checkpoint-4", "checkpoint-6", "metrics.jsonl",
                                                          "pytorch_lora_weights.safetensors", "validation"]  # fmt: skip
    assert sorted(p.name for p in (aside[0] / "validation").iterdir()) == ["step-000004.png", "step-000006.png"]
    assert sorted(p.name for p in (folder / "validation").iterdir()) == ["step-000000.png", "step-000002.png"]
    assert checkpoint_folders.resolve("latest", str(folder)) == folder / "checkpoint-2"  # `latest` is the live branch
    assert aside[0].name in manifest.read(folder) and "checkpoint-4" not in manifest.read(folder)


def test_links_where_the_trainer_writes_its_own_files_are_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / "out"
    folder.mkdir()
    os.symlink(victim, folder / outdir.LOCK_NAME)
    with pytest.raises(UsageError, match=r"\.flux_cp\.lock cannot be opened .*it is a symbolic link"):
        outdir.claim(folder, None, False)
    assert victim.read_text() == "precious"
    (folder / outdir.LOCK_NAME).unlink()
    os.link(victim, folder / outdir.LOCK_NAME)  # a hard link: the lock's truncation would empty the victim
    with pytest.raises(UsageError, match="is not a plain file of its own"):
        outdir.claim(folder, None, False)
    assert victim.read_text() == "precious"
    (folder / outdir.LOCK_NAME).unlink()
    _checkpoint(tmp_path, 2)
    os.symlink(tmp_path / "checkpoint-2", folder / "checkpoint-2")
    os.symlink(victim, folder / "metrics.jsonl")
    with pytest.raises(UsageError, match=r"checkpoint-2 is a symbolic link \(to .*\), where flux-cp writes its own"):
        outdir.claim(folder, "latest", False)
    assert victim.read_text() == "precious"


def test_a_failed_final_write_says_what_a_resume_would_do(tmp_path):
    def full_disk(folder: Path) -> Path:
        raise OSError(28, "No space left on device")

    with pytest.raises(UsageError) as e:
        outdir.write_final(tmp_path, "pytorch_lora_weights.safetensors", full_disk)
    assert str(e.value) == (
        f"writing {tmp_path / 'pytorch_lora_weights.safetensors'} failed (No space left on device). No checkpoint was "
        "written, so a resume has nothing to start from: free disk space, then run again with --overwrite_output_dir "
        "(from step 0)"
    )
    _checkpoint(tmp_path, 4)
    with pytest.raises(UsageError) as e:
        outdir.write_final(tmp_path, "pytorch_lora_weights.safetensors", full_disk)
    assert str(e.value).endswith(
        "Free disk space, then resume with --resume_from_checkpoint latest: it restarts from step 4 "
        f"({tmp_path / 'checkpoint-4'}, the last good checkpoint) and writes it again at the end"
    )


def test_unusable_folders_are_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a folder: choose a folder"):
        outdir.claim(tmp_path / "file", None, False)
    with pytest.raises(UsageError, match=r"file/sub cannot be written \(Not a directory\)"):
        outdir.claim(tmp_path / "file" / "sub", None, False)


def test_a_second_live_run_is_kept_out_until_the_first_ends(tmp_path):
    folder = tmp_path / "out"
    outdir.claim(folder, None, False)
    code = f"from flux_cp.run.output_phase import outdir; outdir.claim({str(folder)!r}, 'latest', False)"
    r = subprocess.run(python_cmd("-c", code), cwd=ROOT, env=env(), capture_output=True, text=True)
    assert r.returncode != 0 and f"--output_dir {folder} is in use by another run (pid " in r.stderr, r.stderr
    outdir.release(folder)
    r = subprocess.run(python_cmd("-c", code), cwd=ROOT, env=env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# --- folders of other roles --------------------------------------------------------------------------------------


def _roles(tmp_path: Path, **kw) -> None:
    from flux_cp.outputs import roles

    for name in ("model", "data", "bundled"):
        (tmp_path / name).mkdir(exist_ok=True)
    args = {"model": str(tmp_path / "model"), "data": str(tmp_path / "data"), "bundled": tmp_path / "bundled", **kw}
    roles.check(args.pop("output_dir", str(tmp_path / "out")), **args)


@pytest.mark.parametrize(
    "logs, message",
    [(name, f"names {name}, one of the run's own outputs") for name in
     ("run_config.json", "metrics.jsonl", "README.md", "checkpoint-2", "pytorch_lora_weights.safetensors",
      "transformer", "validation", "loss_curve.png", "profile", ".flux_cp_manifest.json", "abandoned-20250101-120000",
      ".checkpoint-4.partial", ".transformer.partial")]
    + [("checkpoint-2/tb", "is in checkpoint-2, one of the run's own outputs"),
       (".", "is the output folder itself"), ("a/..", "is the output folder itself")],
)  # fmt: skip
def test_a_logging_dir_naming_one_of_the_run_s_outputs_is_refused(tmp_path, logs, message):
    with pytest.raises(UsageError, match=f"^--logging_dir {logs} {message}"):
        _roles(tmp_path, logs=logs)


def test_the_folders_of_other_roles_are_refused_one_line_each(tmp_path):
    _roles(tmp_path, class_dir=str(tmp_path / "class"), encodings=str(tmp_path / "cache"), logs="logs")
    _roles(tmp_path, encodings=str(tmp_path / "data" / ".cache"))  # a cache of its own inside the data: excluded there
    _roles(tmp_path, encodings=str(tmp_path / "out" / "cache"), logs="tb")  # inside the output folder, no output's
    _roles(tmp_path, encodings=str(tmp_path / "cache"), logs="..")  # a tracker folder outside: never removed
    refused = [
        (dict(class_dir=str(tmp_path / "data")), "--class_data_dir {t}/data is --dataset_name {t}/data"),
        (dict(class_dir=str(tmp_path / "data" / "class")), "is inside --dataset_name"),
        (dict(class_dir=str(tmp_path)), "holds --pretrained_model_name_or_path"),
        (dict(class_dir=str(tmp_path / "bundled" / "x")), "is inside the bundled data"),
        (dict(class_dir=str(tmp_path / "model")), "is --pretrained_model_name_or_path"),
        (dict(class_dir=str(tmp_path / "cache"), encodings=str(tmp_path / "cache")), "is --encodings_dir"),
        (dict(class_dir=str(tmp_path / "out" / "logs" / "c"), logs="logs"), "is inside --logging_dir"),
        (dict(logs=str(tmp_path / "data" / "tb")), "--logging_dir {t}/data/tb is inside --dataset_name"),
        (dict(logs="logs", encodings=str(tmp_path / "out" / "logs" / "x")), "--logging_dir logs holds --encodings_dir"),
        (
            dict(logs="logs/c", encodings=str(tmp_path / "out" / "logs")),
            "--logging_dir logs/c is inside --encodings_dir",
        ),
        (dict(logs=str(tmp_path / "cache"), encodings=str(tmp_path / "cache")), "is --encodings_dir"),
        (dict(logs="logs", encodings=str(tmp_path / "out" / "logs")), "--logging_dir logs is --encodings_dir"),
        (dict(encodings=str(tmp_path / "out")), "--encodings_dir {t}/out is the output folder"),
        (dict(encodings=str(tmp_path / "out" / "checkpoint-2")), "names checkpoint-2, one of the run's own outputs"),
        (dict(encodings=str(tmp_path / "model" / "cache")), "is inside --pretrained_model_name_or_path"),
        (dict(encodings=str(tmp_path / "data")), "--encodings_dir {t}/data is --dataset_name"),
    ]
    for kw, message in refused:
        with pytest.raises(UsageError) as e:
            _roles(tmp_path, **kw)
        assert message.format(t=tmp_path) in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))


def test_another_run_s_output_folder_is_no_class_folder(tmp_path):
    run = tmp_path / "runs" / "earlier"
    run.mkdir(parents=True)
    (run / manifest.NAME).write_text("{}")
    for class_dir, how in ((run, "is the output folder of another run:"),
                           (run / "validation", f"is inside the output folder of another run ({run})"),
                           (tmp_path / "runs", f"holds the output folder of another run ({run})")):  # fmt: skip
        with pytest.raises(
            UsageError, match=f"^--class_data_dir {class_dir} {how}".replace("(", r"\(").replace(")", r"\)")
        ):
            _roles(tmp_path, class_dir=str(class_dir))
    legacy = tmp_path / "legacy"  # a run of a version before the manifest: its run_config.json says so
    legacy.mkdir()
    (legacy / "run_config.json").write_text(
        json.dumps({"output_dir": "x", "cp_size": 1, "resume_from_checkpoint": None})
    )
    with pytest.raises(UsageError, match="is the output folder of another run"):
        _roles(tmp_path, class_dir=str(legacy))
    # this run's own output folder: refused as such
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / manifest.NAME).write_text("{}")
    with pytest.raises(
        UsageError, match=f"^--class_data_dir {tmp_path}/out/class is inside --output_dir {tmp_path}/out:"
    ):
        _roles(tmp_path, class_dir=str(tmp_path / "out" / "class"))


def test_a_pair_run_s_reference_images_go_beside_its_weights_and_never_over_the_user_s(tmp_path, caplog):
    """The reference images the card's lines edit: the --validation_image (cut as validation cuts it, at least 64 px:
    FLUX.2's pipelines take no smaller image; here at 64 for a run at 32), recorded in
    the manifest (so --overwrite_output_dir removes them), rewritten by a later run of the folder; a file of that name
    the user put there is kept, with a warning. Without --validation_image: the first training pair's references, in
    order, one file each."""
    import logging
    from types import SimpleNamespace

    import numpy as np
    from PIL import Image

    from flux_cp.config.parser import parse_config
    from flux_cp.data.sources import BUNDLED_DATA
    from flux_cp.outputs.validation import reference_image, square
    from flux_cp.run.output_phase import Outputs

    pairs = BUNDLED_DATA.parent / "tiny_pairs"
    image = str(pairs / "02_white_triangle.png")
    out = tmp_path / "run"

    def written(*flags: str, source=None) -> Outputs:
        cfg = parse_config(["--output_dir", str(out), "--dataset_name", str(pairs), "--resolution", "32", *flags])
        outputs = Outputs(cfg, SimpleNamespace(pairs=True), *[None] * 11, source=source)
        outputs.write_references()
        return outputs

    outdir.claim(out)
    try:
        (out / "reference.png").write_bytes(b"mine")
        with caplog.at_level(logging.WARNING, logger="flux_cp"):
            kept = written("--validation_prompt", "make it red", "--validation_image", image)
        assert (out / "reference.png").read_bytes() == b"mine" and kept.references == ("reference.png",)
        assert "run/reference.png was not written by flux-cp: kept, and the model card's lines edit it" in caplog.text
        (out / "reference.png").unlink()
        written("--validation_prompt", "make it red", "--validation_image", image)
        assert "reference.png" in manifest.read(out)
        saved = np.asarray(Image.open(out / "reference.png"))
        assert saved.shape == (64, 64, 3) and np.array_equal(saved, np.asarray(reference_image(image, 64)))
        written("--validation_prompt", "make it red", "--validation_image", str(pairs / "00_blue_circle.png"))
        assert not np.array_equal(np.asarray(Image.open(out / "reference.png")), saved)  # ours: rewritten
        # no --validation_image: the first pair's references (two here), as files of their own
        first = [pairs / "00_blue_circle.png", pairs / "02_white_triangle.png"]

        class Pair:  # a data set of one target with two references (flux_cp.data.sources.ImageSource's calls)
            def __len__(self) -> int:
                return 1

            def reference_count(self, i: int) -> int:
                return 2

            def load(self, i: int, reference: bool, ref_index: int) -> Image.Image:
                assert (i, reference) == (0, True)
                return Image.open(first[ref_index]).convert("RGB")

        two = written("--max_train_steps", "1", source=Pair())  # (not the demo, whose --validation_image is set)
        assert two.references == ("reference-1.png", "reference-2.png")
        for name, path in zip(two.references, first):
            want = np.asarray(square(Image.open(path).convert("RGB"), 64))
            assert np.array_equal(np.asarray(Image.open(out / name)), want) and name in manifest.read(out)
    finally:
        outdir.release(out)


def test_the_class_folder_and_the_output_folder_are_apart_whether_they_exist_or_not(tmp_path):
    """The same flags are refused before the folders exist and after (a resume): one inside the other either way,
    through a link too."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    x, link, real = tmp_path / "x", tmp_path / "link", tmp_path / "real"
    cases = [
        (x, x, "is"),
        (x / "class", x, "is inside"),
        (x, x / "out", "holds"),
        (link / "c", real, "is inside"),
        (real / "c", link / "c" / "..", "is inside"),
    ]
    for class_dir, out, how in cases:
        for exists in (False, True):
            if exists:
                for folder in (class_dir, out):
                    os.makedirs(folder, exist_ok=True)
            with pytest.raises(UsageError, match=f"^--class_data_dir {class_dir} {how} --output_dir "):
                _roles(tmp_path, class_dir=str(class_dir), output_dir=str(out))


def test_no_class_folder_is_an_encoding_cache(tmp_path):
    """Not this run's cache, nor the default one (another run's), nor any folder holding a cache's entries."""
    default = tmp_path / "home" / "encodings"
    with pytest.raises(UsageError, match="is the default encoding cache"):
        _roles(tmp_path, class_dir=str(default), default_encodings=str(default))
    with pytest.raises(UsageError, match="is inside the default encoding cache"):
        _roles(tmp_path, class_dir=str(default / "latents"), default_encodings=str(default))
    other = tmp_path / "classes" / "elsewhere"
    (other / "latents").mkdir(parents=True)
    (other / "latents" / f"{'0' * 32}.safetensors").write_bytes(b"x")
    for class_dir, how in ((other, "is"), (other / "latents", "is inside"), (other.parent, "holds")):
        with pytest.raises(UsageError, match=f"^--class_data_dir {class_dir} {how} an encoding cache"):
            _roles(tmp_path, class_dir=str(class_dir))


def test_no_folder_a_run_writes_goes_into_a_folder_another_tool_owns(tmp_path, monkeypatch):
    """The output folder, the class folder, the cache and the tracker folder, by resolved path: the Hugging Face and
    pip caches, the Python environment, flux-cp's own files; by content: a model folder, another run's folder."""
    import sysconfig

    from huggingface_hub import constants

    from flux_cp.outputs import roles

    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip"))
    site = sysconfig.get_paths()["purelib"]
    (tmp_path / "models" / "flux").mkdir(parents=True)
    (tmp_path / "models" / "flux" / "model_index.json").write_text("{}")
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / manifest.NAME).write_text("{}")
    root = roles.CHECKOUT
    refused = [
        (dict(output_dir=str(tmp_path / "hf" / "run")), "--output_dir {t}/hf/run is inside the Hugging Face cache"),
        (dict(class_dir=str(tmp_path / "pip")), "--class_data_dir {t}/pip is pip's cache"),
        (dict(encodings=os.path.join(site, "cache")), "is inside the Python environment's packages"),
        (dict(output_dir=str(root)), "is flux-cp's own checkout"),
        (dict(output_dir=str(root / "flux_cp")), f"is {root}/flux_cp, one of flux-cp's own files"),
        (dict(output_dir=str(root / "data" / "mine")), f"is inside {root}/data, one of flux-cp's own files"),
        (
            dict(output_dir=str(tmp_path / "models" / "flux" / "lora")),
            "is inside a model folder ({t}/models/flux: it holds model_index.json)",
        ),
        (dict(encodings=str(tmp_path / "models" / "flux")), "is a model folder"),
        (dict(output_dir=str(tmp_path / "runs" / "a" / "b")), "is inside the output folder of another run"),
        (dict(logs=str(tmp_path / "runs" / "a" / "tb")), "is inside the output folder of another run"),
    ]
    for kw, message in refused:
        with pytest.raises(UsageError) as e:
            _roles(tmp_path, **kw)
        assert message.format(t=tmp_path) in str(e.value), (kw, str(e.value))
    seeds = [
        (str(tmp_path / "model" / "seed.safetensors"), "is inside --pretrained_model_name_or_path"),
        (str(tmp_path / "out" / "checkpoint-2" / "seed.safetensors"), "is in checkpoint-2, one of the run's own"),
        (os.path.join(site, "seed.safetensors"), "is inside the Python environment's packages"),
    ]
    for seed, message in seeds:
        with pytest.raises(UsageError, match=f"^--seed_checkpoint {re.escape(seed)} {message}"):
            _roles(tmp_path, seed=seed)
    _roles(tmp_path, seed=str(tmp_path / "out" / "seed.safetensors"))  # the output folder may hold it
    _roles(tmp_path, output_dir=str(root / "flux-cp-output"))  # a new folder of the checkout: the default's place
    monkeypatch.chdir(tmp_path)
    _roles(tmp_path, output_dir=str(tmp_path / "out2"), cache_dir=".")  # a cache in the current folder: not all its
    _roles(tmp_path, output_dir=str(tmp_path / "runs" / "a"))  # the run's own folder (a resume)
    _roles(tmp_path, output_dir=str(tmp_path / "runs" / "a"), logs="tb")  # its tracker folder inside it


def test_flux_cp_s_own_files_are_every_entry_its_repository_tracks():
    from flux_cp.outputs import roles

    if not (roles.CHECKOUT / ".git").exists():
        pytest.skip("not a git checkout")
    r = subprocess.run(["git", "ls-files"], cwd=roles.CHECKOUT, capture_output=True, text=True, check=True)
    tracked = {line.split("/")[0] for line in r.stdout.splitlines()}
    assert tracked <= set(roles.CHECKOUT_ENTRIES), sorted(tracked - set(roles.CHECKOUT_ENTRIES))
