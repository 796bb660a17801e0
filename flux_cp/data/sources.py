"""Training data sources: where images and captions come from - the bundled data sets, a local folder (its
metadata.jsonl or caption files, or kohya's `N_name` sub-folders), a Hugging Face data set - each opened and checked
once, with a content hash per image (`ImageSource`), and the pair data's reference images and their counts. Buckets
and crops: flux_cp.data.buckets; which samples make up each batch: flux_cp.data.schedule."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from flux_cp.config.fields import DEFAULT_ENCODINGS_DIR
from flux_cp.data.folders import FILE_NAME, Metadata, caption_of, list_folder, read_metadata_file
from flux_cp.data.kohya_folders import KohyaLayout, kohya_subfolders, list_kohya, mixed_names
from flux_cp.errors import UsageError
from flux_cp.families.base import FAMILIES
from flux_cp.images import decode

if TYPE_CHECKING:
    from flux_cp.config.flags import ValidationConfig
    from flux_cp.config.training import DataConfig

BUNDLED_DATA = Path(__file__).resolve().parents[2] / "data" / "tiny_shapes"


# --- sources -----------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One training image: `ref` is a file path (local folder) or a row index (HF data set). `references`: the
    reference images of an editing sample, in order (same kinds of value; a hub row's index once per image of its
    list), empty for text-to-image data. FLUX.1 Kontext takes one, FLUX.2 one or more. `repeats`: see below."""

    ref: str | int
    caption: str
    references: tuple[str | int, ...] = ()
    repeats: int = 1  # its copies per epoch before --repeats: its folder's N in kohya's layout (N_name), else 1

    @property
    def reference(self) -> str | int | None:
        """The first reference image (FLUX.1 Kontext's only one); None for text-to-image data."""
        return self.references[0] if self.references else None


@dataclass(frozen=True)
class DataIdentity:
    """What a resumed run must share with its checkpoint about the data: one row per sample, in order (its name
    relative to the data set, the hash of its file's content and of its caption, then each reference image's name
    and content hash for editing samples), and their fingerprint. `legacy`: the fingerprint versions before
    content hashing computed (the data set's path and the captions), to compare with their checkpoints."""

    fingerprint: str
    files: list[list]
    legacy: str


class ImageSource:
    """A list of (image, caption) samples, or (target, references, caption) editing samples, with up-front checks
    and a content hash per image. An image is named by its sample `i` and, for a reference, `reference=True` and its
    position `ref_index` in the sample's references."""

    def __init__(
        self,
        samples: list[Sample],
        name: str,
        hf_dataset=None,
        image_column: str | None = None,
        reference_column: str | None = None,
        root: Path | None = None,
        reference_list: bool = False,
    ):
        self.samples = samples
        self.name = name
        self.root = root  # a local folder's path: samples are named relative to it
        self._hf = hf_dataset
        self._image_column = image_column
        self._reference_column = reference_column
        self._reference_list = reference_list  # a hub column holding a list of images per row
        self._digests: dict[tuple[int, bool, int], str] = {}
        self.kohya: KohyaLayout | None = None  # a folder in kohya's layout (N_name sub-folders): what was read
        self.warnings: tuple[str, ...] = ()  # what the listing would have a user know (said once, at start)

    def copies(self) -> list[int] | None:
        """Each sample's copies per epoch before --repeats (kohya's N_name folders); None when every one has one."""
        counts = [s.repeats for s in self.samples]
        return None if all(c == 1 for c in counts) else counts

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def pairs(self) -> bool:
        """Editing data: every sample has one or more reference images (a source never mixes)."""
        return bool(self.samples) and bool(self.samples[0].references)

    def reference_count(self, i: int) -> int:
        return len(self.samples[i].references)

    def reference_counts(self) -> dict[int, int]:
        """{number of references: the first sample with that many}, in ascending order of the number."""
        first: dict[int, int] = {}
        for i, s in enumerate(self.samples):
            first.setdefault(len(s.references), i)
        return dict(sorted(first.items()))

    def _ref(self, i: int, reference: bool, ref_index: int) -> str | int:
        return self.samples[i].references[ref_index] if reference else self.samples[i].ref

    def raw_bytes(self, i: int, reference: bool = False, ref_index: int = 0) -> bytes:
        ref = self._ref(i, reference, ref_index)
        if self._hf is None:
            with open(ref, "rb") as f:
                return f.read()
        column = self._reference_column if reference else self._image_column
        item = self._hf[int(ref)][column]
        if reference and self._reference_list:
            item = item[ref_index] if item and ref_index < len(item) else None
        if not item or (item.get("bytes") is None and not item.get("path")):
            where = self.where(i, reference, ref_index)
            raise UsageError(f"{where} has no image" + ("" if reference else f" in column '{column}'"))
        if item.get("bytes") is not None:
            return item["bytes"]
        with open(item["path"], "rb") as f:
            return f.read()

    def where(self, i: int, reference: bool = False, ref_index: int = 0) -> str:
        ref = self._ref(i, reference, ref_index)
        if self._hf is None:
            return str(ref)
        if not reference:
            return f"{self.name} row {ref}"
        item = f" item {ref_index + 1}" if self._reference_list else ""
        return f"{self.name} row {ref} column '{self._reference_column}'{item}"

    def load(self, i: int, data: bytes | None = None, reference: bool = False, ref_index: int = 0) -> Image.Image:
        """Image i (its reference image `ref_index` with `reference`) as the RGB picture a viewer shows
        (flux_cp.images); a UsageError naming the file if it cannot be read."""
        where = self.where(i, reference, ref_index)
        what = f"{'reference ' if reference else ''}image {where}"
        try:
            data = self.raw_bytes(i, reference, ref_index) if data is None else data
        except OSError as e:
            raise UsageError(f"cannot read {what}: {e.strerror or e}") from None
        return decode(data, where, what)

    def note_digest(self, i: int, digest: str, reference: bool = False, ref_index: int = 0) -> None:
        """The SHA-256 of image i's bytes, as whoever read them computed it (the encoding pass reads every file)."""
        self._digests[(i, reference, ref_index if reference else 0)] = digest

    def digest(self, i: int, reference: bool = False, ref_index: int = 0) -> str:
        """The SHA-256 of image i's bytes (read now unless noted)."""
        key = (i, reference, ref_index if reference else 0)
        if key not in self._digests:
            try:
                self._digests[key] = hashlib.sha256(self.raw_bytes(i, reference, ref_index)).hexdigest()
            except OSError as e:
                what = "reference image" if reference else "image"
                where = self.where(i, reference, ref_index)
                raise UsageError(f"cannot read {what} {where}: {e.strerror or e}") from None
        return self._digests[key]

    def sample_name(self, i: int, reference: bool = False, ref_index: int = 0) -> str:
        """Sample i's image (or reference) named as the data set names it: relative to a local folder, or a row."""
        ref = self._ref(i, reference, ref_index)
        if self._hf is not None:
            item = f"[{ref_index}]" if self._reference_list else ""
            return f"row {ref}" + (f" {self._reference_column}{item}" if reference else "")
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
            for j in range(len(s.references)):
                row += [self.sample_name(i, True, j), self.digest(i, True, j)[:16]]
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
            for r in s.references:
                h.update(f"{r}\0".encode())
        return h.hexdigest()[:16]


def cache_folder(data: DataConfig) -> Path | None:
    """The encoding cache's folder (None with --no_cache): `--encodings_dir`, default ~/.cache/flux_cp/encodings."""
    if data.no_cache:
        return None
    return Path(os.path.expanduser(data.encodings_dir or DEFAULT_ENCODINGS_DIR))


def encodings_folder(data: DataConfig) -> str:
    """Where the encodings are cached (--encodings_dir, else the default)."""
    return str(cache_folder(data) or os.path.expanduser(DEFAULT_ENCODINGS_DIR))


def _local_folder(
    folder: Path, caption_column: str, instance_prompt: str | None, exclude: tuple[Path, ...], meta: Metadata | None
) -> list[Sample]:
    listed = list_folder(folder, caption_column, instance_prompt, exclude, meta)
    return [Sample(path, caption) for path, caption in listed]


def local_metadata(data: DataConfig) -> Metadata | None:
    """The metadata.jsonl of a local `--dataset_name` folder, read and checked (None: no such file or folder)."""
    name = data.dataset_name
    return read_metadata_file(Path(name)) if name is not None and os.path.isdir(name) else None


def reference_column(data: DataConfig, meta: Metadata | None = None) -> str | None:
    """The reference-image column of FLUX.1 Kontext pairs, from the flags and a local folder's metadata.jsonl
    alone (no image is read): `--cond_image_column`, or else the one `<column>_file_name` key that the folder's
    rows have besides `file_name` (the key datasets' imagefolder reads as an image column). None: FLUX.1 data.
    `meta`: the folder's metadata.jsonl already read (flux_cp.data.folders.read_metadata_file; read here when None)."""
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


def check_pair_flags(data: DataConfig, validation: ValidationConfig, pairs: bool, label: str) -> None:
    """Flags that only make sense with pair data, or only without it (checked before anything loads). `label`: what
    the model family calls its pair model (`Family.pairs_label`)."""
    if data.with_prior_preservation and pairs:
        raise UsageError(
            "--with_prior_preservation adds class images of --class_prompt to text-to-image training; pair data "
            "(a reference image per target) has no class images to pair them with: drop --with_prior_preservation"
        )
    if validation.validation_image is not None and not pairs:
        raise UsageError(
            f"--validation_image is the reference image {label} validation edits: it needs pair data "
            "(--cond_image_column, or a folder whose metadata.jsonl names each target's reference image)"
        )


def check_reference_limit(
    limit: int | None,
    label: str,
    validation: ValidationConfig,
    meta: Metadata | None = None,
    column: str | None = None,
    source: ImageSource | None = None,
) -> None:
    """Several reference images per target for a model family that takes fewer (`limit`; FLUX.1 Kontext: one):
    refused naming the first row that has more (from a local folder's metadata.jsonl `meta`, or from the opened
    `source`), or the repeated --validation_image. None: any number (FLUX.2)."""
    if limit is None:
        return
    one = "one" if limit == 1 else f"at most {limit}"
    several = [f.label for f in FAMILIES if f.max_references is None]
    hint = f"({' and '.join(several)} take several)" if several else ""
    images = validation.validation_image or ()
    if len(images) > limit:
        raise UsageError(
            f"--validation_image is given {len(images)} times, but {label} edits {one} reference image: give {one} "
            + hint
        )
    found = None
    if source is not None:
        found = next(((source.where(i), n) for n, i in source.reference_counts().items() if n > limit), None)
    elif meta is not None and column is not None:
        key = f"{column}_file_name"
        rows = ((row, row.files.get(key)) for row in meta.rows)
        many = ((f"{meta.where(row)} ({key})", len(f)) for row, f in rows if isinstance(f, tuple) and len(f) > limit)
        found = next(many, None)
    if found:
        raise UsageError(
            f"{found[0]} names {found[1]} reference images, but {label} takes {one} per target: keep {one} per row "
            + hint
        )


def _local_pairs(
    folder: Path, column: str, caption_column: str, instance_prompt: str | None, meta: Metadata | None
) -> list[Sample]:
    """Editing samples of a local folder: one metadata.jsonl row per target, naming its reference image in
    `<column>_file_name`, or several as a list of names (FLUX.2); every path checked like every path of
    metadata.jsonl (flux_cp.data.folders). Images no row names as a target (the references) are not trained on alone."""
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
                f"{meta.where(row)} ({row.values[FILE_NAME]}) has no reference image '{key}': every target of "
                "pair data needs its reference"
            )
        caption = instance_prompt if instance_prompt is not None else caption_of(meta, row, caption_column)
        refs = row.files[key]
        refs = refs if isinstance(refs, tuple) else (refs,)
        samples.append(Sample(str(folder / row.files[FILE_NAME]), caption, tuple(str(folder / r) for r in refs)))
    return samples


def reference_counts(meta: Metadata | None, column: str | None) -> tuple[int, ...] | None:
    """The numbers of reference images that the rows of a local folder's metadata.jsonl name in `column`, ascending
    (read without any image); None when they are not known before the data set is opened (a hub data set)."""
    if meta is None or column is None:
        return None
    key = f"{column}_file_name"
    counts = {len(f) if isinstance(f, tuple) else 1 for row in meta.rows if (f := row.files.get(key)) is not None}
    return tuple(sorted(counts)) or None


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
        # A column of one image per row, or of a list of images per row (FLUX.2's several references).
        listed = isinstance(ds.features[column], (datasets.List, datasets.LargeList, list))
        try:
            image = datasets.Image(decode=False)
            ds = ds.cast_column(column, datasets.List(image) if listed else image)
        except (TypeError, ValueError) as e:
            raise UsageError(
                f"--cond_image_column '{column}' of {data.dataset_name} does not hold images or lists of images "
                f"({e}); choose the column of reference images"
            ) from None
        counts = _reference_counts(ds, column, data.dataset_name, listed)
    captions = [data.instance_prompt] * len(ds) if data.instance_prompt is not None else ds[data.caption_column]
    for i, c in enumerate(captions):
        if not isinstance(c, str):
            raise UsageError(
                f"{data.dataset_name} row {i}: '{data.caption_column}' is {c!r}, not a string: give every image a "
                "caption, or use --instance_prompt"
            )
    refs = [(i,) * counts[i] for i in range(len(captions))] if column is not None else [()] * len(captions)
    samples = [Sample(i, c, r) for i, (c, r) in enumerate(zip(captions, refs))]
    return ImageSource(
        samples,
        data.dataset_name,
        hf_dataset=ds,
        image_column=data.image_column,
        reference_column=column,
        reference_list=column is not None and listed,
    )


def _reference_counts(ds, column: str, name: str, listed: bool) -> list[int]:
    """The number of reference images of every row (1, or the length of a row's list): from the Arrow column, no
    image decoded. Every row needs one: a null or an empty list is refused."""
    import pyarrow.compute as pc

    values = ds.data.column(column)
    if values.null_count:
        row = pc.index(pc.is_null(values), True).as_py()
        raise UsageError(
            f"{name} row {row} has no reference image in --cond_image_column '{column}' ({values.null_count} rows "
            "lack one): every target of pair data needs its reference"
        )
    if not listed:
        return [1] * len(values)
    counts = pc.list_value_length(values)
    empty = pc.sum(pc.equal(counts, 0)).as_py() or 0
    if empty:
        row = pc.index(pc.equal(counts, 0), True).as_py()
        raise UsageError(
            f"{name} row {row} has an empty list in --cond_image_column '{column}' ({empty} rows have one): give "
            "every target one or more reference images"
        )
    return counts.to_pylist()


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
        kohya, warnings = None, ()
        if column := reference_column(data, meta):
            samples = _local_pairs(folder, column, data.caption_column, data.instance_prompt, meta)
        elif meta is None and (subs := kohya_subfolders(folder, exclude)):  # N_name sub-folders: N repeats each
            listed, kohya = list_kohya(folder, subs, data.instance_prompt, exclude)
            samples = [Sample(path, caption, repeats=n) for path, caption, n in listed]
            warnings = kohya.warnings
        else:
            samples = _local_folder(folder, data.caption_column, data.instance_prompt, exclude, meta)
            warnings = tuple(w for w in (mixed_names(folder, exclude),) if w)
        source = ImageSource(samples, str(folder), root=folder)
        source.kohya, source.warnings = kohya, warnings
    else:
        source = _hub_dataset(data, cache_dir)
    if len(source) == 0:
        raise UsageError(f"the data set {source.name} is empty")
    return source
