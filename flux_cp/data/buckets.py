"""Buckets and crops: every training bucket of a run (a square per `--resolution`, or aspect buckets whose image-token
counts divide by lcm(cp, 8), so that CP sizes 1, 2, 4 and 8 train on the same buckets and every bucket splits evenly
over a CP group: docs/design.md, data flow, rule 2), the bucket each image trains in at each resolution, and its crop
(drawn from a generator keyed by the seed and the image, never by the rank)."""

from __future__ import annotations

import math

import torch

from flux_cp.errors import UsageError
from flux_cp.rng import Stream, generator


def bucket_divisor(cp_size: int) -> int:
    """Image-token counts of buckets divide by this: lcm(cp, 8), so that runs with CP sizes 1, 2, 4 and 8 use
    the same buckets (and so the same data), and every bucket splits evenly over the CP group."""
    return math.lcm(cp_size, 8)


def bucket_sizes(resolution: int, divisor: int, max_aspect: float = 2.0) -> list[tuple[int, int]]:
    """(width, height) buckets of about resolution^2 pixels (within 25%), multiples of 16 px, widths in steps
    of 64 px (16 px for small resolutions), whose image-token count (w/16 * h/16) divides by `divisor`.
    Square (or the nearest to square) first."""
    side = resolution // 16
    area = side * side
    step = 4 if side >= 32 else 1
    buckets: set[tuple[int, int]] = set()
    for w in range(max(1, math.ceil(side / max_aspect)), int(side * max_aspect) + 1):
        if (w - side) % step:
            continue
        h = max(1, round(area / w))
        options = [hh for hh in range(max(1, h - divisor), h + divisor + 1) if (w * hh) % divisor == 0]
        if options:
            hh = min(options, key=lambda x: (abs(w * x - area), x))
            if 1 / max_aspect <= w / hh <= max_aspect and abs(w * hh - area) <= 0.25 * area:
                buckets.add((w * 16, hh * 16))
    return sorted(buckets, key=lambda b: (abs(math.log(b[0] / b[1])), b))


def nearest_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> int:
    ratio = math.log(width / height)
    return min(range(len(buckets)), key=lambda i: (abs(math.log(buckets[i][0] / buckets[i][1]) - ratio), i))


def crop_box(size: tuple[int, int], target: tuple[int, int], center: bool, gen: torch.Generator):
    """Resize-to-cover scale and crop box (left, top) for an image of `size` into `target` (w, h)."""
    (w, h), (tw, th) = size, target
    scale = max(tw / w, th / h)
    rw, rh = max(tw, round(w * scale)), max(th, round(h * scale))
    if center:
        left, top = (rw - tw) // 2, (rh - th) // 2
    else:
        left = int(torch.randint(0, rw - tw + 1, (1,), generator=gen))
        top = int(torch.randint(0, rh - th + 1, (1,), generator=gen))
    return (rw, rh), (left, top)


def run_buckets(
    resolutions: tuple[int, ...], cp_size: int, aspect_buckets: bool
) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Every training bucket of a run and, per resolution, the indices of its own (`training_buckets` of each;
    a size two resolutions share is one bucket)."""
    buckets: list[tuple[int, int]] = []
    per_resolution = []
    for resolution in resolutions:
        ids = []
        for size in training_buckets(resolution, cp_size, aspect_buckets):
            if size not in buckets:
                buckets.append(size)
            ids.append(buckets.index(size))
        per_resolution.append(ids)
    return buckets, per_resolution


def training_buckets(resolution: int, cp_size: int, aspect_buckets: bool) -> list[tuple[int, int]]:
    """(width, height) of every training bucket: one square of `resolution`, or aspect buckets whose token count
    divides by the CP size."""
    buckets = bucket_sizes(resolution, bucket_divisor(cp_size)) if aspect_buckets else [(resolution, resolution)]
    if not buckets:
        raise UsageError(
            f"--aspect_buckets: no bucket of about {resolution}^2 pixels has an image-token count divisible by "
            f"{bucket_divisor(cp_size)} (lcm of --cp_size and 8): use a larger --resolution, or square crops",
            agreed=True,
        )
    return buckets


class Geometry:
    """Where each image trains: at each of its placements (one per --resolution), in the bucket of that
    resolution nearest its aspect ratio (`run_buckets`), cropped where its crop draw says. An encoded sample is
    (image, placement): index `placement * images + image`."""

    def __init__(self, buckets: list[tuple[int, int]], placements: list[list[int]] | None = None):
        self.buckets = list(buckets)
        self.placements = placements or [list(range(len(self.buckets)))]  # bucket indices, per placement

    def bucket_of(self, size: tuple[int, int], placement: int = 0) -> int:
        ids = self.placements[placement]
        if len(ids) == 1:
            return ids[0]
        return ids[nearest_bucket(size[0], size[1], [self.buckets[b] for b in ids])]

    def crop_generator(self, seed: int, image: int, placement: int, epoch: int | None = None) -> torch.Generator:
        """The random crop of `image` at `placement`: drawn once per image for the cache, per epoch live (`epoch`).
        The first placement has the keys a run of one resolution has always had."""
        keys = (image,) if epoch is None else (image, epoch)
        return generator(Stream.CROP, seed, *keys, *((placement,) if placement else ()))


class ClassGeometry(Geometry):
    """Class images of prior preservation: each joins batches of every bucket the training images use, so it is
    placed in each of them (`used`: bucket indices), its crop drawn per class image and bucket."""

    def __init__(self, buckets: list[tuple[int, int]], used: list[int]):
        super().__init__(buckets, [[b] for b in used])

    def crop_generator(self, seed: int, image: int, placement: int, epoch: int | None = None) -> torch.Generator:
        keys = (image, self.placements[placement][0]) + (() if epoch is None else (epoch,))
        return generator(Stream.CLASS_CROP, seed, *keys)
