"""The product code is laid out by its formatter (`ruff format`): `# fmt: skip` (or a `# fmt: off` region) only where
a table reads better with its columns aligned, fewer than 30 in flux_cp/ and cp/ together. The counter itself is
checked on a small tree whose markers are known."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flux_cp", "cp")
MAX_MARKERS = 30  # the product code holds fewer than this
MARKERS = ("fmt:skip", "fmt:off")  # as the formatter reads them, spaces aside


def formatter_markers(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, int]:
    """{file relative to `root`: how many comments of its Python files turn the formatter off}: comments only, so a
    string that mentions a marker does not count."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
            comments = [t.string for t in tokens if t.type == tokenize.COMMENT]
            n = sum(any(m in c.replace(" ", "") for m in MARKERS) for c in comments)
            if n:
                found[str(path.relative_to(root))] = n
    return found


def test_formatter_markers_stay_rare():
    found = formatter_markers(ROOT)
    assert sum(found.values()) < MAX_MARKERS, found


def test_counter_counts_comments_not_strings(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text(
        'TABLE = (\n    "a",  "b",\n    "cc", "d",\n)  # fmt: skip\nx = 1  # fmt:skip\ntext = "# fmt: skip"\n'
    )
    (package / "sub" / "b.py").write_text("# fmt: off\ny = [1,2]\n# fmt: on\nz = 2  # a comment\n")
    (package / "c.py").write_text("w = 3\n")
    assert formatter_markers(tmp_path, ("pkg",)) == {"pkg/a.py": 2, "pkg/sub/b.py": 1}
