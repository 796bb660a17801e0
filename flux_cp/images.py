"""Image files and caption files as a person sees them: every image PIL opens becomes the RGB picture an image
viewer shows, and every caption is read as UTF-8 text.

`Image.convert("RGB")` alone (what diffusers' examples do) trains on something else for many ordinary files:
it ignores the EXIF orientation of phone photos, keeps the hidden colour of transparent pixels, clips 16-bit
and float greyscale to white or black, and ignores embedded colour profiles (Display P3, Adobe RGB, CMYK
press profiles). Here:

- orientation: the EXIF tag is applied (the picture turned as a viewer turns it);
- colour profile: an embedded ICC profile is converted to sRGB (a broken profile is ignored, as viewers do);
- transparency (RGBA, LA, PA, palette with a transparent index, premultiplied): composited onto white;
- 16-bit and 32-bit integer greyscale: scaled from 0..65535; float greyscale: 0..1 (clipped);
- animated or multi-page files (GIF, APNG, WebP, TIFF): the first frame;
- CMYK without a profile, YCbCr, LAB, HSV, 1-bit, palette: PIL's conversion.

DECODER_VERSION is part of the encoding-cache key, so a change of these rules re-encodes cached images.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageCms, ImageOps, UnidentifiedImageError

from flux_cp.errors import UsageError

DECODER_VERSION = 2
BACKGROUND = (255, 255, 255)

# Raster formats a photo or artwork comes in, among those this PIL build can open (its other readers are
# stubs or need external programs: BUFR, GRIB, HDF5, MPEG, WMF, EPS, FITS).
_FORMATS = {
    "AVIF",
    "BMP",
    "DDS",
    "DIB",
    "GIF",
    "ICNS",
    "ICO",
    "JPEG",
    "JPEG2000",
    "MPO",
    "PCX",
    "PNG",
    "PPM",
    "PSD",
    "QOI",
    "SGI",
    "TGA",
    "TIFF",
    "WEBP",
}
IMAGE_EXTENSIONS = tuple(
    sorted(e for e, f in Image.registered_extensions().items() if f in _FORMATS and f in Image.OPEN)
)

_SRGB = ImageCms.createProfile("sRGB")


def is_image_file(path: Path) -> bool:
    """An image file a data folder contributes: a known extension, not hidden (macOS `._name.png` resource forks,
    `.ipynb_checkpoints` and other dot-folders are not pictures)."""
    return path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


def decode(data: bytes, where: str, what: str | None = None) -> Image.Image:
    """The RGB picture a viewer shows for the file's bytes; a UsageError naming `what` (default: "image
    <where>") if PIL cannot read it."""
    what = what or f"image {where}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PIL's warnings (large images, odd metadata) would interleave the bar
            img = Image.open(io.BytesIO(data))
            img.seek(0)
            img.load()
            img = ImageOps.exif_transpose(img)  # keeps img.info, and with it the colour profile
            return to_rgb(_to_srgb(img, img.info.get("icc_profile")))
    except UnidentifiedImageError:
        raise UsageError(f"cannot read {what}: not an image format PIL can decode") from None
    except Image.DecompressionBombError as e:
        raise UsageError(f"cannot read {what}: {e} Downscale it (or split it) before training.") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated or damaged file; PIL uses all four
        raise UsageError(f"cannot read {what}: {e}") from None


def to_rgb(img: Image.Image) -> Image.Image:
    """`img` (any PIL mode, colours already sRGB) as 8-bit RGB, transparency composited onto white."""
    mode = img.mode
    if mode in ("I", "F") or mode.startswith("I;16"):
        arr = np.asarray(img, dtype=np.float64)
        scale = 255.0 if mode == "F" else 255.0 / 65535.0
        grey = np.clip(np.round(arr * scale), 0, 255).astype(np.uint8)
        return Image.fromarray(np.stack([grey] * 3, axis=-1), "RGB")
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    elif mode == "P":
        img = img.convert("RGB")
    if img.mode in ("LA", "La", "PA", "RGBA", "RGBa"):
        rgba = img.convert("RGBA")  # also un-premultiplies La / RGBa
        background = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode == "LAB":  # PIL has no direct LAB -> RGB conversion
        return ImageCms.profileToProfile(img, ImageCms.createProfile("LAB"), _SRGB, outputMode="RGB")
    return img.convert("RGB")


def _to_srgb(img: Image.Image, icc: bytes | None) -> Image.Image:
    """Colours converted from the embedded ICC profile to sRGB (no profile, or an sRGB one: unchanged)."""
    if not icc or img.mode not in ("RGB", "RGBA", "CMYK", "L", "LA"):
        return img
    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        alpha = img.getchannel("A") if img.mode in ("RGBA", "LA") else None
        base = img.convert("RGB" if img.mode == "RGBA" else "L") if alpha is not None else img
        out = ImageCms.profileToProfile(base, profile, _SRGB, outputMode="RGB")
    except (ImageCms.PyCMSError, OSError, ValueError):
        return img  # a broken profile: viewers show the numbers as they are, and so do we
    if alpha is not None:
        out.putalpha(alpha)
    return out


def read_caption(path: Path) -> str:
    """A `.txt` caption: UTF-8 (a byte-order mark is dropped), surrounding whitespace stripped."""
    try:
        return path.read_bytes().decode("utf-8-sig").strip()
    except UnicodeDecodeError as e:
        raise UsageError(
            f"caption file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): save it as "
            "UTF-8"
        ) from None
    except OSError as e:
        raise UsageError(f"cannot read caption file {path}: {e.strerror or e}") from None


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
