"""No stale references in the README and docs/: every repository path they write (backticked, linked or in a command:
`flux_cp/plan/memory.py`, `tests/test_x.py::test_name`, `benchmarks/...`, `accelerate_configs/x.yaml`), every module or
name of ours they write dotted (`flux_cp.model.offload_plan.plan_offload`, `python -m benchmarks.gpu_table`) and every
page anchor they link exists in this checkout. A path counts as ours when its first folder is one the repository tracks;
placeholders (`RESULTS/...`, `accelerate_configs/CONFIG`, `<layout>`) and output folders (`output/tiny/...`, not
tracked) are examples, not references. docs/bad_inputs.md is generated from the bad-input cases, whose paths are
meant not to exist."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from tests.doc_text import CODE_SPAN, ROOT, anchors, blocks, link_targets, pages, references

PAGES = pages(exclude=("bad_inputs.md",))
TRACKED_FOLDERS = {
    p.split("/", 1)[0]
    for p in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    if "/" in p
}
PACKAGES = ("cp", "flux_cp", "benchmarks", "tests", "tools")
DOTTED = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.\w+)+$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|[<>{}]|\.\.\.|^N$")
# Paths under a tracked folder's name that a page says are not this checkout's: {(page, path): why}.
ELSEWHERE = {
    ("config_files.md", "data/sks"): "the example's own data folder",
    ("benchmarks.md", "flux_cp/fp8.py"): "in git at the commit the page names, removed since",
    ("compatibility.md", "tests/models/transformers/test_models_transformer_flux.py"): "diffusers' repository",
    ("compatibility.md", "tests/lora/test_lora_layers_flux.py"): "diffusers' repository",
    ("compatibility.md", "tests/pipelines/flux/test_pipeline_flux.py"): "diffusers' repository",
}


def words(text: str) -> list[str]:
    """The path-like words of code: split on spaces and quotes, stripped of the punctuation around them."""
    words = (w.lstrip("([").rstrip(".,;:)]") for w in re.split(r"[\s'\"=]+", text))
    return [w for w in words if w]


def resolve_dotted(name: str) -> str | None:
    """None when `name` (a.b.c) is a module of ours or a name in one; else why not."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        if cut == len(parts):
            return None
        obj = importlib.import_module(module)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{module} has no {'.'.join(parts[cut:])}"
            obj = getattr(obj, attr)
        return None
    return "no such module"


def check_path(word: str) -> str | None:
    """None when `word`, a path under a tracked folder, exists (a glob: matches something; `file::test`: the file
    defines the test); else why not."""
    path, _, test = word.partition("::")
    if "*" in path:
        return None if list(ROOT.glob(path)) else "matches nothing"
    if not (ROOT / path).exists():
        module = re.match(r"^(.+)\.(\w+)$", path)  # flux_cp/model/parallel.make_accelerator: a name in a module
        if module and (ROOT / f"{module.group(1)}.py").is_file():
            return resolve_dotted(path.replace("/", "."))
        return "does not exist"
    name = re.escape(test.split("::")[-1].split("[")[0])
    if test and not re.search(rf"^\s*(?:async )?def {name}\(", (ROOT / path).read_text(), re.M):
        return f"defines no {test}"
    return None


def references_in(page: Path) -> list[tuple[str, str]]:
    """(where, word) of every path and dotted name of ours the page writes, in code spans and code blocks."""
    found = []
    for block in blocks(page):
        code = block.text if block.code else " ".join(CODE_SPAN.findall(block.text))
        for word in words(code):
            first = word.split("/", 1)[0]
            if "/" in word and first in TRACKED_FOLDERS:
                if not any(PLACEHOLDER.search(part) for part in word.split("/")):
                    found.append((block.where(), word))
            elif DOTTED.match(word) and not word.endswith((".py", ".md", ".json", ".yaml")):
                found.append((block.where(), word))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_and_module_a_page_names_exists(page):
    stale = []
    for where, word in references_in(page):
        if (page.name, word) in ELSEWHERE:
            continue
        why = check_path(word) if "/" in word else resolve_dotted(word)
        if why is not None:
            stale.append(f"{where}: {word} ({why})")
    assert not stale, "\n".join(stale)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_of_a_page_reaches_its_file_and_anchor(page):
    refs, stale = references(page), []
    for block in blocks(page):
        if block.code:
            continue
        for target in link_targets(block, refs):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                stale.append(f"{block.where()}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                stale.append(f"{block.where()}: {target} (no heading #{anchor} in {file.name})")
    assert not stale, "\n".join(stale)


def test_the_checks_see_a_stale_path_a_missing_test_a_gone_name_and_a_broken_anchor(tmp_path):
    assert check_path("flux_cp/plan/memory.py") is None and check_path("flux_cp/plan/speed_data/*.json") is None
    assert check_path("flux_cp/gone.py") == "does not exist"
    assert check_path("tests/test_doc_paths.py::test_every_path_and_module_a_page_names_exists") is None
    assert check_path("tests/test_doc_paths.py::test_gone") == "defines no test_gone"
    assert resolve_dotted("flux_cp.plan.memory.checkpoint_from_end") is None and resolve_dotted("flux_cp.tiny") is None
    assert resolve_dotted("flux_cp.plan.memory.gone") == "flux_cp.plan.memory has no gone"
    assert resolve_dotted("flux_cp.gone_module") == "flux_cp has no gone_module"
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\nSee `flux_cp/gone.py` and [this](#a-page), [that](#nowhere).\n\n    python -m flux_cp.tiny\n"
    )
    assert [w for _, w in references_in(page)] == ["flux_cp/gone.py", "flux_cp.tiny"]
    assert anchors(page) == {"a-page"}


def test_the_readme_stays_a_first_read():
    """README.md stays under 350 lines with its table of contents; the rest belongs in docs/."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 350 and "## Contents" in text
