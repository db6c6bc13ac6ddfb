"""The layering of the code, read from its imports: no import cycles, and the core never imports plugins.

Every `import` anywhere in a module counts (also inside functions: a deferred import is how a cycle
hides), except under `if TYPE_CHECKING:`. `plugins/` is the package `trainer.plugins` (pyproject.toml's
package-dir), so its modules are named that way here.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where a package's files are: the installed name -> the folder in the repository.
PACKAGE_DIRS = {"trainer": ROOT / "trainer", "trainer.plugins": ROOT / "plugins"}
# The composition root: the modules that put plugins together and so may import them.
COMPOSITION_ROOT = ("trainer.cli", "trainer.__main__", "trainer.run", "trainer.sweep", "trainer.config.registry",
                    "trainer.planner")


def module_files() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that the import statements of `source` name, outside `if TYPE_CHECKING:`.
    `from X import y` names X.y when that is a module, else X."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            submodules = {f"{origin}.{alias.name}" for alias in node.names} & known
            names.update(submodules)
            if len(submodules) < len(node.names):
                names.add(origin)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return (names & known) - {module}


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    files = module_files()
    known = set(files)
    return {module: imported_modules(path.read_text(), module, path.name == "__init__.py", known)
            for module, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def connect(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
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
    return found


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_core_does_not_import_plugins() -> None:
    offenders = {}
    for module, targets in import_graph().items():
        if module.startswith("trainer.plugins") or module.startswith(COMPOSITION_ROOT):
            continue
        plugin_imports = sorted(t for t in targets if t.startswith("trainer.plugins"))
        if plugin_imports:
            offenders[module] = plugin_imports
    assert offenders == {}, "core modules importing plugins (define an interface in trainer/interfaces instead)"


def test_the_core_does_not_reach_plugins_by_name() -> None:
    """No string naming a plugin module in the core either (importlib / Hydra's get_object would turn it
    into the import the test above forbids); docstrings may mention them."""
    offenders = {}
    for module, path in module_files().items():
        if module.startswith("trainer.plugins") or module.startswith(COMPOSITION_ROOT):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        names = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                 and isinstance(node.value, str) and node.value.startswith("trainer.plugins")
                 and id(node) not in docstrings]
        if names:
            offenders[module] = names
    assert offenders == {}


def test_nothing_imports_a_bare_plugins_package() -> None:
    offenders = []
    for folder in (ROOT / "trainer", ROOT / "plugins", ROOT / "tests", ROOT / "benchmarks"):
        for path in folder.rglob("*.py"):
            if re.search(r"^\s*(from|import)\s+plugins\b", path.read_text(), flags=re.MULTILINE):
                offenders.append(str(path.relative_to(ROOT)))
    targets = [str(p.relative_to(ROOT)) for p in (ROOT / "conf").rglob("*.yaml")
               if re.search(r"_target_:\s*plugins\.", p.read_text())]
    assert offenders + targets == []


def test_pyproject_lists_every_package_folder() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"trainer": "trainer", "trainer.plugins": "plugins"}
    folders = sorted(module for module, path in module_files().items() if path.name == "__init__.py")
    assert sorted(setuptools["packages"]) == folders


# ---- the checker itself must be able to fail ---------------------------------------------------------------
def test_cycle_detection_finds_a_cycle_hidden_in_a_function() -> None:
    source_a = "def f():\n    from trainer.b import g\n"
    graph = {"trainer.a": imported_modules(source_a, "trainer.a", False, {"trainer.a", "trainer.b"}),
             "trainer.b": {"trainer.a"}}
    assert cycles(graph) == [["trainer.a", "trainer.b"]]


def test_type_checking_imports_do_not_count() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer.loop import Trainer\n"
    assert imported_modules(source, "trainer.callback", False, {"trainer.loop", "trainer.callback"}) == set()


@pytest.mark.parametrize("statement, expected", [
    ("from . import io", "trainer.checkpoint.io"),
    ("from .io import save", "trainer.checkpoint.io"),
    ("from .. import loss", "trainer.loss"),
    ("from trainer.checkpoint import io, save_checkpoint", "trainer.checkpoint"),
])
def test_relative_and_from_imports_resolve(statement: str, expected: str) -> None:
    known = {"trainer.checkpoint", "trainer.checkpoint.io", "trainer.checkpoint.state", "trainer.loss"}
    assert expected in imported_modules(statement, "trainer.checkpoint.state", False, known)
