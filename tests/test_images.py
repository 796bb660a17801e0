"""Every image file PIL opens is decoded to the picture a viewer shows; captions are UTF-8."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageCms

from flux_cp.errors import UsageError
from flux_cp.images import decode, is_image_file, read_caption

RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def _bytes(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def _pixels(img: Image.Image) -> np.ndarray:
    assert img.mode == "RGB"
    return np.asarray(img).astype(int)


def test_exif_orientation_is_applied():
    img = Image.new("RGB", (4, 2), RED)
    img.paste(BLUE, (2, 0, 4, 2))  # left half red, right half blue
    exif = img.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to view"
    out = decode(_bytes(img, exif=exif), "x.png")
    assert out.size == (2, 4)
    px = _pixels(out)
    assert tuple(px[0, 0]) == RED and tuple(px[-1, 0]) == BLUE  # the left half is now on top


def test_transparency_is_composited_onto_white():
    rgba = Image.new("RGBA", (2, 1), (0, 0, 0, 0))  # hidden colour black, fully transparent
    rgba.putpixel((1, 0), (0, 0, 0, 128))  # half-transparent black
    px = _pixels(decode(_bytes(rgba), "a.png"))
    assert tuple(px[0, 0]) == WHITE
    assert all(abs(v - 127) <= 1 for v in px[0, 1])
    la = Image.new("LA", (1, 1), (0, 0))
    assert tuple(_pixels(decode(_bytes(la), "la.png"))[0, 0]) == WHITE


def test_palette_with_transparent_index_and_animated_first_frame():
    frames = [Image.new("P", (2, 2), 0), Image.new("P", (2, 2), 1)]
    for f in frames:
        f.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    data = _bytes(frames[0], "GIF", save_all=True, append_images=frames[1:], transparency=0, duration=100)
    assert tuple(_pixels(decode(data, "t.gif"))[0, 0]) == WHITE  # index 0 is transparent in frame 0
    data = _bytes(frames[1], "GIF", save_all=True, append_images=frames[:1], duration=100)
    assert tuple(_pixels(decode(data, "anim.gif"))[0, 0]) == RED


def test_high_bit_depth_greyscale_keeps_its_tones():
    grey16 = Image.fromarray(np.array([[0, 32896, 65535]], dtype=np.uint16))
    assert grey16.mode == "I;16"
    px = _pixels(decode(_bytes(grey16), "g16.png"))
    assert [int(v[0]) for v in px[0]] == [0, 128, 255]  # PIL's convert("RGB") gives 0, 255, 255
    grey_f = Image.fromarray(np.array([[0.0, 0.5, 1.0, 2.0]], dtype=np.float32))
    px = _pixels(decode(_bytes(grey_f, "TIFF"), "f.tif"))
    assert [int(v[0]) for v in px[0]] == [0, 128, 255, 255]  # PIL's convert("RGB") gives 0, 0, 1, 2


def test_cmyk_lab_and_one_bit_images():
    cmyk = Image.new("CMYK", (1, 1), (255, 0, 0, 0))  # pure cyan ink, no profile
    assert tuple(_pixels(decode(_bytes(cmyk, "TIFF"), "c.tif"))[0, 0]) == (0, 255, 255)
    lab = Image.new("LAB", (1, 1), (255, 128, 128))  # L=100, a=b=0: white
    assert all(v >= 250 for v in _pixels(decode(_bytes(lab, "TIFF"), "lab.tif"))[0, 0])
    one = Image.new("1", (1, 1), 1)
    assert tuple(_pixels(decode(_bytes(one), "1.png"))[0, 0]) == WHITE


def _swapped_primaries_profile() -> bytes:
    """sRGB with the red and blue primaries exchanged: (255, 0, 0) in it is sRGB blue."""
    icc = bytearray(ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes())
    count = struct.unpack(">I", icc[128:132])[0]
    where = {bytes(icc[132 + 12 * i : 136 + 12 * i]): 132 + 12 * i for i in range(count)}
    r, b = where[b"rXYZ"], where[b"bXYZ"]
    icc[r + 4 : r + 12], icc[b + 4 : b + 12] = icc[b + 4 : b + 12], icc[r + 4 : r + 12]
    return bytes(icc)


def test_embedded_colour_profile_is_converted_to_srgb():
    img = Image.new("RGB", (1, 1), (100, 150, 200))
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    assert _pixels(decode(_bytes(img, icc_profile=srgb), "s.png"))[0, 0].tolist() == [100, 150, 200]
    for red in (Image.new("RGB", (1, 1), RED), Image.new("RGBA", (1, 1), RED + (255,))):
        assert tuple(_pixels(decode(_bytes(red, icc_profile=_swapped_primaries_profile()), "p.png"))[0, 0]) == BLUE
    broken = _bytes(img, icc_profile=b"not a profile")
    assert _pixels(decode(broken, "b.png"))[0, 0].tolist() == [100, 150, 200]  # ignored, as viewers do


def test_unreadable_files_name_the_file(monkeypatch):
    good = _bytes(Image.new("RGB", (64, 64), RED))
    for data in (b"not an image", good[: len(good) // 2]):
        with pytest.raises(UsageError, match="cannot read image some/file.png"):
            decode(data, "some/file.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(UsageError, match="cannot read image big.png: .*Downscale it"):
        decode(good, "big.png")


def test_which_files_are_images():
    assert is_image_file(Path("a/B.PNG")) and is_image_file(Path("x.tif")) and is_image_file(Path("x.gif"))
    assert not is_image_file(Path("._photo.png")) and not is_image_file(Path("notes.txt"))


def test_captions_are_utf8(tmp_path):
    (tmp_path / "bom.txt").write_bytes("\ufeff  café au lait \n".encode())
    assert read_caption(tmp_path / "bom.txt") == "café au lait"
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(UsageError, match=r"latin1.txt is not UTF-8 text \(byte 0xe9 at offset 3\): save it as UTF-8"):
        read_caption(tmp_path / "latin1.txt")
