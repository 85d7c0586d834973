# Part of rigctl's llama_server role.
"""Jinja filters over rigctl's one profile resolver (rigctl/inventory/profiles.py) and its one list of the
unit's hardening (rigctl/hostside/sandbox.py, which rigctl's jobs and probe servers run under too).

Both files are loaded by their path from the rigctl this role came with, not imported from an installed
rigctl: plain ``ansible-playbook`` may run under any Python (a system Ansible has no rigctl), and an installed
rigctl of another version could resolve differently from the role beside it. The files are standard library
only, so loading them needs nothing else of rigctl. Where they are depends on how the role came (:data:`HOMES`).
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

_HERE = Path(__file__).resolve()
#: Where the resolver and the sandbox's properties are, by how this file came: in the rigctl collection
#: (plugins/filter/ beside plugins/module_utils/, where its build puts both files); in a checkout
#: (roles/llama_server/filter_plugins/ under the repository root); in an installed rigctl
#: (rigctl/project/roles/llama_server/filter_plugins/ inside the package).
HOMES = (
    {"profile resolver": _HERE.parents[1] / "module_utils" / "profiles.py",
     "sandbox": _HERE.parents[1] / "module_utils" / "sandbox.py"},
    {"profile resolver": _HERE.parents[3] / "rigctl" / "inventory" / "profiles.py",
     "sandbox": _HERE.parents[3] / "rigctl" / "hostside" / "sandbox.py"},
    {"profile resolver": _HERE.parents[4] / "inventory" / "profiles.py",
     "sandbox": _HERE.parents[4] / "hostside" / "sandbox.py"},
)
_MODULE = "_rigctl_llama_server_profiles"
_SANDBOX_MODULE = "_rigctl_llama_server_sandbox"


def _load(name: str, what: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    path = next((home[what] for home in HOMES if home[what].is_file()), None)
    spec = importlib.util.spec_from_file_location(name, path) if path is not None else None
    if path is None or spec is None or spec.loader is None:
        raise AnsibleFilterError(f"llama_server: rigctl's {what} is missing (looked for "
                                 f"{', '.join(str(home[what]) for home in HOMES)})")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and typing look the module up by name
    spec.loader.exec_module(module)
    return module


def _resolver() -> ModuleType:
    return _load(_MODULE, "profile resolver")


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
        return list(_load(_SANDBOX_MODULE, "sandbox").properties([str(p) for p in read_write],
                                                                          [str(d) for d in device_allow]))
    except ValueError as exc:
        raise AnsibleFilterError(f"llama_server: {exc}") from None


def llama_server_clean_env(_: Any = None) -> str:
    """Jinja: ``none | llama_server_clean_env``: the launcher's line that drops the variables llama.cpp reads
    (rigctl/hostside/sandbox.py's ``CLEAN_ENV_SH``)."""
    return str(_load(_SANDBOX_MODULE, "sandbox").CLEAN_ENV_SH)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"llama_server_plan": llama_server_plan, "llama_server_key_file": llama_server_key_file,
                "llama_server_sandbox": llama_server_sandbox, "llama_server_clean_env": llama_server_clean_env}
