"""Shapes of inventory values that the typed views, the schema and the fact probe share (standard library only,
so reading an inventory costs no pydantic): commit and sha256 patterns, and the variables that hold what a host
said about itself; an allowance (``{name: the reason it is allowed}``)."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from rigctl.errors import ConfigError

HEX_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
FULL_COMMIT = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: The longest text a host may report for one fact: longer than any GPU name, CPU brand string (48 bytes) or
#: os-release PRETTY_NAME shipped.
HOST_TEXT_MAX = 128
#: The variables :func:`rigctl.fleet.host_facts.inventory_vars` writes: facts, which rigctl reads as data and
#: never templates.
PROBED_KEYS = frozenset({"gpu_host_gpu", "gpu_host_gpus", "llama_cpp_cuda_architectures", "rigctl_host_facts"})


def allowances(value: Any, where: str, var: str, known: Collection[str], *, what: str, unknown: str,
               granted: str) -> dict[str, str]:
    """An allowance variable ``var`` (``{name: reason}``: ``rigctl_allowed_advisories``,
    ``rigctl_allowed_server_flags``) as a dict; ConfigError naming ``where``, the variable and the entry for a
    value that is no mapping of ``what`` to a reason, a name not in ``known`` (``unknown`` says what it is
    not), or a reason left out (the fleet says why it is ``granted``)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: {var}: expected a mapping of {what} to the reason it is {granted}")
    out = {}
    for name, reason in value.items():
        if str(name) not in known:
            raise ConfigError(f"{where}: {var}.{name}: {unknown}")
        if not isinstance(reason, str) or not reason.strip():
            raise ConfigError(f"{where}: {var}.{name}: give the reason it is {granted}")
        out[str(name)] = reason.strip()
    return out
