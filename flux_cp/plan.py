"""`train_flux_cp.py --plan`: per-GPU memory of a configuration before anything heavy is loaded, and the
smallest CP size that fits.

Weights, gradients and AdamW state are counted exactly from the transformer's config (the model is built on
the meta device, with the LoRA adapters the flags would add). Activations are counted in units of one
token's hidden state in bf16 (2 x D bytes per token). Without checkpointing a double block keeps
DOUBLE_BLOCK_UNITS and a single block SINGLE_BLOCK_UNITS (what autograd saves, counted on CPU by
tests/test_plan.py); with checkpointing every block keeps its input (1 unit) and the block being recomputed
peaks at BLOCK_PEAK_UNITS. BLOCK_PEAK_UNITS was fitted to one measured peak (FLUX.1-dev, LoRA, 2048 px,
one H200); the other measured peaks check the whole estimate (tests/test_plan.py). The constants and those peaks,
with their sources, are in plan_data.json beside this module.
The optimizer step has a peak of its own: torch's multi-tensor AdamW holds sqrt(v) for all of a rank's
trainable parameters at once (fp32), after the activations are freed; it decides full fine-tuning's peak.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import Config

GIB = 2**30
DATA = json.loads((Path(__file__).parent / "plan_data.json").read_text())  # its "notes" say what each constant is
BLOCK_PEAK_UNITS: float = DATA["block_peak_units"]
DOUBLE_BLOCK_UNITS: float = DATA["double_block_units"]
SINGLE_BLOCK_UNITS: float = DATA["single_block_units"]
FSDP_GATHERED_BLOCKS: int = DATA["fsdp_gathered_blocks"]
SAVED_ATTENTION_UNITS: dict[str, float] = DATA["saved_attention_units"]


@dataclass
class Estimate:
    weights: float
    grads: float
    optimizer: float
    activations: float
    activations_without_ckpt: float
    activations_with_ckpt: float
    step_temporaries: float  # AdamW's sqrt(v) during the optimizer step, when no activations are held

    @property
    def fixed(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.total_with(self.activations)

    def total_with(self, activations: float) -> float:
        return self.fixed + max(activations, self.step_temporaries)


def count_parameters(config: dict, lora_rank: int | None, lora_layers: list[str]) -> tuple[int, int, int]:
    """(all base parameters, trainable parameters, parameters of the largest block), exact, on the meta device."""
    return _count_parameters(json.dumps(config, sort_keys=True), lora_rank, tuple(lora_layers))


@functools.lru_cache(maxsize=16)  # --plan asks for every CP size; building the model is the slow part
def _count_parameters(config: str, lora_rank: int | None, lora_layers: tuple[str, ...]) -> tuple[int, int, int]:
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(json.loads(config))
        base = sum(p.numel() for p in model.parameters())
        block = max(
            sum(p.numel() for p in b.parameters())
            for b in [*model.transformer_blocks, *model.single_transformer_blocks]
        )
        if lora_rank is None:
            return base, base, block
        from peft import LoraConfig

        model.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=list(lora_layers)))
        trainable = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return base, trainable, block


def estimate(
    config: dict,
    *,
    tokens: int,
    batch: int,
    lora_rank: int | None,
    lora_layers: list[str],
    world: int,
    cp: int,
    checkpointing: bool,
    weight_bytes: int = 2,
    fsdp: bool | None = None,
    saved_attention: float = 0.0,
) -> Estimate:
    """Bytes per GPU. `tokens` per sample (image + text); FSDP (default: world > 1) shards weights, gradients
    and optimizer state over all `world` ranks; each rank holds tokens / cp of each of its `batch` samples.
    `saved_attention`: units each checkpointed block keeps of its attention (`saved_attention_units`)."""
    base, trainable, block = count_parameters(config, lora_rank, lora_layers)
    fsdp = world > 1 if fsdp is None else fsdp
    shard = world if fsdp else 1
    frozen = base - trainable if lora_rank is not None else 0
    weights = frozen * weight_bytes / shard + trainable * 4 / shard
    if fsdp:
        weights += FSDP_GATHERED_BLOCKS * block * weight_bytes
    grads = trainable * 4 / shard
    optimizer = 2 * trainable * 4 / shard
    step_temporaries = trainable * 4 / shard
    d = config["num_attention_heads"] * config["attention_head_dim"]
    blocks = config["num_layers"] + config["num_single_layers"]
    unit = batch * math.ceil(tokens / cp) * d * 2
    with_ckpt = unit * (blocks * (1 + saved_attention) + BLOCK_PEAK_UNITS)
    without = unit * (config["num_layers"] * DOUBLE_BLOCK_UNITS + config["num_single_layers"] * SINGLE_BLOCK_UNITS)
    activations = with_ckpt if checkpointing else without
    return Estimate(weights, grads, optimizer, activations, without, with_ckpt, step_temporaries)


def saved_attention_units(train, mode: str, cp: int) -> float:
    """Units of its attention a checkpointed block keeps with these training flags (`TrainConfig`) and CP mode."""
    from .blocks import attention_recomputed

    if attention_recomputed(train):
        return 0.0
    return SAVED_ATTENTION_UNITS["exchanged" if cp > 1 and mode in ("ulysses", "hybrid") else "local"]


def sharded_weights(full_finetune: bool) -> bool:
    """FSDP2 (sharded) or DDP (replicated) for the plan: the launch config's choice when accelerate launched us,
    else the README's advice (DDP for LoRA, FSDP2 for full fine-tuning)."""
    if "ACCELERATE_MIXED_PRECISION" in os.environ or "ACCELERATE_USE_FSDP" in os.environ:  # set by accelerate launch
        return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    return full_finetune


def print_disk(cfg: Config, config: dict, world: int) -> None:
    """The disk a run needs in --output_dir: one checkpoint and the final model (flux_cp.diskspace)."""
    from . import diskspace

    lora = None if cfg.lora.full_finetune else cfg.lora.rank
    counts = diskspace.count(config, lora, list(cfg.lora.lora_layers))
    dtype = torch.float32 if cfg.train.mixed_precision == "no" else torch.bfloat16
    from .optim import optimizer_name

    s = diskspace.sizes(counts, cfg.lora.full_finetune, not cfg.checkpoints.checkpoint_weights_only, dtype, world,
                        optimizer_name(cfg.train))  # fmt: skip
    limit = cfg.checkpoints.checkpoints_total_limit
    print(
        f"disk: {s.describe()}; keep at least {diskspace.gib(s.checkpoint + s.model)} free in --output_dir"
        + (f" ({limit} checkpoints kept: {diskspace.gib((limit + 1) * s.checkpoint + s.model)})" if limit else "")
    )


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def transformer_config(path: str, revision: str | None = None, cache_dir: str | None = None) -> tuple[dict, str]:
    """(transformer config, where it came from) of a model folder or hub id, without waiting on the network: a
    folder's own file; a hub id's from the local HF cache (`cache_dir`: --cache_dir's, else the default), else built
    in for the known FLUX.1 ids (flux_cp.known_models), else from the Hub in one short attempt (not when
    HF_HUB_OFFLINE is set). Whatever fails is one UsageError line."""
    from .errors import UsageError
    from .known_models import KNOWN, known_model

    flag = f"--pretrained_model_name_or_path {path}"
    file = "transformer/config.json"
    if os.path.isdir(path):
        from diffusers import FluxTransformer2DModel

        try:
            return dict(FluxTransformer2DModel.load_config(path, subfolder="transformer")), path
        except (OSError, ValueError) as e:
            raise UsageError(f"{flag}: cannot read {file} there ({str(e).splitlines()[0]})") from None
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError

    try:
        cached = huggingface_hub.try_to_load_from_cache(path, file, cache_dir=cache_dir, revision=revision)
    except HFValidationError:
        raise UsageError(f"{flag}: no such folder (and not a hub id like owner/name)") from None
    if isinstance(cached, str):
        with open(cached) as f:
            return json.load(f), f"{path} (local HF cache)"
    known = known_model(path)
    if known is not None:
        return dict(known.transformer), f"{known.model_id} (built-in config)"
    offline_ids = ", ".join(m.model_id for m in KNOWN.values())
    if _hub_offline():
        raise UsageError(
            f"{flag}: not a local folder, and its {file} is not in the local HF cache (HF_HUB_OFFLINE is set): "
            f"pass the model's folder, or a model known offline ({offline_ids})"
        )
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    try:  # one attempt with a short timeout (hf_hub_download alone retries for ~30 s when the hub is unreachable)
        url = huggingface_hub.hf_hub_url(path, file, revision=revision)
        huggingface_hub.get_hf_file_metadata(url, timeout=10)
        local = huggingface_hub.hf_hub_download(path, file, revision=revision, cache_dir=cache_dir)
    except (HfHubHTTPError, httpx.HTTPError, OSError, ValueError) as e:
        why = " ".join(str(e).split())[:200] or type(e).__name__
        raise UsageError(
            f"{flag}: not a local folder or in the local HF cache, and {file} could not be read from the Hugging Face "
            f"Hub ({why}): pass the model's folder, or a model known offline ({offline_ids})"
        ) from None
    with open(local) as f:
        return json.load(f), path


def print_plan(cfg: Config) -> None:
    """The plan, printed once: under `accelerate launch` every rank runs this, and all but rank 0 return at once."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    from .data import reference_column
    from .families import for_transformer
    from .parallel import auto_mode, launched_world_size
    from .shape import model_of

    pairs = reference_column(cfg.data) is not None  # FLUX.1 Kontext: the reference has its target's size
    if cfg.model.embedded_default:
        family, path = model_of(cfg.model, pairs)
        config = dict(family.transformer_class().load_config(path, subfolder="transformer"))
    else:
        model = cfg.model
        config, path = transformer_config(model.pretrained_model_name_or_path, model.revision, model.cache_dir)
        family = for_transformer(config)
    world = launched_world_size()
    resolution, batch, cp_size = cfg.data.resolution, cfg.train.train_batch_size, cfg.parallel.cp_size
    tokens = (2 if pairs else 1) * (resolution // 16) ** 2 + cfg.data.max_sequence_length
    lora = None if cfg.lora.full_finetune else cfg.lora.rank
    layers = list(cfg.lora.lora_layers)
    gpu = cfg.plan.gpu_memory_gib or (
        torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else 141.0
    )
    wb = 4 if cfg.train.mixed_precision == "no" else 2
    fsdp = sharded_weights(lora is None)
    print(
        f"plan: {path}, {resolution} px{' Kontext pairs' if pairs else ''} ({tokens} tokens/sample), "
        f"batch {batch}/rank, "
        f"{'full fine-tuning' if lora is None else f'LoRA r{lora}'}, {world} process(es), GPU {gpu:.0f} GiB, "
        + ("weights sharded over all GPUs (FSDP2)" if fsdp else "weights whole on every GPU (DDP)")
    )
    print_disk(cfg, config, max(world, cp_size))
    print(
        f"{'cp':>3} {'world':>5} {'weights':>8} {'grads':>7} {'adam':>7} {'act.ckpt':>9} {'act.full':>9} "
        f"{'total(ckpt)':>12} {'total(no ckpt)':>15}  fits"
    )
    fits_at = None
    sizes = sorted({c for c in (1, 2, 4, 8, 16) if c <= max(world, 8)} | {cp_size})
    for c in sizes:
        w = max(world, c)
        mode = (
            cfg.parallel.cp_mode if cfg.parallel.cp_mode != "auto" else auto_mode(config["num_attention_heads"], c)[0]
        )
        e = estimate(
            config,
            tokens=tokens,
            batch=batch,
            lora_rank=lora,
            lora_layers=layers,
            world=w,
            cp=c,
            checkpointing=True,
            weight_bytes=wb,
            fsdp=fsdp and w > 1,
            saved_attention=saved_attention_units(cfg.train, mode, c),
        )
        ck, full = e.total_with(e.activations_with_ckpt) / GIB, e.total_with(e.activations_without_ckpt) / GIB
        verdict = "yes" if full < 0.9 * gpu else ("with --gradient_checkpointing" if ck < 0.9 * gpu else "no")
        if verdict != "no" and fits_at is None:
            fits_at = (c, verdict)
        print(
            f"{c:>3} {w:>5} {e.weights / GIB:>8.1f} {e.grads / GIB:>7.1f} {e.optimizer / GIB:>7.1f} "
            f"{e.activations_with_ckpt / GIB:>9.1f} {e.activations_without_ckpt / GIB:>9.1f} {ck:>12.1f} "
            f"{full:>15.1f}  {verdict}"
        )
    if fits_at is None:
        print(
            "suggestion: nothing listed fits; use more GPUs"
            + (" (FSDP shards the weights over all of them)" if fsdp else ", or an fsdp2_* config to shard the weights")
        )
        return
    c, verdict = fits_at
    mode, u = auto_mode(config["num_attention_heads"], c) if c > 1 else ("none", None)
    extra = "" if verdict == "yes" else " --gradient_checkpointing"
    print(
        f"suggestion: --cp_size {c}{extra}"
        + (f" (auto mode: {mode}" + (f", ulysses {u}" if u else "") + ")" if c > 1 else "")
        + "; figures are estimates within ~15% of measured peaks (GiB per GPU; 10% headroom kept)."
    )
