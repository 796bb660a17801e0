"""Every measured figure in the README and docs/ is the one in its result file. The rule (docs/benchmarks.md, "How
figures in the docs are kept true"): a block (a paragraph, a list item or a table row) that states a figure measured
on a GPU links, or names in code, the result file under benchmarks/archive/results/ it comes from (or its folder:
then any of the folder's text files). This test holds every block that does to it: each number with a unit (s, ms,
GiB, x, %; in a table also a bare number in a column whose header names s/step or GiB) must be a value of those files,
rounded to the figure's own precision (a percentage also as a fraction, ms also as seconds), or be derived from two
figures of the same block that are: a ratio (x) as their quotient, a percentage as their relative difference or as
the share of one in the other, a time or memory as their difference.
docs/bad_inputs.md (generated from the bad-input cases) and README's GPU table (rendered from the result files and
checked by tests/test_gpu_table.py) are left out."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest

from benchmarks import gpu_table
from tests.doc_text import CODE_SPAN, LINK, ROOT, Block, blocks, link_targets, pages, references

RESULTS = "benchmarks/archive/results/"
TEXT_FILES = (".json", ".jsonl", ".txt", ".md", ".log", ".sh", ".csv")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
# A figure: a number with its unit, not inside a word or a name (h200x2, 2026-12-05-h100); a range's end counts.
FIGURE = re.compile(r"(?<![\w./])(?<![A-Za-z_]-)(\d+(?:\.\d+)?)(?:\s?(ms|s|GiB)(?![\w/])|(%)|(x)(?![\w]))")
HEADER_UNITS = (("s/step", "s"), ("s per step", "s"), ("GiB", "GiB"))
CELL = re.compile(r"^~?(\d+(?:\.\d+)?)(?: \((\d+(?:\.\d+)?)\))?$")  # 0.506, 19.1 (21.5)
PAGES = pages(exclude=("bad_inputs.md",))


@cache
def numbers_of(path: Path) -> frozenset[float]:
    """Every number a result file holds (JSON values, and the numbers inside its strings and its text), or those of
    every text file of a folder."""
    if path.is_dir():
        return frozenset().union(*(numbers_of(p) for p in sorted(path.rglob("*")) if p.suffix in TEXT_FILES))
    if path.suffix not in TEXT_FILES:
        return frozenset()
    text = path.read_text(errors="replace")
    found: set[float] = set()

    def walk(value: object) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            found.add(float(value))
        elif isinstance(value, str):
            found.update(float(n) for n in NUMBER.findall(value))
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    documents = [text] if path.suffix == ".json" else text.splitlines() if path.suffix == ".jsonl" else []
    for document in documents:
        try:
            walk(json.loads(document))
        except ValueError:
            found.update(float(n) for n in NUMBER.findall(document))
    if not documents:
        found.update(float(n) for n in NUMBER.findall(text))
    return frozenset(found)


def same(value: float, stated: str) -> bool:
    """Whether `value` rounded to the precision of `stated` (its decimals) is `stated`."""
    decimals = len(stated.partition(".")[2])
    return f"{value:.{decimals}f}" == stated or f"{-value:.{decimals}f}" == stated


def matches(stated: str, unit: str, values: frozenset[float]) -> list[float]:
    """The values of the files a figure may be: itself, a fraction for a percentage, seconds for milliseconds."""
    scale = {"%": (1, 100), "ms": (1, 1000)}.get(unit, (1,))
    return [v for v in values for k in scale if same(v * k, stated)]


def prose(block: Block) -> str:
    """The block's text without code spans and link targets (a date or a folder name is not a figure)."""
    return LINK.sub("]", CODE_SPAN.sub(" ", block.text))


def table_figures(block: Block, header: list[str] | None) -> list[tuple[str, str]]:
    """Bare numbers of a table row in the columns whose header names a unit: (number, unit)."""
    if header is None:
        return []
    cells = [c.strip() for c in prose(block).strip("|").split("|")]
    out = []
    for cell, title in zip(cells, header):
        unit = next((u for key, u in HEADER_UNITS if key in title), None)
        found = CELL.match(cell)
        if unit and found:
            out += [(n, unit) for n in found.groups() if n is not None]
    return out


def figures(block: Block, header: list[str] | None = None) -> list[tuple[str, str]]:
    """(number, unit) of every figure the block states."""
    stated = [(m[0], m[1] or m[2] or m[3]) for m in FIGURE.findall(prose(block))]
    return stated + table_figures(block, header)


def sources(block: Block, refs: dict[str, str]) -> list[Path]:
    """The result files (or folders) the block links or names."""
    out = []
    for target in link_targets(block, refs) + CODE_SPAN.findall(block.text):
        for word in target.split():
            if RESULTS in word:
                path = word.split("#")[0]
                path = ROOT / path[path.index(RESULTS) :]
                out.append(path if path.exists() else path.parent)  # `FOLDER/rows.sh RESULTS`: the folder's
    return out


def derived(stated: str, unit: str, others: list[tuple[str, str, list[float]]]) -> bool:
    """A ratio (x) as the quotient of two figures of the block, a percentage as their relative difference or the share
    of one in the other, a time or memory as their difference (s and ms as one unit); each figure by its stated value
    or a value of the files it matched."""
    seconds = {"s": 1.0, "ms": 1e-3}
    for i, (a, a_unit, a_values) in enumerate(others):
        for j, (b, b_unit, b_values) in enumerate(others):
            if i == j or not (a_unit == b_unit or (a_unit in seconds and b_unit in seconds)):
                continue  # the same figure, or two of different kinds
            for x in [float(a) * seconds.get(a_unit, 1), *(v * seconds.get(a_unit, 1) for v in a_values)]:
                for y in [float(b) * seconds.get(b_unit, 1), *(v * seconds.get(b_unit, 1) for v in b_values)]:
                    if unit == "x" and y and same(x / y, stated):
                        return True
                    if unit == "%" and y and (same(100 * abs(x - y) / y, stated) or same(100 * x / y, stated)):
                        return True
                    if unit == "GiB" == a_unit and same(abs(x - y), stated):
                        return True
                    if unit in seconds and a_unit in seconds and same(abs(x - y) / seconds[unit], stated):
                        return True
    return False


def check_block(block: Block, refs: dict[str, str], header: list[str] | None = None) -> list[str]:
    """What in the block is not in the result files it links (empty: all is, or it links none)."""
    files = sources(block, refs)
    stated = figures(block, header)
    if not files or not stated:
        return []
    values = frozenset().union(*(numbers_of(f) for f in files))
    missing = [f for f in files if not f.exists()]
    found = [(n, u, matches(n, u, values)) for n, u in stated]
    measured = [(n, u, hits) for n, u, hits in found if hits and u not in ("x", "%")]
    wrong = []
    for n, u, hits in found:
        if hits or derived(n, u, measured):
            continue
        wrong.append(f"{n}{'' if u in ('x', '%') else ' '}{u}")
    names = ", ".join(str(f.relative_to(ROOT)) for f in files)
    out = [f"{block.where()}: {f.relative_to(ROOT)} does not exist" for f in missing]
    return out + ([f"{block.where()}: {', '.join(wrong)} not in {names}"] if wrong else [])


def check_page(page: Path) -> list[str]:
    text = page.read_text()
    if page.name == "README.md":  # the generated table has its own test
        text = gpu_table.replace_block(text, "")
    refs, problems, header = references(page), [], None
    for block in blocks(page, text):
        if block.code:
            continue
        if block.text.startswith("|"):
            cells = [c.strip() for c in block.text.strip("|").split("|")]
            if all(set(c) <= set("-: ") for c in cells):
                continue
            if header is None:
                header = cells
                continue
        else:
            header = None
        problems += check_block(block, refs, header)
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_figure_beside_a_result_file_is_in_it(page):
    problems = check_page(page)
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_figure_missing_from_its_file_and_accepts_rounding_ratios_and_fractions(tmp_path):
    """On a page of its own: a figure rounded from the file passes, a wrong one fails; a ratio and a relative
    difference of two of the block's figures pass, a ratio of none of them fails; a percentage stored as a fraction
    passes; a table column's unit applies to its bare numbers; a block that links no result file is not checked."""
    link = "../benchmarks/archive/results/2026-12-05-h100-small/trainer_small.json"
    auto = "../benchmarks/archive/results/2026-12-02-h200/auto.json"
    values = numbers_of(ROOT / link[3:])
    assert {0.506, 0.707, 19.05} <= values  # small24_fp8_auto_c's and small24_bf16_auto_c's steps, fp8's peak
    assert 0.484 in numbers_of(ROOT / auto[3:])  # cp1_2048_ro's MFU, a fraction
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(
        f"fp8: 0.506 s and 0.51 s, bf16 0.707 s: 1.40x faster, 28% less ([file]({link})).\n\n"
        f"fp8: 0.600 s, 19.05 GiB, 1.50x ([file]({link})).\n\n"
        "| run | s/step | peak GiB (planned) | file |\n|---|---:|---:|---|\n"
        f"| fp8 | 0.506 | 19.1 (21.5) | [f]({link}) |\n"
        f"| fp8 | 0.506 | 19.9 (21.5) | [f]({link}) |\n\n"
        f"2048 px, one GPU: 48% MFU ([file]({auto})).\n\n"
        "No link, no check: 9.999 s.\n"
    )
    problems = check_page(page)
    assert len(problems) == 2, problems
    assert problems[0].endswith(f":3: 0.600 s, 1.50x not in {link[3:]}"), problems[0]
    assert problems[1].endswith(f":8: 19.9 GiB not in {link[3:]}"), problems[1]
