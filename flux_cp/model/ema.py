"""--use_ema: an exponential moving average (EMA) of the trained weights, the run's output (the final weights and the
validation images are the EMA's; checkpoints hold the raw weights and the EMA, so a resumed run continues both).

The math is diffusers' `EMAModel` (diffusers.training_utils), updated after an optimizer step s:
`shadow -= (1 - d) * (shadow - weight)` with `d = min(--ema_decay, (1 + t) / (10 + t))`, t = s - 1 (d = 0 at the
first step: the shadow becomes the weights), the same ops in the same order (tests/test_ema.py checks the shadow
against EMAModel's bit for bit). With `--ema_update_interval k` the update runs after every k-th step and its decay is
that of the step it follows, as SimpleTuner's EMAModel computes it from the global step. The decay is a function of
the step alone, so a resumed run computes the decays of an uninterrupted one; only the shadow is checkpointed.

Why not EMAModel itself: its state is a list of shadows by position, where a checkpoint here is resharded by name on
another dp x cp layout (torch.distributed.checkpoint), and its update does not take FSDP2's sharded parameters apart
from their shards. Here each shadow is a copy of its parameter as it lives on this rank (a DTensor shard under
FSDP2, so the EMA is sharded like the weights), and the update acts on the local tensors of both, which is the same
elementwise update on every layout: CP changes nothing, as it changes nothing in the weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

Tensor = torch.Tensor


def decay_at(step: int, max_decay: float) -> float:
    """The decay of the update after optimizer step `step` (1-based): diffusers' `EMAModel.get_decay(step)` with its
    defaults (no update_after_step, no power warm-up, min_decay 0)."""
    t = max(0, step - 1)
    if t <= 0:
        return 0.0
    return min((1 + t) / (10 + t), max_decay)


def _local(t: Tensor) -> Tensor:
    """The tensor this rank holds: a DTensor's local shard (its storage: writes to it change the DTensor), else
    the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class EMA:
    """The EMA of `named` (name, parameter) pairs; the names are the checkpoint's keys (those of the unwrapped
    model, the same on every layout)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], max_decay: float, interval: int):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.max_decay, self.interval = max_decay, interval
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in self.params]  # a DTensor's clone is a DTensor alike

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step`: the update when it is due (nothing else; queued on the device, no read)."""
        if not self.due(step):
            return
        d = decay_at(step, self.max_decay)
        shadow, params = [_local(s) for s in self.shadow], [_local(p.detach()) for p in self.params]
        torch._foreach_sub_(shadow, torch._foreach_sub(shadow, params), alpha=1 - d)  # as EMAModel.step

    def state_dict(self) -> dict[str, Tensor]:
        """{name: shadow}: the tensors themselves, so that torch.distributed.checkpoint loads into them in place."""
        return dict(zip(self.names, self.shadow))

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The parameters hold the EMA inside the block and their own values again after it (swapped one tensor at a
        time: one tensor of extra memory, bit-exact both ways)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for s, p in zip(self.shadow, self.params):
            a, b = _local(s), _local(p.detach())
            kept = a.clone()
            a.copy_(b)
            b.copy_(kept)
