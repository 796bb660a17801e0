"""Training data: where images and captions come from, how each is cropped, and which samples make up
each global batch.

Every random choice here (crop, flip, sample order) is a function of (seed, epoch, sample) alone, so
all ranks of a CP group see the same samples, and the data a run sees does not depend on its layout.
The global batch of micro-step m is split over the dp ranks; a CP group shares its dp rank's slice.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from .errors import UsageError
from .folders import FILE_NAME, Metadata, caption_of, list_folder, read_metadata_file
from .images import decode
from .rng import Stream, generator

if TYPE_CHECKING:
    from .config import DataConfig, ValidationConfig

BUNDLED_DATA = Path(__file__).resolve().parent.parent / "data" / "tiny_shapes"


# --- sources -----------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One training image: `ref` is a file path (local folder) or a row index (HF data set). `reference`: the
    reference image of a FLUX.1 Kontext pair (same kinds of value), None for plain FLUX.1 data."""

    ref: str | int
    caption: str
    reference: str | int | None = None


@dataclass(frozen=True)
class DataIdentity:
    """What a resumed run must share with its checkpoint about the data: one row per sample, in order (its name
    relative to the data set, the hash of its file's content and of its caption, the reference image's name and
    content hash for FLUX.1 Kontext pairs), and their fingerprint. `legacy`: the fingerprint versions before
    content hashing computed (the data set's path and the captions), to compare with their checkpoints."""

    fingerprint: str
    files: list[list]
    legacy: str


class ImageSource:
    """A list of (image, caption) samples, or (target, reference, caption) pairs, with up-front checks and a
    content hash per image."""

    def __init__(
        self,
        samples: list[Sample],
        name: str,
        hf_dataset=None,
        image_column: str | None = None,
        reference_column: str | None = None,
        root: Path | None = None,
    ):
        self.samples = samples
        self.name = name
        self.root = root  # a local folder's path: samples are named relative to it
        self._hf = hf_dataset
        self._image_column = image_column
        self._reference_column = reference_column
        self._digests: dict[tuple[int, bool], str] = {}

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def pairs(self) -> bool:
        """FLUX.1 Kontext data: every sample has a reference image (a source never mixes)."""
        return bool(self.samples) and self.samples[0].reference is not None

    def raw_bytes(self, i: int, reference: bool = False) -> bytes:
        ref = self.samples[i].reference if reference else self.samples[i].ref
        if self._hf is None:
            with open(ref, "rb") as f:
                return f.read()
        column = self._reference_column if reference else self._image_column
        item = self._hf[int(ref)][column]
        if not item or (item.get("bytes") is None and not item.get("path")):
            raise UsageError(f"{self.where(i)} has no image in column '{column}'")
        if item.get("bytes") is not None:
            return item["bytes"]
        with open(item["path"], "rb") as f:
            return f.read()

    def where(self, i: int, reference: bool = False) -> str:
        ref = self.samples[i].reference if reference else self.samples[i].ref
        if self._hf is None:
            return str(ref)
        return f"{self.name} row {ref}" + (f" column '{self._reference_column}'" if reference else "")

    def load(self, i: int, data: bytes | None = None, reference: bool = False) -> Image.Image:
        """Image i (its reference image with `reference`) as the RGB picture a viewer shows (flux_cp.images); a
        UsageError naming the file if it cannot be read."""

        what = f"{'reference ' if reference else ''}image {self.where(i, reference)}"
        try:
            data = self.raw_bytes(i, reference) if data is None else data
        except OSError as e:
            raise UsageError(f"cannot read {what}: {e.strerror or e}") from None
        return decode(data, self.where(i, reference), what)

    def note_digest(self, i: int, digest: str, reference: bool = False) -> None:
        """The SHA-256 of image i's bytes, as whoever read them computed it (the encoding pass reads every file)."""
        self._digests[(i, reference)] = digest

    def digest(self, i: int, reference: bool = False) -> str:
        """The SHA-256 of image i's bytes (read now unless noted)."""
        key = (i, reference)
        if key not in self._digests:
            try:
                self._digests[key] = hashlib.sha256(self.raw_bytes(i, reference)).hexdigest()
            except OSError as e:
                what = "reference image" if reference else "image"
                raise UsageError(f"cannot read {what} {self.where(i, reference)}: {e.strerror or e}") from None
        return self._digests[key]

    def sample_name(self, i: int, reference: bool = False) -> str:
        """Sample i's image (or reference) named as the data set names it: relative to a local folder, or a row."""
        ref = self.samples[i].reference if reference else self.samples[i].ref
        if self._hf is not None:
            return f"row {ref}" + (f" {self._reference_column}" if reference else "")
        if self.root is not None:
            try:
                return Path(ref).relative_to(self.root).as_posix()
            except ValueError:
                pass
        return str(ref)

    def identity(self) -> DataIdentity:
        """Names, contents and captions of every sample, in order (see DataIdentity)."""
        rows = []
        for i, s in enumerate(self.samples):
            caption = hashlib.sha256(s.caption.encode()).hexdigest()[:16]
            row = [self.sample_name(i), self.digest(i)[:16], caption]
            if s.reference is not None:
                row += [self.sample_name(i, reference=True), self.digest(i, reference=True)[:16]]
            rows.append(row)
        fingerprint = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
        return DataIdentity(fingerprint, rows, self.legacy_fingerprint())

    def fingerprint(self) -> str:
        return self.identity().fingerprint

    def legacy_fingerprint(self) -> str:
        """The data set's path and captions (what checkpoints of earlier versions recorded)."""
        h = hashlib.sha256(self.name.encode())
        for s in self.samples:
            h.update(f"{s.ref}\0{s.caption}\0".encode())
            if s.reference is not None:
                h.update(f"{s.reference}\0".encode())
        return h.hexdigest()[:16]


def cache_folder(data: DataConfig) -> Path | None:
    """The encoding cache's folder (None with --no_cache): `--encodings_dir`, default ~/.cache/flux_cp/encodings."""
    from .config import DEFAULT_ENCODINGS_DIR

    if data.no_cache:
        return None
    return Path(os.path.expanduser(data.encodings_dir or DEFAULT_ENCODINGS_DIR))


def _local_folder(
    folder: Path, caption_column: str, instance_prompt: str | None, exclude: tuple[Path, ...], meta: Metadata | None
) -> list[Sample]:
    return [Sample(path, caption) for path, caption in list_folder(folder, caption_column, instance_prompt, exclude,
                                                                   meta)]  # fmt: skip


def local_metadata(data: DataConfig) -> Metadata | None:
    """The metadata.jsonl of a local `--dataset_name` folder, read and checked (None: no such file or folder)."""
    name = data.dataset_name
    return read_metadata_file(Path(name)) if name is not None and os.path.isdir(name) else None


def reference_column(data: DataConfig, meta: Metadata | None = None) -> str | None:
    """The reference-image column of FLUX.1 Kontext pairs, from the flags and a local folder's metadata.jsonl
    alone (no image is read): `--cond_image_column`, or else the one `<column>_file_name` key that the folder's
    rows have besides `file_name` (the key datasets' imagefolder reads as an image column). None: FLUX.1 data.
    `meta`: the folder's metadata.jsonl already read (flux_cp.folders.read_metadata_file; read here when None)."""
    if data.cond_image_column:
        return data.cond_image_column
    meta = meta or local_metadata(data)
    if meta is None:
        return None
    columns = meta.image_columns
    if len(columns) > 1:
        raise UsageError(
            f"{meta.path} names several images per row ({', '.join(c + '_file_name' for c in columns)}): pick the "
            f"reference image of each pair with --cond_image_column (one of {', '.join(columns)})"
        )
    return columns[0] if columns else None


def check_pair_flags(data: DataConfig, validation: ValidationConfig, pairs: bool) -> None:
    """Flags that only make sense with FLUX.1 Kontext pairs, or only without them (checked before anything
    loads)."""
    if data.with_prior_preservation and pairs:
        raise UsageError(
            "--with_prior_preservation adds class images of --class_prompt to text-to-image training; pair data "
            "(a reference image per target) has no class images to pair them with: drop --with_prior_preservation"
        )
    if validation.validation_image is not None and not pairs:
        raise UsageError(
            "--validation_image is the reference image FLUX.1 Kontext validation edits: it needs pair data "
            "(--cond_image_column, or a folder whose metadata.jsonl names each target's reference image)"
        )


def _local_pairs(
    folder: Path, column: str, caption_column: str, instance_prompt: str | None, meta: Metadata | None
) -> list[Sample]:
    """FLUX.1 Kontext pairs of a local folder: one metadata.jsonl row per target, naming its reference image
    in `<column>_file_name` (both checked like every path of metadata.jsonl: flux_cp.folders). Images no row names
    as a target (the references) are not trained on alone."""
    key = f"{column}_file_name"
    if meta is None:
        raise UsageError(
            f"--cond_image_column {column}: {folder} has no metadata.jsonl; pairs need one row per target image "
            f"with 'file_name', '{key}' and '{caption_column}'"
        )
    if column not in meta.image_columns:
        keys = sorted({k for row in meta.rows for k in row.values})
        raise UsageError(f"--cond_image_column {column}: no row of {meta.path} has '{key}' (its keys: {keys})")
    samples = []
    for row in meta.rows:
        if key not in row.files:
            raise UsageError(
                f"{meta.where(row)} ({row.values[FILE_NAME]}) has no reference image '{key}': every target of a "
                "FLUX.1 Kontext data set needs its reference"
            )
        caption = instance_prompt if instance_prompt is not None else caption_of(meta, row, caption_column)
        samples.append(Sample(str(folder / row.files[FILE_NAME]), caption, str(folder / row.files[key])))
    return samples


def _hub_dataset(data: DataConfig, cache_dir: str | None) -> ImageSource:
    import datasets

    try:
        ds = datasets.load_dataset(data.dataset_name, data.dataset_config_name, split="train", cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - every loading failure becomes one clear line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"--dataset_name {data.dataset_name} is not a local folder, and datasets cannot load it from the hub "
            f"({type(e).__name__}: {first}). Check the id (owner/name), the network or HF_HUB_OFFLINE, and "
            "`huggingface-cli login` for gated sets"
        ) from None
    columns = ds.column_names
    if data.image_column not in columns:
        raise UsageError(f"--image_column '{data.image_column}' is not in {data.dataset_name} (columns: {columns})")
    if data.instance_prompt is None and data.caption_column not in columns:
        raise UsageError(
            f"--caption_column '{data.caption_column}' is not in {data.dataset_name} (columns: {columns}); "
            "set --caption_column or --instance_prompt"
        )
    try:
        ds = ds.cast_column(data.image_column, datasets.Image(decode=False))
    except (TypeError, ValueError) as e:
        raise UsageError(
            f"--image_column '{data.image_column}' of {data.dataset_name} does not hold images ({e}); choose the "
            "column of images"
        ) from None
    column = data.cond_image_column
    if column is not None:
        if column not in columns:
            raise UsageError(f"--cond_image_column '{column}' is not in {data.dataset_name} (columns: {columns})")
        ds = ds.cast_column(column, datasets.Image(decode=False))
        _check_no_missing_references(ds, column, data.dataset_name)
    captions = [data.instance_prompt] * len(ds) if data.instance_prompt is not None else ds[data.caption_column]
    for i, c in enumerate(captions):
        if not isinstance(c, str):
            raise UsageError(
                f"{data.dataset_name} row {i}: '{data.caption_column}' is {c!r}, not a string: give every image a "
                "caption, or use --instance_prompt"
            )
    samples = [Sample(i, c, i if column is not None else None) for i, c in enumerate(captions)]
    return ImageSource(
        samples, data.dataset_name, hf_dataset=ds, image_column=data.image_column, reference_column=column
    )


def _check_no_missing_references(ds, column: str, name: str) -> None:
    """Every row of a FLUX.1 Kontext data set has its reference image (read from the Arrow nulls, no decoding)."""
    import pyarrow.compute as pc

    values = ds.data.column(column)
    if values.null_count:
        row = pc.index(pc.is_null(values), True).as_py()
        raise UsageError(
            f"{name} row {row} has no reference image in --cond_image_column '{column}' ({values.null_count} rows "
            "lack one): every target of a FLUX.1 Kontext data set needs its reference"
        )


def open_source(data: DataConfig, meta: Metadata | None = None, cache_dir: str | None = None) -> ImageSource:
    """The data set named by the flags (bundled default, local folder, or hub id); never empty. Every rank
    reads the same listing, so its errors are the same on every rank (printed once). `meta`: a local folder's
    metadata.jsonl already read (`local_metadata`; read here when None). `cache_dir`: where a hub data set is
    downloaded (--cache_dir)."""
    try:
        return _open_source(data, meta, cache_dir)
    except UsageError as e:
        raise UsageError(str(e), agreed=True) from None


def _open_source(data: DataConfig, meta: Metadata | None, cache_dir: str | None) -> ImageSource:
    name = data.dataset_name
    cache = cache_folder(data)
    # the encoding cache and the class images (prior preservation) are no training images, even inside the folder
    exclude = tuple(Path(p) for p in (cache, data.class_data_dir if data.with_prior_preservation else None) if p)
    if name is None:
        samples = _local_folder(BUNDLED_DATA, "text", data.instance_prompt, exclude, None)
        source = ImageSource(samples, "bundled:tiny_shapes", root=BUNDLED_DATA)
    elif os.path.isdir(name):
        folder, meta = Path(name), meta or local_metadata(data)  # metadata.jsonl read once, checked, then used
        if column := reference_column(data, meta):
            samples = _local_pairs(folder, column, data.caption_column, data.instance_prompt, meta)
        else:
            samples = _local_folder(folder, data.caption_column, data.instance_prompt, exclude, meta)
        source = ImageSource(samples, str(folder), root=folder)
    else:
        source = _hub_dataset(data, cache_dir)
    if len(source) == 0:
        raise UsageError(f"the data set {source.name} is empty")
    return source


# --- crops and buckets --------------------------------------------------------------------------------


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


# A resize to cover the target larger than this many times the target's pixels resizes the crop alone (to_pixels).
WHOLE_RESIZE_LIMIT = 16


def to_pixels(img: Image.Image, target: tuple[int, int], resized: tuple[int, int], offset, flip: bool) -> torch.Tensor:
    """Resize to `resized`, crop `target` at `offset`, optionally flip; `[3, h, w]` in [-1, 1].

    An extreme aspect ratio makes the cover size huge (1 x 100,000 px to a 1024 px square: 1024 x 102,400,000 px,
    300 GB): then only the crop box, in the image's own coordinates, is resized to the target (the same bicubic
    filter at the same positions; values within one level of resizing the whole, from floating-point rounding).
    Ordinary images (cover size up to WHOLE_RESIZE_LIMIT times the target) are resized whole, as always."""
    left, top = offset
    (tw, th), (rw, rh) = target, resized
    if rw * rh <= WHOLE_RESIZE_LIMIT * tw * th:
        img = img.resize(resized, Image.BICUBIC)
        img = img.crop((left, top, left + tw, top + th))
    else:
        sx, sy = img.width / rw, img.height / rh
        img = img.resize(target, Image.BICUBIC, box=(left * sx, top * sy, (left + tw) * sx, (top + th) * sy))
    if flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    arr = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


# --- which samples make up each batch ------------------------------------------------------------------


class BatchSchedule:
    """Global batches of one bucket each, reshuffled every epoch; a pure function of (seed, epoch). With prior
    preservation, the class image of each slot too (`class_images`)."""

    def __init__(self, buckets: list[int], global_batch: int, seed: int):
        self.global_batch = global_batch
        self.seed = seed
        self.by_bucket: dict[int, list[int]] = {}
        for i, b in enumerate(buckets):
            self.by_bucket.setdefault(b, []).append(i)
        self.batches_per_epoch = sum(len(v) // global_batch for v in self.by_bucket.values())
        if self.batches_per_epoch == 0:
            largest = max(len(v) for v in self.by_bucket.values())
            raise UsageError(
                f"no global batch can be formed: the global batch is {global_batch} samples (--train_batch_size x "
                f"data-parallel size) but an epoch has {len(buckets)} samples"
                + (f" and the largest aspect bucket holds {largest}" if len(self.by_bucket) > 1 else "")
                + "; lower --train_batch_size, use fewer data-parallel ranks, or add images"
            )
        self._epoch_cache: tuple[int, list[list[int]]] | None = None

    def epoch(self, epoch: int) -> list[list[int]]:
        if self._epoch_cache and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        batches = []
        for b in sorted(self.by_bucket):
            idx = self.by_bucket[b]
            perm = torch.randperm(len(idx), generator=generator(Stream.BUCKET_ORDER, self.seed, epoch, b)).tolist()
            shuffled = [idx[p] for p in perm]
            for k in range(len(shuffled) // self.global_batch):
                batches.append(shuffled[k * self.global_batch : (k + 1) * self.global_batch])
        order = torch.randperm(len(batches), generator=generator(Stream.BATCH_ORDER, self.seed, epoch)).tolist()
        batches = [batches[o] for o in order]
        self._epoch_cache = (epoch, batches)
        return batches

    def batch(self, micro_step: int) -> tuple[int, list[int]]:
        """(epoch, global batch) of global micro-step `micro_step`."""
        epoch, k = divmod(micro_step, self.batches_per_epoch)
        return epoch, self.epoch(epoch)[k]

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
