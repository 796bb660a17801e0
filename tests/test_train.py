"""train_flux_cp.py end to end on CPU: CP changes nothing, outputs load in diffusers, resume is exact."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from flux_cp.outputs.metrics import read_metrics
from tests import snippets
from tests.launch import assert_same_trajectory, ok, run_args, train

pytestmark = pytest.mark.e2e  # every test here launches train_flux_cp.py


def _common(model: Path, tmp: Path, name: str, steps: int, *extra: str) -> list[str]:
    return run_args(tmp, name, steps, "--pretrained_model_name_or_path", str(model), "--resolution", "64",
                    "--max_sequence_length", "32", "--checkpointing_steps", "1000", "--seed", "3", *extra)  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The tiny FLUX.1 pipeline with a transformer of one double and one single block: each kind of block is one graph
    for --compile to build (Inductor's C++ kernels take minutes on a CPU), the second of a kind another (its input
    requires grad, or has other strides); the 64 px and 32 text tokens of the tiny default."""
    import shutil

    from flux_cp.families.flux1.tiny import ensure_tiny_pipeline, tiny_transformer

    path = tmp_path_factory.mktemp("model") / "tiny-1-1"
    shutil.copytree(ensure_tiny_pipeline(), path)
    shutil.rmtree(path / "transformer")
    tiny_transformer(seed=0, num_layers=1, num_single_layers=1).save_pretrained(path / "transformer")
    return path


# Gradient accumulation and checkpointing, CP by Ulysses: one process against cp=2 (eager), shared by the tests
# that compare against the cp=2 run. With the recipe options that must be exact under CP too: the text encoder's LoRA
# (CLIP run on every rank of the group, its gradients averaged as the transformer's) and the EMA as the output.
ACCUMULATED = ["--learning_rate", "1e-3", "--gradient_accumulation_steps", "2", "--gradient_checkpointing", "all",
               "--train_text_encoder", "--text_encoder_lr", "1e-3", "--use_ema", "--ema_decay", "0.9",
               "--ema_update_interval", "2"]  # fmt: skip
CP2 = ["--cp_size", "2", "--cp_mode", "ulysses"]


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory, model) -> Path:
    """Both runs also write their initial LoRA weights (--seed_checkpoint: written when absent, which changes nothing
    else in the run), for the test that they do not depend on the layout."""
    tmp = tmp_path_factory.mktemp("accumulated")
    ok(train(1, *_common(model, tmp, "one", 10, *ACCUMULATED, "--checkpointing_steps", "3",
                         "--checkpoints_total_limit", "2", "--seed_checkpoint",
                         str(tmp / "seed_one.safetensors"))))  # fmt: skip
    # --profile_step: a trace per rank, and the profiled step's numbers are those of the run without it
    ok(train(2, *_common(model, tmp, "cp2", 10, *CP2, "--profile_step", "4", *ACCUMULATED,
                         "--seed_checkpoint", str(tmp / "seed_cp2.safetensors"))))  # fmt: skip
    # the first run stopped at its step 9: what its checkpoint-9's LoRA file must be
    ok(train(1, *_common(model, tmp, "nine", 9, *ACCUMULATED)))
    return tmp


def test_single_process_matches_cp2(accumulated):
    kept = sorted(p.name for p in (accumulated / "one").glob("checkpoint-*"))
    assert kept == ["checkpoint-10", "checkpoint-9"], kept  # every 3 steps and the last, the newest 2 kept
    assert_same_trajectory(accumulated / "one", accumulated / "cp2")
    for rank in (0, 1):
        trace = json.loads((accumulated / "cp2" / "profile" / f"rank{rank}.json").read_text())
        assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
        assert "kernels" in json.loads((accumulated / "cp2" / "profile" / f"rank{rank}_summary.json").read_text())
    rows = read_metrics(accumulated / "cp2" / "metrics.jsonl")
    assert all(r["grad_norm"] > 0 for r in rows), "gradient norm not measured"


def test_the_output_is_the_ema_and_holds_the_text_encoders_lora(accumulated):
    """--use_ema: the LoRA file holds the EMA the last checkpoint keeps beside the raw weights, not the raw weights;
    --train_text_encoder: its text_encoder.* keys (compared under CP by the test above) are CLIP's LoRA."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    saved = load_file(accumulated / "one" / "pytorch_lora_weights.safetensors")
    text = [k for k in saved if k.startswith("text_encoder.")]
    assert text and all(re.search(r"\.(q|k|v|out)_proj\.lora_[AB]\.weight$", k) for k in text), text
    with warnings.catch_warnings():  # "torch.distributed is unavailable ... load in a single process": as meant
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys(checkpoint_id=str(accumulated / "one" / "checkpoint-10" / "state"))

    def named(entries: dict) -> dict:  # checkpoint names -> the LoRA file's
        out = {}
        for k, v in entries.items():
            part, rest = k.split(".", 1)
            out[f"{part}.{rest.replace('.default.', '.')}"] = v
        return out

    ema, raw = named(state["ema"]), named(state["model"])
    assert ema.keys() == raw.keys() == saved.keys()
    assert all(torch.equal(saved[k], ema[k]) for k in saved)
    assert not all(torch.equal(saved[k], raw[k]) for k in saved if "lora_B" in k), "the raw weights were written"


def test_each_checkpoint_holds_the_lora_file_of_its_step_which_the_card_s_lines_load(accumulated):
    """checkpoint-9 of a 10-step run holds the LoRA file (the EMA's, with the text encoder's LoRA) that a run of 9
    steps ends with, bit for bit, and the last checkpoint the run's own; the model card's lines, pointed at the
    checkpoint as their comment says, load it into FluxPipeline (both LoRAs) and make an image of the trained size."""
    one = accumulated / "one"
    name = "pytorch_lora_weights.safetensors"

    def content(folder: Path) -> tuple[dict, dict]:  # (safetensors writes its header's entries in any order)
        with safe_open(str(folder / name), "pt") as f:
            return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}

    def same(a: Path, b: Path) -> bool:
        (meta_a, a), (meta_b, b) = content(a), content(b)
        return meta_a == meta_b and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    assert same(one / "checkpoint-9", accumulated / "nine") and same(one / "checkpoint-10", one)
    assert not same(one / "checkpoint-9", one)
    listed = json.loads((one / "checkpoint-9" / "meta.json").read_text())["checksums"]["files"]
    assert name in listed  # checked on resume like the rest of the checkpoint
    code = snippets.card_code(one)
    hint = '# a checkpoint\'s: f"{folder}/checkpoint-N"'
    assert f"pipe.load_lora_weights(folder, weight_name={name!r})  {hint}" in code
    code = code.replace("load_lora_weights(folder, ", 'load_lora_weights(f"{folder}/checkpoint-9", ')
    check = "assert any('lora' in n for n, _ in pipe.text_encoder.named_parameters())"  # CLIP's LoRA loaded too
    code = code.replace("pipe.to(device)", f"pipe.to(device)\n{check}")
    result = snippets.run(code, one)
    assert result.returncode == 0, result.stderr[-5000:]
    assert not snippets.noise(result.stdout + result.stderr), snippets.noise(result.stdout + result.stderr)
    snippets.check_image(one / "image.png", 64)


def test_compiled_blocks_train_like_eager_with_cp(tmp_path, model, accumulated):
    """--compile (README's advice for GPUs): every block compiled as one graph, CP attention included (no graph
    break), the first block checkpointed inside its graph and the others plain; the same trajectory as eager with
    every block checkpointed (the shared cp=2 run: checkpointing recomputes exactly) up to Inductor's fp32
    reassociation."""
    flags = [*CP2, *ACCUMULATED, "--compile", "--gradient_checkpointing", "1"]
    logs = {"TORCH_LOGS": "graph_breaks,graph_code"}
    compiled = ok(train(2, *_common(model, tmp_path, "compiled", 10, *flags), extra_env=logs))
    breaks = re.findall(r"Graph break in user code at (\S+)", compiled.stderr)
    assert not breaks, breaks
    # the graphs dynamo produced hold the CP attention: its exchange and its attention op
    assert "ops.cp.ring_attention" in compiled.stderr and "all_to_all_single" in compiled.stderr
    assert json.loads((tmp_path / "compiled" / "run_config.json").read_text())["checkpointed_blocks"] == 1
    assert_same_trajectory(accumulated / "cp2", tmp_path / "compiled")


def test_lora_loads_into_flux_pipeline_and_changes_its_output(model, accumulated):
    """The shared cp=2 run's LoRA file (its EMA, with CLIP's LoRA from --train_text_encoder) in FluxPipeline."""
    from diffusers import FluxPipeline

    out = accumulated / "cp2"
    assert (out / "metrics.jsonl").is_file() and (out / "loss_curve.png").is_file()

    pipe = FluxPipeline.from_pretrained(model)

    def image():
        return pipe(
            "a red circle on a blue background",
            height=64,
            width=64,
            num_inference_steps=2,
            max_sequence_length=32,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images

    def pooled():
        return pipe.encode_prompt("a red circle on a blue background", None, max_sequence_length=32)[1]

    before, pooled_before = image(), pooled()
    pipe.load_lora_weights(str(out))
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
    # --train_text_encoder: CLIP's LoRA (text_encoder.* keys) loads into the pipeline's text encoder and changes it
    assert any("lora" in n for n, _ in pipe.text_encoder.named_parameters())
    assert (pooled() - pooled_before).abs().max().item() > 1e-4
    after = image()
    assert (after - before).abs().max().item() > 1e-3


def test_initial_weights_do_not_depend_on_the_layout_and_seed_checkpoint_round_trips(tmp_path, model, accumulated):
    """The initial LoRA weights the shared runs wrote (one process, cp=2) are equal; a third layout (dp=2) with another
    seed reads them back."""
    seed_a, seed_b = accumulated / "seed_cp2.safetensors", accumulated / "seed_one.safetensors"
    a, b = load_file(seed_a), load_file(seed_b)
    assert a.keys() == b.keys() and any("lora_A" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), "initial LoRA weights depend on the layout"
    # Read back by a third layout with another seed: the weights come from the file, not the seed.
    # (--learning_rate 0 is refused; at 1e-12 a step moves no fp32 LoRA weight of this size by one ulp)
    other = _common(model, tmp_path, "c", 1, "--cp_size", "1", "--seed_checkpoint", str(seed_a),
                    "--learning_rate", "1e-12")  # fmt: skip
    other[other.index("--seed") + 1] = "11"
    result = ok(train(2, *other))
    assert "seed checkpoint read" in result.stdout + result.stderr
    saved = load_file(tmp_path / "c" / "pytorch_lora_weights.safetensors")
    lora_a = sorted(k for k in a if "lora_A" in k)
    saved_a = sorted(k for k in saved if "lora_A" in k)
    assert len(lora_a) == len(saved_a) and all(torch.equal(a[x], saved[y]) for x, y in zip(lora_a, saved_a))


def test_a_trained_clip_stays_whole_while_t5_streams_and_trains_as_without_offload(tmp_path, model):
    """--train_text_encoder with --text_encoder_offload on: T5 is streamed from host memory for the encoding, CLIP (the
    one trained, every step) is kept whole: the run is the run without offload, loss for loss and weight for weight."""
    args = ["--learning_rate", "1e-3", "--train_text_encoder", "--text_encoder_lr", "1e-3"]
    streamed = ok(train(1, *_common(model, tmp_path, "streamed", 10, *args, "--text_encoder_offload", "on")))
    assert "text_encoder_2: streamed from host memory (--text_encoder_offload on)" in streamed.stderr
    assert "text_encoder: whole on the accelerator when in use (--train_text_encoder trains it whole" in streamed.stderr
    ok(train(1, *_common(model, tmp_path, "whole", 10, *args, "--text_encoder_offload", "off")))
    assert_same_trajectory(tmp_path / "streamed", tmp_path / "whole", tol=1e-6)
    lora = load_file(tmp_path / "streamed" / "pytorch_lora_weights.safetensors")
    assert any(k.startswith("text_encoder.") for k in lora)
