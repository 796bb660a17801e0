"""--base_precision (flux_cp.model.precision): the frozen transformer's linears in fp8 or int8 (torchao) or nf4
(bitsandbytes) with LoRA through peft's layers for them: which weights are quantized and which train, the error
against the unquantized model, the planner's bytes against what is stored, the refusals, torch.compile, checkpoints,
the noise of the libraries, and the LoRA file. CP with a quantized base: tests/test_cp_precision.py."""

from __future__ import annotations

import copy
import importlib.util
import re
import sys

import pytest
import torch

from flux_cp.config.fields import PRECISIONS
from flux_cp.config.training import check_base_precision
from flux_cp.errors import UsageError
from flux_cp.extras import PACKAGES
from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER, tiny_transformer
from flux_cp.families.flux2.tiny import FLUX2_DEV_TRANSFORMER, tiny_flux2_transformer
from flux_cp.model.blocks import transformer_blocks
from flux_cp.model.precision import (
    QUANTIZED,
    base_bytes,
    check_installed,
    check_sharding,
    is_quantized,
    quantize_base,
    quantized_linears,
    stored_bytes,
)

AVAILABLE = {p: importlib.util.find_spec(PACKAGES[p][0]) is not None for p in QUANTIZED}


def _skip(precision: str):
    """Skipped where its package is missing (CI installs torchao only: bitsandbytes would be imported by peft in every
    test process)."""
    package = PACKAGES.get(precision, ("",))[0]
    return pytest.mark.skipif(not AVAILABLE.get(precision, True), reason=f"{package} is not installed (pip install "
                              "-e .[quant])")  # fmt: skip


def _precisions(names=QUANTIZED) -> list:
    return [pytest.param(p, marks=_skip(p)) for p in names]


FAMILIES = ["flux1", "flux2"]


def _family(name: str):
    from flux_cp.families import FLUX1, FLUX2

    return FLUX1 if name == "flux1" else FLUX2


def _model(family: str, normal: bool = False, **overrides) -> torch.nn.Module:
    """The tiny transformer of `family` (fp32); `normal`: every linear weight drawn from N(0, 1/in_features), as
    trained weights are distributed (the default init is uniform, which NF4's normal quantiles do not fit)."""
    model = (tiny_transformer if family == "flux1" else tiny_flux2_transformer)(seed=0, **overrides)
    if normal:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * m.in_features**-0.5)
    return model


def _inputs(family: str) -> dict:
    from flux_cp.families.flux1.tokens import image_ids, pack_latents, text_ids

    g = torch.Generator().manual_seed(7)
    if family == "flux1":
        return dict(hidden_states=pack_latents(torch.randn(2, 4, 8, 12, generator=g)),
                    encoder_hidden_states=torch.randn(2, 12, 32, generator=g),
                    pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.rand(2, generator=g),
                    guidance=torch.full((2,), 3.5), img_ids=image_ids(8, 12), txt_ids=text_ids(12))  # fmt: skip
    img = torch.cartesian_prod(torch.tensor([0]), torch.arange(4), torch.arange(6), torch.arange(1))
    txt = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(12))
    return dict(hidden_states=torch.randn(2, 24, 16, generator=g),
                encoder_hidden_states=torch.randn(2, 12, 48, generator=g), timestep=torch.rand(2, generator=g),
                guidance=torch.full((2,), 3.5), img_ids=img, txt_ids=txt)  # fmt: skip


def _lora_config(family: str, model: torch.nn.Module):
    from flux_cp.config.parser import parse_config
    from flux_cp.shape.build import resolved

    return resolved(parse_config(["--rank", "4"]), _family(family), False, dict(model.config)).lora


def _trained(family: str, precision: str, **overrides) -> torch.nn.Module:
    """The tiny transformer as the trainer prepares it: quantized, then LoRA (flux_cp.model.loading.prepare_trainable),
    with lora_B drawn non-zero so that the adapters change the output."""
    from flux_cp.model.loading import prepare_trainable

    model = _model(family, **overrides)
    quantize_base(model, precision)
    prepare_trainable(model, _lora_config(family, model), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


# --- what is quantized, what trains --------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", _precisions())
def test_the_blocks_linears_are_quantized_and_only_lora_weights_get_gradients(family, precision):
    plain = _model(family)
    model = _trained(family, precision)
    names = set(quantized_linears(plain))
    modules = dict(model.named_modules())
    # Every linear of the blocks (and FLUX.2's shared modulation) holds a quantized weight; the rest is untouched.
    for name, m in plain.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        held = modules[name]
        weight = held.get_base_layer().weight if hasattr(held, "get_base_layer") else held.weight
        if name in names:
            assert is_quantized(weight) and not weight.requires_grad, name
        else:
            assert not is_quantized(weight) and torch.equal(weight, m.weight), name
    top = {n.split(".")[0] for n in names}
    assert top >= {"transformer_blocks", "single_transformer_blocks"}
    kept = {n.split(".")[0] for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear) and n not in names}
    assert kept >= {"x_embedder", "context_embedder", "norm_out", "proj_out"} and not kept & top
    if family == "flux2":
        assert "single_transformer_blocks.0.attn.to_qkv_mlp_proj" in names and "single_stream_modulation" in top
    # peft's LoRA layer for that kind of quantized base wraps every LoRA target.
    wanted = ("peft.tuners.lora.bnb", "Linear4bit") if precision == "nf4" else ("peft.tuners.lora.torchao",
                                                                                 "TorchaoLoraLinear")  # fmt: skip
    wrapped = {(type(m).__module__, type(m).__name__) for m in model.modules() if hasattr(m, "lora_A")}
    assert wrapped == {wanted}
    # Forward and backward: gradients on the LoRA weights only, all of them.
    out = model(**_inputs(family)).sample
    out.float().square().mean().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    lora = {n for n, p in model.named_parameters() if "lora_" in n}
    assert with_grad == lora == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in lora)


def test_bf16_changes_nothing_and_lora_comes_after():
    model = _model("flux1")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    report = quantize_base(model, "bf16")
    assert report.linears == 0 and report.bytes_before == report.bytes_after == stored_bytes(model)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    assert not hasattr(model, "_ddp_params_and_buffers_to_ignore")
    model.add_adapter(_peft_config())
    with pytest.raises(ValueError, match="before LoRA adapters are added"):
        quantize_base(model, "int8")
    with pytest.raises(ValueError, match="unknown base precision 'int4'"):
        quantize_base(_model("flux1"), "int4")


@pytest.mark.parametrize("precision", _precisions())
def test_under_autocast_a_quantized_linear_computes_in_the_dtype_a_bf16_one_does(precision):
    """torchao's int8 layer and bitsandbytes' 4-bit layer return their input's dtype, so an fp32 input (a LayerNorm's
    output under CUDA's autocast) would leave the rest of the block in fp32: more activation memory than planned,
    and attention in fp32."""
    ref = _model("flux1").to(torch.bfloat16)
    model = copy.deepcopy(ref)
    quantize_base(model, precision)
    names = quantized_linears(ref)
    x = torch.randn(3, ref.get_submodule(names[0]).in_features)  # fp32
    for name in names[:4]:
        with torch.autocast("cpu", torch.bfloat16):
            want, got = ref.get_submodule(name)(x), model.get_submodule(name)(x)
        assert want.dtype == got.dtype == torch.bfloat16, name
        assert torch.allclose(got.float(), want.float(), rtol=0.2, atol=0.2 * want.abs().max().item())
    with torch.autocast("cpu", torch.bfloat16):  # the whole model as before
        assert model(**_inputs("flux1")).sample.dtype == ref(**_inputs("flux1")).sample.dtype


def _peft_config():
    from peft import LoraConfig

    return LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"])


@pytest.mark.parametrize("precision", _precisions(["int8"]))
def test_skip_keeps_named_linears_and_a_second_call_changes_nothing(precision):
    model = _model("flux1")
    report = quantize_base(model, precision, skip=["attn.to_q", "single_transformer_blocks.1.proj_out"])
    assert not is_quantized(model.transformer_blocks[0].attn.to_q.weight)
    assert not is_quantized(model.single_transformer_blocks[1].proj_out.weight)
    assert is_quantized(model.single_transformer_blocks[0].proj_out.weight)
    assert report.linears == len(quantized_linears(_model("flux1"))) - 5  # every block's to_q, one proj_out
    assert quantize_base(model, precision, skip=["attn.to_q", "proj_out"]).linears == 0


def test_a_replaced_linear_does_not_outlive_its_replacement(monkeypatch):
    """nf4's layer is a new module: the bf16 linear it replaces must be freed as each is quantized, or a model loaded
    on the CPU holds every bf16 weight on the GPU by the end (a 12 GiB card ran out of memory while quantizing)."""
    import weakref

    import flux_cp.model.precision as precision

    def replaced(linear, _precision):  # what bitsandbytes' path does: a new module with new weights
        new = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        return new.requires_grad_(False)

    monkeypatch.setattr(precision, "_quantized", replaced)
    monkeypatch.setattr(precision, "check_installed", lambda _p: None)
    model = _model("flux1")
    old = [weakref.ref(m) for m in (model.get_submodule(n) for n in quantized_linears(model))]
    alive_at_each = []
    real_replace = precision._replace

    def replace(root, name, module):
        real_replace(root, name, module)
        alive_at_each.append(sum(r() is not None for r in old))

    monkeypatch.setattr(precision, "_replace", replace)
    quantize_base(model, "nf4")
    # At each replacement at most the one being replaced (and none after it is gone) is alive besides those to come.
    assert alive_at_each == [len(old) - i for i in range(len(old))]
    assert all(r() is None for r in old)


def test_with_a_home_each_linear_goes_there_once_quantized_on_the_device(monkeypatch):
    """With blocks to offload the quantized model lives on the CPU until offload places each block (`home`): each
    linear is quantized on the GPU (`device`) and goes home before the next one is, so the GPU never holds the whole
    quantized model (an fp8 FLUX.1-dev, 11.2 GiB, ran out of memory under a 12 GiB cap while quantizing). Here the
    device is the CPU and home the meta device, which stands for somewhere else."""
    import flux_cp.model.precision as precision

    quantized_on = []

    def replaced(linear, _precision):
        quantized_on.append(linear.weight.device.type)
        return torch.nn.Linear(linear.in_features, linear.out_features, device=linear.weight.device)

    monkeypatch.setattr(precision, "_quantized", replaced)
    monkeypatch.setattr(precision, "check_installed", lambda _p: None)
    model = _model("flux1")
    names = quantized_linears(model)
    away_at_each = []
    real_replace = precision._replace

    def replace(root, name, module):
        real_replace(root, name, module)
        away_at_each.append(
            sum(root.get_submodule(n).weight.device.type != "meta" for n in names[: len(away_at_each) + 1])
        )

    monkeypatch.setattr(precision, "_replace", replace)
    quantize_base(model, "int8", device="cpu", home="meta")
    assert quantized_on == ["cpu"] * len(names)
    assert away_at_each == [0] * len(names)  # every quantized linear already home when it is put in place
    assert {p.device.type for p in model.parameters()} == {"meta"}  # and the rest of the model with them


def test_the_trainer_keeps_a_quantized_base_on_the_cpu_when_it_offloads_blocks(monkeypatch):
    """load_trainee gives quantize_base the CPU as home exactly when blocks are to be offloaded."""
    import flux_cp.model.loading as loading
    from flux_cp.config.parser import parse_config

    homes = []
    monkeypatch.setattr(loading, "load_transformer", lambda *a: _model("flux1"))
    monkeypatch.setattr(loading, "model_fingerprint", lambda *a: "fp")
    monkeypatch.setattr(loading, "prepare_trainable", lambda *a: None)

    def record(transformer, precision, **kw):
        homes.append(kw.get("home"))
        return precision_report

    precision_report = type("R", (), {"describe": lambda self: "quantized"})()
    monkeypatch.setattr(loading, "quantize_base", record)
    for offload in ("0", "auto", "4"):
        cfg = parse_config(["--base_precision", "int8", "--offload_blocks", offload, "--gradient_checkpointing"])
        loading.load_trainee(cfg, "MODEL", object, ("transformer_blocks",), torch.float32, torch.device("cpu"), True)
    assert homes == [None, torch.device("cpu"), torch.device("cpu")]


# --- how far from the unquantized model ---------------------------------------------------------------------------

# Relative error of each block's update (its output less its input, on the unquantized model's inputs to it) and of
# the whole model's output, with normally distributed weights. Measured: int8 1.2% / 0.6-0.8%, fp8 4.4-5.1% /
# 2.6-3.0%, nf4 16-19% / 8.6-10.5% (NF4's 16 levels per block of 64 weights).
BOUNDS = {"int8": (0.02, 0.015), "fp8": (0.08, 0.05), "nf4": (0.25, 0.15)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", _precisions())
def test_each_blocks_error_against_the_unquantized_model_is_bounded(family, precision):
    from benchmarks.bench_precision_error import block_errors, record_blocks

    ref = _model(family, normal=True)
    calls, expected = record_blocks(ref, transformer_blocks(ref), _inputs(family))
    model = copy.deepcopy(ref)
    quantize_base(model, precision)
    block_bound, model_bound = BOUNDS[precision]
    for err in block_errors(calls, transformer_blocks(model)):
        assert 1e-4 < err < block_bound, f"{precision} block error {err:.4f}"
    with torch.no_grad():
        err = ((model(**_inputs(family)).sample - expected).norm() / expected.norm()).item()
    assert 1e-4 < err < model_bound, f"{precision} model error {err:.4f}"


# --- bytes ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", _precisions(PRECISIONS))
def test_planned_bytes_are_the_stored_bytes(family, precision):
    """`base_bytes` (the planner's count, from the config's shapes) equals what the quantized model holds, byte for
    byte, and describes the reduction."""
    model = _model(family).to(torch.bfloat16)
    planned = base_bytes(model, precision)
    with torch.device("meta"):
        on_meta = base_bytes(_model(family), precision)
    report = quantize_base(model, precision, device="cpu")  # each layer moved there before it is quantized
    assert planned == on_meta == stored_bytes(model) == report.bytes_after
    if precision != "bf16":
        assert report.bytes_after < report.bytes_before == base_bytes(_model(family), "bf16")
        assert report.describe().startswith(f"base precision {precision}: {report.linears} linear layers in ")


def test_full_size_bytes_per_parameter_as_the_docs_give_them():
    """docs/small_gpus.md's table: FLUX.1-dev's and FLUX.2 [dev]'s frozen transformer at each precision (GiB), counted
    on the meta device."""
    from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel

    with torch.device("meta"):
        flux1 = FluxTransformer2DModel.from_config(FLUX1_DEV_TRANSFORMER)
        flux2 = Flux2Transformer2DModel.from_config(FLUX2_DEV_TRANSFORMER)
    gib = {p: (round(base_bytes(flux1, p) / 2**30, 2), round(base_bytes(flux2, p) / 2**30, 2)) for p in PRECISIONS}
    assert gib == {"bf16": (22.17, 60.02), "fp8": (11.16, 30.26), "int8": (11.16, 30.26), "nf4": (5.81, 15.83)}
    for model, share in ((flux1, 0.994), (flux2, 0.992)):
        quantized = sum(model.get_submodule(n).weight.numel() for n in quantized_linears(model))
        assert round(quantized / sum(p.numel() for p in model.parameters()), 3) == share


# --- refusals -----------------------------------------------------------------------------------------------------


def test_refusals_say_what_to_change(monkeypatch):
    from flux_cp.config.parser import parse_config

    check_base_precision("bf16", True)
    with pytest.raises(UsageError, match=r"^--base_precision nf4 stores the frozen base weights in 4 bits for LoRA; "
                                         r"--full_finetune trains every weight"):  # fmt: skip
        parse_config(["--base_precision", "nf4", "--full_finetune", "--plan"])
    check_sharding("bf16", True)
    check_sharding("int8", False)
    with pytest.raises(UsageError) as e:
        check_sharding("fp8", True)
    assert str(e.value) == (
        "--base_precision fp8 cannot be sharded by FSDP2: launch with DDP (accelerate_configs/ddp_*.yaml, or gpu1.yaml "
        "on one GPU) with a quantized base, or use --base_precision bf16 with FSDP2"
    )
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(UsageError) as e:
        parse_config(["--base_precision", "nf4"])
    assert str(e.value) == (
        "--base_precision nf4 needs the bitsandbytes package: pip install -e .[quant] (or pip install "
        "'bitsandbytes>=0.50')"
    )
    parse_config(["--base_precision", "nf4", "--plan"])  # the planner loads nothing: no package needed
    check_installed("bf16")
    monkeypatch.setattr("flux_cp.extras.version", lambda package: "0.15.0")
    with pytest.raises(UsageError, match=r"^--base_precision int8 needs torchao >= 0.16 \(found 0.15.0\): pip "
                                         r"install -U 'torchao>=0.16' \(or pip install -e .\[quant\]\)$"):  # fmt: skip
        check_installed("int8")


def test_the_flag_is_recorded_and_may_change_on_resume():
    from flux_cp.config.parser import parse_config
    from flux_cp.outputs.resume import RESUMABLE_CHANGES

    assert parse_config([]).flat()["base_precision"] == "bf16"
    assert parse_config(["--base_precision", "fp8", "--plan"]).flat()["base_precision"] == "fp8"
    assert "base_precision" in RESUMABLE_CHANGES  # a LoRA trained on one base precision continues on another


# --- compile ------------------------------------------------------------------------------------------------------


# torchao's two kinds share their path: FLUX.1 (whose single block needed a change) with int8, FLUX.2 with fp8.
@pytest.mark.parametrize(
    ("family", "precision"),
    [
        pytest.param(f, p, marks=_skip(p), id=f"{f}-{p}")
        for f, p in (("flux1", "int8"), ("flux1", "nf4"), ("flux2", "fp8"))
    ],
)
def test_quantized_blocks_with_lora_compile_whole(family, precision):
    """torch.compile traces every quantized block with its LoRA layers in one graph (fullgraph: no graph break),
    forward and backward, with the results of eager, with block inputs that require grad (as those of every block but
    the first do in training). FLUX.1's single block returns two views of one tensor, which AOT autograd refuses
    beside torchao's weights until quantize_base separates them. (The AOT-eager backend: the tracing that a tensor
    subclass or a library op could break, without Inductor's code generation.) One block of each kind, its inputs
    (the text's too) requiring grad: a graph per kind, as the other blocks of a kind would reuse it."""
    model = _trained(family, precision, num_layers=1, num_single_layers=1)
    inputs = _inputs(family)
    grad_inputs = [inputs[k].requires_grad_(True) for k in ("hidden_states", "encoder_hidden_states")]

    def run():
        out = model(**inputs).sample
        out.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad] + [t.grad for t in grad_inputs]
        model.zero_grad(set_to_none=True)
        for t in grad_inputs:
            t.grad = None
        return out.detach(), grads

    want = run()
    torch._dynamo.reset()
    try:
        for block in transformer_blocks(model):
            block.compile(fullgraph=True, backend="aot_eager")
        got = run()
    finally:
        torch._dynamo.reset()
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(got[1], want[1], strict=True))


# --- checkpoints ----------------------------------------------------------------------------------------------------


class _Stats(torch.nn.Linear):
    """A frozen layer that puts more than its parameters in its state dict: its weight's statistics, an attribute of
    the weight (as bitsandbytes' 4-bit layer does)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.weight.absmax = torch.ones(3)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight.absmax"] = self.weight.absmax


def test_a_checkpoint_holds_the_trainable_weights_only():
    from flux_cp.outputs.checkpoint import _state

    model = torch.nn.Sequential(_Stats(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    state = _state(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    assert set(state["model"]) == {"1.weight", "1.bias"}
    assert set(_state(model, None, with_optimizer=False)["model"]) == {"1.weight", "1.bias"}


@pytest.mark.parametrize("precision", _precisions())
def test_a_checkpoint_of_a_quantized_base_run_holds_the_lora_weights(precision):
    from flux_cp.outputs.checkpoint import _state

    model = _trained("flux1", precision)
    lora = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(_state(model, None, with_optimizer=False)["model"]) == lora


# --- the libraries' noise ------------------------------------------------------------------------------------------


def test_quantized_base_warnings_are_dropped_by_their_own_text(caplog):
    import logging
    import warnings

    from flux_cp import quiet

    quiet.install()
    with caplog.at_level(logging.INFO):
        logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torchao").warning("Failed to load something else")
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque "
            "value type."
        )
        logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").warning(
            "Unable to import `torchao` Tensor objects. This may affect loading checkpoints serialized with `torchao`"
        )
    assert [r.getMessage() for r in caplog.records] == ["Failed to load something else"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.install()
        warnings.warn("TorchaoLoraLinear was instantiated without `get_apply_tensor_subclass`. Forward", stacklevel=1)
        warnings.warn("Int8Tensor does not implement _stable_hash_for_caching. For PT2...", stacklevel=1)
        warnings.warn("TorchaoLoraLinear says something else", stacklevel=1)
    assert [str(w.message) for w in caught] == ["TorchaoLoraLinear says something else"]


# --- the LoRA file ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", _precisions())
def test_the_lora_file_of_a_quantized_base_is_a_bf16_runs_and_loads_into_the_bf16_pipeline(tmp_path, precision):
    """The file written from a quantized-base run has the keys, shapes, dtypes and metadata of one from a bf16 run;
    FluxPipeline.load_lora_weights loads it into the unquantized pipeline with the weights as trained, and that
    pipeline renders what the quantized one (validation's) renders, within the quantization error."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from flux_cp.families import FLUX1
    from flux_cp.families.flux1.tiny import build_tiny_pipeline
    from flux_cp.model.lora import save_lora

    files = {}
    for kind in ("bf16", precision):
        model = _trained("flux1", kind)
        state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
        files[kind] = save_lora(model, state, str(tmp_path / kind), _lora_config("flux1", model), FLUX1)
    quantized = model
    bf16, ours = (load_file(files[k]) for k in ("bf16", precision))
    assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {k: (v.shape, v.dtype) for k, v in bf16.items()}
    headers = [safe_open(str(files[k]), "pt").metadata() for k in ("bf16", precision)]
    assert headers[0] == headers[1]

    def pipeline(transformer=None):
        pipe = build_tiny_pipeline(transformer=transformer is None)
        if transformer is not None:
            pipe.transformer = transformer
        for m in pipe.components.values():
            if isinstance(m, torch.nn.Module):
                m.eval()
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sample(pipe) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        out = pipe("a red circle", height=64, width=64, num_inference_steps=2, guidance_scale=3.5,
                   max_sequence_length=16, generator=g, output_type="latent")  # fmt: skip
        return out.images

    loaded = pipeline()
    loaded.load_lora_weights(str(files[precision].parent))
    weights = {re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", n): p
               for n, p in loaded.transformer.named_parameters() if "lora_" in n}  # fmt: skip
    assert weights.keys() == {k.removeprefix("transformer.") for k in ours}
    assert all(torch.equal(p, ours[f"transformer.{n}"]) for n, p in weights.items())
    with torch.no_grad():  # the quantized model's base is the pipeline's (tiny_transformer(0)), quantized
        want, got = sample(loaded), sample(pipeline(quantized))
    err = ((got - want).norm() / want.norm()).item()
    assert err < BOUNDS[precision][1], f"{precision}: {err:.4f}"
