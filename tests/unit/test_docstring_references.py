"""Every ``rigctl.…`` dotted name a docstring or comment of the package names resolves: a module, or an
attribute of one (a cross-reference left behind by a move or rename reads as a lie to the next reader)."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rigctl"
#: A dotted name under rigctl, not part of a path, not an import statement quoted as an example, and not a role of
#: the rigctl.fleet Ansible collection named by its FQCN in a play's role list (``roles: [rigctl.fleet.gpu_host]``).
REFERENCE = re.compile(r"(?<![\w/.\[])(?<!from )(?<!import )rigctl(?:\.[A-Za-z_]\w*)+")


def prose(path: Path) -> Iterator[str]:
    """The docstrings and comments of one module."""
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.string


def resolves(name: str) -> bool:
    """Whether ``name`` is an importable module, or an attribute path below the longest one that is."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def references() -> list[tuple[str, str]]:
    return sorted({(str(path.relative_to(PACKAGE.parent)), match.group(0))
                   for path in PACKAGE.rglob("*.py") if "assets" not in path.parts
                   for text in prose(path) for match in REFERENCE.finditer(text)})


def test_the_package_s_prose_names_something_to_check() -> None:
    assert len(references()) > 50  # the scan reads docstrings and comments, not nothing


def test_every_dotted_reference_resolves() -> None:
    stale = [f"{module}: {name}" for module, name in references() if not resolves(name)]
    assert not stale, f"names that are no module or attribute of rigctl: {stale}"
