"""Pair sequences (FLUX.1 Kontext, FLUX.2 with one or more reference images): the target image's noisy latent tokens
followed by each reference image's clean latent tokens, with the family's reference position ids (FLUX.1 Kontext:
first coordinate 1, as diffusers' `FluxKontextPipeline`; FLUX.2: time coordinate 10, 20, 30, ... for references 1,
2, 3, ..., as `Flux2Pipeline`); how a CP group splits that image segment; and the flow-matching loss over the
target tokens only.

The split: text tokens are cut into `cp` equal chunks as for FLUX.1, and the image segment `[target;
reference_1; ...; reference_k]` is cut into `cp` equal contiguous chunks *as one sequence* (exactly what
`cp.full_sequence_io` does to the pipeline's inputs at inference). A chunk may hold target tokens, reference tokens
or both. Only `target + all references` must divide by the CP size, not each part, and the loss on rank r is
`cp * sum(squared errors of r's target tokens) / (target tokens * channels)`, so the mean over the group is
the full-sequence mean however the target/reference boundary falls (docs/design.md, Kontext).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flux_cp.families.base import Family

Tensor = torch.Tensor


def image_segment(
    target: Tensor,
    references: Sequence[Tensor],
    target_hw: tuple[int, int],
    reference_hws: Sequence[tuple[int, int]],
    family: Family,
) -> tuple[Tensor, Tensor]:
    """The full image segment: packed target tokens `[B, T, C]`, then each reference's packed tokens `[B, R_j, C]`
    in order, with their ids `[T + sum R_j, k]` (`family`'s `image_ids`, and `reference_ids` of reference j).
    `*_hw(s)` are the model latents' (not the tokens') heights and widths."""
    for reference in references:
        if target.shape[0] != reference.shape[0] or target.shape[2] != reference.shape[2]:
            raise ValueError(
                f"target tokens {tuple(target.shape)} and reference tokens {tuple(reference.shape)} differ in batch "
                "size or channels"
            )
    dev = target.device
    ids = [family.image_ids(*target_hw, device=dev)]
    ids += [family.reference_ids(*hw, device=dev, index=j) for j, hw in enumerate(reference_hws)]
    names = ["target"] + [f"reference {j + 1}" if len(references) > 1 else "reference" for j in range(len(references))]
    for name, t, part, (h, w) in zip(names, [target, *references], ids, [target_hw, *reference_hws]):
        if t.shape[1] != part.shape[0]:
            raise ValueError(f"{name} has {t.shape[1]} tokens, but a {h}x{w} latent packs to {part.shape[0]}")
    return torch.cat([target, *references], dim=1), torch.cat(ids, dim=0)


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
