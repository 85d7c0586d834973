"""rigctl: turn a few local GPU boxes into a managed llama.cpp fleet (provision, serve, bench, eval, report).

The library logs through ``logging.getLogger(__name__)`` under ``rigctl`` and configures no output: only the CLI
does. ``docs/architecture.md`` maps the packages.
"""

from __future__ import annotations

import logging
from typing import Any

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["__commit__", "__version__"]

#: Seconds git may take to name the checkout's commit.
_GIT_TIMEOUT = 5.0


def __getattr__(name: str) -> Any:
    # Read when asked for: every `rigctl` command imports this package, few need its version.
    if name == "__version__":
        from importlib import metadata

        try:
            return metadata.version("rigctl")
        except metadata.PackageNotFoundError:  # a source tree that is not installed
            return "0+unknown"
    if name == "__commit__":
        return _checkout_commit()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_commit: str | None = None


def _checkout_commit() -> str:
    """The commit of the checkout this package runs from (``-dirty`` after it when tracked files differ from
    it); "" for an installed rigctl, or when git cannot say. Asked once per process."""
    global _commit
    if _commit is None:
        import subprocess
        from pathlib import Path

        checkout = Path(__file__).resolve().parent.parent
        _commit = ""
        if (checkout / ".git").exists():
            try:
                head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                                      text=True, timeout=_GIT_TIMEOUT, check=True).stdout.strip()
                changed = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                                         capture_output=True, text=True, timeout=_GIT_TIMEOUT, check=True).stdout
                _commit = head + ("-dirty" if changed.strip() else "")
            except (OSError, subprocess.SubprocessError):
                log = logging.getLogger(__name__)
                log.debug("git could not name the commit of %s", checkout)
    return _commit
