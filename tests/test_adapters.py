"""`--adapter` (flux_cp.model.adapters): DoRA and LoKr files load where the model card says, with the trained model's
output (diffusers; ComfyUI's LoKr rules), their flags and formats, FSDP2 and a quantized base, the planner's counts,
the run identity and the card. Training under CP: tests/test_train_adapters.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flux_cp.config.parser import parse_config
from flux_cp.families import FLUX1, FLUX2, of_model
from flux_cp.model import adapters
from flux_cp.plan.counts import parameter_counts
from flux_cp.shape.build import resolved
from tests.launch import comfy_apply, comfy_flux2_key_map, comfy_flux2_weights, comfy_lokr_diff, comfy_lora_prefixes

FAMILIES = ["flux1", "flux2"]


def _cfg(family: str, *argv: str, config: dict | None = None):
    """The flags as the trainer holds them once the model is known (the family's default layers)."""
    return resolved(parse_config(list(argv)), FLUX1 if family == "flux1" else FLUX2, False, config)


def _pipeline(family: str):
    from flux_cp.families.flux1.tiny import build_tiny_pipeline
    from flux_cp.families.flux2.tiny import build_tiny_flux2_pipeline

    pipe = build_tiny_pipeline() if family == "flux1" else build_tiny_flux2_pipeline()
    pipe.transformer.eval()
    return pipe


def _inputs(family: str) -> dict:
    from tests.test_precision import _inputs as inputs

    return inputs(family)


def _trained(transformer, cfg) -> dict[str, torch.Tensor]:
    """The adapters of `cfg.lora` as the trainer adds them (flux_cp.model.loading.prepare_trainable), every trainable
    weight moved off its start (as after training: LoRA's B and LoKr's w1 start at zero); the trainable state."""
    from flux_cp.model.loading import prepare_trainable, trainable_parameters

    prepare_trainable(transformer, cfg.lora, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in trainable_parameters(transformer):
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return {n: p.detach().clone() for n, p in trainable_parameters(transformer)}


def _saved(transformer, cfg, state, folder) -> dict[str, torch.Tensor]:
    from flux_cp.model.lora import save_lora

    return load_file(save_lora(transformer, state, str(folder), cfg.lora, of_model(transformer)))


# --- files: diffusers and ComfyUI load what was trained -------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("adapter, alpha", [("dora", 4), ("dora", 8), ("lokr", 8)])
def test_the_file_loads_with_the_cards_line_into_the_pipeline_as_the_trained_model(tmp_path, family, adapter, alpha):
    """The card snippet's load line (`load_lora_weights`; a LoKr: the transformer's `load_lora_adapter`) puts the
    written DoRA / LoKr into a fresh pipeline whose transformer then computes what the trained one does: DoRA with
    alpha keys (FLUX.1, alpha != rank), with its scale in lora_B (FLUX.2) and at scale 1; LoKr with its scale in w1."""
    trained = _pipeline(family).transformer
    cfg = _cfg(family, "--adapter", adapter, "--rank", "4", "--lora_alpha", str(alpha), config=dict(trained.config))
    sd = _saved(trained, cfg, _trained(trained, cfg), tmp_path)
    if adapter == "dora":
        assert any(k.endswith(".lora_magnitude_vector") for k in sd)
    else:
        assert all(".lokr_w" in k for k in sd) and not any(k.endswith(".alpha") for k in sd)
    inputs = _inputs(family)
    with torch.no_grad():
        expected = trained(**inputs).sample
        pipe = _pipeline(family)
        base = pipe.transformer(**inputs).sample
        exec(adapters.load_line(adapter, repr(str(tmp_path)), "pytorch_lora_weights.safetensors"), {"pipe": pipe})
        got = pipe.transformer(**inputs).sample
    scale = expected.abs().max()
    assert (base - expected).abs().max() / scale > 1e-3, "the adapter should change the output"
    assert (got - expected).abs().max() / scale < 1e-6
    kind = "lokr" if adapter == "lokr" else "lora"
    assert type(next(iter(pipe.transformer.peft_config.values()))).__name__.lower().startswith(kind)


def _lokr_model(family: str):
    from flux_cp.families.flux1.tiny import tiny_transformer
    from flux_cp.families.flux2.tiny import tiny_flux2_transformer

    return (tiny_transformer if family == "flux1" else tiny_flux2_transformer)(seed=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_lokr_file_gives_peft_s_update_by_comfyui_s_rules(tmp_path, family):
    """Every key of the LoKr file is under a module name ComfyUI maps for the family (FLUX.1: `transformer.<layer>`;
    FLUX.2: its full key map, q/k/v as rows of the fused linear) and is one its LoKr loader reads; the update its
    formula builds from them (kron(w1, w2) at scale 1: no alpha keys) is peft's update of the trained layer,
    alpha / rank included (rank 4, alpha 8; whole and factored w2 both)."""
    from peft.tuners.lokr.layer import LoKrLayer

    model = _lokr_model(family)
    cfg = _cfg(family, "--adapter", "lokr", "--rank", "4", "--lora_alpha", "8", config=dict(model.config))
    sd = _saved(model, cfg, _trained(model, cfg), tmp_path)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoKrLayer)}
    config = dict(model.config)
    if family == "flux1":
        prefixes = comfy_lora_prefixes(config["num_layers"], config["num_single_layers"])
    else:
        prefixes = set(comfy_flux2_key_map(config))
    by_module: dict[str, dict] = {}
    for key, value in sd.items():
        prefix, part = key.rsplit(".", 1)
        by_module.setdefault(prefix, {})[part] = value
    assert set(by_module) == {f"transformer.{n}" for n in layers} and set(by_module) <= prefixes
    parts = {p for tensors in by_module.values() for p in tensors}
    assert parts == {"lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b"}, parts
    with torch.no_grad():
        for name, layer in layers.items():
            want = layer.get_delta_weight("default").double()
            got = comfy_lokr_diff(by_module[f"transformer.{name}"]).reshape(want.shape)
            assert (got - want).abs().max() <= 1e-6 * want.abs().max(), name
    if family == "flux2":  # ComfyUI's FLUX.2 model: every key loaded and applied to a weight it has
        bfl = {k: torch.zeros(shape) for k, shape in comfy_flux2_weights(config).items()}
        not_loaded, unreached, patched = comfy_apply(sd, comfy_flux2_key_map(config), bfl)
        assert not_loaded == unreached == set() and any(patched[k].any() for k in patched)


def test_lora_files_and_their_keys_are_unchanged_by_the_adapter_machinery(tmp_path):
    """--adapter lora (the default) writes what it wrote before: LoRA keys and alpha keys, no other."""
    model = _lokr_model("flux1")
    cfg = _cfg("flux1", "--rank", "4", "--lora_alpha", "8")
    assert cfg.lora.adapter == "lora"
    sd = _saved(model, cfg, _trained(model, cfg), tmp_path)
    assert {k.rsplit(".", 1)[1] if k.endswith(".alpha") else k.rsplit(".", 2)[1] for k in sd} == {
        "lora_A",
        "lora_B",
        "alpha",
    }


# --- flags ----------------------------------------------------------------------------------------------------


def test_the_flag_s_default_choices_and_what_it_refuses():
    from flux_cp.errors import UsageError

    assert parse_config([]).lora.adapter == "lora"
    assert [parse_config(["--adapter", a]).lora.adapter for a in ("dora", "lokr")] == ["dora", "lokr"]
    with pytest.raises(UsageError, match="invalid choice: 'loha'"):
        parse_config(["--adapter", "loha"])
    for argv, line in (
        (["--adapter", "dora", "--full_finetune"], "--adapter dora trains DoRA adapters; --full_finetune"),
        (["--adapter", "lokr", "--lora_format", "kohya"], "--adapter lokr with --lora_format kohya: "),
        (["--adapter", "dora", "--lora_format", "kohya"], "--adapter dora with --lora_format kohya: "),
        (["--adapter", "lokr", "--train_text_encoder"], "--adapter lokr with --train_text_encoder: "),
        (["--adapter", "lokr", "--lora_dropout", "0.1"], "--lora_dropout 0.1 with --adapter lokr: "),
        (["--adapter", "lokr", "--base_precision", "nf4"], "--adapter lokr with --base_precision nf4: "),
    ):
        with pytest.raises(UsageError) as e:
            parse_config(argv)
        assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)
    # what DoRA and LoRA take
    parse_config(["--adapter", "dora", "--lora_dropout", "0.1", "--base_precision", "nf4", "--plan"])
    parse_config(["--adapter", "lora", "--full_finetune"])


# --- training machinery: FSDP2, a quantized base --------------------------------------------------------------


def _sharded_gradients(adapter: str, shard: bool) -> dict[str, torch.Tensor]:
    """Gradients of the adapters of the tiny FLUX.1 transformer (cp off), each block and the root sharded by FSDP2
    as accelerate's FSDP2 wraps them (gathered to full tensors), or none sharded."""
    from torch.distributed.fsdp import fully_shard

    from flux_cp.families.flux1.tiny import tiny_transformer
    from flux_cp.model.blocks import transformer_blocks
    from flux_cp.model.loading import prepare_trainable

    model = tiny_transformer(seed=0)
    cfg = _cfg("flux1", "--adapter", adapter, "--rank", "4", "--lora_alpha", "8")
    prepare_trainable(model, cfg.lora, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    if shard:
        for block in transformer_blocks(model):
            fully_shard(block)
        fully_shard(model)
    model(**_inputs("flux1")).sample.square().mean().backward()
    full = (lambda t: t.full_tensor()) if shard else (lambda t: t)
    return {n: full(p.grad) for n, p in model.named_parameters() if p.requires_grad}


def _fsdp2_errors(rank: int, world: int) -> dict[str, tuple[int, float]]:
    out = {}
    for adapter in ("dora", "lokr"):
        plain, sharded = _sharded_gradients(adapter, False), _sharded_gradients(adapter, True)
        assert plain.keys() == sharded.keys()
        worst = max(((sharded[n] - plain[n]).abs().max() / plain[n].abs().max()).item() for n in plain)
        out[adapter] = (len(plain), worst)
    return out


@pytest.mark.distributed
def test_dora_and_lokr_under_fsdp2_give_the_unsharded_gradients():
    """FSDP2 shards the base weights and the adapters; DoRA reads the base weight (its norm per output feature) and
    LoKr builds its update inside the block's forward, where FSDP2 has gathered both: the same gradients."""
    from tests import distributed

    for adapter, (n, error) in distributed.run(_fsdp2_errors, 2)[0].items():
        assert n > 8 and error < 1e-5, (adapter, n, error)


def _quantized(precision: str) -> list:
    from tests.test_precision import _precisions

    return _precisions([precision])


def _adapter_on_quantized() -> list:
    """DoRA and LoKr on each quantized base (its skip mark kept), but LoKr on nf4: refused at start
    (test_the_flag_s_default_choices_and_what_it_refuses)."""
    bases = [*_quantized("int8"), *_quantized("fp8"), *_quantized("nf4")]
    return [
        pytest.param(adapter, base.values[0], marks=base.marks)
        for adapter in ("dora", "lokr")
        for base in bases
        if not (adapter == "lokr" and base.values[0] == "nf4")
    ]


@pytest.mark.parametrize(("adapter", "precision"), _adapter_on_quantized())
def test_on_a_quantized_base_only_the_adapters_get_gradients(adapter, precision):
    """--base_precision int8 / fp8 (torchao; nf4 where bitsandbytes is installed, DoRA only): peft's DoRA layer
    reads the dequantized base weight for its norm, LoKr adds its update beside the quantized layer; every adapter
    weight gets a gradient and nothing else does."""
    from flux_cp.model.precision import is_quantized, quantize_base

    model = _lokr_model("flux1")
    model.requires_grad_(False)
    quantize_base(model, precision)
    _trained(model, _cfg("flux1", "--adapter", adapter, "--rank", "4", "--lora_alpha", "8"))
    assert is_quantized(model.transformer_blocks[0].attn.to_q.get_base_layer().weight)
    model(**_inputs("flux1")).sample.float().square().mean().backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in model.named_parameters() if adapters.is_adapter_parameter(n)}
    assert {n for n, p in model.named_parameters() if p.grad is not None} == trained
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in trained)


# --- the planner, the run identity, the card ------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("adapter", ["lora", "dora", "lokr"])
def test_the_planner_counts_the_trainable_parameters_the_trainer_adds(family, adapter):
    from flux_cp.model.loading import trainable_parameters

    model = _lokr_model(family)
    config = dict(model.config)
    cfg = _cfg(family, "--adapter", adapter, "--rank", "4", config=config)
    _trained(model, cfg)
    params = trainable_parameters(model)
    counts = parameter_counts(of_model(model), config, 4, list(cfg.lora.lora_layers), adapter)
    assert (counts.trainable, counts.trainable_tensors) == (sum(p.numel() for _, p in params), len(params))


def test_the_planner_s_counts_at_flux1_dev_size():
    """FLUX.1-dev, rank 16, the default layers: DoRA is LoRA plus one magnitude per output feature of each layer;
    LoKr's factors (48 x 48 and 64 x 16 + 16 x 64 on a 3072-wide layer) are a small part of LoRA's."""
    from flux_cp.families.flux1 import DEFAULT_TARGETS
    from flux_cp.families.flux1.kohya import lora_modules
    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER
    from flux_cp.plan import memory as plan

    dev, layers = dict(FLUX1_DEV_TRANSFORMER), list(DEFAULT_TARGETS)
    lora, dora, lokr = (plan.count_parameters(dev, 16, layers, a)[1] for a in ("lora", "dora", "lokr"))
    with torch.device("meta"):
        model = FLUX1.transformer_class().from_config(dev)
    outputs = sum(model.get_submodule(m).out_features for m in lora_modules(dev, layers))
    assert dora == lora + outputs
    assert 0 < lokr < lora / 10


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_keeps_are_what_autograd_keeps_beyond_lora(family):
    """plan_data.json's `adapter_keeps`: the units a block keeps with DoRA or LoKr on the family's default layers
    (tests/saved_activations.py, eager, bf16 autocast as the trainer runs) less LoRA's (`block_keeps`, recounted by
    tests/test_plan.py; both rounded to 0.1)."""
    from flux_cp.families.flux1 import DEFAULT_TARGETS
    from flux_cp.plan import memory as plan
    from tests.saved_activations import eager_units, flux2_targets

    targets = DEFAULT_TARGETS if family == "flux1" else flux2_targets(2)
    name = "FluxTransformer2DModel" if family == "flux1" else "Flux2Transformer2DModel"
    keeps, lora = plan.ADAPTER_KEEPS[name], plan.BLOCK_KEEPS[name]["eager"]
    for adapter in ("dora", "lokr"):
        for kind, units in eager_units(family, targets, adapter).items():
            assert abs(units - lora[kind] - keeps[adapter][kind]) < 0.15, (adapter, kind, units - lora[kind])
    assert min(keeps["dora"].values()) > 5, "DoRA keeps its layers' outputs: the check would be blind"


def test_a_lokr_layer_keeps_its_update_weight_for_the_backward():
    """What `adapters.kept_bytes` rests on: under bf16 autocast peft's LoKr layer multiplies the input by its whole
    update weight, which autograd keeps in bf16 (2 bytes per weight of the layer); per token it keeps no more than a
    LoRA layer (`adapter_keeps` 0)."""
    from peft import LoraConfig, inject_adapter_in_model

    tokens, features = 64, (256, 512)

    def saved(config) -> tuple[int, int]:
        """(bytes of saved tensors with a token dimension, of saved tensors the size of the layer's weight)."""
        model = torch.nn.ModuleDict({"net": torch.nn.Sequential(torch.nn.Linear(*features))})
        model = model.to(torch.bfloat16).requires_grad_(False)
        inject_adapter_in_model(config, model)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        x = torch.randn(tokens, features[0], dtype=torch.bfloat16, requires_grad=True)
        owned = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
        new = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in owned:
                new[t.untyped_storage().data_ptr()] = t
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            model["net"](x).float().sum().backward()
        per_token = sum(t.untyped_storage().nbytes() for t in new.values() if tokens in t.shape)
        weights = sum(t.untyped_storage().nbytes() for t in new.values() if t.numel() == features[0] * features[1])
        return per_token, weights

    targets = ["net.0"]
    lora, lokr = saved(LoraConfig(r=2, target_modules=targets)), saved(adapters.peft_config("lokr", 2, 2, 0.0, targets))
    assert 0 < lokr[0] <= lora[0] and lora[1] == 0  # per token: LoRA's input copy, not its r-wide intermediate
    assert lokr[1] == adapters.kept_bytes("lokr", (features,), 2) == features[0] * features[1] * 2


def test_the_planner_adds_what_each_adapter_keeps():
    """FLUX.1-dev at 1024 px, rank 16: DoRA's blocks keep `adapter_keeps` units more (a checkpointed block only while
    it is recomputed, the last one), LoKr's blocks their update weights in bf16 (the same rule as a torchao base's
    dequantized weights); both add one layer's moment in its forward."""
    from flux_cp.families.flux1 import DEFAULT_TARGETS
    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER
    from flux_cp.plan import memory as plan

    dev, layers = dict(FLUX1_DEV_TRANSFORMER), list(DEFAULT_TARGETS)

    def activations(adapter: str, n: int) -> float:
        return plan.estimate(
            dev, tokens=4608, batch=1, lora_rank=16, lora_layers=layers, world=1, cp=1, checkpointed=n, adapter=adapter
        ).activations

    shapes = adapters.adapted_layers(FLUX1, dev, layers)
    assert len(shapes) == 58 and shapes[-1] == () and all(shapes[:57])  # 57 blocks, nothing adapted outside them
    unit, extra = 4608 * 3072 * 2, plan.ADAPTER_KEEPS["FluxTransformer2DModel"]["dora"]
    transient = {a: adapters.transient_bytes(a, sum(shapes, ()), 2) for a in ("dora", "lokr")}
    assert transient["dora"] == 12288**2 * 6 + 2 * 12288 * 3072 * 2  # ff.net.2's identity, fp32 and bf16
    assert activations("dora", 0) - activations("lora", 0) == pytest.approx(
        unit * (19 * extra["double"] + 38 * extra["single"]) + transient["dora"]
    )
    assert activations("dora", 57) - activations("lora", 57) == pytest.approx(
        unit * extra["single"] + transient["dora"]
    )
    kept = [adapters.kept_bytes("lokr", b, 2) for b in shapes[:57]]
    for n in (0, 19, 57):  # FLUX.1 checkpoints from the front; the last block is held while it is recomputed
        held = sum(kept[n:]) + (kept[-1] if n == 57 else 0)
        assert activations("lokr", n) - activations("lora", n) == pytest.approx(held + transient["lokr"])


def test_the_adapter_is_in_the_run_identity_and_a_resume_with_another_is_refused(tmp_path):
    from flux_cp.errors import UsageError
    from flux_cp.outputs import resume

    identity = {a: resume.run_identity(_cfg("flux1", "--adapter", a), 2, "abc", None) for a in ("lora", "lokr")}
    meta = json.loads(json.dumps({"run": identity["lokr"]}))
    resume.check_compatible(meta, identity["lokr"], tmp_path)
    with pytest.raises(UsageError, match=r"incompatible run \(adapter: checkpoint 'lokr', now 'lora'\)"):
        resume.check_compatible(meta, identity["lora"], tmp_path)
    # a checkpoint written before the adapter was recorded holds a LoRA (full fine-tuning records lora too)
    before = {"run": {k: v for k, v in identity["lora"].items() if k != "adapter"}}
    resume.check_compatible(before, identity["lora"], tmp_path)
    full = resume.run_identity(_cfg("flux1", "--full_finetune"), 2, "abc", None)
    resume.check_compatible({"run": {k: v for k, v in full.items() if k != "adapter"}}, full, tmp_path)


@pytest.mark.parametrize("adapter", ["dora", "lokr"])
def test_the_card_and_the_summary_name_the_adapter_and_how_it_loads(tmp_path, adapter):
    from flux_cp.outputs.card import write_model_card
    from flux_cp.outputs.summary import outputs

    out = tmp_path / "run"
    out.mkdir()
    (out / "pytorch_lora_weights.safetensors").write_bytes(b"")
    cfg = _cfg("flux1", "--adapter", adapter, "--output_dir", str(out))
    text = write_model_card(out, cfg).read_text()
    what = adapters.label(adapter)
    assert f"# FLUX.1 {what} - run" in text and f"\n- {adapter}\n" in text
    assert f"| training | {what} rank 16, alpha 16" in text and f"| adapter | {what}: " in text
    loads = "pipe.transformer.load_lora_adapter(" if adapter == "lokr" else "pipe.load_lora_weights("
    assert loads in text
    comfy = text.split("## Use it in ComfyUI", 1)[1]
    assert ("lokr_w1" in comfy) if adapter == "lokr" else ("without its magnitudes" in comfy)
    assert ("pytorch_lora_weights.safetensors", f"the {what} (diffusers format)") in outputs(cfg)
