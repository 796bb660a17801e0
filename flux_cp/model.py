"""Loading FLUX.1 components, adding LoRA, the seed checkpoint, and writing the final outputs in the
formats diffusers loads (`FluxPipeline.load_lora_weights`, `FluxTransformer2DModel.from_pretrained`)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from .encode import Encoders
from .errors import UsageError

Tensor = torch.Tensor


def model_path(args) -> str:
    if args.embedded_default:
        from .data import reference_column
        from .tiny import ensure_tiny_pipeline

        # Pair data (e.g. data/tiny_pairs) gets the tiny FLUX.1 Kontext variant.
        return str(ensure_tiny_pipeline(kontext=reference_column(args) is not None))
    return args.pretrained_model_name_or_path


def _load(cls, path: str, subfolder: str, args, **kwargs):
    try:
        return cls.from_pretrained(path, subfolder=subfolder, revision=args.revision, **kwargs)
    except (OSError, ValueError) as e:
        raise UsageError(
            f"cannot load {subfolder} from --pretrained_model_name_or_path {path}: {str(e).splitlines()[0]}"
        ) from None


def load_transformer(args, path: str, dtype: torch.dtype, device: torch.device):
    """The transformer in `dtype` on `device`: pretrained weights, or seeded random ones from its config."""
    from diffusers import FluxTransformer2DModel

    if args.transformer_init == "random":
        try:
            config = FluxTransformer2DModel.load_config(path, subfolder="transformer", revision=args.revision)
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read transformer/config.json under {path}: {str(e).splitlines()[0]}") from None
        # Built directly on the device and in the target dtype: a 12B model initialises in seconds on a GPU,
        # and never holds an fp32 copy (48 GB) on the way.
        default = torch.get_default_dtype()
        with torch.device(device), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(args.seed)
            torch.set_default_dtype(dtype)
            try:
                model = FluxTransformer2DModel.from_config(config)
            finally:
                torch.set_default_dtype(default)
        return model.to(dtype)
    kw = {"variant": args.variant} if args.variant else {}
    return _load(FluxTransformer2DModel, path, "transformer", args, torch_dtype=dtype, **kw).to(device)


def load_encoders(args, path: str, dtype: torch.dtype, device: torch.device) -> Encoders:
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

    kw = {"variant": args.variant} if args.variant else {}
    vae = _load(AutoencoderKL, path, "vae", args, torch_dtype=dtype, **kw).to(device).eval()
    text_encoder = _load(CLIPTextModel, path, "text_encoder", args, torch_dtype=dtype, **kw).to(device).eval()
    text_encoder_2 = _load(T5EncoderModel, path, "text_encoder_2", args, torch_dtype=dtype, **kw).to(device).eval()
    tokenizer = _load(CLIPTokenizer, path, "tokenizer", args)
    tokenizer_2 = _load(T5TokenizerFast, path, "tokenizer_2", args)
    for m in (vae, text_encoder, text_encoder_2):
        m.requires_grad_(False)
    return Encoders(vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2, device, dtype)


def load_scheduler(args, path: str):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return _load(FlowMatchEulerDiscreteScheduler, path, "scheduler", args)


def add_lora(transformer, args) -> None:
    """peft LoRA adapters; initialised from `--seed` alone, so every layout starts from the same weights."""
    from peft import LoraConfig

    targets = [t.strip() for t in args.lora_layers.split(",") if t.strip()]
    names = [n for n, _ in transformer.named_modules()]
    unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        raise UsageError(f"--lora_layers {unknown} match no module of the transformer (e.g. attn.to_q, ff.net.2)")
    config = LoraConfig(
        r=args.rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, init_lora_weights="gaussian",
        target_modules=targets,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        transformer.add_adapter(config)


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def prepare_trainable(transformer, args) -> None:
    """Freeze or unfreeze; trainable parameters are kept in fp32 (master weights)."""
    if args.full_finetune:
        transformer.requires_grad_(True)
    else:
        transformer.requires_grad_(False)
        add_lora(transformer, args)
    for _, p in trainable_parameters(transformer):
        p.data = p.data.float()


def apply_seed_checkpoint(transformer, path: str, is_main: bool) -> str:
    """Read the initial trainable weights from `path` if it exists, else write them there (rank 0,
    atomically). Runs before sharding, on plain tensors. Returns 'read' or 'written'."""
    params = dict(trainable_parameters(transformer))
    distributed = dist.is_available() and dist.is_initialized()
    exists = os.path.isfile(path)
    if distributed:
        # Every rank looks before any rank writes, so all take the same branch (rank 0 writing the file
        # while another rank still looks would send that rank to read and leave rank 0 in the barrier).
        dist.barrier()
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
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        os.close(fd)
        save_file({n: p.detach().float().cpu().contiguous() for n, p in params.items()}, tmp)
        os.replace(tmp, path)
    if distributed:
        dist.barrier()
    return "written"


def full_state_dict(model: torch.nn.Module, trainable_only: bool) -> dict[str, Tensor]:
    """Plain CPU tensors of the (trainable) parameters on rank 0, from a DDP-, FSDP2- or un-wrapped model.
    Every rank must call it (FSDP gathers)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    inner = getattr(model, "module", model)
    if dist.is_available() and dist.is_initialized() and _is_fsdp(inner):
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


def save_lora(transformer, state: dict[str, Tensor], output_dir: str) -> Path:
    """`pytorch_lora_weights.safetensors` in diffusers' format, loadable by FluxPipeline.load_lora_weights."""
    from diffusers import FluxPipeline
    from peft.utils import get_peft_model_state_dict

    lora = get_peft_model_state_dict(transformer, state_dict=state)
    lora = {k: v.contiguous() for k, v in lora.items()}
    FluxPipeline.save_lora_weights(output_dir, transformer_lora_layers=lora, safe_serialization=True)
    return Path(output_dir) / "pytorch_lora_weights.safetensors"


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


def write_json(path: str | os.PathLike, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
