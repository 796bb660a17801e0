"""The memory planner against what autograd saves (CPU) and against peaks measured on H200s."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig

import cp
from flux_cp import plan
from flux_cp.flow import image_ids, pack_latents, text_ids
from flux_cp.lora import ATTENTION_TARGETS
from flux_cp.tiny import FLUX1_DEV_TRANSFORMER, tiny_transformer

ATTN_LORA = list(ATTENTION_TARGETS)


def _saved_units(double: int, single: int) -> float:
    """Bytes autograd saves in one bf16 forward (LoRA, our processor), in units of 2 x D bytes per token."""
    d, heads = 256, 8
    model = tiny_transformer(
        num_layers=double,
        num_single_layers=single,
        num_attention_heads=heads,
        attention_head_dim=d // heads,
        axes_dims_rope=(8, 12, 12),
        joint_attention_dim=64,
        pooled_projection_dim=32,
    ).to(torch.bfloat16)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, target_modules=ATTN_LORA))
    cp.apply_context_parallel(model, None)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    h = w = 32
    text = 64
    inputs = dict(
        hidden_states=pack_latents(torch.randn(1, 4, h, w)).bfloat16(),
        encoder_hidden_states=torch.randn(1, text, 64).bfloat16(),
        pooled_projections=torch.randn(1, 32).bfloat16(),
        timestep=torch.rand(1),
        guidance=torch.full((1,), 3.5),
        img_ids=image_ids(h, w),
        txt_ids=text_ids(text),
    )
    storages = {}

    def pack(t):
        if not (t.is_leaf and t.requires_grad):  # parameters are not activations
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(**inputs)
    tokens = (h // 2) * (w // 2) + text
    return sum(storages.values()) / (tokens * d * 2)


def test_activation_units_per_block_match_what_autograd_saves():
    base = _saved_units(1, 1)
    double = _saved_units(2, 1) - base
    single = _saved_units(1, 2) - base
    assert abs(double - plan.DOUBLE_BLOCK_UNITS) / plan.DOUBLE_BLOCK_UNITS < 0.1, double
    assert abs(single - plan.SINGLE_BLOCK_UNITS) / plan.SINGLE_BLOCK_UNITS < 0.1, single


def test_estimates_are_within_15_percent_of_the_peaks_measured_on_h200s():
    """The model-level peaks of plan_data.json (eager, checkpointed, attention-only LoRA or full fine-tuning);
    BLOCK_PEAK_UNITS was fitted to the rows marked `fitted`, the others are held out."""
    rows = plan.DATA["measured_peaks"]["model_level"]
    kinds = {(r["train"], r["fsdp"]) for r in rows}
    assert kinds == {("lora", False), ("lora", True), ("full", True)}, kinds  # replicated, sharded, full FT
    assert sum("fitted" not in r for r in rows) >= 20  # most rows check the fit rather than make it
    for r in rows:
        e = plan.estimate(
            dict(FLUX1_DEV_TRANSFORMER),
            tokens=(r["resolution"] // 16) ** 2 + 512,
            batch=r["batch"],
            lora_rank=16 if r["train"] == "lora" else None,
            lora_layers=ATTN_LORA,
            world=r["gpus"],
            cp=r["cp"],
            checkpointing=True,
            fsdp=r["fsdp"],
        )
        predicted = e.total / plan.GIB
        assert abs(predicted - r["peak_gib"]) / r["peak_gib"] < 0.15, (predicted, r)


def test_estimates_of_compiled_trainer_runs_are_within_10_percent_of_their_h200_peaks():
    """The trainer's own peaks (metrics.jsonl) with compiled blocks that keep the attention's outputs, and with
    --recompute_attention; one GPU and cp=2 (Ulysses), 1024 to 4096 px, default LoRA layers, DDP. The saved
    attention's units were fitted to these same peaks: this checks that one pair of constants fits all of them."""
    from types import SimpleNamespace

    from flux_cp.config import parse_config

    layers = list(parse_config([]).lora.lora_layers)
    rows = plan.DATA["measured_peaks"]["trainer"]
    assert len(rows) >= 10 and any("--recompute_attention" in r["flags"] for r in rows)
    for r in rows:
        flags = r["flags"].split()
        train = SimpleNamespace(
            gradient_checkpointing=True,
            compile="--compile" in flags,
            compile_mode="reduce-overhead" if "--compile_mode" in flags else None,
            recompute_attention="--recompute_attention" in flags,
        )
        res = int(flags[flags.index("--resolution") + 1])
        e = plan.estimate(
            dict(FLUX1_DEV_TRANSFORMER),
            tokens=(res // 16) ** 2 + 512,
            batch=1,
            lora_rank=16,
            lora_layers=layers,
            world=r["gpus"],
            cp=r["gpus"],
            checkpointing=True,
            fsdp=False,
            saved_attention=plan.saved_attention_units(train, "ulysses", r["gpus"]),
        )
        predicted = e.total / plan.GIB
        assert abs(predicted - r["peak_gib"]) / r["peak_gib"] < 0.10, (r["name"], predicted, r["peak_gib"])


def test_plan_flag_prints_a_table_and_a_suggestion_without_training(tmp_path, capsys):
    """`train_flux_cp.py --plan` (its entry point, in this process): a table and a suggestion, no run."""
    import train_flux_cp
    from flux_cp.tiny import write_flux1_dev_shapes

    folder = write_flux1_dev_shapes(tmp_path / "dev")
    argv = ["--plan", "--pretrained_model_name_or_path", str(folder), "--resolution", "4096", "--gpu_memory_gib",
            "141", "--full_finetune", "--output_dir", str(tmp_path / "o")]  # fmt: skip
    assert train_flux_cp.main(argv) == 0
    out = capsys.readouterr().out
    assert "suggestion: --cp_size" in out, out
    assert not (tmp_path / "o").exists(), "--plan must not start a run"


# --- --plan on the command line: offline for the known ids, one line for the rest, printed once ---------------


def _offline(monkeypatch, tmp_path):
    """No network and an empty HF cache, as on a fresh machine without access to the Hub."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("RANK", raising=False)


@pytest.mark.parametrize("model", ["FLUX.1-dev", "FLUX.1-schnell", "FLUX.1-Kontext-dev"])
def test_plan_works_offline_for_the_known_flux1_ids(model, tmp_path, monkeypatch, capsys):
    import train_flux_cp

    model_id = f"black-forest-labs/{model}"
    _offline(monkeypatch, tmp_path)
    argv = ["--plan", "--pretrained_model_name_or_path", model_id, "--resolution", "2048", "--gpu_memory_gib", "141"]
    assert train_flux_cp.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"plan: {model_id} (built-in config), 2048 px") and "suggestion: --cp_size" in out, out


def test_the_known_configs_are_flux1_dev_s_and_schnell_s_lacks_only_the_guidance_embedding():
    from diffusers import FluxTransformer2DModel

    from flux_cp.known_models import known_model

    dev, schnell = known_model("black-forest-labs/FLUX.1-dev"), known_model("Black-Forest-Labs/flux.1-schnell")
    kontext = known_model("black-forest-labs/FLUX.1-Kontext-dev")
    assert dev.transformer == FLUX1_DEV_TRANSFORMER and kontext.transformer == FLUX1_DEV_TRANSFORMER
    assert schnell.transformer == {**FLUX1_DEV_TRANSFORMER, "guidance_embeds": False}
    assert (dev.pipeline, schnell.pipeline, kontext.pipeline) == ("FluxPipeline", "FluxPipeline", "FluxKontextPipeline")
    with torch.device("meta"):
        embedder = FluxTransformer2DModel(**dev.transformer).time_text_embed.guidance_embedder
    counts = [plan.count_parameters(m.transformer, None, [])[0] for m in (dev, schnell)]
    assert counts[0] - counts[1] == sum(p.numel() for p in embedder.parameters()) > 0


def test_a_cached_config_comes_first_and_an_unknown_id_offline_is_one_line(tmp_path, monkeypatch):
    from flux_cp.errors import UsageError

    _offline(monkeypatch, tmp_path)
    # the layout huggingface_hub's cache has: models--owner--name/{refs/main, snapshots/<commit>/...}
    repo = tmp_path / "hf-cache" / "models--someone--flux-finetune"
    (repo / "snapshots" / "abc123" / "transformer").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    config = {**FLUX1_DEV_TRANSFORMER, "num_layers": 5}
    (repo / "snapshots" / "abc123" / "transformer" / "config.json").write_text(json.dumps(config))
    got, source = plan.transformer_config("someone/flux-finetune")
    assert got["num_layers"] == 5 and source == "someone/flux-finetune (local HF cache)"
    with pytest.raises(UsageError) as e:
        plan.transformer_config("someone/not-cached")
    assert str(e.value).startswith(
        "--pretrained_model_name_or_path someone/not-cached: not a local folder, and its transformer/config.json is "
        "not in the local HF cache (HF_HUB_OFFLINE is set): pass the model's folder, or a model known offline "
        "(black-forest-labs/FLUX.1-dev, "
    ) and "\n" not in str(e.value)


def test_the_plan_reads_a_hub_config_from_the_download_cache_that_cache_dir_names(tmp_path, monkeypatch):
    """--cache_dir is where a diffusers user's models are: --plan looks there, offline too."""
    from flux_cp.config import parse_config
    from flux_cp.errors import UsageError

    _offline(monkeypatch, tmp_path)
    repo = tmp_path / "downloads" / "models--someone--flux-finetune"
    (repo / "snapshots" / "abc123" / "transformer").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    config = {**FLUX1_DEV_TRANSFORMER, "num_layers": 3}
    (repo / "snapshots" / "abc123" / "transformer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="is not in the local HF cache"):  # not in the default cache
        plan.transformer_config("someone/flux-finetune")
    got, _ = plan.transformer_config("someone/flux-finetune", cache_dir=str(tmp_path / "downloads"))
    assert got["num_layers"] == 3
    cfg = parse_config(["--plan", "--pretrained_model_name_or_path", "someone/flux-finetune", "--cache_dir",
                        str(tmp_path / "downloads")])  # fmt: skip
    plan.print_plan(cfg)  # reads the config from there (else: the one-line error above)


def test_an_unreachable_hub_is_one_line_after_one_attempt(tmp_path, monkeypatch):
    """Not offline, but nothing listens at the endpoint: one attempt, no retries (hf_hub_download alone retries for
    about 30 s), and one line."""
    import time

    import huggingface_hub.constants

    from flux_cp.errors import UsageError

    _offline(monkeypatch, tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(UsageError) as e:
        plan.transformer_config("someone/not-cached")
    assert time.monotonic() - start < 5
    message = str(e.value)
    assert (
        message.startswith(
            "--pretrained_model_name_or_path someone/not-cached: not a local folder or in the local HF cache, and "
            "transformer/config.json could not be read from the Hugging Face Hub ("
        )
        and "\n" not in message
    ), message


def test_plan_prints_on_rank_0_only(tmp_path, monkeypatch, capsys):
    import train_flux_cp

    _offline(monkeypatch, tmp_path)
    argv = ["--plan", "--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-dev"]
    monkeypatch.setenv("RANK", "1")
    assert train_flux_cp.main(argv) == 0
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    assert train_flux_cp.main(argv) == 0
    assert capsys.readouterr().out.count("plan: ") == 1


@pytest.mark.e2e
def test_plan_under_accelerate_launch_prints_once(tmp_path):
    from tests.launch import ok, train

    r = ok(train(2, "--plan", "--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-dev", "--cp_size", "2",
                 "--output_dir", str(tmp_path / "o")))  # fmt: skip
    assert r.stdout.count("plan: black-forest-labs/FLUX.1-dev (built-in config)") == 1, r.stdout
    assert r.stdout.count("suggestion: ") == 1 and not (tmp_path / "o").exists()
