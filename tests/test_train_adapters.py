"""`--adapter dora` and `--adapter lokr` end to end on CPU: each trained at cp=2 gives one process's losses and
adapter weights (DoRA by Ulysses with checkpointing and accumulation, LoKr by the ring), a LoKr checkpoint resumes on
another layout into the same trajectory, the files load where the model card says, and a resume with another
adapter is refused."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flux_cp.outputs.metrics import read_metrics
from tests.launch import assert_same_trajectory, in_process, ok, run_args, train

pytestmark = pytest.mark.e2e  # every test here launches train_flux_cp.py

STEPS = 10
# rank 4 with alpha 8: the scale alpha / rank is not 1, so the file's alpha keys (DoRA) and the scale multiplied into
# lokr_w1 (LoKr) are exercised. The tiny model's 64 features: LoKr's w2 whole there, factored on the 256-wide MLP.
ADAPTER = ["--rank", "4", "--lora_alpha", "8", "--learning_rate", "1e-3"]
DORA = ["--adapter", "dora", *ADAPTER, "--gradient_accumulation_steps", "2", "--gradient_checkpointing", "all"]
LOKR = ["--adapter", "lokr", *ADAPTER]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The tiny FLUX.1 pipeline with one double and one single block (as tests/test_train.py's)."""
    from flux_cp.families.flux1.tiny import ensure_tiny_pipeline, tiny_transformer

    path = tmp_path_factory.mktemp("model") / "tiny-1-1"
    shutil.copytree(ensure_tiny_pipeline(), path)
    shutil.rmtree(path / "transformer")
    tiny_transformer(seed=0, num_layers=1, num_single_layers=1).save_pretrained(path / "transformer")
    return path


def _args(model: Path, tmp: Path, name: str, *extra: str) -> list[str]:
    return run_args(
        tmp,
        name,
        STEPS,
        "--pretrained_model_name_or_path",
        str(model),
        "--resolution",
        "64",
        "--max_sequence_length",
        "32",
        "--seed",
        "3",
        *extra,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model) -> Path:
    """DoRA and LoKr, one process against cp=2; LoKr's cp=2 run checkpoints at step 5, from which a one-process run
    forks into `lokr_resumed`."""
    tmp = tmp_path_factory.mktemp("adapters")
    ok(train(1, *_args(model, tmp, "dora_one", *DORA)))
    ok(train(2, *_args(model, tmp, "dora_cp2", *DORA, "--cp_size", "2", "--cp_mode", "ulysses")))
    ok(train(1, *_args(model, tmp, "lokr_one", *LOKR)))
    cp2 = ok(
        train(
            2,
            *_args(model, tmp, "lokr_cp2", *LOKR, "--cp_size", "2", "--cp_mode", "ring", "--checkpointing_steps", "5"),
        )
    )
    (tmp / "lokr_cp2.log").write_text(cp2.stdout + cp2.stderr)
    resumed = _args(
        model, tmp, "lokr_resumed", *LOKR, "--resume_from_checkpoint", str(tmp / "lokr_cp2" / "checkpoint-5")
    )
    ok(train(1, *resumed))
    return tmp


def test_dora_and_lokr_under_cp_train_as_one_process(runs):
    assert_same_trajectory(runs / "dora_one", runs / "dora_cp2")
    assert_same_trajectory(runs / "lokr_one", runs / "lokr_cp2")
    dora, lokr = (load_file(runs / f"{a}_cp2" / "pytorch_lora_weights.safetensors") for a in ("dora", "lokr"))
    # DoRA: LoRA's keys, alpha keys (alpha 8 != rank 4) and a trained magnitude per output feature of each layer.
    magnitudes = [k for k in dora if k.endswith(".lora_magnitude_vector")]
    assert magnitudes and {k.rsplit(".", 1)[1] for k in dora} == {"weight", "lora_magnitude_vector", "alpha"}
    assert len(magnitudes) == len([k for k in dora if k.endswith(".lora_A.weight")])
    # LoKr: w1 whole, w2 whole on the 64-wide layers and factored on the 256-wide ones; no alpha keys.
    assert {k.rsplit(".", 1)[1] for k in lokr} == {"lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b"}
    for name in ("dora", "lokr"):
        config = json.loads((runs / f"{name}_cp2" / "run_config.json").read_text())
        assert config["adapter"] == name
    log = (runs / "lokr_cp2.log").read_text()
    assert "--adapter lokr: peft's LoKr (a Kronecker product of two factors) on --lora_layers, rank 4, alpha 8" in log
    assert "the LoKr (diffusers format)" in log and "Load the LoKr with diffusers" in log


def test_a_lokr_checkpoint_resumes_on_another_layout_into_the_same_trajectory(runs):
    """Written at cp=2 (ring), resumed at step 5 by one process: the one-process run's losses and weights."""
    rows = read_metrics(runs / "lokr_resumed" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert_same_trajectory(runs / "lokr_one", runs / "lokr_resumed")


def test_a_resume_with_another_adapter_is_refused(runs, model, tmp_path):
    """The LoKr run's last checkpoint resumed as a LoRA: refused naming the adapter, the folder left as it was."""
    out = runs / "lokr_resumed"
    before = sorted(p.name for p in out.iterdir())
    args = _args(
        model,
        runs,
        "lokr_resumed",
        "--rank",
        "4",
        "--lora_alpha",
        "8",
        "--learning_rate",
        "1e-3",
        "--resume_from_checkpoint",
        "latest",
        "--max_train_steps",
        "12",
    )
    code, stderr = in_process(args)
    assert code != 0
    assert "incompatible run (adapter: checkpoint 'lokr', now 'lora')" in stderr, stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == before


def test_the_dora_file_loads_into_flux_pipeline_and_changes_its_output(runs, model):
    """load_lora_weights reads the trained DoRA (its magnitudes too: the transformer's layers are peft's DoRA)."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(model)
    inputs = dict(height=64, width=64, num_inference_steps=2, max_sequence_length=32, output_type="pt")

    def image():
        return pipe("a red circle", generator=torch.Generator().manual_seed(0), **inputs).images

    before = image()
    pipe.load_lora_weights(str(runs / "dora_cp2"))
    layers = [m for m in pipe.transformer.modules() if hasattr(m, "lora_magnitude_vector")]
    assert layers and all("default_0" in m.lora_magnitude_vector for m in layers)
    assert (image() - before).abs().max().item() > 1e-3


def test_the_lokr_model_cards_snippet_runs_as_pasted(runs, monkeypatch):
    """The card's diffusers lines, as pasted: the LoKr loads through the transformer's loader and renders."""
    card = (runs / "lokr_cp2" / "README.md").read_text()
    code = re.search(r"```py\n(.*?)```", card, re.S).group(1)
    assert "pipe.transformer.load_lora_adapter(" in code and "LoKr" in card
    monkeypatch.chdir(runs)
    try:
        exec(compile(code, "card snippet", "exec"), {})  # noqa: S102 - the snippet is the test's subject
    finally:
        logging.disable(logging.NOTSET)  # the snippet's, for a process of its own
    assert (runs / "lokr_cp2" / "image.png").is_file()  # the snippet saves into the run's output folder
