"""VAE latents and prompt embeddings: computed once, spread over all ranks, cached on disk as safetensors
keyed by content and settings (a changed image, caption, crop, resolution or model recomputes only what
changed), then the text encoders are freed so GPU memory goes to the transformer.

The cache holds the VAE's latent distribution (mean, std), so a latent is still sampled every step as in
diffusers' examples; with --random_flip both orientations are cached, and a random crop is drawn once per
image. `--no_cache` encodes every batch live instead (per-epoch random crops, encoders stay loaded).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm

from flux_cp import distributed, files
from flux_cp.bars import on_terminal
from flux_cp.data.buckets import Geometry, crop_box
from flux_cp.data.schedule import Repeats
from flux_cp.data.sources import ImageSource
from flux_cp.errors import UsageError
from flux_cp.families.components import component_folder, files_fingerprint, model_fingerprint
from flux_cp.families.encoders import Encoders
from flux_cp.images import DECODER_VERSION, to_pixels
from flux_cp.terminal import printable

if TYPE_CHECKING:
    from PIL import Image

    from flux_cp.config.training import DataConfig

Tensor = torch.Tensor
logger = logging.getLogger("flux_cp")


def component_fingerprints(
    encoders: Encoders, path: str, revision: str | None, cache_dir: str | None = None
) -> dict[str, str]:
    """{component: fingerprint} of the VAE and every text encoder (named as the model folder's subfolders)."""
    parts = {"vae": encoders.vae, **encoders.text_encoders}
    return {name: model_fingerprint(m, component_folder(path, name, revision, cache_dir)) for name, m in parts.items()}


def tokenizer_fingerprints(encoders: Encoders, path: str, revision: str | None, cache_dir: str | None = None) -> str:
    """The content of the model's tokenizers (`Encoders.tokenizer_folders`): another vocabulary or template gives
    other token ids, so other prompt embeddings."""
    return "".join(
        files_fingerprint(component_folder(path, name, revision, cache_dir)) for name in encoders.tokenizer_folders
    )


def encoder_fingerprints(
    components: dict[str, str], encoders: Encoders, tokenizers: str = "", variant: str | None = None
) -> tuple[str, str]:
    """(VAE, text encoders) fingerprints: the cache keys of latents and of prompt embeddings include them (every
    text encoder's, in the family's order, its `text_recipe` and the tokenizers' content; the VAE's with whether it
    encodes in tiles and the precision it computes in, which the latents, cached in fp32, do not show; both with the
    weights' --variant, whose files the components' fingerprints do not tell apart from the others of their folder).
    `components`: `component_fingerprints`; `tokenizers`: `tokenizer_fingerprints`."""
    text = "".join(components[name] for name in encoders.text_encoders)
    tiled = ":tiled" if getattr(encoders, "tiled_encode", False) else ""  # tiles blend: other latents (--vae_tiling)
    dtype = getattr(encoders, "dtype", None)
    computed = f":{str(dtype).removeprefix('torch.')}" if dtype is not None else ""
    weights = f":variant={variant}" if variant else ""
    return components["vae"] + tiled + computed + weights, text + encoders.text_recipe + tokenizers + weights


LATENT_KEYS = ("latent_mean", "latent_std")


# safetensors' names of the dtypes cache entries hold
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def _usable(path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype | None = None) -> bool:
    """A cache entry that exists and is whole: its header reads, names the keys of `shapes` with those shapes (and
    `dtype`, when given), and its file is as long as the header says (safetensors checks that on open). Another
    entry is removed with a line naming what differs, to be recomputed (an entry of the right names but another
    shape or dtype would fail only at the first step, or train in another precision)."""
    if not path.is_file():
        return False
    want = _SAFETENSORS_DTYPES.get(dtype) if dtype is not None else None
    try:
        with safe_open(str(path), "pt") as f:
            if not set(shapes) <= set(f.keys()):
                problem = f"it holds {sorted(f.keys())}, not {list(shapes)}"
            else:
                found = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in shapes}
                wrong = [
                    f"shape {k} {list(found[k][0])} instead of {list(v)}" for k, v in shapes.items() if found[k][0] != v
                ]
                wrong += [f"dtype {k} {found[k][1]} instead of {want}" for k in shapes if want and found[k][1] != want]
                if not wrong:
                    return True
                problem = "cannot be used (" + ", ".join(wrong)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for every kind of damage
        problem = f"cannot be read ({type(e).__name__}: {e}"
    logger.warning(f"cache entry {path} {printable(problem)}): recomputing it")
    path.unlink(missing_ok=True)
    return False


def _load(path: Path) -> dict[str, Tensor]:
    try:
        return load_file(path)
    except Exception as err:  # noqa: BLE001 - removed or damaged after this run checked it
        raise UsageError(
            f"cache entry {path} cannot be read ({type(err).__name__}: {err}): delete it and resume "
            "(--resume_from_checkpoint latest); it is recomputed at start"
        ) from None


def _sha(*parts) -> str:
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:32]


def reference_key(j: int) -> str:
    """The key of reference image j's latent in a sample's encodings: `reference_latent` for the first (the one
    reference of a FLUX.1 Kontext pair), `reference_latent_2`, `reference_latent_3`, ... for FLUX.2's further ones."""
    return "reference_latent" if j == 0 else f"reference_latent_{j + 1}"


def reference_count(sample: dict) -> int:
    """How many reference latents a sample's encodings hold (`reference_key` 0, 1, ... in turn)."""
    j = 0
    while reference_key(j) in sample:
        j += 1
    return j


class TrainingData(Protocol):
    """What the batch builder reads, cached or live: the bucket of every sample, and one sample's encodings
    (`latent_mean`, `latent_std` `[C, H, W]`, the text entries of the family's `Encoders.prompts`, e.g.
    `prompt_embeds` `[L, D]`; for editing samples also each reference's mean latent `[C, H, W]` with the target's
    crop and flip, under `reference_key(j)`), given whether it is flipped and the epoch (for crops drawn per epoch);
    and the text entries of a caption encoded up front (the empty caption of --caption_dropout)."""

    buckets: list[int]

    def load(self, index: int, flip: bool, epoch: int) -> dict[str, Tensor]: ...

    def text(self, caption: str) -> dict[str, Tensor]: ...


class Repeated:
    """--repeats and kohya's N_name folders: `data` with every sample `repeats` times per epoch, times its own count
    of `counts` (one per sample of `data`; None: one each), as `flux_cp.data.schedule.Repeats` orders them (without
    counts, sample t is `data`'s t mod its length). The copies share their encodings (and so their crop); each has its
    own flip, noise and timestep."""

    def __init__(self, data: TrainingData, repeats: int, counts: list[int] | None = None):
        self.data = data
        self.buckets = Repeats(data.buckets, repeats, counts)  # not a list of every copy: an epoch may hold millions

    def position(self, index: int) -> int:
        """The sample of `data` that sample `index` is a copy of."""
        return self.buckets.position(index)

    def load(self, index: int, flip: bool, epoch: int) -> dict[str, Tensor]:
        return self.data.load(self.position(index), flip, epoch)

    def text(self, caption: str) -> dict[str, Tensor]:
        return self.data.text(caption)


class EncodedData:
    """The cache's table: per-sample cache keys and buckets for the whole data set (identical on every rank).
    Its crops were drawn once, at encoding time, so `load` does not depend on the epoch."""

    def __init__(
        self,
        cache_dir: Path,
        entries: list[dict],
        computed: int = 0,
        texts: dict[str, str] | None = None,
        computed_texts: int = 0,
    ):
        self.cache_dir = cache_dir
        self.entries = entries
        self.buckets = [e["bucket"] for e in entries]
        self.computed = computed  # encodings computed by this run (the rest came from the cache) ...
        self.computed_texts = computed_texts  # ... of which caption embeddings (the others are image latents)
        self.texts = texts or {}  # caption -> cache key of the captions encoded up front

    def text(self, caption: str) -> dict[str, Tensor]:
        return _load(self.cache_dir / "text" / f"{self.texts[caption]}.safetensors")

    def load(self, index: int, flip: bool, epoch: int) -> dict[str, Tensor]:
        e = self.entries[index]
        lat = _load(self.cache_dir / "latents" / f"{e['latents'][int(flip) % len(e['latents'])]}.safetensors")
        txt = _load(self.cache_dir / "text" / f"{e['text']}.safetensors")
        for j, keys in enumerate(e.get("references", ())):  # a reference's latent is its distribution's mean
            ref = keys[int(flip) % len(keys)]
            txt[reference_key(j)] = _load(self.cache_dir / "latents" / f"{ref}.safetensors")["latent_mean"]
        return {**lat, **txt}


def _decode(source: ImageSource, i: int, reference: bool = False, ref_index: int = 0) -> tuple[Image.Image, str]:
    """Sample i's image (or its reference `ref_index`), decoded, and the hash of its bytes (the cache key's part);
    a UsageError naming the file when it cannot be read or decoded."""
    try:
        raw = source.raw_bytes(i, reference, ref_index)
    except OSError as e:
        what = "reference image" if reference else "image"
        raise UsageError(f"cannot read {what} {source.where(i, reference, ref_index)}: {e.strerror or e}") from None
    return source.load(i, raw, reference, ref_index), hashlib.sha256(raw).hexdigest()


def encode_dataset(
    source: ImageSource,
    encoders: Encoders,
    geometry: Geometry,
    data: DataConfig,
    seed: int,
    cache_dir: Path,
    fingerprints: tuple[str, str],
    rank: int,
    world: int,
    captions: tuple[str, ...] = (),
    flips: bool | None = None,
) -> EncodedData:
    """Encode what is not cached yet (rank r takes images r, r+world, ...), then share the table: one entry per image
    and placement of `geometry` (index `placement * len(source) + image`). `captions`: encoded too, for
    `EncodedData.text`. `flips`: whether flipped latents are encoded (default: --random_flip)."""
    vae_fp, text_fp = fingerprints
    variants = (False, True) if (data.random_flip if flips is None else flips) else (False,)
    n = len(source)
    mine = list(range(rank, n, world))
    entries: dict[int, dict] = {}
    errors: list[str] = []
    pending_text: dict[str, str] = {}
    texts = {c: _sha(c, data.max_sequence_length, text_fp) for c in captions}
    computed, text_keys = 0, []  # latents, and captions' keys, encoded here
    text_shapes = encoders.text_shapes(data.max_sequence_length)
    text_dtype = getattr(encoders, "dtype", None)  # the prompt embeddings are cached in the encoders' dtype
    # (no bar in a log file: the line after it says what was encoded)
    bar = tqdm(mine, desc="encoding (this rank's share)", disable=rank != 0 or not on_terminal(), dynamic_ncols=True)
    try:  # a cache that cannot be written (full disk, permissions) ends as one line, on every rank alike
        for caption, tkey in texts.items() if rank == 0 else ():
            if not _usable(cache_dir / "text" / f"{tkey}.safetensors", text_shapes, text_dtype):
                pending_text[tkey] = caption
        for i in bar:
            try:
                img, img_hash = _decode(source, i)
                # Every reference gets the target's resize, crop and flip, so they stay aligned with it (and each
                # has the target's token count).
                images = [("latents", img, img_hash)]
                images += [(j, *_decode(source, i, True, j)) for j in range(source.reference_count(i))]
            except UsageError as e:
                errors.append(str(e))
                continue
            caption = source.samples[i].caption
            tkey = _sha(caption, data.max_sequence_length, text_fp)
            cached = cache_dir / "text" / f"{tkey}.safetensors"
            if tkey not in pending_text and not _usable(cached, text_shapes, text_dtype):
                pending_text[tkey] = caption
            for placement in range(len(geometry.placements)):
                bucket = geometry.bucket_of(img.size, placement)
                target = geometry.buckets[bucket]
                crop = geometry.crop_generator(seed, i, placement)
                resized, offset = crop_box(img.size, target, data.center_crop, crop)
                entry: dict = {"bucket": bucket}
                latent = encoders.latent_shape(target)
                for name, image, digest in images:
                    keys = []
                    for flip in variants:
                        key = _sha(digest, target, resized, offset, flip, vae_fp, DECODER_VERSION)
                        path = cache_dir / "latents" / f"{key}.safetensors"
                        if not _usable(path, dict.fromkeys(LATENT_KEYS, latent), torch.float32):
                            mean, std = encoders.latents(to_pixels(image, target, resized, offset, flip)[None])
                            files.write_safetensors(path, {"latent_mean": mean[0], "latent_std": std[0]})
                            computed += 1
                        keys.append(key)
                    # the file's content goes into the data set's identity (resume)
                    if name == "latents":
                        entry["latents"], entry["latents_sha"] = keys, digest
                    else:  # reference `name`, in order
                        entry.setdefault("references", []).append(keys)
                        entry.setdefault("reference_sha", []).append(digest)
                entries[placement * n + i] = {**entry, "text": tkey}
        # The captions after the images: the VAE is on the accelerator for the images, then each text encoder for the
        # captions (flux_cp.placement), each moved there once per TEXT_CHUNK captions rather than once per image.
        text_keys = sorted(pending_text)
        _encode_texts(encoders, pending_text, data.max_sequence_length, cache_dir)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        errors.append(
            f"cannot write the encoding cache under --encodings_dir {cache_dir}{where}: {e.strerror or e}. Free space "
            "there, choose another --encodings_dir, or pass --no_cache"
        )
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    distributed.check_all_ranks(not errors, "; ".join(errors[:5]) + more)

    merged: dict[int, dict] = {}
    for table in distributed.all_gather(entries):
        merged.update(table)
    for index, e in merged.items():
        source.note_digest(index % n, e.pop("latents_sha"))
        for j, digest in enumerate(e.pop("reference_sha", ())):
            source.note_digest(index % n, digest, True, j)
    shares = distributed.all_gather((computed, text_keys))
    # (a caption of two ranks' images is encoded by both: counted once)
    latents, captions = sum(c for c, _ in shares), len({k for _, keys in shares for k in keys})
    table = [merged[index] for index in range(n * len(geometry.placements))]
    return EncodedData(cache_dir, table, latents + captions, texts, captions)


# Captions encoded per call of `Encoders.prompts` while caching (each text encoder goes to the accelerator once per
# call), and per forward of a text encoder within it (its activations: flux_cp.plan.encoding).
TEXT_CHUNK = 256


def _encode_texts(encoders: Encoders, pending: dict[str, str], max_len: int, cache_dir: Path) -> int:
    keys = list(pending)
    for start in range(0, len(keys), TEXT_CHUNK):
        chunk = keys[start : start + TEXT_CHUNK]
        embeds = encoders.prompts([pending[k] for k in chunk], max_len)
        for j, k in enumerate(chunk):
            files.write_safetensors(cache_dir / "text" / f"{k}.safetensors", {n: t[j] for n, t in embeds.items()})
    pending.clear()
    return len(keys)


class LiveData:
    """`--no_cache`: decode, crop (per epoch) and encode each sample when its batch comes up; samples are (image,
    placement) as in the cache's table."""

    def __init__(self, source: ImageSource, encoders: Encoders, geometry: Geometry, data: DataConfig, seed: int):
        self.source, self.encoders, self.geometry, self.config, self.seed = source, encoders, geometry, data, seed
        self.sizes = []
        for i in range(len(source)):
            img, digest = _decode(source, i)
            source.note_digest(i, digest)  # the data set's identity (resume) reads no file a second time
            self.sizes.append(img.size)
            img.close()
        self.buckets = [geometry.bucket_of(s, p) for p in range(len(geometry.placements)) for s in self.sizes]
        self._texts: dict[str, dict[str, Tensor]] = {}

    def text(self, caption: str) -> dict[str, Tensor]:
        if caption not in self._texts:  # encoded once
            embeds = self.encoders.prompts([caption], self.config.max_sequence_length)
            self._texts[caption] = {n: t[0] for n, t in embeds.items()}
        return dict(self._texts[caption])

    def load(self, index: int, flip: bool, epoch: int) -> dict[str, Tensor]:
        placement, i = divmod(index, len(self.source))
        img = self.source.load(i)
        target = self.geometry.buckets[self.buckets[index]]
        gen = self.geometry.crop_generator(self.seed, i, placement, epoch)
        resized, offset = crop_box(img.size, target, self.config.center_crop, gen)
        mean, std = self.encoders.latents(to_pixels(img, target, resized, offset, flip)[None])
        embeds = self.encoders.prompts([self.source.samples[i].caption], self.config.max_sequence_length)
        out = {"latent_mean": mean[0], "latent_std": std[0], **{n: t[0] for n, t in embeds.items()}}
        for j in range(self.source.reference_count(i)):  # with the target's resize, crop and flip; the mean latent
            pixels = to_pixels(self.source.load(i, reference=True, ref_index=j), target, resized, offset, flip)
            out[reference_key(j)] = self.encoders.latents(pixels[None])[0][0]
        return out


class ClassSamples:
    """The class images' encodings: `data` holds class image c in the p-th of the buckets the training images use
    (`used`) at index `p * count + c` (flux_cp.data.buckets.ClassGeometry)."""

    def __init__(self, data: TrainingData, count: int, used: list[int]):
        self.data, self.count, self.used = data, count, list(used)

    def load(self, image: int, bucket: int, epoch: int) -> dict[str, torch.Tensor]:
        return self.data.load(self.used.index(bucket) * self.count + image, False, epoch)
