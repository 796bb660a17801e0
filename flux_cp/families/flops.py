"""FLOPs of a training step from a family's forward FLOPs (`Family.step_flops`): what MFU and HFU count."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one optimizer step. `model`: what training needs, each matmul once (forward, backward without
    recomputation), as MFU counts them; `executed`: what runs (recomputation included), as HFU counts them."""

    model: float
    executed: float

    def __add__(self, other: StepFlops) -> StepFlops:
        return StepFlops(self.model + other.model, self.executed + other.executed)


NO_FLOPS = StepFlops(0.0, 0.0)


def step_flops(linear_fwd: float, attention_fwd: float, lora: bool, ckpt: float, attn_recomputed: float) -> StepFlops:
    """Model and executed FLOPs of a step from its forward FLOPs: the matmuls of the linear layers
    (`linear_fwd`) and the two of attention (`attention_fwd`).

    Linear layers: the backward computes the input gradients (as much as the forward) and, for trained weights,
    the weight gradients (as much again); with LoRA the base weights are frozen, so theirs are not computed.
    Checkpointing runs the forward once more (`ckpt`: the share of the blocks checkpointed, True for all; every
    block of a model costs the same). Attention: its backward is 4 matmuls of the forward's size, twice the
    forward (as torchtitan and PaLM count it); flash-style kernels also recompute the scores inside the backward
    (executed: 2.5x), and recomputed blocks run the attention forward again (`attn_recomputed`; compiled blocks
    keep its outputs; the share of the blocks that do). LoRA's own small matmuls are left out."""
    backward = 1 if lora else 2
    model = linear_fwd * (1 + backward) + attention_fwd * 3
    executed = linear_fwd * (1 + backward + float(ckpt)) + attention_fwd * (1 + 2.5 + float(attn_recomputed))
    return StepFlops(float(model), float(executed))
