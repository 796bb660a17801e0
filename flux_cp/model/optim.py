"""The optimizer side of a step: the optimizer (AdamW, 8-bit AdamW or Prodigy, as diffusers' examples name them)
and the LR schedule from the flags, the gradient norm (clipped), and what a step does with a non-finite loss or
gradient norm (`--on_nonfinite`)."""

from __future__ import annotations

import contextlib
import io
import logging
import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flux_cp.errors import NonFiniteError, UsageError
from flux_cp.extras import OPTIMIZER_INSTALL as INSTALL
from flux_cp.extras import OPTIMIZER_PACKAGES as PACKAGES
from flux_cp.extras import installed

if TYPE_CHECKING:
    from flux_cp.config.training import TrainConfig

logger = logging.getLogger("flux_cp")


# Bytes of an optimizer's state per trainable parameter. AdamW: two fp32 moments. Prodigy: two moments, its running
# sum and the initial weights, fp32 each. 8-bit AdamW: two uint8 moments with an fp32 scale per 256 values each (a
# tensor under 4096 values keeps fp32 moments: flux_cp.plan.diskspace allows for them per tensor).
STATE_BYTES = {"adamw": 8, "prodigy": 16, "adamw8bit": 2 + 2 * 4 / 256}
LABELS = {"adamw": "AdamW", "prodigy": "Prodigy", "adamw8bit": "8-bit AdamW"}


def state_bytes(name: str) -> float:
    """Bytes of the state optimizer `name` (`optimizer_name`) keeps per trainable parameter: the memory planner's and
    the checkpoints' size."""
    return STATE_BYTES[name]


def optimizer_name(train: TrainConfig) -> str:
    """'adamw', 'adamw8bit' or 'prodigy': which optimizer the flags make (a checkpoint's optimizer state is that
    optimizer's, so it is part of what a resumed run must match)."""
    if train.optimizer == "adamw" and train.use_8bit_adam:
        return "adamw8bit"
    return train.optimizer


def check_optimizer(train: TrainConfig, device: str | None = None, sharded: bool = False) -> None:
    """One line when the chosen optimizer cannot run here, before anything loads: 8-bit AdamW off a CUDA GPU, a
    missing package, or either optional optimizer with FSDP. `device`: the training device's type once known (None:
    whether torch sees a CUDA GPU); `sharded`: the weights are sharded (FSDP2). Every rank decides alike (agreed)."""
    name = optimizer_name(train)
    if name == "adamw":
        return
    flag = "--use_8bit_adam" if name == "adamw8bit" else "--optimizer prodigy"
    on = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "adamw8bit" and on != "cuda":
        where = "the CPU" if on == "cpu" else on
        raise UsageError(
            f"--use_8bit_adam needs a CUDA GPU (bitsandbytes' 8-bit AdamW); this run trains on {where}: "
            "drop --use_8bit_adam",
            agreed=True,
        )
    if not installed(PACKAGES[name]):
        raise UsageError(
            f"{flag} needs the {PACKAGES[name]} package: {INSTALL} (or pip install {PACKAGES[name]})", agreed=True
        )
    if sharded:
        # Prodigy estimates its step size from dot products over whole parameters and bitsandbytes' kernels take
        # plain tensors; FSDP2 hands both DTensor shards. Neither is tested with them.
        raise UsageError(
            f"{flag} is not supported with FSDP (sharded weights): use a DDP config (ddp_*.yaml, LoRA) or AdamW",
            agreed=True,
        )


def make_optimizer(
    train: TrainConfig,
    params: list[torch.nn.Parameter],
    global_batch: int,
    text_params: list[torch.nn.Parameter] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer of `--optimizer` / `--use_8bit_adam` over `params`; `--scale_lr` multiplies the LR by the
    samples per optimizer step. `text_params` (--train_text_encoder): a second parameter group at --text_encoder_lr
    with --adam_weight_decay_text_encoder, as diffusers' example builds it (--scale_lr scales --learning_rate only,
    and Prodigy takes --learning_rate for both, as there).

    AdamW is torch's fused implementation: a LoRA has hundreds of small tensors, and the default (foreach) AdamW
    spends milliseconds of host time per step issuing its dozen list operations over them (docs/design.md, "The
    step's host time"). The fused one updates them in a few kernels, the same update to rounding, and takes the
    `found_inf` flag that lets `apply_update` drop a non-finite step on the device. 8-bit AdamW (bitsandbytes) and
    Prodigy (prodigyopt) are built as diffusers' examples build them; `apply_update` reads their step's flag first."""
    lr = train.learning_rate * (global_batch * train.gradient_accumulation_steps if train.scale_lr else 1)
    betas, name = (train.adam_beta1, train.adam_beta2), optimizer_name(train)
    every = list(params) + list(text_params or ())
    if text_params:
        text_lr = lr if name == "prodigy" else train.text_encoder_lr
        decay = train.adam_weight_decay_text_encoder
        params = [{"params": list(params)}, {"params": list(text_params), "lr": text_lr, "weight_decay": decay}]
    if name == "prodigy":
        from prodigyopt import Prodigy

        with _without_line("Using decoupled weight decay"):  # printed by every rank's constructor
            return Prodigy(
                params,
                lr=lr,
                betas=betas,
                beta3=train.prodigy_beta3,
                weight_decay=train.adam_weight_decay,
                eps=train.adam_epsilon,
                decouple=train.prodigy_decouple,
                use_bias_correction=train.prodigy_use_bias_correction,
                safeguard_warmup=train.prodigy_safeguard_warmup,
            )
    if name == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(
            params, lr=lr, betas=betas, weight_decay=train.adam_weight_decay, eps=train.adam_epsilon
        )
    fused = all(p.device.type in ("cuda", "cpu") and p.is_floating_point() for p in every)
    return torch.optim.AdamW(
        params, lr=lr, betas=betas, weight_decay=train.adam_weight_decay, eps=train.adam_epsilon, fused=fused or None
    )


@contextlib.contextmanager
def _without_line(line: str):
    """Drop one exact line a library prints on stdout; everything else it prints still shows."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        rest = [t for t in captured.getvalue().splitlines(keepends=True) if t.rstrip("\n") != line]
        sys.stdout.write("".join(rest))


def describe(train: TrainConfig) -> str:
    """The optimizer and its settings, for people (the model card)."""
    common = f"betas {train.adam_beta1:g}, {train.adam_beta2:g}; weight decay {train.adam_weight_decay:g}; eps "
    common += f"{train.adam_epsilon:g}"
    name = optimizer_name(train)
    if name == "prodigy":
        beta3 = "sqrt(beta2)" if train.prodigy_beta3 is None else f"{train.prodigy_beta3:g}"
        switches = {
            "decoupled decay": train.prodigy_decouple,
            "bias correction": train.prodigy_use_bias_correction,
            "safeguard warmup": train.prodigy_safeguard_warmup,
        }
        said = [f"{k} {'on' if v else 'off'}" for k, v in switches.items()]
        return f"Prodigy ({common}; beta3 {beta3}; {', '.join(said)})"
    return f"{'8-bit AdamW (bitsandbytes)' if name == 'adamw8bit' else 'AdamW'} ({common})"


def make_lr_scheduler(train: TrainConfig, optimizer: torch.optim.Optimizer, max_steps: int):
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        train.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=train.lr_warmup_steps,
        num_training_steps=max_steps,
        num_cycles=train.lr_num_cycles,
        power=train.lr_power,
    )


def clip_grad_norm(
    accelerator, params: list[torch.nn.Parameter], max_norm: float, extra: list[torch.nn.Parameter] | None = None
) -> torch.Tensor:
    """Global gradient norm of the trainable parameters (a 0-d tensor on their device, not read by the host),
    clipped to `max_norm` (<= 0: no clipping). `extra`: more trained parameters outside the wrapped model (the text
    encoder's LoRA, whole on every rank), in the same norm and clipped alike, as diffusers' example clips both.
    (accelerate's clip_grad_norm_ under FSDP2 only handles the whole model's parameters, not LoRA's.)"""
    from torch.distributed.tensor import DTensor

    accelerator.unscale_gradients()
    limit = max_norm if max_norm > 0 else float("inf")
    if not extra:
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    # The two sets apart (sharded DTensors and plain tensors do not mix in one norm), then clip_grad_norm_'s math.
    norms = []
    for group in (params, extra):
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    for group in (params, extra):
        torch.nn.utils.clip_grads_with_norm_(group, limit, total.to(group[0].device))
    return total


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


def _steps(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


@dataclass
class Progress:
    """Which steps of a run that started (or resumed) after step `start` had their update applied, as `after_step`
    reads them (with --on_nonfinite skip a non-finite step's update is dropped). A run whose every step was skipped
    did not train; one whose last steps were skipped ends with weights that gave non-finite losses. Neither may
    write its final model: `failure` says why."""

    start: int
    applied: int = 0
    skipped: list[int] = field(default_factory=list)  # the trailing run of skipped steps

    def note(self, step: int, skipped: bool) -> None:
        if skipped:
            self.skipped.append(step)
        else:
            self.applied, self.skipped = self.applied + 1, []

    def failure(self, checkpoints: list[int], output_dir: str) -> str | None:
        """Why the run's end must not be written as its final model (None: it may). `checkpoints`: the steps of the
        output folder's checkpoints, to name the newest one whose weights gave a finite loss (the weights of
        checkpoint-k give step k+1 its loss)."""
        if not self.skipped:
            return None
        kept = "no final model or checkpoint was written" + (
            f", and {output_dir} keeps its earlier outputs" if self.start or checkpoints else ""
        )
        steps = _steps(self.skipped)
        if not self.applied:
            after = f"the resume at step {self.start}" if self.start else "the start"
            return (
                f"the run did not train: {steps}, every step after {after}, had a non-finite loss or gradient "
                f"norm and {'were' if len(self.skipped) > 1 else 'was'} skipped (--on_nonfinite skip): {kept}. "
                "Check the data and the settings (a lower --learning_rate)"
            )
        many = len(self.skipped) > 1
        them, were = ("them", "were") if many else ("it", "was")
        good = [k for k in checkpoints if k <= self.skipped[0] - 2]
        then = (
            f"checkpoint-{good[-1]} is the newest checkpoint before {them}: resume from it with a lower --learning_rate"
            if good
            else f"no checkpoint was written before {them}: run again with a lower --learning_rate"
        )
        last = f"the last {len(self.skipped)} of the run" if many else "the last of the run"
        return (
            f"{steps}, {last}, had a non-finite loss or gradient norm and {were} skipped (--on_nonfinite skip): the "
            f"weights before {them} give non-finite losses, so {kept}. {then}"
        )
