# Part of rigctl's llama_server role.
"""Jinja filters over rigctl's one profile resolver (rigctl/inventory/profiles.py).

The resolver is loaded from this checkout by its path, not imported from an installed rigctl: plain
``ansible-playbook`` from the repository may run under any Python (a system Ansible has no rigctl), and
an installed rigctl of another version could resolve differently from the role beside it. The file is
standard library only, so loading it needs nothing else of rigctl.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

try:
    from ansible.errors import AnsibleFilterError
except ImportError:  # imported outside Ansible (tests)
    AnsibleFilterError = ValueError  # type: ignore[misc,assignment]

#: roles/llama_server/filter_plugins/ -> the repository root -> the resolver.
RESOLVER = Path(__file__).resolve().parents[3] / "rigctl" / "inventory" / "profiles.py"
_MODULE = "_rigctl_llama_server_profiles"


def _resolver() -> ModuleType:
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    spec = importlib.util.spec_from_file_location(_MODULE, RESOLVER)
    if spec is None or spec.loader is None or not RESOLVER.is_file():
        raise AnsibleFilterError(f"llama_server: rigctl's profile resolver {RESOLVER} is missing "
                                 "(the role runs from a rigctl checkout)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE] = module  # dataclasses and typing look the module up by name
    spec.loader.exec_module(module)
    return module


def llama_server_plan(instances: Mapping[str, Any] | None, profiles: Mapping[str, Any],
                      overrides: Mapping[str, Any] | None = None, **paths: Any) -> list[dict[str, Any]]:
    """Jinja: ``llama_server_instances | llama_server_plan(llama_server_profiles, overrides, models_dir=...,
    config_dir=..., bind_address=..., api_key=...)``: every instance with its profile, paths and flags."""
    resolver = _resolver()
    try:
        return resolver.host_plan(instances, profiles, overrides, **paths)
    except resolver.ProfileError as exc:
        raise AnsibleFilterError(str(exc)) from None


def llama_server_key_file(config_dir: str) -> str:
    """Jinja: ``llama_server_config_dir | llama_server_key_file``."""
    return str(_resolver().key_file(config_dir))


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"llama_server_plan": llama_server_plan, "llama_server_key_file": llama_server_key_file}
