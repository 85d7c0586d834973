# Part of rigctl's llama_server role.
"""Jinja filters over rigctl's one profile resolver (rigctl/inventory/profiles.py) and its one list of the
unit's hardening (rigctl/hostside/sandbox.py, which rigctl's jobs and probe servers run under too).

Both files are loaded from this checkout by its path, not imported from an installed rigctl: plain
``ansible-playbook`` from the repository may run under any Python (a system Ansible has no rigctl), and
an installed rigctl of another version could resolve differently from the role beside it. The files are
standard library only, so loading them needs nothing else of rigctl.
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
#: The same root -> the sandbox's properties.
SANDBOX = Path(__file__).resolve().parents[3] / "rigctl" / "hostside" / "sandbox.py"
_SANDBOX_MODULE = "_rigctl_llama_server_sandbox"


def _load(name: str, path: Path, what: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise AnsibleFilterError(f"llama_server: rigctl's {what} {path} is missing "
                                 "(the role runs from a rigctl checkout)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and typing look the module up by name
    spec.loader.exec_module(module)
    return module


def _resolver() -> ModuleType:
    return _load(_MODULE, RESOLVER, "profile resolver")


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


def llama_server_sandbox(device_allow: list[str], read_write: list[str]) -> list[str]:
    """Jinja: ``llama_server_device_allow | llama_server_sandbox([llama_server_state_dir])``: the unit's
    hardening lines (rigctl/hostside/sandbox.py's ``properties``)."""
    try:
        return list(_load(_SANDBOX_MODULE, SANDBOX, "sandbox").properties([str(p) for p in read_write],
                                                                          [str(d) for d in device_allow]))
    except ValueError as exc:
        raise AnsibleFilterError(f"llama_server: {exc}") from None


def llama_server_clean_env(_: Any = None) -> str:
    """Jinja: ``none | llama_server_clean_env``: the launcher's line that drops the variables llama.cpp reads
    (rigctl/hostside/sandbox.py's ``CLEAN_ENV_SH``)."""
    return str(_load(_SANDBOX_MODULE, SANDBOX, "sandbox").CLEAN_ENV_SH)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"llama_server_plan": llama_server_plan, "llama_server_key_file": llama_server_key_file,
                "llama_server_sandbox": llama_server_sandbox, "llama_server_clean_env": llama_server_clean_env}
