"""FLUX.2 end to end on CPU, on tiny FLUX.2 [dev] and [klein] folders built in a temporary folder: CP trains like
one process, resume continues on another layout, validation under CP renders the image one process renders, the LoRA
file loads into Flux2Pipeline and gives the trained model's image, full fine-tuning writes a transformer folder
Flux2Transformer2DModel loads. Four trainer launches (one with CP), shared by the tests. [klein]'s pairs with CP:
tests/test_train_flux2_references.py (rows of one to three references)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests import snippets
from tests.launch import assert_same_trajectory, losses, max_rel_weights, ok, run_args, train

pytestmark = pytest.mark.e2e  # every test here launches train_flux_cp.py

PAIRS = Path(__file__).resolve().parent.parent / "data" / "tiny_pairs"
PROMPT = "a red circle on a blue background"
SEED = 3
# [dev]'s system message and chat template take ~170 of the tiny byte-level tokenizer's tokens: 256 keeps the
# captions inside the prompt ([klein]'s template ~20).
TEXT_TOKENS = {"dev": 256, "klein": 64}


def _validation(prompt: str) -> list[str]:
    return ["--validation_prompt", prompt, "--num_validation_images", "1", "--validation_inference_steps", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from flux_cp.families.flux2.tiny import ensure_tiny_flux2_pipeline

    tmp = tmp_path_factory.mktemp("flux2_runs")
    # under the session's FLUX_CP_HOME, shared with other tests
    models = {name: ensure_tiny_flux2_pipeline(klein=name == "klein") for name in ("dev", "klein")}

    def flags(name: str, model: str, steps: int, *extra: str) -> list[str]:
        # --adam_epsilon 1e-6: some LoRA gradient elements of the tiny [dev] are of the order of AdamW's default
        # epsilon (1e-8), where the size of a step depends on the order of fp32 sums (one process against CP: 5e-6
        # apart after one step at 1e-3, 1.5e-5 relative after ten); above them, the comparison measures CP.
        # [dev] with --lora_alpha 8: its LoRA file carries the scale 2 in lora_B ([klein]: alpha = rank, scale 1)
        lora = [] if "--full_finetune" in extra else ["--rank", "4", *(["--lora_alpha", "8"] if model == "dev" else [])]
        return run_args(tmp, name, steps, "--pretrained_model_name_or_path", str(models[model]), "--resolution", "64",
                        "--max_sequence_length", str(TEXT_TOKENS[model]), "--seed", str(SEED), *lora, "--learning_rate",
                        "1e-2", "--adam_epsilon", "1e-6", "--random_flip", *extra)  # fmt: skip

    dev = [*_validation(PROMPT), "--checkpointing_steps", "5"]
    ok(train(1, *flags("dev_one", "dev", 10, *dev)))
    ok(train(2, *flags("dev_cp2", "dev", 10, "--cp_size", "2", "--cp_mode", "ring", *dev)))
    # the CP run's checkpoint of step 5, resumed by one process
    resume = ["--resume_from_checkpoint", str(tmp / "dev_cp2" / "checkpoint-5"), "--checkpointing_steps", "5"]
    ok(train(1, *flags("dev_resumed", "dev", 10, *resume)))
    # --no_cache: encoded live every batch (a later flag overrides an earlier one)
    full = ["--full_finetune", "--learning_rate", "1e-3", "--no_cache", "--dataset_name", str(PAIRS),
            "--checkpointing_steps", "1000", "--resolution", "48"]  # fmt: skip
    out = ok(train(1, *flags("klein_full", "klein", 2, *full)))
    (tmp / "klein_full.log").write_text(out.stdout + out.stderr)
    return {"tmp": tmp, **models}


def _png(run: Path, step: int = 10) -> np.ndarray:
    return np.asarray(Image.open(run / "validation" / f"step-{step:06d}.png")).astype(int)


def _render(pipe, prompt: str, text_tokens: int, **extra) -> np.ndarray:
    """The image flux_cp.outputs.validation renders for the first prompt's first image with these settings."""
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        prompt=prompt, height=64, width=64, num_inference_steps=2, guidance_scale=3.5,
        max_sequence_length=text_tokens, generator=torch.Generator("cpu").manual_seed(SEED * 1000), output_type="np",
        **extra,
    ).images[0]  # fmt: skip
    return (np.clip(image, 0, 1) * 255).round().astype(int)


def test_dev_with_cp_trains_like_one_process_with_the_recipes_defaults(runs):
    tmp = runs["tmp"]
    assert_same_trajectory(tmp / "dev_one", tmp / "dev_cp2")
    # validation with CP (Flux2Pipeline through full_sequence_io) draws the image one process draws
    one, two = _png(tmp / "dev_one"), _png(tmp / "dev_cp2")
    assert one.shape == (64, 64, 3) and np.abs(one - two).max() <= 1, np.abs(one - two).max()
    config = json.loads((tmp / "dev_cp2" / "run_config.json").read_text())
    assert config["vae_encode_mode"] == "mode" and (config["rank"], config["lora_alpha"]) == (4, 8)
    single = [f"single_transformer_blocks.{i}.attn.to_out" for i in range(2)]
    assert config["lora_layers"] == ["to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj", *single]


def test_a_resume_on_another_layout_continues_the_run(runs):
    tmp = runs["tmp"]
    cp2, resumed = losses(tmp / "dev_cp2"), losses(tmp / "dev_resumed")[5:]  # after the source's rows of a fork
    assert len(resumed) == 5
    worst = max(abs(a - b) / abs(b) for a, b in zip(cp2[5:], resumed))
    assert worst < 1e-5, (cp2[5:], resumed)
    assert max_rel_weights(tmp / "dev_cp2", tmp / "dev_resumed") < 1e-5


def test_the_dev_lora_loads_into_flux2_pipeline_and_renders_the_trained_models_image(runs):
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline.from_pretrained(runs["dev"])
    before = _render(pipe, PROMPT, TEXT_TOKENS["dev"])
    pipe.load_lora_weights(str(runs["tmp"] / "dev_cp2"))
    after = _render(pipe, PROMPT, TEXT_TOKENS["dev"])
    trained = _png(runs["tmp"] / "dev_cp2")  # the trainer's own render, with the transformer it trained
    assert np.abs(after - trained).max() <= 1, np.abs(after - trained).max()
    assert np.abs(before - trained).max() > 3  # the LoRA is what makes them equal


def test_full_finetune_writes_a_transformer_folder_that_flux2_loads(runs):
    from diffusers import Flux2Transformer2DModel

    trained = Flux2Transformer2DModel.from_pretrained(runs["tmp"] / "klein_full" / "transformer")
    original = Flux2Transformer2DModel.from_pretrained(runs["klein"], subfolder="transformer")
    pairs = list(zip(trained.named_parameters(), original.named_parameters()))
    assert [a for (a, _), _ in pairs] == [b for _, (b, _) in pairs]
    changed = [n for (n, a), (_, b) in pairs if not torch.equal(a, b)]
    assert len(changed) > len(pairs) // 2, "training changed too few weights"


def test_the_lines_of_a_full_fine_tune_on_pairs_load_its_transformer_and_edit_the_first_pair_s_reference(runs):
    """No --validation_image: the first training pair's reference is copied beside the transformer (cut square, at
    64 px rather than the trained 48: FLUX.2's pipelines take no smaller image); the lines of the model card and of
    the log load the transformer into Flux2KleinPipeline and edit it, making an image of the trained size. A full
    fine-tune's checkpoints hold no LoRA file."""
    from flux_cp.outputs.validation import square

    out = runs["tmp"] / "klein_full"
    code = snippets.check(out, (runs["tmp"] / "klein_full.log").read_text(), 48)
    assert 'Flux2Transformer2DModel.from_pretrained(folder, subfolder="transformer"' in code
    assert 'reference = load_image(f"{folder}/reference.png")' in code
    first = json.loads((PAIRS / "metadata.jsonl").read_text().splitlines()[0])
    reference = next(v for k, v in first.items() if k != "file_name" and k.endswith("file_name"))
    with Image.open(PAIRS / reference) as image:
        want = np.asarray(square(image.convert("RGB"), 64))
    assert np.array_equal(np.asarray(Image.open(out / "reference.png").convert("RGB")), want)
    assert not (out / "checkpoint-2" / "pytorch_lora_weights.safetensors").exists()
