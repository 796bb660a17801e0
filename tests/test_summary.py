"""How a run ends: a summary of every output it wrote and the diffusers lines that load the weights, without the
libraries' noise (flux_cp.outputs.summary, flux_cp.quiet). The trainer's own end is checked in test_run_outputs.py."""

from __future__ import annotations

import json
import logging
import re
import textwrap
import warnings
from pathlib import Path

from flux_cp import quiet
from flux_cp.config.parser import parse_config
from flux_cp.outputs.summary import loss_change, summary


def _folder(out: Path, losses: list[float], grids: int, checkpoints: tuple[int, ...]) -> None:
    (out / "validation").mkdir(parents=True)
    (out / "logs").mkdir()
    for name in ("pytorch_lora_weights.safetensors", "README.md", "run_config.json", "loss_curve.png"):
        (out / name).write_bytes(b"x")
    rows = [{"step": i + 1, "loss": v} for i, v in enumerate(losses)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step in range(grids):
        (out / "validation" / f"step-{step * 5:06d}.png").write_bytes(b"x")
    for step in checkpoints:
        (out / f"checkpoint-{step}").mkdir()
        (out / f"checkpoint-{step}" / "meta.json").write_text("{}")
        (out / f"checkpoint-{step}" / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    (out / ".checkpoint-99.partial").mkdir()  # never listed


def _code(text: str) -> str:
    return textwrap.dedent(re.split(r"Load the \w+ with diffusers[^\n]*:\n", text, maxsplit=1)[1])


def test_the_summary_lists_every_output_the_loss_change_and_how_to_load_the_lora(tmp_path):
    out = tmp_path / "kontext-lora"
    losses = [1.2, 1.1, 1.3, 1.0, 0.9, 1.0, 0.8, 0.9, 0.7, 0.9]
    _folder(out, losses, grids=6, checkpoints=(5, 10))
    cfg = parse_config(["--output_dir", str(out), "--dataset_name", "data/tiny_pairs", "--max_train_steps", "10"])
    (out / "reference.png").write_bytes(b"x")
    text = summary(cfg, steps=10, pairs=True, hub_url="https://huggingface.co/me/k",
                   repo_id="me/k", references=("reference.png",))  # fmt: skip
    head, *lines = text.splitlines()
    assert head == f"done: 10 steps, loss 1.150 -> 0.800 (-30%, means of the first and last 2 steps). Outputs in {out}:"
    listed = [line.split()[0].rstrip(",") for line in lines if line.startswith("  ") and not line.startswith("    ")]
    assert listed == ["pytorch_lora_weights.safetensors", "README.md", "run_config.json", "metrics.jsonl",
                      "loss_curve.png", "reference.png", "validation/", "checkpoint-5/", "logs/",
                      "https://huggingface.co/me/k"]  # fmt: skip
    assert "  reference.png                     the reference image the lines below edit" in lines
    assert (
        "  validation/                       validation images: 6 grids, step-000000.png ... step-000025.png" in lines
    )
    (kept,) = [line for line in lines if line.startswith("  checkpoint-5/, checkpoint-10/ ")]
    assert kept.endswith("  resumable: --resume_from_checkpoint latest or one of them; each holds its step's LoRA")
    (out / "checkpoint-5" / "pytorch_lora_weights.safetensors").unlink()  # as an earlier version wrote it
    again = summary(cfg, steps=10, pairs=True)
    assert "  resumable: --resume_from_checkpoint latest or one of them\n" in again
    assert f"tensorboard --logdir {out / 'logs'}" in text
    code = _code(text)
    compile(code, "snippet", "exec")
    assert "pipe = FluxKontextPipeline.from_pretrained(ensure_tiny_pipeline(kontext=True), " in code
    assert "pipe.load_lora_weights(repo, weight_name='pytorch_lora_weights.safetensors')" in code
    assert "repo = 'me/k'" in code and "reference = load_image(hf_hub_download(repo, 'reference.png'))" in code
    # pushed: the weights from the Hub, the image into the local output folder (not where the run was launched)
    assert code.rstrip().endswith(f"image.save({str(out / 'image.png')!r})")


def test_the_summary_names_only_what_exists_and_a_transformer_folder_when_fully_fine_tuned(tmp_path):
    out = tmp_path / "full"
    (out / "transformer").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": NaN}\n')
    cfg = parse_config(["--output_dir", str(out), "--full_finetune", "--max_train_steps", "1",
                        "--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-dev"])  # fmt: skip
    text = summary(cfg, steps=1, pairs=False)
    assert text.splitlines()[:3] == [
        f"done: 1 step. Outputs in {out}:",
        "  transformer/   the fine-tuned transformer (diffusers' format)",
        "  metrics.jsonl  one row per step: loss, lr, speed, memory",
    ]
    code = _code(text)
    compile(code, "snippet", "exec")
    assert f"folder = {str(out)!r}" in code
    assert 'FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer"' in code
    assert "FluxPipeline.from_pretrained('black-forest-labs/FLUX.1-dev', transformer=transformer" in code


def test_the_loss_change_compares_the_first_and_last_fifth(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "loss": float(i)}) + "\n" for i in range(1, 11)))
    assert loss_change(metrics) == (1.5, 9.5, 2)
    metrics.write_text('{"step": 1, "loss": 1.0}\n')
    assert loss_change(metrics) is None and loss_change(tmp_path / "missing") is None


def test_third_party_noise_is_dropped_by_its_own_text_and_everything_else_shows(caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.install()
        quiet.install()  # idempotent
        warnings.warn(
            "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a "
            "single process.",
            UserWarning,
            stacklevel=1,
        )
        warnings.warn("torch.distributed is disabled for another reason", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["torch.distributed is disabled for another reason"]
    assert len(logging.getLogger("matplotlib.font_manager").filters) == 1
    with caplog.at_level(logging.INFO):
        transformers = logging.getLogger("transformers.utils.import_utils")
        transformers.warning(
            "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil` for "
            "backward compatibility. Install torchvision to use the default backend, or import "
            "`CLIPImageProcessorPil` directly to silence this warning."
        )
        transformers.warning("`Something` else that transformers says")
        logging.getLogger("matplotlib.font_manager").info("generated new fontManager")
        logging.getLogger("matplotlib.font_manager").warning("Font family 'x' not found.")
        logging.getLogger("flux_cp").warning("warning: ours, always shown")
    assert [r.getMessage() for r in caplog.records] == [
        "`Something` else that transformers says",
        "Font family 'x' not found.",
        "warning: ours, always shown",
    ]
