"""rigctl: turn a few local GPU boxes into a managed llama.cpp fleet (provision, serve, bench, eval, report).

The library logs through ``logging.getLogger(__name__)`` under ``rigctl`` and configures no output: only the CLI
does. ``docs/architecture.md`` maps the packages.
"""

from __future__ import annotations

import logging
from typing import Any

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["__version__"]


def __getattr__(name: str) -> Any:
    # Read when asked for: every `rigctl` command imports this package, few need its version.
    if name == "__version__":
        from importlib import metadata

        try:
            return metadata.version("rigctl")
        except metadata.PackageNotFoundError:  # a source tree that is not installed
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
