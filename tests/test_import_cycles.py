"""No import cycle in src/modelkiln, counting the imports made inside functions too.

A lazy (function-level) import, or one under ``if TYPE_CHECKING:``, hides a cycle from Python at
start-up but not from the reader: two modules that need each other are one module cut in two. The
imports are read with ``ast``; nothing is executed.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "modelkiln"
SOURCE = Path(__file__).resolve().parent.parent / "src" / PACKAGE


def module_name(path: Path, root: Path = SOURCE) -> str:
    parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every dotted name an import statement in ``tree`` may load, relative imports resolved.
    For ``from a import b`` both ``a`` and ``a.b`` are listed; the caller keeps those that are modules."""
    names: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph(root: Path = SOURCE) -> dict[str, set[str]]:
    """Module -> the project modules it imports. Importing ``a.b.c`` also runs ``a/__init__.py``
    and ``a/b/__init__.py``: those count as imported too, except the importer's own packages
    (they are already running when it is imported)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        targets: set[str] = set()
        for name in imported_names(ast.parse(path.read_text(encoding="utf-8")), module, is_package):
            if name not in files:
                continue
            parts = name.split(".")
            targets.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                           if p in files and p not in own_packages)
        graph[module] = targets - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def test_no_import_cycle_in_src():
    found = cycles(import_graph())
    assert not found, "import cycles in src/modelkiln:\n" + "\n".join(" <-> ".join(c) for c in found)


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / PACKAGE


@pytest.mark.parametrize("files, expected", [
    # A cycle closed by an import inside a function is still a cycle.
    ({"__init__.py": "", "a.py": "from . import b\n", "b.py": "def f():\n    from .a import x\n"},
     [["modelkiln.a", "modelkiln.b"]]),
    # Importing a submodule runs its package's __init__, which imports back.
    ({"__init__.py": "", "p/__init__.py": "from ..c import y\n", "p/m.py": "", "c.py": "from .p.m import z\n"},
     [["modelkiln.c", "modelkiln.p"]]),
    # A module inside a package importing its sibling is no cycle with the package file.
    ({"__init__.py": "", "p/__init__.py": "from .m import z\n", "p/m.py": "from . import n\n", "p/n.py": ""}, []),
    # Imports that only a type checker reads count too.
    ({"__init__.py": "", "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
      "b.py": "from .a import A\n"}, [["modelkiln.a", "modelkiln.b"]]),
    # Modules that import the same leaf are no cycle.
    ({"__init__.py": "", "a.py": "from .leaf import x\n", "b.py": "from .leaf import y\nfrom . import a\n",
      "leaf.py": ""}, []),
])
def test_the_cycle_finder_sees_what_it_should(tmp_path, files, expected):
    root = _write(tmp_path, files)
    assert cycles(import_graph(root)) == expected
