"""What the flags ask of a run that its shape (the model, the data's metadata, the launch) or the machine cannot give,
refused at start before anything loads, one UsageError line: each check is its owner's (the family's, the
optimizer's, block offload's, the base precision's, ...); this module asks them all, in order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flux_cp.data.sources import check_pair_flags, check_reference_limit
from flux_cp.model import network_weights
from flux_cp.model.blocks import check_counts
from flux_cp.model.loading import check_seed_checkpoint
from flux_cp.model.offload_plan import check_offload
from flux_cp.model.optim import check_optimizer
from flux_cp.model.precision import check_sharding
from flux_cp.model.text_encoder import check_sharding as check_text_encoder_sharding
from flux_cp.shape.run_shape import check_tokens

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.shape.run_shape import RunShape


def check_start(cfg: Config, shape: RunShape, device_type: str) -> None:
    """What the flags ask of this run that its shape (the model, the data's metadata, the launch) or the machine
    cannot give, refused at start before anything loads (one UsageError): the family's flags and prompt window, the
    seed checkpoint's file, the LoRA file of --network_weights, the optimizer on this device and sharding, block
    offload and a quantized base against FSDP2, counts of blocks beyond the model's, reference images per target, the
    CP split of every sequence, the
    flags of pair data."""
    family = shape.family
    family.check(cfg)
    family.check_text(cfg, shape.model_path)
    if cfg.train.seed_checkpoint is not None:
        check_seed_checkpoint(cfg.train.seed_checkpoint)
    if cfg.lora.network_weights is not None and not cfg.lora.full_finetune:
        network_weights.check_start(cfg.lora, family, shape.transformer_config)
    check_optimizer(cfg.train, device_type, shape.sharded)
    check_offload(cfg.train.offload_blocks, full_finetune=cfg.lora.full_finetune, sharded=shape.sharded)
    blocks = sum(n for _, n in family.block_kinds(shape.transformer_config))
    check_counts(cfg.train.gradient_checkpointing, cfg.train.offload_blocks, blocks)
    check_sharding(cfg.model.base_precision, shape.sharded)
    check_text_encoder_sharding(cfg.lora.train_text_encoder, shape.sharded)
    check_reference_limit(
        family.max_references, family.pairs_label, cfg.validation, shape.metadata, shape.reference_column
    )
    check_tokens(shape, cfg.data, cfg.validation)
    check_pair_flags(cfg.data, cfg.validation, shape.pairs, family.pairs_label)
