"""The package's rooms depend one way and no module imports itself round a cycle.

Imports are read from the source (``ast``), as Python runs them: those under
``if TYPE_CHECKING:`` are annotations only and do not count. ``from fusectl.core import logs``
is an import of the module ``fusectl.core.logs``; ``from fusectl import optimize`` is an import
of the package ``fusectl`` (its ``__init__``, which imports the public API).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

# Each room may import the rooms listed after it, never one before it.
ROOMS = ("cli", "api", "diagnostics", "core", "passes", "rewrite", "leaf")
LEAVES = {"fusectl.errors", "fusectl.version", "fusectl._imports"}


def _modules() -> dict[str, Path]:
    """Every module of the installed layout: fusectl.* and the passes/ folder as fusectl.passes."""
    found: dict[str, Path] = {}
    for base, package in ((ROOT / "fusectl", "fusectl"), (ROOT / "passes", "fusectl.passes")):
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(module: str, path: Path) -> set[str]:
    """The fusectl modules ``module`` imports when it runs (at any depth of the file)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    imported: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                imported.add(submodule if submodule in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {name for name in imported if name in MODULES and name != module}


GRAPH = {module: _runtime_imports(module, path) for module, path in MODULES.items()}


def _room(module: str) -> str:
    if module in LEAVES:
        return "leaf"
    parts = module.split(".")
    if module == "fusectl" or parts[1] == "api":
        return "api"
    if parts[1] in ("cli", "__main__"):
        return "cli"
    return parts[1]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules round it, or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        state[start] = 1
        stack = [iter(sorted(graph[start]))]
        while stack:
            step = next(stack[-1], None)
            if step is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(step) == 1:
                return [*path[path.index(step) :], step]
            elif not state.get(step):
                state[step] = 1
                path.append(step)
                stack.append(iter(sorted(graph[step])))
    return None


def test_every_module_sits_in_a_room() -> None:
    assert {_room(module) for module in MODULES} <= set(ROOMS)
    # The rooms the tree promises are there, each with modules in it.
    for room in ("core", "rewrite", "diagnostics", "passes"):
        assert any(_room(module) == room for module in MODULES if module.count(".") > 1), room


def test_no_import_cycle() -> None:
    assert _cycle(GRAPH) is None, " -> ".join(_cycle(GRAPH) or [])


def test_rooms_depend_one_way() -> None:
    wrong = sorted(
        f"{module} ({_room(module)}) imports {target} ({_room(target)})"
        for module, targets in GRAPH.items()
        for target in targets
        if ROOMS.index(_room(target)) < ROOMS.index(_room(module))
    )
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"a"}}, ["a", "a"]),
    ],
)
def test_cycle_finder(graph: dict[str, set[str]], expected: list[str] | None) -> None:
    """The checker itself finds a cycle where there is one (so a green run means something)."""
    assert _cycle(graph) == expected


def test_type_checking_imports_do_not_count(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from fusectl.core import engine\n"
        "if TYPE_CHECKING:\n"
        "    from fusectl.diagnostics.sitecheck import SiteChecker\n"
        "def f():\n"
        "    from fusectl import api\n"
    )
    assert _runtime_imports("fusectl.rewrite.m", source) == {"fusectl.core.engine", "fusectl.api"}
