"""Which settings and options hold a secret, and a command line with their values masked: the one rule for
the controller (:mod:`rigctl.trust`: records, logs, error lines) and the host (:mod:`rigctl.hostside.stamp`:
a server's argv as deployed, masked before it leaves the host). Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

MASK = "***"
# Names of settings and options that hold secrets (llama_server_api_key, models_hf_token, --api-key, ...);
# a key *file*, path or directory names where a secret is, not the secret.
_SECRET_NAME = re.compile(r"(?:^|[_-])(?:api[_-]?key|token|secret|passw(?:or)?d|credentials?)"
                          r"(?=$|[_-](?!file|path|dir))", re.IGNORECASE)
#: Short options whose long form holds a secret, which no name rule can tell: llama.cpp's ``-hft``
#: (``--hf-token``).
SECRET_SHORT_OPTIONS = frozenset({"-hft"})


def is_secret_name(name: str) -> bool:
    """Whether a setting or option named ``name`` holds a secret (its value is never shown)."""
    return name in SECRET_SHORT_OPTIONS or bool(_SECRET_NAME.search(name))


def mask_argv(argv: Sequence[str], other: Callable[[str], str] = str) -> list[str]:
    """``argv`` with the value of every secret option (``--api-key K``, ``--hf-token=K``, ``-hft K``) replaced
    by ``***``; each other argument passed through ``other`` (the controller masks the secrets it knows)."""
    out: list[str] = []
    masking = False
    for arg in argv:
        if masking:
            out.append(MASK)
            masking = False
            continue
        name, eq, _value = arg.partition("=")
        if name.startswith("-") and is_secret_name(name):
            out.append(f"{name}={MASK}" if eq else arg)
            masking = not eq
            continue
        out.append(other(arg))
    return out
