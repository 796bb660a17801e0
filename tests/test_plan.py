"""The memory planner against what autograd saves (CPU) and against peaks measured on H200s."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig

import cp
from flux_cp import plan
from flux_cp.flow import image_ids, pack_latents, text_ids
from flux_cp.lora import ATTENTION_TARGETS, DEFAULT_TARGETS
from flux_cp.tiny import FLUX1_DEV_TRANSFORMER, tiny_transformer

ROOT = Path(__file__).resolve().parent.parent
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
    rows = []
    for name in ("2026-11-29-h200x4", "2026-11-29-h200x2"):
        results = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
        rows += [r for r in results["model"] if r["impl"] == "ours" and r.get("peak_mem_gib") and not r.get("error")]
    kinds = {(r["train"], r["gpus"] > 1 and r.get("weights", "fsdp2") == "fsdp2") for r in rows}
    assert kinds == {("lora", False), ("lora", True), ("full", True)}, kinds  # replicated, sharded, full FT
    for r in rows:
        e = plan.estimate(
            dict(FLUX1_DEV_TRANSFORMER),
            tokens=(r["res"] // 16) ** 2 + 512,
            batch=r["samples_per_step"] // r["dp"],
            lora_rank=16 if r["train"] == "lora" else None,
            lora_layers=ATTN_LORA,
            world=r["gpus"],
            cp=r["cp"],
            checkpointing=True,
            fsdp=r["gpus"] > 1 and r.get("weights", "fsdp2") == "fsdp2",
        )
        predicted = e.total / plan.GIB
        assert abs(predicted - r["peak_mem_gib"]) / r["peak_mem_gib"] < 0.15, (r["res"], r["cp"], predicted, r)


def test_estimates_of_compiled_trainer_runs_are_within_10_percent_of_their_h200_peaks():
    """The trainer's own peaks (metrics.jsonl) with compiled blocks that keep the attention's outputs, and with
    --recompute_attention; one GPU and cp=2 (Ulysses), 1024 to 4096 px, default LoRA layers, DDP."""
    from types import SimpleNamespace

    layers = list(DEFAULT_TARGETS)  # FLUX.1's default --lora_layers
    rows = []
    for name in ("2026-11-30-h200x2-saved-attention", "2026-11-30-h200x2-cuda-graphs"):
        for path in (ROOT / "benchmarks" / "results" / name).glob("trainer_*.json"):
            rows += [r for r in json.loads(path.read_text())["runs"] if "error" not in r]
    assert len(rows) >= 10 and any("--recompute_attention" in r["extra"] for r in rows)
    for r in rows:
        flags = r["extra"]
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
        assert abs(predicted - r["peak_mem_gib"]) / r["peak_mem_gib"] < 0.10, (r["name"], predicted, r["peak_mem_gib"])


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
