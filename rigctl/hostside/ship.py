"""How the host-side modules travel to a host. This module runs on the controller only.

A host-side module imports its siblings the way the controller does (``from rigctl.hostside import
model_files``), so the controller's tests exercise the very code a host runs. Two ways to ship one:

* :func:`python_command`: a one-shot ``python3 -c`` command line that carries the module and the
  host-side modules it imports (transitively); nothing is written on the host. The module's
  ``main(argv) -> int`` runs with the command's arguments.
* :func:`package_files`: the same modules as files under ``rigctl/hostside/`` (with an empty
  ``rigctl/__init__.py``), for a job directory: a script in that directory imports them from there.
"""

from __future__ import annotations

import ast
import functools
import shlex
import threading
from importlib import resources

from rigctl.errors import ConfigError

PACKAGE = "rigctl.hostside"
#: Written as ``rigctl/__init__.py`` on the host: a regular package there wins over any other ``rigctl``
#: on the host's path.
_ROOT_INIT = "# rigctl's host-side modules, shipped by the controller (rigctl.hostside.ship).\n"

# Installs (name, source) modules into sys.modules, packages first, then runs the entry's main.
_BOOTSTRAP = """import sys, types
def _install(modules):
    for name, text in modules:
        module = types.ModuleType(name)
        module.__file__ = "<rigctl>/" + name.replace(".", "/") + ".py"
        if name in ("rigctl", "rigctl.hostside"):
            module.__path__ = []
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
        exec(compile(text, module.__file__, "exec"), module.__dict__)
"""


@functools.cache  # the package's files do not change under a running controller (the exporter asks often)
def source(name: str) -> str:
    """The source of ``rigctl/hostside/<name>.py``; ConfigError when there is no such module."""
    if not name.isidentifier():
        raise ConfigError(f"task {name!r}: not a module name")
    try:
        return resources.files(PACKAGE).joinpath(f"{name}.py").read_text()
    except FileNotFoundError:
        raise ConfigError(f"task {name!r}: no rigctl/hostside/{name}.py") from None


#: CPython 3.11 keeps ast's recursion bookkeeping per interpreter, not per thread: two threads parsing at
#: once (a fan-out shipping code to several hosts) can fail with "SystemError: AST constructor recursion
#: depth mismatch". One parse at a time.
_PARSE_LOCK = threading.Lock()


@functools.cache
def imported_siblings(text: str) -> tuple[str, ...]:
    """The host-side modules a module's source imports (``from rigctl.hostside import x``,
    ``from rigctl.hostside.x import y``, ``import rigctl.hostside.x``), in source order."""
    found: list[str] = []
    with _PARSE_LOCK:
        tree = ast.parse(text)
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + "."):
            names = [str(node.module).split(".")[2]]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[2] for a in node.names if a.name.startswith(PACKAGE + ".")]
        found.extend(n for n in names if n not in found)
    return tuple(found)


def closure(names: list[str]) -> list[str]:
    """``names`` and every host-side module they import, dependencies first."""
    ordered: list[str] = []

    def visit(name: str, stack: tuple[str, ...]) -> None:
        if name in ordered:
            return
        if name in stack:
            raise ConfigError(f"rigctl/hostside: import cycle {' -> '.join((*stack, name))}")
        for sibling in imported_siblings(source(name)):
            visit(sibling, (*stack, name))
        ordered.append(name)

    for name in names:
        visit(name, ())
    return ordered


def package_files(names: list[str]) -> dict[str, str]:
    """``{relative path: source}`` of the modules ``names`` import, as the package ``rigctl.hostside``."""
    files = {"rigctl/__init__.py": _ROOT_INIT, "rigctl/hostside/__init__.py": source("__init__")}
    for name in closure(names):
        for sibling in imported_siblings(source(name)):
            files[f"rigctl/hostside/{sibling}.py"] = source(sibling)
    return files


@functools.cache
def _program(entry: str) -> str:
    modules = [("rigctl", _ROOT_INIT), (PACKAGE, source("__init__"))]
    modules += [(f"{PACKAGE}.{name}", source(name)) for name in closure([entry])]
    return (f"{_BOOTSTRAP}_install({modules!r})\n"
            f"sys.exit(sys.modules[{f'{PACKAGE}.{entry}'!r}].main(sys.argv[1:]))\n")


def python_command(entry: str, *args: str) -> str:
    """``python3 -c ...`` running ``rigctl.hostside.<entry>``'s ``main(args)``, its imports carried along."""
    return "python3 -c " + " ".join(shlex.quote(a) for a in (_program(entry), *args))
