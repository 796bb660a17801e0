"""The shape of the code, measured by tools/import_graph.py: no import loops, no import from a phase of the recipe to
a later one, at most 10 floors, and no module of flux_cp/ or cp/ over 600 lines. The tool itself is checked on a small
package whose graph is known."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_FLOORS = 10
MAX_LINES = 600


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and annotations look the module up by name
    spec.loader.exec_module(module)
    return module


graph = _tool()


@pytest.fixture(scope="module")
def measured() -> dict:
    return graph.measure(ROOT)


def test_no_import_loops(measured):
    assert measured["loops"] == []


def test_no_upward_arrows(measured):
    assert measured["upward"] == []


def test_floors(measured):
    assert measured["floors"] <= MAX_FLOORS, " -> ".join(measured["longest_chain"])


def test_every_module_has_a_phase(measured):
    assert set(measured["phases"]) == set(measured["imports"])


def test_no_long_modules():
    long = {
        str(p.relative_to(ROOT)): n
        for package in graph.PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


# --- the tool, on a package whose graph is known -----------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


PHASES = [("cp", ("cp",)), ("low", ("flux_cp.low", "flux_cp")), ("high", ("flux_cp.high",))]


def test_tool_counts_every_kind_of_import(tmp_path):
    """Module-level, function-local, TYPE_CHECKING and relative imports are arrows; a package's own `__init__` run by
    importing one of its modules is not."""
    _write(
        tmp_path,
        {
            "cp/__init__.py": "from .core import f\n",
            "cp/core.py": "import torch\n",
            "flux_cp/__init__.py": "",
            "flux_cp/base.py": "import os\n",
            "flux_cp/low/__init__.py": "",
            "flux_cp/low/a.py": "from flux_cp import base\n",
            "flux_cp/low/b.py": "def g():\n    from . import a\n",
            "flux_cp/high/__init__.py": "",
            "flux_cp/high/c.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..low.b import g\nimport cp\n"
            ),
        },
    )
    result = graph.measure(tmp_path, PHASES)
    assert result["imports"]["flux_cp.low.a"] == ["flux_cp.base"]
    assert result["imports"]["flux_cp.low.b"] == ["flux_cp.low.a"]
    assert result["imports"]["flux_cp.high.c"] == ["cp", "flux_cp.low.b"]
    assert result["imports"]["cp"] == ["cp.core"]
    assert result["floor"]["flux_cp.base"] == 1
    assert result["floors"] == 4  # c -> b -> a -> base
    assert result["longest_chain"] == ["flux_cp.high.c", "flux_cp.low.b", "flux_cp.low.a", "flux_cp.base"]
    assert result["loops"] == [] and result["upward"] == []
    assert result["phases"]["flux_cp.base"] == "low" and result["phases"]["flux_cp.high.c"] == "high"


def test_tool_finds_loops_and_upward_arrows(tmp_path):
    _write(
        tmp_path,
        {
            "cp/__init__.py": "",
            "flux_cp/__init__.py": "",
            "flux_cp/low/__init__.py": "",
            "flux_cp/low/a.py": "from flux_cp.low import b\n",
            "flux_cp/low/b.py": "def f():\n    import flux_cp.high.c\n",
            "flux_cp/high/__init__.py": "",
            "flux_cp/high/c.py": "from flux_cp.low.a import x\n",
        },
    )
    result = graph.measure(tmp_path, PHASES)
    assert result["loops"] == [["flux_cp.high.c", "flux_cp.low.a", "flux_cp.low.b"]]
    assert result["upward"] == [{"from": "flux_cp.low.b", "to": "flux_cp.high.c", "line": 2}]
    assert result["floors"] == 1  # a loop counts as one module


def test_tool_prints_the_numbers(tmp_path, capsys):
    assert graph.main(["--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert f"floors: {graph.measure(ROOT)['floors']}\n" in out and "loops: " in out and "upward arrows: " in out
