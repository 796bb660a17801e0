"""Which samples make up each global batch: the batch schedule (every sample, each `--repeats` times, in buckets of
one size, in an order drawn from the seed and the epoch alone), and which class image each batch slot trains beside
with prior preservation. The global batch of micro-step m is cut into dp slices; a CP group shares its dp rank's
slice (flux_cp.data.batches), so the data a run sees does not depend on its layout."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flux_cp.errors import UsageError
from flux_cp.rng import Stream, generator


def batch_groups(buckets: list[int], counts: list[int]) -> list[int]:
    """What each global batch holds one kind of (BatchSchedule's groups): the bucket, and where samples have
    different numbers of reference images also that number, so that a batch is one sequence length with one set of
    position ids (Flux2Transformer2DModel reads the ids of the first sample for all). The bucket alone when every
    sample has as many references: the grouping, and so the data order, of runs of one reference count."""
    if len(set(counts)) <= 1:
        return list(buckets)
    stride = max(buckets) + 1
    return [b + stride * c for b, c in zip(buckets, counts)]


# Samples in one epoch (images x --resolution sizes x --repeats) at most: the schedule of an epoch holds a few
# integers per sample (about 2 GB at this bound).
EPOCH_SAMPLES_MAX = 50_000_000


def check_epoch_size(images: int, resolutions: int, repeats: int, what: str = "images") -> None:
    """Refuse an epoch too long to schedule (before any model loads), naming the factors (`what`: the first's)."""
    samples = images * resolutions * repeats
    if samples > EPOCH_SAMPLES_MAX:
        factors = ((resolutions, "--resolution sizes"), (repeats, "--repeats"))
        parts = [f"{images} {what}"] + [f"{n} {name}" for n, name in factors if n > 1]
        raise UsageError(
            f"an epoch would hold {samples} samples ({' x '.join(parts)}), more than {EPOCH_SAMPLES_MAX}: lower "
            "--repeats (a run's length is --max_train_steps or --num_train_epochs)",
            agreed=True,  # every rank lists the same data
        )


class Repeats(Sequence):
    """`base` `repeats` times over, without a list of every copy: --repeats. `counts`: each item's own copies in one
    round (kohya's N_name folders), None for one each. A round lists its items in turns: turn k the items (in order)
    that have more than k copies; with one count c for all, `counts` lists exactly what `repeats` c would. The round
    repeats `repeats` times; item t is `base[self.position(t)]`."""

    def __init__(self, base: Sequence[int], repeats: int, counts: Sequence[int] | None = None):
        self.base, self.repeats = list(base), repeats
        self.order: torch.Tensor | None = None  # a round's items' positions in `base` (None: base itself)
        if counts is not None and any(c != 1 for c in counts):
            counts = torch.as_tensor(list(counts), dtype=torch.long)
            self.order = torch.cat([torch.nonzero(counts > k).flatten() for k in range(int(counts.max()))])

    @property
    def round(self) -> torch.Tensor:
        """One round's items (`base` at the positions of `order`)."""
        base = torch.as_tensor(self.base, dtype=torch.long)
        return base if self.order is None else base[self.order]

    def __len__(self) -> int:
        return (len(self.base) if self.order is None else len(self.order)) * self.repeats

    def position(self, index: int) -> int:
        """The position in `base` of item `index`."""
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        if self.order is None:
            return index % len(self.base)
        return int(self.order[index % len(self.order)])

    def __getitem__(self, index: int) -> int:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.base[self.position(index)]


class BatchSchedule:
    """Global batches of one bucket each, reshuffled every epoch; a pure function of (seed, epoch). With prior
    preservation, the class image of each slot too (`class_images`). `buckets`: each sample's group (a `Repeats`
    for --repeats: the copies of a sample are never listed one by one, the epoch's order is held as tensors)."""

    def __init__(self, buckets: Sequence[int], global_batch: int, seed: int):
        self.global_batch = global_batch
        self.seed = seed
        if isinstance(buckets, Repeats):
            groups, repeats = buckets.round, buckets.repeats
        else:
            groups, repeats = torch.as_tensor(list(buckets), dtype=torch.long), 1
        size = len(groups)
        copies = torch.arange(repeats, dtype=torch.long)[:, None] * size
        # A group's samples in ascending order: item i of the round in copy r is r * size + i.
        self.by_bucket: dict[int, torch.Tensor] = {
            b: (copies + torch.nonzero(groups == b).flatten()[None, :]).flatten() for b in sorted(set(groups.tolist()))
        }
        self.samples = size * repeats
        self.batches_per_epoch = sum(len(v) // global_batch for v in self.by_bucket.values())
        if self.batches_per_epoch == 0:
            largest = max(len(v) for v in self.by_bucket.values())
            raise UsageError(
                f"no global batch can be formed: the global batch is {global_batch} samples (--train_batch_size x "
                f"data-parallel size) but an epoch has {self.samples} samples"
                + (f" and the largest aspect bucket holds {largest}" if len(self.by_bucket) > 1 else "")
                + "; lower --train_batch_size, use fewer data-parallel ranks, or add images"
            )
        self._epoch_cache: tuple[int, torch.Tensor] | None = None

    def unfilled(self) -> dict[int, int]:
        """{group: its samples} of the groups too small for one global batch: their samples are never trained on."""
        return {b: len(v) for b, v in sorted(self.by_bucket.items()) if len(v) < self.global_batch}

    def _epoch(self, epoch: int) -> torch.Tensor:
        """The epoch's global batches `[batches, global_batch]` of sample indices, in training order."""
        if self._epoch_cache and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        g, batches = self.global_batch, []
        for b in sorted(self.by_bucket):
            idx = self.by_bucket[b]
            shuffled = idx[torch.randperm(len(idx), generator=generator(Stream.BUCKET_ORDER, self.seed, epoch, b))]
            n = len(shuffled) // g
            batches.append(shuffled[: n * g].view(n, g))
        batches = torch.cat(batches)
        order = torch.randperm(len(batches), generator=generator(Stream.BATCH_ORDER, self.seed, epoch))
        self._epoch_cache = (epoch, batches[order])
        return self._epoch_cache[1]

    def epoch(self, epoch: int) -> list[list[int]]:
        return self._epoch(epoch).tolist()

    def batch(self, micro_step: int) -> tuple[int, list[int]]:
        """(epoch, global batch) of global micro-step `micro_step`."""
        epoch, k = divmod(micro_step, self.batches_per_epoch)
        return epoch, self._epoch(epoch)[k].tolist()

    def class_images(self, micro_step: int, count: int) -> list[int]:
        """The class image (of `count`) that each slot of global batch `micro_step` trains beside its own sample
        (prior preservation). The run's slots, in order, take the class images in turn, each round through all of
        them in an order of its own (keyed by the seed and the round): every class image is used equally often,
        and which one a slot gets depends on neither the layout nor the length of an epoch."""
        out = []
        for s in range(self.global_batch):
            round_, k = divmod(micro_step * self.global_batch + s, count)
            out.append(self._class_order(round_, count)[k])
        return out

    def _class_order(self, round_: int, count: int) -> list[int]:
        cached = self.__dict__.get("_class_cache")
        if cached is None or cached[:2] != (round_, count):
            order = torch.randperm(count, generator=generator(Stream.CLASS_ORDER, self.seed, round_)).tolist()
            self._class_cache = cached = (round_, count, order)
        return cached[2]
