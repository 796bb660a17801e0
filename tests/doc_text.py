"""Reading the README and docs/ as their tests need them: the pages, their blocks (a paragraph, a list item, a table
row or a heading, code apart), the links and code of a block, and GitHub's anchors of a page's headings."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LINK = re.compile(r"\]\(([^()\s]+(?:\([^()\s]*\))?)\)")  # [text](target)
REF_USE = re.compile(r"\]\[([^\]]+)\]")  # [text][name]
REF_DEF = re.compile(r"^\[([^\]]+)\]:\s*(\S+)\s*$", re.M)  # [name]: target
CODE_SPAN = re.compile(r"`([^`\n]+)`")
ITEM = re.compile(r"\s*(?:[-*] |\d+\. )")


def pages(exclude: tuple[str, ...] = ()) -> list[Path]:
    """README.md and every page of docs/, but those named in `exclude`."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [p for p in found if p.name not in exclude or p.parent == ROOT]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of its first line, from 1
    text: str  # its lines joined by spaces
    code: bool  # a code block (indented or fenced) rather than prose

    def where(self) -> str:
        name = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{name}:{self.line}"


def blocks(page: Path, text: str | None = None) -> list[Block]:
    """The page's blocks (of `text` when given, else of the page's file): paragraphs, list items (with their
    continuation lines), table rows and headings as prose; each indented or fenced code block as code."""
    out: list[Block] = []
    lines = (page.read_text() if text is None else text).split("\n")
    current: list[str] = []
    start, code, fence = 0, False, False

    def flush() -> None:
        nonlocal current
        if current:
            out.append(Block(page, start, " ".join(s.strip() for s in current), code))
        current = []

    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            flush()
            fence = not fence
            code, start = fence, number + 1
            continue
        if fence:
            current.append(line)
            continue
        is_code = line.startswith("    ") and (code or not current)
        if not line.strip():
            if not code:
                flush()
            continue
        if is_code != code or (not is_code and (ITEM.match(line) or line.startswith(("|", "#")))):
            flush()
            code = is_code
        if not current:
            start = number
        current.append(line)
        if not code and line.startswith(("|", "#")):
            flush()
    flush()
    return out


def references(page: Path) -> dict[str, str]:
    """The page's reference-style link definitions: {name: target}."""
    return dict(REF_DEF.findall(page.read_text()))


def link_targets(block: Block, refs: dict[str, str]) -> list[str]:
    """Every link target of a prose block, inline and by reference, and a definition line's own target."""
    targets = LINK.findall(block.text) + [refs[name] for name in REF_USE.findall(block.text) if name in refs]
    defined = REF_DEF.match(block.text)
    return targets + ([defined.group(2)] if defined else [])


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, GitHub's way (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for block in blocks(page):
        if block.code or not block.text.startswith("#"):
            continue
        base = slug(block.text.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out
