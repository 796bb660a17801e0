"""Loading FLUX.1 components, choosing the trainable weights (LoRA or all), the seed checkpoint, and
gathering and writing the final weights (a transformer folder `FluxTransformer2DModel.from_pretrained` loads;
LoRA files are written by flux_cp.model.lora)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from flux_cp import distributed, files
from flux_cp.errors import UsageError
from flux_cp.families.components import component_folder, load_component, model_fingerprint
from flux_cp.model import network_weights
from flux_cp.model.lora import add_lora
from flux_cp.model.precision import quantize_base
from flux_cp.random_weights import build_random, name_seed

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.config.training import LoraConfig, ModelConfig

logger = logging.getLogger("flux_cp")

Tensor = torch.Tensor


def load_transformer(model: ModelConfig, path: str, cls: type, dtype: torch.dtype, device: torch.device, seed: int):
    """The transformer (of diffusers class `cls`) in `dtype` on `device`: pretrained weights, or random ones from its
    config and `seed`."""
    if model.transformer_init == "random":
        try:
            config = cls.load_config(path, subfolder="transformer", revision=model.revision, cache_dir=model.cache_dir)
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read transformer/config.json under {path}: {str(e).splitlines()[0]}") from None
        # Filled a parameter at a time on the GPU when there is one (flux_cp.random_weights), in the target dtype and
        # kept on `device`: a 12B model initialises in seconds, also when it is staged on the CPU (torch's default
        # init on the CPU takes minutes at that size), and never holds an fp32 copy on the way. The values depend
        # on the seed only, not on where they are kept: a staged run starts from the same weights as one that is not.
        return build_random(cls, dict(config), dtype, device, name_seed("transformer", seed))
    kw = {"variant": model.variant} if model.variant else {}
    return load_component(
        cls, path, "transformer", model.revision, torch_dtype=dtype, cache_dir=model.cache_dir, **kw
    ).to(device)


def transformer_fingerprint(model: ModelConfig, path: str, cls: type) -> str:
    """The fingerprint `load_trainee` gives the transformer (its config and weight files' content; random weights:
    its config alone), from its config.json and weight files without loading them (the model is built on the meta
    device), so that a resume on a changed model is refused before any work."""
    from accelerate import init_empty_weights

    try:
        config = cls.load_config(path, subfolder="transformer", revision=model.revision, cache_dir=model.cache_dir)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read transformer/config.json under {path}: {str(e).splitlines()[0]}") from None
    with init_empty_weights():
        module = cls.from_config(config)
    pretrained = model.transformer_init == "pretrained"
    return model_fingerprint(
        module, component_folder(path, "transformer", model.revision, model.cache_dir) if pretrained else None
    )


def load_trainee(
    cfg: Config,
    path: str,
    cls: type,
    quantized_parts: tuple[str, ...],
    dtype: torch.dtype,
    device: torch.device,
    is_main: bool,
) -> tuple[torch.nn.Module, str]:
    """The transformer (diffusers class `cls`, of the model at `path`) to train and the fingerprint of its weights as
    loaded: its frozen base (the linears of `quantized_parts`) quantized with
    --base_precision (before LoRA: peft wraps each quantized linear in its LoRA layer), then LoRA adapters or every
    weight trainable (`prepare_trainable`), then the LoRA file's weights (--network_weights) or the seed checkpoint's
    (written when absent)."""
    model, train, precision = cfg.model, cfg.train, cfg.model.base_precision
    # On the CPU first when blocks are offloaded or the base is quantized: the whole bf16 model need not fit the
    # GPU (quantize_base and offload_blocks move it there, a layer or a block at a time). With blocks to offload the
    # quantized model stays on the CPU too (each linear quantized on the GPU and brought back) until offload_blocks
    # places each block: the GPU holds the resident blocks and the slots only, never the whole quantized model.
    offloading = train.offload_blocks != "0"
    staged = offloading or precision != "bf16"
    transformer = load_transformer(model, path, cls, dtype, torch.device("cpu") if staged else device, train.seed)
    pretrained = model.transformer_init == "pretrained"  # random weights: its config and the seed are all
    folder = component_folder(path, "transformer", model.revision, model.cache_dir)
    fingerprint = model_fingerprint(transformer, folder if pretrained else None)
    if precision != "bf16":
        home = torch.device("cpu") if offloading else None
        logger.info(quantize_base(transformer, precision, device=device, home=home, parts=quantized_parts).describe())
    prepare_trainable(transformer, cfg.lora, train.seed)
    if cfg.lora.network_weights is not None and not cfg.lora.full_finetune:
        logger.info(f"flux-cp: {network_weights.apply(transformer, cfg.lora)}")
    if train.seed_checkpoint:
        how = apply_seed_checkpoint(transformer, train.seed_checkpoint, is_main)
        logger.info(f"seed checkpoint {how}: {train.seed_checkpoint}")
    return transformer, fingerprint


def load_scheduler(model: ModelConfig, path: str):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return load_component(FlowMatchEulerDiscreteScheduler, path, "scheduler", model.revision, cache_dir=model.cache_dir)


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def prepare_trainable(transformer, lora: LoraConfig, seed: int) -> None:
    """Freeze or unfreeze (adding LoRA adapters); trainable parameters are kept in fp32 (master weights)."""
    if lora.full_finetune:
        transformer.requires_grad_(True)
    else:
        transformer.requires_grad_(False)
        add_lora(transformer, lora, seed)
    for _, p in trainable_parameters(transformer):
        p.data = p.data.float()


def check_seed_checkpoint(path: str) -> None:
    """--seed_checkpoint at start, before any model loads: a path that names a folder or something else than a file
    is refused, and an existing file must be a readable safetensors file (its header; the names and shapes are
    checked against the model once it is built). A missing file is written there (its folder made)."""
    if not path:
        raise UsageError("--seed_checkpoint is empty: name a .safetensors file (written when absent, read if present)")
    if os.path.isdir(path):
        raise UsageError(
            f"--seed_checkpoint {path} is a folder: name a file in it (e.g. {os.path.join(path, 'seed.safetensors')}), "
            "written when absent and read when present"
        )
    if os.path.lexists(path) and not os.path.isfile(path):
        raise UsageError(f"--seed_checkpoint {path} exists but is not a regular file: name a .safetensors file")
    if os.path.isfile(path):
        from safetensors import safe_open

        try:
            with safe_open(path, "pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for every kind of damage
            raise UsageError(f"--seed_checkpoint {path} cannot be read: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def apply_seed_checkpoint(transformer, path: str, is_main: bool) -> str:
    """Read the initial trainable weights from `path` if it exists, else write them there (rank 0,
    atomically). Runs before sharding, on plain tensors. Returns 'read' or 'written'."""
    params = dict(trainable_parameters(transformer))
    exists = os.path.isfile(path)
    # Every rank looks before any rank writes, so all take the same branch (rank 0 writing the file
    # while another rank still looks would send that rank to read and leave rank 0 in the barrier).
    distributed.barrier()
    if exists:
        try:
            state = load_file(path)
        except Exception as e:  # noqa: BLE001 - a corrupt file is a usage problem
            raise UsageError(f"--seed_checkpoint {path} cannot be read: {e}") from None
        if set(state) != set(params):
            extra, missing = sorted(set(state) - set(params))[:3], sorted(set(params) - set(state))[:3]
            raise UsageError(
                f"--seed_checkpoint {path} was written for other trainable weights (unexpected {extra}, missing "
                f"{missing}): use the same model, --full_finetune, --rank and --lora_layers, or another path"
            )
        with torch.no_grad():
            for n, p in params.items():
                if state[n].shape != p.shape:
                    raise UsageError(
                        f"--seed_checkpoint {path}: {n} has shape {tuple(state[n].shape)}, expected {tuple(p.shape)}"
                    )
                p.copy_(state[n].to(p.device, p.dtype))
        return "read"
    if is_main:
        files.write_safetensors(path, {n: p.detach().float() for n, p in params.items()})
    distributed.barrier()
    return "written"


def full_state_dict(model: torch.nn.Module, trainable_only: bool) -> dict[str, Tensor]:
    """Plain CPU tensors of the (trainable) parameters on rank 0, from a DDP-, FSDP2- or un-wrapped model.
    Every rank must call it (FSDP gathers)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    inner = getattr(model, "module", model)
    if distributed.is_distributed() and _is_fsdp(inner):
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        return get_model_state_dict(inner, options=opts)
    names = {n for n, _ in trainable_parameters(inner)} if trainable_only else None
    return {k: v.detach().cpu() for k, v in inner.state_dict().items() if names is None or k in names}


def _is_fsdp(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - old torch
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def save_full(transformer, state: dict[str, Tensor], output_dir: str, dtype: torch.dtype) -> Path:
    """A transformer folder loadable by FluxTransformer2DModel.from_pretrained (sharded above 10 GB)."""
    from huggingface_hub import save_torch_state_dict

    out = Path(output_dir) / "transformer"
    out.mkdir(parents=True, exist_ok=True)
    transformer.save_config(out)
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    save_torch_state_dict(
        state, out, filename_pattern="diffusion_pytorch_model{suffix}.safetensors", max_shard_size="10GB"
    )
    return out
