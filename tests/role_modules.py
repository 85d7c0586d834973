"""Load a role's Ansible module (or plugin) from its file, as a host runs it: its ``ansible.module_utils`` imports of
rigctl's host-side code resolve the way ``ansible.cfg``'s ``module_utils = rigctl/hostside`` makes them."""

from __future__ import annotations

import configparser
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def _module_utils_dir() -> Path:
    config = configparser.ConfigParser()
    config.read(REPO / "ansible.cfg")
    return REPO / config["defaults"]["module_utils"]


def load(path: Path, name: str) -> ModuleType:
    """The module at ``path`` as ``name``, with every ``ansible.module_utils.<x>`` of the module_utils dir."""
    utils = _module_utils_dir()
    package = ".".join(utils.relative_to(REPO).parts)
    for source in utils.glob("*.py"):
        if source.stem != "__init__":
            sys.modules.setdefault(f"ansible.module_utils.{source.stem}", importlib.import_module(
                f"{package}.{source.stem}"))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
