"""FLUX.2 editing with reference images, end to end on CPU on the tiny FLUX.2 [klein]: CP over 3 ranks (encoding
live, --no_cache) gives one process's loss rows and weights on targets with two references each, validation with two
--validation_image renders under CP what one process renders, the LoRA loaded into Flux2KleinPipeline with
image=[reference 1, reference 2] renders the trained model's image, and a resume refuses a data set whose second
reference changed, naming the file; rows of 1, 2 and 3 references train in batches of one count, with CP over 2 ranks
as without, and with one --validation_image (the pairs of FLUX.2 [klein]: one reference) CP renders what one process
renders and the LoRA edits in Flux2KleinPipeline as the trained model. Four trainer launches, shared by the tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests import snippets
from tests.launch import assert_same_trajectory, in_process, ok, run_args, train
from tests.reference_folders import references_folder

pytestmark = pytest.mark.e2e  # every test here launches train_flux_cp.py

SEED = 3
EDIT = "make the circle red"
TEXT_TOKENS = 66  # divisible by 2 and 3; [klein]'s chat template takes ~20 of the tiny tokenizer's


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from flux_cp.families.flux2.tiny import ensure_tiny_flux2_pipeline

    tmp = tmp_path_factory.mktemp("flux2_references")
    model = ensure_tiny_flux2_pipeline(klein=True)  # under the session's FLUX_CP_HOME, shared with other tests
    data = references_folder(tmp / "data", n=8)
    # 64 px: 16 target + 2 x 16 reference tokens, divisible by 2 and 3; --center_crop makes the live encodings of
    # --no_cache the cached ones (random crops are drawn per epoch there)
    images = [str(data / "00_blue_circle.png"), str(data / "second_0.png")]
    settings = ["--validation_prompt", EDIT, "--num_validation_images", "1", "--validation_inference_steps", "2"]
    validation = [*settings, "--validation_image", images[0], "--validation_image", images[1]]

    def flags(name: str, *extra: str, dataset: Path = data, validate: bool = True) -> list[str]:
        return run_args(tmp, name, 10, "--pretrained_model_name_or_path", str(model), "--dataset_name", str(dataset),
                        "--resolution", "64", "--max_sequence_length", str(TEXT_TOKENS), "--seed", str(SEED),
                        "--rank", "4", "--learning_rate", "1e-2", "--adam_epsilon", "1e-6", "--random_flip",
                        "--center_crop", "--train_batch_size", "2", "--checkpointing_steps", "5",
                        *(validation if validate else ()), *extra)  # fmt: skip

    out = ok(train(1, *flags("one")))
    (tmp / "one" / "log.txt").write_text(out.stdout + out.stderr)
    ok(train(3, *flags("cp3", "--cp_size", "3", "--no_cache")))
    # rows of 1, 2 and 3 references: a batch holds one count; the one row of 3 never fills a batch of 2. Validation
    # edits one reference, as FLUX.2 [klein] pairs do.
    mixed = references_folder(tmp / "mixed", n=8, counts=[1, 2, 1, 2, 2, 1, 2, 3])
    one_image = [*settings, "--validation_image", images[0]]
    out = ok(train(1, *flags("mixed_one", *one_image, dataset=mixed, validate=False)))
    (tmp / "mixed_one" / "log.txt").write_text(out.stdout + out.stderr)
    ok(train(2, *flags("mixed_cp2", "--cp_size", "2", *one_image, dataset=mixed, validate=False)))
    return {"tmp": tmp, "model": model, "data": data, "images": images, "flags": flags}


def _png(run: Path, step: int = 10) -> np.ndarray:
    return np.asarray(Image.open(run / "validation" / f"step-{step:06d}.png")).astype(int)


def test_cp_over_3_ranks_trains_two_reference_samples_like_one_process(runs):
    """(CP over 2 ranks on rows of two references: the mixed runs below.)"""
    tmp = runs["tmp"]
    assert "FLUX.2 [klein] pairs: 8 targets with 2 reference images each" in (tmp / "one" / "log.txt").read_text()
    assert_same_trajectory(tmp / "one", tmp / "cp3")
    # validation with both references, under CP, draws one process's image
    one, other = _png(tmp / "one"), _png(tmp / "cp3")
    assert one.shape == (64, 64, 3) and np.abs(one - other).max() <= 1, np.abs(one - other).max()
    config = json.loads((tmp / "one" / "run_config.json").read_text())
    assert config["validation_image"] == runs["images"]


def test_rows_of_several_reference_counts_train_in_batches_of_one_count_with_cp_as_without(runs):
    tmp = runs["tmp"]
    log = (tmp / "mixed_one" / "log.txt").read_text()
    assert "FLUX.2 [klein] pairs: 8 targets with 1 to 3 reference images (a batch holds one count)" in log
    assert "1 of 8 samples is never trained on: a global batch holds one aspect bucket and one number of" in log
    assert_same_trajectory(tmp / "mixed_one", tmp / "mixed_cp2")
    rows = [json.loads(line) for line in (tmp / "mixed_cp2" / "metrics.jsonl").read_text().splitlines()]
    per_step = {round(r["tokens_per_s"] * r["s_per_step"]) for r in rows}
    assert per_step == {2 * (2 * 16 + TEXT_TOKENS), 2 * (3 * 16 + TEXT_TOKENS)}, per_step  # 1 and 2 references
    # validation with one reference, under CP, draws one process's image
    one, two = _png(tmp / "mixed_one"), _png(tmp / "mixed_cp2")
    assert one.shape == (64, 64, 3) and np.abs(one - two).max() <= 1, np.abs(one - two).max()


def _pipeline(runs):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(runs["model"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _render(pipe, image) -> np.ndarray:
    """The image flux_cp.outputs.validation renders for the first prompt's first image with these settings."""
    out = pipe(prompt=EDIT, image=image, height=64, width=64, num_inference_steps=2, guidance_scale=3.5,
               max_sequence_length=TEXT_TOKENS, generator=torch.Generator("cpu").manual_seed(SEED * 1000),
               output_type="np").images[0]  # fmt: skip
    return (np.clip(out, 0, 1) * 255).round().astype(int)


def test_the_lora_edits_with_both_references_in_flux2_klein_pipeline_as_the_trained_model(runs):
    from flux_cp.outputs.validation import reference_image

    pipe = _pipeline(runs)
    images = [reference_image(p, 64) for p in runs["images"]]
    pipe.load_lora_weights(str(runs["tmp"] / "cp3"))
    trained = _png(runs["tmp"] / "cp3")
    both = _render(pipe, images)
    assert np.abs(both - trained).max() <= 1, np.abs(both - trained).max()
    assert np.abs(_render(pipe, images[0]) - trained).max() > 3  # the second reference is part of what it rendered


def test_the_lora_edits_one_reference_in_flux2_klein_pipeline_as_the_trained_model(runs):
    """Flux2KleinPipeline (a base model: true CFG against "", encoded by the pipeline itself here) with the LoRA of
    the CP run, the reference as the trainer's validation cut it."""
    from flux_cp.outputs.validation import reference_image

    pipe = _pipeline(runs)
    assert not pipe.config.is_distilled
    image = reference_image(runs["images"][0], 64)
    trained = _png(runs["tmp"] / "mixed_cp2")
    before = _render(pipe, image)
    pipe.load_lora_weights(str(runs["tmp"] / "mixed_cp2"))
    after = _render(pipe, image)
    assert np.abs(after - trained).max() <= 1, np.abs(after - trained).max()
    assert np.abs(before - trained).max() > 3  # the LoRA is what makes them equal


def test_the_lines_of_a_two_reference_run_edit_its_references_pasted_from_its_card_or_its_log(runs):
    """The run's two --validation_image copied beside its LoRA, in order, as validation cuts them; the lines of the
    model card and of the log load the LoRA into Flux2KleinPipeline and edit both, making an image of the trained
    size."""
    from flux_cp.outputs.validation import reference_image

    out = runs["tmp"] / "one"
    code = snippets.check(out, (out / "log.txt").read_text(), 64)
    assert 'reference = [load_image(f"{folder}/reference-1.png"), load_image(f"{folder}/reference-2.png")]' in code
    for name, path in zip(("reference-1.png", "reference-2.png"), runs["images"]):
        saved = np.asarray(Image.open(out / name).convert("RGB"))
        assert np.array_equal(saved, np.asarray(reference_image(path, 64))), name


def test_a_resume_refuses_a_data_set_whose_second_reference_changed_naming_the_file(runs):
    tmp = runs["tmp"]
    changed = tmp / "changed"
    shutil.copytree(runs["data"], changed)
    (changed / "second_3.png").write_bytes((runs["data"] / "second_5.png").read_bytes())
    flags = runs["flags"]("resumed", "--resume_from_checkpoint", str(tmp / "one" / "checkpoint-5"))
    flags[flags.index(str(runs["data"]))] = str(changed)
    code, stderr = in_process(flags)
    assert code != 0
    line = next(ln for ln in stderr.splitlines() if ln.startswith("error:"))
    assert "comes from an incompatible run (data set differs (changed reference image: second_3.png (reference 2 " \
           "of 03_red_circle_edited.png))" in line, line  # fmt: skip
    assert not (tmp / "resumed" / "checkpoint-10").exists()
