"""The import graph of the merak package: no cycle between modules or between packages, merak.core
depends on nothing, and the top level holds only the entry points.

The graph is read from the source with ``ast`` (nothing is imported), from every
import statement, at module level or inside a function:

- ``import merak.a.b`` and ``from merak.a.b import name`` are edges to ``merak.a.b``;
  ``from merak.a import b`` is an edge to ``merak.a.b`` when that is a module, else to
  ``merak.a`` (a package's module is its ``__init__``); relative imports are resolved first.
- Importing ``merak.a.b`` runs ``merak/a/__init__.py`` first, so it is an edge to the
  package ``merak.a`` as well, unless the importer is inside ``merak.a`` (Python has
  started that ``__init__`` already). The root ``merak/__init__.py`` runs before any
  merak module at all, so it is left out of these implicit edges; its own imports count.
"""

from __future__ import annotations

import ast
from pathlib import Path

MERAK = Path(__file__).resolve().parents[2] / "merak"
CORE = "merak.core"


def module_files(root: Path = MERAK) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package under ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_package(modules: dict[str, Path], name: str) -> bool:
    return modules[name].name == "__init__.py"


def _nearest_module(modules: dict[str, Path], name: str) -> str | None:
    """``name`` if it is a module, else the closest enclosing one (``merak.a.b.attr`` -> ``merak.a.b``)."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name if name in modules else None


def _imported(modules: dict[str, Path], importer: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The merak modules one import statement of ``importer`` names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [m for m in (_nearest_module(modules, n) for n in names if n.split(".")[0] == "merak") if m]
    if node.level:
        base = importer if _is_package(modules, importer) else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    if base.split(".")[0] != "merak":
        return []
    targets = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        target = submodule if submodule in modules else _nearest_module(modules, base)
        if target:
            targets.append(target)
    return targets


def _enclosing_packages(modules: dict[str, Path], importer: str, target: str) -> list[str]:
    """The packages whose ``__init__`` importing ``target`` runs first (not the root, not the importer's own)."""
    parts = target.split(".")
    packages = [".".join(parts[:end]) for end in range(2, len(parts))]
    return [p for p in packages if p in modules and p != importer and not importer.startswith(p + ".")]


def import_graph(root: Path = MERAK) -> dict[str, set[str]]:
    """Module -> the merak modules it imports (see the module docstring)."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for importer, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(modules, importer, node):
                graph[importer].update(t for t in (target, *_enclosing_packages(modules, importer, target))
                                       if t != importer)
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph seen a level up: ``merak.a.b`` counts as package ``merak.a``; a top-level module
    (``merak.runner``) is a node of its own; edges within one package are dropped."""
    def package(name: str) -> str:
        return ".".join(name.split(".")[:2])

    packages: dict[str, set[str]] = {package(name): set() for name in graph}
    for importer, targets in graph.items():
        packages[package(importer)].update(package(t) for t in targets if package(t) != package(importer))
    return packages


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that import each other, directly or not (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
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
                    groups.append(sorted(group))
    return groups


def shortest_cycle(graph: dict[str, set[str]], group: list[str], start: str) -> list[str]:
    """One shortest cycle through ``start`` within ``group`` (a strongly connected group), ``start`` at both ends."""
    members = set(group)
    previous = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & members):
                if successor == start:
                    cycle = [node]
                    while previous[cycle[-1]] is not None:
                        cycle.append(previous[cycle[-1]])
                    return [*reversed(cycle), start]
                if successor not in previous:
                    previous[successor] = node
                    following.append(successor)
        frontier = following
    return [start]


def describe_cycles(graph: dict[str, set[str]], groups: list[list[str]], per_group: int = 8) -> str:
    """Each group's modules, then up to ``per_group`` different cycles in it (the shortest through each
    module), one line each."""
    lines = []
    for group in groups:
        lines.append(f"{len(group)} modules import each other: {', '.join(group)}")
        seen: set[frozenset[tuple[str, str]]] = set()
        for start in group:
            cycle = shortest_cycle(graph, group, start)
            edges = frozenset(zip(cycle, cycle[1:]))
            if edges not in seen and len(seen) < per_group:
                seen.add(edges)
                lines.append("  cycle: " + " -> ".join(cycle))
    return "\n".join(lines)


def test_the_graph_reads_every_kind_of_import(tmp_path):
    package = tmp_path / "merak"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("from merak.a import helper\n")
    (package / "a" / "__init__.py").write_text("from .helper import name\n")
    (package / "a" / "helper.py").write_text("def name():\n    from merak import b\n    return b\n")
    (package / "b.py").write_text("import merak.a.helper\nfrom merak.a import name\n")
    graph = import_graph(package)
    assert graph == {"merak": {"merak.a", "merak.a.helper"}, "merak.a": {"merak.a.helper"},
                     "merak.a.helper": {"merak.b"}, "merak.b": {"merak.a", "merak.a.helper"}}
    groups = strongly_connected(graph)
    assert groups == [["merak.a", "merak.a.helper", "merak.b"]]
    assert describe_cycles(graph, groups).splitlines() == [
        "3 modules import each other: merak.a, merak.a.helper, merak.b",
        "  cycle: merak.a -> merak.a.helper -> merak.b -> merak.a",
        "  cycle: merak.a.helper -> merak.b -> merak.a.helper"]


def test_merak_has_no_import_cycle():
    graph = import_graph()
    groups = strongly_connected(graph)
    assert not groups, "import cycles in merak:\n" + describe_cycles(graph, groups)


def test_core_imports_nothing_else_from_merak():
    graph = import_graph()
    outside = {module: sorted(t for t in targets if t != CORE and not t.startswith(CORE + "."))
               for module, targets in graph.items() if module == CORE or module.startswith(CORE + ".")}
    assert outside.get(CORE) is not None, "merak.core is missing"
    assert not {m: t for m, t in outside.items() if t}, f"merak.core imports other merak modules: {outside}"


def test_packages_import_each_other_one_way():
    tmp = {"merak.a.x": {"merak.b.y"}, "merak.a.z": set(), "merak.b.y": {"merak.b.w"}, "merak.b.w": {"merak.a.z"},
           "merak.c": {"merak.a.x"}}
    assert package_graph(tmp) == {"merak.a": {"merak.b"}, "merak.b": {"merak.a"}, "merak.c": {"merak.a"}}
    assert strongly_connected(package_graph(tmp)) == [["merak.a", "merak.b"]]
    packages = package_graph(import_graph())
    groups = strongly_connected(packages)
    assert not groups, "packages of merak import each other:\n" + describe_cycles(packages, groups)


# The top level keeps the entry points; everything else lives in a package that says what it is for
# (docs/architecture.md). A new module here needs a reason as good as these.
TOP_LEVEL = {"__init__", "__main__", "cli", "runner", "engine", "recipe", "generation", "scaffold"}


def test_the_top_level_holds_only_entry_points():
    modules = {path.stem for path in MERAK.glob("*.py")}
    assert modules == TOP_LEVEL, (f"new at the top level: {sorted(modules - TOP_LEVEL)}; "
                                  f"gone: {sorted(TOP_LEVEL - modules)}")
