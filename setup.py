"""The wheel carries what ``rigctl provision`` runs besides the Python package: the roles, the playbooks and
Ansible's settings, under ``rigctl/project/`` (:func:`rigctl.fleet.deploy.project_root` finds them there when
rigctl does not run from a checkout). They stay where they are in the repository; this copies them at build
time. Everything else is in pyproject.toml."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
#: The directories copied whole, and the settings file.
TREES = ("roles", "playbooks")
CONFIG = "ansible.cfg"
#: ansible.cfg's keys as they must read beside the installed package (paths are relative to the file):
#: the host-side module_utils are the package's own ``rigctl/hostside``; an installed rigctl has no default
#: inventory (``-i`` names one) and finds mitogen's strategy wherever it is installed (rigctl sets
#: ANSIBLE_STRATEGY_PLUGINS).
INSTALLED_SETTINGS = {"module_utils": "../hostside", "inventory": None, "strategy_plugins": None}


def installed_config(text: str) -> str:
    """The repository's ansible.cfg with :data:`INSTALLED_SETTINGS` applied; a key it no longer has stops the
    build (the copy would silently keep the checkout's paths)."""
    lines, seen = [], set()
    for line in text.splitlines():
        key = line.split("=", 1)[0].strip() if "=" in line and not line.lstrip().startswith("#") else None
        if key in INSTALLED_SETTINGS:
            seen.add(key)
            if INSTALLED_SETTINGS[key] is None:
                continue
            line = f"{key} = {INSTALLED_SETTINGS[key]}"
        lines.append(line)
    missing = set(INSTALLED_SETTINGS) - seen
    if missing:
        raise SystemExit(f"{CONFIG}: no {', '.join(sorted(missing))} to set for the installed copy")
    return "\n".join(lines) + "\n"


class BuildWithProject(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "rigctl" / "project"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")
        for tree in TREES:
            shutil.copytree(ROOT / tree, target / tree, ignore=ignore, symlinks=False)
        (target / CONFIG).write_text(installed_config((ROOT / CONFIG).read_text()))


if __name__ == "__main__":  # setuptools runs it so; tests import installed_config
    setup(cmdclass={"build_py": BuildWithProject})
