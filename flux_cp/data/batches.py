"""Micro-batches for the flow-matching step: which samples this rank holds at global micro-step m, their
noisy latents, timesteps and targets, split into this rank's sequence chunk.

With prior preservation a global batch of G slots is followed by G class slots (slot G + s holds the class image
paired with slot s), so a rank holding slots s..s+b-1 also holds class slots G+s..G+s+b-1: which samples are class
samples, and their noise, do not depend on the layout."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cp.comm import shard
from flux_cp.data.encode import TrainingData, reference_count, reference_key
from flux_cp.data.flow import per_sample_draws
from flux_cp.data.pairs import image_segment
from flux_cp.data.schedule import BatchSchedule
from flux_cp.loss import PairSplit, loss_weighting
from flux_cp.rng import Stream, generator

if TYPE_CHECKING:
    from flux_cp.config.training import DataConfig, TrainConfig
    from flux_cp.data.encode import ClassSamples
    from flux_cp.families.base import Family
    from flux_cp.layout import Layout

Tensor = torch.Tensor


@dataclass
class MicroBatch:
    """This rank's share of one micro-step: the transformer's inputs, and what the loss reads (flux_cp.loss)."""

    inputs: dict  # keyword arguments of the transformer's forward, this rank's chunk
    target: Tensor  # this rank's chunk of (noise - latents), packed; the whole of it for pairs
    weighting: Tensor  # [B, 1, 1] per-sample loss weights
    epoch: int
    image_tokens: int  # per sample, whole sequence (target and references for pairs)
    text_tokens: int
    pair: PairSplit | None = None  # pairs: how the [target; references] tokens are split over the CP group
    cp_rank: int = 0
    prior: int = 0  # prior preservation: the last `prior` samples are class samples
    prior_loss_weight: float = 1.0
    captions: list[str] | None = None  # --train_text_encoder: each sample's caption ("" where dropped), in order


class Batches:
    """This rank's micro-batch of every global micro-step, built from `data` in the order of `schedule`."""

    def __init__(
        self,
        data: TrainingData,
        schedule: BatchSchedule,
        layout: Layout,
        data_config: DataConfig,
        train: TrainConfig,
        noise_scheduler,
        family: Family,
        normalize,
        guidance: bool,
        device: torch.device,
        input_dtype: torch.dtype = torch.float32,
        classes: ClassSamples | None = None,
        captions: tuple[Callable[[int], str], str | None] | None = None,
    ):
        """`captions` (--train_text_encoder): the caption of a sample index and the class images' prompt, for
        `MicroBatch.captions`."""
        self.data, self.schedule, self.layout = data, schedule, layout
        self.captions = captions
        self.random_flip, self.train = data_config.random_flip, train
        self.caption_dropout = data_config.caption_dropout
        self.classes, self.prior_loss_weight = classes, data_config.prior_loss_weight  # prior preservation
        self.vae_encode_mode = data_config.vae_encode_mode  # None: the family's default for the data
        self.noise_scheduler = noise_scheduler
        self.family, self.normalize = family, normalize  # the model's tokens; VAE latents -> the model's latents
        self.guidance, self.device = guidance, device
        self.input_dtype = input_dtype  # the transformer's compute dtype (inputs are cast here, not by FSDP)
        self._ahead: tuple[int, MicroBatch] | None = None

    def slots(self) -> range:
        """Positions of this rank's samples in the global batch (a CP group shares its dp rank's slice)."""
        bs = self.train.train_batch_size
        return range(self.layout.dp_rank * bs, (self.layout.dp_rank + 1) * bs)

    def _load(self, i: int, epoch: int) -> dict:
        gen = generator(Stream.FLIP, self.train.seed, epoch, i)
        flip = self.random_flip and bool(torch.rand(1, generator=gen) < 0.5)
        return self.data.load(i, flip, epoch)

    def dropped(self, m: int, slot: int) -> bool:
        """--caption_dropout: whether global slot `slot` of micro-step m trains on the empty caption."""
        p = self.caption_dropout
        return p > 0 and bool(torch.rand(1, generator=generator(Stream.CAPTION_DROPOUT, self.train.seed, m, slot)) < p)

    def _samples(self, m: int, epoch: int, batch: list[int]) -> tuple[list[dict], list[int], list[str] | None]:
        """This rank's samples of micro-step m (its class samples after them), their global slots, and with
        `captions` their captions."""
        slots = list(self.slots())
        samples = [self._load(batch[s], epoch) for s in slots]
        captions = [self.captions[0](batch[s]) for s in slots] if self.captions else None
        for k, s in enumerate(slots):
            if self.dropped(m, s):  # the empty caption's entries in place of the caption's
                samples[k].update(self.data.text(""))
                if captions is not None:
                    captions[k] = ""
        if self.classes is None:
            return samples, slots, captions
        g, bucket = self.schedule.global_batch, self.data.buckets[batch[0]]
        chosen = self.schedule.class_images(m, self.classes.count)
        samples += [self.classes.load(chosen[s], bucket, epoch) for s in slots]  # never flipped, as diffusers'
        if captions is not None:
            captions += [self.captions[1]] * len(slots)
        return samples, slots + [g + s for s in slots], captions

    def micro(self, m: int) -> MicroBatch:
        """Global micro-step m's batch, as `prefetch` built it if it was asked for m."""
        if self._ahead is not None and self._ahead[0] == m:
            batch, self._ahead = self._ahead[1], None
            return batch
        return self._build(m)

    def prefetch(self, m: int) -> None:
        """Build micro-step m's batch now, while the GPU still runs the step before. Reading the samples and drawing
        the noise on the host takes ~20 ms at 2048 px (20.8 ms in a profiled step); built at the start of its own
        step, the GPU would wait for it (a batch depends on m alone, so building it early changes nothing)."""
        self._ahead = (m, self._build(m))

    def _to_device(self, t: Tensor) -> Tensor:
        # From pinned memory the host does not wait for the kernels queued before the copy (from pageable memory it
        # does, and the prefetch would wait for the backward it is meant to run beside).
        if self.device.type == "cuda" and t.device.type == "cpu":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _build(self, m: int) -> MicroBatch:
        a, dev, group = self.train, self.device, self.layout.cp_group
        epoch, batch = self.schedule.batch(m)
        samples, slots, captions = self._samples(m, epoch, batch)
        stack = {k: self._to_device(torch.stack([s[k] for s in samples])) for k in samples[0]}
        mean, std = stack["latent_mean"], stack["latent_std"]
        refs = [stack.pop(reference_key(j)) for j in range(reference_count(stack))]  # one count per batch
        family, pairs = self.family, bool(refs)
        # Noise and timesteps per *global* slot: the same for every layout and every rank of a CP group. The
        # flow-matching noise is drawn in the model's latent space, as diffusers' examples draw it.
        shape = tuple(mean.shape[1:])
        generators = [generator(Stream.NOISE, a.seed, m, s) for s in slots]
        draws = per_sample_draws(generators, shape, a, self.noise_scheduler, family.model_latent_shape(shape))
        weighting = loss_weighting(a.weighting_scheme, draws["sigmas"])
        draws = {k: self._to_device(v) for k, v in draws.items()}
        sample = (self.vae_encode_mode or family.default_vae_encode_mode(pairs)) == "sample"
        latents = self.normalize(mean + std * draws["eps"] if sample else mean)
        noise = draws["noise"]
        sigmas = draws["sigmas"].view(-1, 1, 1, 1)
        noisy = (1.0 - sigmas) * latents + sigmas * noise
        h, w = latents.shape[-2:]
        embeds = stack["prompt_embeds"]
        dt = self.input_dtype
        target, hidden, ids, pair = family.pack(noise - latents), family.pack(noisy), family.image_ids(h, w, dev), None
        if pairs:  # the clean tokens of each reference, in order, follow the noisy target tokens
            refs = [self.normalize(r) for r in refs]
            hidden, ids = image_segment(
                hidden, [family.pack(r) for r in refs], (h, w), [tuple(r.shape[-2:]) for r in refs], family
            )
            pair = PairSplit(target.shape[1], hidden.shape[1] - target.shape[1], self.layout.cp)
        text = {k: v.to(dt) for k, v in stack.items() if k not in ("latent_mean", "latent_std")}
        inputs = family.transformer_inputs(
            hidden=hidden.to(dt),
            img_ids=ids,
            text=text,
            txt_ids=family.text_ids(embeds.shape[1], dev),
            timestep=draws["timesteps"] / 1000.0,
            guidance=torch.full((len(slots),), a.guidance_scale, device=dev) if self.guidance else None,
        )
        # this rank's chunk of each input the family's CP plan names, along its sequence dimension
        inputs = {k: shard(v, family.cp_plan[k], group) if k in family.cp_plan else v for k, v in inputs.items()}
        return MicroBatch(
            inputs=inputs,
            target=target if pair else shard(target, 1, group),
            weighting=self._to_device(weighting).view(-1, 1, 1),
            epoch=epoch,
            image_tokens=hidden.shape[1],
            text_tokens=embeds.shape[1],
            pair=pair,
            cp_rank=self.layout.cp_rank,
            prior=0 if self.classes is None else len(slots) // 2,
            prior_loss_weight=self.prior_loss_weight,
            captions=captions,
        )
