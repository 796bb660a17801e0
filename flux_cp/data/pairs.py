"""Pair sequences (a target image with one or more reference images): the target's noisy latent tokens followed by
each reference's clean latent tokens, with the model family's position ids of each reference (`Family.reference_ids`,
as the family's editing pipeline gives them).

The split: text tokens are cut into `cp` equal chunks, and the image segment `[target; reference_1; ...;
reference_k]` is cut into `cp` equal contiguous chunks *as one sequence* (exactly what `cp.full_sequence_io` does to
the pipeline's inputs at inference). A chunk may hold target tokens, reference tokens or both; only `target + all
references` must divide by the CP size, not each part. Which tokens each rank holds (`PairSplit`) and the loss over
the target tokens, exact however the target/reference boundary falls: flux_cp.loss.
"""

from __future__ import annotations

from collections.abc import Sequence
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
