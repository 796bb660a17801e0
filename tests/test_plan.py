"""The memory planner against what autograd saves (CPU) and against peaks measured on H200s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flux_cp.families.flux1 import ATTENTION_TARGETS, DEFAULT_TARGETS
from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER
from flux_cp.plan import memory as plan
from flux_cp.plan import report
from flux_cp.shape.build import transformer_config_offline

ATTN_LORA = list(ATTENTION_TARGETS)


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_block_keeps_are_what_autograd_and_the_compiled_graphs_keep(family):
    """plan_data.json's `block_keeps`: eager, what autograd saves; compiled, what the partitioner Inductor uses passes
    from each block's forward graph to its backward (tests/saved_activations.py counts both on CPU)."""
    from flux_cp.families.flux1 import DEFAULT_TARGETS
    from tests.saved_activations import compiled_units, eager_units, flux2_targets

    targets = DEFAULT_TARGETS if family == "flux1" else flux2_targets(2)
    keeps = plan.BLOCK_KEEPS["FluxTransformer2DModel" if family == "flux1" else "Flux2Transformer2DModel"]
    for mode, counted in (("eager", eager_units(family, targets)), ("compiled", compiled_units(family, targets))):
        for kind, units in counted.items():
            assert abs(units - keeps[mode][kind]) < 0.1, (mode, kind, units)
    # Inductor keeps less than autograd: it recomputes cheap intermediates in the backward instead.
    assert all(keeps["compiled"][k] < keeps["eager"][k] for k in ("double", "single")), keeps


def test_a_compiled_checkpointed_block_keeps_its_input_and_its_attention_output():
    """`saved_attention_units["local"]`: 1 unit of attention output (and its log-sum-exp) beside the block's input."""
    from flux_cp.families.flux1 import DEFAULT_TARGETS
    from tests.saved_activations import compiled_units

    for kind, units in compiled_units("flux1", DEFAULT_TARGETS, checkpointed=True).items():
        assert abs(units - (1 + plan.SAVED_ATTENTION_UNITS["local"])) < 0.05, (kind, units)


def test_partial_checkpointing_takes_the_end_whose_blocks_keep_the_most():
    flux1 = (("double", 19), ("single", 38))
    flux2 = (("double", 8), ("single", 48))
    for compiled in (False, True):
        keeps1 = plan.BLOCK_KEEPS["FluxTransformer2DModel"]["compiled" if compiled else "eager"]
        keeps2 = plan.BLOCK_KEEPS["Flux2Transformer2DModel"]["compiled" if compiled else "eager"]
        assert not plan.checkpoint_from_end(flux1, keeps1) and plan.checkpoint_from_end(flux2, keeps2)
    assert list(plan.checkpointed_indices(57, 3, False)) == [0, 1, 2]
    assert list(plan.checkpointed_indices(56, 3, True)) == [53, 54, 55]
    assert list(plan.checkpointed_indices(56, 99, True)) == list(range(56))
    keeps = plan.BLOCK_KEEPS["FluxTransformer2DModel"]["compiled"]
    units = [plan.activation_units(flux1, keeps, n, 1.0) for n in range(58)]
    # each block checkpointed from the front lowers the peak by what it kept less its input and attention output
    assert all(abs(units[n] - units[n + 1] - (keeps["double"] - 2)) < 1e-9 for n in range(19))
    assert all(abs(units[n] - units[n + 1] - (keeps["single"] - 2)) < 1e-9 for n in range(19, 56))
    assert units[0] == pytest.approx(19 * keeps["double"] + 38 * keeps["single"] + plan.BACKWARD_START_UNITS)
    assert units[57] == pytest.approx(57 * 2 + plan.BLOCK_PEAK_UNITS)


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
    --recompute_attention; one GPU and cp=2 (Ulysses; a rank with loopback peers for the runs without
    checkpointing), 1024 to 4096 px, default LoRA layers, DDP. The saved attention's units were fitted to the
    checkpointed peaks: this checks that one pair of constants fits all of them. Without checkpointing, the counted
    `block_keeps` and one fitted constant (`backward_start_units`) predict the peaks they were not fitted to."""
    from types import SimpleNamespace

    layers = list(DEFAULT_TARGETS)  # FLUX.1's default --lora_layers
    rows = plan.DATA["measured_peaks"]["trainer"]
    assert len(rows) >= 10 and any("--recompute_attention" in r["flags"] for r in rows)
    unchecked = [r for r in rows if "--gradient_checkpointing none" in r["flags"] and "fitted" not in r]
    assert len(unchecked) >= 2  # without checkpointing: one peak fitted, the others held out
    for r in rows:
        flags = r["flags"].split()
        train = SimpleNamespace(
            compile="on" if "--compile" in flags else "off",
            compile_mode="reduce-overhead" if "--compile_mode" in flags else None,
            recompute_attention="--recompute_attention" in flags,
        )
        res = int(flags[flags.index("--resolution") + 1])
        cp = int(flags[flags.index("--cp_size") + 1]) if "--cp_size" in flags else 1
        e = plan.estimate(
            dict(FLUX1_DEV_TRANSFORMER),
            tokens=(res // 16) ** 2 + 512,
            batch=1,
            lora_rank=16,
            lora_layers=layers,
            world=cp,
            cp=cp,
            checkpointing="--gradient_checkpointing none" not in r["flags"],
            compiled=True,
            fsdp=False,
            saved_attention=plan.saved_attention_units(train, "ulysses", cp),
        )
        predicted = e.total / plan.GIB
        assert abs(predicted - r["peak_gib"]) / r["peak_gib"] < 0.10, (r["name"], predicted, r["peak_gib"])


def test_plan_flag_prints_a_table_and_a_recommendation_without_training(tmp_path, capsys):
    """`train_flux_cp.py --plan` (its entry point, in this process): a table and a recommendation, no run."""
    import train_flux_cp
    from flux_cp.families.flux1.tiny import write_flux1_dev_shapes

    folder = write_flux1_dev_shapes(tmp_path / "dev")
    argv = ["--plan", "--pretrained_model_name_or_path", str(folder), "--resolution", "4096", "--gpu_memory_gib",
            "141", "--full_finetune", "--output_dir", str(tmp_path / "o")]  # fmt: skip
    assert train_flux_cp.main(argv) == 0
    out = capsys.readouterr().out
    assert "recommended for 1 GPU of 141 GiB" in out and "nothing fits; use more GPUs" in out, out
    assert "settings compared" in out and not (tmp_path / "o").exists(), "--plan must not start a run"


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
    assert out.startswith(f"plan: {model_id} (built-in config), 2048 px") and "recommended for 1 GPU" in out, out


def test_the_known_configs_are_flux1_dev_s_and_schnell_s_lacks_only_the_guidance_embedding():
    from diffusers import FluxTransformer2DModel

    from flux_cp.families import known_model

    dev, schnell = known_model("black-forest-labs/FLUX.1-dev"), known_model("Black-Forest-Labs/flux.1-schnell")
    kontext = known_model("black-forest-labs/FLUX.1-Kontext-dev")
    assert dev.transformer == FLUX1_DEV_TRANSFORMER and kontext.transformer == FLUX1_DEV_TRANSFORMER
    assert schnell.transformer == {**FLUX1_DEV_TRANSFORMER, "guidance_embeds": False}
    assert (dev.pipeline, schnell.pipeline, kontext.pipeline) == ("FluxPipeline", "FluxPipeline", "FluxKontextPipeline")
    with torch.device("meta"):
        embedder = FluxTransformer2DModel(**dev.transformer).time_text_embed.guidance_embedder
    counts = [plan.count_parameters(m.transformer, None, [])[0] for m in (dev, schnell)]
    assert counts[0] - counts[1] == sum(p.numel() for p in embedder.parameters()) > 0


def _cache_transformer_config(cache: Path, num_layers: int) -> None:
    """someone/flux-finetune's transformer/config.json in huggingface_hub's cache layout under `cache`:
    models--owner--name/{refs/main, snapshots/<commit>/...}."""
    repo = cache / "models--someone--flux-finetune"
    (repo / "snapshots" / "abc123" / "transformer").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    config = {**FLUX1_DEV_TRANSFORMER, "num_layers": num_layers}
    (repo / "snapshots" / "abc123" / "transformer" / "config.json").write_text(json.dumps(config))


def test_a_cached_config_comes_first_and_an_unknown_id_offline_is_one_line(tmp_path, monkeypatch):
    from flux_cp.errors import UsageError

    _offline(monkeypatch, tmp_path)
    _cache_transformer_config(tmp_path / "hf-cache", num_layers=5)
    got, source = transformer_config_offline("someone/flux-finetune")
    assert got["num_layers"] == 5 and source == "someone/flux-finetune (local HF cache)"
    with pytest.raises(UsageError) as e:
        transformer_config_offline("black-forest-labs/FLUX.2-dev")
    assert str(e.value).startswith(
        "--pretrained_model_name_or_path black-forest-labs/FLUX.2-dev: not a local folder, and its "
        "transformer/config.json is not in the local HF cache (HF_HUB_OFFLINE is set): pass the model's folder, a "
        "FLUX.1 model known offline (black-forest-labs/FLUX.1-dev, "
    ) and "\n" not in str(e.value)
    assert (
        "python -m flux_cp.tiny --preset flux1-dev-shapes --out DIR (FLUX.1; flux2-dev-shapes: FLUX.2 [dev]; "
        in str(e.value)
    )


def test_the_plan_reads_a_hub_config_from_the_download_cache_that_cache_dir_names(tmp_path, monkeypatch):
    """--cache_dir is where a diffusers user's models are: --plan looks there, offline too."""
    from flux_cp.config.parser import parse_config
    from flux_cp.errors import UsageError

    _offline(monkeypatch, tmp_path)
    _cache_transformer_config(tmp_path / "downloads", num_layers=3)
    with pytest.raises(UsageError, match="is not in the local HF cache"):  # not in the default cache
        transformer_config_offline("someone/flux-finetune")
    got, _ = transformer_config_offline("someone/flux-finetune", cache_dir=str(tmp_path / "downloads"))
    assert got["num_layers"] == 3
    cfg = parse_config(["--plan", "--pretrained_model_name_or_path", "someone/flux-finetune", "--cache_dir",
                        str(tmp_path / "downloads")])  # fmt: skip
    report.print_plan(cfg)  # reads the config from there (else: the one-line error above)


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
        transformer_config_offline("someone/not-cached")
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
def test_plan_under_accelerate_launch_prints_once_and_without_the_libraries_import_noise(tmp_path):
    """Two launched processes print one plan and write nothing. With torchao installed, transformers imports it in
    every process once a model class loads (--plan is the earliest such load): its messages about kernels for other
    GPUs, torch's about its enums and diffusers' about torchao checkpoints are left out (flux_cp/quiet.py, installed
    before train_flux_cp.py imports anything else), in each process."""
    from tests.launch import ok, train

    r = ok(train(2, "--plan", "--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-dev", "--cp_size", "2",
                 "--output_dir", str(tmp_path / "o")))  # fmt: skip
    assert r.stdout.count("plan: black-forest-labs/FLUX.1-dev (built-in config)") == 1, r.stdout
    assert r.stdout.count("recommended for ") == 1 and not (tmp_path / "o").exists()
    for noise in ("Failed to load", "is an Enum subclass", "Unable to import `torchao`"):
        assert noise not in r.stderr, r.stderr


def test_flux2_plans_count_its_own_blocks_width_and_weights():
    """FLUX.2 [dev]: 8 double and 48 single blocks 6144 wide; the planner asks the family for them and counts the
    weights of its own class (a stand-in family here: what the planner asks of one)."""
    from diffusers import Flux2Transformer2DModel

    from flux_cp.families.flux1 import Flux1
    from flux_cp.families.flux2.tiny import FLUX2_DEV_TRANSFORMER
    from tests.saved_activations import flux2_targets

    class Flux2Shapes(Flux1):
        name, transformer_class_name = "flux2-shapes", "Flux2Transformer2DModel"

        def transformer_class(self) -> type:
            return Flux2Transformer2DModel

    family, config = Flux2Shapes(), dict(FLUX2_DEV_TRANSFORMER)
    assert family.block_kinds(config) == (("double", 8), ("single", 48)) and family.hidden_size(config) == 6144
    tokens = 64**2 + 512

    def estimate(n: int) -> plan.Estimate:
        return plan.estimate(config, tokens=tokens, batch=1, lora_rank=16, lora_layers=list(flux2_targets(48)),
                             world=1, cp=1, checkpointed=n, compiled=True, fsdp=False, saved_attention=1.0,
                             family=family)  # fmt: skip

    none, one = estimate(0), estimate(1)
    assert 30e9 < none.weights / 2 < 33e9  # FLUX.2 [dev]: 32B parameters, bf16
    keeps = plan.BLOCK_KEEPS["Flux2Transformer2DModel"]["compiled"]
    unit = tokens * 6144 * 2
    start, recompute = plan.BACKWARD_START_UNITS, plan.BLOCK_PEAK_UNITS
    assert none.activations == pytest.approx(unit * (8 * keeps["double"] + 48 * keeps["single"] + start))
    # the last block (a single one) goes first, and recomputes at the start of the backward
    assert one.activations == pytest.approx(none.activations - unit * (keeps["single"] - 2 + start - recompute))
    chosen, fits = plan.choose_checkpointing(estimate, 80 * plan.GIB)
    assert fits and 0 < chosen.checkpointed < 56 and chosen.total <= 0.9 * 80 * plan.GIB
