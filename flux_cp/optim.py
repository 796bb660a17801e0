"""The optimizer side of a step: AdamW and the LR schedule from the flags, the gradient norm (clipped), and
what a step does with a non-finite loss or gradient norm (`--on_nonfinite`)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from .errors import NonFiniteError

if TYPE_CHECKING:
    from .config import TrainConfig

logger = logging.getLogger("flux_cp")


def make_optimizer(train: TrainConfig, params: list[torch.nn.Parameter], global_batch: int) -> torch.optim.Optimizer:
    """AdamW over `params`; `--scale_lr` multiplies the LR by the samples per optimizer step.

    The fused implementation: a LoRA has hundreds of small tensors, and the default (foreach) AdamW spends
    milliseconds of host time per step issuing its dozen list operations over them (docs/design.md, "The step's
    host time"). The fused one updates them in a few kernels, the same update to rounding, and takes the
    `found_inf` flag that lets `apply_update` drop a non-finite step on the device."""
    scale = global_batch * train.gradient_accumulation_steps if train.scale_lr else 1
    fused = all(p.device.type in ("cuda", "cpu") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(
        params, lr=train.learning_rate * scale, betas=(train.adam_beta1, train.adam_beta2),
        weight_decay=train.adam_weight_decay, eps=train.adam_epsilon, fused=fused or None,
    )  # fmt: skip


def make_lr_scheduler(train: TrainConfig, optimizer: torch.optim.Optimizer, max_steps: int):
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        train.lr_scheduler, optimizer=optimizer, num_warmup_steps=train.lr_warmup_steps,
        num_training_steps=max_steps, num_cycles=train.lr_num_cycles, power=train.lr_power,
    )  # fmt: skip


def clip_grad_norm(accelerator, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient norm of the trainable parameters (a 0-d tensor on their device, not read by the host),
    clipped to `max_norm` (<= 0: no clipping).
    (accelerate's clip_grad_norm_ under FSDP2 only handles the whole model's parameters, not LoRA's.)"""
    from torch.distributed.tensor import DTensor

    accelerator.unscale_gradients()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def skips_on_device(optimizer) -> bool:
    """Whether a non-finite step can be dropped without the host reading the loss first. Fused AdamW takes the
    `found_inf` flag that torch's GradScaler sets, and where it is 1 leaves weights, moments and step count as
    they were. Not under fp16, whose GradScaler sets that flag itself."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds torch's optimizer
    return bool(inner.defaults.get("fused")) and getattr(optimizer, "scaler", None) is None


def apply_update(optimizer, lr_scheduler, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """Step the optimizer and the LR schedule, unless the loss or the gradient norm is not finite: then the
    update is dropped (weights, moments and AdamW's step count unchanged) and only the schedule advances. Returns
    whether it was dropped, as a 0-d bool tensor. With a fused optimizer the decision stays on the device, so the
    host queues the update and the next step without waiting for this backward to end (`check_finite` acts on
    it once read)."""
    nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
    if skips_on_device(optimizer):
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.found_inf = nonfinite.to(torch.float32)
        try:
            optimizer.step()
        finally:
            del inner.found_inf
    elif not nonfinite.item():
        optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return nonfinite


def check_finite(loss: float, grad_norm: float, on_nonfinite: str, step: int) -> None:
    """Act on a step whose loss or gradient norm was not finite (its update already dropped by `apply_update`):
    stop with NonFiniteError, or with `on_nonfinite == "skip"` warn and go on."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    if on_nonfinite == "stop":
        raise NonFiniteError(
            f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step}; "
            f"no checkpoint was written for it. Lower --learning_rate, check the data, or "
            f"pass --on_nonfinite skip to skip such steps"
        )
    logger.warning(f"step {step}: non-finite loss or gradient norm, update skipped (--on_nonfinite skip)")
