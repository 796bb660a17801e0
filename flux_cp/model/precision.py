"""The frozen base's precision (`--base_precision`): the transformer's large linear weights stored in 8 or 4 bits
while LoRA trains beside them in fp32, as diffusers' QLoRA recipe, kohya's --fp8_base and SimpleTuner's
--base_model_precision do. docs/small_gpus.md is the user's page.

What each precision stores per weight of a quantized linear (its bias stays as loaded):
- bf16: nothing changes (the weights as loaded, in --mixed_precision's dtype).
- int8: torchao's `Int8WeightOnlyConfig` (version 2): one int8 per weight and one fp32 scale per output row
  (and an int8 zero point per row, always 0).
- fp8: torchao's `Float8WeightOnlyConfig`: one float8_e4m3fn per weight and one fp32 scale per output row.
- nf4: bitsandbytes' `Linear4bit` (QLoRA's NF4: 4 bits per weight, an absmax per block of 64 weights, the absmax
  values themselves in 8 bits with an fp32 scale per 256 of them - bitsandbytes' double quantization), computing in
  the dtype the weights were loaded in (bf16), as diffusers' `BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)`.
The 8-bit kinds are weight-only: each matmul converts the weight back to the activation's dtype and multiplies in
it, so no fp8 or int8 matmul runs and no GPU generation is required.

Which linears: every `nn.Linear` of the transformer blocks (attention projections, MLPs, FLUX.1's per-block adaLN
modulation, FLUX.2's fused `to_qkv_mlp_proj`) and FLUX.2's shared modulation linears - 99.4% of FLUX.1-dev's
weights, 99.2% of FLUX.2 [dev]'s. The rest stays as loaded: the input embedders (`x_embedder`, `context_embedder`),
the timestep / guidance embedders, the final adaLN and projection (`norm_out`, `proj_out`) and every norm. They map
the model's inputs and conditioning into the residual stream and out of it, where an error is not one of many block
contributions but reaches every block or the output directly; SimpleTuner keeps the same embedders and final layer
of Flux unquantized, diffusers' FLUX.2 fp8 example its `proj_out`. Kept, they are 0.13 GiB of FLUX.1-dev in bf16,
0.47 GiB of FLUX.2 [dev].

Order: `quantize_base` after the transformer is loaded and before LoRA adapters are added
(`flux_cp.model.lora.add_lora`), so that peft wraps each quantized linear in its own LoRA layer for it
(`TorchaoLoraLinear`, bitsandbytes' `Linear4bit`), whose forward adds the fp32 LoRA update to the quantized layer's
output.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from flux_cp.config.fields import PRECISION_BITS, PRECISIONS
from flux_cp.errors import UsageError
from flux_cp.extras import check_installed
from flux_cp.families.base import of_model

QUANTIZED = PRECISIONS[1:]
NF4_BLOCK = 64  # weights per absmax (bitsandbytes' default blocksize for 4 bits)
NF4_STATS_BLOCK = 256  # absmax values per fp32 scale (bitsandbytes' double quantization)
# Per layer: the NF4 code (16 fp32), the absmax quantization's code (256 fp32) and its offset (one fp32).
NF4_LAYER_BYTES = 16 * 4 + 256 * 4 + 4


# --- checks: one line each, before anything loads -------------------------------------------------------------


def check_sharding(precision: str, sharded: bool) -> None:
    """FSDP2 cannot shard quantized weights: torchao's int8 and float8 tensors implement neither the split nor the
    new_zeros that `fully_shard` applies to every parameter, and bitsandbytes' packed 4-bit weight keeps its scales
    outside the tensor that FSDP2 would gather. (DDP holds the whole base on every GPU, which is what a quantized base
    is for.)"""
    if precision != "bf16" and sharded:
        raise UsageError(
            f"--base_precision {precision} cannot be sharded by FSDP2: launch with DDP "
            "(accelerate_configs/ddp_*.yaml, or gpu1.yaml on one GPU) with a quantized base, or use --base_precision "
            "bf16 with FSDP2",
            agreed=True,
        )


def bits(precision: str) -> int:
    return PRECISION_BITS[precision]


# --- which linears, and quantizing them ------------------------------------------------------------------------


def quantized_linears(
    transformer: torch.nn.Module, skip: Iterable[str] = (), parts: Iterable[str] | None = None
) -> list[str]:
    """Names of the linears `quantize_base` quantizes: those of the top-level modules `parts` (default: the model
    family's `quantized_parts`) still holding plain weights, less any named by `skip` (a module name or the end of
    one, as --lora_layers names them)."""
    skip, parts = tuple(skip), tuple(of_model(transformer).quantized_parts if parts is None else parts)
    out = []
    for name, module in transformer.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.split(".")[0] not in parts:
            continue
        if any(name == s or name.endswith("." + s) for s in skip) or not _plain(module.weight):
            continue
        out.append(name)
    return out


@dataclass(frozen=True)
class QuantizedBase:
    """What `quantize_base` did, for the log."""

    precision: str
    linears: int  # linears quantized
    bytes_before: int  # of the whole transformer's parameters and buffers
    bytes_after: int

    def describe(self) -> str:
        if self.precision == "bf16":
            return f"base precision bf16: the transformer's weights as loaded ({_size(self.bytes_before)})"
        return (
            f"base precision {self.precision}: {self.linears} linear layers in {bits(self.precision)} bits (embedders, "
            f"norms, final layer as loaded); the transformer {_size(self.bytes_before)} -> {_size(self.bytes_after)}"
        )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def quantize_base(
    transformer: torch.nn.Module,
    precision: str,
    *,
    device: torch.device | str | None = None,
    home: torch.device | str | None = None,
    skip: Iterable[str] = (),
    parts: Iterable[str] | None = None,
) -> QuantizedBase:
    """Store the frozen transformer's linear weights (`quantized_linears` of the top-level modules `parts`, default
    its family's `quantized_parts`) in `precision`, in place. Call it after loading and before adding LoRA adapters.
    `device`: where the quantized model is to live; each linear moves there just before it is quantized, then the rest
    of the model, so that a model loaded on the CPU never needs its whole bf16 copy on the GPU. `home`: where the
    model is to live instead (default `device`): each linear, quantized on `device`, goes there at once, and so does
    the rest; with blocks to offload, the CPU, from where `offload_blocks` places each block (the quantized model need
    not fit the GPU at any time: an fp8 FLUX.1-dev is 11.2 GiB, more than a 12 GiB GPU holds beside the rest). The
    values are those quantized on `device` either way: a move copies bytes. Quantizing is a
    function of the weights alone, so every rank quantizing the same loaded weights holds the same quantized ones
    (tests/test_cp_precision.py compares them) and needs no other rank's: the quantized weights are kept out of DDP's
    start-up broadcast (`_ddp_params_and_buffers_to_ignore`), which cannot send torchao's tensors."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown base precision {precision!r}; one of {PRECISIONS}")
    if _has_adapters(transformer):
        raise ValueError("quantize_base must run before LoRA adapters are added (peft wraps the quantized linears)")
    place = home if home is not None else device  # where the quantized model lives
    before = stored_bytes(transformer)
    names = quantized_linears(transformer, skip, parts) if precision != "bf16" else []
    if names:
        check_installed(precision)
        modules = dict(transformer.named_modules())
        with torch.no_grad():
            for name in names:
                # Taken out of the lookup: bitsandbytes' layer is a new module, and the bf16 linear it replaces must
                # not outlive it (held here, every replaced linear's weights would pile up on `device`).
                linear = modules.pop(name)
                if device is not None:
                    linear.to(device)
                quantized = _quantized(linear, precision)
                if place != device:
                    quantized.to(place)
                quantized.register_forward_pre_hook(_autocast_input)
                _replace(transformer, name, quantized)
                del linear, quantized
        if precision == "nf4":
            transformer.is_loaded_in_4bit = True  # peft then wraps Linear4bit in its bitsandbytes LoRA layer
        else:
            _separate_outputs(transformer)
        transformer._ddp_params_and_buffers_to_ignore = _QuantizedStates(transformer)
    if place is not None:
        transformer.to(place)
    return QuantizedBase(precision, len(names), before, stored_bytes(transformer))


def _quantized(linear: torch.nn.Linear, precision: str) -> torch.nn.Module:
    if precision == "nf4":
        import bitsandbytes as bnb

        weight = linear.weight.detach()
        q = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=weight.dtype,
            compress_statistics=True,
            quant_type="nf4",
            device="meta",
        )
        # Params4bit quantizes when moved to a real device (here: the one it is on).
        q.weight = bnb.nn.Params4bit(
            weight, requires_grad=False, compress_statistics=True, quant_type="nf4", blocksize=NF4_BLOCK
        ).to(weight.device)
        if linear.bias is not None:
            q.bias = torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        q.train(linear.training)
        return q
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    # set_inductor_config=False: torchao would otherwise change Inductor's global settings for the whole run
    # (every compiled block), not only for its own kernels.
    config = (
        Int8WeightOnlyConfig(version=2, set_inductor_config=False)
        if precision == "int8"
        else Float8WeightOnlyConfig(set_inductor_config=False)
    )
    quantize_(linear, config)
    return linear


def _autocast_input(module: torch.nn.Module, args: tuple) -> tuple | None:
    """Under autocast, a quantized linear's input in the autocast dtype, as autocast gives a bf16 linear's: torchao's
    int8 layer and bitsandbytes' 4-bit layer return their input's dtype, so an fp32 input (a LayerNorm's output under
    autocast) would make the rest of the block compute and keep fp32 activations (twice the memory planned, and
    attention in fp32)."""
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        if x.dtype != dtype:
            return (x.to(dtype), *args[1:])
    return None


def _separate_outputs(transformer: torch.nn.Module) -> None:
    """torch.compile (AOT autograd) refuses a graph whose outputs alias one another once torchao's weights, tensor
    subclasses, are among its inputs; FLUX.1's single block returns its text and image tokens as two views of one
    tensor. Its text part becomes a copy of its own (512 tokens of the thousands; the values are the same), so that
    the block compiles as a bf16 one does."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    for block in transformer.modules():
        if isinstance(block, FluxSingleTransformerBlock):
            block.forward = functools.partial(_text_copied, block.forward)


def _text_copied(forward, *args, **kwargs):
    text, image = forward(*args, **kwargs)
    return text.clone(), image


def _replace(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _has_adapters(model: torch.nn.Module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - peft is a requirement
        return False
    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_floating_point()


def is_quantized(t: torch.Tensor) -> bool:
    """A weight stored by torchao or bitsandbytes (its bytes are not numel x element size)."""
    return hasattr(t, "quant_state") or (not _plain(t) and hasattr(t, "__tensor_flatten__"))


class _QuantizedStates:
    """The state-dict names of the model's quantized weights (and of the statistics bitsandbytes saves beside them),
    listed when DDP reads them at its construction: LoRA adds its layers between `quantize_base` and DDP, which
    renames every wrapped weight (`attn.to_q.weight` -> `attn.to_q.base_layer.weight`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = weakref.ref(model)

    def __iter__(self) -> Iterator[str]:
        model = self.model()
        if model is None:
            return iter(())
        names = []
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and is_quantized(weight):
                prefix = f"{name}.weight" if name else "weight"
                keys = module.state_dict(prefix=f"{name}." if name else "", keep_vars=True)
                names += [k for k in keys if k == prefix or k.startswith(prefix + ".")]
        return iter(names)


# --- bytes: stored, and planned ---------------------------------------------------------------------------------


def stored_bytes(module: torch.nn.Module) -> int:
    """Bytes the module's parameters and buffers hold, a quantized weight counted by what it stores (its data and
    scales, bitsandbytes' statistics)."""
    return sum(t.numel() * t.element_size() for p in [*module.parameters(), *module.buffers()] for t in stored(p))


def stored(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a (quantized) tensor is stored in."""
    if hasattr(t, "quant_state"):  # bitsandbytes' Params4bit: packed data, then its statistics
        qs = t.quant_state
        stats = [qs.absmax, qs.code] + ([qs.offset, qs.state2.absmax, qs.state2.code] if qs.nested else [])
        return [t.data.as_subclass(torch.Tensor), *stats]
    if not _plain(t) and hasattr(t, "__tensor_flatten__"):  # torchao: the tensors it is made of
        names, _ = t.__tensor_flatten__()
        return [inner for n in names if getattr(t, n) is not None for inner in stored(getattr(t, n))]
    return [t]


def weight_bytes(precision: str, out_features: int, in_features: int, dtype_bytes: int = 2) -> int:
    """Bytes of one linear's weight stored in `precision` (bf16: `dtype_bytes` per weight)."""
    n = out_features * in_features
    if precision == "int8":
        return n + 5 * out_features  # 1 byte each; per row an fp32 scale and an int8 zero point (always 0)
    if precision == "fp8":
        return n + 4 * out_features  # 1 byte each, an fp32 scale per row
    if precision == "nf4":
        blocks = math.ceil(n / NF4_BLOCK)
        return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NF4_STATS_BLOCK) + NF4_LAYER_BYTES
    return n * dtype_bytes


def block_bytes(block: torch.nn.Module, precision: str, dtype_bytes: int = 2) -> tuple[int, int]:
    """(bytes, quantized weights) of one module inside a quantized part (a transformer block) after `quantize_base`:
    every linear's weight in `precision`, its other tensors at `dtype_bytes` each, and how many weights were
    quantized. Exact, on the meta device as well (the planner's per-block count)."""
    linears = {n for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)} if precision != "bf16" else set()
    total = quantized = 0
    for name, p in block.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if owner in linears and leaf == "weight":
            total += weight_bytes(precision, *p.shape)
            quantized += p.numel()
        else:
            total += p.numel() * dtype_bytes
    return total + sum(b.numel() * b.element_size() for b in block.buffers()), quantized


def base_bytes(
    transformer: torch.nn.Module,
    precision: str,
    dtype_bytes: int = 2,
    skip: Iterable[str] = (),
    parts: Iterable[str] | None = None,
) -> int:
    """Bytes of the frozen transformer after `quantize_base(transformer, precision, parts=parts)`, its other weights
    at `dtype_bytes` each: exact, and counted from a model on the meta device as well as a real one (for the
    planner)."""
    chosen = set(quantized_linears(transformer, skip, parts)) if precision != "bf16" else set()
    total = 0
    for name, p in transformer.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if owner in chosen and leaf == "weight":
            total += weight_bytes(precision, *p.shape)
        else:
            total += p.numel() * dtype_bytes
    return total + sum(b.numel() * b.element_size() for b in transformer.buffers())
