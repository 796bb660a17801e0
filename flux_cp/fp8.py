"""`--fp8 rowwise|tensorwise`: LoRA's frozen base linears of the transformer blocks in FP8, through torchao's float8
training (`torchao.float8.convert_to_float8_training`): each selected `nn.Linear` becomes a `Float8Linear` that casts
its input and weight to float8 (e4m3) with dynamic scales - per row and output channel (rowwise) or per tensor
(tensorwise) - and multiplies them with `torch._scaled_mm`; outputs and gradients stay bf16. The forward, its
recomputation and the input gradients of the frozen weights run in FP8; everything else stays bf16.

What is converted (`converts`): the `nn.Linear` modules of the transformer blocks that are frozen, are not LoRA
adapters (peft's `lora_A`, `lora_B`), are not the blocks' modulation (`norm*.linear`: one row per sample, nothing
to gain) and have both sizes multiples of 16 (FP8 matmuls need them). Inside peft's `lora.Linear` that is its
`base_layer`: `Float8Linear` subclasses `nn.Linear`, so peft still treats it as the base layer (the adapters, their
state dict and merging are unchanged). Embedders, the output layer, norms and attention are not touched.

Why the refusals (`check`, one line before anything loads):
- a GPU with FP8 tensor cores: compute capability 8.9 (Ada) or newer, 9.0 (Hopper) for rowwise scaling;
- --compile: torchao's backward computes every weight's gradient; compiled graphs drop the frozen weights' unused
  ones, eager ones compute them and throw them away (eager float8 on a FLUX.1 block pair measured 0.30-0.66x of
  bf16 on one H200);
- LoRA only (--full_finetune trains the weights: not this switch's scope), bf16 weights (the casts are from bf16);
- tensorwise under CP: its input scale is the maximum over a rank's tokens, so a CP rank would scale its tokens
  differently from one GPU and CP would no longer compute what one GPU computes. Rowwise scales each token by
  itself: exact under CP.
FSDP2: torchao supports it (each rank casts the gathered bf16 weight); `enable_fsdp_float8_all_gather` casts trained
weights before their all-gather and is left off: ours are frozen, and LoRA runs best with whole weights (DDP).

MFU and HFU in metrics.jsonl stay counted against the GPU's bf16 peak.

The switch is this module, the `--fp8` flag (flux_cp/config.py) and two calls in flux_cp/trainer.py.
"""

from __future__ import annotations

import torch

from .errors import UsageError

SCALINGS = ("rowwise", "tensorwise")
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
TORCHAO = "torchao==0.16.0"


def converts(name: str, module: torch.nn.Module) -> bool:
    """Whether the module called `name` in the transformer runs in FP8 (see above)."""
    parts = name.split(".")
    if type(module) is not torch.nn.Linear or parts[0] not in BLOCK_LISTS:
        return False
    if any(p.startswith("lora_") for p in parts):  # peft's adapters (lora_A, lora_B): trained, stay bf16
        return False
    if any(p.startswith("norm") for p in parts):  # AdaLayerNorm's modulation (norm1.linear, norm.linear)
        return False
    if module.weight.requires_grad:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def selected(transformer: torch.nn.Module) -> list[str]:
    """Names of the modules `convert` turns into FP8."""
    return [name for name, m in transformer.named_modules() if converts(name, m)]


def check(cfg, weight_dtype: torch.dtype | None = None) -> None:
    """One UsageError line where `--fp8` cannot run (`cfg`: the run's Config)."""
    scaling = cfg.train.fp8
    if scaling == "off":
        return
    flag = f"--fp8 {scaling}"
    if cfg.lora.full_finetune:
        raise UsageError(f"{flag} runs LoRA's frozen base weights in FP8; --full_finetune trains them: drop one")
    if not (cfg.train.compile or cfg.train.compile_mode):
        raise UsageError(
            f"{flag} needs --compile (or --compile_mode): eager float8 computes the frozen weights' gradients too and "
            "runs slower than bf16"
        )
    if scaling == "tensorwise" and cfg.parallel.cp_size > 1:
        raise UsageError(
            f"{flag} scales each rank's tokens by their own maximum, so --cp_size {cfg.parallel.cp_size} would not "
            "compute what one GPU computes: use --fp8 rowwise (each token scaled by itself)"
        )
    if not torch.cuda.is_available():
        raise UsageError(f"{flag} needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer)")
    major, minor = torch.cuda.get_device_capability()
    need = (9, 0) if scaling == "rowwise" else (8, 9)
    if (major, minor) < need:
        name = torch.cuda.get_device_name()
        raise UsageError(
            f"{flag} needs FP8 tensor cores with compute capability {need[0]}.{need[1]} or newer; {name} has "
            f"{major}.{minor}" + (": try --fp8 tensorwise" if (major, minor) >= (8, 9) else ": drop --fp8")
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UsageError(f"{flag} needs torchao: pip install {TORCHAO} (or -r requirements-gpu.txt)") from None
    if weight_dtype is not None and weight_dtype != torch.bfloat16:
        raise UsageError(f"{flag} casts bf16 weights to FP8; this run's weights are {weight_dtype}: use bf16")


def float8_config(scaling: str, emulate: bool = False):
    """torchao's Float8LinearConfig of a scaling recipe (`emulate`: float8 arithmetic emulated, for CPU tests)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(scaling)
    return dataclasses.replace(config, emulate=True) if emulate else config


def convert(transformer: torch.nn.Module, scaling: str, emulate: bool = False) -> str:
    """Swap the selected linears for torchao's Float8Linear, in place, before compile and FSDP; says what it did."""
    from torchao.float8 import convert_to_float8_training

    names = set(selected(transformer))
    convert_to_float8_training(transformer, module_filter_fn=lambda m, fqn: fqn in names,
                               config=float8_config(scaling, emulate))  # fmt: skip
    return f"--fp8 {scaling}: {len(names)} frozen linears of the transformer blocks run in FP8 (torchao float8)"
