"""docs/architecture.md and the manual's module table (docs/index.md) hold to the tree: every path they name
exists, every package and top-level module of rigctl/ is named, no import goes against the layers the page
states, and no module grows past the size a reader can hold."""

from __future__ import annotations

import logging
import re
from importlib import metadata
from pathlib import Path

import pytest
from test_import_graph import graph

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rigctl"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MANUAL = ROOT / "docs" / "index.md"
MAX_LINES = 700
#: Imports against the layers that a change in flight removes: (importer prefix, imported prefix) -> why.
#: Each must still be needed; drop it with the import it excuses.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def layers() -> list[set[str]]:
    """The ```layers block of docs/architecture.md, bottom layer first."""
    found = re.search(r"```layers\n(.*?)```", ARCHITECTURE.read_text(), re.S)
    assert found, "docs/architecture.md has no ```layers block"
    return [set(line.split()) for line in reversed(found.group(1).strip().splitlines())]


def unit(module: str) -> str:
    """The package or top-level module of rigctl a module belongs to (``__init__`` for rigctl itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def units() -> set[str]:
    """Every package and top-level module of rigctl."""
    return {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.is_file() and p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}


def ranks() -> dict[str, int]:
    """Each unit's layer, bottom 0; the package's own ``__init__`` (version, logging) is at the bottom."""
    return {"__init__": 0, **{name: index for index, layer in enumerate(layers()) for name in layer}}


def named_paths(markdown: str) -> set[str]:
    """The ``rigctl/...`` paths a Markdown text names in backticks, directories with their slash."""
    return set(re.findall(r"`(rigctl/[\w/.]*)`", markdown))


def table(markdown: str, first_column: str) -> str:
    """The Markdown table whose header starts with ``| first_column |``."""
    found = re.search(rf"^\| {re.escape(first_column)} \|.*?\n((?:\|.*\n)+)", markdown, re.M)
    assert found, f"no table headed {first_column!r}"
    return found.group(1)


@pytest.mark.parametrize("document", [ARCHITECTURE, MANUAL], ids=lambda p: p.name)
def test_every_path_named_exists_and_every_package_is_named(document: Path) -> None:
    text = table(document.read_text(), "path" if document == ARCHITECTURE else "module")
    named = named_paths(text)
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{document.name} names what is not in the tree: {missing}"
    covered = {p.removeprefix("rigctl/").split("/")[0].removesuffix(".py") for p in named}
    unnamed = sorted(units() - covered)
    assert not unnamed, f"{document.name}'s layout table leaves out {unnamed}"


def test_every_package_has_a_layer() -> None:
    placed = set().union(*layers())
    assert not units() - placed, f"docs/architecture.md places no layer for {sorted(units() - placed)}"
    assert not placed - units(), f"docs/architecture.md layers name what is not in rigctl/: {sorted(placed - units())}"


def violations(edges: dict[str, set[str]], rank: dict[str, int]) -> tuple[list[str], set[tuple[str, str]]]:
    """The imports in ``edges`` that go up the layers, and the known exceptions that excused one."""
    against, excused = [], set()
    for importer, imported in edges.items():
        for dep in imported:
            if rank[unit(dep)] <= rank[unit(importer)]:
                continue
            exception = next((key for key in KNOWN_EXCEPTIONS if importer.startswith(key[0])
                              and dep.startswith(key[1])), None)
            if exception:
                excused.add(exception)
            else:
                against.append(f"{importer} imports {dep} ({unit(importer)} is below {unit(dep)})")
    return sorted(against), excused


def test_no_import_goes_against_the_layers() -> None:
    against, excused = violations(graph(deferred=True), ranks())
    assert not against, "imports against docs/architecture.md's layers:\n" + "\n".join(against)
    stale = set(KNOWN_EXCEPTIONS) - excused
    assert not stale, f"exceptions no import needs any more (remove them here and in the page): {sorted(stale)}"


def test_the_layer_check_sees_an_import_against_the_direction() -> None:
    rank = ranks()
    assert rank["errors"] < rank["inventory"] < rank["fleet"] < rank["analysis"] < rank["cli"]
    edges = {"rigctl.inventory.model": {"rigctl.fleet.host_facts", "rigctl.errors"},
             "rigctl.services.exporter": {"rigctl.fleet.state"}}
    against, _ = violations(edges, rank)
    assert against == ["rigctl.inventory.model imports rigctl.fleet.host_facts (inventory is below fleet)"]


def test_no_module_is_longer_than_a_reader_holds() -> None:
    long = sorted(f"{p.relative_to(ROOT)} ({n} lines)" for p in PACKAGE.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_package_has_a_version_and_configures_no_output() -> None:
    import rigctl

    assert rigctl.__version__ == metadata.version("rigctl")
    handlers = logging.getLogger("rigctl").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)
