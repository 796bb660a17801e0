"""The import graph of flux_cp/ and cp/, measured from the source: floors, loops and upward arrows.

    python tools/import_graph.py            # the numbers, the longest chain, every loop and upward arrow
    python tools/import_graph.py --edges    # also every module's imports, by floor
    python tools/import_graph.py --json     # the same as one JSON object

An arrow is any import of a project module, wherever it is written: at module level, inside a function, or under
`if TYPE_CHECKING:` (a type import ties two modules as much as any). `from a import b` is an arrow to the module
`a.b` when there is one, else to `a`. Importing a module also runs its packages' `__init__.py`; those implicit
arrows are not counted (every package's `__init__` would otherwise sit above all its modules).

- *floor*: a module that imports no project module is on floor 1; any other is one floor above the highest module
  it imports. The floors of the graph are the highest module's (with loops, each loop counts as one module).
- *loops*: groups of modules that import each other, directly or through others (strongly connected components).
- *upward arrows*: an import from a phase to a later phase of `PHASES` (the order of the recipe: a phase may use
  the ones before it, never one after it). Every module belongs to exactly one phase.

Standard library only, so it runs before anything is installed."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cp", "flux_cp")

# The phases in the order of the recipe: each may import the phases above it in this list, never one below.
# A module's phase is the one with the longest prefix it has (a package or a module, by dotted name).
Phases = list[tuple[str, tuple[str, ...]]]  # (phase, module prefixes), in order
PHASES: Phases = [
    ("cp", ("cp",)),  # the CP library, which knows nothing of flux_cp
    ("ground", ("flux_cp",)),  # the modules at flux_cp/'s top: errors, files, terminal, images, layout, hub, ...
    ("config", ("flux_cp.config",)),  # the flags
    ("families", ("flux_cp.families",)),  # what is specific to a model family
    ("loss", ("flux_cp.loss",)),  # the objective: a pure function of a micro-batch's tensors and their CP split
    ("data", ("flux_cp.data",)),  # sources, buckets, batch schedule, encodings and their cache, micro-batches
    ("shape", ("flux_cp.shape",)),  # the run shape: what kind of run this is
    ("model", ("flux_cp.model",)),  # loading, adapters, precision, offload, blocks, parallelize, optimizer
    ("plan", ("flux_cp.plan",)),  # memory, disk and speed models, --compile auto, --plan's report
    ("outputs", ("flux_cp.outputs",)),  # output folder, checkpoints, resume, validation, metrics, card, summary
    # the run's phases, and the commands users run (python -m flux_cp.tiny / .metrics / .profiling)
    ("run", ("flux_cp.run", "flux_cp.tiny", "flux_cp.metrics", "flux_cp.profiling")),
]


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages (a package by its `__init__.py`)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module name of a (possibly relative) `from ... import`."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _project_module(name: str, modules: dict[str, Path]) -> str | None:
    """The project module a dotted name is in (its longest prefix that is a module), or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported project module: line of its first import}, every import statement of the file."""
    modules = module_files(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets: dict[str, int] = {}
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(node, module, path.name == "__init__.py")
                for alias in node.names:
                    names.append(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
            for name in names:
                target = _project_module(name, modules)
                if target is not None and target != module:
                    targets.setdefault(target, node.lineno)
        graph[module] = targets
    return graph


def loops(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The groups of modules that import each other (Tarjan's strongly connected components of more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # iterative, so a deep graph cannot exhaust Python's recursion limit
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def floors(graph: dict[str, dict[str, int]]) -> tuple[dict[str, int], list[str]]:
    """Each module's floor, and the longest chain of imports (top first). A loop counts as one module: all its
    members share a floor."""
    group_of = {m: m for m in graph}
    for group in loops(graph):
        for member in group:
            group_of[member] = group[0]
    members: dict[str, list[str]] = {}
    for module, group in group_of.items():
        members.setdefault(group, []).append(module)
    below = {g: {group_of[t] for m in ms for t in graph[m]} - {g} for g, ms in members.items()}
    floor: dict[str, int] = {}
    step: dict[str, str | None] = {}

    def settle(start: str) -> None:
        work = [start]
        while work:
            group = work[-1]
            pending = [b for b in sorted(below[group]) if b not in floor]
            if pending:
                work.extend(pending)
                continue
            work.pop()
            if group in floor:
                continue
            best = max(sorted(below[group]), key=lambda b: floor[b], default=None)
            floor[group] = 1 + (floor[best] if best is not None else 0)
            step[group] = best

    for group in sorted(members):
        settle(group)
    top = max(sorted(floor), key=lambda g: floor[g])
    chain: list[str] = []
    group: str | None = top
    while group is not None:
        chain.append(group if len(members[group]) == 1 else "{" + ", ".join(sorted(members[group])) + "}")
        group = step[group]
    return {m: floor[group_of[m]] for m in graph}, chain


def phase_of(module: str, phases: Phases | None = None) -> str:
    """The phase of `phases` (default: `PHASES`) a module belongs to: the one with the longest prefix it has."""
    matches = [
        (len(prefix), name)
        for name, prefixes in (PHASES if phases is None else phases)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    if not matches:
        raise ValueError(f"{module} belongs to no phase of PHASES")
    return max(matches)[1]


def upward(graph: dict[str, dict[str, int]], phases: Phases | None = None) -> list[tuple[str, str, int]]:
    """(importer, imported, line) of every import from a phase to a later one."""
    rank = {name: i for i, (name, _) in enumerate(PHASES if phases is None else phases)}
    return [
        (module, target, line)
        for module, targets in sorted(graph.items())
        for target, line in sorted(targets.items())
        if rank[phase_of(target, phases)] > rank[phase_of(module, phases)]
    ]


def measure(root: Path = ROOT, phases: Phases | None = None) -> dict:
    """Everything the tool prints, as plain data (`phases`: default `PHASES`)."""
    graph = imports(root)
    floor, chain = floors(graph)
    return {
        "modules": len(graph),
        "floors": max(floor.values()),
        "loops": loops(graph),
        "upward": [{"from": a, "to": b, "line": line} for a, b, line in upward(graph, phases)],
        "longest_chain": chain,
        "floor": floor,
        "imports": {m: sorted(t) for m, t in graph.items()},
        "phases": {m: phase_of(m, phases) for m in graph},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--edges", action="store_true", help="also list every module's imports, by floor")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this tool's)")
    args = parser.parse_args(argv)
    result = measure(args.root)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"modules: {result['modules']}")
    print(f"floors: {result['floors']}")
    print(f"loops: {len(result['loops'])}")
    for group in result["loops"]:
        print("  loop: " + " <-> ".join(group))
    print(f"upward arrows: {len(result['upward'])}")
    for arrow in result["upward"]:
        source, target = arrow["from"], arrow["to"]
        phases = result["phases"]
        print(f"  {source} ({phases[source]}) -> {target} ({phases[target]}), line {arrow['line']}")
    print("longest chain: " + " -> ".join(result["longest_chain"]))
    if args.edges:
        for module in sorted(result["floor"], key=lambda m: (-result["floor"][m], m)):
            targets = sorted(result["imports"][module], key=lambda t: (-result["floor"][t], t))
            print(f"{result['floor'][module]:3d} {module} -> {', '.join(targets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
