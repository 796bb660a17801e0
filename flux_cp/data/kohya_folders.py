"""kohya's DreamBooth-style data set layout: a folder whose sub-folders are named `N_name` (`10_sks person/`), each
image in one trained N times per epoch, read as kohya's sd-scripts read it.

A local data folder without metadata.jsonl is in this layout when it has sub-folders and every one of them (hidden
ones, the encoding cache and the class images left out) is named `<digits>_<name>`. As in sd-scripts
(`library/config_util.py`, `library/train_util.py`): N is the number before the first '_' and the rest of the name is
the folder's class token; only the images directly inside each sub-folder are read; an image's caption is the first
line of its caption file (here `<image>.txt`, else `<image>.caption`, sd-scripts' default extension), and an image
without one is captioned with its folder's class token; a folder of 0 repeats is skipped. `--instance_prompt`
replaces every caption, as for any folder. Where sd-scripts would skip without a word, a line says it: images beside
the sub-folders are refused (sd-scripts never reads them), images in deeper folders are named in a warning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from flux_cp.data.folders import METADATA, image_files
from flux_cp.errors import UsageError
from flux_cp.images import read_caption

_NAME = re.compile(r"^(\d+)_(.*)$", re.DOTALL)
CAPTION_EXTENSIONS = (".txt", ".caption")  # in this order; sd-scripts reads one, --caption_extension (.caption)


@dataclass(frozen=True)
class KohyaFolder:
    """One `N_name` sub-folder: its name, N, its class token (the name after `N_`), its images and how many of them
    are captioned with the token (no caption file)."""

    name: str
    repeats: int
    token: str
    images: int
    by_token: int = 0


@dataclass(frozen=True)
class KohyaLayout:
    """A folder in kohya's layout: its `N_name` sub-folders read, those skipped (0 repeats, no images), and what a
    user should hear about (`warnings`)."""

    folders: tuple[KohyaFolder, ...]
    skipped: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=())

    def describe(self, repeats: int = 1) -> str:
        """The one line said at start: the folders, their images and repeats, where captions come from."""
        parts = [f"{f.name} ({f.images} image{'s' * (f.images != 1)} x {f.repeats})" for f in self.folders]
        n = len(self.folders)
        line = f"kohya layout: {n} folder{'s' * (n != 1)}, {', '.join(parts)}"
        if self.skipped:
            line += f"; skipped {', '.join(self.skipped)}"
        by_token = sum(f.by_token for f in self.folders)
        if by_token:
            line += f"; {by_token} image{'s' * (by_token != 1)} without a caption file captioned with the folder's name"
        per_epoch = sum(f.images * f.repeats for f in self.folders)
        if repeats > 1:
            line += f"; x {repeats} (--repeats): {per_epoch * repeats} samples per epoch"
        else:
            line += f"; {per_epoch} samples per epoch"
        return line


def kohya_subfolders(folder: Path, exclude: tuple[Path, ...] = ()) -> list[Path] | None:
    """The `N_name` sub-folders of `folder` when it is in kohya's layout (see the module doc), sorted; None when it is
    not (no sub-folder, a metadata.jsonl, or a sub-folder of another name)."""
    if (folder / METADATA).is_file():
        return None
    left_out = {p.resolve() for p in exclude}
    subs = sorted(
        p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".") and p.resolve() not in left_out
    )
    if not subs or not all(_NAME.match(p.name) for p in subs):
        return None
    return subs


def mixed_names(folder: Path, exclude: tuple[Path, ...] = ()) -> str | None:
    """A warning when some sub-folders of `folder` are named `N_name` and others are not: the folder is then read as
    one folder without repeats, which a kohya user may not expect."""
    if (folder / METADATA).is_file():
        return None
    left_out = {p.resolve() for p in exclude}
    subs = [
        p.name
        for p in sorted(folder.iterdir())
        if p.is_dir() and not p.name.startswith(".") and p.resolve() not in left_out
    ]
    named = [s for s in subs if _NAME.match(s)]
    if not named or len(named) == len(subs):
        return None
    other = [s for s in subs if not _NAME.match(s)]
    return (
        f"{folder}: sub-folders {', '.join(named[:3])} are named as in kohya's layout (N_name: N repeats) but "
        f"{', '.join(other[:3])} {'is' if len(other) == 1 else 'are'} not, so the folder is read as one folder "
        "without repeats; name every sub-folder N_name to read it as kohya does"
    )


def _caption(image: Path) -> tuple[str | None, bool]:
    """(the first line of the image's caption file, whether the file has further non-empty lines); (None, False)
    without a caption file."""
    for ext in CAPTION_EXTENSIONS:
        path = image.with_suffix(ext)
        if path.is_file():
            lines = read_caption(path).replace("\r\n", "\n").replace("\r", "\n").split("\n")
            return lines[0].strip(), any(line.strip() for line in lines[1:])
    return None, False


def list_kohya(
    folder: Path, subs: list[Path], instance_prompt: str | None, exclude: tuple[Path, ...] = ()
) -> tuple[list[tuple[str, str, int]], KohyaLayout]:
    """(image path, caption, repeats) of every image of the `N_name` sub-folders `subs` of `folder`, in folder and
    file order, and the layout read (a UsageError for what sd-scripts would read differently than asked)."""
    beside = [p for p in image_files(folder, exclude) if p.parent == folder]
    if beside:
        raise UsageError(
            f"{folder} holds N_name sub-folders (kohya's layout: N repeats) and {len(beside)} image(s) beside them "
            f"(e.g. {beside[0].name}), which kohya does not read: move them into a sub-folder such as "
            f"{folder / ('1_' + (_NAME.match(subs[0].name).group(2) or 'images'))}"
        )
    samples, folders, skipped, deeper, multiline = [], [], [], [], 0
    for sub in subs:
        m = _NAME.match(sub.name)
        repeats, token = int(m.group(1)), m.group(2)
        found = image_files(sub, exclude)
        direct = [p for p in found if p.parent == sub]
        deeper += [p for p in found if p.parent != sub]
        if repeats < 1 or not direct:
            skipped.append(f"{sub.name} ({'0 repeats' if repeats < 1 else 'no images'})")
            continue
        by_token = 0
        for image in direct:
            if instance_prompt is not None:
                caption = instance_prompt
            else:
                caption, more = _caption(image)
                multiline += more
                if caption is None:
                    caption, by_token = token, by_token + 1
            samples.append((str(image), caption, repeats))
        folders.append(KohyaFolder(sub.name, repeats, token, len(direct), by_token))
    if not samples:
        raise UsageError(
            f"--dataset_name {folder}: its N_name sub-folders (kohya's layout) hold no images to train on "
            f"({', '.join(skipped)})"
        )
    warnings = []
    if deeper:
        names = ", ".join(str(p.relative_to(folder)) for p in deeper[:3])
        warnings.append(
            f"{len(deeper)} image(s) in folders inside the N_name sub-folders of {folder} are not read (e.g. {names}): "
            "kohya's layout trains the images directly in each N_name folder"
        )
    if multiline:
        warnings.append(
            f"{multiline} caption file(s) in {folder} have more than one line: the first line is the caption, as kohya "
            "reads them"
        )
    return samples, KohyaLayout(tuple(folders), tuple(skipped), tuple(warnings))
