"""Load a role's Ansible module (or plugin) from its file, as a host runs it: its ``ansible.module_utils`` imports of
rigctl's host-side code resolve the way ``ansible.cfg``'s ``module_utils = rigctl/hostside`` makes them."""

from __future__ import annotations

import configparser
import importlib
import importlib.util
import json
import os
import subprocess
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


def run(library: Path, name: str, args: dict, workdir: Path, env: dict[str, str] | None = None, *,
        check: bool = False) -> tuple[int, str]:
    """Run the role module ``name`` of ``library`` as Ansible runs it on localhost (``ansible -m``, the
    module_utils dir of ansible.cfg, Ansible's defaults otherwise; in check mode with ``check``);
    (exit status, its output)."""
    (workdir / "ansible.cfg").write_text(f"[defaults]\nmodule_utils = {_module_utils_dir()}\n")
    ansible = str(Path(sys.executable).parent / "ansible")
    done = subprocess.run(
        [ansible, "localhost", "-c", "local", "-M", str(library), "-m", name, "-a", json.dumps(args),
         "-e", f"ansible_python_interpreter={sys.executable}", *(["--check"] if check else [])],
        capture_output=True, text=True, timeout=120, cwd=workdir, check=False,
        env={**os.environ, "ANSIBLE_CONFIG": str(workdir / "ansible.cfg"), "ANSIBLE_LOCALHOST_WARNING": "0",
             "ANSIBLE_NOCOLOR": "1", **(env or {})})
    return done.returncode, done.stdout + done.stderr
