"""rigctl's import graph: no cycle among the imports a module runs when it is imported, and nothing outside
rigctl.cli imports rigctl.cli (the CLI is a thin layer over the library, never a part of it), counting the
imports deferred into functions too. Read from the source with ast."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rigctl"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "assets" not in p.parts}


def _import_nodes(tree: ast.Module, deferred: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement (``deferred``), or those that run on import: the module body's own, under
    ``if``/``try`` too, not inside functions or classes' methods and not under ``if TYPE_CHECKING``."""
    if deferred:
        return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    found: list[ast.Import | ast.ImportFrom] = []

    def body(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    body(node.body)
                body(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    body(part)
            elif isinstance(node, ast.ClassDef):
                body(node.body)

    body(tree.body)
    return found


def imports(path: Path, name: str, known: set[str], *, deferred: bool = False) -> set[str]:
    """The rigctl modules ``path`` imports (``from rigctl.x import y`` counts rigctl.x.y when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), deferred):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known and m != name}


def graph(*, deferred: bool = False) -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(path, name, known, deferred=deferred) for name, path in found.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_one() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_walk_tells_import_time_from_deferred_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nimport a\nif TYPE_CHECKING:\n    import b\n"
                      "try:\n    import c\nexcept ImportError:\n    import d\n\ndef f():\n    import e\n")
    known = set("abcde")
    assert imports(module, "m", known) == {"a", "c", "d"}
    assert imports(module, "m", known, deferred=True) == known


def test_rigctl_has_no_import_cycle() -> None:
    edges = graph()
    assert "rigctl.cli.bench" in edges["rigctl.cli.app"]  # the walk sees the app's imports of its groups
    found = cycle(edges)
    assert found is None, "import cycle: " + " -> ".join(found or [])


def test_rigctl_has_no_import_cycle_counting_the_imports_deferred_into_functions() -> None:
    """A deferred import only postpones a circle: each shared piece has one home both sides import."""
    edges = graph(deferred=True)
    assert "rigctl.cli.app" in edges["rigctl.cli.main"]  # the walk sees imports inside functions
    found = cycle(edges)
    assert found is None, "import cycle (deferred imports included): " + " -> ".join(found or [])


def test_nothing_outside_the_cli_imports_it() -> None:
    edges = graph(deferred=True)
    offenders = sorted(f"{name} imports {dep}" for name, deps in edges.items() if not name.startswith("rigctl.cli")
                       for dep in deps if dep == "rigctl.cli" or dep.startswith("rigctl.cli."))
    assert not offenders


def test_no_command_module_imports_the_cli_package_back() -> None:
    """rigctl.cli.app puts the command modules together; they share rigctl.cli.common, never the package
    (``python -m rigctl.cli``'s __main__ runs the package's main, and is no command module)."""
    edges = graph(deferred=True)
    back = sorted(name for name, deps in edges.items() if name.startswith("rigctl.cli.")
                  and name not in ("rigctl.cli.__main__", "rigctl.cli.app") and "rigctl.cli" in deps)
    assert not back


def test_the_cli_package_itself_imports_nothing_heavy() -> None:
    """``rigctl``'s entry point may start the inventory's preload before the app is imported."""
    code = ("import sys, rigctl.cli.main, rigctl.cli.preloading, rigctl.inventory.preload; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'typer', 'rich', 'click', 'ansible', 'paramiko', "
            "'pydantic', 'yaml', 'numpy'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("folder", ["tests", "perf"])
def test_tests_and_scripts_do_not_import_the_cli(folder: str) -> None:
    """Tests drive the CLI as a command (subprocess), never by importing its modules."""
    known = {"rigctl.cli", *(m for m in modules() if m.startswith("rigctl.cli."))}
    offenders = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        found = imports(path, "", known | {""}, deferred=True)
        offenders += [f"{path.relative_to(ROOT)} imports {m}" for m in sorted(found & known)]
    assert not offenders
