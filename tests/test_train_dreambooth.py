"""The DreamBooth data options end to end on CPU, combined in few launches: --instance_data_dir, --repeats,
--caption_dropout, prior preservation with its class images generated under CP, and two resolutions (aspect buckets
at each) train at cp=2 exactly as one process does (loss and LoRA weights); the class images are what the family's
pipeline renders without CP (FLUX.1 and FLUX.2 [klein]). Three trainer launches, two of them with CP (the batches
do not depend on the family: FLUX.2 [klein] runs here for its class images and empty caption; the lines that load
its LoRA are run as pasted)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flux_cp.data.prior import class_images
from flux_cp.data.sources import BUNDLED_DATA
from flux_cp.rng import Stream, generator
from tests import snippets
from tests.launch import assert_same_trajectory, losses, ok, run_args, train

pytestmark = pytest.mark.e2e  # every test here launches train_flux_cp.py

SEED = 3
CLASS_PROMPT = "a shape on a background"
PAIRS = BUNDLED_DATA.parent / "tiny_pairs"


def _options(tmp: Path, classes: str, count: int) -> list[str]:
    return ["--instance_data_dir", str(BUNDLED_DATA), "--with_prior_preservation", "--class_data_dir",
            str(tmp / classes), "--class_prompt", CLASS_PROMPT, "--num_class_images", str(count),
            "--prior_loss_weight", "0.5", "--caption_dropout", "0.3", "--repeats", "2", "--random_flip",
            "--seed", str(SEED), "--learning_rate", "1e-3", "--rank", "4", "--checkpointing_steps", "1000"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    from flux_cp.families.flux2.tiny import ensure_tiny_flux2_pipeline

    tmp = tmp_path_factory.mktemp("dreambooth")
    # FLUX.1: two resolutions with aspect buckets at each; the CP run generates the class images (at 128 px, the
    # largest), the one-process run finds them there
    flux1 = [*_options(tmp, "class", 3), "--resolution", "64,128", "--aspect_buckets"]
    out = ok(train(2, *run_args(tmp, "cp2", 10, "--cp_size", "2", "--cp_mode", "ring", *flux1)))
    (tmp / "cp2.log").write_text(out.stdout + out.stderr)
    out = ok(train(1, *run_args(tmp, "one", 10, *flux1)))
    (tmp / "one.log").write_text(out.stdout + out.stderr)
    # FLUX.2 [klein]: class images through Flux2KleinPipeline (true guidance against the empty prompt) under CP
    klein = ensure_tiny_flux2_pipeline(klein=True)  # under the session's FLUX_CP_HOME, shared with other tests
    flux2 = [*_options(tmp, "klein_class", 1), "--pretrained_model_name_or_path", str(klein), "--resolution", "64",
             "--max_sequence_length", "64"]  # fmt: skip
    out = ok(train(2, *run_args(tmp, "klein_cp2", 4, "--cp_size", "2", *flux2)))
    (tmp / "klein_cp2.log").write_text(out.stdout + out.stderr)
    return tmp


def test_the_options_train_with_cp_as_one_process(runs):
    assert "generating 3 with the base model" in (runs / "cp2.log").read_text()
    assert "generating" not in (runs / "one.log").read_text()  # the folder holds them: none generated
    assert_same_trajectory(runs / "one", runs / "cp2")
    config = json.loads((runs / "cp2" / "run_config.json").read_text())
    assert config["resolution"] == [64, 128] and config["dataset_name"] == str(BUNDLED_DATA)
    meta = json.loads((runs / "cp2" / "checkpoint-10" / "meta.json").read_text())["run"]
    assert meta["resolution"] == [64, 128] and (meta["repeats"], meta["caption_dropout"]) == (2, 0.3)
    assert isinstance(meta["prior"], str)  # the class images' fingerprint: a resume with others is refused


def _rendered(pipe, k: int, resolution: int, text_tokens: int) -> np.ndarray:
    """Class image k as the family's pipeline renders it in one process, without CP (its default steps and
    guidance, as diffusers' examples call it)."""
    pipe.set_progress_bar_config(disable=True)
    image = pipe(prompt=CLASS_PROMPT, height=resolution, width=resolution, max_sequence_length=text_tokens,
                 generator=generator(Stream.CLASS_IMAGE, SEED, k), output_type="np").images[0]  # fmt: skip
    return (np.clip(image, 0, 1) * 255).round().astype(int)


def test_class_images_generated_under_cp_are_the_pipeline_s(runs):
    from diffusers import Flux2KleinPipeline, FluxPipeline

    from flux_cp.families.flux1.tiny import ensure_tiny_pipeline
    from flux_cp.families.flux2.tiny import ensure_tiny_flux2_pipeline

    for folder, pipe, resolution, tokens, count in (
        ("class", FluxPipeline.from_pretrained(ensure_tiny_pipeline()), 128, 32, 3),
        ("klein_class", Flux2KleinPipeline.from_pretrained(ensure_tiny_flux2_pipeline(klein=True)), 64, 64, 1),
    ):
        files = class_images(runs / folder)
        assert [f.name[:5] for f in files] == [f"{k:05d}" for k in range(count)], files
        for k, path in enumerate(files):
            made = np.asarray(Image.open(path)).astype(int)
            want = _rendered(pipe, k, resolution, tokens)
            assert made.shape == (resolution, resolution, 3) and np.abs(made - want).max() <= 1, (folder, k)
        assert len({p.read_bytes() for p in files}) == count  # each from noise of its own
    assert len(losses(runs / "klein_cp2")) == 4  # and FLUX.2 trained on them, with its empty caption


def test_the_klein_lora_s_lines_render_it_pasted_from_its_card_or_its_log(runs):
    """FLUX.2 [klein] text-to-image: the lines of the model card and of the log load the LoRA into Flux2KleinPipeline
    (the prompt by name: the pipeline's first parameter is an image) and make an image of the trained size."""
    code = snippets.check(runs / "klein_cp2", (runs / "klein_cp2.log").read_text(), 64)
    assert "Flux2KleinPipeline.from_pretrained(" in code and "pipe(prompt=" in code and "load_image" not in code
