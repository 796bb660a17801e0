"""FLUX.1 Kontext end to end on CPU: pairs train the same with CP as without, the LoRA loads into
FluxKontextPipeline and changes its edits, full fine-tuning writes a transformer the pipeline loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests import snippets
from tests.launch import assert_same_trajectory, ok, run_args, train

pytestmark = pytest.mark.e2e  # every test here launches train_flux_cp.py

PAIRS = Path(__file__).resolve().parent.parent / "data" / "tiny_pairs"
REFERENCE = PAIRS / "00_blue_circle.png"


def _pairs(tmp: Path, name: str, steps: int, *extra: str) -> list[str]:
    # Flips: both images of a pair are cropped and flipped together.
    return run_args(tmp, name, steps, "--dataset_name", str(PAIRS), "--seed", "5", "--checkpointing_steps", "1000",
                    "--random_flip", *extra)  # fmt: skip


def _edit(pipe, seed: int = 0) -> torch.Tensor:
    return pipe(
        image=Image.open(REFERENCE).convert("RGB"), prompt="make the circle red", height=64, width=64,
        max_area=64 * 64, _auto_resize=False, num_inference_steps=2, max_sequence_length=32, guidance_scale=2.5,
        generator=torch.Generator().manual_seed(seed), output_type="pt",
    ).images  # fmt: skip


def test_kontext_pairs_with_cp_train_like_one_process_and_the_lora_edits(tmp_path):
    from diffusers import FluxKontextPipeline

    from flux_cp.families.flux1.tiny import ensure_tiny_pipeline

    validation = ["--validation_prompt", "make the circle red", "--validation_image", str(REFERENCE),
                  "--validation_inference_steps", "2", "--num_validation_images", "1"]  # fmt: skip
    args = ["--learning_rate", "1e-2", "--rank", "4", "--aspect_buckets", *validation]  # pairs of several sizes
    ok(train(1, *_pairs(tmp_path, "one", 10, *args)))
    cp2 = ok(train(2, *_pairs(tmp_path, "cp2", 10, "--cp_size", "2", "--cp_mode", "ring", *args)))
    assert "FLUX.1 Kontext pairs: 16 targets" in cp2.stdout + cp2.stderr
    assert_same_trajectory(tmp_path / "one", tmp_path / "cp2")
    # FluxKontextPipeline validation with CP (target and reference split as in training) draws the same image.
    one, two = (
        np.asarray(Image.open(tmp_path / r / "validation" / "step-000010.png")).astype(int) for r in ("one", "cp2")
    )
    assert one.shape == (64, 64, 3) and np.abs(one - two).max() <= 1, np.abs(one - two).max()

    pipe = FluxKontextPipeline.from_pretrained(ensure_tiny_pipeline(kontext=True))
    before = _edit(pipe)
    pipe.load_lora_weights(str(tmp_path / "cp2"))
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
    assert (_edit(pipe) - before).abs().max().item() > 1e-3


def test_kontext_full_finetune_writes_a_transformer_the_pipeline_loads(tmp_path):
    """Also FLUX.1's full fine-tuning (the same FluxTransformer2DModel, saved by the same code whatever the data): the
    folder FluxTransformer2DModel.from_pretrained loads holds weights the training changed, most of them, and the
    run's lines load it."""
    from diffusers import FluxKontextPipeline, FluxTransformer2DModel

    from flux_cp.families.flux1.tiny import ensure_tiny_pipeline

    # --no_cache: pairs encoded live, every batch (the reference with its target's crop and flip). 48 px: 9 target
    # + 9 reference tokens, which FLUX.1 data could not split over 2 ranks (9 image tokens) but a pair can.
    flags = ["--cp_size", "2", "--full_finetune", "--learning_rate", "1e-3", "--no_cache", "--resolution", "48"]
    result = ok(train(2, *_pairs(tmp_path, "full", 2, *flags)))
    trained = FluxTransformer2DModel.from_pretrained(tmp_path / "full" / "transformer")
    path = ensure_tiny_pipeline(kontext=True)
    original = FluxKontextPipeline.from_pretrained(path)
    pairs = list(zip(trained.named_parameters(), original.transformer.named_parameters()))
    assert [a for (a, _), _ in pairs] == [b for _, (b, _) in pairs]
    changed = [n for (n, a), (_, b) in pairs if not torch.equal(a, b)]
    assert len(changed) > len(pairs) // 2, "training changed too few weights"
    pipe = FluxKontextPipeline.from_pretrained(path, transformer=trained)
    assert (_edit(pipe) - _edit(original)).abs().max().item() > 1e-4
    # the lines of the model card and of the log: the transformer in FluxKontextPipeline, editing the first pair's
    # reference (no --validation_image), copied beside it
    code = snippets.check(tmp_path / "full", result.stderr, 48)
    assert 'FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer"' in code and "reference.png" in code
