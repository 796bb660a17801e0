"""What a model family's VAE and text encoders do for the data path (`Encoders`, which each family subclasses with its
prompt encoding), and the helpers the families' prompt encodings share."""

from __future__ import annotations

import gc
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from flux_cp.placement import Placement

Tensor = torch.Tensor


class Encoders(ABC):
    """A model family's VAE and text encoders, as the encoding cache and the live data path use them. A family
    subclasses it with its prompt encoding (`prompts`, returning `text_keys`, of `text_shapes`)."""

    text_keys: tuple[str, ...] = ("prompt_embeds",)  # what `prompts` returns: the keys of a cached text entry
    text_recipe: str = ""  # what else decides the prompt embeddings (e.g. the hidden layers read): in their cache key
    tokenizer_folders: tuple[str, ...] = ()  # the model folder's tokenizers: their files' content is in the text key

    def __init__(
        self, vae: torch.nn.Module, text_encoders: dict[str, torch.nn.Module], device: torch.device, dtype: torch.dtype
    ):
        self.vae, self.device, self.dtype = vae, device, dtype
        # name -> model, in the order their fingerprints enter the text cache key
        self.text_encoders: dict[str, torch.nn.Module] = dict(text_encoders)
        # one component at a time on the accelerator (flux_cp.placement); the families load them into host memory
        self.placement = Placement({"vae": vae, **self.text_encoders}, device)
        # --vae_tiling resolved: whether the VAE encodes (training and reference images) and decodes (validation
        # images) in tiles (flux_cp.plan.encoding.tiling_choice)
        self.tiled_encode = self.tiled_decode = False

    @abstractmethod
    def prompts(self, captions: list[str], max_sequence_length: int) -> dict[str, Tensor]:
        """The captions' encodings `{name: [B, ...]}`, named as the pipeline's arguments (`text_keys`)."""

    @abstractmethod
    def text_shapes(self, max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        """The shape of each of one caption's encodings (`text_keys`): what a usable cache entry holds."""

    @torch.no_grad()
    def latents(self, pixels: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and std of the VAE latent distribution (fp32, before any normalisation)."""
        with self.placement.use("vae"), self.vae_tiles(self.tiled_encode):
            dist_ = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist
            return dist_.mean.float(), dist_.std.float()

    @contextmanager
    def vae_tiles(self, tiled: bool) -> Iterator[None]:
        """The VAE in tiles (diffusers' `use_tiling`: tiles that overlap and blend) or whole, for the body."""
        before = getattr(self.vae, "use_tiling", False)
        self.vae.use_tiling = tiled
        try:
            yield
        finally:
            self.vae.use_tiling = before

    def latent_shape(self, size: tuple[int, int]) -> tuple[int, ...]:
        """`[C, h, w]` of the latent distribution's mean (and std) of an image of `size` (w, h)."""
        config = self.vae.config
        factor = 2 ** (len(config.block_out_channels) - 1)
        return (config.latent_channels, size[1] // factor, size[0] // factor)

    def truncation_warnings(self, captions: list[str], max_sequence_length: int) -> list[str]:
        """One line per window of the prompt encoding that cuts captions, saying how many it cuts."""
        return []

    def trained_text(self, module: torch.nn.Module, captions: list[str]) -> Tensor:
        """The output of the text encoder `module` (being trained, --train_text_encoder) for `captions`, with its
        gradients: what the family's `trained_text_encoder` feeds the transformer."""
        raise NotImplementedError(f"{type(self).__name__} trains no text encoder")

    def free_text_encoders(self, keep: tuple[str, ...] = ()) -> None:
        """Free the text encoders but those named in `keep` (one being trained), which leave the placement for the
        accelerator: they run in every step from here."""
        for name in list(self.text_encoders):
            self.placement.forget(name)
            if name in keep:
                self.text_encoders[name].to(self.device)
            else:
                del self.text_encoders[name]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def truncation_line(lengths: list[int], limit: int, window: str, remedy: str) -> str | None:
    """`warning: N of M captions do not fit in <window> ...` for captions of `lengths` tokens in a window of `limit`
    (None: every caption fits)."""
    over = [n for n in lengths if n > limit]
    if not over:
        return None
    return (
        f"warning: {len(over)} of {len(lengths)} captions do not fit in {window} and are cut there (the longest needs "
        f"{max(over)} tokens): {remedy}"
    )


TEXT_BATCH = 16


def in_batches(encode, captions: list[str], size: int = TEXT_BATCH) -> dict[str, Tensor]:
    """`encode(batch)` ({name: [b, ...]}) of `captions` in batches of `size`, concatenated: where they are for one
    batch, in host memory for several (a chunk's encodings would take the accelerator's room: 1 GiB for 256
    captions of T5-XXL at 512 tokens)."""
    if len(captions) <= size:
        return encode(captions)
    parts = [{n: t.cpu() for n, t in encode(captions[i : i + size]).items()} for i in range(0, len(captions), size)]
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
