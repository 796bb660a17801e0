"""The loss of a training step, for every model family: the weighted flow-matching MSE of diffusers' training examples
(the target is noise - latents, packed into the model's tokens), over plain samples, pairs (the target tokens only)
and prior preservation (the class samples' mean, weighted, beside the training samples').

The exactness rule (docs/design.md, data flow, rule 4): each rank's loss is the weighted mean over its own tokens.
DDP or FSDP2 average gradients over all dp x cp ranks; with equal chunks the average of the chunk means is the
full-sequence mean, so the averaged gradient is the full-sequence gradient (code that gathered the output and computed
the full loss on every rank would have to *sum* gradients over the CP group instead), and the reported loss is the
mean over ranks of the same quantity.
- Pairs (`target_loss`): ranks hold different numbers of target tokens, so rank r computes `cp * S_r / (T * C)` per
  sample (`S_r`: its weighted squared errors over its target tokens, `T` the target tokens of the sample, `C` the
  channels); averaged over the CP group that is the full-sequence mean, however the target/reference boundary falls
  (docs/design.md, Kontext). A rank with no target tokens keeps a zero loss on the graph, so its backward still runs
  the attention's collectives.
- Prior preservation, as diffusers' DreamBooth examples: per rank the mean over its own samples plus
  `--prior_loss_weight` times the mean over its class samples; both halves hold the same number of samples on every
  rank, so the average over ranks is the global batch's.
- The weighting: each sample's weight from its sigma (`loss_weighting`, the SD3 schemes of diffusers'
  `compute_loss_weighting_for_sd3`), computed with the sample's draws (flux_cp.data.batches) and carried by the
  micro-batch, like its target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

Tensor = torch.Tensor


def loss_weighting(scheme: str, sigmas: Tensor) -> Tensor:
    """Per-sample loss weights, as diffusers' `compute_loss_weighting_for_sd3`."""
    if scheme == "sigma_sqrt":
        return (sigmas**-2.0).float()
    if scheme == "cosmap":
        bot = 1 - 2 * sigmas + 2 * sigmas**2
        return 2 / (math.pi * bot)
    return torch.ones_like(sigmas)


@dataclass(frozen=True)
class PairSplit:
    """Which image tokens of `[target; references]` each of `cp_size` ranks holds: a contiguous chunk of
    `(target_tokens + reference_tokens) / cp_size` tokens (`reference_tokens`: of all references together)."""

    target_tokens: int
    reference_tokens: int
    cp_size: int

    def __post_init__(self) -> None:
        if (self.target_tokens + self.reference_tokens) % self.cp_size:
            raise ValueError(
                f"{self.target_tokens} + {self.reference_tokens} image tokens do not split over {self.cp_size} ranks"
            )

    @property
    def chunk(self) -> int:
        return (self.target_tokens + self.reference_tokens) // self.cp_size

    def span(self, rank: int) -> tuple[int, int]:
        """[start, stop) of rank's chunk in the image segment."""
        return rank * self.chunk, (rank + 1) * self.chunk

    def local_targets(self, rank: int) -> int:
        """How many target tokens rank holds: the first ones of its chunk (0 when it holds only reference)."""
        start, stop = self.span(rank)
        return max(0, min(stop, self.target_tokens) - start)


def target_loss(pred: Tensor, target: Tensor, weighting: Tensor, split: PairSplit, rank: int) -> Tensor:
    """Weighted flow-matching MSE over the target tokens of this rank's chunk.

    `pred`: the transformer's output on this rank's chunk `[B, chunk, C]`; `target`: the *full* packed target
    `[B, T, C]` (every rank of a CP group draws the same noise); `weighting`: `[B, 1, 1]`. The result is
    `cp * sum / (T * C)` per sample, averaged over the batch: at cp 1 the plain mean, and with gradients
    averaged over the CP group (DDP/FSDP) exactly the gradient of the full-sequence mean.
    """
    start, _ = split.span(rank)
    k = split.local_targets(rank)
    # pred[:, :0] when this rank holds only reference tokens: the loss is 0 but stays on the graph, so its
    # backward still runs the attention's collectives with the other ranks.
    err = weighting * (pred[:, :k].float() - target[:, start : start + k].float()) ** 2
    per_sample = err.reshape(err.shape[0], -1).sum(1) * (split.cp_size / (split.target_tokens * target.shape[2]))
    return per_sample.mean()


class LossInputs(Protocol):
    """What the loss reads of a micro-batch (flux_cp.data.batches.MicroBatch)."""

    target: Tensor  # this rank's chunk of (noise - latents), packed; the whole of it for pairs
    weighting: Tensor  # [B, 1, 1] per-sample loss weights (`loss_weighting`)
    pair: PairSplit | None  # pairs: how the [target; references] tokens are split over the CP group
    cp_rank: int
    prior: int  # prior preservation: the last `prior` samples are class samples
    prior_loss_weight: float


def batch_loss(pred: Tensor, batch: LossInputs) -> Tensor:
    """This rank's loss of a micro-batch, from the transformer's output on its chunk `pred`: the weighted MSE, mean
    over this rank's tokens; pairs: over the target tokens only (`target_loss`); prior preservation: the mean over
    the training samples plus `prior_loss_weight` times the mean over the class samples (module note)."""
    if batch.pair is not None:
        return target_loss(pred, batch.target, batch.weighting, batch.pair, batch.cp_rank)
    err = batch.weighting * (pred.float() - batch.target.float()) ** 2
    per_sample = err.reshape(err.shape[0], -1).mean(1)
    if batch.prior:
        own = per_sample.shape[0] - batch.prior
        return per_sample[:own].mean() + batch.prior_loss_weight * per_sample[own:].mean()
    return per_sample.mean()
